//! What the user asked for, validated before anything is created.

use std::path::PathBuf;

use crate::error::{Error, Result};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const DEFAULT_MEMORY: u64 = 256 * MIB;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqChipKind {
    Kernel,
    Split,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    Stdio,
    File(PathBuf),
    None,
}

/// What the machine starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartFrom {
    Kernel(PathBuf),
    /// A snapshot file; memory size, vCPUs and irqchip mode come from it.
    Restore(PathBuf),
    /// An incoming live migration on `HOST:PORT`.
    Incoming(String),
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
    pub api_socket: Option<PathBuf>,
    /// `--restore-verify`: check all of a snapshot's page data before the guest runs.
    pub restore_verify: bool,
    /// `--restore-eager`: copy a snapshot's pages into guest RAM before the guest runs,
    /// instead of mapping the file.
    pub restore_eager: bool,
}

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
            api_socket: None,
            restore_verify: false,
            restore_eager: false,
        }
    }
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
        _ => match text.strip_prefix("file:") {
            Some(path) if !path.is_empty() => Ok(SerialOutput::File(PathBuf::from(path))),
            _ => Err(Error::Option {
                option: "--serial",
                value: text.to_string(),
                reason: "expected stdio, none or file:PATH".into(),
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
    fn serial_outputs() {
        assert_eq!(parse_serial("stdio").unwrap(), SerialOutput::Stdio);
        assert_eq!(parse_serial("none").unwrap(), SerialOutput::None);
        assert_eq!(
            parse_serial("file:/tmp/x").unwrap(),
            SerialOutput::File("/tmp/x".into())
        );
        assert!(parse_serial("file:").is_err());
        assert!(parse_serial("tcp:1").is_err());
    }
}
