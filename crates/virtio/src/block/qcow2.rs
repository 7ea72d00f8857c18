//! qcow2 images, through the `imago` crate (docs/disks.md says why that crate).
//!
//! This layer decides what imago is given: it reads the header's fixed fields itself to
//! refuse what ferrovm does not support before imago touches the file (imago may rewrite the
//! header of a writable image as it opens it), opens the backing chain itself (read-only, each
//! file under a shared lock, relative names resolved against the image that names them, loops
//! and over-deep chains refused), and moves guest memory to and from imago's I/O vectors. The
//! system calls stay in imago's file driver; nothing here issues one except for opening and
//! locking.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use zerocopy::big_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, KnownLayout};

use super::image::{ImageError, ImageErrorKind};

/// The first bytes of every qcow2 file: "QFI\xfb".
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
/// The longest backing chain opened under one image (the image itself not counted). Every
/// image keeps its own metadata caches (up to about 10 MiB each), so a chain is bounded.
pub const MAX_BACKING_DEPTH: usize = 32;
/// Longest backing file name the format allows (QEMU's limit too).
const MAX_BACKING_NAME: u32 = 1023;

/// Incompatible feature bits (qcow2 v3 header, bytes 72-79).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// The fixed header fields of versions 2 and 3 (big-endian on disk).
#[derive(FromBytes, KnownLayout, Immutable)]
#[repr(C)]
struct Header {
    magic: [u8; 4],
    version: U32,
    backing_file_offset: U64,
    backing_file_size: U32,
    cluster_bits: U32,
    size: U64,
    crypt_method: U32,
    l1_size: U32,
    l1_table_offset: U64,
    refcount_table_offset: U64,
    refcount_table_clusters: U32,
    nb_snapshots: U32,
    snapshots_offset: U64,
    // Version 3 only.
    incompatible_features: U64,
    compatible_features: U64,
    autoclear_features: U64,
    refcount_order: U32,
    header_length: U32,
}
const V2_HEADER_LEN: usize = 72;
const V3_HEADER_LEN: usize = std::mem::size_of::<Header>();

/// What ferrovm reads from a qcow2 header before it lets imago open the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderSummary {
    pub version: u32,
    /// The guest-visible size in bytes.
    pub size: u64,
    pub cluster_bits: u32,
    /// Internal snapshots in the image.
    pub snapshots: u32,
    /// Where the L1 table lies in the file.
    pub l1_table: std::ops::Range<u64>,
    /// The backing file named in the header, as written there.
    pub backing: Option<String>,
}

/// Whether `file` starts with qcow2's magic.
pub fn has_qcow2_magic(file: &File) -> io::Result<bool> {
    let mut magic = [0u8; 4];
    match file.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == QCOW2_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Checks a qcow2 header (the first bytes of the file, up to a cluster) and the backing
/// file name it points at, refusing what ferrovm does not support. `file_len` bounds every
/// offset the header gives.
pub fn parse_header(bytes: &[u8], file_len: u64) -> Result<HeaderSummary, String> {
    let mut fixed = [0u8; V3_HEADER_LEN];
    let n = bytes.len().min(V3_HEADER_LEN);
    fixed[..n].copy_from_slice(&bytes[..n]);
    let h = Header::read_from_bytes(&fixed).map_err(|_| "header size".to_string())?;
    if h.magic != QCOW2_MAGIC {
        return Err("not a qcow2 image (no QFI\\xfb magic)".into());
    }
    let version = h.version.get();
    let needed = match version {
        2 => V2_HEADER_LEN,
        3 => V3_HEADER_LEN,
        v => {
            return Err(format!(
                "qcow2 version {v}: only versions 2 and 3 are supported"
            ))
        }
    };
    if bytes.len() < needed {
        return Err(format!(
            "truncated qcow2 header: {} bytes, version {version} needs {needed}",
            bytes.len()
        ));
    }
    let cluster_bits = h.cluster_bits.get();
    if !(9..=21).contains(&cluster_bits) {
        return Err(format!(
            "qcow2 cluster_bits {cluster_bits}: expected 9 to 21"
        ));
    }
    if h.crypt_method.get() != 0 {
        return Err("encrypted qcow2 images are not supported".into());
    }
    if version == 3 {
        check_v3_fields(&h)?;
    }
    check_tables(&h, file_len)?;
    let backing = backing_name(&h, bytes, file_len)?;
    Ok(HeaderSummary {
        version,
        size: h.size.get(),
        cluster_bits,
        snapshots: h.nb_snapshots.get(),
        l1_table: h.l1_table_offset.get()..h.l1_table_offset.get() + u64::from(h.l1_size.get()) * 8,
        backing,
    })
}

fn check_v3_fields(h: &Header) -> Result<(), String> {
    let incompatible = h.incompatible_features.get();
    let refusals = [
        (INCOMPAT_DIRTY, "its dirty bit is set (not closed cleanly with lazy refcounts): `qemu-img check -r all` repairs it"),
        (INCOMPAT_CORRUPT, "it is marked corrupt: `qemu-img check -r all` repairs it"),
        (INCOMPAT_DATA_FILE, "external data files are not supported"),
        (INCOMPAT_COMPRESSION, "compression types other than deflate (zstd) are not supported"),
        (INCOMPAT_EXTL2, "extended L2 entries (subclusters) are not supported"),
    ];
    for (bit, why) in refusals {
        if incompatible & bit != 0 {
            return Err(format!("qcow2 image refused: {why}"));
        }
    }
    let known = refusals.iter().fold(0, |acc, (bit, _)| acc | bit);
    if incompatible & !known != 0 {
        return Err(format!(
            "qcow2 image refused: unknown incompatible feature bits {:#x}",
            incompatible & !known
        ));
    }
    let order = h.refcount_order.get();
    if order > 6 {
        return Err(format!(
            "qcow2 refcount_order {order}: at most 6 (64-bit refcounts)"
        ));
    }
    let length = h.header_length.get();
    if (length as usize) < V3_HEADER_LEN {
        return Err(format!(
            "qcow2 header_length {length}: less than {V3_HEADER_LEN}"
        ));
    }
    Ok(())
}

/// The L1 and refcount tables must lie inside the file, on cluster boundaries.
fn check_tables(h: &Header, file_len: u64) -> Result<(), String> {
    let cluster = 1u64 << h.cluster_bits.get();
    let tables = [
        (
            "L1 table",
            h.l1_table_offset.get(),
            u64::from(h.l1_size.get()) * 8,
        ),
        (
            "refcount table",
            h.refcount_table_offset.get(),
            u64::from(h.refcount_table_clusters.get()) * cluster,
        ),
    ];
    for (what, offset, len) in tables {
        if !offset.is_multiple_of(cluster) {
            return Err(format!("qcow2 {what} at {offset:#x}: not cluster-aligned"));
        }
        if offset.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(format!(
                "qcow2 {what} at {offset:#x} ({len} bytes) lies past the end of the file ({file_len} bytes)"
            ));
        }
    }
    Ok(())
}

