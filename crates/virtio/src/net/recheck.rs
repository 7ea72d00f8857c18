//! Receive buffers re-checked on a short timer instead of a notification.
//!
//! When a frame waits for receive buffers, the device would turn the driver's notifications
//! on, and a driver that has fallen behind (the device fills buffers faster than it empties
//! them) then pays one notification, a VM exit, for nearly every frame it hands back: the
//! device is waiting again by the time the driver reposts. Instead, the first time a frame
//! waits the pair's thread leaves notifications off and looks again [`RECHECK_AFTER`] later,
//! when a driver that is working through a ring of frames has reposted a batch of buffers.
//! Only when a re-check finds that no frame moved since the timer was set (the driver is not
//! draining: idle, or out of memory) are notifications turned on, as before. The timerfd is
//! made at start-up: `timerfd_create` is not a call of the device threads.

use std::io;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::timerfd::TimerFd;

/// How long after a frame found too few buffers the pair's thread looks again.
pub const RECHECK_AFTER: Duration = Duration::from_micros(50);

/// One pair's timer (a non-blocking timerfd), kept across activations.
pub struct RxTimer(Mutex<TimerFd>);

impl RxTimer {
    pub fn new() -> io::Result<RxTimer> {
        let timer = TimerFd::new().map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        let fd = timer.as_raw_fd();
        // SAFETY: F_GETFL and F_SETFL on a descriptor this process owns touch no memory.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(RxTimer(Mutex::new(timer)))
    }

    fn timer(&self) -> std::sync::MutexGuard<'_, TimerFd> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The re-check state of one receive queue.
pub struct RxRecheck {
    timer: Arc<RxTimer>,
    /// Frames delivered when the timer was set; None when it is not set.
    armed_at: Option<u64>,
    fired: bool,
}

impl RxRecheck {
    pub fn new(timer: Arc<RxTimer>) -> RxRecheck {
        RxRecheck {
            timer,
            armed_at: None,
            fired: false,
        }
    }

    /// A frame waits for buffers, `delivered` frames so far: true to leave the driver's
    /// notifications off (the timer will bring the thread back), false to turn them on.
    pub fn defer(&mut self, delivered: u64) -> bool {
        match self.armed_at {
            Some(_) if !self.fired => true,
            Some(at) if at == delivered => {
                self.armed_at = None;
                false
            }
            _ => self.arm(delivered),
        }
    }

    fn arm(&mut self, delivered: u64) -> bool {
        if let Err(e) = self.timer.timer().reset(RECHECK_AFTER, None) {
            log::debug!("virtio-net: cannot set the receive re-check timer: {e}");
            self.armed_at = None;
            return false;
        }
        self.armed_at = Some(delivered);
        self.fired = false;
        true
    }

    /// No frame waits any more.
    pub fn clear(&mut self) {
        self.armed_at = None;
    }

    /// The timer's descriptor while it is set and has not fired.
    pub fn poll_fd(&self) -> Option<RawFd> {
        (self.armed_at.is_some() && !self.fired).then(|| self.timer.timer().as_raw_fd())
    }

    /// Notes an expiry of the timer, if there was one (a non-blocking read).
    pub fn take_expiry(&mut self) {
        if self.armed_at.is_some() && !self.fired {
            self.fired = self.timer.timer().wait().is_ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expire(recheck: &mut RxRecheck) {
        std::thread::sleep(RECHECK_AFTER * 4);
        recheck.take_expiry();
    }

    #[test]
    fn notifications_come_on_only_after_a_recheck_without_progress() {
        let mut recheck = RxRecheck::new(Arc::new(RxTimer::new().unwrap()));
        assert!(recheck.poll_fd().is_none());
        // A frame waits: the timer is set, notifications stay off until it fires.
        assert!(recheck.defer(5));
        assert!(recheck.poll_fd().is_some());
        assert!(recheck.defer(5));
        // It fired and frames moved meanwhile: set again.
        expire(&mut recheck);
        assert!(recheck.poll_fd().is_none());
        assert!(recheck.defer(9));
        // It fired and nothing moved: the driver must notify.
        expire(&mut recheck);
        assert!(!recheck.defer(9));
        assert!(recheck.poll_fd().is_none());
        // The next wait starts over.
        assert!(recheck.defer(9));
        recheck.clear();
        assert!(recheck.poll_fd().is_none());
    }
}
