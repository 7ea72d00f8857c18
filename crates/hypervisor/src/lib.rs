//! The accelerator layer: everything ferrovm asks of the host's in-kernel hypervisor.
//!
//! Three traits, one per kernel object: [`Hypervisor`] (the accelerator and what it offers),
//! [`Vm`] (memory, interrupt controllers, injection, dirty log, clock) and [`Vcpu`] (run,
//! state). Backends live in their own modules (`kvm` on Linux, `bhyve` for FreeBSD's vmm.ko);
//! nothing above this crate names a KVM or bhyve type.
//!
//! For snapshots and migration, [`state`] bundles a vCPU's state ([`VcpuState`]) and saves
//! and restores it in the order the kernel needs; the VM-level pieces are the in-kernel
//! irqchip ([`IrqChipState`]), the clock and the dirty log (see [`Vm`]).

pub mod arch;
pub mod bhyve;
mod error;
mod hypervisor;
pub mod kick;
#[cfg(target_os = "linux")]
pub mod kvm;
pub mod state;
mod vcpu;
mod vm;

pub use arch::*;
pub use error::{HypervisorError, Result};
pub use hypervisor::{
    open_accelerator, open_accelerator_with, AccelKind, AccelOptions, Capabilities, Hypervisor,
};
pub use kick::VcpuKicker;
pub use state::{restore_vcpu_state, save_vcpu_state, VcpuState, SNAPSHOT_MSRS};
pub use vcpu::{Vcpu, VcpuExit};
pub use vm::{
    ClockData, IoEventAddress, IrqChipMode, IrqChipPin, IrqChipState, IrqRoute, KernelBlob,
    MemoryRegion, MsiMessage, Vm, FIRST_MSI_GSI,
};
