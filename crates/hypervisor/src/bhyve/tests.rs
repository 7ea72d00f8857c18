//! The bhyve backend against the fake kernel: what it asks vmm.ko, in which order, and what
//! it makes of the answers.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::Arc;

use super::abi::{self, exitcode, reg, suspend, Abi, SegDesc};
use super::exit::build;
use super::fake::{Call, FakeControl, FakeKernel};
use super::{BhyveHypervisor, BhyveOptions, BhyveVcpu, BhyveVm};
use crate::{
    Hypervisor, HypervisorError, IrqChipMode, IrqChipPin, IrqRoute, MemoryRegion, MpState,
    MsiMessage, SegmentRegister, SpecialRegisters, StandardRegisters, Vcpu, VcpuExit, Vm,
};

struct Setup {
    control: Arc<FakeControl>,
    kernel: Arc<FakeKernel>,
    vm: Arc<BhyveVm>,
}

fn setup(abi: Abi) -> Setup {
    let control = FakeControl::new(abi);
    let hv = BhyveHypervisor::with_control(control.clone(), BhyveOptions::default());
    let vm = hv.create_bhyve_vm().unwrap();
    // Forget the VM_SNAPSHOT_REQ probe of VM creation (bhyve/snapshot.rs tests it).
    control.kernel.clear_calls();
    Setup {
        kernel: control.kernel.clone(),
        control,
        vm,
    }
}

fn vcpu(s: &Setup, id: u32) -> BhyveVcpu {
    s.vm.create_bhyve_vcpu(id).unwrap()
}

/// Index of the first call after `from` that matches.
fn find(calls: &[Call], from: usize, pred: impl Fn(&Call) -> bool) -> Option<usize> {
    calls.iter().skip(from).position(pred).map(|i| i + from)
}

fn is_run(c: &Call) -> bool {
    c.request == abi::VM_RUN || c.request == abi::VM_RUN_IOWR
}

fn runs(k: &FakeKernel) -> Vec<usize> {
    k.calls()
        .iter()
        .enumerate()
        .filter(|(_, c)| is_run(c))
        .map(|(i, _)| i)
        .collect()
}

fn hlt() -> [u8; abi::VM_EXIT_SIZE] {
    build::header(exitcode::HLT, 1, 0)
}

#[test]
fn capabilities_are_honest() {
    let s = setup(Abi::FreeBsd15);
    let hv = BhyveHypervisor::with_control(s.control.clone(), BhyveOptions::default());
    let caps = hv.capabilities();
    assert_eq!(caps.accelerator, "bhyve");
    assert!(caps.irqchip_kernel);
    assert!(!caps.irqchip_split, "bhyve has no split irqchip");
    assert!(
        !caps.dirty_log_bitmap,
        "upstream bhyve has no dirty tracking"
    );
    assert_eq!(caps.dirty_log_ring_bytes, 0);
    assert!(!caps.dirty_log_manual_protect);
    assert!(caps.msi_injection);
    assert!(caps.user_space_msr);
    assert!(!caps.xsave && !caps.vcpu_events && !caps.immediate_exit);
    assert_eq!(caps.api_version, 15);
    assert_eq!(caps.max_memslots, 8);
    assert_eq!(caps.max_vcpus, 16);
    assert_eq!(caps.tpr_shadow, Some(true));
    assert!(caps.backend.contains("15.0-RELEASE"), "{}", caps.backend);
    let caps14 =
        BhyveHypervisor::with_control(FakeControl::new(Abi::FreeBsd14), Default::default())
            .capabilities();
    assert_eq!((caps14.api_version, caps14.max_memslots), (14, 4));
    assert!(hv.supported_cpuid().unwrap().is_empty());
}

#[cfg(not(target_os = "freebsd"))]
#[test]
fn bhyve_is_refused_off_freebsd() {
    let err = BhyveHypervisor::new().err().expect("no vmm.ko here");
    assert!(err.to_string().contains("/dev/vmm is absent"), "{err}");
    let err = crate::open_accelerator(crate::AccelKind::Bhyve)
        .err()
        .expect("no vmm.ko here");
    assert!(err.to_string().contains("/dev/vmm"), "{err}");
}

#[test]
fn vm_is_destroyed_with_its_last_vcpu() {
    let s = setup(Abi::FreeBsd15);
    let name = s.vm.name().to_string();
    assert_eq!(*s.control.created.lock().unwrap(), vec![name.clone()]);
    let v = vcpu(&s, 0);
    drop(s.vm);
    assert!(s.control.destroyed.lock().unwrap().is_empty());
    drop(v);
    assert_eq!(*s.control.destroyed.lock().unwrap(), vec![name]);
}

