//! Backend-neutral x86-64 vCPU state. Layouts follow the architecture, not a kernel ABI, so
//! the same structures serve KVM and bhyve and travel in snapshots and migration streams.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandardRegisters {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rsp: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub rip: u64,
    pub rflags: u64,
}

/// A segment register with its hidden (descriptor-cache) part, unpacked field by field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRegister {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    /// Descriptor type (4 bits).
    pub type_: u8,
    pub present: bool,
    pub dpl: u8,
    /// Default operation size (1 = 32-bit).
    pub db: bool,
    /// Code/data (true) or system (false) descriptor.
    pub s: bool,
    /// 64-bit code segment.
    pub l: bool,
    /// Granularity: limit in 4 KiB units.
    pub g: bool,
    pub avl: bool,
    pub unusable: bool,
}

impl SegmentRegister {
    /// Flat segment from the fields of a GDT descriptor (`access` is byte 5 of the
    /// descriptor, `flags` the high nibble of byte 6).
    pub fn from_descriptor(selector: u16, base: u32, limit: u32, access: u8, flags: u8) -> Self {
        let g = flags & 0x8 != 0;
        SegmentRegister {
            base: u64::from(base),
            // The hidden limit is always in bytes.
            limit: if g { (limit << 12) | 0xfff } else { limit },
            selector,
            type_: access & 0xf,
            present: access & 0x80 != 0,
            dpl: (access >> 5) & 3,
            db: flags & 0x4 != 0,
            s: access & 0x10 != 0,
            l: flags & 0x2 != 0,
            g,
            avl: flags & 0x1 != 0,
            unusable: access & 0x80 == 0,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescriptorTable {
    pub base: u64,
    pub limit: u16,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecialRegisters {
    pub cs: SegmentRegister,
    pub ds: SegmentRegister,
    pub es: SegmentRegister,
    pub fs: SegmentRegister,
    pub gs: SegmentRegister,
    pub ss: SegmentRegister,
    pub tr: SegmentRegister,
    pub ldt: SegmentRegister,
    pub gdt: DescriptorTable,
    pub idt: DescriptorTable,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub cr8: u64,
    pub efer: u64,
    pub apic_base: u64,
}

/// Legacy FPU and SSE state (the FXSAVE image, unpacked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FpuState {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
}

/// The XSAVE area exactly as the processor lays it out (standard format), so it is kernel
/// neutral. Its length depends on the features enabled in XCR0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XsaveState {
    pub region: Vec<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Xcr {
    pub index: u32,
    pub value: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsrEntry {
    pub index: u32,
    pub data: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidEntry {
    pub function: u32,
    pub index: u32,
    /// The leaf is indexed by ECX (the `index` field matters).
    pub significant_index: bool,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

/// The local APIC register page (1 KiB, architectural offsets: ID at 0x20, TPR at 0x80, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LapicState {
    pub regs: Vec<u8>,
}

impl Default for LapicState {
    fn default() -> Self {
        LapicState {
            regs: vec![0; LAPIC_REGS_SIZE],
        }
    }
}

pub const LAPIC_REGS_SIZE: usize = 1024;

impl LapicState {
    pub fn read_u32(&self, offset: usize) -> u32 {
        let mut word = [0u8; 4];
        if let Some(bytes) = self.regs.get(offset..offset + 4) {
            word.copy_from_slice(bytes);
        }
        u32::from_le_bytes(word)
    }

    pub fn write_u32(&mut self, offset: usize, value: u32) {
        if let Some(bytes) = self.regs.get_mut(offset..offset + 4) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MpState {
    #[default]
    Runnable,
    /// An application processor waiting for INIT.
    Uninitialized,
    /// INIT received, waiting for SIPI.
    InitReceived,
    Halted,
    SipiReceived,
}

/// Events in flight on a vCPU: an exception or interrupt being injected, NMI state, the
/// SIPI vector. Needed to save a vCPU at an arbitrary exit without losing an event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuEvents {
    pub exception_injected: bool,
    pub exception_pending: bool,
    pub exception_nr: u8,
    pub exception_has_error_code: bool,
    pub exception_error_code: u32,
    pub interrupt_injected: bool,
    pub interrupt_nr: u8,
    pub interrupt_soft: bool,
    pub interrupt_shadow: u8,
    pub nmi_injected: bool,
    pub nmi_pending: bool,
    pub nmi_masked: bool,
    pub sipi_vector: u32,
    pub smi_pending: bool,
    pub smm: bool,
    pub latched_init: bool,
}
