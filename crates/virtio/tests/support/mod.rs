//! Harnesses for the guest-controlled input of the virtio devices, shared by the property
//! tests (`tests/chain_props.rs`, `tests/pci_props.rs`) and the fuzz targets (`fuzz/`, which
//! includes this directory):
//!
//! - [`chains`]: hostile descriptor tables and available rings published to a running
//!   virtio-blk, -rng or -console device; checks what the device writes back;
//! - [`pci_access`]: sequences of configuration-space and BAR accesses on the PCI transport
//!   of a real virtio-blk device; checks the transport's invariants after each;
//! - [`qcow2_image`]: a qcow2 file of arbitrary bytes opened, read and written as a disk.
//!
//! This file holds what both use: the guest RAM layout, RAM snapshots, a recording
//! [`Interrupt`], temporary disk images and the byte reader that decodes fuzz input.

#![allow(dead_code)]

pub mod chain_input;
pub mod chains;
pub mod pci_access;
pub mod pci_input;
pub mod qcow2_image;

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use virtio::block::{Block, BlockOptions};
use virtio::Interrupt;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory of the harnesses.
pub type Mem = GuestMemoryMmap<()>;

/// RAM region A: rings, indirect tables, data.
pub const RAM_A: (u64, u64) = (0, 0x4_0000);
/// RAM region B, after a hole: a buffer may start in A and run into the hole.
pub const RAM_B: (u64, u64) = (0x5_0000, 0x1_0000);
/// Where the harnesses' own buffers (request headers, data) live in region A.
pub const DATA_START: u64 = 0x1_0000;
/// How long a device may take to answer before the harness calls it a hang (the fuzzer's own
/// timeout is shorter and fires first).
pub const HANG_DEADLINE: Duration = Duration::from_secs(5);
/// Sectors of the harnesses' disk images (64 KiB).
pub const IMAGE_SECTORS: u64 = 128;
/// GET_ID's answer.
pub const SERIAL: &str = "ferrovm-fuzz";

/// Two RAM regions with a hole between them, filled with a pattern a device is unlikely to
/// write (so that the RAM comparison sees its writes).
pub fn ram() -> Arc<Mem> {
    let regions = [
        (GuestAddress(RAM_A.0), RAM_A.1 as usize),
        (GuestAddress(RAM_B.0), RAM_B.1 as usize),
    ];
    let mem = GuestMemoryMmap::from_ranges(&regions).expect("mapping the harness's guest RAM");
    static FILL: OnceLock<[Vec<u8>; 2]> = OnceLock::new();
    let fill = FILL.get_or_init(|| {
        [RAM_A, RAM_B].map(|(base, len)| (base..base + len).map(pattern_byte).collect())
    });
    for ((base, _), bytes) in [RAM_A, RAM_B].iter().zip(fill) {
        mem.write_slice(bytes, GuestAddress(*base))
            .expect("RAM region");
    }
    Arc::new(mem)
}

/// The fill of RAM byte `addr`: never 0 and never the console's input byte.
pub fn pattern_byte(addr: u64) -> u8 {
    ((addr.wrapping_mul(0x9e37_79b9) >> 13) as u8) | 0x80
}

/// Whether `[addr, addr + len)` lies in RAM (one region).
pub fn in_ram(addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    [RAM_A, RAM_B]
        .iter()
        .any(|&(base, size)| addr >= base && end <= base + size)
}

/// A copy of guest RAM.
#[derive(Clone)]
pub struct Snapshot(Vec<(u64, Vec<u8>)>);

impl Snapshot {
    pub fn take(mem: &Mem) -> Snapshot {
        let regions = [RAM_A, RAM_B].map(|(base, len)| {
            let mut bytes = vec![0; len as usize];
            mem.read_slice(&mut bytes, GuestAddress(base))
                .expect("RAM region");
            (base, bytes)
        });
        Snapshot(regions.to_vec())
    }

    /// `len` bytes at `addr`, if they lie in one region.
    pub fn bytes(&self, addr: u64, len: usize) -> Option<&[u8]> {
        self.0.iter().find_map(|(base, bytes)| {
            let start = usize::try_from(addr.checked_sub(*base)?).ok()?;
            bytes.get(start..start.checked_add(len)?)
        })
    }

    /// Overwrites the copy of `bytes.len()` bytes at `addr` (which must be in RAM).
    pub fn patch(&mut self, addr: u64, bytes: &[u8]) {
        for (base, copy) in &mut self.0 {
            if let Some(start) = addr.checked_sub(*base).map(|s| s as usize) {
                if let Some(dst) = copy.get_mut(start..start + bytes.len()) {
                    dst.copy_from_slice(bytes);
                    return;
                }
            }
        }
        panic!("patch of {addr:#x} outside RAM");
    }

    pub fn u16_at(&self, addr: u64) -> Option<u16> {
        let b = self.bytes(addr, 2)?;
        Some(u16::from_le_bytes([b[0], b[1]]))
    }

