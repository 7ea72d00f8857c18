//! irqfd, GSI routes and ioeventfd on the real /dev/kvm, with hand-assembled guests: guest
//! writes that signal an eventfd in the kernel without an exit, and eventfds that deliver
//! MSIs to a guest that counts its interrupts per vector, in both irqchip modes.

mod common;

use std::os::unix::io::AsRawFd;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use common::{region_of, require_kvm, start_flat_32};
use hypervisor::{
    open_accelerator, AccelKind, DescriptorTable, Hypervisor, HypervisorError, IoEventAddress,
    IrqChipMode, IrqChipPin, IrqRoute, MsiMessage, Vcpu, VcpuExit, VcpuKicker, Vm,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const MEM_SIZE: usize = 1 << 21;
const CODE: u64 = 0x1000;
const NOTIFY_MMIO: u64 = 0xd000_0000;
const NOTIFY_PIO: u16 = 0x500;
const READY_PORT: u16 = 0x80;
const WOKEN_PORT: u16 = 0x81;

// ---------------------------------------------------------------- machine set-up

fn accelerator() -> Box<dyn Hypervisor> {
    require_kvm();
    open_accelerator(AccelKind::Kvm).expect("open kvm")
}

/// A VM with 2 MiB of RAM holding `code` at 0x1000 and one vCPU about to run it in flat
/// 32-bit protected mode; interrupt controllers as `mode` says (none when `None`).
fn machine(
    hv: &dyn Hypervisor,
    mode: Option<IrqChipMode>,
    code: &[u8],
) -> (Arc<dyn Vm>, Box<dyn Vcpu>, GuestMemoryMmap) {
    let vm = hv.create_vm().expect("create vm");
    if let Some(mode) = mode {
        vm.create_irqchip(mode).expect("create irqchip");
        if mode == IrqChipMode::Kernel {
            // The VMM writes the PC wiring; these tests need the I/O APIC pins only.
            let routes: Vec<IrqRoute> = (1..24)
                .map(|pin| IrqRoute {
                    gsi: pin,
                    pin: IrqChipPin::Ioapic(pin),
                })
                .collect();
            vm.set_irqchip_routes(&routes).expect("irqchip routes");
        }
    }
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    // SAFETY: `mem` is returned to the caller and outlives every use of the VM in the test.
    unsafe { vm.map_memory(&region_of(&mem)) }.expect("map memory");
    mem.write_slice(code, GuestAddress(CODE)).unwrap();
    let vcpu = vm.create_vcpu(0).expect("create vcpu");
    vcpu.set_cpuid(&hv.supported_cpuid().unwrap())
        .expect("set cpuid");
    start_flat_32(vcpu.as_ref(), CODE);
    (vm, vcpu, mem)
}

fn eventfd() -> EventFd {
    EventFd::new(EFD_NONBLOCK).unwrap()
}

/// The eventfd's counter (reading resets it); 0 when it was never signalled.
fn count(fd: &EventFd) -> u64 {
    match fd.read() {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(e) => panic!("eventfd read: {e}"),
    }
}

/// Kicks the vCPU thread if the guest has not left `run` after 20 s (an interrupt that never
/// arrives leaves it in HLT inside the kernel), so a broken delivery fails instead of hanging.
struct Watchdog {
    cancel: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Watchdog {
    fn new(kicker: VcpuKicker) -> Self {
        let (cancel, wait) = mpsc::channel::<()>();
        let thread = thread::spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) =
                wait.recv_timeout(Duration::from_secs(20))
            {
                let _ = kicker.kick();
            }
        });
        Watchdog {
            cancel: Some(cancel),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.cancel.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

// ---------------------------------------------------------------- ioeventfd

/// `mov dword [NOTIFY_MMIO], value` for each value, then `out 0x80, al; hlt`.
fn mmio_writer(values: &[u32]) -> Vec<u8> {
    let mut code = Vec::new();
    for value in values {
        code.extend_from_slice(&[0xc7, 0x05]);
        code.extend_from_slice(&(NOTIFY_MMIO as u32).to_le_bytes());
        code.extend_from_slice(&value.to_le_bytes());
    }
    code.extend_from_slice(&[0xe6, READY_PORT as u8, 0xf4]);
    code
}

/// The MMIO writes that reached user space before the guest's `out 0x80`.
fn mmio_exits_until_done(vcpu: &mut dyn Vcpu) -> Vec<(u64, Vec<u8>)> {
    let mut seen = Vec::new();
    loop {
        match vcpu.run().unwrap() {
            VcpuExit::MmioWrite { addr, data } => seen.push((addr, data.to_vec())),
            VcpuExit::IoOut { port, .. } if port == READY_PORT => return seen,
            VcpuExit::Spurious => {}
            other => panic!("unexpected exit {other:?}"),
        }
    }
}

#[test]
fn capabilities_report_irqfd_and_ioeventfd() {
    let caps = accelerator().capabilities();
    assert!(caps.irqfd, "KVM_CAP_IRQFD");
    assert!(caps.ioeventfd, "KVM_CAP_IOEVENTFD");
}

#[test]
fn mmio_write_signals_the_eventfd_without_an_exit() {
    let hv = accelerator();
    let (vm, mut vcpu, _mem) = machine(&*hv, None, &mmio_writer(&[7]));
    let fd = eventfd();
    vm.register_ioeventfd(fd.as_raw_fd(), IoEventAddress::Mmio(NOTIFY_MMIO), 4, None)
        .unwrap();
    assert_eq!(mmio_exits_until_done(&mut *vcpu), vec![]);
    assert_eq!(count(&fd), 1);
}

#[test]
fn datamatch_lets_only_the_matching_value_through_the_kernel() {
    let hv = accelerator();
    let (vm, mut vcpu, _mem) = machine(&*hv, None, &mmio_writer(&[1, 2, 3, 2]));
    let fd = eventfd();
    let addr = IoEventAddress::Mmio(NOTIFY_MMIO);
    vm.register_ioeventfd(fd.as_raw_fd(), addr, 4, Some(2))
        .unwrap();
    let exits = mmio_exits_until_done(&mut *vcpu);
    let values: Vec<&[u8]> = exits.iter().map(|(_, data)| data.as_slice()).collect();
    assert_eq!(values, vec![&1u32.to_le_bytes(), &3u32.to_le_bytes()]);
    assert!(exits.iter().all(|(a, _)| *a == NOTIFY_MMIO));
    assert_eq!(count(&fd), 2);
}

#[test]
fn pio_write_with_datamatch_signals_the_eventfd() {
    // mov dx, 0x500; mov ax, 5; out dx, ax; mov ax, 9; out dx, ax; out 0x80, al; hlt
    let code = [
        0x66, 0xba, 0x00, 0x05, 0x66, 0xb8, 0x05, 0x00, 0x66, 0xef, 0x66, 0xb8, 0x09, 0x00, 0x66,
        0xef, 0xe6, 0x80, 0xf4,
    ];
    let hv = accelerator();
    let (vm, mut vcpu, _mem) = machine(&*hv, None, &code);
    let fd = eventfd();
    let addr = IoEventAddress::Pio(u64::from(NOTIFY_PIO));
    vm.register_ioeventfd(fd.as_raw_fd(), addr, 2, Some(9))
        .unwrap();
    match vcpu.run().unwrap() {
        VcpuExit::IoOut { port, data, .. } => {
            assert_eq!((port, data.to_vec()), (NOTIFY_PIO, vec![5, 0]))
        }
        other => panic!("unexpected exit {other:?}"),
    }
    match vcpu.run().unwrap() {
        VcpuExit::IoOut { port, .. } => assert_eq!(port, READY_PORT),
        other => panic!("unexpected exit {other:?}"),
    }
    assert_eq!(count(&fd), 1);
}

#[test]
fn unregistered_ioeventfd_no_longer_fires() {
    let hv = accelerator();
    let (vm, mut vcpu, _mem) = machine(&*hv, None, &mmio_writer(&[2]));
    let fd = eventfd();
    let addr = IoEventAddress::Mmio(NOTIFY_MMIO);
    vm.register_ioeventfd(fd.as_raw_fd(), addr, 4, Some(2))
        .unwrap();
    vm.unregister_ioeventfd(fd.as_raw_fd(), addr, 4, Some(2))
        .unwrap();
    let exits = mmio_exits_until_done(&mut *vcpu);
    assert_eq!(exits, vec![(NOTIFY_MMIO, 2u32.to_le_bytes().to_vec())]);
    assert_eq!(count(&fd), 0);
    // Unregistering what is not registered is the kernel's error, passed on.
    assert!(vm
        .unregister_ioeventfd(fd.as_raw_fd(), addr, 4, Some(2))
        .is_err());
}

#[test]
fn malformed_ioeventfd_requests_are_refused() {
    let hv = accelerator();
    let (vm, _vcpu, _mem) = machine(&*hv, None, &[0xf4]);
    let fd = eventfd();
    let addr = IoEventAddress::Mmio(NOTIFY_MMIO);
    for (len, datamatch) in [
        (3, None),
        (1, Some(0x100)),
        (2, Some(0x1_0000)),
        (0, Some(1)),
    ] {
        let err = vm
            .register_ioeventfd(fd.as_raw_fd(), addr, len, datamatch)
            .unwrap_err();
        assert!(
            matches!(err, HypervisorError::Invalid(_)),
            "{len} {datamatch:?}: {err}"
        );
    }
    assert!(vm.register_ioeventfd(-1, addr, 4, None).is_err());
    assert!(vm.register_irqfd(-1, 24).is_err());
}

// ---------------------------------------------------------------- irqfd and GSI routes

const GDT: u64 = 0x500;
const IDT: u64 = 0x2000;
const HANDLERS: u64 = 0x1800;
const COUNTERS: u64 = 0x3000;
/// The guest counts vectors FIRST_VECTOR .. FIRST_VECTOR + VECTORS.
const FIRST_VECTOR: u8 = 0x40;
const VECTORS: u8 = 4;
/// The in-kernel IOAPIC pin the guest programs to vector 0x42 (no 8259 input shares it).
const KERNEL_IOAPIC_PIN: u32 = 20;

fn mov_mem_imm32(addr: u32, value: u32) -> Vec<u8> {
    let mut code = vec![0xc7, 0x05];
    code.extend_from_slice(&addr.to_le_bytes());
    code.extend_from_slice(&value.to_le_bytes());
    code
}

/// Enables the LAPIC (masking LINT0, so no 8259 ExtINT can sneak in), points the in-kernel
/// IOAPIC's pin 20 at vector 0x42 (in split mode these writes exit and are ignored), says
/// it is ready on port 0x80, then waits for interrupts: `sti; hlt` forever. Also returns the
/// address of that loop.
fn counting_guest_main() -> (Vec<u8>, u32) {
    let redirection = 0x10 + 2 * KERNEL_IOAPIC_PIN;
    let mut code = Vec::new();
    code.extend(mov_mem_imm32(0xfee0_00f0, 0x1ff)); // SVR: enabled, spurious vector 0xff
    code.extend(mov_mem_imm32(0xfee0_0350, 0x1_0000)); // LVT LINT0 masked
    code.extend(mov_mem_imm32(0xfec0_0000, redirection));
    code.extend(mov_mem_imm32(0xfec0_0010, 0x42)); // fixed, physical, edge, unmasked
    code.extend(mov_mem_imm32(0xfec0_0000, redirection + 1));
    code.extend(mov_mem_imm32(0xfec0_0010, 0)); // destination APIC 0
    code.extend_from_slice(&[0xe6, READY_PORT as u8]);
    let idle = CODE as u32 + code.len() as u32;
    // idle: sti; hlt; jmp idle
    code.extend_from_slice(&[0xfb, 0xf4, 0xeb, 0xfc]);
    (code, idle)
}

/// `inc dword [counter]; mov dword [LAPIC EOI], 0`, then back to the idle loop with the
/// stack reset and a report on port 0x81. It never returns with IRET, which KVM's
/// instruction emulator (all of ring 0 on this project's PVM hosts) cannot do in protected
/// mode.
fn counting_handler(counter: u32, idle: u32) -> Vec<u8> {
    let mut code = vec![0xff, 0x05];
    code.extend_from_slice(&counter.to_le_bytes());
    code.extend(mov_mem_imm32(0xfee0_00b0, 0));
    code.extend_from_slice(&[0xbc, 0x00, 0x80, 0x00, 0x00]); // mov esp, 0x8000
    code.extend_from_slice(&[0xe6, WOKEN_PORT as u8]); // out 0x81, al
    code.push(0xb8); // mov eax, idle; jmp eax
    code.extend_from_slice(&idle.to_le_bytes());
    code.extend_from_slice(&[0xff, 0xe0]);
    code
}

fn counter_of(vector: u8) -> u64 {
    COUNTERS + 4 * u64::from(vector - FIRST_VECTOR)
}

/// Writes the GDT, the IDT and one counting handler per vector, and loads GDTR and IDTR.
fn install_counting_guest(vcpu: &dyn Vcpu, mem: &GuestMemoryMmap, idle: u32) {
    let gdt: [u64; 4] = [0, 0, 0x00cf_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
    for (i, entry) in gdt.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(GDT + 8 * i as u64))
            .unwrap();
    }
    for i in 0..VECTORS {
        let vector = FIRST_VECTOR + i;
        let handler = HANDLERS + 0x20 * u64::from(i);
        mem.write_slice(
            &counting_handler(counter_of(vector) as u32, idle),
            GuestAddress(handler),
        )
        .unwrap();
        // 32-bit interrupt gate, selector 0x10, present, DPL 0.
        let gate = (handler & 0xffff) | (0x10 << 16) | (0x8e00u64 << 32) | ((handler >> 16) << 48);
        mem.write_obj(gate, GuestAddress(IDT + 8 * u64::from(vector)))
            .unwrap();
    }
    let mut sregs = vcpu.sregs().unwrap();
    sregs.gdt = DescriptorTable {
        base: GDT,
        limit: 31,
    };
    sregs.idt = DescriptorTable {
        base: IDT,
        limit: 256 * 8 - 1,
    };
    vcpu.set_sregs(&sregs).unwrap();
}

/// A guest that counts its interrupts, and what drives it.
struct CountingGuest {
    vm: Arc<dyn Vm>,
    vcpu: Box<dyn Vcpu>,
    mem: GuestMemoryMmap,
    _watchdog: Watchdog,
    /// Level-triggered vectors whose EOI came back as `VcpuExit::IoapicEoi` (split mode).
    eois: Vec<u8>,
}

impl CountingGuest {
    /// Boots the guest on a VM with `mode`'s interrupt controllers, up to its "ready".
    fn start(hv: &dyn Hypervisor, mode: IrqChipMode) -> Self {
        let (main, idle) = counting_guest_main();
        let (vm, mut vcpu, mem) = machine(hv, Some(mode), &main);
        install_counting_guest(&*vcpu, &mem, idle);
        let watchdog = Watchdog::new(vcpu.bind_kicker().unwrap());
        let mut guest = CountingGuest {
            vm,
            vcpu,
            mem,
            _watchdog: watchdog,
            eois: Vec::new(),
        };
        guest.run_to(READY_PORT);
        guest
    }

    /// Runs until the guest writes to `port`, noting EOI exits on the way.
    fn run_to(&mut self, want: u16) {
        loop {
            match self.vcpu.run().unwrap() {
                VcpuExit::IoOut { port, .. } if port == want => return,
                // Split mode: the IOAPIC set-up is for the in-kernel one; nobody is there.
                VcpuExit::MmioWrite { addr, .. } if addr & !0xfff == 0xfec0_0000 => {}
                VcpuExit::IoapicEoi { vector } => self.eois.push(vector),
                VcpuExit::Spurious => {}
                VcpuExit::Interrupted => panic!("no interrupt reached the guest within 20 s"),
                other => panic!("unexpected exit {other:?}"),
            }
        }
    }

    /// Lets the guest take what is pending: its handler reports on port 0x81.
    fn wake(&mut self) {
        self.run_to(WOKEN_PORT);
    }

    /// How many times each vector FIRST_VECTOR.. was taken.
    fn counts(&self) -> Vec<u32> {
        (0..VECTORS)
            .map(|i| {
                self.mem
                    .read_obj::<u32>(GuestAddress(counter_of(FIRST_VECTOR + i)))
                    .unwrap()
            })
            .collect()
    }
}

fn irqfd_on(vm: &dyn Vm, gsi: u32) -> EventFd {
    let fd = eventfd();
    vm.register_irqfd(fd.as_raw_fd(), gsi).unwrap();
    fd
}

fn split() -> IrqChipMode {
    IrqChipMode::Split { ioapic_pins: 24 }
}

#[test]
fn irqfd_delivers_its_msi_route_in_both_irqchip_modes() {
    let hv = accelerator();
    for mode in [IrqChipMode::Kernel, split()] {
        let mut guest = CountingGuest::start(&*hv, mode);
        guest
            .vm
            .set_msi_route(24, Some(MsiMessage::fixed(0, 0x41)))
            .unwrap();
        let device = irqfd_on(&*guest.vm, 24);
        device.write(1).unwrap();
        guest.wake();
        assert_eq!(guest.counts(), [0, 1, 0, 0], "{mode:?}");
        // The route moves to another vector; the irqfd follows it.
        guest
            .vm
            .set_msi_route(24, Some(MsiMessage::fixed(0, 0x43)))
            .unwrap();
        device.write(1).unwrap();
        guest.wake();
        assert_eq!(guest.counts(), [0, 1, 0, 1], "{mode:?}");
        guest.vm.unregister_irqfd(device.as_raw_fd(), 24).unwrap();
    }
}

/// Kernel mode: the PC wiring of the in-kernel IOAPIC stays in the table while device routes
/// come and go.
#[test]
fn device_routes_keep_the_in_kernel_ioapic_wiring() {
    let hv = accelerator();
    let mut guest = CountingGuest::start(&*hv, IrqChipMode::Kernel);
    let vm = Arc::clone(&guest.vm);
    vm.set_msi_route(24, Some(MsiMessage::fixed(0, 0x41)))
        .unwrap();
    vm.set_msi_route(25, Some(MsiMessage::fixed(0, 0x43)))
        .unwrap();
    let pin = irqfd_on(&*vm, KERNEL_IOAPIC_PIN);
    let first = irqfd_on(&*vm, 24);
    let second = irqfd_on(&*vm, 25);

    pin.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [0, 0, 1, 0]);
    first.write(1).unwrap();
    guest.wake();
    second.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [0, 1, 1, 1]);

    // Dropping a device route silences its irqfd and nothing else.
    vm.set_msi_route(24, None).unwrap();
    first.write(1).unwrap();
    pin.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [0, 1, 2, 1]);
    // KVM_IRQ_LINE still finds the pin too.
    vm.set_irq_line(KERNEL_IOAPIC_PIN, true).unwrap();
    vm.set_irq_line(KERNEL_IOAPIC_PIN, false).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [0, 1, 3, 1]);
}

