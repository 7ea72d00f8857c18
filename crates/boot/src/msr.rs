//! The MSR values a vCPU gets before it first runs, beyond the kernel's reset values: what
//! QEMU presents on the same host, so that guests see the same platform (docs/fidelity.md).

use hypervisor::{CpuidEntry, MsrEntry};

use crate::cpuid::{family, is_amd};

/// AMD hardware configuration register.
pub const MSR_K7_HWCR: u32 = 0xc001_0015;
/// HWCR[24] TscFreqSel: the TSC counts at the P0 frequency. Set by firmware on every AMD
/// part of family 0x10 and later; Linux warns ("TSC doesn't count with P0 frequency!") when
/// it finds it clear.
pub const HWCR_TSC_FREQ_SEL: u64 = 1 << 24;
/// Microcode revision (AMD: patch level in bits 31:0; Intel: revision in bits 63:32).
pub const MSR_IA32_UCODE_REV: u32 = 0x8b;
pub const MSR_IA32_MCG_CTL: u32 = 0x17b;
/// IA32_MC0_CTL; bank i's CTL is at `MSR_IA32_MC0_CTL + 4 * i`.
pub const MSR_IA32_MC0_CTL: u32 = 0x400;

/// IA32_MCG_CAP: MCG_CTL is present.
pub const MCG_CTL_P: u64 = 1 << 8;
/// IA32_MCG_CAP: software error recovery is supported.
pub const MCG_SER_P: u64 = 1 << 24;
const MCG_BANKS_MASK: u64 = 0xff;
/// Machine-check banks a guest gets (QEMU's number).
pub const GUEST_MCE_BANKS: u64 = 10;

/// CPUID 1 EDX: machine-check exception (bit 7) and architecture (bit 14).
const EDX_MCE_MCA: u32 = (1 << 7) | (1 << 14);

/// The guest's IA32_MCG_CAP: 10 banks, MCG_CTL and software error recovery, as far as the
/// kernel can emulate them (`supported`); `None` without machine checks in the CPUID or
/// in the kernel, which then keeps its own default.
pub fn guest_mcg_cap(cpuid: &[CpuidEntry], supported: Option<u64>) -> Option<u64> {
    let supported = supported?;
    let features = cpuid.iter().find(|e| e.function == 1)?;
    if features.edx & EDX_MCE_MCA != EDX_MCE_MCA {
        return None;
    }
    let banks = GUEST_MCE_BANKS.min(supported & MCG_BANKS_MASK);
    if banks == 0 {
        return None;
    }
    Some((supported & (MCG_CTL_P | MCG_SER_P)) | banks)
}

/// MSRs to write on a new vCPU whose CPUID is `cpuid`, with IA32_MCG_CAP `mcg_cap` (as set
/// up) and `host_features` the host's feature MSRs the kernel reported.
pub fn guest_msrs(
    cpuid: &[CpuidEntry],
    mcg_cap: Option<u64>,
    host_features: &[MsrEntry],
) -> Vec<MsrEntry> {
    let mut msrs = Vec::new();
    if is_amd(cpuid) && family(cpuid) >= 0x10 {
        msrs.push(MsrEntry {
            index: MSR_K7_HWCR,
            data: HWCR_TSC_FREQ_SEL,
        });
    }
    msrs.extend(
        host_features
            .iter()
            .filter(|m| m.index == MSR_IA32_UCODE_REV)
            .copied(),
    );
    if let Some(cap) = mcg_cap {
        // Every error reporting enabled, as firmware leaves it.
        if cap & MCG_CTL_P != 0 {
            msrs.push(MsrEntry {
                index: MSR_IA32_MCG_CTL,
                data: u64::MAX,
            });
        }
        msrs.extend((0..(cap & MCG_BANKS_MASK) as u32).map(|bank| MsrEntry {
            index: MSR_IA32_MC0_CTL + 4 * bank,
            data: u64::MAX,
        }));
    }
    msrs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, eax: u32, ebx: u32, edx: u32) -> CpuidEntry {
        CpuidEntry {
            function,
            index: 0,
            significant_index: false,
            eax,
            ebx,
            ecx: 0,
            edx,
        }
    }

    fn cpu(vendor_ebx: u32, signature: u32) -> Vec<CpuidEntry> {
        vec![
            entry(0, 0x10, vendor_ebx, 0),
            entry(1, signature, 0, 0x178b_fbff),
        ]
    }

    const AMD: u32 = 0x6874_7541;
    const INTEL: u32 = 0x756e_6547;

    fn value(msrs: &[MsrEntry], index: u32) -> Option<u64> {
        msrs.iter().find(|m| m.index == index).map(|m| m.data)
    }

    #[test]
    fn amd_family_0x10_and_later_get_tsc_freq_sel() {
        let zen3 = guest_msrs(&cpu(AMD, 0x00a0_0f11), None, &[]);
        assert_eq!(value(&zen3, MSR_K7_HWCR), Some(HWCR_TSC_FREQ_SEL));
        let k8 = guest_msrs(&cpu(AMD, 0x0002_0f12), None, &[]);
        assert_eq!(
            value(&k8, MSR_K7_HWCR),
            None,
            "family 0xf has no TscFreqSel"
        );
        let intel = guest_msrs(&cpu(INTEL, 0x0006_06a6), None, &[]);
        assert_eq!(value(&intel, MSR_K7_HWCR), None);
    }

    #[test]
    fn machine_checks_follow_the_kernel_and_the_cpuid() {
        let amd = cpu(AMD, 0x00a0_0f11);
        let kvm = Some(MCG_CTL_P | MCG_SER_P | (1 << 27) | 32);
        let cap = guest_mcg_cap(&amd, kvm);
        assert_eq!(cap, Some(MCG_CTL_P | MCG_SER_P | 10));
        assert_eq!(
            guest_mcg_cap(&amd, Some(4)),
            Some(4),
            "fewer banks, no MCG_CTL"
        );
        assert_eq!(guest_mcg_cap(&amd, None), None);
        let mut no_mca = amd.clone();
        no_mca[1].edx &= !(1 << 14);
        assert_eq!(guest_mcg_cap(&no_mca, kvm), None);

        let msrs = guest_msrs(&amd, cap, &[]);
        assert_eq!(value(&msrs, MSR_IA32_MCG_CTL), Some(u64::MAX));
        assert_eq!(value(&msrs, MSR_IA32_MC0_CTL + 4 * 9), Some(u64::MAX));
        assert_eq!(value(&msrs, MSR_IA32_MC0_CTL + 4 * 10), None);
        let no_ctl = guest_msrs(&amd, Some(2), &[]);
        assert_eq!(value(&no_ctl, MSR_IA32_MCG_CTL), None);
    }

    #[test]
    fn the_host_microcode_revision_is_passed_on() {
        let host = [
            MsrEntry {
                index: MSR_IA32_UCODE_REV,
                data: 0x0100_0065,
            },
            MsrEntry {
                index: 0x10a,
                data: 0x69,
            },
        ];
        let msrs = guest_msrs(&cpu(AMD, 0x00a0_0f11), None, &host);
        assert_eq!(value(&msrs, MSR_IA32_UCODE_REV), Some(0x0100_0065));
        assert_eq!(value(&msrs, 0x10a), None, "only the revision is taken");
    }
}
