//! How a device asks the VMM to stop the machine.
//!
//! Devices that end the VM (debug-exit, the i8042 reset line, later ACPI
//! power-off) run on vCPU threads, inside an exit handler, while the decision
//! to tear the machine down belongs to the VMM's main loop. [`ExitRequest`]
//! carries the request across: the first request wins (a guest that writes
//! the debug-exit port and then triple-faults must report the debug-exit
//! status), recording it is a single lock-free compare-and-swap, and the
//! main loop is woken through a file descriptor it can poll next to its
//! other event sources, or through [`ExitRequest::wait`].

use std::io;
#[cfg(unix)]
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Why the machine should stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitReason {
    /// The guest wrote this byte to the debug-exit port.
    DebugExit(u8),
    /// The guest reset the machine (i8042 0xFE, triple fault, ...).
    Reset,
    /// The guest, or the operator, powered the machine off.
    PowerOff,
    /// This vCPU's thread failed (the VMM, not the guest, ends the VM; the
    /// thread reports the cause itself).
    VcpuFailed(u32),
    /// The machine was migrated: the destination runs the guest now.
    Migrated,
    /// The VMM found it cannot run the guest on (e.g. the page data of a lazily restored
    /// snapshot proved corrupt); it reports the cause itself.
    Failed,
    /// The operator typed the console's quit sequence (Ctrl-A x), as QEMU's.
    ConsoleQuit,
}

impl ExitReason {
    /// The exit status of `ferrovm run` for this reason: `(v << 1) | 1` for a
    /// debug exit (QEMU's isa-debug-exit convention, so existing test
    /// harnesses keep working), 0 for reset and power-off, 2 (a VMM error)
    /// for a failed vCPU or VMM.
    ///
    /// The value ranges over 1..=511 for debug exits; like QEMU, the process
    /// exit status the parent sees is this value truncated to 8 bits.
    pub fn exit_status(self) -> i32 {
        match self {
            ExitReason::DebugExit(v) => (i32::from(v) << 1) | 1,
            ExitReason::Reset
            | ExitReason::PowerOff
            | ExitReason::Migrated
            | ExitReason::ConsoleQuit => 0,
            ExitReason::VcpuFailed(_) | ExitReason::Failed => 2,
        }
    }

    /// Kind in the high 32 bits (never 0), payload in the low 32 bits, so a
    /// reason fits one atomic word.
    fn encode(self) -> u64 {
        let (kind, payload): (u64, u32) = match self {
            ExitReason::DebugExit(v) => (1, u32::from(v)),
            ExitReason::Reset => (2, 0),
            ExitReason::PowerOff => (3, 0),
            ExitReason::VcpuFailed(id) => (4, id),
            ExitReason::Migrated => (5, 0),
            ExitReason::Failed => (6, 0),
            ExitReason::ConsoleQuit => (7, 0),
        };
        (kind << 32) | u64::from(payload)
    }

    fn decode(raw: u64) -> Option<Self> {
        let payload = raw as u32; // the low half, by design
        match raw >> 32 {
            1 => u8::try_from(payload).ok().map(ExitReason::DebugExit),
            2 => Some(ExitReason::Reset),
            3 => Some(ExitReason::PowerOff),
            4 => Some(ExitReason::VcpuFailed(payload)),
            5 => Some(ExitReason::Migrated),
            6 => Some(ExitReason::Failed),
            7 => Some(ExitReason::ConsoleQuit),
            _ => None,
        }
    }
}

/// Wakes a poller through a file descriptor. An eventfd on Linux; elsewhere
/// (FreeBSD) a socket pair, which every Unix has. Once woken, the poll
/// descriptor stays readable: nothing here drains it.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub struct Waker(vmm_sys_util::eventfd::EventFd);