#[test]
fn vcpu_creation_sets_capabilities_topology_and_activates_the_bsp() {
    let s = setup(Abi::FreeBsd15);
    let bsp = vcpu(&s, 0);
    let calls = s.kernel.calls();
    let caps: Vec<(i32, i32, i32)> = calls
        .iter()
        .filter(|c| c.request == abi::VM_SET_CAPABILITY)
        .map(|c| {
            let a: abi::VmCapability = zerocopy::FromBytes::read_from_bytes(&c.arg[..]).unwrap();
            (a.cpuid, a.captype, a.capval)
        })
        .collect();
    assert_eq!(
        caps,
        [
            (0, abi::cap::UNRESTRICTED_GUEST, 1),
            (0, abi::cap::HALT_EXIT, 1)
        ]
    );
    assert!(calls.iter().any(|c| c.request == abi::VM_SET_X2APIC_STATE));
    let activate = calls
        .iter()
        .find(|c| c.request == abi::VM_ACTIVATE_CPU)
        .expect("BSP activated");
    assert_eq!(&activate.arg[..], &0i32.to_le_bytes());
    assert_eq!(bsp.mp_state().unwrap(), MpState::Runnable);

    s.kernel.clear_calls();
    let ap = vcpu(&s, 1);
    assert_eq!(ap.mp_state().unwrap(), MpState::Uninitialized);
    let calls = s.kernel.calls();
    assert!(!calls.iter().any(|c| c.request == abi::VM_ACTIVATE_CPU));
    let topo = calls
        .iter()
        .find(|c| c.request == abi::VM_SET_TOPOLOGY)
        .unwrap();
    let t: abi::VmCpuTopology = zerocopy::FromBytes::read_from_bytes(&topo.arg[..]).unwrap();
    assert_eq!((t.sockets, t.cores, t.threads, t.maxcpus), (1, 2, 1, 0));
}

fn region(slot: u32, gpa: u64, size: u64, host: u64) -> MemoryRegion {
    MemoryRegion {
        slot,
        guest_addr: gpa,
        size,
        host_addr: host,
        readonly: false,
        log_dirty: false,
    }
}

#[test]
fn memory_is_a_segment_per_slot_mapped_at_its_gpa() {
    let s = setup(Abi::FreeBsd15);
    // SAFETY: the fake kernel never touches the host range.
    unsafe {
        s.vm.map_memory(&region(1, 0x1_0000_0000, 0x20_0000, 0x7000_0000_0000))
    }
    .unwrap();
    let calls = s.kernel.calls();
    assert_eq!(calls[0].request, abi::VM_ALLOC_MEMSEG_15);
    let seg: abi::VmMemseg15 = zerocopy::FromBytes::read_from_bytes(&calls[0].arg[..]).unwrap();
    assert_eq!(
        (seg.segid, seg.len, seg.ds_mask, seg.ds_policy),
        (1, 0x20_0000, 0, 0)
    );
    assert_eq!(seg.name, [0; 16], "system memory is unnamed");
    assert_eq!(calls[1].request, abi::VM_MMAP_MEMSEG);
    let map: abi::VmMemmap = zerocopy::FromBytes::read_from_bytes(&calls[1].arg[..]).unwrap();
    assert_eq!(
        (map.gpa, map.segid, map.segoff, map.len, map.prot, map.flags),
        (0x1_0000_0000, 1, 0, 0x20_0000, 7, 0)
    );
    assert_eq!(
        *s.kernel.mapped.lock().unwrap(),
        vec![(0x7000_0000_0000, 0x20_0000, 0x1_0000_0000)]
    );
    assert_eq!(
        s.vm.shared.host_address(0x1_0000_1000, 16),
        Some(0x7000_0000_1000)
    );
    assert_eq!(s.vm.shared.host_address(0x1_0020_0000, 1), None);

    // Removal unmaps it from the guest.
    s.kernel.clear_calls();
    // SAFETY: as above.
    unsafe {
        s.vm.map_memory(&region(1, 0x1_0000_0000, 0, 0x7000_0000_0000))
    }
    .unwrap();
    let calls = s.kernel.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].request, abi::VM_MUNMAP_MEMSEG);
    assert_eq!(s.vm.shared.host_address(0x1_0000_1000, 16), None);
}

