//! The destination side: validates the stream, writes pages into guest memory, returns the
//! state blob after `End`. Also restores snapshots (the same stream, no reply channel).

use std::io::{BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Serialize, Serializer};

use crate::config::{ConfigCheck, MigrationConfig};
use crate::error::{Error, Result};
use crate::lanes::{apply_page_frame, lock, LaneRound, Lanes, ParallelReceive};
use crate::pages::PageApplier;
use crate::postcopy::{accept_link, PostcopyIncoming, Switch};
use crate::ram::{GuestRam, Layout};
use crate::stages::DestinationStages;
use crate::stream::{send_reply, Frame, StreamReader, CONNECTION_READ_AHEAD, MAX_STATE_TOTAL};

fn ms<S: Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

/// One round as the destination saw it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IncomingRound {
    pub index: u32,
    pub final_round: bool,
    pub pages: u64,
    pub zero_pages: u64,
    pub bytes: u64,
    /// Time from the previous round's end (or the configuration) to this round's end.
    #[serde(rename = "duration_ms", serialize_with = "ms")]
    pub duration: Duration,
    /// The source's own measure of the round.
    pub source_duration_us: u64,
}

/// What the destination received.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IncomingReport {
    pub rounds: Vec<IncomingRound>,
    pub bytes_total: u64,
    pub pages_total: u64,
    pub zero_pages_total: u64,
    pub state_bytes: u64,
    /// Pages that arrived torn in a live round and were replaced by a later copy.
    pub torn_pages_recovered: u64,
    /// Destination pages that held data before the stream and were zeroed.
    pub preexisting_pages_zeroed: u64,
    #[serde(rename = "total_time_ms", serialize_with = "ms")]
    pub total_time: Duration,
    /// From the end of the last live round to `End`: the destination's view of the
    /// stop-and-copy.
    #[serde(rename = "final_phase_ms", serialize_with = "ms")]
    pub final_phase: Duration,
    /// Where the destination's time went.
    pub stages: DestinationStages,
}

/// Sends the destination's final word to the source.
pub struct AckSender<W: Write> {
    w: W,
}

impl<W: Write> AckSender<W> {
    pub(crate) fn new(w: W) -> Self {
        AckSender { w }
    }

    /// "The destination runs the guest": the source may now shut its copy down. Send it only
    /// once the guest is restored and running; if this fails, the source resumes its own
    /// copy, so stop this one.
    pub fn ack(&mut self) -> Result<()> {
        send_reply(&mut self.w, &Frame::Ack)
    }

    /// The final state is applied: the source may let go of its disk locks, which this
    /// destination takes before it runs the guest (then `ack`).
    pub fn handover(&mut self) -> Result<()> {
        send_reply(&mut self.w, &Frame::Handover)
    }

    /// Restoring failed: the source resumes its guest and shows `message`.
    pub fn fail(&mut self, message: &str) -> Result<()> {
        send_reply(&mut self.w, &Frame::Error(message.to_string()))
    }

    pub fn into_inner(self) -> W {
        self.w
    }
}

/// A received migration, ready to be restored.
pub struct IncomingResult<W: Write> {
    /// The source's device/vCPU state blob.
    pub state: Vec<u8>,
    /// The source's configuration (already checked against the destination's).
    pub config: MigrationConfig,
    pub report: IncomingReport,
    /// Send the acknowledgement through this once the guest runs.
    pub ack: AckSender<W>,
    /// Set when the source switched to post-copy: these pages are still missing, and come
    /// on the post-copy connection (see `crate::postcopy`). The guest may run at once, but
    /// only with guest RAM registered so that every access to a missing page waits for it.
    pub postcopy: Option<PostcopyIncoming>,
}

/// A restored snapshot.
#[derive(Clone, Debug)]
pub struct Restored {
    pub state: Vec<u8>,
    pub config: MigrationConfig,
    pub report: IncomingReport,
}

/// Receives a migration into `ram`: checks the source's configuration against `expected`
/// (refusing a mismatch with both values named, and telling the source), replies `Ready`,
/// writes pages into guest memory (replying `RoundAck` after each live round), and returns
/// the state after `End`. Restore the state, resume the guest, then call
/// `result.ack.ack()`.
///
/// `ram` must be fresh anonymous memory that no running vCPU uses during the call. Pages the
/// stream does not mention are left as they are; pages found resident beforehand are zeroed
/// first (when residency is known exactly).
///
/// On error, an `Error` frame with the message is sent on `ack` (best effort).
pub fn receive<G, R, W>(
    ram: &G,
    input: R,
    ack: W,
    expected: &ConfigCheck,
) -> Result<IncomingResult<W>>
where
    G: GuestRam + ?Sized,
    R: Read,
    W: Write,
{
    receive_parallel(ram, input, ack, expected, None)
}

