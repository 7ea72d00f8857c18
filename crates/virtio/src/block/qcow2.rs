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
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{FormatAccess, StorageOpenOptions};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;
use zerocopy::big_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, KnownLayout};

use super::image::{buffered, lock_image, ImageError, ImageErrorKind};
use super::options::{BlockOptions, CacheMode};
use super::ordered::OrderedFile;

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

type Storage = OrderedFile;
/// An image of any format, as a backing file of another.
type Layer = Arc<FormatAccess<Storage>>;

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

/// A backing file kept open: its descriptor holds the shared lock for as long as the image
/// it backs is open.
#[derive(Debug)]
struct BackingFile {
    _lock_holder: File,
}

/// An open qcow2 image and its backing chain.
pub struct Qcow2Image {
    /// Behind a lock: discards need the image to themselves (they may drop clusters a
    /// concurrent request still maps), and a migration destination reopens it at take-over.
    access: RwLock<FormatAccess<Storage>>,
    size: u64,
    header: HeaderSummary,
    /// What to reopen: the image's own descriptor (a duplicate, sharing its lock).
    file: File,
    path: PathBuf,
    options: BlockOptions,
    backing: Option<Layer>,
    _chain: Vec<BackingFile>,
}

impl std::fmt::Debug for Qcow2Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Image")
            .field("path", &self.path)
            .field("size", &self.size)
            .finish()
    }
}

impl Qcow2Image {
    /// Opens the qcow2 image `file` (already open and locked by the caller) and its backing
    /// chain.
    pub fn open(file: &File, options: &BlockOptions) -> Result<Qcow2Image, ImageError> {
        let path = options.path.as_path();
        let header = read_header(&buffered(path)?, path)?;
        if header.snapshots > 0 && !options.readonly {
            // Writing would copy L2 tables that snapshots share; ferrovm leaves that to QEMU.
            return Err(image_error(
                path,
                ImageErrorKind::Open,
                format!(
                    "qcow2 image with {} internal snapshots: writing to it is not supported (use readonly, or `qemu-img snapshot -d`)",
                    header.snapshots
                ),
            ));
        }
        let file = file.try_clone().map_err(|e| {
            image_error(path, ImageErrorKind::Open, format!("cannot duplicate: {e}"))
        })?;
        let mut image = open_qcow2(&file, options, &header)?;
        // The header's backing format applies to the file it names, not to an override.
        let (backing_path, format) = match (&options.image.backing, &header.backing) {
            (Some(explicit), _) => (Some(explicit.clone()), None),
            (None, Some(name)) => (
                Some(resolve(path, name)),
                image.implicit_backing_format().cloned(),
            ),
            (None, None) => (None, None),
        };
        let mut chain = Vec::new();
        let mut seen = vec![canonical(path)];
        let backing = match backing_path {
            Some(b) => Some(open_layer(
                &b,
                format.as_deref(),
                path,
                &mut seen,
                &mut chain,
            )?),
            None => None,
        };
        image.set_backing(backing.clone());
        Ok(Qcow2Image {
            size: header.size,
            header,
            access: RwLock::new(FormatAccess::new(image)),
            file,
            path: path.to_path_buf(),
            options: options.clone(),
            backing,
            _chain: chain,
        })
    }

    /// The guest-visible size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The format-level alignment imago needs for direct I/O (1 when buffered).
    pub fn request_alignment(&self) -> usize {
        self.access().req_align()
    }

    fn access(&self) -> RwLockReadGuard<'_, FormatAccess<Storage>> {
        self.access.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn read_into<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
    ) -> io::Result<()> {
        // The guard marks the slices dirty when it goes (migration sends them again).
        let (vector, _guard) = IoVectorMut::from_volatile_slice(bufs);
        self.access().readv(vector, offset)
    }

    pub fn write_from<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
    ) -> io::Result<()> {
        let (vector, _guard) = IoVector::from_volatile_slice(bufs);
        self.access().writev(vector, offset)
    }

    /// Writes the cached metadata back (refcounts, then the L2 tables that use them, then the
    /// held-back L1 entries that point at those), then fsyncs: an acknowledged FLUSH leaves
    /// data and metadata on disk.
    pub fn flush(&self) -> io::Result<()> {
        // Alone: a request that made a new L2 table between imago's write-back of the refcounts
        // and the release of the L1 writes would get its L1 entry out before its refcount.
        let access = self.access.write().unwrap_or_else(|p| p.into_inner());
        access.flush()?;
        access.sync()
    }

    /// Frees the clusters of the range where whole clusters are covered (they read back as
    /// zeroes, never as the backing file's data); zeroes the rest.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut access = self.access.write().unwrap_or_else(|p| p.into_inner());
        access.discard_to_zero(offset, len)
    }

    /// Zeroes the range: with `unmap` its clusters may be freed, else they become
    /// preallocated zero clusters where whole clusters are covered.
    pub fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        if unmap {
            return self.discard(offset, len);
        }
        self.access().write_zeroes(offset, len)
    }

    /// Drops what is cached of the image's metadata and reads it again from the file: a
    /// migration destination, whose source wrote the image until the hand-over.
    pub fn reopen(&self) -> Result<(), ImageError> {
        let header = read_header(&buffered(&self.path)?, &self.path)?;
        if header.l1_table != self.header.l1_table || header.size != self.size {
            return Err(image_error(
                &self.path,
                ImageErrorKind::Open,
                "qcow2 image changed its size or moved its L1 table while another machine had it",
            ));
        }
        let mut fresh = open_qcow2(&self.file, &self.options, &header)?;
        fresh.set_backing(self.backing.clone());
        let fresh = FormatAccess::new(fresh);
        let mut access = self.access.write().unwrap_or_else(|p| p.into_inner());
        // The old instance has written nothing the new one has not read: a destination
        // writes only after its take-over.
        *access = fresh;
        Ok(())
    }
}

