//! Breakpoints, bit counts, byte-swapping moves, random numbers, the wide compare-exchanges
//! and the small system instructions kernels use in ring 0.

use iced_x86::{Instruction, Mnemonic, OpKind};

use crate::context::{flags, width_mask, Context};
use crate::{Exception, Failure, Outcome, Step};

/// IA32_TSC_AUX, which RDPID reads.
const TSC_AUX: u32 = 0xc000_0103;

pub fn execute(ctx: &mut Context, insn: &Instruction) -> Option<Step> {
    let step = match insn.mnemonic() {
        Mnemonic::Int3 => trap(3),
        Mnemonic::Int1 => trap(1),
        Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2 => Ok(Outcome::Exception(Exception::UD)),
        Mnemonic::Popcnt | Mnemonic::Lzcnt | Mnemonic::Tzcnt => bit_count(ctx, insn),
        Mnemonic::Movbe => movbe(ctx, insn),
        Mnemonic::Rdrand | Mnemonic::Rdseed => random(ctx, insn),
        Mnemonic::Rdpid => rdpid(ctx, insn),
        Mnemonic::Cmpxchg16b | Mnemonic::Cmpxchg8b => cmpxchg_wide(ctx, insn),
        Mnemonic::Stac => flag(ctx, flags::AC, true),
        Mnemonic::Clac => flag(ctx, flags::AC, false),
        Mnemonic::Rdfsbase | Mnemonic::Rdgsbase | Mnemonic::Wrfsbase | Mnemonic::Wrgsbase => {
            fs_gs_base(ctx, insn)
        }
        // Caches are coherent for a VMM's guest: write-backs and fences have nothing to do
        // once the instruction is out of the emulator's way.
        Mnemonic::Clflush
        | Mnemonic::Clflushopt
        | Mnemonic::Clwb
        | Mnemonic::Lfence
        | Mnemonic::Sfence
        | Mnemonic::Mfence
        | Mnemonic::Pause
        | Mnemonic::Prefetchw
        | Mnemonic::Prefetcht0
        | Mnemonic::Prefetcht1
        | Mnemonic::Prefetcht2
        | Mnemonic::Prefetchnta => Ok(Outcome::Done),
        _ => return None,
    };
    Some(step)
}

fn trap(vector: u8) -> Step {
    Ok(Outcome::Exception(Exception {
        vector,
        error_code: None,
        trap: true,
        cr2: None,
    }))
}

/// Turns an exception met while reading or writing an operand into the instruction's outcome.
macro_rules! attempt {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(exception) => return Ok(Outcome::Exception(exception)),
        }
    };
}

fn bit_count(ctx: &mut Context, insn: &Instruction) -> Step {
    let size = insn.op_register(0).size();
    let bits = (size * 8) as u32;
    let src = attempt!(ctx.read_operand(insn, 1, size)) & width_mask(size);
    let (result, cf) = match insn.mnemonic() {
        Mnemonic::Popcnt => (u64::from(src.count_ones()), false),
        Mnemonic::Lzcnt => (u64::from(src.leading_zeros() - (64 - bits)), src == 0),
        _ => (u64::from(src.trailing_zeros().min(bits)), src == 0),
    };
    ctx.set_gpr(insn.op_register(0), result);
    let zf = if insn.mnemonic() == Mnemonic::Popcnt {
        src == 0
    } else {
        result == 0
    };
    let mut set = 0;
    if zf {
        set |= flags::ZF;
    }
    if cf {
        set |= flags::CF;
    }
    ctx.set_flags(flags::ARITHMETIC, set);
    Ok(Outcome::Done)
}

fn movbe(ctx: &mut Context, insn: &Instruction) -> Step {
    // MOVBE r, m or MOVBE m, r: the source is operand 1 either way.
    let size = if insn.op_kind(0) == OpKind::Register {
        insn.op_register(0).size()
    } else {
        insn.op_register(1).size()
    };
    let value = attempt!(ctx.read_operand(insn, 1, size));
    let swapped = value.swap_bytes() >> (64 - 8 * size as u32);
    attempt!(ctx.write_operand(insn, 0, size, swapped));
    Ok(Outcome::Done)
}

