//! The XSAVE family (XSAVE, XSAVEOPT, XSAVEC, XSAVES, XRSTOR, XRSTORS, their 64-bit forms),
//! FXSAVE/FXRSTOR and XGETBV, done on the vCPU's XSAVE image.
//!
//! The hypervisor gives the vCPU's extended state as one XSAVE area in the standard
//! (non-compacted) format. A save copies the requested components from it to guest memory in
//! the instruction's format (standard, or compacted with XSAVEC/XSAVES); a restore checks the
//! header as the processor does (#GP on a malformed one), copies the components whose
//! XSTATE_BV bit is set into the image, marks the others as in their initial state and hands
//! the image back to the hypervisor, which puts those in their initial configuration.
//! Supervisor components (IA32_XSS) are not in that image; XSAVES/XRSTORS refuse them.

use iced_x86::{Instruction, Mnemonic, Register};

use crate::context::Context;
use crate::{Exception, Failure, Outcome, Step};

const CR4_OSXSAVE: u64 = 1 << 18;
const IA32_XSS: u32 = 0xda0;
const LEGACY_SIZE: usize = 512;
pub(crate) const HEADER: usize = 512;
const HEADER_SIZE: usize = 64;
const COMPACTED: u64 = 1 << 63;
/// The legacy region's parts: x87 control and pointers, MXCSR with its mask, the x87
/// registers, the XMM registers.
const X87_CONTROL: std::ops::Range<usize> = 0..24;
const MXCSR: std::ops::Range<usize> = 24..32;
const X87_REGS: std::ops::Range<usize> = 32..160;
const XMM_REGS: std::ops::Range<usize> = 160..416;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Standard,
    Compacted,
    /// Compacted, with supervisor components and ring 0 only.
    Supervisor,
}

pub fn execute(ctx: &mut Context, insn: &Instruction) -> Option<Step> {
    use Mnemonic::*;
    let step = match insn.mnemonic() {
        Xsave | Xsave64 | Xsaveopt | Xsaveopt64 => save(ctx, insn, Form::Standard),
        Xsavec | Xsavec64 => save(ctx, insn, Form::Compacted),
        Xsaves | Xsaves64 => save(ctx, insn, Form::Supervisor),
        Xrstor | Xrstor64 => restore(ctx, insn, false),
        Xrstors | Xrstors64 => restore(ctx, insn, true),
        Fxsave | Fxsave64 => fxsave(ctx, insn),
        Fxrstor | Fxrstor64 => fxrstor(ctx, insn),
        Xgetbv => xgetbv(ctx),
        _ => return None,
    };
    Some(step)
}

macro_rules! attempt {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(exception) => return Ok(Outcome::Exception(exception)),
        }
    };
}

/// Where each extended component (2 and up) sits, from CPUID leaf 0xD.
struct Layout {
    /// (component, size, standard offset, 64-byte aligned when compacted)
    components: Vec<(u32, usize, usize, bool)>,
}

impl Layout {
    fn read(ctx: &Context) -> Result<Self, Failure> {
        let cpuid = ctx.vcpu.cpuid()?;
        let components = cpuid
            .iter()
            .filter(|e| e.function == 0xd && (2..63).contains(&e.index) && e.eax != 0)
            .map(|e| (e.index, e.eax as usize, e.ebx as usize, e.ecx & 2 != 0))
            .collect();
        Ok(Layout { components })
    }

    fn get(&self, i: u32) -> Result<(usize, usize, bool), Failure> {
        self.components
            .iter()
            .find(|c| c.0 == i)
            .map(|&(_, size, offset, align)| (size, offset, align))
            .ok_or_else(|| Failure::Unsupported(format!("XSAVE component {i} is not in CPUID")))
    }

    /// The offset of each component of `xcomp_bv` in the compacted format.
    fn compacted_offsets(&self, xcomp_bv: u64) -> Result<Vec<(u32, usize)>, Failure> {
        let mut offset = LEGACY_SIZE + HEADER_SIZE;
        let mut out = Vec::new();
        for i in bits(xcomp_bv & !COMPACTED & !3) {
            let (size, _, align) = self.get(i)?;
            if align {
                offset = offset.next_multiple_of(64);
            }
            out.push((i, offset));
            offset += size;
        }
        Ok(out)
    }
}

