//! The type-0 configuration header a PCI function embeds.
//!
//! [`ConfigSpace`] holds the 256 bytes of conventional configuration space with a mask of
//! guest-writable bits per byte. Everything the guest can change goes through that mask, so
//! BAR sizing falls out of it: a BAR's writable bits are exactly its address bits, so a
//! guest that writes all ones reads back the size mask with the read-only type bits.
//! Extended configuration space (0x100–0xfff, reachable through ECAM) reads as zero and
//! ignores writes.
//!
//! The function's code changes read-only state (status bits, capability bodies it owns)
//! through the `set_*` methods, which bypass the mask.

use devices::StateError;
use serde::{Deserialize, Serialize};

use crate::{BarKind, BarRequest};

/// Bytes of conventional configuration space.
pub const CONFIG_SPACE_SIZE: usize = 256;
/// Bytes of configuration space per function through ECAM.
pub const EXTENDED_CONFIG_SIZE: u16 = 4096;
/// BAR registers in a type-0 header.
pub const NUM_BARS: usize = 6;

pub const VENDOR_ID: usize = 0x00;
pub const DEVICE_ID: usize = 0x02;
pub const COMMAND: usize = 0x04;
pub const STATUS: usize = 0x06;
pub const REVISION_ID: usize = 0x08;
/// Programming interface (0x09), subclass (0x0a), base class (0x0b).
pub const CLASS_CODE: usize = 0x09;
pub const CACHE_LINE_SIZE: usize = 0x0c;
pub const HEADER_TYPE: usize = 0x0e;
pub const BAR0: usize = 0x10;
pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
pub const SUBSYSTEM_ID: usize = 0x2e;
pub const CAPABILITIES_POINTER: usize = 0x34;
pub const INTERRUPT_LINE: usize = 0x3c;
pub const INTERRUPT_PIN: usize = 0x3d;
/// Where capabilities start: the first byte after the standard header.
pub const FIRST_CAPABILITY: usize = 0x40;

/// Command register: I/O space decode.
pub const COMMAND_IO: u16 = 1 << 0;
/// Command register: memory space decode.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: the function may master the bus (DMA, MSI).
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// Command register: INTx assertion disabled.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// The command bits a guest can change.
const COMMAND_WRITABLE: u16 =
    COMMAND_IO | COMMAND_MEMORY | COMMAND_BUS_MASTER | COMMAND_INTX_DISABLE;

/// Status register: the function has an INTx pending (whether or not it is disabled).
pub const STATUS_INTERRUPT: u16 = 1 << 3;
/// Status register: the capability list at [`CAPABILITIES_POINTER`] is valid.
pub const STATUS_CAPABILITIES: u16 = 1 << 4;

/// BAR register bit 0: an I/O BAR.
const BAR_IO: u32 = 1;
/// Memory BAR type field (bits 2:1) for a 64-bit BAR.
const BAR_MEM64: u32 = 0b10 << 1;
/// Memory BAR bit 3.
const BAR_PREFETCHABLE: u32 = 1 << 3;
/// Read-only low bits of a memory BAR and of an I/O BAR.
const BAR_MEM_FLAGS: u32 = 0xf;
const BAR_IO_FLAGS: u32 = 0x3;

/// Smallest memory BAR (the four type bits take the rest).
pub const MIN_MEMORY_BAR: u64 = 16;
/// Smallest and largest I/O BAR (the PCI specification caps I/O BARs at 256 bytes).
pub const MIN_IO_BAR: u64 = 4;
pub const MAX_IO_BAR: u64 = 256;

/// How a function identifies itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    pub revision: u8,
    /// Base class << 16 | subclass << 8 | programming interface.
    pub class: u32,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
}

/// Why a BAR or capability cannot be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("BAR {index}: {reason}")]
    Bar { index: usize, reason: String },
    #[error("capability {id:#x} with a {len}-byte body does not fit configuration space")]
    CapabilityTooLarge { id: u8, len: usize },
}

/// An INTx pin a function may use. `A` is 1 in the interrupt-pin register.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IntxPin {
    A,
    B,
    C,
    D,
}

