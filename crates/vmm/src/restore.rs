//! `run --restore FILE`: guest memory from a snapshot file.
//!
//! - Format version 2 (page images, written by `ctl snapshot`), by default on Linux:
//!   **verify on fault**. Guest RAM is registered with a userfaultfd ([`pager`]), the guest
//!   runs as soon as the frames are checked, and each page it (or KVM, a device, the VMM)
//!   first touches is read from the file, checked against its CRC and only then installed;
//!   a background prefetcher installs the rest the same way, after which the file is no
//!   longer needed. A bad page is never installed: the VM stops (exit status 2, one line
//!   naming the file and the page). `--restore-verify` checks all page data before the
//!   guest runs too. `--restore-eager` (and `--wired`, and hosts where guest RAM cannot be
//!   served lazily: bhyve) copies every page into guest RAM first, checking each.
//! - Where the kernel refuses a userfaultfd, the restore says so loudly and falls back to
//!   checking all page data first, then mapping the images over guest RAM (`MAP_PRIVATE`).
//! - Format version 1 (a stream, written by earlier builds): loaded eagerly, as before.
//!
//! Until the prefetch is complete (or, after the fallback, for as long as the VM runs), the
//! snapshot file must not be modified or truncated: a changed page fails its check and a
//! missing one is reported, both stopping the VM with an error naming the file. Deleting
//! or renaming it is fine.

// Elsewhere (bhyve) every restore is eager: the lazy machinery stays unused there.
#![cfg_attr(not(target_os = "linux"), allow(dead_code))]

#[cfg(target_os = "linux")]
mod pager;
#[cfg(target_os = "linux")]
pub mod postcopy;

/// Elsewhere there is no userfaultfd: post-copy is refused with a clear error.
#[cfg(not(target_os = "linux"))]
pub mod postcopy {
    use std::sync::Arc;

    /// Never made here.
    pub struct Postcopy;

    impl Postcopy {
        pub fn failure(&self) -> Option<String> {
            None
        }
    }

    pub fn start(
        _incoming: migration::PostcopyIncoming,
        _memory: &crate::memory::GuestMemory,
        _exit: &Arc<devices::exit::ExitRequest>,
    ) -> std::io::Result<Arc<Postcopy>> {
        Err(std::io::Error::other(
            "post-copy needs a userfaultfd, which only Linux has",
        ))
    }
}

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use devices::exit::{ExitReason, ExitRequest};
use migration::{Bitmap, MigrationConfig, SnapshotImage};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::memory::{self, GuestMemory};

/// How `--restore` brings guest memory back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreOptions {
    /// `--restore-verify`: check all page data before the guest runs.
    pub verify_first: bool,
    /// `--restore-eager` (or `--wired`): copy every page into anonymous guest RAM before the
    /// guest runs; the guest then no longer depends on the file.
    pub eager: bool,
    /// Verify-on-fault without the prefetcher: pages come in only when touched, and the VM
    /// needs the file for as long as it runs (`FERROVM_RESTORE_PREFETCH=off`, for tests of a
    /// file changed under a running guest).
    pub no_prefetch: bool,
}

impl RestoreOptions {
    /// Whether `FERROVM_RESTORE_PREFETCH=off` asks for [`RestoreOptions::no_prefetch`].
    pub fn no_prefetch_from_env() -> bool {
        std::env::var("FERROVM_RESTORE_PREFETCH").is_ok_and(|v| v == "off")
    }
}

/// Guest memory restored from a snapshot file.
pub struct LoadedMemory {
    /// The device/vCPU state blob.
    pub state: Vec<u8>,
    /// Set when guest RAM is served lazily from the file.
    pub lazy: Option<Arc<LazyRestore>>,
    /// How it was done and how long it took, for the log.
    pub figures: Value,
}

#[derive(Clone, Debug, PartialEq)]
enum Check {
    /// Pages are being installed on fault and by the prefetcher.
    Loading,
    /// Every data page is installed and verified: the file is no longer needed.
    Loaded,
    /// (Fallback) all page data verified, the images mapped from the file.
    Mapped,
    /// A page proved bad or unreadable; the VM was stopped.
    Failed(String),
    /// The prefetcher was stopped before the end (the VM is ending).
    Stopped,
}

