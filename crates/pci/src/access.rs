//! The guest's ways into the bus: configuration mechanism #1 (ports 0xcf8–0xcff), ECAM,
//! and the BAR windows. Each is a [`BusDevice`] on the machine's (immutable) PIO or MMIO
//! bus, served through `&self`; configuration accesses go to [`PciBus`], BAR accesses
//! through the dispatch table the bus keeps up to date.
//!
//! A BAR access takes no lock but the function's own: the window reads the current table
//! without a lock ([`ArcSwap`]) and calls the function. Two vCPUs using two functions
//! never wait on each other, even while one function is slow (a virtio device pausing
//! its I/O threads).

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use devices::bus::BusDevice;

use crate::bus::{BarTable, PciBus, SharedDevice, Space};

/// Configuration address register: enable bit.
const CONFIG_ENABLE: u32 = 1 << 31;
/// The bits of the address register that hold something (enable, bus, device, function,
/// register); reserved bits 30:24 and 1:0 read as zero.
const CONFIG_ADDRESS_MASK: u32 = 0x80ff_fffc;
/// Offset of the data ports (0xcfc) from the address port (0xcf8).
const DATA_OFFSET: u64 = 4;

/// A configuration access: bus, device, function and byte offset in the function's space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ConfigAddress {
    bus: u8,
    device: u8,
    function: u8,
    register: u16,
}

/// Reads `data.len()` bytes at `at`: accesses of 1, 2 or 4 bytes inside one dword are
/// served, anything else reads as all ones.
fn read_config(bus: &PciBus, at: ConfigAddress, data: &mut [u8]) {
    let sub = usize::from(at.register & 3);
    if !matches!(data.len(), 1 | 2 | 4) || sub + data.len() > 4 {
        data.fill(0xff);
        return;
    }
    let dword = bus.config_read(at.bus, at.device, at.function, at.register & !3);
    data.copy_from_slice(&dword.to_le_bytes()[sub..sub + data.len()]);
}

/// The write counterpart of [`read_config`]; other accesses are dropped.
fn write_config(bus: &PciBus, at: ConfigAddress, data: &[u8]) {
    let sub = at.register & 3;
    if !matches!(data.len(), 1 | 2 | 4) || usize::from(sub) + data.len() > 4 {
        return;
    }
    bus.config_write(
        at.bus,
        at.device,
        at.function,
        at.register & !3,
        sub as u8,
        data,
    );
}

/// Port 0xcf9 within the configuration ports.
const RESET_CONTROL_OFFSET: u64 = 1;
const RESET_HARD: u8 = 1 << 1;
const RESET_CPU: u8 = 1 << 2;

/// Configuration mechanism #1: the address latch at 0xcf8 (dword accesses only; other
/// sizes there reach nothing, as on a PC where 0xcf9 is another register) and the data
/// window at 0xcfc–0xcff. Its two registers are atomics: one vCPU's configuration cycle
/// never waits on another's (the latch is shared by all vCPUs, as on real hardware).
pub struct ConfigPorts {
    bus: Arc<PciBus>,
    address: AtomicU32,
    /// The PIIX reset control register, a byte at 0xcf9 (inside the address dword's
    /// ports, told apart by its width): bit 1 selects a hard reset, bit 2 resets the CPU.
    reset_control: AtomicU8,
}

impl ConfigPorts {
    pub fn new(bus: Arc<PciBus>) -> Self {
        ConfigPorts {
            bus,
            address: AtomicU32::new(0),
            reset_control: AtomicU8::new(0),
        }
    }

    /// Where the data ports point, or `None` while the enable bit is clear.
    fn target(&self, data_offset: u64) -> Option<ConfigAddress> {
        let a = self.address.load(Ordering::Acquire);
        if a & CONFIG_ENABLE == 0 {
            return None;
        }
        Some(ConfigAddress {
            bus: (a >> 16) as u8,
            device: ((a >> 11) & 0x1f) as u8,
            function: ((a >> 8) & 0x7) as u8,
            register: (a & 0xfc) as u16 + data_offset as u16,
        })
    }
}

impl BusDevice for ConfigPorts {
    fn read(&self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => {
                data.copy_from_slice(&self.address.load(Ordering::Acquire).to_le_bytes())
            }
            RESET_CONTROL_OFFSET if data.len() == 1 => {
                data[0] = self.reset_control.load(Ordering::Acquire)
            }
            DATA_OFFSET..=7 => match self.target(offset - DATA_OFFSET) {
                Some(at) => read_config(&self.bus, at, data),
                None => data.fill(0xff),
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&self, offset: u64, data: &[u8]) {
        match offset {
            0 => {
                if let Ok(bytes) = <[u8; 4]>::try_from(data) {
                    let address = u32::from_le_bytes(bytes) & CONFIG_ADDRESS_MASK;
                    self.address.store(address, Ordering::Release);
                }
            }
            RESET_CONTROL_OFFSET if data.len() == 1 => {
                let value = data[0] & (RESET_HARD | RESET_CPU);
                // The reset fires on the CPU bit's rising edge, once however many race.
                let before = self.reset_control.swap(value, Ordering::AcqRel);
                if value & RESET_CPU != 0 && before & RESET_CPU == 0 {
                    self.bus.request_reset();
                }
            }
            DATA_OFFSET..=7 => {
                if let Some(at) = self.target(offset - DATA_OFFSET) {
                    write_config(&self.bus, at, data);
                }
            }
            _ => {}
        }
    }
}

/// ECAM: bus 0's configuration space memory-mapped, offset = device << 15 | function <<
/// 12 | register.
pub struct Ecam {
    bus: Arc<PciBus>,
}

impl Ecam {
    pub fn new(bus: Arc<PciBus>) -> Self {
        Ecam { bus }
    }
}

fn ecam_address(offset: u64) -> ConfigAddress {
    ConfigAddress {
        bus: (offset >> 20) as u8,
        device: ((offset >> 15) & 0x1f) as u8,
        function: ((offset >> 12) & 0x7) as u8,
        register: (offset & 0xfff) as u16,
    }
}

impl BusDevice for Ecam {
    fn read(&self, offset: u64, data: &mut [u8]) {
        read_config(&self.bus, ecam_address(offset), data);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        write_config(&self.bus, ecam_address(offset), data);
    }
}

/// One BAR window (32-bit MMIO, 64-bit MMIO or I/O): forwards an access to the BAR that
/// decodes it; where none does, reads are all ones and writes are dropped.
pub struct BarWindow {
    base: u64,
    space: Space,
    table: Arc<ArcSwap<BarTable>>,
}

impl BarWindow {
    pub(crate) fn new(base: u64, space: Space, table: Arc<ArcSwap<BarTable>>) -> Self {
        BarWindow { base, space, table }
    }

    /// The function decoding `[offset, offset + len)`, its BAR and the offset in it, read
    /// from the table as it is now without a lock (a BAR moving meanwhile publishes a new
    /// table; this access completes against the one it read, as if it came first).
    fn find(&self, offset: u64, len: usize) -> Option<(SharedDevice, usize, u64)> {
        let addr = self.base.checked_add(offset)?;
        self.table.load().lookup(self.space, addr, len)
    }
}

impl BusDevice for BarWindow {
    fn read(&self, offset: u64, data: &mut [u8]) {
        match self.find(offset, data.len()) {
            Some((device, bar, at)) => device
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .bar_read(bar, at, data),
            None => data.fill(0xff),
        }
    }

    fn write(&self, offset: u64, data: &[u8]) {
        if let Some((device, bar, at)) = self.find(offset, data.len()) {
            device
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .bar_write(bar, at, data);
        }
    }
}
