//! Sequences of [`Op`]s as bytes (the fuzz target's input) and as a driver makes them (the
//! seeds and the property tests' starting points).
//!
//! The byte form: at most [`MAX_OPS`] operations, each an opcode byte (taken modulo the 14
//! operations, in the order of [`Op`]) and its fields, little-endian; past the end of the
//! input every field reads as zero, and decoding stops there.
//!
//! ```text
//! BarRead      bar u8 (0 unless 1 mod 8: BAR 2), offset (selector u8, value u32), len u8 (mod 17)
//! BarWrite     bar u8, offset, len u8 (mod 17), the bytes
//! ConfigRead   offset u16
//! ConfigWrite  offset u16, sub u8, len u8 (mod 9), the bytes
//! BarMoved     u8 (bit 0: decoding off), base u64
//! Status       u8
//! Negotiate    features u64
//! SetupQueue   queue u16, size u16, u8 (bit 0: the rings that follow, else the harness's),
//!              desc u64, driver u64, device u64
//! DriverOk     -
//! Msix         u8 (bit 0: enable, bit 1: function mask)
//! Vector       entry u16, masked u8 (bit 0)
//! SetVectors   config u16, queue u16
//! Request      sector u8
//! Kick         queue u16
//! ```

use super::pci_access::{layout, Op, ACKNOWLEDGE, DRIVER, VERSION_1};
use super::ByteReader;

/// Most operations one input runs.
pub const MAX_OPS: usize = 256;

/// The BAR0 offset a selector and a value name: inside one of the regions, or anywhere.
pub fn decode_offset(selector: u8, value: u32) -> u64 {
    let v = u64::from(value);
    let layout = layout();
    match selector % 8 {
        0 => v % 0x40,            // common configuration
        1 => 0x1000 + v % 8,      // ISR
        2 => 0x2000 + v % 0x1008, // device configuration
        3 => 0x3000 + v % 16,     // notifications
        4 => layout.table_offset + v % (layout.table_len + 16),
        5 => layout.pba_offset + v % 16,
        6 => u64::MAX - v,
        _ => v,
    }
}

fn read_offset(r: &mut ByteReader) -> u64 {
    let selector = r.u8();
    decode_offset(selector, r.u32())
}

fn read_op(r: &mut ByteReader) -> Op {
    match r.u8() % 14 {
        code @ (0 | 1) => read_bar_access(r, code == 1),
        2 => Op::ConfigRead { offset: r.u16() },
        3 => {
            let (offset, sub, len) = (r.u16(), r.u8(), usize::from(r.u8() % 9));
            Op::ConfigWrite {
                offset,
                sub,
                data: r.bytes(len),
            }
        }
        4 => {
            let off = r.u8() & 1 != 0;
            let base = r.u64();
            Op::BarMoved {
                base: (!off).then_some(base),
            }
        }
        5 => Op::Status(r.u8()),
        6 => Op::Negotiate(r.u64()),
        7 => read_setup_queue(r),
        8 => Op::DriverOk,
        9 => {
            let bits = r.u8();
            Op::Msix {
                enable: bits & 1 != 0,
                mask: bits & 2 != 0,
            }
        }
        10 => Op::Vector {
            entry: r.u16(),
            masked: r.u8() & 1 != 0,
        },
        11 => Op::SetVectors {
            config: r.u16(),
            queue: r.u16(),
        },
        12 => Op::Request { sector: r.u8() },
        _ => Op::Kick { queue: r.u16() },
    }
}

/// BarRead or BarWrite (`write`), after the opcode.
fn read_bar_access(r: &mut ByteReader, write: bool) -> Op {
    let (bar, offset) = (read_bar(r), read_offset(r));
    let len = usize::from(r.u8() % 17);
    if write {
        Op::BarWrite {
            bar,
            offset,
            data: r.bytes(len),
        }
    } else {
        Op::BarRead { bar, offset, len }
    }
}

fn read_bar(r: &mut ByteReader) -> usize {
    if r.u8() % 8 == 1 {
        2
    } else {
        0
    }
}

fn read_setup_queue(r: &mut ByteReader) -> Op {
    let (queue, size) = (r.u16(), r.u16());
    let own = r.u8() & 1 != 0;
    let rings = (r.u64(), r.u64(), r.u64());
    Op::SetupQueue {
        queue,
        size,
        rings: own.then_some(rings),
    }
}

/// The operations `data` describes (any bytes describe some).
pub fn decode(data: &[u8]) -> Vec<Op> {
    let mut r = ByteReader::new(data);
    let mut ops = Vec::new();
    while !r.is_empty() && ops.len() < MAX_OPS {
        ops.push(read_op(&mut r));
    }
    ops
}

