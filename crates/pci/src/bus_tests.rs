//! Tests of the bus through the guest's ways in: CF8 ports, ECAM and the BAR windows, on
//! a machine bus as the VMM builds it.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use devices::bus::Bus;
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};

use crate::bus::{PciBus, PciError, PciLayout, Window, ECAM_BUS_SIZE};
use crate::config::{ConfigSpace, IntxPin, PciIds};
use crate::host_bridge::HostBridge;
use crate::{BarKind, BarRequest, PciDevice};

const ECAM: u64 = 0xe000_0000;
const MMIO32: Window = Window::new(0xc000_0000, 0x2000_0000);
const MMIO64: Window = Window::new(0x1_0000_0000, 0x10_0000_0000);
const IO: Window = Window::new(0xc000, 0x4000);

fn no_irq() -> Arc<dyn devices::irqchip::IrqChip> {
    Arc::new(devices::serial::NoIrq)
}

fn layout() -> PciLayout {
    PciLayout {
        ecam: Window::new(ECAM, ECAM_BUS_SIZE),
        mmio32: MMIO32,
        mmio64: MMIO64,
        io: IO,
    }
}

/// A function with the given BARs; BAR reads return `bar << 4 | offset` per byte.
struct TestFn {
    config: ConfigSpace,
    name: String,
    moved: Vec<(usize, Option<u64>)>,
    writes: Vec<(usize, u64, Vec<u8>)>,
    /// Set: each BAR read says it started, then waits to be let go (as a virtio
    /// function's accesses wait while it pauses its I/O threads).
    stall: Option<(Sender<()>, Receiver<()>)>,
}

impl TestFn {
    fn new(name: &str, bars: &[BarRequest]) -> Arc<Mutex<TestFn>> {
        let mut config = ConfigSpace::new(PciIds {
            vendor: 0x1af4,
            device: 0x1040,
            revision: 1,
            class: 0xff_00_00,
            subsystem_vendor: 0x1af4,
            subsystem: 0x40,
        });
        for b in bars {
            config.add_bar(*b).unwrap();
        }
        config.set_interrupt_pin(Some(IntxPin::A));
        Arc::new(Mutex::new(TestFn {
            config,
            name: name.into(),
            moved: Vec::new(),
            writes: Vec::new(),
            stall: None,
        }))
    }
}

impl Lifecycle for TestFn {
    fn id(&self) -> String {
        self.name.clone()
    }
    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(1, &self.config.state())
    }
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        self.config.restore(&state.parse("test", 1)?)
    }
}

impl PciDevice for TestFn {
    fn bars(&self) -> Vec<BarRequest> {
        self.config.bar_requests()
    }
    fn config_read(&mut self, offset: u16) -> u32 {
        self.config.read(offset)
    }
    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        self.config.write(offset, sub, data)
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if let Some((entered, release)) = &self.stall {
            let _ = entered.send(());
            let _ = release.recv();
        }
        for (i, b) in data.iter_mut().enumerate() {
            *b = ((bar as u8) << 4) | ((offset as u8).wrapping_add(i as u8) & 0xf);
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        self.writes.push((bar, offset, data.to_vec()));
    }
    fn bar_moved(&mut self, bar: usize, base: Option<u64>) {
        self.moved.push((bar, base));
    }
}

fn bar(index: usize, size: u64, kind: BarKind) -> BarRequest {
    BarRequest {
        index,
        size,
        kind,
        prefetchable: false,
    }
}

/// A machine's two buses with the PCI bus registered and the host bridge in slot 0.
struct Machine {
    pci: Arc<PciBus>,
    pio: Bus,
    mmio: Bus,
}

impl Machine {
    fn new() -> Machine {
        let pci = Arc::new(PciBus::new(layout(), no_irq()).unwrap());
        pci.add_device_at(0, Arc::new(Mutex::new(HostBridge::new())))
            .unwrap();
        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        pci.register(&mut pio, &mut mmio).unwrap();
        Machine { pci, pio, mmio }
    }

    fn cf8_address(dev: u8, reg: u16) -> u32 {
        0x8000_0000 | u32::from(dev) << 11 | u32::from(reg & 0xfc)
    }

    fn cf8_read(&self, dev: u8, reg: u16, len: usize) -> u32 {
        assert!(self
            .pio
            .write(0xcf8, &Self::cf8_address(dev, reg).to_le_bytes()));
        let mut data = [0u8; 4];
        assert!(self.pio.read(0xcfc + u64::from(reg & 3), &mut data[..len]));
        u32::from_le_bytes(data)
    }

    fn cf8_write(&self, dev: u8, reg: u16, data: &[u8]) {
        assert!(self
            .pio
            .write(0xcf8, &Self::cf8_address(dev, reg).to_le_bytes()));
        assert!(self.pio.write(0xcfc + u64::from(reg & 3), data));
    }

