//! Scenarios of [`super::chains`] as bytes (the fuzz target's input) and built the way a
//! driver builds requests (the seeds and the property tests' starting points).
//!
//! The byte form, little-endian; past the end of the input every field reads as zero:
//!
//! ```text
//! byte 0      bits 0-1: target (block, rng, console receive, console transmit); bit 2: EVENT_IDX
//! byte 1      log2 of the queue size (mod 9)
//! byte 2      descriptors in the table (at most the queue size)
//! byte 3      bits 0-1: indirect tables; bits 2-4: fills; bits 5-6: batches - 1
//! table       12 bytes a descriptor: address (selector u8, value u32), len u32, flags u8, next u16
//! indirect    per table: entry count u8, then its descriptors
//! fills       per fill: address (5 bytes), length u8, the bytes
//! batches     per batch: head count u8, heads u16 each, u8 (bit 0: publish the index that
//!             follows instead of the honest one), index u16, used_event u16
//! ```
//!
//! An address is a selector and a value, so that most inputs point somewhere that matters:
//! see [`decode_address`].

use super::chains::*;
use super::{ByteReader, DATA_START, RAM_A, RAM_B};

const ADDRESS_BYTES: usize = 5;

/// The address a selector and a value name.
pub fn decode_address(selector: u8, value: u32) -> u64 {
    let v = u64::from(value);
    let ram_a_end = RAM_A.0 + RAM_A.1;
    match selector % 8 {
        0 => DATA_START + v % (ram_a_end - DATA_START),
        1 => RAM_B.0 + v % RAM_B.1,
        2 => ram_a_end - v % 0x1000,   // running into the hole
        3 => ram_a_end + v % 0x4_0000, // the hole, region B and beyond
        4 => INDIRECT_BASE + v % (MAX_INDIRECT_TABLES as u64 * INDIRECT_STRIDE),
        5 => v % RINGS_END, // the rings themselves
        6 => u64::MAX - v,  // the top of the address space
        _ => v,             // anywhere in the first 4 GiB
    }
}

/// A selector and value naming `addr` (the first that does).
pub fn encode_address(addr: u64) -> [u8; ADDRESS_BYTES] {
    for selector in [0u8, 1, 4, 5, 7, 6, 2, 3] {
        let value = match selector {
            0 => addr.checked_sub(DATA_START),
            1 => addr.checked_sub(RAM_B.0),
            4 => addr.checked_sub(INDIRECT_BASE),
            5 | 7 => Some(addr),
            6 => Some(u64::MAX - addr),
            2 => (RAM_A.0 + RAM_A.1).checked_sub(addr),
            _ => addr.checked_sub(RAM_A.0 + RAM_A.1),
        };
        let Some(value) = value.and_then(|v| u32::try_from(v).ok()) else {
            continue;
        };
        if decode_address(selector, value) == addr {
            let mut out = [selector; ADDRESS_BYTES];
            out[1..].copy_from_slice(&value.to_le_bytes());
            return out;
        }
    }
    panic!("address {addr:#x} has no encoding");
}

fn read_address(r: &mut ByteReader) -> u64 {
    let selector = r.u8();
    decode_address(selector, r.u32())
}

fn read_desc(r: &mut ByteReader) -> Desc {
    Desc {
        addr: read_address(r),
        len: r.u32(),
        flags: u16::from(r.u8()),
        next: r.u16(),
    }
}

fn write_desc(out: &mut Vec<u8>, d: &Desc) {
    out.extend_from_slice(&encode_address(d.addr));
    out.extend_from_slice(&d.len.to_le_bytes());
    out.push(d.flags as u8);
    out.extend_from_slice(&d.next.to_le_bytes());
}

fn read_batch(r: &mut ByteReader) -> Batch {
    let count = r.u8();
    let heads = (0..count).map(|_| r.u16()).collect();
    let override_index = r.u8() & 1 != 0;
    let index = r.u16();
    Batch {
        heads,
        avail_idx: override_index.then_some(index),
        used_event: r.u16(),
    }
}

/// The scenario `data` describes (any bytes describe one).
pub fn decode(data: &[u8]) -> Scenario {
    let mut r = ByteReader::new(data);
    let mode = r.u8();
    let queue_size = 1u16 << (r.u8() % 9);
    let descriptors = r.u8().min(queue_size.min(255) as u8);
    let counts = r.u8();
    let mut s = Scenario {
        target: Target::ALL[usize::from(mode & 3)],
        event_idx: mode & 4 != 0,
        queue_size,
        table: (0..descriptors).map(|_| read_desc(&mut r)).collect(),
        indirect: Vec::new(),
        fills: Vec::new(),
        batches: Vec::new(),
    };
    for _ in 0..counts & 3 {
        let entries = r.u8();
        s.indirect
            .push((0..entries).map(|_| read_desc(&mut r)).collect());
    }
    for _ in 0..(counts >> 2) & 7 {
        let addr = read_address(&mut r);
        let len = r.u8();
        s.fills.push((addr, r.bytes(usize::from(len))));
    }
    for _ in 0..=(counts >> 5) & 3 {
        s.batches.push(read_batch(&mut r));
    }
    s
}

