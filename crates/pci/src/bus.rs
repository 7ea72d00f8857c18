//! PCI bus 0: the functions in its 32 slots, their BAR placement and the table that
//! routes BAR accesses.
//!
//! # Who owns what
//!
//! - A function's configuration space, BAR registers and command register included, is
//!   the function's: it answers config reads and saves it with its own state.
//! - The bus derives from those registers which BARs decode where. After every guest
//!   write to a command register or a BAR register it re-reads that function's BARs and
//!   command register, rebuilds its dispatch table and calls [`PciDevice::bar_moved`] for
//!   each BAR whose decoding changed.
//! - The bus's own saved state records every function's BAR registers and command
//!   register; restoring it writes them back through `config_write` (as firmware would),
//!   rebuilds the table and calls `bar_moved` for every BAR. Restore the bus after the
//!   functions on it; the writes are idempotent if the functions restored the same values.
//!
//! # Decoding rule
//!
//! A BAR decodes when its space is enabled in the command register, it lies wholly inside
//! one of the layout's windows for its kind, and it overlaps no BAR that comes earlier in
//! (slot, BAR index) order. The rule depends only on the registers, never on the order of
//! the guest's writes, so the same registers always give the same table.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use arc_swap::ArcSwap;

use devices::bus::{Bus, BusError};
use devices::irqchip::IrqChip;
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use vm_allocator::{AddressAllocator, AllocPolicy, RangeInclusive};

use crate::access::{BarWindow, ConfigPorts, Ecam};
use crate::config::{
    bar_offset, validate_bar, ConfigError, IntxPin, COMMAND, COMMAND_IO, COMMAND_MEMORY,
    INTERRUPT_LINE, INTERRUPT_PIN, NUM_BARS,
};
use crate::intx::{intx_gsi, IntxLine, IntxRouter};
use crate::{BarKind, BarRequest, PciDevice};

/// Device numbers on bus 0.
pub const NUM_SLOTS: u8 = 32;
/// ECAM bytes per bus.
pub const ECAM_BUS_SIZE: u64 = 1 << 20;
/// Configuration mechanism #1: address port, then data ports 0xcfc–0xcff.
pub const CONFIG_ADDRESS_PORT: u64 = 0xcf8;
/// Ports taken by configuration mechanism #1.
pub const CONFIG_PORTS_LEN: u64 = 8;
/// Memory BARs are placed on page boundaries, each on pages of its own.
const MEMORY_BAR_ALIGN: u64 = 0x1000;
/// BAR registers saved per function.
const SAVED_BAR_REGISTERS: usize = NUM_BARS;

/// An address range `[base, base + size)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub base: u64,
    pub size: u64,
}

impl Window {
    pub const fn new(base: u64, size: u64) -> Self {
        Window { base, size }
    }

    /// Whether `[base, base + size)` lies wholly inside (a zero size never does).
    pub fn contains(&self, base: u64, size: u64) -> bool {
        size != 0 && size <= self.size && base >= self.base && base - self.base <= self.size - size
    }

    /// One past the last address, saturated.
    pub fn end(&self) -> u64 {
        self.base.saturating_add(self.size)
    }
}

/// Where the bus's address ranges go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciLayout {
    /// The ECAM window of bus 0 (1 MiB).
    pub ecam: Window,
    /// Memory BARs below 4 GiB.
    pub mmio32: Window,
    /// 64-bit memory BARs that do not fit below 4 GiB.
    pub mmio64: Window,
    /// I/O BARs.
    pub io: Window,
}

/// Why a function could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PciError {
    #[error("no free slot on PCI bus 0")]
    NoFreeSlot,
    #[error("PCI slot {0} does not exist (bus 0 has slots 0-31)")]
    BadSlot(u8),
    #[error("PCI slot {0} is already taken")]
    SlotTaken(u8),
    /// Functions 1-7 of a slot hold configuration registers only, beside a function 0.
    #[error("PCI function {slot}.{function}: {reason}")]
    BadFunction {
        slot: u8,
        function: u8,
        reason: &'static str,
    },
    #[error("PCI function {id}: {source}")]
    BadBar {
        id: String,
        #[source]
        source: ConfigError,
    },
    #[error("PCI function {id}: no room for BAR {index} ({size:#x} bytes) in the {window} window")]
    NoRoom {
        id: String,
        index: usize,
        size: u64,
        window: &'static str,
    },
    #[error("PCI function {id}: BAR {index} reads {found:#x} after being programmed with {programmed:#x}")]
    BarNotProgrammable {
        id: String,
        index: usize,
        programmed: u64,
        found: u64,
    },
    #[error("PCI layout: {0}")]
    Layout(String),
}

