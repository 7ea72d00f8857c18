//! ACPI fixed hardware: the PM1a event and control registers and the PM timer, at the I/O
//! ports the FADT of `boot::acpi` advertises.
//!
//! | port | register | |
//! | --- | --- | --- |
//! | 0x600 | PM1 status (16 bits) | write 1 to clear; TMR_STS, PWRBTN_STS |
//! | 0x602 | PM1 enable (16 bits) | TMR_EN, GBL_EN, PWRBTN_EN, SLPBTN_EN, RTC_EN |
//! | 0x604 | PM1 control (16 bits) | SCI_EN (always 1), SLP_TYP (12:10), SLP_EN (13) |
//! | 0x608 | PM timer (32 bits, 24 significant) | 3.579545 MHz, from a monotonic clock |
//!
//! The machine has no SMI command port, so it is always in ACPI mode: SCI_EN reads as 1
//! whatever the guest writes. Writing SLP_EN with SLP_TYP = [`S5_SLP_TYP`] (the value of the
//! DSDT's `\_S5_` package) powers the machine off through [`ExitRequest`]; SLP_TYP =
//! [`S3_SLP_TYP`] suspends it to RAM through the [`SleepControl`] the VMM connects (the RTC
//! alarm, with RTC_EN, the power button or the API wake it: [`AcpiPm::woke`] sets WAK_STS);
//! other sleep types are not offered by the DSDT and are ignored. [`AcpiPm::power_button`] presses the
//! fixed-feature power button (PWRBTN_STS, and an SCI when the guest enabled it), which is how
//! an operator asks a guest to shut down cleanly.
//!
//! TMR_STS is set when bit 23 of the timer changes, computed when the guest reads the
//! status; no SCI is raised for it (guests do not use the timer's overflow interrupt).
//! Registers take accesses of any width at any offset inside the block, byte by byte.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::exit::{ExitReason, ExitRequest};
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::serial::{IrqLine, NoIrq};
use crate::state::StateError;

/// First port of the register block (the FADT's PM1a event block).
pub const PM_BASE: u64 = 0x600;
/// Ports claimed: PM1a event (4), PM1a control (2), two unused, PM timer (4).
pub const PM_LEN: u64 = 12;
/// Offset of PM1 status.
pub const PM1_STS: u64 = 0;
/// Offset of PM1 enable.
pub const PM1_EN: u64 = 2;
/// Offset of PM1 control (the FADT's PM1a control block, port 0x604).
pub const PM1_CNT: u64 = 4;
/// Offset of the PM timer (the FADT's PM timer block, port 0x608).
pub const PM_TMR: u64 = 8;
/// PM timer frequency.
pub const PM_TIMER_HZ: u64 = 3_579_545;
/// The timer counts in 24 bits (the FADT does not set TMR_VAL_EXT).
pub const PM_TIMER_MASK: u32 = 0x00ff_ffff;
/// SLP_TYP of the DSDT's `\_S5_` (soft off).
pub const S5_SLP_TYP: u16 = 5;
/// SLP_TYP of the DSDT's `\_S3_` (suspend to RAM).
pub const S3_SLP_TYP: u16 = 1;

/// What puts the machine to sleep when the guest asks for S3 (the VMM's power control).
/// Called on the vCPU thread that wrote PM1 control, with the device's lock held: it must
/// only record the request and make the vCPUs leave the guest, never take this device's
/// lock.
pub trait SleepControl: Send + Sync {
    fn suspend(&self);
}

/// What woke the machine from S3; each sets its PM1 status bit with WAK_STS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeEvent {
    /// The RTC alarm, with RTC_EN set (RTC_STS).
    RtcAlarm,
    /// The fixed power button (PWRBTN_STS).
    PowerButton,
    /// The operator's resume through the API (WAK_STS alone).
    Resume,
}

