//! The devices a machine records in its snapshots (and in a migration's `Config` frame):
//! its device list as is, and the firmware's boot order. `run --restore` and the API's
//! snapshot load rebuild the devices from it when no device is given; when some are, they
//! must be the recorded devices (the same ids) as far as the guest can tell (host-side
//! bindings — image paths, cache mode, tap names, the vsock socket — may differ), and a
//! difference is refused by name.
//!
//! The record has its own `format` number ([`DEVICES_FORMAT`]). Format 1, written by
//! builds before the device list, had one field per kind; it is read and converted, its
//! devices getting the ids and the order those builds gave them. Snapshots of builds
//! before any record restore with the options given, as they always did.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{DeviceConfig, DeviceEntry, Devices};
use crate::config::VmConfig;
use crate::error::{Error, Result};

/// The layout of [`DeviceRecord`] this build writes and the newest it reads.
pub const DEVICES_FORMAT: u32 = 2;

/// The machine's devices as recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// [`DEVICES_FORMAT`].
    pub format: u32,
    pub devices: Devices,
    /// Device ids, as `--boot` gave them.
    #[serde(default)]
    pub boot_order: Vec<String>,
    /// Read from format 1, whose devices had no ids: devices given are matched to them by
    /// their place among the devices of their kind, as those builds did.
    #[serde(skip)]
    pub positional: bool,
}

/// A format 1 record (read only).
#[derive(Deserialize)]
struct RecordV1 {
    #[serde(default)]
    disks: Vec<virtio::block::BlockOptions>,
    #[serde(default)]
    nets: Vec<virtio::net_config::NetConfig>,
    #[serde(default)]
    vsock: Option<virtio::vsock_config::VsockConfig>,
    #[serde(default)]
    virtio_console: bool,
    #[serde(default)]
    rng: bool,
    /// Indices into `disks`.
    #[serde(default)]
    boot_order: Vec<usize>,
}

impl RecordV1 {
    /// The devices as the builds that wrote format 1 created them: disks, console, rng,
    /// interfaces, vsock, named by kind and position.
    fn convert(self) -> Result<DeviceRecord> {
        let mut devices = Devices::default();
        let configs = (self.disks.into_iter().map(DeviceConfig::Disk))
            .chain(
                self.virtio_console
                    .then(|| DeviceConfig::Console(Default::default())),
            )
            .chain(self.rng.then(|| DeviceConfig::Rng(Default::default())))
            .chain(self.nets.into_iter().map(DeviceConfig::Net))
            .chain(self.vsock.map(DeviceConfig::Vsock));
        for config in configs {
            devices.add(None, config)?;
        }
        Ok(DeviceRecord {
            format: DEVICES_FORMAT,
            devices,
            boot_order: self.boot_order.iter().map(|i| format!("disk{i}")).collect(),
            positional: true,
        })
    }
}

impl DeviceRecord {
    /// The record of `config`'s devices as a migration config carries it; `None` if a path
    /// is not UTF-8 (JSON cannot hold it): such a machine's snapshots restore only with the
    /// device options repeated.
    pub fn value_of(config: &VmConfig) -> Option<Value> {
        let record = DeviceRecord {
            format: DEVICES_FORMAT,
            devices: config.devices.clone(),
            boot_order: config.boot_order.clone(),
            positional: false,
        };
        match serde_json::to_value(record) {
            Ok(value) => Some(value),
            Err(e) => {
                log::warn!(
                    "snapshots of this machine do not record its devices ({e}; give the \
                     device options again with --restore)"
                );
                None
            }
        }
    }

    /// Reads a record of this format or format 1; refuses one of a newer format.
    pub fn from_value(value: &Value) -> Result<DeviceRecord> {
        let malformed =
            |e: serde_json::Error| Error::State(format!("malformed device record: {e}"));
        let format = value.get("format").and_then(Value::as_u64).unwrap_or(0);
        match format {
            1 => RecordV1::deserialize(value).map_err(malformed)?.convert(),
            2 => DeviceRecord::deserialize(value).map_err(malformed),
            _ => Err(Error::State(format!(
                "the snapshot's device record has format {format}; this build reads formats 1 \
                 to {DEVICES_FORMAT} (made by a newer build?)"
            ))),
        }
    }
}