/// The progress of a lazy restore, shared with the pager's threads.
pub struct Status {
    path: PathBuf,
    check: Mutex<Check>,
    changed: Condvar,
    exit: Arc<ExitRequest>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Status {
    fn new(path: &Path, check: Check, exit: &Arc<ExitRequest>) -> Arc<Self> {
        Arc::new(Status {
            path: path.to_path_buf(),
            check: Mutex::new(check),
            changed: Condvar::new(),
            exit: exit.clone(),
        })
    }

    /// Records the first failure and stops the VM. Recorded before the exit request, so
    /// the main loop finds the cause.
    fn fail(&self, reason: String) {
        {
            let mut check = lock(&self.check);
            if matches!(*check, Check::Failed(_)) {
                return;
            }
            log::debug!("lazy restore of {} failed: {reason}", self.path.display());
            *check = Check::Failed(format!("{reason}; the restored guest was stopped"));
        }
        self.exit.request(ExitReason::Failed);
        self.changed.notify_all();
    }

    fn failed(&self) -> bool {
        matches!(*lock(&self.check), Check::Failed(_))
    }

    /// Records that every data page is in, unless a page failed; true if recorded.
    fn loaded(&self, summary: String) -> bool {
        {
            let mut check = lock(&self.check);
            if matches!(*check, Check::Failed(_)) {
                return false;
            }
            *check = Check::Loaded;
        }
        self.changed.notify_all();
        log::info!("snapshot {}: {summary}", self.path.display());
        true
    }

    fn prefetch_stopped(&self) {
        let mut check = lock(&self.check);
        if *check == Check::Loading {
            *check = Check::Stopped;
            self.changed.notify_all();
        }
    }

    fn error(&self, reason: String) -> Error {
        Error::File {
            path: self.path.clone(),
            reason,
        }
    }
}

/// Guest RAM restored lazily from a snapshot file: the pages that hold the file's data (a
/// later snapshot or migration must send them, installed yet or not: reading them through
/// guest memory brings them in, verified), and the state of the restore.
pub struct LazyRestore {
    status: Arc<Status>,
    data_pages: Bitmap,
    #[cfg(target_os = "linux")]
    threads: Mutex<Option<pager::PagerThreads>>,
}

impl LazyRestore {
    fn new(status: Arc<Status>, data_pages: Bitmap) -> Self {
        LazyRestore {
            status,
            data_pages,
            #[cfg(target_os = "linux")]
            threads: Mutex::new(None),
        }
    }

    /// The pages of guest RAM that hold the snapshot file's data.
    pub fn data_pages(&self) -> &Bitmap {
        &self.data_pages
    }

    /// Fails if a page of the snapshot proved bad: the guest is being stopped, and a
    /// snapshot or migration of it must not go on. Pages not installed yet need no wait: a
    /// snapshot or migration reads them through guest memory, which installs them verified.
    pub fn check_intact(&self) -> Result<()> {
        match &*lock(&self.status.check) {
            Check::Failed(reason) => Err(self.status.error(reason.clone())),
            _ => Ok(()),
        }
    }

    /// The error that stopped the guest, if the page data proved bad.
    pub fn failure(&self) -> Option<Error> {
        self.check_intact().err()
    }

