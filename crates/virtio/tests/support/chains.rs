//! Hostile descriptor chains: a [`Scenario`] (a descriptor table, indirect tables, bytes in
//! guest RAM and batches of available-ring entries) is published to a running virtio-blk,
//! -rng or -console device, one batch and one notification at a time. [`run`] checks that
//!
//! - the device answers every chain it can or halts the queue with DEVICE_NEEDS_RESET (a head
//!   beyond the queue, an available index more than a queue ahead), within a deadline;
//! - every used entry names the head the driver made available at that place, with a length
//!   no larger than the device-writable bytes of that chain;
//! - guest RAM changes only inside the served chains' device-writable buffers and the used
//!   ring (RAM is compared with a copy taken before each notification);
//! - after a device reset, a good request is served correctly.
//!
//! The expected chains come from [`walk`], a model of the split virtqueue written from the
//! specification. A chain whose device-writable buffers overlap a descriptor table or a ring
//! makes the device rewrite its own input; from such a batch on, only the absence of panics
//! and hangs and the request after the reset are checked.

use std::io::{self, Write};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::exit::Waker;
use virtio::console::Console;
use virtio::rng::Rng;
use virtio::{ActiveQueue, VirtioDevice};
use virtio_bindings::bindings::virtio_blk::{
    VIRTIO_BLK_S_OK, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::*;

pub const NEXT: u16 = VRING_DESC_F_NEXT as u16;
pub const WRITE: u16 = VRING_DESC_F_WRITE as u16;
pub const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

/// Every device here has queues of 256 entries at most.
pub const MAX_QUEUE_SIZE: u16 = 256;
/// Queue `q`'s rings: descriptor table, available ring, used ring, a page each.
pub const RING_STRIDE: u64 = 0x3000;
/// The end of both queues' rings.
pub const RINGS_END: u64 = 2 * RING_STRIDE;
/// Indirect table `i` of a scenario lives at `INDIRECT_BASE + i * INDIRECT_STRIDE`.
pub const INDIRECT_BASE: u64 = 0x8000;
pub const INDIRECT_STRIDE: u64 = 0x2000;
pub const MAX_INDIRECT_TABLES: usize = 4;
/// Entries of an indirect table a scenario writes (a descriptor may claim any length).
pub const MAX_INDIRECT_ENTRIES: usize = 255;
/// What the console's input source gives, endlessly.
pub const CONSOLE_INPUT: u8 = 0x5a;
/// The largest chain virtio-rng fills.
const RNG_MAX_BYTES: u32 = 64 << 10;

/// The device and queue a scenario is published to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Block,
    Rng,
    /// virtio-console's receive queue, with an input source that never runs dry.
    ConsoleReceive,
    ConsoleTransmit,
}

impl Target {
    pub const ALL: [Target; 4] = [
        Target::Block,
        Target::Rng,
        Target::ConsoleReceive,
        Target::ConsoleTransmit,
    ];

    /// The index of the queue the scenario goes to.
    pub fn queue(self) -> u16 {
        u16::from(self == Target::ConsoleTransmit)
    }

    fn queue_count(self) -> u16 {
        match self {
            Target::ConsoleReceive | Target::ConsoleTransmit => 2,
            Target::Block | Target::Rng => 1,
        }
    }
}

/// A split-queue descriptor as the driver writes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

impl Desc {
    fn to_bytes(self) -> [u8; 16] {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&self.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&self.len.to_le_bytes());
        raw[12..14].copy_from_slice(&self.flags.to_le_bytes());
        raw[14..].copy_from_slice(&self.next.to_le_bytes());
        raw
    }

    fn from_bytes(raw: &[u8]) -> Desc {
        Desc {
            addr: u64::from_le_bytes(raw[..8].try_into().unwrap()),
            len: u32::from_le_bytes(raw[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes(raw[12..14].try_into().unwrap()),
            next: u16::from_le_bytes(raw[14..].try_into().unwrap()),
        }
    }
}

/// Entries the driver adds to the available ring before one notification.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub heads: Vec<u16>,
    /// An available index published instead of the honest one.
    pub avail_idx: Option<u16>,
    /// The available ring's used_event (VIRTIO_F_EVENT_IDX).
    pub used_event: u16,
}

