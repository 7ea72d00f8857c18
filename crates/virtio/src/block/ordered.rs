//! The storage under a writable qcow2 image: imago's file driver, except that writes to the
//! L1 table wait for the next flush.
//!
//! Why: imago (0.2.6) writes a new L1 entry as soon as it has made a new L2 table, while the
//! refcount of that table's cluster is still only in its refcount-block cache. A process
//! killed between the two leaves an L1 entry pointing at a cluster whose refcount is 0, which
//! `qemu-img check` reports as an error (not a leak). Held back here, an L1 entry reaches the
//! file only in [`Storage::flush`], which imago calls after it has written back its refcount
//! blocks and then its L2 tables, and after an fdatasync of those: so the file's L1 table only
//! ever points at L2 tables whose refcounts are on disk, after a kill or a power cut alike. A
//! kill before that flush leaves the new L2 table and its data as leaked clusters, which
//! `qemu-img check` counts as leaks, not errors.
//!
//! Reads of the L1 table see the held-back entries (imago reads it only when it opens the
//! image, but a reader must never see the file older than its own writes).

use std::fmt;
use std::io;
use std::ops::Range;
use std::sync::Mutex;

use imago::io_buffers::{IoBuffer, IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::{Storage, StorageExt, StorageOpenOptions};

/// imago's file driver with the L1 table's writes held back until a flush.
#[derive(Debug)]
pub struct OrderedFile {
    inner: imago::file::File,
    /// Where the L1 table lies in the file (set at open; ferrovm never resizes an image, the
    /// only thing that would move it).
    l1: Range<u64>,
    /// Writes to the L1 table not yet made, oldest first.
    held: Mutex<Vec<(u64, Vec<u8>)>>,
}

impl OrderedFile {
    pub fn new(inner: imago::file::File, l1: Range<u64>) -> OrderedFile {
        OrderedFile {
            inner,
            l1,
            held: Mutex::new(Vec::new()),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Vec<u8>)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touches_l1(&self, offset: u64, len: u64) -> bool {
        offset < self.l1.end && offset.saturating_add(len) > self.l1.start
    }

    /// Makes the held-back writes, in order, after syncing what came before them.
    fn release(&self) -> io::Result<()> {
        let mut held = self.held();
        if held.is_empty() {
            return Ok(());
        }
        self.inner.sync()?;
        for (offset, data) in held.iter() {
            // Through imago's own write path: it pads an 8-byte entry to the alignment that
            // O_DIRECT needs (cache=none) and orders it against overlapping writes.
            self.inner.write(data.as_slice(), *offset)?;
        }
        held.clear();
        Ok(())
    }
}

impl fmt::Display for OrderedFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl Storage for OrderedFile {
    fn open(_opts: StorageOpenOptions) -> io::Result<Self> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "an ordered qcow2 file is made from an open file, never opened by name",
        ))
    }

    fn mem_align(&self) -> usize {
        self.inner.mem_align()
    }

    fn req_align(&self) -> usize {
        self.inner.req_align()
    }

    fn zero_align(&self) -> usize {
        self.inner.zero_align()
    }

    fn discard_align(&self) -> usize {
        self.inner.discard_align()
    }

    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }

    fn resolve_relative_path<P: AsRef<std::path::Path>>(
        &self,
        relative: P,
    ) -> io::Result<std::path::PathBuf> {
        self.inner.resolve_relative_path(relative)
    }

    fn get_filename(&self) -> Option<std::path::PathBuf> {
        self.inner.get_filename()
    }

    unsafe fn pure_readv(&self, mut bufv: IoVectorMut<'_>, offset: u64) -> io::Result<()> {
        let len = bufv.len();
        let held = self.held();
        if held.is_empty() || !self.touches_l1(offset, len) {
            drop(held);
            // SAFETY: the caller's guarantees for this request carry over unchanged.
            return unsafe { self.inner.pure_readv(bufv, offset) };
        }
        // Aligned for O_DIRECT like any buffer imago passes down (the request already is).
        let mut bounce = IoBuffer::new(len as usize, self.inner.mem_align())?;
        // SAFETY: as above; the bounce buffer is ours.
        unsafe {
            self.inner
                .pure_readv(IoVectorMut::from(&mut bounce), offset)
        }?;
        let data = bounce.as_mut().into_slice();
        for (at, bytes) in held.iter() {
            overlay(data, offset, *at, bytes);
        }
        bufv.copy_from_slice(data);
        Ok(())
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        if self.touches_l1(offset, bufv.len()) {
            let mut data = vec![0u8; bufv.len() as usize];
            bufv.copy_into_slice(&mut data);
            self.held().push((offset, data));
            return Ok(());
        }
        // SAFETY: the caller's guarantees for this request carry over unchanged.
        unsafe { self.inner.pure_writev(bufv, offset) }
    }

    unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        debug_assert!(!self.touches_l1(offset, length));
        // SAFETY: the caller's guarantees for this request carry over unchanged.
        unsafe { self.inner.pure_write_zeroes(offset, length) }
    }

    unsafe fn pure_write_allocated_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's guarantees for this request carry over unchanged.
        unsafe { self.inner.pure_write_allocated_zeroes(offset, length) }
    }

    unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's guarantees for this request carry over unchanged.
        unsafe { self.inner.pure_discard(offset, length) }
    }

    fn flush(&self) -> io::Result<()> {
        self.release()?;
        self.inner.flush()
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }

    fn settle_writes(&self) -> io::Result<()> {
        self.inner.settle_writes()
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        // SAFETY: the caller guarantees the on-disk state is consistent.
        unsafe { self.inner.invalidate_cache() }
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        self.inner.get_storage_helper()
    }

    fn resize(
        &self,
        new_size: u64,
        prealloc_mode: imago::storage::PreallocateMode,
    ) -> io::Result<()> {
        self.inner.resize(new_size, prealloc_mode)
    }
}

/// Copies the part of `bytes` (written at `at`) that falls inside `data` (read at `offset`).
fn overlay(data: &mut [u8], offset: u64, at: u64, bytes: &[u8]) {
    let start = at.max(offset);
    let end = (at + bytes.len() as u64).min(offset + data.len() as u64);
    if start >= end {
        return;
    }
    let n = (end - start) as usize;
    let (dst, src) = ((start - offset) as usize, (start - at) as usize);
    data[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
}

#[cfg(test)]
mod tests {
    use super::overlay;

    #[test]
    fn overlay_copies_only_the_overlap() {
        let mut data = vec![0u8; 8];
        overlay(&mut data, 100, 96, &[1; 8]);
        assert_eq!(data, [1, 1, 1, 1, 0, 0, 0, 0]);
        overlay(&mut data, 100, 106, &[2; 8]);
        assert_eq!(data, [1, 1, 1, 1, 0, 0, 2, 2]);
        overlay(&mut data, 100, 200, &[3; 8]);
        assert_eq!(data, [1, 1, 1, 1, 0, 0, 2, 2]);
    }
}