/// A restore from a snapshot that recorded `saved`: with no device given, the devices come
/// from the record; otherwise the devices given must be the recorded ones (see the module
/// documentation), and take the recorded order. An old snapshot (`None`) keeps the options.
pub fn apply_to_restore(config: &mut VmConfig, saved: Option<&Value>) -> Result<()> {
    let Some(saved) = saved else {
        return Ok(());
    };
    let record = DeviceRecord::from_value(saved)?;
    if !config.devices.is_empty() {
        if record.positional {
            take_ids_by_place(&mut config.devices, &record.devices);
        }
        config.devices = given_as_recorded(&config.devices, &record.devices)?;
    } else {
        config.devices = record.devices;
    }
    config.boot_order = record.boot_order;
    Ok(())
}

/// Gives the n-th device of each kind in `given` the id of the n-th of that kind in
/// `recorded` (a format 1 record's devices have the ids of their places).
fn take_ids_by_place(given: &mut Devices, recorded: &Devices) {
    let mut seen: Vec<&str> = Vec::new();
    for entry in &mut given.0 {
        let kind = entry.config.kind().name;
        let place = seen.iter().filter(|k| **k == kind).count();
        seen.push(kind);
        let namesake = recorded
            .iter()
            .filter(|r| r.config.kind().name == kind)
            .nth(place);
        if let Some(namesake) = namesake {
            entry.id = namesake.id.clone();
        }
    }
}

/// The refusal of a device given that differs from the snapshot's device.
fn differs(entry: &DeviceEntry, what: String) -> Error {
    Error::Option {
        option: entry.config.kind().option,
        value: entry.config.label(),
        reason: format!(
            "the snapshot's machine has {what} (give the devices as the snapshot's machine had \
             them, or none with --restore to use its recorded devices)"
        ),
    }
}

