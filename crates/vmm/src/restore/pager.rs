//! Verify-on-fault for lazy restores (Linux): guest RAM is registered with a userfaultfd in
//! missing mode, so no page of it becomes visible before this pager has installed it — not
//! to a vCPU (KVM's MMU faults the page in through the same host page tables), not to a
//! device thread, not to the snapshot and migration code. A page is installed only after
//! its data was read from the snapshot file with `pread` and matched its CRC-32
//! ([`SnapshotImage::read_verified`]); pages the snapshot holds no data for are installed as
//! zero, whatever the file stores there.
//!
//! The pager's threads share the work and never touch guest memory themselves (a fault of
//! their own on registered memory would wait for themselves): `snapshot-faults` serves
//! faults, each with the data pages of the 64 KiB block around the faulting page (up to
//! 1 MiB ahead for faults in order), and the `snapshot-prefetch-N` workers install every
//! remaining data page in file order, so that the guest stops depending on the file. A page
//! is installed by whichever thread claims it first (an atomic bit per page); a thread
//! faulting on a page another one has claimed is woken by that thread's `UFFDIO_COPY`. Once
//! every data page is in, the userfaultfd is closed: the registration ends, the remaining
//! (zero) pages are ordinary anonymous memory again, and the file is closed.
//!
//! A bad page (CRC mismatch, a page past the end of a truncated file, a read error) is
//! never installed: the pager records the failure, which stops the VM, and keeps the
//! userfaultfd open for as long as the process lives, so whatever touches that page waits
//! until the VMM exits rather than see wrong data.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use devices::exit::Waker;
use migration::{Bitmap, SnapshotImage, PAGE_SIZE};
use userfaultfd::{Event, IoctlFlags, ReadWrite, Uffd, UffdBuilder};

use super::Status;
use super::{locate_host, PageBits, RamSpan};
use crate::memory::GuestMemory;

/// Pages installed around a faulting page: the data pages of its aligned 64 KiB block, or
/// more when faults come in sequence (see [`Readahead`]).
const FAULT_BLOCK: u64 = 16;
/// The most pages one fault brings in (1 MiB), for a guest reading its memory in order.
const MAX_FAULT_PAGES: u64 = 256;
/// Pages read and installed per prefetch step (1 MiB): short, so that a fault on a page
/// the prefetcher has claimed waits little.
const PREFETCH_CHUNK: u64 = 256;
/// Prefetch workers at most.
const MAX_PREFETCH_WORKERS: usize = 2;
/// The prefetch workers' nice value: below the vCPUs and the fault thread.
const PREFETCH_NICE: libc::c_int = 10;
const PAGE: usize = PAGE_SIZE as usize;
/// A zero page for write faults on pages without data (a copy saves the guest the second,
/// copy-on-write fault a mapped zero page would take).
static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

/// What the pager did, for the log.
#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    fault_pages: AtomicU64,
    zero_pages: AtomicU64,
    prefetched_pages: AtomicU64,
}

/// Serves guest RAM from a snapshot file through a userfaultfd (see the module
/// documentation). Dropped — closing the userfaultfd and the file — once every data page is
/// installed and both threads are done with it.
pub struct Pager {
    uffd: Uffd,
    image: SnapshotImage,
    spans: Vec<RamSpan>,
    data: Bitmap,
    /// One bit per page of each region: set by the thread that installs the page.
    claimed: PageBits,
    /// Woken when the prefetch is complete: the fault thread then lets go of the pager.
    loaded: Waker,
    counters: Counters,
}

/// The handle the VMM keeps: stops the prefetcher.
pub struct PagerThreads {
    stop: Arc<AtomicBool>,
    prefetch: Vec<std::thread::JoinHandle<()>>,
}

impl PagerThreads {
    /// Stops the prefetcher and waits for it. The fault thread goes on serving faults (with
    /// verified pages) until the process exits: memory must stay correct for whatever still
    /// reads it while the VMM ends.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.prefetch.drain(..) {
            let _ = t.join();
        }
    }
}

