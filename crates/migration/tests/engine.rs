//! The pre-copy engine with fake dirty sources and VMs: convergence, max rounds,
//! auto-converge, the source resumed on every failure, the bandwidth limit, and a real
//! concurrent writer over a socket pair.

mod common;

use std::cell::RefCell;
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use migration::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// State shared by the fake dirty source and the fake VM.
struct Shared {
    mem: GuestMemoryMmap<()>,
    rng: Lcg,
    /// Pages the "guest" writes before each dirty-log read, as a function of the throttle.
    writes: Box<dyn Fn(u8) -> u64>,
    paused: bool,
    tracking: bool,
    pauses: u32,
    resumes: u32,
    stops: u32,
    throttles: Vec<u8>,
    /// Calls of `hand_over` and `take_back`, in order ('h', 't').
    handovers: String,
    takes: u32,
    fail_take_at: Option<u32>,
}

type S = Rc<RefCell<Shared>>;

struct FakeDirty(S);
struct FakeVm(S);

impl DirtySource for FakeDirty {
    fn start_tracking(&mut self) -> Result<()> {
        self.0.borrow_mut().tracking = true;
        Ok(())
    }

    fn take_dirty(&mut self) -> Result<Bitmap> {
        let mut s = self.0.borrow_mut();
        assert!(s.tracking);
        s.takes += 1;
        if s.fail_take_at == Some(s.takes) {
            return Err(Error::vmm("KVM_GET_DIRTY_LOG failed: EFAULT"));
        }
        let mut b = Bitmap::new(&[R0 / 4096, R1 / 4096]);
        if !s.paused {
            let throttle = *s.throttles.last().unwrap_or(&0);
            let n = (s.writes)(throttle);
            for _ in 0..n {
                let p = s.rng.next() % 768;
                let (region, page, addr) = if p < 512 {
                    (0, p, p * 4096)
                } else {
                    (1, p - 512, R1_BASE + (p - 512) * 4096)
                };
                let page_data = s.rng.page();
                s.mem.write_slice(&page_data, GuestAddress(addr)).unwrap();
                b.set(region, page);
            }
        }
        Ok(b)
    }

    fn stop_tracking(&mut self) {
        let mut s = self.0.borrow_mut();
        s.tracking = false;
        s.stops += 1;
    }
}

impl VmControl for FakeVm {
    fn pause(&mut self) -> Result<()> {
        let mut s = self.0.borrow_mut();
        s.paused = true;
        s.pauses += 1;
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        let mut s = self.0.borrow_mut();
        s.paused = false;
        s.resumes += 1;
        Ok(())
    }

    fn save_state(&mut self) -> Result<Vec<u8>> {
        Ok(b"cpu state".to_vec())
    }

    fn throttle(&mut self, percent: u8) {
        self.0.borrow_mut().throttles.push(percent);
    }

    fn hand_over(&mut self) -> Result<()> {
        assert!(
            self.0.borrow().paused,
            "disks handed over from a running guest"
        );
        self.0.borrow_mut().handovers.push('h');
        Ok(())
    }

    fn take_back(&mut self) -> Result<()> {
        self.0.borrow_mut().handovers.push('t');
        Ok(())
    }
}

fn source(writes: impl Fn(u8) -> u64 + 'static) -> (S, FakeDirty, FakeVm) {
    let mem = ram();
    let mut rng = Lcg(42);
    // Touch a third of the pages, one of them with zeroes.
    for p in (0..512).step_by(3) {
        fill_page(&mem, p * 4096, &mut rng);
    }
    fill_page(&mem, R1_BASE, &mut rng);
    mem.write_obj(0u8, GuestAddress(R1_BASE + 8192)).unwrap();
    let s = Rc::new(RefCell::new(Shared {
        mem,
        rng,
        writes: Box::new(writes),
        paused: false,
        tracking: false,
        pauses: 0,
        resumes: 0,
        stops: 0,
        throttles: vec![],
        handovers: String::new(),
        takes: 0,
        fail_take_at: None,
    }));
    (s.clone(), FakeDirty(s.clone()), FakeVm(s))
}

/// What the fake destination answers on the reply channel.
#[derive(Clone)]
enum Replies {
    /// Like a real destination: Ready, a RoundAck per live round, Ack after End.
    Auto,
    /// The first `n` replies of `Auto`, then the connection closes.
    AutoFirst(usize),
    /// Exactly these frames, then the connection closes.
    Script(Vec<Frame>),
}

/// The source's output, shared with the fake destination that answers it; fails with
/// "connection reset" after `limit` bytes.
#[derive(Clone, Default)]
struct Wire {
    buf: Rc<RefCell<Vec<u8>>>,
    limit: Option<usize>,
}

