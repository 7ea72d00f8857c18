//! The CPUID a guest sees: what the accelerator supports, with the topology of this machine
//! (one socket, one thread per core, APIC ID = vCPU index) and the hypervisor bit filled in
//! per vCPU, and the few values a VMM must supply itself (QEMU supplies the same ones).
//!
//! What differs from QEMU 7.2 `-cpu host` on the same host, and why, is in docs/fidelity.md.

use hypervisor::CpuidEntry;

const LEAF_VENDOR: u32 = 0x0;
const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_TOPOLOGY: u32 = 0x4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;
const LEAF_EXT_FEATURES: u32 = 0x8000_0001;
const LEAF_BRAND_FIRST: u32 = 0x8000_0002;
const LEAF_BRAND_LAST: u32 = 0x8000_0004;
const LEAF_POWER_MANAGEMENT: u32 = 0x8000_0007;
const LEAF_ADDRESS_SIZES: u32 = 0x8000_0008;
const LEAF_AMD_CACHE_TOPOLOGY: u32 = 0x8000_001d;
const LEAF_AMD_EXT_APIC_ID: u32 = 0x8000_001e;

/// KVM's paravirtual feature leaf (after the "KVMKVMKVM" signature at 0x4000_0000).
const LEAF_KVM_FEATURES: u32 = 0x4000_0001;
/// KVM paravirtual features that are hypercalls: PV unhalt (KVM_HC_KICK_CPU), PV IPIs
/// (KVM_HC_SEND_IPI) and directed yield (KVM_HC_SCHED_YIELD).
const KVM_FEATURES_BY_HYPERCALL: u32 = (1 << 7) | (1 << 11) | (1 << 13);
const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
/// 0x80000007 EDX: the TSC runs at a constant rate in every P-, C- and T-state.
const EDX_INVARIANT_TSC: u32 = 1 << 8;

/// Topology level types of leaf 0xB / 0x1F (ECX[15:8]).
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// "AuthenticAMD" and "HygonGenuine" in leaf 0's EBX: the vendors with AMD's leaves.
const EBX_AUTHENTIC_AMD: u32 = 0x6874_7541;
const EBX_HYGON_GENUINE: u32 = 0x6f67_7948;

/// Bits needed to number `count` items (the APIC-ID shift of a topology level).
fn id_bits(count: u32) -> u32 {
    if count <= 1 {
        0
    } else {
        32 - (count - 1).leading_zeros()
    }
}

/// What the policy takes from the host CPU itself, not from the accelerator.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCpu {
    /// The processor brand string, leaves 0x80000002-0x80000004 (EAX, EBX, ECX, EDX each),
    /// `None` where the host has none.
    pub brand: Option<[u32; 12]>,
}

impl HostCpu {
    /// Reads this machine's CPU.
    #[cfg(target_arch = "x86_64")]
    pub fn detect() -> Self {
        use std::arch::x86_64::__cpuid;
        if __cpuid(0x8000_0000).eax < LEAF_BRAND_LAST {
            return HostCpu { brand: None };
        }
        let mut brand = [0u32; 12];
        for (i, leaf) in (LEAF_BRAND_FIRST..=LEAF_BRAND_LAST).enumerate() {
            let r = __cpuid(leaf);
            brand[i * 4..i * 4 + 4].copy_from_slice(&[r.eax, r.ebx, r.ecx, r.edx]);
        }
        HostCpu { brand: Some(brand) }
    }

    /// Reads this machine's CPU (nothing to read off x86-64).
    #[cfg(not(target_arch = "x86_64"))]
    pub fn detect() -> Self {
        HostCpu::default()
    }
}

/// Whether `cpuid` describes an AMD (or Hygon) processor.
pub fn is_amd(cpuid: &[CpuidEntry]) -> bool {
    cpuid
        .iter()
        .find(|e| e.function == LEAF_VENDOR)
        .is_some_and(|e| matches!(e.ebx, EBX_AUTHENTIC_AMD | EBX_HYGON_GENUINE))
}

