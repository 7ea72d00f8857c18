//! The migration stream: a header, then checksummed frames. The byte layout is documented in
//! `docs/migration.md`; in short:
//!
//! ```text
//! header  "FERROVM\0" | version u32 | flags u32 | crc32 u32                (20 bytes, LE)
//! frame   kind u8 | flags u8 | reserved [u8;2] | length u32 | payload | crc32 u32
//! ```
//!
//! The frame CRC covers the 8 header bytes and the payload, except for `Pages` frames whose
//! page data (the last `count * 4096` payload bytes) is covered by a per-page CRC table in the
//! payload instead, so that a page torn by a running guest costs that one page, not the frame.
//!
//! Version 1 is the migration stream (and the snapshot written by [`crate::snapshot`]).
//! Version 2 is the snapshot *file* ([`crate::snapshot_file`]): the same header and framing,
//! with `Images` and `DataPages` frames describing page data that lies outside the frames, in
//! page-aligned images of the RAM regions (see `image.rs`).

use std::io::{self, Read, Write};

use serde::Serialize;

use crate::compress::Codec;
use crate::config::MigrationConfig;
use crate::error::{Error, Result};
use crate::ram::{locate_in, RamRange, PAGE_SIZE, PAGE_USIZE};
use crate::sink::{Batch, Out};

/// The first 8 bytes of every stream.
pub const MAGIC: [u8; 8] = *b"FERROVM\0";
/// The format version of migration streams (and of snapshots written as a stream by
/// [`crate::snapshot`]). A migration stream is always written as version 1, so that builds
/// which read version 1 only can still receive from this one.
pub const FORMAT_VERSION: u32 = 1;
/// The format version of snapshot files with page images ([`crate::snapshot_file`]): version 1
/// framing plus the `Images` and `DataPages` frames, page data outside the frames.
pub const SNAPSHOT_VERSION: u32 = 2;
/// Most RAM regions an `Images` frame may describe.
pub const MAX_IMAGE_REGIONS: u32 = 1024;
/// Pages per `DataPages` frame written by this build (readers accept up to what fits in
/// [`MAX_FRAME_PAYLOAD`]): 256 KiB of CRCs.
pub const MAX_DATA_PAGES_PER_FRAME: u32 = 65536;
/// Length of the stream header.
pub const HEADER_LEN: usize = 20;
/// Length of a frame header (kind, flags, reserved, length).
pub const FRAME_HEADER_LEN: usize = 8;
/// Length of a frame trailer (CRC-32).
pub const FRAME_TRAILER_LEN: usize = 4;
/// Largest payload of any frame. Longer frames are refused before anything is allocated.
pub const MAX_FRAME_PAYLOAD: u32 = 8 << 20;
/// Pages per `Pages` frame written by this build (readers accept up to what fits in
/// [`MAX_FRAME_PAYLOAD`]).
pub const MAX_PAGES_PER_FRAME: u32 = 1024;
/// Fixed part of a `Pages` / `ZeroPages` payload: address u64, count u32, reserved u32.
pub const PAGES_FIXED_LEN: usize = 16;
/// `Pages` frame flag: sent while the guest was running; a page whose CRC does not match may
/// have been torn by a guest write and must be sent again later in the stream.
pub const FLAG_LIVE: u8 = 1;
/// Most data connections a migration may open besides its control connection.
pub const MAX_DATA_CONNECTIONS: u32 = 15;
/// Largest total device/vCPU state accepted (the sum of all `State` frames).
pub const MAX_STATE_TOTAL: usize = 256 << 20;