/// Whether a userfaultfd can be had here (`FERROVM_USERFAULTFD=off` says no, to test the
/// fallback), and a reason when not.
pub fn open_userfaultfd() -> io::Result<Uffd> {
    if std::env::var("FERROVM_USERFAULTFD").is_ok_and(|v| v == "off") {
        return Err(io::Error::other("turned off by FERROVM_USERFAULTFD=off"));
    }
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        // Faults from the kernel too: KVM's and the VMM's system calls on guest memory.
        .user_mode_only(false)
        .require_ioctls(IoctlFlags::API | IoctlFlags::REGISTER | IoctlFlags::UNREGISTER)
        .create()
        .map_err(uffd_error)
}

pub(super) fn uffd_error(e: userfaultfd::Error) -> io::Error {
    match e {
        userfaultfd::Error::SystemError(errno)
        | userfaultfd::Error::CopyFailed(errno)
        | userfaultfd::Error::ZeropageFailed(errno) => io::Error::from_raw_os_error(errno as i32),
        userfaultfd::Error::OpenDevUserfaultfd(e) => e,
        other => io::Error::other(other.to_string()),
    }
}

/// Registers all of `memory` with `uffd` in missing mode. Any page already present (the
/// machine's set-up may have written some) is dropped first, so that every page faults.
/// No vCPU may run yet.
pub fn register(uffd: &Uffd, memory: &GuestMemory) -> io::Result<()> {
    for span in super::ram_spans(memory)? {
        let (host, size) = (span.host, (span.pages * PAGE_SIZE) as usize);
        // SAFETY: `host..host + size` is one region of guest RAM, a private anonymous mapping
        // that `memory` owns and keeps mapped; no vCPU runs and nothing else uses it during
        // the restore, and its contents are about to be replaced by the snapshot's anyway.
        // MADV_DONTNEED only drops pages (they read as missing afterwards).
        if unsafe { libc::madvise(host as *mut libc::c_void, size, libc::MADV_DONTNEED) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let ioctls = uffd
            .register(host as *mut libc::c_void, size)
            .map_err(uffd_error)?;
        let needed = IoctlFlags::COPY | IoctlFlags::ZEROPAGE | IoctlFlags::WAKE;
        if !ioctls.contains(needed) {
            return Err(io::Error::other(format!(
                "the kernel offers {ioctls:?} on guest RAM, not {needed:?}"
            )));
        }
    }
    Ok(())
}

impl Pager {
    /// A pager over `memory`, already registered with `uffd` ([`register`]).
    pub fn new(uffd: Uffd, image: SnapshotImage, memory: &GuestMemory) -> io::Result<Self> {
        let spans = super::ram_spans(memory)?;
        let claimed = PageBits::new(&spans);
        Ok(Pager {
            data: image.data_pages(),
            uffd,
            image,
            spans,
            claimed,
            loaded: Waker::new()?,
            counters: Counters::default(),
        })
    }

    /// Starts the fault thread and, unless `prefetch` is false, the prefetcher: one worker
    /// per host CPU, at most [`MAX_PREFETCH_WORKERS`] (while the guest waits for its memory,
    /// copying it in is all there is to do).
    pub fn start(self, status: &Arc<Status>, prefetch: bool) -> io::Result<PagerThreads> {
        let pager = Arc::new(self);
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (pager.clone(), status.clone());
        sandbox::spawn(sandbox::Role::RestoreFaults, "snapshot-faults", move || {
            serve_faults(p, &s)
        })?;
        let workers = if prefetch {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_PREFETCH_WORKERS))
        } else {
            0
        };
        let shared = Arc::new(Prefetch {
            stop: stop.clone(),
            workers,
            finished: AtomicU64::new(0),
            started: Instant::now(),
        });
        let mut threads = PagerThreads {
            stop,
            prefetch: Vec::new(),
        };
        for index in 0..workers {
            let (p, s, shared) = (pager.clone(), status.clone(), shared.clone());
            let spawned = sandbox::spawn(
                sandbox::Role::RestoreFaults,
                format!("snapshot-prefetch-{index}"),
                move || prefetch_all(p, &s, &shared, index),
            );
            match spawned {
                Ok(t) => threads.prefetch.push(t),
                Err(e) => {
                    threads.stop();
                    return Err(e);
                }
            }
        }
        Ok(threads)
    }

    /// Claims a page for installing; false if a thread claimed it before.
    fn claim(&self, region: usize, page: u64) -> bool {
        self.claimed.claim(region, page)
    }

    /// Claims the data pages of `first..end` that no thread claimed yet, and installs them
    /// in runs, verified; `buf` holds at least `end - first` pages.
    fn install_data(&self, region: usize, first: u64, end: u64, buf: &mut [u8]) -> Result<u64> {
        let mut installed = 0;
        let mut run: Option<(u64, u64)> = None;
        for p in first..=end {
            let mine = p < end && self.data.get(region, p) && self.claim(region, p);
            match (&mut run, mine) {
                (Some((_, n)), true) => *n += 1,
                (None, true) => run = Some((p, 1)),
                (Some((s, n)), false) => {
                    let len = *n as usize * PAGE;
                    let data = &mut buf[..len];
                    self.image
                        .read_verified(region, *s, data)
                        .map_err(PageError::Snapshot)?;
                    self.copy(region, *s, data)?;
                    installed += *n;
                    run = None;
                }
                (None, false) => {}
            }
        }
        Ok(installed)
    }

    fn host_addr(&self, region: usize, page: u64) -> usize {
        self.spans[region].host + (page * PAGE_SIZE) as usize
    }

    /// `UFFDIO_COPY` of `data` to pages `page..` of `region`, waking whoever waits on them.
    fn copy(&self, region: usize, page: u64, data: &[u8]) -> Result<()> {
        let dst = self.host_addr(region, page);
        let mut done = 0;
        let mut retries = 0;
        while done < data.len() {
            // SAFETY: `data[done..]` is this thread's own buffer (never guest memory), and
            // `dst + done..` lies inside one registered region of guest RAM (the pages come
            // from `locate`, the data runs or a fault block, all clipped to the region). The
            // kernel copies into pages that are missing, atomically, without touching any
            // page present already (EEXIST); nothing in this process holds a reference to
            // those guest bytes.
            let r = unsafe {
                self.uffd.copy(
                    data[done..].as_ptr().cast(),
                    (dst + done) as *mut libc::c_void,
                    data.len() - done,
                    true,
                )
            };
            match r {
                Ok(n) if n > 0 => done += n.min(data.len() - done),
                // Partly done, or the address space was changing (fork, mremap): go on.
                Err(userfaultfd::Error::PartiallyCopied(n)) if retries < 1000 => {
                    retries += 1;
                    if n <= data.len() - done {
                        done += n;
                    }
                }
                Ok(_) => {
                    return Err(PageError::Install {
                        addr: self.guest_addr(region, page) + done as u64,
                        source: io::Error::other("UFFDIO_COPY copied nothing"),
                    })
                }
                Err(e) => {
                    let e = uffd_error(e);
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(PageError::Install {
                            addr: self.guest_addr(region, page) + done as u64,
                            source: e,
                        });
                    }
                    // Present already (nothing but this pager installs pages, so this is not
                    // expected): leave it, and wake whoever may wait on it.
                    log::warn!(
                        "guest page at {:#x} was present before the pager installed it",
                        dst + done
                    );
                    let _ = self.uffd.wake((dst + done) as *mut libc::c_void, PAGE);
                    done += PAGE;
                }
            }
        }
        Ok(())
    }

    /// Installs a zero page for a fault on a page without data: a private zero page for a
    /// write, the shared zero page for a read.
    fn install_zero(&self, region: usize, page: u64, write: bool) -> Result<()> {
        if write {
            return self.copy(region, page, &ZERO_PAGE);
        }
        let dst = self.host_addr(region, page) as *mut libc::c_void;
        // SAFETY: `dst` is one page of a registered region of guest RAM (from `locate`); the
        // kernel maps the zero page there only if the page is missing.
        match unsafe { self.uffd.zeropage(dst, PAGE, true) } {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = uffd_error(e);
                match e.raw_os_error() {
                    // Present already, or the address space was changing (the fault then
                    // comes again): wake whoever waits.
                    Some(libc::EEXIST) | Some(libc::EAGAIN) => {
                        let _ = self.uffd.wake(dst, PAGE);
                        Ok(())
                    }
                    _ => Err(PageError::Install {
                        addr: self.guest_addr(region, page),
                        source: e,
                    }),
                }
            }
        }
    }

    fn guest_addr(&self, region: usize, page: u64) -> u64 {
        self.image.images()[region].guest_addr + page * PAGE_SIZE
    }

    /// Serves one fault: the unclaimed data pages of the faulting page's 64 KiB block (or
    /// of a longer window, for faults in order), and the page itself as zero if it holds no
    /// data. A page another thread has claimed is left to it: its copy wakes the faulting
    /// thread.
    fn serve(&self, addr: usize, write: bool, ahead: &mut Readahead, buf: &mut [u8]) -> Result<()> {
        let Some((region, page)) = locate_host(&self.spans, addr) else {
            log::warn!("userfaultfd: a fault at {addr:#x}, outside guest RAM");
            return Ok(());
        };
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        let (first, end) = ahead.window(region, page, self.spans[region].pages);
        let n = self.install_data(region, first, end, buf)?;
        self.counters.fault_pages.fetch_add(n, Ordering::Relaxed);
        if !self.data.get(region, page) && self.claim(region, page) {
            self.install_zero(region, page, write)?;
            self.counters.zero_pages.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The fault thread's read-ahead: a fault just past the pages the previous one brought in
/// doubles the next window (up to [`MAX_FAULT_PAGES`]); any other fault resets it to one
/// block. A guest reading its memory in order then pays a fault per 1 MiB, not per 64 KiB.
#[derive(Default)]
struct Readahead {
    region: usize,
    next: u64,
    pages: u64,
}

impl Readahead {
    /// The pages to bring in for a fault on `page` of `region` (`limit` pages long).
    fn window(&mut self, region: usize, page: u64, limit: u64) -> (u64, u64) {
        let first = page / FAULT_BLOCK * FAULT_BLOCK;
        let in_order =
            region == self.region && first >= self.next && first < self.next + FAULT_BLOCK;
        self.pages = if in_order {
            (self.pages * 2).clamp(FAULT_BLOCK, MAX_FAULT_PAGES)
        } else {
            FAULT_BLOCK
        };
        let end = (first + self.pages).min(limit);
        self.region = region;
        self.next = end;
        (first, end)
    }
}

/// Why a page could not be installed.
enum PageError {
    /// The snapshot's data for it is bad or unreadable.
    Snapshot(migration::Error),
    /// The kernel refused to install it.
    Install { addr: u64, source: io::Error },
}

impl std::fmt::Display for PageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PageError::Snapshot(e) => write!(f, "bad snapshot: {e}"),
            PageError::Install { addr, source } => {
                write!(f, "cannot install guest page {addr:#x}: {source}")
            }
        }
    }
}