/// [`receive`], also accepting the data connections a source announces (`--connections`):
/// each is read by a thread of its own from `parallel.spawn`. Without `parallel`, a source
/// that announces data connections is refused.
pub fn receive_parallel<G, R, W>(
    ram: &G,
    input: R,
    mut ack: W,
    expected: &ConfigCheck,
    parallel: Option<&ParallelReceive<'_>>,
) -> Result<IncomingResult<W>>
where
    G: GuestRam + ?Sized,
    R: Read,
    W: Write,
{
    match receive_core(ram, input, Some(&mut ack), expected, parallel) {
        Ok((state, config, report, postcopy)) => Ok(IncomingResult {
            state,
            config,
            report,
            ack: AckSender { w: ack },
            postcopy,
        }),
        Err(e) => {
            if let Err(t) = send_reply(&mut ack, &Frame::Error(format!("destination: {e}"))) {
                log::debug!("could not tell the source about the failure: {t}");
            }
            Err(e)
        }
    }
}

/// Restores a snapshot written by [`crate::snapshot`] (or any complete stream) into `ram`.
/// Page data is read into guest memory eagerly (no lazy mmap of the file yet).
pub fn restore_from<G, R>(ram: &G, input: R, expected: &ConfigCheck) -> Result<Restored>
where
    G: GuestRam + ?Sized,
    R: Read,
{
    let (state, config, report, postcopy) =
        receive_core::<G, R, std::io::Sink>(ram, input, None, expected, None)?;
    if postcopy.is_some() {
        return Err(Error::Param(
            "a post-copy stream cannot be restored from a file".into(),
        ));
    }
    Ok(Restored {
        state,
        config,
        report,
    })
}