const MAX_CONFIG_LEN: u32 = 1 << 20;
const MAX_ERROR_LEN: u32 = 64 << 10;
const ROUND_END_LEN: u32 = 48;
const END_LEN: u32 = 24;
const SAME_PAGE_LEN: u32 = 24;
/// Wire length of a `SamePage` frame.
pub const SAME_PAGE_FRAME_LEN: u64 = (FRAME_HEADER_LEN + FRAME_TRAILER_LEN) as u64 + 24;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Config = 1,
    Pages = 2,
    ZeroPages = 3,
    RoundEnd = 4,
    State = 5,
    End = 6,
    Error = 7,
    /// Reply: the destination accepted the `Config` frame.
    Ready = 8,
    /// Reply: the destination is running the guest.
    Ack = 9,
    /// Reply: the destination has applied a live round (payload: round number u32).
    RoundAck = 10,
    /// Version 2 snapshot files: where the page image of each RAM region lies in the file.
    Images = 11,
    /// Version 2 snapshot files: a run of pages of an image that hold data, with their CRCs.
    DataPages = 12,
    /// Reply: the destination has applied the final state and asks the source to let go of
    /// what it must take over (disk image locks) before it runs the guest.
    Handover = 13,
    /// Control connection, right after `Config`: `count` data connections join this
    /// migration (each opens with `Join` carrying the same token); pages are striped over
    /// them and the control connection.
    Connections = 14,
    /// First frame of a data connection: the migration's token and the connection's index.
    Join = 15,
    /// A run of pages with data, compressed (LZ4 or zstd), with each page's CRC-32.
    CompressedPages = 16,
    /// A page with the same content as a page sent before on the same connection: the
    /// receiver copies it from there (and checks its CRC-32).
    SamePage = 17,
    /// Control connection, in place of the final round: the source switches to post-copy
    /// (payload: see `crate::postcopy::Switch`). Numbered apart from the pre-copy kinds.
    Postcopy = 32,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Config,
            2 => Kind::Pages,
            3 => Kind::ZeroPages,
            4 => Kind::RoundEnd,
            5 => Kind::State,
            6 => Kind::End,
            7 => Kind::Error,
            8 => Kind::Ready,
            9 => Kind::Ack,
            10 => Kind::RoundAck,
            11 => Kind::Images,
            12 => Kind::DataPages,
            13 => Kind::Handover,
            14 => Kind::Connections,
            15 => Kind::Join,
            16 => Kind::CompressedPages,
            17 => Kind::SamePage,
            32 => Kind::Postcopy,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Config => "Config",
            Kind::Pages => "Pages",
            Kind::ZeroPages => "ZeroPages",
            Kind::RoundEnd => "RoundEnd",
            Kind::State => "State",
            Kind::End => "End",
            Kind::Error => "Error",
            Kind::Ready => "Ready",
            Kind::Ack => "Ack",
            Kind::RoundAck => "RoundAck",
            Kind::Images => "Images",
            Kind::DataPages => "DataPages",
            Kind::Handover => "Handover",
            Kind::Connections => "Connections",
            Kind::Join => "Join",
            Kind::CompressedPages => "CompressedPages",
            Kind::SamePage => "SamePage",
            Kind::Postcopy => "Postcopy",
        }
    }

    fn max_len(self) -> u32 {
        match self {
            Kind::Config => MAX_CONFIG_LEN,
            Kind::Pages
            | Kind::State
            | Kind::DataPages
            | Kind::CompressedPages
            | Kind::Postcopy => MAX_FRAME_PAYLOAD,
            Kind::Images => IMAGES_FIXED_LEN + IMAGE_ENTRY_LEN * MAX_IMAGE_REGIONS,
            Kind::ZeroPages | Kind::Connections | Kind::Join => PAGES_FIXED_LEN as u32,
            Kind::RoundEnd => ROUND_END_LEN,
            Kind::SamePage => SAME_PAGE_LEN,
            Kind::End => END_LEN,
            Kind::Error => MAX_ERROR_LEN,
            Kind::Ready | Kind::Ack | Kind::Handover => 0,
            Kind::RoundAck => 4,
        }
    }

    /// Fixed payload length, for kinds that have one.
    fn fixed_len(self) -> Option<u32> {
        match self {
            Kind::ZeroPages | Kind::Connections | Kind::Join => Some(PAGES_FIXED_LEN as u32),
            Kind::RoundEnd => Some(ROUND_END_LEN),
            Kind::SamePage => Some(SAME_PAGE_LEN),
            Kind::End => Some(END_LEN),
            Kind::Ready | Kind::Ack | Kind::Handover => Some(0),
            Kind::RoundAck => Some(4),
            _ => None,
        }
    }

    fn is_reply(self) -> bool {
        matches!(
            self,
            Kind::Ready | Kind::Ack | Kind::RoundAck | Kind::Handover | Kind::Error
        )
    }

    fn is_stream(self) -> bool {
        !matches!(
            self,
            Kind::Ready | Kind::Ack | Kind::RoundAck | Kind::Handover
        )
    }

    /// Kinds that only version 2 (snapshot files) has.
    fn needs_version_2(self) -> bool {
        matches!(self, Kind::Images | Kind::DataPages)
    }
}

const IMAGES_FIXED_LEN: u32 = 8;
const IMAGE_ENTRY_LEN: u32 = 24;

/// Where the page image of one RAM region lies in a version 2 snapshot file: `size` bytes
/// from byte `offset` (4 KiB aligned) of the file are the region's memory, page for page;
/// pages without data are zero (holes, in a sparse file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RegionImage {
    pub guest_addr: u64,
    pub size: u64,
    pub offset: u64,
}

/// The stream header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub flags: u32,
}

/// The fixed part of a `Pages` frame. Its data is read with [`StreamReader::read_page_data`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagesHeader {
    /// Guest address of the first page.
    pub addr: u64,
    /// Number of pages.
    pub count: u32,
    /// Sent while the guest ran (see [`FLAG_LIVE`]).
    pub live: bool,
}

/// End of a round of pages, with the sender's statistics of that round.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RoundEndInfo {
    /// Round number: 0, 1, 2... consecutive.
    pub round: u32,
    /// The final (stop-and-copy) round: the guest was paused.
    pub final_round: bool,
    /// Pages sent with data in this round.
    pub pages: u64,
    /// Pages sent as `ZeroPages` in this round.
    pub zero_pages: u64,
    /// Bytes of the `Pages` and `ZeroPages` frames of this round.
    pub bytes: u64,
    /// Dirty (or, for round 0, touched) pages this round set out to send.
    pub dirty_pages_found: u64,
    /// Sender's duration of the round in microseconds.
    pub duration_us: u64,
}

/// The sender's totals, in the `End` frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EndInfo {
    /// Number of rounds (RoundEnd frames) sent.
    pub rounds: u32,
    /// Pages sent with data, over all rounds.
    pub total_pages: u64,
    /// Pages sent as `ZeroPages`, over all rounds.
    pub total_zero_pages: u64,
}

/// A decoded, validated frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Config(MigrationConfig),
    /// A run of pages; the data follows and must be read with
    /// [`StreamReader::read_page_data`] (or is skipped by the next `next_frame`).
    Pages(PagesHeader),
    /// A run of pages that are all zero.
    ZeroPages {
        addr: u64,
        count: u32,
    },
    RoundEnd(RoundEndInfo),
    /// A piece of the opaque device/vCPU state; consecutive pieces concatenate.
    State(Vec<u8>),
    End(EndInfo),
    /// A message from the peer, which gave up.
    Error(String),
    /// Reply channel: configuration accepted.
    Ready,
    /// Reply channel: the destination runs the guest.
    Ack,
    /// Reply channel: the destination applied the final state; the source lets go of its
    /// disk image locks so that the destination can take them before it runs the guest.
    Handover,
    /// Reply channel: the destination has applied live round `n` (the source waits for it
    /// before the next round, so rounds are measured end to end and nothing is still in
    /// flight when the guest is paused).
    RoundAck(u32),
    /// Snapshot files (version 2): the page image of each RAM region, in `Config` order.
    Images(Vec<RegionImage>),
    /// Snapshot files (version 2): `crcs.len()` consecutive pages from `addr` hold data in
    /// their image; one CRC-32 per page.
    DataPages {
        addr: u64,
        crcs: Vec<u32>,
    },
    /// Control connection: `count` data connections carry pages too (see [`Kind::Connections`]).
    Connections {
        count: u32,
        token: u64,
    },
    /// Opens a data connection: connection `index` (1..=count) of the migration `token`.
    Join {
        token: u64,
        index: u32,
    },
    /// `crcs.len()` consecutive pages from `addr`, compressed with `codec` into `data`.
    CompressedPages(CompressedPages),
    /// The page at `addr` holds what the page at `from` received earlier on this
    /// connection; `crc` is the CRC-32 of its content. `live`: see [`FLAG_LIVE`].
    SamePage {
        addr: u64,
        from: u64,
        crc: u32,
        live: bool,
    },
    /// Control connection: the switch to post-copy, its payload still encoded (decoded
    /// against the guest's RAM layout by the receiver).
    Postcopy(Vec<u8>),
}

