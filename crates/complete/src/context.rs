//! The vCPU state one completion works on: registers read once, operands resolved, memory
//! reached through the guest's page tables, and everything written back at the end.

use hypervisor::{SpecialRegisters, StandardRegisters, Vcpu};
use iced_x86::{Instruction, OpKind, Register};

use crate::paging::Mmu;
use crate::{Exception, Failure, GuestRam};

/// RFLAGS bits the completed instructions touch.
pub mod flags {
    pub const CF: u64 = 1 << 0;
    pub const PF: u64 = 1 << 2;
    pub const AF: u64 = 1 << 4;
    pub const ZF: u64 = 1 << 6;
    pub const SF: u64 = 1 << 7;
    pub const OF: u64 = 1 << 11;
    pub const AC: u64 = 1 << 18;
    pub const ARITHMETIC: u64 = CF | PF | AF | ZF | SF | OF;
}

pub struct Context<'a> {
    pub vcpu: &'a dyn Vcpu,
    pub ram: &'a dyn GuestRam,
    pub regs: StandardRegisters,
    pub sregs: SpecialRegisters,
    /// Set when an instruction changed the special registers (FS/GS base, say).
    pub sregs_dirty: bool,
}

impl<'a> Context<'a> {
    pub fn load(vcpu: &'a dyn Vcpu, ram: &'a dyn GuestRam) -> Result<Self, Failure> {
        Ok(Context {
            vcpu,
            ram,
            regs: vcpu.regs()?,
            sregs: vcpu.sregs()?,
            sregs_dirty: false,
        })
    }

    /// 64 in long mode, else 32 or 16 from CS's default size.
    pub fn bitness(&self) -> u32 {
        match (self.sregs.cs.l, self.sregs.cs.db) {
            (true, _) if self.sregs.efer & (1 << 10) != 0 => 64,
            (_, true) => 32,
            _ => 16,
        }
    }

    pub fn cpl(&self) -> u8 {
        self.sregs.cs.dpl & 3
    }

    fn mmu(&self) -> Mmu {
        Mmu {
            cr0: self.sregs.cr0,
            cr3: self.sregs.cr3,
            cr4: self.sregs.cr4,
            efer: self.sregs.efer,
            user: self.cpl() == 3,
        }
    }

    /// Up to 15 bytes at CS:RIP, fewer if the instruction's page ends before a fault.
    pub fn fetch_instruction(&self) -> Result<Vec<u8>, Failure> {
        let start = self.sregs.cs.base.wrapping_add(self.regs.rip);
        // All 15 bytes, or when the next page cannot be read, those up to the page's end:
        // one walk per page instead of one per byte.
        let to_page_end = (4096 - (start & 0xfff)).min(15) as usize;
        let mut bytes = vec![0u8; 15];
        if self.read(start, &mut bytes).is_err() {
            bytes.truncate(to_page_end);
            if self.read(start, &mut bytes).is_err() {
                bytes.clear();
            }
        }
        if bytes.is_empty() {
            return Err(Failure::Unsupported(
                "the instruction's bytes cannot be read".into(),
            ));
        }
        Ok(bytes)
    }

    /// Reads `buf.len()` bytes at a linear address, page by page.
    pub fn read(&self, linear: u64, buf: &mut [u8]) -> Result<(), Exception> {
        self.each_page(linear, buf.len(), false, |gpa, range| {
            self.ram.read(gpa, &mut buf[range])
        })
    }

    /// Writes `data` at a linear address. Every page is translated before the first byte is
    /// written, so a fault leaves memory untouched.
    pub fn write(&self, linear: u64, data: &[u8]) -> Result<(), Exception> {
        self.each_page(linear, data.len(), true, |_, _| true)?;
        self.each_page(linear, data.len(), true, |gpa, range| {
            self.ram.write(gpa, &data[range])
        })
    }

    fn each_page(
        &self,
        linear: u64,
        len: usize,
        write: bool,
        mut access: impl FnMut(u64, std::ops::Range<usize>) -> bool,
    ) -> Result<(), Exception> {
        let mmu = self.mmu();
        let mut done = 0;
        while done < len {
            let at = linear.wrapping_add(done as u64);
            let in_page = (4096 - (at & 0xfff)) as usize;
            let n = in_page.min(len - done);
            let gpa = mmu
                .translate(self.ram, at, write)
                .map_err(|f| f.exception())?;
            if !access(gpa, done..done + n) {
                // Not RAM (a device's window): no completed instruction targets one.
                return Err(Exception::GP0);
            }
            done += n;
        }
        Ok(())
    }

    /// The linear address of the instruction's memory operand.
    pub fn memory_address(&self, insn: &Instruction) -> u64 {
        let base = match insn.memory_base() {
            Register::None => 0,
            // The decoder already folded RIP-relative displacements into an absolute one.
            Register::RIP | Register::EIP => 0,
            r => self.gpr(r),
        };
        let index = match insn.memory_index() {
            Register::None => 0,
            r => self
                .gpr(r)
                .wrapping_mul(u64::from(insn.memory_index_scale())),
        };
        let offset = base
            .wrapping_add(index)
            .wrapping_add(insn.memory_displacement64());
        let offset = match self.bitness() {
            64 => offset,
            32 => offset & 0xffff_ffff,
            _ => offset & 0xffff,
        };
        self.segment_base(insn.memory_segment())
            .wrapping_add(offset)
    }

