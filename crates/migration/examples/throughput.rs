//! Page-sending throughput on this machine:
//!
//! ```text
//! cargo run --release -p migration --example throughput [MiB] [--zero-every N]
//! ```
//!
//! Fills `MiB` of guest RAM (default 1024) with non-zero data, then measures
//! 1. the sender alone into `io::sink()` (inspect + CRC + writev bookkeeping),
//! 2. a snapshot through a pipe into a receiving thread that writes another RAM,
//! 3. a full live migration (no dirtying) over TCP loopback, with its downtime.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use migration::*;
use vm_memory::{GuestAddress, GuestMemoryMmap};

fn ram(size: usize) -> GuestMemoryMmap<()> {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), size)]).unwrap();
    for r in mem.regions() {
        // SAFETY: a mapping `mem` owns; advice only (as the VMM does).
        let rc = unsafe { libc::madvise(r.host_ptr.cast(), r.size as usize, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            eprintln!("MADV_HUGEPAGE: {}", io::Error::last_os_error());
        }
    }
    mem
}

fn fill(mem: &GuestMemoryMmap<()>, zero_every: u64) {
    for r in mem.regions() {
        let pages = r.size / 4096;
        for p in 0..pages {
            let zero = zero_every != 0 && p % zero_every == 0;
            let ptr = r.host_ptr.wrapping_add((p * 4096) as usize).cast::<u64>();
            for i in 0..512u64 {
                let v = if zero {
                    0
                } else {
                    (p * 512 + i).wrapping_mul(0x9e3779b97f4a7c15) | 1
                };
                // SAFETY: inside the mapping; nothing else uses it yet.
                unsafe { ptr.add(i as usize).write(v) };
            }
        }
    }
}

fn config(mem: &GuestMemoryMmap<()>) -> MigrationConfig {
    let ram_regions: Vec<RamRange> = mem
        .regions()
        .iter()
        .map(|r| RamRange {
            guest_addr: r.guest_addr,
            size: r.size,
        })
        .collect();
    MigrationConfig {
        memory_size: ram_regions.iter().map(|r| r.size).sum(),
        vcpus: 1,
        irqchip: "kernel".into(),
        ram_regions,
        extra: Default::default(),
        devices: None,
    }
}

struct NoDirty(u64);
impl DirtySource for NoDirty {
    fn start_tracking(&mut self) -> Result<()> {
        Ok(())
    }
    fn take_dirty(&mut self) -> Result<Bitmap> {
        Ok(Bitmap::new(&[self.0]))
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
        Ok(vec![0; 64 << 10])
    }
    fn throttle(&mut self, _: u8) {}
}

fn mibs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / 1048576.0 / d.as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let zero_every: u64 = args
        .iter()
        .position(|a| a == "--zero-every")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let size = mib << 20;
    let src = ram(size);
    let t = Instant::now();
    fill(&src, zero_every);
    println!("filled {mib} MiB in {:?}", t.elapsed());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    if let Some(l) = meminfo.lines().find(|l| l.starts_with("AnonHugePages")) {
        println!("{l}");
    }
    let cfg = config(&src);

    // 1. Sender alone.
    let t = Instant::now();
    let rep = snapshot(&src, &cfg, b"s", io::sink()).unwrap();
    let d = t.elapsed();
    println!(
        "sender -> io::sink:          {:>8.0} MiB/s  ({} pages, {} zero, {:?}, residency {:?})",
        mibs(size as u64, d),
        rep.round.pages_sent,
        rep.round.zero_pages,
        d,
        rep.residency_method
    );

    // 2. Receiver alone, from memory. A fresh destination pays the first touch of every page
    //    (on this nested host that is most of the cost); a reused one pays zeroing it first.
    let mut stream = Vec::with_capacity(size + (size >> 8) + (1 << 20));
    snapshot(&src, &cfg, b"s", &mut stream).unwrap();
    let dst = ram(size);
    for pass in ["fresh", "touched"] {
        let t = Instant::now();
        restore_from(&dst, &stream[..], &cfg).unwrap();
        let d = t.elapsed();
        println!(
            "memory -> restore ({pass:>7}):     {:>8.0} MiB/s",
            mibs(size as u64, d)
        );
    }
    drop(stream);
    drop(dst);

    // 3. Snapshot through a pipe (1 MiB pipe buffer) into a receiving thread.
    let dst = ram(size);
    for pass in ["fresh", "touched"] {
        let (rx, tx) = io::pipe().unwrap();
        // SAFETY: fcntl on a pipe this function owns; only resizes its buffer.
        unsafe { libc::fcntl(tx.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        let t = Instant::now();
        let receiver = {
            let (dst, cfg) = (dst.clone(), cfg.clone());
            std::thread::spawn(move || restore_from(&dst, rx, &cfg).unwrap())
        };
        snapshot(&src, &cfg, b"s", tx).unwrap();
        receiver.join().unwrap();
        let d = t.elapsed();
        println!(
            "snapshot -> pipe -> restore ({pass:>7}): {:>8.0} MiB/s ({d:?})",
            mibs(size as u64, d)
        );
    }
    drop(dst);

    // Baseline: plain 4 MiB write()/read() over TCP loopback between pre-touched buffers.
    {
        use std::io::{Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let total = size;
        let reader = std::thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            let mut buf = vec![1u8; 4 << 20];
            let mut got = 0;
            while got < total {
                let n = sock.read(&mut buf).unwrap();
                assert!(n > 0);
                got += n;
            }
        });
        let mut sock = TcpStream::connect(addr).unwrap();
        let buf = vec![1u8; 4 << 20];
        let t = Instant::now();
        for _ in 0..total / buf.len() {
            sock.write_all(&buf).unwrap();
        }
        reader.join().unwrap();
        let d = t.elapsed();
        println!(
            "baseline: raw TCP loopback copy:          {:>8.0} MiB/s",
            mibs(size as u64, d)
        );
    }

    // 4. Live migration over TCP loopback.
    let dst = ram(size);
    for pass in ["fresh", "touched"] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = {
            let (dst, cfg) = (dst.clone(), cfg.clone());
            std::thread::spawn(move || {
                let (sock, _) = listener.accept().unwrap();
                let mut got = receive(&dst, sock.try_clone().unwrap(), sock, &cfg).unwrap();
                got.ack.ack().unwrap();
                got.report
            })
        };
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_nodelay(true).unwrap();
        let ack = sock.try_clone().unwrap();
        ack.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let t = Instant::now();
        let rep = migrate(
            &src,
            &cfg,
            &mut NoDirty((size / 4096) as u64),
            &mut Vm,
            &sock,
            ack,
            &MigrationParams::default(),
            |_| {},
        )
        .unwrap();
        let d = t.elapsed();
        receiver.join().unwrap();
        println!(
            "migrate over TCP loopback ({pass:>7}):   {:>8.0} MiB/s (total {:.0} ms, round 0 {:.0} ms, downtime {:.2} ms)",
            mibs(size as u64, d),
            d.as_secs_f64() * 1e3,
            rep.rounds[0].duration.as_secs_f64() * 1e3,
            rep.downtime.as_secs_f64() * 1e3,
        );
    }
}
