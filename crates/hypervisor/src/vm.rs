use std::os::unix::io::RawFd;

use serde::{Deserialize, Serialize};

use crate::HypervisorError;

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

/// The first GSI free for device MSIs (`Vm::set_msi_route`): the ones below belong to the
/// interrupt controllers' pins.
pub const FIRST_MSI_GSI: u32 = 24;

/// A guest write the kernel turns into an eventfd signal without leaving the kernel
/// (`Vm::register_ioeventfd`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoEventAddress {
    Pio(u64),
    Mmio(u64),
}

/// The guest's kvmclock-style clock, saved and restored so time does not jump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClockData {
    pub clock_ns: u64,
    pub flags: u32,
}

/// An input of the in-kernel interrupt controllers (kernel irqchip mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqChipPin {
    /// Input 0-7 of the master 8259.
    PicMaster(u32),
    /// Input 0-7 of the slave 8259.
    PicSlave(u32),
    /// An I/O APIC pin.
    Ioapic(u32),
}

/// Line `gsi` of `Vm::set_irq_line` reaches controller input `pin` (a line may reach
/// several: an ISA IRQ goes to an 8259 input and an I/O APIC pin).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IrqRoute {
    pub gsi: u32,
    pub pin: IrqChipPin,
}

/// The state the kernel keeps for the VM itself (`IrqChipMode::Kernel`), for snapshots and
/// migration: the in-kernel PIC pair, IOAPIC and PIT, and on backends whose kernel keeps
/// more than that (bhyve) everything it saves for the VM.
///
/// The blobs are the backend's own structures, opaque above this crate: they only restore
/// on the backend named in `backend`. KVM fills the four chip fields (`kvm_pic_state` ×2,
/// `kvm_ioapic_state` and `kvm_pit_state2`, native endianness) and no named blobs. bhyve
/// leaves the chip fields empty and fills `blobs` with the structures vmm.ko saves through
/// VM_SNAPSHOT_REQ (the HPET, the VM and its vCPUs' VMCS/VMCB and local APICs, IOAPIC, PIT,
/// PIC, PM timer, RTC). `Vm::set_irqchip_state` checks names, sizes and the fields the
/// kernel would otherwise take on trust, and refuses anything else.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IrqChipState {
    /// Which backend produced the blobs (`"kvm"`, `"bhyve"`).
    pub backend: String,
    pub pic_master: Vec<u8>,
    pub pic_slave: Vec<u8>,
    pub ioapic: Vec<u8>,
    pub pit: Vec<u8>,
    /// Further kernel structures, named and in the order the backend restores them. Absent
    /// from KVM's state (which serialises exactly as before this field existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blobs: Vec<KernelBlob>,
}

