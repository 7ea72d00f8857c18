//! A 24-pin I/O APIC (version 0x20, as in the ICH chipsets and KVM's model)
//! that delivers every interrupt as an MSI.
//!
//! Pins and redirection entries:
//!
//! - a masked pin remembers its line level (and, for an edge pin, that an
//!   edge arrived: it is delivered when the pin is unmasked, so an interrupt
//!   raised while the guest re-programs an entry is not lost);
//! - an edge pin delivers on each rising edge;
//! - a level pin delivers while asserted and Remote IRR is clear, sets
//!   Remote IRR, and when the guest EOIs the vector (the hypervisor's
//!   "IOAPIC EOI" exit, or a write to the EOI register at 0x40) Remote IRR
//!   clears and the pin is delivered again if still asserted;
//! - the destination is the entry's (physical APIC ID or logical set),
//!   never a fixed CPU; lowest-priority arbitration is left to the local
//!   APICs (KVM resolves it).
//!
//! Vectors below 0x10 are illegal for fixed and lowest-priority delivery:
//! such an entry is logged once and not delivered. NMI, SMI, INIT and
//! ExtINT entries are passed through in the MSI data (always as edge
//! triggered, as the I/O APIC specification requires). Polarity is stored
//! but not applied: device models assert a line with `true` whatever the
//! electrical polarity the firmware tables describe.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::state::StateError;

/// Guest-physical base of the I/O APIC's registers.
pub const IOAPIC_BASE: u64 = 0xfec0_0000;
/// Size of the MMIO window claimed for it.
pub const IOAPIC_SIZE: u64 = 0x1000;
/// Number of input pins (GSIs 0-23).
pub const NUM_PINS: usize = 24;
/// The version register's version field.
pub const IOAPIC_VERSION: u8 = 0x20;

/// Register offsets in the MMIO window.
const IOREGSEL: u64 = 0x00;
const IOWIN: u64 = 0x10;
const EOI: u64 = 0x40;

/// Indirect register indices.
const REG_ID: u8 = 0x00;
const REG_VERSION: u8 = 0x01;
const REG_ARB: u8 = 0x02;
const REG_REDIR_FIRST: u8 = 0x10;
const REG_REDIR_LAST: u8 = REG_REDIR_FIRST + 2 * NUM_PINS as u8 - 1;

/// Redirection entry fields.
const VECTOR_MASK: u64 = 0xff;
const DELIVERY_MODE_SHIFT: u32 = 8;
const DEST_MODE_LOGICAL: u64 = 1 << 11;
const DELIVERY_STATUS: u64 = 1 << 12;
const REMOTE_IRR: u64 = 1 << 14;
const TRIGGER_LEVEL: u64 = 1 << 15;
const MASKED: u64 = 1 << 16;
const DEST_SHIFT: u32 = 56;
/// Bits of the low dword the guest can write: vector, delivery mode,
/// destination mode, polarity, trigger mode, mask.
const LOW_WRITABLE: u64 = 0x0001_afff;
/// Bits of the high dword kept: the 8-bit destination (63:56).
const HIGH_WRITABLE: u64 = 0xff00_0000;

/// Delivery modes.
const DM_FIXED: u8 = 0;
const DM_LOWEST: u8 = 1;
const DM_SMI: u8 = 2;
const DM_NMI: u8 = 4;
const DM_INIT: u8 = 5;
const DM_EXTINT: u8 = 7;

/// The x86 MSI address of the local APICs.
pub const MSI_ADDRESS_BASE: u64 = 0xfee0_0000;
const MSI_ADDR_DEST_SHIFT: u32 = 12;
const MSI_ADDR_DEST_MODE_LOGICAL: u64 = 1 << 2;
const MSI_DATA_DELIVERY_MODE_SHIFT: u32 = 8;
const MSI_DATA_LEVEL_ASSERT: u32 = 1 << 14;
const MSI_DATA_TRIGGER_LEVEL: u32 = 1 << 15;

/// An x86 MSI: what the I/O APIC sends to the local APICs.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Msi {
    /// 0xfee00000 | destination << 12 | (logical ? 1 << 2 : 0).
    pub address: u64,
    /// vector | delivery mode << 8 | (level ? assert << 14 | 1 << 15 : 0).
    pub data: u32,
}

impl fmt::Debug for Msi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Msi({:#x}, {:#x})", self.address, self.data)
    }
}

