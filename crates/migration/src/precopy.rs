//! The pre-copy engine (source side), the receiver (destination side), and snapshot /
//! restore, which are the same stream without the reply channel.
//!
//! Source:
//! ```text
//! header, Config ─────────────────────────────▶  check config
//!                 ◀───────────────────────────── Ready (or Error naming both values)
//! start dirty tracking; round 0 = touched pages (pagemap / mincore)
//! Pages / ZeroPages ..., RoundEnd(0) ─────────▶  write into guest memory
//!                 ◀───────────────────────────── RoundAck(0)
//! while the dirty set does not fit the downtime target at the measured bandwidth:
//!   take dirty bitmap; Pages ..., RoundEnd(n) ▶
//!                 ◀───────────────────────────── RoundAck(n)
//!   (max rounds / max time: auto-converge throttles 20, 40, 60, 80, 99 %; else stop anyway)
//! pause; save state; final dirty set
//! Pages ..., RoundEnd(final), State, End ─────▶  restore state, resume
//!                 ◀───────────────────────────── Ack   ("destination running")
//! ```
//! Any error before `End` is sent resumes the source guest (if it was paused) and returns the
//! error: a failed migration loses nothing. After `End`, only the destination's `Error` frame
//! resumes it; without `Ack` or `Error` the outcome is unknown ([`Error::OutcomeUnknown`]) and
//! the guest stays paused, since it must never run on both hosts.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use crate::bitmap::Bitmap;
use crate::compress::{Compression, Compressor};
use crate::config::MigrationConfig;
use crate::dedup::Refs;
use crate::error::{Error, Result};
use crate::lanes::SpawnLane;
use crate::pages::{send_pages, Sent};
use crate::postcopy::{PostcopyReport, PostcopySource, SourceLink, Switch};
use crate::ram::{GuestRam, Layout, PAGE_SIZE};
use crate::resident::{prefetch_swapped, touched_in, ResidencyMethod};
use crate::senders::{LaneKit, RoundSender, Threads};
use crate::stages::SourceStages;
use crate::stream::{
    read_reply, wait_reply, EndInfo, Frame, RoundEndInfo, StreamWriter, MAX_STATE_TOTAL,
};

mod shared;

/// Where the dirty pages come from: the hypervisor's dirty log, plus any page the VMM's own
/// device emulation wrote (KVM's log only sees guest writes).
pub trait DirtySource {
    /// Starts tracking: from now on every page written is reported by `take_dirty`.
    fn start_tracking(&mut self) -> Result<()>;
    /// Returns the pages written since `start_tracking` or the previous call, and re-arms
    /// them (a write after this call is reported by the next one): one bitmap per RAM region,
    /// in [`GuestRam::regions`] order, one bit per 4 KiB page (KVM's dirty-log layout). With
    /// KVM's manual-protect protocol that means `dirty_log` then `clear_dirty_log` over the
    /// returned pages; with KVM_DIRTY_LOG_INITIALLY_SET, `start_tracking` must clear every
    /// slot once, or the first call reports all of RAM.
    fn take_dirty(&mut self) -> Result<Bitmap>;
    /// Stops tracking (also called after a failure).
    fn stop_tracking(&mut self);
}

