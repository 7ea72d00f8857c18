use crate::{Result, Vcpu};

/// A range of guest physical memory backed by a host mapping.
#[derive(Clone, Copy, Debug)]
pub struct MemoryRegion {
    pub slot: u32,
    pub guest_addr: u64,
    pub size: u64,
    /// Start of the host mapping that backs the range.
    pub host_addr: u64,
    pub readonly: bool,
    pub log_dirty: bool,
}

/// Where the interrupt controllers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqChipMode {
    /// LAPIC, IOAPIC, PIC and PIT all in the kernel.
    Kernel,
    /// Only the LAPICs in the kernel; PIC/IOAPIC/PIT in user space, delivering MSIs.
    Split { ioapic_pins: u32 },
}

/// An MSI as the guest would write it: address 0xFEExxxxx, data with vector and mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsiMessage {
    pub address: u64,
    pub data: u32,
}

impl MsiMessage {
    /// Fixed, edge-triggered delivery of `vector` to the LAPIC with physical ID `apic_id`.
    pub fn fixed(apic_id: u32, vector: u8) -> Self {
        MsiMessage {
            address: 0xfee0_0000 | (u64::from(apic_id & 0xff) << 12),
            data: u32::from(vector),
        }
    }
}

/// The guest's kvmclock-style clock, saved and restored so time does not jump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClockData {
    pub clock_ns: u64,
    pub flags: u32,
}

/// One virtual machine. Shared by every vCPU thread, so every method takes `&self` and
/// none of them waits on a vCPU: injecting an interrupt is a single kernel call.
pub trait Vm: Send + Sync {
    /// Maps guest memory.
    ///
    /// # Safety
    /// `region.host_addr .. + size` must stay mapped and valid for the VM's lifetime (or
    /// until the slot is removed); the kernel accesses it behind Rust's back.
    unsafe fn map_memory(&self, region: &MemoryRegion) -> Result<()>;
    fn create_irqchip(&self, mode: IrqChipMode) -> Result<()>;
    fn create_vcpu(&self, id: u32) -> Result<Box<dyn Vcpu>>;
    /// Drives an interrupt line of the in-kernel PIC/IOAPIC (kernel irqchip mode).
    fn set_irq_line(&self, gsi: u32, level: bool) -> Result<()>;
    /// Delivers an MSI to the in-kernel LAPICs without touching any vCPU.
    fn signal_msi(&self, msi: MsiMessage) -> Result<()>;
    /// Installs the MSI each user-space IOAPIC pin sends, as the kernel's GSI routes. A
    /// split irqchip needs them to know which vectors are level-triggered, so that their EOI
    /// comes back as `VcpuExit::IoapicEoi`. Pins not listed get no route.
    fn set_msi_routes(&self, routes: &[(u32, MsiMessage)]) -> Result<()>;
    /// Returns and clears the dirty bitmap of a slot (one bit per 4 KiB page).
    fn dirty_log(&self, slot: u32, size: u64) -> Result<Vec<u64>>;
    fn clock(&self) -> Result<ClockData>;
    fn set_clock(&self, clock: &ClockData) -> Result<()>;
}
