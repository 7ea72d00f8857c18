//! The function's type-0 configuration header and the guest-written fields of the
//! PCI-configuration-access capability. The MSI-X capability is served by `pci::msix`.

use serde::{Deserialize, Serialize};

use super::layout::{CAP_MSIX, CAP_PCI_CFG, PCI_CFG_DATA};

const COMMAND: usize = 0x04;
const CLASS_REVISION: usize = 0x08;
const HEADER: usize = 0x0c;
const BAR0: usize = 0x10;
const BAR1: usize = 0x14;
const SUBSYSTEM: usize = 0x2c;
const CAPABILITIES_POINTER: usize = 0x34;
const INTERRUPT: usize = 0x3c;

/// Command bits this function implements: memory space, bus master, parity error
/// response, SERR# enable, INTx disable. It has no I/O BAR.
const COMMAND_WRITABLE: u16 = 0x0002 | 0x0004 | 0x0040 | 0x0100 | 0x0400;
/// The command register's memory-space-enable bit.
pub const COMMAND_MEMORY: u16 = 0x0002;
/// The command register's INTx-disable bit.
pub const COMMAND_INTX_DISABLE: u16 = 0x0400;
const STATUS_INTERRUPT: u16 = 0x0008;
const STATUS_CAPABILITIES: u16 = 0x0010;
/// BAR0's type bits: memory, 64-bit, not prefetchable.
const BAR_MEMORY_64: u32 = 0b100;

/// Configuration-space size of a conventional PCI function.
pub const CONFIG_SIZE: usize = 256;

/// What identifies the function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub vendor_id: u16,
    pub device_id: u16,
    pub revision: u8,
    /// Class, subclass and programming interface, as 0xCCSSPP.
    pub class_code: u32,
    pub subsystem_vendor_id: u16,
    pub subsystem_id: u16,
}

/// The PCI-configuration-access capability's fields the driver writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CfgWindow {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
    pub data: [u8; 4],
}

/// The writable header registers, as saved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRegs {
    pub command: u16,
    pub cache_line_size: u8,
    pub latency_timer: u8,
    pub bar_address: u64,
    pub interrupt_line: u8,
    pub window: CfgWindow,
}

/// What a configuration write asks of the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteEffect {
    None,
    /// The command register changed; the transport re-reads the INTx-disable bit.
    Command,
    /// The driver wrote `pci_cfg_data`: write the window's bytes to the BAR.
    WindowWrite,
}

/// The header registers and the fixed bytes around them.
#[derive(Clone, Debug)]
pub struct ConfigSpace {
    fixed: [u8; CONFIG_SIZE],
    bar_size: u64,
    pub regs: HeaderRegs,
}

impl ConfigSpace {
    /// A header for `identity`, BAR0 of `bar_size` bytes (a power of two), INTA routed to
    /// `interrupt_line`, with `capabilities` (offset, bytes) after the MSI-X capability.
    pub fn new(
        identity: &Identity,
        bar_size: u64,
        interrupt_line: u8,
        capabilities: &[(u8, Vec<u8>)],
    ) -> Self {
        let mut fixed = [0u8; CONFIG_SIZE];
        put(&mut fixed, 0, &identity.vendor_id.to_le_bytes());
        put(&mut fixed, 2, &identity.device_id.to_le_bytes());
        let class_revision = (identity.class_code << 8) | u32::from(identity.revision);
        put(&mut fixed, CLASS_REVISION, &class_revision.to_le_bytes());
        put(
            &mut fixed,
            SUBSYSTEM,
            &identity.subsystem_vendor_id.to_le_bytes(),
        );
        put(
            &mut fixed,
            SUBSYSTEM + 2,
            &identity.subsystem_id.to_le_bytes(),
        );
        fixed[CAPABILITIES_POINTER] = CAP_MSIX;
        fixed[INTERRUPT + 1] = 1; // INTA
        for (offset, bytes) in capabilities {
            put(&mut fixed, usize::from(*offset), bytes);
        }
        ConfigSpace {
            fixed,
            bar_size,
            regs: HeaderRegs {
                interrupt_line,
                ..Default::default()
            },
        }
    }

