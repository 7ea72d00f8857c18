//! ACPI S3, suspend to RAM: how the machine goes to sleep and wakes up.
//!
//! The guest writes SLP_TYP = 1 with SLP_EN to PM1a control; the ACPI PM device calls
//! [`PowerControl::suspend`], which only raises a flag and kicks every vCPU out of the guest.
//! Each vCPU thread, at the top of its loop, then sleeps in [`PowerControl::sleep`]: once all
//! are there the machine is suspended (RAM and device state kept, nothing runs in the guest;
//! device threads and timers go on). A wake event — the RTC alarm with RTC_EN set, the power
//! button, or the API's resume — sets WAK_STS (and its own status bit) and releases the
//! vCPUs, each of which puts itself in its power-on state first:
//!
//! - every AP: real mode, waiting for the OS's SIPI (wait-for-SIPI, as firmware leaves it);
//! - the BSP, with firmware: the reset vector. Suspending wrote 0xFE to the CMOS shutdown
//!   status (0x0F), so the firmware's reset path resumes (SeaBIOS jumps to the FACS waking
//!   vector) instead of booting;
//! - the BSP, on a direct kernel boot: ferrovm does what firmware would, and starts it at
//!   the FACS waking vector (real mode CS:IP = vector >> 4 : vector & 0xf, or 32-bit flat
//!   protected mode at X_Firmware_Waking_Vector).
//!
//! Lock order: RTC → power → ACPI PM. [`PowerControl::suspend`] is called with the ACPI PM
//! lock held and takes no lock; the RTC's CMOS byte is written before the power lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use boot::acpi::WakingVector;
use devices::acpi_pm::{AcpiPm, SleepControl, WakeEvent};
use devices::rtc::Rtc;
use hypervisor::{MpState, SegmentRegister, StandardRegisters, Vcpu, VcpuKicker};

use crate::error::{Error, Result};
use crate::memory::GuestMemory;

/// CMOS shutdown status byte, and the value that makes firmware resume from S3.
const CMOS_SHUTDOWN_STATUS: u8 = 0x0f;
const SHUTDOWN_S3_RESUME: u8 = 0xfe;

#[derive(Default)]
struct Inner {
    /// vCPUs in [`PowerControl::sleep`].
    asleep: u32,
    /// All vCPUs are asleep.
    suspended: bool,
    /// A wake event that came while vCPUs were still on their way to sleep.
    pending_wake: Option<WakeEvent>,
    /// Counts wake-ups; a sleeping vCPU waits for it to move.
    wakeups: u64,
    /// vCPUs a wake-up released that have not left yet: a new sleep waits for them, so
    /// that it counts only vCPUs of its own round.
    leaving: u32,
}

