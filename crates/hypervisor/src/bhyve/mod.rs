//! The FreeBSD bhyve backend: vmm.ko driven through /dev/vmm/NAME.
//!
//! bhyve differs from KVM in ways the traits hide:
//!
//! * **One device per VM, no vCPU descriptors.** Every vCPU ioctl carries the vCPU id. VMs
//!   are created through /dev/vmmctl (FreeBSD 15) or the `hw.vmm.create` sysctl (14) and
//!   destroyed when the [`BhyveVm`] goes away.
//! * **The kernel owns guest memory.** `Vm::map_memory` allocates a system-memory segment
//!   per slot (VM_ALLOC_MEMSEG), maps it at the slot's guest address (VM_MMAP_MEMSEG) and
//!   then maps the VM device at offset = GPA over the caller's host range (`MAP_FIXED`), so
//!   the caller's mapping *becomes* guest memory. Pages already written are copied over.
//! * **The interrupt controllers are always in the kernel** (LAPIC, IOAPIC, 8259 pair, PIT,
//!   HPET, RTC, ACPI PM timer): `IrqChipMode::Split` is refused and
//!   `Capabilities::irqchip_split` is false.
//! * **RIP is already past the instruction at every exit** (the kernel computed `nextrip =
//!   rip + inst_length`). The data of an IN, an MMIO read or an RDMSR is therefore written
//!   into RAX (or the decoded destination register) with VM_SET_REGISTER before the next
//!   VM_RUN, which only continues. `Vcpu::regs` reports that advanced RIP, so a VMM that
//!   reads and writes back registers after an exit cannot re-execute an IN/OUT.
//! * **No dirty-page tracking upstream**: the dirty-log methods fail with a clear error and
//!   `Capabilities::dirty_log_bitmap` is false; live migration is refused, while a
//!   stop-and-copy migration still works.
//! * **Snapshots through VM_SNAPSHOT_REQ** (kernels built with `options BHYVE_SNAPSHOT`,
//!   probed when a VM is created: `Capabilities::kernel_snapshot`). `Vm::irqchip_state`
//!   returns what vmm.ko saves for the VM (devices, LAPICs, VMCS/VMCB) as named blobs; the
//!   vCPU ioctls keep serving registers, segments, MSRs and the pending event, and answer
//!   Unsupported for the FPU, XCRs and LAPIC, which `save_vcpu_state` then leaves out.
//! * **Injection.** `Vm::signal_msi` is VM_LAPIC_MSI, which takes no vCPU lock and wakes the
//!   target itself; `Vm::set_irq_line` drives the in-kernel 8259/IOAPIC. NMIs and
//!   exceptions (VM_INJECT_NMI, VM_INJECT_EXCEPTION) and VM_LAPIC_IRQ lock the target vCPU,
//!   i.e. wait until it leaves VM_RUN; they are offered only on [`BhyveVcpu`], which is
//!   owned by the thread that runs it, so they are only ever issued by that thread.
//! * **Application processors** start when the BSP's LAPIC sends INIT/SIPI: the kernel
//!   reports a SPINUP_AP exit on the sender, the backend hands the SIPI to the AP's thread,
//!   which sets the real-mode start state itself (CS = vector << 8, IP = 0) and activates
//!   its vCPU (VM_ACTIVATE_CPU).
//! * **Kicks.** A kick sets the high byte of the vCPU id in the vCPU's own `struct vm_run`.
//!   If it lands before VM_RUN reaches the kernel, the kernel sees an impossible vCPU id
//!   and fails at once (EINVAL); if it lands inside VM_RUN, the signal makes the kernel
//!   return a BOGUS exit. Either way `run` returns `VcpuExit::Interrupted`: no kick is
//!   lost, whatever instant it lands.
//!
//! Every ioctl goes through [`VmmTransport`], so all of this is unit-tested on Linux
//! against a fake kernel. Nothing here has run on FreeBSD yet (see docs/bhyve.md).

pub mod abi;
mod emul;
pub mod exit;
mod segment;
mod snapshot;
pub mod transport;
mod vcpu;
mod vm;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub use transport::{FdTransport, HostInfo, VmmControl, VmmTransport};
pub use vcpu::BhyveVcpu;
pub use vm::BhyveVm;

