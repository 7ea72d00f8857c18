//! Which guest pages hold data: the set round 0 sends. Pages the guest never touched are
//! still unpopulated anonymous memory, zero on both sides, and are not sent at all.
//!
//! Order of methods:
//! 1. `/proc/self/pagemap` (Linux): a page holds data if it is present (bit 63) **or swapped
//!    out (bit 62)**: a non-wired guest's swapped pages hold data too.
//! 2. `mincore(2)`: reports only pages in RAM, so a swapped-out page would look untouched and
//!    be lost. It is used only when the host has no active swap (`/proc/swaps` lists none).
//! 3. Otherwise every page is sent (zero pages still travel as 28-byte `ZeroPages` frames).

use std::fs::File;
use std::io;

use serde::Serialize;

use crate::bitmap::{words_for, Bitmap};
use crate::error::Result;
use crate::ram::{GuestRam, Layout, RamRegion, PAGE_SIZE};

/// How the touched pages were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResidencyMethod {
    Pagemap,
    Mincore,
    AllPages,
    /// None: guest RAM is shared with the destination (a local update).
    Shared,
}

/// The pages of guest RAM that hold data.
#[derive(Clone, Debug)]
pub struct Residency {
    /// Touched pages (present or swapped), per region.
    pub pages: Bitmap,
    /// The swapped-out subset (known only with pagemap; empty otherwise).
    pub swapped: Bitmap,
    pub method: ResidencyMethod,
}

impl Residency {
    /// True when untouched pages are known to be zero (the method is exact).
    pub fn is_exact(&self) -> bool {
        self.method != ResidencyMethod::AllPages
    }
}

/// Finds the pages of `ram` that hold data: the resident ones, plus those it says hold a
/// file's data ([`GuestRam::file_data_pages`]).
pub fn touched_pages<G: GuestRam + ?Sized>(ram: &G) -> Result<Residency> {
    Ok(touched_in(
        &Layout::of(ram)?,
        ram.file_data_pages().as_ref(),
    ))
}

/// The pages that hold data: resident (or swapped) pages, and `file_pages` — pages mapped
/// from a snapshot file that hold its data whether or not they were touched since (a private
/// file mapping's untouched pages are not present, yet not zero).
pub(crate) fn touched_in(layout: &Layout, file_pages: Option<&Bitmap>) -> Residency {
    let mut r = resident_in(layout);
    if let Some(f) = file_pages {
        let mut f = f.clone();
        match f.conform(&layout.page_counts()) {
            Ok(()) => r.pages.union_with(&f),
            Err(e) => {
                // Cannot happen with a bitmap made for this RAM; never lose pages over it.
                log::warn!("file-backed page bitmap does not fit guest RAM ({e}): all pages");
                return all_pages(layout);
            }
        }
    }
    r
}

fn resident_in(layout: &Layout) -> Residency {
    match by_pagemap(layout) {
        Ok(r) => return r,
        Err(e) => log::debug!("pagemap unavailable ({e}); trying mincore"),
    }
    if swap_inactive() {
        match by_mincore(layout) {
            Ok(r) => return r,
            Err(e) => log::debug!("mincore failed ({e}); sending every page"),
        }
    } else {
        log::debug!("swap may be active and pagemap is unreadable: sending every page");
    }
    all_pages(layout)
}

pub(crate) fn all_pages(layout: &Layout) -> Residency {
    let counts = layout.page_counts();
    Residency {
        pages: Bitmap::full(&counts),
        swapped: Bitmap::new(&counts),
        method: ResidencyMethod::AllPages,
    }
}

/// Entries read from pagemap per `pread` (8 bytes each: 512 KiB).
const PAGEMAP_CHUNK: usize = 64 << 10;
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;

pub(crate) fn by_pagemap(layout: &Layout) -> io::Result<Residency> {
    use std::os::unix::fs::FileExt;
    let f = File::open("/proc/self/pagemap")?;
    let counts = layout.page_counts();
    let mut pages = Bitmap::new(&counts);
    let mut swapped = Bitmap::new(&counts);
    let mut buf = vec![0u8; PAGEMAP_CHUNK * 8];
    for (ri, r) in layout.regions.iter().enumerate() {
        let first = r.host_ptr as u64 / PAGE_SIZE;
        let n = r.size / PAGE_SIZE;
        let mut done = 0u64;
        while done < n {
            let take = (n - done).min(PAGEMAP_CHUNK as u64) as usize;
            let bytes = &mut buf[..take * 8];
            f.read_exact_at(bytes, (first + done) * 8)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let mut b = [0u8; 8];
                b.copy_from_slice(e);
                let v = u64::from_le_bytes(b);
                let p = done + i as u64;
                if v & PM_PRESENT != 0 {
                    pages.set(ri, p);
                } else if v & PM_SWAPPED != 0 {
                    pages.set(ri, p);
                    swapped.set(ri, p);
                }
            }
            done += take as u64;
        }
    }
    Ok(Residency {
        pages,
        swapped,
        method: ResidencyMethod::Pagemap,
    })
}