type Result<T> = std::result::Result<T, PageError>;

/// Waits until `fd` or `other` is readable; true for `other`.
pub(super) fn wait_readable(fd: i32, other: i32) -> io::Result<bool> {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: other,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the whole call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r >= 0 {
            return Ok(fds[1].revents != 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The fault thread: serves faults until the prefetch is complete, then lets go of the
/// pager (the last one to do so closes the userfaultfd). After a failure it goes on serving
/// the other pages, and the bad one never.
fn serve_faults(pager: Arc<Pager>, status: &Status) {
    let mut buf = vec![0u8; MAX_FAULT_PAGES as usize * PAGE];
    let mut ahead = Readahead::default();
    let fd = pager.uffd.as_raw_fd();
    loop {
        match wait_readable(fd, pager.loaded.poll_fd()) {
            Ok(false) => {}
            // Every data page is in, unless a fault of this thread's failed meanwhile: then
            // the userfaultfd stays open, or the bad page would fill with zeroes.
            Ok(true) if status.failed() => return std::mem::forget(pager),
            Ok(true) => return,
            Err(e) => return hold_forever(pager, status, format!("polling the userfaultfd: {e}")),
        }
        loop {
            match pager.uffd.read_event() {
                Ok(Some(Event::Pagefault { addr, rw, .. })) => {
                    let write = rw == ReadWrite::Write;
                    if let Err(e) = pager.serve(addr as usize, write, &mut ahead, &mut buf) {
                        status.fail(e.to_string());
                    }
                }
                Ok(Some(other)) => log::warn!("userfaultfd: unexpected event {other:?}"),
                Ok(None) => break,
                Err(e) => {
                    let e = uffd_error(e);
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return hold_forever(pager, status, format!("reading the userfaultfd: {e}"));
                }
            }
        }
    }
}

/// The fault thread cannot go on: stop the VM, and keep the userfaultfd open until the
/// process exits so that no missing page is ever filled with zeroes.
fn hold_forever(pager: Arc<Pager>, status: &Status, reason: String) {
    status.fail(reason);
    std::mem::forget(pager);
}

/// What the prefetch workers share.
struct Prefetch {
    stop: Arc<AtomicBool>,
    workers: usize,
    finished: AtomicU64,
    started: Instant,
}

/// One prefetch worker (`index` of `p.workers`): installs the data pages of every
/// `workers`-th chunk not installed yet, in file order, the workers side by side; the last
/// one to finish reports that the file is no longer needed.
fn prefetch_all(pager: Arc<Pager>, status: &Status, p: &Prefetch, index: usize) {
    lower_priority();
    let mut buf = vec![0u8; PREFETCH_CHUNK as usize * PAGE];
    let chunks = pager.image.data_runs().flat_map(|(region, first, count)| {
        (first..first + count)
            .step_by(PREFETCH_CHUNK as usize)
            .map(move |page| (region, page, (page + PREFETCH_CHUNK).min(first + count)))
    });
    for (region, page, end) in chunks.skip(index).step_by(p.workers) {
        if p.stop.load(Ordering::Relaxed) || status.failed() {
            status.prefetch_stopped();
            return;
        }
        match pager.install_data(region, page, end, &mut buf) {
            Ok(n) => {
                pager
                    .counters
                    .prefetched_pages
                    .fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                status.fail(e.to_string());
                return;
            }
        }
    }
    if p.finished.fetch_add(1, Ordering::AcqRel) + 1 == p.workers as u64 {
        report_loaded(&pager, status, p.started);
    }
}

/// Gives the calling thread a lower CPU priority (nice 10): the vCPUs and the fault thread,
/// which a waiting guest needs at once, come first; the prefetch takes what is left.
fn lower_priority() {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on this thread's own id changes only its scheduling priority.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, PREFETCH_NICE) } != 0 {
        log::debug!(
            "cannot lower the prefetcher's priority: {}",
            io::Error::last_os_error()
        );
    }
}

/// Every data page is in: says so, and lets the fault thread close the userfaultfd.
fn report_loaded(pager: &Pager, status: &Status, started: Instant) {
    let c = &pager.counters;
    let loaded = status.loaded(format!(
        "{} pages loaded and verified in {:.1} ms ({} by the prefetcher; {} faults brought \
         {} data pages and {} zero pages); the guest no longer needs the file",
        pager.data.count(),
        started.elapsed().as_secs_f64() * 1000.0,
        c.prefetched_pages.load(Ordering::Relaxed),
        c.faults.load(Ordering::Relaxed),
        c.fault_pages.load(Ordering::Relaxed),
        c.zero_pages.load(Ordering::Relaxed),
    ));
    if !loaded {
        // A page failed: the userfaultfd must stay open.
        return;
    }
    if let Err(e) = pager.loaded.wake() {
        // The fault thread then keeps the userfaultfd: harmless, every data page is in.
        log::warn!("cannot tell the snapshot fault thread the restore is complete: {e}");
    }
}
