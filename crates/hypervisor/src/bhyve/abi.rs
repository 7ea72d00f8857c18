//! The FreeBSD vmm.ko ioctl ABI (amd64), written from the facts of FreeBSD's headers.
//!
//! Nothing here is copied from FreeBSD: the layouts are re-declared field by field with the
//! padding a C compiler inserts on amd64 made explicit (every struct derives zerocopy's
//! `IntoBytes`, which refuses implicit padding), and the tests at the bottom pin every
//! size, offset and ioctl number, so a drift fails the build's tests.
//!
//! Where each fact comes from (read with the `search` tool, see docs/bhyve.md):
//!
//! * `sys/sys/ioccom.h`: `_IOC(inout, group, num, len) = inout | (len & 0x1fff) << 16 |
//!   group << 8 | num`, `IOC_VOID 0x20000000`, `IOC_OUT 0x40000000`, `IOC_IN 0x80000000`.
//! * `sys/amd64/include/vmm_dev.h` (13.x and 14.x trees): the `IOCNUM_*` numbers and the
//!   argument structures (`vm_register`, `vm_seg_desc`, `vm_register_set`, `vm_memmap`,
//!   `vm_munmap`, `vm_capability`, `vm_exception`, `vm_lapic_msi`, `vm_lapic_irq`,
//!   `vm_ioapic_irq`, `vm_isa_irq`, `vm_nmi`, `vm_x2apic`, `vm_suspend`, `vm_gla2gpa`,
//!   `vm_activate_cpu`, `vm_intinfo`, `vm_cpu_topology`). Unchanged from 13 to 15.
//! * `sys/amd64/include/vmm.h` (14.x tree, the one with `struct vcpu` handles): `enum
//!   vm_reg_name` (49 entries, TPR last), `enum vm_exitcode` (INOUT 0 .. DB 25), `enum
//!   vm_cap_type`, `enum vm_suspend_how`, `enum x2apic_state`, `struct seg_desc`,
//!   `struct vm_guest_paging`, `struct vie` (64 bytes, `_Static_assert`ed offsets 22, 24,
//!   28) and `struct vm_exit` (the union is 120 bytes: `inst_emul` is the largest arm).
//! * `sys/amd64/vmm/vmm_dev_machdep.c` (15.x tree): `VM_RUN` copies the exit out to
//!   `vm_run.vm_exit`; `VM_RUN_13` (`_IOWR`, exit embedded) is the FreeBSD 13 layout kept
//!   under `COMPAT_FREEBSD13`. Which ioctls lock a vCPU: `VM_LAPIC_MSI`, `VM_IOAPIC_*`,
//!   `VM_ISA_*` lock none; `VM_LAPIC_IRQ`, `VM_INJECT_NMI`, `VM_INJECT_EXCEPTION`, the
//!   register and descriptor ioctls lock the target vCPU.
//! * `sys/dev/vmm/vmm_dev.h` and `sys/dev/vmm/vmm_param.h` (15.x): `/dev/vmmctl`,
//!   `VMMCTL_VM_CREATE`/`DESTROY` = `_IOWR('V', 0/1, {char name[VM_MAX_NAMELEN + 1]; int
//!   reserved[16]})`, `VM_MAX_NAMELEN = SPECNAMELEN (255) - 10 - 15 - 1 = 229`. Newer trees
//!   turn `reserved[0]` into `uint32_t flags` (`VMMCTL_CREATE_DESTROY_ON_CLOSE = 1`); the
//!   size is unchanged.
//! * `sys/dev/vmm/vmm_dev.c` and `sys/dev/vmm/vmm_mem.h` (15.x): `struct vm_memseg` gains
//!   `ds_mask`, `ds_mask_size`, `ds_policy` (NUMA); the 14 layout stays as
//!   `VM_ALLOC_MEMSEG_14` under `COMPAT_FREEBSD14` (size `VM_MAX_SUFFIXLEN + 1 + 16` = 32);
//!   sysmem segments are ids 0..7 (`VM_MAXSYSMEM` 8), `VM_MAX_MEMSEGS` 11. FreeBSD 14's
//!   `sys/amd64/vmm/vmm.c`: `VM_MAX_MEMSEGS 4`, `VM_MAX_MEMMAPS 8`. The 15 field order is
//!   the one `sys/riscv/include/vmm_dev.h` of the same tree declares (the amd64 header of
//!   that tree was not in the index; `vmm_dev.c` uses exactly these fields).
//!
//! Not verified against FreeBSD's own amd64 source: the direction bits of the 14+ `VM_RUN`
//! (the fact sheet's `_IOW` = 0x80207601; the riscv port of the same tree uses `_IOWR`).
//! The backend tries `_IOW` first and falls back to `_IOWR` on ENOTTY (see `Vcpu::run`).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

// --- ioctl encoding (sys/sys/ioccom.h) ---------------------------------------------------

pub const IOCPARM_MASK: u64 = 0x1fff;
pub const IOC_VOID: u64 = 0x2000_0000;
pub const IOC_OUT: u64 = 0x4000_0000;
pub const IOC_IN: u64 = 0x8000_0000;
pub const IOC_INOUT: u64 = IOC_IN | IOC_OUT;

/// `_IOC(inout, group, num, len)`.
pub const fn ioc(inout: u64, group: u8, num: u8, len: usize) -> u64 {
    inout | ((len as u64 & IOCPARM_MASK) << 16) | ((group as u64) << 8) | num as u64
}

/// `_IOW(group, num, T)`: the kernel copies `T` in.
pub const fn iow<T>(group: u8, num: u8) -> u64 {
    ioc(IOC_IN, group, num, std::mem::size_of::<T>())
}

/// `_IOWR(group, num, T)`: the kernel copies `T` in and back out.
pub const fn iowr<T>(group: u8, num: u8) -> u64 {
    ioc(IOC_INOUT, group, num, std::mem::size_of::<T>())
}

/// `IOCPARM_LEN(cmd)`: how many bytes of argument the kernel copies.
pub const fn ioc_len(request: u64) -> usize {
    ((request >> 16) & IOCPARM_MASK) as usize
}

/// Group of the per-VM ioctls on /dev/vmm/NAME.
const VM: u8 = b'v';
/// Group of the control ioctls on /dev/vmmctl (FreeBSD 15+).
const VMMCTL: u8 = b'V';

