//! Guest pages on the wire, without copies of the data.
//!
//! Sending: each page is inspected through a 4 KiB L1-resident scratch copy (zero check and
//! CRC-32), then queued **by reference**: the I/O vector handed to `writev` points into the
//! guest mapping, so the kernel copies the page straight from guest memory into the socket or
//! file. Only frame headers, CRC tables and trailers live in a small arena.
//!
//! Receiving: page data is read straight into the destination's guest mapping; `ZeroPages`
//! zero only pages that may hold data.

use std::io::{Read, Write};

use vm_memory::VolatileSlice;

use crate::bitmap::Bitmap;
use crate::compress::Compressor;
use crate::error::{Error, Result};
use crate::ram::{Layout, PAGE_SIZE, PAGE_USIZE};
use crate::resident::touched_in;
use crate::sink::Batch;
use crate::stream::{
    encode_compressed, page_crc, pages_frame_len, pages_head, CompressedPages, Frame, PagesHeader,
    StreamReader, StreamWriter, FRAME_HEADER_LEN, FRAME_TRAILER_LEN, MAX_PAGES_PER_FRAME,
    PAGES_FIXED_LEN, ZERO_PAGES_FRAME_LEN,
};

/// Largest run of pages one `ZeroPages` frame carries (4 GiB).
const MAX_ZERO_RUN: u32 = 1 << 20;

/// True if every byte of `data` is zero. Exits at the first non-zero 256-byte block; the
/// inner OR-reduction vectorizes.
pub fn is_zero(data: &[u8]) -> bool {
    let mut blocks = data.chunks_exact(256);
    let full = blocks
        .by_ref()
        .all(|b| b.iter().fold(0u8, |acc, &x| acc | x) == 0);
    full && blocks.remainder().iter().all(|&x| x == 0)
}

#[repr(C, align(64))]
pub(crate) struct PageBuf(pub [u8; PAGE_USIZE]);

impl PageBuf {
    pub fn new() -> Self {
        PageBuf([0; PAGE_USIZE])
    }
}

/// Reads a guest page through a scratch copy: `None` if it is all zero, else its CRC.
/// `ptr` must be a page of a region of a validated [`Layout`] ([`Layout::host_page`]).
pub(crate) fn inspect(ptr: *mut u8, buf: &mut PageBuf) -> Option<u32> {
    // SAFETY: callers pass a page inside a region of a validated `Layout`, which the
    // `GuestRam` contract keeps mapped and readable while the RAM is borrowed. Guest memory
    // may change under us (a running vCPU), which is why it is read as a volatile slice.
    let page = unsafe { VolatileSlice::new(ptr, PAGE_USIZE) };
    page.copy_to(&mut buf.0[..]);
    if is_zero(&buf.0) {
        None
    } else {
        Some(page_crc(&buf.0))
    }
}

/// What a round of pages put on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sent {
    /// Pages sent with data.
    pub pages: u64,
    /// Pages sent as zero markers.
    pub zero_pages: u64,
    /// Bytes of Pages and ZeroPages frames.
    pub bytes: u64,
}

impl Sent {
    pub fn add(&mut self, other: &Sent) {
        self.pages += other.pages;
        self.zero_pages += other.zero_pages;
        self.bytes += other.bytes;
    }
}

/// Sends every page set in `set` as `Pages` / `ZeroPages` frames, page data by reference to
/// the guest mapping. `live`: the guest runs (frames are flagged so torn pages are
/// tolerated). With `compressor`, page data is compressed whenever it chooses a codec, and
/// repeated pages go as markers. `tick` is called now and then with the number of pages
/// done so far. All queued data is flushed before returning, so no reference into guest
/// memory outlives the call.
pub(crate) fn send_pages<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    set: &Bitmap,
    live: bool,
    compressor: Option<&mut Compressor>,
    tick: &mut dyn FnMut(u64, &Sent),
) -> Result<Sent> {
    let mut tally = Tally {
        compressor,
        total: Sent::default(),
    };
    let mut runs = set_runs(layout, set);
    let res = send_pages_inner(w, layout, &mut runs, live, &mut tally, tick);
    // Whatever happened, no guest reference may stay queued past this point.
    let flushed = match res {
        Ok(()) => w.batch.flush_to(&mut w.out),
        Err(_) => Ok(()),
    };
    w.batch.clear();
    res.and(flushed).map(|_| tally.total)
}

