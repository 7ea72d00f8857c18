//! Parallel connections on the destination: data connections ("lanes") that carry a share
//! of the pages of every round, each read by a thread of its own, next to the control
//! connection, which keeps the order of the migration (rounds, state, `End`).
//!
//! A round is applied in full before any lane reads the next one: a lane that reached the
//! round's end reports its counts and waits until the control connection's `RoundEnd` has
//! been matched against every lane's, so a page sent in round n + 1 on one lane can never be
//! overwritten by its round n copy still travelling on another.

use std::io::{BufReader, Read};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::pages::{apply_compressed, apply_pages_shared, compressed_frame_len, PageApplier};
use crate::ram::RamRange;
use crate::stream::{
    pages_frame_len, Frame, StreamReader, CONNECTION_READ_AHEAD, SAME_PAGE_FRAME_LEN,
    ZERO_PAGES_FRAME_LEN,
};

/// Starts a thread for a lane (the VMM passes its sandboxed spawner, `Role::Migration`).
pub type SpawnLane<'a> =
    &'a (dyn Fn(String, Box<dyn FnOnce() + Send>) -> std::io::Result<JoinHandle<()>> + Sync);

/// What a destination needs to accept data connections: the listener the control
/// connection came from, a thread spawner, and how long to wait for the connections.
pub struct ParallelReceive<'a> {
    pub listener: &'a TcpListener,
    pub spawn: SpawnLane<'a>,
    /// Read timeout of the data connections and the wait for them to connect.
    pub timeout: Duration,
}

/// Counts of one round on one lane (or totals).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaneRound {
    pub pages: u64,
    pub zero_pages: u64,
    pub bytes: u64,
}

enum LaneMsg {
    Round(u32, LaneRound),
    /// The lane finished the final round: its bytes and stage times.
    Done {
        bytes: u64,
        read: Duration,
        crc: Duration,
    },
    Failed(Error),
}

struct Lane {
    stream: TcpStream,
    from: Receiver<LaneMsg>,
    go: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The running lanes of one migration. Dropping it shuts their connections down and joins
/// their threads, so no lane writes guest memory after `receive` returns.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    pub bytes: u64,
    pub read: Duration,
    pub crc: Duration,
}

impl Lanes {
    /// Accepts the `count` data connections announced with `token`, checks that each opens
    /// with the stream header and its `Join` frame, and starts a thread reading each.
    pub fn accept(
        par: &ParallelReceive<'_>,
        count: u32,
        token: u64,
        ranges: &[RamRange],
        applier: &Arc<Mutex<PageApplier>>,
    ) -> Result<Lanes> {
        let mut streams: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
        let deadline = Instant::now() + par.timeout;
        for _ in 0..count {
            let stream = accept_by(par.listener, deadline)?;
            stream
                .set_read_timeout(Some(par.timeout))
                .map_err(|e| Error::io("setting up a data connection", e))?;
            let mut reader = StreamReader::new(
                stream
                    .try_clone()
                    .map_err(|e| Error::io("setting up a data connection", e))?,
            );
            reader.read_header()?;
            match reader.next_frame()? {
                Frame::Join { token: t, index } if t == token => {
                    let slot = index
                        .checked_sub(1)
                        .and_then(|i| streams.get_mut(i as usize))
                        .filter(|s| s.is_none())
                        .ok_or_else(|| {
                            Error::Vmm(format!(
                                "data connection {index} is out of range or joined twice"
                            ))
                        })?;
                    *slot = Some(stream);
                }
                Frame::Join { .. } => {
                    return Err(Error::Vmm(
                        "a data connection joined with another migration's token".into(),
                    ))
                }
                other => {
                    return Err(Error::Vmm(format!(
                        "a data connection opened with {other:?} instead of Join"
                    )))
                }
            }
        }
        let mut lanes = Lanes {
            lanes: Vec::new(),
            bytes: 0,
            read: Duration::ZERO,
            crc: Duration::ZERO,
        };
        for (i, stream) in streams.into_iter().enumerate() {
            let stream = stream.ok_or_else(|| Error::Vmm("a data connection is missing".into()))?;
            lanes.start(par, i + 1, stream, ranges, applier)?;
        }
        Ok(lanes)
    }