fn receive_core<G, R, W>(
    ram: &G,
    input: R,
    mut replies: Option<&mut W>,
    expected: &ConfigCheck,
    parallel: Option<&ParallelReceive<'_>>,
) -> Result<(
    Vec<u8>,
    MigrationConfig,
    IncomingReport,
    Option<PostcopyIncoming>,
)>
where
    G: GuestRam + ?Sized,
    R: Read,
    W: Write,
{
    let t0 = Instant::now();
    let layout = Layout::of(ram)?;
    if expected.ram_regions != layout.ranges() {
        return Err(Error::Param(
            "the destination's configuration does not describe its own guest RAM".into(),
        ));
    }
    let mut reader = StreamReader::new(BufReader::with_capacity(CONNECTION_READ_AHEAD, input));
    let config = read_config(&mut reader, expected)?;
    let reader_ranges = layout.ranges();
    reader.set_ram_ranges(reader_ranges.clone());

    // Memory of the destination that already holds data (nothing, for a fresh VM).
    let (applier, preexisting_pages_zeroed) = PageApplier::onto_idle_ram(layout)?;
    let applier = Arc::new(Mutex::new(applier));
    // Data connections, if the source announces any.
    let mut lanes: Option<Lanes> = None;

    if let Some(w) = replies.as_mut() {
        send_reply(w, &Frame::Ready)?;
    }

    let mut rounds: Vec<IncomingRound> = Vec::new();
    let mut counted = LaneRound::default();
    let (mut total_pages, mut total_zero) = (0u64, 0u64);
    let mut round_start = Instant::now();
    let mut last_live_end = round_start;
    let mut seen_final = false;
    let mut state: Vec<u8> = Vec::new();
    let mut state_frames = 0u32;
    let mut switch: Option<Switch> = None;
    loop {
        let at = reader.offset();
        let protocol = |reason: String| Error::Protocol { offset: at, reason };
        match reader.next_frame()? {
            page @ (Frame::Pages(_)
            | Frame::CompressedPages(_)
            | Frame::SamePage { .. }
            | Frame::ZeroPages { .. }) => {
                if seen_final {
                    return Err(protocol("pages after the final round".into()));
                }
                apply_page_frame(&applier, &mut reader, page, at, &mut counted)?;
            }
            Frame::RoundEnd(info) => {
                if seen_final {
                    return Err(protocol("a round after the final round".into()));
                }
                let index = rounds.len() as u32;
                if info.round != index {
                    return Err(protocol(format!(
                        "round {} ends where round {index} was expected",
                        info.round
                    )));
                }
                if let Some(l) = lanes.as_mut() {
                    let sum = l.round_end(index, info.final_round)?;
                    counted.pages += sum.pages;
                    counted.zero_pages += sum.zero_pages;
                    counted.bytes += sum.bytes;
                }
                let LaneRound {
                    pages,
                    zero_pages,
                    bytes,
                } = counted;
                if (info.pages, info.zero_pages, info.bytes) != (pages, zero_pages, bytes) {
                    return Err(protocol(format!(
                        "round {index} announces {} pages, {} zero pages, {} bytes; {pages}, {zero_pages}, {bytes} arrived",
                        info.pages, info.zero_pages, info.bytes
                    )));
                }
                let now = Instant::now();
                rounds.push(IncomingRound {
                    index,
                    final_round: info.final_round,
                    pages,
                    zero_pages,
                    bytes,
                    duration: now.duration_since(round_start),
                    source_duration_us: info.duration_us,
                });
                round_start = now;
                if info.final_round {
                    seen_final = true;
                } else {
                    last_live_end = now;
                    if let Some(w) = replies.as_mut() {
                        send_reply(w, &Frame::RoundAck(index))?;
                    }
                    if let Some(l) = lanes.as_ref() {
                        l.release();
                    }
                }
                total_pages += pages;
                total_zero += zero_pages;
                counted = LaneRound::default();
            }
            Frame::State(piece) => {
                if !seen_final {
                    return Err(protocol("device state before the final round".into()));
                }
                if state.len() + piece.len() > MAX_STATE_TOTAL {
                    return Err(protocol(format!(
                        "the device state exceeds {MAX_STATE_TOTAL} bytes"
                    )));
                }
                state.extend_from_slice(&piece);
                state_frames += 1;
            }
            Frame::End(info) => {
                if !seen_final || state_frames == 0 {
                    return Err(protocol(
                        "End before the final round and the device state".into(),
                    ));
                }
                let got = (rounds.len() as u32, total_pages, total_zero);
                if (info.rounds, info.total_pages, info.total_zero_pages) != got {
                    return Err(protocol(format!(
                        "End announces {} rounds, {} pages, {} zero pages; {} rounds, {} pages, {} zero pages arrived",
                        info.rounds, info.total_pages, info.total_zero_pages, got.0, got.1, got.2
                    )));
                }
                let applier = lock(&applier)?;
                let postcopy = match switch.take() {
                    Some(s) => {
                        let p = parallel.ok_or_else(|| {
                            protocol("post-copy needs the listener for its connection".into())
                        })?;
                        // A page torn in a live round must be among the missing ones.
                        applier.check_complete_except(&s.missing)?;
                        Some(PostcopyIncoming {
                            link: accept_link(p.listener, s.token, p.timeout)?,
                            missing: s.missing,
                            ranges: reader_ranges.clone(),
                        })
                    }
                    None => {
                        applier.check_complete()?;
                        None
                    }
                };
                let lane_totals = lanes
                    .as_ref()
                    .map_or((0, Duration::ZERO, Duration::ZERO), |l| {
                        (l.bytes, l.read, l.crc)
                    });
                let report = IncomingReport {
                    rounds,
                    bytes_total: reader.offset() + lane_totals.0,
                    pages_total: total_pages,
                    zero_pages_total: total_zero,
                    state_bytes: state.len() as u64,
                    torn_pages_recovered: applier.torn_recovered,
                    preexisting_pages_zeroed,
                    total_time: t0.elapsed(),
                    final_phase: last_live_end.elapsed(),
                    stages: DestinationStages {
                        populate: applier.populate_time,
                        read: reader.page_read_time + lane_totals.1,
                        crc: reader.crc_time + lane_totals.2,
                        zero: applier.zero_time,
                    },
                };
                return Ok((state, config, report, postcopy));
            }
            Frame::Error(message) => {
                return Err(Error::Peer {
                    peer: "source",
                    message,
                })
            }
            Frame::Config(_) => return Err(protocol("a second Config frame".into())),
            Frame::Postcopy(payload) => {
                if seen_final {
                    return Err(protocol(
                        "a switch to post-copy after the final round".into(),
                    ));
                }
                if counted.pages != 0 || counted.zero_pages != 0 {
                    return Err(protocol("a switch to post-copy inside a round".into()));
                }
                let counts: Vec<u64> = reader_ranges
                    .iter()
                    .map(|r| r.size / crate::ram::PAGE_SIZE)
                    .collect();
                switch = Some(Switch::decode(&payload, &counts)?);
                seen_final = true;
                if let Some(l) = lanes.take() {
                    drop(l);
                }
            }
            Frame::Connections { count, token } => {
                let first = rounds.is_empty() && counted.pages == 0 && counted.zero_pages == 0;
                let par = match parallel {
                    Some(p) if first && lanes.is_none() => p,
                    Some(_) => {
                        return Err(protocol(
                            "Connections after the first page or a second time".into(),
                        ))
                    }
                    None => return Err(protocol(
                        "the source announces data connections, which this receiver does not take"
                            .into(),
                    )),
                };
                lanes = Some(Lanes::accept(par, count, token, &reader_ranges, &applier)?);
            }
            Frame::Join { .. } => {
                return Err(protocol(
                    "a data connection's Join on the control connection".into(),
                ))
            }
            Frame::Ready | Frame::Ack | Frame::RoundAck(_) | Frame::Handover => {
                return Err(protocol("a reply frame inside the stream".into()))
            }
            Frame::Images(_) | Frame::DataPages { .. } => {
                return Err(protocol(
                    "a snapshot file's page-image frame inside a migration stream".into(),
                ))
            }
        }
    }
}

/// Reads the stream's header and its `Config` frame, checked against `expected`.
pub(crate) fn read_config<R: Read>(
    reader: &mut StreamReader<R>,
    expected: &ConfigCheck,
) -> Result<MigrationConfig> {
    reader.read_header()?;
    let config = match reader.next_frame()? {
        Frame::Config(c) => c,
        Frame::Error(message) => {
            return Err(Error::Peer {
                peer: "source",
                message,
            })
        }
        other => {
            return Err(Error::Protocol {
                offset: reader.offset(),
                reason: format!("the stream starts with {other:?} instead of Config"),
            })
        }
    };
    config.check_against(expected)?;
    Ok(config)
}
