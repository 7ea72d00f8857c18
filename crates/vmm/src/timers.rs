//! The timer thread: serves the devices with deadlines of their own ([`TimedDevice`]: the
//! user-space PIT in split mode, the CMOS RTC) at the deadlines the guest programmed. The
//! device manager registers them; guest writes that move a deadline wake the thread through
//! `TimerWaker`.

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

/// Holds the timer thread between two ticks: snapshots and migrations pause it with the
/// devices, so that no PIT or RTC interrupt is raised while the vCPUs' state is read.
#[derive(Default)]
pub struct TimerGate {
    paused: Mutex<bool>,
    cond: Condvar,
}

impl TimerGate {
    /// Returns once the timer thread is between ticks; it starts no other until `resume`.
    /// (The thread holds the gate's lock while it ticks.)
    pub fn pause(&self) {
        *lock(&self.paused) = true;
    }

    pub fn resume(&self) {
        *lock(&self.paused) = false;
        self.cond.notify_all();
    }
}

/// A device with deadlines of its own, served by the timer thread. It locks only itself,
/// and raises its interrupt after releasing its lock (device lock, then irqchip).
pub trait TimedDevice: Send + Sync {
    /// When it next needs [`TimedDevice::on_deadline`], if ever.
    fn next_deadline(&self) -> Option<Instant>;
    /// Raises what fell due by `now`.
    fn on_deadline(&self, now: Instant);
}

/// The user-space PIT: channel 0 pulses ISA IRQ 0.
pub struct PitTimer {
    pub pit: Arc<Mutex<Pit>>,
    pub irqchip: Arc<dyn IrqChip>,
}

impl TimedDevice for PitTimer {
    fn next_deadline(&self) -> Option<Instant> {
        lock(&self.pit).next_irq_deadline()
    }

    fn on_deadline(&self, now: Instant) {
        let edges = lock(&self.pit).on_timer(now);
        if edges > 0 {
            self.irqchip.pulse_irq(0);
        }
    }
}

/// The CMOS RTC raises and lowers IRQ 8 itself.
impl TimedDevice for Mutex<Rtc> {
    fn next_deadline(&self) -> Option<Instant> {
        lock(self).next_irq_deadline()
    }

    fn on_deadline(&self, now: Instant) {
        lock(self).on_timer(now);
    }
}

/// What the timer thread serves, and how it is woken and paused.
pub struct TimerDevices {
    pub devices: Vec<Arc<dyn TimedDevice>>,
    pub wake: Arc<TimerWake>,
    pub gate: Arc<TimerGate>,
}

impl TimerDevices {
    /// Whether any device here needs the timer thread.
    pub fn has_timers(&self) -> bool {
        !self.devices.is_empty()
    }

    /// The earliest deadline of any device.
    fn next_deadline(&self) -> Option<Instant> {
        self.devices.iter().filter_map(|d| d.next_deadline()).min()
    }
}

pub struct TimerThread {
    stop: Arc<AtomicBool>,
    wake: Arc<TimerWake>,
    gate: Arc<TimerGate>,
    handle: JoinHandle<()>,
}

impl TimerThread {
    pub fn spawn(devices: TimerDevices) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let wake = devices.wake.clone();
        let gate = devices.gate.clone();
        let thread_stop = stop.clone();
        let handle = sandbox::spawn(sandbox::Role::Timer, "timers", move || {
            run(devices, &thread_stop)
        })?;
        Ok(TimerThread {
            stop,
            wake,
            gate,
            handle,
        })
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.wake.deadline_changed();
        // Taking the lock orders the notification after the thread's check of `stop`.
        drop(lock(&self.gate.paused));
        self.gate.cond.notify_all();
        let _ = self.handle.join();
    }
}

fn run(devices: TimerDevices, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let deadline = devices.next_deadline();
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
        let paused = lock(&devices.gate.paused);
        if *paused {
            // Wait for `resume` (or a stop), then look at the deadlines afresh.
            if !stop.load(Ordering::Acquire) {
                let _ = devices.gate.cond.wait_timeout(paused, IDLE_WAIT);
            }
            continue;
        }
        tick(&devices, Instant::now());
        drop(paused);
    }
}

/// Raises what fell due by `now`. Runs with the gate's lock held.
fn tick(devices: &TimerDevices, now: Instant) {
    for device in &devices.devices {
        device.on_deadline(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::bus::BusDeviceMut;
    use std::sync::atomic::AtomicU32;

    #[derive(Default)]
    struct CountIrq0(AtomicU32);
    impl IrqChip for CountIrq0 {
        fn set_irq(&self, gsi: u32, level: bool) {
            if gsi == 0 && level {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn a_paused_gate_holds_the_timer_thread() {
        let mut pit = Pit::new();
        // Channel 0, lobyte/hibyte, mode 2, count 1193: a 1 ms period.
        pit.write(3, &[0x34]);
        pit.write(0, &[0xa9]);
        pit.write(0, &[0x04]);
        let irqs = Arc::new(CountIrq0::default());
        let pit = PitTimer {
            pit: Arc::new(Mutex::new(pit)),
            irqchip: irqs.clone(),
        };
        let devices = TimerDevices {
            devices: vec![Arc::new(pit)],
            wake: Arc::default(),
            gate: Arc::default(),
        };
        let gate = devices.gate.clone();
        let thread = TimerThread::spawn(devices).unwrap();
        let count = || irqs.0.load(Ordering::SeqCst);
        let wait_for_more = |than: u32| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while count() <= than && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            count() > than
        };
        assert!(wait_for_more(0), "the PIT never ticked");
        gate.pause();
        let paused_at = count();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(count(), paused_at, "IRQ 0 raised while paused");
        gate.resume();
        assert!(wait_for_more(paused_at), "no IRQ 0 after resume");
        gate.pause();
        // Stopping a paused thread does not wait for a resume.
        let stopping = Instant::now();
        thread.stop();
        assert!(stopping.elapsed() < IDLE_WAIT * 2);
    }
}
