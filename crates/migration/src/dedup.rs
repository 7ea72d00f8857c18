//! Repeated pages as markers: a page whose content already went out on the same connection
//! in the same round is sent as a `SamePage` frame naming that earlier page, and the
//! receiver copies it from there (docs/migration.md, "Repeated pages").
//!
//! A CRC-32 match only proposes a candidate: the two pages are compared byte for byte
//! before a marker is sent. The destination holds the earlier page as it was *sent*, which
//! may differ from what it holds now if the guest wrote it since (it is then dirty): every
//! marker is remembered as a reference, and a page is sent again whenever the page it was
//! copied from is (see [`Refs::follow`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, DefaultHasher, Hasher};

use vm_memory::VolatileSlice;

use crate::bitmap::Bitmap;
use crate::pages::PageBuf;
use crate::ram::PAGE_USIZE;

/// A guest page: region index and page number in the region.
pub(crate) type PageAt = (usize, u64);

/// Pages seen on one connection in the current round, by CRC-32.
pub(crate) struct Dedup {
    seen: HashMap<u32, PageAt, Keyed>,
    scratch: PageBuf,
    /// Markers sent: (page, the page it was copied from).
    pub refs: Vec<(PageAt, PageAt)>,
}

impl Dedup {
    pub fn new() -> Self {
        Dedup {
            seen: HashMap::with_hasher(Keyed::new()),
            scratch: PageBuf::new(),
            refs: Vec::new(),
        }
    }

    /// Forgets the pages seen (a new round: a marker may only name a page of its round).
    pub fn new_round(&mut self) {
        self.seen.clear();
    }

    /// The page sent earlier this round with the content `data` (CRC `crc`) of `page`, if
    /// any; `host` maps a page to its address. Otherwise remembers `page` for later ones.
    pub fn earlier(
        &mut self,
        page: PageAt,
        crc: u32,
        data: &PageBuf,
        host: impl Fn(PageAt) -> *mut u8,
    ) -> Option<PageAt> {
        let Some(&other) = self.seen.get(&crc) else {
            self.seen.insert(crc, page);
            return None;
        };
        if other == page {
            return None;
        }
        // SAFETY: `other` is a page of the validated layout the caller sends from (a live
        // mapping while the RAM is borrowed); a running vCPU may change it, hence the
        // volatile read into a scratch copy.
        let slice = unsafe { VolatileSlice::new(host(other), PAGE_USIZE) };
        slice.copy_to(&mut self.scratch.0[..]);
        (self.scratch.0 == data.0).then(|| {
            self.refs.push((page, other));
            other
        })
    }
}

/// SipHash with a key of its own: the CRCs are the guest's to choose, and std's
/// `RandomState` asks the kernel for its keys (`getrandom`, which the migration threads'
/// seccomp profile does not allow).
struct Keyed(u64);

impl Keyed {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let here = &nanos as *const u64 as u64;
        Keyed(nanos.rotate_left(17) ^ here ^ 0x243f_6a88_85a3_08d3)
    }
}

impl BuildHasher for Keyed {
    type Hasher = DefaultHasher;

    fn build_hasher(&self) -> DefaultHasher {
        let mut h = DefaultHasher::new();
        h.write_u64(self.0);
        h
    }
}

/// The markers of a whole migration, kept until their page is sent again.
#[derive(Default)]
pub(crate) struct Refs(pub Vec<(PageAt, PageAt)>);

impl Refs {
    pub fn add(&mut self, refs: &mut Vec<(PageAt, PageAt)>) {
        self.0.append(refs);
    }

    /// Adds to `dirty` every page copied from a dirty page (the destination's copy of it
    /// may be stale), then forgets the references of pages that will be sent again.
    pub fn follow(&mut self, dirty: &mut Bitmap) {
        for &(page, from) in &self.0 {
            if dirty.get(from.0, from.1) {
                dirty.set(page.0, page.1);
            }
        }
        self.0.retain(|&(page, _)| !dirty.get(page.0, page.1));
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crc_match_is_checked_byte_for_byte() {
        let mut mem = vec![0u8; 3 * PAGE_USIZE];
        mem[0] = 1;
        mem[PAGE_USIZE] = 1;
        mem[2 * PAGE_USIZE] = 2;
        let base = mem.as_mut_ptr();
        let host = |p: PageAt| base.wrapping_add(p.1 as usize * PAGE_USIZE);
        let mut d = Dedup::new();
        let mut page = PageBuf::new();
        page.0[0] = 1;
        assert_eq!(d.earlier((0, 0), 7, &page, host), None);
        assert_eq!(d.earlier((0, 0), 7, &page, host), None, "not itself");
        assert_eq!(d.earlier((0, 1), 7, &page, host), Some((0, 0)));
        // The same CRC (a collision) with other content is no match.
        let mut other = PageBuf::new();
        other.0[0] = 2;
        assert_eq!(d.earlier((0, 2), 7, &other, host), None);
        assert_eq!(d.refs, vec![((0, 1), (0, 0))]);
        d.new_round();
        assert_eq!(
            d.earlier((0, 1), 7, &page, host),
            None,
            "a new round forgets"
        );
    }

    #[test]
    fn pages_copied_from_a_dirty_page_are_sent_again() {
        let mut refs = Refs::default();
        refs.add(&mut vec![((0, 5), (0, 1)), ((0, 6), (0, 2))]);
        let mut dirty = Bitmap::new(&[16]);
        dirty.set(0, 1);
        refs.follow(&mut dirty);
        assert!(dirty.get(0, 5) && !dirty.get(0, 6));
        assert_eq!(refs.len(), 1, "page 5 goes again: its reference is gone");
    }
}
