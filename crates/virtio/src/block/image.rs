//! A disk image on the host: a regular file or a block device, opened, locked, sized, its
//! format told from its header, and read and written straight into guest memory (a raw image
//! here with preadv/pwritev, a qcow2 image through [`super::qcow2`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, VolatileSlice};

use super::options::{BlockOptions, CacheMode, ImageFormat};
use super::qcow2::{has_qcow2_magic, Qcow2Image, QCOW2_MAGIC};
use super::sys;

/// Bytes in a virtio-blk sector.
pub const SECTOR_SIZE: u64 = 512;
/// Size of a worker's bounce buffer: unaligned direct I/O and zero writes go through it in
/// pieces of at most this.
const BOUNCE_SIZE: usize = 1 << 20;
/// Alignment of the bounce buffer (a page, enough for any device's direct I/O).
const BOUNCE_ALIGN: usize = 4096;

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("disk {}: {what}", path.display())]
pub struct ImageError {
    pub path: PathBuf,
    pub kind: ImageErrorKind,
    pub what: String,
}

/// The class of an [`ImageError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageErrorKind {
    /// Bad options, missing, unreadable or not an image.
    Open,
    /// Another process (or another open of it) holds the image's lock.
    Locked,
    /// cache=none, but the file system refuses O_DIRECT.
    DirectIo,
}

fn image_error(path: &Path, kind: ImageErrorKind, what: impl Into<String>) -> ImageError {
    ImageError {
        path: path.to_path_buf(),
        kind,
        what: what.into(),
    }
}

/// What identifies an image file's content at one moment, for one fstat: which file it is
/// (its inode) and when its data and its inode last changed. Any write moves both times (and
/// since Linux 6.13 the first change after a stat gets a fine-grained time, so a write right
/// after the snapshot is seen too); a copy is another inode; the ctime cannot be set back.
/// The device number is left out: it may change across reboots for the same file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageStamp {
    pub ino: u64,
    pub size: u64,
    /// Modification time: seconds and nanoseconds since the epoch.
    pub mtime: (i64, i64),
    /// Change time of the inode.
    pub ctime: (i64, i64),
}

impl ImageStamp {
    /// How `now` differs from `self`, in words, if it does.
    pub fn difference(&self, now: &ImageStamp) -> Option<&'static str> {
        if now.ino != self.ino {
            Some("another file (its inode differs)")
        } else if now.size != self.size || now.mtime != self.mtime {
            Some("written since")
        } else if now.ctime != self.ctime {
            Some("changed since (its inode's change time differs)")
        } else {
            None
        }
    }
}

/// What backs the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    File,
    BlockDevice,
}

/// An open, locked image.
#[derive(Debug)]
pub struct DiskImage {
    /// A qcow2 image: every request goes through it.
    qcow2: Option<Qcow2Image>,
    /// Raw because nothing said so and its header did not say otherwise: a guest write that
    /// would give it a qcow2 header is refused, so that the next open does not take the
    /// guest's word for the format (and open the backing file the guest names).
    probed_raw: bool,
    file: File,
    path: PathBuf,
    kind: ImageKind,
    /// Usable size in bytes: a whole number of sectors (a partial last sector is not shown).
    size: u64,
    readonly: bool,
    /// With O_DIRECT: the alignment of offsets, lengths and memory the file system demands.
    direct_align: Option<usize>,
}

