//! Snapshot files (format version 2): guest memory as page-aligned, sparse images of the RAM
//! regions, which a restore can serve page by page as the guest touches them
//! ([`SnapshotImage::read_verified`]), or map over guest RAM (`MAP_PRIVATE`), instead of
//! reading it all first.
//!
//! ```text
//! byte 0  header (version 2) | Config | Images | DataPages* | State+ | End    framed, CRCs
//!         zero padding up to the next 2 MiB boundary                           (a hole)
//!         image of region 0: `size` bytes, page i = guest page i of the region  (sparse)
//!         image of region 1, from the next 2 MiB boundary ...
//! ```
//!
//! Pages without data are holes in the images: the file holds only the touched, non-zero
//! pages. The `DataPages` frames list every page that holds data with its CRC-32, so the page
//! data can be checked eagerly ([`SnapshotImage::verify`], [`SnapshotImage::load`]) or page
//! by page as it is needed ([`SnapshotImage::read_verified`]), while opening the file reads
//! nothing but the frames. The byte layout is in `docs/migration.md`.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::bitmap::Bitmap;
use crate::config::{ConfigCheck, MigrationConfig};
use crate::error::{Error, Result};
use crate::pages::{inspect, is_zero, queue_guest_pages, PageApplier, PageBuf};
use crate::precopy::{check_config_matches_ram, RoundStats, SnapshotReport};
use crate::ram::{locate_in, GuestRam, Layout, PAGE_SIZE, PAGE_USIZE};
use crate::resident::touched_in;
use crate::sink::{Batch, Out};
use crate::stream::{
    encode_data_pages, encode_frame, encode_header_version, images_frame_len, EndInfo, Frame,
    RegionImage, StreamReader, MAX_DATA_PAGES_PER_FRAME, MAX_IMAGE_REGIONS, MAX_STATE_TOTAL,
    SNAPSHOT_VERSION,
};

/// Alignment of each page image in the file, and of the first one after the frames. 4 KiB
/// would do for `mmap`; 2 MiB keeps the file offset and a huge-page-aligned guest mapping in
/// the same phase, and costs only holes.
pub const IMAGE_ALIGN: u64 = 2 << 20;

/// Pages read per `pread` when loading or verifying page data (4 MiB).
const CHUNK_PAGES: u64 = 1024;

/// A run of consecutive pages of one region that hold data; their CRCs are
/// `crcs[crc_at..crc_at + count]`.
#[derive(Clone, Copy, Debug)]
struct DataRun {
    region: usize,
    first: u64,
    count: u64,
    crc_at: usize,
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x / a * a)
}