#[test]
fn memory_layout_follows_the_kernel_version() {
    let s = setup(Abi::FreeBsd14);
    // SAFETY: the fake kernel never touches the host range.
    unsafe { s.vm.map_memory(&region(0, 0, 0x10_0000, 0x10_0000)) }.unwrap();
    assert_eq!(s.kernel.requests()[0], abi::VM_ALLOC_MEMSEG_14);
    // FreeBSD 14 has four segment ids.
    // SAFETY: as above.
    let err = unsafe { s.vm.map_memory(&region(4, 0x4000_0000, 0x1000, 0x20_0000)) }.unwrap_err();
    assert!(err.to_string().contains("system-memory segments"), "{err}");

    // A 15 kernel without the NUMA layout says ENOTTY: the 14 layout is used from then on.
    let s = setup(Abi::FreeBsd15);
    s.kernel
        .fail
        .lock()
        .unwrap()
        .insert(abi::VM_ALLOC_MEMSEG_15, libc::ENOTTY);
    // SAFETY: as above.
    unsafe { s.vm.map_memory(&region(0, 0, 0x10_0000, 0x10_0000)) }.unwrap();
    // SAFETY: as above.
    unsafe {
        s.vm.map_memory(&region(1, 0x1_0000_0000, 0x10_0000, 0x40_0000))
    }
    .unwrap();
    let allocs: Vec<u64> = s
        .kernel
        .requests()
        .into_iter()
        .filter(|&r| r == abi::VM_ALLOC_MEMSEG_14 || r == abi::VM_ALLOC_MEMSEG_15)
        .collect();
    assert_eq!(
        allocs,
        [
            abi::VM_ALLOC_MEMSEG_15,
            abi::VM_ALLOC_MEMSEG_14,
            abi::VM_ALLOC_MEMSEG_14
        ]
    );

    // Dirty logging and misaligned regions are refused.
    let mut r = region(2, 0x8000_0000, 0x1000, 0x50_0000);
    r.log_dirty = true;
    // SAFETY: as above.
    let err = unsafe { s.vm.map_memory(&r) }.unwrap_err();
    assert!(err.to_string().contains("on bhyve"), "{err}");
    // SAFETY: as above.
    assert!(unsafe { s.vm.map_memory(&region(2, 0x8000_0100, 0x1000, 0x50_0000)) }.is_err());
}

#[test]
fn in_completes_with_rax_written_before_the_next_run() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel.set_reg(0, reg::RAX, 0x1122_3344_5566_7788);
    s.kernel.set_reg(0, reg::RIP, 0x1000);
    s.kernel
        .queue_exit(build::inout(true, 1, 0x60, 0x5566_7788, 0x1000));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::IoIn { port, size, data } => {
            assert_eq!((port, size, data.len()), (0x60, 1, 1));
            data[0] = 0xab;
        }
        other => panic!("{other:?}"),
    }
    // RIP as the kernel advanced it, not the IN the RIP register still shows.
    assert_eq!(v.regs().unwrap().rip, 0x1001);
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    let calls = s.kernel.calls();
    let r = runs(&s.kernel);
    let set = find(&calls, r[0], |c| c.sets(reg::RAX).is_some()).expect("RAX written");
    assert!(set < r[1], "RAX must be written before re-entry");
    // 8-bit IN: the rest of RAX is kept.
    assert_eq!(calls[set].sets(reg::RAX), Some(0x1122_3344_5566_77ab));
    assert_eq!(s.kernel.reg(0, reg::RAX), 0x1122_3344_5566_77ab);
}

#[test]
fn in_of_four_bytes_zero_extends_rax_and_out_needs_no_completion() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel.set_reg(0, reg::RAX, u64::MAX);
    s.kernel.queue_exit(build::inout(true, 4, 0xcfc, 0, 0x1000));
    s.kernel
        .queue_exit(build::inout(false, 2, 0x3f8, 0xffff_1234, 0x1001));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::IoIn { data, .. } => data.copy_from_slice(&[1, 2, 3, 4]),
        other => panic!("{other:?}"),
    }
    match v.run().unwrap() {
        VcpuExit::IoOut { port, size, data } => {
            assert_eq!((port, size, data), (0x3f8, 2, &[0x34, 0x12][..]));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.kernel.reg(0, reg::RAX), 0x0403_0201);
    s.kernel.clear_calls();
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    // Nothing to complete after an OUT: the next call is VM_RUN itself.
    assert!(is_run(&s.kernel.calls()[0]));
}

#[test]
fn write_back_after_an_exit_does_not_re_execute_the_instruction() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel.set_reg(0, reg::RIP, 0x2000);
    s.kernel.queue_exit(build::inout(false, 1, 0x80, 0, 0x2000));
    s.kernel.queue_exit(hlt());
    assert!(matches!(v.run().unwrap(), VcpuExit::IoOut { .. }));
    let regs = v.regs().unwrap();
    assert_eq!(regs.rip, 0x2001);
    v.set_regs(&regs).unwrap();
    assert_eq!(s.kernel.reg(0, reg::RIP), 0x2001);
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
}

