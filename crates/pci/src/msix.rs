//! MSI-X: the capability's message control, the vector table and the pending-bit array
//! (PCI Local Bus 3.0, section 6.8.2), as a function keeps them in one of its BARs.
//!
//! [`Msix`] owns the state and the function's [`MsiTarget`]. It tells the target every
//! time an entry's *effective* message changes (what a fire would deliver: the entry's
//! message while MSI-X is enabled and neither the function nor the entry is masked,
//! otherwise nothing), so that a KVM VMM can keep one GSI route and irqfd per vector.
//! [`Msix::notify`] fires an unmasked vector or records it in the pending-bit array; the
//! pending message is delivered when the guest unmasks the entry or the function.
//!
//! Guest accesses: the PCI spec lets software use aligned 4- and 8-byte accesses only.
//! Reads of any size or alignment are answered from the table's bytes; other writes are
//! ignored. Nothing here panics on guest input.
//!
//! The target is called with the caller's locks held (a device keeps its `Msix` under a
//! lock that its I/O threads share), so an `MsiTarget` must not call back into the device.

use std::fmt;
use std::sync::Arc;

use devices::StateError;
use serde::{Deserialize, Serialize};

use crate::{MsiMessage, MsiTarget};

/// The MSI-X capability ID.
pub const MSIX_CAP_ID: u8 = 0x11;
/// Length of the MSI-X capability in configuration space.
pub const MSIX_CAP_LEN: usize = 12;
/// The most entries a table can have (the Table Size field is 11 bits).
pub const MAX_TABLE_SIZE: u16 = 2048;
/// Bytes per table entry.
pub const ENTRY_SIZE: u64 = 16;

/// Message control: MSI-X enable.
const CONTROL_ENABLE: u16 = 1 << 15;
/// Message control: function mask.
const CONTROL_FUNCTION_MASK: u16 = 1 << 14;
/// Vector control: the entry is masked.
const VECTOR_MASKED: u32 = 1;

const STATE_DEVICE: &str = "msix";

/// One vector table entry as the guest programs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixEntry {
    pub address_lo: u32,
    pub address_hi: u32,
    pub data: u32,
    /// Bit 0: the entry is masked. The other bits are reserved (read as zero).
    pub vector_control: u32,
}

impl Default for MsixEntry {
    /// Every entry comes out of reset masked.
    fn default() -> Self {
        MsixEntry {
            address_lo: 0,
            address_hi: 0,
            data: 0,
            vector_control: VECTOR_MASKED,
        }
    }
}

impl MsixEntry {
    fn masked(&self) -> bool {
        self.vector_control & VECTOR_MASKED != 0
    }

    fn message(&self) -> MsiMessage {
        MsiMessage {
            address: (u64::from(self.address_hi) << 32) | u64::from(self.address_lo),
            data: self.data,
        }
    }

    fn dword(&self, index: u64) -> u32 {
        match index {
            0 => self.address_lo,
            1 => self.address_hi,
            2 => self.data,
            _ => self.vector_control,
        }
    }

    fn set_dword(&mut self, index: u64, value: u32) {
        match index {
            0 => self.address_lo = value,
            1 => self.address_hi = value,
            2 => self.data = value,
            _ => self.vector_control = value & VECTOR_MASKED,
        }
    }
}

/// Where the table and the PBA live: a BAR index (BIR) and an 8-byte-aligned offset each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixLocation {
    pub table_bar: u8,
    pub table_offset: u32,
    pub pba_bar: u8,
    pub pba_offset: u32,
}

/// The saved state of an [`Msix`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixState {
    pub enabled: bool,
    pub function_mask: bool,
    pub table: Vec<MsixEntry>,
    /// The pending bits, 64 vectors per word (the PBA's layout).
    pub pending: Vec<u64>,
}

/// What [`Msix::notify`] did with a vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notified {
    /// The message went to the target.
    Fired,
    /// The entry or the function is masked: the vector's pending bit is set.
    Pending,
    /// MSI-X is disabled: the function signals through INTx instead.
    Disabled,
    /// The vector is beyond the table; nothing was sent.
    NoSuchVector,
}

