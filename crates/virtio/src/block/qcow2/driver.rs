//! The qcow2 image itself, through imago's file driver (Linux only).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{FormatAccess, StorageOpenOptions};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use super::super::image::{buffered, lock_image, ImageError, ImageErrorKind};
use super::super::options::{BlockOptions, CacheMode};
use super::super::ordered::OrderedFile;
use super::{has_qcow2_magic, image_error, read_header, HeaderSummary, MAX_BACKING_DEPTH};

type Storage = OrderedFile;
/// An image of any format, as a backing file of another.
type Layer = Arc<FormatAccess<Storage>>;

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
