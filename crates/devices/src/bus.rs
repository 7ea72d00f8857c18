//! Address buses for port I/O and MMIO, and the dispatcher that answers for
//! addresses nobody claims.
//!
//! The bus is built once, before any vCPU runs, and is then shared read-only
//! (`Arc<Bus>`) by every vCPU thread. A lookup is a `BTreeMap` range query and
//! the bus itself takes no lock: it calls the device through `&self`
//! ([`BusDevice`]), and the device locks only the state it owns. Two vCPUs
//! talking to two different devices never contend, and no global lock sits on
//! the exit fast path (an AP spinning on a port must not starve the BSP).
//!
//! A device whose registers are one piece of state implements [`BusDeviceMut`]
//! and goes on the bus inside a `Mutex`: that mutex is the device's own lock.
//! A device that fans out to others (the PCI BAR windows) implements
//! [`BusDevice`] directly, so that it never holds a lock while the device it
//! forwards to runs.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A device reachable through a [`Bus`]: served through a shared reference,
/// from any vCPU thread at once, locking only what the device owns.
///
/// `offset` is relative to the base of the range the device was inserted at
/// (plus the range's device offset, see [`Bus::insert_with_offset`]), so a
/// device never needs to know where the machine placed it. `data.len()` is
/// the access size chosen by the guest (it can be anything, including 0 or
/// more than 8, and implementations must not panic on any size); the bus
/// guarantees that the whole access lies inside the registered range.
pub trait BusDevice: Send + Sync {
    /// Serves a guest read: fill `data` (every byte of it).
    fn read(&self, offset: u64, data: &mut [u8]);
    /// Serves a guest write.
    fn write(&self, offset: u64, data: &[u8]);
}

/// A device whose registers are one piece of state, served one access at a
/// time: a `Mutex<D>` around it is its [`BusDevice`]. Same contract for
/// `offset` and `data` as [`BusDevice`].
pub trait BusDeviceMut: Send {
    /// Serves a guest read: fill `data` (every byte of it).
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Serves a guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// The device's own mutex, taken even if a previous holder panicked: one
/// broken device must not take down every vCPU thread that later touches it.
impl<D: BusDeviceMut + ?Sized> BusDevice for Mutex<D> {
    fn read(&self, offset: u64, data: &mut [u8]) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .read(offset, data);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(offset, data);
    }
}

/// Serves a wider access to a device of byte-wide registers as byte reads of consecutive
/// offsets. Bytes whose offset would overflow read as all ones.
pub fn read_bytewise(offset: u64, data: &mut [u8], mut read_byte: impl FnMut(u64) -> u8) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = match offset.checked_add(i as u64) {
            Some(o) => read_byte(o),
            None => 0xff,
        };
    }
}

/// The write counterpart of [`read_bytewise`]: byte writes to consecutive offsets, in order.
pub fn write_bytewise(offset: u64, data: &[u8], mut write_byte: impl FnMut(u64, u8)) {
    for (i, &v) in data.iter().enumerate() {
        if let Some(o) = offset.checked_add(i as u64) {
            write_byte(o, v);
        }
    }
}

/// Why a range could not be inserted into a [`Bus`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// A range of length zero would claim nothing and cannot be looked up.
    #[error("bus range at {base:#x} has zero length")]
    ZeroLength {
        /// Requested base address.
        base: u64,
    },
    /// `base + len` does not fit in 64 bits.
    #[error("bus range at {base:#x} with length {len:#x} overflows the address space")]
    Overflow {
        /// Requested base address.
        base: u64,
        /// Requested length.
        len: u64,
    },
    /// The new range shares at least one address with a range already on the bus.
    #[error(
        "bus range [{new_first:#x}, {new_last:#x}] overlaps existing range [{existing_first:#x}, {existing_last:#x}]"
    )]
    Overlap {
        /// First address of the rejected range.
        new_first: u64,
        /// Last address (inclusive) of the rejected range.
        new_last: u64,
        /// First address of the range already present.
        existing_first: u64,
        /// Last address (inclusive) of the range already present.
        existing_last: u64,
    },
}