impl Write for Wire {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut buf = self.buf.borrow_mut();
        let room = self
            .limit
            .map_or(usize::MAX, |l| l.saturating_sub(buf.len()));
        if room == 0 {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "connection reset",
            ));
        }
        let n = data.len().min(room);
        buf.extend_from_slice(&data[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The reply channel of a fake destination that answers what the source wrote so far.
struct Destination {
    wire: Wire,
    replies: Replies,
    given: usize,
    pending: Vec<u8>,
    pos: usize,
}

impl Destination {
    fn new(wire: &Wire, replies: Replies) -> Self {
        Destination {
            wire: wire.clone(),
            replies,
            given: 0,
            pending: vec![],
            pos: 0,
        }
    }
}

fn auto_replies(stream: &[u8]) -> Vec<Frame> {
    let mut r = StreamReader::new(stream);
    let mut out = vec![];
    while let Ok(f) = r.next_frame() {
        match f {
            Frame::Config(c) => {
                r.set_ram_ranges(c.ram_regions.clone());
                out.push(Frame::Ready);
            }
            Frame::RoundEnd(i) if !i.final_round => out.push(Frame::RoundAck(i.round)),
            Frame::End(_) => out.push(Frame::Ack),
            _ => {}
        }
    }
    out
}

impl io::Read for Destination {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.pending.len() {
            let next = match &self.replies {
                Replies::Script(f) => f.get(self.given).cloned(),
                Replies::Auto => auto_replies(&self.wire.buf.borrow())
                    .get(self.given)
                    .cloned(),
                Replies::AutoFirst(n) if self.given < *n => auto_replies(&self.wire.buf.borrow())
                    .get(self.given)
                    .cloned(),
                Replies::AutoFirst(_) => None,
            };
            let Some(f) = next else { return Ok(0) };
            self.pending = encode_frame(&f).unwrap();
            self.pos = 0;
            self.given += 1;
        }
        let n = buf.len().min(self.pending.len() - self.pos);
        buf[..n].copy_from_slice(&self.pending[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

struct Outcome {
    report: Result<MigrationReport>,
    stream: Vec<u8>,
    progress: Vec<Progress>,
}

fn run(
    s: &S,
    d: &mut FakeDirty,
    v: &mut FakeVm,
    params: &MigrationParams,
    replies: Replies,
) -> Outcome {
    let mem = s.borrow().mem.clone();
    let cfg = config_of(&mem);
    let wire = Wire::default();
    let ack = Destination::new(&wire, replies);
    let mut progress = Vec::new();
    let report = migrate(&mem, &cfg, d, v, wire.clone(), ack, params, |p| {
        progress.push(p.clone())
    });
    let stream = wire.buf.borrow().clone();
    Outcome {
        report,
        stream,
        progress,
    }
}

/// [`run`] with the default parameters and a destination that answers like a real one.
fn run_with_defaults(s: &S, d: &mut FakeDirty, v: &mut FakeVm) -> Outcome {
    run(s, d, v, &MigrationParams::default(), Replies::Auto)
}

/// Receives `stream` into fresh RAM and checks it equals the source's.
fn check_destination(s: &S, stream: &[u8]) -> IncomingReport {
    let src = s.borrow().mem.clone();
    let dst = ram();
    let got = receive(&dst, stream, Vec::new(), &config_of(&src)).unwrap();
    assert_eq!(got.state, b"cpu state");
    assert_eq!(diff(&src, &dst), Vec::<u64>::new());
    let report = got.report.clone();
    let mut ack = got.ack;
    ack.ack().unwrap();
    let replies = ack.into_inner();
    let mut r = StreamReader::replies(&replies[..]);
    assert_eq!(r.next_frame().unwrap(), Frame::Ready);
    for i in 0..report.rounds.len() - 1 {
        assert_eq!(r.next_frame().unwrap(), Frame::RoundAck(i as u32));
    }
    assert_eq!(r.next_frame().unwrap(), Frame::Ack);
    report
}

#[test]
fn converges_when_the_dirty_set_is_small() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run_with_defaults(&s, &mut d, &mut v);
    let rep = o.report.unwrap();
    assert!(rep.converged);
    assert_eq!(rep.stop_reason, StopReason::Converged);
    assert!(rep.downtime_estimate <= Duration::from_millis(50));
    // Round 0 then the final round: 10 pages easily fit 50 ms.
    assert_eq!(rep.rounds.len(), 2);
    let r0 = &rep.rounds[0];
    assert!(r0.live);
    // 171 pages of region 0, one of region 1, and one touched page of zeroes.
    assert_eq!(r0.dirty_pages_found, 173);
    assert_eq!(r0.pages_sent, 172);
    assert_eq!(r0.zero_pages, 1);
    assert_eq!(rep.touched_pages, 173);
    assert_eq!(rep.untouched_pages_skipped, 768 - 173);
    assert!(!rep.rounds[1].live);
    assert!(rep.rounds[1].dirty_pages_found <= 10 && rep.rounds[1].dirty_pages_found > 0);
    assert_eq!(rep.bytes_total, o.stream.len() as u64);
    assert_eq!(rep.state_bytes, 9);
    {
        let sh = s.borrow();
        assert_eq!((sh.pauses, sh.resumes, sh.stops), (1, 0, 1));
        assert!(sh.throttles.is_empty());
    }
    let inc = check_destination(&s, &o.stream);
    assert_eq!(inc.rounds.len(), 2);
    assert_eq!(inc.pages_total, rep.pages_total);
    // Progress: phases in order, bytes growing.
    assert_eq!(o.progress.first().unwrap().phase, Phase::Precopy);
    assert_eq!(o.progress.last().unwrap().phase, Phase::WaitingAck);
    assert!(o
        .progress
        .windows(2)
        .all(|w| w[0].bytes_sent <= w[1].bytes_sent));
    let json = serde_json::to_value(&rep).unwrap();
    assert_eq!(json["converged"], true);
    assert!(json["rounds"][0]["duration_ms"].as_f64().is_some());
    assert!(json["downtime_ms"].as_f64().is_some());
}

#[test]
fn max_rounds_is_honoured_without_auto_converge() {
    let (s, mut d, mut v) = source(|_| 40);
    let params = MigrationParams {
        downtime_target: Duration::ZERO,
        max_rounds: 4,
        ..Default::default()
    };
    let o = run(&s, &mut d, &mut v, &params, Replies::Auto);
    let rep = o.report.unwrap();
    assert!(!rep.converged);
    assert_eq!(rep.stop_reason, StopReason::MaxRounds);
    assert_eq!(rep.rounds.len(), 5, "4 pre-copy rounds and the final one");
    assert!(rep.rounds[..4].iter().all(|r| r.live));
    assert!(rep.downtime_estimate > Duration::ZERO);
    assert!(s.borrow().throttles.is_empty());
    check_destination(&s, &o.stream);
}

#[test]
fn max_time_is_honoured() {
    let (s, mut d, mut v) = source(|_| 40);
    let params = MigrationParams {
        downtime_target: Duration::ZERO,
        max_rounds: 1000,
        max_time: Some(Duration::ZERO),
        auto_converge: true,
        ..Default::default()
    };
    let o = run(&s, &mut d, &mut v, &params, Replies::Auto);
    let rep = o.report.unwrap();
    assert_eq!(rep.stop_reason, StopReason::MaxTime);
    assert_eq!(rep.rounds.len(), 2);
    // No time left, so auto-converge does not get to throttle.
    assert!(s.borrow().throttles.is_empty());
}

#[test]
fn auto_converge_throttles_until_the_guest_fits() {
    // The guest stops dirtying memory once slowed to 40 % of its speed.
    let (s, mut d, mut v) = source(|t| if t >= 60 { 0 } else { 50 });
    let params = MigrationParams {
        downtime_target: Duration::ZERO,
        max_rounds: 2,
        auto_converge: true,
        ..Default::default()
    };
    let o = run(&s, &mut d, &mut v, &params, Replies::Auto);
    let rep = o.report.unwrap();
    assert!(rep.converged);
    assert_eq!(rep.max_throttle_percent, 60);
    // Steps 20, 40, 60, then back to full speed at the end.
    assert_eq!(s.borrow().throttles, vec![20, 40, 60, 0]);
    let throttles: Vec<u8> = rep.rounds.iter().map(|r| r.throttle_percent).collect();
    // The last one is the stop-and-copy round, still throttled.
    assert_eq!(throttles, vec![0, 0, 20, 40, 60, 60]);
    check_destination(&s, &o.stream);
}

#[test]
fn auto_converge_gives_up_at_99_percent() {
    let (s, mut d, mut v) = source(|_| 30);
    let params = MigrationParams {
        downtime_target: Duration::ZERO,
        max_rounds: 3,
        auto_converge: true,
        ..Default::default()
    };
    let o = run(&s, &mut d, &mut v, &params, Replies::Auto);
    let rep = o.report.unwrap();
    assert!(!rep.converged);
    assert_eq!(rep.stop_reason, StopReason::MaxRounds);
    assert_eq!(rep.max_throttle_percent, 99);
    let t = s.borrow().throttles.clone();
    assert_eq!(t.last(), Some(&0));
    assert!(t.contains(&99));
    assert!(t.windows(2).take(t.len() - 2).all(|w| w[0] < w[1]), "{t:?}");
    check_destination(&s, &o.stream);
}

fn run_failing(limit: usize) -> (S, Error) {
    let (s, mut d, mut v) = source(|_| 10);
    let mem = s.borrow().mem.clone();
    let wire = Wire {
        limit: Some(limit),
        ..Default::default()
    };
    let ack = Destination::new(&wire, Replies::Auto);
    let e = migrate(
        &mem,
        &config_of(&mem),
        &mut d,
        &mut v,
        wire,
        ack,
        &MigrationParams::default(),
        |_| {},
    )
    .unwrap_err();
    (s, e)
}

#[test]
fn a_failed_write_resumes_the_source() {
    let (s, mut d, mut v) = source(|_| 10);
    let total = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Auto,
    )
    .stream
    .len();
    // Fails in the final round: the guest was paused and is resumed.
    let (s, e) = run_failing(total - 60);
    assert!(e.to_string().contains("connection reset"), "{e}");
    {
        let sh = s.borrow();
        assert_eq!((sh.pauses, sh.resumes, sh.stops), (1, 1, 1));
        assert!(!sh.paused && !sh.tracking);
    }
    // Fails in round 0: never paused, so not resumed; tracking stopped.
    let (s, _) = run_failing(5000);
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.stops), (0, 0, 1));
}

/// The acknowledgement lost after `End`: the destination may be running the guest, so the
/// source keeps it paused (it must never run twice) and says the outcome is unknown.
#[test]
fn a_missing_ack_leaves_the_source_paused_with_an_unknown_outcome() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        // Ready and RoundAck(0), then nothing.
        Replies::AutoFirst(2),
    );
    let e = o.report.unwrap_err();
    assert!(e.outcome_unknown(), "{e}");
    assert_eq!(
        e.to_string(),
        "outcome unknown: the destination may be running the guest (the destination closed \
         the connection before its acknowledgement); the guest stays paused here"
    );
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.stops), (1, 0, 1));
    assert!(sh.paused);
    // Nothing follows End: the destination may already run the guest.
    drop(sh);
    let mut r = StreamReader::new(&o.stream[..]);
    let mut last = None;
    while let Ok(f) = r.next_frame() {
        if let Frame::Config(c) = &f {
            r.set_ram_ranges(c.ram_regions.clone());
        }
        last = Some(f);
    }
    assert!(matches!(last, Some(Frame::End(_))), "{last:?}");
}