/// Writes a snapshot of a **paused** VM to `file` in format version 2: the configuration, the
/// CRC table of the pages that hold data, and the state as frames from byte 0, then each RAM
/// region's memory as a sparse page image (only touched, non-zero pages are written; the
/// rest are holes). `file` must be a regular file open for writing; it is truncated first.
/// Page data goes from the guest mapping to the file with `writev`, without copies.
///
/// After a lazy restore, pass the RAM as [`crate::FileBackedRam`] so that pages still to come
/// from the old snapshot file (not present yet) are written too.
pub fn snapshot_file<G>(
    ram: &G,
    config: &MigrationConfig,
    state: &[u8],
    file: &File,
) -> Result<SnapshotReport>
where
    G: GuestRam + ?Sized,
{
    let layout = Layout::of(ram)?;
    check_config_matches_ram(config, &layout)?;
    if state.len() > MAX_STATE_TOTAL {
        return Err(Error::Param(format!(
            "the device/vCPU state is {} bytes, more than the {MAX_STATE_TOTAL} a snapshot carries",
            state.len()
        )));
    }
    if layout.regions.len() > MAX_IMAGE_REGIONS as usize {
        return Err(Error::Param(format!(
            "{} RAM regions, more than the {MAX_IMAGE_REGIONS} a snapshot file describes",
            layout.regions.len()
        )));
    }
    let t = Instant::now();
    let residency = touched_in(&layout, ram.file_data_pages().as_ref());
    let touched = residency.pages.count();

    // Which touched pages hold data, and their CRCs: each page is read once through a scratch
    // page here; the data itself goes from the guest mapping to the file below.
    let mut runs: Vec<DataRun> = Vec::new();
    let mut crcs: Vec<u32> = Vec::new();
    let mut zero_pages = 0u64;
    let mut buf = PageBuf::new();
    for (ri, r) in layout.regions.iter().enumerate() {
        let npages = r.size / PAGE_SIZE;
        for (start, count) in residency.pages.runs(ri, u64::MAX) {
            for p in start..(start + count).min(npages) {
                let Some(crc) = inspect(layout.host_page(ri, p), &mut buf) else {
                    zero_pages += 1;
                    continue;
                };
                match runs.last_mut() {
                    Some(run)
                        if run.region == ri
                            && run.first + run.count == p
                            && run.count < u64::from(MAX_DATA_PAGES_PER_FRAME) =>
                    {
                        run.count += 1
                    }
                    _ => runs.push(DataRun {
                        region: ri,
                        first: p,
                        count: 1,
                        crc_at: crcs.len(),
                    }),
                }
                crcs.push(crc);
            }
        }
    }
    let residency_method = residency.method;
    drop(residency);
    let data_pages = crcs.len() as u64;

    // The frames; their length decides where the images go.
    let mut head = encode_header_version(SNAPSHOT_VERSION).to_vec();
    head.extend(encode_frame(&Frame::Config(config.clone()))?);
    let mut tail = Vec::with_capacity(runs.len() * 28 + crcs.len() * 4 + state.len() + 64);
    for run in &runs {
        let addr = layout.regions[run.region].guest_addr + run.first * PAGE_SIZE;
        let c = &crcs[run.crc_at..run.crc_at + run.count as usize];
        encode_data_pages(addr, c, &mut tail)?;
    }
    tail.extend(encode_frame(&Frame::State(state.to_vec()))?);
    tail.extend(encode_frame(&Frame::End(EndInfo {
        rounds: 0,
        total_pages: data_pages,
        total_zero_pages: 0,
    }))?);
    let frames_len =
        head.len() as u64 + images_frame_len(layout.regions.len() as u64) + tail.len() as u64;
    let too_large = || Error::Param("the snapshot file would exceed 2^63 bytes".into());
    let mut images = Vec::with_capacity(layout.regions.len());
    let mut next = align_up(frames_len, IMAGE_ALIGN).ok_or_else(too_large)?;
    for r in &layout.regions {
        images.push(RegionImage {
            guest_addr: r.guest_addr,
            size: r.size,
            offset: next,
        });
        next = next
            .checked_add(r.size)
            .and_then(|e| align_up(e, IMAGE_ALIGN))
            .filter(|&e| i64::try_from(e).is_ok())
            .ok_or_else(too_large)?;
    }
    let file_len = images.last().map_or(frames_len, |i| i.offset + i.size);
    head.extend(encode_frame(&Frame::Images(images.clone()))?);
    debug_assert_eq!(head.len() as u64 + tail.len() as u64, frames_len);

    // Frames from byte 0, then each run of data pages at its place in its image, straight
    // from the guest mapping; everything else stays a hole.
    let io_err = |what: &'static str| move |e: io::Error| Error::io(what, e);
    file.set_len(0)
        .map_err(io_err("truncating the snapshot file"))?;
    let mut pos_file: &File = file;
    pos_file
        .seek(SeekFrom::Start(0))
        .map_err(io_err("seeking in the snapshot file"))?;
    let mut out = Out::new(file, None);
    let mut batch = Batch::new();
    batch.push_bytes(&head);
    batch.push_bytes(&tail);
    drop((head, tail));
    let mut pos = frames_len;
    let written = (|| {
        for run in &runs {
            let at = images[run.region].offset + run.first * PAGE_SIZE;
            if at != pos {
                batch.flush_to(&mut out)?;
                pos_file
                    .seek(SeekFrom::Start(at))
                    .map_err(io_err("seeking in the snapshot file"))?;
                pos = at;
            }
            queue_guest_pages(&mut batch, &layout, run.region, run.first, run.count);
            pos += run.count * PAGE_SIZE;
            if batch.is_full() {
                batch.flush_to(&mut out)?;
            }
        }
        batch.flush_to(&mut out)
    })();
    // No reference into guest memory stays queued past this point.
    batch.clear();
    written?;
    file.set_len(file_len)
        .map_err(io_err("setting the snapshot file's length"))?;
    let duration = t.elapsed();
    let total = layout.total_pages();
    Ok(SnapshotReport {
        round: RoundStats {
            index: 0,
            live: false,
            duration,
            pages_sent: data_pages,
            zero_pages,
            bytes_sent: data_pages * PAGE_SIZE,
            dirty_pages_found: touched,
            throttle_percent: 0,
        },
        bytes_total: out.bytes,
        file_bytes: file_len,
        touched_pages: touched,
        untouched_pages_skipped: total - touched.min(total),
        residency_method,
        state_bytes: state.len() as u64,
    })
}