impl DiskImage {
    /// Opens and locks the image `options` names.
    pub fn open(options: &BlockOptions) -> Result<DiskImage, ImageError> {
        let path = options.path.as_path();
        options
            .validate()
            .map_err(|e| image_error(path, ImageErrorKind::Open, e))?;
        let kind = image_kind(path)?;
        let file = open_file(path, options)?;
        if !options.defer_lock {
            lock_image(&file, path, options.readonly)?;
        }
        let qcow2 = open_format(&file, options)?;
        let bytes = match &qcow2 {
            Some(image) => image.size(),
            None => image_size(&file, kind).map_err(|e| {
                image_error(path, ImageErrorKind::Open, format!("cannot size: {e}"))
            })?,
        };
        let direct_align = (options.cache == CacheMode::None).then(|| match &qcow2 {
            Some(image) => image.request_alignment().max(SECTOR_SIZE as usize),
            None => probe_direct_alignment(&file),
        });
        Ok(DiskImage {
            probed_raw: qcow2.is_none() && options.image.format == ImageFormat::Auto,
            qcow2,
            file,
            path: path.to_path_buf(),
            kind,
            size: bytes - bytes % SECTOR_SIZE,
            readonly: options.readonly,
            direct_align,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The image file's [`ImageStamp`] now; None for a block device (writes through it do
    /// not move the device node's times).
    pub fn stamp(&self) -> io::Result<Option<ImageStamp>> {
        if self.kind != ImageKind::File {
            return Ok(None);
        }
        let meta = self.file.metadata()?;
        Ok(Some(ImageStamp {
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }))
    }

    /// Takes the image's lock (again): exclusive when writable, shared when read-only. A
    /// qcow2 image then reads its metadata again: the machine that held the lock before may
    /// have changed it (migration take-over).
    pub fn lock(&self) -> Result<(), ImageError> {
        lock_image(&self.file, &self.path, self.readonly)?;
        match &self.qcow2 {
            Some(image) => image.reopen(),
            None => Ok(()),
        }
    }

    /// Lets go of the image's lock, for another machine to take it (migration hand-over); a
    /// qcow2 image first writes back the metadata it caches.
    pub fn unlock(&self) -> io::Result<()> {
        self.settle()?;
        sys::unlock(&self.file)
    }

    /// Writes back what a qcow2 image caches of its metadata and syncs, so that the file
    /// alone is the whole image (before a snapshot records it or another process opens it).
    pub fn settle(&self) -> io::Result<()> {
        match &self.qcow2 {
            Some(image) if !self.readonly => image.flush(),
            _ => Ok(()),
        }
    }

    /// The image's format.
    pub fn format(&self) -> ImageFormat {
        match self.qcow2 {
            Some(_) => ImageFormat::Qcow2,
            None => ImageFormat::Raw,
        }
    }

    pub fn kind(&self) -> ImageKind {
        self.kind
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.size / SECTOR_SIZE
    }

    pub fn readonly(&self) -> bool {
        self.readonly
    }

    /// The logical block size the guest should use: 512, or what O_DIRECT demands.
    pub fn block_size(&self) -> u32 {
        self.direct_align.map_or(SECTOR_SIZE as u32, |a| a as u32)
    }

    /// Fills `bufs` (guest memory) from the image at `offset`.
    pub fn read_into<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        if let Some(image) = &self.qcow2 {
            return image.read_into(offset, bufs);
        }
        if self.needs_bounce(offset, bufs)? {
            return self.read_bounced(offset, bufs, bounce);
        }
        let guards: Vec<_> = bufs.iter().map(|b| b.ptr_guard_mut()).collect();
        let mut iovecs: Vec<libc::iovec> = guards
            .iter()
            .zip(bufs)
            .map(|(g, b)| libc::iovec {
                iov_base: g.as_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let result = self.transfer(Direction::Read, offset, &mut iovecs);
        for b in bufs {
            b.bitmap().mark_dirty(0, b.len());
        }
        result
    }

    /// Writes `bufs` (guest memory) to the image at `offset`.
    pub fn write_from<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        self.check_writable()?;
        if let Some(image) = &self.qcow2 {
            return image.write_from(offset, bufs);
        }
        if self.probed_raw && offset < QCOW2_MAGIC.len() as u64 {
            self.refuse_format_header(offset, bufs)?;
        }
        if self.needs_bounce(offset, bufs)? {
            return self.write_bounced(offset, bufs, bounce);
        }
        let guards: Vec<_> = bufs.iter().map(|b| b.ptr_guard()).collect();
        let mut iovecs: Vec<libc::iovec> = guards
            .iter()
            .zip(bufs)
            .map(|(g, b)| libc::iovec {
                iov_base: g.as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        self.transfer(Direction::Write, offset, &mut iovecs)
    }

    /// Makes every completed write durable (fdatasync).
    pub fn flush(&self) -> io::Result<()> {
        match &self.qcow2 {
            Some(image) => image.flush(),
            None => self.file.sync_data(),
        }
    }

    /// Tells the host the range is unused. Where the host cannot, nothing happens: a discard
    /// is a hint.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        if let Some(image) = &self.qcow2 {
            return image.discard(offset, len);
        }
        match sys::deallocate(&self.file, self.kind, offset, len) {
            Err(e) if sys::is_unsupported(&e) => Ok(()),
            other => other,
        }
    }

    /// Zeroes the range; with `unmap` the host may free its storage.
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        self.check_writable()?;
        if let Some(image) = &self.qcow2 {
            return image.write_zeroes(offset, len, unmap);
        }
        match sys::zero_range(&self.file, self.kind, offset, len, unmap) {
            Err(e) if sys::is_unsupported(&e) => self.write_zero_buffers(offset, len, bounce),
            other => other,
        }
    }

    /// Refuses a write that would put qcow2's magic at the start of a probed raw image.
    fn refuse_format_header<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
    ) -> io::Result<()> {
        let mut head = [0u8; 4];
        let skip = offset as usize;
        let mut cursor = SliceCursor::new(bufs);
        let n = cursor.remaining().min(head.len() - skip);
        cursor.copy_out(&mut head[skip..skip + n])?;
        let mut current = [0u8; 4];
        if skip > 0 || n < head.len() {
            // A partial overwrite (never from a guest: its writes are whole sectors) keeps
            // bytes of the file's; read them past O_DIRECT's alignment rules.
            let file = buffered(&self.path).map_err(|e| io::Error::other(e.what))?;
            file.read_exact_at(&mut current, 0)
                .or_else(|e| match e.kind() {
                    io::ErrorKind::UnexpectedEof => Ok(()),
                    _ => Err(e),
                })?;
        }
        current[skip..skip + n].copy_from_slice(&head[skip..skip + n]);
        if current == QCOW2_MAGIC {
            log::warn!(
                "disk {}: refused a guest write of a qcow2 header to a raw image whose format was probed (give format=raw to allow it)",
                self.path.display()
            );
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a qcow2 header written to a probed raw image",
            ));
        }
        Ok(())
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.readonly {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the image is read-only",
            ));
        }
        Ok(())
    }

    /// With O_DIRECT: refuses requests whose offset or length the file system cannot take,
    /// and says whether guest memory is too loosely aligned to be used directly.
    fn needs_bounce<B: BitmapSlice>(
        &self,
        offset: u64,
        bufs: &[VolatileSlice<B>],
    ) -> io::Result<bool> {
        let Some(align) = self.direct_align else {
            return Ok(false);
        };
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if !offset.is_multiple_of(align as u64) || !total.is_multiple_of(align) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("request not aligned to the image's {align}-byte direct I/O block"),
            ));
        }
        let aligned = bufs.iter().all(|b| {
            (b.ptr_guard().as_ptr() as usize).is_multiple_of(align) && b.len().is_multiple_of(align)
        });
        Ok(!aligned)
    }

    fn read_bounced<B: BitmapSlice>(
        &self,
        mut offset: u64,
        bufs: &[VolatileSlice<B>],
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        let mut cursor = SliceCursor::new(bufs);
        while cursor.remaining() > 0 {
            let chunk = bounce.window(cursor.remaining().min(BOUNCE_SIZE));
            self.file.read_exact_at(chunk, offset)?;
            cursor.copy_in(chunk)?;
            offset += chunk.len() as u64;
        }
        Ok(())
    }

    fn write_bounced<B: BitmapSlice>(
        &self,
        mut offset: u64,
        bufs: &[VolatileSlice<B>],
        bounce: &mut Bounce,
    ) -> io::Result<()> {
        let mut cursor = SliceCursor::new(bufs);
        while cursor.remaining() > 0 {
            let chunk = bounce.window(cursor.remaining().min(BOUNCE_SIZE));
            cursor.copy_out(chunk)?;
            self.file.write_all_at(chunk, offset)?;
            offset += chunk.len() as u64;
        }
        Ok(())
    }

    fn write_zero_buffers(&self, offset: u64, len: u64, bounce: &mut Bounce) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let chunk = bounce.window((len - done).min(BOUNCE_SIZE as u64) as usize);
            chunk.fill(0);
            self.file.write_all_at(chunk, offset + done)?;
            done += chunk.len() as u64;
        }
        Ok(())
    }

    /// preadv/pwritev until every byte of `iovecs` moved; they are consumed in the process.
    fn transfer(
        &self,
        dir: Direction,
        mut offset: u64,
        iovecs: &mut [libc::iovec],
    ) -> io::Result<()> {
        let mut first = 0;
        while first < iovecs.len() {
            let batch = &iovecs[first..iovecs.len().min(first + IOV_MAX)];
            let done = sys::vectored(&self.file, dir, batch, offset)?;
            if done == 0 {
                return Err(match dir {
                    Direction::Read => io::Error::from(io::ErrorKind::UnexpectedEof),
                    Direction::Write => io::Error::from(io::ErrorKind::WriteZero),
                });
            }
            offset += done as u64;
            advance(iovecs, &mut first, done);
        }
        Ok(())
    }
}