/// A decoded `CompressedPages` frame (see [`Frame::CompressedPages`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressedPages {
    pub addr: u64,
    /// Sent while the guest ran (see [`FLAG_LIVE`]).
    pub live: bool,
    pub codec: Codec,
    pub crcs: Vec<u32>,
    pub data: Vec<u8>,
}

/// Most pages one `CompressedPages` frame may hold (8 MiB once decompressed).
pub const MAX_COMPRESSED_PAGES: u32 = 2048;

/// Appends a `CompressedPages` frame to `out`; returns its wire length.
pub(crate) fn encode_compressed(
    addr: u64,
    live: bool,
    codec: Codec,
    crcs: &[u32],
    data: &[u8],
    out: &mut Vec<u8>,
) -> Result<u64> {
    let len = PAGES_FIXED_LEN + 4 * crcs.len() + data.len();
    if crcs.is_empty()
        || crcs.len() > MAX_COMPRESSED_PAGES as usize
        || len > MAX_FRAME_PAYLOAD as usize
    {
        return Err(Error::Param(format!(
            "a CompressedPages frame of {} pages and {} bytes does not fit a frame",
            crcs.len(),
            data.len()
        )));
    }
    let h = frame_header(
        Kind::CompressedPages,
        if live { FLAG_LIVE } else { 0 },
        len as u32,
    );
    let start = out.len();
    out.extend_from_slice(&h);
    out.extend_from_slice(&addr.to_le_bytes());
    out.extend_from_slice(&(crcs.len() as u32).to_le_bytes());
    out.extend_from_slice(&[codec as u8, 0, 0, 0]);
    for c in crcs {
        out.extend_from_slice(&c.to_le_bytes());
    }
    out.extend_from_slice(data);
    let c = crc(&[&out[start..]]);
    out.extend_from_slice(&c.to_le_bytes());
    Ok((out.len() - start) as u64)
}

fn crc(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

/// CRC-32 of one page.
pub fn page_crc(page: &[u8]) -> u32 {
    crc32fast::hash(page)
}

pub(crate) fn encode_header() -> [u8; HEADER_LEN] {
    encode_header_version(FORMAT_VERSION)
}

pub(crate) fn encode_header_version(version: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&0u32.to_le_bytes());
    let c = crc(&[&h[..16]]);
    h[16..20].copy_from_slice(&c.to_le_bytes());
    h
}

fn frame_header(kind: Kind, flags: u8, len: u32) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0] = kind as u8;
    h[1] = flags;
    h[4..8].copy_from_slice(&len.to_le_bytes());
    h
}

/// Appends one complete frame (not `Pages`) to `out`.
fn encode_simple(kind: Kind, payload: &[u8], out: &mut Vec<u8>) {
    let h = frame_header(kind, 0, payload.len() as u32);
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    out.extend_from_slice(&crc(&[&h, payload]).to_le_bytes());
}

fn zero_pages_payload(addr: u64, count: u32) -> [u8; PAGES_FIXED_LEN] {
    let mut p = [0u8; PAGES_FIXED_LEN];
    p[..8].copy_from_slice(&addr.to_le_bytes());
    p[8..12].copy_from_slice(&count.to_le_bytes());
    p
}