impl IntxPin {
    /// 0 for INTA# .. 3 for INTD#.
    pub fn index(self) -> u32 {
        self as u32
    }

    /// The pin's value in the interrupt-pin register (1..=4).
    pub fn register_value(self) -> u8 {
        self as u8 + 1
    }

    /// The pin an interrupt-pin register value names (0: none; above 4: invalid).
    pub fn from_register(value: u8) -> Option<Self> {
        match value {
            1 => Some(IntxPin::A),
            2 => Some(IntxPin::B),
            3 => Some(IntxPin::C),
            4 => Some(IntxPin::D),
            _ => None,
        }
    }
}

/// What a BAR register slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BarSlot {
    Unused,
    /// A BAR (for a 64-bit BAR, its low dword).
    Bar(BarRequest),
    /// The high dword of the 64-bit BAR in the slot below.
    Upper,
}

/// A type-0 configuration header plus capabilities: see the module documentation.
#[derive(Clone, Debug)]
pub struct ConfigSpace {
    bytes: [u8; CONFIG_SPACE_SIZE],
    writable: [u8; CONFIG_SPACE_SIZE],
    bars: [BarSlot; NUM_BARS],
    /// Offset of the last capability in the list, if any.
    last_capability: Option<usize>,
    /// Where the next capability goes.
    next_capability: usize,
}

/// The guest-visible bytes of a [`ConfigSpace`], for a function's saved state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigSpaceState {
    pub bytes: Vec<u8>,
}

impl ConfigSpace {
    /// A header with `ids`, no BARs, no capabilities, no interrupt pin, command zero.
    pub fn new(ids: PciIds) -> Self {
        let mut c = ConfigSpace {
            bytes: [0; CONFIG_SPACE_SIZE],
            writable: [0; CONFIG_SPACE_SIZE],
            bars: [BarSlot::Unused; NUM_BARS],
            last_capability: None,
            next_capability: FIRST_CAPABILITY,
        };
        c.set_u16(VENDOR_ID, ids.vendor);
        c.set_u16(DEVICE_ID, ids.device);
        c.set_u8(REVISION_ID, ids.revision);
        c.set_bytes(CLASS_CODE, &ids.class.to_le_bytes()[..3]);
        c.set_u16(SUBSYSTEM_VENDOR_ID, ids.subsystem_vendor);
        c.set_u16(SUBSYSTEM_ID, ids.subsystem);
        c.set_writable(COMMAND, &COMMAND_WRITABLE.to_le_bytes());
        c.set_writable(CACHE_LINE_SIZE, &[0xff]);
        c.set_writable(INTERRUPT_LINE, &[0xff]);
        c
    }

    /// Declares BAR `request.index`: its type bits become read-only and its address bits
    /// writable. A 64-bit BAR also takes the next slot.
    pub fn add_bar(&mut self, request: BarRequest) -> Result<(), ConfigError> {
        validate_bar(&request)?;
        let index = request.index;
        let span = if request.kind == BarKind::Memory64 {
            index..index + 2
        } else {
            index..index + 1
        };
        if self.bars[span].iter().any(|b| *b != BarSlot::Unused) {
            return Err(bar_error(index, "overlaps a BAR already declared"));
        }
        let size_mask = !(request.size - 1);
        let (flags, ro_bits) = match request.kind {
            BarKind::Io => (BAR_IO, BAR_IO_FLAGS),
            BarKind::Memory32 => (0, BAR_MEM_FLAGS),
            BarKind::Memory64 => (BAR_MEM64, BAR_MEM_FLAGS),
        };
        let flags = flags
            | if request.prefetchable {
                BAR_PREFETCHABLE
            } else {
                0
            };
        let offset = bar_offset(index);
        self.set_u32(offset, flags);
        self.set_writable(offset, &((size_mask as u32) & !ro_bits).to_le_bytes());
        self.bars[index] = BarSlot::Bar(request);
        if request.kind == BarKind::Memory64 {
            self.set_u32(offset + 4, 0);
            self.set_writable(offset + 4, &((size_mask >> 32) as u32).to_le_bytes());
            self.bars[index + 1] = BarSlot::Upper;
        }
        Ok(())
    }

