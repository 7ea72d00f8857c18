//! The PIIX functions of a PC that BIOS firmware sets up, with the IDs QEMU's `-M pc` shows:
//! the PIIX3 PCI-to-ISA bridge (8086:7000) at 00:01.0 and the PIIX4 power management
//! function (8086:7113) at 00:01.3.
//!
//! They are configuration registers, stored so that firmware reads back what it wrote:
//!
//! - ISA bridge: the PIRQ route registers 0x60–0x63 (SeaBIOS routes PIRQA–D to ISA IRQs
//!   10 and 11 there and writes the matching ELCR bits through ports 0x4d0/0x4d1, which the
//!   8259 model owns). ferrovm wires each slot's INTx straight to an IOAPIC GSI
//!   (`crate::intx`), as the DSDT's `_PRT` says; the PIRQ routes do not reroute it.
//! - PM function: the PM I/O base (PMBA, 0x40), its enable (PMREGMISC bit 0, 0x80), the
//!   SMBus base (0x90) and its enable (0xd2). The ACPI PM registers themselves live at the
//!   fixed ports 0x600–0x60b (`devices::acpi_pm`, as the FADT says), where SeaBIOS also
//!   puts them; a base written elsewhere is stored but does not move them. The machine has
//!   no SMM, so APM command SMIs read as enabled and locked (DEVACTB bit 25), which tells
//!   firmware that SMM was set up already.

use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use serde::{Deserialize, Serialize};

use crate::config::{ConfigSpace, ConfigSpaceState, PciIds, HEADER_TYPE, INTERRUPT_PIN};
use crate::{BarRequest, PciDevice};

pub const VENDOR_INTEL: u16 = 0x8086;
/// 82371SB PIIX3 ISA bridge.
pub const DEVICE_PIIX3_ISA: u16 = 0x7000;
/// 82371AB/EB/MB PIIX4 power management.
pub const DEVICE_PIIX4_PM: u16 = 0x7113;
/// The slot and functions where they sit.
pub const PIIX_SLOT: u8 = 1;
pub const ISA_FUNCTION: u8 = 0;
pub const PM_FUNCTION: u8 = 3;

/// PIRQA–D route control.
const PIRQ_ROUTE: usize = 0x60;
/// A route register after reset: routing disabled (bit 7), no IRQ.
const PIRQ_DISABLED: u8 = 0x80;
/// PM I/O base (dword; bits 15:6 writable, bit 0 reads 1: I/O space).
const PMBA: usize = 0x40;
/// PM miscellaneous: bit 0 enables the PM I/O space.
const PMREGMISC: usize = 0x80;
/// SMBus base (dword; bits 15:4 writable, bit 0 reads 1).
const SMBBA: usize = 0x90;
/// SMBus host configuration: bit 0 enables the SMBus I/O space, bits 3:1 its interrupt.
const SMBHSTCFG: usize = 0xd2;
/// Device activity B (dword 0x58); byte 0x5b bit 1 is APMC_EN, SMIs on APM command writes.
const DEVACTB_APMC_BYTE: usize = 0x5b;
const DEVACTB_APMC_EN: u8 = 1 << 1;
/// Header type bit 7: the device has more than one function.
const MULTI_FUNCTION: u8 = 0x80;

const STATE_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FunctionState {
    config: ConfigSpaceState,
}

/// A function made only of configuration registers.
pub struct ConfigOnlyFunction {
    name: &'static str,
    id: String,
    config: ConfigSpace,
    reset: ConfigSpaceState,
}

impl ConfigOnlyFunction {
    fn new(name: &'static str, slot: u8, function: u8, config: ConfigSpace) -> Self {
        let reset = config.state();
        ConfigOnlyFunction {
            name,
            id: format!("pci-00:{slot:02x}.{function}"),
            config,
            reset,
        }
    }

    /// Reads a configuration byte (tests, diagnostics).
    pub fn read_u8(&self, offset: usize) -> u8 {
        self.config.read_u8(offset)
    }
}

/// The PIIX3 ISA bridge at 00:01.0 (multi-function: the PM function is 00:01.3).
pub fn isa_bridge() -> ConfigOnlyFunction {
    let mut config = ConfigSpace::new(PciIds {
        vendor: VENDOR_INTEL,
        device: DEVICE_PIIX3_ISA,
        revision: 0,
        class: 0x06_01_00,
        subsystem_vendor: crate::host_bridge::SUBSYSTEM_VENDOR_QEMU,
        subsystem: crate::host_bridge::SUBSYSTEM_QEMU_PC,
    });
    config.set_u8(HEADER_TYPE, MULTI_FUNCTION);
    config.set_bytes(PIRQ_ROUTE, &[PIRQ_DISABLED; 4]);
    config.set_writable(PIRQ_ROUTE, &[0x8f; 4]);
    ConfigOnlyFunction::new("PIIX3 ISA bridge", PIIX_SLOT, ISA_FUNCTION, config)
}