/// Encodes a frame other than `Pages` (a `State` blob larger than a frame becomes several
/// frames).
pub fn encode_frame(frame: &Frame) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    match frame {
        Frame::Config(c) => {
            let json = serde_json::to_vec(c)
                .map_err(|e| Error::Param(format!("configuration to JSON: {e}")))?;
            if json.len() > MAX_CONFIG_LEN as usize {
                return Err(Error::Param(format!(
                    "the configuration is {} bytes of JSON, more than {MAX_CONFIG_LEN}",
                    json.len()
                )));
            }
            encode_simple(Kind::Config, &json, &mut out);
        }
        Frame::Pages(_) => {
            return Err(Error::Param(
                "Pages frames are written with write_pages, not encode_frame".into(),
            ))
        }
        Frame::ZeroPages { addr, count } => encode_simple(
            Kind::ZeroPages,
            &zero_pages_payload(*addr, *count),
            &mut out,
        ),
        Frame::RoundEnd(r) => {
            let mut p = Vec::with_capacity(ROUND_END_LEN as usize);
            p.extend_from_slice(&r.round.to_le_bytes());
            p.extend_from_slice(&u32::from(r.final_round).to_le_bytes());
            for v in [
                r.pages,
                r.zero_pages,
                r.bytes,
                r.dirty_pages_found,
                r.duration_us,
            ] {
                p.extend_from_slice(&v.to_le_bytes());
            }
            encode_simple(Kind::RoundEnd, &p, &mut out);
        }
        Frame::State(s) => {
            if s.len() > MAX_STATE_TOTAL {
                return Err(Error::Param(format!(
                    "the device/vCPU state is {} bytes, more than the {MAX_STATE_TOTAL} a stream may carry",
                    s.len()
                )));
            }
            if s.is_empty() {
                encode_simple(Kind::State, &[], &mut out);
            }
            for chunk in s.chunks(MAX_FRAME_PAYLOAD as usize) {
                encode_simple(Kind::State, chunk, &mut out);
            }
        }
        Frame::End(e) => {
            let mut p = Vec::with_capacity(END_LEN as usize);
            p.extend_from_slice(&e.rounds.to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            p.extend_from_slice(&e.total_pages.to_le_bytes());
            p.extend_from_slice(&e.total_zero_pages.to_le_bytes());
            encode_simple(Kind::End, &p, &mut out);
        }
        Frame::Postcopy(p) => {
            if p.len() > MAX_FRAME_PAYLOAD as usize {
                return Err(Error::Param(format!(
                    "the post-copy switch is {} bytes, more than a frame carries",
                    p.len()
                )));
            }
            encode_simple(Kind::Postcopy, p, &mut out);
        }
        Frame::Error(msg) => {
            let mut m = msg.as_bytes();
            if m.len() > MAX_ERROR_LEN as usize {
                let mut cut = MAX_ERROR_LEN as usize;
                while !msg.is_char_boundary(cut) {
                    cut -= 1;
                }
                m = &m[..cut];
            }
            encode_simple(Kind::Error, m, &mut out);
        }
        Frame::Ready => encode_simple(Kind::Ready, &[], &mut out),
        Frame::Ack => encode_simple(Kind::Ack, &[], &mut out),
        Frame::Handover => encode_simple(Kind::Handover, &[], &mut out),
        Frame::RoundAck(n) => encode_simple(Kind::RoundAck, &n.to_le_bytes(), &mut out),
        Frame::Images(images) => {
            if images.is_empty() || images.len() > MAX_IMAGE_REGIONS as usize {
                return Err(Error::Param(format!(
                    "an Images frame describes 1 to {MAX_IMAGE_REGIONS} regions, not {}",
                    images.len()
                )));
            }
            let mut p = Vec::with_capacity(8 + 24 * images.len());
            p.extend_from_slice(&(images.len() as u32).to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            for i in images {
                for v in [i.guest_addr, i.size, i.offset] {
                    p.extend_from_slice(&v.to_le_bytes());
                }
            }
            encode_simple(Kind::Images, &p, &mut out);
        }
        Frame::DataPages { addr, crcs } => encode_data_pages(*addr, crcs, &mut out)?,
        Frame::CompressedPages(c) => {
            encode_compressed(c.addr, c.live, c.codec, &c.crcs, &c.data, &mut out)?;
        }
        Frame::Connections { count, token } => {
            let mut p = [0u8; PAGES_FIXED_LEN];
            p[..4].copy_from_slice(&count.to_le_bytes());
            p[8..].copy_from_slice(&token.to_le_bytes());
            encode_simple(Kind::Connections, &p, &mut out);
        }
        Frame::SamePage {
            addr,
            from,
            crc: page,
            live,
        } => {
            let mut p = [0u8; SAME_PAGE_LEN as usize];
            p[..8].copy_from_slice(&addr.to_le_bytes());
            p[8..16].copy_from_slice(&from.to_le_bytes());
            p[16..20].copy_from_slice(&page.to_le_bytes());
            let h = frame_header(Kind::SamePage, if *live { FLAG_LIVE } else { 0 }, 24);
            out.extend_from_slice(&h);
            out.extend_from_slice(&p);
            out.extend_from_slice(&crc(&[&h, &p]).to_le_bytes());
        }
        Frame::Join { token, index } => {
            let mut p = [0u8; PAGES_FIXED_LEN];
            p[..8].copy_from_slice(&token.to_le_bytes());
            p[8..12].copy_from_slice(&index.to_le_bytes());
            encode_simple(Kind::Join, &p, &mut out);
        }
    }
    Ok(out)
}

/// Appends a `DataPages` frame for `crcs.len()` pages from `addr` to `out`.
pub(crate) fn encode_data_pages(addr: u64, crcs: &[u32], out: &mut Vec<u8>) -> Result<()> {
    let max = (MAX_FRAME_PAYLOAD as usize - PAGES_FIXED_LEN) / 4;
    if crcs.is_empty() || crcs.len() > max {
        return Err(Error::Param(format!(
            "a DataPages frame lists 1 to {max} pages, not {}",
            crcs.len()
        )));
    }
    let mut p = Vec::with_capacity(PAGES_FIXED_LEN + 4 * crcs.len());
    p.extend_from_slice(&zero_pages_payload(addr, crcs.len() as u32));
    for c in crcs {
        p.extend_from_slice(&c.to_le_bytes());
    }
    encode_simple(Kind::DataPages, &p, out);
    Ok(())
}

/// Wire size of an `Images` frame of `regions` regions.
pub(crate) fn images_frame_len(regions: u64) -> u64 {
    (FRAME_HEADER_LEN + FRAME_TRAILER_LEN) as u64
        + u64::from(IMAGES_FIXED_LEN)
        + u64::from(IMAGE_ENTRY_LEN) * regions
}

/// Queues the head of a `Pages` frame (frame header, address, count, CRC table) and returns
/// the trailer to queue after the data.
pub(crate) fn pages_head(
    batch: &mut Batch,
    addr: u64,
    live: bool,
    crcs: &[u32],
) -> [u8; FRAME_TRAILER_LEN] {
    let count = crcs.len() as u32;
    let len = PAGES_FIXED_LEN as u32 + count * (4 + PAGE_SIZE as u32);
    let h = frame_header(Kind::Pages, if live { FLAG_LIVE } else { 0 }, len);
    let fixed = zero_pages_payload(addr, count);
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&h);
    hasher.update(&fixed);
    batch.push_bytes(&h);
    batch.push_bytes(&fixed);
    let mut table = [0u8; 4 * MAX_PAGES_PER_FRAME as usize];
    for (i, c) in crcs.iter().enumerate() {
        table[i * 4..i * 4 + 4].copy_from_slice(&c.to_le_bytes());
    }
    let table = &table[..crcs.len() * 4];
    hasher.update(table);
    batch.push_bytes(table);
    hasher.finalize().to_le_bytes()
}

/// Wire size of a `Pages` frame of `count` pages.
pub fn pages_frame_len(count: u64) -> u64 {
    (FRAME_HEADER_LEN + PAGES_FIXED_LEN + FRAME_TRAILER_LEN) as u64 + count * (4 + PAGE_SIZE)
}

/// Wire size of a `ZeroPages` frame.
pub const ZERO_PAGES_FRAME_LEN: u64 =
    (FRAME_HEADER_LEN + PAGES_FIXED_LEN + FRAME_TRAILER_LEN) as u64;