/// Control of the source VM.
pub trait VmControl {
    /// Stops the vCPUs **and** every device that writes guest memory.
    fn pause(&mut self) -> Result<()>;
    /// Lets the guest run again (after a failed migration).
    fn resume(&mut self) -> Result<()>;
    /// Device and vCPU state, opaque to this crate; called while paused.
    fn save_state(&mut self) -> Result<Vec<u8>>;
    /// Slows the vCPUs down to `100 - percent` % of their time (0 = full speed).
    fn throttle(&mut self, percent: u8);
    /// The destination applied the final state and takes over now: let go of what it must
    /// take (disk image locks). Called paused, after the destination's `Handover` reply.
    fn hand_over(&mut self) -> Result<()> {
        Ok(())
    }
    /// The destination refused after `hand_over`: take it all back before resuming. An
    /// error leaves the guest paused (another machine may hold the disks now).
    fn take_back(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Tunables of a live migration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrationParams {
    /// Bandwidth limit in bytes per second (token bucket); `None`: as fast as the link.
    pub max_bandwidth: Option<u64>,
    /// Largest acceptable pause of the guest; pre-copy stops once the remaining dirty pages
    /// fit in it at the measured bandwidth.
    pub downtime_target: Duration,
    /// Pre-copy rounds (round 0 included) before the fallback.
    pub max_rounds: u32,
    /// Total time allowed for pre-copy before the fallback.
    pub max_time: Option<Duration>,
    /// Fallback when the guest dirties memory faster than the link: throttle the vCPUs
    /// (20, 40, 60, 80, 99 %) instead of stopping with a long downtime.
    pub auto_converge: bool,
    /// Compression of page data (default: automatic, on while the link is the bottleneck).
    pub compression: Compression,
    /// The destination maps the very same guest RAM (a local update: the memory file went
    /// across as a descriptor): no page is sent, only the state ([`shared`]).
    pub shared_ram: bool,
}

impl Default for MigrationParams {
    fn default() -> Self {
        MigrationParams {
            max_bandwidth: None,
            downtime_target: Duration::from_millis(50),
            max_rounds: 30,
            max_time: None,
            auto_converge: false,
            compression: Compression::Auto,
            shared_ram: false,
        }
    }
}

impl MigrationParams {
    fn validate(&self) -> Result<()> {
        if self.max_rounds == 0 {
            return Err(Error::Param("max_rounds must be at least 1".into()));
        }
        if self.max_bandwidth == Some(0) {
            return Err(Error::Param("max_bandwidth must be positive".into()));
        }
        Ok(())
    }
}

/// The throttle levels auto-converge goes through.
pub const THROTTLE_STEPS: [u8; 5] = [20, 40, 60, 80, 99];
/// Rounds granted after each throttle step taken because the round budget ran out.
const ROUNDS_PER_STEP: u32 = 2;

pub(crate) fn ms<S: Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

/// One round as the source measured it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoundStats {
    pub index: u32,
    /// The guest ran during the round (false for the stop-and-copy round).
    pub live: bool,
    #[serde(rename = "duration_ms", serialize_with = "ms")]
    pub duration: Duration,
    /// Pages sent with data.
    pub pages_sent: u64,
    /// Pages sent as zero markers.
    pub zero_pages: u64,
    /// Bytes of page frames.
    pub bytes_sent: u64,
    /// Pages this round set out to send (round 0: touched pages).
    pub dirty_pages_found: u64,
    pub throttle_percent: u8,
}

/// Why pre-copy stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The remaining dirty pages fit the downtime target.
    Converged,
    /// `max_rounds` reached (after auto-converge's steps, if enabled).
    MaxRounds,
    /// `max_time` reached.
    MaxTime,
    /// Post-copy was asked for: the source switched after the rounds it was told to run.
    Postcopy,
}

/// What a migration did, measured. `converged: false` means the stop-and-copy ran with more
/// dirty pages than the downtime target allowed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationReport {
    /// Every round, the final stop-and-copy round last.
    pub rounds: Vec<RoundStats>,
    #[serde(rename = "total_time_ms", serialize_with = "ms")]
    pub total_time: Duration,
    /// Downtime estimated when pre-copy stopped (remaining dirty bytes / bandwidth).
    #[serde(rename = "downtime_estimate_ms", serialize_with = "ms")]
    pub downtime_estimate: Duration,
    /// Measured downtime: from the pause to the destination's acknowledgement (the
    /// destination is running by then).
    #[serde(rename = "downtime_ms", serialize_with = "ms")]
    pub downtime: Duration,
    /// Part of the downtime spent sending (pause to End written).
    #[serde(rename = "stop_and_copy_ms", serialize_with = "ms")]
    pub stop_and_copy: Duration,
    pub bytes_total: u64,
    pub pages_total: u64,
    pub zero_pages_total: u64,
    /// Pages holding data when round 0 started (present or swapped).
    pub touched_pages: u64,
    /// Pages never touched, not sent at all.
    pub untouched_pages_skipped: u64,
    /// Touched pages that were swapped out (found with pagemap).
    pub swapped_pages: u64,
    pub residency_method: ResidencyMethod,
    pub state_bytes: u64,
    /// Average bandwidth of the page rounds (bytes/s).
    pub bandwidth_bytes_per_s: f64,
    pub converged: bool,
    pub stop_reason: StopReason,
    pub max_throttle_percent: u8,
    /// Where the source's time went.
    pub stages: SourceStages,
    /// Compression asked for, and what it did: page bytes that went out compressed and the
    /// bytes of their frames.
    pub compression: Compression,
    pub compressed_page_bytes: u64,
    pub compressed_frame_bytes: u64,
    /// After a switch to post-copy: what it did (`downtime` then ends with the destination
    /// running, `total_time` once it holds every page).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub postcopy: Option<PostcopyReport>,
}

/// Where the migration is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Precopy,
    StopAndCopy,
    WaitingAck,
    /// The destination runs the guest; the remaining pages go on demand and in the
    /// background.
    Postcopy,
}

/// Progress, reported during rounds (at most every 100 ms) and at every round's end.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Progress {
    pub phase: Phase,
    pub round: u32,
    pub bytes_sent: u64,
    pub bytes_remaining_estimate: u64,
    pub dirty_rate_pages_per_s: f64,
    pub bandwidth_bytes_per_s: f64,
    pub throttle_percent: u8,
    pub elapsed_ms: f64,
}

struct Meter<P: FnMut(&Progress)> {
    progress: P,
    t0: Instant,
    last: Option<Instant>,
    phase: Phase,
    round: u32,
    dirty_rate: f64,
    bandwidth: f64,
    throttle: u8,
}

