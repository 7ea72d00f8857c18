//! Instruction completion: guest instructions the hypervisor's in-kernel emulator rejected,
//! carried out in user space against the vCPU's registers, FPU state and guest memory.
//!
//! Some hosts run part of the guest by instruction emulation (KVM's PVM backend emulates
//! guest ring 0), and the in-kernel emulator lacks instructions real kernels and firmware
//! use: `int3`, `fwait`, `fninit`, the XSAVE family, `popcnt`, `cmpxchg16b`, `rdrand`...
//! When it meets one it stops the vCPU and hands the instruction's bytes to user space
//! (`VcpuExit::InstructionNotEmulated`). [`Completer::complete`] decodes the bytes with
//! iced-x86 in the vCPU's current mode, performs the instruction's architectural effect
//! (operands in memory are reached through the guest's page tables, faults are delivered to
//! the guest as the processor would) and moves RIP past it. An instruction it does not
//! know is refused with one line naming it, disassembled, with RIP; the caller stops the VM.
//!
//! On hosts with hardware virtualisation of ring 0 (VT-x, AMD-V) this path is never taken.

mod context;
mod iret;
mod paging;
mod scalar;
mod x87;
mod xsave;

use std::collections::BTreeMap;
use std::sync::Mutex;

use hypervisor::Vcpu;
use iced_x86::{Decoder, DecoderOptions, Formatter, Instruction, IntelFormatter, Mnemonic};

pub use context::Context;
pub use paging::Fault;

/// Guest physical memory as the completer sees it. Reads and writes that leave guest RAM
/// (a device's MMIO range, say) answer `false`.
pub trait GuestRam: Send + Sync {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> bool;
    fn write(&self, gpa: u64, buf: &[u8]) -> bool;
}

/// Why an instruction was not completed. Its `Display` is the one line the VMM reports
/// (the caller adds the vCPU and its RIP).
#[derive(Debug, thiserror::Error)]
#[error("cannot complete `{text}` ({bytes}): {reason}")]
pub struct Refusal {
    pub text: String,
    pub bytes: String,
    pub rip: u64,
    pub reason: String,
}

/// What went wrong inside one completion, before it is dressed as a [`Refusal`].
#[derive(Debug)]
pub enum Failure {
    /// The completer does not implement this instruction (or this form of it).
    Unsupported(String),
    /// Reading or writing the vCPU's state failed.
    Vcpu(hypervisor::HypervisorError),
}

impl From<hypervisor::HypervisorError> for Failure {
    fn from(e: hypervisor::HypervisorError) -> Self {
        Failure::Vcpu(e)
    }
}

/// The result of one instruction's semantics: done (RIP moves on), done with RIP set by
/// the instruction (a return), or an exception the guest must see instead (RIP stays on
/// the instruction for faults).
pub enum Outcome {
    Done,
    Jumped,
    Exception(Exception),
}

/// An exception to deliver to the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exception {
    pub vector: u8,
    pub error_code: Option<u32>,
    /// Faults leave RIP on the instruction; traps (`int3`) move it past.
    pub trap: bool,
    /// CR2 for a page fault.
    pub cr2: Option<u64>,
}

impl Exception {
    pub const fn fault(vector: u8, error_code: Option<u32>) -> Self {
        Exception {
            vector,
            error_code,
            trap: false,
            cr2: None,
        }
    }
    /// #GP(0), the answer to most malformed operands.
    pub const GP0: Exception = Exception::fault(13, Some(0));
    pub const UD: Exception = Exception::fault(6, None);
}

pub type Step = std::result::Result<Outcome, Failure>;

/// Completes instructions for every vCPU of one VM and counts them by mnemonic.
#[derive(Default)]
pub struct Completer {
    counts: Mutex<BTreeMap<String, u64>>,
    /// Serialises the locked read-modify-write instructions (`cmpxchg16b`) among vCPUs:
    /// every such access in ring 0 comes through here on hosts that need completion.
    atomic: Mutex<()>,
}