#[test]
fn mmio_read_completes_into_the_decoded_register() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel.set_reg(0, reg::RCX, 0xffff_ffff_ffff_ffff);
    // movzx ecx, word [rdi] = 0f b7 0f
    s.kernel.queue_exit(build::inst_emul(
        0xd000_0010,
        &[0x0f, 0xb7, 0x0f],
        0xb7,
        4,
        1,
        false,
        0,
        abi::CPU_MODE_64BIT,
        0x3000,
    ));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::MmioRead { addr, data } => {
            assert_eq!((addr, data.len()), (0xd000_0010, 2));
            data.copy_from_slice(&[0xcd, 0xab]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(v.regs().unwrap().rip, 0x3003);
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    let calls = s.kernel.calls();
    let r = runs(&s.kernel);
    let set = find(&calls, r[0], |c| c.sets(reg::RCX).is_some()).unwrap();
    assert!(set < r[1]);
    // A 32-bit destination is zero-extended.
    assert_eq!(s.kernel.reg(0, reg::RCX), 0xabcd);
}

#[test]
fn mmio_read_into_ah_and_write_from_a_register() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel.set_reg(0, reg::RAX, 0x1111_2222_3333_4444);
    s.kernel.set_reg(0, reg::R10, 0x0102_0304_0506_0708);
    // mov ah, [rdi] = 8a 27
    s.kernel.queue_exit(build::inst_emul(
        0xd000_0000,
        &[0x8a, 0x27],
        0x8a,
        4,
        4,
        false,
        0,
        abi::CPU_MODE_64BIT,
        0,
    ));
    // mov [rdi], r10 = 4c 89 17
    s.kernel.queue_exit(build::inst_emul(
        0xd000_0008,
        &[0x4c, 0x89, 0x17],
        0x89,
        8,
        10,
        true,
        0,
        abi::CPU_MODE_64BIT,
        2,
    ));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::MmioRead { data, .. } => data[0] = 0x99,
        other => panic!("{other:?}"),
    }
    match v.run().unwrap() {
        VcpuExit::MmioWrite { addr, data } => {
            assert_eq!(addr, 0xd000_0008);
            assert_eq!(data, &0x0102_0304_0506_0708u64.to_le_bytes());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.kernel.reg(0, reg::RAX), 0x1111_2222_3333_9944);
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
}

#[test]
fn unemulated_mmio_instruction_is_reported() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    // or [rdi], eax = 09 07
    s.kernel.queue_exit(build::inst_emul(
        0xd000_0000,
        &[0x09, 0x07],
        0x09,
        4,
        0,
        false,
        0,
        abi::CPU_MODE_64BIT,
        0,
    ));
    match v.run().unwrap() {
        VcpuExit::Unsupported(what) => assert!(what.contains("only MOV"), "{what}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn rdmsr_completes_rax_rdx_or_injects_gp() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    let mut rdmsr = build::header(exitcode::RDMSR, 2, 0x100);
    build::put_u32(&mut rdmsr, abi::VM_EXIT_UNION, 0x1a0);
    s.kernel.queue_exit(rdmsr);
    s.kernel.queue_exit(rdmsr);
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::MsrRead { index, value, .. } => {
            assert_eq!(index, 0x1a0);
            *value = 0x1234_5678_9abc_def0;
        }
        other => panic!("{other:?}"),
    }
    match v.run().unwrap() {
        VcpuExit::MsrRead { error, .. } => *error = 1,
        other => panic!("{other:?}"),
    }
    assert_eq!(s.kernel.reg(0, reg::RAX), 0x9abc_def0);
    assert_eq!(s.kernel.reg(0, reg::RDX), 0x1234_5678);
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    let calls = s.kernel.calls();
    let r = runs(&s.kernel);
    let gp = find(&calls, r[1], |c| c.request == abi::VM_INJECT_EXCEPTION).expect("#GP");
    assert!(gp < r[2]);
    let e: abi::VmException = zerocopy::FromBytes::read_from_bytes(&calls[gp].arg[..]).unwrap();
    assert_eq!(
        (
            e.vector,
            e.error_code,
            e.error_code_valid,
            e.restart_instruction
        ),
        (13, 0, 1, 1)
    );
}

#[test]
fn wrmsr_refused_injects_gp() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    let mut wrmsr = build::header(exitcode::WRMSR, 2, 0);
    build::put_u32(&mut wrmsr, abi::VM_EXIT_UNION, 0x8b);
    build::put_u64(&mut wrmsr, abi::VM_EXIT_UNION + 8, 42);
    s.kernel.queue_exit(wrmsr);
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::MsrWrite {
            index,
            value,
            error,
        } => {
            assert_eq!((index, value), (0x8b, 42));
            *error = 1;
        }
        other => panic!("{other:?}"),
    }
    v.finish_pending_exit().unwrap();
    assert!(s.kernel.requests().contains(&abi::VM_INJECT_EXCEPTION));
}