impl<P: FnMut(&Progress)> Meter<P> {
    fn emit(&mut self, bytes_sent: u64, remaining: u64, force: bool) {
        let now = Instant::now();
        if !force
            && self
                .last
                .is_some_and(|l| now.duration_since(l) < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(now);
        (self.progress)(&Progress {
            phase: self.phase,
            round: self.round,
            bytes_sent,
            bytes_remaining_estimate: remaining,
            dirty_rate_pages_per_s: self.dirty_rate,
            bandwidth_bytes_per_s: self.bandwidth,
            throttle_percent: self.throttle,
            elapsed_ms: self.t0.elapsed().as_secs_f64() * 1000.0,
        });
    }
}

struct Engine<'a, W: Write, R: Read, P: FnMut(&Progress)> {
    layout: Layout,
    /// Pages mapped from a snapshot file (lazy restore): they hold data even when absent.
    file_pages: Option<Bitmap>,
    w: StreamWriter<W>,
    /// Data connections: pages are striped over `w` and these.
    lanes: Vec<LaneKit<W>>,
    /// The data connections' sending threads (always there when `lanes` has any).
    threads: Option<&'a dyn RoundSender<W>>,
    ack: R,
    params: &'a MigrationParams,
    meter: Meter<P>,
    rounds: Vec<RoundStats>,
    /// Time spent in `send_pages` and the bytes it sent, for the bandwidth estimate.
    send_time: Duration,
    send_bytes: u64,
    paused: bool,
    /// The final state and `End` are on their way: the destination may run the guest.
    final_sent: bool,
    /// The source let go of its disk locks for the destination (`VmControl::hand_over`).
    handed_over: bool,
    tracking: bool,
    throttle: u8,
    max_throttle: u8,
    stages: SourceStages,
    compressor: Compressor,
    /// Pages sent as `SamePage` markers, with the pages they were copied from.
    same_refs: Refs,
    /// Post-copy, if asked for.
    postcopy: Option<&'a PostcopySource<'a>>,
    /// The destination acknowledged that it runs the guest.
    acked: bool,
}

/// How long to wait for a page request before looking for the destination's reply.
const ANSWER_POLL: Duration = Duration::from_millis(5);

/// Post-copy from the switch on: the connection, the pages the destination still lacks and
/// what was sent of them.
struct Postcopying {
    link: SourceLink,
    missing: Bitmap,
    report: PostcopyReport,
}

/// Migrates a running VM: streams its memory in pre-copy rounds to `out`, pauses it, sends
/// the rest and its state, and returns once the destination acknowledged on `ack_in` (it
/// runs the guest by then; the source stays paused and may be shut down).
///
/// On any error before `End` is sent, or an `Error` frame from the destination after it, the
/// source guest is resumed (if it had been paused), un-throttled, dirty tracking is stopped,
/// an `Error` frame is sent to the destination when the stream is still intact, and the error
/// is returned. Any other failure after `End` (the acknowledgement lost, a timeout) returns
/// [`Error::OutcomeUnknown`] with the guest left paused: the destination may be running it.
///
/// `ack_in` should have a read timeout (e.g. `TcpStream::set_read_timeout`), or a vanished
/// destination blocks the source forever.
#[allow(clippy::too_many_arguments)]
pub fn migrate<G, D, V, W, R, P>(
    ram: &G,
    config: &MigrationConfig,
    dirty: &mut D,
    vm: &mut V,
    out: W,
    ack_in: R,
    params: &MigrationParams,
    progress: P,
) -> Result<MigrationReport>
where
    G: GuestRam + ?Sized,
    D: DirtySource + ?Sized,
    V: VmControl + ?Sized,
    W: Write,
    R: Read,
    P: FnMut(&Progress),
{
    run_migration(
        ram, config, dirty, vm, out, ack_in, params, None, progress, None,
    )
}

/// [`migrate`] with data connections besides the control connection `out` (connected to
/// the same destination, which accepts them with [`crate::receive_parallel`]): pages are
/// striped over all of them, while rounds, state and `End` keep their order on `out`. Each
/// data connection has a sending thread, started with `spawn` (the VMM passes its sandboxed
/// spawner), that does the zero check, CRC-32, compression and writes of its share of the
/// pages, while this thread sends its own share on `out`. It is still one migration: any
/// connection or thread failing fails it, with the guaranties of [`migrate`]. A bandwidth
/// limit is shared evenly between the connections.
///
/// With `postcopy`, the source switches to post-copy after `after_rounds` live rounds: it
/// pauses, sends its state and the set of pages the destination still lacks, and serves
/// those pages (on request first, the rest in the background) over a connection of their
/// own until the destination holds every one; only then does this return. Until the
/// destination acknowledges that it runs the guest, failures behave as in [`migrate`];
/// after it, a failure returns [`Error::PostcopyLost`] with the guest left paused here: its
/// memory is split between both hosts, and it is lost.
#[allow(clippy::too_many_arguments)]
pub fn migrate_threaded<G, D, V, W, R, P>(
    ram: &G,
    config: &MigrationConfig,
    dirty: &mut D,
    vm: &mut V,
    out: W,
    data: Vec<W>,
    ack_in: R,
    params: &MigrationParams,
    postcopy: Option<&PostcopySource<'_>>,
    progress: P,
    spawn: SpawnLane<'_>,
) -> Result<MigrationReport>
where
    G: GuestRam + ?Sized,
    D: DirtySource + ?Sized,
    V: VmControl + ?Sized,
    W: Write + Send + 'static,
    R: Read,
    P: FnMut(&Progress),
{
    let threads = Threads { spawn };
    run_migration(
        ram,
        config,
        dirty,
        vm,
        out,
        ack_in,
        params,
        postcopy,
        progress,
        Some((data, &threads)),
    )
}