/// The address space a BAR decodes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Space {
    Memory,
    Io,
}

impl Space {
    fn of(kind: BarKind) -> Space {
        match kind {
            BarKind::Io => Space::Io,
            BarKind::Memory32 | BarKind::Memory64 => Space::Memory,
        }
    }
}

pub(crate) type SharedDevice = Arc<Mutex<dyn PciDevice>>;

/// A BAR decoding at `base`.
#[derive(Clone)]
pub(crate) struct Decoding {
    bar: usize,
    size: u64,
    device: SharedDevice,
}

/// What the BAR windows look addresses up in: the decoding BARs by space and base.
#[derive(Default)]
pub(crate) struct BarTable {
    memory: BTreeMap<u64, Decoding>,
    io: BTreeMap<u64, Decoding>,
}

impl BarTable {
    fn map(&mut self, space: Space) -> &mut BTreeMap<u64, Decoding> {
        match space {
            Space::Memory => &mut self.memory,
            Space::Io => &mut self.io,
        }
    }

    /// The BAR holding all of `[addr, addr + len)`: its device, index and the offset.
    pub(crate) fn lookup(
        &self,
        space: Space,
        addr: u64,
        len: usize,
    ) -> Option<(SharedDevice, usize, u64)> {
        let map = match space {
            Space::Memory => &self.memory,
            Space::Io => &self.io,
        };
        let (&base, d) = map.range(..=addr).next_back()?;
        let offset = addr - base;
        let len = (len as u64).max(1);
        if offset >= d.size || d.size - offset < len {
            return None;
        }
        Some((d.device.clone(), d.bar, offset))
    }
}

/// One BAR as its registers left it: where it asks to decode, if anywhere (its space
/// enabled and the BAR inside a window).
#[derive(Clone)]
struct Wanted {
    device: SharedDevice,
    at: Option<(Space, u64, u64)>,
}

/// The bus's derived view; its lock serializes config writes with their effects.
#[derive(Default)]
struct Derived {
    /// Per (slot, BAR index): where it asks to decode.
    wanted: BTreeMap<(u8, usize), Wanted>,
    /// Per (slot, BAR index): the base it decodes at now.
    decoded: BTreeMap<(u8, usize), u64>,
}

/// One occupied slot.
struct Slot {
    device: SharedDevice,
    id: String,
    bars: Vec<BarRequest>,
    /// BAR addresses and command bits given at [`PciBus::add_device_at`], for reset.
    initial_bases: Vec<u64>,
    initial_command: u16,
}

struct Allocators {
    mmio32: AddressAllocator,
    mmio64: AddressAllocator,
    io: AddressAllocator,
}

/// A BAR change the bus must tell a function about.
struct Moved {
    device: SharedDevice,
    bar: usize,
    base: Option<u64>,
}