    /// The BARs declared with [`ConfigSpace::add_bar`], in index order.
    pub fn bar_requests(&self) -> Vec<BarRequest> {
        self.bars
            .iter()
            .filter_map(|b| match b {
                BarSlot::Bar(r) => Some(*r),
                _ => None,
            })
            .collect()
    }

    /// The address BAR `index` holds (whether or not decoding is on); `None` for an
    /// undeclared BAR.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let BarSlot::Bar(r) = self.bars.get(index)? else {
            return None;
        };
        let low = u64::from(self.read_u32(bar_offset(index)));
        Some(match r.kind {
            BarKind::Io => low & !u64::from(BAR_IO_FLAGS),
            BarKind::Memory32 => low & !u64::from(BAR_MEM_FLAGS),
            BarKind::Memory64 => {
                let high = u64::from(self.read_u32(bar_offset(index) + 4));
                (high << 32) | (low & !u64::from(BAR_MEM_FLAGS))
            }
        })
    }

    /// Appends a capability with `id` and `body` (the bytes after the id and next-pointer
    /// bytes) and returns its offset. `writable` gives the guest-writable bits of the body
    /// byte by byte (missing bytes are read-only). The list links itself.
    pub fn add_capability(
        &mut self,
        id: u8,
        body: &[u8],
        writable: &[u8],
    ) -> Result<u8, ConfigError> {
        let offset = self.next_capability;
        let end = offset + 2 + body.len();
        if end > CONFIG_SPACE_SIZE {
            return Err(ConfigError::CapabilityTooLarge {
                id,
                len: body.len(),
            });
        }
        self.set_bytes(offset, &[id, 0]);
        self.set_bytes(offset + 2, body);
        let masks = writable.iter().take(body.len()).copied();
        for (i, mask) in masks.enumerate() {
            self.writable[offset + 2 + i] = mask;
        }
        // offset < 256 here, so it fits the one-byte pointers.
        match self.last_capability {
            Some(last) => self.set_u8(last + 1, offset as u8),
            None => {
                self.set_u8(CAPABILITIES_POINTER, offset as u8);
                let status = self.read_u16(STATUS) | STATUS_CAPABILITIES;
                self.set_u16(STATUS, status);
            }
        }
        self.last_capability = Some(offset);
        self.next_capability = end.next_multiple_of(4);
        Ok(offset as u8)
    }

    /// `(id, offset)` of every capability, following the `next` pointers as a guest would
    /// (at most 48 steps, the most that fit, so a corrupt list cannot loop).
    pub fn capabilities(&self) -> Vec<(u8, u8)> {
        walk_capabilities(|offset| self.read_u8(offset))
    }

    /// The function's INTx pin (`None`: it uses none).
    pub fn set_interrupt_pin(&mut self, pin: Option<IntxPin>) {
        self.set_u8(INTERRUPT_PIN, pin.map_or(0, IntxPin::register_value));
    }

    /// The pin in the interrupt-pin register.
    pub fn interrupt_pin(&self) -> Option<IntxPin> {
        IntxPin::from_register(self.read_u8(INTERRUPT_PIN))
    }

    /// Sets or clears the status register's interrupt bit (the function's INTx is pending).
    pub fn set_interrupt_status(&mut self, pending: bool) {
        let status = self.read_u16(STATUS);
        let status = if pending {
            status | STATUS_INTERRUPT
        } else {
            status & !STATUS_INTERRUPT
        };
        self.set_u16(STATUS, status);
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        self.read_u16(COMMAND)
    }

    /// Whether the guest set INTx disable in the command register.
    pub fn intx_disabled(&self) -> bool {
        self.command() & COMMAND_INTX_DISABLE != 0
    }

    /// Whether the guest let the function master the bus (DMA and MSI writes).
    pub fn bus_master(&self) -> bool {
        self.command() & COMMAND_BUS_MASTER != 0
    }

    /// The dword at `offset` as the guest reads it: zero beyond conventional space or off
    /// a dword boundary.
    pub fn read(&self, offset: u16) -> u32 {
        let offset = usize::from(offset);
        if !offset.is_multiple_of(4) || offset >= CONFIG_SPACE_SIZE {
            return 0;
        }
        self.read_u32(offset)
    }

    /// A guest write of `data` at byte `sub` of dword `offset`: only writable bits change.
    /// Bytes beyond conventional space are ignored.
    pub fn write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        let start = usize::from(offset) + usize::from(sub);
        for (i, &value) in data.iter().enumerate() {
            let Some(byte) = self.bytes.get_mut(start + i) else {
                return;
            };
            let mask = self.writable[start + i];
            *byte = (*byte & !mask) | (value & mask);
        }
    }

    pub fn read_u8(&self, offset: usize) -> u8 {
        self.bytes.get(offset).copied().unwrap_or(0)
    }

    pub fn read_u16(&self, offset: usize) -> u16 {
        u16::from_le_bytes([self.read_u8(offset), self.read_u8(offset + 1)])
    }

    pub fn read_u32(&self, offset: usize) -> u32 {
        u32::from_le_bytes([
            self.read_u8(offset),
            self.read_u8(offset + 1),
            self.read_u8(offset + 2),
            self.read_u8(offset + 3),
        ])
    }

    /// Function-side write of bytes at `offset`, ignoring the writable mask (bytes past
    /// the end are dropped).
    pub fn set_bytes(&mut self, offset: usize, data: &[u8]) {
        for (i, &b) in data.iter().enumerate() {
            if let Some(byte) = self.bytes.get_mut(offset + i) {
                *byte = b;
            }
        }
    }

    pub fn set_u8(&mut self, offset: usize, value: u8) {
        self.set_bytes(offset, &[value]);
    }

    pub fn set_u16(&mut self, offset: usize, value: u16) {
        self.set_bytes(offset, &value.to_le_bytes());
    }

    pub fn set_u32(&mut self, offset: usize, value: u32) {
        self.set_bytes(offset, &value.to_le_bytes());
    }

    /// Makes the bits set in `mask` (one byte per configuration byte from `offset`)
    /// guest-writable and the others read-only.
    pub fn set_writable(&mut self, offset: usize, mask: &[u8]) {
        for (i, &m) in mask.iter().enumerate() {
            if let Some(w) = self.writable.get_mut(offset + i) {
                *w = m;
            }
        }
    }

    /// The guest-visible bytes, for the function's saved state.
    pub fn state(&self) -> ConfigSpaceState {
        ConfigSpaceState {
            bytes: self.bytes.to_vec(),
        }
    }

    /// Loads bytes saved by [`ConfigSpace::state`]. Refuses (and changes nothing) a state
    /// whose read-only header bytes (identity, BAR types, pin, capability pointer) or
    /// capability list differ from this function's: it belongs to another function.
    pub fn restore(&mut self, state: &ConfigSpaceState) -> Result<(), StateError> {
        let err = |detail: String| StateError::new("pci config", detail);
        let saved: [u8; CONFIG_SPACE_SIZE] = state.bytes.as_slice().try_into().map_err(|_| {
            err(format!(
                "{} bytes, not {CONFIG_SPACE_SIZE}",
                state.bytes.len()
            ))
        })?;
        let header = saved.iter().zip(&self.bytes).zip(&self.writable);
        for (offset, ((&saved, &current), &writable)) in header.enumerate().take(FIRST_CAPABILITY) {
            // Status is read-only yet changes at run time.
            if offset == STATUS || offset == STATUS + 1 {
                continue;
            }
            if saved & !writable != current & !writable {
                return Err(err(format!(
                    "read-only byte {offset:#x} is {saved:#x}, this function has {current:#x}"
                )));
            }
        }
        let saved_caps = walk_capabilities(|o| saved.get(o).copied().unwrap_or(0));
        if saved_caps != self.capabilities() {
            return Err(err(format!(
                "capabilities {saved_caps:x?}, this function has {:x?}",
                self.capabilities()
            )));
        }
        self.bytes = saved;
        Ok(())
    }
}