/// A destination that refuses the final state (its restore failed) does not run the guest:
/// the source resumes it.
#[test]
fn a_refusal_after_end_resumes_the_source() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![
            Frame::Ready,
            Frame::RoundAck(0),
            Frame::Error("restoring the vCPUs failed".into()),
        ]),
    );
    let e = o.report.unwrap_err();
    assert!(!e.outcome_unknown(), "{e}");
    assert!(e.to_string().contains("restoring the vCPUs failed"), "{e}");
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.stops), (1, 1, 1));
    assert!(!sh.paused);
}

#[test]
fn the_source_hands_its_disks_over_when_the_destination_asks() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![
            Frame::Ready,
            Frame::RoundAck(0),
            Frame::Handover,
            Frame::Ack,
        ]),
    );
    o.report.unwrap();
    let sh = s.borrow();
    assert_eq!(sh.handovers, "h");
    assert_eq!((sh.pauses, sh.resumes), (1, 0));
}

#[test]
fn a_refusal_after_the_hand_over_takes_the_disks_back_then_resumes() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![
            Frame::Ready,
            Frame::RoundAck(0),
            Frame::Handover,
            Frame::Error("disk a.img: locked by another process".into()),
        ]),
    );
    let e = o.report.unwrap_err();
    assert!(!e.outcome_unknown(), "{e}");
    let sh = s.borrow();
    assert_eq!(sh.handovers, "ht");
    assert_eq!((sh.pauses, sh.resumes), (1, 1));
    assert!(!sh.paused);
}