    fn ecam_read(&self, dev: u8, reg: u16, len: usize) -> u32 {
        let mut data = [0u8; 4];
        let addr = ECAM + (u64::from(dev) << 15) + u64::from(reg);
        assert!(self.mmio.read(addr, &mut data[..len]));
        u32::from_le_bytes(data)
    }

    fn ecam_write(&self, dev: u8, reg: u16, data: &[u8]) {
        let addr = ECAM + (u64::from(dev) << 15) + u64::from(reg);
        assert!(self.mmio.write(addr, data));
    }

    /// A dword read of memory at `addr` (through the MMIO bus, as a vCPU would).
    fn mem_read(&self, addr: u64) -> Option<u32> {
        let mut data = [0u8; 4];
        self.mmio
            .read(addr, &mut data)
            .then(|| u32::from_le_bytes(data))
    }
}

/// Sizes a BAR through CF8: what firmware and Linux do.
fn size_bar(m: &Machine, dev: u8, index: usize) -> u32 {
    let reg = 0x10 + 4 * index as u16;
    let saved = m.cf8_read(dev, reg, 4);
    m.cf8_write(dev, reg, &[0xff; 4]);
    let mask = m.cf8_read(dev, reg, 4);
    m.cf8_write(dev, reg, &saved.to_le_bytes());
    mask
}

#[test]
fn host_bridge_through_both_mechanisms() {
    let m = Machine::new();
    assert_eq!(m.cf8_read(0, 0, 4), 0x1237_8086);
    assert_eq!(m.ecam_read(0, 0, 4), 0x1237_8086);
    assert_eq!(m.cf8_read(0, 8, 4) >> 8, 0x06_00_00);
    assert_eq!(m.cf8_read(0, 2, 2), 0x1237);
    assert_eq!(m.ecam_read(0, 0xb, 1), 0x06);
    for index in 0..6 {
        assert_eq!(size_bar(&m, 0, index), 0, "host bridge has no BARs");
    }
    // PAM through ECAM, read back through CF8.
    m.ecam_write(0, 0x5a, &[0x33]);
    assert_eq!(m.cf8_read(0, 0x5a, 1), 0x33);
}

#[test]
fn bar_sizing_of_each_kind() {
    let m = Machine::new();
    let f = TestFn::new(
        "f",
        &[
            bar(0, 0x4000, BarKind::Memory32),
            bar(1, 0x20, BarKind::Io),
            BarRequest {
                index: 2,
                size: 0x10_0000,
                kind: BarKind::Memory64,
                prefetchable: true,
            },
        ],
    );
    let slot = m.pci.add_device(f).unwrap();
    assert_eq!(slot, 1);
    assert_eq!(size_bar(&m, slot, 0), 0xffff_c000);
    assert_eq!(size_bar(&m, slot, 1), 0xffff_ffe1);
    assert_eq!(size_bar(&m, slot, 2), 0xfff0_000c);
    assert_eq!(size_bar(&m, slot, 3), 0xffff_ffff);
    assert_eq!(size_bar(&m, slot, 4), 0);
    // Sizing restored the addresses: the BARs still answer where they were placed.
    let base0 = m.pci.bar_address(slot, 0).unwrap();
    assert_eq!(m.mem_read(base0 + 4), Some(0x0706_0504));
}

#[test]
fn placement_programs_registers_and_command() {
    let m = Machine::new();
    let a = TestFn::new(
        "a",
        &[bar(0, 0x1000, BarKind::Memory32), bar(1, 0x40, BarKind::Io)],
    );
    let b = TestFn::new(
        "b",
        &[
            bar(0, 0x10, BarKind::Memory32),
            bar(2, 0x2000, BarKind::Memory64),
        ],
    );
    let sa = m.pci.add_device(a.clone()).unwrap();
    let sb = m.pci.add_device(b.clone()).unwrap();
    assert_eq!((sa, sb), (1, 2));
    assert_eq!(m.cf8_read(sa, 0x10, 4), 0xc000_0000);
    assert_eq!(m.cf8_read(sa, 0x14, 4), 0xc001);
    assert_eq!(m.cf8_read(sa, 4, 2), 0x3, "I/O and memory decode on");
    assert_eq!(m.cf8_read(sb, 4, 2), 0x2, "memory decode only");
    assert_eq!(
        m.cf8_read(sb, 0x10, 4),
        0xc000_1000,
        "a 16-byte BAR gets a page"
    );
    assert_eq!(
        m.cf8_read(sb, 0x18, 4),
        0xc000_2004,
        "64-bit BAR below 4 GiB"
    );
    assert_eq!(m.cf8_read(sb, 0x1c, 4), 0);
    // Interrupt line = the INTA GSI of the slot.
    assert_eq!(m.cf8_read(sa, 0x3c, 2), 0x0111);
    assert_eq!(m.cf8_read(sb, 0x3c, 2), 0x0112);
    assert_eq!(
        a.lock().unwrap().moved,
        vec![(0, Some(0xc000_0000)), (1, Some(0xc000))]
    );
    assert_eq!(
        b.lock().unwrap().moved,
        vec![(0, Some(0xc000_1000)), (2, Some(0xc000_2000))]
    );
    // The I/O BAR answers on the PIO bus, and writes reach the function with the offset.
    let mut data = [0u8; 2];
    assert!(m.pio.read(0xc002, &mut data));
    assert_eq!(data, [0x12, 0x13]);
    assert!(m.mmio.write(0xc000_2008, &[9, 8, 7]));
    assert_eq!(b.lock().unwrap().writes, vec![(2, 8, vec![9, 8, 7])]);
    // Past the end of a BAR, and straddling it, nothing answers.
    assert_eq!(m.mem_read(0xc000_0ffc), Some(0x0f0e_0d0c));
    assert_eq!(m.mem_read(0xc000_1010), Some(u32::MAX));
    assert_eq!(m.mem_read(0xc000_100e), Some(u32::MAX));
}