#[test]
fn suspend_reasons_and_exits_without_work() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    let suspended = |how: i32| {
        let mut b = build::header(exitcode::SUSPENDED, 0, 0);
        build::put_u32(&mut b, abi::VM_EXIT_UNION, how as u32);
        b
    };
    for how in [
        suspend::RESET,
        suspend::POWEROFF,
        suspend::HALT,
        suspend::TRIPLEFAULT,
    ] {
        s.kernel.queue_exit(suspended(how));
    }
    for code in [
        exitcode::REQIDLE,
        exitcode::BOGUS,
        exitcode::PAUSE,
        exitcode::RENDEZVOUS,
    ] {
        s.kernel.queue_exit(build::header(code, 0, 0));
    }
    assert!(matches!(v.run().unwrap(), VcpuExit::Reset));
    assert!(matches!(v.run().unwrap(), VcpuExit::PowerOff));
    assert!(matches!(v.run().unwrap(), VcpuExit::PowerOff));
    assert!(matches!(v.run().unwrap(), VcpuExit::Shutdown));
    for _ in 0..4 {
        assert!(matches!(v.run().unwrap(), VcpuExit::Spurious));
    }
    s.kernel
        .queue_exit(build::header(exitcode::TASK_SWITCH, 0, 0));
    assert!(matches!(v.run().unwrap(), VcpuExit::Unsupported(_)));
}

#[test]
fn kicks_are_never_lost() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    let byte = v.kick_byte() as usize;
    let kick = move || {
        // SAFETY: the test keeps the vCPU (and its run area) alive; single-threaded, the
        // hook runs inside the vCPU's own VM_RUN, as the signal handler would.
        unsafe { std::ptr::write_volatile(byte as *mut u8, 1) }
    };

    // Kicked before run: no VM_RUN at all.
    kick();
    assert!(matches!(v.run().unwrap(), VcpuExit::Interrupted));
    assert!(runs(&s.kernel).is_empty());

    // Kicked between the check and the kernel reading vm_run: the vCPU id is impossible,
    // VM_RUN fails at once, and the kick is reported.
    *s.kernel.before_run.lock().unwrap() = Some(Box::new(kick));
    assert!(matches!(v.run().unwrap(), VcpuExit::Interrupted));
    *s.kernel.before_run.lock().unwrap() = None;
    // The next run enters with the right id.
    s.kernel.queue_exit(hlt());
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    let last = s.kernel.calls().into_iter().rfind(is_run).unwrap();
    assert_eq!(&last.arg[..4], &0i32.to_le_bytes());

    // Kicked while in the guest: the kernel returns BOGUS.
    *s.kernel.during_run.lock().unwrap() = Some(Box::new(kick));
    s.kernel.queue_exit(build::header(exitcode::BOGUS, 0, 0));
    assert!(matches!(v.run().unwrap(), VcpuExit::Interrupted));
    *s.kernel.during_run.lock().unwrap() = None;
    // A BOGUS exit without a kick is only spurious.
    s.kernel.queue_exit(build::header(exitcode::BOGUS, 0, 0));
    assert!(matches!(v.run().unwrap(), VcpuExit::Spurious));
    // EINTR too is an interruption.
    s.kernel.queue_errno(libc::EINTR);
    assert!(matches!(v.run().unwrap(), VcpuExit::Interrupted));
    // Any other error is reported with the ioctl's name.
    s.kernel.queue_errno(libc::EFAULT);
    let err = v.run().expect_err("EFAULT");
    assert!(err.to_string().contains("VM_RUN"), "{err}");
}

#[test]
fn vm_run_falls_back_to_iowr_on_enotty() {
    let s = setup(Abi::FreeBsd15);
    let mut v = vcpu(&s, 0);
    s.kernel
        .fail
        .lock()
        .unwrap()
        .insert(abi::VM_RUN, libc::ENOTTY);
    s.kernel.queue_exit(hlt());
    s.kernel.queue_exit(hlt());
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    let req: Vec<u64> = s
        .kernel
        .calls()
        .into_iter()
        .filter(is_run)
        .map(|c| c.request)
        .collect();
    assert_eq!(req, [abi::VM_RUN, abi::VM_RUN_IOWR, abi::VM_RUN_IOWR]);
}