// `IOCNUM_*` (sys/amd64/include/vmm_dev.h, same from 13 to 15 on amd64).
pub mod iocnum {
    pub const RUN: u8 = 1;
    pub const SET_CAPABILITY: u8 = 2;
    pub const GET_CAPABILITY: u8 = 3;
    pub const SUSPEND: u8 = 4;
    pub const GLA2GPA: u8 = 13;
    pub const ALLOC_MEMSEG: u8 = 14;
    pub const MMAP_MEMSEG: u8 = 16;
    pub const GLA2GPA_NOFAULT: u8 = 18;
    pub const MUNMAP_MEMSEG: u8 = 19;
    pub const SET_REGISTER: u8 = 20;
    pub const GET_REGISTER: u8 = 21;
    pub const SET_SEGMENT_DESCRIPTOR: u8 = 22;
    pub const GET_SEGMENT_DESCRIPTOR: u8 = 23;
    pub const SET_REGISTER_SET: u8 = 24;
    pub const GET_REGISTER_SET: u8 = 25;
    pub const GET_INTINFO: u8 = 28;
    pub const SET_INTINFO: u8 = 29;
    pub const INJECT_EXCEPTION: u8 = 30;
    pub const LAPIC_IRQ: u8 = 31;
    pub const INJECT_NMI: u8 = 32;
    pub const IOAPIC_ASSERT_IRQ: u8 = 33;
    pub const IOAPIC_DEASSERT_IRQ: u8 = 34;
    pub const IOAPIC_PULSE_IRQ: u8 = 35;
    pub const LAPIC_MSI: u8 = 36;
    pub const RESTART_INSTRUCTION: u8 = 39;
    pub const SET_X2APIC_STATE: u8 = 60;
    pub const GET_X2APIC_STATE: u8 = 61;
    pub const SET_TOPOLOGY: u8 = 63;
    pub const ISA_ASSERT_IRQ: u8 = 80;
    pub const ISA_DEASSERT_IRQ: u8 = 81;
    pub const ACTIVATE_CPU: u8 = 90;
    pub const SUSPEND_CPU: u8 = 92;
    pub const RESUME_CPU: u8 = 93;
    pub const RTC_WRITE: u8 = 101;
    pub const RTC_SETTIME: u8 = 102;
    /// `IOCNUM_SNAPSHOT_REQ` and `IOCNUM_RESTORE_TIME` ("checkpoint", 13.x-15.x).
    pub const SNAPSHOT_REQ: u8 = 113;
    pub const RESTORE_TIME: u8 = 115;
}

/// Port of the kernel's ACPI PM timer (`IO_PMTMR`, sys/amd64/vmm/io/vpmtmr.h, FreeBSD 11-15).
pub const IO_PMTMR: u16 = 0x408;

// --- argument structures -----------------------------------------------------------------

/// `struct vm_register` (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmRegister {
    pub cpuid: i32,
    pub regnum: i32,
    pub regval: u64,
}

/// `struct seg_desc` (16 bytes); `access` is the VMX access-rights format plus bit 16
/// ("unusable").
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct SegDesc {
    pub base: u64,
    pub limit: u32,
    pub access: u32,
}

/// `struct vm_seg_desc` (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmSegDesc {
    pub cpuid: i32,
    pub regnum: i32,
    pub desc: SegDesc,
}

/// `struct vm_register_set` (24 bytes): `regnums` and `regvals` are user pointers to
/// `count` ints and `count` u64s.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmRegisterSet {
    pub cpuid: i32,
    pub count: u32,
    pub regnums: u64,
    pub regvals: u64,
}

/// `struct vm_run` of FreeBSD 14 and later (32 bytes): the kernel copies the exit out to
/// `vm_exit` and, for IPI exits only, a cpuset to `cpuset`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmRun {
    pub cpuid: i32,
    pub _pad: u32,
    pub cpuset: u64,
    pub cpusetsize: u64,
    pub vm_exit: u64,
}

/// Size of `struct vm_exit` (exit code, instruction length, RIP, 120-byte union).
pub const VM_EXIT_SIZE: usize = 136;
/// Offset of the union in `struct vm_exit`.
pub const VM_EXIT_UNION: usize = 16;

/// `struct vm_exit` as raw storage; `exit.rs` decodes the union arm by arm.
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmExit {
    pub exitcode: i32,
    pub inst_length: i32,
    pub rip: u64,
    pub u: [u64; 15],
}

/// `cpuset_t` storage handed to `VM_RUN` (CPU_SETSIZE 1024 bits on amd64 since 14).
pub const CPUSET_BYTES: usize = 128;

/// `struct vm_memseg` of FreeBSD 14 (32 bytes; `VM_ALLOC_MEMSEG_14` on 15).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmMemseg14 {
    pub segid: i32,
    pub _pad: u32,
    pub len: u64,
    /// Empty for system memory; a device-memory segment is named.
    pub name: [u8; 16],
}

/// `struct vm_memseg` of FreeBSD 15 (56 bytes): adds the NUMA domain mask and policy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmMemseg15 {
    pub segid: i32,
    pub _pad: u32,
    pub len: u64,
    pub name: [u8; 16],
    /// `domainset_t *`; null for "no policy".
    pub ds_mask: u64,
    pub ds_mask_size: u64,
    /// `DOMAINSET_POLICY_INVALID` (0) for "no policy".
    pub ds_policy: i32,
    pub _pad2: u32,
}

/// `struct vm_memmap` (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmMemmap {
    pub gpa: u64,
    pub segid: i32,
    pub _pad: u32,
    pub segoff: i64,
    pub len: u64,
    pub prot: i32,
    pub flags: i32,
}

/// `VM_MEMMAP_F_WIRED`.
pub const VM_MEMMAP_F_WIRED: i32 = 1;
/// `PROT_READ`, `PROT_WRITE`, `PROT_EXEC` (= `VM_PROT_*`, asserted in vmm_dev_machdep.c).
pub const PROT_READ: i32 = 1;
pub const PROT_WRITE: i32 = 2;
pub const PROT_EXEC: i32 = 4;

/// `struct vm_munmap` (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmMunmap {
    pub gpa: u64,
    pub len: u64,
}

/// `struct vm_capability` (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmCapability {
    pub cpuid: i32,
    pub captype: i32,
    pub capval: i32,
    pub allcpus: i32,
}

/// `struct vm_activate_cpu` (4 bytes), also the argument of SUSPEND/RESUME_CPU, and the
/// `int` of `VM_RESTART_INSTRUCTION`, `struct vm_nmi`, `struct vm_suspend` and
/// `struct vm_ioapic_irq`: one `int`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmInt {
    pub value: i32,
}