#[test]
fn sixty_four_bit_bars_spill_into_the_high_window() {
    let m = Machine::new();
    let big = TestFn::new("big", &[bar(0, 0x1000_0000, BarKind::Memory32)]);
    m.pci.add_device(big).unwrap();
    let wide = TestFn::new("wide", &[bar(0, 0x2000_0000, BarKind::Memory64)]);
    let s = m.pci.add_device(wide).unwrap();
    assert_eq!(m.pci.bar_address(s, 0), Some(0x1_0000_0000));
    assert_eq!(m.cf8_read(s, 0x14, 4), 1);
    assert_eq!(m.mem_read(0x1_0000_0000), Some(0x0302_0100));
    let no_room = TestFn::new("no-room", &[bar(0, 0x2000_0000, BarKind::Memory32)]);
    let err = m.pci.add_device(no_room).unwrap_err();
    assert!(matches!(err, PciError::NoRoom { .. }), "{err}");
    // The failed function took no slot and no space.
    let small = TestFn::new("small", &[bar(0, 0x1000, BarKind::Memory32)]);
    assert_eq!(m.pci.add_device(small).unwrap(), 3);
}

/// A function that does not implement its BARs in configuration space is refused.
#[test]
fn function_that_ignores_bar_writes_is_refused() {
    struct Deaf(Arc<Mutex<TestFn>>);
    let inner = TestFn::new("deaf", &[bar(0, 0x1000, BarKind::Memory32)]);
    impl Lifecycle for Deaf {
        fn id(&self) -> String {
            "deaf".into()
        }
        fn save(&self) -> Result<DeviceState, LifecycleError> {
            self.0.lock().unwrap().save()
        }
        fn restore(&mut self, _: &DeviceState) -> Result<(), StateError> {
            Ok(())
        }
    }
    impl PciDevice for Deaf {
        fn bars(&self) -> Vec<BarRequest> {
            self.0.lock().unwrap().bars()
        }
        fn config_read(&mut self, offset: u16) -> u32 {
            self.0.lock().unwrap().config_read(offset)
        }
        fn config_write(&mut self, _: u16, _: u8, _: &[u8]) {}
        fn bar_read(&mut self, _: usize, _: u64, _: &mut [u8]) {}
        fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {}
    }
    let m = Machine::new();
    let err = m
        .pci
        .add_device(Arc::new(Mutex::new(Deaf(inner))))
        .unwrap_err();
    assert!(matches!(err, PciError::BarNotProgrammable { .. }), "{err}");
    let ok = TestFn::new("ok", &[bar(0, 0x1000, BarKind::Memory32)]);
    let s = m.pci.add_device(ok).unwrap();
    assert_eq!(s, 1);
    assert_eq!(
        m.pci.bar_address(s, 0),
        Some(0xc000_0000),
        "space was freed"
    );
}

#[test]
fn bad_requests_and_slots() {
    let m = Machine::new();
    let f = TestFn::new("f", &[]);
    assert_eq!(
        m.pci.add_device_at(0, f.clone()),
        Err(PciError::SlotTaken(0))
    );
    assert_eq!(
        m.pci.add_device_at(32, f.clone()),
        Err(PciError::BadSlot(32))
    );
    for s in 1..32 {
        assert_eq!(m.pci.add_device(TestFn::new("x", &[])).unwrap(), s);
    }
    assert_eq!(m.pci.add_device(f), Err(PciError::NoFreeSlot));
    let bad_layout = PciLayout {
        ecam: Window::new(ECAM, 0x1000),
        ..layout()
    };
    assert!(PciBus::new(bad_layout, no_irq()).is_err());
}

