//! Interrupt controllers: the abstraction device models raise their lines
//! through ([`IrqChip`]), and the user-space 8259 pair and I/O APIC of
//! `--irqchip split` mode ([`SplitIrqChip`]).
//!
//! # Line numbering
//!
//! An [`IrqChip`] takes a `gsi`: 0-15 are the ISA IRQs and 16-23 the PCI
//! interrupt lines of the I/O APIC. ISA IRQ *n* reaches 8259 input *n* and
//! I/O APIC pin *n*, except IRQ 0 (the PIT), which reaches I/O APIC pin 2:
//! the standard interrupt source override the MADT must declare (bus IRQ 0
//! → GSI 2). IRQ 2 is the 8259 cascade and is not a usable line; I/O APIC
//! pin 0 is left unconnected. A kernel-only backend must route the same
//! way (KVM's default routing does not: it maps GSI 0 to pin 0).
//!
//! # Delivery in split mode
//!
//! The I/O APIC delivers every interrupt as an MSI through an [`MsiSink`]
//! (KVM_SIGNAL_MSI, bhyve VM_LAPIC_MSI): a lock-free call that never waits
//! for a vCPU. Level-triggered EOIs come back through
//! [`SplitIrqChip::eoi`]. KVM only reports an EOI for vectors it knows are
//! level triggered, which in split mode it learns from MSI routes on GSIs
//! 0-23: [`MsiSink::ioapic_routes_changed`] hands the VMM the routes to
//! install (KVM_SET_GSI_ROUTING) whenever the guest re-programs the
//! redirection table, before any MSI that depends on them is sent.
//!
//! The 8259 pair's INTR output goes to the BSP as an ExtINT:
//! [`ExtIntSink::extint_pending`] is called when it rises, the VMM's BSP
//! loop checks [`SplitIrqChip::pic_pending`] (one atomic load) and, once the
//! vCPU can take an interrupt, calls [`SplitIrqChip::pic_acknowledge`] (the
//! INTA cycle) and injects the vector.
//!
//! # Locks
//!
//! [`SplitIrqChip`] has three locks: the PIC's, the I/O APIC's, and a
//! route-publication lock. The order is
//!
//! ```text
//! device lock (bus device, RTC, ...)  →  route lock  →  I/O APIC lock
//! device lock                          →  PIC lock
//! ```
//!
//! The PIC and I/O APIC locks are never held together, and no lock of this
//! module is held while an [`MsiSink`] or [`ExtIntSink`] method runs (a
//! device's own lock may be: sinks must not take device locks, and must not
//! block on vCPUs). The PIC and I/O APIC never call into devices, so a
//! device may raise its line while holding its own lock.

pub mod ioapic;
pub mod pic;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use ioapic::{Ioapic, IoapicState, Msi, MsiBatch, IOAPIC_BASE, IOAPIC_SIZE, NUM_PINS};
pub use pic::{Pic, PicChipState, PicState, ELCR_BASE, MASTER_BASE, PIC_PORTS, SLAVE_BASE};

use serde::{Deserialize, Serialize};

use crate::bus::{Bus, BusDevice, BusError};
use crate::serial::{IrqLine, NoIrq};
use crate::state::StateError;

/// Number of ISA IRQ lines (0-15).
pub const ISA_IRQS: u32 = 16;
/// The I/O APIC pin ISA IRQ 0 (the PIT) is wired to.
pub const TIMER_IOAPIC_PIN: u32 = 2;

/// Where the user-space I/O APIC sends its interrupts.
pub trait MsiSink: Send + Sync {
    /// Delivers one MSI (x86 format: `address` 0xfee0_0000 | dest << 12 |
    /// logical << 2, `data` vector | delivery mode << 8 | level trigger
    /// bits 14-15). Must not block on a vCPU.
    fn send_msi(&self, address: u64, data: u32);

    /// The I/O APIC's redirection table changed; `routes[pin]` is the MSI
    /// the pin sends now, `None` if masked or undeliverable. A KVM split
    /// irqchip must install these as MSI routes for GSIs 0-23, or it never
    /// reports the EOI of a level-triggered vector. Called with no lock of
    /// [`SplitIrqChip`] held except its route lock, which serializes calls:
    /// the last call always carries the current table.
    fn ioapic_routes_changed(&self, routes: &[Option<Msi>; NUM_PINS]) {
        let _ = routes;
    }
}