    /// In 64-bit mode only FS and GS have a base.
    fn segment_base(&self, segment: Register) -> u64 {
        let s = &self.sregs;
        match segment {
            Register::FS => s.fs.base,
            Register::GS => s.gs.base,
            _ if self.bitness() == 64 => 0,
            Register::ES => s.es.base,
            Register::CS => s.cs.base,
            Register::SS => s.ss.base,
            _ => s.ds.base,
        }
    }

    /// A general-purpose register of any width (AH..BH included).
    pub fn gpr(&self, reg: Register) -> u64 {
        let full = *self.slot(reg);
        if is_high_byte(reg) {
            return (full >> 8) & 0xff;
        }
        full & width_mask(reg.size())
    }

    /// Writes a register as the processor does: 32-bit writes zero-extend, 8- and 16-bit
    /// writes keep the rest.
    pub fn set_gpr(&mut self, reg: Register, value: u64) {
        let size = reg.size();
        let high = is_high_byte(reg);
        let slot = self.slot_mut(reg);
        *slot = match (size, high) {
            (1, true) => (*slot & !0xff00) | ((value & 0xff) << 8),
            (1, false) => (*slot & !0xff) | (value & 0xff),
            (2, _) => (*slot & !0xffff) | (value & 0xffff),
            (4, _) => value & 0xffff_ffff,
            _ => value,
        };
    }

    /// The value of operand `n` when it is a register, or read from memory.
    pub fn read_operand(&self, insn: &Instruction, n: u32, size: usize) -> Result<u64, Exception> {
        match insn.op_kind(n) {
            OpKind::Register => Ok(self.gpr(insn.op_register(n))),
            OpKind::Memory => {
                let mut raw = [0u8; 8];
                self.read(self.memory_address(insn), &mut raw[..size])?;
                Ok(u64::from_le_bytes(raw))
            }
            _ => Ok(insn.immediate(n)),
        }
    }

    /// Stores into operand `n`, a register or memory.
    pub fn write_operand(
        &mut self,
        insn: &Instruction,
        n: u32,
        size: usize,
        value: u64,
    ) -> Result<(), Exception> {
        if insn.op_kind(n) == OpKind::Memory {
            return self.write(self.memory_address(insn), &value.to_le_bytes()[..size]);
        }
        self.set_gpr(insn.op_register(n), value);
        Ok(())
    }

    pub fn set_flags(&mut self, mask: u64, set: u64) {
        self.regs.rflags = (self.regs.rflags & !mask) | (set & mask);
    }

    fn slot(&self, reg: Register) -> &u64 {
        let r = &self.regs;
        match gpr_index(reg) {
            0 => &r.rax,
            1 => &r.rcx,
            2 => &r.rdx,
            3 => &r.rbx,
            4 => &r.rsp,
            5 => &r.rbp,
            6 => &r.rsi,
            7 => &r.rdi,
            8 => &r.r8,
            9 => &r.r9,
            10 => &r.r10,
            11 => &r.r11,
            12 => &r.r12,
            13 => &r.r13,
            14 => &r.r14,
            _ => &r.r15,
        }
    }

    fn slot_mut(&mut self, reg: Register) -> &mut u64 {
        let r = &mut self.regs;
        match gpr_index(reg) {
            0 => &mut r.rax,
            1 => &mut r.rcx,
            2 => &mut r.rdx,
            3 => &mut r.rbx,
            4 => &mut r.rsp,
            5 => &mut r.rbp,
            6 => &mut r.rsi,
            7 => &mut r.rdi,
            8 => &mut r.r8,
            9 => &mut r.r9,
            10 => &mut r.r10,
            11 => &mut r.r11,
            12 => &mut r.r12,
            13 => &mut r.r13,
            14 => &mut r.r14,
            _ => &mut r.r15,
        }
    }

    /// Writes the registers back with RIP past the instruction.
    pub fn finish(&mut self, len: u64) -> hypervisor::Result<()> {
        self.regs.rip = self.regs.rip.wrapping_add(len);
        if self.sregs_dirty {
            self.vcpu.set_sregs(&self.sregs)?;
        }
        self.vcpu.set_regs(&self.regs)
    }

    /// Delivers an exception: a fault leaves RIP and the registers as they were before the
    /// instruction, a trap moves RIP past it first.
    pub fn raise(&mut self, e: Exception, len: u64) -> hypervisor::Result<()> {
        let mut regs = self.vcpu.regs()?;
        if e.trap {
            regs.rip = regs.rip.wrapping_add(len);
            self.vcpu.set_regs(&regs)?;
        }
        if let Some(cr2) = e.cr2 {
            let mut sregs = self.vcpu.sregs()?;
            sregs.cr2 = cr2;
            self.vcpu.set_sregs(&sregs)?;
        }
        let mut events = self.vcpu.vcpu_events()?;
        events.exception_injected = true;
        events.exception_pending = false;
        events.exception_nr = e.vector;
        events.exception_has_error_code = e.error_code.is_some();
        events.exception_error_code = e.error_code.unwrap_or(0);
        self.vcpu.set_vcpu_events(&events)
    }
}

fn is_high_byte(reg: Register) -> bool {
    matches!(
        reg,
        Register::AH | Register::CH | Register::DH | Register::BH
    )
}

/// 0 = RAX ... 15 = R15, in the encoding's order.
fn gpr_index(reg: Register) -> usize {
    let full = reg.full_register();
    (full as usize).wrapping_sub(Register::RAX as usize) & 15
}

pub fn width_mask(size: usize) -> u64 {
    match size {
        1 => 0xff,
        2 => 0xffff,
        4 => 0xffff_ffff,
        _ => u64::MAX,
    }
}