#[test]
fn sipi_starts_the_ap_in_real_mode_on_its_own_thread() {
    let s = setup(Abi::FreeBsd15);
    let mut bsp = vcpu(&s, 0);
    let mut ap = vcpu(&s, 1);
    let mut spinup = build::header(exitcode::SPINUP_AP, 0, 0);
    build::put_u32(&mut spinup, abi::VM_EXIT_UNION, 1);
    build::put_u64(&mut spinup, abi::VM_EXIT_UNION + 8, 0x9000);
    s.kernel.queue_exit(spinup);
    assert!(matches!(bsp.run().unwrap(), VcpuExit::Spurious));

    s.kernel.clear_calls();
    s.kernel.queue_exit(hlt());
    assert!(matches!(ap.run().unwrap(), VcpuExit::Halt));
    let calls = s.kernel.calls();
    let act = calls
        .iter()
        .position(|c| c.request == abi::VM_ACTIVATE_CPU)
        .unwrap();
    assert_eq!(&calls[act].arg[..], &1i32.to_le_bytes());
    let run = calls.iter().position(is_run).unwrap();
    assert!(act < run);
    assert_eq!(&calls[run].arg[..4], &1i32.to_le_bytes());
    assert_eq!(s.kernel.reg(1, reg::CS), 0x900);
    assert_eq!(s.kernel.reg(1, reg::RIP), 0);
    assert_eq!(
        s.kernel.descs.lock().unwrap()[&(1, reg::CS)],
        SegDesc {
            base: 0x9000,
            limit: 0xffff,
            access: 0x9b
        }
    );
    assert_eq!(ap.mp_state().unwrap(), MpState::Runnable);

    // A waiting AP still answers kicks.
    let mut ap2 = vcpu(&s, 2);
    // SAFETY: single-threaded; the vCPU is alive.
    unsafe { std::ptr::write_volatile(ap2.kick_byte(), 1) };
    assert!(matches!(ap2.run().unwrap(), VcpuExit::Interrupted));
}

/// Page-aligned fake guest RAM at guest-physical 0.
struct Ram {
    ptr: *mut u8,
    layout: Layout,
}

