//! A region of guest RAM backed by an anonymous private mapping that the region owns.
//!
//! vm-memory's own mmap backend (`GuestRegionMmap`) maps with Linux's `MAP_NORESERVE` and does
//! not build elsewhere, so on other hosts guest RAM is made of this type. FreeBSD overcommits
//! anonymous memory, so a large guest still costs only the pages it touches. The bhyve
//! backend maps the VM's memory segment over the same host range (`MAP_FIXED`), so the
//! address handed out stays valid for the region's whole life.

use std::io;
use std::ptr::{self, NonNull};

use vm_memory::bitmap::BS;
use vm_memory::{
    GuestAddress, GuestMemoryError, GuestMemoryRegion, GuestMemoryRegionBytes, GuestUsize,
    MemoryRegionAddress, VolatileSlice,
};

/// Guest RAM from `start_addr()` for `len()` bytes, readable and writable, zero until written;
/// unmapped when dropped.
#[derive(Debug)]
pub struct AnonRegion {
    host: NonNull<u8>,
    len: usize,
    guest_addr: GuestAddress,
}

// SAFETY: the mapping belongs to the process, not to a thread. The region hands it out only as
// raw host addresses and volatile slices, the way vm-memory shares guest memory between
// threads (vCPUs and the VMM access it concurrently by design).
unsafe impl Send for AnonRegion {}
// SAFETY: as above; `&AnonRegion` never gives out a Rust reference into the mapping.
unsafe impl Sync for AnonRegion {}

impl AnonRegion {
    /// Maps `len` bytes for guest addresses from `guest_addr`.
    pub fn new(guest_addr: GuestAddress, len: usize) -> io::Result<Self> {
        let last = (len as u64)
            .checked_sub(1)
            .and_then(|span| guest_addr.0.checked_add(span));
        if last.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "guest RAM of {len:#x} bytes at {:#x} is empty or overflows",
                    guest_addr.0
                ),
            ));
        }
        // SAFETY: a new anonymous mapping at an address the kernel chooses: no memory the
        // process already uses is touched.
        let addr = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let host = NonNull::new(addr.cast()).ok_or_else(|| {
            io::Error::other("mmap returned address 0 for guest RAM without MAP_FIXED")
        })?;
        Ok(AnonRegion {
            host,
            len,
            guest_addr,
        })
    }

    /// The whole region as one volatile slice.
    fn whole(&self) -> VolatileSlice<'_> {
        // SAFETY: `host` is the start of a mapping of `len` bytes that lives until `self` is
        // dropped, which the returned lifetime forbids; guest memory is only ever accessed
        // with volatile reads and writes (the guest itself may change it at any time).
        unsafe { VolatileSlice::new(self.host.as_ptr(), self.len) }
    }
}

impl Drop for AnonRegion {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping made in `new` (or, under bhyve, the VM's memory
        // mapped over it), owned by this region alone; no slice of it outlives `self`.
        let rc = unsafe { libc::munmap(self.host.as_ptr().cast(), self.len) };
        if rc != 0 {
            log::warn!(
                "munmap of {:#x} bytes of guest RAM: {}",
                self.len,
                io::Error::last_os_error()
            );
        }
    }
}

impl GuestMemoryRegion for AnonRegion {
    // No dirty-page bitmap: dirty pages come from the hypervisor's log.
    type B = ();

    fn len(&self) -> GuestUsize {
        self.len as GuestUsize
    }

    fn start_addr(&self) -> GuestAddress {
        self.guest_addr
    }

    fn bitmap(&self) -> BS<'_, Self::B> {}

    fn get_host_address(&self, addr: MemoryRegionAddress) -> Result<*mut u8, GuestMemoryError> {
        self.check_address(addr)
            .ok_or(GuestMemoryError::InvalidBackendAddress)
            // In range, so the offset fits the mapping (and usize).
            .map(|addr| self.host.as_ptr().wrapping_add(addr.0 as usize))
    }

    fn get_slice(
        &self,
        offset: MemoryRegionAddress,
        count: usize,
    ) -> Result<VolatileSlice<'_, BS<'_, Self::B>>, GuestMemoryError> {
        let offset =
            usize::try_from(offset.0).map_err(|_| GuestMemoryError::InvalidBackendAddress)?;
        Ok(self.whole().subslice(offset, count)?)
    }
}

// Plain RAM: vm-memory's default `Bytes` (through `get_slice`) is the right one.
impl GuestMemoryRegionBytes for AnonRegion {}

// SAFETY: `get_host_address(0)` is the start of the region's own read-write mapping of `len()`
// bytes, unmapped only when the region is dropped (a backend may replace the pages in place,
// keeping the range mapped and writable).
unsafe impl migration::HostMappedRegion for AnonRegion {
    fn is_writable(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use migration::GuestRam;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestRegionCollection};

    const PAGE: usize = 4096;