/// PM1 status / enable bits.
pub const TMR_STS: u16 = 1 << 0;
/// Bus master status (never set here).
pub const BM_STS: u16 = 1 << 4;
/// Global lock release status (never set here).
pub const GBL_STS: u16 = 1 << 5;
/// Power button pressed.
pub const PWRBTN_STS: u16 = 1 << 8;
/// Sleep button pressed (never set here: the FADT says it is not a fixed feature).
pub const SLPBTN_STS: u16 = 1 << 9;
/// RTC alarm (set by [`AcpiPm::rtc_alarm`]).
pub const RTC_STS: u16 = 1 << 10;
/// Woken from a sleep state (set by [`AcpiPm::woke`]).
pub const WAK_STS: u16 = 1 << 15;
/// Status bits a write of 1 clears.
const STS_W1C: u16 = TMR_STS | BM_STS | GBL_STS | PWRBTN_STS | SLPBTN_STS | RTC_STS | WAK_STS;
/// Enable bits that exist (same positions as their status bits).
const EN_MASK: u16 = TMR_STS | GBL_STS | PWRBTN_STS | SLPBTN_STS | RTC_STS;
/// Events that raise an SCI when enabled (TMR_STS is computed lazily and raises none).
const SCI_EVENTS: u16 = PWRBTN_STS | SLPBTN_STS | RTC_STS | GBL_STS;

/// PM1 control: SCI enabled (hardwired here).
pub const SCI_EN: u16 = 1 << 0;
/// PM1 control: bus master reload (stored, no effect).
pub const BM_RLD: u16 = 1 << 1;
/// PM1 control: sleep type field (bits 12:10).
pub const SLP_TYP_SHIFT: u16 = 10;
/// PM1 control: sleep type mask.
pub const SLP_TYP_MASK: u16 = 0b111 << SLP_TYP_SHIFT;
/// PM1 control: sleep enable (write-only, reads 0).
pub const SLP_EN: u16 = 1 << 13;
/// PM1 control bits kept as written.
const CNT_STORED: u16 = BM_RLD | SLP_TYP_MASK;

/// Guest-visible state, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AcpiPmState {
    /// PM1 status bits latched by events (TMR_STS is derived from the timer instead).
    pub pm1_status: u16,
    /// PM1 enable.
    pub pm1_enable: u16,
    /// PM1 control (SCI_EN and SLP_EN are not stored).
    pub pm1_control: u16,
    /// Timer ticks since the machine started (not truncated to 24 bits).
    pub timer_ticks: u64,
    /// `timer_ticks >> 23` when TMR_STS was last cleared.
    pub timer_sts_mark: u64,
}

/// Nanoseconds from a monotonic clock.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The ACPI PM register block.
pub struct AcpiPm {
    pm1_status: u16,
    pm1_enable: u16,
    pm1_control: u16,
    timer_sts_mark: u64,
    /// Added (wrapping) to the ticks derived from `clock`.
    timer_offset: u64,
    clock: Clock,
    exit: Arc<ExitRequest>,
    sci: Arc<dyn IrqLine>,
    sleep: Option<Arc<dyn SleepControl>>,
}

impl fmt::Debug for AcpiPm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcpiPm")
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

/// Timer ticks in `ns` nanoseconds.
fn ticks_in(ns: u64) -> u64 {
    (u128::from(ns) * u128::from(PM_TIMER_HZ) / 1_000_000_000) as u64
}

