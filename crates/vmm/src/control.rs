//! Pausing and resuming the vCPUs from another thread (API requests, snapshots, migration).
//!
//! A pause raises a flag and kicks every vCPU; each vCPU thread parks at the top of its loop,
//! outside KVM_RUN, and counts itself in. The controller waits for all of them, so when
//! `pause` returns no vCPU is in the guest and its state can be read consistently.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use hypervisor::VcpuKicker;

use crate::error::{Error, Result};

#[derive(Default)]
struct Parked {
    count: usize,
}

#[derive(Default)]
pub struct RunControl {
    pause_requested: AtomicBool,
    parked: Mutex<Parked>,
    cond: Condvar,
    kickers: OnceLock<Vec<VcpuKicker>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RunControl {
    pub fn set_kickers(&self, kickers: Vec<VcpuKicker>) {
        let _ = self.kickers.set(kickers);
    }

    /// Checked by each vCPU at the top of its loop: one relaxed load on the fast path.
    pub fn pause_requested(&self) -> bool {
        self.pause_requested.load(Ordering::Acquire)
    }

    pub fn is_paused(&self) -> bool {
        self.pause_requested() && lock(&self.parked).count == self.kickers.get().map_or(0, Vec::len)
    }

    /// Called by a vCPU thread when it sees the pause flag: waits, outside the guest, until
    /// the pause ends or the machine stops.
    pub fn park(&self, stop: &AtomicBool) {
        let mut parked = lock(&self.parked);
        parked.count += 1;
        self.cond.notify_all();
        while self.pause_requested() && !stop.load(Ordering::Acquire) {
            parked = self
                .cond
                .wait_timeout(parked, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        parked.count -= 1;
        self.cond.notify_all();
    }

    /// Stops every vCPU outside the guest; returns once all are parked.
    pub fn pause(&self, timeout: Duration) -> Result<()> {
        let kickers = self
            .kickers
            .get()
            .ok_or_else(|| Error::Control("the VM is not running".into()))?;
        self.pause_requested.store(true, Ordering::Release);
        for k in kickers {
            let _ = k.kick();
        }
        let deadline = Instant::now() + timeout;
        let mut parked = lock(&self.parked);
        while parked.count < kickers.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(parked);
                self.resume();
                return Err(Error::Control(format!(
                    "vCPUs did not pause within {} ms",
                    timeout.as_millis()
                )));
            }
            parked = self
                .cond
                .wait_timeout(parked, left.min(Duration::from_millis(20)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            // A kick can race with a vCPU entering the guest only if it raced with the flag;
            // kicking again is cheap and closes the window.
            for k in kickers {
                let _ = k.kick();
            }
        }
        Ok(())
    }

    pub fn resume(&self) {
        self.pause_requested.store(false, Ordering::Release);
        let _guard = lock(&self.parked);
        self.cond.notify_all();
    }
}