#[allow(clippy::too_many_arguments)]
fn run_migration<G, D, V, W, R, P>(
    ram: &G,
    config: &MigrationConfig,
    dirty: &mut D,
    vm: &mut V,
    out: W,
    ack_in: R,
    params: &MigrationParams,
    postcopy: Option<&PostcopySource<'_>>,
    progress: P,
    data: Option<(Vec<W>, &dyn RoundSender<W>)>,
) -> Result<MigrationReport>
where
    G: GuestRam + ?Sized,
    D: DirtySource + ?Sized,
    V: VmControl + ?Sized,
    W: Write,
    R: Read,
    P: FnMut(&Progress),
{
    params.validate()?;
    let (data, threads) = match data {
        Some((data, threads)) => (data, Some(threads)),
        None => (Vec::new(), None),
    };
    if data.len() > crate::stream::MAX_DATA_CONNECTIONS as usize {
        return Err(Error::Param(format!(
            "{} data connections, at most {} allowed",
            data.len(),
            crate::stream::MAX_DATA_CONNECTIONS
        )));
    }
    let share = params
        .max_bandwidth
        .map(|b| (b / (data.len() as u64 + 1)).max(1));
    let layout = Layout::of(ram)?;
    check_config_matches_ram(config, &layout)?;
    let t0 = Instant::now();
    let mut eng = Engine {
        layout,
        file_pages: ram.file_data_pages(),
        w: StreamWriter::with_max_bandwidth(out, share),
        lanes: data
            .into_iter()
            .map(|d| LaneKit {
                w: StreamWriter::with_max_bandwidth(d, share),
                comp: Compressor::new(params.compression),
            })
            .collect(),
        threads,
        ack: ack_in,
        params,
        meter: Meter {
            progress,
            t0,
            last: None,
            phase: Phase::Precopy,
            round: 0,
            dirty_rate: 0.0,
            bandwidth: 0.0,
            throttle: 0,
        },
        rounds: Vec::new(),
        send_time: Duration::ZERO,
        send_bytes: 0,
        paused: false,
        final_sent: false,
        handed_over: false,
        tracking: false,
        throttle: 0,
        max_throttle: 0,
        stages: SourceStages::default(),
        compressor: Compressor::new(params.compression),
        same_refs: Refs::default(),
        postcopy,
        acked: false,
    };
    match eng.run(config, dirty, vm) {
        Ok(report) => {
            dirty.stop_tracking();
            if eng.throttle > 0 {
                vm.throttle(0);
            }
            Ok(report)
        }
        Err(e) if eng.acked => {
            // The destination ran the guest with part of its memory still here.
            if eng.tracking {
                dirty.stop_tracking();
            }
            Err(Error::PostcopyLost {
                cause: e.to_string(),
            })
        }
        Err(e) if eng.final_sent && !matches!(e, Error::Peer { .. }) => {
            // Only a refusal from the destination proves it does not run the guest; anything
            // else (timeout, connection lost, garbage) leaves the guest paused here: it must
            // never run twice.
            if eng.tracking {
                dirty.stop_tracking();
            }
            Err(Error::OutcomeUnknown {
                cause: e.to_string(),
            })
        }
        Err(e) => {
            if !eng.w.out.broken {
                eng.w.batch.clear();
                let told = eng
                    .w
                    .write_frame(&Frame::Error(format!("source: {e}")))
                    .and_then(|_| eng.w.flush());
                if let Err(t) = told {
                    log::debug!("could not tell the destination about the failure: {t}");
                }
            }
            if eng.tracking {
                dirty.stop_tracking();
            }
            if eng.throttle > 0 {
                vm.throttle(0);
            }
            if eng.handed_over {
                if let Err(t) = vm.take_back() {
                    return Err(Error::Vmm(format!(
                        "{e}; the source cannot take its disks back ({t}), so its guest stays \
                         paused"
                    )));
                }
            }
            if eng.paused {
                if let Err(r) = vm.resume() {
                    return Err(Error::Vmm(format!(
                        "{e}; then resuming the source guest failed too: {r}"
                    )));
                }
            }
            Err(e)
        }
    }
}