/// Most iovecs one preadv/pwritev takes (POSIX guarantees 1024 on Linux and FreeBSD).
const IOV_MAX: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

/// Drops the first `done` bytes from `iovecs[*first..]`.
fn advance(iovecs: &mut [libc::iovec], first: &mut usize, mut done: usize) {
    while let Some(iov) = iovecs.get_mut(*first) {
        if done < iov.iov_len {
            iov.iov_base = iov.iov_base.wrapping_add(done);
            iov.iov_len -= done;
            return;
        }
        done -= iov.iov_len;
        *first += 1;
    }
}

/// A page-aligned scratch buffer, one per worker thread, allocated on first use.
#[derive(Default)]
pub struct Bounce {
    storage: Vec<u8>,
}

impl Bounce {
    /// The first `len` (≤ [`BOUNCE_SIZE`]) bytes of the aligned buffer.
    fn window(&mut self, len: usize) -> &mut [u8] {
        if self.storage.is_empty() {
            self.storage = vec![0; BOUNCE_SIZE + BOUNCE_ALIGN];
        }
        let start = self.storage.as_ptr().align_offset(BOUNCE_ALIGN);
        &mut self.storage[start..start + len.min(BOUNCE_SIZE)]
    }
}

/// Walks a list of guest slices, copying to or from flat buffers.
struct SliceCursor<'s, 'a, B> {
    bufs: &'s [VolatileSlice<'a, B>],
    index: usize,
    offset: usize,
    remaining: usize,
}