fn bits(mask: u64) -> impl Iterator<Item = u32> {
    (0..64).filter(move |i| mask & (1 << i) != 0)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

/// The vCPU's XSAVE image as bytes.
pub(crate) fn image(ctx: &Context) -> Result<Vec<u8>, Failure> {
    let region = ctx.vcpu.xsave()?.region;
    Ok(region.iter().flat_map(|w| w.to_le_bytes()).collect())
}

pub(crate) fn set_image(ctx: &Context, bytes: &[u8]) -> Result<(), Failure> {
    let region = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    ctx.vcpu
        .set_xsave(&hypervisor::XsaveState { region })
        .map_err(Failure::Vcpu)
}

fn xcr0(ctx: &Context) -> Result<u64, Failure> {
    Ok(ctx
        .vcpu
        .xcrs()?
        .iter()
        .find(|x| x.index == 0)
        .map_or(3, |x| x.value))
}

/// The requested-feature bitmap: `xcr0` (and IA32_XSS for the supervisor forms) and EDX:EAX.
fn requested(ctx: &Context, form: Form, xcr0: u64) -> Result<u64, Failure> {
    let mut enabled = xcr0;
    if form == Form::Supervisor {
        let xss = ctx.vcpu.msrs(&[IA32_XSS])?.first().map_or(0, |m| m.data);
        if xss != 0 {
            return Err(Failure::Unsupported(format!(
                "supervisor XSAVE components (IA32_XSS = {xss:#x}) are not supported"
            )));
        }
        enabled |= xss;
    }
    let edx_eax = (ctx.regs.rdx << 32) | (ctx.regs.rax & 0xffff_ffff);
    Ok(enabled & edx_eax)
}

/// #UD without CR4.OSXSAVE, #GP for the supervisor forms outside ring 0 or an operand not
/// aligned on 64 bytes.
fn precheck(ctx: &Context, insn: &Instruction, form: Form) -> Result<u64, Exception> {
    if ctx.sregs.cr4 & CR4_OSXSAVE == 0 {
        return Err(Exception::UD);
    }
    if form == Form::Supervisor && ctx.cpl() != 0 {
        return Err(Exception::GP0);
    }
    let addr = ctx.memory_address(insn);
    if !addr.is_multiple_of(64) {
        return Err(Exception::GP0);
    }
    Ok(addr)
}

/// Writes the legacy region's parts that `rfbm` selects.
fn save_legacy(ctx: &Context, addr: u64, img: &[u8], rfbm: u64) -> Result<(), Exception> {
    let put = |range: std::ops::Range<usize>| ctx.write(addr + range.start as u64, &img[range]);
    if rfbm & 1 != 0 {
        put(X87_CONTROL)?;
        put(X87_REGS)?;
    }
    if rfbm & 6 != 0 {
        put(MXCSR)?;
    }
    if rfbm & 2 != 0 {
        put(XMM_REGS)?;
    }
    Ok(())
}

fn save(ctx: &mut Context, insn: &Instruction, form: Form) -> Step {
    let addr = attempt!(precheck(ctx, insn, form));
    let rfbm = requested(ctx, form, xcr0(ctx)?)?;
    let img = image(ctx)?;
    let layout = Layout::read(ctx)?;
    let in_use = u64_at(&img, HEADER);
    let header = addr + HEADER as u64;
    if form == Form::Standard {
        attempt!(save_legacy(ctx, addr, &img, rfbm));
        let mut old = [0u8; 8];
        attempt!(ctx.read(header, &mut old));
        let xstate_bv = (u64::from_le_bytes(old) & !rfbm) | (in_use & rfbm);
        attempt!(ctx.write(header, &xstate_bv.to_le_bytes()));
        for i in bits(rfbm & !3) {
            let (size, offset, _) = layout.get(i)?;
            attempt!(ctx.write(addr + offset as u64, &img[offset..offset + size]));
        }
        return Ok(Outcome::Done);
    }
    // The compacted forms leave out what is in its initial state, MXCSR excepted.
    let xstate_bv = in_use & rfbm;
    attempt!(save_legacy(ctx, addr, &img, xstate_bv & 3));
    if rfbm & 6 != 0 && xstate_bv & 2 == 0 {
        attempt!(ctx.write(addr + MXCSR.start as u64, &img[MXCSR]));
    }
    let xcomp_bv = rfbm | COMPACTED;
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&xstate_bv.to_le_bytes());
    head[8..].copy_from_slice(&xcomp_bv.to_le_bytes());
    attempt!(ctx.write(header, &head));
    for (i, at) in layout.compacted_offsets(xcomp_bv)? {
        if xstate_bv & (1 << i) != 0 {
            let (size, offset, _) = layout.get(i)?;
            attempt!(ctx.write(addr + at as u64, &img[offset..offset + size]));
        }
    }
    Ok(Outcome::Done)
}

/// Checks a restore's header as the processor does; `Ok(compacted)` when it is good.
fn check_header(head: &[u8], enabled: u64, supervisor: bool) -> Result<bool, Exception> {
    let xstate_bv = u64_at(head, 0);
    let xcomp_bv = u64_at(head, 8);
    let reserved_clear = head[16..].iter().all(|&b| b == 0);
    let compacted = xcomp_bv & COMPACTED != 0;
    let good = if compacted {
        xcomp_bv & !COMPACTED & !enabled == 0 && xstate_bv & !xcomp_bv == 0 && reserved_clear
    } else {
        !supervisor && xcomp_bv == 0 && xstate_bv & !enabled == 0 && reserved_clear
    };
    if good {
        Ok(compacted)
    } else {
        Err(Exception::GP0)
    }
}

