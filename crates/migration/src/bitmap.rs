//! Page bitmaps: one bit per 4 KiB page, one vector of 64-bit words per RAM region, in the
//! same layout as KVM's dirty log (bit `i` of word `w` is page `w * 64 + i` of the region).

/// One bit per guest page, per RAM region (in the [`crate::GuestRam::regions`] order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    regions: Vec<Vec<u64>>,
}

/// Number of 64-bit words needed for `pages` bits.
pub fn words_for(pages: u64) -> usize {
    pages.div_ceil(64) as usize
}

impl Bitmap {
    /// An empty bitmap for regions of the given page counts.
    pub fn new(region_pages: &[u64]) -> Self {
        Bitmap {
            regions: region_pages
                .iter()
                .map(|&p| vec![0; words_for(p)])
                .collect(),
        }
    }

    /// A bitmap with every page of every region set.
    pub fn full(region_pages: &[u64]) -> Self {
        let mut b = Self::new(region_pages);
        for (words, &pages) in b.regions.iter_mut().zip(region_pages) {
            words.fill(u64::MAX);
            clear_tail(words, pages);
        }
        b
    }

    /// Wraps per-region word vectors, e.g. KVM dirty logs (one per memory slot, in slot
    /// order).
    pub fn from_words(regions: Vec<Vec<u64>>) -> Self {
        Bitmap { regions }
    }

    /// The per-region words.
    pub fn regions(&self) -> &[Vec<u64>] {
        &self.regions
    }

    /// Mutable per-region words.
    pub fn regions_mut(&mut self) -> &mut [Vec<u64>] {
        &mut self.regions
    }

    pub fn set(&mut self, region: usize, page: u64) {
        if let Some(w) = self
            .regions
            .get_mut(region)
            .and_then(|r| r.get_mut((page / 64) as usize))
        {
            *w |= 1 << (page % 64);
        }
    }

    pub fn clear(&mut self, region: usize, page: u64) {
        if let Some(w) = self
            .regions
            .get_mut(region)
            .and_then(|r| r.get_mut((page / 64) as usize))
        {
            *w &= !(1 << (page % 64));
        }
    }

    pub fn get(&self, region: usize, page: u64) -> bool {
        self.regions
            .get(region)
            .and_then(|r| r.get((page / 64) as usize))
            .is_some_and(|w| w & (1 << (page % 64)) != 0)
    }

    /// Sets `count` pages from `page` (bits beyond the region's words are ignored).
    pub fn set_range(&mut self, region: usize, page: u64, count: u64) {
        for p in page..page.saturating_add(count) {
            self.set(region, p);
        }
    }

    /// Number of set bits.
    pub fn count(&self) -> u64 {
        self.regions
            .iter()
            .flatten()
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.iter().flatten().all(|&w| w == 0)
    }

    /// ORs `other` into `self` (regions and words missing on either side are ignored).
    pub fn union_with(&mut self, other: &Bitmap) {
        for (a, b) in self.regions.iter_mut().zip(&other.regions) {
            for (x, y) in a.iter_mut().zip(b) {
                *x |= *y;
            }
        }
    }

    /// Checks this bitmap has one entry per region with enough words, and clears the bits
    /// past the end of each region.
    pub(crate) fn conform(&mut self, region_pages: &[u64]) -> Result<(), String> {
        if self.regions.len() != region_pages.len() {
            return Err(format!(
                "the dirty bitmap has {} regions, guest RAM has {}",
                self.regions.len(),
                region_pages.len()
            ));
        }
        for (i, (words, &pages)) in self.regions.iter_mut().zip(region_pages).enumerate() {
            let need = words_for(pages);
            if words.len() < need {
                return Err(format!(
                    "the dirty bitmap of region {i} has {} words, {pages} pages need {need}",
                    words.len()
                ));
            }
            words.truncate(need);
            clear_tail(words, pages);
        }
        Ok(())
    }

    /// Runs of consecutive set pages of one region, as (first page, count), each at most
    /// `max_run` long.
    pub fn runs(&self, region: usize, max_run: u64) -> Runs<'_> {
        self.runs_from(region, 0, max_run)
    }

    /// [`Bitmap::runs`] from page `from` on.
    pub fn runs_from(&self, region: usize, from: u64, max_run: u64) -> Runs<'_> {
        Runs {
            words: self.regions.get(region).map_or(&[][..], |v| &v[..]),
            pos: from,
            max_run: max_run.max(1),
        }
    }
}

fn clear_tail(words: &mut [u64], pages: u64) {
    let rem = pages % 64;
    if rem != 0 {
        if let Some(last) = words.get_mut((pages / 64) as usize) {
            *last &= (1u64 << rem) - 1;
        }
    }
    for w in words.iter_mut().skip(words_for(pages)) {
        *w = 0;
    }
}

/// Iterator over runs of set bits.
pub struct Runs<'a> {
    words: &'a [u64],
    pos: u64,
    max_run: u64,
}

impl Runs<'_> {
    fn bit(&self, p: u64) -> bool {
        self.words
            .get((p / 64) as usize)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }
}

impl Iterator for Runs<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        let nbits = self.words.len() as u64 * 64;
        // Find the next set bit, a word at a time.
        let mut p = self.pos;
        loop {
            if p >= nbits {
                self.pos = nbits;
                return None;
            }
            let w = self.words[(p / 64) as usize] >> (p % 64);
            if w != 0 {
                p += u64::from(w.trailing_zeros());
                break;
            }
            p = (p / 64 + 1) * 64;
        }
        let start = p;
        // Extend the run, a word at a time where possible.
        let mut end = start + 1;
        while end < nbits && end - start < self.max_run {
            if end.is_multiple_of(64) && end - start + 64 <= self.max_run {
                let w = self.words[(end / 64) as usize];
                if w == u64::MAX {
                    end += 64;
                    continue;
                }
            }
            if !self.bit(end) {
                break;
            }
            end += 1;
        }
        self.pos = end;
        Some((start, end - start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_and_cap() {
        let mut b = Bitmap::new(&[300]);
        b.set_range(0, 3, 5);
        b.set_range(0, 60, 140);
        b.set(0, 299);
        let runs: Vec<_> = b.runs(0, 64).collect();
        assert_eq!(runs, vec![(3, 5), (60, 64), (124, 64), (188, 12), (299, 1)]);
        assert_eq!(b.count(), 146);
        let all: Vec<_> = Bitmap::full(&[130]).runs(0, 1000).collect();
        assert_eq!(all, vec![(0, 130)]);
        // From the middle of a run, and past the last.
        let from: Vec<_> = b.runs_from(0, 100, 64).collect();
        assert_eq!(from, vec![(100, 64), (164, 36), (299, 1)]);
        assert_eq!(b.runs_from(0, 300, 64).next(), None);
    }

    #[test]
    fn conform_checks_shape() {
        let mut b = Bitmap::from_words(vec![vec![u64::MAX; 3]]);
        b.conform(&[70]).unwrap();
        assert_eq!(b.count(), 70);
        assert!(Bitmap::from_words(vec![vec![0; 1]]).conform(&[70]).is_err());
        assert!(Bitmap::from_words(vec![]).conform(&[70]).is_err());
    }
}