#[cfg(any(target_os = "linux", target_os = "android"))]
impl Waker {
    pub fn new() -> io::Result<Self> {
        vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).map(Waker)
    }
    pub fn wake(&self) -> io::Result<()> {
        self.0.write(1)
    }
    /// The descriptor to poll for readability.
    pub fn poll_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
    /// For a signal handler, which cannot call [`Waker::wake`]: writing an
    /// 8-byte native-endian 1 here (the eventfd format; the socket takes
    /// any bytes) wakes the poller, and write(2) is async-signal-safe.
    pub fn wake_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
    /// Consumes every wake-up so far; returns whether there was one.
    pub fn drain(&self) -> bool {
        self.0.read().is_ok()
    }
}

#[cfg(all(unix, not(any(target_os = "linux", target_os = "android"))))]
pub struct Waker {
    reader: std::os::unix::net::UnixStream,
    writer: std::os::unix::net::UnixStream,
}

#[cfg(all(unix, not(any(target_os = "linux", target_os = "android"))))]
impl Waker {
    pub fn new() -> io::Result<Self> {
        let (reader, writer) = std::os::unix::net::UnixStream::pair()?;
        reader.set_nonblocking(true)?;
        writer.set_nonblocking(true)?;
        Ok(Waker { reader, writer })
    }
    pub fn wake(&self) -> io::Result<()> {
        use std::io::Write;
        (&self.writer).write_all(&[1])
    }
    /// The descriptor to poll for readability.
    pub fn poll_fd(&self) -> RawFd {
        self.reader.as_raw_fd()
    }
    /// For a signal handler, which cannot call [`Waker::wake`]: writing an
    /// 8-byte native-endian 1 here (the eventfd format; the socket takes
    /// any bytes) wakes the poller, and write(2) is async-signal-safe.
    pub fn wake_fd(&self) -> RawFd {
        self.writer.as_raw_fd()
    }
    /// Consumes every wake-up so far; returns whether there was one.
    pub fn drain(&self) -> bool {
        use std::io::Read;
        let mut woken = false;
        let mut buf = [0u8; 64];
        while matches!((&self.reader).read(&mut buf), Ok(n) if n > 0) {
            woken = true;
        }
        woken
    }
}

/// The shared "please stop the machine" flag; create one per VM and hand an
/// `Arc` of it to every device that can end the VM.
pub struct ExitRequest {
    /// 0 = no request, otherwise [`ExitReason::encode`].
    state: AtomicU64,
    waker: Waker,
    lock: Mutex<()>,
    cond: Condvar,
}

impl std::fmt::Debug for ExitRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExitRequest")
            .field("reason", &self.reason())
            .finish_non_exhaustive()
    }
}

impl ExitRequest {
    /// Fails only if the wake-up file descriptor cannot be created.
    pub fn new() -> io::Result<Self> {
        Ok(ExitRequest {
            state: AtomicU64::new(0),
            waker: Waker::new()?,
            lock: Mutex::new(()),
            cond: Condvar::new(),
        })
    }