/// A level-triggered IOAPIC pin route, as the user-space IOAPIC installs it.
fn level_msi(vector: u8) -> MsiMessage {
    let mut msi = MsiMessage::fixed(0, vector);
    msi.data |= 1 << 15 | 1 << 14; // level trigger, asserted
    msi
}

/// Sends the level-triggered vector 0x42 and reports whether its EOI came back to user space,
/// which KVM does only for vectors the GSI table routes from an IOAPIC pin. An edge vector
/// 0x40 follows: on PVM hosts the LAPIC EOIs at delivery and the EOI exit comes on the next
/// entry rather than before the handler's report, and this lets it come.
fn eoi_reaches_user_space(guest: &mut CountingGuest) -> bool {
    guest.eois.clear();
    guest.vm.signal_msi(level_msi(0x42)).unwrap();
    guest.wake();
    guest.vm.signal_msi(MsiMessage::fixed(0, 0x40)).unwrap();
    guest.wake();
    guest.eois == [0x42]
}

/// Split mode: the user-space IOAPIC's pin routes and the device routes share KVM's one
/// table; writing either part keeps the other.
#[test]
fn split_mode_ioapic_routes_and_device_routes_coexist() {
    let hv = accelerator();
    let mut guest = CountingGuest::start(&*hv, split());
    let vm = Arc::clone(&guest.vm);
    vm.set_msi_routes(&[(5, level_msi(0x42))]).unwrap();
    assert!(eoi_reaches_user_space(&mut guest));
    assert_eq!(guest.counts(), [1, 0, 1, 0]);

    // A device route added after the IOAPIC's: the pin route stays (EOIs still exit).
    vm.set_msi_route(24, Some(MsiMessage::fixed(0, 0x41)))
        .unwrap();
    let device = irqfd_on(&*vm, 24);
    device.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [1, 1, 1, 0]);
    assert!(eoi_reaches_user_space(&mut guest));

    // The guest reprograms its IOAPIC: the device route stays.
    vm.set_msi_routes(&[(5, level_msi(0x42)), (9, MsiMessage::fixed(0, 0x43))])
        .unwrap();
    device.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [2, 2, 2, 0]);

    // An irqfd on a pin route works as well.
    let pin = irqfd_on(&*vm, 9);
    pin.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [2, 2, 2, 1]);
    assert!(eoi_reaches_user_space(&mut guest));

    // And the check can fail: without the pin route, the EOI stays in the kernel.
    vm.set_msi_routes(&[]).unwrap();
    assert!(!eoi_reaches_user_space(&mut guest));
    device.write(1).unwrap();
    guest.wake();
    assert_eq!(guest.counts(), [4, 3, 4, 1]);
}

#[test]
fn routes_outside_their_owners_range_are_refused() {
    let hv = accelerator();
    let (vm, _vcpu, _mem) = machine(&*hv, Some(split()), &[0xf4]);
    let msi = MsiMessage::fixed(0, 0x40);
    assert!(vm.set_msi_route(23, Some(msi)).is_err());
    assert!(vm.set_msi_routes(&[(24, msi)]).is_err());
    vm.set_msi_route(24, Some(msi)).unwrap();
}