/// What a connection's frames of a round put on the wire, and the compressor they go through.
struct Tally<'a> {
    compressor: Option<&'a mut Compressor>,
    total: Sent,
}

struct Group {
    zero: bool,
    region: usize,
    first: u64,
    count: u32,
    crcs: Vec<u32>,
}

/// The runs of `set`, region by region: (region, first page, count), inside the region.
pub(crate) fn set_runs<'a>(
    layout: &'a Layout,
    set: &'a Bitmap,
) -> impl Iterator<Item = (usize, u64, u64)> + 'a {
    layout.regions.iter().enumerate().flat_map(move |(ri, r)| {
        let npages = r.size / PAGE_SIZE;
        set.runs(ri, u64::MAX).filter_map(move |(start, count)| {
            let end = (start + count).min(npages);
            (end > start).then_some((ri, start, end - start))
        })
    })
}

/// Sends the pages of `runs` (region, first page, count; each inside its region) on one
/// connection, page data by reference, and flushes: no guest reference stays queued.
pub(crate) fn send_runs<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    runs: &[(usize, u64, u64)],
    live: bool,
    compressor: Option<&mut Compressor>,
) -> Result<Sent> {
    let mut tally = Tally {
        compressor,
        total: Sent::default(),
    };
    let mut it = runs.iter().copied();
    let res = send_pages_inner(w, layout, &mut it, live, &mut tally, &mut |_, _| {});
    let (bytes_before, time_before) = (w.out.bytes, w.out.write_time);
    let flushed = if res.is_ok() {
        w.batch.flush_to(&mut w.out)
    } else {
        Ok(())
    };
    w.batch.clear();
    // The link's speed as this connection sees it, for the automatic compression choice.
    if let Some(c) = tally.compressor {
        c.link(w.out.bytes - bytes_before, w.out.write_time - time_before);
    }
    res.and(flushed).map(|_| tally.total)
}

fn send_pages_inner<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    runs: &mut dyn Iterator<Item = (usize, u64, u64)>,
    live: bool,
    tally: &mut Tally<'_>,
    tick: &mut dyn FnMut(u64, &Sent),
) -> Result<()> {
    let mut buf = PageBuf::new();
    let mut done = 0u64;
    let mut g = Group {
        zero: false,
        region: 0,
        first: 0,
        count: 0,
        crcs: Vec::with_capacity(MAX_PAGES_PER_FRAME as usize),
    };
    let mut inspect_time = std::time::Duration::ZERO;
    let zero_page_crc = page_crc(&[0u8; PAGE_USIZE]);
    for (ri, start, count) in runs {
        let end = start + count;
        for p in start..end {
            let t = std::time::Instant::now();
            let mut crc = inspect(layout.host_page(ri, p), &mut buf);
            let same = match (crc, tally.compressor.as_deref_mut()) {
                (Some(c), Some(comp)) => comp
                    .dedup
                    .as_mut()
                    .and_then(|d| d.earlier((ri, p), c, &buf, |(r, q)| layout.host_page(r, q))),
                _ => None,
            };
            inspect_time += t.elapsed();
            if let (Some(from), Some(c)) = (same, crc) {
                emit(w, layout, &mut g, live, tally)?;
                send_same(w, layout, (ri, p), from, c, live, tally)?;
                done += 1;
                continue;
            }
            if crc.is_none()
                && tally
                    .compressor
                    .as_ref()
                    .is_some_and(|c| c.merges_zero_pages())
            {
                crc = Some(zero_page_crc);
            }
            let zero = crc.is_none();
            let full = g.count
                >= if g.zero {
                    MAX_ZERO_RUN
                } else {
                    MAX_PAGES_PER_FRAME
                };
            if g.count > 0
                && (g.zero != zero || g.region != ri || g.first + u64::from(g.count) != p || full)
            {
                emit(w, layout, &mut g, live, tally)?;
            }
            if g.count == 0 {
                g.zero = zero;
                g.region = ri;
                g.first = p;
            }
            g.count += 1;
            if let Some(c) = crc {
                g.crcs.push(c);
            }
            done += 1;
            if done.is_multiple_of(4096) {
                tick(done, &tally.total);
            }
        }
        // Runs are maximal, so the group cannot continue past a gap.
        emit(w, layout, &mut g, live, tally)?;
    }
    w.inspect_time += inspect_time;
    tick(done, &tally.total);
    Ok(())
}