fn backing_name(h: &Header, bytes: &[u8], file_len: u64) -> Result<Option<String>, String> {
    let (offset, len) = (h.backing_file_offset.get(), h.backing_file_size.get());
    if offset == 0 {
        return Ok(None);
    }
    if len == 0 || len > MAX_BACKING_NAME {
        return Err(format!("qcow2 backing file name of {len} bytes"));
    }
    let end = offset.saturating_add(u64::from(len));
    if end > file_len || end > bytes.len() as u64 {
        return Err(format!(
            "qcow2 backing file name at {offset:#x} lies outside the header cluster"
        ));
    }
    let raw = &bytes[offset as usize..end as usize];
    String::from_utf8(raw.to_vec())
        .map(Some)
        .map_err(|_| "qcow2 backing file name is not UTF-8".into())
}

/// Reads the header cluster of `file` and checks it with [`parse_header`].
#[cfg(target_os = "linux")]
fn read_header(file: &File, path: &Path) -> Result<HeaderSummary, ImageError> {
    let refuse = |what: String| image_error(path, ImageErrorKind::Open, what);
    let file_len = file
        .metadata()
        .map_err(|e| refuse(format!("cannot stat: {e}")))?
        .len();
    let mut probe = [0u8; V3_HEADER_LEN];
    let n = read_prefix(file, &mut probe).map_err(|e| refuse(format!("cannot read: {e}")))?;
    let cluster_bits = Header::ref_from_bytes(&probe)
        .map(|h| h.cluster_bits.get())
        .unwrap_or(16)
        .clamp(9, 21);
    // The backing file name sits in the first cluster, after the header.
    let mut bytes = vec![0u8; 1 << cluster_bits];
    let n = n.max(read_prefix(file, &mut bytes).map_err(|e| refuse(format!("cannot read: {e}")))?);
    bytes.truncate(n);
    parse_header(&bytes, file_len).map_err(refuse)
}

/// Reads as much of `buf` as the file has from offset 0.
#[cfg(target_os = "linux")]
fn read_prefix(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn image_error(path: &Path, kind: ImageErrorKind, what: impl Into<String>) -> ImageError {
    ImageError {
        path: path.to_path_buf(),
        kind,
        what: what.into(),
    }
}

#[cfg(target_os = "linux")]
mod driver;
#[cfg(target_os = "linux")]
pub use driver::Qcow2Image;

/// qcow2 images go through imago's file driver, which is written for Linux: elsewhere an
/// image with a qcow2 header (or `format=qcow2`) is refused when it is opened.
#[cfg(not(target_os = "linux"))]
#[derive(Debug)]
pub enum Qcow2Image {}

#[cfg(not(target_os = "linux"))]
impl Qcow2Image {
    pub fn open(
        _file: &File,
        options: &super::options::BlockOptions,
    ) -> Result<Qcow2Image, ImageError> {
        Err(image_error(
            &options.path,
            ImageErrorKind::Open,
            "qcow2 images are supported on Linux hosts only (imago's file driver)",
        ))
    }

    pub fn size(&self) -> u64 {
        match *self {}
    }

    pub fn request_alignment(&self) -> usize {
        match *self {}
    }

    pub fn read_into<B: vm_memory::bitmap::BitmapSlice>(
        &self,
        _offset: u64,
        _bufs: &[vm_memory::VolatileSlice<B>],
    ) -> io::Result<()> {
        match *self {}
    }

    pub fn write_from<B: vm_memory::bitmap::BitmapSlice>(
        &self,
        _offset: u64,
        _bufs: &[vm_memory::VolatileSlice<B>],
    ) -> io::Result<()> {
        match *self {}
    }

    pub fn flush(&self) -> io::Result<()> {
        match *self {}
    }

    pub fn discard(&self, _offset: u64, _len: u64) -> io::Result<()> {
        match *self {}
    }

    pub fn write_zeroes(&self, _offset: u64, _len: u64, _unmap: bool) -> io::Result<()> {
        match *self {}
    }

    pub fn reopen(&self) -> Result<(), ImageError> {
        match *self {}
    }
}