/// `struct vm_rtc_data` (8 bytes: `int offset; uint8_t value;` and padding), the argument of
/// `VM_RTC_WRITE` (vmm_dev.h, FreeBSD 10-15): one byte of the kernel RTC's CMOS RAM.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmRtcData {
    pub offset: i32,
    pub value: u8,
    pub _pad: [u8; 3],
}

/// `struct vm_rtc_time` (8 bytes: `time_t secs`), the argument of `VM_RTC_SETTIME`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmRtcTime {
    pub secs: i64,
}

/// `struct vm_lapic_irq` (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmLapicIrq {
    pub cpuid: i32,
    pub vector: i32,
}

/// `struct vm_lapic_msi` (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmLapicMsi {
    pub msg: u64,
    pub addr: u64,
}

/// `struct vm_isa_irq` (8 bytes); `ioapic_irq` -1 means "8259 only".
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmIsaIrq {
    pub atpic_irq: i32,
    pub ioapic_irq: i32,
}

/// `struct vm_exception` (20 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmException {
    pub cpuid: i32,
    pub vector: i32,
    pub error_code: u32,
    pub error_code_valid: i32,
    pub restart_instruction: i32,
}

/// `struct vm_x2apic` (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmX2apic {
    pub cpuid: i32,
    pub state: i32,
}

/// `struct vm_cpu_topology` (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmCpuTopology {
    pub sockets: u16,
    pub cores: u16,
    pub threads: u16,
    pub maxcpus: u16,
}

/// `struct vm_intinfo` (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmIntinfo {
    pub vcpuid: i32,
    pub _pad: u32,
    pub info1: u64,
    pub info2: u64,
}

/// `struct vm_guest_paging` (24 bytes).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VmGuestPaging {
    pub cr3: u64,
    pub cpl: i32,
    /// `enum vm_cpu_mode`.
    pub cpu_mode: i32,
    /// `enum vm_paging_mode`.
    pub paging_mode: i32,
    pub _pad: u32,
}

/// `struct vm_gla2gpa` (56 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmGla2gpa {
    pub vcpuid: i32,
    /// PROT_READ or PROT_WRITE.
    pub prot: i32,
    pub gla: u64,
    pub paging: VmGuestPaging,
    pub fault: i32,
    pub _pad: u32,
    pub gpa: u64,
}

/// `VM_MAX_NAMELEN + 1` (sys/dev/vmm/vmm_param.h: 255 - 10 - 15 - 1, plus the NUL).
pub const VM_NAME_BUF: usize = 230;

/// `struct vmmctl_vm_create` / `struct vmmctl_vm_destroy` (296 bytes, FreeBSD 15+).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmmctlVm {
    pub name: [u8; VM_NAME_BUF],
    pub _pad: [u8; 2],
    /// `reserved[0]` on 15.0; `flags` (create only) on newer trees.
    pub flags: u32,
    pub reserved: [i32; 15],
}

/// `VMMCTL_CREATE_DESTROY_ON_CLOSE`: the VM goes away with the /dev/vmmctl descriptor.
pub const VMMCTL_CREATE_DESTROY_ON_CLOSE: u32 = 1;

// --- ioctl numbers -------------------------------------------------------------------------

pub const VM_RUN: u64 = iow::<VmRun>(VM, iocnum::RUN);
/// The same number with both direction bits, tried when the kernel says ENOTTY to `VM_RUN`.
pub const VM_RUN_IOWR: u64 = iowr::<VmRun>(VM, iocnum::RUN);
pub const VM_SET_CAPABILITY: u64 = iow::<VmCapability>(VM, iocnum::SET_CAPABILITY);
pub const VM_GET_CAPABILITY: u64 = iowr::<VmCapability>(VM, iocnum::GET_CAPABILITY);
pub const VM_SUSPEND: u64 = iow::<VmInt>(VM, iocnum::SUSPEND);
pub const VM_GLA2GPA: u64 = iowr::<VmGla2gpa>(VM, iocnum::GLA2GPA);
pub const VM_GLA2GPA_NOFAULT: u64 = iowr::<VmGla2gpa>(VM, iocnum::GLA2GPA_NOFAULT);
pub const VM_ALLOC_MEMSEG_14: u64 = iow::<VmMemseg14>(VM, iocnum::ALLOC_MEMSEG);
pub const VM_ALLOC_MEMSEG_15: u64 = iow::<VmMemseg15>(VM, iocnum::ALLOC_MEMSEG);
pub const VM_MMAP_MEMSEG: u64 = iow::<VmMemmap>(VM, iocnum::MMAP_MEMSEG);
pub const VM_MUNMAP_MEMSEG: u64 = iow::<VmMunmap>(VM, iocnum::MUNMAP_MEMSEG);
pub const VM_SET_REGISTER: u64 = iow::<VmRegister>(VM, iocnum::SET_REGISTER);
pub const VM_GET_REGISTER: u64 = iowr::<VmRegister>(VM, iocnum::GET_REGISTER);
pub const VM_SET_SEGMENT_DESCRIPTOR: u64 = iow::<VmSegDesc>(VM, iocnum::SET_SEGMENT_DESCRIPTOR);
pub const VM_GET_SEGMENT_DESCRIPTOR: u64 = iowr::<VmSegDesc>(VM, iocnum::GET_SEGMENT_DESCRIPTOR);
pub const VM_SET_REGISTER_SET: u64 = iow::<VmRegisterSet>(VM, iocnum::SET_REGISTER_SET);
pub const VM_GET_REGISTER_SET: u64 = iowr::<VmRegisterSet>(VM, iocnum::GET_REGISTER_SET);
pub const VM_GET_INTINFO: u64 = iowr::<VmIntinfo>(VM, iocnum::GET_INTINFO);
pub const VM_SET_INTINFO: u64 = iow::<VmIntinfo>(VM, iocnum::SET_INTINFO);
pub const VM_INJECT_EXCEPTION: u64 = iow::<VmException>(VM, iocnum::INJECT_EXCEPTION);
pub const VM_LAPIC_IRQ: u64 = iow::<VmLapicIrq>(VM, iocnum::LAPIC_IRQ);
pub const VM_INJECT_NMI: u64 = iow::<VmInt>(VM, iocnum::INJECT_NMI);
pub const VM_IOAPIC_ASSERT_IRQ: u64 = iow::<VmInt>(VM, iocnum::IOAPIC_ASSERT_IRQ);
pub const VM_IOAPIC_DEASSERT_IRQ: u64 = iow::<VmInt>(VM, iocnum::IOAPIC_DEASSERT_IRQ);
pub const VM_IOAPIC_PULSE_IRQ: u64 = iow::<VmInt>(VM, iocnum::IOAPIC_PULSE_IRQ);
pub const VM_LAPIC_MSI: u64 = iow::<VmLapicMsi>(VM, iocnum::LAPIC_MSI);
pub const VM_RESTART_INSTRUCTION: u64 = iow::<VmInt>(VM, iocnum::RESTART_INSTRUCTION);
pub const VM_SET_X2APIC_STATE: u64 = iow::<VmX2apic>(VM, iocnum::SET_X2APIC_STATE);
pub const VM_GET_X2APIC_STATE: u64 = iowr::<VmX2apic>(VM, iocnum::GET_X2APIC_STATE);
pub const VM_SET_TOPOLOGY: u64 = iow::<VmCpuTopology>(VM, iocnum::SET_TOPOLOGY);
pub const VM_ISA_ASSERT_IRQ: u64 = iow::<VmIsaIrq>(VM, iocnum::ISA_ASSERT_IRQ);
pub const VM_ISA_DEASSERT_IRQ: u64 = iow::<VmIsaIrq>(VM, iocnum::ISA_DEASSERT_IRQ);
pub const VM_ACTIVATE_CPU: u64 = iow::<VmInt>(VM, iocnum::ACTIVATE_CPU);
pub const VM_SUSPEND_CPU: u64 = iow::<VmInt>(VM, iocnum::SUSPEND_CPU);
pub const VM_RESUME_CPU: u64 = iow::<VmInt>(VM, iocnum::RESUME_CPU);
pub const VM_RTC_WRITE: u64 = iow::<VmRtcData>(VM, iocnum::RTC_WRITE);
pub const VM_RTC_SETTIME: u64 = iow::<VmRtcTime>(VM, iocnum::RTC_SETTIME);
pub const VMMCTL_VM_CREATE: u64 = iowr::<VmmctlVm>(VMMCTL, 0);
pub const VMMCTL_VM_DESTROY: u64 = iowr::<VmmctlVm>(VMMCTL, 1);