/// PCI bus 0: see the module documentation.
pub struct PciBus {
    layout: PciLayout,
    slots: RwLock<Vec<Option<Slot>>>,
    /// Functions 1-7 of multi-function slots, by (slot, function): configuration space
    /// only (no BARs, no INTx), as a chipset's PM function at 00:01.3.
    functions: RwLock<std::collections::BTreeMap<(u8, u8), SharedDevice>>,
    /// Called when the guest resets the machine through the reset control register (port
    /// 0xcf9).
    reset: std::sync::OnceLock<Arc<dyn Fn() + Send + Sync>>,
    allocators: Mutex<Allocators>,
    /// What the BAR windows dispatch by: replaced whole, read without a lock.
    table: Arc<ArcSwap<BarTable>>,
    derived: Mutex<Derived>,
    intx: Arc<IntxRouter>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn allocator(w: Window, name: &str) -> Result<AddressAllocator, PciError> {
    AddressAllocator::new(w.base, w.size)
        .map_err(|e| PciError::Layout(format!("{name} window {w:x?}: {e}")))
}

impl PciBus {
    /// An empty bus 0 with `layout`'s windows, its INTx lines on `irqchip`. Slot 0 is for
    /// the host bridge ([`PciBus::add_device_at`]`(0, ..)`); [`PciBus::add_device`] starts
    /// at slot 1.
    pub fn new(layout: PciLayout, irqchip: Arc<dyn IrqChip>) -> Result<Self, PciError> {
        if layout.ecam.size != ECAM_BUS_SIZE {
            return Err(PciError::Layout(format!(
                "ECAM window of {:#x} bytes: bus 0 needs {ECAM_BUS_SIZE:#x}",
                layout.ecam.size
            )));
        }
        let mut mmio32 = allocator(layout.mmio32, "32-bit MMIO")?;
        if layout.mmio32.contains(layout.ecam.base, layout.ecam.size) {
            // A window around ECAM (firmware machines: the whole PCI hole up to the IOAPIC,
            // where BIOS firmware places BARs) never hands out the ECAM range.
            mmio32
                .allocate(
                    layout.ecam.size,
                    1,
                    AllocPolicy::ExactMatch(layout.ecam.base),
                )
                .map_err(|e| PciError::Layout(format!("ECAM inside the 32-bit window: {e}")))?;
        }
        let allocators = Allocators {
            mmio32,
            mmio64: allocator(layout.mmio64, "64-bit MMIO")?,
            io: allocator(layout.io, "I/O")?,
        };
        Ok(PciBus {
            layout,
            slots: RwLock::new((0..NUM_SLOTS).map(|_| None).collect()),
            functions: RwLock::default(),
            reset: std::sync::OnceLock::new(),
            allocators: Mutex::new(allocators),
            table: Arc::new(ArcSwap::from_pointee(BarTable::default())),
            derived: Mutex::new(Derived::default()),
            intx: IntxRouter::new(irqchip),
        })
    }

    /// The INTx line of `pin` for the function in `slot` (GSI
    /// [`crate::intx::intx_gsi`]`(slot, pin)`), shared with the other functions on that
    /// GSI; `None` for a slot that does not exist.
    pub fn intx_line(&self, slot: u8, pin: IntxPin) -> Option<IntxLine> {
        self.intx.line(slot, pin)
    }

    /// The windows this bus was built with.
    pub fn layout(&self) -> &PciLayout {
        &self.layout
    }

    /// Puts configuration mechanism #1 (ports 0xcf8–0xcff) and the I/O BAR window on
    /// `pio`, and ECAM and the two memory BAR windows on `mmio`. Call once, while the
    /// machine is being built.
    pub fn register(self: &Arc<Self>, pio: &mut Bus, mmio: &mut Bus) -> Result<(), BusError> {
        pio.insert(
            Arc::new(ConfigPorts::new(self.clone())),
            CONFIG_ADDRESS_PORT,
            CONFIG_PORTS_LEN,
        )?;
        let io = self.layout.io;
        pio.insert(self.window(io, Space::Io), io.base, io.size)?;
        let ecam = self.layout.ecam;
        mmio.insert(Arc::new(Ecam::new(self.clone())), ecam.base, ecam.size)?;
        let (w32, ecam) = (self.layout.mmio32, self.layout.ecam);
        let window32 = self.window(w32, Space::Memory);
        if w32.contains(ecam.base, ecam.size) {
            // The window's two parts, below and above ECAM, share one decoder.
            let below = ecam.base - w32.base;
            if below > 0 {
                mmio.insert(window32.clone(), w32.base, below)?;
            }
            let above = w32.end() - ecam.end();
            if above > 0 {
                mmio.insert_with_offset(window32, ecam.end(), above, ecam.end() - w32.base)?;
            }
        } else {
            mmio.insert(window32, w32.base, w32.size)?;
        }
        let w64 = self.layout.mmio64;
        mmio.insert(self.window(w64, Space::Memory), w64.base, w64.size)?;
        Ok(())
    }