impl AcpiPm {
    /// A register block whose S5 request ends the VM through `exit`; the timer runs from
    /// now on the host's monotonic clock and the SCI goes nowhere until [`AcpiPm::with_sci`].
    pub fn new(exit: Arc<ExitRequest>) -> Self {
        let origin = Instant::now();
        let clock: Clock =
            Arc::new(move || u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX));
        Self::with_clock(exit, clock)
    }

    /// Like [`AcpiPm::new`] with the timer driven by `clock` (nanoseconds, monotonic).
    pub fn with_clock(exit: Arc<ExitRequest>, clock: Clock) -> Self {
        let mut pm = AcpiPm {
            pm1_status: 0,
            pm1_enable: 0,
            pm1_control: 0,
            timer_sts_mark: 0,
            timer_offset: 0,
            clock,
            exit,
            sci: Arc::new(NoIrq),
            sleep: None,
        };
        // Start counting from 0.
        pm.timer_offset = pm.clock_ticks().wrapping_neg();
        pm
    }

    /// Connects the SCI (ISA IRQ / GSI 9).
    pub fn with_sci(mut self, sci: Arc<dyn IrqLine>) -> Self {
        self.sci = sci;
        self
    }

    /// Lets the guest enter S3 through `sleep` (without it, S3 is refused as unsupported).
    pub fn with_sleep_control(mut self, sleep: Arc<dyn SleepControl>) -> Self {
        self.sleep = Some(sleep);
        self
    }

    /// The RTC alarm fired (with AIE set): latches RTC_STS, raises the SCI if RTC_EN is set,
    /// and returns whether RTC_EN allows the alarm to wake a sleeping machine.
    pub fn rtc_alarm(&mut self) -> bool {
        let before = self.pending_sci();
        self.pm1_status |= RTC_STS;
        self.update_sci(before);
        self.pm1_enable & RTC_STS != 0
    }

    /// The machine woke from S3 because of `event`: WAK_STS and the event's status bit.
    /// The SCI follows the enables as usual once the guest runs.
    pub fn woke(&mut self, event: WakeEvent) {
        let before = self.pending_sci();
        self.pm1_status |= WAK_STS
            | match event {
                WakeEvent::RtcAlarm => RTC_STS,
                WakeEvent::PowerButton => PWRBTN_STS,
                WakeEvent::Resume => 0,
            };
        self.update_sci(before);
    }

    /// Moves the block onto `bus` at ports 0x600-0x60b.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), PM_BASE, PM_LEN)?;
        Ok(dev)
    }

    /// The guest-visible state.
    pub fn state(&self) -> AcpiPmState {
        AcpiPmState {
            pm1_status: self.pm1_status,
            pm1_enable: self.pm1_enable,
            pm1_control: self.pm1_control,
            timer_ticks: self.ticks(),
            timer_sts_mark: self.timer_sts_mark,
        }
    }

    /// Restores a state captured by [`AcpiPm::state`]; the timer continues from the value
    /// it had then. Bits the registers do not have, or a TMR_STS mark ahead of the timer,
    /// are refused.
    pub fn restore(&mut self, state: &AcpiPmState) -> Result<(), StateError> {
        let err = |what: &str, v: u64| Err(StateError::new("ACPI PM", format!("{what} {v:#x}")));
        if state.pm1_status & !(STS_W1C & !TMR_STS) != 0 {
            return err("PM1 status", state.pm1_status.into());
        }
        if state.pm1_enable & !EN_MASK != 0 {
            return err("PM1 enable", state.pm1_enable.into());
        }
        if state.pm1_control & !CNT_STORED != 0 {
            return err("PM1 control", state.pm1_control.into());
        }
        if state.timer_sts_mark > state.timer_ticks >> 23 {
            return err("TMR_STS mark", state.timer_sts_mark);
        }
        self.pm1_status = state.pm1_status;
        self.pm1_enable = state.pm1_enable;
        self.pm1_control = state.pm1_control;
        self.timer_sts_mark = state.timer_sts_mark;
        self.timer_offset = state.timer_ticks.wrapping_sub(self.clock_ticks());
        Ok(())
    }

    /// Presses the fixed-feature power button: sets PWRBTN_STS and raises the SCI if the
    /// guest enabled it (an ACPI guest then shuts down cleanly).
    pub fn power_button(&mut self) {
        let before = self.pending_sci();
        self.pm1_status |= PWRBTN_STS;
        self.update_sci(before);
    }

    /// The current value of the PM timer register (24 bits).
    pub fn timer(&self) -> u32 {
        self.ticks() as u32 & PM_TIMER_MASK
    }

    fn clock_ticks(&self) -> u64 {
        ticks_in((self.clock)())
    }

    fn ticks(&self) -> u64 {
        self.clock_ticks().wrapping_add(self.timer_offset)
    }

    fn status(&self) -> u16 {
        let mut s = self.pm1_status;
        if self.ticks() >> 23 != self.timer_sts_mark {
            s |= TMR_STS;
        }
        s
    }

    fn control(&self) -> u16 {
        self.pm1_control | SCI_EN
    }

    fn pending_sci(&self) -> bool {
        self.pm1_status & self.pm1_enable & SCI_EVENTS != 0
    }

    /// Raises the SCI when an enabled event became pending (SCI_EN is always set).
    fn update_sci(&self, before: bool) {
        if !before && self.pending_sci() {
            self.sci.trigger();
        }
    }

    /// The 12-byte register block as the guest reads it.
    fn image(&self) -> [u8; PM_LEN as usize] {
        let mut img = [0u8; PM_LEN as usize];
        img[0..2].copy_from_slice(&self.status().to_le_bytes());
        img[2..4].copy_from_slice(&self.pm1_enable.to_le_bytes());
        img[4..6].copy_from_slice(&self.control().to_le_bytes());
        img[8..12].copy_from_slice(&self.timer().to_le_bytes());
        img
    }

    fn write_byte(&mut self, offset: u64, value: u8) {
        let (shift, byte_mask) = if offset & 1 == 0 {
            (0, 0x00ffu16)
        } else {
            (8, 0xff00u16)
        };
        let v = u16::from(value) << shift;
        match offset & !1 {
            PM1_STS => {
                let clear = v & STS_W1C;
                if clear & TMR_STS != 0 {
                    self.timer_sts_mark = self.ticks() >> 23;
                }
                self.pm1_status &= !clear;
            }
            PM1_EN => {
                let before = self.pending_sci();
                self.pm1_enable = (self.pm1_enable & !byte_mask) | (v & EN_MASK);
                self.update_sci(before);
            }
            PM1_CNT => {
                self.pm1_control = (self.pm1_control & !byte_mask) | (v & CNT_STORED);
                if v & SLP_EN != 0 {
                    self.sleep();
                }
            }
            // The two unused ports and the read-only timer.
            _ => {}
        }
    }

    /// SLP_EN was written: enter the sleep state in SLP_TYP.
    fn sleep(&mut self) {
        let slp_typ = (self.pm1_control & SLP_TYP_MASK) >> SLP_TYP_SHIFT;
        if slp_typ == S5_SLP_TYP {
            log::debug!("acpi_pm: guest entered S5 (soft off)");
            self.exit.request(ExitReason::PowerOff);
        } else if let (S3_SLP_TYP, Some(sleep)) = (slp_typ, &self.sleep) {
            log::info!("acpi_pm: guest entered S3 (suspend to RAM)");
            sleep.suspend();
        } else {
            log::warn!("acpi_pm: guest asked for unsupported sleep type {slp_typ}; ignored");
        }
    }
}