/// One named kernel structure of an [`IrqChipState`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelBlob {
    pub name: String,
    pub data: Vec<u8>,
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
    /// Kernel irqchip mode: which controller inputs each line of `set_irq_line` drives,
    /// replacing the kernel's default wiring. Lines not listed reach nothing.
    fn set_irqchip_routes(&self, _routes: &[IrqRoute]) -> Result<()> {
        Err(HypervisorError::Unsupported(
            "routing the in-kernel interrupt controllers' lines".into(),
        ))
    }
    fn create_vcpu(&self, id: u32) -> Result<Box<dyn Vcpu>>;
    /// Drives an interrupt line of the in-kernel PIC/IOAPIC (kernel irqchip mode).
    fn set_irq_line(&self, gsi: u32, level: bool) -> Result<()>;
    /// Delivers an MSI to the in-kernel LAPICs without touching any vCPU.
    fn signal_msi(&self, msi: MsiMessage) -> Result<()>;
    /// Installs the MSI each user-space IOAPIC pin sends, as the kernel's GSI routes. A
    /// split irqchip needs them to know which vectors are level-triggered, so that their EOI
    /// comes back as `VcpuExit::IoapicEoi`. Pins not listed get no route.
    fn set_msi_routes(&self, routes: &[(u32, MsiMessage)]) -> Result<()>;

    /// Makes `gsi` (at or above [`FIRST_MSI_GSI`]) send `msi` when an irqfd registered on it
    /// is signalled, or removes its route (`None`). The backend merges these routes with the
    /// ones the interrupt controllers need. Unsupported where the kernel has no irqfd
    /// (`Capabilities::irqfd`); devices then inject with `signal_msi`.
    fn set_msi_route(&self, gsi: u32, msi: Option<MsiMessage>) -> Result<()> {
        let _ = (gsi, msi);
        Err(HypervisorError::Unsupported("irqfd routes".into()))
    }
    /// Signalling eventfd `fd` injects GSI `gsi` (an MSI route set with `set_msi_route`).
    /// The caller keeps `fd` open until `unregister_irqfd`.
    fn register_irqfd(&self, fd: RawFd, gsi: u32) -> Result<()> {
        let _ = (fd, gsi);
        Err(HypervisorError::Unsupported("irqfd".into()))
    }
    fn unregister_irqfd(&self, fd: RawFd, gsi: u32) -> Result<()> {
        let _ = (fd, gsi);
        Err(HypervisorError::Unsupported("irqfd".into()))
    }
    /// A guest write of `len` bytes to `addr` (matching `datamatch` when given) signals `fd`
    /// in the kernel, with no exit to user space. Unsupported where the kernel lacks it
    /// (`Capabilities::ioeventfd`): the write then reaches the device model as an exit.
    ///
    /// `len` is 1, 2, 4 or 8, and `datamatch` must fit in it. Without `datamatch`, `len` may
    /// also be 0, and KVM then matches a write of any width at `addr` whatever `len` says
    /// (that is also KVM's fast MMIO path). Writes that do not match still exit to user
    /// space. The caller keeps `fd` open until `unregister_ioeventfd`, which takes the same
    /// `addr`, `len` and `datamatch`.
    fn register_ioeventfd(
        &self,
        fd: RawFd,
        addr: IoEventAddress,
        len: u32,
        datamatch: Option<u64>,
    ) -> Result<()> {
        let _ = (fd, addr, len, datamatch);
        Err(HypervisorError::Unsupported("ioeventfd".into()))
    }
    fn unregister_ioeventfd(
        &self,
        fd: RawFd,
        addr: IoEventAddress,
        len: u32,
        datamatch: Option<u64>,
    ) -> Result<()> {
        let _ = (fd, addr, len, datamatch);
        Err(HypervisorError::Unsupported("ioeventfd".into()))
    }

    // Dirty-page tracking for pre-copy migration.
    //
    // Without manual protect (the classic protocol), `dirty_log` returns the pages written
    // since the previous call and, in the same call, clears the bits and write-protects the
    // whole slot again: every round re-protects all of guest memory at once, even the pages
    // that will not be sent for a while.
    //
    // With manual protect (`enable_manual_dirty_protect` returned true):
    //   1. `set_dirty_logging(region, true)`: with KVM_DIRTY_LOG_INITIALLY_SET every page
    //      starts out dirty and nothing is write-protected yet (enabling is O(1), and the
    //      first round sends everything anyway);
    //   2. each round, `dirty_log` returns the dirty bits WITHOUT clearing them and WITHOUT
    //      write-protecting anything: the guest keeps writing at full speed;
    //   3. just before sending a batch of pages, `clear_dirty_log` over exactly those pages
    //      clears their bits and write-protects them again, so a write that lands after the
    //      clear (and so after the copy starts) is caught in the next round. Pages never
    //      cleared stay dirty, so nothing is lost if a round is cut short.
    // The bits `dirty_log` returns are one per 4 KiB page from the start of the slot.

    /// Returns the dirty bitmap of a slot (one bit per 4 KiB page, `size` bytes of slot).
    /// Without manual protect this also clears the bits and write-protects the slot; with
    /// it, the bits stay set until `clear_dirty_log` (see above).
    fn dirty_log(&self, slot: u32, size: u64) -> Result<Vec<u64>>;
    /// Turns dirty logging of a mapped region on or off (re-registers the slot with or
    /// without KVM_MEM_LOG_DIRTY_PAGES). `region` must describe the slot exactly as it was
    /// mapped (same guest range, size and host address); its `log_dirty` field is ignored in
    /// favour of `enabled`.
    fn set_dirty_logging(&self, region: &MemoryRegion, enabled: bool) -> Result<()>;
    /// Makes a mapped region read-only for the guest (writes exit as MMIO writes) or
    /// writable again, keeping its dirty logging and the dirty bits not yet collected.
    /// `region` must describe the slot exactly as it was mapped; its `readonly` field is
    /// ignored in favour of `readonly`. Firmware shadow RAM (the PAM registers) needs it.
    fn set_memory_readonly(&self, region: &MemoryRegion, readonly: bool) -> Result<()> {
        let _ = (region, readonly);
        Err(HypervisorError::Unsupported(
            "switching memory between read-only and writable".into(),
        ))
    }
    /// Switches the VM to the manual-protect protocol (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    /// with KVM_DIRTY_LOG_INITIALLY_SET when the kernel offers it). Returns false, changing
    /// nothing, when the kernel lacks it. Call before enabling dirty logging on any slot.
    fn enable_manual_dirty_protect(&self) -> Result<bool>;
    /// Manual protect: clears the dirty bits of pages `first_page .. first_page + num_pages`
    /// of `slot` and write-protects them again. `first_page` must be a multiple of 64, and
    /// so must `num_pages` unless the range ends at the end of the slot.
    fn clear_dirty_log(&self, slot: u32, first_page: u64, num_pages: u64) -> Result<()>;
    /// Manual protect: clears exactly the pages whose bits are set in `bitmap` (one bit per
    /// page of the whole slot, as `dirty_log` returns it), so pages dirtied since that
    /// `dirty_log` call stay dirty.
    fn clear_dirty_pages(&self, slot: u32, bitmap: &[u64]) -> Result<()>;

    fn clock(&self) -> Result<ClockData>;
    fn set_clock(&self, clock: &ClockData) -> Result<()>;

    /// Kernel irqchip mode: the in-kernel PIC pair, IOAPIC and PIT, and whatever else the
    /// backend's kernel saves for the VM (see [`IrqChipState`]). Take it with every vCPU
    /// stopped and after each vCPU's own state was read (`save_vcpu_state`). An error in
    /// split mode (there is nothing in the kernel to save but the LAPICs, which travel with
    /// each vCPU), and where the kernel cannot save its state
    /// (`Capabilities::kernel_snapshot`).
    fn irqchip_state(&self) -> Result<IrqChipState>;
    /// Restores what `irqchip_state` returned (on a VM whose irqchip was created in kernel
    /// mode and whose vCPUs all exist but have not run; then `restore_vcpu_state` each).
    /// Malformed or foreign state is refused with an error.
    fn set_irqchip_state(&self, state: &IrqChipState) -> Result<()>;

    /// Where the kernel models the RTC (`Capabilities::rtc_in_kernel`): sets its clock to
    /// `unix_secs` and writes `(offset, value)` bytes of its CMOS RAM, as firmware would
    /// (memory sizes). An error on kernels without an RTC.
    fn init_kernel_rtc(&self, unix_secs: i64, cmos: &[(u8, u8)]) -> Result<()>;
}