#[test]
fn a_lost_ack_after_the_hand_over_keeps_the_disks_released_and_the_guest_paused() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![Frame::Ready, Frame::RoundAck(0), Frame::Handover]),
    );
    let e = o.report.unwrap_err();
    assert!(e.outcome_unknown(), "{e}");
    let sh = s.borrow();
    // The destination may run the guest with the disks: the source must not take them back.
    assert_eq!(sh.handovers, "h");
    assert!(sh.paused);
}

#[test]
fn a_refusing_destination_stops_the_migration_early() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![Frame::Error(
            "machine mismatch: vCPU count differs: source 2, destination 4".into(),
        )]),
    );
    let e = o.report.unwrap_err().to_string();
    assert_eq!(
        e,
        "the destination reported an error: machine mismatch: vCPU count differs: source 2, destination 4"
    );
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.takes), (0, 0, 0));
    // Destination error after the final round: the source resumes.
    drop(sh);
    let (s, mut d, mut v) = source(|_| 10);
    let o = run(
        &s,
        &mut d,
        &mut v,
        &MigrationParams::default(),
        Replies::Script(vec![
            Frame::Ready,
            Frame::RoundAck(0),
            Frame::Error("restoring vCPU 1: bad MSR".into()),
        ]),
    );
    assert!(o.report.unwrap_err().to_string().contains("bad MSR"));
    assert_eq!(s.borrow().resumes, 1);
}

