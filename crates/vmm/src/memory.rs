//! Guest RAM: anonymous (or a shared file, `--memory-backend`), not reserved up front,
//! advised for transparent huge pages, wired only on request.

mod anon;
mod backend;

use std::sync::Arc;

use hypervisor::{MemoryRegion, Vm};
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionCollection, MemoryRegionAddress,
};

use crate::config::MIB;
use crate::error::{Error, Result};

pub use anon::AnonRegion;
pub use backend::{check_handed_over, shared_ram_of, MemoryBackend, SharedRam, SharedRegion};

/// One region of guest RAM: vm-memory's mmap region on Linux; elsewhere [`AnonRegion`], as
/// vm-memory's mmap backend builds on Linux only.
///
/// On Linux each region carries a dirty bitmap (one bit per 4 KiB page) in which vm-memory
/// records every write the VMM itself makes through it: virtio devices writing used rings
/// and read data. KVM's dirty log only sees the guest's own writes, so live migration ORs
/// this bitmap into it.
#[cfg(target_os = "linux")]
pub type GuestRegion = vm_memory::GuestRegionMmap<vm_memory::bitmap::AtomicBitmap>;
#[cfg(not(target_os = "linux"))]
pub type GuestRegion = AnonRegion;

/// All of guest RAM (on Linux, vm-memory's `GuestMemoryMmap`).
pub type GuestMemory = GuestRegionCollection<GuestRegion>;

/// Guest RAM as the instruction completer reads and writes it (through vm-memory, so the
/// VMM's own dirty bitmap sees the writes).
pub struct CompletionRam(pub Arc<GuestMemory>);

impl complete::GuestRam for CompletionRam {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        use vm_memory::Bytes;
        self.0.read_slice(buf, GuestAddress(gpa)).is_ok()
    }
    fn write(&self, gpa: u64, buf: &[u8]) -> bool {
        use vm_memory::Bytes;
        self.0.write_slice(buf, GuestAddress(gpa)).is_ok()
    }
}

/// Total RAM of the host, from /proc/meminfo.
#[cfg(target_os = "linux")]
pub fn host_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Total RAM of the host, from the `hw.physmem` sysctl.
#[cfg(target_os = "freebsd")]
pub fn host_memory_bytes() -> Option<u64> {
    // An unsigned long, 64 bits on the 64-bit hosts vm-memory supports.
    let mut bytes: u64 = 0;
    let mut len = std::mem::size_of_val(&bytes);
    // SAFETY: the kernel writes at most `len` bytes to `bytes` and sets nothing (no new value
    // is passed).
    let rc = unsafe {
        libc::sysctlbyname(
            c"hw.physmem".as_ptr(),
            (&raw mut bytes).cast(),
            &mut len,
            std::ptr::null(),
            0,
        )
    };
    (rc == 0 && len == std::mem::size_of_val(&bytes)).then_some(bytes)
}

/// Unknown on other hosts: sizes are then not checked against it.
#[cfg(not(any(target_os = "linux", target_os = "freebsd")))]
pub fn host_memory_bytes() -> Option<u64> {
    None
}

/// Refuses sizes that cannot make a working guest on this host.
pub fn validate_size(size: u64, text: &str) -> Result<()> {
    let refuse = |reason: String| Error::Option {
        option: "--memory",
        value: text.to_string(),
        reason,
    };
    let min = boot::layout::MIN_MEM_SIZE;
    if size < min {
        return Err(refuse(format!(
            "a guest needs at least {} MiB of RAM",
            min / MIB
        )));
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

/// Maps anonymous guest RAM for `size` bytes following the platform layout (RAM split
/// around the 32-bit MMIO hole).
pub fn create_guest_memory(size: u64, wired: bool) -> Result<GuestMemory> {
    create_guest_memory_from(size, wired, RamSource::New(&MemoryBackend::Anon))
}

/// What guest RAM is made of.
pub enum RamSource<'a> {
    /// Fresh, zeroed memory of this backend.
    New(&'a MemoryBackend),
    /// The RAM of a running guest, handed over by a local update (checked already).
    HandedOver(SharedRam),
}

/// Maps guest RAM for `size` bytes following the platform layout, from `source`.
pub fn create_guest_memory_from(size: u64, wired: bool, source: RamSource) -> Result<GuestMemory> {
    let shared = match source {
        RamSource::New(MemoryBackend::Anon) => None,
        RamSource::New(backend) => Some(SharedRam {
            file: backend::create_file(backend, size)?,
            regions: backend::layout_for(size),
        }),
        RamSource::HandedOver(ram) => Some(ram),
    };
    let mut regions = Vec::new();
    for (i, (base, len)) in boot::layout::ram_regions(size).into_iter().enumerate() {
        let len = usize::try_from(len).map_err(|_| Error::Memory("region too large".into()))?;
        let region = match &shared {
            Some(ram) => {
                let place = ram.regions.get(i).ok_or_else(|| {
                    Error::Memory("the shared guest RAM file lacks a region".into())
                })?;
                backend::map_shared_region(&ram.file, place)?
            }
            None => map_region(base, len)?,
        };
        let host_addr = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|e| Error::Memory(e.to_string()))?;
        advise_huge_pages(host_addr, len);
        if wired {
            wire(host_addr, len)?;
        }
        regions.push(region);
    }
    GuestMemory::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))
}