/// The MSIs one operation produced (at most one per pin), without
/// allocating on the interrupt path.
#[derive(Clone, Copy, Default)]
pub struct MsiBatch {
    msgs: [Msi; NUM_PINS],
    len: usize,
}

impl MsiBatch {
    /// An empty batch.
    pub fn new() -> Self {
        MsiBatch::default()
    }

    fn push(&mut self, msi: Msi) {
        if let Some(slot) = self.msgs.get_mut(self.len) {
            *slot = msi;
            self.len += 1;
        }
    }

    /// The messages, in the order they were produced.
    pub fn as_slice(&self) -> &[Msi] {
        &self.msgs[..self.len.min(NUM_PINS)]
    }

    /// Whether nothing is to be sent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for MsiBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Redirection-entry bits the I/O APIC ever holds: the guest-writable ones,
/// Remote IRR and delivery status.
const REDIR_VALID: u64 = LOW_WRITABLE | REMOTE_IRR | DELIVERY_STATUS | (HIGH_WRITABLE << 32);
/// One bit per pin.
const PIN_MASK: u32 = (1 << NUM_PINS) - 1;

/// The guest-visible state, for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoapicState {
    /// I/O APIC ID (4 bits).
    pub id: u8,
    /// IOREGSEL.
    pub ioregsel: u8,
    /// Redirection table.
    pub redirection: [u64; NUM_PINS],
    /// Current level of each pin's line (bit n = pin n).
    pub lines: u32,
    /// Edge pins with an edge not yet delivered (they were masked).
    pub pending_edges: u32,
}

impl Default for IoapicState {
    fn default() -> Self {
        IoapicState {
            id: 0,
            ioregsel: 0,
            redirection: [MASKED; NUM_PINS],
            lines: 0,
            pending_edges: 0,
        }
    }
}

impl IoapicState {
    /// Refuses what the I/O APIC could never hold.
    pub fn validate(&self) -> Result<(), StateError> {
        let err = |detail: String| Err(StateError::new("IOAPIC", detail));
        if self.id > 0xf {
            return err(format!("id {:#x}", self.id));
        }
        if self.lines & !PIN_MASK != 0 || self.pending_edges & !PIN_MASK != 0 {
            return err(format!(
                "lines {:#x}, pending edges {:#x} beyond pin {}",
                self.lines,
                self.pending_edges,
                NUM_PINS - 1
            ));
        }
        if let Some((pin, e)) = self
            .redirection
            .iter()
            .enumerate()
            .find(|(_, e)| *e & !REDIR_VALID != 0)
        {
            return err(format!("redirection entry {pin} is {e:#018x}"));
        }
        Ok(())
    }
}

/// The I/O APIC.
#[derive(Debug, Clone, Default)]
pub struct Ioapic {
    state: IoapicState,
    /// Pins whose illegal vector or reserved delivery mode was logged.
    logged: u32,
}

impl Ioapic {
    /// An I/O APIC with every pin masked.
    pub fn new() -> Self {
        Ioapic::default()
    }

    /// Drives `pin` to `level`, adding any resulting MSI to `out`.
    /// Out-of-range pins are ignored.
    pub fn set_irq(&mut self, pin: usize, level: bool, out: &mut MsiBatch) {
        if pin >= NUM_PINS {
            return;
        }
        let bit = 1u32 << pin;
        let was = self.state.lines & bit != 0;
        if level {
            self.state.lines |= bit;
            if !was && !self.is_level(pin) {
                self.state.pending_edges |= bit;
            }
            self.service(pin, out);
        } else {
            self.state.lines &= !bit;
        }
    }

    /// The guest EOIed `vector` on a local APIC (or through the EOI
    /// register): every level pin with that vector and Remote IRR set has
    /// it cleared and is delivered again if its line is still asserted.
    pub fn eoi(&mut self, vector: u8, out: &mut MsiBatch) {
        for pin in 0..NUM_PINS {
            let e = &mut self.state.redirection[pin];
            if *e & VECTOR_MASK == u64::from(vector) && *e & REMOTE_IRR != 0 {
                *e &= !REMOTE_IRR;
                self.service(pin, out);
            }
        }
    }