    /// Reads dword `offset` (a multiple of 4). `intx_pending` is the Interrupt Status bit.
    pub fn read(&self, offset: usize, intx_pending: bool) -> u32 {
        let regs = &self.regs;
        match offset {
            COMMAND => {
                let mut status = STATUS_CAPABILITIES;
                if intx_pending {
                    status |= STATUS_INTERRUPT;
                }
                u32::from(regs.command) | (u32::from(status) << 16)
            }
            HEADER => u32::from(regs.cache_line_size) | (u32::from(regs.latency_timer) << 8),
            BAR0 => regs.bar_address as u32 | BAR_MEMORY_64,
            BAR1 => (regs.bar_address >> 32) as u32,
            INTERRUPT => u32::from(regs.interrupt_line) | (self.fixed_dword(INTERRUPT) & !0xff),
            o if o == usize::from(CAP_PCI_CFG) + 4 => {
                (self.fixed_dword(o) & !0xff) | u32::from(regs.window.bar)
            }
            o if o == usize::from(CAP_PCI_CFG) + 8 => regs.window.offset,
            o if o == usize::from(CAP_PCI_CFG) + 12 => regs.window.length,
            o if o == usize::from(PCI_CFG_DATA) => u32::from_le_bytes(regs.window.data),
            o => self.fixed_dword(o),
        }
    }

    /// Writes `data` at byte `start`; the bytes stay within one dword.
    pub fn write(&mut self, start: usize, data: &[u8]) -> WriteEffect {
        let dword = start & !3;
        let sub = start & 3;
        let data = &data[..data.len().min(4 - sub)];
        let mut bytes = self.read(dword, false).to_le_bytes();
        bytes[sub..sub + data.len()].copy_from_slice(data);
        let value = u32::from_le_bytes(bytes);
        let touched = |byte: usize| (sub..sub + data.len()).contains(&byte);
        let regs = &mut self.regs;
        match dword {
            COMMAND if touched(0) || touched(1) => {
                regs.command = value as u16 & COMMAND_WRITABLE;
                return WriteEffect::Command;
            }
            HEADER => {
                regs.cache_line_size = bytes[0];
                regs.latency_timer = bytes[1];
            }
            BAR0 => {
                let mask = !(self.bar_size - 1) as u32;
                regs.bar_address = (regs.bar_address & !0xffff_ffff) | u64::from(value & mask);
            }
            BAR1 => {
                let mask = !(self.bar_size - 1) >> 32;
                let high = u64::from(value) & mask;
                regs.bar_address = (regs.bar_address & 0xffff_ffff) | (high << 32);
            }
            INTERRUPT => regs.interrupt_line = bytes[0],
            o if o == usize::from(CAP_PCI_CFG) + 4 => regs.window.bar = bytes[0],
            o if o == usize::from(CAP_PCI_CFG) + 8 => regs.window.offset = value,
            o if o == usize::from(CAP_PCI_CFG) + 12 => regs.window.length = value,
            o if o == usize::from(PCI_CFG_DATA) => {
                regs.window.data = bytes;
                return WriteEffect::WindowWrite;
            }
            _ => {}
        }
        WriteEffect::None
    }

    /// Whether `regs` is a state this header could be in.
    pub fn check(&self, regs: &HeaderRegs) -> Result<(), String> {
        if regs.command & !COMMAND_WRITABLE != 0 {
            return Err(format!("command {:#x}", regs.command));
        }
        if regs.bar_address & (self.bar_size - 1) != 0 {
            return Err(format!("BAR0 address {:#x}", regs.bar_address));
        }
        Ok(())
    }

    fn fixed_dword(&self, offset: usize) -> u32 {
        self.fixed
            .get(offset..offset + 4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u32::from_le_bytes)
    }
}

fn put(image: &mut [u8], offset: usize, bytes: &[u8]) {
    image[offset..offset + bytes.len()].copy_from_slice(bytes);
}