/// What the driver writes and publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    pub target: Target,
    pub event_idx: bool,
    /// A power of two, 1 to [`MAX_QUEUE_SIZE`].
    pub queue_size: u16,
    /// The descriptor table from index 0 (the rest of the table is zero).
    pub table: Vec<Desc>,
    /// Indirect table `i` is written at [`indirect_table`]`(i)`.
    pub indirect: Vec<Vec<Desc>>,
    /// Bytes written to guest RAM (request headers, segments, data), in order; those that
    /// would overlap the rings are left out.
    pub fills: Vec<(u64, Vec<u8>)>,
    pub batches: Vec<Batch>,
}

/// Where indirect table `i` of a scenario lives.
pub fn indirect_table(i: usize) -> u64 {
    INDIRECT_BASE + i as u64 * INDIRECT_STRIDE
}

/// Queue `q`'s (descriptor table, available ring, used ring).
pub fn rings(q: u16) -> (u64, u64, u64) {
    let base = u64::from(q) * RING_STRIDE;
    (base, base + 0x1000, base + 0x2000)
}

fn used_ring_len(size: u16) -> u64 {
    6 + 8 * u64::from(size)
}

/// A chain as a device must see it.
#[derive(Clone, Debug, Default)]
pub struct Walk {
    /// The buffer descriptors in order (indirect ones replaced by their tables' entries).
    pub descs: Vec<Desc>,
    /// (address, length) of the indirect tables the chain went through.
    pub tables: Vec<(u64, u64)>,
}

impl Walk {
    /// (address, length) of the device-writable buffers.
    pub fn writable(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.descs
            .iter()
            .filter(|d| d.flags & WRITE != 0)
            .map(|d| (d.addr, u64::from(d.len)))
    }

    pub fn writable_bytes(&self) -> u64 {
        self.writable().map(|(_, len)| len).sum()
    }
}

