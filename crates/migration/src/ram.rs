//! Guest RAM as this crate sees it: regions of guest-physical memory, each backed by one
//! host mapping.

use serde::{Deserialize, Serialize};
use vm_memory::{
    GuestMemoryBackend, GuestMemoryRegion, GuestRegionCollection, MemoryRegionAddress,
};

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};

/// Size of a guest page as carried by the stream. Fixed in format version 1.
pub const PAGE_SIZE: u64 = 4096;
pub(crate) const PAGE_USIZE: usize = PAGE_SIZE as usize;

/// One region of guest RAM and the host mapping that backs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRegion {
    /// Guest-physical address of the first byte (page-aligned).
    pub guest_addr: u64,
    /// Length in bytes (a multiple of [`PAGE_SIZE`]).
    pub size: u64,
    /// Start of the host mapping of the region.
    pub host_ptr: *mut u8,
    /// Whether the mapping may be written (needed on the receiving side).
    pub writable: bool,
}

/// Where guest RAM is, for the sender and the receiver.
///
/// # Safety
///
/// An implementation guarantees that every [`RamRegion`] returned by `regions` describes a
/// live mapping of `size` bytes at `host_ptr` (readable, and writable when `writable` is
/// true) that stays mapped for as long as the `GuestRam` value is borrowed, and that regions
/// are returned in the same order on every call (the order of the dirty bitmaps).
pub unsafe trait GuestRam {
    /// The RAM regions in a fixed order (the VMM's memory-slot order).
    fn regions(&self) -> Vec<RamRegion>;

    /// Pages that hold data although this process may never have touched them: pages of a
    /// lazily restored region still to be brought in from a snapshot file (served on fault
    /// from [`crate::SnapshotImage::read_verified`], or mapped by
    /// [`crate::SnapshotImage::map_into`]), which are not present in the page tables until
    /// first touched and yet hold the file's data. Touched-page discovery (round 0 of a migration, a
    /// snapshot) adds them to the resident pages. One bitmap per region, in `regions()`
    /// order; `None` (the default) when guest RAM is anonymous memory only.
    fn file_data_pages(&self) -> Option<Bitmap> {
        None
    }
}

/// Guest RAM of which some pages are mapped from a snapshot file: `ram`, plus the pages of it
/// that hold the file's data ([`crate::SnapshotImage::data_pages`]). Hand this, not `ram`
/// alone, to [`crate::migrate`] and [`crate::snapshot_file`] after a lazy restore, or pages
/// the guest has not touched since the restore would be left out.
pub struct FileBackedRam<'a, G: ?Sized> {
    ram: &'a G,
    file_pages: Option<&'a Bitmap>,
}

impl<'a, G: GuestRam + ?Sized> FileBackedRam<'a, G> {
    /// `file_pages`: `None` when nothing of `ram` is mapped from a file.
    pub fn new(ram: &'a G, file_pages: Option<&'a Bitmap>) -> Self {
        FileBackedRam { ram, file_pages }
    }
}

// SAFETY: the regions are those of the wrapped `GuestRam`, which upholds the contract for as
// long as it is borrowed, and the wrapper borrows it for its whole life.
unsafe impl<G: GuestRam + ?Sized> GuestRam for FileBackedRam<'_, G> {
    fn regions(&self) -> Vec<RamRegion> {
        self.ram.regions()
    }

    fn file_data_pages(&self) -> Option<Bitmap> {
        match (self.ram.file_data_pages(), self.file_pages) {
            (Some(mut a), Some(b)) => {
                a.union_with(b);
                Some(a)
            }
            (a, b) => a.or_else(|| b.cloned()),
        }
    }
}

/// A vm-memory region backed by one host mapping that the region owns. Guest memory made of
/// such regions (a `GuestRegionCollection`, e.g. vm-memory's `GuestMemoryMmap`) is
/// [`GuestRam`].
///
/// # Safety
///
/// An implementation guarantees that when `get_host_address(MemoryRegionAddress(0))`
/// succeeds, it returns the start of a mapping of `len()` bytes, readable, and writable when
/// `is_writable` is true, that stays mapped at that address for as long as the region lives.
pub unsafe trait HostMappedRegion: GuestMemoryRegion {
    /// Whether the mapping may be written (needed on the receiving side).
    fn is_writable(&self) -> bool;
}

// SAFETY: a `GuestRegionMmap` owns its mapping (through `Arc<MmapRegion>`) of `len()` bytes,
// mapped with the protection `prot()` reports.
#[cfg(target_os = "linux")]
unsafe impl<B: vm_memory::bitmap::Bitmap> HostMappedRegion for vm_memory::GuestRegionMmap<B> {
    fn is_writable(&self) -> bool {
        self.get_mmap().prot() & libc::PROT_WRITE != 0
    }
}