/// The display family of leaf 1 (base family, plus the extended family when it is 0xf).
pub fn family(cpuid: &[CpuidEntry]) -> u32 {
    let Some(eax) = cpuid
        .iter()
        .find(|e| e.function == LEAF_FEATURES)
        .map(|e| e.eax)
    else {
        return 0;
    };
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// CPUID entries for vCPU `vcpu_id` of a machine with `cpus` vCPUs, from what the
/// accelerator supports and this host's CPU.
pub fn guest_cpuid(supported: &[CpuidEntry], vcpu_id: u32, cpus: u32) -> Vec<CpuidEntry> {
    guest_cpuid_on(supported, &HostCpu::detect(), vcpu_id, cpus)
}

/// Takes out the KVM paravirtual features a guest uses by hypercall, for hosts whose kernel
/// does not complete hypercalls (`Capabilities::hypercalls`): a guest offered them sends
/// its IPIs by VMCALL and never gets past its first one. Kernels fall back to the APIC.
pub fn without_hypercall_features(entries: &mut [CpuidEntry]) {
    for e in entries
        .iter_mut()
        .filter(|e| e.function == LEAF_KVM_FEATURES)
    {
        e.eax &= !KVM_FEATURES_BY_HYPERCALL;
    }
}

/// [`guest_cpuid`] with the host CPU given.
pub fn guest_cpuid_on(
    supported: &[CpuidEntry],
    host: &HostCpu,
    vcpu_id: u32,
    cpus: u32,
) -> Vec<CpuidEntry> {
    let cpus = cpus.max(1);
    let amd = is_amd(supported);
    let mut entries: Vec<CpuidEntry> = supported
        .iter()
        .filter(|e| !matches!(e.function, LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY))
        .copied()
        .collect();
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => set_features(e, vcpu_id, cpus),
            // (Type 0 is "no more caches": AMD leaves the whole leaf zero.)
            LEAF_CACHE_TOPOLOGY if e.eax & 0x1f != 0 => {
                // EAX[31:26]: cores per package - 1; EAX[25:14]: threads sharing the cache - 1.
                e.eax = (e.eax & 0x3fff) | ((cpus - 1).min(63) << 26) | cache_sharing(e.eax, cpus);
            }
            // Package type and brand ID describe a physical part, not this machine.
            LEAF_EXT_FEATURES if amd => e.ebx = 0,
            LEAF_BRAND_FIRST..=LEAF_BRAND_LAST => fill_brand(e, host),
            // Not promised: a migration may land on a host whose TSC runs at another rate.
            LEAF_POWER_MANAGEMENT => e.edx &= !EDX_INVARIANT_TSC,
            // ECX[15:12]: APIC-ID bits of a core; ECX[7:0]: threads per package - 1.
            LEAF_ADDRESS_SIZES if amd => {
                e.ecx = if cpus > 1 {
                    (id_bits(cpus) << 12) | (cpus - 1).min(255)
                } else {
                    0
                };
            }
            LEAF_AMD_CACHE_TOPOLOGY if amd => {
                e.eax = (e.eax & !(0xfff << 14)) | cache_sharing(e.eax, cpus);
            }
            LEAF_AMD_EXT_APIC_ID if amd => {
                // Extended APIC ID; core ID with one thread per core; node 0 of 1.
                e.eax = vcpu_id;
                e.ebx = vcpu_id & 0xff;
                e.ecx = 0;
                e.edx = 0;
            }
            _ => {}
        }
    }
    for leaf in [LEAF_EXT_TOPOLOGY, LEAF_V2_EXT_TOPOLOGY] {
        if supported.iter().any(|e| e.function == leaf) {
            entries.extend(extended_topology(leaf, vcpu_id, cpus));
        }
    }
    entries
}