/// Name of an ioctl number, for error messages.
pub fn ioctl_name(request: u64) -> &'static str {
    const NAMES: &[(u64, &str)] = &[
        (VM_RUN, "VM_RUN"),
        (VM_RUN_IOWR, "VM_RUN"),
        (VM_SET_CAPABILITY, "VM_SET_CAPABILITY"),
        (VM_GET_CAPABILITY, "VM_GET_CAPABILITY"),
        (VM_SUSPEND, "VM_SUSPEND"),
        (VM_GLA2GPA, "VM_GLA2GPA"),
        (VM_GLA2GPA_NOFAULT, "VM_GLA2GPA_NOFAULT"),
        (VM_ALLOC_MEMSEG_14, "VM_ALLOC_MEMSEG"),
        (VM_ALLOC_MEMSEG_15, "VM_ALLOC_MEMSEG"),
        (VM_MMAP_MEMSEG, "VM_MMAP_MEMSEG"),
        (VM_MUNMAP_MEMSEG, "VM_MUNMAP_MEMSEG"),
        (VM_SET_REGISTER, "VM_SET_REGISTER"),
        (VM_GET_REGISTER, "VM_GET_REGISTER"),
        (VM_SET_SEGMENT_DESCRIPTOR, "VM_SET_SEGMENT_DESCRIPTOR"),
        (VM_GET_SEGMENT_DESCRIPTOR, "VM_GET_SEGMENT_DESCRIPTOR"),
        (VM_SET_REGISTER_SET, "VM_SET_REGISTER_SET"),
        (VM_GET_REGISTER_SET, "VM_GET_REGISTER_SET"),
        (VM_GET_INTINFO, "VM_GET_INTINFO"),
        (VM_SET_INTINFO, "VM_SET_INTINFO"),
        (VM_INJECT_EXCEPTION, "VM_INJECT_EXCEPTION"),
        (VM_LAPIC_IRQ, "VM_LAPIC_IRQ"),
        (VM_INJECT_NMI, "VM_INJECT_NMI"),
        (VM_IOAPIC_ASSERT_IRQ, "VM_IOAPIC_ASSERT_IRQ"),
        (VM_IOAPIC_DEASSERT_IRQ, "VM_IOAPIC_DEASSERT_IRQ"),
        (VM_IOAPIC_PULSE_IRQ, "VM_IOAPIC_PULSE_IRQ"),
        (VM_LAPIC_MSI, "VM_LAPIC_MSI"),
        (VM_RESTART_INSTRUCTION, "VM_RESTART_INSTRUCTION"),
        (VM_SET_X2APIC_STATE, "VM_SET_X2APIC_STATE"),
        (VM_GET_X2APIC_STATE, "VM_GET_X2APIC_STATE"),
        (VM_SET_TOPOLOGY, "VM_SET_TOPOLOGY"),
        (VM_ISA_ASSERT_IRQ, "VM_ISA_ASSERT_IRQ"),
        (VM_ISA_DEASSERT_IRQ, "VM_ISA_DEASSERT_IRQ"),
        (VM_ACTIVATE_CPU, "VM_ACTIVATE_CPU"),
        (VM_SUSPEND_CPU, "VM_SUSPEND_CPU"),
        (VM_RESUME_CPU, "VM_RESUME_CPU"),
        (VM_RTC_WRITE, "VM_RTC_WRITE"),
        (VM_RTC_SETTIME, "VM_RTC_SETTIME"),
        (VM_SNAPSHOT_REQ, "VM_SNAPSHOT_REQ"),
        (VM_RESTORE_TIME, "VM_RESTORE_TIME"),
        (VMMCTL_VM_CREATE, "VMMCTL_VM_CREATE"),
        (VMMCTL_VM_DESTROY, "VMMCTL_VM_DESTROY"),
    ];
    NAMES
        .iter()
        .find(|(n, _)| *n == request)
        .map_or("a vmm ioctl", |(_, name)| name)
}

// --- enumerations (sys/amd64/include/vmm.h, 14.x) -----------------------------------------