#[test]
fn cf8_and_ecam_agree() {
    let m = Machine::new();
    let f = TestFn::new(
        "f",
        &[bar(0, 0x1000, BarKind::Memory32), bar(1, 0x10, BarKind::Io)],
    );
    f.lock()
        .unwrap()
        .config
        .add_capability(0x09, &[1, 2, 3, 4, 5], &[0xff])
        .unwrap();
    m.pci.add_device(f).unwrap();
    assert_eq!(m.cf8_read(1, 0x34, 1), 0x40);
    assert_eq!(m.ecam_read(1, 0x40, 4), 0x0201_0009);
    for dev in [0u8, 1, 2, 31] {
        for reg in 0..0x100u16 {
            for len in [1usize, 2, 4] {
                if (reg as usize & 3) + len > 4 {
                    continue;
                }
                assert_eq!(
                    m.cf8_read(dev, reg, len),
                    m.ecam_read(dev, reg, len),
                    "dev {dev} reg {reg:#x} len {len}"
                );
            }
        }
    }
    // Writes through one are seen through the other.
    m.cf8_write(1, 0x3c, &[0x0b]);
    assert_eq!(m.ecam_read(1, 0x3c, 1), 0x0b);
    m.ecam_write(1, 0x3c, &[0x0a]);
    assert_eq!(m.cf8_read(1, 0x3c, 1), 0x0a);
    // Extended space reads zero through ECAM for a present function.
    assert_eq!(m.ecam_read(1, 0x100, 4), 0);
    assert_eq!(m.ecam_read(1, 0xffc, 4), 0);
    assert_eq!(m.ecam_read(2, 0x100, 4), u32::MAX);
}

#[test]
fn absent_functions_read_all_ones() {
    let m = Machine::new();
    assert_eq!(m.cf8_read(5, 0, 4), u32::MAX);
    assert_eq!(m.cf8_read(5, 2, 2), 0xffff);
    assert_eq!(m.ecam_read(31, 0x40, 1), 0xff);
    // Function 1 of the host bridge, bus 1.
    assert!(m.pio.write(0xcf8, &0x8000_0100u32.to_le_bytes()));
    let mut d = [0u8; 4];
    assert!(m.pio.read(0xcfc, &mut d));
    assert_eq!(d, [0xff; 4]);
    assert!(m.pio.write(0xcf8, &0x8001_0000u32.to_le_bytes()));
    assert!(m.pio.read(0xcfc, &mut d));
    assert_eq!(d, [0xff; 4]);
    assert_eq!(
        m.ecam_read(0, 0x1000, 4),
        u32::MAX,
        "function 1 through ECAM"
    );
    // Enable bit clear: all ones, writes ignored.
    assert!(m.pio.write(0xcf8, &0x0000_0058u32.to_le_bytes()));
    assert!(m.pio.read(0xcfc, &mut d));
    assert_eq!(d, [0xff; 4]);
    assert!(m.pio.write(0xcfc, &[0x33; 4]));
    assert_eq!(m.cf8_read(0, 0x5a, 1), 0);
    // Writes to absent functions go nowhere (and do not panic).
    m.cf8_write(7, 0x10, &[0xff; 4]);
    m.ecam_write(7, 0x04, &[0xff; 2]);
}

#[test]
fn address_latch_is_dword_only() {
    let m = Machine::new();
    assert!(m.pio.write(0xcf8, &0x8000_0000u32.to_le_bytes()));
    // Linux's probe: a byte to 0xcfb must not disturb the latch.
    assert!(m.pio.write(0xcfb, &[1]));
    let mut d = [0u8; 4];
    assert!(m.pio.read(0xcf8, &mut d));
    assert_eq!(u32::from_le_bytes(d), 0x8000_0000);
    // Reserved bits read as zero.
    assert!(m.pio.write(0xcf8, &0xffff_ffffu32.to_le_bytes()));
    assert!(m.pio.read(0xcf8, &mut d));
    assert_eq!(u32::from_le_bytes(d), 0x80ff_fffc);
    let mut b = [0u8; 1];
    assert!(m.pio.read(0xcf9, &mut b));
    assert_eq!(b, [0x00], "a byte at 0xcf9 is the reset control register");
    // Sub-dword data accesses at each sub-offset.
    assert!(m.pio.write(0xcf8, &0x8000_0000u32.to_le_bytes()));
    let mut w = [0u8; 2];
    assert!(m.pio.read(0xcfe, &mut w));
    assert_eq!(u16::from_le_bytes(w), 0x1237);
    assert!(m.pio.read(0xcfd, &mut b));
    assert_eq!(b, [0x80]);
    assert!(m.pio.read(0xcfd, &mut w));
    assert_eq!(u16::from_le_bytes(w), 0x3780);
}

