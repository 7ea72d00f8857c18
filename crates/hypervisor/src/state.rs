//! The whole state of a vCPU, for snapshots and live migration, and the order in which it
//! is saved and restored. Backend-neutral: it works through the [`Vcpu`] trait.
//!
//! Machine-level order on restore (the caller's side): create the VM and its irqchip, map
//! and fill guest memory, create every vCPU, restore the kernel's VM state
//! (`Vm::set_irqchip_state`, kernel mode; on bhyve that includes the vCPUs' VMCS/VMCB and
//! LAPICs, so the vCPUs must exist) or the user-space controllers (split mode),
//! [`restore_vcpu_state`] each vCPU, `Vm::set_clock`, then start the vCPUs.
//!
//! Parts a backend cannot read or write through its vCPU ioctls (the vCPU answers
//! `HypervisorError::Unsupported`: bhyve's FPU/XSAVE area, XCRs and LAPIC) are left out of
//! the [`VcpuState`] and skipped on restore; the backend carries what its kernel saves of
//! them in `Vm::irqchip_state`.

use serde::{Deserialize, Serialize};

use crate::{
    CpuidEntry, FpuState, HypervisorError, LapicState, MpState, MsrEntry, Result, SpecialRegisters,
    StandardRegisters, Vcpu, VcpuEvents, Xcr, XsaveState, LAPIC_REGS_SIZE,
};

/// Architectural and KVM paravirtual MSR numbers a snapshot must carry.
pub mod msr {
    pub const IA32_TSC: u32 = 0x10;
    /// kvmclock, original numbers.
    pub const KVM_WALL_CLOCK: u32 = 0x11;
    pub const KVM_SYSTEM_TIME: u32 = 0x12;
    pub const IA32_APIC_BASE: u32 = 0x1b;
    pub const IA32_TSC_ADJUST: u32 = 0x3b;
    pub const IA32_SYSENTER_CS: u32 = 0x174;
    pub const IA32_SYSENTER_ESP: u32 = 0x175;
    pub const IA32_SYSENTER_EIP: u32 = 0x176;
    pub const IA32_MISC_ENABLE: u32 = 0x1a0;
    pub const IA32_PAT: u32 = 0x277;
    pub const IA32_TSC_DEADLINE: u32 = 0x6e0;
    pub const STAR: u32 = 0xc000_0081;
    pub const LSTAR: u32 = 0xc000_0082;
    pub const CSTAR: u32 = 0xc000_0083;
    pub const SFMASK: u32 = 0xc000_0084;
    pub const FS_BASE: u32 = 0xc000_0100;
    pub const GS_BASE: u32 = 0xc000_0101;
    pub const KERNEL_GS_BASE: u32 = 0xc000_0102;
    pub const TSC_AUX: u32 = 0xc000_0103;
    /// kvmclock and the other KVM paravirtual MSRs ("KVM" << 8 | n).
    pub const KVM_WALL_CLOCK_NEW: u32 = 0x4b56_4d00;
    pub const KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
    pub const KVM_ASYNC_PF_EN: u32 = 0x4b56_4d02;
    pub const KVM_STEAL_TIME: u32 = 0x4b56_4d03;
    pub const KVM_PV_EOI_EN: u32 = 0x4b56_4d04;
    pub const KVM_POLL_CONTROL: u32 = 0x4b56_4d05;
    pub const KVM_ASYNC_PF_INT: u32 = 0x4b56_4d06;
}

/// MSRs [`save_vcpu_state`] always asks for, on top of the caller's list (the kernel's
/// `Hypervisor::msr_index_list`). EFER is not here: it travels in the special registers.
/// Those the vCPU cannot read (a kernel without kvmclock, say) are left out of the state.
pub const SNAPSHOT_MSRS: &[u32] = &[
    msr::IA32_TSC,
    msr::IA32_TSC_ADJUST,
    msr::IA32_APIC_BASE,
    msr::IA32_SYSENTER_CS,
    msr::IA32_SYSENTER_ESP,
    msr::IA32_SYSENTER_EIP,
    msr::STAR,
    msr::LSTAR,
    msr::CSTAR,
    msr::SFMASK,
    msr::KERNEL_GS_BASE,
    msr::FS_BASE,
    msr::GS_BASE,
    msr::TSC_AUX,
    msr::IA32_PAT,
    msr::IA32_MISC_ENABLE,
    msr::KVM_WALL_CLOCK,
    msr::KVM_SYSTEM_TIME,
    msr::KVM_WALL_CLOCK_NEW,
    msr::KVM_SYSTEM_TIME_NEW,
    msr::KVM_ASYNC_PF_EN,
    msr::KVM_STEAL_TIME,
    msr::KVM_PV_EOI_EN,
    msr::KVM_POLL_CONTROL,
    msr::KVM_ASYNC_PF_INT,
    msr::IA32_TSC_DEADLINE,
];