/// Configuration offset of BAR register `index`.
pub fn bar_offset(index: usize) -> usize {
    BAR0 + 4 * index
}

fn bar_error(index: usize, reason: &str) -> ConfigError {
    ConfigError::Bar {
        index,
        reason: reason.into(),
    }
}

/// Checks a BAR request: index, power-of-two size within what the kind can decode.
pub fn validate_bar(r: &BarRequest) -> Result<(), ConfigError> {
    let last_index = if r.kind == BarKind::Memory64 {
        NUM_BARS - 2
    } else {
        NUM_BARS - 1
    };
    if r.index > last_index {
        return Err(bar_error(r.index, "index out of range for its kind"));
    }
    if !r.size.is_power_of_two() {
        return Err(bar_error(
            r.index,
            &format!("size {:#x} is not a power of two", r.size),
        ));
    }
    let (min, max) = match r.kind {
        BarKind::Io => (MIN_IO_BAR, MAX_IO_BAR),
        BarKind::Memory32 => (MIN_MEMORY_BAR, 1 << 31),
        BarKind::Memory64 => (MIN_MEMORY_BAR, 1 << 63),
    };
    if r.size < min || r.size > max {
        return Err(bar_error(
            r.index,
            &format!("size {:#x} outside [{min:#x}, {max:#x}]", r.size),
        ));
    }
    if r.kind == BarKind::Io && r.prefetchable {
        return Err(bar_error(r.index, "an I/O BAR cannot be prefetchable"));
    }
    Ok(())
}