#[test]
fn a_dirty_log_failure_after_pause_resumes_the_source() {
    let (s, mut d, mut v) = source(|_| 10);
    // take 1: after round 0; take 2: the final one, after the pause.
    s.borrow_mut().fail_take_at = Some(2);
    let o = run_with_defaults(&s, &mut d, &mut v);
    assert!(o.report.unwrap_err().to_string().contains("EFAULT"));
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.stops), (1, 1, 1));
}

#[test]
fn bad_parameters_are_refused() {
    let (s, mut d, mut v) = source(|_| 10);
    let p = MigrationParams {
        max_rounds: 0,
        ..Default::default()
    };
    let e = run(&s, &mut d, &mut v, &p, Replies::Script(vec![]))
        .report
        .unwrap_err();
    assert!(e.to_string().contains("max_rounds"), "{e}");
    let mem = s.borrow().mem.clone();
    let mut cfg = config_of(&mem);
    cfg.memory_size += 4096;
    cfg.ram_regions[0].size += 4096;
    let e = migrate(
        &mem,
        &cfg,
        &mut d,
        &mut v,
        Vec::new(),
        &[][..],
        &MigrationParams::default(),
        |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("RAM regions"), "{e}");
}

#[test]
fn bandwidth_limit_is_respected() {
    // 8 MiB of touched memory at 32 MiB/s: about 250 ms.
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
    let mut rng = Lcg(8);
    for p in 0..2048u64 {
        fill_page(&mem, p * 4096, &mut rng);
    }
    let s = Rc::new(RefCell::new(Shared {
        mem: mem.clone(),
        rng,
        writes: Box::new(|_| 0),
        paused: false,
        tracking: false,
        pauses: 0,
        resumes: 0,
        stops: 0,
        throttles: vec![],
        handovers: String::new(),
        takes: 0,
        fail_take_at: None,
    }));
    struct NoDirty;
    impl DirtySource for NoDirty {
        fn start_tracking(&mut self) -> Result<()> {
            Ok(())
        }
        fn take_dirty(&mut self) -> Result<Bitmap> {
            Ok(Bitmap::new(&[2048]))
        }
        fn stop_tracking(&mut self) {}
    }
    let params = MigrationParams {
        max_bandwidth: Some(32 << 20),
        ..Default::default()
    };
    let wire = Wire::default();
    let ack = Destination::new(&wire, Replies::Auto);
    let t = Instant::now();
    let rep = migrate(
        &mem,
        &config_of(&mem),
        &mut NoDirty,
        &mut FakeVm(s),
        wire.clone(),
        ack,
        &params,
        |_| {},
    )
    .unwrap();
    let el = t.elapsed().as_secs_f64();
    let out = wire.buf.borrow();
    let ideal = out.len() as f64 / (32u64 << 20) as f64;
    assert!(
        el >= ideal * 0.9,
        "{el:.3} s for {} bytes: faster than the limit",
        out.len()
    );
    // Only a gross overshoot fails: on a loaded host the sender itself may be descheduled
    // (0.505 s against 2× the ideal was seen), which says nothing about the limiter.
    assert!(
        el <= ideal * 8.0,
        "{el:.3} s for {} bytes (ideal {ideal:.3})",
        out.len()
    );
    let bw = rep.bandwidth_bytes_per_s;
    assert!(bw <= (32 << 20) as f64 * 1.01, "{bw}");
    assert!(rep.rounds[0].bytes_sent > 8 << 20);
}

/// Fake dirty log for a real concurrent writer, which marks each page after writing it.
struct ThreadDirty(Arc<Mutex<Bitmap>>);

impl DirtySource for ThreadDirty {
    fn start_tracking(&mut self) -> Result<()> {
        Ok(())
    }
    fn take_dirty(&mut self) -> Result<Bitmap> {
        let mut b = self.0.lock().unwrap();
        let fresh = Bitmap::new(&[R0 / 4096, R1 / 4096]);
        Ok(std::mem::replace(&mut *b, fresh))
    }
    fn stop_tracking(&mut self) {}
}

