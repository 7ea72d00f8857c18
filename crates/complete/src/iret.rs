//! IRET in protected mode, returning to the same privilege level: how 32-bit firmware and
//! boot loaders (syslinux's protected-mode core) return from their interrupt handlers. KVM's
//! emulator does IRET only in real mode. Returns to another privilege level, to
//! virtual-8086 mode, through a task (NT) or through the LDT are refused.

use hypervisor::SegmentRegister;
use iced_x86::{Instruction, Mnemonic};

use crate::context::Context;
use crate::{Exception, Failure, Outcome, Step};

const CR0_PE: u64 = 1;
const EFER_LMA: u64 = 1 << 10;
const IF: u64 = 1 << 9;
const IOPL: u64 = 3 << 12;
const NT: u64 = 1 << 14;
const VM: u64 = 1 << 17;
const VIF_VIP: u64 = 3 << 19;
/// The flags an IRET may load: CF PF AF ZF SF TF IF DF OF IOPL NT RF AC VIF VIP ID (not VM,
/// whose return is refused). Bit 1 always reads 1.
const LOADABLE: u64 = 0x003d_7fd5;
const FIXED: u64 = 1 << 1;

pub fn execute(ctx: &mut Context, insn: &Instruction) -> Option<Step> {
    match insn.mnemonic() {
        Mnemonic::Iret => Some(iret(ctx, 2)),
        Mnemonic::Iretd => Some(iret(ctx, 4)),
        _ => None,
    }
}

fn unsupported(what: &str) -> Step {
    Err(Failure::Unsupported(format!("{what} is not completed")))
}

/// Pops EIP, CS and EFLAGS of `size` bytes each from SS:ESP (SP for a 16-bit stack).
fn iret(ctx: &mut Context, size: u64) -> Step {
    if ctx.sregs.cr0 & CR0_PE == 0 || ctx.sregs.efer & EFER_LMA != 0 {
        return unsupported("IRET outside 32-bit protected mode");
    }
    if ctx.regs.rflags & NT != 0 {
        return unsupported("IRET with NT set (a task return)");
    }
    let sp_mask: u64 = if ctx.sregs.ss.db { 0xffff_ffff } else { 0xffff };
    let sp = ctx.regs.rsp & sp_mask;
    let mut frame = [0u64; 3];
    for (k, slot) in frame.iter_mut().enumerate() {
        let offset = sp.wrapping_add(k as u64 * size) & sp_mask;
        let mut raw = [0u8; 8];
        if let Err(e) = ctx.read(
            ctx.sregs.ss.base.wrapping_add(offset),
            &mut raw[..size as usize],
        ) {
            return Ok(Outcome::Exception(e));
        }
        *slot = u64::from_le_bytes(raw);
    }
    let [ip, selector, popped] = frame;
    let selector = selector as u16;
    let cpl = ctx.cpl();
    if size == 4 && popped & VM != 0 && cpl == 0 {
        return unsupported("IRET to virtual-8086 mode");
    }
    if selector & 4 != 0 {
        return unsupported("IRET to a code segment of the LDT");
    }
    match (selector & 3).cmp(&u16::from(cpl)) {
        std::cmp::Ordering::Less => {
            return Ok(Outcome::Exception(Exception::fault(
                13,
                Some(u32::from(selector & !3)),
            )))
        }
        std::cmp::Ordering::Greater => return unsupported("IRET to an outer privilege level"),
        std::cmp::Ordering::Equal => {}
    }
    let cs = match code_segment(ctx, selector) {
        Ok(cs) => cs,
        Err(e) => return Ok(Outcome::Exception(e)),
    };
    if ip > u64::from(cs.limit) {
        return Ok(Outcome::Exception(Exception::GP0));
    }

    let mut loadable = if size == 2 {
        LOADABLE & 0xffff
    } else {
        LOADABLE
    };
    if cpl > 0 {
        loadable &= !(IOPL | VIF_VIP);
    }
    if u64::from(cpl) > (ctx.regs.rflags & IOPL) >> 12 {
        loadable &= !IF;
    }
    ctx.regs.rflags = (ctx.regs.rflags & !loadable) | (popped & loadable) | FIXED;
    ctx.regs.rip = ip;
    let new_sp = sp.wrapping_add(3 * size) & sp_mask;
    ctx.regs.rsp = (ctx.regs.rsp & !sp_mask) | new_sp;
    ctx.sregs.cs = cs;
    ctx.sregs_dirty = true;
    // An IRET ends the blocking of NMIs that the delivery of an NMI began.
    let mut events = ctx.vcpu.vcpu_events()?;
    if events.nmi_masked {
        events.nmi_masked = false;
        ctx.vcpu.set_vcpu_events(&events)?;
    }
    Ok(Outcome::Jumped)
}