// SAFETY: the collection holds its regions (through `Arc`) for as long as it lives, so by the
// `HostMappedRegion` contract the host addresses stay valid while it is borrowed; its regions
// are kept sorted by guest address, so the order is stable.
unsafe impl<R: HostMappedRegion> GuestRam for GuestRegionCollection<R> {
    fn regions(&self) -> Vec<RamRegion> {
        self.iter()
            .filter_map(|r| {
                let host_ptr = r.get_host_address(MemoryRegionAddress(0)).ok()?;
                Some(RamRegion {
                    guest_addr: r.start_addr().0,
                    size: r.len(),
                    host_ptr,
                    writable: r.is_writable(),
                })
            })
            .collect()
    }
}

/// A guest-physical range, as carried in the `Config` frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamRange {
    pub guest_addr: u64,
    pub size: u64,
}

impl std::fmt::Display for RamRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:#x}..{:#x}",
            self.guest_addr,
            self.guest_addr.saturating_add(self.size)
        )
    }
}

/// Validated RAM layout: regions sorted by index (caller order), page-aligned, not
/// overlapping.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub regions: Vec<RamRegion>,
}

impl Layout {
    pub fn new(regions: Vec<RamRegion>) -> Result<Self> {
        for (i, r) in regions.iter().enumerate() {
            if r.guest_addr % PAGE_SIZE != 0 || r.size % PAGE_SIZE != 0 || r.size == 0 {
                return Err(Error::Layout(format!(
                    "region {i} at {:#x} of {:#x} bytes is not a non-empty whole number of 4 KiB pages",
                    r.guest_addr, r.size
                )));
            }
            if r.guest_addr.checked_add(r.size).is_none() || usize::try_from(r.size).is_err() {
                return Err(Error::Layout(format!(
                    "region {i} at {:#x} of {:#x} bytes overflows the address space",
                    r.guest_addr, r.size
                )));
            }
            if r.host_ptr.is_null() || !(r.host_ptr as usize).is_multiple_of(PAGE_USIZE) {
                return Err(Error::Layout(format!(
                    "region {i} at {:#x}: host mapping {:p} is not page-aligned",
                    r.guest_addr, r.host_ptr
                )));
            }
            for (j, o) in regions.iter().enumerate().take(i) {
                if r.guest_addr < o.guest_addr + o.size && o.guest_addr < r.guest_addr + r.size {
                    return Err(Error::Layout(format!(
                        "regions {j} and {i} overlap ({:#x}+{:#x} and {:#x}+{:#x})",
                        o.guest_addr, o.size, r.guest_addr, r.size
                    )));
                }
            }
        }
        Ok(Layout { regions })
    }

    pub fn of<G: GuestRam + ?Sized>(ram: &G) -> Result<Self> {
        Self::new(ram.regions())
    }

    pub fn ranges(&self) -> Vec<RamRange> {
        self.regions
            .iter()
            .map(|r| RamRange {
                guest_addr: r.guest_addr,
                size: r.size,
            })
            .collect()
    }

    pub fn page_counts(&self) -> Vec<u64> {
        self.regions.iter().map(|r| r.size / PAGE_SIZE).collect()
    }

    pub fn total_pages(&self) -> u64 {
        self.regions.iter().map(|r| r.size / PAGE_SIZE).sum()
    }

    /// Finds the region holding `count` pages from `addr`: (region index, first page index in
    /// the region), or why the range is refused.
    pub fn locate(&self, addr: u64, count: u64) -> std::result::Result<(usize, u64), String> {
        locate_in(&self.ranges(), addr, count)
    }

    /// Host pointer of page `page` of region `region` (the caller checked the bounds).
    pub fn host_page(&self, region: usize, page: u64) -> *mut u8 {
        let r = &self.regions[region];
        debug_assert!(page < r.size / PAGE_SIZE);
        // `page * PAGE_SIZE < size`, which fits in usize (checked in `new`).
        r.host_ptr.wrapping_add((page * PAGE_SIZE) as usize)
    }
}

/// Finds the range holding `count` pages from `addr`: (range index, first page index in the
/// range), or why the pages are refused.
pub(crate) fn locate_in(
    ranges: &[RamRange],
    addr: u64,
    count: u64,
) -> std::result::Result<(usize, u64), String> {
    if !addr.is_multiple_of(PAGE_SIZE) {
        return Err("the address is not 4 KiB aligned".into());
    }
    if count == 0 {
        return Err("the page count is zero".into());
    }
    let end = count
        .checked_mul(PAGE_SIZE)
        .and_then(|len| addr.checked_add(len))
        .ok_or_else(|| "the range overflows".to_string())?;
    for (i, r) in ranges.iter().enumerate() {
        if addr >= r.guest_addr && end <= r.guest_addr.saturating_add(r.size) {
            return Ok((i, (addr - r.guest_addr) / PAGE_SIZE));
        }
    }
    Err(format!(
        "not inside one RAM region (RAM is {})",
        ranges
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}
