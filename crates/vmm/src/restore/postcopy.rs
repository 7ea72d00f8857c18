//! The destination of a post-copy migration (Linux): guest RAM is registered with a
//! userfaultfd in missing mode before the state is restored, so no page the source has not
//! sent yet is ever seen — not by a vCPU (KVM faults through the same page tables), not by
//! a device thread, not by the VMM. Pages the destination already holds stay as they are;
//! the missing ones were dropped first (an earlier round may have left a stale copy).
//!
//! Two threads, which never touch guest memory themselves:
//! - `postcopy-faults` reads fault events: a fault on a missing page asks the source for it
//!   (and the missing pages of its 64 KiB block) on the post-copy connection, once; a fault
//!   on a page the source never had data for installs a zero page;
//! - `postcopy-in` reads the post-copy connection and installs each page with `UFFDIO_COPY`
//!   (checked against its CRC first), which wakes whoever waits on it. After `End`, with
//!   every missing page in, it tells the source `Resident` and the userfaultfd is closed.
//!
//! If the connection fails before that, the guest is lost: the failure is recorded (one
//! line, with the cause), the VM is stopped, and the userfaultfd stays open until the
//! process exits, so a vCPU waiting for a page never runs on with a wrong one.

use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use devices::exit::{ExitReason, ExitRequest, Waker};
use migration::{Arrival, ArrivalReader, Bitmap, PostcopyIncoming, Record, PAGE_SIZE};
use userfaultfd::{Event, ReadWrite, Uffd};

use super::pager::{open_userfaultfd, uffd_error, wait_readable};
use super::{locate_host, PageBits, RamSpan};
use crate::memory::GuestMemory;

const PAGE: usize = PAGE_SIZE as usize;
/// Pages asked for around a faulting page: the missing ones of its aligned 64 KiB block.
const REQUEST_BLOCK: u64 = 16;
static ZERO_PAGE: [u8; PAGE] = [0; PAGE];

/// What the destination counted, for the log and the report.
#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    requests: AtomicU64,
    requested_pages: AtomicU64,
    zero_faults: AtomicU64,
    received: AtomicU64,
}

/// The state of a post-copy on the destination, kept by the machine: the failure, if any.
pub struct Postcopy {
    failure: Mutex<Option<String>>,
    exit: Arc<ExitRequest>,
}

impl Postcopy {
    /// The error that stopped the guest, if post-copy failed.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn fail(&self, reason: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(format!(
                "post-copy failed and the guest is lost ({reason}): stopping it"
            ));
            drop(f);
            self.exit.request(ExitReason::Failed);
        }
    }
}

struct Server {
    uffd: Uffd,
    spans: Vec<RamSpan>,
    missing: Bitmap,
    /// One bit per page: installed (or claimed for a zero page).
    installed: PageBits,
    /// One bit per page: asked for already.
    requested: PageBits,
    requests: Mutex<TcpStream>,
    resident: Waker,
    counters: Counters,
    status: Arc<Postcopy>,
    started: Instant,
}

/// Registers guest RAM and starts the post-copy threads. No vCPU may run yet; the guest may
/// run as soon as this returns.
pub fn start(
    incoming: PostcopyIncoming,
    memory: &GuestMemory,
    exit: &Arc<ExitRequest>,
) -> io::Result<Arc<Postcopy>> {
    // Dropping a stale page (MADV_DONTNEED) leaves shared memory's copy in place, so a
    // missing page would never fault: post-copy needs anonymous guest RAM.
    if crate::memory::shared_ram_of(memory).is_some() {
        return Err(io::Error::other(
            "post-copy needs anonymous guest RAM on the destination (--memory-backend anon)",
        ));
    }
    let uffd = open_userfaultfd()
        .map_err(|e| io::Error::other(format!("post-copy needs a userfaultfd: {e}")))?;
    let spans = super::ram_spans(memory)?;
    register(&uffd, &spans, &incoming.missing)?;
    let status = Arc::new(Postcopy {
        failure: Mutex::new(None),
        exit: exit.clone(),
    });
    let link = incoming.link;
    // The link keeps the read timeout it was accepted with: until `End` the source sends
    // without pause, so a silence that long means a source (or link) gone without a word.
    let server = Arc::new(Server {
        installed: PageBits::new(&spans),
        requested: PageBits::new(&spans),
        requests: Mutex::new(link.try_clone()?),
        uffd,
        spans,
        missing: incoming.missing,
        resident: Waker::new()?,
        counters: Counters::default(),
        status: status.clone(),
        started: Instant::now(),
    });
    let s = server.clone();
    sandbox::spawn(sandbox::Role::RestoreFaults, "postcopy-faults", move || {
        serve_faults(s)
    })?;
    let s = server;
    let ranges = incoming.ranges;
    sandbox::spawn(sandbox::Role::RestoreFaults, "postcopy-in", move || {
        receive_pages(s, link, ranges)
    })?;
    Ok(status)
}