/// Everything needed to resume a vCPU elsewhere.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// The CPUID the guest saw; installed first on restore so the guest keeps seeing the
    /// same CPU. Empty: leave the destination vCPU's CPUID as it is.
    #[serde(default)]
    pub cpuid: Vec<CpuidEntry>,
    pub mp_state: MpState,
    pub regs: StandardRegisters,
    pub sregs: SpecialRegisters,
    /// x87/SSE state; restored only when there is no XSAVE area (which contains it).
    /// `None` from a backend without an FPU ioctl (bhyve).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fpu: Option<FpuState>,
    /// The XSAVE area; `None` from a kernel that cannot provide it.
    pub xsave: Option<XsaveState>,
    /// Extended control registers (XCR0); empty from a kernel without XCR support.
    pub xcrs: Vec<Xcr>,
    /// The in-kernel local APIC (both irqchip modes keep it in the kernel). `None` from a
    /// backend whose LAPIC travels in the VM's kernel state instead (bhyve).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lapic: Option<LapicState>,
    /// Restored with IA32_TSC first and IA32_TSC_DEADLINE last, whatever the order here.
    pub msrs: Vec<MsrEntry>,
    pub vcpu_events: VcpuEvents,
}

/// Largest number of XCRs any backend keeps (KVM_MAX_XCRS).
const MAX_XCRS: usize = 16;

impl VcpuState {
    /// Checks what the kernel would otherwise take on trust or silently truncate. The
    /// kernel validates the rest (control registers, XCR0, MSR values) and fails the
    /// restore with an error of its own.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(HypervisorError::Invalid(format!("vCPU state: {what}")));
        if let Some(lapic) = &self.lapic {
            if lapic.regs.len() != LAPIC_REGS_SIZE {
                return bad(format!(
                    "LAPIC page of {} bytes (expected {LAPIC_REGS_SIZE})",
                    lapic.regs.len()
                ));
            }
        }
        if self.xcrs.len() > MAX_XCRS {
            return bad(format!("{} XCRs", self.xcrs.len()));
        }
        let s = &self.sregs;
        for (name, seg) in [
            ("cs", &s.cs),
            ("ds", &s.ds),
            ("es", &s.es),
            ("fs", &s.fs),
            ("gs", &s.gs),
            ("ss", &s.ss),
            ("tr", &s.tr),
            ("ldt", &s.ldt),
        ] {
            if seg.dpl > 3 || seg.type_ > 0xf {
                return bad(format!(
                    "segment {name} has DPL {} and type {:#x}",
                    seg.dpl, seg.type_
                ));
            }
        }
        let e = &self.vcpu_events;
        if e.exception_nr >= 32 {
            return bad(format!("exception vector {}", e.exception_nr));
        }
        if e.interrupt_shadow > 3 {
            return bad(format!("interrupt shadow {:#x}", e.interrupt_shadow));
        }
        if e.sipi_vector > 0xff {
            return bad(format!("SIPI vector {:#x}", e.sipi_vector));
        }
        Ok(())
    }
}

/// The MSRs to read: [`SNAPSHOT_MSRS`] first, then the caller's, without repeats.
fn msrs_to_read(extra: &[u32]) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::with_capacity(SNAPSHOT_MSRS.len() + extra.len());
    for &index in SNAPSHOT_MSRS.iter().chain(extra) {
        if !out.contains(&index) {
            out.push(index);
        }
    }
    out
}