/// The code segment `selector` names in the GDT, checked as IRET checks it at the same
/// privilege level (#GP or #NP with the selector), its accessed bit set in memory.
fn code_segment(ctx: &Context, selector: u16) -> Result<SegmentRegister, Exception> {
    let index = u64::from(selector >> 3);
    let gp = Exception::fault(13, Some(u32::from(selector & !3)));
    if index == 0 {
        return Err(Exception::GP0);
    }
    if index * 8 + 7 > u64::from(ctx.sregs.gdt.limit) {
        return Err(gp);
    }
    let at = ctx.sregs.gdt.base.wrapping_add(index * 8);
    let mut raw = [0u8; 8];
    ctx.read(at, &mut raw)?;
    let d = u64::from_le_bytes(raw);
    let access = raw[5];
    let type_ = access & 0xf;
    let dpl = (access >> 5) & 3;
    let rpl = (selector & 3) as u8;
    let code = access & 0x10 != 0 && type_ & 8 != 0;
    let conforming = type_ & 4 != 0;
    if !code || (conforming && dpl > rpl) || (!conforming && dpl != rpl) {
        return Err(gp);
    }
    if access & 0x80 == 0 {
        return Err(Exception::fault(11, Some(u32::from(selector & !3))));
    }
    if type_ & 1 == 0 {
        ctx.write(at + 5, &[access | 1])?;
    }
    let flags = raw[6] >> 4;
    let g = flags & 8 != 0;
    let limit = ((d & 0xffff) | ((d >> 32) & 0xf_0000)) as u32;
    Ok(SegmentRegister {
        base: ((d >> 16) & 0xff_ffff) | ((d >> 32) & 0xff00_0000),
        limit: if g { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: type_ | 1,
        present: true,
        dpl,
        db: flags & 4 != 0,
        s: true,
        l: flags & 2 != 0,
        g,
        avl: flags & 1 != 0,
        unusable: false,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use hypervisor::*;

    use super::*;
    use crate::GuestRam;

    /// The vCPU state an IRET completion touches besides registers: its events.
    #[derive(Default)]
    struct Events(Mutex<VcpuEvents>);

    macro_rules! not_used {
        ($($name:ident($($arg:ty),*) -> $ret:ty;)*) => {
            $(fn $name(&self, $(_: $arg),*) -> $ret { unreachable!() })*
        };
    }

    impl Vcpu for Events {
        fn id(&self) -> u32 {
            0
        }
        fn run(&mut self) -> Result<VcpuExit<'_>> {
            unreachable!()
        }
        fn bind_kicker(&mut self) -> Result<VcpuKicker> {
            unreachable!()
        }
        fn finish_pending_exit(&mut self) -> Result<()> {
            unreachable!()
        }
        fn request_interrupt_window(&mut self, _: bool) {}
        not_used! {
            ready_for_interrupt() -> bool;
            inject_external_interrupt(u8) -> Result<()>;
            regs() -> Result<StandardRegisters>;
            set_regs(&StandardRegisters) -> Result<()>;
            sregs() -> Result<SpecialRegisters>;
            set_sregs(&SpecialRegisters) -> Result<()>;
            fpu() -> Result<FpuState>;
            set_fpu(&FpuState) -> Result<()>;
            xsave() -> Result<XsaveState>;
            set_xsave(&XsaveState) -> Result<()>;
            xcrs() -> Result<Vec<Xcr>>;
            set_xcrs(&[Xcr]) -> Result<()>;
            msrs(&[u32]) -> Result<Vec<MsrEntry>>;
            set_msrs(&[MsrEntry]) -> Result<()>;
            set_cpuid(&[CpuidEntry]) -> Result<()>;
            cpuid() -> Result<Vec<CpuidEntry>>;
            lapic() -> Result<LapicState>;
            set_lapic(&LapicState) -> Result<()>;
            mp_state() -> Result<MpState>;
            set_mp_state(MpState) -> Result<()>;
        }
        fn vcpu_events(&self) -> Result<VcpuEvents> {
            Ok(*self.0.lock().unwrap())
        }
        fn set_vcpu_events(&self, events: &VcpuEvents) -> Result<()> {
            *self.0.lock().unwrap() = *events;
            Ok(())
        }
    }

    struct Ram(Mutex<Vec<u8>>);

    impl GuestRam for Ram {
        fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
            let ram = self.0.lock().unwrap();
            let at = gpa as usize;
            buf.copy_from_slice(&ram[at..at + buf.len()]);
            true
        }
        fn write(&self, gpa: u64, buf: &[u8]) -> bool {
            let mut ram = self.0.lock().unwrap();
            let at = gpa as usize;
            ram[at..at + buf.len()].copy_from_slice(buf);
            true
        }
    }

    const GDT: u64 = 0x1000;
    const STACK: u64 = 0x8000;
    /// Flat 32-bit code at ring 0, not yet accessed (type 0xa).
    const CODE32: u64 = 0x00cf_9a00_0000_ffff;

    /// Ring 0 of 32-bit protected mode without paging (syslinux's state): flat code at
    /// selector 0x08, `descriptor` at 0x10, a 32-bit stack at STACK holding `frame`.
    fn machine(
        descriptor: u64,
        frame: &[u32],
    ) -> (Events, Ram, StandardRegisters, SpecialRegisters) {
        let mut ram = vec![0u8; 0x10000];
        ram[GDT as usize + 8..][..8].copy_from_slice(&CODE32.to_le_bytes());
        ram[GDT as usize + 16..][..8].copy_from_slice(&descriptor.to_le_bytes());
        for (k, word) in frame.iter().enumerate() {
            ram[STACK as usize + 4 * k..][..4].copy_from_slice(&word.to_le_bytes());
        }
        let code = SegmentRegister {
            limit: 0xffff_ffff,
            selector: 8,
            type_: 0xb,
            present: true,
            db: true,
            s: true,
            g: true,
            ..Default::default()
        };
        let stack = SegmentRegister {
            selector: 0x18,
            type_: 0x3,
            ..code
        };
        let sregs = SpecialRegisters {
            cs: code,
            ss: stack,
            gdt: DescriptorTable {
                base: GDT,
                limit: 0x1f,
            },
            cr0: CR0_PE,
            ..Default::default()
        };
        let regs = StandardRegisters {
            rsp: STACK,
            rip: 0x9000,
            rflags: 0x2,
            ..Default::default()
        };
        let events = Events::default();
        events.0.lock().unwrap().nmi_masked = true;
        (events, Ram(Mutex::new(ram)), regs, sregs)
    }

    fn run(
        vcpu: &Events,
        ram: &Ram,
        regs: StandardRegisters,
        sregs: SpecialRegisters,
        size: u64,
    ) -> (Step, StandardRegisters, SpecialRegisters) {
        let mut ctx = Context {
            vcpu,
            ram,
            regs,
            sregs,
            sregs_dirty: false,
        };
        let step = iret(&mut ctx, size);
        (step, ctx.regs, ctx.sregs)
    }

    #[test]
    fn iretd_returns_to_a_code_segment_of_the_gdt() {
        // Code at 0x10 with base 0x12345000, 64 KiB, 32-bit: EIP, CS, EFLAGS (IF, CF).
        let descriptor = 0x1240_9a34_5000_ffff;
        let (vcpu, ram, regs, sregs) = machine(descriptor, &[0x2345, 0x10, 0x203]);
        let (step, regs, sregs) = run(&vcpu, &ram, regs, sregs, 4);
        assert!(matches!(step, Ok(Outcome::Jumped)));
        assert_eq!(regs.rip, 0x2345);
        assert_eq!(regs.rsp, STACK + 12);
        assert_eq!(regs.rflags, 0x203);
        assert_eq!(sregs.cs.selector, 0x10);
        assert_eq!(sregs.cs.base, 0x1234_5000);
        assert_eq!(sregs.cs.limit, 0xffff);
        assert!(sregs.cs.db && !sregs.cs.g && sregs.cs.present);
        assert_eq!(sregs.cs.type_, 0xb);
        // The descriptor is marked accessed, and NMIs are no longer blocked.
        assert_eq!(ram.0.lock().unwrap()[GDT as usize + 16 + 5], 0x9b);
        assert!(!vcpu.vcpu_events().unwrap().nmi_masked);
    }

    #[test]
    fn a_16_bit_iret_pops_words_and_keeps_the_high_flags() {
        let (vcpu, ram, mut regs, sregs) = machine(CODE32, &[0x0008_1234, 0x0246]);
        regs.rflags = 0x4_0002; // AC, which a 16-bit IRET does not load
        let (step, regs, _) = run(&vcpu, &ram, regs, sregs, 2);
        assert!(matches!(step, Ok(Outcome::Jumped)));
        assert_eq!(regs.rip, 0x1234);
        assert_eq!(regs.rsp, STACK + 6);
        assert_eq!(regs.rflags, 0x4_0246);
    }

    #[test]
    fn bad_targets_raise_what_the_processor_raises() {
        // Not present: #NP(0x10).
        let (vcpu, ram, regs, sregs) = machine(CODE32 & !(0x80 << 40), &[0x1000, 0x10, 0x2]);
        let (step, ..) = run(&vcpu, &ram, regs, sregs, 4);
        assert!(matches!(step, Ok(Outcome::Exception(e)) if e == Exception::fault(11, Some(0x10))));
        // A data segment: #GP(0x10).
        let (vcpu, ram, regs, sregs) = machine(0x00cf_9200_0000_ffff, &[0x1000, 0x10, 0x2]);
        let (step, ..) = run(&vcpu, &ram, regs, sregs, 4);
        assert!(matches!(step, Ok(Outcome::Exception(e)) if e == Exception::fault(13, Some(0x10))));
        // Beyond the GDT's limit: #GP(0x20).
        let (vcpu, ram, regs, sregs) = machine(CODE32, &[0x1000, 0x20, 0x2]);
        let (step, ..) = run(&vcpu, &ram, regs, sregs, 4);
        assert!(matches!(step, Ok(Outcome::Exception(e)) if e == Exception::fault(13, Some(0x20))));
        // A task return and a return to ring 3 are refused, not half done.
        let (vcpu, ram, mut regs, sregs) = machine(CODE32, &[0x1000, 0x8, 0x2]);
        regs.rflags |= NT;
        assert!(matches!(
            run(&vcpu, &ram, regs, sregs, 4).0,
            Err(Failure::Unsupported(_))
        ));
        let (vcpu, ram, regs, sregs) = machine(CODE32, &[0x1000, 0x13, 0x2]);
        assert!(matches!(
            run(&vcpu, &ram, regs, sregs, 4).0,
            Err(Failure::Unsupported(_))
        ));
    }
}
