//! State capture and restore against the real /dev/kvm: a guest stopped on one VM resumes on
//! a new one; the in-kernel irqchip travels; dirty logging in both protocols.

mod common;

use std::sync::Arc;

use common::{region_of, require_kvm, start_flat_32};

use hypervisor::{
    open_accelerator, restore_vcpu_state, save_vcpu_state, AccelKind, Hypervisor, IrqChipMode,
    IrqChipState, Vcpu, VcpuExit, VcpuState, Vm,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM_SIZE: usize = 1 << 21;
const CODE: u64 = 0x1000;
const COUNTER: u64 = 0x3000;
const PORT: u16 = 0x80;
const INPUT_PORT: u16 = 0x81;

/// A running sum of bytes read from port 0x81, stored at 0x3000 and written to port 0x80:
///
/// ```text
///       mov dx, 0x80
/// loop: in al, 0x81; movzx eax, al; add ebx, eax; mov [0x3000], ebx
///       mov eax, ebx; out dx, eax; jmp loop
/// ```
const COUNTING_GUEST: &[u8] = &[
    0x66, 0xba, 0x80, 0x00, // mov dx, 0x80
    0xe4, 0x81, // in al, 0x81
    0x0f, 0xb6, 0xc0, // movzx eax, al
    0x01, 0xc3, // add ebx, eax
    0x89, 0x1d, 0x00, 0x30, 0x00, 0x00, // mov [0x3000], ebx
    0x89, 0xd8, // mov eax, ebx
    0xef, // out dx, eax
    0xeb, 0xee, // jmp loop
];

fn accelerator() -> Box<dyn Hypervisor> {
    require_kvm();
    open_accelerator(AccelKind::Kvm).expect("open kvm")
}

/// A VM with `mode`'s interrupt controllers and 2 MiB of RAM (a copy of `ram` if given), and
/// one vCPU with the host's CPUID. The vCPU is left in its reset state.
fn new_machine(
    hv: &dyn Hypervisor,
    mode: IrqChipMode,
    ram: Option<&[u8]>,
) -> (Arc<dyn Vm>, Box<dyn Vcpu>, GuestMemoryMmap) {
    let vm = hv.create_vm().expect("create vm");
    vm.create_irqchip(mode).expect("create irqchip");
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    if let Some(ram) = ram {
        mem.write_slice(ram, GuestAddress(0)).unwrap();
    }
    // SAFETY: `mem` is returned to the caller and outlives every use of the VM in the test.
    unsafe { vm.map_memory(&region_of(&mem)) }.expect("map memory");
    let vcpu = vm.create_vcpu(0).expect("create vcpu");
    vcpu.set_cpuid(&hv.supported_cpuid().unwrap())
        .expect("set cpuid");
    (vm, vcpu, mem)
}

/// Puts the vCPU in flat 32-bit protected mode at the code.
fn start_at_code(vcpu: &dyn Vcpu) {
    start_flat_32(vcpu, CODE);
}

/// Runs until the guest's next OUT to the counter port and returns the value written; the
/// guest's IN reads `input`.
fn next_sum(vcpu: &mut dyn Vcpu, input: u8) -> u32 {
    loop {
        match vcpu.run().unwrap() {
            VcpuExit::IoIn { port, data, .. } => {
                assert_eq!(port, INPUT_PORT);
                data[0] = input;
            }
            VcpuExit::IoOut { port, data, .. } => {
                assert_eq!(port, PORT);
                let mut word = [0u8; 4];
                word.copy_from_slice(data);
                return u32::from_le_bytes(word);
            }
            VcpuExit::Interrupted | VcpuExit::Spurious => {}
            other => panic!("unexpected exit {other:?}"),
        }
    }
}

/// Runs until the guest's next OUT and returns the value written; the guest's IN reads 1.
fn next_count(vcpu: &mut dyn Vcpu) -> u32 {
    next_sum(vcpu, 1)
}

/// What a pause does: kick, so the next `run` completes the pending exit in the kernel and
/// returns without running guest code.
fn pause(vcpu: &mut dyn Vcpu) {
    let kicker = vcpu.bind_kicker().unwrap();
    kicker.kick().unwrap();
    assert!(matches!(vcpu.run().unwrap(), VcpuExit::Interrupted));
}

fn read_ram(mem: &GuestMemoryMmap) -> Vec<u8> {
    let mut ram = vec![0u8; MEM_SIZE];
    mem.read_slice(&mut ram, GuestAddress(0)).unwrap();
    ram
}

fn counter(mem: &GuestMemoryMmap) -> u32 {
    mem.read_obj::<u32>(GuestAddress(COUNTER)).unwrap()
}

#[test]
fn guest_resumes_on_a_new_vm_where_it_stopped() {
    let hv = accelerator();
    let (vm, mut vcpu, mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    mem.write_slice(COUNTING_GUEST, GuestAddress(CODE)).unwrap();
    start_at_code(&*vcpu);
    for (input, sum) in [(1, 1), (2, 3), (3, 6), (4, 10), (5, 15)] {
        assert_eq!(next_sum(&mut *vcpu, input), sum);
    }
    // Stop in the middle of an IN: the byte handed over only reaches AL when the kernel
    // completes the instruction, which the pause's re-entry does.
    match vcpu.run().unwrap() {
        VcpuExit::IoIn { port, data, .. } => {
            assert_eq!(port, INPUT_PORT);
            data[0] = 100;
        }
        other => panic!("unexpected exit {other:?}"),
    }
    pause(&mut *vcpu);

    // Save: vCPU, RAM, in-kernel irqchip, clock; through JSON, as a stream would carry it.
    let msr_list = hv.msr_index_list().unwrap();
    let state = save_vcpu_state(&*vcpu, &msr_list).expect("save vcpu state");
    assert_eq!(state.regs.rbx, 15);
    assert_eq!(
        state.regs.rax & 0xff,
        100,
        "the IN completed before the save"
    );
    assert!(state.xsave.is_some());
    assert!(state.msrs.iter().any(|m| m.index == 0x10), "TSC saved");
    let json = serde_json::to_string(&state).unwrap();
    let state: VcpuState = serde_json::from_str(&json).unwrap();
    let ram = read_ram(&mem);
    let irqchip = vm.irqchip_state().expect("save irqchip");
    let clock = vm.clock().expect("save clock");
    drop(vcpu);
    drop(vm);

    // Restore on a new VM.
    let (vm2, mut vcpu2, mem2) = new_machine(&*hv, IrqChipMode::Kernel, Some(&ram));
    vm2.set_irqchip_state(&irqchip).expect("restore irqchip");
    restore_vcpu_state(&*vcpu2, &state).expect("restore vcpu state");
    vm2.set_clock(&clock).expect("restore clock");

    // What was restored reads back the same (the TSC moves on; all else is still).
    let back = save_vcpu_state(&*vcpu2, &msr_list).unwrap();
    assert_eq!(back.regs, state.regs);
    assert_eq!(back.sregs, state.sregs);
    assert_eq!(back.fpu, state.fpu);
    assert_eq!(back.xsave, state.xsave);
    assert_eq!(back.xcrs, state.xcrs);
    assert_eq!(back.lapic, state.lapic);
    assert_eq!(back.mp_state, state.mp_state);
    assert_eq!(back.vcpu_events, state.vcpu_events);
    assert_eq!(back.cpuid, state.cpuid);
    let without_tsc =
        |s: &VcpuState| -> Vec<_> { s.msrs.iter().filter(|m| m.index != 0x10).copied().collect() };
    assert_eq!(without_tsc(&back), without_tsc(&state));

    // The guest continues after its IN, with the sum so far (not from the start), and its
    // RAM came along.
    assert_eq!(counter(&mem2), 15);
    assert_eq!(next_sum(&mut *vcpu2, 7), 115);
    assert_eq!(next_sum(&mut *vcpu2, 7), 122);
    assert_eq!(counter(&mem2), 122);
}

#[test]
fn restoring_garbage_vcpu_state_is_an_error() {
    let hv = accelerator();
    let (_vm, vcpu, _mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    start_at_code(&*vcpu);
    let good = save_vcpu_state(&*vcpu, &[]).unwrap();

    let mut bad = good.clone();
    bad.lapic
        .as_mut()
        .expect("KVM saves the LAPIC")
        .regs
        .truncate(16);
    assert!(restore_vcpu_state(&*vcpu, &bad).is_err());
    let mut bad = good.clone();
    bad.xsave = Some(hypervisor::XsaveState {
        region: vec![0; 5000],
    });
    assert!(restore_vcpu_state(&*vcpu, &bad).is_err());
    // Reserved CR4 bits: the kernel refuses them.
    let mut bad = good.clone();
    bad.sregs.cr4 = u64::MAX;
    assert!(restore_vcpu_state(&*vcpu, &bad).is_err());
    // An MSR nobody has.
    let mut bad = good.clone();
    bad.msrs.push(hypervisor::MsrEntry {
        index: 0x1234_5678,
        data: 1,
    });
    assert!(restore_vcpu_state(&*vcpu, &bad).is_err());
    // Still usable afterwards.
    restore_vcpu_state(&*vcpu, &good).unwrap();
}

#[test]
fn kernel_irqchip_state_travels_to_a_new_vm() {
    let hv = accelerator();
    let (vm, _vcpu, _mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    // Leave a mark: COM1's line (ISA IRQ 4) held high sets the PIC's and the IOAPIC's IRR.
    vm.set_irq_line(4, true).unwrap();
    let saved = vm.irqchip_state().unwrap();
    assert_eq!(saved.backend, "kvm");
    assert_eq!(saved.pic_master.len(), 16);
    assert_eq!(saved.ioapic.len(), 216);
    assert_eq!(saved.pit.len(), 112);
    assert_ne!(saved.pic_master[1] & 0x10, 0, "IRQ 4 requested at the PIC");

    // Same VM: get -> set -> get.
    vm.set_irqchip_state(&saved).unwrap();
    let again = vm.irqchip_state().unwrap();
    assert_eq!(again.pic_master, saved.pic_master);
    assert_eq!(again.pic_slave, saved.pic_slave);
    assert_eq!(again.ioapic, saved.ioapic);

    // A new VM takes it (the PIT's load time is re-based on the new host clock).
    let (vm2, _vcpu2, _mem2) = new_machine(&*hv, IrqChipMode::Kernel, None);
    assert_ne!(vm2.irqchip_state().unwrap().pic_master, saved.pic_master);
    let json = serde_json::to_string(&saved).unwrap();
    let carried: IrqChipState = serde_json::from_str(&json).unwrap();
    vm2.set_irqchip_state(&carried).unwrap();
    let restored = vm2.irqchip_state().unwrap();
    assert_eq!(restored.pic_master, saved.pic_master);
    assert_eq!(restored.pic_slave, saved.pic_slave);
    assert_eq!(restored.ioapic, saved.ioapic);

    // Garbage is refused and changes nothing.
    let before = vm2.irqchip_state().unwrap();
    let mut bad = saved.clone();
    bad.backend = "bhyve".into();
    assert!(vm2.set_irqchip_state(&bad).is_err());
    let mut bad = saved.clone();
    bad.ioapic.truncate(10);
    assert!(vm2.set_irqchip_state(&bad).is_err());
    let mut bad = saved.clone();
    bad.pit = vec![0xff; 112];
    assert!(vm2.set_irqchip_state(&bad).is_err());
    assert!(vm2.set_irqchip_state(&IrqChipState::default()).is_err());
    let after = vm2.irqchip_state().unwrap();
    assert_eq!(after.pic_master, before.pic_master);
    assert_eq!(after.ioapic, before.ioapic);
}

#[test]
fn split_irqchip_has_no_kernel_irqchip_state() {
    let hv = accelerator();
    let (vm, _vcpu, _mem) = new_machine(&*hv, IrqChipMode::Split { ioapic_pins: 24 }, None);
    assert!(vm.irqchip_state().is_err());
}

/// Bit `page` of a dirty bitmap.
fn dirty(bitmap: &[u64], page: u64) -> bool {
    bitmap[(page / 64) as usize] & (1 << (page % 64)) != 0
}

#[test]
fn dirty_log_classic_protocol() {
    let hv = accelerator();
    let (vm, mut vcpu, mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    mem.write_slice(COUNTING_GUEST, GuestAddress(CODE)).unwrap();
    start_at_code(&*vcpu);
    let region = region_of(&mem);
    vm.set_dirty_logging(&region, true).unwrap();
    assert!(vm
        .dirty_log(0, MEM_SIZE as u64)
        .unwrap()
        .iter()
        .all(|w| *w == 0));
    next_count(&mut *vcpu);
    let bits = vm.dirty_log(0, MEM_SIZE as u64).unwrap();
    assert!(dirty(&bits, COUNTER / 4096), "the counter's page");
    assert!(!dirty(&bits, CODE / 4096), "the code is only read");
    // The read cleared and re-protected: nothing new without guest writes.
    assert!(vm
        .dirty_log(0, MEM_SIZE as u64)
        .unwrap()
        .iter()
        .all(|w| *w == 0));
    next_count(&mut *vcpu);
    assert!(dirty(
        &vm.dirty_log(0, MEM_SIZE as u64).unwrap(),
        COUNTER / 4096
    ));

    vm.set_dirty_logging(&region, false).unwrap();
    assert!(vm.dirty_log(0, MEM_SIZE as u64).is_err(), "logging is off");
}

#[test]
fn dirty_log_manual_protect_protocol() {
    let hv = accelerator();
    let (vm, mut vcpu, mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    if !vm.enable_manual_dirty_protect().unwrap() {
        eprintln!("KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 is not offered here; skipped");
        return;
    }
    mem.write_slice(COUNTING_GUEST, GuestAddress(CODE)).unwrap();
    start_at_code(&*vcpu);
    let region = region_of(&mem);
    let pages = MEM_SIZE as u64 / 4096;
    vm.set_dirty_logging(&region, true).unwrap();

    // KVM_DIRTY_LOG_INITIALLY_SET: everything starts dirty, and GET does not clear.
    let initial = vm.dirty_log(0, MEM_SIZE as u64).unwrap();
    assert!((0..pages).all(|p| dirty(&initial, p)));
    assert_eq!(vm.dirty_log(0, MEM_SIZE as u64).unwrap(), initial);

    // "Send" everything: clear (and re-protect) the whole slot, in two ranges.
    vm.clear_dirty_log(0, 0, 64).unwrap();
    vm.clear_dirty_log(0, 64, pages - 64).unwrap();
    assert!(vm
        .dirty_log(0, MEM_SIZE as u64)
        .unwrap()
        .iter()
        .all(|w| *w == 0));

    // The guest writes its counter: only that page turns dirty, and stays so until cleared.
    next_count(&mut *vcpu);
    let bits = vm.dirty_log(0, MEM_SIZE as u64).unwrap();
    let counter_page = COUNTER / 4096;
    assert!(dirty(&bits, counter_page));
    assert!(!dirty(&bits, CODE / 4096));
    assert!(dirty(
        &vm.dirty_log(0, MEM_SIZE as u64).unwrap(),
        counter_page
    ));
    vm.clear_dirty_log(0, 0, 64).unwrap();
    assert!(!dirty(
        &vm.dirty_log(0, MEM_SIZE as u64).unwrap(),
        counter_page
    ));
    // Re-protected: the next write is caught again.
    next_count(&mut *vcpu);
    assert!(dirty(
        &vm.dirty_log(0, MEM_SIZE as u64).unwrap(),
        counter_page
    ));

    // Ranges the kernel would refuse are refused here, with a message.
    assert!(
        vm.clear_dirty_log(0, 1, 64).is_err(),
        "start not 64-aligned"
    );
    assert!(
        vm.clear_dirty_log(0, 0, 10).is_err(),
        "count not 64-aligned mid-slot"
    );
    assert!(vm.clear_dirty_log(0, 64, pages).is_err(), "past the slot");
    assert!(vm.clear_dirty_log(7, 0, 64).is_err(), "no such slot");
    vm.clear_dirty_log(0, 0, 0).unwrap();
}

#[test]
fn dirty_logging_only_for_the_slot_as_mapped() {
    let hv = accelerator();
    let (vm, _vcpu, mem) = new_machine(&*hv, IrqChipMode::Kernel, None);
    let region = region_of(&mem);
    let mut other_host = region;
    other_host.host_addr += 4096;
    assert!(vm.set_dirty_logging(&other_host, true).is_err());
    let mut other_slot = region;
    other_slot.slot = 3;
    assert!(vm.set_dirty_logging(&other_slot, true).is_err());
    let mut shorter = region;
    shorter.size /= 2;
    assert!(vm.set_dirty_logging(&shorter, true).is_err());
    vm.set_dirty_logging(&region, true).unwrap();
    vm.set_dirty_logging(&region, false).unwrap();
}
