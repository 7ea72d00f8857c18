//! `--irqchip split`: the kernel keeps the local APICs; the 8259 pair and the I/O APIC are
//! ferrovm's (`devices::irqchip::SplitIrqChip`), delivering through the kernel's MSI path
//! and, for the 8259, an ExtINT the BSP's own thread injects.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use devices::bus::Bus;
use devices::irqchip::{
    ExtIntSink, Ioapic, IrqChip, Msi, MsiSink, Pic, SplitIrqChip, SplitIrqChipState, NUM_PINS,
};
use hypervisor::{IrqChipMode, MsiMessage, Vcpu, VcpuKicker, Vm};

use super::{wrong_mode, IrqChipSavedState, MachineIrqChip};
use crate::config::IrqChipKind;
use crate::error::{Error, Result};

/// The user-space 8259 pair and I/O APIC of one VM.
pub struct SplitMachineIrqChip {
    vm: Arc<dyn Vm>,
    chip: Arc<SplitIrqChip>,
    extint: Arc<BspExtInt>,
}

impl SplitMachineIrqChip {
    /// Leaves only the local APICs in the kernel, with the I/O APIC's pins as its GSIs.
    pub fn create(vm: Arc<dyn Vm>) -> Result<Self> {
        vm.create_irqchip(IrqChipMode::Split {
            ioapic_pins: NUM_PINS as u32,
        })?;
        let extint = Arc::new(BspExtInt::default());
        let chip = Arc::new(SplitIrqChip::new(
            Arc::new(VmMsiSink { vm: vm.clone() }),
            extint.clone(),
        ));
        Ok(SplitMachineIrqChip { vm, chip, extint })
    }
}

impl IrqChip for SplitMachineIrqChip {
    fn set_irq(&self, gsi: u32, level: bool) {
        self.chip.set_irq(gsi, level);
    }

    fn pulse_irq(&self, gsi: u32) {
        self.chip.pulse_irq(gsi);
    }
}

impl MachineIrqChip for SplitMachineIrqChip {
    fn kind(&self) -> IrqChipKind {
        IrqChipKind::Split
    }

    fn register(&self, pio: &mut Bus, mmio: &mut Bus) -> Result<()> {
        self.chip
            .register(pio, mmio)
            .map_err(|e| Error::Devices(e.to_string()))
    }

    fn send_msi(&self, msi: MsiMessage) -> Result<()> {
        Ok(self.vm.signal_msi(msi)?)
    }

    fn service_bsp(&self, vcpu: &mut dyn Vcpu) {
        self.extint.service(&self.chip, vcpu);
    }

    fn set_bsp_kicker(&self, kicker: VcpuKicker) {
        self.extint.set_kicker(kicker);
    }

    fn eoi(&self, vector: u8) {
        self.chip.eoi(vector);
    }

    /// Everything is in user space.
    fn check_can_save(&self) -> Result<()> {
        Ok(())
    }

    fn save(&self) -> Result<IrqChipSavedState> {
        Ok(IrqChipSavedState::Split {
            chips: self.chip.state(),
        })
    }

    fn restore(&self, state: &IrqChipSavedState) -> Result<()> {
        match state {
            IrqChipSavedState::Split { chips } => self
                .chip
                .restore(chips)
                .map_err(|e| Error::State(e.to_string())),
            other => Err(wrong_mode(IrqChipKind::Split, other)),
        }
    }

    /// 8259s uninitialized, I/O APIC pins masked, their routes republished (so the kernel
    /// forgets the old ones).
    fn reset(&self) -> Result<()> {
        let power_on = SplitIrqChipState {
            pic: Pic::new().state(),
            ioapic: Ioapic::new().state(),
        };
        self.chip
            .restore(&power_on)
            .map_err(|e| Error::State(e.to_string()))
    }
}

/// Where the user-space IOAPIC's messages go: straight to the in-kernel LAPICs.
struct VmMsiSink {
    vm: Arc<dyn Vm>,
}

impl MsiSink for VmMsiSink {
    fn send_msi(&self, address: u64, data: u32) {
        if let Err(e) = self.vm.signal_msi(MsiMessage { address, data }) {
            log::warn!("MSI {address:#x}/{data:#x}: {e}");
        }
    }

    fn ioapic_routes_changed(&self, routes: &[Option<Msi>; NUM_PINS]) {
        let table: Vec<(u32, MsiMessage)> = routes
            .iter()
            .enumerate()
            .filter_map(|(pin, msi)| {
                msi.map(|m| {
                    (
                        pin as u32,
                        MsiMessage {
                            address: m.address,
                            data: m.data,
                        },
                    )
                })
            })
            .collect();
        if let Err(e) = self.vm.set_msi_routes(&table) {
            log::warn!("IOAPIC routes: {e}");
        }
    }
}

/// The 8259's INTR line into the BSP: raising it flags the BSP and kicks it, so the BSP's own
/// thread acknowledges the PIC and injects the vector (KVM_INTERRUPT is a vCPU call).
#[derive(Default)]
struct BspExtInt {
    flagged: AtomicBool,
    kicker: OnceLock<VcpuKicker>,
}

impl BspExtInt {
    fn set_kicker(&self, kicker: VcpuKicker) {
        let _ = self.kicker.set(kicker);
    }

    /// Called by the BSP before each entry: hands a pending 8259 interrupt to the kernel if
    /// the vCPU can take one now, or asks for an exit when it can.
    fn service(&self, chip: &SplitIrqChip, vcpu: &mut dyn Vcpu) {
        // Clear before looking, so a rise that races with this check flags again.
        if !self.flagged.swap(false, Ordering::AcqRel) && !chip.pic_pending() {
            return;
        }
        if !chip.pic_pending() {
            vcpu.request_interrupt_window(false);
            return;
        }
        if vcpu.ready_for_interrupt() {
            vcpu.request_interrupt_window(false);
            if let Some(vector) = chip.pic_acknowledge() {
                if let Err(e) = vcpu.inject_external_interrupt(vector) {
                    log::warn!("ExtINT vector {vector:#x}: {e}");
                }
            }
        } else {
            vcpu.request_interrupt_window(true);
        }
        if chip.pic_pending() {
            self.flagged.store(true, Ordering::Release);
        }
    }
}

impl ExtIntSink for BspExtInt {
    fn extint_pending(&self) {
        self.flagged.store(true, Ordering::Release);
        if let Some(kicker) = self.kicker.get() {
            let _ = kicker.kick();
        }
    }
}