struct ThreadVm {
    stop: Arc<AtomicBool>,
    writer: Option<std::thread::JoinHandle<u64>>,
    writes: u64,
    resumed: bool,
}

impl VmControl for ThreadVm {
    fn pause(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.writer.take() {
            self.writes = h.join().unwrap();
        }
        Ok(())
    }
    fn resume(&mut self) -> Result<()> {
        self.resumed = true;
        Ok(())
    }
    fn save_state(&mut self) -> Result<Vec<u8>> {
        Ok(b"cpu state".to_vec())
    }
    fn throttle(&mut self, _percent: u8) {}
}

#[test]
fn live_migration_with_a_busy_guest_over_a_socket() {
    let (s, _, _) = source(|_| 0);
    let mem = s.borrow().mem.clone();
    let cfg = config_of(&mem);
    let dirty = Arc::new(Mutex::new(Bitmap::new(&[R0 / 4096, R1 / 4096])));
    let stop = Arc::new(AtomicBool::new(false));
    // The "guest": rewrites a hot set of 64 pages with byte-wise writes (so a page being
    // sent can be torn), plus random other pages, until paused.
    let writer = {
        let (mem, dirty, stop) = (mem.clone(), dirty.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Lcg(77);
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let r = rng.next();
                let page = if r.is_multiple_of(4) {
                    r / 4 % 512
                } else {
                    r / 4 % 64
                };
                let v = rng.next();
                for i in (0..4096).step_by(512) {
                    mem.write_obj(v.wrapping_add(i), GuestAddress(page * 4096 + i))
                        .unwrap();
                }
                // Marked after the stores: a write the dirty log has not reported yet is
                // reported by a later read of it (the final one comes after the pause).
                dirty.lock().unwrap().set(0, page);
                n += 1;
                if n.is_multiple_of(64) {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            n
        })
    };
    let mut vm = ThreadVm {
        stop,
        writer: Some(writer),
        writes: 0,
        resumed: false,
    };
    let (src_sock, dst_sock) = UnixStream::pair().unwrap();
    let dst = ram();
    let receiver = {
        let (dst, cfg) = (dst.clone(), cfg.clone());
        std::thread::spawn(move || {
            let input = dst_sock.try_clone().unwrap();
            let got = receive(&dst, input, dst_sock, &cfg).unwrap();
            let report = got.report.clone();
            // Restore, resume, then acknowledge.
            let mut ack = got.ack;
            ack.ack().unwrap();
            (got.state, report)
        })
    };
    let ack_in = src_sock.try_clone().unwrap();
    ack_in
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let params = MigrationParams {
        downtime_target: Duration::from_micros(200),
        max_rounds: 6,
        ..Default::default()
    };
    let rep = migrate(
        &mem,
        &cfg,
        &mut ThreadDirty(dirty),
        &mut vm,
        &src_sock,
        ack_in,
        &params,
        |_| {},
    )
    .unwrap();
    let (state, inc) = receiver.join().unwrap();
    assert_eq!(state, b"cpu state");
    assert!(!vm.resumed);
    assert!(vm.writes > 0);
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
    assert!(rep.downtime >= rep.stop_and_copy);
    eprintln!(
        "busy guest: {} writes, {} rounds, {} torn pages recovered, converged {}, downtime {:?}",
        vm.writes,
        rep.rounds.len(),
        inc.torn_pages_recovered,
        rep.converged,
        rep.downtime
    );
}

#[test]
fn snapshot_to_a_file_and_back() {
    let (s, _, _) = source(|_| 0);
    let mem = s.borrow().mem.clone();
    let cfg = config_of(&mem);
    let path = std::env::temp_dir().join(format!("ferrovm-mig-test-{}.snap", std::process::id()));
    let rep = snapshot(
        &mem,
        &cfg,
        b"cpu state",
        std::fs::File::create(&path).unwrap(),
    )
    .unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), rep.bytes_total);
    let dst = ram();
    let r = restore_from(&dst, std::fs::File::open(&path).unwrap(), &cfg).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(r.state, b"cpu state");
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
}

/// A data connection that fails ("connection reset") after `limit` bytes.
struct CutAfter {
    inner: std::net::TcpStream,
    left: Option<usize>,
}