    /// A guest read of the MMIO window at `offset`.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let Some(addr) = offset.checked_add(i as u64) else {
                *b = 0;
                continue;
            };
            let dword = match addr & !3 {
                IOREGSEL => u32::from(self.state.ioregsel),
                IOWIN => self.read_register(self.state.ioregsel),
                _ => 0,
            };
            *b = (dword >> (8 * (addr & 3))) as u8;
        }
    }

    /// A guest write to the MMIO window. Sub-dword writes modify only the
    /// bytes written. Returns whether the redirection table changed (the
    /// MSI routes a hypervisor may need to know about).
    pub fn write(&mut self, offset: u64, data: &[u8], out: &mut MsiBatch) -> bool {
        let mut changed = false;
        let mut i = 0usize;
        while i < data.len() {
            let Some(addr) = offset.checked_add(i as u64) else {
                break;
            };
            let base = addr & !3;
            // The bytes of this access that fall in the dword at `base`.
            let first = (addr & 3) as usize;
            let n = (4 - first).min(data.len() - i);
            let bytes = &data[i..i + n];
            i += n;
            let merge = |old: u32| {
                let mut v = old.to_le_bytes();
                v[first..first + n].copy_from_slice(bytes);
                u32::from_le_bytes(v)
            };
            match base {
                IOREGSEL => {
                    self.state.ioregsel = merge(u32::from(self.state.ioregsel)) as u8;
                }
                IOWIN => {
                    let reg = self.state.ioregsel;
                    let v = merge(self.read_register(reg));
                    changed |= self.write_register(reg, v, out);
                }
                EOI if first == 0 => {
                    if let Some(&vector) = bytes.first() {
                        self.eoi(vector, out);
                    }
                }
                _ => {}
            }
        }
        changed
    }

    /// For each pin, the MSI it would send now, or `None` if it is masked
    /// or cannot deliver. A hypervisor that must know which vectors are
    /// level triggered (KVM's split irqchip learns it from MSI routes on
    /// GSIs 0-23) mirrors these.
    pub fn routes(&self) -> [Option<Msi>; NUM_PINS] {
        let mut r = [None; NUM_PINS];
        for (pin, slot) in r.iter_mut().enumerate() {
            if self.state.redirection[pin] & MASKED == 0 {
                *slot = msi_for(self.state.redirection[pin]);
            }
        }
        r
    }

    /// The guest-visible state.
    pub fn state(&self) -> IoapicState {
        self.state
    }

    /// Restores a state captured by [`Ioapic::state`]. Nothing is delivered:
    /// Remote IRR and pending edges are taken as they were. A state the I/O
    /// APIC could not hold is refused and the I/O APIC left as it was.
    pub fn restore(&mut self, state: &IoapicState) -> Result<(), StateError> {
        state.validate()?;
        self.state = *state;
        self.logged = 0;
        Ok(())
    }

    fn read_register(&self, reg: u8) -> u32 {
        match reg {
            REG_ID | REG_ARB => u32::from(self.state.id & 0xf) << 24,
            REG_VERSION => ((NUM_PINS as u32 - 1) << 16) | u32::from(IOAPIC_VERSION),
            REG_REDIR_FIRST..=REG_REDIR_LAST => {
                let idx = usize::from(reg - REG_REDIR_FIRST);
                let e = self.state.redirection[idx / 2];
                if idx % 2 == 0 {
                    e as u32
                } else {
                    (e >> 32) as u32
                }
            }
            _ => 0,
        }
    }

    fn write_register(&mut self, reg: u8, val: u32, out: &mut MsiBatch) -> bool {
        match reg {
            REG_ID => {
                self.state.id = ((val >> 24) & 0xf) as u8;
                false
            }
            REG_REDIR_FIRST..=REG_REDIR_LAST => {
                let idx = usize::from(reg - REG_REDIR_FIRST);
                let pin = idx / 2;
                let old = self.state.redirection[pin];
                let mut e = if idx % 2 == 0 {
                    (old & 0xffff_ffff_0000_0000)
                        | (old & (REMOTE_IRR | DELIVERY_STATUS))
                        | (u64::from(val) & LOW_WRITABLE)
                } else {
                    (old & 0xffff_ffff) | ((u64::from(val) & HIGH_WRITABLE) << 32)
                };
                let bit = 1u32 << pin;
                if is_level_entry(e) {
                    // Edges latched while the pin was an edge pin are moot.
                    self.state.pending_edges &= !bit;
                } else {
                    // Switching to edge clears Remote IRR (older Linux
                    // relies on this to recover a lost EOI).
                    e &= !REMOTE_IRR;
                }
                self.state.redirection[pin] = e;
                if e & VECTOR_MASK != old & VECTOR_MASK {
                    self.logged &= !bit;
                }
                self.service(pin, out);
                e != old
            }
            _ => false, // version, arbitration: read-only
        }
    }

    fn is_level(&self, pin: usize) -> bool {
        is_level_entry(self.state.redirection[pin])
    }

    /// Delivers `pin` if its state calls for it.
    fn service(&mut self, pin: usize, out: &mut MsiBatch) {
        let e = self.state.redirection[pin];
        if e & MASKED != 0 {
            return;
        }
        let bit = 1u32 << pin;
        let level = is_level_entry(e);
        if level {
            if self.state.lines & bit == 0 || e & REMOTE_IRR != 0 {
                return;
            }
        } else {
            if self.state.pending_edges & bit == 0 {
                return;
            }
            self.state.pending_edges &= !bit;
        }
        let Some(msi) = msi_for(e) else {
            if self.logged & bit == 0 {
                self.logged |= bit;
                log::warn!(
                    "ioapic: pin {pin} has an undeliverable entry {e:#018x} (vector {:#x}, delivery mode {}); interrupt not delivered",
                    e & VECTOR_MASK,
                    delivery_mode(e)
                );
            }
            return;
        };
        if level {
            self.state.redirection[pin] |= REMOTE_IRR;
        }
        out.push(msi);
    }
}

