//! MMIO instructions the kernel decoded (`VM_EXITCODE_INST_EMUL`), turned into one read or
//! one write of a user-space device plus the register update that completes it.
//!
//! vmm.ko emulates accesses to its own devices (LAPIC, IOAPIC, HPET) and hands every other
//! access to a non-RAM address to user space with the instruction already fetched and
//! decoded into `struct vie`; RIP is already past the instruction. User space performs the
//! access and writes the destination register with VM_SET_REGISTER.
//!
//! The instruction bytes are decoded again here with iced-x86 (the decoder the instruction
//! completion in `complete` uses), in the bitness of the guest's code segment, and the
//! access is derived from iced's operands: the moves a driver uses for device registers,
//! MOV (to or from a general-purpose register, or from an immediate), MOVZX and MOVSX, in
//! any encoding (prefixes, REX, moffs). Read-modify-write instructions (AND, OR, TEST, BT,
//! ...) and string moves to MMIO are refused with one line naming the instruction.
//!
//! iced's decode is cross-checked against the kernel's (`num_processed`, `op_byte`,
//! ModRM.reg, the operand size and the immediate), so a drift of the `struct vie`
//! bit-field layout, or a CPU mode read wrongly, stops the guest instead of silently
//! writing the wrong register.

use iced_x86::{
    Code, Decoder, DecoderError, DecoderOptions, Formatter, Instruction, IntelFormatter, Mnemonic,
    OpKind, Register,
};

use super::abi::{reg, CPU_MODE_64BIT};
use super::exit::{InstEmul, Vie};

/// Where a read's value goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// `GPR_BY_MODRM[n]`, written with the operand size (8/16-bit writes merge into the old
    /// value, 32-bit writes zero-extend, 64-bit writes replace).
    Gpr { reg: i32, size: u8 },
    /// A byte register: AL..BL, SPL..DIL or R8B..R15B (`high` = false), or AH..BH (`high`).
    Byte { reg: i32, high: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extend {
    Zero,
    Sign,
}

/// Where a write's value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Gpr { reg: i32 },
    Byte { reg: i32, high: bool },
    Imm(u64),
}

/// One decoded MMIO access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmioOp {
    /// Read `size` bytes, extend them to the destination's size, write the register.
    Read {
        size: u8,
        extend: Extend,
        dest: Dest,
    },
    /// Write `size` bytes taken from `source`.
    Write { size: u8, source: Source },
}

/// Why an INST_EMUL exit could not be turned into an access.
#[derive(Debug, PartialEq, Eq)]
pub struct Unemulated(pub String);

/// Decides what an INST_EMUL exit asks for.
pub fn decode_mmio(e: &InstEmul) -> Result<MmioOp, Unemulated> {
    let vie = &e.vie;
    let bytes = vie.bytes();
    let mut decoder = Decoder::new(bitness(e), bytes, DecoderOptions::NONE);
    let insn = decoder.decode();
    let fail = |why: String| {
        let len = if insn.is_invalid() {
            bytes.len()
        } else {
            insn.len()
        };
        Unemulated(format!(
            "MMIO access at GPA {:#x} by `{}` ({}): {why}",
            e.gpa,
            disassemble(&insn),
            hex(&bytes[..len])
        ))
    };
    if !vie.decoded {
        // RIP was not advanced either: nothing can complete it.
        return Err(fail("the kernel could not decode it".into()));
    }
    if insn.is_invalid() {
        return Err(fail(match decoder.last_error() {
            DecoderError::NoMoreBytes => "truncated instruction".into(),
            _ => "not a valid instruction".into(),
        }));
    }
    if usize::from(vie.num_processed) != insn.len() {
        return Err(fail(mismatch(format!(
            "a {}-byte instruction",
            vie.num_processed
        ))));
    }
    let op = mmio_op(&insn).map_err(|why| fail(why.into()))?;
    cross_check(vie, &insn, op).map_err(fail)?;
    Ok(op)
}

/// 64 in long mode, else the default operand size of CS (CS.D).
fn bitness(e: &InstEmul) -> u32 {
    if e.paging.cpu_mode == CPU_MODE_64BIT {
        64
    } else if e.cs_d {
        32
    } else {
        16
    }
}