    fn window(&self, w: Window, space: Space) -> Arc<BarWindow> {
        Arc::new(BarWindow::new(w.base, space, self.table.clone()))
    }

    /// Adds `device` at the lowest free slot from 1 on and returns the slot. See
    /// [`PciBus::add_device_at`].
    pub fn add_device(&self, device: SharedDevice) -> Result<u8, PciError> {
        let slot = self.free_slot().ok_or(PciError::NoFreeSlot)?;
        self.add_device_at(slot, device)?;
        Ok(slot)
    }

    /// The lowest free slot from 1 on, where [`PciBus::add_device`] would put a function.
    pub fn free_slot(&self) -> Option<u8> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        (1..NUM_SLOTS).find(|&s| slots[usize::from(s)].is_none())
    }

    /// Adds `device` at `slot` (function 0), as firmware would find it set up: each BAR
    /// it asks for ([`PciDevice::bars`]) gets an address — memory BARs in the 32-bit
    /// window (64-bit BARs go to the 64-bit window only when the 32-bit one is full), I/O BARs
    /// in the I/O window — written into its BAR registers through `config_write`; memory
    /// and I/O decoding are turned on for the kinds of BAR it has; a function with an
    /// INTx pin gets its GSI ([`crate::intx::intx_gsi`]) in its interrupt-line register.
    /// The function is told where its BARs are through [`PciDevice::bar_moved`].
    ///
    /// Call before the vCPUs start: there is no hot-plug.
    pub fn add_device_at(&self, slot: u8, device: SharedDevice) -> Result<(), PciError> {
        if slot >= NUM_SLOTS {
            return Err(PciError::BadSlot(slot));
        }
        let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
        if slots[usize::from(slot)].is_some() {
            return Err(PciError::SlotTaken(slot));
        }
        let (id, bars) = {
            let d = lock(&device);
            (d.id(), d.bars())
        };
        check_bar_requests(&id, &bars)?;
        let bases = self.allocate(&id, &bars)?;
        let command = match program_function(slot, &device, &id, &bars, &bases) {
            Ok(command) => command,
            Err(e) => {
                self.free(&bars, &bases);
                return Err(e);
            }
        };
        slots[usize::from(slot)] = Some(Slot {
            device: device.clone(),
            id,
            bars: bars.clone(),
            initial_bases: bases,
            initial_command: command,
        });
        drop(slots);
        let mut derived = lock(&self.derived);
        self.read_wanted(&mut derived, slot, &device, &bars);
        let moved = self.apply(&mut derived);
        notify(moved);
        Ok(())
    }

    fn allocate(&self, id: &str, bars: &[BarRequest]) -> Result<Vec<u64>, PciError> {
        let mut alloc = lock(&self.allocators);
        let mut bases = Vec::with_capacity(bars.len());
        for (i, r) in bars.iter().enumerate() {
            let found = match r.kind {
                BarKind::Io => take(&mut alloc.io, r),
                BarKind::Memory32 => take(&mut alloc.mmio32, r),
                BarKind::Memory64 => {
                    take(&mut alloc.mmio32, r).or_else(|| take(&mut alloc.mmio64, r))
                }
            };
            match found {
                Some(base) => bases.push(base),
                None => {
                    drop(alloc);
                    self.free(&bars[..i], &bases);
                    return Err(PciError::NoRoom {
                        id: id.into(),
                        index: r.index,
                        size: r.size,
                        window: match r.kind {
                            BarKind::Io => "I/O",
                            BarKind::Memory32 => "32-bit MMIO",
                            BarKind::Memory64 => "32-bit and 64-bit MMIO",
                        },
                    });
                }
            }
        }
        Ok(bases)
    }

    fn free(&self, bars: &[BarRequest], bases: &[u64]) {
        let mut alloc = lock(&self.allocators);
        for (r, &base) in bars.iter().zip(bases) {
            let len = allocation_size(r);
            let Ok(range) = RangeInclusive::new(base, base + (len - 1)) else {
                continue;
            };
            let allocator = match r.kind {
                BarKind::Io => &mut alloc.io,
                _ if self.layout.mmio32.contains(base, len) => &mut alloc.mmio32,
                _ => &mut alloc.mmio64,
            };
            let _ = allocator.free(&range);
        }
    }

