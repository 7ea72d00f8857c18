//! The 8254 programmable interval timer (ports 0x40-0x43) and system
//! control port B (0x61: channel 2 gate and output, speaker enable).
//!
//! Counters are derived from a monotonic clock (`Instant`) at 1.193182 MHz
//! instead of ticking, so reading a counter is exact and costs nothing
//! while the guest is idle. Modes 0-5 are modelled (1 and 5 only make sense
//! on channel 2, the only channel whose gate the guest controls); BCD
//! counting, counter latch and read-back commands, and the lo/hi/lohi
//! access modes are supported.
//!
//! Channel 0's output drives ISA IRQ 0. A user-space model cannot tick at
//! 1 MHz, so a timer thread in the VMM drives it:
//!
//! ```text
//! loop {
//!     let deadline = pit.lock().next_irq_deadline();   // None: sleep until woken
//!     sleep until deadline (or until the TimerWaker fires)
//!     if pit.lock().on_timer(Instant::now()) > 0 { irqchip.pulse_irq(PIT_IRQ) }
//! }
//! ```
//!
//! The rate is limited: periodic interrupts (modes 2 and 3) come at most
//! every [`MIN_IRQ_PERIOD`] (200 µs, 5 kHz, as KVM's in-kernel PIT has the
//! same kind of floor, its `min_timer_period_us`), whatever the count; the
//! counter and the channel output as read by the guest keep the programmed
//! rate. Missed periods are not queued: [`Pit::on_timer`] reports how many
//! edges fell due since the previous call (one IRQ 0 edge covers them, the
//! interrupt controllers coalesce edges anyway) and [`Pit::missed_ticks`]
//! counts the ones that were folded.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::bus::{read_bytewise, write_bytewise, Bus, BusDeviceMut, BusError};
use crate::irqchip::TimerWaker;
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::state::StateError;

/// The PIT's input clock.
pub const PIT_FREQ_HZ: u64 = 1_193_182;
/// First PIT port (channel 0 data); 0x43 is the mode/command register.
pub const PIT_BASE: u64 = 0x40;
/// Ports the PIT decodes from [`PIT_BASE`].
pub const PIT_PORTS: u64 = 4;
/// System control port B.
pub const PORT_B: u64 = 0x61;
/// The ISA IRQ channel 0 drives.
pub const PIT_IRQ: u32 = 0;
/// Shortest interval between two IRQ 0 edges.
pub const MIN_IRQ_PERIOD: Duration = Duration::from_micros(200);

const NANOS_PER_SEC: u64 = 1_000_000_000;
/// [`MIN_IRQ_PERIOD`] in PIT ticks, rounded up (239 ticks, 200.3 µs).
const MIN_PERIOD_TICKS: u64 = (200_000 * PIT_FREQ_HZ).div_ceil(NANOS_PER_SEC);
/// Device offset of port B (the device sees 0x40-0x43 as 0-3).
const PORT_B_OFFSET: u64 = PORT_B - PIT_BASE;
const COMMAND_OFFSET: u64 = 3;

// Port B bits.
const PORT_B_GATE2: u8 = 0x01;
const PORT_B_WRITABLE: u8 = 0x0f;
const PORT_B_REFRESH: u8 = 0x10;
const PORT_B_OUT2: u8 = 0x20;

// Access modes.
const ACCESS_LSB: u8 = 1;
const ACCESS_MSB: u8 = 2;
const ACCESS_WORD: u8 = 3;

/// Whole PIT ticks in `d`.
fn ticks(d: Duration) -> u64 {
    let t = d.as_nanos() * u128::from(PIT_FREQ_HZ) / u128::from(NANOS_PER_SEC);
    u64::try_from(t).unwrap_or(u64::MAX)
}

/// The shortest duration holding at least `t` ticks.
fn ticks_to_duration(t: u64) -> Duration {
    let ns = (u128::from(t) * u128::from(NANOS_PER_SEC)).div_ceil(u128::from(PIT_FREQ_HZ));
    let secs = u64::try_from(ns / u128::from(NANOS_PER_SEC)).unwrap_or(u64::MAX);
    Duration::new(secs, (ns % u128::from(NANOS_PER_SEC)) as u32)
}

fn from_bcd16(v: u16) -> u32 {
    (0..4)
        .rev()
        .fold(0, |acc, i| acc * 10 + u32::from((v >> (4 * i)) & 0xf))
}

fn to_bcd16(v: u64) -> u16 {
    let v = v % 10_000;
    (((v / 1000) << 12) | ((v / 100 % 10) << 8) | ((v / 10 % 10) << 4) | (v % 10)) as u16
}

/// The guest-visible state of one counter, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PitChannelState {
    /// Counter mode, 0-5.
    pub mode: u8,
    /// 1: LSB only, 2: MSB only, 3: LSB then MSB.
    pub access: u8,
    /// BCD counting.
    pub bcd: bool,
    /// The initial count in counts (1-65536; 1-10000 in BCD).
    pub count: u32,
    /// A count was written since the last control word.
    pub loaded: bool,
    /// The gate input.
    pub gate: bool,
    /// Modes 1 and 5: the gate has triggered the counter.
    pub triggered: bool,
    /// Ticks counted since the count was loaded (or triggered).
    pub elapsed: u64,
    /// Whether the counter is counting.
    pub counting: bool,
    /// Unlatched lohi reads: the MSB comes next.
    pub read_msb_next: bool,
    /// lohi writes: the MSB comes next.
    pub write_msb_next: bool,
    /// The LSB of a lohi count being written.
    pub write_latch: u8,
    /// Latched count, if any.
    pub count_latch: Option<u16>,
    /// Latched lohi reads: the MSB comes next.
    pub latch_msb_next: bool,
    /// Latched status byte, if any.
    pub status_latch: Option<u8>,
    /// Status "null count": a count is being written.
    pub null_count: bool,
    /// Output edges already reported by [`Pit::on_timer`] (channel 0).
    pub irq_edges: u64,
}

