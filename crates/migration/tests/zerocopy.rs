//! Zero-copy sending (Linux): guest pages spliced into the migration socket by reference, a
//! page changed while in flight caught by its CRC and sent again, and the `writev` path kept
//! for writers that are not sockets.
#![cfg(target_os = "linux")]

mod common;

use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use migration::*;
use vm_memory::{Bytes, GuestAddress};

/// A dirty log that reports the pages the test marks.
struct Marked(Rc<RefCell<Vec<u64>>>);

impl DirtySource for Marked {
    fn start_tracking(&mut self) -> Result<()> {
        Ok(())
    }
    fn take_dirty(&mut self) -> Result<Bitmap> {
        let mut b = Bitmap::new(&[R0 / 4096, R1 / 4096]);
        for p in self.0.borrow_mut().drain(..) {
            b.set(0, p);
        }
        Ok(b)
    }
    fn stop_tracking(&mut self) {}
}

struct Vm;

impl VmControl for Vm {
    fn pause(&mut self) -> Result<()> {
        Ok(())
    }
    fn resume(&mut self) -> Result<()> {
        Ok(())
    }
    fn save_state(&mut self) -> Result<Vec<u8>> {
        Ok(b"cpu state".to_vec())
    }
    fn throttle(&mut self, _: u8) {}
}

/// A gate the destination's reads wait at once it has replied `Ready`, until the test opens
/// it: the source's round 0 then sits in the socket, unread.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<(bool, bool)>, Condvar)>);

impl Gate {
    fn replied(&self) {
        self.0 .0.lock().unwrap().0 = true;
    }
    fn open(&self) {
        self.0 .0.lock().unwrap().1 = true;
        self.0 .1.notify_all();
    }
    fn wait(&self) {
        let mut g = self.0 .0.lock().unwrap();
        while g.0 && !g.1 {
            g = self.0 .1.wait(g).unwrap();
        }
    }
}

struct GatedReader(TcpStream, Gate);

impl Read for GatedReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.1.wait();
        self.0.read(buf)
    }
}

struct GateOnReply(TcpStream, Gate);

impl Write for GateOnReply {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.1.replied();
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// The source's reply channel: runs `hook` once, on the first read after the `Ready` reply
/// (`ready_len` bytes), i.e. when the source waits for round 0's `RoundAck`, every byte of
/// round 0 handed to the kernel.
struct HookedAck {
    inner: TcpStream,
    seen: usize,
    ready_len: usize,
    hook: Option<Box<dyn FnOnce()>>,
}

impl Read for HookedAck {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.seen >= self.ready_len {
            if let Some(h) = self.hook.take() {
                h();
            }
        }
        let n = self.inner.read(buf)?;
        self.seen += n;
        Ok(n)
    }
}

fn ready_len() -> usize {
    let mut w = StreamWriter::new(Vec::new());
    w.write_frame(&Frame::Ready).unwrap();
    w.flush().unwrap();
    w.into_inner().len()
}

fn spawn(name: String, body: Box<dyn FnOnce() + Send>) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(body)
}

/// Eight pages of data in region 0; page 3 is rewritten while round 0 sits unread in the
/// socket. Over a socket, the kernel sends guest memory by reference, so the destination
/// reads the new bytes under the old CRC: a torn page, sent again in the next round.
#[test]
fn spliced_pages_changed_in_flight_are_sent_again() {
    let mem = ram();
    let mut rng = Lcg(5);
    for p in 0..8 {
        fill_page(&mem, p * 4096, &mut rng);
    }
    let cfg = config_of(&mem);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dst = ram();
    let gate = Gate::default();
    let receiver = {
        let (dst, cfg, gate) = (dst.clone(), cfg.clone(), gate.clone());
        std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let input = GatedReader(conn.try_clone().unwrap(), gate.clone());
            let got = receive(&dst, input, GateOnReply(conn, gate), &cfg)?;
            let mut ack = got.ack;
            ack.ack()?;
            Ok::<_, Error>(got.report)
        })
    };
    let control = TcpStream::connect(addr).unwrap();
    control
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let dirty = Rc::new(RefCell::new(Vec::new()));
    let hook = {
        let (mem, dirty, gate) = (mem.clone(), dirty.clone(), gate.clone());
        Box::new(move || {
            mem.write_slice(&[0xa5; 64], GuestAddress(3 * 4096 + 100))
                .unwrap();
            dirty.borrow_mut().push(3);
            gate.open();
        })
    };
    let ack_in = HookedAck {
        inner: control.try_clone().unwrap(),
        seen: 0,
        ready_len: ready_len(),
        hook: Some(hook),
    };
    let params = MigrationParams {
        compression: Compression::None,
        ..Default::default()
    };
    let rep = migrate_threaded(
        &mem,
        &cfg,
        &mut Marked(dirty),
        &mut Vm,
        control,
        Vec::new(),
        ack_in,
        &params,
        None,
        |_| {},
        &spawn,
    )
    .unwrap();
    let got = receiver.join().unwrap().unwrap();
    assert!(
        rep.stages.zero_copy_bytes >= 8 * 4096,
        "the pages went through the pipe: {:?}",
        rep.stages
    );
    assert_eq!(got.torn_pages_recovered, 1, "{got:?}");
    assert_eq!(rep.rounds.len(), 2, "{:?}", rep.rounds);
    assert_eq!(rep.rounds[1].pages_sent, 1);
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
}

/// The same migration into a writer that is not a socket (an in-memory stream): every byte
/// goes through `writev`, and the destination gets every page.
#[test]
fn a_writer_that_is_no_socket_gets_writev() {
    let mem = ram();
    let mut rng = Lcg(6);
    for p in 0..64 {
        fill_page(&mem, p * 4096, &mut rng);
    }
    let cfg = config_of(&mem);
    let (src_end, dst_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let dst = ram();
    let receiver = {
        let (dst, cfg) = (dst.clone(), cfg.clone());
        std::thread::spawn(move || {
            let input = dst_end.try_clone().unwrap();
            let got = receive(&dst, io::BufReader::new(input), dst_end, &cfg)?;
            let mut ack = got.ack;
            ack.ack()?;
            Ok::<_, Error>(got.report)
        })
    };
    let ack_in = src_end.try_clone().unwrap();
    ack_in
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // A socket behind a type the engine does not know: the plain path.
    struct Opaque(std::os::unix::net::UnixStream);
    impl Write for Opaque {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.write(buf)
        }
        fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
            self.0.write_vectored(bufs)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let rep = migrate_threaded(
        &mem,
        &cfg,
        &mut Marked(Rc::default()),
        &mut Vm,
        Opaque(src_end),
        Vec::new(),
        ack_in,
        &MigrationParams::default(),
        None,
        |_| {},
        &spawn,
    )
    .unwrap();
    receiver.join().unwrap().unwrap();
    assert_eq!(rep.stages.zero_copy_bytes, 0);
    assert!(rep.pages_total >= 64);
    assert_eq!(diff(&mem, &dst), Vec::<u64>::new());
}
