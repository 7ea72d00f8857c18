//! Sending threads on the source: one per data connection, each doing the zero check, CRC-32,
//! compression and `writev` of its share of a round's pages, while the migration's own thread
//! hands out the work (and sends its own share on the control connection).
//!
//! The threads live for one round: each is given its connection's writer and compressor at
//! the round's start and gives them back at its end, so everything between rounds (the
//! `RoundEnd` frames, the state, `End`, the `Error` frame of a failure) stays on the
//! migration's thread, in order. A round's threads are always joined before the round
//! returns, with success or error, so no thread reads guest memory after the RAM's borrow.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::bitmap::Bitmap;
use crate::compress::Compressor;
use crate::error::{Error, Result};
use crate::lanes::SpawnLane;
use crate::pages::{send_runs, set_runs, Sent};
use crate::ram::Layout;
use crate::stream::StreamWriter;

/// A run of pages: region, first page, count (inside the region).
type Run = (usize, u64, u64);

/// Pages handed to a connection at a time (1 MiB): small enough that every connection gets
/// work often, large enough to keep the hand-out cheap.
const ITEM_PAGES: u64 = 256;
/// Items queued per thread before the hand-out waits for it.
const QUEUE_DEPTH: usize = 4;

/// A data connection's writer and compressor, owned by the engine between rounds.
pub(crate) struct LaneKit<W: Write> {
    pub w: StreamWriter<W>,
    pub comp: Compressor,
}

/// Sends a round's pages over the control connection and the data connections.
pub(crate) trait RoundSender<W: Write> {
    /// Sends every page of `set`: a share on `main` from this thread, the rest on `lanes`
    /// from a thread each. Returns what went on each connection (`main` first). `tick` is
    /// called now and then with the pages handed out so far.
    #[allow(clippy::too_many_arguments)]
    fn send_round(
        &self,
        main: &mut StreamWriter<W>,
        main_comp: &mut Compressor,
        lanes: &mut Vec<LaneKit<W>>,
        layout: &Layout,
        set: &Bitmap,
        live: bool,
        tick: &mut dyn FnMut(u64, &Sent),
    ) -> Result<Vec<Sent>>;
}

/// Sending threads started through the VMM's sandboxed spawner.
pub(crate) struct Threads<'s> {
    pub spawn: SpawnLane<'s>,
}

/// What a thread takes for a round.
struct Moved<W: Write> {
    kit: LaneKit<W>,
    layout: Layout,
}

// SAFETY: the writer's batch holds no reference into guest memory when it moves (every round
// flushes or clears it before returning), and the layout's pointers stay valid while the
// thread runs: `send_round` joins every thread before it returns, within the borrow of the
// guest RAM that `migrate` holds. The writer itself (`W: Send`) and the compressor are owned.
unsafe impl<W: Write + Send> Send for Moved<W> {}

/// What a thread gives back at the round's end.
struct Done<W: Write> {
    kit: LaneKit<W>,
    sent: Sent,
    result: Result<()>,
}

// SAFETY: as for `Moved`: the batch is cleared before the kit goes back.
unsafe impl<W: Write + Send> Send for Done<W> {}

struct Running<W: Write> {
    work: Option<SyncSender<Vec<Run>>>,
    done: Receiver<Done<W>>,
    thread: Option<JoinHandle<()>>,
}

/// The threads of one round; dropping it stops and joins them.
struct Round<W: Write> {
    running: Vec<Running<W>>,
    stop: Arc<AtomicBool>,
    /// Bytes the threads sent so far (for progress reports).
    lane_bytes: Arc<AtomicU64>,
}