/// Why an [`Msix`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsixError {
    #[error("MSI-X table size {0} is outside 1..=2048")]
    TableSize(u16),
    #[error("MSI-X {0} offset {1:#x} is not 8-byte aligned")]
    Unaligned(&'static str, u32),
    #[error("MSI-X {0} BAR index {1} is beyond BAR 5")]
    BadBar(&'static str, u8),
}

/// A function's MSI-X state and where its messages go.
pub struct Msix {
    location: MsixLocation,
    enabled: bool,
    function_mask: bool,
    table: Vec<MsixEntry>,
    pending: Vec<u64>,
    target: Arc<dyn MsiTarget>,
}

impl fmt::Debug for Msix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Msix")
            .field("location", &self.location)
            .field("enabled", &self.enabled)
            .field("function_mask", &self.function_mask)
            .field("table", &self.table)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

impl Msix {
    /// A table of `table_size` entries at `location`, all masked, MSI-X disabled.
    pub fn new(
        table_size: u16,
        location: MsixLocation,
        target: Arc<dyn MsiTarget>,
    ) -> Result<Self, MsixError> {
        if table_size == 0 || table_size > MAX_TABLE_SIZE {
            return Err(MsixError::TableSize(table_size));
        }
        for (what, bar, offset) in [
            ("table", location.table_bar, location.table_offset),
            ("PBA", location.pba_bar, location.pba_offset),
        ] {
            if bar > 5 {
                return Err(MsixError::BadBar(what, bar));
            }
            if !offset.is_multiple_of(8) {
                return Err(MsixError::Unaligned(what, offset));
            }
        }
        Ok(Msix {
            location,
            enabled: false,
            function_mask: false,
            table: vec![MsixEntry::default(); usize::from(table_size)],
            pending: vec![0; pba_words(table_size)],
            target,
        })
    }

    /// Number of table entries.
    pub fn table_size(&self) -> u16 {
        self.table.len() as u16 // at most MAX_TABLE_SIZE, checked in new
    }

    /// Bytes the table occupies in its BAR.
    pub fn table_bytes(&self) -> u64 {
        table_bytes(self.table_size())
    }

    /// Bytes the PBA occupies in its BAR.
    pub fn pba_bytes(&self) -> u64 {
        pba_bytes(self.table_size())
    }

    /// Where the table and PBA live.
    pub fn location(&self) -> MsixLocation {
        self.location
    }

    /// Whether the guest enabled MSI-X.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether the whole function is masked.
    pub fn function_masked(&self) -> bool {
        self.function_mask
    }

    /// The Message Control register.
    pub fn message_control(&self) -> u16 {
        let mut control = self.table_size() - 1;
        if self.enabled {
            control |= CONTROL_ENABLE;
        }
        if self.function_mask {
            control |= CONTROL_FUNCTION_MASK;
        }
        control
    }

    /// The capability's 12 configuration bytes, `next` being the next capability pointer.
    pub fn capability(&self, next: u8) -> [u8; MSIX_CAP_LEN] {
        let mut bytes = [0u8; MSIX_CAP_LEN];
        bytes[0] = MSIX_CAP_ID;
        bytes[1] = next;
        bytes[2..4].copy_from_slice(&self.message_control().to_le_bytes());
        let table = self.location.table_offset | u32::from(self.location.table_bar);
        let pba = self.location.pba_offset | u32::from(self.location.pba_bar);
        bytes[4..8].copy_from_slice(&table.to_le_bytes());
        bytes[8..12].copy_from_slice(&pba.to_le_bytes());
        bytes
    }

    /// A guest write of `data` at byte `offset` of the capability. Only the enable and
    /// function-mask bits (the top two bits of byte 3) are writable.
    pub fn write_capability(&mut self, offset: usize, data: &[u8]) {
        let Some(index) = 3usize.checked_sub(offset) else {
            return;
        };
        if let Some(&byte) = data.get(index) {
            let control = u16::from(byte) << 8;
            self.set_control(
                control & CONTROL_ENABLE != 0,
                control & CONTROL_FUNCTION_MASK != 0,
            );
        }
    }

    /// Sets the enable and function-mask bits, telling the target about every entry whose
    /// effective message changed and delivering what became deliverable.
    pub fn set_control(&mut self, enabled: bool, function_mask: bool) {
        if enabled == self.enabled && function_mask == self.function_mask {
            return;
        }
        let before: Vec<Option<MsiMessage>> =
            (0..self.table.len()).map(|v| self.effective(v)).collect();
        self.enabled = enabled;
        self.function_mask = function_mask;
        for (vector, old) in before.into_iter().enumerate() {
            self.publish_change(vector, old);
        }
    }

    /// Reads `data.len()` bytes at `offset` of the table (any size; bytes outside the table
    /// read as zero).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = offset
                .checked_add(i as u64)
                .and_then(|at| self.table_byte(at))
                .unwrap_or(0);
        }
    }

    /// Writes the table: aligned 4- or 8-byte accesses only, others are ignored.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) {
        let aligned = matches!(data.len(), 4 | 8) && offset.is_multiple_of(data.len() as u64);
        if !aligned {
            log::debug!(
                "msix: ignored {}-byte table write at {offset:#x}",
                data.len()
            );
            return;
        }
        for (i, chunk) in data.chunks_exact(4).enumerate() {
            let mut dword = [0u8; 4];
            dword.copy_from_slice(chunk);
            self.write_table_dword(offset + 4 * i as u64, u32::from_le_bytes(dword));
        }
    }

    /// Reads `data.len()` bytes at `offset` of the PBA (bytes outside it read as zero).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = offset
                .checked_add(i as u64)
                .and_then(|at| {
                    let word = self.pending.get(usize::try_from(at / 8).ok()?)?;
                    Some(word.to_le_bytes()[(at % 8) as usize])
                })
                .unwrap_or(0);
        }
    }

    /// A guest write to the PBA: it is read-only, so nothing happens.
    pub fn write_pba(&mut self, offset: u64, data: &[u8]) {
        log::debug!("msix: ignored {}-byte PBA write at {offset:#x}", data.len());
    }

    /// Signals `vector`: fires it, or marks it pending while it or the function is masked.
    pub fn notify(&mut self, vector: u16) -> Notified {
        let index = usize::from(vector);
        let Some(entry) = self.table.get(index) else {
            return Notified::NoSuchVector;
        };
        if !self.enabled {
            return Notified::Disabled;
        }
        if self.function_mask || entry.masked() {
            self.set_pending(index, true);
            return Notified::Pending;
        }
        self.target.fire(vector);
        Notified::Fired
    }

    /// The kernel's eventfd for `vector` ([`MsiTarget::irqfd`]) while MSI-X is enabled.
    pub fn irqfd(&self, vector: u16) -> Option<std::os::fd::OwnedFd> {
        if !self.enabled || usize::from(vector) >= self.table.len() {
            return None;
        }
        self.target.irqfd(vector)
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        let index = usize::from(vector);
        self.pending
            .get(index / 64)
            .is_some_and(|word| word & (1 << (index % 64)) != 0)
    }

    /// Back to the reset state: disabled, unmasked function, every entry zero and masked,
    /// nothing pending.
    pub fn reset(&mut self) {
        let before: Vec<Option<MsiMessage>> =
            (0..self.table.len()).map(|v| self.effective(v)).collect();
        self.enabled = false;
        self.function_mask = false;
        self.table.fill(MsixEntry::default());
        self.pending.fill(0);
        for (vector, old) in before.into_iter().enumerate() {
            self.publish_change(vector, old);
        }
    }

    /// The state to save.
    pub fn save(&self) -> MsixState {
        MsixState {
            enabled: self.enabled,
            function_mask: self.function_mask,
            table: self.table.clone(),
            pending: self.pending.clone(),
        }
    }

    /// Checks that `state` fits this table, without loading it.
    pub fn validate(&self, state: &MsixState) -> Result<(), StateError> {
        validate_state(state, self.table_size())
    }

    /// Loads a saved state (refused, leaving this as it was, if it does not fit this
    /// table), then tells the target every entry's effective message.
    pub fn restore(&mut self, state: &MsixState) -> Result<(), StateError> {
        validate_state(state, self.table_size())?;
        self.enabled = state.enabled;
        self.function_mask = state.function_mask;
        self.table.copy_from_slice(&state.table);
        self.pending.copy_from_slice(&state.pending);
        for vector in 0..self.table.len() {
            self.target.update(vector as u16, self.effective(vector));
        }
        Ok(())
    }

    /// What a fire of `vector` would deliver now.
    fn effective(&self, vector: usize) -> Option<MsiMessage> {
        let entry = self.table.get(vector)?;
        (self.enabled && !self.function_mask && !entry.masked()).then(|| entry.message())
    }

    /// Tells the target if `vector`'s effective message is no longer `old`, and delivers
    /// its pending message if it just became deliverable.
    fn publish_change(&mut self, vector: usize, old: Option<MsiMessage>) {
        let new = self.effective(vector);
        if new == old {
            return;
        }
        let vector_id = vector as u16; // table index, below MAX_TABLE_SIZE
        self.target.update(vector_id, new);
        if new.is_some() && self.is_pending(vector_id) {
            self.set_pending(vector, false);
            self.target.fire(vector_id);
        }
    }

    fn write_table_dword(&mut self, offset: u64, value: u32) {
        let Ok(vector) = usize::try_from(offset / ENTRY_SIZE) else {
            return;
        };
        let old = self.effective(vector);
        let Some(entry) = self.table.get_mut(vector) else {
            return;
        };
        entry.set_dword((offset % ENTRY_SIZE) / 4, value);
        self.publish_change(vector, old);
    }

    fn table_byte(&self, offset: u64) -> Option<u8> {
        let entry = self.table.get(usize::try_from(offset / ENTRY_SIZE).ok()?)?;
        let within = offset % ENTRY_SIZE;
        Some(entry.dword(within / 4).to_le_bytes()[(within % 4) as usize])
    }

    fn set_pending(&mut self, vector: usize, pending: bool) {
        if let Some(word) = self.pending.get_mut(vector / 64) {
            let bit = 1u64 << (vector % 64);
            if pending {
                *word |= bit;
            } else {
                *word &= !bit;
            }
        }
    }
}