use crate::{AccelKind, Capabilities, CpuidEntry, Hypervisor, HypervisorError, Result, Vm};

/// How vCPUs are configured (VM_SET_CAPABILITY, VM_SET_X2APIC_STATE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BhyveOptions {
    /// VM_CAP_HALT_EXIT: a HLT puts the vCPU thread to sleep in the kernel until an
    /// interrupt arrives, instead of halting a host CPU (bhyve's `-H`).
    pub halt_exit: bool,
    /// VM_CAP_PAUSE_EXIT: every PAUSE exits to user space (bhyve's `-P`). Off: a spinning
    /// guest spins in the guest and costs no exits.
    pub pause_exit: bool,
    /// VM_CAP_UNRESTRICTED_GUEST: real mode runs natively. Needed to start APs at their
    /// SIPI vector.
    pub unrestricted_guest: bool,
    /// The local APICs start in x2APIC mode (bhyve's `-x`). vmm.ko fixes the APIC mode when
    /// the vCPU is created; the guest cannot switch it.
    pub x2apic: bool,
    /// Guest memory wired (VM_MEMMAP_F_WIRED).
    pub wired: bool,
}

impl Default for BhyveOptions {
    fn default() -> Self {
        BhyveOptions {
            halt_exit: true,
            pause_exit: false,
            unrestricted_guest: true,
            x2apic: false,
            wired: false,
        }
    }
}

/// The bhyve accelerator.
pub struct BhyveHypervisor {
    control: Arc<dyn VmmControl>,
    options: BhyveOptions,
    /// VM_SNAPSHOT_REQ, as the last VM created found it (`Capabilities::kernel_snapshot`).
    kernel_snapshot: snapshot::Support,
}

static VM_COUNTER: AtomicU32 = AtomicU32::new(0);

impl BhyveHypervisor {
    /// Opens vmm.ko with the default options. Off FreeBSD this fails with a message naming
    /// /dev/vmm.
    pub fn new() -> Result<Self> {
        Self::open(BhyveOptions::default())
    }

    /// Opens vmm.ko. Off FreeBSD this fails with a message naming /dev/vmm.
    #[cfg(target_os = "freebsd")]
    pub fn open(options: BhyveOptions) -> Result<Self> {
        let control = transport::freebsd::FreeBsdControl::open().map_err(|source| {
            HypervisorError::DeviceUnavailable {
                path: "/dev/vmm".into(),
                source,
            }
        })?;
        Ok(Self::with_control(Arc::new(control), options))
    }

    /// Opens vmm.ko. Off FreeBSD this fails with a message naming /dev/vmm.
    #[cfg(not(target_os = "freebsd"))]
    pub fn open(_options: BhyveOptions) -> Result<Self> {
        Err(HypervisorError::Unsupported(
            "bhyve (/dev/vmm is absent; the bhyve backend runs on FreeBSD only)".into(),
        ))
    }

    /// The accelerator over any control interface (a fake one in tests).
    pub fn with_control(control: Arc<dyn VmmControl>, options: BhyveOptions) -> Self {
        BhyveHypervisor {
            control,
            options,
            kernel_snapshot: snapshot::Support::default(),
        }
    }

    pub fn options(&self) -> BhyveOptions {
        self.options
    }

    /// Creates a VM with its concrete type (the trait returns `Arc<dyn Vm>`).
    pub fn create_bhyve_vm(&self) -> Result<Arc<BhyveVm>> {
        let name = format!(
            "ferrovm-{}-{}",
            std::process::id(),
            VM_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let dev = self
            .control
            .create_vm(&name)
            .map_err(|source| HypervisorError::Ioctl {
                op: "creating a bhyve VM",
                source,
            })?;
        let vm = Arc::new(BhyveVm::new(name, self.control.clone(), dev, self.options));
        // One ioctl on the new VM says whether the kernel was built with BHYVE_SNAPSHOT.
        if let Some(present) = snapshot::probe(&vm.shared) {
            self.kernel_snapshot.set(Some(present));
        }
        Ok(vm)
    }
}

/// MSRs whose state bhyve exposes through its register ioctls.
pub(crate) const MSR_EFER: u32 = 0xc000_0080;
pub(crate) const MSR_FS_BASE: u32 = 0xc000_0100;
pub(crate) const MSR_GS_BASE: u32 = 0xc000_0101;
pub(crate) const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

impl Hypervisor for BhyveHypervisor {
    fn kind(&self) -> AccelKind {
        AccelKind::Bhyve
    }