/// Drops the missing pages (stale copies from earlier rounds) and registers all of RAM.
fn register(uffd: &Uffd, spans: &[RamSpan], missing: &Bitmap) -> io::Result<()> {
    for (ri, s) in spans.iter().enumerate() {
        let runs = missing.runs(ri, u64::MAX).take_while(|&(p, _)| p < s.pages);
        for (p, n) in runs.map(|(p, n)| (p, n.min(s.pages - p))) {
            // SAFETY: the run lies inside one region of guest RAM, a private anonymous
            // mapping the machine owns; no vCPU runs yet, and these pages' contents are
            // stale (the source sends them again). MADV_DONTNEED only drops them.
            let addr = (s.host + (p * PAGE_SIZE) as usize) as *mut libc::c_void;
            if unsafe { libc::madvise(addr, (n * PAGE_SIZE) as usize, libc::MADV_DONTNEED) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        uffd.register(s.host as *mut libc::c_void, (s.pages * PAGE_SIZE) as usize)
            .map_err(uffd_error)?;
    }
    Ok(())
}

impl Server {
    fn locate_guest(&self, addr: u64) -> Option<(usize, u64)> {
        self.spans.iter().enumerate().find_map(|(i, s)| {
            let off = addr.checked_sub(s.guest)? / PAGE_SIZE;
            (off < s.pages).then_some((i, off))
        })
    }

    fn host(&self, region: usize, page: u64) -> *mut libc::c_void {
        (self.spans[region].host + (page * PAGE_SIZE) as usize) as *mut libc::c_void
    }

    /// One fault: ask for a missing page (with its block), or give a page without data a
    /// zero page.
    fn serve(&self, addr: usize, write: bool) -> io::Result<()> {
        let Some((region, page)) = locate_host(&self.spans, addr) else {
            log::warn!("post-copy: a fault at {addr:#x}, outside guest RAM");
            return Ok(());
        };
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        if !self.missing.get(region, page) {
            if self.installed.claim(region, page) {
                self.counters.zero_faults.fetch_add(1, Ordering::Relaxed);
                return self.install_zero(region, page, write);
            }
            // Zeroed by another fault already: waking only resumes waiters.
            let _ = self.uffd.wake(self.host(region, page), PAGE);
            return Ok(());
        }
        let first = page / REQUEST_BLOCK * REQUEST_BLOCK;
        let end = (first + REQUEST_BLOCK).min(self.spans[region].pages);
        let wanted: Vec<u64> = (first..end)
            .filter(|&p| p == page || self.missing.get(region, p))
            .filter(|&p| !self.installed.is_set(region, p))
            .filter(|&p| self.requested.claim(region, p))
            .collect();
        let (Some(&lo), Some(&hi)) = (wanted.first(), wanted.last()) else {
            return Ok(());
        };
        let record = Record::Request {
            addr: self.spans[region].guest + lo * PAGE_SIZE,
            count: (hi - lo + 1) as u32,
        };
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        self.counters
            .requested_pages
            .fetch_add(wanted.len() as u64, Ordering::Relaxed);
        let mut link = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        link.write_all(&record.encode())
    }

    fn install_zero(&self, region: usize, page: u64, write: bool) -> io::Result<()> {
        let dst = self.host(region, page);
        // SAFETY: `dst` is one page of registered guest RAM; the kernel fills it only if it
        // is missing. ZERO_PAGE is this module's own static buffer.
        let r = unsafe {
            if write {
                self.uffd
                    .copy(ZERO_PAGE.as_ptr().cast(), dst, PAGE, true)
                    .map(|_| ())
            } else {
                self.uffd.zeropage(dst, PAGE, true).map(|_| ())
            }
        };
        self.tolerate_present(r, dst, PAGE)
    }

    /// An install that found the page present (or the address space changing) wakes the
    /// waiters and is fine; any other error is not.
    fn tolerate_present(
        &self,
        r: std::result::Result<(), userfaultfd::Error>,
        dst: *mut libc::c_void,
        len: usize,
    ) -> io::Result<()> {
        match r.map_err(uffd_error) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::EAGAIN)) => {
                let _ = self.uffd.wake(dst, len);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Installs pages that arrived: runs of pages still missing in one `UFFDIO_COPY` each
    /// (a page that is present already is skipped by the page-wise retry).
    fn install(&self, addr: u64, data: &[u8]) -> io::Result<u64> {
        let pages = (data.len() / PAGE) as u64;
        let (region, first) = self
            .locate_guest(addr)
            .filter(|&(r, p)| p + pages <= self.spans[r].pages)
            .ok_or_else(|| io::Error::other(format!("pages at {addr:#x} outside guest RAM")))?;
        let mut i = 0;
        while i < pages {
            let mine = |j: u64| {
                self.missing.get(region, first + j) && self.installed.claim(region, first + j)
            };
            if !mine(i) {
                i += 1;
                continue;
            }
            let mut n = 1;
            while i + n < pages && mine(i + n) {
                n += 1;
            }
            self.copy_run(
                region,
                first + i,
                &data[i as usize * PAGE..(i + n) as usize * PAGE],
            )?;
            i += n;
        }
        Ok(pages)
    }

    /// One `UFFDIO_COPY` of a run this thread claimed; page by page if that fails part way.
    fn copy_run(&self, region: usize, page: u64, src: &[u8]) -> io::Result<()> {
        let dst = self.host(region, page);
        // SAFETY: `src` is this thread's own buffer; `dst..dst + src.len()` lies inside one
        // registered region (checked by `install`), pages nobody else installs (claimed);
        // the kernel copies atomically per page and wakes waiters.
        let whole = unsafe { self.uffd.copy(src.as_ptr().cast(), dst, src.len(), true) };
        if matches!(whole, Ok(n) if n == src.len()) {
            return Ok(());
        }
        for (k, chunk) in src.chunks_exact(PAGE).enumerate() {
            let d = self.host(region, page + k as u64);
            // SAFETY: as above, one page of the same run.
            let r = unsafe { self.uffd.copy(chunk.as_ptr().cast(), d, PAGE, true) };
            self.tolerate_present(r.map(|_| ()), d, PAGE)?;
        }
        Ok(())
    }

    fn install_zeroes(&self, addr: u64, count: u32) -> io::Result<u64> {
        for i in 0..u64::from(count) {
            let (region, page) = self
                .locate_guest(addr + i * PAGE_SIZE)
                .ok_or_else(|| io::Error::other(format!("page {addr:#x} outside guest RAM")))?;
            if self.missing.get(region, page) && self.installed.claim(region, page) {
                self.install_zero(region, page, false)?;
            }
        }
        Ok(u64::from(count))
    }

    fn missing_left(&self) -> u64 {
        let mut left = 0;
        for (ri, s) in self.spans.iter().enumerate() {
            for p in 0..s.pages {
                if self.missing.get(ri, p) && !self.installed.is_set(ri, p) {
                    left += 1;
                }
            }
        }
        left
    }
}

/// The fault thread: until every page is in (then it lets go, closing the userfaultfd with
/// the last reference), or forever after a failure.
fn serve_faults(server: Arc<Server>) {
    let fd = server.uffd.as_raw_fd();
    loop {
        match wait_readable(fd, server.resident.poll_fd()) {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => return hold(server, format!("polling the userfaultfd: {e}")),
        }
        loop {
            match server.uffd.read_event() {
                Ok(Some(Event::Pagefault { addr, rw, .. })) => {
                    if let Err(e) = server.serve(addr as usize, rw == ReadWrite::Write) {
                        return hold(server, format!("asking the source for a page: {e}"));
                    }
                }
                Ok(Some(other)) => log::warn!("post-copy: unexpected userfaultfd event {other:?}"),
                Ok(None) => break,
                Err(e) => {
                    let e = uffd_error(e);
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return hold(server, format!("reading the userfaultfd: {e}"));
                }
            }
        }
    }
}

/// Post-copy failed: stop the VM and keep the userfaultfd open until the process ends.
fn hold(server: Arc<Server>, reason: String) {
    server.status.fail(reason);
    std::mem::forget(server);
}

/// The receiving thread: installs pages until `End`, then confirms residency.
fn receive_pages(server: Arc<Server>, link: TcpStream, ranges: Vec<migration::RamRange>) {
    let mut reader = ArrivalReader::new(io::BufReader::with_capacity(1 << 20, link), ranges);
    loop {
        let got = match reader.next_arrival() {
            Ok(Arrival::Pages { addr, data }) => server.install(addr, &data),
            Ok(Arrival::Zero { addr, count }) => server.install_zeroes(addr, count),
            Ok(Arrival::End { pages, .. }) => return finish(server, pages),
            Err(e) => return hold(server, format!("the connection to the source: {e}")),
        };
        match got {
            Ok(n) => {
                server.counters.received.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => return hold(server, format!("installing a page: {e}")),
        }
    }
}

fn finish(server: Arc<Server>, pages: u64) {
    let left = server.missing_left();
    if left > 0 {
        return hold(
            server,
            format!("the source ended with {left} of {pages} pages still missing"),
        );
    }
    let sent = {
        let mut link = server.requests.lock().unwrap_or_else(|e| e.into_inner());
        link.write_all(&Record::Resident.encode())
    };
    if let Err(e) = sent {
        // Every page is here: the guest is whole; the source learns it from the closed link.
        log::warn!("post-copy: cannot tell the source every page arrived: {e}");
    }
    let c = &server.counters;
    log::info!(
        "post-copy: every page resident {:.1} ms after the guest started ({} pages arrived, \
         {} faults, {} requests for {} pages, {} zero-page faults)",
        server.started.elapsed().as_secs_f64() * 1000.0,
        c.received.load(Ordering::Relaxed),
        c.faults.load(Ordering::Relaxed),
        c.requests.load(Ordering::Relaxed),
        c.requested_pages.load(Ordering::Relaxed),
        c.zero_faults.load(Ordering::Relaxed),
    );
    if let Err(e) = server.resident.wake() {
        log::warn!("post-copy: cannot tell the fault thread to end: {e}");
    }
}