struct Range {
    /// Last address claimed, inclusive (so a range may end at `u64::MAX`).
    last: u64,
    /// Added to `addr - base` before the device sees it.
    device_offset: u64,
    device: Arc<dyn BusDevice>,
}

/// Maps address ranges to devices.
///
/// Mutable (`insert`) while the machine is being assembled, then wrapped in an
/// `Arc` and never changed again, which is what lets lookups go without a lock.
#[derive(Default)]
pub struct Bus {
    /// Keyed by the first address of each range; ranges never overlap.
    ranges: BTreeMap<u64, Range>,
}

impl fmt::Debug for Bus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for (first, r) in &self.ranges {
            list.entry(&format_args!("[{first:#x}, {:#x}]", r.last));
        }
        list.finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Claims `[base, base + len)` for `device`; the device sees offsets
    /// starting at 0.
    pub fn insert(
        &mut self,
        device: Arc<dyn BusDevice>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        self.insert_with_offset(device, base, len, 0)
    }

    /// Like [`Bus::insert`], but the device sees offsets starting at
    /// `device_offset`.
    ///
    /// This lets one device answer several disjoint windows without claiming
    /// the ports in between: the i8042 answers 0x60 and 0x64 but must leave
    /// 0x61 (system control port B, PIT channel 2 gate) to another device, so
    /// it is inserted twice, at 0x60 with offset 0 and at 0x64 with offset 4.
    pub fn insert_with_offset(
        &mut self,
        device: Arc<dyn BusDevice>,
        base: u64,
        len: u64,
        device_offset: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::ZeroLength { base });
        }
        let last = base
            .checked_add(len - 1)
            .ok_or(BusError::Overflow { base, len })?;
        // The device must be able to see every offset of the range.
        device_offset
            .checked_add(len - 1)
            .ok_or(BusError::Overflow { base, len })?;

        let overlap = |existing_first: u64, existing: &Range| BusError::Overlap {
            new_first: base,
            new_last: last,
            existing_first,
            existing_last: existing.last,
        };
        // Ranges are disjoint, so only the nearest range starting at or before
        // `base` and the nearest one starting after it can collide.
        if let Some((&first, r)) = self.ranges.range(..=base).next_back() {
            if r.last >= base {
                return Err(overlap(first, r));
            }
        }
        if let Some((&first, r)) = self.ranges.range(base..).next() {
            if first <= last {
                return Err(overlap(first, r));
            }
        }
        self.ranges.insert(
            base,
            Range {
                last,
                device_offset,
                device,
            },
        );
        Ok(())
    }

    /// Finds the device claiming the whole access `[addr, addr + size)` and
    /// the offset it should see. An access straddling a range end is not
    /// claimed: no device is asked to serve bytes it does not own.
    fn lookup(&self, addr: u64, size: usize) -> Option<(&Range, u64)> {
        let (&first, r) = self.ranges.range(..=addr).next_back()?;
        if addr > r.last {
            return None;
        }
        let room = r.last - addr; // bytes after `addr` still in the range
        if size > 0 && (size - 1) as u64 > room {
            return None;
        }
        // Cannot overflow: checked in `insert_with_offset`.
        Some((r, r.device_offset + (addr - first)))
    }

    /// Whether some range contains `addr`.
    pub fn is_claimed(&self, addr: u64) -> bool {
        self.lookup(addr, 1).is_some()
    }

    /// Dispatches a read; returns false, leaving `data` untouched, when no
    /// device claims the whole access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((r, offset)) = self.lookup(addr, data.len()) else {
            return false;
        };
        if !data.is_empty() {
            r.device.read(offset, data);
        }
        true
    }

    /// Dispatches a write; returns false when no device claims the whole access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((r, offset)) = self.lookup(addr, data.len()) else {
            return false;
        };
        if !data.is_empty() {
            r.device.write(offset, data);
        }
        true
    }

    /// The claimed ranges as `(first, last_inclusive)`, in address order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&first, r)| (first, r.last))
    }
}

/// At most this many distinct unclaimed addresses are remembered (and logged)
/// per dispatcher, so a guest scanning the address space cannot make the VMM
/// grow without bound.
pub const MAX_REMEMBERED_UNCLAIMED: usize = 4096;