/// Reads the header of a snapshot file from its start and returns its format version: 1, a
/// stream (restore it with [`crate::restore_from`]), or 2, page images (open it with
/// [`SnapshotImage::open`]). The file position is back at 0 afterwards.
pub fn snapshot_version(file: &File) -> Result<u32> {
    let mut f: &File = file;
    f.seek(SeekFrom::Start(0))
        .map_err(|e| Error::io("seeking in the snapshot file", e))?;
    let header = StreamReader::snapshot_file((&mut f).take(64)).read_header();
    f.seek(SeekFrom::Start(0))
        .map_err(|e| Error::io("seeking in the snapshot file", e))?;
    Ok(header?.version)
}

/// What [`SnapshotImage::load`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoadReport {
    /// Pages read into guest memory (and checked against their CRC).
    pub pages: u64,
    /// Pages of guest RAM that held data before and were zeroed.
    pub preexisting_pages_zeroed: u64,
    #[serde(rename = "duration_ms", serialize_with = "crate::precopy::ms")]
    pub duration: Duration,
}

/// What [`SnapshotImage::verify`] checked.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VerifyReport {
    /// Pages listed in the CRC table whose data matched.
    pub pages_checked: u64,
    /// Pages not listed that the file nevertheless stores (data extents, as `SEEK_DATA`
    /// reports them) and that were found to be zero.
    pub unlisted_pages_checked: u64,
    /// False when stopped before the end.
    pub complete: bool,
    #[serde(rename = "duration_ms", serialize_with = "crate::precopy::ms")]
    pub duration: Duration,
}

/// A version 2 snapshot file, opened and checked: header, configuration (against the
/// destination's), the page images' places, the CRC table, the state and the `End` totals,
/// and that the file is long enough to hold every image. Page data is not read here: see
/// [`SnapshotImage::verify`], [`SnapshotImage::load`] and [`SnapshotImage::map_into`].
#[derive(Debug)]
pub struct SnapshotImage {
    file: File,
    config: MigrationConfig,
    state: Vec<u8>,
    images: Vec<RegionImage>,
    runs: Vec<DataRun>,
    crcs: Vec<u32>,
    frames_len: u64,
}

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Config(_) => "Config",
        Frame::Pages(_) => "Pages",
        Frame::ZeroPages { .. } => "ZeroPages",
        Frame::RoundEnd(_) => "RoundEnd",
        Frame::State(_) => "State",
        Frame::End(_) => "End",
        Frame::Error(_) => "Error",
        Frame::Ready => "Ready",
        Frame::Ack => "Ack",
        Frame::Handover => "Handover",
        Frame::RoundAck(_) => "RoundAck",
        Frame::Images(_) => "Images",
        Frame::DataPages { .. } => "DataPages",
        Frame::Connections { .. } => "Connections",
        Frame::Postcopy(_) => "Postcopy",
        Frame::Join { .. } => "Join",
        Frame::CompressedPages(_) => "CompressedPages",
        Frame::SamePage { .. } => "SamePage",
    }
}

