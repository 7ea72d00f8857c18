//! The machine's interrupt controllers as one object, whichever side of the kernel boundary
//! they live on (crosvm's `IrqChip` is the model).
//!
//! A [`MachineIrqChip`] owns everything the machine does with its interrupt controllers:
//! their creation on the VM, the PC wiring (ISA IRQ 0 on I/O APIC pin 2, from
//! `devices::irqchip::ioapic_pin`, the one place it is written), line injection (it is the
//! [`IrqChip`] devices drive), MSI injection, the BSP's ExtINT service and I/O APIC EOIs
//! (split mode), and one versioned saved state ([`IrqChipSavedState`]) for both modes, which
//! the machine's device list carries under the id [`IRQCHIP_ID`] (last, so that lines other
//! devices drive while they are restored end in its saved state).
//!
//! - [`KernelIrqChip`] (`--irqchip kernel`): the kernel models the 8259 pair, I/O APIC and
//!   PIT; lines are `Vm::set_irq_line`, the wiring is handed to the kernel once.
//! - [`SplitIrqChip`](split::SplitMachineIrqChip) (`--irqchip split`): the kernel keeps the
//!   local APICs; the 8259 pair and I/O APIC are ferrovm's (`devices::irqchip`).

mod kernel;
mod split;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub use tests::FakeVm;

use std::sync::{Arc, Mutex};

use devices::bus::Bus;
use devices::irqchip::{IrqChip, SplitIrqChipState};
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use hypervisor::{Capabilities, IrqChipState, MsiMessage, Vcpu, VcpuKicker, Vm};
use serde::{Deserialize, Serialize};

use crate::config::IrqChipKind;
use crate::error::{Error, Result};
use crate::state::SharedDevice;

pub use kernel::KernelIrqChip;
pub use split::SplitMachineIrqChip;

/// The id of the interrupt controllers in the machine's device list.
pub const IRQCHIP_ID: &str = "irqchip";
/// Layout version of [`IrqChipSavedState`].
pub const IRQCHIP_STATE_VERSION: u32 = 1;

/// The interrupt controllers' saved state, one format for both modes (the mode is part of
/// it: a state restores only into a chip of the same mode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum IrqChipSavedState {
    /// The in-kernel 8259 pair, I/O APIC and PIT, as the backend saves them.
    Kernel { chips: IrqChipState },
    /// ferrovm's 8259 pair and I/O APIC.
    Split { chips: SplitIrqChipState },
}

/// The machine's interrupt controllers (see the module documentation). Line injection is
/// the supertrait's `set_irq`.
pub trait MachineIrqChip: IrqChip {
    fn kind(&self) -> IrqChipKind;
    /// Puts the controllers that live in user space on the buses (split mode: the 8259
    /// ports and the I/O APIC window).
    fn register(&self, pio: &mut Bus, mmio: &mut Bus) -> Result<()>;
    /// Delivers an MSI to the local APICs, never waiting for a vCPU.
    fn send_msi(&self, msi: MsiMessage) -> Result<()>;
    /// Called by the BSP's own thread before each entry into the guest: hands it a pending
    /// 8259 interrupt (split mode).
    fn service_bsp(&self, vcpu: &mut dyn Vcpu);
    /// The BSP's thread runs: how to make it call `service_bsp` soon.
    fn set_bsp_kicker(&self, kicker: VcpuKicker);
    /// A vCPU EOIed a level-triggered `vector` the kernel reported (split mode).
    fn eoi(&self, vector: u8);
    /// Fails, with the accelerator's explanation, if the state cannot be saved.
    fn check_can_save(&self) -> Result<()>;
    fn save(&self) -> Result<IrqChipSavedState>;
    /// Restores a state of this chip's mode; anything else is refused, the chip unchanged.
    fn restore(&self, state: &IrqChipSavedState) -> Result<()>;
    /// The controllers as they were created.
    fn reset(&self) -> Result<()>;
}

/// Creates the interrupt controllers of `kind` on `vm`, wired as a PC. `caps` as the
/// accelerator reports them once the VM exists.
pub fn create(
    vm: &Arc<dyn Vm>,
    kind: IrqChipKind,
    caps: &Capabilities,
) -> Result<Arc<dyn MachineIrqChip>> {
    Ok(match kind {
        IrqChipKind::Kernel => Arc::new(KernelIrqChip::create(
            vm.clone(),
            caps.kernel_snapshot != Some(false),
        )?),
        IrqChipKind::Split => {
            if !caps.irqchip_split {
                return Err(Error::Option {
                    option: "--irqchip",
                    value: "split".into(),
                    reason: "the accelerator has no split irqchip".into(),
                });
            }
            Arc::new(SplitMachineIrqChip::create(vm.clone())?)
        }
    })
}

/// A chip's state wrapped for the device list.
pub fn save_device(chip: &dyn MachineIrqChip) -> Result<DeviceState> {
    DeviceState::new(IRQCHIP_STATE_VERSION, &chip.save()?)
        .map_err(|e| Error::State(format!("irqchip: {e}")))
}

/// The interrupt controllers as an entry of the machine's device list.
pub struct IrqChipDevice(pub Arc<dyn MachineIrqChip>);

impl IrqChipDevice {
    pub fn shared(chip: Arc<dyn MachineIrqChip>) -> SharedDevice {
        Arc::new(Mutex::new(IrqChipDevice(chip)))
    }
}

/// The controllers deliver only when a line changes or a vCPU acknowledges or EOIs, never
/// on their own: pause and resume have nothing to do.
impl Lifecycle for IrqChipDevice {
    fn id(&self) -> String {
        IRQCHIP_ID.into()
    }

    fn save(&self) -> std::result::Result<DeviceState, LifecycleError> {
        save_device(self.0.as_ref()).map_err(|e| LifecycleError(e.to_string()))
    }

    fn restore(&mut self, state: &DeviceState) -> std::result::Result<(), StateError> {
        let saved: IrqChipSavedState = state.parse("irqchip", IRQCHIP_STATE_VERSION)?;
        self.0
            .restore(&saved)
            .map_err(|e| StateError::new("irqchip", e.to_string()))
    }

    fn reset(&mut self) {
        if let Err(e) = self.0.reset() {
            log::error!("irqchip reset: {e}");
        }
    }
}

/// The error for a saved state of the other mode.
fn wrong_mode(ours: IrqChipKind, state: &IrqChipSavedState) -> Error {
    let theirs = match state {
        IrqChipSavedState::Kernel { .. } => "kernel",
        IrqChipSavedState::Split { .. } => "split",
    };
    Error::State(format!(
        "the saved interrupt controllers are of --irqchip {theirs}, this machine's of \
         --irqchip {}",
        ours.name()
    ))
}