fn emit<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    g: &mut Group,
    live: bool,
    tally: &mut Tally<'_>,
) -> Result<()> {
    if g.count == 0 {
        return Ok(());
    }
    let addr = layout.regions[g.region].guest_addr + g.first * PAGE_SIZE;
    let add = if g.zero {
        w.write_frame(&Frame::ZeroPages {
            addr,
            count: g.count,
        })?;
        Sent {
            pages: 0,
            zero_pages: u64::from(g.count),
            bytes: ZERO_PAGES_FRAME_LEN,
        }
    } else {
        let (bytes_before, time_before) = (w.out.bytes, w.out.write_time);
        let bytes = match compress_group(w, layout, g, addr, live, tally.compressor.as_deref_mut())?
        {
            Some(n) => n,
            None => {
                let trailer = pages_head(&mut w.batch, addr, live, &g.crcs);
                queue_guest_pages(&mut w.batch, layout, g.region, g.first, u64::from(g.count));
                w.batch.push_bytes(&trailer);
                pages_frame_len(u64::from(g.count))
            }
        };
        w.maybe_flush()?;
        if let Some(c) = tally.compressor.as_deref_mut() {
            c.link(w.out.bytes - bytes_before, w.out.write_time - time_before);
        }
        Sent {
            pages: u64::from(g.count),
            zero_pages: 0,
            bytes,
        }
    };
    tally.total.add(&add);
    g.count = 0;
    g.crcs.clear();
    Ok(())
}

/// Queues a `SamePage` frame: page `page` holds what `from` holds (sent earlier on this
/// connection).
fn send_same<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    page: (usize, u64),
    from: (usize, u64),
    crc: u32,
    live: bool,
    tally: &mut Tally<'_>,
) -> Result<()> {
    let addr_of = |(r, p): (usize, u64)| layout.regions[r].guest_addr + p * PAGE_SIZE;
    let bytes = w.write_frame(&Frame::SamePage {
        addr: addr_of(page),
        from: addr_of(from),
        crc,
        live,
    })?;
    tally.total.pages += 1;
    tally.total.bytes += bytes;
    Ok(())
}

/// Queues the pages of `g` as a `CompressedPages` frame if the compressor chooses a codec and
/// the data shrinks; returns the frame's length, or `None` to send them as `Pages`.
fn compress_group<W: Write>(
    w: &mut StreamWriter<W>,
    layout: &Layout,
    g: &Group,
    addr: u64,
    live: bool,
    compressor: Option<&mut Compressor>,
) -> Result<Option<u64>> {
    let Some(c) = compressor else {
        return Ok(None);
    };
    let Some(codec) = c.choose() else {
        return Ok(None);
    };
    c.raw.clear();
    c.raw.resize(g.count as usize * PAGE_USIZE, 0);
    let ptr = layout.host_page(g.region, g.first);
    // SAFETY: the group's pages lie inside one region of the validated layout (a live
    // mapping while the RAM is borrowed); a running vCPU may change them, hence the volatile
    // read, and the per-page CRC (computed earlier) then marks the page as torn.
    let pages = unsafe { VolatileSlice::new(ptr, c.raw.len()) };
    pages.copy_to(&mut c.raw[..]);
    if !c.compress(codec)? {
        return Ok(None);
    }
    let mut frame = Vec::with_capacity(c.packed.len() + 4 * g.crcs.len() + 32);
    let n = encode_compressed(addr, live, codec, &g.crcs, &c.packed, &mut frame)?;
    w.batch.push_bytes(&frame);
    c.compressed_raw += c.raw.len() as u64;
    c.compressed_bytes += n;
    Ok(Some(n))
}