impl SnapshotImage {
    /// Opens a version 2 snapshot file and checks everything but the page data (a few
    /// hundred KiB of frames per GiB of data). `expected`: the destination's configuration.
    pub fn open(file: File, expected: &ConfigCheck) -> Result<Self> {
        let file_len = file
            .metadata()
            .map_err(|e| Error::io("reading the snapshot file's size", e))?
            .len();
        let mut start: &File = &file;
        start
            .seek(SeekFrom::Start(0))
            .map_err(|e| Error::io("seeking in the snapshot file", e))?;
        let mut reader = StreamReader::snapshot_file(BufReader::with_capacity(256 << 10, start));
        let header = reader.read_header()?;
        if header.version != SNAPSHOT_VERSION {
            return Err(Error::UnsupportedVersion {
                found: header.version,
                supported: "version 2 here (a version 1 snapshot is a stream: restore_from)",
            });
        }
        let protocol = |offset: u64, reason: String| Error::Protocol { offset, reason };
        let config = match reader.next_frame()? {
            Frame::Config(c) => c,
            other => {
                return Err(protocol(
                    reader.offset(),
                    format!(
                        "the snapshot starts with a {} frame instead of Config",
                        frame_name(&other)
                    ),
                ))
            }
        };
        config.check_against(expected)?;
        let ranges = config.ram_regions.clone();
        reader.set_ram_ranges(ranges.clone());
        let at = reader.offset();
        let images = match reader.next_frame()? {
            Frame::Images(i) => i,
            other => {
                return Err(protocol(
                    at,
                    format!(
                        "a {} frame where the Images frame belongs (after Config)",
                        frame_name(&other)
                    ),
                ))
            }
        };
        if images.len() != ranges.len()
            || images
                .iter()
                .zip(&ranges)
                .any(|(i, r)| i.guest_addr != r.guest_addr || i.size != r.size)
        {
            return Err(protocol(
                at,
                "the Images frame does not describe the configuration's RAM regions".into(),
            ));
        }
        let mut prev_end = 0u64;
        for i in &images {
            let end = i.offset.checked_add(i.size);
            if !i.offset.is_multiple_of(PAGE_SIZE)
                || i.offset < prev_end
                || end.is_none_or(|e| i64::try_from(e).is_err())
            {
                return Err(protocol(
                    at,
                    format!(
                        "the page image of the region at {:#x} is at byte {}: not 4 KiB aligned, overlapping, or past 2^63",
                        i.guest_addr, i.offset
                    ),
                ));
            }
            prev_end = end.unwrap_or(u64::MAX);
        }

        let mut runs: Vec<DataRun> = Vec::new();
        let mut crcs: Vec<u32> = Vec::new();
        let mut state: Vec<u8> = Vec::new();
        let mut state_frames = 0u32;
        let mut next_addr = 0u64;
        loop {
            let at = reader.offset();
            match reader.next_frame()? {
                Frame::DataPages { addr, crcs: c } => {
                    if state_frames > 0 {
                        return Err(protocol(at, "page CRCs after the device state".into()));
                    }
                    if addr < next_addr {
                        return Err(protocol(
                            at,
                            format!(
                                "pages from {addr:#x} listed out of order (after pages up to {next_addr:#x})"
                            ),
                        ));
                    }
                    let count = c.len() as u64;
                    // Checked by the reader already; this finds the region.
                    let (region, first) =
                        locate_in(&ranges, addr, count).map_err(|reason| Error::BadPageRange {
                            addr,
                            end: addr.saturating_add(count * PAGE_SIZE),
                            count,
                            offset: at,
                            reason,
                        })?;
                    next_addr = addr + count * PAGE_SIZE;
                    runs.push(DataRun {
                        region,
                        first,
                        count,
                        crc_at: crcs.len(),
                    });
                    crcs.extend(c);
                }
                Frame::State(piece) => {
                    if state.len() + piece.len() > MAX_STATE_TOTAL {
                        return Err(protocol(
                            at,
                            format!("the device state exceeds {MAX_STATE_TOTAL} bytes"),
                        ));
                    }
                    state.extend_from_slice(&piece);
                    state_frames += 1;
                }
                Frame::End(info) => {
                    if state_frames == 0 {
                        return Err(protocol(at, "End before the device state".into()));
                    }
                    let listed = crcs.len() as u64;
                    if (info.rounds, info.total_pages, info.total_zero_pages) != (0, listed, 0) {
                        return Err(protocol(
                            at,
                            format!(
                                "End announces {} rounds, {} pages, {} zero pages; a snapshot file has 0 rounds, {listed} pages listed, 0 zero pages",
                                info.rounds, info.total_pages, info.total_zero_pages
                            ),
                        ));
                    }
                    break;
                }
                Frame::Error(message) => {
                    return Err(Error::Peer {
                        peer: "source",
                        message,
                    })
                }
                other => {
                    return Err(protocol(
                        at,
                        format!(
                            "a {} frame in a version 2 snapshot file",
                            frame_name(&other)
                        ),
                    ))
                }
            }
        }
        let frames_len = reader.offset();
        drop(reader);
        for i in &images {
            if i.offset < frames_len {
                return Err(protocol(
                    frames_len,
                    format!(
                        "the page image of the region at {:#x} starts at byte {}, inside the frames",
                        i.guest_addr, i.offset
                    ),
                ));
            }
        }
        let image = SnapshotImage {
            file,
            config,
            state,
            images,
            runs,
            crcs,
            frames_len,
        };
        image.check_length(file_len)?;
        Ok(image)
    }

