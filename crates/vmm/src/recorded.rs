//! The device configuration a machine records in its snapshots (and in a migration's
//! `Config` frame): disks, network interfaces, vsock, the virtio console and rng, the boot
//! order. `run --restore` and the API's snapshot load rebuild the devices from it when no
//! device option is given; when some are, they must describe the same devices as far as
//! the guest can tell (host-side bindings — image paths, cache mode, tap names, the vsock
//! socket — may differ), and a difference is refused by name.
//!
//! The record is JSON with its own `format` number ([`DEVICES_FORMAT`]); snapshots of
//! builds before it have none and restore with the options given, as they always did.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{ConsoleConfig, DiskCache, DiskConfig, NetConfig, VmConfig, VsockConfig};
use crate::error::{Error, Result};
use virtio::block::{FormatOptions, ImageFormat};

/// The layout of [`DeviceRecord`] this build writes and the newest it reads.
pub const DEVICES_FORMAT: u32 = 1;

/// The machine's devices as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// [`DEVICES_FORMAT`].
    pub format: u32,
    #[serde(default)]
    pub disks: Vec<DiskRecord>,
    #[serde(default)]
    pub nets: Vec<NetRecord>,
    #[serde(default)]
    pub vsock: Option<VsockRecord>,
    #[serde(default)]
    pub virtio_console: bool,
    #[serde(default)]
    pub rng: bool,
    /// Indices into `disks`, as `--boot` gave them.
    #[serde(default)]
    pub boot_order: Vec<usize>,
}

/// One disk: `--disk PATH[,readonly][,serial=S][,cache=C][,queues=N]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskRecord {
    pub path: String,
    pub readonly: bool,
    pub serial: Option<String>,
    /// `writeback` or `none`.
    pub cache: String,
    pub queues: u16,
    /// `raw` or `qcow2` when given (absent: told from the header, as before this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// A qcow2 image's `backing=` override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<String>,
}

/// One network interface: `--net tap=NAME[,mac=MAC][,queues=N]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetRecord {
    pub tap: String,
    /// As given (the device's state carries the MAC the guest saw in any case).
    pub mac: Option<[u8; 6]>,
    pub queues: u16,
    /// `vhost=on` (a host-side choice; records without it had none).
    #[serde(default)]
    pub vhost: bool,
    /// `iothreads=N` (host-side, like `vhost`; records without it had none).
    #[serde(default)]
    pub iothreads: Option<u16>,
}

/// The vsock device: `--vsock cid=N,socket=PATH`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockRecord {
    pub cid: u64,
    pub socket: String,
}

fn utf8(path: &std::path::Path) -> Option<String> {
    path.to_str().map(str::to_string)
}

