//! Assembles a machine from a [`config::VmConfig`] and runs it until the guest or the
//! operator ends it.

pub mod api;
pub mod config;
mod console;
mod control;
mod cpu_setup;
pub mod device_kinds;
mod device_manager;
mod error;
mod files;
pub mod firmware;
mod ioevents;
mod irqchip;
mod local;
mod machine;
pub mod memory;
mod msi;
mod platform;
pub mod power;
mod restore;
pub mod runstate;
mod snapshot;
mod socket;
mod state;
mod timers;
mod vcpu;

pub use error::{Error, Result};
pub use local::incoming_start;
pub use machine::{run, Outcome};
pub use snapshot::parse_tcp;

/// The CPUs this process may run on. Counted once (it reads cgroup files and the affinity
/// mask), before any thread is sandboxed: [`run`] asks first.
pub(crate) fn host_cpus() -> usize {
    static COUNT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *COUNT.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