impl Default for PitChannelState {
    /// Power-on: never programmed (no count, no output edges), lohi access.
    fn default() -> Self {
        PitChannelState {
            mode: 0,
            access: ACCESS_WORD,
            bcd: false,
            count: 0x10000,
            loaded: false,
            gate: true,
            triggered: false,
            elapsed: 0,
            counting: false,
            read_msb_next: false,
            write_msb_next: false,
            write_latch: 0,
            count_latch: None,
            latch_msb_next: false,
            status_latch: None,
            null_count: true,
            irq_edges: 0,
        }
    }
}

/// The guest-visible state of the PIT and port B, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PitState {
    /// Channels 0-2.
    pub channels: [PitChannelState; 3],
    /// Port B bits 1-3 (bit 0 is channel 2's gate).
    pub port_b: u8,
    /// Channel 0 edges that fell due before the guest re-programmed it and
    /// that [`Pit::on_timer`] has not reported yet.
    pub unreported_irq_edges: u64,
}

impl Default for PitState {
    fn default() -> Self {
        let mut channels = [PitChannelState::default(); 3];
        channels[2].gate = false;
        PitState {
            channels,
            port_b: 0,
            unreported_irq_edges: 0,
        }
    }
}

impl PitChannelState {
    fn validate(&self, i: usize) -> Result<(), StateError> {
        let err = |detail: String| Err(StateError::new("PIT", format!("channel {i}: {detail}")));
        if self.mode > 5 || !(ACCESS_LSB..=ACCESS_WORD).contains(&self.access) {
            return err(format!("mode {} access {}", self.mode, self.access));
        }
        // A count is loaded in the counting format of its control word (which clears
        // `loaded`), so a loaded BCD count is at most 10^4.
        let max = if self.bcd && self.loaded {
            10_000
        } else {
            0x10000
        };
        if !(1..=max).contains(&self.count) {
            return err(format!("count {:#x} (bcd {})", self.count, self.bcd));
        }
        if self.counting && !self.loaded {
            return err("counting without a count".into());
        }
        // Only channel 2's gate is wired to anything (port B); 0 and 1 are tied high.
        if i != 2 && !self.gate {
            return err("gate low".into());
        }
        Ok(())
    }
}

