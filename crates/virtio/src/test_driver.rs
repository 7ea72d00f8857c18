//! A driver-side harness for device tests: guest RAM, split queues, chains written
//! descriptor by descriptor (hostile ones included), kicks, and waits for used entries.
//!
//! The rings are laid out here rather than by virtio-queue's `MockSplitQueue`, whose layout
//! (0.18) sizes the available ring in entries instead of bytes, so that its used ring overlaps
//! the upper half of the available ring: a driver publishing more than size/2 chains clobbers
//! the used index.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use devices::exit::Waker;
use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

use crate::{ActiveQueue, Interrupt};

pub const RAM_SIZE: u64 = 128 << 20;
/// Buffers are allocated from here up.
const DATA_START: u64 = 16 << 20;

/// Counts the signals a device raises.
#[derive(Default)]
pub struct TestInterrupt {
    counts: Mutex<HashMap<u16, u64>>,
    cond: Condvar,
    /// Set by [`Interrupt::needs_reset`].
    pub broken: std::sync::atomic::AtomicBool,
}

impl TestInterrupt {
    pub fn count(&self, queue: u16) -> u64 {
        *self.counts.lock().unwrap().get(&queue).unwrap_or(&0)
    }

    /// Waits (at most 10 s) until `queue` was signalled at least `n` times. A device signals
    /// just after it publishes used entries, so a test that saw the entries waits here.
    pub fn wait_count(&self, queue: u16, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut counts = self.counts.lock().unwrap();
        while *counts.get(&queue).unwrap_or(&0) < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "queue {queue}: fewer than {n} interrupts");
            counts = self.cond.wait_timeout(counts, left).unwrap().0;
        }
    }

    /// The count once signals in flight have landed.
    pub fn settled_count(&self, queue: u16) -> u64 {
        std::thread::sleep(Duration::from_millis(30));
        self.count(queue)
    }
}