impl Write for CutAfter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = match self.left {
            Some(0) => {
                let _ = self.inner.shutdown(std::net::Shutdown::Both);
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "connection reset",
                ));
            }
            Some(left) => data.len().min(left),
            None => data.len(),
        };
        let n = self.inner.write(&data[..n])?;
        if let Some(left) = &mut self.left {
            *left -= n;
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A migration with a sending thread per data connection (`migrate_threaded`) into a
/// destination that reads each connection on a thread (`receive_parallel`), over TCP; with
/// `cut = Some((lane, bytes))`, data connection `lane` fails after `bytes`.
fn threaded_migration(lanes: usize, cut: Option<(usize, usize)>) -> (S, Result<MigrationReport>) {
    let (s, mut d, mut v) = source(|_| 40);
    let mem = s.borrow().mem.clone();
    // Every page holds data: round 0 is then several items, handed to every thread.
    let mut rng = Lcg(9);
    for p in 0..512 {
        fill_page(&mem, p * 4096, &mut rng);
    }
    for p in 0..R1 / 4096 {
        fill_page(&mem, R1_BASE + p * 4096, &mut rng);
    }
    let cfg = config_of(&mem);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dst = ram();
    let receiver = {
        let (dst, cfg) = (dst.clone(), cfg.clone());
        std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let spawn = |name: String, body: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new().name(name).spawn(body)
            };
            let par = ParallelReceive {
                listener: &listener,
                spawn: &spawn,
                timeout: Duration::from_secs(10),
            };
            let input = conn.try_clone().unwrap();
            receive_parallel(&dst, input, conn, &cfg, Some(&par)).map(|got| {
                let mut ack = got.ack;
                ack.ack().unwrap();
                got.state
            })
        })
    };
    let control = std::net::TcpStream::connect(addr).unwrap();
    let ack_in = control.try_clone().unwrap();
    ack_in
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let data = (1..=lanes)
        .map(|i| CutAfter {
            inner: std::net::TcpStream::connect(addr).unwrap(),
            left: cut.filter(|c| c.0 == i).map(|c| c.1),
        })
        .collect();
    let spawn = |name: String, body: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new().name(name).spawn(body)
    };
    let out = CutAfter {
        inner: control,
        left: None,
    };
    let params = MigrationParams {
        downtime_target: Duration::from_micros(100),
        max_rounds: 4,
        ..Default::default()
    };
    let rep = migrate_threaded(
        &mem,
        &cfg,
        &mut d,
        &mut v,
        out,
        data,
        ack_in,
        &params,
        None,
        |_| {},
        &spawn,
    );
    let got = receiver.join().unwrap();
    if rep.is_ok() {
        assert_eq!(got.unwrap(), b"cpu state");
        assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
    } else {
        assert!(got.is_err(), "the destination must fail too");
    }
    (s, rep)
}

#[test]
fn sending_threads_move_every_page_over_data_connections() {
    for lanes in [1, 3] {
        let (s, rep) = threaded_migration(lanes, None);
        let rep = rep.unwrap();
        assert!(rep.rounds.len() >= 2, "{:?}", rep.rounds);
        let s = s.borrow();
        assert_eq!((s.pauses, s.resumes, s.stops), (1, 0, 1));
    }
}

#[test]
fn a_failed_sending_thread_fails_the_migration_and_resumes_the_source() {
    for (lanes, cut) in [(1, 0), (2, 5000), (3, 200_000), (1, 100)] {
        let lane = lanes.min(2);
        let (s, rep) = threaded_migration(lanes, Some((lane, cut)));
        let err = rep.unwrap_err().to_string();
        assert!(
            err.contains(&format!("data connection {lane}")) && err.contains("connection reset"),
            "{err}"
        );
        let s = s.borrow();
        assert_eq!(s.pauses, s.resumes, "the source runs on");
        assert!(!s.paused && !s.tracking);
    }
}

/// A dirty log that, at its first read, rewrites page 0 (the page the copies of round 0 name)
/// and reports only it; later reads report nothing.
struct RewritesPageZero {
    mem: GuestMemoryMmap<()>,
    takes: u32,
}

impl DirtySource for RewritesPageZero {
    fn start_tracking(&mut self) -> Result<()> {
        Ok(())
    }
    fn take_dirty(&mut self) -> Result<Bitmap> {
        self.takes += 1;
        let mut b = Bitmap::new(&[R0 / 4096, R1 / 4096]);
        if self.takes == 1 {
            self.mem
                .write_slice(&[0x5a; 4096], GuestAddress(0))
                .unwrap();
            b.set(0, 0);
        }
        Ok(b)
    }
    fn stop_tracking(&mut self) {}
}