/// Read-ahead buffer of a migration connection's reader. Frame headers are read through it;
/// page data larger than it goes from the socket straight into guest memory, and only what
/// was read ahead together with a header is copied out of it (a few KiB per 1 MiB frame; a
/// 256 KiB buffer copied a quarter of all page data once more).
pub(crate) const CONNECTION_READ_AHEAD: usize = 16 << 10;

/// Writes a stream (or reply channel) over any [`Write`]. Frames are gathered and written
/// with `write_vectored`; call [`StreamWriter::flush`] to push them out.
pub struct StreamWriter<W: Write> {
    pub(crate) out: Out<W>,
    pub(crate) batch: Batch,
    /// Time spent reading pages to send (zero check and CRC), for the stage timings.
    pub(crate) inspect_time: std::time::Duration,
}

impl<W: Write> StreamWriter<W> {
    pub fn new(inner: W) -> Self {
        Self::with_max_bandwidth(inner, None)
    }

    /// A writer that sends at most `bytes_per_s` bytes per second (token bucket).
    pub fn with_max_bandwidth(inner: W, bytes_per_s: Option<u64>) -> Self {
        StreamWriter {
            out: Out::new(inner, bytes_per_s),
            batch: Batch::new(),
            inspect_time: std::time::Duration::ZERO,
        }
    }

    pub(crate) fn maybe_flush(&mut self) -> Result<()> {
        if self.batch.is_full() {
            self.batch.flush_to(&mut self.out)?;
        }
        Ok(())
    }

    /// Queues the stream header.
    pub fn write_header(&mut self) -> Result<()> {
        self.batch.push_bytes(&encode_header());
        self.maybe_flush()
    }

    /// Queues a frame (not `Pages`: see [`StreamWriter::write_pages`]); returns its size.
    pub fn write_frame(&mut self, frame: &Frame) -> Result<u64> {
        let bytes = encode_frame(frame)?;
        self.batch.push_bytes(&bytes);
        self.maybe_flush()?;
        Ok(bytes.len() as u64)
    }

    /// Queues `Pages` frames for `data` (whole pages) at guest address `addr`, copying the
    /// data. Guest memory is sent without copies by the engine; this is for tools and tests.
    pub fn write_pages(&mut self, addr: u64, data: &[u8], live: bool) -> Result<u64> {
        if data.is_empty()
            || !data.len().is_multiple_of(PAGE_USIZE)
            || !addr.is_multiple_of(PAGE_SIZE)
        {
            return Err(Error::Param(format!(
                "write_pages needs whole, aligned pages (address {addr:#x}, {} bytes)",
                data.len()
            )));
        }
        let mut total = 0;
        let per = MAX_PAGES_PER_FRAME as usize * PAGE_USIZE;
        for (i, chunk) in data.chunks(per).enumerate() {
            let crcs: Vec<u32> = chunk.chunks(PAGE_USIZE).map(page_crc).collect();
            let a = addr + (i * per) as u64;
            let trailer = pages_head(&mut self.batch, a, live, &crcs);
            self.batch.push_bytes(chunk);
            self.batch.push_bytes(&trailer);
            total += pages_frame_len(crcs.len() as u64);
            self.maybe_flush()?;
        }
        Ok(total)
    }

    /// Writes everything queued and flushes the writer.
    pub fn flush(&mut self) -> Result<()> {
        self.batch.flush_to(&mut self.out)?;
        self.out.flush()
    }

    /// Bytes written to the underlying writer so far.
    pub fn bytes_written(&self) -> u64 {
        self.out.bytes
    }

    /// Drops anything queued and returns the writer.
    pub fn into_inner(self) -> W {
        self.out.inner
    }
}

/// Writes one reply frame (`Ready`, `Ack` or `Error`) and flushes.
pub fn send_reply<W: Write>(w: &mut W, frame: &Frame) -> Result<()> {
    let bytes = encode_frame(frame)?;
    w.write_all(&bytes)
        .and_then(|_| w.flush())
        .map_err(|e| Error::io("sending a reply to the source", e))
}

/// Waits for the destination's final acknowledgement on the reply channel. An `Error` frame
/// becomes [`Error::Peer`]; end of file or a read timeout (set one on the socket) is an
/// error too.
pub fn wait_ack<R: Read>(reader: &mut R) -> Result<()> {
    wait_reply(reader, &Frame::Ack)
}

/// Reads one reply frame and checks it is `want`.
pub(crate) fn wait_reply<R: Read>(reader: &mut R, want: &Frame) -> Result<()> {
    let what = match want {
        Frame::Ack => "its acknowledgement".to_string(),
        Frame::Handover => "applying the final state".to_string(),
        Frame::Ready => "accepting the configuration".to_string(),
        Frame::RoundAck(n) => format!("acknowledging round {n}"),
        other => format!("{other:?}"),
    };
    match read_reply(reader, &what)? {
        f if f == *want => Ok(()),
        f => Err(Error::Protocol {
            offset: 0,
            reason: format!("the destination replied {f:?} instead of {what}"),
        }),
    }
}

/// Reads the destination's next reply, waited for as `what`; an `Error` reply is the
/// destination's refusal ([`Error::Peer`]).
pub(crate) fn read_reply<R: Read>(reader: &mut R, what: &str) -> Result<Frame> {
    let mut r = StreamReader::replies(reader);
    match r.next_frame() {
        Ok(Frame::Error(message)) => Err(Error::Peer {
            peer: "destination",
            message,
        }),
        Ok(f) => Ok(f),
        Err(Error::EndedEarly { .. }) => Err(Error::Vmm(format!(
            "the destination closed the connection before {what}"
        ))),
        Err(Error::Io { source, .. }) => Err(Error::io(
            format!("waiting for the destination {what}"),
            source,
        )),
        Err(e) => Err(e),
    }
}

struct Pending {
    offset: u64,
    addr: u64,
    count: u32,
    live: bool,
    crcs: Vec<u32>,
    hasher: crc32fast::Hasher,
}

