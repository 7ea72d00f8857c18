//! The MC146818 real-time clock and CMOS RAM (ports 0x70-0x71, IRQ 8).
//!
//! Port 0x70 selects a register (bit 7 is the NMI mask, stored and
//! reported by [`Rtc::nmi_masked`]), port 0x71 reads or writes it. The time
//! and date come from the host clock plus an offset the guest sets by
//! writing the time registers; they read in BCD or binary and in 24- or
//! 12-hour format as register B says. Register A selects the periodic rate
//! (2 Hz-8192 Hz) and shows update-in-progress in the last 244 µs of each
//! second; register C holds the interrupt flags (reading it clears them and
//! deasserts IRQ 8); register D reports a valid battery. Bytes 0x0e-0x7f
//! are CMOS RAM (0x32 is the century, part of the clock);
//! [`Rtc::set_memory_sizes`] fills in the memory-size bytes firmware reads,
//! as QEMU does.
//!
//! Interrupts (periodic, alarm, update-ended) are computed from the clock,
//! lazily on every register access and by a VMM timer thread through
//! [`Rtc::next_irq_deadline`] and [`Rtc::on_timer`], the same interface as
//! the PIT. The RTC drives IRQ 8 itself as a level that follows IRQF (the
//! 8259 and the I/O APIC see the rising edge), so the VMM only has to call
//! `on_timer`. The fastest rate, 8192 Hz (122 µs), is above the 100 µs
//! floor of the PIT, so no rate is clamped; missed periods are not queued,
//! they coalesce into the one pending IRQF, as on the real chip when the
//! guest is late reading register C.
//!
//! The clock follows the host's monotonic clock from the moment the device
//! is created (or restored), anchored to the host's UTC time then: a host
//! wall-clock step does not move the guest's RTC.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::bus::{read_bytewise, write_bytewise, Bus, BusDeviceMut, BusError};
use crate::irqchip::{IrqPin, TimerWaker};
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::state::StateError;

/// Index port; the data port follows.
pub const RTC_PORT_INDEX: u64 = 0x70;
/// Ports decoded from [`RTC_PORT_INDEX`].
pub const RTC_PORTS: u64 = 2;
/// The ISA IRQ of the RTC.
pub const RTC_IRQ: u32 = 8;
/// Bytes of CMOS (registers and RAM).
pub const CMOS_SIZE: usize = 128;

const REG_SECONDS: u8 = 0x00;
const REG_SECONDS_ALARM: u8 = 0x01;
const REG_MINUTES: u8 = 0x02;
const REG_MINUTES_ALARM: u8 = 0x03;
const REG_HOURS: u8 = 0x04;
const REG_HOURS_ALARM: u8 = 0x05;
const REG_WEEKDAY: u8 = 0x06;
const REG_DAY: u8 = 0x07;
const REG_MONTH: u8 = 0x08;
const REG_YEAR: u8 = 0x09;
const REG_A: u8 = 0x0a;
const REG_B: u8 = 0x0b;
const REG_C: u8 = 0x0c;
const REG_D: u8 = 0x0d;
/// Century, where QEMU and the FADT's century field put it.
const REG_CENTURY: u8 = 0x32;
const FIRST_RAM: u8 = 0x0e;

/// Registers computed from the clock while it runs.
const TIME_REGS: [u8; 8] = [
    REG_SECONDS,
    REG_MINUTES,
    REG_HOURS,
    REG_WEEKDAY,
    REG_DAY,
    REG_MONTH,
    REG_YEAR,
    REG_CENTURY,
];

const A_UIP: u8 = 0x80;
const A_DV_MASK: u8 = 0x70;
const A_RS_MASK: u8 = 0x0f;
const B_SET: u8 = 0x80;
const B_PIE: u8 = 0x40;
const B_AIE: u8 = 0x20;
const B_UIE: u8 = 0x10;
const B_BINARY: u8 = 0x04;
const B_24H: u8 = 0x02;
const C_IRQF: u8 = 0x80;
const C_PF: u8 = 0x40;
const C_AF: u8 = 0x20;
const C_UF: u8 = 0x10;
const D_VRT: u8 = 0x80;

const NANOS_PER_SEC: u64 = 1_000_000_000;
const RTC_FREQ_HZ: u64 = 32_768;
/// UIP is set this long before each update (8 cycles of 32.768 kHz).
const UIP_HOLD_NS: u64 = 8 * NANOS_PER_SEC / RTC_FREQ_HZ;

/// The largest guest-minus-host offset a guest can set: the time registers
/// reach the year 25755 at most (binary century and year of 255), about
/// 2^39.6 seconds after the epoch.
const MAX_OFFSET_SECS: i64 = 1 << 40;

/// The guest-visible state, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RtcState {
    /// Registers and RAM. While the clock runs, the time registers (0x00,
    /// 0x02, 0x04, 0x06-0x09, 0x32) here are stale: the time is
    /// `offset_secs`; while it is stopped (SET, divider reset) they hold it.
    #[serde(with = "crate::state::byte_array")]
    pub cmos: [u8; CMOS_SIZE],
    /// Selected register.
    pub index: u8,
    /// NMI mask (bit 7 of the last index write).
    pub nmi_masked: bool,
    /// Guest RTC time minus host UTC, in seconds.
    pub offset_secs: i64,
}

impl Default for RtcState {
    fn default() -> Self {
        let mut cmos = [0u8; CMOS_SIZE];
        cmos[usize::from(REG_A)] = 0x26; // 32.768 kHz, 1024 Hz
        cmos[usize::from(REG_B)] = B_24H; // BCD, 24-hour
        cmos[usize::from(REG_D)] = D_VRT;
        RtcState {
            cmos,
            index: 0,
            nmi_masked: false,
            offset_secs: 0,
        }
    }
}

