//! Decoding `struct vm_exit` (FreeBSD 14/15 amd64, 136 bytes) from the bytes the kernel
//! copied out. Offsets are relative to the start of the structure; the union starts at 16.

use super::abi::{exitcode, SegDesc, VmGuestPaging, VM_EXIT_SIZE, VM_EXIT_UNION};

const U: usize = VM_EXIT_UNION;

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap_or([0; 4]))
}

fn i32_at(b: &[u8], off: usize) -> i32 {
    u32_at(b, off) as i32
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap_or([0; 8]))
}

fn paging_at(b: &[u8], off: usize) -> VmGuestPaging {
    VmGuestPaging {
        cr3: u64_at(b, off),
        cpl: i32_at(b, off + 8),
        cpu_mode: i32_at(b, off + 12),
        paging_mode: i32_at(b, off + 16),
        _pad: 0,
    }
}

/// `struct vm_inout` (8 bytes): a 16-bit word of bit fields (`bytes:3, in:1, string:1,
/// rep:1`, allocated from bit 0 on amd64), the port, and EAX at the exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inout {
    pub bytes: u8,
    pub is_in: bool,
    pub string: bool,
    pub rep: bool,
    pub port: u16,
    pub eax: u32,
}

impl Inout {
    fn decode(b: &[u8], off: usize) -> Self {
        let bits = u16_at(b, off);
        Inout {
            bytes: (bits & 0x7) as u8,
            is_in: bits & 0x8 != 0,
            string: bits & 0x10 != 0,
            rep: bits & 0x20 != 0,
            port: u16_at(b, off + 2),
            eax: u32_at(b, off + 4),
        }
    }
}

/// `struct vm_inout_str`: INS/OUTS with the state needed to walk guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InoutStr {
    pub inout: Inout,
    pub paging: VmGuestPaging,
    pub rflags: u64,
    pub cr0: u64,
    /// RSI (OUTS) or RDI (INS) at the exit.
    pub index: u64,
    /// RCX with REP, 1 without.
    pub count: u64,
    /// Address size in bytes (2, 4 or 8).
    pub addrsize: i32,
    /// `enum vm_reg_name` of the segment (ES for INS, DS or the override for OUTS).
    pub seg_name: i32,
    pub seg_desc: SegDesc,
}

/// The part of `struct vie` (64 bytes, at offset 56 of the `inst_emul` arm) that the
/// backend uses. The bit fields of bytes 17..21 are allocated from bit 0 of each byte, the
/// way the amd64 ABI packs consecutive `uint8_t` bit fields (vmm.h `_Static_assert`s
/// `disp_bytes` at 22, which only holds with that packing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vie {
    pub inst: [u8; 15],
    pub num_valid: u8,
    pub num_processed: u8,
    pub addrsize: u8,
    pub opsize: u8,
    pub rex_w: bool,
    pub rex_r: bool,
    pub rex_present: bool,
    /// ModRM.reg with REX.R folded in (0..15).
    pub reg: u8,
    pub immediate: i64,
    pub decoded: bool,
    pub op_byte: u8,
}

impl Vie {
    pub const SIZE: usize = 64;

    pub fn decode(b: &[u8]) -> Self {
        let mut inst = [0u8; 15];
        inst.copy_from_slice(&b[0..15]);
        Vie {
            inst,
            num_valid: b[15],
            num_processed: b[16],
            addrsize: b[17] & 0xf,
            opsize: b[17] >> 4,
            rex_w: b[18] & 0x01 != 0,
            rex_r: b[18] & 0x02 != 0,
            rex_present: b[18] & 0x10 != 0,
            reg: b[19] >> 4,
            immediate: u64_at(b, 48) as i64,
            decoded: b[56] != 0,
            op_byte: b[58],
        }
    }

    /// The valid instruction bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.inst[..usize::from(self.num_valid).min(self.inst.len())]
    }
}

/// `inst_emul`: an access to guest-physical memory that is not RAM and not one of the
/// in-kernel devices; the kernel has fetched and decoded the instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstEmul {
    pub gpa: u64,
    pub gla: u64,
    pub cs_base: u64,
    pub cs_d: bool,
    pub paging: VmGuestPaging,
    pub vie: Vie,
}

