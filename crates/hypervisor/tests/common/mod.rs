//! Set-up shared by the tests that drive /dev/kvm with hand-assembled guests.

#![allow(dead_code)]

use hypervisor::{MemoryRegion, SegmentRegister, StandardRegisters, Vcpu};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Fails (never skips) when the accelerator is missing.
pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "/dev/kvm is missing: these tests need the KVM accelerator"
    );
}

/// The single RAM region of `mem` as memory slot 0.
pub fn region_of(mem: &GuestMemoryMmap) -> MemoryRegion {
    let region = mem.iter().next().unwrap();
    MemoryRegion {
        slot: 0,
        guest_addr: 0,
        size: region.len(),
        host_addr: region.as_ptr() as u64,
        readonly: false,
        log_dirty: false,
    }
}

/// Puts the vCPU in flat 32-bit protected mode (paging off) about to execute at `rip`.
pub fn start_flat_32(vcpu: &dyn Vcpu, rip: u64) {
    let mut sregs = vcpu.sregs().unwrap();
    let code_seg = SegmentRegister::from_descriptor(0x10, 0, 0xfffff, 0x9b, 0xc);
    let data_seg = SegmentRegister::from_descriptor(0x18, 0, 0xfffff, 0x93, 0xc);
    sregs.cs = code_seg;
    sregs.ds = data_seg;
    sregs.es = data_seg;
    sregs.ss = data_seg;
    sregs.fs = data_seg;
    sregs.gs = data_seg;
    sregs.cr0 = 0x11; // PE | ET
    vcpu.set_sregs(&sregs).unwrap();
    vcpu.set_regs(&StandardRegisters {
        rip,
        rflags: 2,
        rsp: 0x8000,
        ..Default::default()
    })
    .unwrap();
}
