//! What each vCPU presents to the guest before it first runs: its CPUID and the MSRs the
//! VMM sets beyond the kernel's reset values (the policies are in `boot::cpuid` and
//! `boot::msr`).

use boot::cpuid::{guest_cpuid_on, without_hypercall_features, HostCpu};
use boot::msr::{guest_mcg_cap, guest_msrs, MSR_IA32_UCODE_REV};
use hypervisor::{Capabilities, CpuidEntry, Hypervisor, MsrEntry, Vcpu};

use crate::error::Result;

/// What the accelerator and the host offer, asked once for all vCPUs.
pub struct CpuSetup {
    supported_cpuid: Vec<CpuidEntry>,
    host: HostCpu,
    supported_mcg_cap: Option<u64>,
    host_feature_msrs: Vec<MsrEntry>,
    /// The kernel completes hypercalls (`Capabilities::hypercalls`).
    hypercalls: bool,
}

impl CpuSetup {
    /// `caps` are the accelerator's, already asked for by the machine.
    pub fn new(hv: &dyn Hypervisor, caps: &Capabilities) -> Result<Self> {
        Ok(CpuSetup {
            supported_cpuid: hv.supported_cpuid()?,
            host: HostCpu::detect(),
            supported_mcg_cap: hv.supported_mcg_cap()?,
            host_feature_msrs: hv.feature_msrs(&[MSR_IA32_UCODE_REV])?,
            hypercalls: caps.hypercalls,
        })
    }

    /// Gives vCPU `id` of `cpus` its CPUID, machine-check banks and initial MSRs.
    pub fn configure(&self, vcpu: &dyn Vcpu, id: u32, cpus: u32) -> Result<()> {
        let mut cpuid = guest_cpuid_on(&self.supported_cpuid, &self.host, id, cpus);
        if !self.hypercalls {
            without_hypercall_features(&mut cpuid);
        }
        vcpu.set_cpuid(&cpuid)?;
        let mcg_cap = guest_mcg_cap(&cpuid, self.supported_mcg_cap);
        if let Some(cap) = mcg_cap {
            vcpu.setup_machine_check(cap)?;
        }
        let msrs = guest_msrs(&cpuid, mcg_cap, &self.host_feature_msrs);
        if vcpu.set_msrs(&msrs).is_err() {
            // An older kernel may refuse a value (HWCR.TscFreqSel): the
            // others still go in, and the guest sees the kernel's value for that one.
            for msr in &msrs {
                if let Err(e) = vcpu.set_msrs(std::slice::from_ref(msr)) {
                    log::warn!(
                        "vCPU {id}: MSR {:#x} stays at the kernel's value ({e})",
                        msr.index
                    );
                }
            }
        }
        Ok(())
    }
}