/// Told when the 8259 pair's INTR output rises.
pub trait ExtIntSink: Send + Sync {
    /// The PIC requests an interrupt: kick the BSP so it polls
    /// [`SplitIrqChip::pic_pending`]. Must not block.
    fn extint_pending(&self);
}

/// Told when a guest access moved a timer device's next deadline, so a
/// timer thread sleeping until the old one re-reads
/// `next_irq_deadline()`. Called with the device's lock held: must not
/// block or take device locks.
pub trait TimerWaker: Send + Sync {
    /// The deadline may have changed.
    fn deadline_changed(&self);
}

/// What device models raise interrupt lines through. Implemented here by
/// [`SplitIrqChip`] and, in the vmm crate, by in-kernel irqchips.
pub trait IrqChip: Send + Sync {
    /// Drives line `gsi` (see the module documentation for numbering).
    /// Unknown lines are ignored.
    fn set_irq(&self, gsi: u32, level: bool);

    /// An edge: assert, then deassert.
    fn pulse_irq(&self, gsi: u32) {
        self.set_irq(gsi, true);
        self.set_irq(gsi, false);
    }
}

impl<T: IrqChip + ?Sized> IrqChip for Arc<T> {
    fn set_irq(&self, gsi: u32, level: bool) {
        (**self).set_irq(gsi, level)
    }
    fn pulse_irq(&self, gsi: u32) {
        (**self).pulse_irq(gsi)
    }
}

/// No interrupt controller: lines go nowhere.
impl IrqChip for NoIrq {
    fn set_irq(&self, _gsi: u32, _level: bool) {}
}

/// One line of an [`IrqChip`], as a device holds it. Implements the
/// serial port's [`IrqLine`] (trigger = an edge), so COM1 is wired with
/// `IrqPin::new(chip, serial::COM1_IRQ)`.
#[derive(Clone)]
pub struct IrqPin {
    chip: Arc<dyn IrqChip>,
    gsi: u32,
}

impl IrqPin {
    /// Line `gsi` of `chip`.
    pub fn new(chip: Arc<dyn IrqChip>, gsi: u32) -> Self {
        IrqPin { chip, gsi }
    }

    /// A line connected to nothing.
    pub fn disconnected(gsi: u32) -> Self {
        IrqPin::new(Arc::new(NoIrq), gsi)
    }

    /// The line's number.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// Drives the line.
    pub fn set(&self, level: bool) {
        self.chip.set_irq(self.gsi, level)
    }

    /// Pulses the line.
    pub fn pulse(&self) {
        self.chip.pulse_irq(self.gsi)
    }
}

impl fmt::Debug for IrqPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IrqPin").field("gsi", &self.gsi).finish()
    }
}

impl IrqLine for IrqPin {
    fn trigger(&self) {
        self.pulse()
    }
}

/// Locks even if a previous holder panicked.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The PC wiring, the one place it is written: the I/O APIC pin ISA IRQ or GSI `gsi`
/// reaches, if any. The user-space chip routes by it, and the VMM hands it to an in-kernel
/// chip.
pub fn ioapic_pin(gsi: u32) -> Option<usize> {
    match gsi {
        0 => Some(TIMER_IOAPIC_PIN as usize),
        2 => None, // the cascade
        g if (g as usize) < NUM_PINS => Some(g as usize),
        _ => None,
    }
}

/// The PC wiring: the 8259 input (0-15, master then slave) ISA IRQ `gsi` reaches, if any.
pub fn pic_input(gsi: u32) -> Option<u32> {
    (gsi < ISA_IRQS && gsi != 2).then_some(gsi)
}

/// Saved state of a [`SplitIrqChip`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SplitIrqChipState {
    /// The 8259 pair.
    pub pic: PicState,
    /// The I/O APIC.
    pub ioapic: IoapicState,
}