    #[test]
    fn reads_and_writes_through_bytes() {
        let region = AnonRegion::new(GuestAddress(0x10_0000), 4 * PAGE).unwrap();
        assert_eq!(region.start_addr(), GuestAddress(0x10_0000));
        assert_eq!(region.len(), 4 * PAGE as u64);
        assert_eq!(
            region.last_addr(),
            GuestAddress(0x10_0000 + 4 * PAGE as u64 - 1)
        );
        // Fresh anonymous memory reads as zero.
        assert_eq!(
            region.read_obj::<u64>(MemoryRegionAddress(0x1230)).unwrap(),
            0
        );

        region
            .write_slice(b"ferrovm", MemoryRegionAddress(0x1ffc))
            .unwrap();
        let mut back = [0u8; 7];
        region
            .read_slice(&mut back, MemoryRegionAddress(0x1ffc))
            .unwrap();
        assert_eq!(&back, b"ferrovm");

        // The last bytes of the region are reachable; one past them is not.
        let end = 4 * PAGE as u64;
        region
            .write_obj(0xdead_beef_u32, MemoryRegionAddress(end - 4))
            .unwrap();
        assert_eq!(
            region
                .read_obj::<u32>(MemoryRegionAddress(end - 4))
                .unwrap(),
            0xdead_beef
        );
        assert!(region
            .write_obj(0u32, MemoryRegionAddress(end - 2))
            .is_err());
        assert!(region.read_obj::<u8>(MemoryRegionAddress(end)).is_err());
    }

    #[test]
    fn host_address_shows_the_same_bytes() {
        let region = AnonRegion::new(GuestAddress(0), 2 * PAGE).unwrap();
        let base = region.get_host_address(MemoryRegionAddress(0)).unwrap();
        assert!((base as usize).is_multiple_of(PAGE));
        let at = region
            .get_host_address(MemoryRegionAddress(0x1001))
            .unwrap();
        assert_eq!(at, base.wrapping_add(0x1001));

        region
            .write_obj(0x5au8, MemoryRegionAddress(0x1001))
            .unwrap();
        // SAFETY: `at` is inside the region's live mapping; nothing else accesses it now.
        assert_eq!(unsafe { at.read_volatile() }, 0x5a);
        // SAFETY: as above.
        unsafe { base.write_volatile(0xa5) };
        assert_eq!(region.read_obj::<u8>(MemoryRegionAddress(0)).unwrap(), 0xa5);
    }

    #[test]
    fn out_of_range_accesses_are_refused() {
        let region = AnonRegion::new(GuestAddress(0x1000), PAGE).unwrap();
        let len = PAGE as u64;
        assert!(region.get_host_address(MemoryRegionAddress(len)).is_err());
        assert!(region
            .get_host_address(MemoryRegionAddress(u64::MAX))
            .is_err());
        assert!(region.get_slice(MemoryRegionAddress(len - 8), 16).is_err());
        assert!(region.get_slice(MemoryRegionAddress(u64::MAX), 1).is_err());
        assert_eq!(
            region
                .get_slice(MemoryRegionAddress(len - 8), 8)
                .unwrap()
                .len(),
            8
        );
        assert_eq!(region.as_volatile_slice().unwrap().len(), PAGE);
    }

    #[test]
    fn empty_or_overflowing_regions_are_refused() {
        assert!(AnonRegion::new(GuestAddress(0), 0).is_err());
        assert!(AnonRegion::new(GuestAddress(u64::MAX - 0xfff), 2 * PAGE).is_err());
        // Ending exactly at the top of the address space is fine.
        let top = AnonRegion::new(GuestAddress(u64::MAX - 0xfff), PAGE).unwrap();
        assert_eq!(top.last_addr(), GuestAddress(u64::MAX));
    }

    #[test]
    fn serves_as_guest_memory_and_guest_ram() {
        let mem = GuestRegionCollection::from_regions(vec![
            AnonRegion::new(GuestAddress(0), 2 * PAGE).unwrap(),
            AnonRegion::new(GuestAddress(0x10_0000), PAGE).unwrap(),
        ])
        .unwrap();
        mem.write_obj(0x1122_3344_u32, GuestAddress(0x10_0010))
            .unwrap();
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x10_0010)).unwrap(),
            0x1122_3344
        );
        // A guest address in the gap between the regions is not RAM.
        assert!(mem.read_obj::<u8>(GuestAddress(0x8000)).is_err());

        let ram = mem.regions();
        assert_eq!(ram.len(), 2);
        assert_eq!((ram[1].guest_addr, ram[1].size), (0x10_0000, PAGE as u64));
        assert!(ram.iter().all(|r| r.writable));
        let second = mem.iter().nth(1).unwrap();
        assert_eq!(
            ram[1].host_ptr,
            second.get_host_address(MemoryRegionAddress(0)).unwrap()
        );
    }
}