/// Reads and validates a stream (or a reply channel) from any [`Read`]. Wrap sockets and
/// files in a `BufReader`: frames are read with small reads.
pub struct StreamReader<R: Read> {
    inner: R,
    offset: u64,
    replies: bool,
    /// Highest format version accepted: 1 for migration streams, 2 for snapshot files.
    max_version: u32,
    header: Option<Header>,
    ranges: Option<Vec<RamRange>>,
    pending: Option<Pending>,
    /// Time spent reading page data and checking its CRCs (stage timings).
    pub(crate) page_read_time: std::time::Duration,
    pub(crate) crc_time: std::time::Duration,
}

impl<R: Read> StreamReader<R> {
    /// A reader of a migration stream (header first; version 1).
    pub fn new(inner: R) -> Self {
        StreamReader {
            inner,
            offset: 0,
            replies: false,
            max_version: FORMAT_VERSION,
            header: None,
            ranges: None,
            pending: None,
            page_read_time: std::time::Duration::ZERO,
            crc_time: std::time::Duration::ZERO,
        }
    }

    /// A reader of a snapshot file: version 1 (a stream) or 2 (page images outside the
    /// frames; the reader then stops at the `End` frame, before the images).
    pub fn snapshot_file(inner: R) -> Self {
        StreamReader {
            max_version: SNAPSHOT_VERSION,
            ..Self::new(inner)
        }
    }

    /// The header, once read.
    pub fn header(&self) -> Option<Header> {
        self.header
    }

    /// A reader of the reply channel (no header; only `Ready`, `Ack` and `Error`).
    pub fn replies(inner: R) -> Self {
        StreamReader {
            replies: true,
            ..Self::new(inner)
        }
    }

    /// Sets the guest RAM that page frames must fall in. Until this is called, page frames
    /// are refused.
    pub fn set_ram_ranges(&mut self, ranges: Vec<RamRange>) {
        self.ranges = Some(ranges);
    }

