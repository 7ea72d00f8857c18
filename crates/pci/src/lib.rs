//! The PCI platform: bus 0 behind a host bridge, configuration through ports 0xCF8/0xCFC
//! and ECAM, BAR allocation, MSI-X and INTx.
//!
//! A function is a [`PciDevice`]. The bus owns configuration-space dispatch and BAR
//! placement: BARs live in the PCI MMIO windows, each window registered once on the
//! machine's (immutable) MMIO bus as one device that looks BARs up in a table the PCI bus
//! updates when the guest moves a BAR. The device is told of every move
//! ([`PciDevice::bar_moved`]) so that it can re-register its ioeventfds.

#![forbid(unsafe_code)]

pub mod msix;

use devices::Lifecycle;

/// Configuration mechanism #1, ECAM and the BAR windows as bus devices.
pub mod access;
/// Bus 0: slots, BAR placement and dispatch.
pub mod bus;
/// The type-0 configuration header functions embed.
pub mod config;
/// The i440FX host bridge at 00:00.0.
pub mod host_bridge;
/// INTx routing to GSIs 16-19.
pub mod intx;
/// The PIIX ISA bridge and PM functions BIOS firmware sets up.
pub mod piix;

#[cfg(test)]
mod bus_tests;

pub use bus::{PciBus, PciBusState, PciError, PciLayout, Window};
pub use config::{ConfigSpace, IntxPin, PciIds};
pub use host_bridge::{HostBridge, PamListener};
pub use intx::{intx_gsi, IntxLine, IntxRouter};

/// An x86 MSI as the guest programs it (address 0xFEExxxxx, data with the vector).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MsiMessage {
    pub address: u64,
    pub data: u32,
}

/// Where a function's MSI-X messages go; the VMM implements it. On KVM each vector has a
/// GSI route and an irqfd, so `fire` is one eventfd write; elsewhere `fire` injects the
/// message through the VM. Never blocks on a vCPU.
pub trait MsiTarget: Send + Sync {
    /// Table entry `vector` now holds `message`, or is masked or disabled (`None`).
    fn update(&self, vector: u16, message: Option<MsiMessage>);
    /// Delivers entry `vector`'s current message. Called only for an unmasked entry while
    /// MSI-X is enabled.
    fn fire(&self, vector: u16);
    /// A duplicate of the eventfd whose signal delivers entry `vector` in the kernel (KVM's
    /// irqfd), for a device whose queues the kernel serves (vhost) to interrupt the guest
    /// without the VMM. `None` where the entry has no such route (the default).
    fn irqfd(&self, _vector: u16) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// What kind of address space a BAR decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Io,
    Memory32,
    /// A 64-bit memory BAR (takes two BAR slots).
    Memory64,
}

/// A BAR a function asks for: its size (a power of two, at least 16 bytes for memory BARs)
/// and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarRequest {
    pub index: usize,
    pub size: u64,
    pub kind: BarKind,
    pub prefetchable: bool,
}

/// One PCI function on bus 0.
///
/// Configuration accesses arrive dword-aligned: `offset` is a multiple of 4 in 0..4096.
/// Writes carry the byte enables as `data` at `offset + sub` (`sub` = the byte offset
/// within the dword). BAR accesses arrive with the offset inside the BAR.
pub trait PciDevice: Lifecycle {
    /// The BARs this function needs; the bus allocates them before the guest runs.
    fn bars(&self) -> Vec<BarRequest>;
    /// Reads configuration dword `offset`.
    fn config_read(&mut self, offset: u16) -> u32;
    /// Writes bytes of configuration dword `offset` starting at byte `sub`.
    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]);
    /// Serves a guest read inside BAR `bar`.
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]);
    /// Serves a guest write inside BAR `bar`.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);
    /// BAR `bar` now decodes at `base` (None: decoding off or unmapped). Called by the
    /// bus while it holds its configuration lock: must not call back into the bus.
    fn bar_moved(&mut self, _bar: usize, _base: Option<u64>) {}
}