/// Repeated pages go as `SamePage` markers; when the page they were copied from changes,
/// they are sent again (else the destination would keep the old copies).
#[test]
fn repeated_pages_go_as_markers_and_follow_their_source_page() {
    let (s, _, mut v) = source(|_| 0);
    let mem = s.borrow().mem.clone();
    let same = Lcg(11).page();
    for p in 0..100 {
        mem.write_slice(&same, GuestAddress(p * 4096)).unwrap();
    }
    let cfg = config_of(&mem);
    let mut sizes = Vec::new();
    for compression in [Compression::Auto, Compression::None] {
        let wire = Wire::default();
        let ack = Destination::new(&wire, Replies::Auto);
        let mut dirty = RewritesPageZero {
            mem: mem.clone(),
            takes: 0,
        };
        mem.write_slice(&same, GuestAddress(0)).unwrap();
        let params = MigrationParams {
            downtime_target: Duration::ZERO,
            max_rounds: 2,
            compression,
            ..Default::default()
        };
        let rep = migrate(
            &mem,
            &cfg,
            &mut dirty,
            &mut v,
            wire.clone(),
            ack,
            &params,
            |_| {},
        )
        .unwrap();
        let stream = wire.buf.borrow().clone();
        check_destination(&s, &stream);
        if compression != Compression::None {
            // Round 1 sends page 0 and, as its copies may be stale, the 99 copies again.
            assert_eq!(rep.rounds[1].pages_sent, 100, "{:?}", rep.rounds);
        }
        sizes.push(rep.bytes_total);
        // Undo the rewrite for the next pass, and resume the fake VM.
        s.borrow_mut().paused = false;
    }
    // Round 0: 99 copies as 36-byte markers instead of 4100 bytes each; round 1 sends
    // page 1 with data and 98 markers, where the stream without markers sends only page 0.
    assert!(sizes[0] + 99 * 3900 < sizes[1], "{sizes:?}");
}

fn shared_ram() -> MigrationParams {
    MigrationParams {
        shared_ram: true,
        ..Default::default()
    }
}

/// Over shared guest RAM (a local update) no page is sent: the stream is the configuration,
/// the state and `End`, and the destination reads it without touching its memory.
#[test]
fn shared_ram_sends_the_state_only() {
    let (s, mut d, mut v) = source(|_| 10);
    let replies = Replies::Script(vec![Frame::Ready, Frame::Handover, Frame::Ack]);
    let o = run(&s, &mut d, &mut v, &shared_ram(), replies);
    let rep = o.report.unwrap();
    assert!(rep.rounds.is_empty());
    assert_eq!((rep.pages_total, rep.zero_pages_total), (0, 0));
    assert_eq!(rep.residency_method, ResidencyMethod::Shared);
    let sh = s.borrow();
    assert_eq!((sh.pauses, sh.resumes, sh.handovers.as_str()), (1, 0, "h"));
    assert!(!sh.tracking, "no dirty tracking over shared RAM");
    let got = receive_shared_ram(&o.stream[..], Vec::new(), &config_of(&sh.mem)).unwrap();
    assert_eq!(got.state, b"cpu state");
    assert_eq!(got.report.pages_total, 0);
    // A page-copying receiver refuses such a stream rather than run a guest without RAM.
    let err = receive(&ram(), &o.stream[..], Vec::new(), &config_of(&sh.mem))
        .err()
        .unwrap();
    assert!(err.to_string().contains("before the final round"), "{err}");
}

/// A destination gone before `Handover` changed nothing in the shared RAM: the source
/// resumes. Gone after it, the outcome is unknown and the source stays paused.
#[test]
fn shared_ram_destination_lost_before_or_after_handover() {
    let (s, mut d, mut v) = source(|_| 10);
    let e = run(
        &s,
        &mut d,
        &mut v,
        &shared_ram(),
        Replies::Script(vec![Frame::Ready]),
    )
    .report
    .unwrap_err();
    assert!(!e.outcome_unknown(), "{e}");
    assert!(
        e.to_string().contains("before taking the guest over"),
        "{e}"
    );
    assert_eq!((s.borrow().pauses, s.borrow().resumes), (1, 1));

    let (s, mut d, mut v) = source(|_| 10);
    let replies = Replies::Script(vec![Frame::Ready, Frame::Handover]);
    let e = run(&s, &mut d, &mut v, &shared_ram(), replies)
        .report
        .unwrap_err();
    assert!(e.outcome_unknown(), "{e}");
    assert_eq!((s.borrow().pauses, s.borrow().resumes), (1, 0));
}

/// A source that sends pages on a shared-RAM stream is refused by the destination.
#[test]
fn shared_ram_receiver_refuses_pages() {
    let (s, mut d, mut v) = source(|_| 10);
    let o = run_with_defaults(&s, &mut d, &mut v);
    o.report.unwrap();
    let err = receive_shared_ram(&o.stream[..], Vec::new(), &config_of(&s.borrow().mem))
        .err()
        .unwrap();
    assert!(err.to_string().contains("pages"), "{err}");
}
