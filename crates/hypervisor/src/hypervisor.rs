use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use crate::{CpuidEntry, HypervisorError, MsrEntry, Result, Vm};

/// Which in-kernel hypervisor to drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccelKind {
    /// The first one this host has.
    Auto,
    Kvm,
    Bhyve,
}

impl fmt::Display for AccelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccelKind::Auto => "auto",
            AccelKind::Kvm => "kvm",
            AccelKind::Bhyve => "bhyve",
        })
    }
}

/// What the accelerator offers. `None` means the kernel does not say.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Capabilities {
    pub accelerator: String,
    /// Kernel module or flavour behind the accelerator (e.g. `kvm_intel`, `kvm_amd`, `kvm_pvm`).
    pub backend: String,
    pub api_version: i32,
    pub max_vcpus: usize,
    pub max_memslots: usize,
    pub irqchip_kernel: bool,
    pub irqchip_split: bool,
    pub msi_injection: bool,
    pub dirty_log_bitmap: bool,
    /// Largest dirty ring in bytes; 0 when the kernel has no dirty ring.
    pub dirty_log_ring_bytes: u64,
    pub dirty_log_manual_protect: bool,
    pub x2apic_api: bool,
    pub user_space_msr: bool,
    pub immediate_exit: bool,
    /// Eventfds inject interrupts through GSI routes (`Vm::register_irqfd`).
    pub irqfd: bool,
    /// Guest writes signal eventfds in the kernel (`Vm::register_ioeventfd`).
    pub ioeventfd: bool,
    /// The vCPU ioctls read and write the XSAVE area, the XCRs and the pending events.
    /// Where the kernel has no such ioctl (bhyve: no FPU, XSAVE, XCR or LAPIC access), the
    /// vCPU answers `HypervisorError::Unsupported`, `save_vcpu_state` leaves the part out,
    /// and a snapshot carries what the kernel saves of it in the VM's kernel state
    /// (`Vm::irqchip_state`).
    pub xsave: bool,
    pub xcrs: bool,
    pub vcpu_events: bool,
    pub tsc_control: bool,
    /// The kernel can save and restore its own VM state (`Vm::irqchip_state`), which
    /// snapshots and warm and live migration need. KVM: always. bhyve: only a kernel built
    /// with `options BHYVE_SNAPSHOT` (VM_SNAPSHOT_REQ); `None` until a VM has been created,
    /// since the probe needs one.
    pub kernel_snapshot: Option<bool>,
    /// TPR writes are absorbed by hardware (VMX TPR shadow / flexpriority, or AVIC).
    pub tpr_shadow: Option<bool>,
    /// APIC-register virtualization (VMX APICv / AMD AVIC).
    pub apic_virtualization: Option<bool>,
    pub posted_interrupts: Option<bool>,
    /// The kernel models the MC146818 RTC/CMOS at ports 0x70-0x71 (bhyve); otherwise the
    /// VMM provides it.
    pub rtc_in_kernel: bool,
    /// A guest's VMCALL/VMMCALL is served by the kernel's hypercall handler. Not so on KVM's
    /// PVM backend: its emulator rewrites the instruction in the guest's (by then read-only)
    /// kernel text and the call never completes, so paravirtual features that are
    /// hypercalls (PV IPIs, directed yield, PV unhalt) must not be offered to the guest.
    pub hypercalls: bool,
    /// I/O port of an ACPI PM timer the kernel models (bhyve: 0x408), for the FADT to point
    /// at; `None` when the VMM provides the PM timer.
    pub pm_timer_port: Option<u16>,
}

/// The accelerator: reports its capabilities and creates VMs.
pub trait Hypervisor: Send + Sync {
    fn kind(&self) -> AccelKind;
    fn capabilities(&self) -> Capabilities;
    fn create_vm(&self) -> Result<Arc<dyn Vm>>;
    /// CPUID leaves the kernel can present to a guest.
    fn supported_cpuid(&self) -> Result<Vec<CpuidEntry>>;
    /// MSRs whose state the kernel keeps per vCPU (what a snapshot must save).
    fn msr_index_list(&self) -> Result<Vec<u32>>;
    /// The host's values of the read-only "feature" MSRs among `indices` that the kernel
    /// reports (KVM_GET_MSRS on the system: e.g. the microcode revision), for the VMM to
    /// present to its guests; those the kernel does not report are left out.
    fn feature_msrs(&self, _indices: &[u32]) -> Result<Vec<MsrEntry>> {
        Ok(Vec::new())
    }
    /// The IA32_MCG_CAP bits the kernel can emulate for a guest (machine-check banks in
    /// bits 7:0), or `None` if the VMM cannot configure machine checks.
    fn supported_mcg_cap(&self) -> Result<Option<u64>> {
        Ok(None)
    }
}

/// What the VMM asks of the accelerator beyond its kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccelOptions {
    /// Guest memory stays resident. KVM: nothing to do here (the VMM locks its own mapping).
    /// bhyve: the segments are mapped with VM_MEMMAP_F_WIRED, since an `mlock` of the VMM's
    /// range is lost when vmm.ko's memory is mapped over it.
    pub wired: bool,
}

/// Opens the accelerator the user asked for, with default options.
///
/// `Auto` takes KVM on Linux and bhyve elsewhere. On Linux, `Bhyve` fails with a message
/// that names /dev/vmm (the bhyve backend drives FreeBSD's vmm.ko only).
pub fn open_accelerator(kind: AccelKind) -> Result<Box<dyn Hypervisor>> {
    open_accelerator_with(kind, AccelOptions::default())
}

/// [`open_accelerator`] with options.
pub fn open_accelerator_with(
    kind: AccelKind,
    options: AccelOptions,
) -> Result<Box<dyn Hypervisor>> {
    let bhyve_options = crate::bhyve::BhyveOptions {
        wired: options.wired,
        ..Default::default()
    };
    match kind {
        #[cfg(target_os = "linux")]
        AccelKind::Kvm => Ok(Box::new(crate::kvm::KvmHypervisor::new()?)),
        #[cfg(not(target_os = "linux"))]
        AccelKind::Kvm => Err(HypervisorError::Unsupported(
            "the kvm accelerator is not available: /dev/kvm exists on Linux only".into(),
        )),
        #[cfg(target_os = "linux")]
        AccelKind::Auto => match crate::kvm::KvmHypervisor::new() {
            Ok(kvm) => Ok(Box::new(kvm)),
            Err(err) => Err(HypervisorError::Unsupported(format!(
                "no accelerator found (kvm: {err}; bhyve: /dev/vmm is absent)"
            ))),
        },
        #[cfg(not(target_os = "linux"))]
        AccelKind::Auto => match crate::bhyve::BhyveHypervisor::open(bhyve_options) {
            Ok(bhyve) => Ok(Box::new(bhyve)),
            Err(err) => Err(HypervisorError::Unsupported(format!(
                "no accelerator found (bhyve: {err})"
            ))),
        },
        AccelKind::Bhyve => Ok(Box::new(crate::bhyve::BhyveHypervisor::open(
            bhyve_options,
        )?)),
    }
}