/// The instruction in Intel syntax. RIP-relative operands stay relative: the decoder does
/// not know the instruction's address.
fn disassemble(insn: &Instruction) -> String {
    let mut formatter = IntelFormatter::new();
    formatter.options_mut().set_rip_relative_addresses(true);
    let mut text = String::new();
    formatter.format(insn, &mut text);
    text
}

fn hex(bytes: &[u8]) -> String {
    let text: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    text.join(" ")
}

fn mismatch(what: String) -> String {
    format!("the kernel decoded {what} (struct vie layout or CPU mode mismatch?)")
}

/// The access a MOV, MOVZX or MOVSX with one memory operand makes.
fn mmio_op(insn: &Instruction) -> Result<MmioOp, &'static str> {
    let extend = match insn.mnemonic() {
        Mnemonic::Mov | Mnemonic::Movzx => Extend::Zero,
        Mnemonic::Movsx => Extend::Sign,
        _ => {
            return Err(
                "only MOV, MOVZX and MOVSX are emulated for user-space devices \
                        (no read-modify-write or string instructions)",
            )
        }
    };
    let size = insn.memory_size().size() as u8;
    if !matches!(size, 1 | 2 | 4 | 8) {
        return Err("no memory operand of 1, 2, 4 or 8 bytes");
    }
    let not_gpr = "the register operand is not a general-purpose register";
    match (insn.op0_kind(), insn.op1_kind()) {
        (OpKind::Register, OpKind::Memory) => {
            let (reg, high) = gpr(insn.op0_register()).ok_or(not_gpr)?;
            let dest = match insn.op0_register().size() as u8 {
                1 => Dest::Byte { reg, high },
                size => Dest::Gpr { reg, size },
            };
            Ok(MmioOp::Read { size, extend, dest })
        }
        (OpKind::Memory, OpKind::Register) => {
            let (reg, high) = gpr(insn.op1_register()).ok_or(not_gpr)?;
            let source = match size {
                1 => Source::Byte { reg, high },
                _ => Source::Gpr { reg },
            };
            Ok(MmioOp::Write { size, source })
        }
        // iced sign-extends imm32 to 64 bits for `mov r/m64, imm32`, as the CPU does.
        (OpKind::Memory, _) if insn.op_count() == 2 => Ok(MmioOp::Write {
            size,
            source: Source::Imm(insn.immediate(1) & mask(size)),
        }),
        _ => Err("not a move between memory and a register or an immediate"),
    }
}

/// bhyve's register number for a general-purpose register of iced's, and whether it is
/// one of AH..BH (the second byte of RAX..RBX).
fn gpr(r: Register) -> Option<(i32, bool)> {
    if !r.is_gpr() {
        return None;
    }
    let high = matches!(r, Register::AH | Register::CH | Register::DH | Register::BH);
    let n = r.full_register().number();
    Some((reg::GPR_BY_MODRM[n], high))
}

fn mask(size: u8) -> u64 {
    if size >= 8 {
        u64::MAX
    } else {
        (1u64 << (8 * u32::from(size))) - 1
    }
}

/// Compares the kernel's decode with iced's: they differ only if `struct vie` was read
/// at the wrong offsets or the bitness is wrong.
fn cross_check(vie: &Vie, insn: &Instruction, op: MmioOp) -> Result<(), String> {
    let Some(opcode) = opcode_byte(insn.code()) else {
        return Err(format!("iced code {:?} has no known opcode", insn.code()));
    };
    if vie.op_byte != opcode {
        return Err(mismatch(format!("opcode {:#04x}", vie.op_byte)));
    }
    // ModRM.reg (with REX.R): the register operand, or /0 for the immediate forms (whose
    // REX.R is ignored); moffs forms have no ModRM.
    let reg_ok = match (opcode, op) {
        (0xa0..=0xa3, _) => true,
        (0xc6 | 0xc7, _) => vie.reg & 7 == 0,
        (_, MmioOp::Read { .. }) => Some(vie.reg) == modrm_reg(insn.op0_register()),
        (_, MmioOp::Write { .. }) => Some(vie.reg) == modrm_reg(insn.op1_register()),
    };
    if !reg_ok {
        return Err(mismatch(format!("ModRM.reg {}", vie.reg)));
    }
    // The kernel's opsize is the prefix-selected size, which byte forms do not use.
    let opsize = match op {
        MmioOp::Read {
            dest: Dest::Gpr { size, .. },
            ..
        } => Some(size),
        MmioOp::Write { size, .. } if size > 1 => Some(size),
        _ => None,
    };
    if opsize.is_some_and(|size| size != vie.opsize) {
        return Err(mismatch(format!("operand size {}", vie.opsize)));
    }
    if let MmioOp::Write {
        size,
        source: Source::Imm(imm),
    } = op
    {
        if vie.immediate as u64 & mask(size) != imm {
            return Err(mismatch(format!("immediate {:#x}", vie.immediate)));
        }
    }
    Ok(())
}