/// `enum vm_reg_name`.
pub mod reg {
    pub const RAX: i32 = 0;
    pub const RBX: i32 = 1;
    pub const RCX: i32 = 2;
    pub const RDX: i32 = 3;
    pub const RSI: i32 = 4;
    pub const RDI: i32 = 5;
    pub const RBP: i32 = 6;
    pub const R8: i32 = 7;
    pub const R9: i32 = 8;
    pub const R10: i32 = 9;
    pub const R11: i32 = 10;
    pub const R12: i32 = 11;
    pub const R13: i32 = 12;
    pub const R14: i32 = 13;
    pub const R15: i32 = 14;
    pub const CR0: i32 = 15;
    pub const CR3: i32 = 16;
    pub const CR4: i32 = 17;
    pub const DR7: i32 = 18;
    pub const RSP: i32 = 19;
    pub const RIP: i32 = 20;
    pub const RFLAGS: i32 = 21;
    pub const ES: i32 = 22;
    pub const CS: i32 = 23;
    pub const SS: i32 = 24;
    pub const DS: i32 = 25;
    pub const FS: i32 = 26;
    pub const GS: i32 = 27;
    pub const LDTR: i32 = 28;
    pub const TR: i32 = 29;
    pub const IDTR: i32 = 30;
    pub const GDTR: i32 = 31;
    pub const EFER: i32 = 32;
    pub const CR2: i32 = 33;
    pub const PDPTE0: i32 = 34;
    pub const PDPTE1: i32 = 35;
    pub const PDPTE2: i32 = 36;
    pub const PDPTE3: i32 = 37;
    pub const INTR_SHADOW: i32 = 38;
    pub const DR0: i32 = 39;
    pub const DR1: i32 = 40;
    pub const DR2: i32 = 41;
    pub const DR3: i32 = 42;
    pub const DR6: i32 = 43;
    pub const ENTRY_INST_LENGTH: i32 = 44;
    pub const FS_BASE: i32 = 45;
    pub const GS_BASE: i32 = 46;
    pub const KGS_BASE: i32 = 47;
    pub const TPR: i32 = 48;
    pub const LAST: i32 = 49;

    /// The general-purpose registers in ModRM order (the `gpr_map` of the instruction
    /// decoder): index 0 = RAX, 1 = RCX, 2 = RDX, 3 = RBX, 4 = RSP, ...
    pub const GPR_BY_MODRM: [i32; 16] = [
        RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI, R8, R9, R10, R11, R12, R13, R14, R15,
    ];
}

/// `enum vm_exitcode`.
pub mod exitcode {
    pub const INOUT: i32 = 0;
    pub const VMX: i32 = 1;
    pub const BOGUS: i32 = 2;
    pub const RDMSR: i32 = 3;
    pub const WRMSR: i32 = 4;
    pub const HLT: i32 = 5;
    pub const MTRAP: i32 = 6;
    pub const PAUSE: i32 = 7;
    pub const PAGING: i32 = 8;
    pub const INST_EMUL: i32 = 9;
    pub const SPINUP_AP: i32 = 10;
    pub const DEPRECATED1: i32 = 11;
    pub const RENDEZVOUS: i32 = 12;
    pub const IOAPIC_EOI: i32 = 13;
    pub const SUSPENDED: i32 = 14;
    pub const INOUT_STR: i32 = 15;
    pub const TASK_SWITCH: i32 = 16;
    pub const MONITOR: i32 = 17;
    pub const MWAIT: i32 = 18;
    pub const SVM: i32 = 19;
    pub const REQIDLE: i32 = 20;
    pub const DEBUG: i32 = 21;
    pub const VMINSN: i32 = 22;
    pub const BPT: i32 = 23;
    pub const IPI: i32 = 24;
    pub const DB: i32 = 25;
}

/// `enum vm_cap_type`.
pub mod cap {
    pub const HALT_EXIT: i32 = 0;
    pub const MTRAP_EXIT: i32 = 1;
    pub const PAUSE_EXIT: i32 = 2;
    pub const UNRESTRICTED_GUEST: i32 = 3;
    pub const ENABLE_INVPCID: i32 = 4;
    pub const BPT_EXIT: i32 = 5;
    pub const RDPID: i32 = 6;
    pub const RDTSCP: i32 = 7;
    pub const IPI_EXIT: i32 = 8;
    pub const MASK_HWINTR: i32 = 9;
    pub const RFLAGS_TF: i32 = 10;
}

/// `enum vm_suspend_how`.
pub mod suspend {
    pub const NONE: i32 = 0;
    pub const RESET: i32 = 1;
    pub const POWEROFF: i32 = 2;
    pub const HALT: i32 = 3;
    pub const TRIPLEFAULT: i32 = 4;
    /// FreeBSD 15: the VM is being destroyed.
    pub const DESTROY: i32 = 5;
}

/// `enum x2apic_state`.
pub const X2APIC_DISABLED: i32 = 0;
pub const X2APIC_ENABLED: i32 = 1;

/// `enum vm_cpu_mode`.
pub const CPU_MODE_REAL: i32 = 0;
pub const CPU_MODE_PROTECTED: i32 = 1;
pub const CPU_MODE_COMPATIBILITY: i32 = 2;
pub const CPU_MODE_64BIT: i32 = 3;

/// `VM_INTINFO_*` (the event being delivered: `info1` of `VM_GET/SET_INTINFO`).
pub mod intinfo {
    pub const VECTOR_MASK: u64 = 0xff;
    pub const DEL_ERRCODE: u64 = 0x800;
    pub const VALID: u64 = 0x8000_0000;
    pub const TYPE_MASK: u64 = 0x700;
    pub const HWINTR: u64 = 0;
    pub const NMI: u64 = 2 << 8;
    pub const HWEXCEPTION: u64 = 3 << 8;
    pub const SWINTR: u64 = 4 << 8;
    /// The error code travels in bits 32..63 (`vcpu_exception_intinfo` in vmm.c).
    pub const ERRCODE_SHIFT: u32 = 32;
}

/// Memory-segment ids: one system-memory segment per ferrovm slot. FreeBSD 14 has four
/// segment ids (any unnamed one is system memory); FreeBSD 15 reserves 0..7 for system
/// memory (`VM_SYSMEM .. VM_MAXSYSMEM`).
pub const MAX_SYSMEM_SEGS_14: u32 = 4;
pub const MAX_SYSMEM_SEGS_15: u32 = 8;

/// Which layout family the running kernel speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abi {
    /// FreeBSD 14: VMs created through the `hw.vmm.create` sysctl, 32-byte `vm_memseg`.
    FreeBsd14,
    /// FreeBSD 15: `/dev/vmmctl`, 56-byte `vm_memseg` with NUMA fields.
    FreeBsd15,
}