/// The 8259 pair and the 24-pin I/O APIC of split-irqchip mode.
pub struct SplitIrqChip {
    pic: Mutex<Pic>,
    ioapic: Mutex<Ioapic>,
    /// Serializes [`MsiSink::ioapic_routes_changed`] calls.
    routes: Mutex<()>,
    /// Mirror of the PIC's INTR output, written under the PIC lock.
    pic_output: AtomicBool,
    msi: Arc<dyn MsiSink>,
    extint: Arc<dyn ExtIntSink>,
    bad_line_logged: AtomicBool,
}

impl fmt::Debug for SplitIrqChip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SplitIrqChip")
            .field("pic_output", &self.pic_pending())
            .finish_non_exhaustive()
    }
}

impl SplitIrqChip {
    /// Controllers in their reset state (8259s uninitialized, I/O APIC pins
    /// masked) delivering through `msi` and `extint`.
    pub fn new(msi: Arc<dyn MsiSink>, extint: Arc<dyn ExtIntSink>) -> Self {
        SplitIrqChip {
            pic: Mutex::new(Pic::new()),
            ioapic: Mutex::new(Ioapic::new()),
            routes: Mutex::new(()),
            pic_output: AtomicBool::new(false),
            msi,
            extint,
            bad_line_logged: AtomicBool::new(false),
        }
    }

    /// The guest EOIed `vector` on a local APIC (the hypervisor's IOAPIC
    /// EOI exit): level-triggered pins with that vector may deliver again.
    pub fn eoi(&self, vector: u8) {
        self.with_ioapic(|io, out| io.eoi(vector, out));
    }

    /// Whether the 8259 pair requests an interrupt (its INTR output).
    /// Lock-free; cheap enough to check after every BSP exit.
    pub fn pic_pending(&self) -> bool {
        self.pic_output.load(Ordering::Acquire)
    }

    /// The INTA cycle: the vector to inject into the BSP, with IRR/ISR
    /// updated (AEOI honoured). `None` if nothing is requested any more.
    /// Call only when the vCPU can take the interrupt, and inject what it
    /// returns: the request is in service once this returns.
    pub fn pic_acknowledge(&self) -> Option<u8> {
        self.with_pic(Pic::acknowledge)
    }

    /// The MSI each I/O APIC pin would send now (see
    /// [`MsiSink::ioapic_routes_changed`]).
    pub fn ioapic_routes(&self) -> [Option<Msi>; NUM_PINS] {
        lock(&self.ioapic).routes()
    }

    /// The bus device for the master PIC, the slave PIC or the ELCR pair.
    pub fn pic_io(self: &Arc<Self>, regs: PicRegisters) -> PicIo {
        PicIo {
            chip: self.clone(),
            regs,
        }
    }

    /// The bus device for the I/O APIC's MMIO window.
    pub fn ioapic_mmio(self: &Arc<Self>) -> IoapicMmio {
        IoapicMmio { chip: self.clone() }
    }

    /// Claims the standard places: ports 0x20-0x21, 0xa0-0xa1, 0x4d0-0x4d1
    /// on `pio` and [`IOAPIC_BASE`] (+[`IOAPIC_SIZE`]) on `mmio`.
    pub fn register(self: &Arc<Self>, pio: &mut Bus, mmio: &mut Bus) -> Result<(), BusError> {
        for (regs, base) in [
            (PicRegisters::Master, MASTER_BASE),
            (PicRegisters::Slave, SLAVE_BASE),
            (PicRegisters::Elcr, ELCR_BASE),
        ] {
            pio.insert(Arc::new(self.pic_io(regs)), base, PIC_PORTS)?;
        }
        mmio.insert(Arc::new(self.ioapic_mmio()), IOAPIC_BASE, IOAPIC_SIZE)
    }

    /// The guest-visible state of both controllers (taken one after the
    /// other: pause the vCPUs and devices first for a consistent snapshot).
    pub fn state(&self) -> SplitIrqChipState {
        let pic = lock(&self.pic).state();
        let ioapic = lock(&self.ioapic).state();
        SplitIrqChipState { pic, ioapic }
    }