impl Completer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Completes the instruction at the vCPU's RIP. `fetched` holds the bytes the kernel
    /// fetched (up to 15; empty if it gave none, in which case they are read from guest
    /// memory through the page tables).
    pub fn complete(
        &self,
        vcpu: &dyn Vcpu,
        ram: &dyn GuestRam,
        fetched: &[u8],
    ) -> std::result::Result<(), Refusal> {
        let mut ctx = Context::load(vcpu, ram).map_err(|e| refusal_without_text(0, &e))?;
        let mut bytes = fetched.to_vec();
        let mut insn = decode(&bytes, ctx.bitness(), ctx.regs.rip);
        if insn.is_invalid() {
            // The kernel's fetch stops at a page boundary on some hosts: fetch again through
            // the guest's page tables, which reach the next page.
            bytes = ctx
                .fetch_instruction()
                .map_err(|e| refusal_without_text(ctx.regs.rip, &e))?;
            insn = decode(&bytes, ctx.bitness(), ctx.regs.rip);
        }
        let refuse = |reason: String| refusal(&insn, &bytes, reason);
        if insn.is_invalid() {
            return Err(refuse("not a valid instruction".into()));
        }
        let outcome = {
            let _atomic = needs_lock(&insn).then(|| lock(&self.atomic));
            execute(&mut ctx, &insn)
        };
        match outcome {
            Ok(Outcome::Done) => ctx.finish(insn.len() as u64),
            Ok(Outcome::Jumped) => ctx.finish(0),
            Ok(Outcome::Exception(e)) => ctx.raise(e, insn.len() as u64),
            Err(Failure::Unsupported(why)) => return Err(refuse(why)),
            Err(Failure::Vcpu(e)) => return Err(refuse(format!("vCPU state: {e}"))),
        }
        .map_err(|e| refuse(format!("vCPU state: {e}")))?;
        let mut counts = lock(&self.counts);
        let count = counts.entry(mnemonic_name(&insn)).or_default();
        if *count == 0 {
            log::info!(
                "completing `{}` for the kernel's emulator (first at RIP {:#x})",
                disassemble(&insn),
                insn.ip()
            );
        }
        *count += 1;
        Ok(())
    }

    /// Completions so far, by mnemonic (lower case, as disassemblers print them).
    pub fn counts(&self) -> BTreeMap<String, u64> {
        lock(&self.counts).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decodes one instruction of `bitness` (16, 32 or 64) at `rip`.
pub fn decode(bytes: &[u8], bitness: u32, rip: u64) -> Instruction {
    let mut decoder = Decoder::with_ip(bitness, bytes, rip, DecoderOptions::NONE);
    decoder.decode()
}

/// The instruction in Intel syntax, as the refusal prints it.
pub fn disassemble(insn: &Instruction) -> String {
    let mut text = String::new();
    IntelFormatter::new().format(insn, &mut text);
    text
}

fn mnemonic_name(insn: &Instruction) -> String {
    format!("{:?}", insn.mnemonic()).to_ascii_lowercase()
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn refusal(insn: &Instruction, bytes: &[u8], reason: String) -> Refusal {
    let len = if insn.is_invalid() {
        bytes.len()
    } else {
        insn.len()
    };
    Refusal {
        text: disassemble(insn),
        bytes: hex(&bytes[..len.min(bytes.len())]),
        rip: insn.ip(),
        reason,
    }
}

fn refusal_without_text(rip: u64, e: &Failure) -> Refusal {
    Refusal {
        text: "?".into(),
        bytes: String::new(),
        rip,
        reason: match e {
            Failure::Unsupported(why) => why.clone(),
            Failure::Vcpu(e) => format!("vCPU state: {e}"),
        },
    }
}

fn needs_lock(insn: &Instruction) -> bool {
    matches!(insn.mnemonic(), Mnemonic::Cmpxchg16b | Mnemonic::Cmpxchg8b)
}

/// Dispatches on the mnemonic to the module that implements it.
fn execute(ctx: &mut Context, insn: &Instruction) -> Step {
    if let Some(step) = x87::execute(ctx, insn) {
        return step;
    }
    if let Some(step) = xsave::execute(ctx, insn) {
        return step;
    }
    if let Some(step) = scalar::execute(ctx, insn) {
        return step;
    }
    if let Some(step) = iret::execute(ctx, insn) {
        return step;
    }
    Err(Failure::Unsupported(
        "the instruction is not one ferrovm completes".into(),
    ))
}