#[test]
fn moving_a_bar_moves_its_dispatch() {
    let m = Machine::new();
    let f = TestFn::new("f", &[bar(0, 0x1000, BarKind::Memory32)]);
    let s = m.pci.add_device(f.clone()).unwrap();
    assert_eq!(m.mem_read(0xc000_0000), Some(0x0302_0100));
    m.ecam_write(s, 0x10, &0xc800_0000u32.to_le_bytes());
    assert_eq!(
        m.mem_read(0xc000_0000),
        Some(u32::MAX),
        "old address is dead"
    );
    assert_eq!(
        m.mem_read(0xc800_0000),
        Some(0x0302_0100),
        "new address answers"
    );
    assert_eq!(m.pci.bar_address(s, 0), Some(0xc800_0000));
    // Byte-wise move through CF8: each byte is a move (the middle states are in window).
    m.cf8_write(s, 0x12, &[0x10]);
    assert_eq!(m.mem_read(0xc810_0000), Some(0x0302_0100));
    let moved = f.lock().unwrap().moved.clone();
    assert_eq!(
        moved,
        vec![
            (0, Some(0xc000_0000)),
            (0, Some(0xc800_0000)),
            (0, Some(0xc810_0000))
        ]
    );
    // Out of the window: decodes nothing, and the function is told.
    m.ecam_write(s, 0x10, &0x1000_0000u32.to_le_bytes());
    assert_eq!(m.pci.bar_address(s, 0), None);
    assert_eq!(f.lock().unwrap().moved.last(), Some(&(0, None)));
    assert_eq!(
        m.mem_read(0x1000_0000),
        None,
        "RAM's address: not the PCI bus's"
    );
    // A rewrite of the same value tells nobody anything.
    m.ecam_write(s, 0x10, &0xc000_0000u32.to_le_bytes());
    m.ecam_write(s, 0x10, &0xc000_0000u32.to_le_bytes());
    assert_eq!(f.lock().unwrap().moved.len(), 5);
}

#[test]
fn decode_disable_and_enable() {
    let m = Machine::new();
    let f = TestFn::new(
        "f",
        &[bar(0, 0x1000, BarKind::Memory32), bar(1, 0x10, BarKind::Io)],
    );
    let s = m.pci.add_device(f.clone()).unwrap();
    let mut d = [0u8; 1];
    m.cf8_write(s, 4, &[0x01, 0x00]); // I/O only
    assert_eq!(m.mem_read(0xc000_0000), Some(u32::MAX));
    assert!(m.pio.read(0xc000, &mut d) && d == [0x10]);
    m.cf8_write(s, 4, &[0x02]); // memory only
    assert_eq!(m.mem_read(0xc000_0000), Some(0x0302_0100));
    assert!(m.pio.read(0xc000, &mut d) && d == [0xff]);
    let moved = f.lock().unwrap().moved.clone();
    assert_eq!(moved[2..], [(0, None), (0, Some(0xc000_0000)), (1, None)]);
}

#[test]
fn overlapping_bars_decode_by_slot_order() {
    let m = Machine::new();
    let a = TestFn::new("a", &[bar(0, 0x1000, BarKind::Memory32)]);
    let b = TestFn::new("b", &[bar(3, 0x2000, BarKind::Memory32)]);
    let sa = m.pci.add_device(a.clone()).unwrap();
    let sb = m.pci.add_device(b.clone()).unwrap();
    let b_base = m.pci.bar_address(sb, 3).unwrap();
    // b moves onto a: a (earlier slot) keeps decoding, b decodes nothing.
    m.cf8_write(sb, 0x1c, &0xc000_0000u32.to_le_bytes());
    assert_eq!(m.pci.bar_address(sa, 0), Some(0xc000_0000));
    assert_eq!(m.pci.bar_address(sb, 3), None);
    assert_eq!(m.mem_read(0xc000_0000), Some(0x0302_0100));
    assert_eq!(
        m.mem_read(0xc000_1000),
        Some(u32::MAX),
        "b's upper half is dead too"
    );
    // a moves away: b now decodes where its registers say.
    m.cf8_write(sa, 0x10, &0xd000_0000u32.to_le_bytes());
    assert_eq!(m.pci.bar_address(sb, 3), Some(0xc000_0000));
    assert_eq!(m.mem_read(0xc000_1000), Some(0x3332_3130));
    // a moves back onto b: a wins again (earlier slot), whatever the write order.
    m.cf8_write(sa, 0x10, &0xc000_1000u32.to_le_bytes());
    assert_eq!(m.pci.bar_address(sa, 0), Some(0xc000_1000));
    assert_eq!(m.pci.bar_address(sb, 3), None);
    assert_eq!(b.lock().unwrap().moved.last(), Some(&(3, None)));
    assert_ne!(b_base, 0xc000_0000);
}