pub(crate) fn check_config_matches_ram(config: &MigrationConfig, layout: &Layout) -> Result<()> {
    let ranges = layout.ranges();
    if config.ram_regions != ranges {
        return Err(Error::Param(format!(
            "the configuration's RAM regions ({}) are not the guest RAM's ({})",
            config
                .ram_regions
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            ranges
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let total: u64 = ranges.iter().map(|r| r.size).sum();
    if total != config.memory_size {
        return Err(Error::Param(format!(
            "the configuration's memory size {} is not the guest RAM's {total} bytes",
            config.memory_size
        )));
    }
    Ok(())
}

impl<W: Write, R: Read, P: FnMut(&Progress)> Engine<'_, W, R, P> {
    fn bandwidth(&self) -> f64 {
        let measured = if self.send_time.as_secs_f64() > 0.0 && self.send_bytes > 0 {
            self.send_bytes as f64 / self.send_time.as_secs_f64()
        } else {
            f64::INFINITY
        };
        match self.params.max_bandwidth {
            Some(limit) => measured.min(limit as f64),
            None => measured,
        }
    }

    /// Bytes written on every connection.
    fn bytes_written(&self) -> u64 {
        self.over_connections(|w, _| w.bytes_written())
    }

    /// `f` of every connection's writer and compressor (the control connection's first),
    /// summed.
    fn over_connections<T: std::iter::Sum>(
        &self,
        f: impl Fn(&StreamWriter<W>, &Compressor) -> T,
    ) -> T {
        let lanes = self.lanes.iter().map(|l| f(&l.w, &l.comp));
        std::iter::once(f(&self.w, &self.compressor))
            .chain(lanes)
            .sum()
    }

    /// Opens the data connections: each starts with the header and its `Join`; the control
    /// connection announces them.
    fn open_lanes(&mut self) -> Result<()> {
        if self.lanes.is_empty() {
            return Ok(());
        }
        let token = lane_token();
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            let index = i as u32 + 1;
            lane.w
                .write_header()
                .and_then(|_| lane.w.write_frame(&Frame::Join { token, index }))
                .and_then(|_| lane.w.flush())
                .map_err(|e| Error::Vmm(format!("data connection {index}: {e}")))?;
        }
        self.w.write_frame(&Frame::Connections {
            count: self.lanes.len() as u32,
            token,
        })?;
        self.w.flush()
    }

    fn set_throttle<V: VmControl + ?Sized>(&mut self, vm: &mut V, percent: u8) {
        self.throttle = percent;
        self.max_throttle = self.max_throttle.max(percent);
        self.meter.throttle = percent;
        vm.throttle(percent);
    }

    fn next_throttle(&self) -> Option<u8> {
        THROTTLE_STEPS.iter().copied().find(|&s| s > self.throttle)
    }

    fn take_dirty<D: DirtySource + ?Sized>(&mut self, dirty: &mut D) -> Result<Bitmap> {
        let t = Instant::now();
        let mut d = dirty.take_dirty()?;
        d.conform(&self.layout.page_counts()).map_err(Error::Vmm)?;
        self.same_refs.follow(&mut d);
        self.stages.scan += t.elapsed();
        Ok(d)
    }

    /// Sends one round of pages and its RoundEnd frame.
    fn round(&mut self, set: &Bitmap, live: bool, found: u64) -> Result<()> {
        let index = self.rounds.len() as u32;
        let t = Instant::now();
        self.meter.round = index;
        let base = self.bytes_written();
        for c in compressors(&mut self.compressor, &mut self.lanes) {
            if let Some(d) = c.dedup.as_mut() {
                d.new_round();
            }
        }
        let meter = &mut self.meter;
        let mut tick = |done, s: &Sent| {
            meter.emit(
                base + s.bytes,
                found.saturating_sub(done) * PAGE_SIZE,
                false,
            )
        };
        let per_lane = match self.threads {
            Some(t) if !self.lanes.is_empty() => t.send_round(
                &mut self.w,
                &mut self.compressor,
                &mut self.lanes,
                &self.layout,
                set,
                live,
                &mut tick,
            )?,
            _ => {
                let c = Some(&mut self.compressor);
                vec![send_pages(
                    &mut self.w,
                    &self.layout,
                    set,
                    live,
                    c,
                    &mut tick,
                )?]
            }
        };
        let duration_us = t.elapsed().as_micros() as u64;
        for c in compressors(&mut self.compressor, &mut self.lanes) {
            if let Some(d) = c.dedup.as_mut() {
                self.same_refs.add(&mut d.refs);
            }
        }
        let mut sent = Sent::default();
        for (i, s) in per_lane.iter().enumerate() {
            sent.pages += s.pages;
            sent.zero_pages += s.zero_pages;
            sent.bytes += s.bytes;
            if i > 0 {
                // Each data connection ends the round with its own counts.
                let lane = &mut self.lanes[i - 1].w;
                lane.write_frame(&Frame::RoundEnd(RoundEndInfo {
                    round: index,
                    final_round: !live,
                    pages: s.pages,
                    zero_pages: s.zero_pages,
                    bytes: s.bytes,
                    dirty_pages_found: 0,
                    duration_us,
                }))
                .and_then(|_| lane.flush())
                .map_err(|e| Error::Vmm(format!("data connection {i}: {e}")))?;
            }
        }
        self.w.write_frame(&Frame::RoundEnd(RoundEndInfo {
            round: index,
            final_round: !live,
            pages: sent.pages,
            zero_pages: sent.zero_pages,
            bytes: sent.bytes,
            dirty_pages_found: found,
            duration_us,
        }))?;
        self.w.flush()?;
        if live {
            // A live round ends when the destination has applied it: the bandwidth is then
            // measured end to end, and no backlog is left in socket buffers to drain while
            // the guest is paused.
            let waiting = Instant::now();
            wait_reply(&mut self.ack, &Frame::RoundAck(index))?;
            self.stages.round_ack_wait += waiting.elapsed();
        }
        let duration = t.elapsed();
        self.send_time += duration;
        self.send_bytes += sent.bytes;
        self.meter.bandwidth = self.bandwidth();
        self.rounds.push(RoundStats {
            index,
            live,
            duration,
            pages_sent: sent.pages,
            zero_pages: sent.zero_pages,
            bytes_sent: sent.bytes,
            dirty_pages_found: found,
            throttle_percent: self.throttle,
        });
        Ok(())
    }

    fn run<D, V>(
        &mut self,
        config: &MigrationConfig,
        dirty: &mut D,
        vm: &mut V,
    ) -> Result<MigrationReport>
    where
        D: DirtySource + ?Sized,
        V: VmControl + ?Sized,
    {
        let t0 = self.meter.t0;
        let target = self.params.downtime_target;
        self.w.write_header()?;
        self.w.write_frame(&Frame::Config(config.clone()))?;
        self.w.flush()?;
        wait_reply(&mut self.ack, &Frame::Ready)?;
        if self.params.shared_ram {
            return self.run_shared(vm);
        }
        self.open_lanes()?;

        // Round 0: the pages that hold data. Tracking starts first, so a page the guest
        // writes after the scan is caught by the dirty log.
        self.tracking = true;
        dirty.start_tracking()?;
        let mut last_take = Instant::now();
        let residency = touched_in(&self.layout, self.file_pages.as_ref());
        self.stages.scan += last_take.elapsed();
        let swapped_pages = residency.swapped.count();
        if swapped_pages > 0 {
            prefetch_swapped(&self.layout, &residency.swapped);
        }
        let touched = residency.pages.count();
        let residency_method = residency.method;
        self.meter
            .emit(self.bytes_written(), touched * PAGE_SIZE, true);
        let switch_after = self.postcopy.map(|p| p.after_rounds);
        // Post-copy from the start: every touched page is missing at the destination.
        let unsent = if switch_after == Some(0) {
            Some(residency.pages)
        } else {
            self.round(&residency.pages, true, touched)?;
            None
        };
        drop(residency.swapped);

        let mut budget = self.params.max_rounds;
        let mut prev_found = u64::MAX;
        let (carry, stop_reason, estimate) = loop {
            let d = self.take_dirty(dirty)?;
            let now = Instant::now();
            let found = d.count();
            let dt = now.duration_since(last_take).as_secs_f64();
            last_take = now;
            self.meter.dirty_rate = if dt > 0.0 { found as f64 / dt } else { 0.0 };
            let bw = self.bandwidth();
            let estimate = Duration::from_secs_f64(((found * PAGE_SIZE) as f64 / bw).min(1e9));
            self.meter
                .emit(self.bytes_written(), found * PAGE_SIZE, true);
            if switch_after.is_some_and(|n| self.rounds.len() as u32 >= n) {
                break (d, StopReason::Postcopy, Duration::ZERO);
            }
            if estimate <= target {
                break (d, StopReason::Converged, estimate);
            }
            let time_up = self.params.max_time.is_some_and(|m| t0.elapsed() >= m);
            let done = self.rounds.len() as u32;
            let auto = self.params.auto_converge && !time_up;
            let stalled = done >= 2 && found.saturating_mul(5) > prev_found.saturating_mul(4);
            if auto && stalled && done < budget {
                // The dirty set stopped shrinking: throttle early rather than waste rounds.
                if let Some(step) = self.next_throttle() {
                    self.set_throttle(vm, step);
                }
            } else if done >= budget || time_up {
                match self.next_throttle().filter(|_| auto) {
                    Some(step) => {
                        self.set_throttle(vm, step);
                        budget = budget.saturating_add(ROUNDS_PER_STEP);
                    }
                    None => {
                        let reason = if time_up {
                            StopReason::MaxTime
                        } else {
                            StopReason::MaxRounds
                        };
                        break (d, reason, estimate);
                    }
                }
            }
            prev_found = found;
            self.round(&d, true, found)?;
        };

        // Stop and copy.
        self.meter.phase = Phase::StopAndCopy;
        let t_pause = Instant::now();
        let state = self.pause_and_save(vm)?;
        let mut fin = self.take_dirty(dirty)?;
        fin.union_with(&carry);
        drop(carry);
        if let Some(u) = &unsent {
            fin.union_with(u);
        }
        drop(unsent);
        let found = fin.count();
        let link = match self.postcopy {
            Some(pc) => Some(self.switch(pc, &fin)?),
            None => {
                self.round(&fin, false, found)?;
                None
            }
        };
        let sent: (u64, u64) = self
            .rounds
            .iter()
            .fold((0, 0), |a, r| (a.0 + r.pages_sent, a.1 + r.zero_pages));
        let end = EndInfo {
            rounds: self.rounds.len() as u32,
            total_pages: sent.0,
            total_zero_pages: sent.1,
        };
        let mut postcopying = link.map(|link| Postcopying {
            report: PostcopyReport {
                after_rounds: self.rounds.len() as u32,
                missing_pages: fin.count(),
                ..PostcopyReport::default()
            },
            link,
            missing: fin,
        });
        let stop_and_copy = self.send_final(vm, &state, end, t_pause, postcopying.as_mut())?;
        let downtime = t_pause.elapsed();
        let postcopy = match postcopying {
            Some(p) => Some(self.serve_postcopy(p, t_pause)?),
            None => None,
        };

        let total_pages = self.layout.total_pages();
        Ok(MigrationReport {
            total_time: t0.elapsed(),
            downtime_estimate: estimate,
            downtime,
            stop_and_copy,
            bytes_total: self.bytes_written(),
            pages_total: sent.0,
            zero_pages_total: sent.1,
            touched_pages: touched,
            untouched_pages_skipped: total_pages - touched.min(total_pages),
            swapped_pages,
            residency_method,
            state_bytes: state.len() as u64,
            bandwidth_bytes_per_s: self.bandwidth().min(1e15),
            converged: stop_reason == StopReason::Converged,
            stop_reason,
            max_throttle_percent: self.max_throttle,
            rounds: std::mem::take(&mut self.rounds),
            stages: SourceStages {
                inspect: self.over_connections(|w, _| w.inspect_time),
                write: self.over_connections(|w, _| w.out.write_time),
                compress: self.over_connections(|_, c| c.time),
                ..self.stages.clone()
            },
            compression: self.params.compression,
            compressed_page_bytes: self.over_connections(|_, c| c.compressed_raw),
            compressed_frame_bytes: self.over_connections(|_, c| c.compressed_bytes),
            postcopy,
        })
    }

    /// Opens the post-copy connection and sends the switch in place of the final round.
    fn switch(&mut self, pc: &PostcopySource<'_>, missing: &Bitmap) -> Result<SourceLink> {
        let token = lane_token();
        let link = SourceLink::open(pc, token)?;
        let switch = Switch {
            token,
            missing: missing.clone(),
        };
        self.w.write_frame(&Frame::Postcopy(switch.encode()))?;
        Ok(link)
    }

    /// The destination runs the guest: serves the pages it still lacks until it has all.
    fn serve_postcopy(&mut self, p: Postcopying, t_pause: Instant) -> Result<PostcopyReport> {
        let Postcopying {
            link,
            missing,
            mut report,
        } = p;
        self.acked = true;
        self.meter.phase = Phase::Postcopy;
        self.meter
            .emit(self.bytes_written(), report.missing_pages * PAGE_SIZE, true);
        let base = self.bytes_written();
        let meter = &mut self.meter;
        link.serve(&self.layout, missing, &mut report, &mut |bytes, left| {
            meter.emit(base + bytes, left * PAGE_SIZE, false)
        })?;
        report.time_to_residency = t_pause.elapsed();
        log::info!(
            "post-copy: {} pages in {:.1} ms after the pause ({} on demand in {} requests, {} streamed)",
            report.missing_pages,
            report.time_to_residency.as_secs_f64() * 1000.0,
            report.pages_on_demand,
            report.requests,
            report.pages_streamed
        );
        Ok(report)
    }

    /// After `End`: the destination applies the state and replies `Handover`; the source
    /// lets go of its disk locks, and the destination takes them, runs the guest and
    /// replies `Ack`. A destination of an earlier build replies `Ack` at once.
    fn hand_over<V: VmControl + ?Sized>(
        &mut self,
        vm: &mut V,
        mut postcopying: Option<&mut Postcopying>,
    ) -> Result<()> {
        let what = "its acknowledgement";
        let reply = self.reply_answering(what, postcopying.as_deref_mut());
        match self.gone_before_handover(reply)? {
            Frame::Handover => {}
            Frame::Ack => return Ok(()),
            other => {
                return Err(Error::Protocol {
                    offset: 0,
                    reason: format!("the destination replied {other:?} instead of Handover"),
                })
            }
        }
        self.handed_over = true;
        // A lock that cannot be released makes the destination refuse; that answer decides.
        if let Err(e) = vm.hand_over() {
            log::error!("handing the disks over: {e}");
        }
        match self.reply_answering(what, postcopying)? {
            Frame::Ack => Ok(()),
            f => Err(Error::Protocol {
                offset: 0,
                reason: format!("the destination replied {f:?} instead of {what}"),
            }),
        }
    }

    /// The destination's next reply; in post-copy its page requests are answered meanwhile,
    /// while a thread of the migration waits for the reply on the control connection.
    fn reply_answering(
        &mut self,
        what: &str,
        postcopying: Option<&mut Postcopying>,
    ) -> Result<Frame> {
        let (Some(p), Some(pc)) = (postcopying, self.postcopy) else {
            return read_reply(&mut self.ack, what);
        };
        let mut reader = (pc.replies)().map_err(|e| Error::io("the control connection", e))?;
        let (tx, reply) = std::sync::mpsc::channel();
        let waited_for = what.to_string();
        let body = Box::new(move || {
            let _ = tx.send(read_reply(&mut reader, &waited_for));
        });
        (pc.spawn)("migration-reply".into(), body)
            .map_err(|e| Error::io("starting the thread that waits for the reply", e))?;
        loop {
            match reply.try_recv() {
                Ok(frame) => return frame,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(Error::Vmm(format!("no reply: waiting for {what} failed")))
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            let answered =
                p.link
                    .answer_requests(&self.layout, &mut p.missing, &mut p.report, ANSWER_POLL);
            if let Err(e) = answered {
                // An `Ack` already on its way means the destination runs the guest; without
                // one the outcome is unknown. (The thread ends at the read timeout.)
                if let Ok(Ok(Frame::Ack)) = reply.recv_timeout(Duration::from_secs(1)) {
                    self.acked = true;
                }
                return Err(e);
            }
        }
    }
}

/// The compressors (and page-marker tables) of every connection: the control connection's,
/// then each data connection's.
fn compressors<'a, W: Write>(
    main: &'a mut Compressor,
    lanes: &'a mut [LaneKit<W>],
) -> impl Iterator<Item = &'a mut Compressor> {
    std::iter::once(main).chain(lanes.iter_mut().map(|l| &mut l.comp))
}

/// A token that ties the data connections to their migration (not a secret: it keeps a
/// stray connection from joining the wrong migration).
fn lane_token() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32) ^ 0x9e37_79b9_7f4a_7c15
}

