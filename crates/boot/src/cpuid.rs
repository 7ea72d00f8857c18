//! The CPUID a guest sees: what the accelerator supports, with the topology of this machine
//! (APIC IDs, logical processor counts) and the hypervisor bit filled in per vCPU.

use hypervisor::CpuidEntry;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_TOPOLOGY: u32 = 0x4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;

const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;

/// Topology level types of leaf 0xB / 0x1F (ECX[15:8]).
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Bits needed to number `count` items (the APIC-ID shift of a topology level).
fn id_bits(count: u32) -> u32 {
    if count <= 1 {
        0
    } else {
        32 - (count - 1).leading_zeros()
    }
}

/// CPUID entries for vCPU `vcpu_id` of a machine with `cpus` vCPUs: one socket, one thread
/// per core, APIC ID equal to the vCPU index.
pub fn guest_cpuid(supported: &[CpuidEntry], vcpu_id: u32, cpus: u32) -> Vec<CpuidEntry> {
    let cpus = cpus.max(1);
    let mut entries: Vec<CpuidEntry> = supported.to_vec();
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & 0x0000_ffff) | ((vcpu_id & 0xff) << 24) | ((cpus.min(255)) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if cpus > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE_TOPOLOGY => {
                // EAX[31:26]: cores per package - 1; EAX[25:14]: threads sharing the cache - 1.
                let cache_level = (e.eax >> 5) & 0x7;
                let sharing = if cache_level >= 3 { cpus - 1 } else { 0 };
                e.eax = (e.eax & 0x3ff) | ((cpus - 1).min(63) << 26) | (sharing.min(0xfff) << 14);
            }
            LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => {
                e.edx = vcpu_id;
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (LEVEL_SMT << 8) | e.index;
                    }
                    1 => {
                        e.eax = id_bits(cpus);
                        e.ebx = cpus;
                        e.ecx = (LEVEL_CORE << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            _ => {}
        }
    }
    entries
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
    fn apic_ids_and_counts_follow_the_vcpu() {
        let supported = [leaf(0, 0), leaf(1, 0), leaf(0xb, 0), leaf(0xb, 1)];
        let cpuid = guest_cpuid(&supported, 3, 4);
        let l1 = cpuid.iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "brand/CLFLUSH bits are kept");
        assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
        assert_ne!(l1.edx & EDX_HTT, 0);
        let core = cpuid
            .iter()
            .find(|e| e.function == 0xb && e.index == 1)
            .unwrap();
        assert_eq!((core.eax, core.ebx, core.edx), (2, 4, 3));
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let cpuid = guest_cpuid(&[leaf(1, 0)], 0, 1);
        assert_eq!(cpuid[0].edx & EDX_HTT, 0);
        assert_eq!(cpuid[0].ebx >> 24, 0);
    }

    #[test]
    fn id_bits_cover_the_count() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 255].map(id_bits),
            [0, 1, 2, 2, 3, 3, 4, 8]
        );
    }
}