/// Queues `count` guest pages from page `first` of region `region` on `batch`, by reference
/// to the guest mapping. The caller must flush or clear the batch before its borrow of the RAM
/// behind `layout` ends (`send_pages` and `snapshot_file` do, before they return).
pub(crate) fn queue_guest_pages(
    batch: &mut Batch,
    layout: &Layout,
    region: usize,
    first: u64,
    count: u64,
) {
    let npages = layout.regions[region].size / PAGE_SIZE;
    assert!(
        first < npages && count <= npages - first,
        "pages outside the region"
    );
    let ptr = layout.host_page(region, first);
    // SAFETY: the pages lie inside one region of the validated layout (checked above; a live
    // mapping while the RAM is borrowed, per the `GuestRam` contract), and the callers flush
    // or clear the batch before they return, while that borrow is still held.
    unsafe { batch.push_guest(ptr, count as usize * PAGE_USIZE) };
}

/// Faults in `len` bytes of fresh destination memory at `ptr` for writing, in one call
/// (`MADV_POPULATE_WRITE`, Linux 5.14+), before page data is read into it: the kernel then
/// copies from the socket into present pages instead of taking a fault per page in the middle
/// of the copy. Best effort: an older kernel (`EINVAL`) leaves the faults to the copy.
/// `FERROVM_MIGRATION_POPULATE=off` turns it off (to measure what it saves).
fn populate_for_write(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        use std::sync::OnceLock;
        static ENABLED: OnceLock<bool> = OnceLock::new();
        let enabled = *ENABLED.get_or_init(|| {
            std::env::var("FERROVM_MIGRATION_POPULATE").map_or(true, |v| v != "off")
        });
        if !enabled {
            return;
        }
        // MADV_POPULATE_WRITE wants a page-aligned start; guest pages are.
        // SAFETY: the range is guest RAM of the destination (a live, writable mapping that
        // no vCPU uses during the receive); populating it changes no byte of its contents.
        let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            log::debug!(
                "MADV_POPULATE_WRITE: {} (pages fault in during the copy)",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// The destination pages of one `Pages` frame, located and checked.
struct PagesTarget {
    region: usize,
    first: u64,
    ptr: *mut u8,
    /// Fresh memory: populate it before the data is read into it.
    populate: bool,
    populate_time: std::time::Duration,
}

impl PagesTarget {
    /// Reads the frame's page data straight into guest memory; returns the pages that
    /// failed their CRC (torn, in a live round).
    fn read<R: Read>(&mut self, reader: &mut StreamReader<R>, h: &PagesHeader) -> Result<Vec<u32>> {
        let len = h.count as usize * PAGE_USIZE;
        if self.populate {
            let t = std::time::Instant::now();
            populate_for_write(self.ptr, len);
            self.populate_time = t.elapsed();
        }
        // SAFETY: `begin_pages` located the pages inside one region, a live, writable mapping
        // (GuestRam contract, checked `writable`). The destination guest does not run while it
        // receives (contract of `receive`/`restore_from`), and the pages of one round are
        // sent once, on one connection, so nothing else accesses these bytes while the slice
        // exists; it is dropped before this function returns.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr, len) };
        reader.read_page_data(dst)
    }
}

/// Applies the `Pages` frame `h` from `reader` with an applier shared between connections:
/// the data is read into guest memory without holding the lock.
pub(crate) fn apply_pages_shared<R: Read>(
    applier: &std::sync::Mutex<PageApplier>,
    reader: &mut StreamReader<R>,
    h: &PagesHeader,
) -> Result<()> {
    let mut target = crate::lanes::lock(applier)?.begin_pages(h)?;
    let bad = target.read(reader, h)?;
    crate::lanes::lock(applier)?.end_pages(&target, h.count, bad);
    Ok(())
}

/// Applies a `CompressedPages` frame (read at byte `at`): decompresses it straight into
/// guest memory, without holding the lock, and checks each page's CRC.
pub(crate) fn apply_compressed(
    applier: &std::sync::Mutex<PageApplier>,
    c: &CompressedPages,
    at: u64,
) -> Result<()> {
    let count = c.crcs.len() as u32;
    let h = PagesHeader {
        addr: c.addr,
        count,
        live: c.live,
    };
    let mut target = crate::lanes::lock(applier)?.begin_pages(&h)?;
    let len = count as usize * PAGE_USIZE;
    if target.populate {
        let t = std::time::Instant::now();
        populate_for_write(target.ptr, len);
        target.populate_time = t.elapsed();
    }
    // SAFETY: as in `PagesTarget::read`: the pages lie inside one live, writable region, no
    // vCPU runs, and no other connection writes them in this round.
    let dst = unsafe { std::slice::from_raw_parts_mut(target.ptr, len) };
    c.codec
        .decompress(&c.data, dst)
        .map_err(|reason| Error::Malformed {
            kind: "CompressedPages",
            offset: at,
            reason: format!(
                "its {:?} data does not decompress to {count} pages: {reason}",
                c.codec
            ),
        })?;
    let mut bad = Vec::new();
    for (i, (page, &stored)) in dst.chunks_exact(PAGE_USIZE).zip(&c.crcs).enumerate() {
        let computed = page_crc(page);
        if computed == stored {
            continue;
        }
        if !c.live {
            return Err(Error::Checksum {
                what: format!(
                    "guest page {:#x} of the CompressedPages frame",
                    c.addr + i as u64 * PAGE_SIZE
                ),
                offset: at,
                stored,
                computed,
            });
        }
        bad.push(i as u32);
    }
    crate::lanes::lock(applier)?.end_pages(&target, count, bad);
    Ok(())
}

/// Wire length of a `CompressedPages` frame.
pub(crate) fn compressed_frame_len(c: &CompressedPages) -> u64 {
    (FRAME_HEADER_LEN + PAGES_FIXED_LEN + FRAME_TRAILER_LEN + 4 * c.crcs.len() + c.data.len())
        as u64
}

/// The receiving side: applies page frames to guest memory and keeps track of pages that
/// arrived torn during live rounds.
pub(crate) struct PageApplier {
    layout: Layout,
    /// Pages that may hold non-zero data (written by this stream, or resident before it).
    maybe_nonzero: Bitmap,
    /// Pages whose last copy failed its CRC in a live round and must be sent again.
    torn: Bitmap,
    torn_count: u64,
    pub torn_recovered: u64,
    /// Time spent populating and zeroing destination memory (stage timings).
    pub populate_time: std::time::Duration,
    pub zero_time: std::time::Duration,
}

// SAFETY: the raw pointers in the layout point into guest RAM, which `receive` borrows for
// as long as any connection's thread runs (the threads are joined before it returns); every
// access to the pointed-to pages goes through this applier's checks.
unsafe impl Send for PageApplier {}

impl PageApplier {
    /// An applier onto destination memory no vCPU uses: the pages found holding data
    /// beforehand (when residency is known exactly; nothing, for fresh memory) are zeroed at
    /// once, so pages the source never sends read as zero. Also returns how many were zeroed.
    pub fn onto_idle_ram(layout: Layout) -> Result<(Self, u64)> {
        let residency = touched_in(&layout, None);
        let preexisting = if residency.is_exact() {
            residency.pages
        } else {
            Bitmap::new(&layout.page_counts())
        };
        let zeroed = preexisting.count();
        let mut applier = PageApplier::new(layout, preexisting)?;
        applier.zero_all_maybe_nonzero();
        Ok((applier, zeroed))
    }

    /// `maybe_nonzero`: pages of the destination that may already hold data.
    fn new(layout: Layout, maybe_nonzero: Bitmap) -> Result<Self> {
        if let Some((i, r)) = layout.regions.iter().enumerate().find(|(_, r)| !r.writable) {
            return Err(Error::Layout(format!(
                "region {i} at {:#x} is mapped read-only: cannot receive guest memory into it",
                r.guest_addr
            )));
        }
        let counts = layout.page_counts();
        Ok(PageApplier {
            torn: Bitmap::new(&counts),
            maybe_nonzero,
            layout,
            torn_count: 0,
            torn_recovered: 0,
            populate_time: std::time::Duration::ZERO,
            zero_time: std::time::Duration::ZERO,
        })
    }

    fn locate(&self, addr: u64, count: u32) -> Result<(usize, u64)> {
        self.layout
            .locate(addr, u64::from(count))
            .map_err(|reason| Error::BadPageRange {
                addr,
                end: addr.saturating_add(u64::from(count) * PAGE_SIZE),
                count: u64::from(count),
                offset: 0,
                reason,
            })
    }

    fn set_torn(&mut self, ri: usize, p: u64, torn: bool) {
        let was = self.torn.get(ri, p);
        if torn && !was {
            self.torn.set(ri, p);
            self.torn_count += 1;
        } else if !torn && was {
            self.torn.clear(ri, p);
            self.torn_count -= 1;
            self.torn_recovered += 1;
        }
    }

    /// Where the pages of `h` go, checked against the RAM layout.
    fn begin_pages(&self, h: &PagesHeader) -> Result<PagesTarget> {
        let (region, first) = self.locate(h.addr, h.count)?;
        Ok(PagesTarget {
            region,
            first,
            ptr: self.layout.host_page(region, first),
            populate: !self.maybe_nonzero.get(region, first),
            populate_time: std::time::Duration::ZERO,
        })
    }

    /// Records the pages of a frame as written, and those that arrived torn.
    fn end_pages(&mut self, t: &PagesTarget, count: u32, bad: Vec<u32>) {
        self.populate_time += t.populate_time;
        let mut bad = bad.into_iter().peekable();
        for i in 0..u64::from(count) {
            self.maybe_nonzero.set(t.region, t.first + i);
            let torn = bad.next_if(|&b| u64::from(b) == i).is_some();
            self.set_torn(t.region, t.first + i, torn);
        }
    }

    /// Applies a `SamePage` frame (read at byte `at`): copies the page at `from`, which this
    /// stream must have sent with data, to `addr`, and checks the result against `crc`.
    /// A copy from a page that arrived torn, or that does not match, is torn too in a live
    /// round (the source sends it again) and an error otherwise.
    pub fn apply_same(
        &mut self,
        addr: u64,
        from: u64,
        crc: u32,
        live: bool,
        at: u64,
    ) -> Result<()> {
        let (ri, p) = self.locate(addr, 1)?;
        let (fi, fp) = self.locate(from, 1)?;
        if !self.maybe_nonzero.get(fi, fp) || (ri, p) == (fi, fp) {
            return Err(Error::Malformed {
                kind: "SamePage",
                offset: at,
                reason: format!(
                    "guest page {addr:#x} refers to guest page {from:#x}, which this stream \
                     has not sent with data"
                ),
            });
        }
        let (src, dst) = (self.layout.host_page(fi, fp), self.layout.host_page(ri, p));
        // SAFETY: both pages lie inside live, writable regions (checked by `locate`), they
        // differ (checked above), the destination guest does not run, and the applier's
        // lock is held; `from` was sent earlier on this connection in this round, or in an
        // earlier round, so no other connection writes it now (each page once per round).
        let page = unsafe {
            std::ptr::copy_nonoverlapping(src, dst, PAGE_USIZE);
            std::slice::from_raw_parts(dst.cast_const(), PAGE_USIZE)
        };
        let computed = page_crc(page);
        let torn = self.torn.get(fi, fp) || computed != crc;
        if torn && !live {
            return Err(Error::Checksum {
                what: format!("guest page {addr:#x} copied from {from:#x} by the SamePage frame"),
                offset: at,
                stored: crc,
                computed,
            });
        }
        self.maybe_nonzero.set(ri, p);
        self.set_torn(ri, p, torn);
        Ok(())
    }

    /// Zeroes the pages of a `ZeroPages` frame that may hold data.
    pub fn apply_zero(&mut self, addr: u64, count: u32) -> Result<()> {
        let (ri, first) = self.locate(addr, count)?;
        let t = std::time::Instant::now();
        for p in first..first + u64::from(count) {
            if self.maybe_nonzero.get(ri, p) {
                let ptr = self.layout.host_page(ri, p);
                // SAFETY: the page is inside a live, writable region (checked by `locate`),
                // and the destination guest is not running.
                unsafe { std::ptr::write_bytes(ptr, 0, PAGE_USIZE) };
                self.maybe_nonzero.clear(ri, p);
            }
            self.set_torn(ri, p, false);
        }
        self.zero_time += t.elapsed();
        Ok(())
    }

    /// Zeroes every page that may hold data (destination memory that was touched before the
    /// stream began).
    fn zero_all_maybe_nonzero(&mut self) {
        for ri in 0..self.layout.regions.len() {
            let runs: Vec<(u64, u64)> = self.maybe_nonzero.runs(ri, u64::MAX).collect();
            for (p, n) in runs {
                let n = n.min(self.layout.regions[ri].size / PAGE_SIZE - p);
                let ptr = self.layout.host_page(ri, p);
                // SAFETY: the run lies inside region `ri` (bitmap bits past the region are
                // cleared by `Bitmap::new`/`conform`; `n` is clamped), a live writable
                // mapping, and the destination guest is not running.
                unsafe { std::ptr::write_bytes(ptr, 0, n as usize * PAGE_USIZE) };
            }
        }
        self.maybe_nonzero = Bitmap::new(&self.layout.page_counts());
    }

    /// [`PageApplier::check_complete`], where the pages of `later` are still to come (post-copy).
    pub fn check_complete_except(&self, later: &Bitmap) -> Result<()> {
        let mut torn = self.torn.clone();
        for (t, l) in torn.regions_mut().iter_mut().zip(later.regions()) {
            for (tw, lw) in t.iter_mut().zip(l) {
                *tw &= !lw;
            }
        }
        match torn.count() {
            0 => Ok(()),
            count => Err(Error::TornPages {
                count,
                first_addr: 0,
            }),
        }
    }

    /// Fails if a page torn in a live round was never sent again.
    pub fn check_complete(&self) -> Result<()> {
        if self.torn_count == 0 {
            return Ok(());
        }
        let first_addr = (0..self.layout.regions.len())
            .find_map(|ri| {
                self.torn
                    .runs(ri, 1)
                    .next()
                    .map(|(p, _)| self.layout.regions[ri].guest_addr + p * PAGE_SIZE)
            })
            .unwrap_or(0);
        Err(Error::TornPages {
            count: self.torn_count,
            first_addr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; 4096];
        assert!(is_zero(&page));
        for i in [0, 1, 255, 256, 2047, 4095] {
            page[i] = 1;
            assert!(!is_zero(&page), "byte {i}");
            page[i] = 0;
        }
        assert!(is_zero(&[0u8; 10]));
        assert!(!is_zero(&[0, 0, 3]));
    }
}
