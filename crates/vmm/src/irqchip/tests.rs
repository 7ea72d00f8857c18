//! Conformance of both [`MachineIrqChip`] implementations: every test body runs against the
//! kernel and the split chip, over a fake `Vm` that records what reaches the kernel.

use std::sync::{Arc, Mutex};

use devices::bus::Bus;
use hypervisor::{
    ClockData, HypervisorError, IrqChipMode, IrqChipPin, IrqChipState, IrqRoute, MemoryRegion,
    MsiMessage, Vcpu, Vm,
};

use super::*;

/// What the chip did to the VM.
#[derive(Default)]
pub struct FakeVm {
    mode: Mutex<Option<IrqChipMode>>,
    routes: Mutex<Vec<IrqRoute>>,
    lines: Mutex<Vec<(u32, bool)>>,
    msis: Mutex<Vec<MsiMessage>>,
    kernel_state: Mutex<IrqChipState>,
}

fn unsupported<T>() -> hypervisor::Result<T> {
    Err(HypervisorError::Unsupported("not in the fake".into()))
}

impl Vm for FakeVm {
    unsafe fn map_memory(&self, _region: &MemoryRegion) -> hypervisor::Result<()> {
        unsupported()
    }
    fn create_irqchip(&self, mode: IrqChipMode) -> hypervisor::Result<()> {
        *self.mode.lock().unwrap() = Some(mode);
        Ok(())
    }
    fn set_irqchip_routes(&self, routes: &[IrqRoute]) -> hypervisor::Result<()> {
        *self.routes.lock().unwrap() = routes.to_vec();
        Ok(())
    }
    fn create_vcpu(&self, _id: u32) -> hypervisor::Result<Box<dyn Vcpu>> {
        unsupported()
    }
    fn set_irq_line(&self, gsi: u32, level: bool) -> hypervisor::Result<()> {
        self.lines.lock().unwrap().push((gsi, level));
        Ok(())
    }
    fn signal_msi(&self, msi: MsiMessage) -> hypervisor::Result<()> {
        self.msis.lock().unwrap().push(msi);
        Ok(())
    }
    fn set_msi_routes(&self, _routes: &[(u32, MsiMessage)]) -> hypervisor::Result<()> {
        Ok(())
    }
    fn dirty_log(&self, _slot: u32, _size: u64) -> hypervisor::Result<Vec<u64>> {
        unsupported()
    }
    fn set_dirty_logging(&self, _r: &MemoryRegion, _on: bool) -> hypervisor::Result<()> {
        unsupported()
    }
    fn enable_manual_dirty_protect(&self) -> hypervisor::Result<bool> {
        unsupported()
    }
    fn clear_dirty_log(&self, _slot: u32, _first: u64, _n: u64) -> hypervisor::Result<()> {
        unsupported()
    }
    fn clear_dirty_pages(&self, _slot: u32, _bitmap: &[u64]) -> hypervisor::Result<()> {
        unsupported()
    }
    fn clock(&self) -> hypervisor::Result<ClockData> {
        unsupported()
    }
    fn set_clock(&self, _clock: &ClockData) -> hypervisor::Result<()> {
        unsupported()
    }
    fn irqchip_state(&self) -> hypervisor::Result<IrqChipState> {
        match *self.mode.lock().unwrap() {
            Some(IrqChipMode::Kernel) => Ok(self.kernel_state.lock().unwrap().clone()),
            _ => unsupported(),
        }
    }
    fn set_irqchip_state(&self, state: &IrqChipState) -> hypervisor::Result<()> {
        *self.kernel_state.lock().unwrap() = state.clone();
        Ok(())
    }
    fn init_kernel_rtc(&self, _secs: i64, _cmos: &[(u8, u8)]) -> hypervisor::Result<()> {
        unsupported()
    }
}

