//! The machine description carried by the `Config` frame, and the destination's check of it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ram::RamRange;

/// What the destination must match: sent as JSON in the `Config` frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationConfig {
    /// Total guest RAM in bytes.
    pub memory_size: u64,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Interrupt controller mode, e.g. "kernel" or "split".
    pub irqchip: String,
    /// Guest RAM regions, in memory-slot order.
    pub ram_regions: Vec<RamRange>,
    /// Further properties the VMM wants checked (compared key by key, e.g. "accel",
    /// "devices"). Missing on one side counts as a mismatch.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, String>,
    /// The machine's device configuration as the VMM records it (disks, network
    /// interfaces, vsock, ...), versioned by the VMM itself: what a snapshot load rebuilds
    /// the devices from. Not compared by [`MigrationConfig::check_against`] (host-side
    /// paths may differ between source and destination). Absent in snapshots and streams
    /// of builds before it was recorded, and skipped by them when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<serde_json::Value>,
}

/// The destination's own configuration, against which the source's `Config` frame is checked.
pub type ConfigCheck = MigrationConfig;

fn mib(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

fn ranges(r: &[RamRange]) -> String {
    if r.is_empty() {
        return "none".into();
    }
    r.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl MigrationConfig {
    /// Checks that a machine with `self` (the source) can be received by `destination`.
    pub fn check_against(&self, destination: &MigrationConfig) -> Result<()> {
        let mismatch = |field: &str, s: String, d: String| {
            Err(Error::ConfigMismatch {
                field: field.into(),
                source_value: s,
                destination_value: d,
            })
        };
        if self.memory_size != destination.memory_size {
            return mismatch(
                "memory size",
                mib(self.memory_size),
                mib(destination.memory_size),
            );
        }
        if self.vcpus != destination.vcpus {
            return mismatch(
                "vCPU count",
                self.vcpus.to_string(),
                destination.vcpus.to_string(),
            );
        }
        if self.irqchip != destination.irqchip {
            return mismatch(
                "irqchip mode",
                self.irqchip.clone(),
                destination.irqchip.clone(),
            );
        }
        if self.ram_regions != destination.ram_regions {
            return mismatch(
                "RAM layout",
                ranges(&self.ram_regions),
                ranges(&destination.ram_regions),
            );
        }
        let keys: std::collections::BTreeSet<&String> =
            self.extra.keys().chain(destination.extra.keys()).collect();
        for k in keys {
            let (s, d) = (self.extra.get(k), destination.extra.get(k));
            if s != d {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(not set)".into());
                return mismatch(k, show(s), show(d));
            }
        }
        let sum = self
            .ram_regions
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.size));
        if sum != self.memory_size {
            return Err(Error::Param(format!(
                "the RAM regions add up to {}, the memory size is {}",
                mib(sum),
                mib(self.memory_size)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MigrationConfig {
        MigrationConfig {
            memory_size: 1 << 30,
            vcpus: 2,
            irqchip: "kernel".into(),
            ram_regions: vec![RamRange {
                guest_addr: 0,
                size: 1 << 30,
            }],
            extra: BTreeMap::new(),
            devices: None,
        }
    }

    #[test]
    fn mismatches_name_both_values() {
        let a = cfg();
        a.check_against(&a).unwrap();
        let mut b = cfg();
        b.memory_size = 512 << 20;
        let e = a.check_against(&b).unwrap_err().to_string();
        assert_eq!(
            e,
            "machine mismatch: memory size differs: source 1024 MiB, destination 512 MiB"
        );
        let mut b = cfg();
        b.vcpus = 4;
        let e = a.check_against(&b).unwrap_err().to_string();
        assert!(
            e.contains("vCPU count differs: source 2, destination 4"),
            "{e}"
        );
        let mut b = cfg();
        b.irqchip = "split".into();
        assert!(a
            .check_against(&b)
            .unwrap_err()
            .to_string()
            .contains("split"));
        let mut b = cfg();
        b.extra.insert("accel".into(), "kvm".into());
        let e = a.check_against(&b).unwrap_err().to_string();
        assert!(
            e.contains("accel differs: source (not set), destination kvm"),
            "{e}"
        );
    }

    /// The device record is optional both ways: a configuration written without it (an
    /// earlier build) reads as `None`, one with it round-trips, and it is never compared.
    #[test]
    fn the_device_record_is_optional_and_not_compared() {
        let old = serde_json::to_string(&cfg()).unwrap();
        assert!(!old.contains("devices"), "{old}");
        let read: MigrationConfig = serde_json::from_str(&old).unwrap();
        assert_eq!(read.devices, None);
        let mut with = cfg();
        with.devices = Some(serde_json::json!({"version": 1, "disks": [{"path": "/a"}]}));
        let text = serde_json::to_string(&with).unwrap();
        let back: MigrationConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, with);
        with.check_against(&cfg()).unwrap();
        cfg().check_against(&with).unwrap();
    }
}