    /// Refuses a file that ends before the end of an image: those guest pages would lie past
    /// the end of the file (a `SIGBUS` when mapped, data lost when read).
    fn check_length(&self, file_len: u64) -> Result<()> {
        for i in &self.images {
            let end = i.offset + i.size;
            if file_len < end {
                return Err(Error::ShortImage {
                    file_len,
                    region_addr: i.guest_addr,
                    end,
                });
            }
        }
        Ok(())
    }

    /// The source's configuration (already checked against the destination's).
    pub fn config(&self) -> &MigrationConfig {
        &self.config
    }

    /// The device/vCPU state blob.
    pub fn state(&self) -> &[u8] {
        &self.state
    }

    /// Where each region's page image lies in the file.
    pub fn images(&self) -> &[RegionImage] {
        &self.images
    }

    /// Pages that hold data (listed in the CRC table).
    pub fn data_page_count(&self) -> u64 {
        self.crcs.len() as u64
    }

    /// Length of the frames at the start of the file.
    pub fn frames_len(&self) -> u64 {
        self.frames_len
    }

    /// The pages that hold data, one bitmap per region in `Config` order: what a lazily
    /// restored guest's RAM holds beyond its resident pages ([`crate::FileBackedRam`]).
    pub fn data_pages(&self) -> Bitmap {
        let counts: Vec<u64> = self.images.iter().map(|i| i.size / PAGE_SIZE).collect();
        let mut b = Bitmap::new(&counts);
        for run in &self.runs {
            b.set_range(run.region, run.first, run.count);
        }
        b
    }