/// A chip of `kind` on a fresh fake VM, its user-space parts on buses of its own.
struct Rig {
    vm: Arc<FakeVm>,
    chip: Arc<dyn MachineIrqChip>,
    mmio: Bus,
}

fn caps() -> Capabilities {
    Capabilities {
        irqchip_split: true,
        kernel_snapshot: Some(true),
        ..Default::default()
    }
}

fn rig(kind: IrqChipKind) -> Rig {
    let vm = Arc::new(FakeVm::default());
    vm.kernel_state.lock().unwrap().backend = "fake".into();
    let dyn_vm: Arc<dyn Vm> = vm.clone();
    let chip = create(&dyn_vm, kind, &caps()).unwrap();
    let (mut pio, mut mmio) = (Bus::new(), Bus::new());
    chip.register(&mut pio, &mut mmio).unwrap();
    Rig { vm, chip, mmio }
}

const KINDS: [IrqChipKind; 2] = [IrqChipKind::Kernel, IrqChipKind::Split];

impl Rig {
    /// The I/O APIC pin line `gsi` reaches. Kernel mode: from the routes handed to the
    /// kernel. Split mode: measured, by programming every pin with its own vector and
    /// pulsing the line.
    fn ioapic_pin_of(&mut self, gsi: u32) -> Option<u32> {
        match self.chip.kind() {
            IrqChipKind::Kernel => {
                self.vm
                    .routes
                    .lock()
                    .unwrap()
                    .iter()
                    .find_map(|r| match (r.gsi == gsi, r.pin) {
                        (true, IrqChipPin::Ioapic(pin)) => Some(pin),
                        _ => None,
                    })
            }
            IrqChipKind::Split => {
                for pin in 0..24u32 {
                    self.ioapic_write(0x10 + 2 * pin, 0x40 + pin); // edge, fixed, unmasked
                    self.ioapic_write(0x11 + 2 * pin, 0);
                }
                self.vm.msis.lock().unwrap().clear();
                self.chip.pulse_irq(gsi);
                let msis = self.vm.msis.lock().unwrap();
                msis.first().map(|m| (m.data & 0xff) - 0x40)
            }
        }
    }

    fn ioapic_write(&mut self, reg: u32, value: u32) {
        let base = devices::irqchip::IOAPIC_BASE;
        assert!(self.mmio.write(base, &reg.to_le_bytes()));
        assert!(self.mmio.write(base + 0x10, &value.to_le_bytes()));
    }

    /// Leaves a mark in the chip's state.
    fn disturb(&mut self) {
        match self.chip.kind() {
            IrqChipKind::Kernel => self.vm.kernel_state.lock().unwrap().pic_master = vec![7; 16],
            IrqChipKind::Split => self.ioapic_write(0x10 + 2 * 5, 0x55),
        }
    }
}

#[test]
fn each_mode_creates_its_controllers_on_the_vm() {
    for kind in KINDS {
        let r = rig(kind);
        assert_eq!(r.chip.kind(), kind);
        let mode = *r.vm.mode.lock().unwrap();
        match kind {
            IrqChipKind::Kernel => assert_eq!(mode, Some(IrqChipMode::Kernel)),
            IrqChipKind::Split => assert_eq!(mode, Some(IrqChipMode::Split { ioapic_pins: 24 })),
        }
    }
}

#[test]
fn irq0_reaches_ioapic_pin_2_and_the_cascade_nothing() {
    for kind in KINDS {
        let mut r = rig(kind);
        assert_eq!(r.ioapic_pin_of(0), Some(2), "{kind:?}: the PIT");
        assert_eq!(r.ioapic_pin_of(4), Some(4), "{kind:?}: COM1");
        assert_eq!(r.ioapic_pin_of(19), Some(19), "{kind:?}: a PCI line");
        assert_eq!(r.ioapic_pin_of(2), None, "{kind:?}: the cascade");
    }
    // The kernel also gets the 8259 inputs: ISA IRQ n on input n, none for the cascade.
    let r = rig(IrqChipKind::Kernel);
    let routes = r.vm.routes.lock().unwrap();
    let pic: Vec<(u32, IrqChipPin)> = routes
        .iter()
        .filter(|r| !matches!(r.pin, IrqChipPin::Ioapic(_)))
        .map(|r| (r.gsi, r.pin))
        .collect();
    assert_eq!(pic.len(), 15);
    assert!(pic.contains(&(0, IrqChipPin::PicMaster(0))));
    assert!(pic.contains(&(8, IrqChipPin::PicSlave(0))));
}

