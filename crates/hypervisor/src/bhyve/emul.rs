//! MMIO instructions the kernel decoded (`VM_EXITCODE_INST_EMUL`), turned into one read or
//! one write of a user-space device plus the register update that completes it.
//!
//! vmm.ko emulates accesses to its own devices (LAPIC, IOAPIC, HPET) and hands every other
//! access to a non-RAM address to user space with the instruction already fetched and
//! decoded into `struct vie`. User space performs the access and writes the destination
//! register with VM_SET_REGISTER; RIP is already past the instruction. Supported here are
//! the moves a driver uses for device registers: MOV (88, 89, 8A, 8B, A1, A3, C6, C7),
//! MOVZX (0F B6, 0F B7) and MOVSX (0F BE, 0F BF). Read-modify-write instructions (AND, OR,
//! TEST, BT, ...) and string moves to MMIO are refused with a clear error.
//!
//! The operand size, ModRM.reg (with REX.R) and the immediate come from the kernel's
//! decode; the opcode is identified from the raw bytes as well (the kernel's private
//! `op_type` numbering changes between releases and is not used), and ModRM.reg is
//! cross-checked against the raw ModRM byte, so a drift of the `struct vie` bit-field
//! layout is caught instead of silently writing the wrong register.

use super::abi::reg;
use super::exit::InstEmul;

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

const LEGACY_PREFIXES: [u8; 11] = [
    0x66, 0x67, 0xf0, 0xf2, 0xf3, 0x2e, 0x36, 0x3e, 0x26, 0x64, 0x65,
];

/// Opcode (one byte, or 0x0f plus one) and the ModRM byte of `bytes`.
fn opcode_and_modrm(bytes: &[u8], long_mode: bool) -> Option<(bool, u8, Option<u8>)> {
    let mut i = 0;
    while i < bytes.len() && LEGACY_PREFIXES.contains(&bytes[i]) {
        i += 1;
    }
    if long_mode && i < bytes.len() && bytes[i] & 0xf0 == 0x40 {
        i += 1; // REX
    }
    let first = *bytes.get(i)?;
    let (two_byte, op, next) = if first == 0x0f {
        (true, *bytes.get(i + 1)?, i + 2)
    } else {
        (false, first, i + 1)
    };
    Some((two_byte, op, bytes.get(next).copied()))
}

fn byte_reg(modrm_reg: u8, rex_present: bool) -> (i32, bool) {
    // Without REX, ModRM.reg 4..7 name AH, CH, DH, BH: the second byte of RAX..RBX.
    if !rex_present && (4..8).contains(&modrm_reg) {
        (reg::GPR_BY_MODRM[usize::from(modrm_reg - 4)], true)
    } else {
        (reg::GPR_BY_MODRM[usize::from(modrm_reg & 0xf)], false)
    }
}