impl DeviceRecord {
    /// The record of `config`'s devices; `None` if a path is not UTF-8 (JSON cannot hold
    /// it): such a machine's snapshots restore only with the device options repeated.
    pub fn of(config: &VmConfig) -> Option<DeviceRecord> {
        let disks = config
            .disks
            .iter()
            .map(|d| {
                Some(DiskRecord {
                    path: utf8(&d.path)?,
                    readonly: d.readonly,
                    serial: d.serial.clone(),
                    cache: match d.cache {
                        DiskCache::Writeback => "writeback".into(),
                        DiskCache::None => "none".into(),
                    },
                    queues: d.queues,
                    format: (d.image.format != ImageFormat::Auto)
                        .then(|| d.image.format.to_string()),
                    backing: match &d.image.backing {
                        Some(path) => Some(utf8(path)?),
                        None => None,
                    },
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let vsock = match &config.vsock {
            Some(v) => Some(VsockRecord {
                cid: v.cid,
                socket: utf8(&v.socket)?,
            }),
            None => None,
        };
        Some(DeviceRecord {
            format: DEVICES_FORMAT,
            disks,
            nets: config
                .nets
                .iter()
                .map(|n| NetRecord {
                    tap: n.tap.clone(),
                    mac: n.mac,
                    queues: n.queues,
                    vhost: n.vhost,
                    iothreads: n.iothreads,
                })
                .collect(),
            vsock,
            virtio_console: config.console == ConsoleConfig::Virtio,
            rng: config.rng,
            boot_order: config.boot_order.clone(),
        })
    }

    /// [`DeviceRecord::of`] as the JSON a migration config carries.
    pub fn value_of(config: &VmConfig) -> Option<Value> {
        match DeviceRecord::of(config) {
            Some(record) => serde_json::to_value(record).ok(),
            None => {
                log::warn!(
                    "a device path is not UTF-8: snapshots of this machine do not record \
                     its devices (give the device options again with --restore)"
                );
                None
            }
        }
    }

    /// Reads a record; refuses one of a newer format.
    pub fn from_value(value: &Value) -> Result<DeviceRecord> {
        let format = value.get("format").and_then(Value::as_u64).unwrap_or(0);
        if format == 0 || format > u64::from(DEVICES_FORMAT) {
            return Err(Error::State(format!(
                "the snapshot's device record has format {format}; this build reads format \
                 {DEVICES_FORMAT} (made by a newer build?)"
            )));
        }
        DeviceRecord::deserialize(value)
            .map_err(|e| Error::State(format!("malformed device record: {e}")))
    }

    /// Fills `config`'s devices from the record.
    fn fill(&self, config: &mut VmConfig) {
        config.disks = self
            .disks
            .iter()
            .map(|d| DiskConfig {
                path: PathBuf::from(&d.path),
                readonly: d.readonly,
                serial: d.serial.clone(),
                cache: if d.cache == "none" {
                    DiskCache::None
                } else {
                    DiskCache::Writeback
                },
                queues: d.queues,
                image: FormatOptions {
                    format: d
                        .format
                        .as_deref()
                        .and_then(|f| f.parse().ok())
                        .unwrap_or_default(),
                    backing: d.backing.as_ref().map(PathBuf::from),
                },
            })
            .collect();
        config.nets = self
            .nets
            .iter()
            .map(|n| NetConfig {
                tap: n.tap.clone(),
                mac: n.mac,
                queues: n.queues,
                vhost: n.vhost,
                iothreads: n.iothreads,
            })
            .collect();
        config.vsock = self.vsock.as_ref().map(|v| VsockConfig {
            cid: v.cid,
            socket: PathBuf::from(&v.socket),
        });
        config.console = if self.virtio_console {
            ConsoleConfig::Virtio
        } else {
            ConsoleConfig::Serial
        };
        config.rng = self.rng;
        config.boot_order = self.boot_order.clone();
    }
}

/// Whether the user gave any device option (on the command line, or through the API
/// before a snapshot load).
fn devices_given(config: &VmConfig) -> bool {
    !config.disks.is_empty()
        || !config.nets.is_empty()
        || config.vsock.is_some()
        || config.console == ConsoleConfig::Virtio
        || config.rng
}

/// A restore from a snapshot that recorded `saved`: with no device option given, the
/// devices come from the record; otherwise the options given must describe the recorded
/// devices (see the module documentation). An old snapshot (`None`) keeps the options.
pub fn apply_to_restore(config: &mut VmConfig, saved: Option<&Value>) -> Result<()> {
    let Some(saved) = saved else {
        return Ok(());
    };
    let record = DeviceRecord::from_value(saved)?;
    if devices_given(config) {
        check_given(config, &record)
    } else {
        record.fill(config);
        Ok(())
    }
}

/// The refusal of a device option that differs from the snapshot's device.
fn differs(option: &'static str, value: String, what: String) -> Error {
    Error::Option {
        option,
        value,
        reason: format!(
            "the snapshot's machine has {what} (give the device options as the snapshot's \
             machine had them, or leave them all out with --restore to use its recorded \
             devices)"
        ),
    }
}

fn count_check(option: &'static str, given: usize, recorded: usize, noun: &str) -> Result<()> {
    if given == recorded {
        return Ok(());
    }
    Err(differs(
        option,
        format!("{given} given"),
        format!("{recorded} {noun}"),
    ))
}

/// Options given with `--restore`, against the record: what the guest sees must match.
fn check_given(config: &VmConfig, record: &DeviceRecord) -> Result<()> {
    count_check("--disk", config.disks.len(), record.disks.len(), "disk(s)")?;
    for (i, (given, saved)) in config.disks.iter().zip(&record.disks).enumerate() {
        let value = given.path.display().to_string();
        if given.readonly != saved.readonly {
            let mode = if saved.readonly {
                "read-only"
            } else {
                "writable"
            };
            return Err(differs("--disk", value, format!("disk {i} {mode}")));
        }
        if given.serial != saved.serial {
            let serial = saved.serial.as_deref().unwrap_or("(none)");
            return Err(differs(
                "--disk",
                value,
                format!("disk {i} serial={serial}"),
            ));
        }
        if given.queues != saved.queues {
            let what = format!("disk {i} with queues={}", saved.queues);
            return Err(differs("--disk", value, what));
        }
    }
    count_check(
        "--net",
        config.nets.len(),
        record.nets.len(),
        "network interface(s)",
    )?;
    for (i, (given, saved)) in config.nets.iter().zip(&record.nets).enumerate() {
        let value = format!("tap={}", given.tap);
        if let (Some(g), Some(s)) = (given.mac, saved.mac) {
            if g != s {
                let mac = s.map(|b| format!("{b:02x}")).join(":");
                return Err(differs("--net", value, format!("interface {i} mac={mac}")));
            }
        }
        if given.queues != saved.queues {
            let what = format!("interface {i} with queues={}", saved.queues);
            return Err(differs("--net", value, what));
        }
    }
    check_vsock(config, record)?;
    let console = config.console == ConsoleConfig::Virtio;
    if console != record.virtio_console {
        let what = if record.virtio_console { "a" } else { "no" };
        return Err(differs(
            "--console",
            if console { "virtio" } else { "serial" }.into(),
            format!("{what} virtio console"),
        ));
    }
    if config.rng != record.rng {
        let what = if record.rng { "a" } else { "no" };
        return Err(differs(
            "--rng",
            config.rng.to_string(),
            format!("{what} virtio-rng"),
        ));
    }
    Ok(())
}

fn check_vsock(config: &VmConfig, record: &DeviceRecord) -> Result<()> {
    match (&config.vsock, &record.vsock) {
        (None, None) => Ok(()),
        (Some(g), Some(s)) if g.cid == s.cid => Ok(()),
        (Some(g), Some(s)) => Err(differs(
            "--vsock",
            format!("cid={}", g.cid),
            format!("a vsock device of cid {}", s.cid),
        )),
        (None, Some(s)) => Err(differs(
            "--vsock",
            "(none)".into(),
            format!("a vsock device of cid {}", s.cid),
        )),
        (Some(g), None) => Err(differs(
            "--vsock",
            format!("cid={}", g.cid),
            "no vsock device".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_disk, parse_net, parse_vsock, StartFrom};

    fn machine() -> VmConfig {
        let mut config = VmConfig::new(StartFrom::Kernel("k".into()));
        config.disks = vec![
            parse_disk("/img/a.raw,serial=root").unwrap(),
            parse_disk("/img/b.raw,readonly,cache=none,queues=2").unwrap(),
        ];
        config.nets = vec![parse_net("tap=fc0,mac=02:00:00:00:00:01").unwrap()];
        config.vsock = Some(parse_vsock("cid=3,socket=/run/v.sock").unwrap());
        config.rng = true;
        config.boot_order = vec![1, 0];
        config
    }

    fn restore() -> VmConfig {
        VmConfig::new(StartFrom::Restore("snap".into()))
    }

    #[test]
    fn a_restore_without_device_options_gets_the_recorded_devices() {
        let source = machine();
        let saved = DeviceRecord::value_of(&source).unwrap();
        assert_eq!(saved["format"], DEVICES_FORMAT);
        let mut config = restore();
        apply_to_restore(&mut config, Some(&saved)).unwrap();
        assert_eq!(config.disks, source.disks);
        assert_eq!(config.nets, source.nets);
        assert_eq!(config.vsock, source.vsock);
        assert_eq!(
            (config.rng, config.console.clone()),
            (true, ConsoleConfig::Serial)
        );
        assert_eq!(config.boot_order, [1, 0]);
        assert_eq!(DeviceRecord::value_of(&config).unwrap(), saved);
    }

    #[test]
    fn old_snapshots_keep_the_options_given() {
        let mut config = restore();
        config.rng = true;
        apply_to_restore(&mut config, None).unwrap();
        assert!(config.rng && config.disks.is_empty());
    }

    #[test]
    fn options_given_must_describe_the_recorded_devices() {
        let saved = DeviceRecord::value_of(&machine()).unwrap();
        // The same devices, bound to other host files and taps: accepted as given.
        let mut moved = machine();
        moved.disks[0].path = "/elsewhere/a.raw".into();
        moved.nets[0].tap = "fc1".into();
        moved.vsock.as_mut().unwrap().socket = "/run/w.sock".into();
        let mut config = moved.clone();
        config.start = StartFrom::Restore("snap".into());
        apply_to_restore(&mut config, Some(&saved)).unwrap();
        assert_eq!(config.disks, moved.disks);

        let refused = |change: &dyn Fn(&mut VmConfig)| {
            let mut config = machine();
            change(&mut config);
            apply_to_restore(&mut config, Some(&saved))
                .unwrap_err()
                .to_string()
        };
        let e = refused(&|c| c.disks[1].readonly = false);
        assert!(
            e.contains("--disk") && e.contains("disk 1 read-only"),
            "{e}"
        );
        let e = refused(&|c| {
            c.disks.pop();
        });
        assert!(e.contains("1 given") && e.contains("2 disk(s)"), "{e}");
        let e = refused(&|c| c.nets[0].mac = Some([2, 0, 0, 0, 0, 9]));
        assert!(e.contains("mac=02:00:00:00:00:01"), "{e}");
        let e = refused(&|c| c.vsock.as_mut().unwrap().cid = 4);
        assert!(e.contains("--vsock") && e.contains("cid 3"), "{e}");
        let e = refused(&|c| c.rng = false);
        assert!(e.contains("--rng") && e.contains("a virtio-rng"), "{e}");
        let e = refused(&|c| c.console = ConsoleConfig::Virtio);
        assert!(e.contains("no virtio console"), "{e}");
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