    /// Adds `device` as function `function` (1-7) of `slot`, which must already hold a
    /// function 0 (whose header type says multi-function). Such functions have
    /// configuration registers only: a device asking for BARs is refused.
    pub fn add_function_at(
        &self,
        slot: u8,
        function: u8,
        device: SharedDevice,
    ) -> Result<(), PciError> {
        let bad = |reason| PciError::BadFunction {
            slot,
            function,
            reason,
        };
        if !(1..8).contains(&function) {
            return Err(bad("only functions 1-7 are added this way"));
        }
        if self.device_at(slot).is_none() {
            return Err(bad("the slot has no function 0"));
        }
        if !lock(&device).bars().is_empty() {
            return Err(bad("functions other than 0 cannot have BARs here"));
        }
        let mut functions = self.functions.write().unwrap_or_else(|e| e.into_inner());
        if functions.contains_key(&(slot, function)) {
            return Err(bad("already taken"));
        }
        functions.insert((slot, function), device);
        Ok(())
    }

    /// Makes the reset control register (port 0xcf9) call `reset` when the guest asks for a
    /// CPU reset through it. Only the first handler set is kept.
    pub fn set_reset_handler(&self, reset: Arc<dyn Fn() + Send + Sync>) {
        let _ = self.reset.set(reset);
    }

    /// The guest asked for a reset through port 0xcf9.
    pub(crate) fn request_reset(&self) {
        match self.reset.get() {
            Some(reset) => reset(),
            None => log::warn!("reset through port 0xcf9 ignored: no reset handler"),
        }
    }

    fn other_function(&self, slot: u8, function: u8) -> Option<SharedDevice> {
        let functions = self.functions.read().unwrap_or_else(|e| e.into_inner());
        functions.get(&(slot, function)).cloned()
    }

    /// Reads configuration dword `offset` (rounded down to a dword) of bus `bus`, device
    /// `device`, function `function`. All ones where nothing answers.
    pub fn config_read(&self, bus: u8, device: u8, function: u8, offset: u16) -> u32 {
        if bus != 0 || offset >= crate::config::EXTENDED_CONFIG_SIZE {
            return u32::MAX;
        }
        if function != 0 {
            return match self.other_function(device, function) {
                Some(d) => lock(&d).config_read(offset & !3),
                None => u32::MAX,
            };
        }
        match self.device_at(device) {
            Some(d) => lock(&d).config_read(offset & !3),
            None => u32::MAX,
        }
    }

    /// Writes `data` at byte `sub` of configuration dword `offset` (rounded down); ignored
    /// where nothing answers or when the bytes do not fit the dword. A write to a command
    /// or BAR register updates the BAR dispatch.
    pub fn config_write(
        &self,
        bus: u8,
        device: u8,
        function: u8,
        offset: u16,
        sub: u8,
        data: &[u8],
    ) {
        let fits = !data.is_empty() && usize::from(sub) + data.len() <= 4;
        if bus != 0 || offset >= crate::config::EXTENDED_CONFIG_SIZE || !fits {
            return;
        }
        if function != 0 {
            if let Some(d) = self.other_function(device, function) {
                lock(&d).config_write(offset & !3, sub, data);
            }
            return;
        }
        let Some((dev, bars)) = self.function(device) else {
            return;
        };
        let offset = offset & !3;
        // Held across the write and its effects so that two vCPUs' writes cannot
        // interleave their table updates.
        let mut derived = lock(&self.derived);
        lock(&dev).config_write(offset, sub, data);
        if touches_decoding(offset) && !bars.is_empty() {
            self.read_wanted(&mut derived, device, &dev, &bars);
            let moved = self.apply(&mut derived);
            notify(moved);
        }
    }

    fn device_at(&self, slot: u8) -> Option<SharedDevice> {
        self.function(slot).map(|(d, _)| d)
    }