/// The order MSRs are written back in: the TSC first (the TSC deadline is relative to it),
/// the TSC deadline last (it only takes once the LAPIC timer is in TSC-deadline mode and the
/// TSC is right), the rest as saved.
fn msrs_in_restore_order(msrs: &[MsrEntry]) -> Vec<MsrEntry> {
    let rank = |m: &MsrEntry| match m.index {
        msr::IA32_TSC => 0,
        msr::IA32_TSC_DEADLINE => 2,
        _ => 1,
    };
    let mut out = msrs.to_vec();
    out.sort_by_key(rank); // stable: the rest keep their order
    out
}

/// Captures the state of a stopped vCPU.
///
/// The vCPU must not be running, and its last `run` must have returned
/// `VcpuExit::Interrupted` (a kick, as a pause does): after an I/O, MMIO or MSR exit the
/// instruction is only completed by the next `run`, and until then part of it lives in
/// the kernel where no GET ioctl can see it (RIP still points at an OUT, the data of an IN
/// is not in RAX yet). Kicking and re-entering completes it without running guest code.
///
/// `msr_indices` is normally `Hypervisor::msr_index_list()`; [`SNAPSHOT_MSRS`] are added.
/// MSRs the vCPU cannot read are left out.
///
/// The FPU, XSAVE area, XCRs and LAPIC are left out when the vCPU answers
/// `HypervisorError::Unsupported` for them: the backend has no vCPU ioctl for that part
/// (bhyve, whose kernel saves it with the VM's state, `Vm::irqchip_state`). Any other
/// error fails the save.
///
/// Order: MP state first (reading it makes KVM process a pending INIT/SIPI, which changes
/// the rest), the vCPU events last (the other GETs may still move an event along).
pub fn save_vcpu_state(vcpu: &dyn Vcpu, msr_indices: &[u32]) -> Result<VcpuState> {
    let mp_state = vcpu.mp_state()?;
    let regs = vcpu.regs()?;
    let sregs = vcpu.sregs()?;
    let fpu = unless_unsupported(vcpu.fpu())?;
    let xsave = unless_unsupported(vcpu.xsave())?;
    let xcrs = unless_unsupported(vcpu.xcrs())?.unwrap_or_default();
    let lapic = unless_unsupported(vcpu.lapic())?;
    let cpuid = vcpu.cpuid()?;
    let msrs = vcpu.msrs(&msrs_to_read(msr_indices))?;
    let vcpu_events = vcpu.vcpu_events()?;
    Ok(VcpuState {
        cpuid,
        mp_state,
        regs,
        sregs,
        fpu,
        xsave,
        xcrs,
        lapic,
        msrs,
        vcpu_events,
    })
}