impl RtcState {
    /// Refuses what the MC146818 model could never hold.
    pub fn validate(&self) -> Result<(), StateError> {
        let err = |detail: String| Err(StateError::new("RTC", detail));
        let reg = |r: u8| self.cmos[usize::from(r)];
        if self.index > 0x7f {
            return err(format!("register index {:#04x}", self.index));
        }
        if reg(REG_A) & A_UIP != 0 {
            return err(format!("register A {:#04x} with UIP stored", reg(REG_A)));
        }
        if reg(REG_C) & !(C_IRQF | C_PF | C_AF | C_UF) != 0 {
            return err(format!("register C {:#04x}", reg(REG_C)));
        }
        if reg(REG_D) != D_VRT {
            return err(format!("register D {:#04x}", reg(REG_D)));
        }
        if !(-MAX_OFFSET_SECS..=MAX_OFFSET_SECS).contains(&self.offset_secs) {
            return err(format!("time offset of {} s", self.offset_secs));
        }
        Ok(())
    }
}

/// A broken-down time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tm {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    min: u32,
    sec: u32,
    /// 1 = Sunday.
    wday: u32,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day number (H. Hinnant).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z.saturating_add(719_468);
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era.saturating_mul(400);
    (if m <= 2 { y.saturating_add(1) } else { y }, m, d)
}

impl Tm {
    fn from_secs(t: i64) -> Tm {
        let days = t.div_euclid(86_400);
        let rem = t.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        Tm {
            year,
            month,
            day,
            hour: rem / 3600,
            min: rem / 60 % 60,
            sec: rem % 60,
            wday: (days.rem_euclid(7) as u32 + 4) % 7 + 1,
        }
    }

    /// Seconds since the epoch; out-of-range fields (a guest can write
    /// anything) carry over instead of failing.
    fn to_secs(self) -> i64 {
        let days = days_from_civil(self.year, self.month.clamp(1, 12), 1)
            .saturating_add(i64::from(self.day) - 1);
        days.saturating_mul(86_400)
            .saturating_add(i64::from(self.hour) * 3600)
            .saturating_add(i64::from(self.min) * 60)
            .saturating_add(i64::from(self.sec))
    }
}

fn to_bcd(v: u32) -> u8 {
    let v = v % 100;
    (((v / 10) << 4) | (v % 10)) as u8
}

fn from_bcd(v: u8) -> u32 {
    u32::from(v >> 4) * 10 + u32::from(v & 0xf)
}

/// The CMOS bytes that report guest RAM as a PC BIOS (and QEMU) writes them, as
/// `(index, value)`: base memory in KiB (0x15-0x16), memory above 1 MiB in KiB up to
/// 64 MiB (0x17-0x18, 0x30-0x31), memory between 16 MiB and 4 GiB in 64 KiB units
/// (0x34-0x35), memory above 4 GiB in 64 KiB units (0x5b-0x5d). Also what a kernel-modelled
/// RTC is given (bhyve).
pub fn cmos_memory_sizes(below_4g: u64, above_4g: u64) -> Vec<(u8, u8)> {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    let base = (below_4g / KIB).min(640);
    let ext = (below_4g.saturating_sub(MIB) / KIB).min(0xffff);
    let high = (below_4g.saturating_sub(16 * MIB) / (64 * KIB)).min(0xffff);
    let above = (above_4g / (64 * KIB)).min(0xff_ffff);
    let mut bytes = Vec::with_capacity(11);
    for (index, value, len) in [
        (0x15u8, base, 2u8),
        (0x17, ext, 2),
        (0x30, ext, 2),
        (0x34, high, 2),
        (0x5b, above, 3),
    ] {
        for k in 0..len {
            bytes.push((index + k, (value >> (8 * k)) as u8));
        }
    }
    bytes
}

/// The MC146818 RTC with CMOS RAM.
pub struct Rtc {
    s: RtcState,
    base_instant: Instant,
    /// Host UTC at `base_instant`, in ns since the epoch.
    base_unix_ns: u64,
    /// Host UTC (ns) up to which interrupt flags are computed.
    last_ns: u64,
    irq: IrqPin,
    /// Level currently driven on `irq`.
    line: bool,
    missed: u64,
    waker: Option<Arc<dyn TimerWaker>>,
    alarm_hook: Option<AlarmHook>,
}

/// Called, with the RTC's lock held, when the alarm fires with AIE set (the ACPI RTC event
/// that wakes a sleeping machine). It must not take the RTC's lock.
pub type AlarmHook = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for Rtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rtc")
            .field("state", &self.s)
            .field("irq", &self.irq)
            .field("line", &self.line)
            .finish_non_exhaustive()
    }
}

impl Rtc {
    /// An RTC showing the host's UTC time, interrupting on `irq` (IRQ 8).
    pub fn new(irq: IrqPin) -> Self {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Rtc::with_clock(irq, Instant::now(), unix)
    }

    /// An RTC whose host clock reads `unix` (since the Unix epoch) at `now`.
    pub fn with_clock(irq: IrqPin, now: Instant, unix: Duration) -> Self {
        let base_unix_ns = u64::try_from(unix.as_nanos()).unwrap_or(u64::MAX);
        Rtc {
            s: RtcState::default(),
            base_instant: now,
            base_unix_ns,
            last_ns: base_unix_ns,
            irq,
            line: false,
            missed: 0,
            waker: None,
            alarm_hook: None,
        }
    }