fn set_features(e: &mut CpuidEntry, vcpu_id: u32, cpus: u32) {
    // EBX[31:24]: initial APIC ID; EBX[23:16]: logical processors, valid with HTT only.
    let logical = if cpus > 1 { cpus.min(255) } else { 0 };
    e.ebx = (e.ebx & 0x0000_ffff) | ((vcpu_id & 0xff) << 24) | (logical << 16);
    e.ecx |= ECX_HYPERVISOR;
    if cpus > 1 {
        e.edx |= EDX_HTT;
    } else {
        e.edx &= !EDX_HTT;
    }
}

/// EAX[25:14] of a cache-parameters leaf (4, 0x8000001D): the threads sharing the cache - 1.
/// One thread per core: the L3 is shared by the package, lower levels by nobody.
fn cache_sharing(eax: u32, cpus: u32) -> u32 {
    let level = (eax >> 5) & 0x7;
    let sharing = if level >= 3 { cpus - 1 } else { 0 };
    sharing.min(0xfff) << 14
}

fn fill_brand(e: &mut CpuidEntry, host: &HostCpu) {
    let (Some(brand), 0) = (&host.brand, e.eax | e.ebx | e.ecx | e.edx) else {
        return;
    };
    let i = ((e.function - LEAF_BRAND_FIRST) * 4) as usize;
    [e.eax, e.ebx, e.ecx, e.edx] = [brand[i], brand[i + 1], brand[i + 2], brand[i + 3]];
}