/// RDRAND and RDSEED from the host's random source; CF=1 says the value is valid.
fn random(ctx: &mut Context, insn: &Instruction) -> Step {
    let mut raw = [0u8; 8];
    let ok = getrandom(&mut raw);
    let size = insn.op_register(0).size();
    let value = if ok { u64::from_le_bytes(raw) } else { 0 };
    ctx.set_gpr(insn.op_register(0), value & width_mask(size));
    ctx.set_flags(flags::ARITHMETIC, if ok { flags::CF } else { 0 });
    Ok(Outcome::Done)
}

fn getrandom(buf: &mut [u8]) -> bool {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    n == buf.len() as isize
}

fn rdpid(ctx: &mut Context, insn: &Instruction) -> Step {
    let aux = ctx
        .vcpu
        .msrs(&[TSC_AUX])?
        .first()
        .map(|m| m.data)
        .ok_or_else(|| Failure::Unsupported("IA32_TSC_AUX cannot be read".into()))?;
    ctx.set_gpr(insn.op_register(0), aux);
    Ok(Outcome::Done)
}

/// CMPXCHG16B m128 / CMPXCHG8B m64: compare rDX:rAX with memory; equal: store rCX:rBX and
/// set ZF; else load memory into rDX:rAX and clear ZF. The memory operand is always written
/// (as the locked processor cycle does), so a read-only page faults either way.
fn cmpxchg_wide(ctx: &mut Context, insn: &Instruction) -> Step {
    let wide = insn.mnemonic() == Mnemonic::Cmpxchg16b;
    let half = if wide { 8 } else { 4 };
    let addr = ctx.memory_address(insn);
    if wide && !addr.is_multiple_of(16) {
        return Ok(Outcome::Exception(Exception::GP0));
    }
    let mut old = [0u8; 16];
    attempt!(ctx.read(addr, &mut old[..2 * half]));
    let mask = width_mask(half);
    let word = |at: usize| {
        let mut raw = [0u8; 8];
        raw[..half].copy_from_slice(&old[at..at + half]);
        u64::from_le_bytes(raw)
    };
    let (lo, hi) = (word(0), word(half));
    let r = ctx.regs;
    let equal = lo == r.rax & mask && hi == r.rdx & mask;
    let (new_lo, new_hi) = if equal {
        (r.rbx & mask, r.rcx & mask)
    } else {
        (lo, hi)
    };
    let mut out = [0u8; 16];
    out[..half].copy_from_slice(&new_lo.to_le_bytes()[..half]);
    out[half..2 * half].copy_from_slice(&new_hi.to_le_bytes()[..half]);
    attempt!(ctx.write(addr, &out[..2 * half]));
    if !equal {
        // 32-bit register writes zero-extend, as in the processor.
        ctx.regs.rax = lo;
        ctx.regs.rdx = hi;
    }
    ctx.set_flags(flags::ZF, if equal { flags::ZF } else { 0 });
    Ok(Outcome::Done)
}

fn flag(ctx: &mut Context, bit: u64, on: bool) -> Step {
    if ctx.cpl() != 0 {
        return Ok(Outcome::Exception(Exception::UD));
    }
    ctx.set_flags(bit, if on { bit } else { 0 });
    Ok(Outcome::Done)
}

fn fs_gs_base(ctx: &mut Context, insn: &Instruction) -> Step {
    let reg = insn.op_register(0);
    let fs = matches!(insn.mnemonic(), Mnemonic::Rdfsbase | Mnemonic::Wrfsbase);
    let read = matches!(insn.mnemonic(), Mnemonic::Rdfsbase | Mnemonic::Rdgsbase);
    if read {
        let base = if fs {
            ctx.sregs.fs.base
        } else {
            ctx.sregs.gs.base
        };
        ctx.set_gpr(reg, base);
        return Ok(Outcome::Done);
    }
    let value = ctx.gpr(reg);
    // A 64-bit base must be canonical.
    if reg.size() == 8 && ((value as i64) << 16 >> 16) as u64 != value {
        return Ok(Outcome::Exception(Exception::GP0));
    }
    if fs {
        ctx.sregs.fs.base = value;
    } else {
        ctx.sregs.gs.base = value;
    }
    ctx.sregs_dirty = true;
    Ok(Outcome::Done)
}