    fn function(&self, slot: u8) -> Option<(SharedDevice, Vec<BarRequest>)> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        let s = slots.get(usize::from(slot))?.as_ref()?;
        Some((s.device.clone(), s.bars.clone()))
    }

    /// Where BAR `bar` of the function in `slot` decodes now (`None`: nowhere).
    pub fn bar_address(&self, slot: u8, bar: usize) -> Option<u64> {
        lock(&self.derived).decoded.get(&(slot, bar)).copied()
    }

    /// Re-reads `slot`'s command and BAR registers into `derived.wanted`.
    fn read_wanted(
        &self,
        derived: &mut Derived,
        slot: u8,
        device: &SharedDevice,
        bars: &[BarRequest],
    ) {
        let mut d = lock(device);
        let command = read_command(&mut *d);
        for r in bars {
            let base = read_bar_base(&mut *d, r);
            let (enabled, in_window) = match r.kind {
                BarKind::Io => (
                    command & COMMAND_IO != 0,
                    self.layout.io.contains(base, r.size),
                ),
                _ => (
                    command & COMMAND_MEMORY != 0,
                    self.layout.mmio32.contains(base, r.size)
                        || self.layout.mmio64.contains(base, r.size),
                ),
            };
            let wanted = Wanted {
                device: device.clone(),
                at: (enabled && in_window).then_some((Space::of(r.kind), base, r.size)),
            };
            derived.wanted.insert((slot, r.index), wanted);
        }
    }

    /// Rebuilds the dispatch table from `derived.wanted` by the decoding rule and returns
    /// the BARs whose decoding changed.
    fn apply(&self, derived: &mut Derived) -> Vec<Moved> {
        let mut table = BarTable::default();
        let mut decoded = BTreeMap::new();
        for (&(slot, bar), wanted) in &derived.wanted {
            let Some((space, base, size)) = wanted.at else {
                continue;
            };
            let map = table.map(space);
            if overlaps(map, base, size) {
                // Trace only: the guest decides how often this happens.
                log::trace!(
                    "pci: slot {slot} BAR {bar} at {base:#x} overlaps another BAR: not decoding"
                );
                continue;
            }
            let device = wanted.device.clone();
            map.insert(base, Decoding { bar, size, device });
            decoded.insert((slot, bar), base);
        }
        let moved = derived
            .wanted
            .iter()
            .filter(|(key, _)| derived.decoded.get(key) != decoded.get(key))
            .map(|(&(slot, bar), w)| Moved {
                device: w.device.clone(),
                bar,
                base: decoded.get(&(slot, bar)).copied(),
            })
            .collect();
        self.table.store(Arc::new(table));
        derived.decoded = decoded;
        moved
    }

    /// Re-reads every function's command and BAR registers, rebuilds the dispatch table
    /// and tells every function where each of its BARs decodes (changed or not). What a
    /// restore ends with; call it yourself if functions were restored after the bus.
    pub fn refresh_decoding(&self) {
        let functions: Vec<(u8, SharedDevice, Vec<BarRequest>)> = {
            let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
            slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| {
                    s.as_ref()
                        .map(|s| (i as u8, s.device.clone(), s.bars.clone()))
                })
                .collect()
        };
        let mut derived = lock(&self.derived);
        for (slot, device, bars) in &functions {
            self.read_wanted(&mut derived, *slot, device, bars);
        }
        self.apply(&mut derived);
        let all = functions
            .iter()
            .flat_map(|(slot, device, bars)| {
                bars.iter().map(|r| Moved {
                    device: device.clone(),
                    bar: r.index,
                    base: derived.decoded.get(&(*slot, r.index)).copied(),
                })
            })
            .collect();
        notify(all);
    }

    /// The BAR and command registers of every function, for the bus's saved state.
    pub fn state(&self) -> PciBusState {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        let functions = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                let mut d = lock(&s.device);
                let bar_registers = (0..NUM_BARS)
                    .map(|b| d.config_read(bar_offset(b) as u16))
                    .collect();
                Some(FunctionState {
                    slot: i as u8,
                    id: s.id.clone(),
                    command: read_command(&mut *d),
                    bar_registers,
                })
            })
            .collect();
        PciBusState { functions }
    }

    /// Loads a state from [`PciBus::state`]: the same functions must sit in the same
    /// slots. Writes the saved registers into the functions and calls
    /// [`PciBus::refresh_decoding`]. Refuses a foreign state before changing anything.
    pub fn restore_state(&self, state: &PciBusState) -> Result<(), StateError> {
        let err = |detail: String| StateError::new("pci-bus", detail);
        let programs = {
            let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
            let present: Vec<(u8, &str)> = slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().map(|s| (i as u8, s.id.as_str())))
                .collect();
            let saved: Vec<(u8, &str)> = state
                .functions
                .iter()
                .map(|f| (f.slot, f.id.as_str()))
                .collect();
            if present != saved {
                return Err(err(format!(
                    "functions {saved:?}, this machine has {present:?}"
                )));
            }
            let mut programs = Vec::new();
            for f in &state.functions {
                if f.bar_registers.len() != SAVED_BAR_REGISTERS {
                    return Err(err(format!(
                        "slot {}: {} BAR registers",
                        f.slot,
                        f.bar_registers.len()
                    )));
                }
                let s = slots[usize::from(f.slot)]
                    .as_ref()
                    .ok_or_else(|| err("slot vanished".into()))?;
                programs.push((s.device.clone(), s.bars.clone(), f.clone()));
            }
            programs
        };
        for (device, bars, f) in programs {
            let mut d = lock(&device);
            for r in &bars {
                write_dword(&mut *d, bar_offset(r.index), f.bar_registers[r.index]);
                if r.kind == BarKind::Memory64 {
                    write_dword(
                        &mut *d,
                        bar_offset(r.index + 1),
                        f.bar_registers[r.index + 1],
                    );
                }
            }
            d.config_write(COMMAND as u16, 0, &f.command.to_le_bytes());
        }
        self.refresh_decoding();
        Ok(())
    }

    /// [`Lifecycle::restore`] through a shared reference, for a bus the machine holds in
    /// an `Arc`.
    pub fn restore_saved(&self, state: &DeviceState) -> Result<(), StateError> {
        self.restore_state(&state.parse("pci-bus", STATE_VERSION)?)
    }

    /// Puts every BAR back where [`PciBus::add_device_at`] placed it, with the command
    /// bits it set, as firmware does after a reset.
    pub fn reset_placements(&self) {
        let programs: Vec<(SharedDevice, Vec<BarRequest>, Vec<u64>, u16)> = {
            let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
            slots
                .iter()
                .flatten()
                .map(|s| {
                    (
                        s.device.clone(),
                        s.bars.clone(),
                        s.initial_bases.clone(),
                        s.initial_command,
                    )
                })
                .collect()
        };
        for (device, bars, bases, command) in programs {
            let mut d = lock(&device);
            for (r, &base) in bars.iter().zip(&bases) {
                write_bar(&mut *d, r, base);
            }
            d.config_write(COMMAND as u16, 0, &command.to_le_bytes());
        }
        self.refresh_decoding();
    }
}