impl Abi {
    pub fn major(self) -> i32 {
        match self {
            Abi::FreeBsd14 => 14,
            Abi::FreeBsd15 => 15,
        }
    }

    pub fn max_sysmem_segments(self) -> u32 {
        match self {
            Abi::FreeBsd14 => MAX_SYSMEM_SEGS_14,
            Abi::FreeBsd15 => MAX_SYSMEM_SEGS_15,
        }
    }
}

// --- snapshots (kernels built with `options BHYVE_SNAPSHOT`) -----------------------------
//
// Read in `sys/amd64/include/vmm_snapshot.h` (14.x and 15.x trees), `sys/amd64/vmm/vmm.c`
// (14.x: `vm_snapshot_req`, `vm_restore_time`), `sys/amd64/vmm/vmm_snapshot.c` (15.x:
// `vm_snapshot_buf`), `sys/amd64/vmm/vmm_dev.c` (14.x) and `sys/amd64/vmm/vmm_dev_machdep.c`
// (15.x) for the dispatch, and `usr.sbin/bhyve/snapshot.c` (14.x/15.x) for how bhyve(8)
// drives it:
//
// * `VM_SNAPSHOT_REQ = _IOWR('v', 113, struct vm_snapshot_meta)` and `VM_RESTORE_TIME =
//   _IOWR('v', 115, int)` exist only in kernels built with `BHYVE_SNAPSHOT`; elsewhere
//   the ioctl dispatch finds no handler and answers ENOTTY (14.x `vmmdev_ioctl`'s default
//   case; 15.x `vmmdev_ioctl` when neither ioctl table has the number).
// * Both lock every vCPU (`vcpu_lock_all`, 14.x; `VMMDEV_IOCTL_LOCK_ALL_VCPUS`, 15.x): the
//   kernel waits for each vCPU to leave VM_RUN, so the VMM pauses its vCPU threads first.
// * FreeBSD 13's `struct vm_snapshot_meta` began with an unused `void *ctx` (72 bytes,
//   0xC0487671); 14 dropped it (64 bytes, 0xC0407671) and keeps the 13 number as
//   `VM_SNAPSHOT_REQ_OLD`/`_13` under `COMPAT_FREEBSD13`. This backend speaks 14+ only.
// * The kernel reads `dev_req`, `op` and the buffer; `dev_data` and `dev_name` are for
//   bhyve(8)'s own devices. Each saved field is copied out to `buffer.buf` (copyin on
//   restore) and `buf`/`buf_rem` advance; a field that does not fit fails the request with
//   E2BIG. On success the meta is copied back (`_IOWR`), so `buf_size - buf_rem` is the
//   number of bytes the kernel wrote (or, on restore, consumed).
// * `enum snapshot_req`: 13.x began with `STRUCT_VMX = 0`; 14.x removed it and pinned
//   `STRUCT_VIOAPIC = 1`, so every value used here is the same on 13, 14 and 15. An
//   unknown value fails with EINVAL.

/// `struct vm_snapshot_meta` (FreeBSD 14+, 64 bytes). Pointers travel as `u64`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VmSnapshotMeta {
    /// `void *dev_data` (user-space devices only).
    pub dev_data: u64,
    /// `const char *dev_name` (bhyve(8) names the structure; the kernel ignores it).
    pub dev_name: u64,
    /// `enum snapshot_req dev_req`.
    pub dev_req: i32,
    pub _pad0: u32,
    /// `struct vm_snapshot_buffer`: `buf_start`, `buf_size`, `buf`, `buf_rem`.
    pub buf_start: u64,
    pub buf_size: u64,
    pub buf: u64,
    pub buf_rem: u64,
    /// `enum vm_snapshot_op op`.
    pub op: i32,
    pub _pad1: u32,
}

/// `enum snapshot_req` (vmm_snapshot.h; the same values in 13.x, 14.x and 15.x).
pub mod snapshot_req {
    pub const STRUCT_VIOAPIC: i32 = 1;
    pub const STRUCT_VM: i32 = 2;
    pub const STRUCT_VLAPIC: i32 = 3;
    /// Guest memory: bhyve(8) copies it itself; the kernel has no handler for it.
    pub const VM_MEM: i32 = 4;
    pub const STRUCT_VHPET: i32 = 5;
    /// Every vCPU's VMCS (Intel) or VMCB (AMD) fields and the registers kept beside them.
    pub const STRUCT_VMCX: i32 = 6;
    pub const STRUCT_VATPIC: i32 = 7;
    pub const STRUCT_VATPIT: i32 = 8;
    pub const STRUCT_VPMTMR: i32 = 9;
    pub const STRUCT_VRTC: i32 = 10;
}

/// `enum vm_snapshot_op`.
pub const SNAPSHOT_SAVE: i32 = 0;
pub const SNAPSHOT_RESTORE: i32 = 1;

/// The kernel structures bhyve(8) saves and restores, in its order (`snapshot_kern_structs`
/// in usr.sbin/bhyve/snapshot.c, 14.x/15.x; both directions walk the same table). `vm`
/// holds every vCPU's x2APIC mode, pending event, XCR0, `nextrip` and absolute TSC, plus
/// the vCPUs waiting for a SIPI; `vlapic` and `vmcx` loop over every vCPU the kernel has.
pub const KERNEL_STRUCTS: [(&str, i32); 9] = [
    ("vhpet", snapshot_req::STRUCT_VHPET),
    ("vm", snapshot_req::STRUCT_VM),
    ("vioapic", snapshot_req::STRUCT_VIOAPIC),
    ("vlapic", snapshot_req::STRUCT_VLAPIC),
    ("vmcx", snapshot_req::STRUCT_VMCX),
    ("vatpit", snapshot_req::STRUCT_VATPIT),
    ("vatpic", snapshot_req::STRUCT_VATPIC),
    ("vpmtmr", snapshot_req::STRUCT_VPMTMR),
    ("vrtc", snapshot_req::STRUCT_VRTC),
];

