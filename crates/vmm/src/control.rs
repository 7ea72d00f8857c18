//! Pausing and resuming the vCPUs from another thread (API requests, snapshots, migration).
//!
//! A pause raises a flag and kicks every vCPU; each vCPU thread parks at the top of its loop,
//! outside KVM_RUN, and counts itself in. The controller waits for all of them, so when
//! `pause` returns no vCPU is in the guest and its state can be read consistently.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use std::sync::Arc;

use hypervisor::{save_vcpu_state, Vcpu, VcpuKicker, VcpuState};

use crate::error::{Error, Result};

/// The period over which auto-converge throttling takes its share of vCPU time.
const THROTTLE_SLICE: Duration = Duration::from_millis(20);

#[derive(Default)]
struct Parked {
    count: usize,
    /// Set while a capture wants every parked vCPU's state: the MSRs to read.
    capture: Option<Arc<Vec<u32>>>,
    /// Counts capture requests, so a parked vCPU serves each one once.
    capture_round: u64,
    /// Captured states by vCPU id (or why capturing failed).
    states: Vec<Option<std::result::Result<VcpuState, String>>>,
}

#[derive(Default)]
pub struct RunControl {
    /// Auto-converge: the share of time (percent) each vCPU is kept out of the guest.
    throttle: AtomicU8,
    throttle_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
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

    /// Sets the throttle. A non-zero throttle starts a thread that kicks every vCPU each
    /// [`THROTTLE_SLICE`]; a kicked vCPU then sleeps its share of the slice.
    pub fn set_throttle(self: &Arc<Self>, percent: u8) {
        let percent = percent.min(99);
        self.throttle.store(percent, Ordering::Release);
        let mut thread = lock(&self.throttle_thread);
        if percent == 0 {
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
            return;
        }
        if thread.is_none() {
            let control = self.clone();
            *thread = sandbox::spawn(sandbox::Role::Timer, "throttle", move || {
                while control.throttle.load(Ordering::Acquire) > 0 {
                    if let Some(kickers) = control.kickers.get() {
                        for k in kickers {
                            let _ = k.kick();
                        }
                    }
                    std::thread::sleep(THROTTLE_SLICE);
                }
            })
            .ok();
        }
    }

    /// Called by a vCPU after a kick: sleeps the throttled share of a slice.
    pub fn throttle_pause(&self) {
        let percent = u32::from(self.throttle.load(Ordering::Relaxed));
        if percent > 0 {
            std::thread::sleep(THROTTLE_SLICE * percent / 100);
        }
    }

    /// Checked by each vCPU at the top of its loop: one relaxed load on the fast path.
    pub fn pause_requested(&self) -> bool {
        self.pause_requested.load(Ordering::Acquire)
    }

    pub fn is_paused(&self) -> bool {
        self.pause_requested() && lock(&self.parked).count == self.kickers.get().map_or(0, Vec::len)
    }

    /// Called by a vCPU thread when it sees the pause flag: waits, outside the guest, until
    /// the pause ends or the machine stops, saving its state whenever a capture asks.
    pub fn park(&self, stop: &AtomicBool, vcpu: &mut dyn Vcpu) {
        let mut parked = lock(&self.parked);
        let mut served = parked.capture_round;
        parked.count += 1;
        self.cond.notify_all();
        while self.pause_requested() && !stop.load(Ordering::Acquire) {
            if let Some(msrs) = parked
                .capture
                .clone()
                .filter(|_| served != parked.capture_round)
            {
                served = parked.capture_round;
                drop(parked);
                let state = vcpu
                    .finish_pending_exit()
                    .and_then(|_| save_vcpu_state(vcpu, &msrs))
                    .map_err(|e| e.to_string());
                parked = lock(&self.parked);
                let id = vcpu.id() as usize;
                if parked.states.len() <= id {
                    parked.states.resize(id + 1, None);
                }
                parked.states[id] = Some(state);
                self.cond.notify_all();
                continue;
            }
            parked = self
                .cond
                .wait_timeout(parked, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        parked.count -= 1;
        self.cond.notify_all();
    }

    /// Pauses and returns every vCPU's state, saved by its own thread. On failure the
    /// vCPUs run again.
    pub fn pause_and_capture(&self, msrs: Vec<u32>, timeout: Duration) -> Result<Vec<VcpuState>> {
        if self.is_paused() {
            return Err(Error::Control("the VM is already paused".into()));
        }
        self.pause(timeout)?;
        self.capture(msrs, timeout).inspect_err(|_| self.resume())
    }

    /// Returns every vCPU's state while the VM is paused (it stays paused), each saved by its
    /// own thread.
    pub fn capture(&self, msrs: Vec<u32>, timeout: Duration) -> Result<Vec<VcpuState>> {
        let vcpus = self.kickers.get().map_or(0, Vec::len);
        if !self.is_paused() {
            return Err(Error::Control("the VM is not paused".into()));
        }
        let deadline = Instant::now() + timeout;
        let mut parked = lock(&self.parked);
        parked.capture = Some(Arc::new(msrs));
        parked.capture_round += 1;
        parked.states = vec![None; vcpus];
        self.cond.notify_all();
        while parked.states.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || parked.count < vcpus {
                break;
            }
            parked = self
                .cond
                .wait_timeout(parked, left.min(Duration::from_millis(20)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        parked.capture = None;
        let states = std::mem::take(&mut parked.states);
        drop(parked);
        let mut out = Vec::with_capacity(states.len());
        for (id, state) in states.into_iter().enumerate() {
            match state {
                Some(Ok(s)) => out.push(s),
                Some(Err(e)) => return Err(Error::Control(format!("saving vCPU {id}: {e}"))),
                None => return Err(Error::Control(format!("vCPU {id} saved no state"))),
            }
        }
        Ok(out)
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

    /// Before the vCPUs start: each parks before it first enters the guest.
    pub fn start_paused(&self) {
        self.pause_requested.store(true, Ordering::Release);
    }

    pub fn resume(&self) {
        self.pause_requested.store(false, Ordering::Release);
        let _guard = lock(&self.parked);
        self.cond.notify_all();
    }
}