/// `given`, in the order of `recorded`, if every device given is a recorded one that the
/// guest would not tell apart, and none is missing.
fn given_as_recorded(given: &Devices, recorded: &Devices) -> Result<Devices> {
    for entry in given.iter() {
        let Some(saved) = recorded.get(&entry.id) else {
            let ids: Vec<&str> = recorded.iter().map(|d| d.id.as_str()).collect();
            let what = format!("no device {} (its devices: {})", entry.id, ids.join(", "));
            return Err(differs(entry, what));
        };
        if let Some(difference) = entry.config.guest_difference(&saved.config) {
            return Err(differs(entry, format!("{} {difference}", saved.id)));
        }
    }
    let mut ordered = Vec::new();
    for saved in recorded.iter() {
        match given.get(&saved.id) {
            Some(entry) => ordered.push(entry.clone()),
            None => return Err(differs(saved, format!("{}, which is not given", saved.id))),
        }
    }
    Ok(Devices(ordered))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StartFrom;
    use crate::device_kinds::{kind_named, parse_option};

    fn add(config: &mut VmConfig, kind: &str, text: &str) {
        let (id, device) = parse_option(kind_named(kind).unwrap(), text)
            .unwrap()
            .unwrap();
        config.devices.add(id, device).unwrap();
    }

    fn machine() -> VmConfig {
        let mut config = VmConfig::new(StartFrom::Kernel("k".into()));
        add(&mut config, "disk", "/img/a.raw,serial=root");
        add(
            &mut config,
            "disk",
            "/img/b.raw,readonly,cache=none,queues=2",
        );
        add(&mut config, "rng", "");
        add(&mut config, "net", "tap=fc0,mac=02:00:00:00:00:01");
        add(&mut config, "vsock", "cid=3,socket=/run/v.sock");
        config.boot_order = vec!["disk1".into(), "disk0".into()];
        config
    }

    fn restore() -> VmConfig {
        VmConfig::new(StartFrom::Restore("snap".into()))
    }

    #[test]
    fn a_restore_without_devices_gets_the_recorded_ones() {
        let source = machine();
        let saved = DeviceRecord::value_of(&source).unwrap();
        assert_eq!(saved["format"], DEVICES_FORMAT);
        let mut config = restore();
        apply_to_restore(&mut config, Some(&saved)).unwrap();
        assert_eq!(config.devices, source.devices);
        assert_eq!(config.boot_order, ["disk1", "disk0"]);
        assert_eq!(DeviceRecord::value_of(&config).unwrap(), saved);
    }

    #[test]
    fn old_snapshots_keep_the_options_given() {
        let mut config = restore();
        add(&mut config, "rng", "");
        apply_to_restore(&mut config, None).unwrap();
        assert_eq!(config.devices.0.len(), 1);
    }

    /// A format 1 record: the devices get the ids and order its builds gave them.
    #[test]
    fn format_1_records_are_read() {
        let v1 = serde_json::json!({"format": 1,
            "disks": [{"path": "/img/a.raw", "readonly": false, "serial": "root",
                       "cache": "writeback", "queues": 1},
                      {"path": "/img/b.raw", "readonly": true, "serial": null,
                       "cache": "none", "queues": 2}],
            "nets": [{"tap": "fc0", "mac": [2, 0, 0, 0, 0, 1], "queues": 1}],
            "vsock": {"cid": 3, "socket": "/run/v.sock"},
            "virtio_console": false, "rng": true, "boot_order": [1, 0]});
        let mut config = restore();
        apply_to_restore(&mut config, Some(&v1)).unwrap();
        assert_eq!(config.devices, machine().devices);
        assert_eq!(config.boot_order, ["disk1", "disk0"]);
        // Devices given (named as Firecracker's drives are) match by their place.
        let mut given = machine();
        given.start = StartFrom::Restore("snap".into());
        for (entry, id) in given
            .devices
            .0
            .iter_mut()
            .zip(["root", "data", "r", "eth0", "v"])
        {
            entry.id = id.into();
        }
        apply_to_restore(&mut given, Some(&v1)).unwrap();
        assert_eq!(given.devices, machine().devices);
    }

    #[test]
    fn devices_given_must_be_the_recorded_ones() {
        let saved = DeviceRecord::value_of(&machine()).unwrap();
        // The same devices in another order, bound to other host files and taps: accepted
        // as given, in the recorded order.
        let mut moved = machine();
        moved.devices.0.reverse();
        for entry in &mut moved.devices.0 {
            match &mut entry.config {
                DeviceConfig::Disk(d) => d.path = "/elsewhere".into(),
                DeviceConfig::Net(n) => n.tap = "fc1".into(),
                DeviceConfig::Vsock(v) => v.socket = "/run/w.sock".into(),
                _ => {}
            }
        }
        let mut config = moved.clone();
        config.start = StartFrom::Restore("snap".into());
        apply_to_restore(&mut config, Some(&saved)).unwrap();
        let ids: Vec<&str> = config.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["disk0", "disk1", "rng0", "net0", "vsock0"]);

        let refused = |change: &dyn Fn(&mut Vec<DeviceEntry>)| {
            let mut config = machine();
            change(&mut config.devices.0);
            apply_to_restore(&mut config, Some(&saved))
                .unwrap_err()
                .to_string()
        };
        let set = |i: usize, text: &'static str| {
            let kind = machine().devices.0[i].config.kind();
            move |d: &mut Vec<DeviceEntry>| {
                d[i].config = parse_option(kind, text).unwrap().unwrap().1;
            }
        };
        let e = refused(&set(1, "/img/b.raw,queues=2"));
        assert!(e.starts_with("--disk /img/b.raw: the snapshot's machine has disk1 read-only"));
        let e = refused(&|d| {
            d.remove(1);
        });
        assert!(e.contains("--disk /img/b.raw") && e.contains("disk1, which is not given"));
        let e = refused(&set(3, "tap=fc0,mac=02:00:00:00:00:09"));
        assert!(e.contains("net0 with mac=02:00:00:00:00:01"), "{e}");
        let e = refused(&set(4, "cid=4,socket=/run/v.sock"));
        assert!(
            e.contains("--vsock") && e.contains("vsock0 with cid 3"),
            "{e}"
        );
        let e = refused(&|d| d[2].id = "rng1".into());
        assert!(e.contains("--rng") && e.contains("no device rng1"), "{e}");
        let e = refused(&|d| d[2].config = DeviceConfig::Console(Default::default()));
        assert!(e.contains("rng0 as a rng device"), "{e}");
    }

    #[test]
    fn newer_or_malformed_records_are_refused() {
        let mut saved = DeviceRecord::value_of(&machine()).unwrap();
        saved["format"] = (DEVICES_FORMAT + 1).into();
        let e = apply_to_restore(&mut restore(), Some(&saved)).unwrap_err();
        assert!(e.to_string().contains("newer build"), "{e}");
        let bad = serde_json::json!({"format": 1, "disks": 7});
        let e = apply_to_restore(&mut restore(), Some(&bad)).unwrap_err();
        assert!(e.to_string().contains("malformed device record"), "{e}");
    }
}