    /// Restores a state captured by [`SplitIrqChip::state`]: republishes the
    /// I/O APIC routes and signals the ExtINT if the PIC requests one.
    /// Nothing else is delivered (in-service and Remote IRR state is kept).
    /// Both halves are checked first: if either is refused, neither
    /// controller changes.
    pub fn restore(&self, state: &SplitIrqChipState) -> Result<(), StateError> {
        state.pic.validate()?;
        state.ioapic.validate()?;
        self.pic_output.store(false, Ordering::Release);
        self.with_pic(|p| p.restore(&state.pic))?;
        lock(&self.ioapic).restore(&state.ioapic)?;
        self.publish_routes();
        Ok(())
    }

    /// Runs `f` on the PIC, then signals the ExtINT if INTR rose.
    fn with_pic<R>(&self, f: impl FnOnce(&mut Pic) -> R) -> R {
        let (r, rose) = {
            let mut pic = lock(&self.pic);
            let r = f(&mut pic);
            let out = pic.output();
            let was = self.pic_output.swap(out, Ordering::AcqRel);
            (r, out && !was)
        };
        if rose {
            self.extint.extint_pending();
        }
        r
    }

    /// Runs `f` on the I/O APIC, then sends the MSIs it produced.
    fn with_ioapic<R>(&self, f: impl FnOnce(&mut Ioapic, &mut MsiBatch) -> R) -> R {
        let mut out = MsiBatch::new();
        let r = f(&mut lock(&self.ioapic), &mut out);
        self.send(&out);
        r
    }

    fn send(&self, out: &MsiBatch) {
        for m in out.as_slice() {
            self.msi.send_msi(m.address, m.data);
        }
    }

    /// Hands the current routes to the sink. Under the route lock the table
    /// is re-read, so concurrent publications cannot end with a stale one.
    fn publish_routes(&self) {
        let _g = lock(&self.routes);
        let routes = lock(&self.ioapic).routes();
        self.msi.ioapic_routes_changed(&routes);
    }

    fn ioapic_write(&self, offset: u64, data: &[u8]) {
        let mut out = MsiBatch::new();
        let changed = lock(&self.ioapic).write(offset, data, &mut out);
        if changed {
            // Routes first: KVM must know a vector is level triggered
            // before the guest can EOI it.
            self.publish_routes();
        }
        self.send(&out);
    }

    fn log_bad_line(&self, gsi: u32) {
        if !self.bad_line_logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "irqchip: interrupt line {gsi} does not exist (IRQ 2 is the cascade; GSIs end at {}); ignored (logged once)",
                NUM_PINS - 1
            );
        }
    }

    fn drive(&self, gsi: u32, levels: &[bool]) {
        let pin = ioapic_pin(gsi);
        let pic = pic_input(gsi);
        if pin.is_none() && pic.is_none() {
            self.log_bad_line(gsi);
            return;
        }
        if let Some(input) = pic {
            self.with_pic(|p| {
                for &l in levels {
                    p.set_irq(input, l);
                }
            });
        }
        if let Some(pin) = pin {
            self.with_ioapic(|io, out| {
                for &l in levels {
                    io.set_irq(pin, l, out);
                }
            });
        }
    }
}

impl IrqChip for SplitIrqChip {
    fn set_irq(&self, gsi: u32, level: bool) {
        self.drive(gsi, &[level]);
    }

    /// Both edges under one acquisition of each lock.
    fn pulse_irq(&self, gsi: u32) {
        self.drive(gsi, &[true, false]);
    }
}

/// Which pair of 8259 ports a [`PicIo`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PicRegisters {
    /// Ports 0x20-0x21.
    Master,
    /// Ports 0xa0-0xa1.
    Slave,
    /// Ports 0x4d0-0x4d1.
    Elcr,
}

/// Port-I/O access to one chip of a [`SplitIrqChip`]'s PIC pair. A wider
/// access is split into byte accesses to consecutive ports.
#[derive(Debug)]
pub struct PicIo {
    chip: Arc<SplitIrqChip>,
    regs: PicRegisters,
}

/// The chip's own locks serialise accesses: these hold no state of their own.
impl BusDevice for PicIo {
    fn read(&self, offset: u64, data: &mut [u8]) {
        let regs = self.regs;
        self.chip.with_pic(|p| {
            for (i, b) in data.iter_mut().enumerate() {
                let port = offset.saturating_add(i as u64);
                *b = match (regs, port) {
                    (_, 2..) => 0xff,
                    (PicRegisters::Master, _) => p.read_port(0, port),
                    (PicRegisters::Slave, _) => p.read_port(1, port),
                    (PicRegisters::Elcr, _) => p.read_elcr(port as usize),
                };
            }
        });
    }