fn op_code(op: &Op) -> u8 {
    match op {
        Op::BarRead { .. } => 0,
        Op::BarWrite { .. } => 1,
        Op::ConfigRead { .. } => 2,
        Op::ConfigWrite { .. } => 3,
        Op::BarMoved { .. } => 4,
        Op::Status(_) => 5,
        Op::Negotiate(_) => 6,
        Op::SetupQueue { .. } => 7,
        Op::DriverOk => 8,
        Op::Msix { .. } => 9,
        Op::Vector { .. } => 10,
        Op::SetVectors { .. } => 11,
        Op::Request { .. } => 12,
        Op::Kick { .. } => 13,
    }
}

fn push_bar_access(out: &mut Vec<u8>, bar: usize, offset: u64, len: usize) {
    out.push(u8::from(bar == 2));
    let value = u32::try_from(offset).expect("seed offsets fit 32 bits");
    out.push(7);
    out.extend_from_slice(&value.to_le_bytes());
    out.push(len as u8);
}

fn push_op(out: &mut Vec<u8>, op: &Op) {
    out.push(op_code(op));
    let u16s = |out: &mut Vec<u8>, values: &[u16]| {
        values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()))
    };
    match op {
        Op::BarRead { bar, offset, len } => push_bar_access(out, *bar, *offset, *len),
        Op::BarWrite { bar, offset, data } => {
            push_bar_access(out, *bar, *offset, data.len());
            out.extend_from_slice(data);
        }
        Op::ConfigRead { offset } => u16s(out, &[*offset]),
        Op::ConfigWrite { offset, sub, data } => {
            u16s(out, &[*offset]);
            out.extend_from_slice(&[*sub, data.len() as u8]);
            out.extend_from_slice(data);
        }
        Op::BarMoved { base } => {
            out.push(u8::from(base.is_none()));
            out.extend_from_slice(&base.unwrap_or(0).to_le_bytes());
        }
        Op::Status(status) => out.push(*status),
        Op::Negotiate(features) => out.extend_from_slice(&features.to_le_bytes()),
        Op::SetupQueue { queue, size, rings } => push_setup_queue(out, *queue, *size, *rings),
        Op::DriverOk => {}
        Op::Msix { enable, mask } => out.push(u8::from(*enable) | u8::from(*mask) << 1),
        Op::Vector { entry, masked } => {
            u16s(out, &[*entry]);
            out.push(u8::from(*masked));
        }
        Op::SetVectors { config, queue } => u16s(out, &[*config, *queue]),
        Op::Request { sector } => out.push(*sector),
        Op::Kick { queue } => u16s(out, &[*queue]),
    }
}

fn push_setup_queue(out: &mut Vec<u8>, queue: u16, size: u16, rings: Option<(u64, u64, u64)>) {
    out.extend_from_slice(&queue.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.push(u8::from(rings.is_some()));
    let (desc, driver, device) = rings.unwrap_or_default();
    for address in [desc, driver, device] {
        out.extend_from_slice(&address.to_le_bytes());
    }
}

/// The bytes [`decode`] turns back into `ops` (BAR offsets below 4 GiB, lengths within
/// their bounds, at most [`MAX_OPS`] operations).
pub fn encode(ops: &[Op]) -> Vec<u8> {
    let mut out = Vec::new();
    ops.iter().for_each(|op| push_op(&mut out, op));
    out
}

/// A driver bringing the device up with `features`, a queue of `size` entries on the
/// harness's rings, MSI-X on or off, then `requests` write requests.
pub fn bring_up(features: u64, size: u16, msix: bool, requests: u8) -> Vec<Op> {
    let mut ops = vec![Op::Status(0)];
    if msix {
        ops.extend([
            Op::Msix {
                enable: true,
                mask: false,
            },
            Op::Vector {
                entry: 0,
                masked: false,
            },
            Op::Vector {
                entry: 1,
                masked: false,
            },
            Op::SetVectors {
                config: 0,
                queue: 1,
            },
        ]);
    }
    ops.extend([
        Op::Status(ACKNOWLEDGE),
        Op::Status(ACKNOWLEDGE | DRIVER),
        Op::Negotiate(features | VERSION_1),
        Op::SetupQueue {
            queue: 0,
            size,
            rings: None,
        },
        Op::DriverOk,
    ]);
    ops.extend((0..requests).map(|sector| Op::Request { sector }));
    ops
}