/// The bytes [`decode`] turns back into `s` (which must fit the byte form: at most 255
/// descriptors a table, 3 indirect tables, 7 fills of 255 bytes, 1 to 4 batches of 255 heads,
/// flags in the low byte, addresses [`encode_address`] can name).
pub fn encode(s: &Scenario) -> Vec<u8> {
    let target = Target::ALL.iter().position(|t| *t == s.target).unwrap() as u8;
    let mode = target | (u8::from(s.event_idx) << 2);
    let log2 = s.queue_size.trailing_zeros() as u8;
    assert!(s.indirect.len() <= 3 && s.fills.len() <= 7 && (1..=4).contains(&s.batches.len()));
    let lists = [s.table.len()]
        .into_iter()
        .chain(s.indirect.iter().map(Vec::len));
    let lists = lists
        .chain(s.fills.iter().map(|f| f.1.len()))
        .chain(s.batches.iter().map(|b| b.heads.len()));
    assert!(
        lists.max().unwrap_or(0) <= 255,
        "a list longer than its count byte"
    );
    let counts =
        s.indirect.len() as u8 | (s.fills.len() as u8) << 2 | (s.batches.len() as u8 - 1) << 5;
    let mut out = vec![mode, log2, s.table.len() as u8, counts];
    s.table.iter().for_each(|d| write_desc(&mut out, d));
    for table in &s.indirect {
        out.push(table.len() as u8);
        table.iter().for_each(|d| write_desc(&mut out, d));
    }
    for (addr, bytes) in &s.fills {
        out.extend_from_slice(&encode_address(*addr));
        out.push(bytes.len() as u8);
        out.extend_from_slice(bytes);
    }
    for batch in &s.batches {
        out.push(batch.heads.len() as u8);
        batch
            .heads
            .iter()
            .for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
        out.push(u8::from(batch.avail_idx.is_some()));
        out.extend_from_slice(&batch.avail_idx.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&batch.used_event.to_le_bytes());
    }
    out
}

/// Builds scenarios the way a driver builds requests: buffers in the data area, chains of
/// consecutive descriptors or behind an indirect table.
pub struct Builder {
    pub scenario: Scenario,
    next_data: u64,
}

impl Builder {
    pub fn new(target: Target, queue_size: u16, event_idx: bool) -> Builder {
        Builder {
            scenario: Scenario {
                target,
                event_idx,
                queue_size,
                table: Vec::new(),
                indirect: Vec::new(),
                fills: Vec::new(),
                batches: Vec::new(),
            },
            next_data: DATA_START + 0x2000, // below: the harness's own request after reset
        }
    }

    /// A fresh buffer of `len` bytes (wrapping around the data area when it is used up).
    pub fn alloc(&mut self, len: u32) -> u64 {
        let end = RAM_A.0 + RAM_A.1;
        if self.next_data + u64::from(len) > end {
            self.next_data = DATA_START + 0x2000;
        }
        let addr = self.next_data;
        self.next_data = (addr + u64::from(len).max(1) + 0xf) & !0xf;
        addr
    }

    pub fn fill(&mut self, addr: u64, bytes: Vec<u8>) {
        self.scenario.fills.push((addr, bytes));
    }

    /// Adds a chain of `(addr, len, device-writable)` buffers; returns its head. Behind an
    /// indirect table when `indirect` and a table is left, else in consecutive descriptors
    /// (None when the table is full).
    pub fn chain(&mut self, bufs: &[(u64, u32, bool)], indirect: bool) -> Option<u16> {
        let link = |i: usize| (i + 1 < bufs.len()).then_some(i as u16 + 1);
        let head = self.scenario.table.len() as u16;
        if indirect && self.scenario.indirect.len() < 3 {
            let entries = bufs.iter().enumerate();
            let table = entries
                .map(|(i, &(a, l, w))| buffer(a, l, w, link(i)))
                .collect();
            let at = indirect_table(self.scenario.indirect.len());
            self.scenario.indirect.push(table);
            let len = 16 * bufs.len() as u32;
            self.push_descs(&[Desc {
                addr: at,
                len,
                flags: INDIRECT,
                next: 0,
            }])?;
            return Some(head);
        }
        let descs: Vec<Desc> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, w))| buffer(a, l, w, link(i).map(|n| n + head)))
            .collect();
        self.push_descs(&descs)?;
        Some(head)
    }

    fn push_descs(&mut self, descs: &[Desc]) -> Option<()> {
        let room = usize::from(self.scenario.queue_size.min(255));
        if self.scenario.table.len() + descs.len() > room {
            return None;
        }
        self.scenario.table.extend_from_slice(descs);
        Some(())
    }

    /// A virtio-blk request: header, an optional data buffer of `data_len` bytes (written by
    /// the device when `device_writes`), status byte. Returns its head.
    pub fn block(
        &mut self,
        request_type: u32,
        sector: u64,
        data: Option<(u32, bool)>,
        indirect: bool,
    ) -> Option<u16> {
        let header = self.alloc(16);
        self.fill(header, block_header(request_type, sector));
        let mut bufs = vec![(header, 16, false)];
        if let Some((len, device_writes)) = data {
            bufs.push((self.alloc(len), len, device_writes));
        }
        bufs.push((self.alloc(1), 1, true));
        self.chain(&bufs, indirect)
    }

    /// Publishes `heads` in a batch of their own.
    pub fn publish(&mut self, heads: Vec<u16>) {
        self.scenario.batches.push(Batch {
            heads,
            avail_idx: None,
            used_event: 0,
        });
    }
}