/// The machine's sleep state; shared by the ACPI PM device, the RTC, the vCPUs and the API.
pub struct PowerControl {
    vcpus: u32,
    firmware: bool,
    memory: Arc<GuestMemory>,
    requested: AtomicBool,
    inner: Mutex<Inner>,
    cond: Condvar,
    kickers: OnceLock<Vec<VcpuKicker>>,
    acpi_pm: OnceLock<Arc<Mutex<AcpiPm>>>,
    rtc: OnceLock<Arc<Mutex<Rtc>>>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PowerControl {
    /// The power control of a machine of `vcpus` vCPUs, booted through firmware or not.
    pub fn new(vcpus: u32, firmware: bool, memory: Arc<GuestMemory>) -> Self {
        PowerControl {
            vcpus,
            firmware,
            memory,
            requested: AtomicBool::new(false),
            inner: Mutex::new(Inner::default()),
            cond: Condvar::new(),
            kickers: OnceLock::new(),
            acpi_pm: OnceLock::new(),
            rtc: OnceLock::new(),
        }
    }

    /// Connects the ACPI PM device (WAK_STS) and the RTC (CMOS, alarm) once built.
    pub fn attach(self: &Arc<Self>, acpi_pm: Arc<Mutex<AcpiPm>>, rtc: Option<Arc<Mutex<Rtc>>>) {
        let _ = self.acpi_pm.set(acpi_pm);
        if let Some(rtc) = rtc {
            let power = Arc::downgrade(self);
            lock(&rtc).set_alarm_hook(Arc::new(move || {
                if let Some(power) = power.upgrade() {
                    power.rtc_alarm();
                }
            }));
            let _ = self.rtc.set(rtc);
        }
    }

    /// The vCPUs' kickers, once their threads run.
    pub fn set_kickers(&self, kickers: Vec<VcpuKicker>) {
        let _ = self.kickers.set(kickers);
    }

    /// Whether a vCPU should go to sleep (checked at the top of each vCPU loop).
    pub fn suspend_requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    /// Whether the machine is asleep (every vCPU stopped in S3).
    pub fn is_suspended(&self) -> bool {
        lock(&self.inner).suspended
    }

    /// The RTC alarm fired: RTC_STS, and a wake-up if RTC_EN allows it.
    fn rtc_alarm(&self) {
        let enabled = self.acpi_pm.get().is_some_and(|pm| lock(pm).rtc_alarm());
        if enabled {
            self.wake(WakeEvent::RtcAlarm);
        }
    }

    /// Wakes a sleeping machine (or one on its way to sleep); false if it is awake.
    pub fn wake(&self, event: WakeEvent) -> bool {
        let mut inner = lock(&self.inner);
        if inner.suspended {
            self.finish_wake(&mut inner, event);
            true
        } else if self.suspend_requested() {
            inner.pending_wake.get_or_insert(event);
            true
        } else {
            false
        }
    }

    fn finish_wake(&self, inner: &mut Inner, event: WakeEvent) {
        log::info!("S3: woken by {event:?}");
        if let Some(pm) = self.acpi_pm.get() {
            lock(pm).woke(event);
        }
        inner.suspended = false;
        inner.pending_wake = None;
        inner.wakeups += 1;
        inner.leaving = inner.asleep;
        self.requested.store(false, Ordering::Release);
        self.cond.notify_all();
    }

    /// Called by each vCPU thread that saw [`Self::suspend_requested`]: waits until the
    /// machine wakes (or `stop` is set), then puts the vCPU in its state after resume.
    pub fn sleep(&self, vcpu: &mut dyn Vcpu, stop: &AtomicBool) -> Result<()> {
        let id = vcpu.id();
        if id == 0 && self.firmware {
            if let Some(rtc) = self.rtc.get() {
                lock(rtc).set_cmos_byte(CMOS_SHUTDOWN_STATUS, SHUTDOWN_S3_RESUME);
            }
        }
        let mut inner = lock(&self.inner);
        while inner.leaving > 0 && !stop.load(Ordering::Acquire) {
            inner = self.wait(inner);
        }
        let round = inner.wakeups;
        inner.asleep += 1;
        if inner.asleep == self.vcpus {
            log::info!("S3: the machine is suspended");
            inner.suspended = true;
            if let Some(event) = inner.pending_wake {
                self.finish_wake(&mut inner, event);
            }
        }
        while inner.wakeups == round && !stop.load(Ordering::Acquire) {
            inner = self.wait(inner);
        }
        inner.asleep -= 1;
        if inner.wakeups != round {
            inner.leaving = inner.leaving.saturating_sub(1);
            self.cond.notify_all();
        }
        drop(inner);
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        self.reset_for_resume(vcpu)
    }

    /// Waits for a change, at most 100 ms (the caller re-checks the stop flag).
    fn wait<'a>(&self, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.cond
            .wait_timeout(inner, Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Gives `vcpu` the state the platform leaves it in when it resumes.
    fn reset_for_resume(&self, vcpu: &mut dyn Vcpu) -> Result<()> {
        vcpu.finish_pending_exit()?;
        if vcpu.id() != 0 {
            crate::firmware::set_reset_registers(vcpu)?;
            vcpu.set_mp_state(MpState::InitReceived)?;
            return Ok(());
        }
        if self.firmware {
            crate::firmware::set_reset_registers(vcpu)?;
            return Ok(());
        }
        let vector = boot::acpi::read_waking_vector(&*self.memory)
            .map_err(|e| Error::Control(format!("resume from S3: {e}")))?;
        log::info!("S3: the BSP resumes at {vector:x?}");
        set_waking_registers(vcpu, vector)
    }
}

impl SleepControl for PowerControl {
    fn suspend(&self) {
        self.requested.store(true, Ordering::Release);
        for k in self.kickers.get().into_iter().flatten() {
            let _ = k.kick();
        }
    }
}

/// Real mode at CS:IP = vector >> 4 : vector & 0xf, or flat 32-bit protected mode at EIP =
/// the vector; interrupts off, paging off, caches on.
fn set_waking_registers(vcpu: &dyn Vcpu, vector: WakingVector) -> Result<()> {
    crate::firmware::set_reset_registers(vcpu)?;
    let mut sregs = vcpu.sregs()?;
    let rip = match vector {
        WakingVector::RealMode(v) => {
            let segment = (v >> 4) as u16; // a real-mode vector is below 1 MiB
            sregs.cs.selector = segment;
            sregs.cs.base = u64::from(segment) << 4;
            sregs.cr0 = 0x10;
            u64::from(v & 0xf)
        }
        WakingVector::Protected32(v) => {
            let flat = |selector: u16, type_: u8| SegmentRegister {
                base: 0,
                limit: 0xffff_ffff,
                selector,
                type_,
                present: true,
                dpl: 0,
                db: true,
                s: true,
                l: false,
                g: true,
                avl: false,
                unusable: false,
            };
            sregs.cs = flat(0x08, 0xb);
            let data = flat(0x10, 0x3);
            (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
            sregs.cr0 = 0x11;
            u64::from(v)
        }
    };
    vcpu.set_sregs(&sregs)?;
    vcpu.set_regs(&StandardRegisters {
        rip,
        rflags: 0x2,
        ..Default::default()
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn power() -> PowerControl {
        let memory = crate::memory::create_guest_memory(4 << 20, false).unwrap();
        PowerControl::new(2, false, Arc::new(memory))
    }

    #[test]
    fn a_wake_event_only_wakes_a_sleeping_machine() {
        let p = power();
        assert!(!p.wake(WakeEvent::Resume), "awake: nothing to wake");
        assert!(!p.suspend_requested() && !p.is_suspended());
        p.suspend();
        assert!(p.suspend_requested());
        // The vCPUs are still on their way to sleep: the event waits for them.
        assert!(p.wake(WakeEvent::RtcAlarm));
        assert_eq!(lock(&p.inner).pending_wake, Some(WakeEvent::RtcAlarm));
        assert!(!p.is_suspended());
    }
}
