//! The KVM backend against the real /dev/kvm: tiny hand-assembled guests, one exit each.

mod common;

use common::{region_of, require_kvm, start_flat_32};

use hypervisor::{open_accelerator, AccelKind, StandardRegisters, Vcpu, VcpuExit, Vm};
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM_SIZE: usize = 1 << 21;
const CODE: u64 = 0x1000;

/// A VM with 2 MiB of RAM holding `code` at 0x1000, and one vCPU in flat 32-bit protected
/// mode about to execute it.
fn vm_running(code: &[u8]) -> (Arc<dyn Vm>, Box<dyn Vcpu>, GuestMemoryMmap) {
    require_kvm();
    let hv = open_accelerator(AccelKind::Kvm).expect("open kvm");
    let vm = hv.create_vm().expect("create vm");
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    // SAFETY: `mem` is returned to the caller and outlives every use of the VM in the test.
    unsafe { vm.map_memory(&region_of(&mem)) }.expect("map memory");
    mem.write_slice(code, GuestAddress(CODE)).unwrap();
    let vcpu = vm.create_vcpu(0).expect("create vcpu");
    start_flat_32(vcpu.as_ref(), CODE);
    (vm, vcpu, mem)
}

#[test]
fn out_exit_carries_port_and_byte() {
    // mov dx, 0xf4; mov al, 0x42; out dx, al; hlt
    let (_vm, mut vcpu, _mem) = vm_running(&[0x66, 0xba, 0xf4, 0x00, 0xb0, 0x42, 0xee, 0xf4]);
    match vcpu.run().unwrap() {
        VcpuExit::IoOut { port, data, .. } => {
            assert_eq!(port, 0xf4);
            assert_eq!(data, &[0x42]);
        }
        other => panic!("unexpected exit {other:?}"),
    }
}

#[test]
fn in_data_reaches_the_guest_register() {
    // in al, 0x60; out 0x61, al; hlt
    let (_vm, mut vcpu, _mem) = vm_running(&[0xe4, 0x60, 0xe6, 0x61, 0xf4]);
    match vcpu.run().unwrap() {
        VcpuExit::IoIn { port, data, .. } => {
            assert_eq!(port, 0x60);
            data[0] = 0x5a;
        }
        other => panic!("unexpected exit {other:?}"),
    }
    match vcpu.run().unwrap() {
        VcpuExit::IoOut { port, data, .. } => {
            assert_eq!(port, 0x61);
            assert_eq!(data, &[0x5a], "the IN completion must reach AL");
        }
        other => panic!("unexpected exit {other:?}"),
    }
    // RIP is past both instructions (not re-executing the IN).
    assert_eq!(vcpu.regs().unwrap().rip, CODE + 4);
}

#[test]
fn mmio_read_and_write_exits() {
    // mov eax, [0xd0000000]; mov [0xd0000008], eax; hlt
    let (_vm, mut vcpu, _mem) = vm_running(&[
        0xa1, 0x00, 0x00, 0x00, 0xd0, 0xa3, 0x08, 0x00, 0x00, 0xd0, 0xf4,
    ]);
    match vcpu.run().unwrap() {
        VcpuExit::MmioRead { addr, data } => {
            assert_eq!(addr, 0xd000_0000);
            assert_eq!(data.len(), 4);
            data.copy_from_slice(&0xdead_beefu32.to_le_bytes());
        }
        other => panic!("unexpected exit {other:?}"),
    }
    match vcpu.run().unwrap() {
        VcpuExit::MmioWrite { addr, data } => {
            assert_eq!(addr, 0xd000_0008);
            assert_eq!(data, &0xdead_beefu32.to_le_bytes());
        }
        other => panic!("unexpected exit {other:?}"),
    }
}

#[test]
fn kick_before_entry_makes_run_return_interrupted() {
    // jmp $ (spins forever)
    let (_vm, mut vcpu, _mem) = vm_running(&[0xeb, 0xfe]);
    let kicker = vcpu.bind_kicker().unwrap();
    kicker.kick().unwrap();
    assert!(matches!(vcpu.run().unwrap(), VcpuExit::Interrupted));
}

#[test]
fn kick_from_another_thread_stops_a_spinning_guest() {
    let (_vm, mut vcpu, _mem) = vm_running(&[0xeb, 0xfe]);
    let (tx, rx) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        tx.send(vcpu.bind_kicker().unwrap()).unwrap();
        loop {
            if let VcpuExit::Interrupted = vcpu.run().unwrap() {
                return;
            }
        }
    });
    let kicker = rx.recv().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    kicker.kick().unwrap();
    runner.join().unwrap();
}

#[test]
fn vcpu_state_round_trips() {
    let (_vm, vcpu, _mem) = vm_running(&[0xf4]);
    let regs = StandardRegisters {
        rax: 1,
        rbx: 2,
        r15: 0xffff_0000_1234,
        rip: CODE,
        rflags: 0x202,
        ..Default::default()
    };
    vcpu.set_regs(&regs).unwrap();
    assert_eq!(vcpu.regs().unwrap(), regs);
    let sregs = vcpu.sregs().unwrap();
    vcpu.set_sregs(&sregs).unwrap();
    assert_eq!(vcpu.sregs().unwrap(), sregs);
    let fpu = vcpu.fpu().unwrap();
    vcpu.set_fpu(&fpu).unwrap();
    let events = vcpu.vcpu_events().unwrap();
    vcpu.set_vcpu_events(&events).unwrap();
    let mp = vcpu.mp_state().unwrap();
    vcpu.set_mp_state(mp).unwrap();
    assert_eq!(vcpu.mp_state().unwrap(), mp);
}

#[test]
fn capabilities_are_reported() {
    require_kvm();
    let hv = open_accelerator(AccelKind::Auto).unwrap();
    let caps = hv.capabilities();
    assert_eq!(caps.accelerator, "kvm");
    assert!(caps.max_vcpus >= 1);
    assert!(caps.immediate_exit);
    assert!(!hv.supported_cpuid().unwrap().is_empty());
    assert!(!hv.msr_index_list().unwrap().is_empty());
}

#[test]
fn bhyve_is_refused_on_linux() {
    let err = open_accelerator(AccelKind::Bhyve)
        .err()
        .expect("bhyve must fail");
    assert!(err.to_string().contains("/dev/vmm"), "{err}");
}