/// Decides what an INST_EMUL exit asks for.
pub fn decode_mmio(e: &InstEmul) -> Result<MmioOp, Unemulated> {
    let vie = &e.vie;
    let bytes = vie.bytes();
    let fail = |why: &str| {
        Err(Unemulated(format!(
            "MMIO access at GPA {:#x} by instruction {:02x?}: {why}",
            e.gpa, bytes
        )))
    };
    if !vie.decoded {
        return fail("the kernel could not decode it");
    }
    let long_mode = e.paging.cpu_mode == super::abi::CPU_MODE_64BIT;
    let Some((two_byte, op, modrm)) = opcode_and_modrm(bytes, long_mode) else {
        return fail("truncated instruction");
    };
    if op != vie.op_byte {
        return fail(&format!(
            "the kernel decoded opcode {:#04x} (struct vie layout mismatch?)",
            vie.op_byte
        ));
    }
    let needs_modrm = !matches!((two_byte, op), (false, 0xa1 | 0xa3));
    if needs_modrm {
        let Some(modrm) = modrm else {
            return fail("no ModRM byte");
        };
        let raw_reg = (modrm >> 3) & 7;
        let is_group = matches!((two_byte, op), (false, 0xc6 | 0xc7));
        if !is_group && raw_reg != vie.reg & 7 {
            return fail(&format!(
                "the kernel decoded ModRM.reg {} (struct vie layout mismatch?)",
                vie.reg
            ));
        }
        if is_group && raw_reg != 0 {
            return fail("not a MOV (group 11 /0)");
        }
    }
    let opsize = vie.opsize;
    if !matches!(opsize, 1 | 2 | 4 | 8) {
        return fail(&format!("operand size {opsize}"));
    }
    let gpr = reg::GPR_BY_MODRM[usize::from(vie.reg & 0xf)];
    let (byte_r, high) = byte_reg(vie.reg & 0xf, vie.rex_present);
    let mask = |size: u8| -> u64 {
        if size >= 8 {
            u64::MAX
        } else {
            (1u64 << (8 * u32::from(size))) - 1
        }
    };
    Ok(match (two_byte, op) {
        (false, 0x88) => MmioOp::Write {
            size: 1,
            source: Source::Byte { reg: byte_r, high },
        },
        (false, 0x89) => MmioOp::Write {
            size: opsize,
            source: Source::Gpr { reg: gpr },
        },
        (false, 0x8a) => MmioOp::Read {
            size: 1,
            extend: Extend::Zero,
            dest: Dest::Byte { reg: byte_r, high },
        },
        (false, 0x8b) => MmioOp::Read {
            size: opsize,
            extend: Extend::Zero,
            dest: Dest::Gpr {
                reg: gpr,
                size: opsize,
            },
        },
        (false, 0xa1) => MmioOp::Read {
            size: opsize,
            extend: Extend::Zero,
            dest: Dest::Gpr {
                reg: reg::RAX,
                size: opsize,
            },
        },
        (false, 0xa3) => MmioOp::Write {
            size: opsize,
            source: Source::Gpr { reg: reg::RAX },
        },
        (false, 0xc6) => MmioOp::Write {
            size: 1,
            source: Source::Imm(vie.immediate as u64 & 0xff),
        },
        (false, 0xc7) => MmioOp::Write {
            size: opsize,
            source: Source::Imm(vie.immediate as u64 & mask(opsize)),
        },
        (true, 0xb6 | 0xbe) => MmioOp::Read {
            size: 1,
            extend: if op == 0xb6 {
                Extend::Zero
            } else {
                Extend::Sign
            },
            dest: Dest::Gpr {
                reg: gpr,
                size: opsize,
            },
        },
        (true, 0xb7 | 0xbf) => MmioOp::Read {
            size: 2,
            extend: if op == 0xb7 {
                Extend::Zero
            } else {
                Extend::Sign
            },
            dest: Dest::Gpr {
                reg: gpr,
                size: opsize,
            },
        },
        _ => return fail("only MOV, MOVZX and MOVSX are emulated for user-space devices"),
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
    use crate::bhyve::abi::{CPU_MODE_64BIT, CPU_MODE_PROTECTED};
    use crate::bhyve::exit::{build, decode, Exit};

    #[allow(clippy::too_many_arguments)]
    fn op(
        inst: &[u8],
        op_byte: u8,
        opsize: u8,
        reg: u8,
        rex: bool,
        imm: i64,
        mode: i32,
    ) -> Result<MmioOp, Unemulated> {
        let b = build::inst_emul(0xfeb0_0000, inst, op_byte, opsize, reg, rex, imm, mode, 0);
        let Exit::InstEmul(e) = decode(&b).exit else {
            panic!()
        };
        decode_mmio(&e)
    }

    #[test]
    fn moves_to_and_from_mmio() {
        // mov eax, [rdi] = 8b 07
        assert_eq!(
            op(&[0x8b, 0x07], 0x8b, 4, 0, false, 0, CPU_MODE_64BIT),
            Ok(MmioOp::Read {
                size: 4,
                extend: Extend::Zero,
                dest: Dest::Gpr {
                    reg: reg::RAX,
                    size: 4
                }
            })
        );
        // mov [rdi], r10 = 4c 89 17 (REX.W REX.R, reg 2 | 8)
        assert_eq!(
            op(&[0x4c, 0x89, 0x17], 0x89, 8, 10, true, 0, CPU_MODE_64BIT),
            Ok(MmioOp::Write {
                size: 8,
                source: Source::Gpr { reg: reg::R10 }
            })
        );
        // mov [rdi], ah = 88 27 (reg 4 without REX = AH)
        assert_eq!(
            op(&[0x88, 0x27], 0x88, 4, 4, false, 0, CPU_MODE_64BIT),
            Ok(MmioOp::Write {
                size: 1,
                source: Source::Byte {
                    reg: reg::RAX,
                    high: true
                }
            })
        );
        // mov spl, [rdi] = 40 8a 27 (reg 4 with REX = SPL)
        assert_eq!(
            op(&[0x40, 0x8a, 0x27], 0x8a, 4, 4, true, 0, CPU_MODE_64BIT),
            Ok(MmioOp::Read {
                size: 1,
                extend: Extend::Zero,
                dest: Dest::Byte {
                    reg: reg::RSP,
                    high: false
                }
            })
        );
        // mov dword [rdi], 0x12345678 = c7 07 78 56 34 12
        assert_eq!(
            op(
                &[0xc7, 0x07, 0x78, 0x56, 0x34, 0x12],
                0xc7,
                4,
                0,
                false,
                0x1234_5678,
                CPU_MODE_64BIT
            ),
            Ok(MmioOp::Write {
                size: 4,
                source: Source::Imm(0x1234_5678)
            })
        );
        // movzx ecx, word [rdi] = 0f b7 0f
        assert_eq!(
            op(&[0x0f, 0xb7, 0x0f], 0xb7, 4, 1, false, 0, CPU_MODE_64BIT),
            Ok(MmioOp::Read {
                size: 2,
                extend: Extend::Zero,
                dest: Dest::Gpr {
                    reg: reg::RCX,
                    size: 4
                }
            })
        );
        // movsx edx, byte [ebx] in 32-bit mode = 0f be 13
        assert_eq!(
            op(
                &[0x0f, 0xbe, 0x13],
                0xbe,
                4,
                2,
                false,
                0,
                CPU_MODE_PROTECTED
            ),
            Ok(MmioOp::Read {
                size: 1,
                extend: Extend::Sign,
                dest: Dest::Gpr {
                    reg: reg::RDX,
                    size: 4
                }
            })
        );
        // mov eax, [moffs32] = a1 00 00 b0 fe
        assert!(matches!(
            op(
                &[0xa1, 0, 0, 0xb0, 0xfe],
                0xa1,
                4,
                0,
                false,
                0,
                CPU_MODE_PROTECTED
            ),
            Ok(MmioOp::Read {
                dest: Dest::Gpr { reg: reg::RAX, .. },
                ..
            })
        ));
    }

    #[test]
    fn refusals() {
        // and [rdi], eax = 21 07
        let err = op(&[0x21, 0x07], 0x21, 4, 0, false, 0, CPU_MODE_64BIT).unwrap_err();
        assert!(err.0.contains("only MOV"), "{}", err.0);
        // A kernel reporting a different ModRM.reg than the bytes say: layout drift.
        let err = op(&[0x8b, 0x07], 0x8b, 4, 3, false, 0, CPU_MODE_64BIT).unwrap_err();
        assert!(err.0.contains("layout mismatch"), "{}", err.0);
        // 0x41 is a REX prefix in 64-bit mode but INC ECX in 32-bit mode.
        let err = op(
            &[0x41, 0x8b, 0x07],
            0x8b,
            4,
            0,
            false,
            0,
            CPU_MODE_PROTECTED,
        )
        .unwrap_err();
        assert!(err.0.contains("opcode"), "{}", err.0);
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