/// One decoded exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    Inout(Inout),
    InoutStr(InoutStr),
    InstEmul(InstEmul),
    Rdmsr {
        code: u32,
    },
    Wrmsr {
        code: u32,
        value: u64,
    },
    Hlt {
        rflags: u64,
    },
    Suspended {
        how: i32,
    },
    SpinupAp {
        vcpu: i32,
        rip: u64,
    },
    /// VMX exit the kernel did not handle; `status` non-zero means a VM-entry failure.
    Vmx {
        status: i32,
        reason: u32,
        qualification: u64,
        inst_type: i32,
        inst_error: i32,
    },
    Svm {
        exitcode: u64,
        info1: u64,
        info2: u64,
    },
    Paging {
        gpa: u64,
        fault_type: i32,
    },
    /// Exits that carry no work: BOGUS (a signal or reschedule), REQIDLE, RENDEZVOUS,
    /// IOAPIC_EOI, MTRAP, PAUSE, DEBUG, and MONITOR/MWAIT/VMINSN (the kernel already
    /// injected #UD).
    NoWork {
        code: i32,
    },
    Other {
        code: i32,
    },
}

/// An exit as the kernel reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decoded {
    pub code: i32,
    pub inst_length: i32,
    pub rip: u64,
    pub exit: Exit,
}

/// Decodes a `struct vm_exit`. `b` must hold the 136 bytes the kernel copied out.
pub fn decode(b: &[u8]) -> Decoded {
    debug_assert!(b.len() >= VM_EXIT_SIZE);
    let code = i32_at(b, 0);
    let inst_length = i32_at(b, 4);
    let rip = u64_at(b, 8);
    let exit = match code {
        exitcode::INOUT => Exit::Inout(Inout::decode(b, U)),
        exitcode::INOUT_STR => Exit::InoutStr(InoutStr {
            inout: Inout::decode(b, U),
            paging: paging_at(b, U + 8),
            rflags: u64_at(b, U + 32),
            cr0: u64_at(b, U + 40),
            index: u64_at(b, U + 48),
            count: u64_at(b, U + 56),
            addrsize: i32_at(b, U + 64),
            seg_name: i32_at(b, U + 68),
            seg_desc: SegDesc {
                base: u64_at(b, U + 72),
                limit: u32_at(b, U + 80),
                access: u32_at(b, U + 84),
            },
        }),
        exitcode::INST_EMUL => Exit::InstEmul(InstEmul {
            gpa: u64_at(b, U),
            gla: u64_at(b, U + 8),
            cs_base: u64_at(b, U + 16),
            cs_d: i32_at(b, U + 24) != 0,
            paging: paging_at(b, U + 32),
            vie: Vie::decode(&b[U + 56..U + 56 + Vie::SIZE]),
        }),
        exitcode::RDMSR => Exit::Rdmsr { code: u32_at(b, U) },
        exitcode::WRMSR => Exit::Wrmsr {
            code: u32_at(b, U),
            value: u64_at(b, U + 8),
        },
        exitcode::HLT => Exit::Hlt {
            rflags: u64_at(b, U),
        },
        exitcode::SUSPENDED => Exit::Suspended { how: i32_at(b, U) },
        exitcode::SPINUP_AP => Exit::SpinupAp {
            vcpu: i32_at(b, U),
            rip: u64_at(b, U + 8),
        },
        exitcode::VMX => Exit::Vmx {
            status: i32_at(b, U),
            reason: u32_at(b, U + 4),
            qualification: u64_at(b, U + 8),
            inst_type: i32_at(b, U + 16),
            inst_error: i32_at(b, U + 20),
        },
        exitcode::SVM => Exit::Svm {
            exitcode: u64_at(b, U),
            info1: u64_at(b, U + 8),
            info2: u64_at(b, U + 16),
        },
        exitcode::PAGING => Exit::Paging {
            gpa: u64_at(b, U),
            fault_type: i32_at(b, U + 8),
        },
        exitcode::BOGUS
        | exitcode::REQIDLE
        | exitcode::RENDEZVOUS
        | exitcode::IOAPIC_EOI
        | exitcode::MTRAP
        | exitcode::PAUSE
        | exitcode::DEBUG
        | exitcode::MONITOR
        | exitcode::MWAIT
        | exitcode::VMINSN => Exit::NoWork { code },
        _ => Exit::Other { code },
    };
    Decoded {
        code,
        inst_length,
        rip,
        exit,
    }
}

