//! What the user asked for, validated before anything is created.

use std::path::PathBuf;

pub use crate::device_kinds::{DeviceConfig, DeviceEntry, Devices};
use crate::error::{Error, Result};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const DEFAULT_MEMORY: u64 = 256 * MIB;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqChipKind {
    Kernel,
    Split,
}

impl IrqChipKind {
    /// As `--irqchip` spells it.
    pub fn name(self) -> &'static str {
        match self {
            IrqChipKind::Kernel => "kernel",
            IrqChipKind::Split => "split",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    /// Output to stdout; input from stdin when it is a terminal.
    Stdio,
    File(PathBuf),
    /// A Unix socket the VMM listens on: one client at a time is the console.
    Socket(PathBuf),
    None,
}

/// What the machine starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartFrom {
    Kernel(PathBuf),
    /// The firmware ROM in [`VmConfig::firmware`], from the reset vector.
    Firmware,
    /// A snapshot file; memory size, vCPUs and irqchip mode come from it.
    Restore(PathBuf),
    /// An incoming live migration on `HOST:PORT`.
    Incoming(String),
    /// A local update arriving on this Unix socket (`--incoming unix:PATH`).
    IncomingLocal(PathBuf),
    /// Nothing yet: the configuration comes through the API (`--api-socket` alone, as
    /// Firecracker starts).
    Api,
}

/// Which of the machine's shape options the user gave (rather than left at their default):
/// with `--restore` they are checked against the snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShapeGiven {
    pub memory: bool,
    pub cpus: bool,
    pub irqchip: bool,
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Which of memory, cpus and irqchip the user gave.
    pub shape_given: ShapeGiven,
    pub start: StartFrom,
    pub cmdline: String,
    pub initrd: Option<PathBuf>,
    pub cpus: u32,
    pub memory: u64,
    /// `--memory` as the user wrote it, for error messages.
    pub memory_text: String,
    pub irqchip: IrqChipKind,
    pub accel: hypervisor::AccelKind,
    pub serial: SerialOutput,
    pub wired: bool,
    /// `--memory-backend`: anonymous memory, or a file a local update can hand over.
    pub memory_backend: crate::memory::MemoryBackend,
    pub api_socket: Option<PathBuf>,
    /// `--restore-verify`: check all of a snapshot's page data before the guest runs.
    pub restore_verify: bool,
    /// The devices of the registered kinds (`--disk`, `--net`...), in the order they take
    /// PCI slots.
    pub devices: Devices,
    /// `--restore-eager`: copy a snapshot's pages into guest RAM before the guest runs,
    /// instead of mapping the file.
    pub restore_eager: bool,
    /// `--restore-allow-changed-disks`: restore even onto disk images changed since the
    /// snapshot.
    pub restore_allow_changed_disks: bool,
    /// `--seccomp`: what the threads' system call filters do with a forbidden call.
    pub seccomp: sandbox::Mode,
    /// `--firmware`: the ROM of a firmware boot, or of the machine an incoming migration
    /// brings (its layout has the ROM and the shadow RAM).
    pub firmware: Option<PathBuf>,
    /// `--boot`: the disks the firmware tries, in order, by device id.
    pub boot_order: Vec<String>,
    /// A restored snapshot waits, paused, to be resumed through the API (Firecracker's
    /// `resume_vm: false`).
    pub start_paused: bool,
}

/// The firmware `ferrovm run` uses when a disk is given without a kernel: Debian's SeaBIOS
/// (package `seabios`), the 256 KiB build QEMU's PC machines use.
pub const DEFAULT_FIRMWARE: &str = "/usr/share/seabios/bios-256k.bin";

impl VmConfig {
    pub fn new(start: StartFrom) -> Self {
        VmConfig {
            shape_given: ShapeGiven::default(),
            start,
            cmdline: String::new(),
            initrd: None,
            cpus: 1,
            memory: DEFAULT_MEMORY,
            memory_text: "256M".into(),
            irqchip: IrqChipKind::Kernel,
            accel: hypervisor::AccelKind::Auto,
            serial: SerialOutput::Stdio,
            wired: false,
            memory_backend: Default::default(),
            api_socket: None,
            restore_verify: false,
            restore_eager: false,
            restore_allow_changed_disks: false,
            seccomp: sandbox::Mode::platform_default(),
            devices: Devices::default(),
            firmware: None,
            boot_order: Vec::new(),
            start_paused: false,
        }
    }
}

