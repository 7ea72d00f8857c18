//! `--irqchip kernel`: the 8259 pair, I/O APIC and PIT are the kernel's.

use std::sync::{Arc, OnceLock};

use devices::bus::Bus;
use devices::irqchip::{ioapic_pin, pic_input, IrqChip, NUM_PINS};
use hypervisor::{
    IrqChipMode, IrqChipPin, IrqChipState, IrqRoute, MsiMessage, Vcpu, VcpuKicker, Vm,
    FIRST_MSI_GSI,
};

use super::{wrong_mode, IrqChipSavedState, MachineIrqChip};
use crate::config::IrqChipKind;
use crate::error::Result;

/// The in-kernel controllers of one VM.
pub struct KernelIrqChip {
    vm: Arc<dyn Vm>,
    /// The kernel can save the controllers' state (`Capabilities::kernel_snapshot`).
    can_save: bool,
    /// Their state right after creation, for `reset`, where it holds the controllers only
    /// (bhyve's holds the whole VM).
    power_on: OnceLock<IrqChipState>,
}

/// The PC wiring as routes of the in-kernel controllers: every line the user-space chip
/// would take, to the same 8259 input and I/O APIC pin.
pub fn pc_routes() -> Vec<IrqRoute> {
    let mut routes = Vec::new();
    for gsi in 0..FIRST_MSI_GSI.max(NUM_PINS as u32) {
        if let Some(input) = pic_input(gsi) {
            let pin = if input < 8 {
                IrqChipPin::PicMaster(input)
            } else {
                IrqChipPin::PicSlave(input - 8)
            };
            routes.push(IrqRoute { gsi, pin });
        }
        if let Some(pin) = ioapic_pin(gsi) {
            routes.push(IrqRoute {
                gsi,
                pin: IrqChipPin::Ioapic(pin as u32),
            });
        }
    }
    routes
}

impl KernelIrqChip {
    /// Creates the kernel's controllers on `vm` and wires them; `can_save` as
    /// `Capabilities::kernel_snapshot` says.
    pub fn create(vm: Arc<dyn Vm>, can_save: bool) -> Result<Self> {
        vm.create_irqchip(IrqChipMode::Kernel)?;
        vm.set_irqchip_routes(&pc_routes())?;
        let power_on = OnceLock::new();
        if can_save {
            match vm.irqchip_state() {
                Ok(state) if state.blobs.is_empty() => {
                    let _ = power_on.set(state);
                }
                _ => {}
            }
        }
        Ok(KernelIrqChip {
            vm,
            can_save,
            power_on,
        })
    }
}

impl IrqChip for KernelIrqChip {
    fn set_irq(&self, gsi: u32, level: bool) {
        if let Err(e) = self.vm.set_irq_line(gsi, level) {
            log::warn!("IRQ line {gsi}: {e}");
        }
    }
}

impl MachineIrqChip for KernelIrqChip {
    fn kind(&self) -> IrqChipKind {
        IrqChipKind::Kernel
    }

    fn register(&self, _pio: &mut Bus, _mmio: &mut Bus) -> Result<()> {
        Ok(())
    }

    fn send_msi(&self, msi: MsiMessage) -> Result<()> {
        Ok(self.vm.signal_msi(msi)?)
    }

    /// The kernel delivers the 8259's interrupts itself.
    fn service_bsp(&self, _vcpu: &mut dyn Vcpu) {}

    fn set_bsp_kicker(&self, _kicker: VcpuKicker) {}

    /// The kernel's I/O APIC sees its EOIs itself.
    fn eoi(&self, _vector: u8) {}

    fn check_can_save(&self) -> Result<()> {
        if !self.can_save {
            // The backend knows it cannot and answers at once, naming what is missing.
            self.vm.irqchip_state()?;
        }
        Ok(())
    }

    fn save(&self) -> Result<IrqChipSavedState> {
        Ok(IrqChipSavedState::Kernel {
            chips: self.vm.irqchip_state()?,
        })
    }

    fn restore(&self, state: &IrqChipSavedState) -> Result<()> {
        match state {
            IrqChipSavedState::Kernel { chips } => Ok(self.vm.set_irqchip_state(chips)?),
            other => Err(wrong_mode(IrqChipKind::Kernel, other)),
        }
    }

    fn reset(&self) -> Result<()> {
        match self.power_on.get() {
            Some(state) => Ok(self.vm.set_irqchip_state(state)?),
            None => Err(crate::error::Error::State(
                "the kernel does not save its interrupt controllers apart from the VM: they \
                 cannot be reset on their own"
                    .into(),
            )),
        }
    }
}