impl<W: Write> Drop for Round<W> {
    fn drop(&mut self) {
        for r in &mut self.running {
            r.work = None;
        }
        for r in &mut self.running {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn lane_round<W: Write>(
    mut m: Moved<W>,
    live: bool,
    work: Receiver<Vec<Run>>,
    stop: &AtomicBool,
    bytes: &AtomicU64,
) -> Done<W> {
    let mut sent = Sent::default();
    let mut result = Ok(());
    for runs in work.iter() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        match send_runs(&mut m.kit.w, &m.layout, &runs, live, Some(&mut m.kit.comp)) {
            Ok(s) => {
                sent.add(&s);
                bytes.fetch_add(s.bytes, Ordering::Relaxed);
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                result = Err(e);
                break;
            }
        }
    }
    m.kit.w.batch.clear();
    Done {
        kit: m.kit,
        sent,
        result,
    }
}

impl<W: Write + Send + 'static> RoundSender<W> for Threads<'_> {
    fn send_round(
        &self,
        main: &mut StreamWriter<W>,
        main_comp: &mut Compressor,
        lanes: &mut Vec<LaneKit<W>>,
        layout: &Layout,
        set: &Bitmap,
        live: bool,
        tick: &mut dyn FnMut(u64, &Sent),
    ) -> Result<Vec<Sent>> {
        let mut round = Round {
            running: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            lane_bytes: Arc::new(AtomicU64::new(0)),
        };
        let started = self
            .start(&mut round, std::mem::take(lanes), layout, live)
            .map_err(HandOut::Failed);
        let mut main_sent = Sent::default();
        let handed = started.and_then(|()| {
            hand_out(
                &round,
                main,
                main_comp,
                layout,
                set,
                live,
                &mut main_sent,
                tick,
            )
        });
        if handed.is_err() {
            round.stop.store(true, Ordering::Relaxed);
        }
        let (per_lane, lane_err) = collect(&mut round, lanes, main_sent);
        match (handed, lane_err) {
            // A lane's own error says more than "its queue closed".
            (Err(HandOut::LaneGone(_)), Some(e)) | (Ok(()), Some(e)) => Err(e),
            (Err(HandOut::LaneGone(n)), None) => Err(Error::Vmm(format!(
                "the sending thread of data connection {n} stopped early"
            ))),
            (Err(HandOut::Failed(e)), _) => Err(e),
            (Ok(()), None) => Ok(per_lane),
        }
    }
}

/// Joins the round's threads and takes their connections back (in connection order, before
/// anything else happens); returns what went on each connection (`main_sent` first) and the
/// first thread's error.
fn collect<W: Write>(
    round: &mut Round<W>,
    lanes: &mut Vec<LaneKit<W>>,
    main_sent: Sent,
) -> (Vec<Sent>, Option<Error>) {
    let mut per_lane = vec![main_sent];
    let mut lane_err = None;
    for (i, r) in round.running.iter_mut().enumerate() {
        r.work = None;
        if let Some(t) = r.thread.take() {
            let _ = t.join();
        }
        let err = match r.done.try_recv() {
            Ok(d) => {
                lanes.push(d.kit);
                per_lane.push(d.sent);
                d.result.err()
            }
            Err(_) => Some(Error::Vmm("its sending thread failed".into())),
        };
        if let (None, Some(e)) = (&lane_err, err) {
            lane_err = Some(Error::Vmm(format!("data connection {}: {e}", i + 1)));
        }
    }
    (per_lane, lane_err)
}

/// Why handing out a round's pages stopped.
enum HandOut {
    /// This thread's own sending failed (or a thread could not start).
    Failed(Error),
    /// The thread of data connection `n` stopped taking work (it failed).
    LaneGone(usize),
}

impl From<Error> for HandOut {
    fn from(e: Error) -> Self {
        HandOut::Failed(e)
    }
}

impl Threads<'_> {
    fn start<W: Write + Send + 'static>(
        &self,
        round: &mut Round<W>,
        kits: Vec<LaneKit<W>>,
        layout: &Layout,
        live: bool,
    ) -> Result<()> {
        for (i, kit) in kits.into_iter().enumerate() {
            let (work, work_rx) = sync_channel(QUEUE_DEPTH);
            let (done_tx, done) = channel();
            let moved = Moved {
                kit,
                layout: layout.clone(),
            };
            let (stop, bytes) = (round.stop.clone(), round.lane_bytes.clone());
            let body = Box::new(move || {
                let _ = done_tx.send(lane_round(moved, live, work_rx, &stop, &bytes));
            });
            let thread = (self.spawn)(format!("migration-out-{}", i + 1), body)
                .map_err(|e| Error::io("starting a data connection's sending thread", e))?;
            round.running.push(Running {
                work: Some(work),
                done,
                thread: Some(thread),
            });
        }
        Ok(())
    }
}

/// Hands the pages of `set` out in items of [`ITEM_PAGES`], in turn to this thread (sent on
/// `main` at once) and to each data connection's thread.
#[allow(clippy::too_many_arguments)]
fn hand_out<W: Write>(
    round: &Round<W>,
    main: &mut StreamWriter<W>,
    main_comp: &mut Compressor,
    layout: &Layout,
    set: &Bitmap,
    live: bool,
    main_sent: &mut Sent,
    tick: &mut dyn FnMut(u64, &Sent),
) -> std::result::Result<(), HandOut> {
    let turns = round.running.len() + 1;
    let mut turn = 0usize;
    let mut item: Vec<Run> = Vec::new();
    let mut item_pages = 0u64;
    let mut done = 0u64;
    let mut give =
        |item: Vec<Run>, pages: u64, turn: &mut usize| -> std::result::Result<(), HandOut> {
            if *turn == 0 {
                let s = send_runs(main, layout, &item, live, Some(main_comp))?;
                main_sent.add(&s);
            } else if round.running[*turn - 1]
                .work
                .as_ref()
                .is_none_or(|w| w.send(item).is_err())
            {
                return Err(HandOut::LaneGone(*turn));
            }
            done += pages;
            let mut so_far = *main_sent;
            so_far.bytes += round.lane_bytes.load(Ordering::Relaxed);
            tick(done, &so_far);
            *turn = (*turn + 1) % turns;
            Ok(())
        };
    for (ri, mut first, mut count) in set_runs(layout, set) {
        while count > 0 {
            let take = count.min(ITEM_PAGES - item_pages);
            item.push((ri, first, take));
            item_pages += take;
            first += take;
            count -= take;
            if item_pages == ITEM_PAGES {
                give(std::mem::take(&mut item), item_pages, &mut turn)?;
                item_pages = 0;
            }
        }
    }
    if item_pages > 0 {
        give(item, item_pages, &mut turn)?;
    }
    Ok(())
}