    /// Moves the RTC onto `bus` at ports 0x70-0x71.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), RTC_PORT_INDEX, RTC_PORTS)?;
        Ok(dev)
    }

    /// Called (with the RTC's lock held) when the guest changes the rate or
    /// the interrupt enables.
    pub fn set_waker(&mut self, waker: Arc<dyn TimerWaker>) {
        self.waker = Some(waker);
    }

    /// Calls `hook` whenever the alarm fires with AIE set.
    pub fn set_alarm_hook(&mut self, hook: AlarmHook) {
        self.alarm_hook = Some(hook);
    }

    /// Whether the guest has masked NMIs through port 0x70.
    pub fn nmi_masked(&self) -> bool {
        self.s.nmi_masked
    }

    /// Sets CMOS RAM byte `index` (0x0e-0x7f, except the century at 0x32).
    /// Returns false, changing nothing, for other indices.
    pub fn set_cmos_byte(&mut self, index: u8, value: u8) -> bool {
        if !(FIRST_RAM..CMOS_SIZE as u8).contains(&index) || index == REG_CENTURY {
            return false;
        }
        self.s.cmos[usize::from(index)] = value;
        true
    }

    /// CMOS RAM byte `index` (0x0e-0x7f), as stored; 0 for other indices.
    pub fn cmos_byte(&self, index: u8) -> u8 {
        if (FIRST_RAM..CMOS_SIZE as u8).contains(&index) {
            self.s.cmos[usize::from(index)]
        } else {
            0
        }
    }

    /// Fills in the memory sizes as a PC BIOS (and QEMU) reports them (see
    /// [`cmos_memory_sizes`]).
    pub fn set_memory_sizes(&mut self, below_4g: u64, above_4g: u64) {
        for (index, value) in cmos_memory_sizes(below_4g, above_4g) {
            self.s.cmos[usize::from(index)] = value;
        }
    }

    /// When the next enabled interrupt (periodic, update-ended or alarm
    /// check) is due; `None` if none is enabled or the clock is stopped.
    pub fn next_irq_deadline(&self) -> Option<Instant> {
        if !self.running() {
            return None;
        }
        let b = self.s.cmos[usize::from(REG_B)];
        let mut next: Option<u64> = None;
        if b & B_PIE != 0 {
            if let Some(p) = self.period_ticks() {
                let tick = (ticks32(self.last_ns) / p).checked_add(1)?.checked_mul(p)?;
                let ns = u128::from(tick) * u128::from(NANOS_PER_SEC);
                let ns = u64::try_from(ns.div_ceil(u128::from(RTC_FREQ_HZ))).ok()?;
                next = Some(ns);
            }
        }
        if b & (B_UIE | B_AIE) != 0 {
            let ns = (self.last_ns / NANOS_PER_SEC + 1).checked_mul(NANOS_PER_SEC)?;
            next = Some(next.map_or(ns, |n| n.min(ns)));
        }
        let ns = next?;
        self.base_instant
            .checked_add(Duration::from_nanos(ns.saturating_sub(self.base_unix_ns)))
    }

    /// Brings the interrupt flags up to `now`, raising IRQ 8 if an enabled
    /// one got set. Returns how many enabled interrupt events happened
    /// since the flags were last brought up to date (more than one means
    /// they were coalesced).
    pub fn on_timer(&mut self, now: Instant) -> u32 {
        let events = self.update_flags(now);
        self.missed = self.missed.saturating_add(events.saturating_sub(1));
        u32::try_from(events).unwrap_or(u32::MAX)
    }

    /// Interrupt events folded into another by [`Rtc::on_timer`] so far.
    pub fn missed_ticks(&self) -> u64 {
        self.missed
    }

    /// The guest-visible state.
    pub fn state(&self) -> RtcState {
        self.s
    }

    /// Restores a state captured by [`Rtc::state`] (on this or another
    /// host: the offset from host UTC is what travels). Interrupts are
    /// computed from now on; IRQ 8 is driven to the restored IRQF. A state
    /// the chip could not hold is refused and the RTC left as it was.
    pub fn restore(&mut self, state: &RtcState) -> Result<(), StateError> {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.restore_with_clock(state, Instant::now(), unix)
    }

    /// Like [`Rtc::restore`], with the host clock reading `unix` at `now`.
    pub fn restore_with_clock(
        &mut self,
        state: &RtcState,
        now: Instant,
        unix: Duration,
    ) -> Result<(), StateError> {
        state.validate()?;
        self.s = *state;
        self.base_instant = now;
        self.base_unix_ns = u64::try_from(unix.as_nanos()).unwrap_or(u64::MAX);
        self.last_ns = self.base_unix_ns;
        self.update_irq();
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        if let Some(w) = &self.waker {
            w.deadline_changed();
        }
    }

    fn reg(&self, r: u8) -> u8 {
        self.s.cmos[usize::from(r & 0x7f)]
    }

    fn running(&self) -> bool {
        self.reg(REG_B) & B_SET == 0 && self.reg(REG_A) & A_DV_MASK <= 0x20
    }

    /// The periodic interrupt period in 32.768 kHz cycles.
    fn period_ticks(&self) -> Option<u64> {
        match self.reg(REG_A) & A_RS_MASK {
            0 => None,
            rs @ (1 | 2) => Some(1 << (rs + 6)),
            rs => Some(1 << (rs - 1)),
        }
    }

    fn host_ns(&self, now: Instant) -> u64 {
        let d = now.saturating_duration_since(self.base_instant).as_nanos();
        self.base_unix_ns
            .saturating_add(u64::try_from(d).unwrap_or(u64::MAX))
    }

    fn guest_secs(&self, now: Instant) -> i64 {
        let host = (self.host_ns(now) / NANOS_PER_SEC) as i64; // < 2^35
        host.saturating_add(self.s.offset_secs)
    }

    fn binary(&self) -> bool {
        self.reg(REG_B) & B_BINARY != 0
    }

    fn enc(&self, v: u32) -> u8 {
        if self.binary() {
            v as u8
        } else {
            to_bcd(v)
        }
    }

    fn dec(&self, v: u8) -> u32 {
        if self.binary() {
            u32::from(v)
        } else {
            from_bcd(v)
        }
    }

    fn enc_hour(&self, h: u32) -> u8 {
        if self.reg(REG_B) & B_24H != 0 {
            self.enc(h)
        } else {
            let h12 = match h % 12 {
                0 => 12,
                x => x,
            };
            self.enc(h12) | if h >= 12 { 0x80 } else { 0 }
        }
    }

    fn dec_hour(&self, v: u8) -> u32 {
        if self.reg(REG_B) & B_24H != 0 {
            self.dec(v)
        } else {
            self.dec(v & 0x7f) % 12 + if v & 0x80 != 0 { 12 } else { 0 }
        }
    }

    /// The clock's value of time register `r` at `now`.
    fn time_reg(&self, r: u8, now: Instant) -> u8 {
        let tm = Tm::from_secs(self.guest_secs(now));
        let year = tm.year.clamp(0, 9999) as u32;
        match r {
            REG_SECONDS => self.enc(tm.sec),
            REG_MINUTES => self.enc(tm.min),
            REG_HOURS => self.enc_hour(tm.hour),
            REG_WEEKDAY => self.enc(tm.wday),
            REG_DAY => self.enc(tm.day),
            REG_MONTH => self.enc(tm.month),
            REG_YEAR => self.enc(year % 100),
            _ => self.enc(year / 100), // century
        }
    }

    /// Stops the clock: the time registers take its current value.
    fn freeze(&mut self, now: Instant) {
        for r in TIME_REGS {
            self.s.cmos[usize::from(r)] = self.time_reg(r, now);
        }
    }

    /// Starts the clock from the time registers.
    fn thaw(&mut self, now: Instant) {
        let tm = Tm {
            year: i64::from(self.dec(self.reg(REG_CENTURY))) * 100
                + i64::from(self.dec(self.reg(REG_YEAR))),
            month: self.dec(self.reg(REG_MONTH)),
            day: self.dec(self.reg(REG_DAY)),
            hour: self.dec_hour(self.reg(REG_HOURS)),
            min: self.dec(self.reg(REG_MINUTES)),
            sec: self.dec(self.reg(REG_SECONDS)),
            wday: 1,
        };
        let host = (self.host_ns(now) / NANOS_PER_SEC) as i64;
        self.s.offset_secs = tm.to_secs().saturating_sub(host);
    }

    fn alarm_matches(&self, now: Instant) -> bool {
        [
            (REG_SECONDS_ALARM, REG_SECONDS),
            (REG_MINUTES_ALARM, REG_MINUTES),
            (REG_HOURS_ALARM, REG_HOURS),
        ]
        .iter()
        .all(|&(alarm, reg)| {
            let a = self.reg(alarm);
            a & 0xc0 == 0xc0 || a == self.time_reg(reg, now)
        })
    }

    /// Sets PF/UF/AF for what happened since `last_ns`; returns the number
    /// of events whose interrupt is enabled.
    fn update_flags(&mut self, now: Instant) -> u64 {
        let t = self.host_ns(now);
        if t <= self.last_ns {
            return 0;
        }
        let prev = self.last_ns;
        self.last_ns = t;
        if !self.running() {
            return 0;
        }
        let b = self.reg(REG_B);
        let mut flags = 0u8;
        let mut events = 0u64;
        let mut alarm = false;
        if let Some(p) = self.period_ticks() {
            let crossed = ticks32(t) / p - ticks32(prev) / p;
            if crossed > 0 {
                flags |= C_PF;
                if b & B_PIE != 0 {
                    events += crossed;
                }
            }
        }
        if t / NANOS_PER_SEC > prev / NANOS_PER_SEC {
            flags |= C_UF;
            if b & B_UIE != 0 {
                events += 1;
            }
            if self.alarm_matches(now) {
                flags |= C_AF;
                if b & B_AIE != 0 {
                    events += 1;
                    alarm = true;
                }
            }
        }
        self.s.cmos[usize::from(REG_C)] |= flags;
        self.update_irq();
        if let (true, Some(hook)) = (alarm, &self.alarm_hook) {
            hook();
        }
        events
    }

    /// IRQF and the IRQ 8 line follow the enabled flags.
    fn update_irq(&mut self) {
        let c = self.reg(REG_C);
        let enabled = c & self.reg(REG_B) & (C_PF | C_AF | C_UF) != 0;
        let c = if enabled { c | C_IRQF } else { c & !C_IRQF };
        self.s.cmos[usize::from(REG_C)] = c;
        if enabled != self.line {
            self.line = enabled;
            self.irq.set(enabled);
        }
    }

    fn read_data(&mut self, now: Instant) -> u8 {
        self.update_flags(now);
        let r = self.s.index & 0x7f;
        match r {
            REG_A => {
                let uip = self.running()
                    && self.host_ns(now) % NANOS_PER_SEC >= NANOS_PER_SEC - UIP_HOLD_NS;
                self.reg(REG_A) | if uip { A_UIP } else { 0 }
            }
            REG_C => {
                let c = self.reg(REG_C);
                self.s.cmos[usize::from(REG_C)] = 0;
                self.update_irq();
                c
            }
            REG_D => D_VRT,
            _ if TIME_REGS.contains(&r) && self.running() => self.time_reg(r, now),
            _ => self.reg(r),
        }
    }

    fn write_data(&mut self, v: u8, now: Instant) {
        self.update_flags(now);
        let r = self.s.index & 0x7f;
        match r {
            REG_A | REG_B => {
                let was_running = self.running();
                let v = match r {
                    REG_A => v & !A_UIP,
                    // Setting SET clears UIE.
                    _ if v & B_SET != 0 => v & !B_UIE,
                    _ => v,
                };
                self.s.cmos[usize::from(r)] = v;
                // The held time is in the format in effect when the clock
                // stops or restarts.
                match (was_running, self.running()) {
                    (true, false) => self.freeze(now),
                    (false, true) => self.thaw(now),
                    _ => {}
                }
                self.update_irq();
                self.wake();
            }
            REG_C | REG_D => {} // read-only
            _ if TIME_REGS.contains(&r) && self.running() => {
                self.freeze(now);
                self.s.cmos[usize::from(r)] = v;
                self.thaw(now);
            }
            _ => self.s.cmos[usize::from(r)] = v,
        }
    }

    fn io_read(&mut self, offset: u64, now: Instant) -> u8 {
        match offset {
            1 => self.read_data(now),
            _ => 0xff, // the index port is write-only
        }
    }

    fn io_write(&mut self, offset: u64, v: u8, now: Instant) {
        match offset {
            0 => {
                self.s.index = v & 0x7f;
                self.s.nmi_masked = v & 0x80 != 0;
            }
            1 => self.write_data(v, now),
            _ => {}
        }
    }
}