    fn start(
        &mut self,
        par: &ParallelReceive<'_>,
        index: usize,
        stream: TcpStream,
        ranges: &[RamRange],
        applier: &Arc<Mutex<PageApplier>>,
    ) -> Result<()> {
        let (to_main, from) = channel();
        let (go, go_rx) = channel();
        let input = stream
            .try_clone()
            .map_err(|e| Error::io("setting up a data connection", e))?;
        let mut reader = StreamReader::new(BufReader::with_capacity(CONNECTION_READ_AHEAD, input));
        // The header and Join were read on another reader: this one starts at a frame.
        reader.assume_header_read();
        reader.set_ram_ranges(ranges.to_vec());
        let applier = applier.clone();
        let body = Box::new(move || {
            if let Err(e) = run_lane(reader, &applier, &to_main, &go_rx) {
                let _ = to_main.send(LaneMsg::Failed(e));
            }
        });
        let thread = (par.spawn)(format!("migration-in-{index}"), body)
            .map_err(|e| Error::io("starting a data connection's thread", e))?;
        self.lanes.push(Lane {
            stream,
            from,
            go: Some(go),
            thread: Some(thread),
        });
        Ok(())
    }

    /// Waits until every lane reached the end of round `index` and returns the sum of their
    /// counts. The lanes then wait for [`Lanes::release`] (or end, after the final round).
    pub fn round_end(&mut self, index: u32, final_round: bool) -> Result<LaneRound> {
        let mut sum = LaneRound::default();
        for (i, lane) in self.lanes.iter().enumerate() {
            let got = match lane.from.recv() {
                Ok(LaneMsg::Round(n, c)) if n == index => c,
                Ok(LaneMsg::Round(n, _)) => {
                    return Err(Error::Vmm(format!(
                        "data connection {} ended round {n} where round {index} was expected",
                        i + 1
                    )))
                }
                Ok(LaneMsg::Failed(e)) => return Err(lane_error(i, e)),
                Ok(LaneMsg::Done { .. }) | Err(_) => {
                    return Err(Error::Vmm(format!(
                        "data connection {} ended before round {index}",
                        i + 1
                    )))
                }
            };
            sum.pages += got.pages;
            sum.zero_pages += got.zero_pages;
            sum.bytes += got.bytes;
        }
        if final_round {
            for (i, lane) in self.lanes.iter().enumerate() {
                match lane.from.recv() {
                    Ok(LaneMsg::Done { bytes, read, crc }) => {
                        self.bytes += bytes;
                        self.read += read;
                        self.crc += crc;
                    }
                    Ok(LaneMsg::Failed(e)) => return Err(lane_error(i, e)),
                    _ => return Err(Error::Vmm(format!("data connection {} failed", i + 1))),
                }
            }
        }
        Ok(sum)
    }

    /// Lets every lane go on with the next round.
    pub fn release(&self) {
        for lane in &self.lanes {
            if let Some(go) = &lane.go {
                let _ = go.send(());
            }
        }
    }
}

fn lane_error(i: usize, e: Error) -> Error {
    Error::Vmm(format!("data connection {}: {e}", i + 1))
}

impl Drop for Lanes {
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            let _ = lane.stream.shutdown(Shutdown::Both);
            lane.go = None;
        }
        for lane in &mut self.lanes {
            if let Some(t) = lane.thread.take() {
                let _ = t.join();
            }
        }
    }
}

