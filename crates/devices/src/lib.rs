//! The machine model ferrovm emulates in user space.
//!
//! Everything here is independent of the hypervisor: a vCPU exit handler
//! turns a port or MMIO exit into a call on an [`IoDispatcher`], and devices
//! talk back to the VMM only through small shared objects ([`ExitRequest`],
//! [`serial::IrqLine`]). That keeps the devices testable without `/dev/kvm`
//! and identical over KVM and bhyve.
//!
//! Each device keeps its guest-visible state in a plain `Clone` struct
//! reachable through `state()`/`restore()`, so snapshots and live migration
//! can capture it without the device knowing about either. The structs are
//! `serde` serializable; `restore()` checks every field and refuses a state
//! the device could never have produced with a [`StateError`], leaving the
//! device unchanged.
//!
//! Standard placement on the port-I/O bus (each device's `register` puts it
//! there):
//!
//! | ports | device |
//! | --- | --- |
//! | 0x60, 0x64 | [`i8042::I8042`] (reset, Ctrl+Alt+Del on IRQ 1) |
//! | 0x92 | [`port92::Port92`] (fast A20 and reset; firmware machines) |
//! | 0xf4 | [`debug_exit::DebugExit`] |
//! | 0x402 | [`debugcon::DebugCon`] (firmware log; firmware machines) |
//! | 0x3f8-0x3ff | [`serial::SerialDevice`] (COM1, IRQ 4) |
//! | 0x510-0x511 | [`fw_cfg::FwCfg`] |

#![forbid(unsafe_code)]

pub mod acpi_pm;
/// Address decoding, shared lock-free by all vCPU threads.
pub mod bus;
/// Guest-initiated VM termination with a QEMU-compatible exit status.
pub mod debug_exit;
/// The firmware's debug log port.
pub mod debugcon;
/// The channel from devices on vCPU threads to the VMM's main loop.
pub mod exit;
/// Machine facts for firmware written against QEMU.
pub mod fw_cfg;
/// The PC's reset line.
pub mod i8042;
pub mod irqchip;
/// Pause, resume, save, restore, reset: the one device lifecycle.
pub mod lifecycle;
/// Bounded, non-blocking output queues for console devices.
pub mod output;
pub mod pit;
/// Fast A20 and reset.
pub mod port92;
pub mod rtc;
/// The guest console.
pub mod serial;
pub mod state;

pub use bus::{Bus, BusDevice, BusDeviceMut, BusError, IoDispatcher};
pub use exit::{ExitReason, ExitRequest};
pub use lifecycle::{DeviceState, Lifecycle, LifecycleError};
pub use state::StateError;

#[cfg(test)]
pub(crate) mod test_util {
    /// A tiny deterministic generator, so the garbage tests are reproducible.
    pub(crate) struct XorShift(pub u64);

    impl XorShift {
        pub(crate) fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
    }
}
