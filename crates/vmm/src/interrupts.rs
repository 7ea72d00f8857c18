//! The interrupt controllers as the rest of the machine sees them: one `IrqChip` for device
//! models, whichever side of the kernel boundary the controllers live on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use devices::irqchip::{ExtIntSink, IrqChip, Msi, MsiSink, SplitIrqChip, NUM_PINS};
use hypervisor::{MsiMessage, Vcpu, VcpuKicker, Vm};

/// `--irqchip kernel`: lines go to the in-kernel PIC and IOAPIC.
pub struct KernelIrqChip {
    pub vm: Arc<dyn Vm>,
}

impl IrqChip for KernelIrqChip {
    fn set_irq(&self, gsi: u32, level: bool) {
        if let Err(e) = self.vm.set_irq_line(gsi, level) {
            log::warn!("IRQ line {gsi}: {e}");
        }
    }
}

/// Where the user-space IOAPIC's messages go: straight to the in-kernel LAPICs.
pub struct VmMsiSink {
    pub vm: Arc<dyn Vm>,
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
pub struct BspExtInt {
    flagged: AtomicBool,
    kicker: OnceLock<VcpuKicker>,
}

impl BspExtInt {
    pub fn set_kicker(&self, kicker: VcpuKicker) {
        let _ = self.kicker.set(kicker);
    }

    /// Called by the BSP before each entry: hands a pending 8259 interrupt to the kernel if
    /// the vCPU can take one now, or asks for an exit when it can.
    pub fn service(&self, chip: &SplitIrqChip, vcpu: &mut dyn Vcpu) {
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