/// Leaf 0xB or 0x1F: an SMT level of one thread, a core level of `cpus` cores, and the
/// invalid level that ends the list. EDX is the x2APIC ID on every subleaf.
fn extended_topology(function: u32, vcpu_id: u32, cpus: u32) -> [CpuidEntry; 3] {
    let level = |index: u32, eax: u32, ebx: u32, kind: u32| CpuidEntry {
        function,
        index,
        significant_index: true,
        eax,
        ebx,
        ecx: (kind << 8) | index,
        edx: vcpu_id,
    };
    [
        level(0, 0, 1, LEVEL_SMT),
        level(1, id_bits(cpus), cpus, LEVEL_CORE),
        level(2, 0, 0, 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32) -> CpuidEntry {
        CpuidEntry {
            function,
            index,
            significant_index: function == LEAF_EXT_TOPOLOGY,
            eax: 0x1234_5678,
            ebx: 0x00aa_0800,
            ecx: 0,
            edx: 0,
        }
    }

    #[test]
    fn hypercall_features_go_and_the_rest_of_kvms_leaf_stays() {
        // KVM's leaf as this project's host offers it: clocksource, NOP_IO_DELAY, MMU_OP...
        let mut cpuid = vec![CpuidEntry {
            eax: 0x0100_7efb,
            ..leaf(LEAF_KVM_FEATURES, 0)
        }];
        without_hypercall_features(&mut cpuid);
        let eax = cpuid[0].eax;
        assert_eq!(eax & KVM_FEATURES_BY_HYPERCALL, 0);
        assert_eq!(
            eax, 0x0100_567b,
            "only PV unhalt, PV IPIs and directed yield go"
        );
    }

    fn find(cpuid: &[CpuidEntry], function: u32, index: u32) -> CpuidEntry {
        *cpuid
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap_or_else(|| panic!("leaf {function:#x}.{index} missing"))
    }

    fn amd_vendor() -> CpuidEntry {
        CpuidEntry {
            ebx: EBX_AUTHENTIC_AMD,
            ..leaf(0, 0)
        }
    }

    #[test]
    fn apic_ids_and_counts_follow_the_vcpu() {
        let supported = [leaf(0, 0), leaf(1, 0), leaf(0xb, 0)];
        let cpuid = guest_cpuid_on(&supported, &HostCpu::default(), 3, 4);
        let l1 = find(&cpuid, 1, 0);
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "brand/CLFLUSH bits are kept");
        assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
        assert_ne!(l1.edx & EDX_HTT, 0);
        // The kernel's list had subleaf 0 only: the core level and the end are added.
        let smt = find(&cpuid, 0xb, 0);
        assert_eq!((smt.eax, smt.ebx, smt.ecx, smt.edx), (0, 1, 0x100, 3));
        let core = find(&cpuid, 0xb, 1);
        assert_eq!((core.eax, core.ebx, core.ecx, core.edx), (2, 4, 0x201, 3));
        let end = find(&cpuid, 0xb, 2);
        assert_eq!((end.eax, end.ebx, end.ecx), (0, 0, 2));
        assert_eq!(cpuid.iter().filter(|e| e.function == 0xb).count(), 3);
    }

    #[test]
    fn an_empty_cache_leaf_stays_empty() {
        let mut none = leaf(4, 0);
        none.eax = 0;
        let cpuid = guest_cpuid_on(&[none], &HostCpu::default(), 1, 2);
        assert_eq!(cpuid[0].eax, 0);
    }

    #[test]
    fn single_vcpu_has_no_htt_and_no_count() {
        let cpuid = guest_cpuid_on(&[leaf(1, 0)], &HostCpu::default(), 0, 1);
        assert_eq!(cpuid[0].edx & EDX_HTT, 0);
        assert_eq!(cpuid[0].ebx >> 16, 0);
    }

    #[test]
    fn amd_topology_leaves_describe_this_machine() {
        let mut l3 = leaf(0x8000_001d, 3);
        l3.eax = 0x0000_4163; // level 3, host: 2 threads share it
        let mut l1d = leaf(0x8000_001d, 0);
        l1d.eax = 0x0000_4121;
        let mut sizes = leaf(0x8000_0008, 0);
        sizes.ecx = 0x7001;
        let supported = [amd_vendor(), l1d, l3, sizes, leaf(0x8000_001e, 0)];
        let cpuid = guest_cpuid_on(&supported, &HostCpu::default(), 5, 8);
        assert_eq!(find(&cpuid, 0x8000_001d, 0).eax, 0x121, "L1 is per core");
        assert_eq!(find(&cpuid, 0x8000_001d, 3).eax, 0x163 | (7 << 14));
        assert_eq!(find(&cpuid, 0x8000_0008, 0).ecx, (3 << 12) | 7);
        let ext = find(&cpuid, 0x8000_001e, 0);
        assert_eq!((ext.eax, ext.ebx, ext.ecx, ext.edx), (5, 5, 0, 0));
        let one = guest_cpuid_on(&supported, &HostCpu::default(), 0, 1);
        assert_eq!(find(&one, 0x8000_0008, 0).ecx, 0);
    }

    #[test]
    fn invariant_tsc_is_hidden_and_the_brand_comes_from_the_host() {
        let mut power = leaf(0x8000_0007, 0);
        power.edx = EDX_INVARIANT_TSC | 1;
        let mut brand = leaf(0x8000_0002, 0);
        (brand.eax, brand.ebx) = (0, 0);
        let host = HostCpu {
            brand: Some(std::array::from_fn(|i| i as u32 + 100)),
        };
        let cpuid = guest_cpuid_on(&[power, brand, leaf(0x8000_0003, 0)], &host, 0, 1);
        assert_eq!(find(&cpuid, 0x8000_0007, 0).edx, 1);
        let b = find(&cpuid, 0x8000_0002, 0);
        assert_eq!([b.eax, b.ebx, b.ecx, b.edx], [100, 101, 102, 103]);
        let kept = find(&cpuid, 0x8000_0003, 0);
        assert_eq!(kept.eax, 0x1234_5678, "a brand the kernel gives is kept");
    }

    #[test]
    fn family_and_vendor() {
        let mut l1 = leaf(1, 0);
        l1.eax = 0x00a0_0f11;
        assert_eq!(family(&[l1]), 0x19);
        l1.eax = 0x0006_06a6;
        assert_eq!(family(&[l1]), 6);
        assert!(is_amd(&[amd_vendor()]));
        assert!(!is_amd(&[leaf(0, 0)]));
    }

    #[test]
    fn id_bits_cover_the_count() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 255].map(id_bits),
            [0, 1, 2, 2, 3, 3, 4, 8]
        );
    }
}
