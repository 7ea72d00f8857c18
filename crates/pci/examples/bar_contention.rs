//! How much one PCI function's BAR accesses wait on another's: two functions on bus 0,
//! their BARs reached through the machine's MMIO bus as vCPU exits reach them.
//!
//! 1. Latency of a BAR read of function B while function A's handler is busy (as a
//!    virtio function is while it pauses its I/O threads).
//! 2. Throughput of two threads, each hammering its own function whose handler does a
//!    little work, against one thread alone.
//!
//! `cargo run --release -p pci --example bar_contention`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use devices::bus::Bus;
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use pci::config::{ConfigSpace, PciIds};
use pci::{BarKind, BarRequest, PciBus, PciDevice, PciLayout, Window};

const BUSY: Duration = Duration::from_millis(200);
const WORK: Duration = Duration::from_micros(2);
const ACCESSES: u32 = 20_000;

/// A function with one 4 KiB BAR whose reads spin for `work`, or, while `hold` is set,
/// for [`BUSY`].
struct Function {
    config: ConfigSpace,
    work: Duration,
    hold: Arc<AtomicBool>,
}

impl Lifecycle for Function {
    fn id(&self) -> String {
        "bench".into()
    }
    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(1, &())
    }
    fn restore(&mut self, _state: &DeviceState) -> Result<(), StateError> {
        Ok(())
    }
}

impl PciDevice for Function {
    fn bars(&self) -> Vec<BarRequest> {
        self.config.bar_requests()
    }
    fn config_read(&mut self, offset: u16) -> u32 {
        self.config.read(offset)
    }
    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        self.config.write(offset, sub, data)
    }
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        let work = if self.hold.swap(false, Ordering::AcqRel) {
            BUSY
        } else {
            self.work
        };
        spin(work);
        data.fill(0x5a);
    }
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
}

fn spin(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn function(work: Duration, hold: Arc<AtomicBool>) -> Arc<Mutex<Function>> {
    let mut config = ConfigSpace::new(PciIds {
        vendor: 0x1af4,
        device: 0x10ff,
        revision: 1,
        class: 0xff_00_00,
        subsystem_vendor: 0x1af4,
        subsystem: 0xff,
    });
    config
        .add_bar(BarRequest {
            index: 0,
            size: 0x1000,
            kind: BarKind::Memory32,
            prefetchable: false,
        })
        .expect("a 4 KiB BAR");
    Arc::new(Mutex::new(Function { config, work, hold }))
}

fn main() {
    let layout = PciLayout {
        ecam: Window::new(0xe000_0000, 1 << 20),
        mmio32: Window::new(0xc000_0000, 0x2000_0000),
        mmio64: Window::new(0x1_0000_0000, 1 << 36),
        io: Window::new(0xc000, 0x4000),
    };
    let pci = Arc::new(PciBus::new(layout, Arc::new(devices::serial::NoIrq)).expect("bus 0"));
    let hold = Arc::new(AtomicBool::new(false));
    let slot_a = pci
        .add_device(function(WORK, hold.clone()))
        .expect("function A");
    let slot_b = pci
        .add_device(function(WORK, Arc::new(AtomicBool::new(false))))
        .expect("function B");
    let (mut pio, mut mmio) = (Bus::new(), Bus::new());
    pci.register(&mut pio, &mut mmio)
        .expect("registering bus 0");
    let mmio = Arc::new(mmio);
    let bar_a = pci.bar_address(slot_a, 0).expect("BAR of A decodes");
    let bar_b = pci.bar_address(slot_b, 0).expect("BAR of B decodes");

    // 1. B's latency while A's handler is busy.
    hold.store(true, Ordering::Release);
    let started = Arc::new(Barrier::new(2));
    let busy = {
        let (mmio, started) = (mmio.clone(), started.clone());
        std::thread::spawn(move || {
            started.wait();
            mmio.read(bar_a, &mut [0u8; 4]);
        })
    };
    started.wait();
    std::thread::sleep(Duration::from_millis(20)); // A is inside its handler by now
    let t = Instant::now();
    mmio.read(bar_b, &mut [0u8; 4]);
    let waited = t.elapsed();
    busy.join().expect("A's reader");
    println!(
        "B's BAR read while A's handler runs for {BUSY:?}: {:.3} ms",
        waited.as_secs_f64() * 1e3
    );

    // 2. Throughput, one thread then two on two functions.
    let run = |bars: &[u64]| {
        let t = Instant::now();
        let threads: Vec<_> = bars
            .iter()
            .map(|&bar| {
                let mmio = mmio.clone();
                std::thread::spawn(move || {
                    let mut data = [0u8; 4];
                    for _ in 0..ACCESSES {
                        mmio.read(bar, &mut data);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().expect("a reader");
        }
        f64::from(ACCESSES) * bars.len() as f64 / t.elapsed().as_secs_f64()
    };
    let one = run(&[bar_a]);
    let two = run(&[bar_a, bar_b]);
    println!(
        "BAR reads with {WORK:?} of device work: 1 thread {:.0}/s, 2 threads on 2 functions {:.0}/s ({:.2}x)",
        one,
        two,
        two / one
    );
}