/// The chain at `head` of a queue of `size` entries whose table is at `table` (virtio 1.2,
/// 2.7.5 and 2.7.5.3.1), with the bounds a device must apply to a hostile one: at most a
/// table's worth of descriptors per table (so a loop ends), one level of indirection, an
/// indirect table a whole number of descriptors long, at most 2^32 bytes in all. A
/// descriptor outside RAM or an index beyond the table ends the chain.
pub fn walk(snap: &Snapshot, table: u64, size: u16, head: u16) -> Walk {
    let mut out = Walk::default();
    let (mut table, mut entries, mut ttl, mut index) = (table, size, size, head);
    let (mut indirect, mut total) = (false, 0u32);
    while ttl > 0 && index < entries {
        let Some(raw) = table
            .checked_add(16 * u64::from(index))
            .and_then(|at| snap.bytes(at, 16))
        else {
            break;
        };
        let desc = Desc::from_bytes(raw);
        if desc.flags & INDIRECT != 0 {
            let count = desc.len / 16;
            if indirect || !desc.len.is_multiple_of(16) || count > u32::from(u16::MAX) {
                break;
            }
            out.tables.push((desc.addr, u64::from(desc.len)));
            (table, entries, ttl, index, indirect) =
                (desc.addr, count as u16, count as u16, 0, true);
            continue;
        }
        let Some(sum) = total.checked_add(desc.len) else {
            break;
        };
        total = sum;
        out.descs.push(desc);
        if desc.flags & NEXT == 0 {
            break;
        }
        (index, ttl) = (desc.next, ttl - 1);
    }
    out
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte (a range past the end of the
/// address space ends there).
fn overlap((a, a_len): (u64, u64), (b, b_len): (u64, u64)) -> bool {
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// Collects the bytes written to a console's output: their count and the last few.
#[derive(Clone, Default)]
pub struct Recorder(Arc<Mutex<(u64, Vec<u8>)>>);

impl Recorder {
    pub fn total(&self) -> u64 {
        self.0.lock().unwrap().0
    }

    pub fn tail(&self) -> Vec<u8> {
        self.0.lock().unwrap().1.clone()
    }
}

impl Write for Recorder {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut state = self.0.lock().unwrap();
        state.0 += buf.len() as u64;
        let keep = &buf[buf.len().saturating_sub(64)..];
        state.1.extend_from_slice(keep);
        let excess = state.1.len().saturating_sub(64);
        state.1.drain(..excess);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The device under test and what the harness observes of it.
struct Rig {
    target: Target,
    size: u16,
    mem: Arc<Mem>,
    device: Box<dyn VirtioDevice<Mem>>,
    signals: Arc<Signals>,
    notifiers: Vec<Arc<Waker>>,
    output: Recorder,
    features: u64,
}

impl Rig {
    fn new(target: Target, size: u16, event_idx: bool) -> Rig {
        let output = Recorder::default();
        let device: Box<dyn VirtioDevice<Mem>> = match target {
            Target::Block => Box::new(block_device()),
            Target::Rng => Box::new(Rng::new()),
            Target::ConsoleReceive | Target::ConsoleTransmit => Box::new(
                Console::with_io(
                    Box::new(output.clone()),
                    Some(Box::new(io::repeat(CONSOLE_INPUT))),
                )
                .expect("creating a console"),
            ),
        };
        let mut features = device.features();
        if !event_idx {
            features &= !(1 << VIRTIO_RING_F_EVENT_IDX);
        }
        let notifiers = (0..target.queue_count())
            .map(|_| Arc::new(Waker::new().expect("a queue notifier")))
            .collect();
        Rig {
            target,
            size,
            mem: ram(),
            device,
            signals: Arc::new(Signals::default()),
            notifiers,
            output,
            features,
        }
    }

    /// Zeroes every ring and activates the device on them, from index 0.
    fn activate(&mut self) {
        let mut queues = Vec::new();
        for (q, notify) in self.notifiers.iter().enumerate() {
            let (desc, avail, used) = rings(q as u16);
            for ring in [desc, avail, used] {
                self.write(ring, &[0; 0x1000]);
            }
            let mut queue = Queue::new(MAX_QUEUE_SIZE).expect("a queue");
            queue.set_size(self.size);
            queue
                .try_set_desc_table_address(GuestAddress(desc))
                .unwrap();
            queue
                .try_set_avail_ring_address(GuestAddress(avail))
                .unwrap();
            queue.try_set_used_ring_address(GuestAddress(used)).unwrap();
            queue.set_ready(true);
            let index = q as u16;
            queues.push(ActiveQueue {
                index,
                queue,
                notify: notify.clone(),
            });
        }
        self.signals = Arc::new(Signals::default());
        let interrupt = self.signals.clone();
        self.device
            .activate(self.mem.clone(), self.features, queues, interrupt)
            .expect("the device starts on valid rings");
    }

    fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem
            .write_slice(bytes, GuestAddress(addr))
            .expect("harness write in RAM");
    }

    fn read_u16(&self, addr: u64) -> u16 {
        u16::from_le(
            self.mem
                .read_obj(GuestAddress(addr))
                .expect("harness read in RAM"),
        )
    }

    fn kick(&self) {
        self.notifiers[usize::from(self.target.queue())]
            .wake()
            .expect("kick");
    }

    fn ring(&self) -> SplitRing {
        SplitRing::at(self.target.queue(), self.size)
    }

    fn used_idx(&self) -> u16 {
        self.ring().used_idx(&self.mem)
    }

    fn used_entry(&self, n: u16) -> (u32, u32) {
        self.ring().used_entry(&self.mem, n)
    }

    fn broken(&self) -> bool {
        self.signals.broken.load(Ordering::SeqCst)
    }
}

/// Where the device is in the queue, as the harness follows it.
#[derive(Default)]
struct Progress {
    /// The available index the driver last published.
    avail_idx: u16,
    /// Chains the device took and answered.
    next_avail: u16,
    next_used: u16,
    halted: bool,
    /// The device may be rewriting its own rings: only liveness is checked.
    weak: bool,
    /// Chains whose answers were checked.
    checked: usize,
}

/// What the device must do with a batch.
struct Expected {
    chains: Vec<(u16, Walk)>,
    halts: bool,
}

impl Expected {
    /// Whether a chain's device-writable buffer overlaps a ring or an indirect table.
    fn rewrites_its_input(&self) -> bool {
        let tables = self
            .chains
            .iter()
            .flat_map(|(_, w)| w.tables.iter().copied());
        let metadata: Vec<(u64, u64)> = std::iter::once((0, RINGS_END)).chain(tables).collect();
        self.chains
            .iter()
            .flat_map(|(_, w)| w.writable())
            .any(|buffer| metadata.iter().any(|&m| overlap(buffer, m)))
    }
}

/// What the available ring in `snap` asks of a device at `progress`.
fn expected(snap: &Snapshot, rig: &Rig, progress: &Progress) -> Expected {
    let mut out = Expected {
        chains: Vec::new(),
        halts: false,
    };
    if progress.halted {
        return out;
    }
    let (table, avail, _) = rings(rig.target.queue());
    let idx = snap.u16_at(avail + 2).expect("ring in RAM");
    let pending = idx.wrapping_sub(progress.next_avail);
    if pending > rig.size {
        out.halts = true;
        return out;
    }
    for k in 0..pending {
        let slot = progress.next_avail.wrapping_add(k) % rig.size;
        let head = snap
            .u16_at(avail + 4 + 2 * u64::from(slot))
            .expect("ring in RAM");
        if head >= rig.size {
            out.halts = true;
            break;
        }
        out.chains.push((head, walk(snap, table, rig.size, head)));
    }
    out
}

/// Writes a batch into the available ring (the driver's side) and returns a copy of RAM as
/// the device finds it when it sees the new index: taken before the index is written, so that
/// a device that finished the previous batch and polls the ring cannot get ahead of it.
fn publish(rig: &Rig, progress: &mut Progress, batch: &Batch) -> Snapshot {
    let (_, avail, _) = rings(rig.target.queue());
    for (k, &head) in batch.heads.iter().enumerate() {
        let slot = progress.avail_idx.wrapping_add(k as u16) % rig.size;
        rig.write(avail + 4 + 2 * u64::from(slot), &head.to_le_bytes());
    }
    let used_event = avail + 4 + 2 * u64::from(rig.size);
    rig.write(used_event, &batch.used_event.to_le_bytes());
    let honest = progress.avail_idx.wrapping_add(batch.heads.len() as u16);
    progress.avail_idx = batch.avail_idx.unwrap_or(honest);
    let mut before = Snapshot::take(&rig.mem);
    let idx = progress.avail_idx.to_le_bytes();
    before.patch(avail + 2, &idx);
    rig.write(avail + 2, &idx);
    before
}

/// Publishes a batch, notifies, and checks what the device did.
fn run_batch(rig: &Rig, progress: &mut Progress, batch: &Batch) {
    let before = publish(rig, progress, batch);
    let expect = expected(&before, rig, progress);
    progress.weak |= expect.rewrites_its_input();
    rig.kick();
    if progress.weak {
        settle(rig);
        return;
    }
    let n = expect.chains.len() as u16;
    let answered = || rig.used_idx().wrapping_sub(progress.next_used);
    wait_until("the device answering its chains", || {
        answered() >= n && (!expect.halts || rig.broken())
    });
    assert_eq!(
        answered(),
        n,
        "chains answered (those behind a halt included?)"
    );
    check_answers(rig, progress, &expect, &before);
    let target = progress.next_used.wrapping_add(n);
    progress.next_used = target;
    progress.next_avail = progress.next_avail.wrapping_add(n);
    progress.halted |= expect.halts;
    progress.checked += usize::from(n);
}

/// The used entries and RAM after a batch the device answered.
fn check_answers(rig: &Rig, progress: &Progress, expect: &Expected, before: &Snapshot) {
    let after = Snapshot::take(&rig.mem);
    let mut allowed = used_rings(rig);
    for (k, (head, chain)) in expect.chains.iter().enumerate() {
        let (id, len) = rig.used_entry(progress.next_used.wrapping_add(k as u16));
        assert_eq!(id, u32::from(*head), "used entry {k} names another head");
        let writable = chain.writable_bytes();
        assert!(
            u64::from(len) <= writable,
            "chain {head}: used length {len} beyond its {writable} writable bytes: {chain:x?}"
        );
        if rig.target == Target::Rng {
            assert!(len <= RNG_MAX_BYTES, "virtio-rng filled {len} bytes");
        }
        allowed.extend(chain.writable());
    }
    let broken = progress.halted || expect.halts; // sticky until the reset
    assert_eq!(
        rig.broken(),
        broken,
        "DEVICE_NEEDS_RESET disagrees with the rings"
    );
    assert_writes_within(before, &after, &allowed, "after a notification");
}

/// The used rings of every queue of the device (a device that serves several queues on one
/// thread sets the flags of each, published or not).
fn used_rings(rig: &Rig) -> Vec<(u64, u64)> {
    let queues = 0..rig.target.queue_count();
    queues
        .map(|q| (rings(q).2, used_ring_len(rig.size)))
        .collect()
}

/// Gives a device that may be rewriting its own rings a moment; it is stopped by the reset.
fn settle(rig: &Rig) {
    let start = Instant::now();
    let mut last = rig.used_idx();
    let mut quiet_since = Instant::now();
    while start.elapsed() < Duration::from_millis(20) {
        std::thread::sleep(Duration::from_micros(200));
        let now = rig.used_idx();
        if now != last {
            (last, quiet_since) = (now, Instant::now());
        } else if quiet_since.elapsed() > Duration::from_millis(2) {
            break;
        }
    }
}

/// Writes the scenario's tables and bytes into RAM (after the rings were zeroed).
fn write_scenario(rig: &Rig, s: &Scenario) {
    let (table, _, _) = rings(rig.target.queue());
    for (i, desc) in s.table.iter().take(usize::from(rig.size)).enumerate() {
        rig.write(table + 16 * i as u64, &desc.to_bytes());
    }
    for (t, entries) in s.indirect.iter().take(MAX_INDIRECT_TABLES).enumerate() {
        for (i, desc) in entries.iter().take(MAX_INDIRECT_ENTRIES).enumerate() {
            rig.write(indirect_table(t) + 16 * i as u64, &desc.to_bytes());
        }
    }
    // The rings are the table's and the batches' business (the used ring is the device's).
    let outside_rings =
        |(addr, bytes): &&(u64, Vec<u8>)| !overlap((*addr, bytes.len() as u64), (0, RINGS_END));
    for (addr, bytes) in s.fills.iter().filter(outside_rings) {
        let _ = rig.mem.write_slice(bytes, GuestAddress(*addr));
    }
}

/// Checks that the size is one a driver may set up.
fn queue_size(s: &Scenario) -> u16 {
    assert!(
        s.queue_size.is_power_of_two() && s.queue_size <= MAX_QUEUE_SIZE,
        "scenario queue size {}",
        s.queue_size
    );
    s.queue_size
}

/// How deep a scenario went.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reach {
    /// Chains answered and checked (used entry and RAM).
    pub checked_chains: usize,
    /// The queue was halted with DEVICE_NEEDS_RESET where the rings said it must be.
    pub halted: bool,
    /// The device rewrote its own rings: only liveness was checked from some batch on.
    pub rewrote_input: bool,
}

/// Runs `s` against its device; panics when a property fails (see the module documentation).
/// Returns how deep it went.
pub fn run(s: &Scenario) -> Reach {
    watch_device_threads();
    let mut rig = Rig::new(s.target, queue_size(s), s.event_idx);
    rig.activate();
    write_scenario(&rig, s);
    let mut progress = Progress::default();
    for batch in &s.batches {
        run_batch(&rig, &mut progress, batch);
    }
    let before = Snapshot::take(&rig.mem);
    drop(rig.device.reset());
    if !progress.weak {
        let after = Snapshot::take(&rig.mem);
        assert_writes_within(&before, &after, &used_rings(&rig), "at reset");
        assert_eq!(
            rig.used_idx(),
            progress.next_used,
            "used entries after the last check"
        );
        assert_eq!(rig.broken(), progress.halted);
    }
    rig.activate();
    good_request(&rig);
    drop(rig.device.reset());
    Reach {
        checked_chains: progress.checked,
        halted: progress.halted,
        rewrote_input: progress.weak,
    }
}

/// A split queue's rings, as the driver sees them.
#[derive(Clone, Copy, Debug)]
pub struct SplitRing {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
}

impl SplitRing {
    /// Queue `q`'s rings in the harness layout ([`rings`]).
    pub fn at(q: u16, size: u16) -> SplitRing {
        let (desc, avail, used) = rings(q);
        SplitRing {
            desc,
            avail,
            used,
            size,
        }
    }

    pub fn used_idx(&self, mem: &Mem) -> u16 {
        read_u16(mem, self.used + 2)
    }

    /// Used entry number `n` (a position in the ring, not yet reduced): (id, len).
    pub fn used_entry(&self, mem: &Mem, n: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * u64::from(n % self.size);
        (read_u32(mem, at), read_u32(mem, at + 4))
    }

    /// Writes `descs` as an indirect table at `table` behind descriptor `slot` and makes it
    /// available; returns (head, the available index it took).
    pub fn publish_indirect(&self, mem: &Mem, slot: u16, table: u64, descs: &[Desc]) -> (u16, u16) {
        for (i, desc) in descs.iter().enumerate() {
            write(mem, table + 16 * i as u64, &desc.to_bytes());
        }
        let head = slot % self.size;
        let len = 16 * descs.len() as u32;
        let indirect = Desc {
            addr: table,
            len,
            flags: INDIRECT,
            next: 0,
        };
        write(mem, self.desc + 16 * u64::from(head), &indirect.to_bytes());
        let idx = read_u16(mem, self.avail + 2);
        write(
            mem,
            self.avail + 4 + 2 * u64::from(idx % self.size),
            &head.to_le_bytes(),
        );
        write(mem, self.avail + 2, &idx.wrapping_add(1).to_le_bytes());
        (head, idx)
    }

    /// Publishes a request (see [`Self::publish_indirect`]), notifies with `kick`, and
    /// returns the used entry's length once the device answered.
    pub fn request(
        &self,
        mem: &Mem,
        slot: u16,
        table: u64,
        descs: &[Desc],
        kick: &dyn Fn(),
    ) -> u32 {
        let (head, idx) = self.publish_indirect(mem, slot, table, descs);
        kick();
        let target = idx.wrapping_add(1);
        wait_until("a good request", || self.used_idx(mem) == target);
        let (id, len) = self.used_entry(mem, idx);
        assert_eq!(
            id,
            u32::from(head),
            "good request: used entry names another head"
        );
        len
    }
}

fn write(mem: &Mem, addr: u64, bytes: &[u8]) {
    mem.write_slice(bytes, GuestAddress(addr))
        .expect("harness write in RAM");
}

fn read_u16(mem: &Mem, addr: u64) -> u16 {
    u16::from_le(
        mem.read_obj(GuestAddress(addr))
            .expect("harness read in RAM"),
    )
}

fn read_u32(mem: &Mem, addr: u64) -> u32 {
    u32::from_le(
        mem.read_obj(GuestAddress(addr))
            .expect("harness read in RAM"),
    )
}

/// [`SplitRing::request`] on the rig's queue.
fn request(rig: &Rig, slot: u16, table: u64, descs: &[Desc]) -> u32 {
    rig.ring()
        .request(&rig.mem, slot, table, descs, &|| rig.kick())
}

/// A buffer descriptor (linked to the next one of its table when `next` is set).
pub fn buffer(addr: u64, len: u32, write: bool, next: Option<u16>) -> Desc {
    let mut flags = if write { WRITE } else { 0 };
    if next.is_some() {
        flags |= NEXT;
    }
    Desc {
        addr,
        len,
        flags,
        next: next.unwrap_or(0),
    }
}

/// Serves a correct request after a reset, and checks its result.
fn good_request(rig: &Rig) {
    let data = DATA_START + 0x1000;
    let table = DATA_START;
    match rig.target {
        Target::Block => good_block_requests(&rig.mem, &rig.ring(), table, data, &|| rig.kick()),
        Target::Rng => {
            let len = request(rig, 0, table, &[buffer(data, 256, true, None)]);
            assert_eq!(len, 256, "virtio-rng after reset");
            let mut bytes = [0u8; 256];
            rig.mem.read_slice(&mut bytes, GuestAddress(data)).unwrap();
            let unchanged = (0..256).filter(|&i| bytes[i] == pattern_byte(data + i as u64));
            assert!(unchanged.count() < 32, "virtio-rng did not fill its buffer");
        }
        Target::ConsoleReceive => {
            rig.write(data, &[0; 16]);
            let len = request(rig, 0, table, &[buffer(data, 16, true, None)]);
            assert!(
                (1..=16).contains(&len),
                "console input after reset: {len} bytes"
            );
            let mut bytes = vec![0u8; len as usize];
            rig.mem.read_slice(&mut bytes, GuestAddress(data)).unwrap();
            assert!(
                bytes.iter().all(|&b| b == CONSOLE_INPUT),
                "console input {bytes:x?}"
            );
        }
        Target::ConsoleTransmit => {
            let text = b"ferrovm\n";
            rig.write(data, text);
            let total = rig.output.total();
            let len = request(rig, 0, table, &[buffer(data, 8, false, None)]);
            assert_eq!(len, 0, "console output used length");
            assert_eq!(rig.output.total(), total + 8, "console output after reset");
            assert!(rig.output.tail().ends_with(text));
        }
    }
}

/// A block request header (struct virtio_blk_outhdr).
pub fn block_header(request_type: u32, sector: u64) -> Vec<u8> {
    let mut header = request_type.to_le_bytes().to_vec();
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&sector.to_le_bytes());
    header
}

/// A write of one sector, then its read back, through `ring` (notified with `kick`): both
/// must succeed and the sector must read back as written. The chains use the indirect table
/// at `table` (48 bytes) and buffers from `data - 0x100` to `data + 0x200`.
pub fn good_block_requests(mem: &Mem, ring: &SplitRing, table: u64, data: u64, kick: &dyn Fn()) {
    let (header, status) = (data - 0x100, data - 0x10);
    let sector: Vec<u8> = (0..512u32).map(|i| (i * 7 + 1) as u8).collect();
    let chain = |write: bool| {
        [
            buffer(header, 16, false, Some(1)),
            buffer(data, 512, !write, Some(2)),
            buffer(status, 1, true, None),
        ]
    };
    let status_byte = || mem.read_obj::<u8>(GuestAddress(status)).unwrap();
    write(mem, header, &block_header(VIRTIO_BLK_T_OUT, 5));
    write(mem, data, &sector);
    write(mem, status, &[0xff]);
    assert_eq!(
        ring.request(mem, 0, table, &chain(true), kick),
        1,
        "write: used length"
    );
    assert_eq!(status_byte(), VIRTIO_BLK_S_OK as u8, "write: status");
    write(mem, header, &block_header(VIRTIO_BLK_T_IN, 5));
    write(mem, data, &[0; 512]);
    write(mem, status, &[0xff]);
    assert_eq!(
        ring.request(mem, 1, table, &chain(false), kick),
        513,
        "read: used length"
    );
    assert_eq!(status_byte(), VIRTIO_BLK_S_OK as u8, "read: status");
    let mut back = vec![0u8; 512];
    mem.read_slice(&mut back, GuestAddress(data)).unwrap();
    assert_eq!(back, sector, "the sector read back");
}

/// The block request types, for builders.
pub const BLOCK_REQUEST_TYPES: [u32; 6] = [
    VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_WRITE_ZEROES,
];