    fn write(&self, offset: u64, data: &[u8]) {
        let regs = self.regs;
        self.chip.with_pic(|p| {
            for (i, &v) in data.iter().enumerate() {
                let port = offset.saturating_add(i as u64);
                match (regs, port) {
                    (_, 2..) => {}
                    (PicRegisters::Master, _) => p.write_port(0, port, v),
                    (PicRegisters::Slave, _) => p.write_port(1, port, v),
                    (PicRegisters::Elcr, _) => p.write_elcr(port as usize, v),
                }
            }
        });
    }
}

/// MMIO access to a [`SplitIrqChip`]'s I/O APIC.
#[derive(Debug)]
pub struct IoapicMmio {
    chip: Arc<SplitIrqChip>,
}

impl BusDevice for IoapicMmio {
    fn read(&self, offset: u64, data: &mut [u8]) {
        lock(&self.chip.ioapic).read(offset, data);
    }

    fn write(&self, offset: u64, data: &[u8]) {
        self.chip.ioapic_write(offset, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Event {
        Msi(u64, u32),
        Routes(Box<[Option<Msi>; NUM_PINS]>),
    }

    #[derive(Default)]
    struct Recorder {
        events: Mutex<Vec<Event>>,
        kicks: AtomicUsize,
    }

    impl Recorder {
        fn take(&self) -> Vec<Event> {
            std::mem::take(&mut *self.events.lock().unwrap())
        }
        fn msis(&self) -> Vec<(u64, u32)> {
            self.take()
                .into_iter()
                .filter_map(|e| match e {
                    Event::Msi(a, d) => Some((a, d)),
                    Event::Routes(_) => None,
                })
                .collect()
        }
        fn kicks(&self) -> usize {
            self.kicks.swap(0, Ordering::SeqCst)
        }
    }

    impl MsiSink for Recorder {
        fn send_msi(&self, address: u64, data: u32) {
            self.events.lock().unwrap().push(Event::Msi(address, data));
        }
        fn ioapic_routes_changed(&self, routes: &[Option<Msi>; NUM_PINS]) {
            self.events
                .lock()
                .unwrap()
                .push(Event::Routes(Box::new(*routes)));
        }
    }

    impl ExtIntSink for Recorder {
        fn extint_pending(&self) {
            self.kicks.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Machine {
        rec: Arc<Recorder>,
        chip: Arc<SplitIrqChip>,
        pio: Bus,
        mmio: Bus,
    }

    impl Machine {
        fn new() -> Self {
            let rec = Arc::new(Recorder::default());
            let chip = Arc::new(SplitIrqChip::new(rec.clone(), rec.clone()));
            let mut pio = Bus::new();
            let mut mmio = Bus::new();
            chip.register(&mut pio, &mut mmio).unwrap();
            Machine {
                rec,
                chip,
                pio,
                mmio,
            }
        }

        fn outb(&self, port: u64, v: u8) {
            assert!(self.pio.write(port, &[v]));
        }

        fn inb(&self, port: u64) -> u8 {
            let mut d = [0u8];
            assert!(self.pio.read(port, &mut d));
            d[0]
        }

        fn init_pic(&self) {
            for (port, v) in [
                (0x20, 0x11),
                (0x21, 0x20),
                (0x21, 0x04),
                (0x21, 0x01),
                (0xa0, 0x11),
                (0xa1, 0x28),
                (0xa1, 0x02),
                (0xa1, 0x01),
                (0x21, 0x00),
                (0xa1, 0x00),
            ] {
                self.outb(port, v);
            }
        }

        fn ioapic_write(&self, reg: u8, v: u32) {
            assert!(self.mmio.write(IOAPIC_BASE, &u32::from(reg).to_le_bytes()));
            assert!(self.mmio.write(IOAPIC_BASE + 0x10, &v.to_le_bytes()));
        }

        fn ioapic_read(&self, reg: u8) -> u32 {
            assert!(self.mmio.write(IOAPIC_BASE, &[reg]));
            let mut d = [0u8; 4];
            assert!(self.mmio.read(IOAPIC_BASE + 0x10, &mut d));
            u32::from_le_bytes(d)
        }

        fn program(&self, pin: u8, low: u32, dest: u8) {
            self.ioapic_write(0x11 + 2 * pin, u32::from(dest) << 24);
            self.ioapic_write(0x10 + 2 * pin, low);
        }
    }

    #[test]
    fn isa_irq_reaches_both_controllers() {
        let m = Machine::new();
        m.init_pic();
        m.program(4, 0x34, 1);
        m.rec.take();
        m.rec.kicks();

        m.chip.pulse_irq(4);
        assert_eq!(m.rec.msis(), vec![(0xfee0_1000, 0x34)]);
        assert_eq!(m.rec.kicks(), 1);
        assert!(m.chip.pic_pending());
        assert_eq!(m.chip.pic_acknowledge(), Some(0x24));
        assert!(!m.chip.pic_pending());
        m.outb(0x20, 0x20);
        assert_eq!(m.chip.pic_acknowledge(), None);
    }

    #[test]
    fn irq0_goes_to_pin_2() {
        let m = Machine::new();
        m.init_pic();
        m.program(0, 0x30, 0);
        m.program(2, 0x32, 0);
        m.rec.take();
        m.chip.pulse_irq(0);
        assert_eq!(m.rec.msis(), vec![(0xfee0_0000, 0x32)]);
        assert_eq!(m.chip.pic_acknowledge(), Some(0x20));
        // IRQ 2 is the cascade: nothing, anywhere (logged once).
        m.chip.pulse_irq(2);
        m.chip.pulse_irq(2);
        assert!(m.rec.msis().is_empty());
        m.outb(0x20, 0x20);
        assert!(!m.chip.pic_pending());
    }

    #[test]
    fn pci_gsis_only_reach_the_ioapic() {
        let m = Machine::new();
        m.init_pic();
        m.program(19, 0x53 | 1 << 15, 2);
        m.rec.take();
        m.rec.kicks();
        m.chip.set_irq(19, true);
        assert_eq!(m.rec.msis(), vec![(0xfee0_2000, 0xc053)]);
        assert_eq!(m.rec.kicks(), 0);
        assert!(!m.chip.pic_pending());
        // Still asserted at EOI: delivered again until deasserted.
        m.chip.eoi(0x53);
        assert_eq!(m.rec.msis(), vec![(0xfee0_2000, 0xc053)]);
        m.chip.set_irq(19, false);
        m.chip.eoi(0x53);
        assert!(m.rec.msis().is_empty());
        // Lines that do not exist are ignored.
        m.chip.set_irq(24, true);
        m.chip.pulse_irq(u32::MAX);
        assert!(m.rec.msis().is_empty());
    }

    #[test]
    fn routes_published_before_dependent_msi() {
        let m = Machine::new();
        m.rec.take();
        m.chip.set_irq(9, true);
        m.program(9, 0x49 | 1 << 15, 0);
        let ev = m.rec.take();
        // The high dword is unchanged (destination 0); the low dword write
        // publishes the routes, then sends the MSI the unmask released.
        assert_eq!(ev.len(), 2, "{ev:?}");
        let Event::Routes(r) = &ev[0] else {
            panic!("{ev:?}")
        };
        assert_eq!(
            r[9],
            Some(Msi {
                address: 0xfee0_0000,
                data: 0xc049
            })
        );
        assert_eq!(ev[1], Event::Msi(0xfee0_0000, 0xc049));
        assert_eq!(m.chip.ioapic_routes(), **r);
        // Rewriting the same value publishes nothing.
        m.chip.eoi(0x49);
        m.rec.take();
        m.chip.set_irq(9, false);
        m.program(9, 0x49 | 1 << 15, 0);
        assert!(m.rec.take().is_empty());
        assert_eq!(
            m.ioapic_read(0x10 + 18),
            0x49 | 1 << 15 | 1 << 14,
            "Remote IRR"
        );
    }

    #[test]
    fn extint_kick_on_rising_output_only() {
        let m = Machine::new();
        m.init_pic();
        m.rec.kicks();
        m.chip.pulse_irq(3);
        m.chip.pulse_irq(5);
        assert_eq!(m.rec.kicks(), 1, "output was already high");
        assert_eq!(m.chip.pic_acknowledge(), Some(0x23));
        assert!(!m.chip.pic_pending(), "IRQ 5 waits for the EOI");
        m.outb(0x20, 0x20);
        assert!(m.chip.pic_pending());
        assert_eq!(m.rec.kicks(), 1, "EOI made the output rise");
        assert_eq!(m.chip.pic_acknowledge(), Some(0x25));
        // Masking and unmasking a pending request.
        m.outb(0x20, 0x20);
        m.outb(0x21, 0xff);
        m.chip.pulse_irq(6);
        assert_eq!(m.rec.kicks(), 0);
        m.outb(0x21, 0x00);
        assert_eq!(m.rec.kicks(), 1);
        assert_eq!(m.inb(0x21), 0);
    }

    #[test]
    fn elcr_and_wide_port_accesses() {
        let m = Machine::new();
        m.init_pic();
        m.outb(0x4d1, 0x02);
        assert_eq!(m.inb(0x4d1), 0x02);
        // A 16-bit access covers both ELCRs.
        assert!(m.pio.write(0x4d0, &[0xff, 0xff]));
        let mut d = [0u8; 2];
        assert!(m.pio.read(0x4d0, &mut d));
        assert_eq!(d, [0xf8, 0xde]);
        m.chip.set_irq(9, true);
        assert_eq!(m.chip.pic_acknowledge(), Some(0x29));
        m.outb(0xa0, 0x20);
        m.outb(0x20, 0x20);
        assert_eq!(m.chip.pic_acknowledge(), Some(0x29), "level, still high");
        // Reads via the bus: IMR of both chips with one 16-bit access at 0x20.
        let mut d = [0u8; 2];
        assert!(m.pio.read(0x20, &mut d));
        assert_eq!(d[1], 0);
        // Direct device access with an out-of-range offset reads 0xff.
        let dev = m.chip.pic_io(PicRegisters::Slave);
        let mut d = [0u8; 3];
        dev.read(1, &mut d);
        assert_eq!(&d[1..], &[0xff, 0xff]);
        dev.write(u64::MAX, &[1, 2]);
    }

    #[test]
    fn serial_line_adapter_pulses() {
        let m = Machine::new();
        m.init_pic();
        let pin = IrqPin::new(m.chip.clone(), crate::serial::COM1_IRQ);
        assert_eq!(pin.gsi(), 4);
        assert!(format!("{pin:?}").contains('4'));
        let line: Arc<dyn IrqLine> = Arc::new(pin.clone());
        m.program(4, 0x44, 0);
        m.rec.take();
        // A UART with its RX interrupt enabled, fed a byte.
        let mut uart =
            crate::serial::SerialDevice::new(&crate::serial::SerialOutput::Sink, line).unwrap();
        crate::bus::BusDeviceMut::write(&mut uart, 1, &[0x01]);
        uart.enqueue_raw_bytes(b"x");
        assert_eq!(m.rec.msis(), vec![(0xfee0_0000, 0x44)]);
        assert_eq!(m.chip.pic_acknowledge(), Some(0x24));
        IrqPin::disconnected(4).pulse();
        IrqPin::disconnected(4).set(true);
    }

    #[test]
    fn state_round_trip() {
        let m = Machine::new();
        m.init_pic();
        m.program(10, 0x4a | 1 << 15, 0);
        m.chip.set_irq(10, true);
        m.chip.pulse_irq(7);
        let st = m.chip.state();

        let json = serde_json::to_string(&st).unwrap();
        let carried: SplitIrqChipState = serde_json::from_str(&json).unwrap();
        let m2 = Machine::new();
        m2.rec.kicks();
        m2.chip.restore(&carried).unwrap();
        assert_eq!(m2.chip.state(), st);
        assert_eq!(m2.rec.kicks(), 1, "PIC requests: BSP kicked");
        let ev = m2.rec.take();
        assert_eq!(ev.len(), 1, "routes only, no MSI: {ev:?}");
        assert!(m2.chip.pic_pending());
        // IRQ 10 (through the cascade) outranks IRQ 7; both were kept.
        assert_eq!(m2.chip.pic_acknowledge(), Some(0x2a));
        m2.outb(0xa0, 0x20);
        m2.outb(0x20, 0x20);
        assert_eq!(m2.chip.pic_acknowledge(), Some(0x27));
        m2.chip.eoi(0x4a);
        assert_eq!(m2.rec.msis(), vec![(0xfee0_0000, 0xc04a)]);
        let _ = format!("{:?}", m2.chip);

        // A bad half is refused before either controller changes.
        let before = m2.chip.state();
        let mut bad = st;
        bad.ioapic.id = 0x20;
        assert!(m2.chip.restore(&bad).is_err());
        let mut bad = st;
        bad.pic.chips[1].init_state = 7;
        assert!(m2.chip.restore(&bad).is_err());
        assert_eq!(m2.chip.state(), before);
        assert!(m2.rec.take().is_empty(), "nothing published or sent");
    }

    #[test]
    fn concurrent_use_does_not_deadlock() {
        let m = Machine::new();
        m.init_pic();
        for pin in 0..NUM_PINS as u8 {
            let trig = if pin >= 16 { 1 << 15 } else { 0 };
            m.program(pin, (0x30 + u32::from(pin)) | trig, 0);
        }
        let m = Arc::new(m);
        let mut threads = vec![];
        for t in 0..4u32 {
            let m = m.clone();
            threads.push(std::thread::spawn(move || {
                for i in 0..2000u32 {
                    let gsi = (i * 7 + t) % 24;
                    match i % 4 {
                        0 => m.chip.pulse_irq(gsi),
                        1 => m.chip.set_irq(gsi, i & 8 != 0),
                        2 => m.chip.eoi(0x30 + (i % 24) as u8),
                        _ => {
                            if let Some(_v) = m.chip.pic_acknowledge() {
                                m.outb(0x20, 0x20);
                                m.outb(0xa0, 0x20);
                            }
                            m.program((i % 24) as u8, 0x30 + i % 24, (i % 4) as u8);
                        }
                    }
                }
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        assert!(m.rec.take().len() < 4 * 2000 * 3);
    }

    #[test]
    fn garbage_never_panics() {
        let m = Machine::new();
        let mut rng = crate::test_util::XorShift(0x5eed_0f1a_c0de_0001);
        let mut buf = [0u8; 16];
        for _ in 0..30_000 {
            let r = rng.next();
            for b in buf.iter_mut() {
                *b = rng.next() as u8;
            }
            let len = ((r >> 8) % 9) as usize;
            match r % 8 {
                0 => {
                    let port = [0x20, 0x21, 0xa0, 0xa1, 0x4d0, 0x4d1][(r >> 16) as usize % 6];
                    m.pio.write(port, &buf[..len.min(2)]);
                }
                1 => {
                    let port = [0x20, 0x21, 0xa0, 0xa1, 0x4d0, 0x4d1][(r >> 16) as usize % 6];
                    m.pio.read(port, &mut buf[..1]);
                }
                2 => {
                    let off = (r >> 16) % 0x50;
                    m.mmio.write(IOAPIC_BASE + off, &buf[..len]);
                }
                3 => {
                    let off = (r >> 16) % IOAPIC_SIZE;
                    m.mmio.read(IOAPIC_BASE + off, &mut buf[..1]);
                }
                4 => m.chip.set_irq((r >> 16) as u32 % 30, r & (1 << 40) != 0),
                5 => m.chip.eoi((r >> 16) as u8),
                6 => {
                    m.chip.pic_acknowledge();
                }
                _ => m.chip.pulse_irq((r >> 16) as u32 % 30),
            }
            // Bounded: nothing accumulates between drains.
            assert!(m.rec.take().len() <= 2 * NUM_PINS + 1);
        }
        // Whatever the guest did, the state it left restores.
        let st = m.chip.state();
        let m2 = Machine::new();
        m2.chip.restore(&st).unwrap();
        assert_eq!(m2.chip.state(), st);
    }
}