/// `None` for a part the backend says it has no vCPU ioctl for.
fn unless_unsupported<T>(part: Result<T>) -> Result<Option<T>> {
    match part {
        Ok(v) => Ok(Some(v)),
        Err(HypervisorError::Unsupported(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Loads `state` into a vCPU that has not run yet (normally a new one, on a new VM).
///
/// The state is validated first; nothing is written if it is malformed. Order, as KVM
/// needs it (the same as Firecracker's and Cloud Hypervisor's):
///
/// 1. CPUID: what the other calls accept (XSAVE features, MSRs, the TSC deadline timer)
///    depends on it, and KVM refuses to change it once the vCPU has run;
/// 2. MP state: whether the vCPU is runnable, halted or waiting for SIPI;
/// 3. general registers: KVM_SET_REGS drops any pending exception, so they must come
///    before the events that carry it;
/// 4. special registers (CR0/CR4/EFER, segments, APIC base): before the LAPIC, whose
///    base address and enable bit they set;
/// 5. XSAVE area (or the FPU without it), then XCR0;
/// 6. LAPIC: before the MSRs, because the TSC deadline MSR is only taken when the LAPIC
///    timer is already in TSC-deadline mode;
///
/// (parts the state does not carry, because the saving backend had no vCPU ioctl for
/// them, are skipped and stay as the vCPU has them: on bhyve, `Vm::set_irqchip_state` has
/// already put them back);
/// 7. MSRs, TSC first and TSC deadline last;
/// 8. vCPU events last: pending/injected exception, interrupt, NMI and SIPI, which the
///    earlier calls may have cleared.
pub fn restore_vcpu_state(vcpu: &dyn Vcpu, state: &VcpuState) -> Result<()> {
    state.validate()?;
    if !state.cpuid.is_empty() {
        vcpu.set_cpuid(&state.cpuid)?;
    }
    vcpu.set_mp_state(state.mp_state)?;
    vcpu.set_regs(&state.regs)?;
    vcpu.set_sregs(&state.sregs)?;
    match (&state.xsave, &state.fpu) {
        (Some(xsave), _) => vcpu.set_xsave(xsave)?,
        (None, Some(fpu)) => vcpu.set_fpu(fpu)?,
        (None, None) => {}
    }
    if !state.xcrs.is_empty() {
        vcpu.set_xcrs(&state.xcrs)?;
    }
    if let Some(lapic) = &state.lapic {
        vcpu.set_lapic(lapic)?;
    }
    vcpu.set_msrs(&msrs_in_restore_order(&state.msrs))?;
    vcpu.set_vcpu_events(&state.vcpu_events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msr_list_has_the_essentials_once() {
        let list = msrs_to_read(&[0x10, 0x2ff, 0xc000_0082, 0x2ff]);
        assert_eq!(&list[..SNAPSHOT_MSRS.len()], SNAPSHOT_MSRS);
        assert_eq!(list.len(), SNAPSHOT_MSRS.len() + 1);
        assert_eq!(list.last(), Some(&0x2ff));
    }

    #[test]
    fn tsc_first_and_deadline_last_on_restore() {
        let m = |index| MsrEntry { index, data: 0 };
        let saved = [
            m(msr::IA32_TSC_DEADLINE),
            m(0x174),
            m(msr::IA32_TSC),
            m(0x175),
        ];
        let order: Vec<u32> = msrs_in_restore_order(&saved)
            .iter()
            .map(|e| e.index)
            .collect();
        assert_eq!(order, [msr::IA32_TSC, 0x174, 0x175, msr::IA32_TSC_DEADLINE]);
    }

    #[test]
    fn validation_refuses_malformed_state() {
        assert!(VcpuState::default().validate().is_ok());
        let mut s = VcpuState {
            lapic: Some(LapicState::default()),
            ..Default::default()
        };
        assert!(s.validate().is_ok());
        s.lapic.as_mut().unwrap().regs.truncate(100);
        assert!(s.validate().is_err());
        let mut s = VcpuState::default();
        s.sregs.cs.dpl = 4;
        assert!(s.validate().is_err());
        let mut s = VcpuState::default();
        s.vcpu_events.exception_nr = 200;
        assert!(s.validate().is_err());
        let s = VcpuState {
            xcrs: vec![Xcr::default(); 17],
            ..Default::default()
        };
        assert!(s.validate().is_err());
    }

    #[test]
    fn serde_round_trip_and_garbage() {
        let mut s = VcpuState::default();
        s.regs.rip = 0x1234;
        s.msrs.push(MsrEntry {
            index: msr::LSTAR,
            data: 0xffff_ffff_8100_0000,
        });
        s.xsave = Some(XsaveState {
            region: vec![7; 1024],
        });
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<VcpuState>(&json).unwrap(), s);
        assert!(serde_json::from_str::<VcpuState>("{\"regs\": 5}").is_err());
        // With FPU and LAPIC (KVM's), the fields keep the names and shapes KVM snapshots
        // have always had; without them (bhyve's), the state round-trips too.
        s.fpu = Some(FpuState::default());
        s.lapic = Some(LapicState::default());
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"fpu\":{\"fpr\":"), "{json}");
        assert!(json.contains("\"lapic\":{\"regs\":["), "{json}");
        assert_eq!(serde_json::from_str::<VcpuState>(&json).unwrap(), s);
        let bare = VcpuState::default();
        let json = serde_json::to_string(&bare).unwrap();
        assert!(!json.contains("fpu") && !json.contains("lapic"), "{json}");
        assert_eq!(serde_json::from_str::<VcpuState>(&json).unwrap(), bare);
        assert!(serde_json::from_str::<VcpuState>(&json[..json.len() / 2]).is_err());
    }
}