    /// The runs of pages that hold data, as (region index, first page of the region, count),
    /// in file and guest address order.
    pub fn data_runs(&self) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        self.runs.iter().map(|r| (r.region, r.first, r.count))
    }

    /// Reads pages `first..first + n` of region `region` (`n` = `buf.len()` / 4096) as the
    /// guest must see them: each page that holds data is read from the file with `pread` and
    /// checked against its CRC; every other page is zero in `buf`, whatever the file stores
    /// there. Never touches guest memory, so a lazy restore can serve guest page faults
    /// with it. Fails, naming the first bad page, on a CRC mismatch, a page past the end of
    /// the file (truncated since [`SnapshotImage::open`]) or a read error; `buf` then holds
    /// nothing the guest may see.
    pub fn read_verified(&self, region: usize, first: u64, buf: &mut [u8]) -> Result<()> {
        let n = (buf.len() / PAGE_USIZE) as u64;
        let image = self
            .images
            .get(region)
            .ok_or_else(|| Error::Param(format!("no RAM region {region} in the snapshot")))?;
        if !buf.len().is_multiple_of(PAGE_USIZE) || first.saturating_add(n) > image.size / PAGE_SIZE
        {
            return Err(Error::Param(format!(
                "pages {first}..+{n} are not inside the RAM region at {:#x}",
                image.guest_addr
            )));
        }
        buf.fill(0);
        let end = first + n;
        let start = self
            .runs
            .partition_point(|r| (r.region, r.first + r.count) <= (region, first));
        for run in self.runs[start..]
            .iter()
            .take_while(|r| r.region == region && r.first < end)
        {
            let from = run.first.max(first);
            let to = (run.first + run.count).min(end);
            let data = &mut buf
                [((from - first) * PAGE_SIZE) as usize..((to - first) * PAGE_SIZE) as usize];
            self.read_pages_at(data, image, from)?;
            self.check_pages(run, from, data)?;
        }
        Ok(())
    }

    /// Reads the data of pages `page..` of `image` into `buf`; a read that ends early names
    /// the first page past the end of the file.
    fn read_pages_at(&self, buf: &mut [u8], image: &RegionImage, page: u64) -> Result<()> {
        let at = image.offset + page * PAGE_SIZE;
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], at + done as u64) {
                Ok(0) => {
                    let offset = at + (done / PAGE_USIZE * PAGE_USIZE) as u64;
                    return Err(Error::PagePastEnd {
                        addr: image.guest_addr + (offset - image.offset),
                        offset,
                        file_len: self.file.metadata().map_or(0, |m| m.len()),
                    });
                }
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let offset = at + (done / PAGE_USIZE * PAGE_USIZE) as u64;
                    return Err(Error::io(
                        format!(
                            "reading guest page {:#x} from the snapshot file (byte {offset})",
                            image.guest_addr + (offset - image.offset)
                        ),
                        e,
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_layout(&self, layout: &Layout) -> Result<()> {
        let ranges = layout.ranges();
        if ranges.len() != self.images.len()
            || ranges
                .iter()
                .zip(&self.images)
                .any(|(r, i)| r.guest_addr != i.guest_addr || r.size != i.size)
        {
            return Err(Error::Param(format!(
                "the guest RAM ({}) is not the snapshot's ({})",
                ranges
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                self.config
                    .ram_regions
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if let Some((i, r)) = layout.regions.iter().enumerate().find(|(_, r)| !r.writable) {
            return Err(Error::Layout(format!(
                "region {i} at {:#x} is mapped read-only: cannot restore guest memory into it",
                r.guest_addr
            )));
        }
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], at: u64, image: &RegionImage) -> Result<()> {
        self.file.read_exact_at(buf, at).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::ShortImage {
                    file_len: self.file.metadata().map_or(0, |m| m.len()),
                    region_addr: image.guest_addr,
                    end: image.offset + image.size,
                }
            } else {
                Error::io(
                    format!("reading the snapshot file's page data at byte {at}"),
                    e,
                )
            }
        })
    }

    fn check_pages(&self, run: &DataRun, page: u64, data: &[u8]) -> Result<()> {
        let image = &self.images[run.region];
        for (i, p) in data.chunks_exact(PAGE_USIZE).enumerate() {
            let pi = page + i as u64;
            let stored = self.crcs[run.crc_at + (pi - run.first) as usize];
            let computed = crc32fast::hash(p);
            if stored != computed {
                return Err(Error::PageCorrupt {
                    addr: image.guest_addr + pi * PAGE_SIZE,
                    offset: image.offset + pi * PAGE_SIZE,
                    stored,
                    computed,
                });
            }
        }
        Ok(())
    }

    /// Eager restore: reads every page that holds data into `ram` and checks it against its
    /// CRC. Pages of `ram` that held data before are zeroed first (nothing, for fresh
    /// memory); the others are left alone (zero). Afterwards the guest does not depend on the
    /// file any more.
    ///
    /// `ram` must not be in use by running vCPUs during the call.
    pub fn load<G: GuestRam + ?Sized>(&self, ram: &G) -> Result<LoadReport> {
        let t = Instant::now();
        let layout = Layout::of(ram)?;
        self.check_layout(&layout)?;
        let (_, preexisting_pages_zeroed) = PageApplier::onto_idle_ram(layout.clone())?;
        for run in &self.runs {
            let image = &self.images[run.region];
            let mut done = 0;
            while done < run.count {
                let n = (run.count - done).min(CHUNK_PAGES);
                let page = run.first + done;
                let ptr = layout.host_page(run.region, page);
                // SAFETY: `page..page + n` lies inside region `run.region` (the run was
                // checked against the configuration's regions, which `check_layout` found
                // equal to the RAM's), a live, writable mapping by the `GuestRam` contract
                // (`writable` checked). No vCPU uses the memory during the call (this
                // function's contract), so nothing else accesses these bytes while the slice
                // exists; it is dropped before the next iteration.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr, n as usize * PAGE_USIZE) };
                self.read_at(dst, image.offset + page * PAGE_SIZE, image)?;
                self.check_pages(run, page, dst)?;
                done += n;
            }
        }
        Ok(LoadReport {
            pages: self.data_page_count(),
            preexisting_pages_zeroed,
            duration: t.elapsed(),
        })
    }

    /// Lazy restore: maps each region's page image over the region's host mapping
    /// (`MAP_PRIVATE | MAP_FIXED`, same address, length and protection), so guest pages are
    /// read from the file (through the page cache) when first touched, and a write copies the
    /// page privately: nothing ever reaches the file. Page data is not checked here: run
    /// [`SnapshotImage::verify`] before or alongside.
    ///
    /// Requirements (not checkable here):
    /// - the hypervisor follows changes of the host mapping behind a memory slot (KVM does,
    ///   through its MMU notifier). Not bhyve: there guest memory is the VM's own memory
    ///   object mapped at that address, and a file mapping would hide it from the VMM;
    /// - `ram` is not in use by running vCPUs during the call;
    /// - the file is not modified or truncated for as long as the mapping lives (a truncated
    ///   file makes accesses past its new end fault with `SIGBUS`). Deleting or renaming it
    ///   is fine: the mapping holds the file.
    ///
    /// Afterwards hand the RAM to [`crate::migrate`] and [`crate::snapshot_file`] as
    /// [`crate::FileBackedRam`] with [`SnapshotImage::data_pages`]: untouched pages of the
    /// mapping are not resident, yet hold data. On error the RAM may be left partly replaced
    /// (or, where the kernel failed after removing the old mapping, unmapped): do not run the
    /// guest then.
    pub fn map_into<G: GuestRam + ?Sized>(&self, ram: &G) -> Result<()> {
        let layout = Layout::of(ram)?;
        self.check_layout(&layout)?;
        // The file may have changed since `open`.
        let len = self
            .file
            .metadata()
            .map_err(|e| Error::io("reading the snapshot file's size", e))?
            .len();
        self.check_length(len)?;
        for (r, image) in layout.regions.iter().zip(&self.images) {
            let offset = libc::off_t::try_from(image.offset)
                .map_err(|_| Error::Param(format!("image offset {} is too large", image.offset)))?;
            #[cfg(target_os = "linux")]
            let flags = libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE;
            #[cfg(not(target_os = "linux"))]
            let flags = libc::MAP_PRIVATE | libc::MAP_FIXED;
            // SAFETY: `host_ptr..host_ptr + size` is exactly one region of guest RAM, a live
            // mapping owned by `ram` for as long as it is borrowed (`GuestRam` contract;
            // page-aligned, checked by `Layout`). MAP_FIXED replaces it in place with a
            // mapping of the same length and the same protection (read and write), so every
            // address that was valid stays valid and writable; only the contents change, as
            // if every page were written, which this function's contract allows because no
            // vCPU or thread uses the memory during the call (and this crate hands out no
            // Rust references into guest memory). Every page of the new mapping lies inside
            // the file (`check_length` just above), so no access faults with SIGBUS unless
            // the file is truncated later, which the contract forbids. MAP_PRIVATE: writes
            // never reach the file.
            let got = unsafe {
                libc::mmap(
                    r.host_ptr.cast(),
                    r.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    self.file.as_raw_fd(),
                    offset,
                )
            };
            if got == libc::MAP_FAILED {
                return Err(Error::io(
                    format!(
                        "mapping the page image of the RAM region at {:#x} over guest memory",
                        r.guest_addr
                    ),
                    io::Error::last_os_error(),
                ));
            }
            if got.cast::<u8>() != r.host_ptr {
                return Err(Error::Layout(format!(
                    "the page image of the region at {:#x} was mapped at {got:p}, not at {:p}",
                    r.guest_addr, r.host_ptr
                )));
            }
        }
        Ok(())
    }

    /// Checks all page data: every listed page against its CRC, and every other page the
    /// file stores (its data extents, found with `SEEK_DATA` / `SEEK_HOLE`) for zeroes, so a
    /// page the guest would read differently from the snapshot cannot pass. Reads the file
    /// with `pread`, never through a mapping, so it can run while a lazily restored guest
    /// runs (the file is never written). Checks `stop` between 4 MiB chunks and returns
    /// early, with `complete: false`, once it is set.
    pub fn verify(&self, stop: &AtomicBool) -> Result<VerifyReport> {
        let t = Instant::now();
        let mut report = VerifyReport::default();
        let mut buf = vec![0u8; CHUNK_PAGES as usize * PAGE_USIZE];
        for run in &self.runs {
            let image = &self.images[run.region];
            let mut done = 0;
            while done < run.count {
                if stop.load(Ordering::Relaxed) {
                    report.duration = t.elapsed();
                    return Ok(report);
                }
                let n = (run.count - done).min(CHUNK_PAGES);
                let page = run.first + done;
                let data = &mut buf[..n as usize * PAGE_USIZE];
                self.read_at(data, image.offset + page * PAGE_SIZE, image)?;
                self.check_pages(run, page, data)?;
                report.pages_checked += n;
                done += n;
            }
        }
        // Whatever else the images store must be zero.
        let listed = self.data_pages();
        for (ri, image) in self.images.iter().enumerate() {
            let end = image.offset + image.size;
            for (from, to) in data_extents(&self.file, image.offset, end)? {
                let first = (from - image.offset) / PAGE_SIZE;
                let last = (to - image.offset).div_ceil(PAGE_SIZE);
                for (p, n) in unlisted_runs(&listed, ri, first, last) {
                    let mut done = 0;
                    while done < n {
                        if stop.load(Ordering::Relaxed) {
                            report.duration = t.elapsed();
                            return Ok(report);
                        }
                        let k = (n - done).min(CHUNK_PAGES);
                        let page = p + done;
                        let at = image.offset + page * PAGE_SIZE;
                        let data = &mut buf[..k as usize * PAGE_USIZE];
                        self.read_at(data, at, image)?;
                        if let Some(i) = data.chunks_exact(PAGE_USIZE).position(|d| !is_zero(d)) {
                            return Err(Error::UnlistedData {
                                addr: image.guest_addr + (page + i as u64) * PAGE_SIZE,
                                offset: at + i as u64 * PAGE_SIZE,
                            });
                        }
                        report.unlisted_pages_checked += k;
                        done += k;
                    }
                }
            }
        }
        report.complete = true;
        report.duration = t.elapsed();
        Ok(report)
    }
}

/// Runs of pages in `first..last` of region `region` that are not set in `listed`.
fn unlisted_runs(listed: &Bitmap, region: usize, first: u64, last: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for p in first..last {
        if listed.get(region, p) {
            continue;
        }
        match out.last_mut() {
            Some((s, n)) if *s + *n == p => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

/// The byte ranges of `from..to` where `file` stores data (`SEEK_DATA` / `SEEK_HOLE`); all
/// of it where the file system cannot tell.
fn data_extents(file: &File, from: u64, to: u64) -> Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let data = match seek_to(file, pos, libc::SEEK_DATA) {
            Ok(Some(d)) => d,
            Ok(None) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(vec![(pos, to)]),
            Err(e) => return Err(Error::io("looking for data in the snapshot file", e)),
        };
        if data >= to {
            break;
        }
        let hole = seek_to(file, data, libc::SEEK_HOLE)
            .map_err(|e| Error::io("looking for holes in the snapshot file", e))?
            .unwrap_or(to)
            .min(to);
        out.push((data, hole.max(data + 1)));
        pos = hole.max(data + 1);
    }
    Ok(out)
}

/// `lseek(2)` with `whence`; `None` for ENXIO (no data, or no hole, at or after `offset`).
fn seek_to(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let off = libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset too large"))?;
    // SAFETY: lseek on a descriptor `file` owns, open for the whole call; it only moves the
    // file position, which nothing else relies on (page data is read with pread).
    let r = unsafe { libc::lseek(file.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(Some(r as u64))
}