impl Interrupt for TestInterrupt {
    fn signal_queue(&self, queue: u16) {
        *self.counts.lock().unwrap().entry(queue).or_default() += 1;
        self.cond.notify_all();
    }
    fn signal_config(&self) {}
    fn needs_reset(&self) {
        self.broken.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// One buffer of a chain, as the driver describes it.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

impl Buf {
    pub fn r(addr: GuestAddress, len: u32) -> Buf {
        Buf {
            addr: addr.0,
            len,
            write: false,
        }
    }
    pub fn w(addr: GuestAddress, len: u32) -> Buf {
        Buf {
            addr: addr.0,
            len,
            write: true,
        }
    }
}

struct TestQueue {
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    size: u16,
    next_desc: u16,
    used_seen: u16,
    notify: Arc<Waker>,
}

impl TestQueue {
    /// Queue `i` at 1 MiB * i: descriptor table, available ring, used ring (4-byte aligned).
    fn new(i: usize, size: u16) -> TestQueue {
        let desc = 0x10_0000 * i as u64;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
        TestQueue {
            desc: GuestAddress(desc),
            avail: GuestAddress(avail),
            used: GuestAddress(used),
            size,
            next_desc: 0,
            used_seen: 0,
            notify: Arc::new(Waker::new().unwrap()),
        }
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.try_set_desc_table_address(self.desc).unwrap();
        q.try_set_avail_ring_address(self.avail).unwrap();
        q.try_set_used_ring_address(self.used).unwrap();
        q.set_ready(true);
        q
    }
}

pub struct TestDriver {
    pub mem: Arc<GuestMemoryMmap>,
    queues: Vec<TestQueue>,
    next_data: u64,
    pub interrupt: Arc<TestInterrupt>,
}

impl TestDriver {
    pub fn new(queue_sizes: &[u16]) -> TestDriver {
        let mem = Arc::new(
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), RAM_SIZE as usize)]).unwrap(),
        );
        let queues = queue_sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| TestQueue::new(i, size))
            .collect();
        TestDriver {
            mem,
            queues,
            next_data: DATA_START,
            interrupt: Arc::new(TestInterrupt::default()),
        }
    }

    fn load16(&self, addr: GuestAddress) -> u16 {
        u16::from_le(self.mem.read_obj(addr).unwrap())
    }

    fn store16(&self, addr: GuestAddress, value: u16) {
        self.mem.write_obj(value.to_le(), addr).unwrap();
    }

    /// The queues as a transport hands them to a device at DRIVER_OK.
    pub fn active_queues(&self) -> Vec<ActiveQueue> {
        self.queues
            .iter()
            .enumerate()
            .map(|(i, q)| ActiveQueue {
                index: i as u16,
                queue: q.queue(),
                notify: q.notify.clone(),
            })
            .collect()
    }

    pub fn interrupt(&self) -> Arc<dyn Interrupt> {
        self.interrupt.clone()
    }

    /// A fresh, zeroed, 4 KiB-aligned guest buffer.
    pub fn alloc(&mut self, len: u64) -> GuestAddress {
        let addr = self.next_data;
        self.next_data = (addr + len.max(1) + 0xfff) & !0xfff;
        assert!(self.next_data <= RAM_SIZE, "test guest RAM exhausted");
        self.mem
            .write_slice(&vec![0; len as usize], GuestAddress(addr))
            .unwrap();
        GuestAddress(addr)
    }

    pub fn write(&self, addr: GuestAddress, data: &[u8]) {
        self.mem.write_slice(data, addr).unwrap();
    }

    pub fn read(&self, addr: GuestAddress, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.mem.read_slice(&mut buf, addr).unwrap();
        buf
    }

    /// Writes `bufs` as one chain of consecutive descriptors, publishes it and returns its
    /// head index. Does not kick.
    pub fn add_chain(&mut self, q: usize, bufs: &[Buf]) -> u16 {
        let descs: Vec<(u64, u32, u16)> = bufs
            .iter()
            .map(|b| {
                (
                    b.addr,
                    b.len,
                    if b.write {
                        VRING_DESC_F_WRITE as u16
                    } else {
                        0
                    },
                )
            })
            .collect();
        let head = self.write_linked(q, &descs);
        self.publish(q, head);
        head
    }

    /// Writes `bufs` as an indirect table and publishes a one-descriptor chain pointing at it.
    pub fn add_indirect_chain(&mut self, q: usize, bufs: &[Buf]) -> u16 {
        let table = self.alloc(16 * bufs.len() as u64);
        for (i, b) in bufs.iter().enumerate() {
            let mut flags = if b.write {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            if i + 1 < bufs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let desc =
                RawDescriptor::from(SplitDescriptor::new(b.addr, b.len, flags, i as u16 + 1));
            self.mem
                .write_obj(desc, table.unchecked_add(16 * i as u64))
                .unwrap();
        }
        let flags = VRING_DESC_F_INDIRECT as u16;
        let head = self.write_linked(q, &[(table.0, 16 * bufs.len() as u32, flags)]);
        self.publish(q, head);
        head
    }

    /// Writes descriptors (addr, len, flags) at consecutive indices, linking each to the next;
    /// returns the first index.
    pub fn write_linked(&mut self, q: usize, descs: &[(u64, u32, u16)]) -> u16 {
        let size = self.queues[q].size;
        let head = self.queues[q].next_desc;
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let index = (head + i as u16) % size;
            let next = (index + 1) % size;
            let flags = if i + 1 < descs.len() {
                flags | VRING_DESC_F_NEXT as u16
            } else {
                flags
            };
            self.store_desc(q, index, addr, len, flags, next);
        }
        self.queues[q].next_desc = (head + descs.len() as u16) % size;
        head
    }

    /// Stores one raw descriptor, whatever it says.
    pub fn store_desc(&self, q: usize, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let desc = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
        let at = self.queues[q].desc.unchecked_add(16 * u64::from(index));
        self.mem.write_obj(desc, at).unwrap();
    }

    /// Puts `head` in the available ring.
    pub fn publish(&self, q: usize, head: u16) {
        let avail = self.queues[q].avail;
        let idx = self.load16(avail.unchecked_add(2));
        let slot = idx % self.queues[q].size;
        self.store16(avail.unchecked_add(4 + 2 * u64::from(slot)), head);
        self.store16(avail.unchecked_add(2), idx.wrapping_add(1));
    }

    /// Overwrites the available index (hostile drivers).
    pub fn set_avail_idx(&self, q: usize, idx: u16) {
        self.store16(self.queues[q].avail.unchecked_add(2), idx);
    }

    /// Sets the avail ring's used_event (VIRTIO_F_EVENT_IDX): "interrupt me once the used
    /// index passes this".
    pub fn set_used_event(&self, q: usize, value: u16) {
        let queue = &self.queues[q];
        self.store16(
            queue.avail.unchecked_add(4 + 2 * u64::from(queue.size)),
            value,
        );
    }

    pub fn kick(&self, q: usize) {
        self.queues[q].notify.wake().unwrap();
    }

    pub fn used_idx(&self, q: usize) -> u16 {
        self.load16(self.queues[q].used.unchecked_add(2))
    }

    /// Waits (at most 10 s) for `n` more used entries; returns their (id, len).
    pub fn wait_used(&mut self, q: usize, n: u16) -> Vec<(u32, u32)> {
        let start = Instant::now();
        let target = self.queues[q].used_seen.wrapping_add(n);
        while self.used_idx(q).wrapping_sub(self.queues[q].used_seen) < n {
            let waited = start.elapsed();
            assert!(
                waited < Duration::from_secs(10),
                "queue {q}: waited for {n} used entries, got {}",
                self.used_idx(q).wrapping_sub(self.queues[q].used_seen)
            );
            // Poll hard briefly (the device is usually quick), then gently.
            if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut out = Vec::new();
        let queue = &self.queues[q];
        let mut i = queue.used_seen;
        while i != target {
            let slot = i % queue.size;
            let at = queue.used.unchecked_add(4 + 8 * u64::from(slot));
            let id: u32 = self.mem.read_obj(at).unwrap();
            let len: u32 = self.mem.read_obj(at.unchecked_add(4)).unwrap();
            out.push((u32::from_le(id), u32::from_le(len)));
            i = i.wrapping_add(1);
        }
        self.queues[q].used_seen = target;
        out
    }

    /// Asserts no used entry arrives within `wait`.
    pub fn assert_no_used(&self, q: usize, wait: Duration) {
        std::thread::sleep(wait);
        assert_eq!(
            self.used_idx(q),
            self.queues[q].used_seen,
            "queue {q}: unexpected used entry"
        );
    }
}