fn restore(ctx: &mut Context, insn: &Instruction, supervisor: bool) -> Step {
    let form = if supervisor {
        Form::Supervisor
    } else {
        Form::Standard
    };
    let addr = attempt!(precheck(ctx, insn, form));
    let enabled = xcr0(ctx)?;
    let rfbm = requested(ctx, form, enabled)?;
    let mut head = [0u8; HEADER_SIZE];
    attempt!(ctx.read(addr + HEADER as u64, &mut head));
    let compacted = attempt!(check_header(&head, enabled, supervisor));
    let xstate_bv = u64_at(&head, 0);
    let layout = Layout::read(ctx)?;
    let mut img = image(ctx)?;
    let mxcsr_mask = u32::from_le_bytes(img[28..32].try_into().unwrap_or_default());
    let load = xstate_bv & rfbm;
    let fetch = |range: std::ops::Range<usize>, from: u64, img: &mut Vec<u8>| {
        ctx.read(from, &mut img[range])
    };
    if load & 1 != 0 {
        attempt!(fetch(X87_CONTROL, addr, &mut img));
        attempt!(fetch(X87_REGS, addr + X87_REGS.start as u64, &mut img));
    }
    if load & 2 != 0 {
        attempt!(fetch(XMM_REGS, addr + XMM_REGS.start as u64, &mut img));
    }
    if rfbm & 6 != 0 && (!compacted || load & 2 != 0) {
        let mut mxcsr = [0u8; 4];
        attempt!(ctx.read(addr + 24, &mut mxcsr));
        if u32::from_le_bytes(mxcsr) & !mxcsr_mask != 0 {
            return Ok(Outcome::Exception(Exception::GP0));
        }
        img[24..28].copy_from_slice(&mxcsr);
    }
    let sources = if compacted {
        layout.compacted_offsets(u64_at(&head, 8))?
    } else {
        bits(load & !3)
            .map(|i| layout.get(i).map(|(_, offset, _)| (i, offset)))
            .collect::<Result<_, _>>()?
    };
    for (i, at) in sources.into_iter().filter(|(i, _)| load & (1 << i) != 0) {
        let (size, offset, _) = layout.get(i)?;
        attempt!(ctx.read(addr + at as u64, &mut img[offset..offset + size]));
    }
    let image_bv = (u64_at(&img, HEADER) & !rfbm) | load;
    img[HEADER..HEADER + 8].copy_from_slice(&image_bv.to_le_bytes());
    img[HEADER + 8..HEADER + HEADER_SIZE].fill(0);
    set_image(ctx, &img)?;
    Ok(Outcome::Done)
}

fn fxsave(ctx: &mut Context, insn: &Instruction) -> Step {
    let addr = ctx.memory_address(insn);
    if !addr.is_multiple_of(16) {
        return Ok(Outcome::Exception(Exception::GP0));
    }
    let img = image(ctx)?;
    attempt!(ctx.write(addr, &img[..XMM_REGS.end]));
    Ok(Outcome::Done)
}

fn fxrstor(ctx: &mut Context, insn: &Instruction) -> Step {
    let addr = ctx.memory_address(insn);
    if !addr.is_multiple_of(16) {
        return Ok(Outcome::Exception(Exception::GP0));
    }
    let mut img = image(ctx)?;
    let mxcsr_mask = u32::from_le_bytes(img[28..32].try_into().unwrap_or_default());
    let mut legacy = [0u8; 416];
    attempt!(ctx.read(addr, &mut legacy));
    let mxcsr = u32::from_le_bytes(legacy[24..28].try_into().unwrap_or_default());
    if mxcsr & !mxcsr_mask != 0 {
        return Ok(Outcome::Exception(Exception::GP0));
    }
    img[X87_CONTROL].copy_from_slice(&legacy[X87_CONTROL]);
    img[24..28].copy_from_slice(&legacy[24..28]);
    img[X87_REGS].copy_from_slice(&legacy[X87_REGS]);
    img[XMM_REGS].copy_from_slice(&legacy[XMM_REGS]);
    let image_bv = u64_at(&img, HEADER) | 3;
    img[HEADER..HEADER + 8].copy_from_slice(&image_bv.to_le_bytes());
    set_image(ctx, &img)?;
    Ok(Outcome::Done)
}

/// XGETBV: XCR0, or with ECX = 1 the components in use (XCR0 & XINUSE).
fn xgetbv(ctx: &mut Context) -> Step {
    if ctx.sregs.cr4 & CR4_OSXSAVE == 0 {
        return Ok(Outcome::Exception(Exception::UD));
    }
    let value = match ctx.regs.rcx & 0xffff_ffff {
        0 => xcr0(ctx)?,
        1 => xcr0(ctx)? & u64_at(&image(ctx)?, HEADER),
        _ => return Ok(Outcome::Exception(Exception::GP0)),
    };
    ctx.set_gpr(Register::EAX, value & 0xffff_ffff);
    ctx.set_gpr(Register::EDX, value >> 32);
    Ok(Outcome::Done)
}