/// imago's view of the (already checked) qcow2 file `file`, its backing not yet set.
fn open_qcow2(
    file: &File,
    options: &BlockOptions,
    header: &HeaderSummary,
) -> Result<Qcow2<Storage, Layer>, ImageError> {
    let path = options.path.as_path();
    let writable = !options.readonly;
    let direct = options.cache == CacheMode::None;
    let storage = storage_of(file, path, writable, direct, header.l1_table.clone())?;
    Qcow2::open_image(storage, writable)
        .map_err(|e| image_error(path, ImageErrorKind::Open, format!("qcow2: {e}")))
}

/// imago's file driver over a duplicate of `file` (the duplicate shares its lock).
/// The L1 table's range `l1` is where writes wait for a flush (see [`OrderedFile`]).
fn storage_of(
    file: &File,
    path: &Path,
    writable: bool,
    direct: bool,
    l1: std::ops::Range<u64>,
) -> Result<Storage, ImageError> {
    let refuse =
        |e: io::Error| image_error(path, ImageErrorKind::Open, format!("cannot open: {e}"));
    let dup = file.try_clone().map_err(refuse)?;
    let options = StorageOpenOptions::new()
        .write(writable)
        .direct(direct)
        .filename(path);
    let inner = imago::file::File::from_open_file(dup, options).map_err(refuse)?;
    Ok(OrderedFile::new(inner, l1))
}

/// Opens the backing file `path` (named by `named_by`) and everything below it, read-only and
/// shared-locked; `format` is what the naming image's header says, probed when absent.
fn open_layer(
    path: &Path,
    format: Option<&str>,
    named_by: &Path,
    seen: &mut Vec<PathBuf>,
    chain: &mut Vec<BackingFile>,
) -> Result<Layer, ImageError> {
    // The errors of this layer name it (the command line names only the top image).
    let named = |e: ImageError| ImageError {
        what: format!("backing file {}: {}", path.display(), e.what),
        ..e
    };
    let refuse = |what: String| named(image_error(path, ImageErrorKind::Open, what));
    if chain.len() >= MAX_BACKING_DEPTH {
        return Err(refuse(format!(
            "the backing chain is deeper than {MAX_BACKING_DEPTH} images"
        )));
    }
    let file = File::open(path).map_err(|e| {
        refuse(format!(
            "cannot open (named by {}): {e}",
            named_by.display()
        ))
    })?;
    let canonical = canonical(path);
    if seen.contains(&canonical) {
        return Err(refuse(format!(
            "backing file loop: {} names it again",
            named_by.display()
        )));
    }
    seen.push(canonical);
    lock_image(&file, path, true).map_err(named)?;
    let qcow2 = match format {
        Some("qcow2") => true,
        Some("raw") => false,
        Some(other) => return Err(refuse(format!("format {other}: only raw and qcow2"))),
        None => has_qcow2_magic(&file).map_err(|e| refuse(format!("cannot read: {e}")))?,
    };
    let storage = storage_of(&file, path, false, false, 0..0).map_err(named)?;
    let header = qcow2
        .then(|| read_header(&file, path))
        .transpose()
        .map_err(named)?;
    chain.push(BackingFile { _lock_holder: file });
    let Some(header) = header else {
        let raw = Raw::open_image(storage, false).map_err(|e| refuse(format!("{e}")))?;
        return Ok(Arc::new(FormatAccess::new(raw)));
    };
    let mut image: Qcow2<Storage, Layer> =
        Qcow2::open_image(storage, false).map_err(|e| refuse(format!("qcow2: {e}")))?;
    if let Some(name) = header.backing {
        let below_format = image.implicit_backing_format().cloned();
        let below = resolve(path, &name);
        let layer = open_layer(&below, below_format.as_deref(), path, seen, chain)?;
        image.set_backing(Some(layer));
    } else {
        image.set_backing(None);
    }
    Ok(Arc::new(FormatAccess::new(image)))
}

/// A backing file name resolved as QEMU does: a relative one against the directory of the
/// image that names it.
fn resolve(image: &Path, name: &str) -> PathBuf {
    let name = Path::new(name);
    match image.parent() {
        Some(dir) if name.is_relative() => dir.join(name),
        _ => name.to_path_buf(),
    }
}

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}