/// The bus's saved state: per occupied slot, the function's id, command register and BAR
/// registers (all six, whatever they hold).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciBusState {
    pub functions: Vec<FunctionState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionState {
    pub slot: u8,
    pub id: String,
    pub command: u16,
    pub bar_registers: Vec<u32>,
}

/// Version of [`PciBusState`]'s layout.
const STATE_VERSION: u32 = 1;

impl Lifecycle for PciBus {
    fn id(&self) -> String {
        "pci-bus".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(STATE_VERSION, &self.state())
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        self.restore_saved(state)
    }

    fn reset(&mut self) {
        self.reset_placements();
    }
}

fn check_bar_requests(id: &str, bars: &[BarRequest]) -> Result<(), PciError> {
    let bad = |source| PciError::BadBar {
        id: id.into(),
        source,
    };
    let mut used = [false; NUM_BARS];
    for r in bars {
        validate_bar(r).map_err(bad)?;
        let span = if r.kind == BarKind::Memory64 { 2 } else { 1 };
        for slot in &mut used[r.index..r.index + span] {
            if *slot {
                return Err(bad(ConfigError::Bar {
                    index: r.index,
                    reason: "overlaps another BAR".into(),
                }));
            }
            *slot = true;
        }
    }
    Ok(())
}