/// Name of an exit code, for messages.
pub fn exit_name(code: i32) -> &'static str {
    const NAMES: [&str; 26] = [
        "INOUT",
        "VMX",
        "BOGUS",
        "RDMSR",
        "WRMSR",
        "HLT",
        "MTRAP",
        "PAUSE",
        "PAGING",
        "INST_EMUL",
        "SPINUP_AP",
        "DEPRECATED1",
        "RENDEZVOUS",
        "IOAPIC_EOI",
        "SUSPENDED",
        "INOUT_STR",
        "TASK_SWITCH",
        "MONITOR",
        "MWAIT",
        "SVM",
        "REQIDLE",
        "DEBUG",
        "VMINSN",
        "BPT",
        "IPI",
        "DB",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("unknown")
}

/// Builders of exit images, for the tests (here and in the backend's tests).
#[cfg(test)]
pub mod build {
    use super::*;

    pub fn header(code: i32, inst_length: i32, rip: u64) -> [u8; VM_EXIT_SIZE] {
        let mut b = [0u8; VM_EXIT_SIZE];
        b[0..4].copy_from_slice(&code.to_le_bytes());
        b[4..8].copy_from_slice(&inst_length.to_le_bytes());
        b[8..16].copy_from_slice(&rip.to_le_bytes());
        b
    }

    pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
        b[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }

    pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
        b[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
        b[off..off + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub fn inout(is_in: bool, bytes: u8, port: u16, eax: u32, rip: u64) -> [u8; VM_EXIT_SIZE] {
        let mut b = header(exitcode::INOUT, 1, rip);
        put_u16(&mut b, U, u16::from(bytes) | if is_in { 0x8 } else { 0 });
        put_u16(&mut b, U + 2, port);
        put_u32(&mut b, U + 4, eax);
        b
    }

    #[allow(clippy::too_many_arguments)]
    pub fn inout_str(
        is_in: bool,
        bytes: u8,
        rep: bool,
        port: u16,
        index: u64,
        count: u64,
        addrsize: i32,
        rflags: u64,
        cpu_mode: i32,
        seg_base: u64,
        rip: u64,
    ) -> [u8; VM_EXIT_SIZE] {
        let mut b = header(exitcode::INOUT_STR, 2, rip);
        let bits =
            u16::from(bytes) | if is_in { 0x8 } else { 0 } | 0x10 | if rep { 0x20 } else { 0 };
        put_u16(&mut b, U, bits);
        put_u16(&mut b, U + 2, port);
        put_u32(&mut b, U + 20, cpu_mode as u32);
        put_u64(&mut b, U + 32, rflags);
        put_u64(&mut b, U + 48, index);
        put_u64(&mut b, U + 56, count);
        put_u32(&mut b, U + 64, addrsize as u32);
        put_u64(&mut b, U + 72, seg_base);
        b
    }

    /// An INST_EMUL exit for `inst` at `gpa`, with the decoded fields a kernel would fill.
    #[allow(clippy::too_many_arguments)]
    pub fn inst_emul(
        gpa: u64,
        inst: &[u8],
        op_byte: u8,
        opsize: u8,
        reg: u8,
        rex_present: bool,
        immediate: i64,
        cpu_mode: i32,
        rip: u64,
    ) -> [u8; VM_EXIT_SIZE] {
        let mut b = header(exitcode::INST_EMUL, inst.len() as i32, rip);
        put_u64(&mut b, U, gpa);
        put_u32(&mut b, U + 24, 1); // cs_d
        put_u32(&mut b, U + 32 + 12, cpu_mode as u32);
        let v = U + 56;
        b[v..v + inst.len()].copy_from_slice(inst);
        b[v + 15] = inst.len() as u8;
        b[v + 16] = inst.len() as u8;
        b[v + 17] = 8 | (opsize << 4); // addrsize 8
        b[v + 18] = if rex_present { 0x10 } else { 0 } | if reg >= 8 { 0x02 } else { 0 };
        b[v + 19] = (reg & 0xf) << 4;
        put_u64(&mut b, v + 48, immediate as u64);
        b[v + 56] = 1;
        b[v + 58] = op_byte;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    #[test]
    fn inout_bit_fields() {
        let d = decode(&inout(true, 2, 0x3f8, 0xdead_beef, 0x1000));
        assert_eq!(d.rip, 0x1000);
        assert_eq!(d.inst_length, 1);
        assert_eq!(
            d.exit,
            Exit::Inout(Inout {
                bytes: 2,
                is_in: true,
                string: false,
                rep: false,
                port: 0x3f8,
                eax: 0xdead_beef
            })
        );
        let d = decode(&inout(false, 4, 0xcf8, 7, 0));
        let Exit::Inout(io) = d.exit else {
            panic!("{d:?}")
        };
        assert!(!io.is_in && io.bytes == 4 && io.port == 0xcf8 && io.eax == 7);
    }

    #[test]
    fn inout_str_fields() {
        let b = inout_str(true, 1, true, 0x60, 0x8000, 5, 8, 0x202, 3, 0x10, 0x2000);
        let Exit::InoutStr(s) = decode(&b).exit else {
            panic!()
        };
        assert!(s.inout.is_in && s.inout.string && s.inout.rep);
        assert_eq!((s.index, s.count, s.addrsize), (0x8000, 5, 8));
        assert_eq!(s.rflags, 0x202);
        assert_eq!(s.paging.cpu_mode, 3);
        assert_eq!(s.seg_desc.base, 0x10);
    }

    #[test]
    fn inst_emul_and_vie_bit_fields() {
        // mov r9d, [rax] = 44 8b 08 (REX.R, 8B /r, reg = 1 | 8)
        let b = inst_emul(
            0xd000_0000,
            &[0x44, 0x8b, 0x08],
            0x8b,
            4,
            9,
            true,
            0,
            3,
            0x5000,
        );
        let Exit::InstEmul(e) = decode(&b).exit else {
            panic!()
        };
        assert_eq!(e.gpa, 0xd000_0000);
        assert!(e.cs_d);
        assert_eq!(e.paging.cpu_mode, 3);
        assert_eq!(e.vie.bytes(), &[0x44, 0x8b, 0x08]);
        assert_eq!((e.vie.opsize, e.vie.addrsize), (4, 8));
        assert_eq!(e.vie.reg, 9);
        assert!(e.vie.rex_present && e.vie.rex_r && e.vie.decoded);
        assert_eq!(e.vie.op_byte, 0x8b);
    }

    #[test]
    fn msr_suspend_spinup_hlt_and_no_work() {
        let mut b = header(exitcode::RDMSR, 2, 0);
        put_u32(&mut b, U, 0xc000_0080);
        assert_eq!(decode(&b).exit, Exit::Rdmsr { code: 0xc000_0080 });

        let mut b = header(exitcode::WRMSR, 2, 0);
        put_u32(&mut b, U, 0x1b);
        put_u64(&mut b, U + 8, 0xfee0_0900);
        assert_eq!(
            decode(&b).exit,
            Exit::Wrmsr {
                code: 0x1b,
                value: 0xfee0_0900
            }
        );

        let mut b = header(exitcode::SUSPENDED, 0, 0);
        put_u32(&mut b, U, 4);
        assert_eq!(decode(&b).exit, Exit::Suspended { how: 4 });

        let mut b = header(exitcode::SPINUP_AP, 0, 0);
        put_u32(&mut b, U, 3);
        put_u64(&mut b, U + 8, 0x9000);
        assert_eq!(
            decode(&b).exit,
            Exit::SpinupAp {
                vcpu: 3,
                rip: 0x9000
            }
        );

        let mut b = header(exitcode::HLT, 1, 0);
        put_u64(&mut b, U, 0x2);
        assert_eq!(decode(&b).exit, Exit::Hlt { rflags: 2 });

        for code in [exitcode::BOGUS, exitcode::REQIDLE, exitcode::PAUSE] {
            assert_eq!(decode(&header(code, 0, 0)).exit, Exit::NoWork { code });
        }
        assert_eq!(decode(&header(99, 0, 0)).exit, Exit::Other { code: 99 });
        assert_eq!(exit_name(exitcode::INOUT_STR), "INOUT_STR");
        assert_eq!(exit_name(-1), "unknown");
    }

    #[test]
    fn vmx_and_paging() {
        let mut b = header(exitcode::VMX, 0, 0);
        put_u32(&mut b, U, 0);
        put_u32(&mut b, U + 4, 0x8000_0021);
        put_u64(&mut b, U + 8, 5);
        assert_eq!(
            decode(&b).exit,
            Exit::Vmx {
                status: 0,
                reason: 0x8000_0021,
                qualification: 5,
                inst_type: 0,
                inst_error: 0
            }
        );
        let mut b = header(exitcode::PAGING, 0, 0);
        put_u64(&mut b, U, 0x1234_5000);
        put_u32(&mut b, U + 8, 2);
        assert_eq!(
            decode(&b).exit,
            Exit::Paging {
                gpa: 0x1234_5000,
                fault_type: 2
            }
        );
    }
}