#[test]
fn lines_and_msis_reach_the_vm() {
    for kind in KINDS {
        let mut r = rig(kind);
        let msi = MsiMessage::fixed(1, 0x61);
        r.chip.send_msi(msi).unwrap();
        assert_eq!(r.vm.msis.lock().unwrap().last(), Some(&msi), "{kind:?}");
        r.chip.set_irq(4, true);
        r.chip.set_irq(4, false);
        match kind {
            IrqChipKind::Kernel => {
                assert_eq!(*r.vm.lines.lock().unwrap(), [(4, true), (4, false)])
            }
            // The user-space chip is what the line reaches (measured above); nothing goes
            // to the kernel's lines.
            IrqChipKind::Split => {
                assert!(r.vm.lines.lock().unwrap().is_empty());
                assert_eq!(r.ioapic_pin_of(4), Some(4));
            }
        }
    }
}

#[test]
fn state_is_one_versioned_format_and_round_trips() {
    for kind in KINDS {
        let mut r = rig(kind);
        r.disturb();
        let saved = save_device(r.chip.as_ref()).unwrap();
        assert_eq!(saved.version, IRQCHIP_STATE_VERSION);
        assert_eq!(saved.data["mode"], kind.name(), "{}", saved.data);

        let fresh = rig(kind);
        let mut device = IrqChipDevice(fresh.chip.clone());
        assert_eq!(device.id(), IRQCHIP_ID);
        device.restore(&saved).unwrap();
        assert_eq!(save_device(fresh.chip.as_ref()).unwrap(), saved, "{kind:?}");

        let newer = DeviceState {
            version: IRQCHIP_STATE_VERSION + 1,
            data: saved.data.clone(),
        };
        assert!(device.restore(&newer).is_err());
    }
}

#[test]
fn a_state_of_the_other_mode_is_refused_and_changes_nothing() {
    let kernel = save_device(rig(IrqChipKind::Kernel).chip.as_ref()).unwrap();
    let split = save_device(rig(IrqChipKind::Split).chip.as_ref()).unwrap();
    for (kind, foreign) in [(IrqChipKind::Kernel, &split), (IrqChipKind::Split, &kernel)] {
        let mut r = rig(kind);
        r.disturb();
        let before = save_device(r.chip.as_ref()).unwrap();
        let err = IrqChipDevice(r.chip.clone())
            .restore(foreign)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--irqchip kernel") && err.contains("--irqchip split"),
            "{err}"
        );
        assert_eq!(save_device(r.chip.as_ref()).unwrap(), before, "{kind:?}");
    }
}

#[test]
fn reset_brings_back_the_state_of_creation() {
    for kind in KINDS {
        let mut r = rig(kind);
        let created = save_device(r.chip.as_ref()).unwrap();
        r.disturb();
        assert_ne!(save_device(r.chip.as_ref()).unwrap(), created, "{kind:?}");
        IrqChipDevice(r.chip.clone()).reset();
        assert_eq!(save_device(r.chip.as_ref()).unwrap(), created, "{kind:?}");
    }
}

#[test]
fn split_mode_needs_the_accelerator_to_have_it() {
    let vm: Arc<dyn Vm> = Arc::new(FakeVm::default());
    let caps = Capabilities::default();
    let err = create(&vm, IrqChipKind::Split, &caps)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no split irqchip"), "{err}");
}