fn delivery_mode(e: u64) -> u8 {
    ((e >> DELIVERY_MODE_SHIFT) & 7) as u8
}

/// Level semantics (Remote IRR, EOI) apply to fixed and lowest-priority
/// entries only; the other delivery modes are edge by definition.
fn is_level_entry(e: u64) -> bool {
    e & TRIGGER_LEVEL != 0 && matches!(delivery_mode(e), DM_FIXED | DM_LOWEST)
}

/// The MSI for a redirection entry, or `None` if it cannot be delivered.
fn msi_for(e: u64) -> Option<Msi> {
    let vector = (e & VECTOR_MASK) as u8;
    let dm = delivery_mode(e);
    match dm {
        DM_FIXED | DM_LOWEST if vector < 0x10 => return None,
        DM_FIXED | DM_LOWEST | DM_SMI | DM_NMI | DM_INIT | DM_EXTINT => {}
        _ => return None, // reserved
    }
    let dest = (e >> DEST_SHIFT) & 0xff;
    let mut address = MSI_ADDRESS_BASE | (dest << MSI_ADDR_DEST_SHIFT);
    if e & DEST_MODE_LOGICAL != 0 {
        address |= MSI_ADDR_DEST_MODE_LOGICAL;
    }
    let mut data = u32::from(vector) | (u32::from(dm) << MSI_DATA_DELIVERY_MODE_SHIFT);
    if is_level_entry(e) {
        data |= MSI_DATA_TRIGGER_LEVEL | MSI_DATA_LEVEL_ASSERT;
    }
    Some(Msi { address, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(io: &mut Ioapic, reg: u8, val: u32) -> Vec<Msi> {
        let mut out = MsiBatch::new();
        io.write(IOREGSEL, &u32::from(reg).to_le_bytes(), &mut out);
        io.write(IOWIN, &val.to_le_bytes(), &mut out);
        out.as_slice().to_vec()
    }

    fn rd(io: &Ioapic, reg: u8) -> u32 {
        let mut out = MsiBatch::new();
        let mut io2 = io.clone();
        io2.write(IOREGSEL, &[reg], &mut out);
        let mut d = [0u8; 4];
        io2.read(IOWIN, &mut d);
        u32::from_le_bytes(d)
    }

    /// Programs `pin`: low dword `low`, destination `dest`.
    fn program(io: &mut Ioapic, pin: u8, low: u32, dest: u8) -> Vec<Msi> {
        let mut v = wr(io, 0x11 + 2 * pin, u32::from(dest) << 24);
        v.extend(wr(io, 0x10 + 2 * pin, low));
        v
    }

    fn set(io: &mut Ioapic, pin: usize, level: bool) -> Vec<Msi> {
        let mut out = MsiBatch::new();
        io.set_irq(pin, level, &mut out);
        out.as_slice().to_vec()
    }

    fn eoi(io: &mut Ioapic, vector: u8) -> Vec<Msi> {
        let mut out = MsiBatch::new();
        io.eoi(vector, &mut out);
        out.as_slice().to_vec()
    }

    const LEVEL: u32 = 1 << 15;
    const MASK: u32 = 1 << 16;
    const LOGICAL: u32 = 1 << 11;

    fn fixed(vector: u8, dest: u64) -> Msi {
        Msi {
            address: 0xfee0_0000 | dest << 12,
            data: u32::from(vector),
        }
    }

    #[test]
    fn identification_registers() {
        let mut io = Ioapic::new();
        assert_eq!(rd(&io, 1), 0x0017_0020);
        assert_eq!(rd(&io, 0), 0);
        wr(&mut io, 0, 0x0f00_0000 | 0xffff);
        assert_eq!(rd(&io, 0), 0x0f00_0000);
        assert_eq!(rd(&io, 2), 0x0f00_0000);
        wr(&mut io, 1, 0xffff_ffff);
        assert_eq!(rd(&io, 1), 0x0017_0020, "read-only");
        assert_eq!(rd(&io, 0x40), 0);
        assert_eq!(rd(&io, 0xff), 0);
        // IOREGSEL reads back.
        let mut out = MsiBatch::new();
        io.write(0, &[0x12, 0x34, 0x56, 0x78], &mut out);
        let mut d = [0u8; 4];
        io.read(0, &mut d);
        assert_eq!(d, [0x12, 0, 0, 0]);
    }

    #[test]
    fn reset_state_masked() {
        let io = Ioapic::new();
        for pin in 0..NUM_PINS as u8 {
            assert_eq!(rd(&io, 0x10 + 2 * pin), 1 << 16);
            assert_eq!(rd(&io, 0x11 + 2 * pin), 0);
        }
        assert!(io.routes().iter().all(Option::is_none));
    }

    #[test]
    fn edge_delivers_on_rising_edge_to_programmed_destination() {
        let mut io = Ioapic::new();
        assert!(program(&mut io, 4, 0x31, 3).is_empty());
        assert_eq!(rd(&io, 0x18), 0x31);
        assert_eq!(rd(&io, 0x19), 0x0300_0000);
        assert_eq!(set(&mut io, 4, true), vec![fixed(0x31, 3)]);
        assert!(set(&mut io, 4, true).is_empty(), "no new edge");
        assert!(set(&mut io, 4, false).is_empty());
        assert_eq!(set(&mut io, 4, true), vec![fixed(0x31, 3)]);
        assert!(eoi(&mut io, 0x31).is_empty(), "edge: EOI does nothing");

        // Logical destination, lowest priority.
        program(&mut io, 5, 0x41 | (1 << 8) | LOGICAL, 0x0f);
        assert_eq!(
            set(&mut io, 5, true),
            vec![Msi {
                address: 0xfee0_f004,
                data: 0x141
            }]
        );
    }

    #[test]
    fn level_remote_irr_and_redelivery_on_eoi() {
        let mut io = Ioapic::new();
        program(&mut io, 9, 0x59 | LEVEL, 1);
        let m = Msi {
            address: 0xfee0_1000,
            data: 0x59 | 1 << 15 | 1 << 14,
        };
        assert_eq!(set(&mut io, 9, true), vec![m]);
        assert_ne!(rd(&io, 0x10 + 18) & (1 << 14), 0, "remote IRR");
        // Re-asserting while Remote IRR is set does nothing.
        assert!(set(&mut io, 9, true).is_empty());
        // EOI with the line still high: delivered again.
        assert_eq!(eoi(&mut io, 0x59), vec![m]);
        // Line drops, then EOI: nothing more.
        set(&mut io, 9, false);
        assert!(eoi(&mut io, 0x58).is_empty(), "other vector");
        assert!(eoi(&mut io, 0x59).is_empty());
        assert_eq!(rd(&io, 0x10 + 18) & (1 << 14), 0);
        // The guest cannot write Remote IRR.
        wr(&mut io, 0x10 + 18, 0x59 | LEVEL | (1 << 14));
        assert_eq!(rd(&io, 0x10 + 18) & (1 << 14), 0);

        // The EOI register (v0x20) works like the LAPIC's EOI exit.
        assert_eq!(set(&mut io, 9, true), vec![m]);
        let mut out = MsiBatch::new();
        io.write(EOI, &[0x59, 0, 0, 0], &mut out);
        assert_eq!(out.as_slice(), &[m]);
    }

    #[test]
    fn masked_pins_remember() {
        let mut io = Ioapic::new();
        // Level line asserted while masked: delivered on unmask.
        program(&mut io, 10, 0x60 | LEVEL | MASK, 0);
        assert!(set(&mut io, 10, true).is_empty());
        let v = wr(&mut io, 0x10 + 20, 0x60 | LEVEL);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].data & 0xff, 0x60);
        // Mask while in service, EOI, unmask with line still high: again.
        wr(&mut io, 0x10 + 20, 0x60 | LEVEL | MASK);
        assert!(eoi(&mut io, 0x60).is_empty());
        assert_eq!(wr(&mut io, 0x10 + 20, 0x60 | LEVEL).len(), 1);

        // An edge that arrives while masked is delivered on unmask, once.
        program(&mut io, 3, 0x33 | MASK, 0);
        set(&mut io, 3, true);
        set(&mut io, 3, false);
        set(&mut io, 3, true);
        assert_eq!(wr(&mut io, 0x16, 0x33), vec![fixed(0x33, 0)]);
        assert!(wr(&mut io, 0x16, 0x33).is_empty());
    }

    #[test]
    fn illegal_vectors_and_modes() {
        let mut io = Ioapic::new();
        program(&mut io, 1, 0x0f, 0);
        assert!(set(&mut io, 1, true).is_empty(), "vector < 0x10");
        set(&mut io, 1, false);
        assert!(set(&mut io, 1, true).is_empty());
        assert!(io.routes()[1].is_none());
        // Level pin with illegal vector: no Remote IRR, delivered once fixed.
        program(&mut io, 2, 0x05 | LEVEL, 0);
        assert!(set(&mut io, 2, true).is_empty());
        assert_eq!(rd(&io, 0x14) & (1 << 14), 0);
        assert_eq!(wr(&mut io, 0x14, 0x25 | LEVEL).len(), 1);

        // NMI passes through, edge even if programmed level; vector ignored.
        program(&mut io, 6, 0x02 | (4 << 8) | LEVEL, 2);
        let v = set(&mut io, 6, true);
        assert_eq!(
            v,
            vec![Msi {
                address: 0xfee0_2000,
                data: 0x402
            }]
        );
        assert_eq!(rd(&io, 0x1c) & (1 << 14), 0, "no Remote IRR for NMI");
        // ExtINT, INIT, SMI pass through as well.
        for (pin, dm) in [(7u8, 7u32), (8, 5), (11, 2)] {
            program(&mut io, pin, dm << 8, 0);
            let v = set(&mut io, usize::from(pin), true);
            assert_eq!(v.len(), 1);
            assert_eq!(v[0].data, dm << 8);
        }
        // Reserved delivery modes are not delivered.
        program(&mut io, 12, 0x40 | (3 << 8), 0);
        assert!(set(&mut io, 12, true).is_empty());
        program(&mut io, 13, 0x40 | (6 << 8), 0);
        assert!(set(&mut io, 13, true).is_empty());
    }

    #[test]
    fn switching_to_edge_clears_remote_irr() {
        let mut io = Ioapic::new();
        program(&mut io, 16, 0x70 | LEVEL, 0);
        assert_eq!(set(&mut io, 16, true).len(), 1);
        wr(&mut io, 0x30, 0x70);
        assert_eq!(rd(&io, 0x30) & (1 << 14), 0);
        // Back to level with the line still high: delivered.
        assert_eq!(wr(&mut io, 0x30, 0x70 | LEVEL).len(), 1);
    }

    #[test]
    fn routes_reflect_entries() {
        let mut io = Ioapic::new();
        let mut out = MsiBatch::new();
        io.write(IOREGSEL, &[0x10 + 2 * 23], &mut out);
        assert!(io.write(IOWIN, &(0x99 | LEVEL).to_le_bytes(), &mut out));
        assert!(!io.write(IOWIN, &(0x99 | LEVEL).to_le_bytes(), &mut out));
        io.write(IOREGSEL, &[0x11 + 2 * 23], &mut out);
        assert!(io.write(IOWIN, &0x0500_0000u32.to_le_bytes(), &mut out));
        let r = io.routes();
        assert_eq!(
            r[23],
            Some(Msi {
                address: 0xfee0_5000,
                data: 0xc099
            })
        );
        assert!(r[..23].iter().all(Option::is_none));
    }

    #[test]
    fn partial_and_odd_accesses() {
        let mut io = Ioapic::new();
        let mut out = MsiBatch::new();
        io.write(IOREGSEL, &[0x10], &mut out);
        // Byte write of the vector only: the mask bit (byte 2) stays.
        io.write(IOWIN, &[0x44], &mut out);
        assert_eq!(rd(&io, 0x10), 0x0001_0044);
        io.write(IOWIN + 2, &[0x00], &mut out);
        assert_eq!(rd(&io, 0x10), 0x44);
        // A 64-bit read of IOWIN returns the register then zeros.
        let mut d = [0xaau8; 8];
        io.read(IOWIN, &mut d);
        assert_eq!(d, [0x44, 0, 0, 0, 0, 0, 0, 0]);
        let mut d = [0xaau8; 2];
        io.read(IOWIN + 1, &mut d);
        assert_eq!(d, [0, 0]);
        io.read(0x20, &mut d);
        assert_eq!(d, [0, 0]);
        io.read(u64::MAX, &mut d);
        io.write(u64::MAX - 1, &[1, 2, 3, 4], &mut out);
        io.write(0x41, &[0x44], &mut out); // not the EOI byte
        io.read(0, &mut []);
        io.write(0, &[], &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn restore_round_trip() {
        let mut io = Ioapic::new();
        program(&mut io, 9, 0x59 | LEVEL, 1);
        set(&mut io, 9, true);
        let st = io.state();
        let json = serde_json::to_string(&st).unwrap();
        let carried: IoapicState = serde_json::from_str(&json).unwrap();
        let mut io2 = Ioapic::new();
        io2.restore(&carried).unwrap();
        assert_eq!(io2.state(), st);
        assert!(set(&mut io2, 9, true).is_empty(), "Remote IRR restored");
        assert_eq!(eoi(&mut io2, 0x59).len(), 1);
        let good = io2.state();
        for bad in [
            IoapicState { id: 0x10, ..good },
            IoapicState {
                lines: 1 << 24,
                ..good
            },
            IoapicState {
                pending_edges: u32::MAX,
                ..good
            },
            {
                let mut b = good;
                b.redirection[3] |= 1 << 40; // reserved high bits
                b
            },
            {
                let mut b = good;
                b.redirection[23] |= 1 << 17; // reserved low bits
                b
            },
        ] {
            assert!(io2.restore(&bad).is_err(), "{bad:?}");
            assert_eq!(io2.state(), good, "unchanged");
        }
        assert!(serde_json::from_str::<IoapicState>(
            &json.replace("\"redirection\":[", "\"redirection\":[1,")
        )
        .is_err());
        let _ = format!("{:?}", MsiBatch::new());
    }

    #[test]
    fn garbage_never_panics() {
        let mut rng = crate::test_util::XorShift(0xdead_beef_cafe_f00d);
        let mut io = Ioapic::new();
        let mut buf = [0u8; 16];
        for _ in 0..50_000 {
            let r = rng.next();
            let mut out = MsiBatch::new();
            let offset = match r % 4 {
                0 => r >> 40,
                1 => (r >> 8) % 0x50,
                _ => [IOREGSEL, IOWIN][(r >> 8) as usize & 1],
            };
            let len = ((r >> 16) % 17) as usize;
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            match (r >> 32) % 5 {
                0 => io.read(offset, &mut buf[..len]),
                1 | 2 => {
                    io.write(offset, &buf[..len], &mut out);
                }
                3 => io.set_irq((r >> 48) as usize % 30, r & (1 << 60) != 0, &mut out),
                _ => io.eoi((r >> 48) as u8, &mut out),
            }
            assert!(out.as_slice().len() <= NUM_PINS);
            for m in out.as_slice() {
                assert_eq!(m.address & 0xfff0_0000, 0xfee0_0000);
            }
        }
        // Whatever the guest did, the state it left restores.
        let st = io.state();
        let mut io2 = Ioapic::new();
        io2.restore(&st).unwrap();
        assert_eq!(io2.state(), st);
    }
}