    /// Bytes consumed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn into_inner(self) -> R {
        self.inner
    }

    fn fill(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.inner.read(&mut buf[done..]) {
                Ok(0) => {
                    return Err(Error::Truncated {
                        what: what(),
                        offset: self.offset,
                    })
                }
                Ok(n) => {
                    done += n;
                    self.offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("reading the migration stream at byte {}", self.offset),
                        e,
                    ))
                }
            }
        }
        Ok(())
    }

    /// For a reader that starts after the header (read on another reader of the same
    /// connection): a version 1 stream.
    pub(crate) fn assume_header_read(&mut self) {
        self.header = Some(Header {
            version: FORMAT_VERSION,
            flags: 0,
        });
    }

    /// Reads and checks the stream header (done by the first `next_frame` if not called).
    pub fn read_header(&mut self) -> Result<Header> {
        if let Some(h) = self.header {
            return Ok(h);
        }
        let mut h = [0u8; HEADER_LEN];
        let what = || "the stream header".to_string();
        self.fill(&mut h[..8], &what)?;
        if h[..8] != MAGIC {
            let mut found = [0u8; 8];
            found.copy_from_slice(&h[..8]);
            return Err(Error::BadMagic { found });
        }
        self.fill(&mut h[8..12], &what)?;
        let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if version == 0 || version > self.max_version {
            return Err(Error::UnsupportedVersion {
                found: version,
                supported: if self.max_version == FORMAT_VERSION {
                    "version 1 only in a migration stream (version 2 is a snapshot file with page images)"
                } else {
                    "versions 1 and 2"
                },
            });
        }
        self.fill(&mut h[12..20], &what)?;
        let stored = u32::from_le_bytes([h[16], h[17], h[18], h[19]]);
        let computed = crc(&[&h[..16]]);
        if stored != computed {
            return Err(Error::Checksum {
                what: "the stream header".into(),
                offset: 0,
                stored,
                computed,
            });
        }
        let flags = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        if flags != 0 {
            return Err(Error::UnknownHeaderFlags { flags });
        }
        let header = Header { version, flags };
        self.header = Some(header);
        Ok(header)
    }

    /// Reads the next frame, validating its kind, length, checksum and fields. After a
    /// `Pages` frame, call [`StreamReader::read_page_data`]; otherwise the data is read,
    /// checked and discarded by the next call.
    pub fn next_frame(&mut self) -> Result<Frame> {
        if !self.replies && self.header.is_none() {
            self.read_header()?;
        }
        if self.pending.is_some() {
            self.skip_page_data()?;
        }
        let start = self.offset;
        let mut h = [0u8; FRAME_HEADER_LEN];
        // A clean end of file between frames is reported as such.
        loop {
            match self.inner.read(&mut h[..1]) {
                Ok(0) => return Err(Error::EndedEarly { offset: start }),
                Ok(_) => {
                    self.offset += 1;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("reading the migration stream at byte {start}"),
                        e,
                    ))
                }
            }
        }
        self.fill(&mut h[1..], &|| format!("the frame header at byte {start}"))?;
        let kind = Kind::from_u8(h[0])
            .filter(|k| {
                if self.replies {
                    k.is_reply()
                } else {
                    k.is_stream()
                }
            })
            .filter(|k| !k.needs_version_2() || self.header.is_some_and(|h| h.version >= 2))
            .ok_or(Error::UnknownKind {
                kind: h[0],
                offset: start,
            })?;
        let name = kind.name();
        let malformed = |reason: String| Error::Malformed {
            kind: name,
            offset: start,
            reason,
        };
        let flags = h[1];
        let allowed_flags = if matches!(kind, Kind::Pages | Kind::CompressedPages | Kind::SamePage)
        {
            FLAG_LIVE
        } else {
            0
        };
        if flags & !allowed_flags != 0 {
            return Err(malformed(format!("unknown flags {flags:#04x}")));
        }
        if h[2] != 0 || h[3] != 0 {
            return Err(malformed("reserved bytes are not zero".into()));
        }
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if len > kind.max_len() {
            return Err(Error::FrameTooLarge {
                kind: name,
                length: len,
                max: kind.max_len(),
                offset: start,
            });
        }
        if let Some(fixed) = kind.fixed_len() {
            if len != fixed {
                return Err(malformed(format!(
                    "length {len}, a {name} frame is {fixed} bytes"
                )));
            }
        }
        if kind == Kind::Pages {
            return self.pages_head(start, h, len);
        }

        // Everything else: read the payload (growing the buffer as bytes arrive, so a lying
        // length in a cut stream allocates nothing) and check the CRC before decoding.
        let mut payload = Vec::with_capacity((len as usize).min(64 << 10));
        let got = (&mut self.inner)
            .take(u64::from(len))
            .read_to_end(&mut payload)
            .map_err(|e| {
                Error::io(
                    format!("reading the migration stream at byte {}", self.offset),
                    e,
                )
            })?;
        self.offset += got as u64;
        if got < len as usize {
            return Err(Error::Truncated {
                what: format!("the {name} frame at byte {start}"),
                offset: self.offset,
            });
        }
        let mut t = [0u8; FRAME_TRAILER_LEN];
        self.fill(&mut t, &|| {
            format!("the checksum of the {name} frame at byte {start}")
        })?;
        let stored = u32::from_le_bytes(t);
        let computed = crc(&[&h, &payload]);
        if stored != computed {
            return Err(Error::Checksum {
                what: format!("the {name} frame"),
                offset: start,
                stored,
                computed,
            });
        }
        let u32_at = |o: usize| {
            u32::from_le_bytes([payload[o], payload[o + 1], payload[o + 2], payload[o + 3]])
        };
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&payload[o..o + 8]);
            u64::from_le_bytes(b)
        };
        Ok(match kind {
            Kind::Config => Frame::Config(
                serde_json::from_slice(&payload)
                    .map_err(|e| malformed(format!("configuration JSON: {e}")))?,
            ),
            Kind::ZeroPages => {
                let addr = u64_at(0);
                let count = u32_at(8);
                if u32_at(12) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                self.check_range(start, addr, count)?;
                Frame::ZeroPages { addr, count }
            }
            Kind::RoundEnd => {
                let final_flag = u32_at(4);
                if final_flag > 1 {
                    return Err(malformed(format!("unknown round flags {final_flag:#x}")));
                }
                Frame::RoundEnd(RoundEndInfo {
                    round: u32_at(0),
                    final_round: final_flag == 1,
                    pages: u64_at(8),
                    zero_pages: u64_at(16),
                    bytes: u64_at(24),
                    dirty_pages_found: u64_at(32),
                    duration_us: u64_at(40),
                })
            }
            Kind::State => Frame::State(payload),
            Kind::Postcopy => Frame::Postcopy(payload),
            Kind::End => {
                if u32_at(4) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                Frame::End(EndInfo {
                    rounds: u32_at(0),
                    total_pages: u64_at(8),
                    total_zero_pages: u64_at(16),
                })
            }
            Kind::Error => Frame::Error(String::from_utf8_lossy(&payload).into_owned()),
            Kind::Ready => Frame::Ready,
            Kind::Ack => Frame::Ack,
            Kind::Handover => Frame::Handover,
            Kind::RoundAck => Frame::RoundAck(u32_at(0)),
            Kind::Images => {
                if payload.len() < IMAGES_FIXED_LEN as usize {
                    return Err(malformed(format!("length {len} is too short")));
                }
                let n = u32_at(0);
                if u32_at(4) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                let want = u64::from(IMAGES_FIXED_LEN) + u64::from(IMAGE_ENTRY_LEN) * u64::from(n);
                if n == 0 || u64::from(len) != want {
                    return Err(malformed(format!(
                        "length {len} does not match {n} regions ({want} bytes)"
                    )));
                }
                Frame::Images(
                    (0..n as usize)
                        .map(|i| {
                            let o = IMAGES_FIXED_LEN as usize + i * IMAGE_ENTRY_LEN as usize;
                            RegionImage {
                                guest_addr: u64_at(o),
                                size: u64_at(o + 8),
                                offset: u64_at(o + 16),
                            }
                        })
                        .collect(),
                )
            }
            Kind::DataPages => {
                if payload.len() < PAGES_FIXED_LEN {
                    return Err(malformed(format!("length {len} is too short")));
                }
                let addr = u64_at(0);
                let count = u32_at(8);
                if u32_at(12) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                let want = PAGES_FIXED_LEN as u64 + 4 * u64::from(count);
                if count == 0 || u64::from(len) != want {
                    return Err(malformed(format!(
                        "length {len} does not match {count} pages ({want} bytes)"
                    )));
                }
                self.check_range(start, addr, count)?;
                Frame::DataPages {
                    addr,
                    crcs: payload[PAGES_FIXED_LEN..]
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                }
            }
            Kind::Connections => {
                if u32_at(4) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                let count = u32_at(0);
                if count == 0 || count > MAX_DATA_CONNECTIONS {
                    return Err(malformed(format!(
                        "{count} data connections (1 to {MAX_DATA_CONNECTIONS} allowed)"
                    )));
                }
                Frame::Connections {
                    count,
                    token: u64_at(8),
                }
            }
            Kind::Join => {
                if u32_at(12) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                Frame::Join {
                    token: u64_at(0),
                    index: u32_at(8),
                }
            }
            Kind::CompressedPages => {
                if payload.len() < PAGES_FIXED_LEN {
                    return Err(malformed(format!("length {len} is too short")));
                }
                let addr = u64_at(0);
                let count = u32_at(8);
                let codec = Codec::from_u8(payload[12])
                    .ok_or_else(|| malformed(format!("unknown codec {}", payload[12])))?;
                if payload[13..16] != [0, 0, 0] {
                    return Err(malformed("reserved bytes are not zero".into()));
                }
                let table_end = PAGES_FIXED_LEN + 4 * count as usize;
                if count == 0 || count > MAX_COMPRESSED_PAGES || table_end > payload.len() {
                    return Err(malformed(format!(
                        "{count} pages (1 to {MAX_COMPRESSED_PAGES}, with their CRCs inside \
                         the frame's {len} bytes)"
                    )));
                }
                self.check_range(start, addr, count)?;
                Frame::CompressedPages(CompressedPages {
                    addr,
                    live: flags & FLAG_LIVE != 0,
                    codec,
                    crcs: payload[PAGES_FIXED_LEN..table_end]
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    data: payload[table_end..].to_vec(),
                })
            }
            Kind::SamePage => {
                if u32_at(20) != 0 {
                    return Err(malformed("reserved field is not zero".into()));
                }
                let (addr, from) = (u64_at(0), u64_at(8));
                self.check_range(start, addr, 1)?;
                self.check_range(start, from, 1)?;
                if addr == from {
                    return Err(malformed(format!("guest page {addr:#x} refers to itself")));
                }
                Frame::SamePage {
                    addr,
                    from,
                    crc: u32_at(16),
                    live: flags & FLAG_LIVE != 0,
                }
            }
            Kind::Pages => return Err(malformed("unexpected Pages frame".into())),
        })
    }

    fn check_range(&self, start: u64, addr: u64, count: u32) -> Result<(usize, u64)> {
        let bad = |reason: String| Error::BadPageRange {
            addr,
            end: addr.saturating_add(u64::from(count) * PAGE_SIZE),
            count: u64::from(count),
            offset: start,
            reason,
        };
        let ranges = self
            .ranges
            .as_ref()
            .ok_or_else(|| bad("page frames before the configuration".into()))?;
        locate_in(ranges, addr, u64::from(count)).map_err(bad)
    }

    fn pages_head(&mut self, start: u64, h: [u8; FRAME_HEADER_LEN], len: u32) -> Result<Frame> {
        let malformed = |reason: String| Error::Malformed {
            kind: "Pages",
            offset: start,
            reason,
        };
        if (len as usize) < PAGES_FIXED_LEN {
            return Err(malformed(format!("length {len} is too short")));
        }
        let mut fixed = [0u8; PAGES_FIXED_LEN];
        self.fill(&mut fixed, &|| format!("the Pages frame at byte {start}"))?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&fixed[..8]);
        let addr = u64::from_le_bytes(a);
        let count = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]);
        let reserved = u32::from_le_bytes([fixed[12], fixed[13], fixed[14], fixed[15]]);
        if reserved != 0 {
            return Err(malformed("reserved field is not zero".into()));
        }
        let expect = PAGES_FIXED_LEN as u64 + u64::from(count) * (4 + PAGE_SIZE);
        if count == 0 || u64::from(len) != expect {
            return Err(malformed(format!(
                "length {len} does not match {count} pages ({expect} bytes)"
            )));
        }
        self.check_range(start, addr, count)?;
        let mut table = vec![0u8; count as usize * 4];
        self.fill(&mut table, &|| format!("the Pages frame at byte {start}"))?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&h);
        hasher.update(&fixed);
        hasher.update(&table);
        let crcs = table
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let live = h[1] & FLAG_LIVE != 0;
        self.pending = Some(Pending {
            offset: start,
            addr,
            count,
            live,
            crcs,
            hasher,
        });
        Ok(Frame::Pages(PagesHeader { addr, count, live }))
    }

    /// Reads the data of the `Pages` frame just returned into `dst` (`count * 4096` bytes)
    /// and checks it. Returns the indices of pages whose CRC did not match; that is only
    /// possible for a live frame (for others it is an error).
    pub fn read_page_data(&mut self, dst: &mut [u8]) -> Result<Vec<u32>> {
        let p = self.take_pending()?;
        if dst.len() as u64 != u64::from(p.count) * PAGE_SIZE {
            return Err(Error::Param(format!(
                "read_page_data: {} bytes given for {} pages",
                dst.len(),
                p.count
            )));
        }
        let start = p.offset;
        let t = std::time::Instant::now();
        self.fill(dst, &|| {
            format!("the page data of the Pages frame at byte {start}")
        })?;
        let t = crate::stages::lap(&mut self.page_read_time, t);
        let computed: Vec<u32> = dst.chunks_exact(PAGE_USIZE).map(page_crc).collect();
        crate::stages::lap(&mut self.crc_time, t);
        self.finish_pages(p, &computed)
    }

    /// Reads the data of the `Pages` frame just returned into a new vector.
    pub fn read_page_data_vec(&mut self) -> Result<(Vec<u8>, Vec<u32>)> {
        let count = self.pending.as_ref().map_or(0, |p| p.count);
        // Bounded by MAX_FRAME_PAYLOAD: the frame length was checked.
        let mut v = vec![0u8; count as usize * PAGE_USIZE];
        let bad = self.read_page_data(&mut v)?;
        Ok((v, bad))
    }

    fn take_pending(&mut self) -> Result<Pending> {
        self.pending.take().ok_or(Error::Param(
            "read_page_data called without a Pages frame before it".into(),
        ))
    }

    fn skip_page_data(&mut self) -> Result<()> {
        let p = self.take_pending()?;
        let mut page = vec![0u8; PAGE_USIZE];
        let mut computed = Vec::with_capacity(p.count as usize);
        let start = p.offset;
        for _ in 0..p.count {
            self.fill(&mut page, &|| {
                format!("the page data of the Pages frame at byte {start}")
            })?;
            computed.push(page_crc(&page));
        }
        self.finish_pages(p, &computed).map(|_| ())
    }

    fn finish_pages(&mut self, p: Pending, computed: &[u32]) -> Result<Vec<u32>> {
        let start = p.offset;
        let mut t = [0u8; FRAME_TRAILER_LEN];
        self.fill(&mut t, &|| {
            format!("the checksum of the Pages frame at byte {start}")
        })?;
        let stored = u32::from_le_bytes(t);
        let head = p.hasher.finalize();
        if stored != head {
            return Err(Error::Checksum {
                what: "the Pages frame".into(),
                offset: start,
                stored,
                computed: head,
            });
        }
        let bad: Vec<u32> = (0..p.count)
            .filter(|&i| p.crcs[i as usize] != computed[i as usize])
            .collect();
        if let (Some(&i), false) = (bad.first(), p.live) {
            return Err(Error::Checksum {
                what: format!(
                    "guest page {:#x} of the Pages frame",
                    p.addr + u64::from(i) * PAGE_SIZE
                ),
                offset: start,
                stored: p.crcs[i as usize],
                computed: computed[i as usize],
            });
        }
        Ok(bad)
    }
}