/// Random configuration writes of random sizes at random offsets, through both
/// mechanisms, never panic, and the dispatch table always follows the decoding rule.
#[test]
fn garbage_config_writes_never_panic() {
    let m = Machine::new();
    let f1 = TestFn::new(
        "a",
        &[bar(0, 0x1000, BarKind::Memory32), bar(1, 0x20, BarKind::Io)],
    );
    let f2 = TestFn::new(
        "b",
        &[
            bar(0, 0x4000, BarKind::Memory64),
            bar(2, 0x100, BarKind::Io),
        ],
    );
    m.pci.add_device(f1).unwrap();
    m.pci.add_device(f2).unwrap();
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let mut buf = [0u8; 16];
    for _ in 0..20_000 {
        for b in buf.iter_mut() {
            *b = rng.next() as u8;
        }
        let len = (rng.next() % 9) as usize;
        let dev = (rng.next() % 4) as u8;
        // Mostly the header (BARs, command), sometimes anywhere.
        let reg = if rng.next().is_multiple_of(4) {
            (rng.next() % 0x1000) as u16
        } else {
            (rng.next() % 0x40) as u16
        };
        match rng.next() % 4 {
            0 => {
                let addr = ECAM + (rng.next() % ECAM_BUS_SIZE);
                let _ = m.mmio.write(addr, &buf[..len]);
            }
            1 => {
                let _ = m.pio.write(0xcf8 + rng.next() % 8, &buf[..len]);
            }
            2 => {
                let _ = m
                    .pio
                    .write(0xcf8, &Machine::cf8_address(dev, reg).to_le_bytes());
                let _ = m.pio.write(0xcfc + rng.next() % 4, &buf[..len]);
            }
            _ => m
                .pci
                .config_write(0, dev, 0, reg, (rng.next() % 5) as u8, &buf[..len]),
        }
        // Accesses into the windows must not panic either.
        let mut d = [0u8; 8];
        let _ = m
            .mmio
            .read(MMIO32.base + rng.next() % 0x10_0000, &mut d[..len.min(8)]);
        let _ = m.pio.read(IO.base + rng.next() % IO.size, &mut d[..1]);
    }
    check_decoding_rule(&m);
}

/// Every decoding BAR lies in its window and overlaps no other.
fn check_decoding_rule(m: &Machine) {
    // (slot, BAR, size, I/O) of the two functions `garbage_config_writes_never_panic` adds.
    let bars = [
        (1u8, 0usize, 0x1000u64, false),
        (1, 1, 0x20, true),
        (2, 0, 0x4000, false),
        (2, 2, 0x100, true),
    ];
    let mut seen: Vec<(bool, u64, u64)> = Vec::new();
    for (slot, index, size, io) in bars {
        let Some(base) = m.pci.bar_address(slot, index) else {
            continue;
        };
        let in_window = if io {
            IO.contains(base, size)
        } else {
            MMIO32.contains(base, size) || MMIO64.contains(base, size)
        };
        assert!(in_window, "slot {slot} BAR {index} at {base:#x}");
        for &(other_io, b, s) in &seen {
            assert!(
                other_io != io || base + size <= b || b + s <= base,
                "overlap"
            );
        }
        seen.push((io, base, size));
    }
}