/// The PIIX4 power-management function at 00:01.3 (SCI on INTA, routed to IRQ 9).
pub fn power_management() -> ConfigOnlyFunction {
    let mut config = ConfigSpace::new(PciIds {
        vendor: VENDOR_INTEL,
        device: DEVICE_PIIX4_PM,
        revision: 3,
        class: 0x06_80_00,
        subsystem_vendor: crate::host_bridge::SUBSYSTEM_VENDOR_QEMU,
        subsystem: crate::host_bridge::SUBSYSTEM_QEMU_PC,
    });
    config.set_u8(INTERRUPT_PIN, 1);
    config.set_u32(PMBA, 1);
    config.set_writable(PMBA, &[0xc0, 0xff, 0, 0]);
    config.set_writable(PMREGMISC, &[0x01]);
    config.set_u32(SMBBA, 1);
    config.set_writable(SMBBA, &[0xf0, 0xff, 0, 0]);
    config.set_writable(SMBHSTCFG, &[0x0f]);
    // There is no SMM: APM SMIs read as already set up (and fixed), so firmware does not
    // try to relocate SMBASE and wait for an SMI handler that never runs (QEMU does the
    // same without SMM).
    config.set_u8(DEVACTB_APMC_BYTE, DEVACTB_APMC_EN);
    ConfigOnlyFunction::new("PIIX4 PM", PIIX_SLOT, PM_FUNCTION, config)
}

impl PciDevice for ConfigOnlyFunction {
    fn bars(&self) -> Vec<BarRequest> {
        Vec::new()
    }

    fn config_read(&mut self, offset: u16) -> u32 {
        self.config.read(offset)
    }

    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        self.config.write(offset, sub, data);
    }

    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

impl Lifecycle for ConfigOnlyFunction {
    fn id(&self) -> String {
        self.id.clone()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(
            STATE_VERSION,
            &FunctionState {
                config: self.config.state(),
            },
        )
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let s: FunctionState = state.parse(self.name, STATE_VERSION)?;
        self.config.restore(&s.config)
    }

    fn reset(&mut self) {
        // The reset image came from this very space: it always restores.
        let _ = self.config.restore(&self.reset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn byte(f: &mut ConfigOnlyFunction, offset: usize) -> u8 {
        (f.config_read((offset & !3) as u16) >> ((offset & 3) * 8)) as u8
    }

    #[test]
    fn isa_bridge_identity_and_pirq_routes() {
        let mut f = isa_bridge();
        assert_eq!(f.config_read(0), 0x7000_8086);
        assert_eq!(f.config_read(8) >> 8, 0x06_01_00);
        assert_eq!(byte(&mut f, HEADER_TYPE), 0x80, "multi-function");
        assert_eq!(f.config_read(0x60), 0x8080_8080);
        // SeaBIOS: PIRQA-D -> IRQ 10, 10, 11, 11.
        f.config_write(0x60, 0, &[10, 10, 11, 11]);
        assert_eq!(f.config_read(0x60), 0x0b0b_0a0a);
        f.config_write(0x60, 0, &[0xff, 0x70, 0, 0]);
        assert_eq!(f.config_read(0x60) & 0xffff, 0x008f, "reserved bits stay 0");
        assert_eq!(f.id(), "pci-00:01.0");
    }

    #[test]
    fn pm_registers_as_seabios_programs_them() {
        let mut f = power_management();
        assert_eq!(f.config_read(0), 0x7113_8086);
        assert_eq!(f.config_read(8), 0x0680_0003);
        assert_eq!(byte(&mut f, INTERRUPT_PIN), 1);
        assert_eq!(f.config_read(0x40), 1, "I/O space indicator");
        assert_eq!(f.config_read(0x58), 1 << 25, "APMC_EN: no SMM set-up to do");
        f.config_write(0x58, 3, &[0]);
        assert_eq!(f.config_read(0x58), 1 << 25, "read-only");
        f.config_write(0x3c, 0, &[9]);
        f.config_write(0x40, 0, &0x601u32.to_le_bytes());
        f.config_write(0x80, 0, &[1]);
        f.config_write(0x90, 0, &0x701u32.to_le_bytes());
        f.config_write(0xd0, 2, &[0x09]);
        assert_eq!(f.config_read(0x40), 0x601);
        assert_eq!(byte(&mut f, 0x80), 1);
        assert_eq!(f.config_read(0x90), 0x701);
        assert_eq!(byte(&mut f, 0xd2), 9);
        assert_eq!(byte(&mut f, 0x3c), 9);
        let saved = f.save().unwrap();
        let mut g = power_management();
        g.restore(&saved).unwrap();
        assert_eq!(g.config_read(0x40), 0x601);
        g.reset();
        assert_eq!(g.config_read(0x40), 1);
        assert_eq!(f.id(), "pci-00:01.3");
    }
}
