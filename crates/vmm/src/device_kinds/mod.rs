//! The registry of device kinds: the one list that maps a kind to its configuration type
//! (which parses its command-line option, builds its device and says what a restore may
//! change; `virtio::kind::DeviceKind`), in the order their devices take PCI slots.
//!
//! A machine's devices are a list of [`DeviceEntry`]s, each an explicit id and one kind's
//! configuration. The command line, the API's bodies, a snapshot's record and
//! `GET /vm/config` all read and write that list; the id names the device in saved state
//! and in `--boot`.

use serde::{Deserialize, Serialize};
pub use virtio::kind::OptionShape;
use virtio::kind::{BuildContext, DeviceKind};
use virtio::VirtioDevice;

use crate::error::{Error, Result};
use crate::memory::GuestMemory;

pub mod record;

/// Declares the kinds, each `Variant("name", Config)`: the [`DeviceConfig`] enum (its
/// serde tag, `kind`, is the name) and [`KINDS`].
macro_rules! device_kinds {
    ($($variant:ident($name:literal, $config:ty),)*) => {
        /// One device's configuration, of one of the registered kinds.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum DeviceConfig {
            $(#[serde(rename = $name)] $variant($config),)*
        }

        /// Every registered kind, in the order their devices take PCI slots.
        pub const KINDS: &[Kind] = &[$(Kind {
            name: $name,
            option: concat!("--", $name),
            syntax: <$config as DeviceKind<GuestMemory>>::SYNTAX,
            help: <$config as DeviceKind<GuestMemory>>::HELP,
            shape: <$config as DeviceKind<GuestMemory>>::SHAPE,
            sandbox: <$config as DeviceKind<GuestMemory>>::SANDBOX,
            parse: |text| {
                <$config as DeviceKind<GuestMemory>>::parse(text)
                    .map(|c| c.map(DeviceConfig::$variant))
            },
        },)*];

        impl DeviceConfig {
            /// The kind's entry in [`KINDS`].
            pub fn kind(&self) -> &'static Kind {
                let mut rank = 0;
                $(
                    if let DeviceConfig::$variant(_) = self {
                        return &KINDS[rank];
                    }
                    rank += 1;
                )*
                unreachable!("{rank} kinds, each matched above")
            }

            /// A short description for messages (a path, a tap).
            pub fn label(&self) -> String {
                match self {
                    $(DeviceConfig::$variant(c) => DeviceKind::<GuestMemory>::label(c),)*
                }
            }

            /// Opens the device's host resources and makes its model.
            pub fn create(
                &self,
                ctx: &BuildContext<GuestMemory>,
            ) -> std::result::Result<Box<dyn VirtioDevice<GuestMemory>>, String> {
                match self {
                    $(DeviceConfig::$variant(c) => c.create(ctx),)*
                }
            }

            /// What the guest would notice if this device stood in for `recorded`.
            pub fn guest_difference(&self, recorded: &DeviceConfig) -> Option<String> {
                match (self, recorded) {
                    $((DeviceConfig::$variant(g), DeviceConfig::$variant(r)) => {
                        DeviceKind::<GuestMemory>::guest_difference(g, r)
                    })*
                    _ => Some(format!("as a {} device", recorded.kind().name)),
                }
            }
        }
    };
}

device_kinds! {
    Disk("disk", virtio::block::BlockOptions),
    Console("console", virtio::console::ConsoleConfig),
    Rng("rng", virtio::rng::RngConfig),
    Net("net", virtio::net_config::NetConfig),
    Vsock("vsock", virtio::vsock_config::VsockConfig),
    Balloon("balloon", virtio::balloon::BalloonConfig),
}

/// A kind as the command line and messages know it.
pub struct Kind {
    /// `kind` in records and replies, and the prefix of default ids (`disk0`, `disk1`...).
    pub name: &'static str,
    /// Its command-line option, `--NAME`.
    pub option: &'static str,
    pub syntax: &'static str,
    pub help: &'static str,
    pub shape: OptionShape,
    /// Profile lines its devices' I/O threads need (`DeviceKind::SANDBOX`).
    pub sandbox: &'static str,
    pub parse: fn(&str) -> std::result::Result<Option<DeviceConfig>, String>,
}

/// What the device I/O threads need beyond their role's profile: every registered kind's
/// needs (the sandbox starts before a configuration sent through the API is known).
pub fn sandbox_needs() -> Vec<(sandbox::Role, &'static str)> {
    KINDS
        .iter()
        .filter(|k| !k.sandbox.is_empty())
        .map(|k| (sandbox::Role::DeviceIo, k.sandbox))
        .collect()
}

/// One device of the machine: an id and its kind's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceEntry {
    /// Names the device in saved state, `--boot` and messages.
    pub id: String,
    #[serde(flatten)]
    pub config: DeviceConfig,
}

/// Why `id` cannot name a device, if it cannot.
pub fn id_refusal(id: &str) -> Option<String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    (!ok).then(|| format!("id={id}: 1 to 64 letters, digits, '_' or '-'"))
}

/// The devices of a machine, in the order they take PCI slots.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Devices(pub Vec<DeviceEntry>);

impl Devices {
    /// Adds a device under `id`, or `NAMEn` (the first free one of its kind) without one.
    /// Refuses an id already taken. Returns the id.
    pub fn add(&mut self, id: Option<String>, config: DeviceConfig) -> Result<String> {
        let kind = config.kind();
        let id = match id {
            Some(id) => id,
            None => (0..)
                .map(|n| format!("{}{n}", kind.name))
                .find(|id| self.get(id).is_none())
                .unwrap_or_default(),
        };
        let refuse = |reason: String| Error::Option {
            option: kind.option,
            value: config.label(),
            reason,
        };
        if let Some(why) = id_refusal(&id) {
            return Err(refuse(why));
        }
        if self.get(&id).is_some() {
            return Err(refuse(format!("another device has the id {id}")));
        }
        self.0.push(DeviceEntry {
            id: id.clone(),
            config,
        });
        Ok(id)
    }