#[test]
fn save_and_restore_bring_placements_back() {
    let m = Machine::new();
    let f = TestFn::new(
        "f",
        &[
            bar(0, 0x1000, BarKind::Memory32),
            bar(2, 0x2000, BarKind::Memory64),
        ],
    );
    let g = TestFn::new("g", &[bar(0, 0x40, BarKind::Io)]);
    let sf = m.pci.add_device(f.clone()).unwrap();
    let sg = m.pci.add_device(g.clone()).unwrap();
    m.cf8_write(sf, 0x10, &0xd000_0000u32.to_le_bytes());
    m.cf8_write(sf, 0x18, &0x0000_0000u32.to_le_bytes());
    m.cf8_write(sf, 0x1c, &0x0000_0002u32.to_le_bytes()); // 8 GiB: in the 64-bit window
    m.cf8_write(sg, 4, &[0]); // decoding off
    let saved = m.pci.save().unwrap();
    let f_saved = f.lock().unwrap().save().unwrap();

    // A new machine of the same shape, as a restore builds it.
    let n = Machine::new();
    let f2 = TestFn::new(
        "f",
        &[
            bar(0, 0x1000, BarKind::Memory32),
            bar(2, 0x2000, BarKind::Memory64),
        ],
    );
    let g2 = TestFn::new("g", &[bar(0, 0x40, BarKind::Io)]);
    n.pci.add_device(f2.clone()).unwrap();
    n.pci.add_device(g2.clone()).unwrap();
    f2.lock().unwrap().restore(&f_saved).unwrap();
    f2.lock().unwrap().moved.clear();
    let mut bus = PciBus::new(layout(), no_irq()).unwrap();
    // The Lifecycle entry point takes &mut; the machine's shared bus uses restore_state.
    assert!(
        bus.restore(&saved).is_err(),
        "an empty bus is another machine"
    );
    n.pci
        .restore_state(&saved.parse("pci-bus", 1).unwrap())
        .unwrap();
    assert_eq!(n.pci.bar_address(sf, 0), Some(0xd000_0000));
    assert_eq!(n.pci.bar_address(sf, 2), Some(0x2_0000_0000));
    assert_eq!(n.pci.bar_address(sg, 0), None);
    assert_eq!(n.mem_read(0xd000_0000), Some(0x0302_0100));
    assert_eq!(n.mem_read(0xc000_0000), Some(u32::MAX));
    assert_eq!(n.cf8_read(sg, 4, 2), 0);
    // Every BAR is told where it is after a restore, changed or not.
    assert_eq!(
        f2.lock().unwrap().moved,
        vec![(0, Some(0xd000_0000)), (2, Some(0x2_0000_0000))]
    );
    assert_eq!(g2.lock().unwrap().moved.last(), Some(&(0, None)));
    assert_eq!(n.pci.save().unwrap(), saved);

    // Another shape is refused.
    let o = Machine::new();
    o.pci.add_device(TestFn::new("f", &[])).unwrap();
    let state = saved.parse("pci-bus", 1).unwrap();
    assert!(o.pci.restore_state(&state).is_err());

    // Reset puts the placements back where add_device put them.
    n.pci.reset_placements();
    assert_eq!(n.pci.bar_address(sf, 0), Some(0xc000_0000));
    assert_eq!(n.pci.bar_address(sg, 0), Some(0xc000));
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

#[test]
fn intx_lines_reach_their_gsis() {
    #[derive(Default)]
    struct Recorder(Mutex<Vec<(u32, bool)>>);
    impl devices::irqchip::IrqChip for Recorder {
        fn set_irq(&self, gsi: u32, level: bool) {
            self.0.lock().unwrap().push((gsi, level));
        }
    }
    let chip = Arc::new(Recorder::default());
    let pci = PciBus::new(layout(), chip.clone()).unwrap();
    let mut a = pci.intx_line(3, IntxPin::A).unwrap();
    let mut b = pci.intx_line(7, IntxPin::A).unwrap();
    assert_eq!((a.gsi(), b.gsi()), (19, 19));
    a.set(true);
    b.set(true);
    a.set(false);
    b.set(false);
    assert_eq!(*chip.0.lock().unwrap(), vec![(19, true), (19, false)]);
    assert!(pci.intx_line(32, IntxPin::A).is_none());
}

#[test]
fn config_only_functions_beside_function_0() {
    let m = Machine::new();
    let pm = Arc::new(Mutex::new(crate::piix::power_management()));
    // No function 0 in slot 1 yet; function 0 itself is not added this way.
    assert!(matches!(
        m.pci.add_function_at(1, 3, pm.clone()),
        Err(PciError::BadFunction { .. })
    ));
    m.pci
        .add_device_at(1, Arc::new(Mutex::new(crate::piix::isa_bridge())))
        .unwrap();
    assert!(m.pci.add_function_at(1, 0, pm.clone()).is_err());
    assert!(m.pci.add_function_at(1, 8, pm.clone()).is_err());
    m.pci.add_function_at(1, 3, pm.clone()).unwrap();
    assert!(m.pci.add_function_at(1, 3, pm.clone()).is_err(), "taken");
    let with_bar = TestFn::new("b", &[bar(0, 0x1000, BarKind::Memory32)]);
    assert!(m.pci.add_function_at(1, 2, with_bar).is_err(), "BARs");
    // Function 3 through both mechanisms; absent functions read all ones.
    let cf8 = |func: u32, reg: u32| {
        let addr = 0x8000_0000 | 1 << 11 | func << 8 | reg;
        assert!(m.pio.write(0xcf8, &addr.to_le_bytes()));
        let mut d = [0u8; 4];
        assert!(m.pio.read(0xcfc, &mut d));
        u32::from_le_bytes(d)
    };
    assert_eq!(cf8(0, 0), 0x7000_8086);
    assert_eq!(cf8(3, 0), 0x7113_8086);
    assert_eq!(cf8(2, 0), u32::MAX);
    let ecam3 = ECAM + (1 << 15) + (3 << 12);
    let mut d = [0u8; 4];
    assert!(m.mmio.write(ecam3 + 0x40, &0x601u32.to_le_bytes()));
    assert!(m.mmio.read(ecam3 + 0x40, &mut d));
    assert_eq!(u32::from_le_bytes(d), 0x601);
    assert_eq!(cf8(3, 0x40), 0x601);
}

#[test]
fn reset_control_register() {
    let m = Machine::new();
    let resets = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let r = resets.clone();
    m.pci.set_reset_handler(Arc::new(move || {
        r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }));
    let rcr = |value: u8| assert!(m.pio.write(0xcf9, &[value]));
    let count = || resets.load(std::sync::atomic::Ordering::SeqCst);
    rcr(0x02);
    assert_eq!(count(), 0, "hard-reset select alone");
    let mut d = [0u8];
    assert!(m.pio.read(0xcf9, &mut d));
    assert_eq!(d, [0x02]);
    rcr(0x06);
    assert_eq!(count(), 1, "RST_CPU rising");
    rcr(0x06);
    assert_eq!(count(), 1, "no new edge");
    rcr(0x00);
    rcr(0x04);
    assert_eq!(count(), 2);
    // A dword at 0xcf8 is still the configuration address.
    assert_eq!(m.cf8_read(0, 0, 4), 0x1237_8086);
}

#[test]
fn a_window_around_ecam_decodes_both_sides() {
    let layout = PciLayout {
        ecam: Window::new(ECAM, ECAM_BUS_SIZE),
        mmio32: Window::new(0xc000_0000, 0xfec0_0000 - 0xc000_0000),
        mmio64: MMIO64,
        io: IO,
    };
    let pci = Arc::new(PciBus::new(layout, no_irq()).unwrap());
    pci.add_device_at(0, Arc::new(Mutex::new(HostBridge::new())))
        .unwrap();
    let (mut pio, mut mmio) = (Bus::new(), Bus::new());
    pci.register(&mut pio, &mut mmio).unwrap();
    let f = TestFn::new("f", &[bar(0, 0x8000, BarKind::Memory32)]);
    pci.add_device_at(2, f).unwrap();
    // Firmware moves the BAR above ECAM, as SeaBIOS does.
    let bar0 = 0x8000_0000u32 | 2 << 11 | 0x10;
    assert!(pio.write(0xcf8, &bar0.to_le_bytes()));
    assert!(pio.write(0xcfc, &0xfebf_8000u32.to_le_bytes()));
    let mut d = [0u8; 4];
    assert!(mmio.read(0xfebf_8004, &mut d));
    assert_eq!(d, [0x04, 0x05, 0x06, 0x07], "BAR 0 bytes 4-7");
    // ECAM is still ECAM.
    assert!(mmio.read(ECAM, &mut d));
    assert_eq!(u32::from_le_bytes(d), 0x1237_8086);
}

/// No BAR access waits on another function: while one function's handler is stopped
/// inside a BAR read on one thread, another thread reaches a second function's memory
/// BAR (in the same window), its I/O BAR and its configuration space.
#[test]
fn a_stalled_function_never_delays_another_functions_bars() {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let m = Machine::new();
    let (entered_tx, entered) = channel();
    let (release, release_rx) = channel();
    let a = TestFn::new("a", &[bar(0, 0x1000, BarKind::Memory32)]);
    a.lock().unwrap().stall = Some((entered_tx, release_rx));
    let sa = m.pci.add_device(a).unwrap();
    let b = TestFn::new(
        "b",
        &[bar(0, 0x1000, BarKind::Memory32), bar(1, 0x40, BarKind::Io)],
    );
    let sb = m.pci.add_device(b).unwrap();
    let bar_a = m.pci.bar_address(sa, 0).unwrap();
    let bar_b = m.pci.bar_address(sb, 0).unwrap();
    let io_b = m.pci.bar_address(sb, 1).unwrap();
    let m = &m;
    std::thread::scope(|s| {
        let a_reader = s.spawn(move || m.mem_read(bar_a));
        entered.recv().unwrap();
        let (done_tx, done) = channel();
        s.spawn(move || {
            let mem = m.mem_read(bar_b + 4);
            let mut io = [0u8; 2];
            assert!(m.pio.read(io_b, &mut io));
            let vendor = m.cf8_read(sb, 0, 2);
            let _ = done_tx.send((mem, io, vendor));
        });
        // Generous: it fails only if B waits for A (forever, until A is released).
        let served = done.recv_timeout(Duration::from_secs(20));
        release.send(()).unwrap();
        let (mem, io, vendor) = served.expect("function B waited for function A");
        assert_eq!(mem, Some(0x0706_0504));
        assert_eq!(io, [0x10, 0x11]);
        assert_eq!(vendor, 0x1af4);
        assert_eq!(a_reader.join().unwrap(), Some(0x0302_0100));
    });
}
