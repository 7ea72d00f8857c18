//! The timer thread: drives the user-space PIT (split mode) and the CMOS RTC at the deadlines
//! the guest programmed. Guest writes that move a deadline wake it through `TimerWaker`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::irqchip::{IrqChip, TimerWaker};
use devices::pit::Pit;
use devices::rtc::Rtc;

/// How long the thread sleeps when no timer is armed, to notice a stop request.
const IDLE_WAIT: Duration = Duration::from_millis(200);

#[derive(Default)]
pub struct TimerWake {
    woken: Mutex<bool>,
    cond: Condvar,
}

impl TimerWaker for TimerWake {
    fn deadline_changed(&self) {
        *lock(&self.woken) = true;
        self.cond.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct TimerDevices {
    /// Only in split mode; the in-kernel PIT drives IRQ 0 otherwise.
    pub pit: Option<Arc<Mutex<Pit>>>,
    /// Absent where the kernel models the RTC.
    pub rtc: Option<Arc<Mutex<Rtc>>>,
    pub irqchip: Arc<dyn IrqChip>,
    pub wake: Arc<TimerWake>,
}

impl TimerDevices {
    /// Whether any device here needs the timer thread.
    pub fn has_timers(&self) -> bool {
        self.pit.is_some() || self.rtc.is_some()
    }
}

pub struct TimerThread {
    stop: Arc<AtomicBool>,
    wake: Arc<TimerWake>,
    handle: JoinHandle<()>,
}

impl TimerThread {
    pub fn spawn(devices: TimerDevices) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let wake = devices.wake.clone();
        let thread_stop = stop.clone();
        let handle = std::thread::Builder::new()
            .name("timers".into())
            .spawn(move || run(devices, &thread_stop))?;
        Ok(TimerThread { stop, wake, handle })
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.wake.deadline_changed();
        let _ = self.handle.join();
    }
}

fn run(devices: TimerDevices, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let pit_deadline = devices
            .pit
            .as_ref()
            .and_then(|p| lock(p).next_irq_deadline());
        let rtc_deadline = devices
            .rtc
            .as_ref()
            .and_then(|r| lock(r).next_irq_deadline());
        let deadline = match (pit_deadline, rtc_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let now = Instant::now();
        let wait = deadline
            .map(|d| d.saturating_duration_since(now))
            .unwrap_or(IDLE_WAIT)
            .min(IDLE_WAIT);
        if !wait.is_zero() {
            let mut woken = lock(&devices.wake.woken);
            if !*woken {
                woken = devices
                    .wake
                    .cond
                    .wait_timeout(woken, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            *woken = false;
        }
        let now = Instant::now();
        if let Some(pit) = &devices.pit {
            // The PIT lock is released before the line is pulsed (device lock, then PIC).
            let edges = lock(pit).on_timer(now);
            if edges > 0 {
                devices.irqchip.pulse_irq(0);
            }
        }
        // The RTC raises and lowers IRQ 8 itself.
        if let Some(rtc) = &devices.rtc {
            lock(rtc).on_timer(now);
        }
    }
}