/// Pages per `mincore` call (its vector is one byte per page: 256 KiB).
const MINCORE_CHUNK: u64 = 256 << 10;

pub(crate) fn by_mincore(layout: &Layout) -> io::Result<Residency> {
    let counts = layout.page_counts();
    let mut pages = Bitmap::new(&counts);
    let mut vec = vec![0u8; MINCORE_CHUNK as usize];
    for (ri, r) in layout.regions.iter().enumerate() {
        let n = r.size / PAGE_SIZE;
        let mut done = 0u64;
        while done < n {
            let take = (n - done).min(MINCORE_CHUNK);
            let addr = region_page(r, done);
            // SAFETY: `addr..addr + take pages` lies inside the region's mapping (a live
            // mapping by the `GuestRam` contract, page-aligned as checked by `Layout`), and
            // `vec` has room for one byte per page. mincore only reads page-table state.
            let rc = unsafe {
                libc::mincore(
                    addr.cast(),
                    (take * PAGE_SIZE) as usize,
                    vec.as_mut_ptr().cast(),
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            for (i, &v) in vec[..take as usize].iter().enumerate() {
                if v & 1 != 0 {
                    pages.set(ri, done + i as u64);
                }
            }
            done += take;
        }
    }
    Ok(Residency {
        pages,
        swapped: Bitmap::new(&counts),
        method: ResidencyMethod::Mincore,
    })
}

fn region_page(r: &RamRegion, page: u64) -> *mut u8 {
    r.host_ptr.wrapping_add((page * PAGE_SIZE) as usize)
}

/// True when the host has no active swap device (so mincore's "not resident" means "never
/// touched" for anonymous memory).
fn swap_inactive() -> bool {
    match std::fs::read_to_string("/proc/swaps") {
        Ok(s) => s.lines().skip(1).all(|l| l.trim().is_empty()),
        Err(_) => false,
    }
}

/// Asks the kernel to start reading swapped-out pages back in (`MADV_WILLNEED`), so the
/// sender does not stall on each one. Best effort.
pub(crate) fn prefetch_swapped(layout: &Layout, swapped: &Bitmap) {
    for (ri, r) in layout.regions.iter().enumerate() {
        if swapped
            .regions()
            .get(ri)
            .is_none_or(|w| w.len() < words_for(r.size / PAGE_SIZE))
        {
            continue;
        }
        for (page, count) in swapped.runs(ri, u64::MAX) {
            let addr = region_page(r, page);
            // SAFETY: the range is inside the region's live mapping; MADV_WILLNEED only
            // schedules read-ahead and never changes the contents.
            let rc = unsafe {
                libc::madvise(
                    addr.cast(),
                    (count * PAGE_SIZE) as usize,
                    libc::MADV_WILLNEED,
                )
            };
            if rc != 0 {
                log::debug!(
                    "MADV_WILLNEED on swapped guest pages: {}",
                    io::Error::last_os_error()
                );
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    fn ram() -> GuestMemoryMmap<()> {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 2 << 20),
            (GuestAddress(1 << 30), 1 << 20),
        ])
        .unwrap();
        for r in mem.regions() {
            // SAFETY: the region is a mapping `mem` owns; this only disables huge pages so
            // one touch populates one 4 KiB page.
            unsafe { libc::madvise(r.host_ptr.cast(), r.size as usize, libc::MADV_NOHUGEPAGE) };
        }
        mem
    }

    #[test]
    fn touched_pages_are_found() {
        let mem = ram();
        for a in [0u64, 5 * 4096, 100 * 4096 + 17, (1 << 30) + 3 * 4096] {
            mem.write_obj(0xabu8, GuestAddress(a)).unwrap();
        }
        let layout = Layout::of(&mem).unwrap();
        let want = |b: &Bitmap| {
            assert!(b.get(0, 0) && b.get(0, 5) && b.get(0, 100) && b.get(1, 3));
        };
        let pm = by_pagemap(&layout).expect("pagemap readable here");
        want(&pm.pages);
        assert_eq!(pm.pages.count(), 4);
        let mc = by_mincore(&layout).unwrap();
        want(&mc.pages);
        assert_eq!(mc.pages.count(), 4);
        let chosen = touched_pages(&mem).unwrap();
        assert_eq!(chosen.method, ResidencyMethod::Pagemap);
        assert!(chosen.is_exact());
        let all = all_pages(&layout);
        assert_eq!(all.pages.count(), 768);
        prefetch_swapped(&layout, &all.pages);
    }
}