    /// The device with this id.
    pub fn get(&self, id: &str) -> Option<&DeviceEntry> {
        self.0.iter().find(|d| d.id == id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &DeviceEntry> {
        self.0.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The disks' ids, in order.
    pub fn disk_ids(&self) -> Vec<String> {
        self.iter()
            .filter(|d| matches!(d.config, DeviceConfig::Disk(_)))
            .map(|d| d.id.clone())
            .collect()
    }

    /// Puts the devices in [`KINDS`] order (keeping the order within a kind), the order
    /// in which they take PCI slots.
    pub fn sort_by_kind(&mut self) {
        self.0.sort_by_key(|d| kind_rank(d.config.kind()));
    }

    /// Whether some device is of this kind and matches.
    pub fn any(&self, test: impl Fn(&DeviceConfig) -> bool) -> bool {
        self.iter().any(|d| test(&d.config))
    }
}

fn kind_rank(kind: &Kind) -> usize {
    KINDS
        .iter()
        .position(|k| k.name == kind.name)
        .unwrap_or(usize::MAX)
}

/// The kind named `name`.
pub fn kind_named(name: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|k| k.name == name)
}

/// Parses one value of `kind`'s option: its own syntax plus `id=NAME` anywhere but in the
/// place of a leading path. `None`: the value asks for no device.
pub fn parse_option(kind: &Kind, text: &str) -> Result<Option<(Option<String>, DeviceConfig)>> {
    let bad = |reason: String| Error::Option {
        option: kind.option,
        value: text.to_string(),
        reason,
    };
    let path_first = kind.syntax.starts_with("PATH");
    let mut id = None;
    let mut rest = Vec::new();
    for (i, item) in text.split(',').enumerate() {
        match item.strip_prefix("id=") {
            Some(_) if i == 0 && path_first => rest.push(item),
            Some(_) if id.is_some() => return Err(bad("id is given twice".into())),
            Some(name) => {
                if let Some(why) = id_refusal(name) {
                    return Err(bad(why));
                }
                id = Some(name.to_string());
            }
            None => rest.push(item),
        }
    }
    let text_without_id = if id.is_some() {
        rest.join(",")
    } else {
        text.to_string()
    };
    let config = (kind.parse)(&text_without_id).map_err(bad)?;
    Ok(config.map(|config| (id, config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_under_its_name() {
        let devices = [
            DeviceConfig::Disk(virtio::block::BlockOptions::new("/a")),
            DeviceConfig::Console(Default::default()),
            DeviceConfig::Rng(Default::default()),
            DeviceConfig::Net(virtio::net_config::NetConfig::on_tap("t")),
            DeviceConfig::Vsock("cid=3,socket=/s".parse().unwrap()),
            DeviceConfig::Balloon("size_mib=1".parse().unwrap()),
        ];
        assert_eq!(devices.len(), KINDS.len(), "one example per kind");
        for device in devices {
            let value = serde_json::to_value(&device).unwrap();
            assert_eq!(value["kind"], device.kind().name);
            let back: DeviceConfig = serde_json::from_value(value).unwrap();
            assert_eq!(back, device);
        }
    }

    #[test]
    fn ids_are_explicit_or_the_first_free_of_the_kind() {
        let disk = |text: &str| {
            parse_option(kind_named("disk").unwrap(), text)
                .unwrap()
                .unwrap()
        };
        let mut devices = Devices::default();
        for text in ["/a", "/b,id=root,readonly", "/c", "id=x,serial=s"] {
            let (id, config) = disk(text);
            devices.add(id, config).unwrap();
        }
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["disk0", "root", "disk1", "disk2"]);
        let DeviceConfig::Disk(path_like_id) = &devices.0[3].config else {
            panic!("a disk")
        };
        assert_eq!(path_like_id.path, std::path::PathBuf::from("id=x"));
        let (id, config) = disk("/d,id=root");
        let e = devices.add(id, config).unwrap_err().to_string();
        assert!(
            e.contains("--disk /d: another device has the id root"),
            "{e}"
        );
        for bad in ["/e,id=", "/e,id=a/b", "/e,id=a,id=b"] {
            let e = parse_option(kind_named("disk").unwrap(), bad).unwrap_err();
            assert!(
                e.to_string().starts_with(&format!("--disk {bad}: id")),
                "{e}"
            );
        }
        let rng = parse_option(kind_named("rng").unwrap(), "")
            .unwrap()
            .unwrap();
        assert_eq!(devices.add(rng.0, rng.1).unwrap(), "rng0");
        assert!(parse_option(kind_named("console").unwrap(), "serial")
            .unwrap()
            .is_none());
    }

    #[test]
    fn entries_serialise_flat_with_their_id() {
        let mut devices = Devices::default();
        let vsock = "cid=3,socket=/run/v.sock".parse().unwrap();
        devices.add(None, DeviceConfig::Vsock(vsock)).unwrap();
        let json = serde_json::to_value(&devices).unwrap();
        assert_eq!(
            json,
            serde_json::json!([{"id": "vsock0", "kind": "vsock", "cid": 3,
                                "socket": "/run/v.sock"}])
        );
        assert_eq!(serde_json::from_value::<Devices>(json).unwrap(), devices);
    }
}
