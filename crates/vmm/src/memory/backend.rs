//! Where guest RAM lives: anonymous memory (the default), a memfd, or a file the operator
//! names. The last two are one shared file holding every RAM region at its own offset, so
//! that another process can map the same RAM from the file's descriptor: a local live
//! update hands it over instead of copying pages (docs/migration.md, "Local update").

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
#[cfg(target_os = "linux")]
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::config::MIB;
use crate::error::{Error, Result};
use crate::memory::GuestRegion;

/// `--memory-backend`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum MemoryBackend {
    /// Private anonymous memory, advised for transparent huge pages.
    #[default]
    Anon,
    /// A memfd: shared memory with no name in the file system.
    Memfd,
    /// A file the operator names (tmpfs, hugetlbfs): created, or empty when given.
    File(PathBuf),
}

impl MemoryBackend {
    /// Parses `anon`, `memfd` or `file:PATH`.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |reason: &str| Error::Option {
            option: "--memory-backend",
            value: text.to_string(),
            reason: reason.to_string(),
        };
        let backend = match text {
            "anon" => MemoryBackend::Anon,
            "memfd" => MemoryBackend::Memfd,
            _ => match text.strip_prefix("file:") {
                Some("") => return Err(bad("file: needs a path")),
                Some(path) => MemoryBackend::File(PathBuf::from(path)),
                None => return Err(bad("expected anon, memfd or file:PATH")),
            },
        };
        if backend != MemoryBackend::Anon && !cfg!(target_os = "linux") {
            return Err(bad("shared guest RAM is supported on Linux only"));
        }
        Ok(backend)
    }

    /// Whether guest RAM is a file another process can map.
    pub fn is_shared(&self) -> bool {
        *self != MemoryBackend::Anon
    }
}

/// One RAM region's place in the shared file, as a local update describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedRegion {
    pub guest_addr: u64,
    pub size: u64,
    /// Where the region starts in the file.
    pub offset: u64,
}

/// Guest RAM's shared file and where each region lies in it.
pub struct SharedRam {
    pub file: Arc<File>,
    pub regions: Vec<SharedRegion>,
}

/// The platform's RAM regions laid one after another in a file.
pub fn layout_for(size: u64) -> Vec<SharedRegion> {
    let mut offset = 0;
    boot::layout::ram_regions(size)
        .into_iter()
        .map(|(base, len)| {
            let region = SharedRegion {
                guest_addr: base.0,
                size: len,
                offset,
            };
            offset += len;
            region
        })
        .collect()
}

/// Creates the shared file of `backend` for `size` bytes of RAM, zero-filled.
pub fn create_file(backend: &MemoryBackend, size: u64) -> Result<Arc<File>> {
    let file = match backend {
        MemoryBackend::Anon => return Err(Error::Memory("anonymous guest RAM has no file".into())),
        MemoryBackend::Memfd => memfd()?,
        MemoryBackend::File(path) => open_empty(path)?,
    };
    file.set_len(size).map_err(|e| {
        Error::Memory(format!(
            "cannot size the guest RAM file to {} MiB: {e}",
            size / MIB
        ))
    })?;
    Ok(Arc::new(file))
}

#[cfg(target_os = "linux")]
fn memfd() -> Result<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor (or -1),
    // which the File below owns alone.
    let fd = unsafe { libc::memfd_create(c"ferrovm-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Memory(format!(
            "--memory-backend memfd: memfd_create: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: as above.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(not(target_os = "linux"))]
fn memfd() -> Result<File> {
    Err(Error::Memory("--memory-backend memfd: Linux only".into()))
}

/// Opens `path` for guest RAM: a new file, or an existing empty regular one (RAM starts
/// zeroed: a file holding data is refused rather than overwritten or shown to the guest).
fn open_empty(path: &std::path::Path) -> Result<File> {
    let refuse = |reason: String| Error::File {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| refuse(format!("cannot open for guest RAM: {e}")))?;
    let meta = file.metadata().map_err(|e| refuse(e.to_string()))?;
    if !meta.is_file() {
        return Err(refuse("guest RAM needs a regular file".into()));
    }
    if meta.len() != 0 {
        return Err(refuse(
            "holds data already: guest RAM starts zeroed; remove the file or name a new one".into(),
        ));
    }
    Ok(file)
}

/// The shared file of `memory` and its regions' places in it; `None` for anonymous RAM.
#[cfg(target_os = "linux")]
pub fn shared_ram_of(memory: &crate::memory::GuestMemory) -> Option<SharedRam> {
    let mut file = None;
    let mut regions = Vec::new();
    for region in memory.iter() {
        let backing = region.file_offset()?;
        file.get_or_insert_with(|| backing.arc().clone());
        regions.push(SharedRegion {
            guest_addr: region.start_addr().0,
            size: region.len(),
            offset: backing.start(),
        });
    }
    Some(SharedRam {
        file: file?,
        regions,
    })
}

#[cfg(not(target_os = "linux"))]
pub fn shared_ram_of(_memory: &crate::memory::GuestMemory) -> Option<SharedRam> {
    None
}

/// Maps one region of the shared file (`MAP_SHARED`: another process mapping the file sees
/// the same pages).
#[cfg(target_os = "linux")]
pub(crate) fn map_shared_region(file: &Arc<File>, region: &SharedRegion) -> Result<GuestRegion> {
    let len = usize::try_from(region.size).map_err(|_| Error::Memory("region too large".into()))?;
    let dirty = vm_memory::bitmap::AtomicBitmap::new(len, super::DIRTY_PAGE_SIZE);
    let mapping = vm_memory::mmap::MmapRegionBuilder::new_with_bitmap(len, dirty)
        .with_file_offset(vm_memory::FileOffset::from_arc(file.clone(), region.offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| {
            Error::Memory(format!(
                "mapping {} MiB of shared guest RAM: {e}",
                region.size / MIB
            ))
        })?;
    GuestRegion::new(mapping, GuestAddress(region.guest_addr))
        .ok_or_else(|| Error::Memory(format!("region at {:#x} overflows", region.guest_addr)))
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn map_shared_region(_file: &Arc<File>, _region: &SharedRegion) -> Result<GuestRegion> {
    Err(Error::Memory(
        "shared guest RAM is supported on Linux only".into(),
    ))
}

/// Checks that a shared file handed over by a local update lays out the RAM of a `size`
/// machine and is large enough for it.
pub fn check_handed_over(ram: &SharedRam, size: u64) -> Result<()> {
    let want: Vec<(u64, u64)> = layout_for(size)
        .iter()
        .map(|r| (r.guest_addr, r.size))
        .collect();
    let got: Vec<(u64, u64)> = ram.regions.iter().map(|r| (r.guest_addr, r.size)).collect();
    if want != got {
        return Err(Error::Migration(format!(
            "the source's guest RAM regions {got:x?} are not this machine's {want:x?} \
             (give the same --memory)"
        )));
    }
    let len = ram
        .file
        .metadata()
        .map_err(|e| Error::Migration(format!("the guest RAM file handed over: {e}")))?
        .len();
    match ram
        .regions
        .iter()
        .find(|r| r.offset.checked_add(r.size).is_none_or(|end| end > len))
    {
        Some(r) => Err(Error::Migration(format!(
            "the guest RAM file handed over is {len} bytes, too short for the region at {:#x}",
            r.guest_addr
        ))),
        None => Ok(()),
    }
}