impl<'s, 'a, B: BitmapSlice> SliceCursor<'s, 'a, B> {
    fn new(bufs: &'s [VolatileSlice<'a, B>]) -> Self {
        SliceCursor {
            bufs,
            index: 0,
            offset: 0,
            remaining: bufs.iter().map(|b| b.len()).sum(),
        }
    }

    fn remaining(&self) -> usize {
        self.remaining
    }

    /// Copies `data` into the guest slices at the cursor.
    fn copy_in(&mut self, data: &[u8]) -> io::Result<()> {
        self.walk(data.len(), |slice, at, range| {
            slice
                .write_slice(&data[range], at)
                .map_err(io::Error::other)
        })
    }

    /// Copies the guest slices at the cursor into `data`.
    fn copy_out(&mut self, data: &mut [u8]) -> io::Result<()> {
        self.walk(data.len(), |slice, at, range| {
            slice
                .read_slice(&mut data[range], at)
                .map_err(io::Error::other)
        })
    }

    fn walk(
        &mut self,
        len: usize,
        mut step: impl FnMut(&VolatileSlice<'a, B>, usize, std::ops::Range<usize>) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let slice = self
                .bufs
                .get(self.index)
                .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
            let n = (slice.len() - self.offset).min(len - done);
            step(slice, self.offset, done..done + n)?;
            done += n;
            self.offset += n;
            self.remaining -= n;
            if self.offset == slice.len() {
                self.index += 1;
                self.offset = 0;
            }
        }
        Ok(())
    }
}