/// What the vCPU exit handler calls: a [`Bus`] plus the behaviour of an
/// ISA/PCI bus for addresses nobody decodes.
///
/// Unclaimed reads return all ones (what a floating bus reads as, and what
/// guests probing for absent hardware expect), unclaimed writes are dropped.
/// The first access to each unclaimed address is logged at debug level, which
/// is how one finds the device a guest is looking for, without flooding the
/// log when a guest polls a port (Linux writes port 0x80 as an I/O delay).
pub struct IoDispatcher {
    name: &'static str,
    bus: Arc<Bus>,
    seen: RwLock<HashSet<u64>>,
    full: AtomicBool,
}

impl fmt::Debug for IoDispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoDispatcher")
            .field("name", &self.name)
            .field("bus", &self.bus)
            .finish_non_exhaustive()
    }
}

impl IoDispatcher {
    /// `name` ("pio", "mmio") only labels log messages.
    pub fn new(name: &'static str, bus: Arc<Bus>) -> Self {
        Self {
            name,
            bus,
            seen: RwLock::new(HashSet::new()),
            full: AtomicBool::new(false),
        }
    }

    /// The underlying bus.
    pub fn bus(&self) -> &Arc<Bus> {
        &self.bus
    }

    /// Serves a guest read; returns whether a device claimed it (if not,
    /// `data` is filled with 0xff).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        if self.bus.read(addr, data) {
            return true;
        }
        data.fill(0xff);
        self.note_unclaimed(addr, "read", data.len(), &[]);
        false
    }

    /// Serves a guest write; returns whether a device claimed it (if not, the
    /// write is dropped).
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        if self.bus.write(addr, data) {
            return true;
        }
        self.note_unclaimed(addr, "write", data.len(), data);
        false
    }

    /// Number of distinct unclaimed addresses remembered so far.
    pub fn unclaimed_seen(&self) -> usize {
        self.seen.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn note_unclaimed(&self, addr: u64, kind: &str, size: usize, data: &[u8]) {
        if self.full.load(Ordering::Relaxed) {
            return;
        }
        if self
            .seen
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&addr)
        {
            return;
        }
        let mut seen = self.seen.write().unwrap_or_else(|e| e.into_inner());
        if seen.len() >= MAX_REMEMBERED_UNCLAIMED {
            if !self.full.swap(true, Ordering::Relaxed) {
                log::debug!(
                    "{}: {} unclaimed addresses seen; no longer logging new ones",
                    self.name,
                    MAX_REMEMBERED_UNCLAIMED
                );
            }
            return;
        }
        if seen.insert(addr) {
            // Show at most 8 bytes of a write: the size says the rest.
            let shown = &data[..data.len().min(8)];
            log::debug!(
                "{}: unclaimed {kind} at {addr:#x}, size {size}{}",
                self.name,
                if kind == "write" {
                    format!(", data {shown:02x?}")
                } else {
                    String::new()
                }
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records accesses; reads return `offset + i`.
    #[derive(Default)]
    struct Probe {
        writes: Vec<(u64, Vec<u8>)>,
        reads: Vec<(u64, usize)>,
    }

    impl BusDeviceMut for Probe {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            self.reads.push((offset, data.len()));
            for (i, b) in data.iter_mut().enumerate() {
                *b = (offset as u8).wrapping_add(i as u8);
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.writes.push((offset, data.to_vec()));
        }
    }

    fn probe() -> Arc<Mutex<Probe>> {
        Arc::new(Mutex::new(Probe::default()))
    }

    #[test]
    fn rejects_zero_length_and_overflow() {
        let mut bus = Bus::new();
        assert_eq!(
            bus.insert(probe(), 0x10, 0),
            Err(BusError::ZeroLength { base: 0x10 })
        );
        assert_eq!(
            bus.insert(probe(), u64::MAX, 2),
            Err(BusError::Overflow {
                base: u64::MAX,
                len: 2
            })
        );
        // A range ending exactly at the top of the address space is fine.
        bus.insert(probe(), u64::MAX, 1).unwrap();
        bus.insert(probe(), u64::MAX - 9, 10).unwrap_err();
        bus.insert(probe(), 0, u64::MAX).unwrap();
        assert!(bus.is_claimed(u64::MAX));
        assert!(bus.is_claimed(0));
    }

    #[test]
    fn rejects_overlaps_accepts_adjacent() {
        let mut bus = Bus::new();
        bus.insert(probe(), 0x100, 0x10).unwrap(); // [0x100, 0x10f]

        let err = bus.insert(probe(), 0x100, 0x10).unwrap_err(); // exact
        assert_eq!(
            err,
            BusError::Overlap {
                new_first: 0x100,
                new_last: 0x10f,
                existing_first: 0x100,
                existing_last: 0x10f
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("[0x100, 0x10f]"), "{msg}");

        // Partial overlaps, from below and from above.
        assert!(matches!(
            bus.insert(probe(), 0xf8, 0x10),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(probe(), 0x10f, 0x10),
            Err(BusError::Overlap { .. })
        ));
        // Contained, and containing.
        assert!(matches!(
            bus.insert(probe(), 0x104, 2),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(probe(), 0, 0x1000),
            Err(BusError::Overlap { .. })
        ));
        // Adjacent on both sides is fine.
        bus.insert(probe(), 0xf0, 0x10).unwrap();
        bus.insert(probe(), 0x110, 0x10).unwrap();
        assert_eq!(
            bus.ranges().collect::<Vec<_>>(),
            vec![(0xf0, 0xff), (0x100, 0x10f), (0x110, 0x11f)]
        );
        // Overlap reported names the range it hit.
        let err = bus.insert(probe(), 0x11f, 1).unwrap_err();
        assert!(err.to_string().contains("[0x110, 0x11f]"), "{err}");
    }

    #[test]
    fn lookup_at_edges() {
        let mut bus = Bus::new();
        let a = probe();
        let b = probe();
        bus.insert(a.clone(), 0x3f8, 8).unwrap();
        bus.insert(b.clone(), 0x400, 1).unwrap();
        let mut d = [0u8; 1];
        assert!(!bus.read(0x3f7, &mut d));
        assert!(bus.read(0x3f8, &mut d));
        assert_eq!(d[0], 0);
        assert!(bus.read(0x3ff, &mut d));
        assert_eq!(d[0], 7);
        assert!(bus.read(0x400, &mut d));
        assert!(!bus.read(0x401, &mut d));
        assert!(bus.write(0x3ff, &[0xaa]));
        assert!(!bus.write(0x3f7, &[0xaa]));
        assert_eq!(a.lock().unwrap().writes, vec![(7, vec![0xaa])]);
        assert_eq!(b.lock().unwrap().reads, vec![(0, 1)]);

        // Multi-byte accesses must fit entirely.
        let mut w = [0u8; 2];
        assert!(bus.read(0x3fe, &mut w));
        assert_eq!(w, [6, 7]);
        assert!(!bus.read(0x3ff, &mut w));
        assert!(!bus.write(0x3ff, &[1, 2]));
        // Empty accesses are claimed if the address is, but reach no device.
        assert!(bus.read(0x3f8, &mut []));
        assert!(!bus.read(0x3f0, &mut []));
        assert_eq!(a.lock().unwrap().reads.len(), 3);
    }

    #[test]
    fn device_offset_window() {
        let mut bus = Bus::new();
        let dev = probe();
        bus.insert_with_offset(dev.clone(), 0x60, 1, 0).unwrap();
        bus.insert_with_offset(dev.clone(), 0x64, 1, 4).unwrap();
        assert!(bus.write(0x60, &[1]));
        assert!(bus.write(0x64, &[2]));
        assert!(!bus.write(0x61, &[3]));
        assert_eq!(dev.lock().unwrap().writes, vec![(0, vec![1]), (4, vec![2])]);
        assert!(matches!(
            bus.insert_with_offset(probe(), 0x1000, 2, u64::MAX),
            Err(BusError::Overflow { .. })
        ));
    }

    #[test]
    fn dispatcher_unclaimed() {
        let mut bus = Bus::new();
        let dev = probe();
        bus.insert(dev.clone(), 0x10, 4).unwrap();
        let io = IoDispatcher::new("pio", Arc::new(bus));

        let mut d = [0u8; 4];
        assert!(!io.read(0x80, &mut d));
        assert_eq!(d, [0xff; 4]);
        let mut d = [0u8; 2];
        assert!(!io.read(0x13, &mut d)); // straddles the end of [0x10, 0x13]
        assert_eq!(d, [0xff; 2]);
        assert!(!io.write(0x80, &[1]));
        assert!(io.read(0x10, &mut d));
        assert_eq!(d, [0, 1]);
        assert_eq!(io.unclaimed_seen(), 2);
        assert!(dev.lock().unwrap().writes.is_empty());
    }

    #[test]
    fn dispatcher_memory_is_bounded() {
        let io = IoDispatcher::new("mmio", Arc::new(Bus::new()));
        let mut d = [0u8; 1];
        for addr in 0..(MAX_REMEMBERED_UNCLAIMED as u64 + 100) {
            io.read(addr, &mut d);
            io.write(addr.wrapping_mul(7919), &d);
        }
        assert_eq!(io.unclaimed_seen(), MAX_REMEMBERED_UNCLAIMED);
    }

    #[test]
    fn shared_across_threads() {
        let mut bus = Bus::new();
        let dev = probe();
        bus.insert(dev.clone(), 0, 0x100).unwrap();
        let io = Arc::new(IoDispatcher::new("pio", Arc::new(bus)));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let io = io.clone();
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        io.write(i, &[t]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(dev.lock().unwrap().writes.len(), 400);
    }

    /// Holds its own lock until released, as a device busy in its handler.
    struct Stuck {
        entered: Mutex<std::sync::mpsc::Sender<()>>,
        release: Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl BusDevice for Stuck {
        fn read(&self, _offset: u64, data: &mut [u8]) {
            let release = self.release.lock().unwrap();
            let _ = self.entered.lock().unwrap().send(());
            let _ = release.recv();
            data.fill(0);
        }
        fn write(&self, _offset: u64, _data: &[u8]) {}
    }

    /// The bus takes no lock of its own: a device stopped in its handler delays only
    /// accesses to itself.
    #[test]
    fn a_stuck_device_never_delays_another() {
        use std::sync::mpsc::channel;
        let (entered_tx, entered) = channel();
        let (release, release_rx) = channel();
        let stuck = Stuck {
            entered: Mutex::new(entered_tx),
            release: Mutex::new(release_rx),
        };
        let mut bus = Bus::new();
        bus.insert(Arc::new(stuck), 0x10, 1).unwrap();
        let other = probe();
        bus.insert(other.clone(), 0x20, 1).unwrap();
        let bus = &bus;
        std::thread::scope(|s| {
            s.spawn(move || bus.read(0x10, &mut [0u8; 1]));
            entered.recv().unwrap();
            let (done_tx, done) = channel();
            s.spawn(move || {
                let _ = done_tx.send(bus.write(0x20, &[7]));
            });
            let served = done.recv_timeout(std::time::Duration::from_secs(20));
            release.send(()).unwrap();
            assert_eq!(served, Ok(true), "the second device waited for the first");
        });
        assert_eq!(other.lock().unwrap().writes, vec![(0, vec![7])]);
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(0x9e37_79b9_7f4a_7c15);
        let mut bus = Bus::new();
        for _ in 0..200 {
            let base = match rng.next() % 3 {
                0 => rng.next(),
                1 => u64::MAX - rng.next() % 16,
                _ => rng.next() % 0x1000,
            };
            let len = match rng.next() % 3 {
                0 => rng.next(),
                _ => rng.next() % 32,
            };
            let _ = bus.insert_with_offset(probe(), base, len, rng.next() % 4);
        }
        let io = IoDispatcher::new("mmio", Arc::new(bus));
        let mut buf = [0u8; 64];
        for _ in 0..20_000 {
            let addr = match rng.next() % 3 {
                0 => rng.next(),
                1 => u64::MAX - rng.next() % 16,
                _ => rng.next() % 0x1000,
            };
            let size = (rng.next() % 17) as usize;
            if rng.next() & 1 == 0 {
                io.read(addr, &mut buf[..size]);
            } else {
                io.write(addr, &buf[..size]);
            }
        }
    }
}