    /// Waits up to `limit` until every data page is installed (or the file was mapped after
    /// a verification); false if that did not happen in time. Fails if a page proved bad.
    #[cfg(test)]
    pub fn wait_loaded(&self, limit: std::time::Duration) -> Result<bool> {
        let deadline = Instant::now() + limit;
        let mut check = lock(&self.status.check);
        loop {
            match &*check {
                Check::Loaded | Check::Mapped => return Ok(true),
                Check::Failed(reason) => return Err(self.status.error(reason.clone())),
                Check::Stopped => return Ok(false),
                Check::Loading => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            check = self
                .status
                .changed
                .wait_timeout(check, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops the prefetcher (the VM is ending) and waits for it. Faults are still served,
    /// verified, until the process exits.
    pub fn stop(&self) {
        #[cfg(target_os = "linux")]
        if let Some(mut t) = lock(&self.threads).take() {
            t.stop();
        }
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// One region of guest RAM as the userfaultfd handlers see it.
struct RamSpan {
    /// Its host address.
    host: usize,
    /// Its guest-physical address.
    guest: u64,
    pages: u64,
}

/// The regions of guest RAM, in order.
fn ram_spans(memory: &GuestMemory) -> std::io::Result<Vec<RamSpan>> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
    memory
        .iter()
        .map(|r| {
            let host = r
                .get_host_address(MemoryRegionAddress(0))
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            Ok(RamSpan {
                host: host as usize,
                guest: r.start_addr().0,
                pages: r.len() / migration::PAGE_SIZE,
            })
        })
        .collect()
}

/// The region and page of a host address inside guest RAM.
fn locate_host(spans: &[RamSpan], addr: usize) -> Option<(usize, u64)> {
    spans.iter().enumerate().find_map(|(i, s)| {
        let off = addr.checked_sub(s.host)? as u64 / migration::PAGE_SIZE;
        (off < s.pages).then_some((i, off))
    })
}

/// One bit per page of guest RAM, each set at most once: which thread installs a page.
struct PageBits(Vec<Vec<std::sync::atomic::AtomicU64>>);

impl PageBits {
    fn new(spans: &[RamSpan]) -> PageBits {
        let words = |s: &RamSpan| {
            (0..migration::words_for(s.pages))
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect()
        };
        PageBits(spans.iter().map(words).collect())
    }

    /// Sets the bit of `page`; false if it was set already.
    fn claim(&self, region: usize, page: u64) -> bool {
        let bit = 1u64 << (page % 64);
        let word = &self.0[region][(page / 64) as usize];
        word.fetch_or(bit, std::sync::atomic::Ordering::AcqRel) & bit == 0
    }

    fn is_set(&self, region: usize, page: u64) -> bool {
        let word = &self.0[region][(page / 64) as usize];
        word.load(std::sync::atomic::Ordering::Acquire) & (1u64 << (page % 64)) != 0
    }
}

/// Restores guest memory from the snapshot at `path` (see the module documentation).
/// `memory` must be the machine's fresh guest RAM, already registered with the VM, with no
/// vCPU running. `exit` ends the VM if a page proves bad while the guest runs.
pub fn load(
    path: &Path,
    memory: &GuestMemory,
    expected: &MigrationConfig,
    options: RestoreOptions,
    exit: &Arc<ExitRequest>,
) -> Result<LoadedMemory> {
    let t0 = Instant::now();
    let bad = |e: migration::Error| Error::File {
        path: path.to_path_buf(),
        reason: format!("bad snapshot: {e}"),
    };
    let file = File::open(path).map_err(|e| Error::File {
        path: path.to_path_buf(),
        reason: format!("cannot open snapshot: {e}"),
    })?;
    if migration::snapshot_version(&file).map_err(bad)? == 1 {
        // An earlier build's snapshot: a stream, read and checked page by page.
        let restored =
            migration::restore_from(memory, BufReader::with_capacity(1 << 20, file), expected)
                .map_err(bad)?;
        return Ok(LoadedMemory {
            state: restored.state,
            lazy: None,
            figures: json!({"format": 1, "memory": "eager", "load_ms": ms(t0)}),
        });
    }
    let image = SnapshotImage::open(file, expected).map_err(bad)?;
    let open_ms = ms(t0);
    if options.verify_first {
        let t = Instant::now();
        image.verify(&AtomicBool::new(false)).map_err(bad)?;
        log::info!("snapshot page data verified in {:.1} ms", ms(t));
    }
    if options.eager || !memory::can_map_files() {
        let report = image.load(memory).map_err(bad)?;
        return Ok(LoadedMemory {
            state: image.state().to_vec(),
            lazy: None,
            figures: json!({
                "format": 2, "memory": "eager", "pages": report.pages,
                "open_ms": open_ms, "load_ms": ms(t0),
            }),
        });
    }
    let figures = json!({
        "format": 2, "pages_in_file": image.data_page_count(),
        "verified_first": options.verify_first, "open_ms": open_ms,
    });
    load_lazily(path, image, memory, options, exit, figures, t0)
}

/// The lazy restore: verify on fault, or (no userfaultfd) check everything, then map.
fn load_lazily(
    path: &Path,
    image: SnapshotImage,
    memory: &GuestMemory,
    options: RestoreOptions,
    exit: &Arc<ExitRequest>,
    figures: Value,
    t0: Instant,
) -> Result<LoadedMemory> {
    #[cfg(target_os = "linux")]
    let image = match serve_on_fault(path, image, memory, exit, !options.no_prefetch)? {
        OnFault::Serving(state, lazy) => {
            let figures = with(figures, "verify-on-fault", t0);
            return Ok(LoadedMemory {
                state,
                lazy: Some(lazy),
                figures,
            });
        }
        OnFault::Unavailable(image, e) => {
            log::warn!(
                "userfaultfd is not available ({e}): verify-on-fault is off; checking all \
                 page data of {} before the guest runs, then mapping it",
                path.display()
            );
            *image
        }
    };
    let bad = |e: migration::Error| Error::File {
        path: path.to_path_buf(),
        reason: format!("bad snapshot: {e}"),
    };
    if !options.verify_first {
        image.verify(&AtomicBool::new(false)).map_err(bad)?;
    }
    image.map_into(memory).map_err(bad)?;
    let lazy = LazyRestore::new(Status::new(path, Check::Mapped, exit), image.data_pages());
    Ok(LoadedMemory {
        state: image.state().to_vec(),
        lazy: Some(Arc::new(lazy)),
        figures: with(figures, "mapped after verification", t0),
    })
}

fn with(mut figures: Value, memory: &str, t0: Instant) -> Value {
    figures["memory"] = json!(memory);
    figures["load_ms"] = json!(ms(t0));
    figures
}

/// What [`serve_on_fault`] did.
#[cfg(target_os = "linux")]
enum OnFault {
    /// Guest RAM is served by the pager: the state blob and the restore.
    Serving(Vec<u8>, Arc<LazyRestore>),
    /// No userfaultfd here: the image back, for the fallback, and why.
    Unavailable(Box<SnapshotImage>, std::io::Error),
}

/// Registers guest RAM with a userfaultfd and starts the pager.
#[cfg(target_os = "linux")]
fn serve_on_fault(
    path: &Path,
    image: SnapshotImage,
    memory: &GuestMemory,
    exit: &Arc<ExitRequest>,
    prefetch: bool,
) -> Result<OnFault> {
    let uffd = match pager::open_userfaultfd() {
        Ok(u) => u,
        Err(e) => return Ok(OnFault::Unavailable(Box::new(image), e)),
    };
    if let Err(e) = pager::register(&uffd, memory) {
        // Dropping the userfaultfd ends the registration of what was registered.
        return Ok(OnFault::Unavailable(Box::new(image), e));
    }
    let state = image.state().to_vec();
    let status = Status::new(path, Check::Loading, exit);
    let lazy = Arc::new(LazyRestore::new(status.clone(), image.data_pages()));
    // Past the registration, no fallback: guest RAM must not run unserved.
    let threads = pager::Pager::new(uffd, image, memory)
        .and_then(|p| p.start(&status, prefetch))
        .map_err(|e| Error::Control(format!("cannot start the snapshot pager: {e}")))?;
    *lock(&lazy.threads) = Some(threads);
    Ok(OnFault::Serving(state, lazy))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::time::Duration;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

    const MIB: u64 = 1 << 20;

    fn guest() -> (GuestMemory, MigrationConfig) {
        let mem = memory::create_guest_memory(16 * MIB, false).unwrap();
        let ram_regions = mem
            .iter()
            .map(|r| migration::RamRange {
                guest_addr: r.start_addr().0,
                size: r.len(),
            })
            .collect();
        let cfg = MigrationConfig {
            memory_size: 16 * MIB,
            vcpus: 1,
            irqchip: "kernel".into(),
            ram_regions,
            extra: Default::default(),
            devices: None,
        };
        (mem, cfg)
    }

    fn fill(mem: &GuestMemory) {
        for (i, a) in [0u64, 0x5000, 0x20_0000, 15 * MIB].into_iter().enumerate() {
            mem.write_slice(&[i as u8 + 1; 4096], GuestAddress(a))
                .unwrap();
        }
    }

    fn same(a: &GuestMemory, b: &GuestMemory) -> bool {
        let mut x = vec![0u8; 16 * MIB as usize];
        let mut y = x.clone();
        a.read_slice(&mut x, GuestAddress(0)).unwrap();
        b.read_slice(&mut y, GuestAddress(0)).unwrap();
        x == y
    }

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ferrovm-restore-{}-{name}", std::process::id()))
    }

    fn write_v2(name: &str) -> (PathBuf, GuestMemory, MigrationConfig) {
        let (src, cfg) = guest();
        fill(&src);
        let path = scratch(name);
        let file = File::create(&path).unwrap();
        migration::snapshot_file(&src, &cfg, b"state", &file).unwrap();
        (path, src, cfg)
    }

    fn exit() -> Arc<ExitRequest> {
        Arc::new(ExitRequest::new().unwrap())
    }

    /// Reads one byte of guest memory on a thread of its own (a fault the pager serves);
    /// `None` if it is still waiting after `limit` (the thread is then left blocked).
    fn read_on_thread(mem: &Arc<GuestMemory>, addr: u64, limit: Duration) -> Option<u8> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mem = mem.clone();
        std::thread::spawn(move || {
            let _ = tx.send(mem.read_obj::<u8>(GuestAddress(addr)).unwrap());
        });
        rx.recv_timeout(limit).ok()
    }

    fn on_demand() -> RestoreOptions {
        RestoreOptions {
            no_prefetch: true,
            ..Default::default()
        }
    }

    #[test]
    fn version_1_snapshots_load_eagerly() {
        let (src, cfg) = guest();
        fill(&src);
        let path = scratch("v1");
        migration::snapshot(&src, &cfg, b"state", File::create(&path).unwrap()).unwrap();
        let (dst, _) = guest();
        let loaded = load(&path, &dst, &cfg, RestoreOptions::default(), &exit()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(loaded.lazy.is_none());
        assert_eq!(loaded.state, b"state");
        assert_eq!(loaded.figures["format"], 1);
        assert!(same(&src, &dst));
    }

    #[test]
    fn version_2_is_served_on_fault_then_prefetched() {
        let (path, src, cfg) = write_v2("lazy");
        let (dst, _) = guest();
        let exit = exit();
        let loaded = load(&path, &dst, &cfg, RestoreOptions::default(), &exit).unwrap();
        let lazy = loaded.lazy.expect("served lazily");
        assert_eq!(loaded.figures["memory"], "verify-on-fault");
        assert_eq!(lazy.data_pages().count(), 4);
        // Read from this thread at once: faults served, verified, whether the prefetcher
        // got there first or not.
        assert!(same(&src, &dst));
        assert!(lazy.wait_loaded(Duration::from_secs(20)).unwrap());
        // The file can go now: every page is in.
        std::fs::remove_file(&path).unwrap();
        assert!(same(&src, &dst));
        lazy.stop();
        assert_eq!(exit.reason(), None);
        assert!(lazy.failure().is_none());
    }

    #[test]
    fn on_demand_pages_come_from_the_file_verified() {
        let (path, src, cfg) = write_v2("demand");
        let (dst, _) = guest();
        let exit = exit();
        let lazy = load(&path, &dst, &cfg, on_demand(), &exit)
            .unwrap()
            .lazy
            .unwrap();
        assert!(!lazy.wait_loaded(Duration::from_millis(50)).unwrap());
        // Data pages, zero pages (read and written) and pages the guest writes first.
        let mut b = [0u8; 4096];
        dst.read_slice(&mut b, GuestAddress(0x5000)).unwrap();
        assert_eq!(b, [2u8; 4096]);
        dst.read_slice(&mut b, GuestAddress(0x9000)).unwrap();
        assert_eq!(b, [0u8; 4096]);
        dst.write_slice(&[9u8; 4096], GuestAddress(0x30_0000))
            .unwrap();
        dst.write_obj(7u8, GuestAddress(0x20_0010)).unwrap();
        dst.read_slice(&mut b, GuestAddress(0x20_0000)).unwrap();
        assert_eq!(&b[..0x10], &[3u8; 0x10]);
        assert_eq!(b[0x10], 7);
        dst.read_slice(&mut b, GuestAddress(0x30_0000)).unwrap();
        assert_eq!(b, [9u8; 4096]);
        let mut x = vec![0u8; 4096];
        src.read_slice(&mut x, GuestAddress(15 * MIB)).unwrap();
        dst.read_slice(&mut b, GuestAddress(15 * MIB)).unwrap();
        assert_eq!(&b[..], &x[..]);
        assert_eq!(exit.reason(), None);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn eager_and_verified_restores() {
        let (path, src, cfg) = write_v2("eager");
        let (dst, _) = guest();
        let eager = RestoreOptions {
            eager: true,
            ..Default::default()
        };
        let loaded = load(&path, &dst, &cfg, eager, &exit()).unwrap();
        assert!(loaded.lazy.is_none());
        assert!(same(&src, &dst));
        let (dst, _) = guest();
        let verify = RestoreOptions {
            verify_first: true,
            ..Default::default()
        };
        let loaded = load(&path, &dst, &cfg, verify, &exit()).unwrap();
        assert!(same(&src, &dst));
        assert!(loaded
            .lazy
            .unwrap()
            .wait_loaded(Duration::from_secs(20))
            .unwrap());
        std::fs::remove_file(&path).unwrap();
    }

    fn corrupt_copy(name: &str) -> (PathBuf, MigrationConfig, u64) {
        let (path, _, cfg) = write_v2(name);
        let image = SnapshotImage::open(File::open(&path).unwrap(), &cfg).unwrap();
        let image0 = image.images()[0].offset;
        let f = File::options().write(true).open(&path).unwrap();
        f.write_all_at(&[0xee], image0 + 0x20_0000 + 9).unwrap();
        (path, cfg, image0)
    }

    #[test]
    fn a_corrupt_page_is_never_installed() {
        let (path, cfg, _) = corrupt_copy("corrupt");
        // On demand: the good pages come in; a read of the bad one stops the VM and waits.
        let dst = Arc::new(guest().0);
        let exit = exit();
        let lazy = load(&path, &dst, &cfg, on_demand(), &exit)
            .unwrap()
            .lazy
            .unwrap();
        assert_eq!(
            read_on_thread(&dst, 0x5000, Duration::from_secs(10)),
            Some(2)
        );
        assert_eq!(
            read_on_thread(&dst, 0x20_0000, Duration::from_millis(500)),
            None
        );
        assert_eq!(
            exit.wait_timeout(Duration::from_secs(10)),
            Some(ExitReason::Failed)
        );
        let e = lazy.failure().unwrap().to_string();
        assert!(
            e.contains("guest page 0x200000")
                && e.contains("fails its checksum")
                && e.contains("the restored guest was stopped"),
            "{e}"
        );
        assert!(lazy.check_intact().is_err());
        // Still waiting: the page never became visible.
        assert_eq!(
            read_on_thread(&dst, 0x20_0000, Duration::from_millis(200)),
            None
        );
        // The blocked readers hold the memory; it stays mapped until the test process ends.
        std::mem::forget(dst);

        // With the prefetcher, it finds the page without any fault.
        let (dst, _) = guest();
        let exit2 = super::tests::exit();
        let lazy = load(&path, &dst, &cfg, RestoreOptions::default(), &exit2)
            .unwrap()
            .lazy
            .unwrap();
        let e = lazy.wait_loaded(Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("guest page 0x200000"), "{e}");
        assert_eq!(exit2.reason(), Some(ExitReason::Failed));
        lazy.stop();
        std::mem::forget(dst);

        for options in [
            RestoreOptions {
                verify_first: true,
                ..Default::default()
            },
            RestoreOptions {
                eager: true,
                ..Default::default()
            },
        ] {
            let (dst, _) = guest();
            let e = load(&path, &dst, &cfg, options, &exit).err().unwrap();
            assert!(e.to_string().contains("fails its checksum"), "{e}");
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_file_truncated_under_the_guest_stops_it() {
        let (path, _, cfg) = write_v2("truncated");
        let image0 = SnapshotImage::open(File::open(&path).unwrap(), &cfg)
            .unwrap()
            .images()[0]
            .offset;
        let dst = Arc::new(guest().0);
        let exit = exit();
        let lazy = load(&path, &dst, &cfg, on_demand(), &exit)
            .unwrap()
            .lazy
            .unwrap();
        assert_eq!(read_on_thread(&dst, 0, Duration::from_secs(10)), Some(1));
        assert_eq!(
            read_on_thread(&dst, 0x5000, Duration::from_secs(10)),
            Some(2)
        );
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(image0)
            .unwrap();
        // Pages in already stay; 15 MiB is not in, and past the end of the file now.
        assert_eq!(
            read_on_thread(&dst, 0x5000, Duration::from_secs(10)),
            Some(2)
        );
        assert_eq!(
            read_on_thread(&dst, 15 * MIB, Duration::from_millis(500)),
            None
        );
        assert_eq!(
            exit.wait_timeout(Duration::from_secs(10)),
            Some(ExitReason::Failed)
        );
        let e = lazy.failure().unwrap().to_string();
        assert!(
            e.contains(&path.display().to_string())
                && e.contains("guest page 0xf00000")
                && e.contains("truncated"),
            "{e}"
        );
        std::mem::forget(dst);
        std::fs::remove_file(&path).unwrap();
    }
}