fn image_kind(path: &Path) -> Result<ImageKind, ImageError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| image_error(path, ImageErrorKind::Open, format!("cannot open: {e}")))?;
    let ft = meta.file_type();
    if ft.is_dir() {
        Err(image_error(path, ImageErrorKind::Open, "is a directory"))
    } else if ft.is_file() {
        Ok(ImageKind::File)
    } else if ft.is_block_device() || (cfg!(target_os = "freebsd") && ft.is_char_device()) {
        // FreeBSD's disks are character devices.
        Ok(ImageKind::BlockDevice)
    } else {
        Err(image_error(
            path,
            ImageErrorKind::Open,
            "not a regular file or a block device",
        ))
    }
}

fn open_file(path: &Path, options: &BlockOptions) -> Result<File, ImageError> {
    let mut open = OpenOptions::new();
    open.read(true).write(!options.readonly);
    if options.cache == CacheMode::None {
        open.custom_flags(libc::O_DIRECT);
    }
    open.open(path).map_err(|e| {
        if options.cache == CacheMode::None && e.raw_os_error() == Some(libc::EINVAL) {
            image_error(
                path,
                ImageErrorKind::DirectIo,
                "the file system refuses O_DIRECT (cache=none); use cache=writeback",
            )
        } else {
            image_error(path, ImageErrorKind::Open, format!("cannot open: {e}"))
        }
    })
}

/// Takes the image's advisory lock: exclusive for a writable image, shared for a read-only
/// one, so two VMs never write one disk. A file system without locks gets a warning.
pub(super) fn lock_image(file: &File, path: &Path, readonly: bool) -> Result<(), ImageError> {
    match sys::lock(file, readonly) {
        Ok(()) => Ok(()),
        Err(e) if sys::is_lock_conflict(&e) => Err(image_error(
            path,
            ImageErrorKind::Locked,
            format!(
                "locked by another process ({} lock refused: {e})",
                if readonly { "shared" } else { "exclusive" }
            ),
        )),
        Err(e) if sys::is_unsupported(&e) || e.raw_os_error() == Some(libc::ENOLCK) => {
            log::warn!(
                "disk {}: cannot lock it ({e}); going on unlocked",
                path.display()
            );
            Ok(())
        }
        Err(e) => Err(image_error(
            path,
            ImageErrorKind::Open,
            format!("cannot lock: {e}"),
        )),
    }
}

/// The qcow2 image in `file` if it is one (by `format=`, or by its header when not given).
fn open_format(file: &File, options: &BlockOptions) -> Result<Option<Qcow2Image>, ImageError> {
    let path = options.path.as_path();
    let qcow2 = match options.image.format {
        ImageFormat::Raw => false,
        ImageFormat::Qcow2 => true,
        ImageFormat::Auto => has_qcow2_magic(&buffered(path)?)
            .map_err(|e| image_error(path, ImageErrorKind::Open, format!("cannot read: {e}")))?,
    };
    if !qcow2 && options.image.backing.is_some() {
        return Err(image_error(
            path,
            ImageErrorKind::Open,
            "backing= given, but the image is raw (no qcow2 header)",
        ));
    }
    qcow2.then(|| Qcow2Image::open(file, options)).transpose()
}

/// A read-only descriptor of `path` through the page cache, to read headers from whatever
/// the alignment rules of the image's own (maybe O_DIRECT) descriptor.
pub(super) fn buffered(path: &Path) -> Result<File, ImageError> {
    File::open(path)
        .map_err(|e| image_error(path, ImageErrorKind::Open, format!("cannot open: {e}")))
}

fn image_size(file: &File, kind: ImageKind) -> io::Result<u64> {
    match kind {
        ImageKind::File => Ok(file.metadata()?.len()),
        ImageKind::BlockDevice => sys::device_size(file),
    }
}

/// The smallest alignment O_DIRECT reads accept (512 or 4096), tried on the first block.
fn probe_direct_alignment(file: &File) -> usize {
    let mut bounce = Bounce::default();
    for align in [512, 4096] {
        match file.read_at(bounce.window(align), 0) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            _ => return align,
        }
    }
    BOUNCE_ALIGN
}
