//! Queues re-checked on a short timer instead of a notification.
//!
//! **Receive.**
//! When a frame waits for receive buffers, the device would turn the driver's notifications
//! on, and a driver that has fallen behind (the device fills buffers faster than it empties
//! them) then pays one notification, a VM exit, for nearly every frame it hands back: the
//! device is waiting again by the time the driver reposts. Instead, the first time a frame
//! waits the pair's thread leaves notifications off and looks again [`RECHECK_AFTER`] later,
//! when a driver that is working through a ring of frames has reposted a batch of buffers.
//! Only when a re-check finds that no frame moved since the timer was set (the driver is not
//! draining: idle, or out of memory) are notifications turned on, as before. The timerfd is
//! made at start-up: `timerfd_create` is not a call of the device threads.
//!
//! **Transmit.** A driver that streams frames would otherwise find notifications on again
//! each time the pair's thread has caught up, and pay an exit for its next frame. After a
//! pass that sent a burst ([`TX_BURST`] frames or more) the thread leaves notifications off
//! and looks again [`RECHECK_AFTER`] later; only a re-check that finds nothing new turns
//! them on. A pass of fewer frames (request and response traffic) turns them on at once,
//! so a lone frame is never held back by the timer.

use std::io;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::timerfd::TimerFd;

/// How long after a frame found too few buffers the pair's thread looks again.
pub const RECHECK_AFTER: Duration = Duration::from_micros(50);

/// Frames a transmit pass must send for the thread to re-check on a timer rather than
/// turn the driver's notifications back on.
pub const TX_BURST: u32 = 4;

/// One queue's timer (a non-blocking timerfd), kept across activations.
pub struct RecheckTimer(Mutex<TimerFd>);

impl RecheckTimer {
    pub fn new() -> io::Result<RecheckTimer> {
        let timer = TimerFd::new().map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        let fd = timer.as_raw_fd();
        // SAFETY: F_GETFL and F_SETFL on a descriptor this process owns touch no memory.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(RecheckTimer(Mutex::new(timer)))
    }

    fn timer(&self) -> std::sync::MutexGuard<'_, TimerFd> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The re-check state of one queue.
pub struct Recheck {
    timer: Arc<RecheckTimer>,
    /// Frames delivered when the timer was set; None when it is not set.
    armed_at: Option<u64>,
    fired: bool,
}

impl Recheck {
    pub fn new(timer: Arc<RecheckTimer>) -> Recheck {
        Recheck {
            timer,
            armed_at: None,
            fired: false,
        }
    }

    /// The queue would ask for a notification (a frame waits for buffers; a burst was
    /// sent), `delivered` frames moved so far: true to leave the driver's notifications off
    /// (the timer will bring the thread back), false to turn them on.
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

    /// Whether the timer is set (fired or not): the queue is being re-checked.
    pub fn armed(&self) -> bool {
        self.armed_at.is_some()
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

/// The transmit side of a pair: frames sent, and the re-check after a burst.
pub struct TxBatching {
    /// Frames taken from the transmit queue so far, and since its last pass ended.
    sent: u64,
    in_pass: u32,
    recheck: Recheck,
}

impl TxBatching {
    pub fn new(timer: Arc<RecheckTimer>) -> TxBatching {
        TxBatching {
            sent: 0,
            in_pass: 0,
            recheck: Recheck::new(timer),
        }
    }

    /// A frame was taken from the transmit queue.
    pub fn sent_one(&mut self) {
        self.sent += 1;
        self.in_pass = self.in_pass.saturating_add(1);
    }

    /// A pass over the transmit queue ended: true to leave the driver's notifications off
    /// (after a burst, or while frames keep coming between re-checks).
    pub fn notifications_off(&mut self) -> bool {
        let burst = std::mem::take(&mut self.in_pass) >= TX_BURST;
        (burst || self.recheck.armed()) && self.recheck.defer(self.sent)
    }

    pub fn recheck(&self) -> &Recheck {
        &self.recheck
    }

    pub fn take_expiry(&mut self) {
        self.recheck.take_expiry();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expire(recheck: &mut Recheck) {
        std::thread::sleep(RECHECK_AFTER * 4);
        recheck.take_expiry();
    }

    #[test]
    fn notifications_come_on_only_after_a_recheck_without_progress() {
        let mut recheck = Recheck::new(Arc::new(RecheckTimer::new().unwrap()));
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

    fn expire_tx(tx: &mut TxBatching) {
        std::thread::sleep(RECHECK_AFTER * 4);
        tx.take_expiry();
    }

    #[test]
    fn transmit_notifications_stay_off_only_while_bursts_keep_coming() {
        let mut tx = TxBatching::new(Arc::new(RecheckTimer::new().unwrap()));
        // A lone frame (request and response): notifications on at once, no timer.
        tx.sent_one();
        assert!(!tx.notifications_off());
        assert!(tx.recheck().poll_fd().is_none());
        // A burst: off, and the timer brings the thread back.
        (0..TX_BURST).for_each(|_| tx.sent_one());
        assert!(tx.notifications_off());
        assert!(tx.recheck().poll_fd().is_some());
        // Re-checked after one more frame came: still off, the timer set again.
        expire_tx(&mut tx);
        tx.sent_one();
        assert!(tx.notifications_off());
        assert!(tx.recheck().poll_fd().is_some());
        // Re-checked with nothing new: the driver must notify again.
        expire_tx(&mut tx);
        assert!(!tx.notifications_off());
        assert!(tx.recheck().poll_fd().is_none());
        tx.sent_one();
        assert!(!tx.notifications_off());
    }
}