/// Walks a capability list through `read_byte`, as a guest would; bounded.
pub(crate) fn walk_capabilities(read_byte: impl Fn(usize) -> u8) -> Vec<(u8, u8)> {
    const MAX_CAPABILITIES: usize = (CONFIG_SPACE_SIZE - FIRST_CAPABILITY) / 4;
    let mut out = Vec::new();
    let mut next = read_byte(CAPABILITIES_POINTER) & !3;
    while next != 0 && out.len() < MAX_CAPABILITIES {
        let offset = usize::from(next);
        out.push((read_byte(offset), next));
        next = read_byte(offset + 1) & !3;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: PciIds = PciIds {
        vendor: 0x1af4,
        device: 0x1042,
        revision: 1,
        class: 0x01_00_00,
        subsystem_vendor: 0x1af4,
        subsystem: 0x0002,
    };

    fn bar(index: usize, size: u64, kind: BarKind, prefetchable: bool) -> BarRequest {
        BarRequest {
            index,
            size,
            kind,
            prefetchable,
        }
    }

    /// Sizes BAR `index` the way firmware does: save, write ones, read, restore.
    fn size_of_bar(c: &mut ConfigSpace, index: usize) -> u32 {
        let offset = bar_offset(index) as u16;
        let saved = c.read(offset);
        c.write(offset, 0, &[0xff; 4]);
        let mask = c.read(offset);
        c.write(offset, 0, &saved.to_le_bytes());
        assert_eq!(c.read(offset), saved, "BAR {index} restored");
        mask
    }

    #[test]
    fn identity_header() {
        let c = ConfigSpace::new(IDS);
        assert_eq!(c.read(0), 0x1042_1af4);
        assert_eq!(c.read(8), 0x0100_0001);
        assert_eq!(c.read(0x2c), 0x0002_1af4);
        assert_eq!(c.read(0x0c) >> 16 & 0xff, 0, "header type 0");
        assert_eq!(c.read(0x34), 0, "no capabilities");
        assert_eq!(c.read(0x100), 0, "extended space");
        assert_eq!(c.read(0xffc), 0);
        assert_eq!(c.read(2), 0, "unaligned");
    }

    #[test]
    fn identity_is_read_only() {
        let mut c = ConfigSpace::new(IDS);
        for offset in [0u16, 8, 0x2c, 0x34] {
            let before = c.read(offset);
            c.write(offset, 0, &[0x5a; 4]);
            assert_eq!(c.read(offset), before, "{offset:#x}");
        }
    }

    #[test]
    fn bar_sizing_memory32() {
        let mut c = ConfigSpace::new(IDS);
        c.add_bar(bar(0, 0x4000, BarKind::Memory32, false)).unwrap();
        assert_eq!(size_of_bar(&mut c, 0), 0xffff_c000);
        c.write(0x10, 0, &0xc000_4000u32.to_le_bytes());
        assert_eq!(c.read(0x10), 0xc000_4000);
        assert_eq!(c.bar_address(0), Some(0xc000_4000));
        // Low address bits are dropped, type bits stay.
        c.write(0x10, 0, &0xc000_5fffu32.to_le_bytes());
        assert_eq!(c.read(0x10), 0xc000_4000);
    }

    #[test]
    fn bar_sizing_prefetchable_memory32() {
        let mut c = ConfigSpace::new(IDS);
        c.add_bar(bar(2, 0x100_0000, BarKind::Memory32, true))
            .unwrap();
        assert_eq!(size_of_bar(&mut c, 2), 0xff00_0008);
        assert_eq!(c.read(0x10), 0, "unused BAR");
        assert_eq!(size_of_bar(&mut c, 0), 0, "unused BAR sizes to zero");
    }

    #[test]
    fn bar_sizing_io() {
        let mut c = ConfigSpace::new(IDS);
        c.add_bar(bar(1, 0x40, BarKind::Io, false)).unwrap();
        assert_eq!(size_of_bar(&mut c, 1), 0xffff_ffc1);
        c.write(0x14, 0, &0xc040u32.to_le_bytes());
        assert_eq!(c.read(0x14), 0xc041);
        assert_eq!(c.bar_address(1), Some(0xc040));
        // Byte-wise writes work too.
        c.write(0x14, 1, &[0xd0]);
        assert_eq!(c.bar_address(1), Some(0xd040));
    }

    #[test]
    fn bar_sizing_memory64() {
        let mut c = ConfigSpace::new(IDS);
        c.add_bar(bar(4, 0x2_0000_0000, BarKind::Memory64, true))
            .unwrap();
        assert_eq!(size_of_bar(&mut c, 4), 0x0000_000c);
        assert_eq!(size_of_bar(&mut c, 5), 0xffff_fffe);
        let mut c2 = ConfigSpace::new(IDS);
        c2.add_bar(bar(0, 0x1000, BarKind::Memory64, false))
            .unwrap();
        assert_eq!(size_of_bar(&mut c2, 0), 0xffff_f004);
        assert_eq!(size_of_bar(&mut c2, 1), 0xffff_ffff);
        c2.write(0x10, 0, &0x2000u32.to_le_bytes());
        c2.write(0x14, 0, &0x10u32.to_le_bytes());
        assert_eq!(c2.bar_address(0), Some(0x10_0000_2000));
        assert_eq!(c2.bar_address(1), None, "upper half is no BAR");
        assert_eq!(c2.bar_requests().len(), 1);
    }

    #[test]
    fn bad_bars_are_refused() {
        let mut c = ConfigSpace::new(IDS);
        for r in [
            bar(6, 0x1000, BarKind::Memory32, false),
            bar(5, 0x1000, BarKind::Memory64, false),
            bar(0, 0x1800, BarKind::Memory32, false),
            bar(0, 8, BarKind::Memory32, false),
            bar(0, 0x200, BarKind::Io, false),
            bar(0, 0x10, BarKind::Io, true),
            bar(0, 1 << 32, BarKind::Memory32, false),
        ] {
            assert!(c.add_bar(r).is_err(), "{r:?}");
        }
        c.add_bar(bar(0, 0x1000, BarKind::Memory64, false)).unwrap();
        assert!(c.add_bar(bar(1, 0x1000, BarKind::Memory32, false)).is_err());
        assert!(c.add_bar(bar(0, 0x1000, BarKind::Memory32, false)).is_err());
        c.add_bar(bar(2, 0x1000, BarKind::Memory32, false)).unwrap();
    }

    #[test]
    fn command_and_interrupt_registers() {
        let mut c = ConfigSpace::new(IDS);
        c.write(4, 0, &[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(c.command(), 0x0407);
        assert_eq!(c.read(4) >> 16, 0, "status not writable");
        assert!(c.intx_disabled() && c.bus_master());
        c.set_interrupt_pin(Some(IntxPin::B));
        c.write(0x3c, 0, &[0x13, 0x04]);
        assert_eq!(
            c.read(0x3c) & 0xffff,
            0x0213,
            "line writable, pin read-only"
        );
        assert_eq!(c.interrupt_pin(), Some(IntxPin::B));
        c.set_interrupt_status(true);
        assert_eq!(c.read(4) >> 16, u32::from(STATUS_INTERRUPT));
        c.set_interrupt_status(false);
        assert_eq!(c.read(4) >> 16, 0);
    }

    #[test]
    fn capability_chain_walk() {
        let mut c = ConfigSpace::new(IDS);
        let a = c.add_capability(0x11, &[0; 10], &[0xff, 0xc0]).unwrap();
        let b = c.add_capability(0x09, &[1, 2, 3], &[]).unwrap();
        let d = c.add_capability(0x05, &[0; 12], &[]).unwrap();
        assert_eq!((a, b, d), (0x40, 0x4c, 0x54));
        assert_ne!(c.read(4) >> 16 & u32::from(STATUS_CAPABILITIES), 0);
        assert_eq!(c.read(0x34), 0x40);
        assert_eq!(
            c.capabilities(),
            vec![(0x11, 0x40), (0x09, 0x4c), (0x05, 0x54)]
        );
        // The guest walks it through dword reads.
        let mut walked = Vec::new();
        let mut next = c.read(0x34) as u8;
        while next != 0 {
            let dw = c.read(u16::from(next));
            walked.push(dw as u8);
            next = (dw >> 8) as u8;
        }
        assert_eq!(walked, vec![0x11, 0x09, 0x05]);
        // Body masks: byte 2 of capability a is writable, byte 3 partly, ids and pointers not.
        c.write(0x40, 0, &[0xff; 4]);
        assert_eq!(c.read(0x40), 0xc0ff_4c11);
        c.write(0x4c, 0, &[0xff; 4]);
        assert_eq!(c.read(0x4c), 0x0201_5409);
        assert!(c.add_capability(0x10, &[0; 200], &[]).is_err());
    }

    #[test]
    fn state_round_trip_and_foreign_state() {
        let mut c = ConfigSpace::new(IDS);
        c.add_bar(bar(0, 0x1000, BarKind::Memory32, false)).unwrap();
        c.add_capability(0x11, &[0; 10], &[0xff]).unwrap();
        c.write(0x10, 0, &0xc000_0000u32.to_le_bytes());
        c.write(4, 0, &[0x06]);
        let saved = c.state();
        let mut fresh = ConfigSpace::new(IDS);
        fresh
            .add_bar(bar(0, 0x1000, BarKind::Memory32, false))
            .unwrap();
        fresh.add_capability(0x11, &[0; 10], &[0xff]).unwrap();
        fresh.restore(&saved).unwrap();
        assert_eq!(fresh.state(), saved);
        assert_eq!(fresh.bar_address(0), Some(0xc000_0000));

        let mut other = ConfigSpace::new(PciIds {
            device: 0x1041,
            ..IDS
        });
        other
            .add_bar(bar(0, 0x1000, BarKind::Memory32, false))
            .unwrap();
        other.add_capability(0x11, &[0; 10], &[0xff]).unwrap();
        let before = other.state();
        assert!(other.restore(&saved).is_err());
        assert_eq!(other.state(), before, "refused state changes nothing");
        let mut io = ConfigSpace::new(IDS);
        io.add_bar(bar(0, 0x10, BarKind::Io, false)).unwrap();
        io.add_capability(0x11, &[0; 10], &[0xff]).unwrap();
        assert!(io.restore(&saved).is_err(), "BAR kind differs");
        let mut nocap = ConfigSpace::new(IDS);
        nocap
            .add_bar(bar(0, 0x1000, BarKind::Memory32, false))
            .unwrap();
        assert!(nocap.restore(&saved).is_err(), "capabilities differ");
        assert!(fresh
            .restore(&ConfigSpaceState { bytes: vec![0; 12] })
            .is_err());
    }
}