/// Bytes taken from a window for a BAR: memory BARs get whole pages.
fn allocation_size(r: &BarRequest) -> u64 {
    match r.kind {
        BarKind::Io => r.size,
        _ => r.size.max(MEMORY_BAR_ALIGN),
    }
}

/// Allocates BAR `r` from `alloc`, aligned to its allocation size (a BAR's address is a
/// multiple of its size).
fn take(alloc: &mut AddressAllocator, r: &BarRequest) -> Option<u64> {
    let len = allocation_size(r);
    alloc
        .allocate(len, len, AllocPolicy::FirstMatch)
        .ok()
        .map(|range| range.start())
}

/// Programs a new function's BARs, command and interrupt line; returns the command bits
/// it set.
fn program_function(
    slot: u8,
    device: &SharedDevice,
    id: &str,
    bars: &[BarRequest],
    bases: &[u64],
) -> Result<u16, PciError> {
    let mut d = lock(device);
    for (r, &base) in bars.iter().zip(bases) {
        write_bar(&mut *d, r, base);
        let found = read_bar_base(&mut *d, r);
        if found != base {
            return Err(PciError::BarNotProgrammable {
                id: id.into(),
                index: r.index,
                programmed: base,
                found,
            });
        }
    }
    let mut command = read_command(&mut *d);
    if bars.iter().any(|r| r.kind == BarKind::Io) {
        command |= COMMAND_IO;
    }
    if bars.iter().any(|r| r.kind != BarKind::Io) {
        command |= COMMAND_MEMORY;
    }
    d.config_write(COMMAND as u16, 0, &command.to_le_bytes());
    let pin_dword = d.config_read(INTERRUPT_LINE as u16);
    let pin = (pin_dword >> ((INTERRUPT_PIN - INTERRUPT_LINE) * 8)) as u8;
    if let Some(pin) = IntxPin::from_register(pin) {
        d.config_write(INTERRUPT_LINE as u16, 0, &[intx_gsi(slot, pin) as u8]);
    }
    Ok(command)
}

/// The command register: the low half of configuration dword 4.
fn read_command(d: &mut dyn PciDevice) -> u16 {
    d.config_read(COMMAND as u16) as u16
}

fn write_dword(d: &mut dyn PciDevice, offset: usize, value: u32) {
    d.config_write(offset as u16, 0, &value.to_le_bytes());
}

/// Writes `base` into BAR `r`, keeping the register's low flag bits as the mask does.
fn write_bar(d: &mut dyn PciDevice, r: &BarRequest, base: u64) {
    write_dword(d, bar_offset(r.index), base as u32);
    if r.kind == BarKind::Memory64 {
        write_dword(d, bar_offset(r.index + 1), (base >> 32) as u32);
    }
}

/// The address BAR `r` holds, read through config reads.
fn read_bar_base(d: &mut dyn PciDevice, r: &BarRequest) -> u64 {
    let low = u64::from(d.config_read(bar_offset(r.index) as u16));
    match r.kind {
        BarKind::Io => low & !0x3,
        BarKind::Memory32 => low & !0xf,
        BarKind::Memory64 => {
            let high = u64::from(d.config_read(bar_offset(r.index + 1) as u16));
            (high << 32) | (low & !0xf)
        }
    }
}

/// Whether a write to configuration dword `offset` can change BAR decoding.
fn touches_decoding(offset: u16) -> bool {
    usize::from(offset) == COMMAND
        || (bar_offset(0)..bar_offset(NUM_BARS)).contains(&usize::from(offset))
}

fn overlaps(map: &BTreeMap<u64, Decoding>, base: u64, size: u64) -> bool {
    let last = base + (size - 1);
    match map.range(..=last).next_back() {
        Some((&b, d)) => b + (d.size - 1) >= base,
        None => false,
    }
}

fn notify(moved: Vec<Moved>) {
    for m in moved {
        lock(&m.device).bar_moved(m.bar, m.base);
    }
}
