//! Post-copy over loopback TCP: the switch, requests answered before the background stream,
//! every page delivered once and verified, and the loss reported when the destination
//! misbehaves or goes away after it ran the guest.

mod common;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use migration::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

struct StillDirty;

impl DirtySource for StillDirty {
    fn start_tracking(&mut self) -> Result<()> {
        Ok(())
    }
    fn take_dirty(&mut self) -> Result<Bitmap> {
        // The guest wrote the first 8 pages again in every round.
        let mut b = Bitmap::new(&[R0 / 4096, R1 / 4096]);
        for p in 0..8 {
            b.set(0, p);
        }
        Ok(b)
    }
    fn stop_tracking(&mut self) {}
}

#[derive(Default)]
struct Vm {
    paused: bool,
    resumed: bool,
}

impl VmControl for Vm {
    fn pause(&mut self) -> Result<()> {
        self.paused = true;
        Ok(())
    }
    fn resume(&mut self) -> Result<()> {
        self.resumed = true;
        Ok(())
    }
    fn save_state(&mut self) -> Result<Vec<u8>> {
        Ok(b"state".to_vec())
    }
    fn throttle(&mut self, _percent: u8) {}
}

fn source_ram() -> GuestMemoryMmap<()> {
    let mem = ram();
    let mut rng = Lcg(5);
    for p in 0..300u64 {
        fill_page(&mem, p * 4096, &mut rng);
    }
    fill_page(&mem, R1_BASE + 7 * 4096, &mut rng);
    // Touched but zero: goes as a marker.
    mem.write_obj(0u8, GuestAddress(400 * 4096)).unwrap();
    mem
}

/// What the fake destination does once it runs the guest.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Asks for some pages, installs everything, says `Resident`.
    Good,
    /// Asks for a page outside guest RAM.
    OutOfRange,
    /// Closes the post-copy connection after the first pages.
    Vanish,
}

fn destination(
    listener: TcpListener,
    dst: GuestMemoryMmap<()>,
    cfg: MigrationConfig,
    how: Behaviour,
) -> JoinHandle<std::result::Result<u64, String>> {
    std::thread::spawn(move || {
        let (ctrl, _) = listener.accept().unwrap();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name).spawn(f)
        };
        let par = ParallelReceive {
            listener: &listener,
            spawn: &spawn,
            timeout: Duration::from_secs(10),
        };
        let got = receive_parallel(&dst, ctrl.try_clone().unwrap(), ctrl, &cfg, Some(&par))
            .map_err(|e| e.to_string())?;
        let pc = got.postcopy.expect("a post-copy switch");
        let mut ack = got.ack;
        ack.ack().unwrap();
        let mut link = pc.link.try_clone().unwrap();
        let request = |link: &mut TcpStream, addr: u64, count: u32| {
            link.write_all(&Record::Request { addr, count }.encode())
        };
        match how {
            Behaviour::Good => {
                request(&mut link, R1_BASE + 7 * 4096, 1).unwrap();
                request(&mut link, 200 * 4096, 16).unwrap();
                // A duplicate: answered with nothing, the pages already went.
                request(&mut link, 200 * 4096, 16).unwrap();
            }
            Behaviour::OutOfRange => request(&mut link, 64 << 30, 1).unwrap(),
            Behaviour::Vanish => {}
        }
        let mut reader = ArrivalReader::new(pc.link.try_clone().unwrap(), pc.ranges.clone());
        let mut installed = 0u64;
        loop {
            match reader.next_arrival().map_err(|e| e.to_string())? {
                Arrival::Pages { addr, data } => {
                    dst.write_slice(&data, GuestAddress(addr)).unwrap();
                    installed += data.len() as u64 / 4096;
                }
                Arrival::Zero { count, .. } => installed += u64::from(count),
                Arrival::End { pages, .. } => {
                    assert_eq!(pages, installed);
                    break;
                }
            }
            if matches!(how, Behaviour::Vanish) && installed > 8 {
                let _ = pc.link.shutdown(std::net::Shutdown::Both);
                return Ok(installed);
            }
        }
        assert_eq!(installed, pc.missing.count());
        link.write_all(&Record::Resident.encode()).unwrap();
        Ok(installed)
    })
}

type Run = (
    Result<MigrationReport>,
    Vm,
    GuestMemoryMmap<()>,
    GuestMemoryMmap<()>,
    std::result::Result<u64, String>,
);