impl BusDeviceMut for AcpiPm {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let img = self.image();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| usize::try_from(o).ok())
                .and_then(|o| img.get(o).copied())
                .unwrap_or(0xff);
        }
    }

    /// Bytes are applied in order; SLP_EN takes effect with the byte that carries it, after
    /// the SLP_TYP bits of the same byte (both are in the high byte of PM1 control).
    fn write(&mut self, offset: u64, data: &[u8]) {
        for (i, &b) in data.iter().enumerate() {
            match offset.checked_add(i as u64) {
                Some(o) if o < PM_LEN => self.write_byte(o, b),
                _ => break,
            }
        }
    }
}

/// Layout version of the state [`Lifecycle::save`] writes: an [`AcpiPmState`].
pub const ACPI_PM_STATE_VERSION: u32 = 1;

/// The PM timer is derived from the host clock when read, and the SCI is raised on the
/// vCPU thread that enables it: nothing runs on its own, so pause and resume have nothing
/// to do.
impl Lifecycle for AcpiPm {
    fn id(&self) -> String {
        "acpi_pm".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(ACPI_PM_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        AcpiPm::restore(self, &state.parse("ACPI PM", ACPI_PM_STATE_VERSION)?)
    }

    /// PM1 status, enable and control cleared. The PM timer is free-running and keeps
    /// counting, as QEMU's does across a system reset.
    fn reset(&mut self) {
        self.pm1_status = 0;
        self.pm1_enable = 0;
        self.pm1_control = 0;
        self.timer_sts_mark = self.ticks() >> 23;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    #[derive(Default)]
    struct CountingIrq(AtomicUsize);
    impl IrqLine for CountingIrq {
        fn trigger(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Fixture {
        exit: Arc<ExitRequest>,
        bus: Bus,
        dev: Arc<Mutex<AcpiPm>>,
        now: Arc<AtomicU64>,
        sci: Arc<CountingIrq>,
    }

    fn setup() -> Fixture {
        let exit = Arc::new(ExitRequest::new().unwrap());
        let now = Arc::new(AtomicU64::new(1_000_000_000));
        let n = now.clone();
        let sci = Arc::new(CountingIrq::default());
        let mut bus = Bus::new();
        let dev = AcpiPm::with_clock(exit.clone(), Arc::new(move || n.load(Ordering::SeqCst)))
            .with_sci(sci.clone())
            .register(&mut bus)
            .unwrap();
        Fixture {
            exit,
            bus,
            dev,
            now,
            sci,
        }
    }

    fn inw(bus: &Bus, port: u64) -> u16 {
        let mut d = [0u8; 2];
        assert!(bus.read(port, &mut d), "port {port:#x} unclaimed");
        u16::from_le_bytes(d)
    }
    fn inl(bus: &Bus, port: u64) -> u32 {
        let mut d = [0u8; 4];
        assert!(bus.read(port, &mut d), "port {port:#x} unclaimed");
        u32::from_le_bytes(d)
    }
    fn outw(bus: &Bus, port: u64, v: u16) {
        assert!(bus.write(port, &v.to_le_bytes()));
    }

    #[test]
    fn ports_claimed() {
        let f = setup();
        for p in 0x600..0x60c {
            assert!(f.bus.is_claimed(p), "{p:#x}");
        }
        assert!(!f.bus.is_claimed(0x5ff) && !f.bus.is_claimed(0x60c));
        let mut d = [0u8; 4];
        assert!(!f.bus.read(0x60a, &mut d), "straddles the end");
    }

    #[test]
    fn s5_powers_off() {
        let f = setup();
        assert_eq!(inw(&f.bus, 0x604) & SCI_EN, SCI_EN, "always in ACPI mode");
        // What ACPICA does: SLP_TYP first, then SLP_TYP | SLP_EN, preserving SCI_EN.
        let typ = S5_SLP_TYP << SLP_TYP_SHIFT;
        outw(&f.bus, 0x604, SCI_EN | typ);
        assert!(!f.exit.is_requested());
        assert_eq!(inw(&f.bus, 0x604), SCI_EN | typ);
        outw(&f.bus, 0x604, SCI_EN | typ | SLP_EN);
        assert_eq!(f.exit.reason(), Some(ExitReason::PowerOff));
        assert_eq!(inw(&f.bus, 0x604) & SLP_EN, 0, "SLP_EN reads 0");

        // A single byte write to the high half carries both fields.
        let f = setup();
        assert!(f.bus.write(0x605, &[((typ | SLP_EN) >> 8) as u8]));
        assert_eq!(f.exit.reason(), Some(ExitReason::PowerOff));
    }

    #[test]
    fn other_sleep_types_ignored() {
        let f = setup();
        // S3 (1) too, without a sleep control.
        for t in [0u16, 1, 3, 4, 7] {
            outw(&f.bus, 0x604, (t << SLP_TYP_SHIFT) | SLP_EN);
        }
        // SLP_EN in the low byte write is not SLP_EN (bit 13 is in the high byte).
        assert!(f.bus.write(0x604, &[0x20]));
        // SLP_TYP = 5 without SLP_EN.
        outw(&f.bus, 0x604, S5_SLP_TYP << SLP_TYP_SHIFT);
        assert!(!f.exit.is_requested());
        // SCI_EN cannot be cleared.
        outw(&f.bus, 0x604, 0);
        assert_eq!(inw(&f.bus, 0x604), SCI_EN);
    }

    #[derive(Default)]
    struct CountingSleep(AtomicUsize);
    impl SleepControl for CountingSleep {
        fn suspend(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn s3_suspends_through_the_sleep_control() {
        let f = setup();
        let sleep = Arc::new(CountingSleep::default());
        f.dev.lock().unwrap().sleep = Some(sleep.clone());
        let typ = S3_SLP_TYP << SLP_TYP_SHIFT;
        outw(&f.bus, 0x604, SCI_EN | typ);
        assert_eq!(sleep.0.load(Ordering::SeqCst), 0, "SLP_TYP alone");
        outw(&f.bus, 0x604, SCI_EN | typ | SLP_EN);
        assert_eq!(sleep.0.load(Ordering::SeqCst), 1);
        assert!(!f.exit.is_requested(), "S3 is not an exit");
        // Other types still do nothing; S5 still powers off.
        outw(&f.bus, 0x604, (3 << SLP_TYP_SHIFT) | SLP_EN);
        assert_eq!(sleep.0.load(Ordering::SeqCst), 1);
        outw(&f.bus, 0x604, (S5_SLP_TYP << SLP_TYP_SHIFT) | SLP_EN);
        assert_eq!(f.exit.reason(), Some(ExitReason::PowerOff));
    }

    #[test]
    fn rtc_alarm_and_wake_status() {
        let f = setup();
        let mut pm = f.dev.lock().unwrap();
        // RTC_EN clear: RTC_STS latches, no SCI, no wake-up allowed.
        assert!(!pm.rtc_alarm());
        assert_eq!(pm.status() & RTC_STS, RTC_STS);
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 0);
        pm.write_byte(PM1_STS + 1, (RTC_STS >> 8) as u8);
        assert_eq!(pm.status() & RTC_STS, 0, "write 1 to clear");
        // RTC_EN set: the alarm may wake the machine and raises the SCI.
        pm.write_byte(PM1_EN + 1, (RTC_STS >> 8) as u8);
        assert!(pm.rtc_alarm());
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 1);
        pm.write_byte(PM1_STS + 1, 0xff);
        pm.woke(WakeEvent::RtcAlarm);
        assert_eq!(pm.status() & (WAK_STS | RTC_STS), WAK_STS | RTC_STS);
        pm.write_byte(PM1_STS + 1, 0xff);
        pm.woke(WakeEvent::PowerButton);
        assert_eq!(pm.status() & (WAK_STS | PWRBTN_STS), WAK_STS | PWRBTN_STS);
        pm.write_byte(PM1_STS + 1, 0xff);
        pm.woke(WakeEvent::Resume);
        assert_eq!(pm.status() & !TMR_STS, WAK_STS);
        // WAK_STS survives a snapshot.
        let state = pm.state();
        let mut other = AcpiPm::new(f.exit.clone());
        other.restore(&state).unwrap();
        assert_eq!(other.status() & WAK_STS, WAK_STS);
    }

    #[test]
    fn timer_counts_at_3_579545_mhz() {
        let f = setup();
        assert_eq!(inl(&f.bus, 0x608), 0, "starts at 0");
        f.now.fetch_add(1_000_000, Ordering::SeqCst); // 1 ms
        assert_eq!(inl(&f.bus, 0x608), 3579);
        f.now.fetch_add(999_000_000, Ordering::SeqCst); // 1 s in total
        assert_eq!(inl(&f.bus, 0x608), 3_579_545);
        // 24 bits: wraps after 2^24 ticks (about 4.69 s).
        f.now.fetch_add(4_000_000_000, Ordering::SeqCst);
        let t = inl(&f.bus, 0x608);
        assert_eq!(t, (ticks_in(5_000_000_000) as u32) & PM_TIMER_MASK);
        assert!(t <= PM_TIMER_MASK);
        // Byte reads agree with the dword.
        let mut b = [0u8; 1];
        f.bus.read(0x609, &mut b);
        assert_eq!(b[0], (t >> 8) as u8);
        f.bus.read(0x60b, &mut b);
        assert_eq!(b[0], 0);
        // Read-only.
        assert!(f.bus.write(0x608, &[0xff; 4]));
        assert_eq!(inl(&f.bus, 0x608), t);
    }

    #[test]
    fn real_clock_is_monotonic() {
        let exit = Arc::new(ExitRequest::new().unwrap());
        let pm = AcpiPm::new(exit);
        let a = pm.ticks();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = pm.ticks();
        assert!(b > a, "{a} {b}");
        assert!(b - a >= 7000, "2 ms is at least 7159 ticks: {}", b - a);
    }

    #[test]
    fn tmr_sts_on_bit_23_and_w1c() {
        let f = setup();
        assert_eq!(inw(&f.bus, 0x600) & TMR_STS, 0);
        // 2^23 ticks ≈ 2.343 s.
        f.now.fetch_add(2_400_000_000, Ordering::SeqCst);
        assert_eq!(inw(&f.bus, 0x600) & TMR_STS, TMR_STS);
        outw(&f.bus, 0x600, 0); // writing 0 clears nothing
        assert_eq!(inw(&f.bus, 0x600) & TMR_STS, TMR_STS);
        outw(&f.bus, 0x600, TMR_STS);
        assert_eq!(inw(&f.bus, 0x600) & TMR_STS, 0);
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 0, "no SCI for the timer");
    }

    #[test]
    fn power_button_and_sci() {
        let f = setup();
        // Not enabled: status latches, no SCI.
        f.dev.lock().unwrap().power_button();
        assert_eq!(inw(&f.bus, 0x600) & PWRBTN_STS, PWRBTN_STS);
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 0);
        // Enabling a pending event raises the SCI.
        outw(&f.bus, 0x602, PWRBTN_STS);
        assert_eq!(inw(&f.bus, 0x602), PWRBTN_STS);
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 1);
        // W1C clears it; a new press raises the SCI again.
        outw(&f.bus, 0x600, PWRBTN_STS);
        assert_eq!(inw(&f.bus, 0x600) & PWRBTN_STS, 0);
        f.dev.lock().unwrap().power_button();
        assert_eq!(f.sci.0.load(Ordering::SeqCst), 2);
        // Unknown enable bits are not stored.
        outw(&f.bus, 0x602, 0xffff);
        assert_eq!(inw(&f.bus, 0x602), EN_MASK);
        assert!(!f.exit.is_requested());
    }

    #[test]
    fn snapshot_restore_continues_timer() {
        let f = setup();
        outw(&f.bus, 0x602, PWRBTN_STS);
        f.dev.lock().unwrap().power_button();
        outw(&f.bus, 0x604, 3 << SLP_TYP_SHIFT);
        f.now.fetch_add(123_000_000, Ordering::SeqCst);
        let s = f.dev.lock().unwrap().state();
        assert_eq!(s.timer_ticks, ticks_in(123_000_000));

        // A new machine whose clock reads something else entirely.
        let g = setup();
        g.now.store(77_000_000_000, Ordering::SeqCst);
        let json = serde_json::to_string(&s).unwrap();
        let carried: AcpiPmState = serde_json::from_str(&json).unwrap();
        g.dev.lock().unwrap().restore(&carried).unwrap();
        assert_eq!(g.dev.lock().unwrap().state(), s);
        assert_eq!(inl(&g.bus, 0x608), ticks_in(123_000_000) as u32);
        g.now.fetch_add(1_000_000, Ordering::SeqCst);
        assert_eq!(
            inl(&g.bus, 0x608),
            (s.timer_ticks + 3579) as u32 & PM_TIMER_MASK
        );
        assert_eq!(inw(&g.bus, 0x600), PWRBTN_STS);
        assert_eq!(inw(&g.bus, 0x604), SCI_EN | (3 << SLP_TYP_SHIFT));
    }

    #[test]
    fn restore_refuses_impossible_state() {
        let f = setup();
        outw(&f.bus, 0x602, PWRBTN_STS | TMR_STS);
        f.dev.lock().unwrap().power_button();
        f.now.fetch_add(5_000_000_000, Ordering::SeqCst); // TMR_STS set
        outw(&f.bus, 0x600, TMR_STS); // and cleared: the mark moves
        let good = f.dev.lock().unwrap().state();
        assert_eq!(good.timer_sts_mark, good.timer_ticks >> 23);
        let mut d = f.dev.lock().unwrap();
        for bad in [
            AcpiPmState {
                pm1_status: TMR_STS, // derived from the timer, never stored
                ..good
            },
            AcpiPmState {
                pm1_status: 1 << 2,
                ..good
            },
            AcpiPmState {
                pm1_enable: 1 << 15,
                ..good
            },
            AcpiPmState {
                pm1_control: SLP_EN,
                ..good
            },
            AcpiPmState {
                timer_sts_mark: (good.timer_ticks >> 23) + 1,
                ..good
            },
        ] {
            assert!(d.restore(&bad).is_err(), "{bad:?}");
            assert_eq!(d.state(), good, "unchanged");
        }
        d.restore(&good).unwrap();
        assert!(serde_json::from_str::<AcpiPmState>("{}").is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(7);
        let f = setup();
        let mut buf = [0u8; 16];
        for _ in 0..20_000 {
            let port = 0x5fc + rng.next() % 20;
            let size = (rng.next() % 9) as usize;
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            if rng.next() & 1 == 0 {
                f.bus.read(port, &mut buf[..size]);
            } else {
                f.bus.write(port, &buf[..size]);
            }
        }
        let mut d = f.dev.lock().unwrap();
        d.read(u64::MAX, &mut buf);
        assert!(buf.iter().all(|&b| b == 0xff));
        d.write(u64::MAX - 1, &[0xff; 8]);
        d.read(10, &mut buf);
        assert_eq!(&buf[2..], &[0xff; 14]);
        d.write(0, &[]);
        // Random writes may well have entered S5; fine.
        let _ = f.exit.reason();
        // Whatever the guest did, the state it left restores.
        let st = d.state();
        drop(d);
        let g = setup();
        g.dev.lock().unwrap().restore(&st).unwrap();
        assert_eq!(g.dev.lock().unwrap().state(), st);
    }
}