    /// Records `reason` unless a request was already made; returns whether
    /// this call was the one that counted. Never blocks on the VMM.
    pub fn request(&self, reason: ExitReason) -> bool {
        let won = self
            .state
            .compare_exchange(0, reason.encode(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            log::debug!("exit requested: {reason:?}");
            if let Err(e) = self.waker.wake() {
                // The flag is set and waiters on the condvar still wake; only
                // a poller of the fd could miss it, so say so.
                log::error!("cannot signal exit request {reason:?}: {e}");
            }
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.cond.notify_all();
        }
        won
    }

    /// The winning request, if any. Cheap enough for a vCPU loop to check
    /// after every exit.
    pub fn reason(&self) -> Option<ExitReason> {
        ExitReason::decode(self.state.load(Ordering::Acquire))
    }

    /// Whether an exit was requested.
    pub fn is_requested(&self) -> bool {
        self.state.load(Ordering::Acquire) != 0
    }

    /// Blocks until an exit is requested.
    pub fn wait(&self) -> ExitReason {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = self.reason() {
                return r;
            }
            guard = self.cond.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks until an exit is requested or `timeout` passes.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitReason> {
        let deadline = Instant::now().checked_add(timeout);
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = self.reason() {
                return Some(r);
            }
            let left = match deadline {
                Some(d) => d.checked_duration_since(Instant::now())?,
                None => Duration::from_secs(3600),
            };
            guard = self
                .cond
                .wait_timeout(guard, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The descriptor becomes readable once an exit is requested (and stays so:
/// nothing here drains it). Register it with the main loop's epoll/kqueue.
#[cfg(unix)]
impl AsRawFd for ExitRequest {
    fn as_raw_fd(&self) -> RawFd {
        self.waker.poll_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn status() {
        assert_eq!(ExitReason::DebugExit(0).exit_status(), 1);
        assert_eq!(ExitReason::DebugExit(1).exit_status(), 3);
        assert_eq!(ExitReason::DebugExit(0x7f).exit_status(), 0xff);
        assert_eq!(ExitReason::DebugExit(255).exit_status(), 511);
        assert_eq!(ExitReason::Reset.exit_status(), 0);
        assert_eq!(ExitReason::PowerOff.exit_status(), 0);
        assert_eq!(ExitReason::VcpuFailed(3).exit_status(), 2);
        assert_eq!(ExitReason::Failed.exit_status(), 2);
        assert_eq!(ExitReason::ConsoleQuit.exit_status(), 0);
        for r in [
            ExitReason::VcpuFailed(0),
            ExitReason::VcpuFailed(u32::MAX),
            ExitReason::DebugExit(0),
            ExitReason::DebugExit(255),
            ExitReason::Reset,
            ExitReason::PowerOff,
            ExitReason::Migrated,
            ExitReason::Failed,
            ExitReason::ConsoleQuit,
        ] {
            assert_eq!(ExitReason::decode(r.encode()), Some(r));
        }
        assert_eq!(ExitReason::decode(0), None);
        assert_eq!(ExitReason::decode((1 << 32) | 0x100), None);
    }

    #[test]
    fn first_request_wins() {
        let e = ExitRequest::new().unwrap();
        assert!(!e.is_requested());
        assert_eq!(e.reason(), None);
        assert_eq!(e.wait_timeout(Duration::from_millis(1)), None);
        assert!(e.request(ExitReason::DebugExit(0)));
        assert!(!e.request(ExitReason::Reset));
        assert!(!e.request(ExitReason::DebugExit(9)));
        assert_eq!(e.reason(), Some(ExitReason::DebugExit(0)));
        assert_eq!(e.wait(), ExitReason::DebugExit(0));
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[test]
    fn fd_becomes_readable() {
        let e = ExitRequest::new().unwrap();
        // Non-blocking eventfd: nothing to read yet.
        assert!(e.waker.0.read().is_err());
        e.request(ExitReason::PowerOff);
        e.request(ExitReason::Reset);
        assert_eq!(e.waker.0.read().unwrap(), 1);
        assert!(e.as_raw_fd() >= 0);
    }

    #[test]
    fn wakes_a_waiter() {
        let e = Arc::new(ExitRequest::new().unwrap());
        let e2 = e.clone();
        let t = std::thread::spawn(move || e2.wait());
        std::thread::sleep(Duration::from_millis(20));
        e.request(ExitReason::Reset);
        assert_eq!(t.join().unwrap(), ExitReason::Reset);
        assert_eq!(
            e.wait_timeout(Duration::from_secs(1)),
            Some(ExitReason::Reset)
        );
    }

    #[test]
    fn racing_requests_pick_one() {
        let e = Arc::new(ExitRequest::new().unwrap());
        let threads: Vec<_> = (0..8u8)
            .map(|i| {
                let e = e.clone();
                std::thread::spawn(move || e.request(ExitReason::DebugExit(i)))
            })
            .collect();
        let wins = threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|w| *w)
            .count();
        assert_eq!(wins, 1);
        assert!(matches!(e.reason(), Some(ExitReason::DebugExit(_))));
    }
}
