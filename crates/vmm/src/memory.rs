//! Guest RAM: anonymous, not reserved up front, advised for transparent huge pages, wired
//! only on request.

use std::sync::Arc;

use hypervisor::{MemoryRegion, Vm};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

use crate::config::MIB;
use crate::error::{Error, Result};

pub type GuestMemory = GuestMemoryMmap<()>;

/// Total RAM of the host, from /proc/meminfo.
pub fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses sizes that cannot make a working guest on this host.
pub fn validate_size(size: u64, text: &str) -> Result<()> {
    let refuse = |reason: String| Error::Option {
        option: "--memory",
        value: text.to_string(),
        reason,
    };
    if size < MIB {
        return Err(refuse("a guest needs at least 1 MiB of RAM".into()));
    }
    if !size.is_multiple_of(4096) {
        return Err(refuse("must be a multiple of 4 KiB".into()));
    }
    if let Some(host) = host_memory_bytes() {
        if size > host {
            return Err(refuse(format!(
                "larger than this host's {} MiB of RAM",
                host / MIB
            )));
        }
    }
    Ok(())
}

/// Maps guest RAM for `size` bytes following the platform layout (RAM split around the
/// 32-bit MMIO hole).
pub fn create_guest_memory(size: u64, wired: bool) -> Result<GuestMemory> {
    let mut regions = Vec::new();
    for (base, len) in boot::layout::ram_regions(size) {
        let len = usize::try_from(len).map_err(|_| Error::Memory("region too large".into()))?;
        // MAP_NORESERVE: a large guest costs only the pages it touches.
        let mapping = MmapRegionBuilder::new(len)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| Error::Memory(format!("mapping {} MiB: {e}", len as u64 / MIB)))?;
        advise_huge_pages(mapping.as_ptr(), len);
        if wired {
            wire(mapping.as_ptr(), len)?;
        }
        let region = GuestRegionMmap::new(mapping, base)
            .ok_or_else(|| Error::Memory(format!("region at {:#x} overflows", base.0)))?;
        regions.push(region);
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))
}

fn advise_huge_pages(addr: *mut u8, len: usize) {
    // SAFETY: the range is a mapping this process just created; madvise only changes how the
    // kernel backs it.
    let rc = unsafe { libc::madvise(addr.cast(), len, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        // Hosts without THP simply keep 4 KiB pages.
        log::debug!(
            "MADV_HUGEPAGE not taken: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn wire(addr: *mut u8, len: usize) -> Result<()> {
    // SAFETY: the range is a mapping this process owns; mlock faults it in and pins it.
    let rc = unsafe { libc::mlock(addr.cast(), len) };
    if rc != 0 {
        return Err(Error::Memory(format!(
            "--wired: cannot lock {} MiB of guest RAM: {} (check `ulimit -l`)",
            len as u64 / MIB,
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Registers every RAM region with the VM, one slot each, in address order.
pub fn map_into_vm(vm: &Arc<dyn Vm>, memory: &GuestMemory) -> Result<Vec<MemoryRegion>> {
    let mut regions = Vec::new();
    for (slot, region) in memory.iter().enumerate() {
        let host_addr = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .map_err(|e| Error::Memory(e.to_string()))?;
        // The mapping is owned by `memory`, which the machine keeps alive for as long as the
        // VM exists.
        let mapped = MemoryRegion {
            slot: slot as u32,
            guest_addr: region.start_addr().0,
            size: region.len(),
            host_addr: host_addr as u64,
            readonly: false,
            log_dirty: false,
        };
        // SAFETY: as above.
        unsafe { vm.map_memory(&mapped)? };
        regions.push(mapped);
    }
    Ok(regions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    #[test]
    fn sizes_are_validated() {
        assert!(validate_size(0, "0").is_err());
        assert!(validate_size(4095, "4095").is_err());
        assert!(validate_size(MIB + 1, "x").is_err());
        assert!(validate_size(256 * MIB, "256M").is_ok());
        let too_big = host_memory_bytes().unwrap() + 4096;
        let err = validate_size(too_big, "huge").unwrap_err().to_string();
        assert!(err.contains("larger than this host"), "{err}");
    }

    #[test]
    fn large_guests_cost_nothing_until_touched() {
        // 8 GiB mapped without reserving it; splits around the MMIO hole.
        let mem = create_guest_memory(8 << 30, false).unwrap();
        assert_eq!(mem.num_regions(), 2);
        let total: u64 = mem.iter().map(|r| r.len()).sum();
        assert_eq!(total, 8 << 30);
        assert_eq!(
            mem.iter().nth(1).unwrap().start_addr(),
            GuestAddress(4 << 30)
        );
    }
}