/// ModRM.reg as the kernel reports it: 4..7 for AH..BH, else the register's number.
fn modrm_reg(r: Register) -> Option<u8> {
    let (_, high) = gpr(r)?;
    let n = r.full_register().number() as u8;
    Some(if high { n + 4 } else { n })
}

/// The opcode byte the kernel reports in `vie.op_byte` (the one after 0F for two-byte
/// opcodes) for each form `mmio_op` accepts. Only the cross-check uses it; iced's own
/// opcode tables need its `op_code_info` feature.
fn opcode_byte(code: Code) -> Option<u8> {
    use Code::*;
    Some(match code {
        Mov_rm8_r8 => 0x88,
        Mov_rm16_r16 | Mov_rm32_r32 | Mov_rm64_r64 => 0x89,
        Mov_r8_rm8 => 0x8a,
        Mov_r16_rm16 | Mov_r32_rm32 | Mov_r64_rm64 => 0x8b,
        Mov_AL_moffs8 => 0xa0,
        Mov_AX_moffs16 | Mov_EAX_moffs32 | Mov_RAX_moffs64 => 0xa1,
        Mov_moffs8_AL => 0xa2,
        Mov_moffs16_AX | Mov_moffs32_EAX | Mov_moffs64_RAX => 0xa3,
        Mov_rm8_imm8 => 0xc6,
        Mov_rm16_imm16 | Mov_rm32_imm32 | Mov_rm64_imm32 => 0xc7,
        Movzx_r16_rm8 | Movzx_r32_rm8 | Movzx_r64_rm8 => 0xb6,
        Movzx_r16_rm16 | Movzx_r32_rm16 | Movzx_r64_rm16 => 0xb7,
        Movsx_r16_rm8 | Movsx_r32_rm8 | Movsx_r64_rm8 => 0xbe,
        Movsx_r16_rm16 | Movsx_r32_rm16 | Movsx_r64_rm16 => 0xbf,
        _ => return None,
    })
}

/// The value of a read of `size` bytes (little-endian) extended as asked.
pub fn extend_value(data: &[u8], extend: Extend) -> u64 {
    let mut raw = [0u8; 8];
    let n = data.len().min(8);
    raw[..n].copy_from_slice(&data[..n]);
    let value = u64::from_le_bytes(raw);
    match (extend, n) {
        (Extend::Sign, 1) => value as u8 as i8 as i64 as u64,
        (Extend::Sign, 2) => value as u16 as i16 as i64 as u64,
        (Extend::Sign, 4) => value as u32 as i32 as i64 as u64,
        _ => value,
    }
}

/// A register written with an operand of `size` bytes: 1 and 2 merge into `old`, 4
/// zero-extends, 8 replaces (the x86-64 rules; bhyve's `vie_update_register`).
pub fn merge_register(old: u64, value: u64, size: u8) -> u64 {
    match size {
        1 => (old & !0xff) | (value & 0xff),
        2 => (old & !0xffff) | (value & 0xffff),
        4 => value & 0xffff_ffff,
        _ => value,
    }
}