pub(crate) fn accept_by(listener: &TcpListener, deadline: Instant) -> Result<TcpStream> {
    let setup = |e| Error::io("accepting a data connection", e);
    listener.set_nonblocking(true).map_err(setup)?;
    let res = loop {
        match listener.accept() {
            Ok((s, _)) => break Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    break Err(Error::Vmm(
                        "the source's data connections did not arrive in time".into(),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => break Err(setup(e)),
        }
    };
    listener.set_nonblocking(false).map_err(setup)?;
    let s = res?;
    s.set_nonblocking(false).map_err(setup)?;
    Ok(s)
}

/// A lane's loop: applies pages until each round's end, reports it, waits to go on.
fn run_lane(
    mut reader: StreamReader<BufReader<TcpStream>>,
    applier: &Mutex<PageApplier>,
    to_main: &Sender<LaneMsg>,
    go: &Receiver<()>,
) -> Result<()> {
    let mut round = LaneRound::default();
    let mut index = 0u32;
    loop {
        let at = reader.offset();
        match reader.next_frame()? {
            page @ (Frame::Pages(_)
            | Frame::CompressedPages(_)
            | Frame::SamePage { .. }
            | Frame::ZeroPages { .. }) => {
                apply_page_frame(applier, &mut reader, page, at, &mut round)?;
            }
            Frame::RoundEnd(info) => {
                let got = (info.pages, info.zero_pages, info.bytes);
                if info.round != index || got != (round.pages, round.zero_pages, round.bytes) {
                    return Err(Error::Protocol {
                        offset: at,
                        reason: format!(
                            "round {} ends announcing {} pages, {} zero pages, {} bytes; \
                             round {index} with {}, {}, {} arrived",
                            info.round,
                            got.0,
                            got.1,
                            got.2,
                            round.pages,
                            round.zero_pages,
                            round.bytes
                        ),
                    });
                }
                let _ = to_main.send(LaneMsg::Round(index, round));
                if info.final_round {
                    let _ = to_main.send(LaneMsg::Done {
                        bytes: reader.offset(),
                        read: reader.page_read_time,
                        crc: reader.crc_time,
                    });
                    return Ok(());
                }
                if go.recv().is_err() {
                    return Ok(());
                }
                index += 1;
                round = LaneRound::default();
            }
            other => {
                return Err(Error::Protocol {
                    offset: at,
                    reason: format!("{other:?} on a data connection"),
                })
            }
        }
    }
}

/// Applies one frame that carries pages (data, compressed, a repeat or zeroes) and counts it
/// into `round`: the control connection and the data connections take them alike.
pub(crate) fn apply_page_frame<R: Read>(
    applier: &Mutex<PageApplier>,
    reader: &mut StreamReader<R>,
    frame: Frame,
    at: u64,
    round: &mut LaneRound,
) -> Result<()> {
    match frame {
        Frame::Pages(h) => {
            apply_pages_shared(applier, reader, &h)?;
            round.pages += u64::from(h.count);
            round.bytes += pages_frame_len(u64::from(h.count));
        }
        Frame::CompressedPages(c) => {
            apply_compressed(applier, &c, at)?;
            round.pages += c.crcs.len() as u64;
            round.bytes += compressed_frame_len(&c);
        }
        Frame::SamePage {
            addr,
            from,
            crc,
            live,
        } => {
            lock(applier)?.apply_same(addr, from, crc, live, at)?;
            round.pages += 1;
            round.bytes += SAME_PAGE_FRAME_LEN;
        }
        Frame::ZeroPages { addr, count } => {
            lock(applier)?.apply_zero(addr, count)?;
            round.zero_pages += u64::from(count);
            round.bytes += ZERO_PAGES_FRAME_LEN;
        }
        other => {
            return Err(Error::Protocol {
                offset: at,
                reason: format!("{other:?} carries no pages"),
            })
        }
    }
    Ok(())
}

pub(crate) fn lock(applier: &Mutex<PageApplier>) -> Result<std::sync::MutexGuard<'_, PageApplier>> {
    applier
        .lock()
        .map_err(|_| Error::Vmm("a data connection's thread panicked".into()))
}