/// What a snapshot wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SnapshotReport {
    /// The single (final) round.
    pub round: RoundStats,
    /// Bytes written: frames and page data.
    pub bytes_total: u64,
    /// Length of the file: for a snapshot file with page images ([`crate::snapshot_file`]),
    /// more than `bytes_total`, as untouched and zero pages are holes.
    pub file_bytes: u64,
    pub touched_pages: u64,
    pub untouched_pages_skipped: u64,
    pub residency_method: ResidencyMethod,
    pub state_bytes: u64,
}

/// Writes a snapshot of a **paused** VM to `out` (a file): the same stream as a migration
/// with a single, final round of the touched pages, the state and `End`; no reply channel.
/// Read it back with [`crate::restore_from`].
pub fn snapshot<G, W>(
    ram: &G,
    config: &MigrationConfig,
    state: &[u8],
    out: W,
) -> Result<SnapshotReport>
where
    G: GuestRam + ?Sized,
    W: Write,
{
    let layout = Layout::of(ram)?;
    check_config_matches_ram(config, &layout)?;
    if state.len() > MAX_STATE_TOTAL {
        return Err(Error::Param(format!(
            "the device/vCPU state is {} bytes, more than the {MAX_STATE_TOTAL} a stream carries",
            state.len()
        )));
    }
    let t = Instant::now();
    let mut w = StreamWriter::new(out);
    w.write_header()?;
    w.write_frame(&Frame::Config(config.clone()))?;
    let residency = touched_in(&layout, ram.file_data_pages().as_ref());
    let touched = residency.pages.count();
    let sent = send_pages(
        &mut w,
        &layout,
        &residency.pages,
        false,
        None,
        &mut |_, _| {},
    )?;
    let duration = t.elapsed();
    w.write_frame(&Frame::RoundEnd(RoundEndInfo {
        round: 0,
        final_round: true,
        pages: sent.pages,
        zero_pages: sent.zero_pages,
        bytes: sent.bytes,
        dirty_pages_found: touched,
        duration_us: duration.as_micros() as u64,
    }))?;
    w.write_frame(&Frame::State(state.to_vec()))?;
    w.write_frame(&Frame::End(EndInfo {
        rounds: 1,
        total_pages: sent.pages,
        total_zero_pages: sent.zero_pages,
    }))?;
    w.flush()?;
    let total = layout.total_pages();
    Ok(SnapshotReport {
        round: RoundStats {
            index: 0,
            live: false,
            duration,
            pages_sent: sent.pages,
            zero_pages: sent.zero_pages,
            bytes_sent: sent.bytes,
            dirty_pages_found: touched,
            throttle_percent: 0,
        },
        bytes_total: w.bytes_written(),
        file_bytes: w.bytes_written(),
        touched_pages: touched,
        untouched_pages_skipped: total - touched.min(total),
        residency_method: residency.method,
        state_bytes: state.len() as u64,
    })
}