impl PitState {
    /// Refuses what the 8254 model could never hold.
    pub fn validate(&self) -> Result<(), StateError> {
        for (i, c) in self.channels.iter().enumerate() {
            c.validate(i)?;
        }
        if self.port_b & !(PORT_B_WRITABLE & !PORT_B_GATE2) != 0 {
            return Err(StateError::new(
                "PIT",
                format!("port B {:#04x}", self.port_b),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Channel {
    /// `s.elapsed` holds the ticks counted before `run_since`.
    s: PitChannelState,
    run_since: Option<Instant>,
}

impl Channel {
    /// A channel resuming `s` (validated) at `now`.
    fn from_state(s: &PitChannelState, now: Instant) -> Self {
        let run_since = s.counting.then_some(now);
        Channel { s: *s, run_since }
    }

    fn state(&self, now: Instant) -> PitChannelState {
        PitChannelState {
            elapsed: self.elapsed(now),
            counting: self.run_since.is_some(),
            ..self.s
        }
    }

    fn elapsed(&self, now: Instant) -> u64 {
        let running = self
            .run_since
            .map_or(0, |t| ticks(now.saturating_duration_since(t)));
        self.s.elapsed.saturating_add(running)
    }

    fn count(&self) -> u64 {
        u64::from(self.s.count.max(1))
    }

    fn modulus(&self) -> u64 {
        if self.s.bcd {
            10_000
        } else {
            0x10000
        }
    }

    fn pause(&mut self, now: Instant) {
        self.s.elapsed = self.elapsed(now);
        self.run_since = None;
    }

    fn restart(&mut self, now: Instant) {
        self.s.elapsed = 0;
        self.s.irq_edges = 0;
        self.run_since = Some(now);
    }

    fn stop(&mut self) {
        self.s.elapsed = 0;
        self.s.irq_edges = 0;
        self.run_since = None;
    }

    /// The counting element's value.
    fn counter(&self, now: Instant) -> u64 {
        let n = self.count();
        let m = self.modulus();
        if !self.s.loaded || (matches!(self.s.mode, 1 | 5) && !self.s.triggered) {
            return n % m;
        }
        let d = self.elapsed(now);
        let v = match self.s.mode {
            2 => n - d % n,
            3 => n - (d.wrapping_mul(2) % n),
            // 0, 1, 4, 5: count down once, then wrap and keep going.
            _ => (n % m + m - d % m) % m,
        };
        v % m
    }

    /// The counter as the guest reads it.
    fn read_value(&self, now: Instant) -> u16 {
        let v = self.counter(now);
        if self.s.bcd {
            to_bcd16(v)
        } else {
            v as u16 // < 0x10000
        }
    }

    fn out(&self, now: Instant) -> bool {
        if !self.s.loaded {
            return self.s.mode != 0;
        }
        let n = self.count();
        let d = self.elapsed(now);
        match self.s.mode {
            0 => d >= n,
            1 => !self.s.triggered || d >= n,
            2 => !self.s.gate || d % n != n - 1,
            3 => !self.s.gate || d % n < n.div_ceil(2),
            4 => d != n,
            _ => !self.s.triggered || d != n,
        }
    }

    fn irq_period(&self) -> u64 {
        self.count().max(MIN_PERIOD_TICKS)
    }

    /// Rising output edges (as IRQ 0 sees them) after `d` ticks.
    fn edges_total(&self, d: u64) -> u64 {
        if !self.s.loaded {
            return 0;
        }
        let n = self.count();
        let fired = match self.s.mode {
            2 | 3 => return d / self.irq_period(),
            0 => d >= n,
            1 => self.s.triggered && d >= n,
            4 => d > n,
            _ => self.s.triggered && d > n,
        };
        u64::from(fired)
    }

    /// The tick count at which the next unreported edge happens.
    fn next_edge_tick(&self) -> Option<u64> {
        self.run_since?;
        let n = self.count();
        match self.s.mode {
            2 | 3 => self
                .s
                .irq_edges
                .checked_add(1)?
                .checked_mul(self.irq_period()),
            0 | 1 => (self.s.irq_edges == 0).then_some(n),
            _ => (self.s.irq_edges == 0).then_some(n + 1),
        }
    }

    fn status(&self, now: Instant) -> u8 {
        (u8::from(self.out(now)) << 7)
            | (u8::from(self.s.null_count) << 6)
            | (self.s.access << 4)
            | (self.s.mode << 1)
            | u8::from(self.s.bcd)
    }

    fn latch_count(&mut self, now: Instant) {
        if self.s.count_latch.is_none() {
            self.s.count_latch = Some(self.read_value(now));
            self.s.latch_msb_next = false;
        }
    }

    fn latch_status(&mut self, now: Instant) {
        if self.s.status_latch.is_none() {
            self.s.status_latch = Some(self.status(now));
        }
    }

    fn control(&mut self, v: u8) {
        self.s.mode = match (v >> 1) & 7 {
            6 => 2,
            7 => 3,
            m => m,
        };
        self.s.access = (v >> 4) & 3;
        self.s.bcd = v & 1 != 0;
        self.s.loaded = false;
        self.s.null_count = true;
        self.s.triggered = false;
        self.s.read_msb_next = false;
        self.s.write_msb_next = false;
        self.stop();
    }

    fn load(&mut self, raw: u16, now: Instant) {
        self.s.count = if self.s.bcd {
            match from_bcd16(raw) {
                0 => 10_000,
                c => c.min(10_000),
            }
        } else if raw == 0 {
            0x10000
        } else {
            u32::from(raw)
        };
        self.s.loaded = true;
        self.s.null_count = false;
        self.s.triggered = false;
        if !matches!(self.s.mode, 1 | 5) && self.s.gate {
            self.restart(now);
        } else {
            self.stop();
        }
    }

    fn write_data(&mut self, v: u8, now: Instant) {
        match self.s.access {
            ACCESS_LSB => self.load(u16::from(v), now),
            ACCESS_MSB => self.load(u16::from(v) << 8, now),
            _ => {
                if self.s.write_msb_next {
                    self.s.write_msb_next = false;
                    self.load(u16::from(self.s.write_latch) | u16::from(v) << 8, now);
                } else {
                    self.s.write_latch = v;
                    self.s.write_msb_next = true;
                }
            }
        }
    }

    fn read_data(&mut self, now: Instant) -> u8 {
        if let Some(s) = self.s.status_latch.take() {
            return s;
        }
        if let Some(c) = self.s.count_latch {
            let [lo, hi] = c.to_le_bytes();
            return match self.s.access {
                ACCESS_LSB => {
                    self.s.count_latch = None;
                    lo
                }
                ACCESS_MSB => {
                    self.s.count_latch = None;
                    hi
                }
                _ if self.s.latch_msb_next => {
                    self.s.count_latch = None;
                    self.s.latch_msb_next = false;
                    hi
                }
                _ => {
                    self.s.latch_msb_next = true;
                    lo
                }
            };
        }
        let [lo, hi] = self.read_value(now).to_le_bytes();
        match self.s.access {
            ACCESS_LSB => lo,
            ACCESS_MSB => hi,
            _ => {
                self.s.read_msb_next = !self.s.read_msb_next;
                if self.s.read_msb_next {
                    lo
                } else {
                    hi
                }
            }
        }
    }

    fn set_gate(&mut self, level: bool, now: Instant) {
        if level == self.s.gate {
            return;
        }
        self.s.gate = level;
        if !self.s.loaded {
            return;
        }
        match self.s.mode {
            // Counting is suspended while the gate is low.
            0 | 4 => {
                if level {
                    self.run_since = Some(now);
                } else {
                    self.pause(now);
                }
            }
            // Stopped (output high) while low; a rising gate reloads.
            2 | 3 => {
                if level {
                    self.restart(now);
                } else {
                    self.pause(now);
                }
            }
            // A rising gate (re)triggers.
            _ => {
                if level {
                    self.s.triggered = true;
                    self.restart(now);
                }
            }
        }
    }
}

/// The 8254 PIT with port B.
pub struct Pit {
    channels: [Channel; 3],
    port_b: u8,
    /// Reference for the refresh-toggle bit of port B.
    epoch: Instant,
    /// Channel 0 edges settled at a re-programming, and since when.
    unreported: u64,
    unreported_at: Option<Instant>,
    missed: u64,
    waker: Option<Arc<dyn TimerWaker>>,
}

impl std::fmt::Debug for Pit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pit")
            .field("channels", &self.channels)
            .field("port_b", &self.port_b)
            .field("missed", &self.missed)
            .finish_non_exhaustive()
    }
}

impl Default for Pit {
    fn default() -> Self {
        Pit::new()
    }
}

impl Pit {
    /// A PIT in its power-on state: no channel programmed (so no IRQ 0
    /// until the guest programs channel 0; ferrovm has no BIOS to do it),
    /// channel 2's gate low.
    pub fn new() -> Self {
        Pit::new_at(Instant::now())
    }

    /// Like [`Pit::new`], with the counters started at `now`.
    pub fn new_at(now: Instant) -> Self {
        let st = PitState::default();
        Pit {
            channels: st.channels.map(|c| Channel::from_state(&c, now)),
            port_b: st.port_b,
            epoch: now,
            unreported: 0,
            unreported_at: None,
            missed: 0,
            waker: None,
        }
    }

    /// Moves the PIT onto `bus` at ports 0x40-0x43 and 0x61.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert_with_offset(dev.clone(), PIT_BASE, PIT_PORTS, 0)?;
        bus.insert_with_offset(dev.clone(), PORT_B, 1, PORT_B_OFFSET)?;
        Ok(dev)
    }

    /// Called (with the PIT's lock held) whenever the guest re-programs
    /// channel 0, so a timer thread can re-read the deadline.
    pub fn set_waker(&mut self, waker: Arc<dyn TimerWaker>) {
        self.waker = Some(waker);
    }

    /// When channel 0's next IRQ edge is due, `None` if none will come
    /// without the guest re-programming the channel. May be in the past
    /// (call [`Pit::on_timer`] right away).
    pub fn next_irq_deadline(&self) -> Option<Instant> {
        if self.unreported > 0 {
            return self.unreported_at;
        }
        let ch = &self.channels[0];
        let target = ch.next_edge_tick()?;
        let since = ch.run_since?;
        since.checked_add(ticks_to_duration(target.saturating_sub(ch.s.elapsed)))
    }

    /// Brings channel 0 up to `now`: returns how many IRQ 0 edges fell due
    /// since the previous call. The caller pulses IRQ 0 once if this is
    /// non-zero; more than one means periods were coalesced.
    pub fn on_timer(&mut self, now: Instant) -> u32 {
        self.settle_channel0(now);
        let due = std::mem::take(&mut self.unreported);
        self.unreported_at = None;
        self.missed = self.missed.saturating_add(due.saturating_sub(1));
        u32::try_from(due).unwrap_or(u32::MAX)
    }

    /// Moves channel 0's edges due by `now` into `unreported`, so that
    /// re-programming the channel cannot lose an interrupt that already
    /// happened (a one-shot that expired just before the guest re-armed it).
    fn settle_channel0(&mut self, now: Instant) {
        let ch = &mut self.channels[0];
        let total = ch.edges_total(ch.elapsed(now));
        let due = total.saturating_sub(ch.s.irq_edges);
        if due > 0 {
            ch.s.irq_edges = total;
            self.unreported = self.unreported.saturating_add(due);
            self.unreported_at.get_or_insert(now);
        }
    }

    /// Channel 0 periods folded into another by [`Pit::on_timer`] so far.
    pub fn missed_ticks(&self) -> u64 {
        self.missed
    }

    /// The guest-visible state.
    pub fn state(&self) -> PitState {
        self.state_at(Instant::now())
    }

    /// The guest-visible state as of `now`.
    pub fn state_at(&self, now: Instant) -> PitState {
        PitState {
            channels: [0, 1, 2].map(|i| self.channels[i].state(now)),
            port_b: self.port_b,
            unreported_irq_edges: self.unreported,
        }
    }

    /// Restores a state captured by [`Pit::state`]; counting resumes now. A
    /// state the 8254 could not hold is refused and the PIT left as it was.
    pub fn restore(&mut self, state: &PitState) -> Result<(), StateError> {
        self.restore_at(state, Instant::now())
    }

    /// Like [`Pit::restore`], resuming at `now`.
    pub fn restore_at(&mut self, state: &PitState, now: Instant) -> Result<(), StateError> {
        state.validate()?;
        self.channels = state.channels.map(|c| Channel::from_state(&c, now));
        self.port_b = state.port_b;
        self.unreported = state.unreported_irq_edges;
        self.unreported_at = (self.unreported > 0).then_some(now);
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        if let Some(w) = &self.waker {
            w.deadline_changed();
        }
    }

    fn read_port_b(&self, now: Instant) -> u8 {
        let ch2 = &self.channels[2];
        let refresh = (now.saturating_duration_since(self.epoch).as_nanos() >> 14) & 1 != 0;
        self.port_b
            | u8::from(ch2.s.gate)
            | if refresh { PORT_B_REFRESH } else { 0 }
            | if ch2.out(now) { PORT_B_OUT2 } else { 0 }
    }

    fn io_read(&mut self, offset: u64, now: Instant) -> u8 {
        match offset {
            0..=2 => self.channels[offset as usize].read_data(now),
            PORT_B_OFFSET => self.read_port_b(now),
            _ => 0xff, // the command register is write-only
        }
    }

    fn io_write(&mut self, offset: u64, v: u8, now: Instant) {
        match offset {
            0..=2 => {
                if offset == 0 {
                    self.settle_channel0(now);
                }
                self.channels[offset as usize].write_data(v, now);
                if offset == 0 {
                    self.wake();
                }
            }
            COMMAND_OFFSET => self.command(v, now),
            PORT_B_OFFSET => {
                self.port_b = v & PORT_B_WRITABLE & !PORT_B_GATE2;
                self.channels[2].set_gate(v & PORT_B_GATE2 != 0, now);
            }
            _ => {}
        }
    }

    fn command(&mut self, v: u8, now: Instant) {
        let sc = usize::from(v >> 6);
        if sc == 3 {
            // Read-back: bit 5 clear latches counts, bit 4 clear latches
            // status, bits 1-3 select channels.
            for (i, ch) in self.channels.iter_mut().enumerate() {
                if v & (2 << i) != 0 {
                    if v & 0x20 == 0 {
                        ch.latch_count(now);
                    }
                    if v & 0x10 == 0 {
                        ch.latch_status(now);
                    }
                }
            }
            return;
        }
        if (v >> 4) & 3 == 0 {
            self.channels[sc].latch_count(now);
        } else {
            if sc == 0 {
                self.settle_channel0(now);
            }
            self.channels[sc].control(v);
            if sc == 0 {
                self.wake();
            }
        }
    }
}

impl BusDeviceMut for Pit {
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

/// Layout version of the state [`Lifecycle::save`] writes: a [`PitState`].
pub const PIT_STATE_VERSION: u32 = 1;

/// IRQ 0 comes from the VMM's timer thread (`on_timer`), which the VMM pauses with the
/// devices; the PIT itself has nothing to pause. Its counters follow the host clock, as
/// the guest's TSC does, and do not stop while the machine is paused.
impl Lifecycle for Pit {
    fn id(&self) -> String {
        "pit".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(PIT_STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        Pit::restore(self, &state.parse("PIT", PIT_STATE_VERSION)?)
    }

    /// Power-on: no channel programmed, channel 2's gate low, nothing pending.
    fn reset(&mut self) {
        if let Err(e) = self.restore_at(&PitState::default(), Instant::now()) {
            log::error!("PIT reset refused its own power-on state: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Ticks → the instant at which exactly that many ticks have elapsed.
    fn at(t0: Instant, ticks: u64) -> Instant {
        t0 + ticks_to_duration(ticks)
    }

    fn program(pit: &mut Pit, ch: u8, mode: u8, count: u16, now: Instant) {
        pit.io_write(3, (ch << 6) | 0x30 | (mode << 1), now);
        pit.io_write(u64::from(ch), count as u8, now);
        pit.io_write(u64::from(ch), (count >> 8) as u8, now);
    }

    fn read16(pit: &mut Pit, ch: u64, now: Instant) -> u16 {
        let lo = pit.io_read(ch, now);
        let hi = pit.io_read(ch, now);
        u16::from_le_bytes([lo, hi])
    }

    #[test]
    fn tick_conversions() {
        assert_eq!(ticks(Duration::from_secs(1)), PIT_FREQ_HZ);
        assert_eq!(ticks(Duration::ZERO), 0);
        assert_eq!(ticks(Duration::MAX), u64::MAX);
        for t in [0u64, 1, 2, 119, 1193, 65536, 1 << 40] {
            let d = ticks_to_duration(t);
            assert_eq!(ticks(d), t, "{t}");
            if t > 0 {
                assert!(ticks(d - Duration::from_nanos(1)) < t);
            }
        }
        let _ = ticks_to_duration(u64::MAX);
        assert_eq!(MIN_PERIOD_TICKS, 239);
        assert_eq!(from_bcd16(0x1234), 1234);
        assert_eq!(to_bcd16(9876), 0x9876);
    }

    #[test]
    fn rate_generator_deadlines_and_coalescing() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        program(&mut pit, 0, 2, 1193, t0); // ~1 ms
        let d1 = pit.next_irq_deadline().unwrap();
        assert_eq!(d1, at(t0, 1193));
        assert_eq!(pit.on_timer(d1 - Duration::from_nanos(1)), 0);
        assert_eq!(pit.on_timer(d1), 1);
        assert_eq!(pit.on_timer(d1), 0, "reported once");
        assert_eq!(pit.next_irq_deadline().unwrap(), at(t0, 2 * 1193));
        // The timer thread oversleeps 8.5 periods: one call reports them,
        // nothing is queued and the next deadline is in the future.
        let late = at(t0, 10 * 1193 + 600);
        assert_eq!(pit.on_timer(late), 9);
        assert_eq!(pit.missed_ticks(), 8);
        let next = pit.next_irq_deadline().unwrap();
        assert!(next > late);
        assert_eq!(next, at(t0, 11 * 1193));
        assert_eq!(pit.on_timer(next), 1);
        // The counter itself follows the programmed rate.
        assert_eq!(read16(&mut pit, 0, at(t0, 11 * 1193 + 193)), 1000);
    }

    #[test]
    fn irq_rate_is_clamped() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        program(&mut pit, 0, 2, 2, t0);
        let d = pit.next_irq_deadline().unwrap();
        assert_eq!(d, at(t0, MIN_PERIOD_TICKS));
        assert!(d - t0 >= MIN_IRQ_PERIOD);
        // 1 ms is ~4.99 clamped periods, not 596 programmed ones.
        assert_eq!(pit.on_timer(t0 + Duration::from_millis(1)), 4);
        // Mode 3 too.
        program(&mut pit, 0, 3, 10, t0);
        assert_eq!(pit.on_timer(t0 + Duration::from_millis(1)), 4);
    }

    #[test]
    fn power_on_is_silent() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        assert_eq!(pit.next_irq_deadline(), None);
        assert_eq!(pit.on_timer(t0 + Duration::from_secs(10)), 0);
        let st = pit.state_at(t0);
        assert!(!st.channels[2].gate && st.channels[0].gate);
        pit.io_write(3, 0xe2, t0);
        assert_eq!(
            pit.io_read(0, t0),
            0x70,
            "null count, lohi, mode 0, output low"
        );
    }

    #[test]
    fn reprogramming_does_not_lose_a_due_edge() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        program(&mut pit, 0, 0, 100, t0);
        // The one-shot expires; before the timer thread collects it, the
        // guest re-arms the channel.
        let t = at(t0, 150);
        program(&mut pit, 0, 0, 1000, t);
        assert_eq!(pit.next_irq_deadline(), Some(t), "due now");
        assert_eq!(pit.on_timer(at(t, 1)), 1);
        assert_eq!(pit.next_irq_deadline(), Some(at(t, 1000)));
        // Re-arming before expiry cancels, as on the chip.
        program(&mut pit, 0, 0, 1000, at(t, 500));
        assert_eq!(pit.on_timer(at(t, 1000)), 0);
        assert_eq!(pit.on_timer(at(t, 1600)), 1, "the re-armed one fires");
        // A state captured with an unreported edge keeps it.
        program(&mut pit, 0, 2, 100, at(t, 2000));
        pit.io_write(3, 0x34, at(t, 2250));
        let st = pit.state_at(at(t, 2250));
        // One clamped period (239 ticks) fell due in those 250 ticks.
        assert_eq!(st.unreported_irq_edges, 1);
        let mut pit2 = Pit::new_at(t);
        pit2.restore_at(&st, t).unwrap();
        assert_eq!(pit2.next_irq_deadline(), Some(t));
        assert_eq!(pit2.on_timer(t), 1);
        assert_eq!(pit2.missed_ticks(), 0);
    }

    #[test]
    fn mode0_one_shot() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        pit.io_write(3, 0x30, t0); // ch0, lohi, mode 0
        assert_eq!(pit.next_irq_deadline(), None, "no count yet");
        pit.io_write(3, 0xe2, t0); // read-back status of ch0
        let st = pit.io_read(0, t0);
        assert_eq!(st & 0x80, 0, "mode 0 output low after control word");
        assert_eq!(st & 0x40, 0x40, "null count");
        assert_eq!(st & 0x3f, 0x30);
        pit.io_write(0, 0x00, t0);
        pit.io_write(0, 0x10, t0); // 4096
        assert_eq!(pit.next_irq_deadline(), Some(at(t0, 4096)));
        assert_eq!(read16(&mut pit, 0, at(t0, 96)), 4000);
        assert_eq!(pit.on_timer(at(t0, 4095)), 0);
        assert_eq!(pit.on_timer(at(t0, 5000)), 1);
        assert_eq!(pit.next_irq_deadline(), None, "fires once");
        assert_eq!(pit.on_timer(at(t0, 100_000)), 0);
        // After terminal count the counter wraps and keeps counting.
        assert_eq!(read16(&mut pit, 0, at(t0, 4097)), 0xffff);
        pit.io_write(3, 0xe2, at(t0, 4097));
        assert_eq!(pit.io_read(0, t0) & 0xc0, 0x80, "output high");
    }

    /// Linux's TSC calibration: channel 2 in mode 0 gated by port 0x61,
    /// polling the output in bit 5.
    #[test]
    fn channel2_gate_and_output_on_port_b() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        let b = pit.io_read(PORT_B_OFFSET, t0);
        pit.io_write(PORT_B_OFFSET, (b & !0x02) | 0x01, t0);
        assert_eq!(pit.io_read(PORT_B_OFFSET, t0) & 0x03, 0x01);
        pit.io_write(3, 0xb0, t0);
        let latch: u16 = 59659; // 50 ms
        pit.io_write(2, latch as u8, t0);
        pit.io_write(2, (latch >> 8) as u8, t0);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t0, 59658)) & 0x20, 0);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t0, 59659)) & 0x20, 0x20);
        assert_eq!(pit.next_irq_deadline(), None, "ch0 untouched");

        // Gate low suspends mode 0 counting; high resumes it.
        pit.io_write(3, 0xb0, t0);
        pit.io_write(2, 0xe8, t0);
        pit.io_write(2, 0x03, t0); // 1000
        pit.io_write(PORT_B_OFFSET, 0x00, at(t0, 400));
        assert_eq!(read16(&mut pit, 2, at(t0, 900)), 600);
        let t1 = at(t0, 1000);
        pit.io_write(PORT_B_OFFSET, 0x01, t1);
        assert_eq!(read16(&mut pit, 2, at(t1, 100)), 500);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t1, 599)) & 0x20, 0);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t1, 600)) & 0x20, 0x20);

        // Loading with the gate low: counting starts at the rising gate.
        pit.io_write(PORT_B_OFFSET, 0x00, t0);
        pit.io_write(3, 0xb0, t0);
        pit.io_write(2, 100, t0);
        pit.io_write(2, 0, t0);
        assert_eq!(read16(&mut pit, 2, at(t0, 50)), 100);
        pit.io_write(PORT_B_OFFSET, 0x03, at(t0, 50));
        assert_eq!(read16(&mut pit, 2, at(t0, 60)), 90);
        assert_eq!(
            pit.io_read(PORT_B_OFFSET, t0) & 0x0f,
            0x03,
            "speaker bit kept"
        );
    }

    #[test]
    fn refresh_bit_toggles() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        let a = pit.io_read(PORT_B_OFFSET, t0) & 0x10;
        let b = pit.io_read(PORT_B_OFFSET, t0 + Duration::from_nanos(1 << 14)) & 0x10;
        assert_ne!(a, b);
    }

    #[test]
    fn square_wave_and_rate_generator_outputs() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        pit.io_write(PORT_B_OFFSET, 0x01, t0);
        program(&mut pit, 2, 3, 100, t0);
        let out = |pit: &mut Pit, t| pit.io_read(PORT_B_OFFSET, at(t0, t)) & 0x20 != 0;
        assert!(out(&mut pit, 0));
        assert!(out(&mut pit, 49));
        assert!(!out(&mut pit, 50));
        assert!(!out(&mut pit, 99));
        assert!(out(&mut pit, 100));
        assert_eq!(read16(&mut pit, 2, at(t0, 10)), 80, "counts by two");
        // Gate low: output forced high, counting stopped.
        pit.io_write(PORT_B_OFFSET, 0x00, at(t0, 60));
        assert!(out(&mut pit, 70));

        program(&mut pit, 2, 2, 100, t0);
        pit.io_write(PORT_B_OFFSET, 0x01, t0);
        assert!(out(&mut pit, 98));
        assert!(!out(&mut pit, 99));
        assert!(out(&mut pit, 100));
        assert_eq!(read16(&mut pit, 2, at(t0, 150)), 50);
    }

    #[test]
    fn mode4_and_gate_triggered_modes() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        program(&mut pit, 0, 4, 500, t0);
        assert_eq!(pit.next_irq_deadline(), Some(at(t0, 501)));
        assert_eq!(pit.on_timer(at(t0, 500)), 0);
        assert_eq!(pit.on_timer(at(t0, 501)), 1);
        assert_eq!(pit.next_irq_deadline(), None);

        // Mode 1 on channel 2: nothing until the gate rises.
        program(&mut pit, 2, 1, 300, t0);
        assert_ne!(pit.io_read(PORT_B_OFFSET, at(t0, 1000)) & 0x20, 0);
        assert_eq!(read16(&mut pit, 2, at(t0, 1000)), 300);
        let t1 = at(t0, 1000);
        pit.io_write(PORT_B_OFFSET, 0x01, t1);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t1, 100)) & 0x20, 0);
        assert_eq!(read16(&mut pit, 2, at(t1, 100)), 200);
        assert_ne!(pit.io_read(PORT_B_OFFSET, at(t1, 300)) & 0x20, 0);
        // Retrigger.
        pit.io_write(PORT_B_OFFSET, 0x00, at(t1, 400));
        let t2 = at(t1, 500);
        pit.io_write(PORT_B_OFFSET, 0x01, t2);
        assert_eq!(read16(&mut pit, 2, at(t2, 10)), 290);

        // Mode 5: strobe at the count after the trigger.
        let t3 = at(t0, 2000);
        program(&mut pit, 2, 5, 10, t3);
        pit.io_write(PORT_B_OFFSET, 0x00, t3);
        pit.io_write(PORT_B_OFFSET, 0x01, t3);
        assert_ne!(pit.io_read(PORT_B_OFFSET, at(t3, 9)) & 0x20, 0);
        assert_eq!(pit.io_read(PORT_B_OFFSET, at(t3, 10)) & 0x20, 0);
        assert_ne!(pit.io_read(PORT_B_OFFSET, at(t3, 11)) & 0x20, 0);

        // Mode 1 on channel 0 (gate tied high) never fires.
        program(&mut pit, 0, 1, 10, t0);
        assert_eq!(pit.next_irq_deadline(), None);
        assert_eq!(pit.on_timer(at(t0, 100_000)), 0);
    }

    #[test]
    fn latches_and_read_back() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        program(&mut pit, 0, 2, 1000, t0);
        pit.io_write(3, 0x00, at(t0, 250)); // latch ch0
        pit.io_write(3, 0x00, at(t0, 300)); // ignored: already latched
        assert_eq!(read16(&mut pit, 0, at(t0, 600)), 750);
        assert_eq!(read16(&mut pit, 0, at(t0, 600)), 400, "latch consumed");

        // Read-back: status and count of channel 0; status comes first.
        pit.io_write(3, 0xc2, at(t0, 100));
        assert_eq!(pit.io_read(0, t0), 0x80 | 0x30 | (2 << 1));
        assert_eq!(read16(&mut pit, 0, t0), 900);
        // Count only (bit 4 set = no status).
        pit.io_write(3, 0xd2, at(t0, 10));
        assert_eq!(read16(&mut pit, 0, t0), 990);

        // LSB-only and MSB-only access.
        pit.io_write(3, 0x54, t0); // ch1, LSB, mode 2
        pit.io_write(1, 200, t0);
        assert_eq!(pit.io_read(1, at(t0, 50)), 150);
        pit.io_write(3, 0x40, at(t0, 60));
        assert_eq!(pit.io_read(1, t0), 140);
        pit.io_write(3, 0x64, t0); // ch1, MSB, mode 2
        pit.io_write(1, 0x02, t0); // 512
        assert_eq!(pit.io_read(1, at(t0, 300)), 0x00); // 212
        assert_eq!(pit.io_read(1, at(t0, 100)), 0x01); // 412
        pit.io_write(3, 0x40, at(t0, 100));
        assert_eq!(pit.io_read(1, t0), 0x01);

        // The command port is write-only.
        assert_eq!(pit.io_read(3, t0), 0xff);
    }

    #[test]
    fn bcd_counting() {
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        pit.io_write(3, 0x35, t0); // ch0, lohi, mode 2, BCD
        pit.io_write(0, 0x00, t0);
        pit.io_write(0, 0x10, t0); // 1000 decimal
        assert_eq!(read16(&mut pit, 0, at(t0, 1)), 0x0999);
        assert_eq!(pit.next_irq_deadline(), Some(at(t0, 1000)));
        pit.io_write(3, 0x31, t0); // mode 0 BCD, count 0 = 10000
        pit.io_write(0, 0, t0);
        pit.io_write(0, 0, t0);
        assert_eq!(read16(&mut pit, 0, at(t0, 1)), 0x9999);
        assert_eq!(
            read16(&mut pit, 0, at(t0, 10_001)),
            0x9999,
            "wraps mod 10000"
        );
        pit.io_write(3, 0x31, t0);
        pit.io_write(0, 0xff, t0);
        pit.io_write(0, 0xff, t0); // not BCD: clamped, no panic
        let _ = read16(&mut pit, 0, at(t0, 5));
    }

    #[test]
    fn waker_and_state_round_trip() {
        #[derive(Default)]
        struct W(AtomicUsize);
        impl TimerWaker for W {
            fn deadline_changed(&self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        let w = Arc::new(W::default());
        pit.set_waker(w.clone());
        program(&mut pit, 0, 2, 1193, t0);
        assert_eq!(w.0.load(Ordering::SeqCst), 3);
        program(&mut pit, 2, 0, 50, t0);
        assert_eq!(w.0.load(Ordering::SeqCst), 3, "channel 2 does not wake");

        pit.on_timer(at(t0, 3 * 1193 + 10));
        pit.io_write(3, 0x00, t0);
        let st = pit.state_at(at(t0, 3 * 1193 + 100));
        assert_eq!(st.channels[0].elapsed, 3 * 1193 + 100);
        assert_eq!(st.channels[0].irq_edges, 3);
        assert_eq!(st.channels[0].count_latch, Some(1193));

        let t1 = t0 + Duration::from_secs(100);
        let mut pit2 = Pit::new_at(t1);
        let json = serde_json::to_string(&st).unwrap();
        let carried: PitState = serde_json::from_str(&json).unwrap();
        pit2.restore_at(&carried, t1).unwrap();
        assert_eq!(pit2.state_at(t1), st);
        assert_eq!(pit2.next_irq_deadline(), Some(at(t1, 1193 - 100)));
        assert_eq!(read16(&mut pit2, 0, t1), 1193, "latch restored");
        assert_eq!(read16(&mut pit2, 0, at(t1, 93)), 1000);

        // A nonsensical state is refused and changes nothing.
        let before = pit2.state_at(t1);
        let refused = |f: &dyn Fn(&mut PitState)| {
            let mut bad = st;
            f(&mut bad);
            bad
        };
        for bad in [
            refused(&|b| b.channels[1].mode = 6),
            refused(&|b| b.channels[1].access = 0),
            refused(&|b| b.channels[1].count = 0),
            refused(&|b| b.channels[0].count = 0x10001),
            refused(&|b| {
                b.channels[2].bcd = true;
                b.channels[2].loaded = true;
                b.channels[2].count = 10_001;
            }),
            refused(&|b| {
                b.channels[1].loaded = false;
                b.channels[1].counting = true;
            }),
            refused(&|b| b.channels[0].gate = false),
            refused(&|b| b.port_b = 0x01),
            refused(&|b| b.port_b = 0x20),
        ] {
            assert!(pit2.restore_at(&bad, t1).is_err(), "{bad:?}");
            assert_eq!(pit2.state_at(t1), before);
        }
        // Channel 2's gate may be low; a BCD count not yet loaded may exceed 10^4.
        let mut ok = st;
        ok.channels[2].gate = false;
        ok.channels[1].bcd = true;
        ok.channels[1].loaded = false;
        ok.channels[1].counting = false;
        ok.channels[1].count = 0x10000;
        pit2.restore_at(&ok, t1).unwrap();
        assert_eq!(pit2.state_at(t1), ok);
        assert!(serde_json::from_str::<PitState>("{\"port_b\": 0}").is_err());
        let _ = format!("{pit2:?}");
    }

    #[test]
    fn bus_registration() {
        let mut bus = Bus::new();
        let pit = Pit::new().register(&mut bus).unwrap();
        assert!(bus.is_claimed(0x40) && bus.is_claimed(0x43) && bus.is_claimed(0x61));
        assert!(!bus.is_claimed(0x44) && !bus.is_claimed(0x60) && !bus.is_claimed(0x62));
        assert!(bus.write(0x43, &[0x34]));
        assert!(bus.write(0x40, &[0xa9]));
        assert!(bus.write(0x40, &[0x04]));
        assert_eq!(pit.lock().unwrap().state().channels[0].count, 1193);
        let mut d = [0u8; 2];
        assert!(bus.read(0x40, &mut d)); // lo of ch0, then ch1's next byte
        assert!(bus.write(0x61, &[0x01]));
        assert!(bus.read(0x61, &mut d[..1]));
        assert_eq!(d[0] & 1, 1);
        let _ = Pit::default();
        let mut p = Pit::new();
        p.write(u64::MAX, &[1, 2]);
        p.read(u64::MAX, &mut d);
        let _ = us(1);
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(0x0123_4567_89ab_cdef);
        let t0 = Instant::now();
        let mut pit = Pit::new_at(t0);
        let mut t = t0;
        for _ in 0..100_000 {
            let r = rng.next();
            if r & 0xf == 0 {
                t += Duration::from_nanos(r >> 40);
            }
            let offset = [0u64, 1, 2, 3, PORT_B_OFFSET, 4, 0x20][(r >> 8) as usize % 7];
            let v = (r >> 16) as u8;
            match (r >> 24) % 4 {
                0 | 1 => pit.io_write(offset, v, t),
                2 => {
                    pit.io_read(offset, t);
                }
                _ => {
                    if let Some(d) = pit.next_irq_deadline() {
                        assert!(d >= t0);
                    }
                    pit.on_timer(t);
                }
            }
        }
        let st = pit.state_at(t);
        for c in st.channels {
            assert!(c.mode <= 5 && (1..=3).contains(&c.access));
        }
        // Whatever the guest did, the state it left restores.
        let mut pit2 = Pit::new_at(t);
        pit2.restore_at(&st, t).unwrap();
        assert_eq!(pit2.state_at(t), st);
    }
}