/// 32.768 kHz cycles since the epoch at host time `ns`.
fn ticks32(ns: u64) -> u64 {
    (u128::from(ns) * u128::from(RTC_FREQ_HZ) / u128::from(NANOS_PER_SEC)) as u64
}

impl BusDeviceMut for Rtc {
    /// A wider access is split into byte accesses to consecutive ports.
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let now = Instant::now();
        read_bytewise(offset, data, |o| self.io_read(o, now));
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let now = Instant::now();
        write_bytewise(offset, data, |o, v| self.io_write(o, v, now));
    }
}

/// Layout version of the state [`Lifecycle::save`] writes: an [`RtcState`].
pub const RTC_STATE_VERSION: u32 = 1;
/// Register B's square-wave enable, which the chip's RESET input clears.
const B_SQWE: u8 = 0x08;

/// Interrupts come from the VMM's timer thread (`on_timer`), which the VMM pauses with the
/// devices; the RTC itself has nothing to pause.
impl Lifecycle for Rtc {
    fn id(&self) -> String {
        "rtc".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(RTC_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        Rtc::restore(self, &state.parse("RTC", RTC_STATE_VERSION)?)
    }

    /// What the MC146818's RESET input does: clears the interrupt enables (PIE, AIE, UIE)
    /// and SQWE in register B and every flag in register C, so IRQ 8 goes low. The time,
    /// the date and CMOS RAM are battery-backed and survive, and so do events due before
    /// the reset (they are dropped, not reported afterwards).
    fn reset(&mut self) {
        let now = self.host_ns(Instant::now());
        self.last_ns = self.last_ns.max(now);
        self.s.cmos[usize::from(REG_B)] &= !(B_PIE | B_AIE | B_UIE | B_SQWE);
        self.s.cmos[usize::from(REG_C)] &= !(C_IRQF | C_PF | C_AF | C_UF);
        self.update_irq();
        self.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::irqchip::IrqChip;

    /// Records line changes.
    #[derive(Default)]
    struct Lines(Mutex<Vec<(u32, bool)>>);
    impl IrqChip for Lines {
        fn set_irq(&self, gsi: u32, level: bool) {
            self.0.lock().unwrap().push((gsi, level));
        }
    }
    impl Lines {
        fn take(&self) -> Vec<(u32, bool)> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    /// 2024-02-29 23:59:58.5 UTC, a Thursday.
    const LEAP_EVE: u64 = 1_709_251_198;

    fn setup(unix_secs: u64, frac_ns: u32) -> (Instant, Rtc, Arc<Lines>) {
        let lines = Arc::new(Lines::default());
        let t0 = Instant::now();
        let rtc = Rtc::with_clock(
            IrqPin::new(lines.clone(), RTC_IRQ),
            t0,
            Duration::new(unix_secs, frac_ns),
        );
        (t0, rtc, lines)
    }

    fn rd(rtc: &mut Rtc, reg: u8, now: Instant) -> u8 {
        rtc.io_write(0, reg, now);
        rtc.io_read(1, now)
    }

    fn wr(rtc: &mut Rtc, reg: u8, v: u8, now: Instant) {
        rtc.io_write(0, reg, now);
        rtc.io_write(1, v, now);
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn calendar_math() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        for d in [-800_000i64, -1, 0, 1, 11_016, 19_782, 2_932_896] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
        let tm = Tm::from_secs(LEAP_EVE as i64);
        assert_eq!(
            tm,
            Tm {
                year: 2024,
                month: 2,
                day: 29,
                hour: 23,
                min: 59,
                sec: 58,
                wday: 5
            }
        );
        assert_eq!(tm.to_secs(), LEAP_EVE as i64);
        assert_eq!(Tm::from_secs(0).wday, 5, "1970-01-01 was a Thursday");
        let _ = Tm::from_secs(i64::MAX);
        let _ = Tm::from_secs(i64::MIN);
        // Garbage fields carry over.
        let t = Tm {
            year: 2024,
            month: 13,
            day: 32,
            hour: 25,
            min: 61,
            sec: 165,
            wday: 1,
        };
        let _ = t.to_secs();
    }

    #[test]
    fn reads_host_time_bcd_and_binary() {
        let (t0, mut rtc, _) = setup(LEAP_EVE, 500_000_000);
        assert_eq!(rd(&mut rtc, REG_SECONDS, t0), 0x58);
        assert_eq!(rd(&mut rtc, REG_MINUTES, t0), 0x59);
        assert_eq!(rd(&mut rtc, REG_HOURS, t0), 0x23);
        assert_eq!(rd(&mut rtc, REG_WEEKDAY, t0), 0x05);
        assert_eq!(rd(&mut rtc, REG_DAY, t0), 0x29);
        assert_eq!(rd(&mut rtc, REG_MONTH, t0), 0x02);
        assert_eq!(rd(&mut rtc, REG_YEAR, t0), 0x24);
        assert_eq!(rd(&mut rtc, REG_CENTURY, t0), 0x20);
        // 2 s later it is March 1st.
        let t = t0 + ms(2000);
        assert_eq!(rd(&mut rtc, REG_SECONDS, t), 0x00);
        assert_eq!(rd(&mut rtc, REG_DAY, t), 0x01);
        assert_eq!(rd(&mut rtc, REG_MONTH, t), 0x03);
        // Binary, 12-hour.
        wr(&mut rtc, REG_B, B_BINARY, t0);
        assert_eq!(rd(&mut rtc, REG_HOURS, t0), 0x80 | 11, "11 PM");
        assert_eq!(rd(&mut rtc, REG_MINUTES, t0), 59);
        assert_eq!(rd(&mut rtc, REG_YEAR, t0), 24);
        wr(&mut rtc, REG_B, 0, t0);
        assert_eq!(rd(&mut rtc, REG_HOURS, t0), 0x91, "BCD 11 PM");
        assert_eq!(rd(&mut rtc, REG_HOURS, t + ms(3_600_000)), 0x01, "1 AM");
        assert_eq!(rd(&mut rtc, REG_D, t0), 0x80);
        assert_eq!(rd(&mut rtc, REG_B, t0), 0);
    }

    #[test]
    fn twelve_hour_encoding() {
        let (_, mut rtc, _) = setup(0, 0);
        rtc.s.cmos[usize::from(REG_B)] = 0;
        assert_eq!(rtc.enc_hour(0), 0x12);
        assert_eq!(rtc.enc_hour(12), 0x92);
        assert_eq!(rtc.enc_hour(13), 0x81);
        for h in 0..24 {
            assert_eq!(rtc.dec_hour(rtc.enc_hour(h)), h);
        }
    }

    #[test]
    fn guest_sets_the_time() {
        let (t0, mut rtc, _) = setup(LEAP_EVE, 0);
        // Linux's sequence: SET, write the fields, clear SET.
        wr(&mut rtc, REG_B, B_SET | B_24H, t0);
        assert_eq!(rd(&mut rtc, REG_SECONDS, t0 + ms(5000)), 0x58, "frozen");
        for (r, v) in [
            (REG_SECONDS, 0x30),
            (REG_MINUTES, 0x15),
            (REG_HOURS, 0x10),
            (REG_DAY, 0x04),
            (REG_MONTH, 0x07),
            (REG_YEAR, 0x99),
            (REG_CENTURY, 0x19),
        ] {
            wr(&mut rtc, r, v, t0);
        }
        assert_eq!(rd(&mut rtc, REG_YEAR, t0), 0x99, "held values read back");
        wr(&mut rtc, REG_B, B_24H, t0 + ms(10_000));
        let t = t0 + ms(10_000);
        assert_eq!(rd(&mut rtc, REG_SECONDS, t), 0x30);
        assert_eq!(rd(&mut rtc, REG_YEAR, t), 0x99);
        assert_eq!(rd(&mut rtc, REG_CENTURY, t), 0x19);
        assert_eq!(
            rd(&mut rtc, REG_WEEKDAY, t),
            0x01,
            "1999-07-04 was a Sunday"
        );
        assert_eq!(rd(&mut rtc, REG_SECONDS, t + ms(61_000)), 0x31);
        assert_eq!(rd(&mut rtc, REG_MINUTES, t + ms(61_000)), 0x16);
        let off = rtc.state().offset_secs;
        assert_eq!(off, 931_083_330 - (LEAP_EVE as i64 + 10));

        // A write while running adjusts just that field.
        wr(&mut rtc, REG_MINUTES, 0x45, t);
        assert_eq!(rd(&mut rtc, REG_MINUTES, t), 0x45);
        assert_eq!(rd(&mut rtc, REG_HOURS, t), 0x10);

        // A divider reset stops the clock too.
        wr(&mut rtc, REG_A, 0x70 | 0x06, t);
        assert_eq!(rd(&mut rtc, REG_SECONDS, t + ms(9000)), 0x30);
        wr(&mut rtc, REG_A, 0x26, t + ms(9000));
        assert_eq!(rd(&mut rtc, REG_SECONDS, t + ms(10_000)), 0x31);

        // Garbage time values do not panic.
        wr(&mut rtc, REG_B, B_SET, t);
        for r in TIME_REGS {
            wr(&mut rtc, r, 0xff, t);
        }
        wr(&mut rtc, REG_B, 0, t);
        for r in TIME_REGS {
            rd(&mut rtc, r, t);
        }
    }

    #[test]
    fn periodic_interrupt_and_register_c() {
        let (t0, mut rtc, lines) = setup(LEAP_EVE, 0);
        wr(&mut rtc, REG_A, 0x26, t0); // 1024 Hz
        assert_eq!(rtc.next_irq_deadline(), None, "PIE off");
        wr(&mut rtc, REG_B, B_24H | B_PIE, t0);
        let d = rtc.next_irq_deadline().unwrap();
        assert_eq!(d - t0, Duration::from_nanos(976_563));
        assert_eq!(rtc.on_timer(d - Duration::from_nanos(1)), 0);
        assert!(lines.take().is_empty());
        assert_eq!(rtc.on_timer(d), 1);
        assert_eq!(lines.take(), vec![(8, true)]);
        // Late by 3 periods: coalesced, line stays high, no new edge.
        assert_eq!(rtc.on_timer(d + Duration::from_nanos(3 * 976_563)), 3);
        assert_eq!(rtc.missed_ticks(), 2);
        assert!(lines.take().is_empty());
        // Reading C returns the flags, clears them, drops the line.
        assert_eq!(rd(&mut rtc, REG_C, d + ms(3)), C_IRQF | C_PF);
        assert_eq!(lines.take(), vec![(8, false)]);
        assert_eq!(rd(&mut rtc, REG_C, d + ms(3)), 0);
        // The next period raises it again.
        let d2 = rtc.next_irq_deadline().unwrap();
        assert!(d2 > d + ms(3));
        rtc.on_timer(d2);
        assert_eq!(lines.take(), vec![(8, true)]);

        // Rates: RS 3 = 8192 Hz, 15 = 2 Hz, 1 = 256 Hz.
        for (rs, hz) in [(3u8, 8192u64), (15, 2), (1, 256), (2, 128)] {
            wr(&mut rtc, REG_A, 0x20 | rs, t0);
            assert_eq!(rtc.period_ticks(), Some(RTC_FREQ_HZ / hz));
        }
        wr(&mut rtc, REG_A, 0x20, t0);
        assert_eq!(rtc.next_irq_deadline(), None, "rate 0");
    }

    #[test]
    fn pf_without_pie_is_polled() {
        let (t0, mut rtc, lines) = setup(LEAP_EVE, 0);
        rd(&mut rtc, REG_C, t0);
        assert_eq!(rd(&mut rtc, REG_C, t0 + ms(2)) & C_PF, C_PF);
        assert_eq!(rd(&mut rtc, REG_C, t0 + ms(2)), 0);
        // Enabling PIE with PF already set raises IRQF and the line.
        rd(&mut rtc, REG_A, t0 + ms(4));
        wr(&mut rtc, REG_B, B_24H | B_PIE, t0 + ms(4));
        assert_eq!(lines.take(), vec![(8, true)]);
        wr(&mut rtc, REG_B, B_24H, t0 + ms(4));
        assert_eq!(lines.take(), vec![(8, false)]);
        assert_eq!(rd(&mut rtc, REG_C, t0 + ms(4)), C_PF);
    }

    #[test]
    fn update_ended_and_alarm() {
        let (t0, mut rtc, lines) = setup(LEAP_EVE, 500_000_000);
        wr(&mut rtc, REG_A, 0x20, t0); // no periodic flag in the way
        wr(&mut rtc, REG_B, B_24H | B_UIE, t0);
        let d = rtc.next_irq_deadline().unwrap();
        assert_eq!(d - t0, ms(500));
        assert_eq!(rtc.on_timer(d), 1);
        assert_eq!(lines.take(), vec![(8, true)]);
        assert_eq!(rd(&mut rtc, REG_C, d) & (C_IRQF | C_UF), C_IRQF | C_UF);
        assert_eq!(lines.take(), vec![(8, false)]);

        // Alarm at 00:00:01 (after midnight), hours and minutes as given.
        let hook_calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let calls = hook_calls.clone();
        rtc.set_alarm_hook(Arc::new(move || {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        wr(&mut rtc, REG_B, B_24H | B_AIE, d);
        wr(&mut rtc, REG_SECONDS_ALARM, 0x01, d);
        wr(&mut rtc, REG_MINUTES_ALARM, 0x00, d);
        wr(&mut rtc, REG_HOURS_ALARM, 0xc0, d); // don't care
        rd(&mut rtc, REG_C, d);
        assert_eq!(rtc.on_timer(d + ms(1000)), 0, "UF only, not enabled");
        assert!(lines.take().is_empty(), "UIE is off");
        assert_eq!(rd(&mut rtc, REG_C, d + ms(1000)), C_UF);
        let d2 = rtc.next_irq_deadline().unwrap();
        assert_eq!(d2, d + ms(2000));
        assert_eq!(hook_calls.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(rtc.on_timer(d2), 1);
        assert_eq!(lines.take(), vec![(8, true)]);
        assert_eq!(rd(&mut rtc, REG_C, d2), C_IRQF | C_AF | C_UF);
        // The alarm with AIE called the hook once (the ACPI RTC event).
        assert_eq!(hook_calls.load(std::sync::atomic::Ordering::SeqCst), 1);

        // SET clears UIE and stops updates and deadlines.
        wr(&mut rtc, REG_B, B_SET | B_UIE | B_24H, d2);
        assert_eq!(rd(&mut rtc, REG_B, d2) & B_UIE, 0);
        assert_eq!(rtc.next_irq_deadline(), None);
        assert_eq!(rtc.on_timer(d2 + ms(5000)), 0);
    }

    #[test]
    fn update_in_progress_window() {
        let (t0, mut rtc, _) = setup(LEAP_EVE, 0);
        assert_eq!(rd(&mut rtc, REG_A, t0) & A_UIP, 0);
        let t = t0 + Duration::from_nanos(NANOS_PER_SEC - UIP_HOLD_NS);
        assert_eq!(rd(&mut rtc, REG_A, t), 0x26 | A_UIP);
        assert_eq!(rd(&mut rtc, REG_A, t + ms(1)), 0x26);
        wr(&mut rtc, REG_A, 0xa6, t0);
        assert_eq!(rtc.state().cmos[usize::from(REG_A)], 0x26, "UIP read-only");
    }

    #[test]
    fn cmos_ram_and_memory_sizes() {
        let (t0, mut rtc, _) = setup(LEAP_EVE, 0);
        wr(&mut rtc, 0x40, 0xab, t0);
        assert_eq!(rd(&mut rtc, 0x40, t0), 0xab);
        assert_eq!(rtc.cmos_byte(0x40), 0xab);
        assert!(rtc.set_cmos_byte(0x7f, 0x11));
        assert!(!rtc.set_cmos_byte(0x32, 0x11));
        assert!(!rtc.set_cmos_byte(0x0c, 0x11));
        assert!(!rtc.set_cmos_byte(0x80, 0x11));
        assert_eq!(rtc.cmos_byte(0x05), 0);
        assert_eq!(rtc.cmos_byte(0x90), 0);
        // Index bit 7 is the NMI mask, not part of the index.
        rtc.io_write(0, 0x80 | 0x7f, t0);
        assert!(rtc.nmi_masked());
        assert_eq!(rtc.io_read(1, t0), 0x11);
        assert_eq!(rtc.io_read(0, t0), 0xff);
        rtc.io_write(0, 0x7f, t0);
        assert!(!rtc.nmi_masked());
        // C and D are read-only.
        wr(&mut rtc, REG_D, 0, t0);
        wr(&mut rtc, REG_C, 0xff, t0);
        assert_eq!(rd(&mut rtc, REG_C, t0), 0);

        const MIB: u64 = 1 << 20;
        rtc.set_memory_sizes(3 * 1024 * MIB, 5 * 1024 * MIB);
        let b = |i: u8| rtc.cmos_byte(i);
        assert_eq!(u16::from_le_bytes([b(0x15), b(0x16)]), 640);
        assert_eq!(u16::from_le_bytes([b(0x17), b(0x18)]), 0xffff);
        assert_eq!(u16::from_le_bytes([b(0x30), b(0x31)]), 0xffff);
        assert_eq!(
            u16::from_le_bytes([b(0x34), b(0x35)]),
            ((3 * 1024 - 16) * 16) as u16
        );
        assert_eq!(
            u32::from_le_bytes([b(0x5b), b(0x5c), b(0x5d), 0]),
            5 * 1024 * 16
        );
        rtc.set_memory_sizes(0, 0);
        assert_eq!(rtc.cmos_byte(0x15), 0);
    }

    #[test]
    fn state_round_trip_keeps_offset() {
        let (t0, mut rtc, lines) = setup(LEAP_EVE, 0);
        wr(&mut rtc, REG_B, B_SET | B_24H, t0);
        wr(&mut rtc, REG_YEAR, 0x28, t0);
        wr(&mut rtc, REG_B, B_24H | B_PIE, t0);
        rtc.on_timer(t0 + ms(2));
        assert_eq!(lines.take(), vec![(8, true)]);
        let st = rtc.state();

        // Restored on a host whose clock is a day later.
        let lines2 = Arc::new(Lines::default());
        let (t1, _, _) = setup(0, 0);
        let mut rtc2 = Rtc::with_clock(IrqPin::new(lines2.clone(), 8), t1, Duration::ZERO);
        let json = serde_json::to_string(&st).unwrap();
        let carried: RtcState = serde_json::from_str(&json).unwrap();
        assert_eq!(carried, st);
        rtc2.restore_with_clock(&carried, t1, Duration::from_secs(LEAP_EVE + 86_400))
            .unwrap();
        assert_eq!(lines2.take(), vec![(8, true)], "pending IRQF re-driven");
        assert_eq!(rd(&mut rtc2, REG_YEAR, t1), 0x28);
        assert_eq!(rd(&mut rtc2, REG_DAY, t1), 0x01, "a day later");
        assert_eq!(rd(&mut rtc2, REG_C, t1), C_IRQF | C_PF);
        let _ = format!("{rtc2:?}");
        rtc2.restore(&RtcState::default()).unwrap();
    }

    #[test]
    fn restore_refuses_impossible_state() {
        let (t0, mut rtc, _lines) = setup(LEAP_EVE, 0);
        wr(&mut rtc, 0x40, 0x5a, t0); // CMOS RAM
        let good = rtc.state();
        let with = |f: &dyn Fn(&mut RtcState)| {
            let mut s = good;
            f(&mut s);
            s
        };
        for bad in [
            with(&|s| s.index = 0x80),
            with(&|s| s.cmos[usize::from(REG_A)] |= A_UIP),
            with(&|s| s.cmos[usize::from(REG_C)] = 0x01),
            with(&|s| s.cmos[usize::from(REG_D)] = 0),
            with(&|s| s.offset_secs = i64::MAX),
            with(&|s| s.offset_secs = -(1 << 41)),
        ] {
            assert!(rtc.restore_with_clock(&bad, t0, Duration::ZERO).is_err());
            assert_eq!(rtc.state(), good, "unchanged");
        }
        // The CMOS array must have exactly 128 bytes.
        let json = serde_json::to_string(&good).unwrap();
        let short = json.replacen("[", "[1,", 1);
        assert!(serde_json::from_str::<RtcState>(&short).is_err());
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["cmos"].as_array_mut().unwrap().pop();
        assert!(serde_json::from_value::<RtcState>(v).is_err());
    }

    #[test]
    fn bus_registration_and_wide_accesses() {
        let mut bus = Bus::new();
        let rtc = Rtc::new(IrqPin::disconnected(8))
            .register(&mut bus)
            .unwrap();
        assert!(bus.is_claimed(0x70) && bus.is_claimed(0x71) && !bus.is_claimed(0x72));
        // outw 0x70: index then data in one access.
        assert!(bus.write(0x70, &[0x50, 0x77]));
        assert_eq!(rtc.lock().unwrap().cmos_byte(0x50), 0x77);
        let mut d = [0u8; 1];
        assert!(bus.read(0x71, &mut d));
        assert_eq!(d[0], 0x77);
        // The clock is near the host's.
        assert!(bus.write(0x70, &[REG_CENTURY]));
        assert!(bus.read(0x71, &mut d));
        assert!(d[0] >= 0x20);
        let mut r = rtc.lock().unwrap();
        r.write(u64::MAX, &[1, 2]);
        let mut d2 = [0u8; 2];
        r.read(u64::MAX, &mut d2);
        r.io_write(5, 0, Instant::now());
        assert_eq!(r.io_read(5, Instant::now()), 0xff);
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(0xfeed_face_0bad_cafe);
        let (t0, mut rtc, lines) = setup(LEAP_EVE, 123);
        let mut t = t0;
        for i in 0..100_000 {
            let r = rng.next();
            if r & 7 == 0 {
                t += Duration::from_nanos(r >> 36);
            }
            let v = (r >> 8) as u8;
            match (r >> 16) % 6 {
                0 => rtc.io_write(0, v, t),
                1 | 2 => rtc.io_write(1, v, t),
                3 => {
                    rtc.io_read((r >> 24) & 3, t);
                }
                4 => {
                    if let Some(d) = rtc.next_irq_deadline() {
                        assert!(d >= t0);
                    }
                }
                _ => {
                    rtc.on_timer(t);
                }
            }
            if i % 1000 == 0 {
                // The line only changes level: bounded, alternating.
                let l = lines.take();
                assert!(l.windows(2).all(|w| w[0].1 != w[1].1));
            }
        }
        // Whatever the guest did, the state it left restores.
        let st = rtc.state();
        let (t1, mut rtc2, _) = setup(LEAP_EVE, 0);
        rtc2.restore_with_clock(&st, t1, Duration::from_secs(LEAP_EVE))
            .unwrap();
        assert_eq!(rtc2.state().cmos, st.cmos);
    }
}
