//! The accelerator layer: everything ferrovm asks of the host's in-kernel hypervisor.
//!
//! Three traits, one per kernel object: [`Hypervisor`] (the accelerator and what it offers),
//! [`Vm`] (memory, interrupt controllers, injection, dirty log, clock) and [`Vcpu`] (run,
//! state). Backends live in their own modules (`kvm` today); nothing above this crate names
//! a KVM or bhyve type, so a second kernel slots in behind the same traits.

pub mod arch;
mod error;
mod hypervisor;
pub mod kick;
pub mod kvm;
mod vcpu;
mod vm;

pub use arch::*;
pub use error::{HypervisorError, Result};
pub use hypervisor::{open_accelerator, AccelKind, Capabilities, Hypervisor};
pub use kick::VcpuKicker;
pub use vcpu::{Vcpu, VcpuExit};
pub use vm::{ClockData, IrqChipMode, MemoryRegion, MsiMessage, Vm};