/// Bytes a table of `table_size` entries occupies.
pub fn table_bytes(table_size: u16) -> u64 {
    u64::from(table_size) * ENTRY_SIZE
}

/// Bytes the PBA of a table of `table_size` entries occupies (whole QWORDs).
pub fn pba_bytes(table_size: u16) -> u64 {
    pba_words(table_size) as u64 * 8
}

fn pba_words(table_size: u16) -> usize {
    usize::from(table_size).div_ceil(64)
}

fn validate_state(state: &MsixState, table_size: u16) -> Result<(), StateError> {
    if state.table.len() != usize::from(table_size) {
        return Err(StateError::new(
            STATE_DEVICE,
            format!(
                "{} table entries (this function has {table_size})",
                state.table.len()
            ),
        ));
    }
    if state.pending.len() != pba_words(table_size) {
        return Err(StateError::new(
            STATE_DEVICE,
            format!("{} PBA words", state.pending.len()),
        ));
    }
    if let Some(v) = state.table.iter().position(|e| e.vector_control & !1 != 0) {
        return Err(StateError::new(
            STATE_DEVICE,
            format!("entry {v}: reserved vector control bits set"),
        ));
    }
    let spare = usize::from(table_size) % 64;
    if let (Some(last), true) = (state.pending.last(), spare != 0) {
        if last >> spare != 0 {
            return Err(StateError::new(
                STATE_DEVICE,
                "pending bits beyond the table",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
