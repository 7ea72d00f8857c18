//! Repeated pages as markers: a page whose content already went out on the same connection
//! in the same round is sent as a `SamePage` frame naming that earlier page, and the
//! receiver copies it from there (docs/migration.md, "Repeated pages").
//!
//! A CRC-32 match only proposes a candidate: the two pages are compared byte for byte
//! before a marker is sent. The destination holds the earlier page as it was *sent*, which
//! may differ from what it holds now if the guest wrote it since (it is then dirty): every
//! marker is remembered as a reference, and a page is sent again whenever the page it was
//! copied from is (see [`Refs::follow`]).

use vm_memory::VolatileSlice;

use crate::bitmap::Bitmap;
use crate::pages::PageBuf;
use crate::ram::PAGE_USIZE;

/// A guest page: region index and page number in the region.
pub(crate) type PageAt = (usize, u64);

/// Slots of the table of pages seen (1 MiB per connection).
const SLOTS_LOG2: u32 = 16;
/// An empty slot (no region has this index).
const EMPTY: u32 = u32::MAX;

/// Pages seen on one connection in the current round, by CRC-32: a direct-mapped table (a
/// page whose slot is taken replaces the one there), so that the cost per page is one
/// multiplication and one memory access, with no allocation, whatever the guest writes; a
/// guest can make it miss, never make it slow.
pub(crate) struct Dedup {
    /// (CRC-32, region or `EMPTY`, page).
    seen: Vec<(u32, u32, u64)>,
    /// Odd multiplier of the slot hash, chosen per table (the CRCs are the guest's to choose).
    key: u32,
    scratch: PageBuf,
    /// Markers sent: (page, the page it was copied from).
    pub refs: Vec<(PageAt, PageAt)>,
}

impl Dedup {
    pub fn new() -> Self {
        Dedup {
            seen: vec![(0, EMPTY, 0); 1 << SLOTS_LOG2],
            key: table_key(),
            scratch: PageBuf::new(),
            refs: Vec::new(),
        }
    }

    /// Forgets the pages seen (a new round: a marker may only name a page of its round).
    pub fn new_round(&mut self) {
        self.seen.fill((0, EMPTY, 0));
    }

    fn slot(&self, crc: u32) -> usize {
        (crc.wrapping_mul(self.key) >> (32 - SLOTS_LOG2)) as usize
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
        let slot = self.slot(crc);
        let (seen_crc, region, p) = self.seen[slot];
        let other = (region as usize, p);
        if region == EMPTY || seen_crc != crc || other == page {
            // Regions are few (a u32 holds their index: `Layout` has at most a handful).
            self.seen[slot] = (crc, page.0 as u32, page.1);
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

/// An odd multiplier for the slot hash, different for each table.
fn table_key() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (nanos.wrapping_mul(0x9e37_79b9) ^ 0x85eb_ca6b) | 1
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
