use crate::{
    CpuidEntry, FpuState, LapicState, MpState, MsrEntry, Result, SpecialRegisters,
    StandardRegisters, VcpuEvents, VcpuKicker, Xcr, XsaveState,
};

/// Why `Vcpu::run` returned, in backend-neutral form.
///
/// Data an exit asks for (IN, MMIO read, RDMSR) is written into the slice or reference the
/// exit carries; the backend completes the instruction on the *next* `run`. That one shape
/// fits both kernels: KVM reads the data out of `kvm_run` on re-entry, while bhyve (whose
/// RIP is already past the instruction) has RAX or the decoded destination register written
/// by the backend before it re-enters.
#[derive(Debug)]
pub enum VcpuExit<'a> {
    /// `data` holds one access of `size` bytes, or several in a row for string I/O
    /// (`REP INS`), each to be served in turn.
    IoIn {
        port: u16,
        size: usize,
        data: &'a mut [u8],
    },
    IoOut {
        port: u16,
        size: usize,
        data: &'a [u8],
    },
    MmioRead {
        addr: u64,
        data: &'a mut [u8],
    },
    MmioWrite {
        addr: u64,
        data: &'a [u8],
    },
    /// An MSR the kernel left to user space: set `value`, or set `error` non-zero to inject #GP.
    MsrRead {
        index: u32,
        value: &'a mut u64,
        error: &'a mut u8,
    },
    MsrWrite {
        index: u32,
        value: u64,
        error: &'a mut u8,
    },
    /// HLT that the kernel did not absorb (no in-kernel LAPIC).
    Halt,
    /// Triple fault.
    Shutdown,
    /// The guest asked the platform for a reset or a power-off through the kernel.
    Reset,
    PowerOff,
    /// Split irqchip: the guest EOIed a level-triggered vector of the user-space IOAPIC.
    IoapicEoi {
        vector: u8,
    },
    /// `run` returned because the vCPU was kicked (or a signal arrived).
    Interrupted,
    /// An exit that carries no work; re-enter.
    Spurious,
    /// The kernel's instruction emulator met an instruction it lacks (hosts that emulate
    /// part of the guest, such as KVM's PVM backend): `bytes` are the instruction's bytes as
    /// the kernel fetched them (up to 15; empty if it gave none). RIP is on the instruction;
    /// user space completes it or stops the VM.
    InstructionNotEmulated {
        bytes: Vec<u8>,
    },
    /// The kernel could not continue.
    InternalError {
        detail: String,
    },
    FailEntry {
        reason: u64,
    },
    /// Anything else; the string names it for the error report.
    Unsupported(String),
}

/// One virtual CPU. Owned by the thread that runs it.
pub trait Vcpu: Send {
    fn id(&self) -> u32;
    fn run(&mut self) -> Result<VcpuExit<'_>>;
    /// Called on the thread that will run this vCPU: returns the handle other threads use to
    /// make `run` return promptly, even if the request races with entry into the guest.
    fn bind_kicker(&mut self) -> Result<VcpuKicker>;
    /// Completes the instruction of the last exit (an IN, MMIO read, ...) without running
    /// guest code, so that the vCPU's state is consistent before it is saved.
    fn finish_pending_exit(&mut self) -> Result<()>;

    /// External interrupts from a user-space 8259 (split irqchip): whether the vCPU can take
    /// one now, asking the kernel to exit as soon as it can, and handing one over.
    fn ready_for_interrupt(&self) -> bool;
    fn request_interrupt_window(&mut self, on: bool);
    fn inject_external_interrupt(&self, vector: u8) -> Result<()>;

    fn regs(&self) -> Result<StandardRegisters>;
    fn set_regs(&self, regs: &StandardRegisters) -> Result<()>;
    fn sregs(&self) -> Result<SpecialRegisters>;
    fn set_sregs(&self, sregs: &SpecialRegisters) -> Result<()>;
    fn fpu(&self) -> Result<FpuState>;
    fn set_fpu(&self, fpu: &FpuState) -> Result<()>;
    fn xsave(&self) -> Result<XsaveState>;
    fn set_xsave(&self, xsave: &XsaveState) -> Result<()>;
    fn xcrs(&self) -> Result<Vec<Xcr>>;
    fn set_xcrs(&self, xcrs: &[Xcr]) -> Result<()>;
    /// Reads the listed MSRs; MSRs the kernel does not know are left out.
    fn msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>>;
    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<()>;
    fn set_cpuid(&self, entries: &[CpuidEntry]) -> Result<()>;
    /// Configures the vCPU's machine-check architecture: IA32_MCG_CAP = `mcg_cap` (a
    /// subset of `Hypervisor::supported_mcg_cap`). Call before setting MCG/MCi MSRs.
    fn setup_machine_check(&self, _mcg_cap: u64) -> Result<()> {
        Err(crate::HypervisorError::Unsupported(
            "configuring machine checks".into(),
        ))
    }
    /// The CPUID the vCPU presents (what `set_cpuid` installed; empty before that).
    fn cpuid(&self) -> Result<Vec<CpuidEntry>>;
    fn lapic(&self) -> Result<LapicState>;
    fn set_lapic(&self, lapic: &LapicState) -> Result<()>;
    fn mp_state(&self) -> Result<MpState>;
    fn set_mp_state(&self, state: MpState) -> Result<()>;
    fn vcpu_events(&self) -> Result<VcpuEvents>;
    fn set_vcpu_events(&self, events: &VcpuEvents) -> Result<()>;
}
