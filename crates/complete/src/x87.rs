//! The x87 control instructions kernels and firmware run while they set up or check the
//! FPU: `fwait`, `fninit`, `fnclex`, `fnstsw`, `fnstcw`, `fldcw` (and their waiting forms).

use iced_x86::{Instruction, Mnemonic, OpKind};

use crate::context::Context;
use crate::xsave::{image, set_image, HEADER};
use crate::{Exception, Failure, Outcome, Step};

/// FSW.ES: an unmasked exception is pending; the next waiting instruction raises #MF.
const FSW_ES: u16 = 1 << 7;
/// FSW bits FNCLEX clears: the exception flags, ES and B.
const FSW_EXCEPTIONS: u16 = 0x80ff;
/// The control word FNINIT loads: every exception masked, 64-bit precision, round to nearest.
const FCW_INIT: u16 = 0x037f;
const CR0_NE: u64 = 1 << 5;

pub fn execute(ctx: &mut Context, insn: &Instruction) -> Option<Step> {
    let waits = matches!(
        insn.mnemonic(),
        Mnemonic::Wait | Mnemonic::Finit | Mnemonic::Fclex | Mnemonic::Fstsw | Mnemonic::Fstcw
    );
    let step = match insn.mnemonic() {
        Mnemonic::Wait => pending_exception(ctx),
        Mnemonic::Fninit | Mnemonic::Finit => then(pending(ctx, waits), || fninit(ctx)),
        Mnemonic::Fnclex | Mnemonic::Fclex => then(pending(ctx, waits), || fnclex(ctx)),
        Mnemonic::Fnstsw | Mnemonic::Fstsw => then(pending(ctx, waits), || fnstsw(ctx, insn)),
        Mnemonic::Fnstcw | Mnemonic::Fstcw => then(pending(ctx, waits), || fnstcw(ctx, insn)),
        Mnemonic::Fldcw => fldcw(ctx, insn),
        _ => return None,
    };
    Some(step)
}

/// Runs `f` unless a waiting form found an exception pending.
fn then(pending: Step, f: impl FnOnce() -> Step) -> Step {
    match pending? {
        Outcome::Done => f(),
        raised => Ok(raised),
    }
}

fn pending(ctx: &Context, waits: bool) -> Step {
    if waits {
        pending_exception(ctx)
    } else {
        Ok(Outcome::Done)
    }
}

/// The x87 control state, edited in the vCPU's XSAVE image: KVM_SET_FPU writes the legacy
/// area without marking x87 state in use, so a value written through it is lost at the
/// next XRSTOR whenever x87 state was in its initial configuration.
struct X87 {
    image: Vec<u8>,
}

impl X87 {
    fn read(ctx: &Context) -> Result<Self, Failure> {
        Ok(X87 { image: image(ctx)? })
    }
    fn word(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.image[at], self.image[at + 1]])
    }
    fn set_word(&mut self, at: usize, value: u16) {
        self.image[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }
    fn fcw(&self) -> u16 {
        self.word(0)
    }
    fn fsw(&self) -> u16 {
        self.word(2)
    }
    /// Writes the state back with x87 marked in use (XSTATE_BV bit 0).
    fn write(mut self, ctx: &Context) -> Result<(), Failure> {
        self.image[HEADER] |= 1;
        set_image(ctx, &self.image)
    }
}

/// What FWAIT does: #MF if an unmasked x87 exception is pending (with CR0.NE; the legacy
/// FERR# route is not modelled), nothing otherwise.
fn pending_exception(ctx: &Context) -> Step {
    if X87::read(ctx)?.fsw() & FSW_ES != 0 && ctx.sregs.cr0 & CR0_NE != 0 {
        return Ok(Outcome::Exception(Exception::fault(16, None)));
    }
    Ok(Outcome::Done)
}

/// Control word 0x37f, status 0, every register empty (abridged tag 0), the last
/// instruction and data pointers and opcode cleared.
fn fninit(ctx: &Context) -> Step {
    let mut x87 = X87::read(ctx)?;
    x87.set_word(0, FCW_INIT);
    x87.image[2..24].fill(0);
    x87.write(ctx)?;
    Ok(Outcome::Done)
}

fn fnclex(ctx: &Context) -> Step {
    let mut x87 = X87::read(ctx)?;
    let fsw = x87.fsw() & !FSW_EXCEPTIONS;
    x87.set_word(2, fsw);
    x87.write(ctx)?;
    Ok(Outcome::Done)
}

fn fnstsw(ctx: &mut Context, insn: &Instruction) -> Step {
    let fsw = X87::read(ctx)?.fsw();
    store16(ctx, insn, fsw)
}

fn fnstcw(ctx: &mut Context, insn: &Instruction) -> Step {
    let fcw = X87::read(ctx)?.fcw();
    store16(ctx, insn, fcw)
}

fn store16(ctx: &mut Context, insn: &Instruction, value: u16) -> Step {
    Ok(match ctx.write_operand(insn, 0, 2, u64::from(value)) {
        Ok(()) => Outcome::Done,
        Err(e) => Outcome::Exception(e),
    })
}

fn fldcw(ctx: &mut Context, insn: &Instruction) -> Step {
    if insn.op_kind(0) != OpKind::Memory {
        return Ok(Outcome::Exception(Exception::UD));
    }
    let fcw = match ctx.read_operand(insn, 0, 2) {
        Ok(v) => v as u16,
        Err(e) => return Ok(Outcome::Exception(e)),
    };
    let mut x87 = X87::read(ctx)?;
    x87.set_word(0, fcw);
    // Unmasking an exception whose flag is set makes it pending.
    let fsw = x87.fsw();
    let fsw = if fsw & !fcw & 0x3f != 0 {
        fsw | FSW_ES | 0x8000
    } else {
        fsw & !(FSW_ES | 0x8000)
    };
    x87.set_word(2, fsw);
    x87.write(ctx)?;
    Ok(Outcome::Done)
}
