//! A migration between two VMMs that map the same guest RAM (a local update: the memory
//! file's descriptor went across before the stream began). No page travels; the stream is
//! the usual one without rounds:
//!
//! ```text
//! header, Config ─────────────────────────────▶  check config
//!                 ◀───────────────────────────── Ready
//! pause; save state
//! State, End (0 rounds) ──────────────────────▶  restore state
//!                 ◀───────────────────────────── Handover; the source lets go of its disks
//!                 ◀───────────────────────────── Ack   ("destination running")
//! ```
//!
//! The destination touches guest memory only after it sent `Handover` (its devices resume
//! then). So a destination that vanishes before `Handover` (its end of the connection
//! closed: the process is gone) has changed nothing, and the source resumes the guest as
//! after any refusal. After `Handover`, the usual rule holds: without `Ack` the outcome is
//! unknown and the guest stays paused.

use std::io::{ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use super::{Engine, MigrationReport, Phase, Progress, StopReason, VmControl};
use crate::error::{Error, Result};
use crate::resident::ResidencyMethod;
use crate::stages::SourceStages;
use crate::stream::{EndInfo, Frame, MAX_STATE_TOTAL};

impl<W: Write, R: Read, P: FnMut(&Progress)> Engine<'_, W, R, P> {
    /// The shared-RAM migration after `Ready`: pause, state, hand-over.
    pub(super) fn run_shared<V: VmControl + ?Sized>(
        &mut self,
        vm: &mut V,
    ) -> Result<MigrationReport> {
        if self.postcopy.is_some() || !self.lanes.is_empty() {
            return Err(Error::Param(
                "a migration over shared guest RAM sends no pages: no post-copy and no data \
                 connections"
                    .into(),
            ));
        }
        let t0 = self.meter.t0;
        self.meter.phase = Phase::StopAndCopy;
        let t_pause = Instant::now();
        let state = self.pause_and_save(vm)?;
        let end = EndInfo {
            rounds: 0,
            total_pages: 0,
            total_zero_pages: 0,
        };
        let stop_and_copy = self.send_final(vm, &state, end, t_pause, None)?;
        Ok(MigrationReport {
            rounds: Vec::new(),
            total_time: t0.elapsed(),
            downtime_estimate: Duration::ZERO,
            downtime: t_pause.elapsed(),
            stop_and_copy,
            bytes_total: self.bytes_written(),
            pages_total: 0,
            zero_pages_total: 0,
            touched_pages: 0,
            untouched_pages_skipped: 0,
            swapped_pages: 0,
            residency_method: ResidencyMethod::Shared,
            state_bytes: state.len() as u64,
            bandwidth_bytes_per_s: 0.0,
            converged: true,
            stop_reason: StopReason::Converged,
            max_throttle_percent: 0,
            stages: SourceStages {
                write: self.w.out.write_time,
                ..SourceStages::default()
            },
            compression: self.params.compression,
            compressed_page_bytes: 0,
            compressed_frame_bytes: 0,
            postcopy: None,
        })
    }

    /// Pauses the guest and saves its state (checked to fit a stream).
    pub(super) fn pause_and_save<V: VmControl + ?Sized>(&mut self, vm: &mut V) -> Result<Vec<u8>> {
        self.paused = true;
        vm.pause()?;
        let state = vm.save_state()?;
        if state.len() > MAX_STATE_TOTAL {
            return Err(Error::Vmm(format!(
                "the device/vCPU state is {} bytes, more than the {MAX_STATE_TOTAL} a stream carries",
                state.len()
            )));
        }
        Ok(state)
    }

    /// Sends the state and `End`, then hands over (`Handover`, `Ack`); returns the time
    /// from the pause to `End` written (the stop-and-copy).
    pub(super) fn send_final<V: VmControl + ?Sized>(
        &mut self,
        vm: &mut V,
        state: &[u8],
        end: EndInfo,
        t_pause: Instant,
        postcopying: Option<&mut super::Postcopying>,
    ) -> Result<Duration> {
        self.w.write_frame(&Frame::State(state.to_vec()))?;
        self.w.write_frame(&Frame::End(end))?;
        self.w.flush()?;
        self.final_sent = true;
        let stop_and_copy = t_pause.elapsed();
        self.meter.phase = Phase::WaitingAck;
        self.meter.emit(self.bytes_written(), 0, true);
        self.hand_over(vm, postcopying)?;
        Ok(stop_and_copy)
    }

    /// The first reply after `End`. Over shared RAM, a destination whose end of the
    /// connection closed before `Handover` is gone without having touched the guest: that is
    /// a refusal (the guest resumes here), not an unknown outcome.
    pub(super) fn gone_before_handover(&self, reply: Result<Frame>) -> Result<Frame> {
        if !self.params.shared_ram {
            return reply;
        }
        match reply {
            Err(e) if peer_closed(&e) => Err(Error::Peer {
                peer: "destination",
                message: format!("it ended before taking the guest over ({e})"),
            }),
            other => other,
        }
    }
}

/// The connection ended: end of stream, or reset by a peer that closed with data unread.
fn peer_closed(e: &Error) -> bool {
    match e {
        Error::Vmm(m) => m.contains("closed the connection"),
        Error::Io { source, .. } => matches!(
            source.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::UnexpectedEof
        ),
        Error::Truncated { .. } => true,
        _ => false,
    }
}