fn run(after_rounds: u32, how: Behaviour) -> Run {
    let mem = source_ram();
    let dst = ram();
    let cfg = config_of(&mem);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dest = destination(listener, dst.clone(), cfg.clone(), how);
    let ctrl = TcpStream::connect(addr).unwrap();
    ctrl.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let connect = move || TcpStream::connect(addr);
    let spawn =
        |name: String, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name).spawn(f);
    let replies_from = ctrl.try_clone().unwrap();
    let replies = move || {
        let reader = replies_from.try_clone()?;
        Ok(Box::new(reader) as Box<dyn std::io::Read + Send>)
    };
    let pc = PostcopySource {
        after_rounds,
        connect: &connect,
        spawn: &spawn,
        replies: &replies,
        timeout: Duration::from_secs(10),
    };
    let mut vm = Vm::default();
    let params = MigrationParams {
        downtime_target: Duration::ZERO,
        ..Default::default()
    };
    let result = migrate_threaded(
        &mem,
        &cfg,
        &mut StillDirty,
        &mut vm,
        ctrl.try_clone().unwrap(),
        Vec::new(),
        ctrl.try_clone().unwrap(),
        &params,
        Some(&pc),
        |_| {},
        &spawn,
    );
    let got = dest.join().unwrap();
    (result, vm, mem, dst, got)
}

#[test]
fn post_copy_from_the_start_delivers_every_page_once() {
    let (result, vm, mem, dst, got) = run(0, Behaviour::Good);
    let rep = result.unwrap();
    let pc = rep.postcopy.expect("post-copy report");
    assert_eq!(rep.stop_reason, StopReason::Postcopy);
    assert!(rep.rounds.is_empty(), "{:?}", rep.rounds);
    assert_eq!(pc.missing_pages, 302);
    assert_eq!(got.unwrap(), 302);
    assert_eq!(pc.pages_on_demand + pc.pages_streamed, 302);
    assert_eq!(pc.requests, 3);
    assert_eq!(pc.zero_pages, 1);
    assert!(vm.paused && !vm.resumed);
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
}

#[test]
fn post_copy_after_two_rounds_sends_only_the_dirty_pages() {
    let (result, _, mem, dst, got) = run(2, Behaviour::Good);
    let rep = result.unwrap();
    let pc = rep.postcopy.expect("post-copy report");
    assert_eq!(rep.rounds.len(), 2);
    assert_eq!(pc.after_rounds, 2);
    // The 8 pages rewritten every round, plus the two pages asked for (already there, but
    // a request only ever gets pages still missing).
    assert_eq!(pc.missing_pages, 8);
    assert_eq!(got.unwrap(), 8);
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
}

#[test]
fn a_request_outside_guest_ram_loses_the_guest_with_a_clear_error() {
    let (result, vm, _, _, _) = run(0, Behaviour::OutOfRange);
    let e = result.unwrap_err();
    assert!(matches!(e, Error::PostcopyLost { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("the guest is lost"), "{text}");
    assert!(text.contains("not inside one RAM region"), "{text}");
    // The destination ran the guest: the source never resumes it.
    assert!(!vm.resumed);
}

#[test]
fn a_destination_that_goes_away_loses_the_guest() {
    let (result, vm, _, _, got) = run(0, Behaviour::Vanish);
    let e = result.unwrap_err();
    assert!(matches!(e, Error::PostcopyLost { .. }), "{e}");
    assert!(!vm.resumed);
    assert!(got.is_ok());
}

#[test]
fn a_truncated_post_copy_stream_is_an_error() {
    let mem = source_ram();
    let ranges = config_of(&mem).ram_regions;
    let mut w = StreamWriter::new(Vec::new());
    w.write_pages(0, &vec![7u8; 8192], false).unwrap();
    w.flush().unwrap();
    let bytes = w.into_inner();
    let mut r = ArrivalReader::new(&bytes[..bytes.len() - 100], ranges.clone());
    let e = r.next_arrival().unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
    // A flipped data byte fails the page's checksum.
    let mut bad = bytes.clone();
    bad[100] ^= 1;
    let e = ArrivalReader::new(&bad[..], ranges.clone())
        .next_arrival()
        .unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    // A page outside guest RAM is refused.
    let mut w = StreamWriter::new(Vec::new());
    w.write_pages(64 << 30, &vec![7u8; 4096], false).unwrap();
    w.flush().unwrap();
    let far = w.into_inner();
    let e = ArrivalReader::new(&far[..], ranges)
        .next_arrival()
        .unwrap_err();
    assert!(e.to_string().contains("guest pages"), "{e}");
}