pub const VM_SNAPSHOT_REQ: u64 = iowr::<VmSnapshotMeta>(VM, iocnum::SNAPSHOT_REQ);
/// Re-bases the guest's time after a restore: the HPET's callouts and every vCPU's TSC
/// offset (the `vm` structure carries the absolute TSC). Called once, after the kernel
/// structures, before any vCPU runs (bhyve(8) does it just before starting its vCPUs).
pub const VM_RESTORE_TIME: u64 = iowr::<VmInt>(VM, iocnum::RESTORE_TIME);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn ioc_encoding_matches_ioccom_h() {
        assert_eq!(ioc(IOC_VOID, b'v', 5, 0), 0x2000_7605); // VM_REINIT = _IO('v', 5)
        assert_eq!(ioc(IOC_IN, b'v', 1, 32), 0x8020_7601);
        assert_eq!(ioc(IOC_INOUT, b'v', 1, 0x90), 0xc090_7601); // FreeBSD 13's VM_RUN
                                                                // The length is masked to 13 bits.
        assert_eq!(ioc(IOC_IN, b'v', 1, 0x2000), 0x8000_7601);
        assert_eq!(ioc_len(0xc128_5600), 296);
    }

    /// Every number of the fact sheet's table (docs/bhyve.md), computed from the layouts.
    #[test]
    fn ioctl_numbers_match_the_fact_sheet() {
        let table: &[(u64, u64, &str)] = &[
            (VMMCTL_VM_CREATE, 0xC128_5600, "VMMCTL_VM_CREATE"),
            (VMMCTL_VM_DESTROY, 0xC128_5601, "VMMCTL_VM_DESTROY"),
            (VM_RUN, 0x8020_7601, "VM_RUN"),
            (VM_ALLOC_MEMSEG_14, 0x8020_760E, "VM_ALLOC_MEMSEG (14)"),
            (VM_ALLOC_MEMSEG_15, 0x8038_760E, "VM_ALLOC_MEMSEG (15)"),
            (VM_MMAP_MEMSEG, 0x8028_7610, "VM_MMAP_MEMSEG"),
            (VM_MUNMAP_MEMSEG, 0x8010_7613, "VM_MUNMAP_MEMSEG"),
            (VM_SET_REGISTER, 0x8010_7614, "VM_SET_REGISTER"),
            (VM_GET_REGISTER, 0xC010_7615, "VM_GET_REGISTER"),
            (VM_SET_REGISTER_SET, 0x8018_7618, "VM_SET_REGISTER_SET"),
            (VM_GET_REGISTER_SET, 0xC018_7619, "VM_GET_REGISTER_SET"),
            (
                VM_SET_SEGMENT_DESCRIPTOR,
                0x8018_7616,
                "VM_SET_SEGMENT_DESCRIPTOR",
            ),
            (
                VM_GET_SEGMENT_DESCRIPTOR,
                0xC018_7617,
                "VM_GET_SEGMENT_DESCRIPTOR",
            ),
            (VM_SET_CAPABILITY, 0x8010_7602, "VM_SET_CAPABILITY"),
            (VM_GET_CAPABILITY, 0xC010_7603, "VM_GET_CAPABILITY"),
            (VM_ACTIVATE_CPU, 0x8004_765A, "VM_ACTIVATE_CPU"),
            (VM_SUSPEND_CPU, 0x8004_765C, "VM_SUSPEND_CPU"),
            (VM_RESUME_CPU, 0x8004_765D, "VM_RESUME_CPU"),
            (VM_SUSPEND, 0x8004_7604, "VM_SUSPEND"),
            (VM_LAPIC_IRQ, 0x8008_761F, "VM_LAPIC_IRQ"),
            (VM_LAPIC_MSI, 0x8010_7624, "VM_LAPIC_MSI"),
            (VM_IOAPIC_ASSERT_IRQ, 0x8004_7621, "VM_IOAPIC_ASSERT_IRQ"),
            (
                VM_IOAPIC_DEASSERT_IRQ,
                0x8004_7622,
                "VM_IOAPIC_DEASSERT_IRQ",
            ),
            (VM_IOAPIC_PULSE_IRQ, 0x8004_7623, "VM_IOAPIC_PULSE_IRQ"),
            (VM_ISA_ASSERT_IRQ, 0x8008_7650, "VM_ISA_ASSERT_IRQ"),
            (VM_ISA_DEASSERT_IRQ, 0x8008_7651, "VM_ISA_DEASSERT_IRQ"),
            (VM_INJECT_NMI, 0x8004_7620, "VM_INJECT_NMI"),
            (VM_INJECT_EXCEPTION, 0x8014_761E, "VM_INJECT_EXCEPTION"),
            (VM_SET_X2APIC_STATE, 0x8008_763C, "VM_SET_X2APIC_STATE"),
            (VM_GET_X2APIC_STATE, 0xC008_763D, "VM_GET_X2APIC_STATE"),
            (
                VM_RESTART_INSTRUCTION,
                0x8004_7627,
                "VM_RESTART_INSTRUCTION",
            ),
            (VM_SET_TOPOLOGY, 0x8008_763F, "VM_SET_TOPOLOGY"),
            // Not in the fact sheet's table; from the IOCNUMs and layouts above.
            (VM_RUN_IOWR, 0xC020_7601, "VM_RUN (_IOWR)"),
            (VM_GLA2GPA, 0xC038_760D, "VM_GLA2GPA"),
            (VM_GLA2GPA_NOFAULT, 0xC038_7612, "VM_GLA2GPA_NOFAULT"),
            (VM_GET_INTINFO, 0xC018_761C, "VM_GET_INTINFO"),
            (VM_SET_INTINFO, 0x8018_761D, "VM_SET_INTINFO"),
            (VM_RTC_WRITE, 0x8008_7665, "VM_RTC_WRITE"),
            (VM_RTC_SETTIME, 0x8008_7666, "VM_RTC_SETTIME"),
            // The fact sheet's number; VM_RESTORE_TIME from IOCNUM 115 and `int`.
            (VM_SNAPSHOT_REQ, 0xC040_7671, "VM_SNAPSHOT_REQ"),
            (VM_RESTORE_TIME, 0xC004_7673, "VM_RESTORE_TIME"),
        ];
        for &(computed, expected, name) in table {
            assert_eq!(
                computed, expected,
                "{name}: computed {computed:#x}, expected {expected:#x}"
            );
        }
    }

    #[test]
    fn struct_sizes() {
        assert_eq!(size_of::<VmRegister>(), 16);
        assert_eq!(size_of::<VmRtcData>(), 8);
        assert_eq!(offset_of!(VmRtcData, value), 4);
        assert_eq!(size_of::<VmRtcTime>(), 8);
        assert_eq!(size_of::<SegDesc>(), 16);
        assert_eq!(size_of::<VmSegDesc>(), 24);
        assert_eq!(size_of::<VmRegisterSet>(), 24);
        assert_eq!(size_of::<VmRun>(), 32);
        assert_eq!(size_of::<VmExit>(), VM_EXIT_SIZE);
        assert_eq!(size_of::<VmMemseg14>(), 32);
        assert_eq!(size_of::<VmMemseg15>(), 56);
        assert_eq!(size_of::<VmMemmap>(), 40);
        assert_eq!(size_of::<VmMunmap>(), 16);
        assert_eq!(size_of::<VmCapability>(), 16);
        assert_eq!(size_of::<VmInt>(), 4);
        assert_eq!(size_of::<VmLapicIrq>(), 8);
        assert_eq!(size_of::<VmLapicMsi>(), 16);
        assert_eq!(size_of::<VmIsaIrq>(), 8);
        assert_eq!(size_of::<VmException>(), 20);
        assert_eq!(size_of::<VmX2apic>(), 8);
        assert_eq!(size_of::<VmCpuTopology>(), 8);
        assert_eq!(size_of::<VmIntinfo>(), 24);
        assert_eq!(size_of::<VmGuestPaging>(), 24);
        assert_eq!(size_of::<VmGla2gpa>(), 56);
        assert_eq!(size_of::<VmmctlVm>(), 296);
    }

    #[test]
    fn field_offsets() {
        assert_eq!(offset_of!(VmRegister, regval), 8);
        assert_eq!(offset_of!(VmSegDesc, desc), 8);
        assert_eq!(offset_of!(SegDesc, limit), 8);
        assert_eq!(offset_of!(SegDesc, access), 12);
        assert_eq!(offset_of!(VmRegisterSet, regnums), 8);
        assert_eq!(offset_of!(VmRegisterSet, regvals), 16);
        assert_eq!(offset_of!(VmRun, cpuset), 8);
        assert_eq!(offset_of!(VmRun, cpusetsize), 16);
        assert_eq!(offset_of!(VmRun, vm_exit), 24);
        assert_eq!(offset_of!(VmExit, inst_length), 4);
        assert_eq!(offset_of!(VmExit, rip), 8);
        assert_eq!(offset_of!(VmExit, u), VM_EXIT_UNION);
        assert_eq!(offset_of!(VmMemseg14, len), 8);
        assert_eq!(offset_of!(VmMemseg14, name), 16);
        assert_eq!(offset_of!(VmMemseg15, ds_mask), 32);
        assert_eq!(offset_of!(VmMemseg15, ds_mask_size), 40);
        assert_eq!(offset_of!(VmMemseg15, ds_policy), 48);
        assert_eq!(offset_of!(VmMemmap, segid), 8);
        assert_eq!(offset_of!(VmMemmap, segoff), 16);
        assert_eq!(offset_of!(VmMemmap, len), 24);
        assert_eq!(offset_of!(VmMemmap, prot), 32);
        assert_eq!(offset_of!(VmMemmap, flags), 36);
        assert_eq!(offset_of!(VmException, error_code), 8);
        assert_eq!(offset_of!(VmException, restart_instruction), 16);
        assert_eq!(offset_of!(VmIntinfo, info1), 8);
        assert_eq!(offset_of!(VmGla2gpa, gla), 8);
        assert_eq!(offset_of!(VmGla2gpa, paging), 16);
        assert_eq!(offset_of!(VmGla2gpa, fault), 40);
        assert_eq!(offset_of!(VmGla2gpa, gpa), 48);
        assert_eq!(offset_of!(VmmctlVm, flags), 232);
        assert_eq!(offset_of!(VmmctlVm, reserved), 236);
    }

    #[test]
    fn enumerations_match_vmm_h() {
        assert_eq!(reg::RIP, 20);
        assert_eq!(reg::EFER, 32);
        assert_eq!(reg::INTR_SHADOW, 38);
        assert_eq!(reg::TPR, 48);
        assert_eq!(reg::LAST, 49);
        assert_eq!(exitcode::INST_EMUL, 9);
        assert_eq!(exitcode::SUSPENDED, 14);
        assert_eq!(exitcode::INOUT_STR, 15);
        assert_eq!(exitcode::REQIDLE, 20);
        assert_eq!(exitcode::DB, 25);
        assert_eq!(cap::UNRESTRICTED_GUEST, 3);
        assert_eq!(cap::RFLAGS_TF, 10);
        assert_eq!(suspend::TRIPLEFAULT, 4);
    }

    /// `struct vm_snapshot_meta` as FreeBSD 14/15 lay it out on amd64, and the request
    /// numbers and the 13 layout it replaced.
    #[test]
    fn snapshot_layout_matches_vmm_snapshot_h() {
        assert_eq!(size_of::<VmSnapshotMeta>(), 64);
        assert_eq!(offset_of!(VmSnapshotMeta, dev_name), 8);
        assert_eq!(offset_of!(VmSnapshotMeta, dev_req), 16);
        assert_eq!(offset_of!(VmSnapshotMeta, buf_start), 24);
        assert_eq!(offset_of!(VmSnapshotMeta, buf_size), 32);
        assert_eq!(offset_of!(VmSnapshotMeta, buf), 40);
        assert_eq!(offset_of!(VmSnapshotMeta, buf_rem), 48);
        assert_eq!(offset_of!(VmSnapshotMeta, op), 56);
        assert_eq!(ioc_len(VM_SNAPSHOT_REQ), 64);
        // FreeBSD 13's layout had one more pointer in front (COMPAT_FREEBSD13's number).
        assert_eq!(ioc(IOC_INOUT, b'v', iocnum::SNAPSHOT_REQ, 72), 0xC048_7671);
        assert_ne!(VM_SNAPSHOT_REQ, 0xC048_7671);
        assert_eq!((SNAPSHOT_SAVE, SNAPSHOT_RESTORE), (0, 1));
        let reqs: Vec<i32> = KERNEL_STRUCTS.iter().map(|s| s.1).collect();
        assert_eq!(reqs, [5, 2, 1, 3, 6, 8, 7, 9, 10]);
        assert_eq!(snapshot_req::VM_MEM, 4);
        let names: Vec<&str> = KERNEL_STRUCTS.iter().map(|s| s.0).collect();
        assert_eq!(
            names,
            ["vhpet", "vm", "vioapic", "vlapic", "vmcx", "vatpit", "vatpic", "vpmtmr", "vrtc"]
        );
        assert_eq!(ioctl_name(VM_SNAPSHOT_REQ), "VM_SNAPSHOT_REQ");
        assert_eq!(ioctl_name(VM_RESTORE_TIME), "VM_RESTORE_TIME");
    }
}