impl Ram {
    fn new(size: usize) -> Self {
        let layout = Layout::from_size_align(size, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Ram { ptr, layout }
    }

    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `layout.size()` bytes and owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Ram {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

#[test]
fn rep_outsb_reads_guest_memory_and_advances_rsi_and_rcx() {
    let s = setup(Abi::FreeBsd15);
    let mut ram = Ram::new(0x10000);
    // SAFETY: `ram` outlives the VM's use of it in this test.
    unsafe { s.vm.map_memory(&region(0, 0, 0x10000, ram.ptr as u64)) }.unwrap();
    ram.slice()[0x1000..0x1003].copy_from_slice(b"abc");
    let mut v = vcpu(&s, 0);
    s.kernel.queue_exit(build::inout_str(
        false,
        1,
        true,
        0x3f8,
        0x1000,
        3,
        8,
        0x2,
        abi::CPU_MODE_64BIT,
        0,
        0x4000,
    ));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::IoOut { port, size, data } => {
            assert_eq!((port, size, data), (0x3f8, 1, &b"abc"[..]));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    assert_eq!(s.kernel.reg(0, reg::RSI), 0x1003);
    assert_eq!(s.kernel.reg(0, reg::RCX), 0);
    assert!(!s.kernel.requests().contains(&abi::VM_RESTART_INSTRUCTION));
}

#[test]
fn rep_insw_longer_than_a_batch_restarts_the_instruction() {
    let s = setup(Abi::FreeBsd15);
    let mut ram = Ram::new(0x10000);
    // SAFETY: `ram` outlives the VM's use of it in this test.
    unsafe { s.vm.map_memory(&region(0, 0, 0x10000, ram.ptr as u64)) }.unwrap();
    let mut v = vcpu(&s, 0);
    // rep insw to ES:EDI = 0x2000, 3000 words, 32-bit addressing in protected mode.
    s.kernel.queue_exit(build::inout_str(
        true,
        2,
        true,
        0x1f0,
        0xdead_0000_0000_2000,
        0xffff_0000_0000_0000 | 3000,
        4,
        0x2,
        abi::CPU_MODE_PROTECTED,
        0,
        0x5000,
    ));
    s.kernel.queue_exit(hlt());
    match v.run().unwrap() {
        VcpuExit::IoIn { port, size, data } => {
            assert_eq!((port, size, data.len()), (0x1f0, 2, 4096));
            for (i, b) in data.iter_mut().enumerate() {
                *b = i as u8;
            }
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    assert_eq!(ram.slice()[0x2000], 0);
    assert_eq!(ram.slice()[0x2fff], 0xff);
    // 32-bit address size: EDI and ECX are written zero-extended.
    assert_eq!(s.kernel.reg(0, reg::RDI), 0x3000);
    assert_eq!(s.kernel.reg(0, reg::RCX), 3000 - 2048);
    assert!(s.kernel.requests().contains(&abi::VM_RESTART_INSTRUCTION));
}

#[test]
fn string_io_fault_on_the_first_element_lets_the_guest_take_it() {
    let s = setup(Abi::FreeBsd15);
    let ram = Ram::new(0x10000);
    // SAFETY: `ram` outlives the VM's use of it in this test.
    unsafe { s.vm.map_memory(&region(0, 0, 0x10000, ram.ptr as u64)) }.unwrap();
    let mut v = vcpu(&s, 0);
    s.kernel.faulting_pages.lock().unwrap().insert(0x3000);
    s.kernel.queue_exit(build::inout_str(
        false,
        1,
        false,
        0x80,
        0x3000,
        1,
        8,
        0x2,
        abi::CPU_MODE_64BIT,
        0,
        0,
    ));
    s.kernel.queue_exit(hlt());
    assert!(matches!(v.run().unwrap(), VcpuExit::Spurious));
    assert!(s.kernel.requests().contains(&abi::VM_GLA2GPA));
    s.kernel.clear_calls();
    assert!(matches!(v.run().unwrap(), VcpuExit::Halt));
    assert!(is_run(&s.kernel.calls()[0]), "nothing to complete");
}

#[test]
fn special_registers_round_trip_through_descriptors() {
    let s = setup(Abi::FreeBsd15);
    let v = vcpu(&s, 0);
    let code = SegmentRegister::from_descriptor(0x10, 0, 0xfffff, 0x9b, 0xa);
    let data = SegmentRegister::from_descriptor(0x18, 0, 0xfffff, 0x93, 0xc);
    let tss = SegmentRegister::from_descriptor(0x20, 0x5000, 0x67, 0x8b, 0);
    let mut ldt = SegmentRegister::from_descriptor(0, 0, 0, 0x82, 0);
    ldt.unusable = true;
    ldt.present = true;
    let sregs = SpecialRegisters {
        cs: code,
        ds: data,
        es: data,
        fs: data,
        gs: data,
        ss: data,
        tr: tss,
        ldt,
        gdt: crate::DescriptorTable {
            base: 0x500,
            limit: 0x27,
        },
        idt: crate::DescriptorTable {
            base: 0x600,
            limit: 0xfff,
        },
        cr0: 0x8000_0011,
        cr2: 0x1234,
        cr3: 0x9000,
        cr4: 0x20,
        cr8: 0,
        efer: 0x500,
        apic_base: 0xfee0_0900,
    };
    v.set_sregs(&sregs).unwrap();
    assert_eq!(s.kernel.descs.lock().unwrap()[&(0, reg::CS)].access, 0xa09b);
    assert_eq!(s.kernel.reg(0, reg::CS), 0x10);
    assert_eq!(v.sregs().unwrap(), sregs);

    let regs = StandardRegisters {
        rax: 1,
        rbx: 2,
        rsp: 0x8000,
        r15: 15,
        rip: 0x10_0000,
        rflags: 0x2,
        ..Default::default()
    };
    v.set_regs(&regs).unwrap();
    assert_eq!(v.regs().unwrap(), regs);
}

#[test]
fn interrupt_lines_and_msis() {
    let s = setup(Abi::FreeBsd15);
    let vm: &dyn Vm = s.vm.as_ref();
    // Before any routes, an ISA IRQ reaches the 8259 only.
    vm.set_irq_line(3, true).unwrap();
    let pc = |gsi: u32, pin: u32| {
        let pic = if gsi < 8 {
            IrqChipPin::PicMaster(gsi)
        } else {
            IrqChipPin::PicSlave(gsi - 8)
        };
        [
            IrqRoute { gsi, pin: pic },
            IrqRoute {
                gsi,
                pin: IrqChipPin::Ioapic(pin),
            },
        ]
    };
    let wiring: Vec<IrqRoute> = [(0, 2), (4, 4), (9, 9)]
        .into_iter()
        .flat_map(|(gsi, pin)| pc(gsi, pin))
        .chain([IrqRoute {
            gsi: 20,
            pin: IrqChipPin::Ioapic(20),
        }])
        .collect();
    vm.set_irqchip_routes(&wiring).unwrap();
    for bad in [
        IrqRoute {
            gsi: 3,
            pin: IrqChipPin::PicMaster(4),
        },
        IrqRoute {
            gsi: 20,
            pin: IrqChipPin::Ioapic(21),
        },
    ] {
        assert_unsupported(vm.set_irqchip_routes(&[bad]));
    }
    vm.set_irq_line(4, true).unwrap();
    vm.set_irq_line(4, false).unwrap();
    vm.set_irq_line(0, true).unwrap();
    vm.set_irq_line(2, true).unwrap(); // the cascade: nothing
    vm.set_irq_line(20, true).unwrap();
    vm.set_irq_line(20, false).unwrap();
    vm.signal_msi(MsiMessage::fixed(3, 0x41)).unwrap();
    let calls = s.kernel.calls();
    let got: Vec<(u64, Vec<u8>)> = calls.into_iter().map(|c| (c.request, c.arg)).collect();
    let isa = |a: i32, b: i32| [a.to_le_bytes(), b.to_le_bytes()].concat();
    assert_eq!(
        got,
        vec![
            (abi::VM_ISA_ASSERT_IRQ, isa(3, -1)),
            (abi::VM_ISA_ASSERT_IRQ, isa(4, 4)),
            (abi::VM_ISA_DEASSERT_IRQ, isa(4, 4)),
            (abi::VM_ISA_ASSERT_IRQ, isa(0, 2)),
            (abi::VM_IOAPIC_ASSERT_IRQ, 20i32.to_le_bytes().to_vec()),
            (abi::VM_IOAPIC_DEASSERT_IRQ, 20i32.to_le_bytes().to_vec()),
            (
                abi::VM_LAPIC_MSI,
                [0x41u64.to_le_bytes(), 0xfee0_3000u64.to_le_bytes()].concat()
            ),
        ]
    );
}

fn assert_unsupported<T: std::fmt::Debug>(r: crate::Result<T>) {
    match r {
        Err(HypervisorError::Unsupported(what)) => {
            assert!(what.contains("on bhyve"), "{what}")
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn what_bhyve_cannot_do_is_refused_clearly() {
    let s = setup(Abi::FreeBsd15);
    let vm: &dyn Vm = s.vm.as_ref();
    assert_unsupported(vm.create_irqchip(IrqChipMode::Split { ioapic_pins: 24 }));
    assert!(vm.create_irqchip(IrqChipMode::Kernel).is_ok());
    assert_unsupported(vm.set_msi_routes(&[]));
    // The trait's defaults: vmm.ko has neither irqfd nor ioeventfd.
    for r in [
        vm.set_msi_route(crate::FIRST_MSI_GSI, None),
        vm.register_irqfd(0, crate::FIRST_MSI_GSI),
        vm.register_ioeventfd(0, crate::IoEventAddress::Mmio(0xd000_0000), 4, None),
    ] {
        assert!(matches!(r, Err(HypervisorError::Unsupported(_))), "{r:?}");
    }
    assert_unsupported(vm.dirty_log(0, 4096));
    assert_unsupported(vm.set_dirty_logging(&region(0, 0, 4096, 0), true));
    assert_unsupported(vm.clear_dirty_log(0, 0, 64));
    assert_unsupported(vm.clear_dirty_pages(0, &[0]));
    assert!(!vm.enable_manual_dirty_protect().unwrap());
    assert_unsupported(vm.irqchip_state());
    assert_unsupported(vm.set_irqchip_state(&Default::default()));
    let v = vcpu(&s, 0);
    assert_unsupported(v.fpu());
    assert_unsupported(v.xsave());
    assert_unsupported(v.lapic());
    assert_unsupported(v.inject_external_interrupt(0x20));
    assert!(!v.ready_for_interrupt());
    // MSRs bhyve has no register for are left out of a read and refused on write.
    s.kernel.set_reg(0, reg::FS_BASE, 0x7000);
    let msrs = v.msrs(&[0xc000_0100, 0x10, 0x1b]).unwrap();
    assert_eq!(msrs.len(), 2);
    assert_eq!(msrs[0].data, 0x7000);
    assert_eq!(msrs[1].data, 0xfee0_0900);
    assert!(v
        .set_msrs(&[crate::MsrEntry {
            index: 0x10,
            data: 0
        }])
        .is_err());
}

#[test]
fn kernel_rtc_gets_time_and_cmos_bytes() {
    let s = setup(Abi::FreeBsd14);
    let caps =
        BhyveHypervisor::with_control(s.control.clone(), BhyveOptions::default()).capabilities();
    assert!(caps.rtc_in_kernel);
    assert_eq!(caps.pm_timer_port, Some(0x408));
    s.kernel.clear_calls();
    s.vm.init_kernel_rtc(1_700_000_000, &[(0x34, 0xf0), (0x35, 0x0f)])
        .unwrap();
    let calls = s.kernel.calls();
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[0].request, abi::VM_RTC_SETTIME);
    let t: abi::VmRtcTime = zerocopy::FromBytes::read_from_bytes(&calls[0].arg[..]).unwrap();
    assert_eq!(t.secs, 1_700_000_000);
    let bytes: Vec<(i32, u8)> = calls[1..]
        .iter()
        .map(|c| {
            assert_eq!(c.request, abi::VM_RTC_WRITE);
            let d: abi::VmRtcData = zerocopy::FromBytes::read_from_bytes(&c.arg[..]).unwrap();
            (d.offset, d.value)
        })
        .collect();
    assert_eq!(bytes, [(0x34, 0xf0), (0x35, 0x0f)]);
    // A kernel that refuses the write is reported, not ignored.
    s.kernel
        .fail
        .lock()
        .unwrap()
        .insert(abi::VM_RTC_WRITE, libc::EINVAL);
    let err = s.vm.init_kernel_rtc(0, &[(0x34, 1)]).unwrap_err();
    assert!(err.to_string().contains("VM_RTC_WRITE"), "{err}");
}