    fn capabilities(&self) -> Capabilities {
        let abi = self.control.abi();
        let host = self.control.host_info();
        Capabilities {
            accelerator: "bhyve".into(),
            backend: format!(
                "vmm.ko, FreeBSD {}, {}",
                if host.os_release.is_empty() {
                    abi.major().to_string()
                } else {
                    host.os_release.clone()
                },
                host.vendor
            ),
            api_version: abi.major(),
            max_vcpus: host.max_vcpus,
            max_memslots: abi.max_sysmem_segments() as usize,
            // vmm.ko has neither: devices take notifications as exits and inject MSIs.
            irqfd: false,
            ioeventfd: false,
            // LAPIC, IOAPIC, 8259, PIT, HPET, RTC and PM timer are always in the kernel;
            // there is no way to move the PIC/IOAPIC to user space.
            irqchip_kernel: true,
            irqchip_split: false,
            // VM_LAPIC_MSI.
            msi_injection: true,
            // Upstream FreeBSD has no dirty-page tracking (no dirty bitmap, no ring, no
            // manual protect): live migration is not possible, stop-and-copy is.
            dirty_log_bitmap: false,
            dirty_log_ring_bytes: 0,
            dirty_log_manual_protect: false,
            // VM_SET_X2APIC_STATE.
            x2apic_api: true,
            // MSRs vmm.ko does not implement exit to user space as RDMSR/WRMSR.
            user_space_msr: true,
            // No kvm_run-style byte; kicks go through the vm_run structure (see module doc).
            immediate_exit: false,
            // No vCPU ioctl reads or writes the guest FPU/XSAVE state or XCRs (XCR0 travels
            // in VM_SNAPSHOT_REQ's `vm` structure; the FPU registers nowhere); the event
            // being delivered is VM_GET/SET_INTINFO, not KVM's full event state.
            xsave: false,
            xcrs: false,
            vcpu_events: false,
            tsc_control: false,
            // VM_SNAPSHOT_REQ exists only in kernels built with `options BHYVE_SNAPSHOT`;
            // known once a VM has been created (the probe needs one).
            kernel_snapshot: self.kernel_snapshot.get(),
            tpr_shadow: host.tpr_shadow,
            apic_virtualization: host.apic_virtualization,
            posted_interrupts: host.posted_interrupts,
            // vmm_ioport.c (FreeBSD 11 to 15) serves the RTC at 0x70-0x71 and the PM timer
            // at IO_PMTMR (vpmtmr.h) in the kernel.
            // bhyve offers no KVM paravirtual leaf, so nothing depends on this.
            hypercalls: true,
            rtc_in_kernel: true,
            pm_timer_port: Some(abi::IO_PMTMR),
        }
    }

    fn create_vm(&self) -> Result<Arc<dyn Vm>> {
        Ok(self.create_bhyve_vm()?)
    }

    /// vmm.ko emulates CPUID in the kernel (topology from VM_SET_TOPOLOGY) and has no ioctl
    /// to read or change it: there is nothing to report.
    fn supported_cpuid(&self) -> Result<Vec<CpuidEntry>> {
        Ok(Vec::new())
    }

    fn msr_index_list(&self) -> Result<Vec<u32>> {
        Ok(vec![MSR_FS_BASE, MSR_GS_BASE, MSR_KERNEL_GS_BASE])
    }
}

pub(crate) fn unsupported<T>(what: &str, why: &str) -> Result<T> {
    Err(HypervisorError::Unsupported(format!(
        "{what} on bhyve: {why}"
    )))
}