/// A byte register written: the low byte, or the second byte for AH..BH.
pub fn merge_byte_register(old: u64, value: u8, high: bool) -> u64 {
    if high {
        (old & !0xff00) | (u64::from(value) << 8)
    } else {
        (old & !0xff) | u64::from(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bhyve::abi::{CPU_MODE_64BIT, CPU_MODE_PROTECTED, CPU_MODE_REAL};
    use crate::bhyve::exit::{build, decode, Exit};

    /// An INST_EMUL exit for `inst` with the kernel's decode, the way vmm.ko reports it:
    /// 15 bytes fetched, `num_processed` the instruction's length.
    fn exit(inst: &[u8], op_byte: u8, opsize: u8, reg: u8, imm: i64, mode: i32) -> InstEmul {
        // `rex_present` is not read: iced tells a REX prefix from INC/DEC itself.
        let b = build::inst_emul(0xfeb0_0000, inst, op_byte, opsize, reg, false, imm, mode, 0);
        let Exit::InstEmul(mut e) = decode(&b).exit else {
            panic!()
        };
        // What follows the instruction in guest memory.
        e.vie.inst[inst.len()..].fill(0x8b);
        e.vie.num_valid = 15;
        e
    }

    fn op(inst: &[u8], op_byte: u8, opsize: u8, reg: u8, imm: i64, mode: i32) -> MmioOp {
        let e = exit(inst, op_byte, opsize, reg, imm, mode);
        decode_mmio(&e).unwrap_or_else(|err| panic!("{inst:02x?}: {}", err.0))
    }

    fn refused(e: &InstEmul) -> String {
        decode_mmio(e).unwrap_err().0
    }

    fn read(size: u8, extend: Extend, dest: Dest) -> MmioOp {
        MmioOp::Read { size, extend, dest }
    }

    fn gpr(reg: i32, size: u8) -> Dest {
        Dest::Gpr { reg, size }
    }

    fn write(size: u8, source: Source) -> MmioOp {
        MmioOp::Write { size, source }
    }

    const LONG: i32 = CPU_MODE_64BIT;

    #[test]
    fn moves_to_and_from_mmio() {
        use super::Extend::{Sign, Zero};
        // mov eax, [rdi]
        let r = op(&[0x8b, 0x07], 0x8b, 4, 0, 0, LONG);
        assert_eq!(r, read(4, Zero, gpr(reg::RAX, 4)));
        // mov [rdi], r10 (REX.W REX.R, reg 2 | 8)
        let w = op(&[0x4c, 0x89, 0x17], 0x89, 8, 10, 0, LONG);
        assert_eq!(w, write(8, Source::Gpr { reg: reg::R10 }));
        // mov [rdi], ah (reg 4 without REX = AH)
        let w = op(&[0x88, 0x27], 0x88, 4, 4, 0, LONG);
        let ah = Source::Byte {
            reg: reg::RAX,
            high: true,
        };
        assert_eq!(w, write(1, ah));
        // mov spl, [rdi] (reg 4 with REX = SPL)
        let r = op(&[0x40, 0x8a, 0x27], 0x8a, 4, 4, 0, LONG);
        let spl = Dest::Byte {
            reg: reg::RSP,
            high: false,
        };
        assert_eq!(r, read(1, Zero, spl));
        // mov dword [rdi], 0x12345678
        let inst = [0xc7, 0x07, 0x78, 0x56, 0x34, 0x12];
        let w = op(&inst, 0xc7, 4, 0, 0x1234_5678, LONG);
        assert_eq!(w, write(4, Source::Imm(0x1234_5678)));
        // movzx ecx, word [rdi]
        let r = op(&[0x0f, 0xb7, 0x0f], 0xb7, 4, 1, 0, LONG);
        assert_eq!(r, read(2, Zero, gpr(reg::RCX, 4)));
        // movsx edx, byte [ebx] in 32-bit mode
        let r = op(&[0x0f, 0xbe, 0x13], 0xbe, 4, 2, 0, CPU_MODE_PROTECTED);
        assert_eq!(r, read(1, Sign, gpr(reg::RDX, 4)));
        // movsx rax, word [rsi]
        let r = op(&[0x48, 0x0f, 0xbf, 0x06], 0xbf, 8, 0, 0, LONG);
        assert_eq!(r, read(2, Sign, gpr(reg::RAX, 8)));
        // mov eax, [moffs32]
        let r = op(&[0xa1, 0, 0, 0xb0, 0xfe], 0xa1, 4, 0, 0, CPU_MODE_PROTECTED);
        assert_eq!(r, read(4, Zero, gpr(reg::RAX, 4)));
        // mov [moffs32], eax
        let w = op(&[0xa3, 0, 0, 0xb0, 0xfe], 0xa3, 4, 0, 0, CPU_MODE_PROTECTED);
        assert_eq!(w, write(4, Source::Gpr { reg: reg::RAX }));
    }

    #[test]
    fn prefixes_rex_and_immediates() {
        use super::Extend::Zero;
        // mov eax, fs:[rdi]: a segment override
        let r = op(&[0x64, 0x8b, 0x07], 0x8b, 4, 0, 0, LONG);
        assert_eq!(r, read(4, Zero, gpr(reg::RAX, 4)));
        // mov [edi], ecx: an address-size override
        let w = op(&[0x67, 0x89, 0x0f], 0x89, 4, 1, 0, LONG);
        assert_eq!(w, write(4, Source::Gpr { reg: reg::RCX }));
        // mov [rdi], cx: an operand-size override
        let w = op(&[0x66, 0x89, 0x0f], 0x89, 2, 1, 0, LONG);
        assert_eq!(w, write(2, Source::Gpr { reg: reg::RCX }));
        // mov r9b, [rdi]: REX.R names R9B
        let r = op(&[0x44, 0x8a, 0x0f], 0x8a, 4, 9, 0, LONG);
        let r9b = Dest::Byte {
            reg: reg::R9,
            high: false,
        };
        assert_eq!(r, read(1, Zero, r9b));
        // mov [r12], r15b: REX.R and REX.B (base R12 through a SIB byte)
        let w = op(&[0x45, 0x88, 0x3c, 0x24], 0x88, 4, 15, 0, LONG);
        let r15b = Source::Byte {
            reg: reg::R15,
            high: false,
        };
        assert_eq!(w, write(1, r15b));
        // mov [r8], sil: REX.B alone makes reg 6 SIL, not DH
        let w = op(&[0x41, 0x88, 0x30], 0x88, 4, 6, 0, LONG);
        let sil = Source::Byte {
            reg: reg::RSI,
            high: false,
        };
        assert_eq!(w, write(1, sil));
        // mov byte ptr [rax], 0x12
        let w = op(&[0xc6, 0x00, 0x12], 0xc6, 4, 0, 0x12, LONG);
        assert_eq!(w, write(1, Source::Imm(0x12)));
        // mov word ptr [rdi], 0x8234
        let w = op(&[0x66, 0xc7, 0x07, 0x34, 0x82], 0xc7, 2, 0, -0x7dcc, LONG);
        assert_eq!(w, write(2, Source::Imm(0x8234)));
        // mov qword ptr [rdi], -1: imm32 sign-extended to 64 bits
        let inst = [0x48, 0xc7, 0x07, 0xff, 0xff, 0xff, 0xff];
        let w = op(&inst, 0xc7, 8, 0, -1, LONG);
        assert_eq!(w, write(8, Source::Imm(u64::MAX)));
        // mov rax, [moffs64]
        let inst = [0x48, 0xa1, 0, 0, 0xb0, 0xfe, 0, 0, 0, 0];
        let r = op(&inst, 0xa1, 8, 0, 0, LONG);
        assert_eq!(r, read(8, Zero, gpr(reg::RAX, 8)));
    }

    #[test]
    fn sixteen_bit_code_follows_cs_d() {
        use super::Extend::Zero;
        // 8b 07 is mov ax, [bx] when CS.D is clear, and 66 8b 07 is mov eax, [bx].
        let mut e = exit(&[0x8b, 0x07], 0x8b, 2, 0, 0, CPU_MODE_REAL);
        e.cs_d = false;
        assert_eq!(decode_mmio(&e), Ok(read(2, Zero, gpr(reg::RAX, 2))));
        let mut e = exit(&[0x66, 0x8b, 0x07], 0x8b, 4, 0, 0, CPU_MODE_REAL);
        e.cs_d = false;
        assert_eq!(decode_mmio(&e), Ok(read(4, Zero, gpr(reg::RAX, 4))));
        // With CS.D set the same bytes are 32-bit.
        let r = op(&[0x8b, 0x07], 0x8b, 4, 0, 0, CPU_MODE_PROTECTED);
        assert_eq!(r, read(4, Zero, gpr(reg::RAX, 4)));
    }

    #[test]
    fn refusals_name_the_instruction() {
        // and [rdi], eax: read-modify-write
        let err = refused(&exit(&[0x21, 0x07], 0x21, 4, 0, 0, LONG));
        assert!(err.contains("only MOV"), "{err}");
        assert!(err.contains("`and [rdi],eax` (21 07)"), "{err}");
        // rep movsd: a string move
        let err = refused(&exit(&[0xf3, 0xa5], 0xa5, 4, 0, 0, LONG));
        assert!(err.contains("only MOV") && err.contains("movsd"), "{err}");
        // mov ds, [rax]: no general-purpose register
        let err = refused(&exit(&[0x8e, 0x18], 0x8e, 4, 3, 0, LONG));
        assert!(err.contains("general-purpose"), "{err}");
        // The kernel could not decode it (RIP was not advanced).
        let mut e = exit(&[0x8b, 0x07], 0x8b, 4, 0, 0, LONG);
        e.vie.decoded = false;
        let err = refused(&e);
        assert!(err.contains("could not decode") && err.contains("mov eax,[rdi]"));
        // Bytes cut short.
        let mut e = exit(&[0x8b, 0x07], 0x8b, 4, 0, 0, LONG);
        e.vie.num_valid = 1;
        assert!(refused(&e).contains("truncated"), "{}", refused(&e));
    }

    #[test]
    fn a_kernel_decode_that_differs_is_a_layout_mismatch() {
        let drift = |e: &InstEmul, what: &str| {
            let err = refused(e);
            assert!(err.contains(what) && err.contains("layout"), "{err}");
        };
        // ModRM.reg
        drift(&exit(&[0x8b, 0x07], 0x8b, 4, 3, 0, LONG), "ModRM.reg 3");
        // AH is ModRM.reg 4, not 0.
        drift(&exit(&[0x88, 0x27], 0x88, 4, 0, 0, LONG), "ModRM.reg 0");
        // opcode
        drift(&exit(&[0x8b, 0x07], 0x89, 4, 0, 0, LONG), "opcode 0x89");
        // operand size
        drift(
            &exit(&[0x48, 0x8b, 0x07], 0x8b, 4, 0, 0, LONG),
            "operand size 4",
        );
        // immediate
        let inst = [0xc6, 0x00, 0x12];
        drift(&exit(&inst, 0xc6, 4, 0, 0x34, LONG), "immediate 0x34");
        // 0x41 is a REX prefix in 64-bit mode but INC ECX in 32-bit mode.
        let e = exit(&[0x41, 0x8b, 0x07], 0x8b, 4, 0, 0, CPU_MODE_PROTECTED);
        drift(&e, "3-byte instruction");
    }

    #[test]
    fn register_merging_follows_x86_64() {
        let old = 0x1111_2222_3333_4444;
        assert_eq!(merge_register(old, 0xab, 1), 0x1111_2222_3333_44ab);
        assert_eq!(merge_register(old, 0xabcd, 2), 0x1111_2222_3333_abcd);
        assert_eq!(merge_register(old, 0xdead_beef, 4), 0xdead_beef);
        assert_eq!(merge_register(old, 7, 8), 7);
        assert_eq!(merge_byte_register(old, 0x99, true), 0x1111_2222_3333_9944);
        assert_eq!(merge_byte_register(old, 0x99, false), 0x1111_2222_3333_4499);
        assert_eq!(extend_value(&[0x80], Extend::Sign), 0xffff_ffff_ffff_ff80);
        assert_eq!(extend_value(&[0x80], Extend::Zero), 0x80);
        assert_eq!(
            extend_value(&[0x00, 0x80], Extend::Sign),
            0xffff_ffff_ffff_8000
        );
    }
}