#[cfg(target_os = "linux")]
pub(crate) fn map_region(base: GuestAddress, len: usize) -> Result<GuestRegion> {
    // MAP_NORESERVE: a large guest costs only the pages it touches.
    let dirty = vm_memory::bitmap::AtomicBitmap::new(len, DIRTY_PAGE_SIZE);
    let mapping = vm_memory::mmap::MmapRegionBuilder::new_with_bitmap(len, dirty)
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| Error::Memory(format!("mapping {} MiB: {e}", len as u64 / MIB)))?;
    GuestRegion::new(mapping, base)
        .ok_or_else(|| Error::Memory(format!("region at {:#x} overflows", base.0)))
}

/// The granule of the VMM's dirty bitmaps: KVM's dirty-log page.
#[cfg(target_os = "linux")]
const DIRTY_PAGE_SIZE: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(4096) {
    Some(size) => size,
    None => unreachable!(),
};

/// FreeBSD overcommits anonymous memory (and has no MAP_NORESERVE): a large guest costs only
/// the pages it touches.
#[cfg(not(target_os = "linux"))]
pub(crate) fn map_region(base: GuestAddress, len: usize) -> Result<GuestRegion> {
    AnonRegion::new(base, len).map_err(|e| {
        Error::Memory(format!(
            "mapping {} MiB at {:#x}: {e}",
            len as u64 / MIB,
            base.0
        ))
    })
}

#[cfg(target_os = "linux")]
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

/// FreeBSD promotes anonymous memory to superpages on its own; there is nothing to ask.
#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_addr: *mut u8, _len: usize) {}

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

/// Whether guest RAM may be replaced by a private mapping of a snapshot file (a lazy restore,
/// `migration::SnapshotImage::map_into`): where guest RAM is the VMM's own mapping and the
/// hypervisor follows whatever is mapped there — Linux, where KVM's memory slots follow host
/// mapping changes through its MMU notifier. Under bhyve the VM's memory object is mapped over
/// guest RAM; a file mapped in its place would hide the guest's memory from the VMM, so a
/// restore there copies the pages in.
pub fn can_map_files() -> bool {
    cfg!(target_os = "linux")
}

/// Registers every RAM region with the VM, one slot each, in address order.
pub fn map_into_vm(vm: &Arc<dyn Vm>, memory: &GuestMemory) -> Result<Vec<MemoryRegion>> {
    let mut regions = Vec::new();
    for (slot, region) in memory.iter().enumerate() {
        let host_addr = region
            .get_host_address(MemoryRegionAddress(0))
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
    fn memfd_ram_is_seen_by_a_second_mapping_of_its_file() {
        use vm_memory::Bytes;
        let size = 8 << 30;
        let first =
            create_guest_memory_from(size, false, RamSource::New(&MemoryBackend::Memfd)).unwrap();
        first.write_obj(0x5eed_u64, GuestAddress(0x1000)).unwrap();
        first.write_obj(0xf00d_u64, GuestAddress(5 << 30)).unwrap();
        let shared = shared_ram_of(&first).unwrap();
        assert_eq!(shared.regions.len(), 2);
        assert_eq!(shared.regions[1].offset, shared.regions[0].size);
        check_handed_over(&shared, size).unwrap();
        let err = check_handed_over(&shared, size / 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("give the same --memory"), "{err}");
        // What a local update's destination maps: the same pages.
        let second = create_guest_memory_from(size, false, RamSource::HandedOver(shared)).unwrap();
        assert_eq!(
            second.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0x5eed
        );
        assert_eq!(
            second.read_obj::<u64>(GuestAddress(5 << 30)).unwrap(),
            0xf00d
        );
        second.write_obj(7_u64, GuestAddress(0x2000)).unwrap();
        assert_eq!(first.read_obj::<u64>(GuestAddress(0x2000)).unwrap(), 7);
        // Anonymous RAM has no file to hand over.
        assert!(shared_ram_of(&create_guest_memory(16 << 20, false).unwrap()).is_none());
    }

    #[test]
    fn backends_parse_and_a_file_holding_data_is_refused() {
        assert_eq!(MemoryBackend::parse("anon").unwrap(), MemoryBackend::Anon);
        assert_eq!(MemoryBackend::parse("memfd").unwrap(), MemoryBackend::Memfd);
        assert!(MemoryBackend::parse("file:").is_err());
        assert!(MemoryBackend::parse("huge").is_err());
        let dir = std::env::temp_dir().join(format!("ferrovm-backend-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let used = dir.join("used");
        std::fs::write(&used, b"data").unwrap();
        let backend = MemoryBackend::parse(&format!("file:{}", used.display())).unwrap();
        let err = create_guest_memory_from(16 << 20, false, RamSource::New(&backend))
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds data already"), "{err}");
        let fresh = MemoryBackend::File(dir.join("fresh"));
        let mem = create_guest_memory_from(16 << 20, false, RamSource::New(&fresh)).unwrap();
        assert!(shared_ram_of(&mem).is_some());
        let _ = std::fs::remove_dir_all(&dir);
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
