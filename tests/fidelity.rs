//! What the virtual CPU shows a guest: `guests/cpuid-msr.c` prints every CPUID leaf and a
//! list of MSRs under ferrovm, and the values ferrovm sets on purpose (docs/fidelity.md,
//! where the same guest is compared with QEMU) are checked against this host.

mod common;

use std::collections::HashMap;

use common::*;

/// One run of the guest: CPUID leaves by (leaf, subleaf), MSRs by index (`None`: #GP).
struct CpuView {
    cpuid: HashMap<(u32, u32), [u32; 4]>,
    msrs: HashMap<u32, Option<u64>>,
}

impl CpuView {
    fn boot(cpus: u32) -> Self {
        let run = run_guest("cpuid-msr", &["--cpus", &cpus.to_string()]);
        run.expect_status(1);
        assert_eq!(run.last_line(), "PASS");
        let mut view = CpuView {
            cpuid: HashMap::new(),
            msrs: HashMap::new(),
        };
        for line in run.stdout.lines().map(str::trim_end) {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["cpuid", leaf, regs @ ..] => view.add_leaf(leaf, regs),
                ["msr", index, _name, "gp"] => {
                    view.msrs.insert(hex(index), None);
                }
                ["msr", index, _name, "=", value] => {
                    view.msrs.insert(hex(index), Some(hex64(value)));
                }
                _ => {}
            }
        }
        assert!(
            view.cpuid.contains_key(&(0, 0)),
            "no CPUID lines:\n{}",
            run.stdout
        );
        view
    }

    fn add_leaf(&mut self, leaf: &str, regs: &[&str]) {
        let (function, index) = leaf.split_once('.').expect("leaf.subleaf");
        let values: Vec<u32> = regs
            .iter()
            .map(|r| hex(r.split_once('=').expect("reg=value").1))
            .collect();
        let values: [u32; 4] = values.try_into().expect("four registers");
        self.cpuid.insert((hex(function), hex(index)), values);
    }

    fn leaf(&self, function: u32, index: u32) -> [u32; 4] {
        *self
            .cpuid
            .get(&(function, index))
            .unwrap_or_else(|| panic!("the guest printed no leaf {function:#x}.{index}"))
    }

    fn msr(&self, index: u32) -> Option<u64> {
        *self
            .msrs
            .get(&index)
            .unwrap_or_else(|| panic!("the guest printed no MSR {index:#x}"))
    }
}

fn hex(s: &str) -> u32 {
    u32::from_str_radix(s.trim_start_matches("0x"), 16).expect("hex number")
}

fn hex64(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).expect("hex number")
}

/// A field of the host's /proc/cpuinfo (first processor).
fn host_cpuinfo(field: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == field)
        .map(|(_, v)| v.trim().to_string())
}

fn host_is_amd() -> bool {
    matches!(
        host_cpuinfo("vendor_id").as_deref(),
        Some("AuthenticAMD" | "HygonGenuine")
    )
}

#[test]
fn amd_hwcr_says_the_tsc_counts_at_p0_frequency() {
    let view = CpuView::boot(1);
    let family = host_cpuinfo("cpu family").and_then(|f| f.parse::<u32>().ok());
    if !host_is_amd() || family < Some(0x10) {
        eprintln!("note: not an AMD host of family 0x10 or later: HWCR.TscFreqSel not checked");
        return;
    }
    let hwcr = view
        .msr(0xc001_0015)
        .expect("HWCR reads without #GP on AMD");
    assert_ne!(
        hwcr & (1 << 24),
        0,
        "HWCR = {hwcr:#x}: TscFreqSel (bit 24) clear"
    );
}

#[test]
fn machine_checks_match_qemu() {
    let view = CpuView::boot(1);
    let edx = view.leaf(1, 0)[3];
    assert_eq!(edx & 0x4080, 0x4080, "CPUID 1 EDX has MCE and MCA");
    let cap = view.msr(0x179).expect("MCG_CAP");
    assert_eq!(
        cap & 0xff,
        10,
        "MCG_CAP = {cap:#x}: 10 banks, as QEMU gives"
    );
    assert_ne!(cap & (1 << 8), 0, "MCG_CAP = {cap:#x}: MCG_CTL_P");
    assert_eq!(view.msr(0x17b), Some(u64::MAX), "MCG_CTL all enabled");
    assert_eq!(view.msr(0x400), Some(u64::MAX), "MC0_CTL all enabled");
}

#[test]
fn microcode_revision_and_brand_are_the_hosts() {
    let view = CpuView::boot(1);
    let host_rev = host_cpuinfo("microcode").map(|m| hex64(&m));
    let guest_rev = view.msr(0x8b).expect("the microcode revision MSR reads");
    let guest_rev = if host_is_amd() {
        guest_rev
    } else {
        guest_rev >> 32
    };
    assert_eq!(Some(guest_rev), host_rev, "microcode revision");

    let brand: Vec<u8> = (0x8000_0002..=0x8000_0004)
        .flat_map(|leaf| view.leaf(leaf, 0))
        .flat_map(u32::to_le_bytes)
        .take_while(|&b| b != 0)
        .collect();
    let brand = String::from_utf8_lossy(&brand).trim().to_string();
    assert_eq!(Some(brand), host_cpuinfo("model name"), "brand string");
}

#[test]
fn tsc_is_not_promised_invariant() {
    // As QEMU: a live migration may move the guest to a host whose TSC runs at another rate.
    let view = CpuView::boot(1);
    assert_eq!(view.leaf(0x8000_0007, 0)[3] & (1 << 8), 0);
}

#[test]
fn topology_leaves_describe_the_machine() {
    let one = CpuView::boot(1);
    assert_eq!(
        one.leaf(1, 0)[1] & 0x00ff_0000,
        0,
        "one CPU: no logical count"
    );
    let two = CpuView::boot(2);
    let [_, ebx, _, edx] = two.leaf(1, 0);
    assert_eq!((ebx >> 16) & 0xff, 2, "two logical processors");
    assert_ne!(edx & (1 << 28), 0, "HTT");
    if two.cpuid.contains_key(&(0xb, 0)) {
        assert_eq!(
            two.leaf(0xb, 0)[..3],
            [0, 1, 0x100],
            "SMT level: one thread"
        );
        assert_eq!(
            two.leaf(0xb, 1)[..3],
            [1, 2, 0x201],
            "core level: two cores"
        );
        assert_eq!(two.leaf(0xb, 2)[2] & 0xff00, 0, "the list ends");
    }
    if host_is_amd() {
        assert_eq!(one.leaf(0x8000_0008, 0)[2], 0, "one CPU: no core count");
        assert_eq!(
            two.leaf(0x8000_0008, 0)[2],
            0x1001,
            "2 threads, 1 APIC-ID bit"
        );
        let l3 = two.leaf(0x8000_001d, 3)[0];
        assert_eq!((l3 >> 5) & 7, 3, "subleaf 3 is the L3");
        assert_eq!((l3 >> 14) & 0xfff, 1, "the L3 is shared by both CPUs");
        assert_eq!(
            (two.leaf(0x8000_001d, 0)[0] >> 14) & 0xfff,
            0,
            "L1 per core"
        );
    }
}