/// Parses `--boot`: `disk` (every disk, in order) or a comma-separated list of disk ids
/// (`diskN` by default: the N-th `--disk`, from 0).
pub fn parse_boot_order(text: &str, devices: &Devices) -> Result<Vec<String>> {
    let bad = |reason: String| Error::Option {
        option: "--boot",
        value: text.to_string(),
        reason,
    };
    let disks = devices.disk_ids();
    if text == "disk" {
        return Ok(disks);
    }
    let mut order: Vec<String> = Vec::new();
    for item in text.split(',') {
        if !disks.iter().any(|d| d == item) {
            return Err(bad(format!(
                "{item:?}: expected disk or disk ids (the disks are {})",
                if disks.is_empty() {
                    "none".into()
                } else {
                    disks.join(", ")
                }
            )));
        }
        if order.iter().any(|o| o == item) {
            return Err(bad(format!("{item} is listed twice")));
        }
        order.push(item.to_string());
    }
    Ok(order)
}

/// Parses a memory size: a whole number with a unit B, K/KiB, M/MiB, G/GiB or T/TiB (powers
/// of 1024; the letter in either case); a bare number means MiB, as with QEMU's `-m`. Any
/// other suffix is refused ("512MB" is ambiguous, "512X" a typo).
pub fn parse_memory_size(text: &str) -> Result<u64> {
    let bad = || Error::Option {
        option: "--memory",
        value: text.to_string(),
        reason: "expected a size such as 512M, 2G or 1GiB (units B, K/KiB, M/MiB, G/GiB, T/TiB)"
            .into(),
    };
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(bad());
    }
    let number: u64 = t[..digits_end].parse().map_err(|_| bad())?;
    let unit = &t[digits_end..];
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "M" | "MIB" => 20,
        "B" => 0,
        "K" | "KIB" => 10,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(bad()),
    };
    number
        .checked_mul(1u64 << shift)
        .filter(|v| v >> shift == number)
        .ok_or_else(bad)
}

pub fn parse_serial(text: &str) -> Result<SerialOutput> {
    match text {
        "stdio" => Ok(SerialOutput::Stdio),
        "none" => Ok(SerialOutput::None),
        _ => match text.split_once(':') {
            Some(("file", path)) if !path.is_empty() => Ok(SerialOutput::File(path.into())),
            Some(("socket", path)) if !path.is_empty() => Ok(SerialOutput::Socket(path.into())),
            _ => Err(Error::Option {
                option: "--serial",
                value: text.to_string(),
                reason: "expected stdio, none, file:PATH or socket:PATH".into(),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory_size("256").unwrap(), 256 * MIB);
        assert_eq!(parse_memory_size("256M").unwrap(), 256 * MIB);
        assert_eq!(parse_memory_size("1G").unwrap(), GIB);
        assert_eq!(parse_memory_size("2GiB").unwrap(), 2 * GIB);
        assert_eq!(parse_memory_size("4096k").unwrap(), 4 * MIB);
        assert_eq!(parse_memory_size("0").unwrap(), 0);
        assert_eq!(parse_memory_size("512B").unwrap(), 512);
        assert_eq!(parse_memory_size("3t").unwrap(), 3 << 40);
        assert_eq!(parse_memory_size("64KiB").unwrap(), 64 << 10);
        for bad in [
            "",
            "G",
            "12X",
            "512MB",
            "1Gi",
            "2GB",
            "1iB",
            "5BB",
            "-1",
            "1.5G",
            "99999999999999999999",
            "18446744073709551615T",
        ] {
            assert!(parse_memory_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn boot_orders() {
        let kind = crate::device_kinds::kind_named("disk").unwrap();
        let mut devices = Devices::default();
        for text in ["/a", "/b", "/c,id=root"] {
            let (id, disk) = crate::device_kinds::parse_option(kind, text)
                .unwrap()
                .unwrap();
            devices.add(id, disk).unwrap();
        }
        assert_eq!(
            parse_boot_order("disk", &devices).unwrap(),
            ["disk0", "disk1", "root"]
        );
        assert!(parse_boot_order("disk", &Devices::default())
            .unwrap()
            .is_empty());
        assert_eq!(
            parse_boot_order("root,disk0", &devices).unwrap(),
            ["root", "disk0"]
        );
        for bad in [
            "",
            "cdrom",
            "disk2",
            "disk0,disk0",
            "disk-1",
            "disk0,",
            "net",
        ] {
            let e = parse_boot_order(bad, &devices).unwrap_err().to_string();
            assert!(e.contains("--boot"), "{bad}: {e}");
        }
    }

    #[test]
    fn serial_outputs() {
        assert_eq!(parse_serial("stdio").unwrap(), SerialOutput::Stdio);
        assert_eq!(parse_serial("none").unwrap(), SerialOutput::None);
        assert_eq!(
            parse_serial("file:/tmp/x").unwrap(),
            SerialOutput::File("/tmp/x".into())
        );
        assert_eq!(
            parse_serial("socket:/run/c.sock").unwrap(),
            SerialOutput::Socket("/run/c.sock".into())
        );
        assert!(parse_serial("file:").is_err());
        assert!(parse_serial("socket:").is_err());
        assert!(parse_serial("tcp:1").is_err());
    }
}