    /// The addresses whose bytes differ in `later`, as ranges [start, end).
    pub fn changes(&self, later: &Snapshot) -> Vec<(u64, u64)> {
        const CHUNK: usize = 256;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for ((base, old), (_, new)) in self.0.iter().zip(&later.0) {
            let chunks = old.chunks(CHUNK).zip(new.chunks(CHUNK)).enumerate();
            // Whole chunks compare as slices (memcmp); only differing ones byte by byte.
            for (c, (old, new)) in chunks.filter(|(_, (a, b))| a != b) {
                for (i, _) in old.iter().zip(new).enumerate().filter(|(_, (a, b))| a != b) {
                    let addr = base + (c * CHUNK + i) as u64;
                    match out.last_mut() {
                        Some(last) if last.1 == addr => last.1 += 1,
                        _ => out.push((addr, addr + 1)),
                    }
                }
            }
        }
        out
    }
}

/// Asserts that every byte that changed between `before` and `after` lies in one of
/// `allowed` (each `(start, len)`; wrapping ranges allow nothing).
pub fn assert_writes_within(
    before: &Snapshot,
    after: &Snapshot,
    allowed: &[(u64, u64)],
    what: &str,
) {
    for (start, end) in before.changes(after) {
        for addr in start..end {
            let inside = allowed
                .iter()
                .any(|&(a, len)| a.checked_add(len).is_some_and(|e| addr >= a && addr < e));
            assert!(
                inside,
                "{what}: guest RAM at {addr:#x} changed outside the chains' device-writable \
                 buffers and the used ring (changed {start:#x}..{end:#x}; allowed {allowed:x?})"
            );
        }
    }
}

/// An [`Interrupt`] that records what a device raised.
#[derive(Default)]
pub struct Signals {
    pub queue: AtomicU64,
    pub config: AtomicU64,
    /// [`Interrupt::needs_reset`] was called.
    pub broken: AtomicBool,
}

impl Interrupt for Signals {
    fn signal_queue(&self, _queue: u16) {
        self.queue.fetch_add(1, Ordering::SeqCst);
    }
    fn signal_config(&self) {
        self.config.fetch_add(1, Ordering::SeqCst);
    }
    fn needs_reset(&self) {
        self.broken.store(true, Ordering::SeqCst);
    }
}

/// Panics on device threads so far (their panics do not reach the harness).
static DEVICE_PANICS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// [`DEVICE_PANICS`] when this thread's run began.
    static PANICS_BEFORE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Starts a harness run on this thread: from now on a panic on a device thread ("virtio-...")
/// fails [`wait_until`]. The panic hook already installed (the fuzzer's, which aborts) still
/// runs.
pub fn watch_device_threads() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.starts_with("virtio") {
                DEVICE_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
    PANICS_BEFORE.with(|before| before.set(DEVICE_PANICS.load(Ordering::SeqCst)));
}

/// Waits until `done` holds, spinning briefly then sleeping; panics after [`HANG_DEADLINE`],
/// or at once if a device thread panicked since [`watch_device_threads`].
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    let before = PANICS_BEFORE.with(|before| before.get());
    while !done() {
        assert!(
            DEVICE_PANICS.load(Ordering::SeqCst) == before,
            "{what}: a device thread panicked (see above)"
        );
        let waited = start.elapsed();
        assert!(
            waited < HANG_DEADLINE,
            "{what}: no answer within {waited:?} (a hang)"
        );
        if waited < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Where temporary images go: tmpfs when there is one.
fn image_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// The byte at `offset` of a fresh harness image (every sector different).
pub fn image_byte(offset: u64) -> u8 {
    ((offset / 512) as u8).wrapping_mul(37) ^ (offset as u8).wrapping_mul(11) ^ 0x5c
}

/// A writable, single-queue virtio-blk device on a fresh [`IMAGE_SECTORS`]-sector image
/// (tmpfs when available). The file is unlinked once open: nothing is left behind.
pub fn block_device() -> Block {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = image_dir().join(format!("ferrovm-vfuzz-{}-{n}.img", std::process::id()));
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes = BYTES.get_or_init(|| (0..IMAGE_SECTORS * 512).map(image_byte).collect());
    File::create(&path)
        .and_then(|mut f| f.write_all(bytes))
        .expect("creating the harness's disk image");
    let mut options = BlockOptions::new(&path);
    options.serial = Some(SERIAL.into());
    let device = Block::new(options);
    let _ = std::fs::remove_file(&path);
    device.expect("opening the harness's disk image")
}

/// Reads fuzz input front to back; past its end every read gives zeros.
pub struct ByteReader<'a> {
    rest: &'a [u8],
}

impl<'a> ByteReader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        ByteReader { rest: data }
    }

    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let take = n.min(self.rest.len());
        let (head, rest) = self.rest.split_at(take);
        self.rest = rest;
        let mut out = head.to_vec();
        out.resize(n, 0);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.bytes(1)[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes(2).try_into().unwrap())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes(4).try_into().unwrap())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes(8).try_into().unwrap())
    }
}
