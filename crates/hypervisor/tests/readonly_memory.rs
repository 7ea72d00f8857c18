//! `Vm::set_memory_readonly` on the real /dev/kvm, with a hand-assembled guest: a write to a
//! read-only slot exits as an MMIO write and leaves memory alone; switched to writable, the
//! write lands; switched back while dirty logging is on, the page's dirty bit survives the
//! slot being re-created.

#![cfg(target_os = "linux")]

mod common;

use common::{region_of, require_kvm, start_flat_32};
use hypervisor::{open_accelerator, AccelKind, MemoryRegion, VcpuExit};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

const CODE: u64 = 0x1000;
/// The read-only slot: one page above the 2 MiB of RAM.
const SHADOW: u64 = 0x20_0000;

/// `mov dword [SHADOW], value` then `out port, al`, for each (value, port); then `hlt`.
fn writer(steps: &[(u32, u8)]) -> Vec<u8> {
    let mut code = Vec::new();
    for &(value, port) in steps {
        code.extend_from_slice(&[0xc7, 0x05]);
        code.extend_from_slice(&(SHADOW as u32).to_le_bytes());
        code.extend_from_slice(&value.to_le_bytes());
        code.extend_from_slice(&[0xe6, port]);
    }
    code.push(0xf4);
    code
}

/// Runs until the guest's `out` to `port`; returns the MMIO writes seen on the way.
fn run_to_port(vcpu: &mut dyn hypervisor::Vcpu, port: u16) -> Vec<(u64, Vec<u8>)> {
    let mut writes = Vec::new();
    loop {
        match vcpu.run().unwrap() {
            VcpuExit::MmioWrite { addr, data } => writes.push((addr, data.to_vec())),
            VcpuExit::IoOut { port: p, .. } if p == port => return writes,
            VcpuExit::Spurious => {}
            other => panic!("unexpected exit {other:?}"),
        }
    }
}

#[test]
fn read_only_slots_switch_and_keep_their_dirty_bits() {
    require_kvm();
    let hv = open_accelerator(AccelKind::Kvm).unwrap();
    let vm = hv.create_vm().unwrap();
    let ram = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let shadow = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(SHADOW), 4096)]).unwrap();
    // SAFETY: both mappings outlive the VM in this test.
    unsafe { vm.map_memory(&region_of(&ram)) }.unwrap();
    let shadow_region = shadow.iter().next().unwrap();
    let slot = MemoryRegion {
        slot: 1,
        guest_addr: SHADOW,
        size: 4096,
        host_addr: shadow_region.as_ptr() as u64,
        readonly: true,
        log_dirty: false,
    };
    // SAFETY: as above.
    unsafe { vm.map_memory(&slot) }.unwrap();
    let code = writer(&[
        (0x1111_1111, 0x80),
        (0x2222_2222, 0x81),
        (0x3333_3333, 0x82),
    ]);
    ram.write_slice(&code, GuestAddress(CODE)).unwrap();
    let mut vcpu = vm.create_vcpu(0).unwrap();
    vcpu.set_cpuid(&hv.supported_cpuid().unwrap()).unwrap();
    start_flat_32(vcpu.as_ref(), CODE);
    let word = || shadow.read_obj::<u32>(GuestAddress(SHADOW)).unwrap();

    // Read-only: the write exits and memory keeps its contents.
    let writes = run_to_port(vcpu.as_mut(), 0x80);
    assert_eq!(
        writes,
        vec![(SHADOW, 0x1111_1111u32.to_le_bytes().to_vec())]
    );
    assert_eq!(word(), 0);
    // Asking for what the slot already is changes nothing.
    vm.set_memory_readonly(&slot, true).unwrap();

    // Writable, with dirty logging: the write lands without an exit.
    vm.set_memory_readonly(&slot, false).unwrap();
    vm.set_dirty_logging(&slot, true).unwrap();
    vm.dirty_log(1, 4096).unwrap();
    assert!(run_to_port(vcpu.as_mut(), 0x81).is_empty());
    assert_eq!(word(), 0x2222_2222);

    // Back to read-only: the slot is re-created, the page stays dirty, writes exit again.
    vm.set_memory_readonly(&slot, true).unwrap();
    assert_eq!(
        vm.dirty_log(1, 4096).unwrap()[0] & 1,
        1,
        "dirty bit carried"
    );
    assert_eq!(
        vm.dirty_log(1, 4096).unwrap()[0] & 1,
        0,
        "and handed out once"
    );
    let writes = run_to_port(vcpu.as_mut(), 0x82);
    assert_eq!(writes.len(), 1);
    assert_eq!(word(), 0x2222_2222);

    // A region that is not the mapped slot is refused.
    let other = MemoryRegion { size: 8192, ..slot };
    assert!(vm.set_memory_readonly(&other, false).is_err());
}
