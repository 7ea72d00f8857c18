//! Instruction completion: the `complete` guest runs each instruction ferrovm completes in
//! ring 0 (where this project's PVM host emulates it and its emulator rejects many) and
//! natively in ring 3, and compares the two results.

mod common;

use common::*;

/// Hosts whose kernel emulates guest ring 0 (KVM's PVM backend) hand rejected instructions
/// to user space; on VT-x/AMD-V hosts the guest runs them natively and the completer is idle.
fn host_emulates_ring0() -> bool {
    std::path::Path::new("/sys/module/kvm_pvm").exists()
}

#[test]
fn completed_instructions_match_native_execution() {
    // The completer logs the first completion of each mnemonic at `info`: that is how this
    // test knows the ring-0 half really went through it on a host that emulates ring 0.
    std::env::set_var("FERROVM_LOG", "info");
    let run = run_guest("complete", &["--memory", "64M"]);
    run.expect_status(1);
    if host_emulates_ring0() {
        // (mnemonic, the guest's check that runs it: present when the vCPU has the feature)
        for (mnemonic, check) in [
            ("int3", "int3"),
            ("fldcw", "fninit"),
            ("fwait", "fninit"),
            ("fnclex", "fninit"),
            ("popcnt", "popcnt"),
            ("cmpxchg16b", "cmpxchg16b"),
            ("stac", "stac clac"),
            ("clac", "stac clac"),
            ("xgetbv", "xgetbv"),
            ("xsave", "xsave"),
            ("xrstor", "xrstor"),
            ("xsavec", "xsavec"),
        ] {
            if !run.stdout.contains(&format!("complete: {check}")) {
                continue;
            }
            assert!(
                run.stderr.contains(&format!("completing `{mnemonic}"))
                    || run.stderr.contains(&format!("completing `lock {mnemonic}")),
                "{mnemonic} was not completed by ferrovm:\n{}",
                run.stderr
            );
        }
    }
    for check in [
        "int3",
        "fninit fnstcw fnstsw fwait fldcw fnclex",
        "cmpxchg8b",
        "xgetbv",
        "fxsave64",
        "fxrstor64",
        "xsave",
        "xrstor",
    ] {
        run.expect_stdout(&format!("complete: {check} ok"));
    }
    assert_eq!(run.last_line(), "PASS");
}

#[test]
fn an_instruction_nobody_completes_stops_the_vm_with_its_name() {
    let run = run_guest("complete", &["--memory", "64M", "--cmdline", "unknown=1"]);
    if !host_emulates_ring0() {
        // AESENC runs natively in ring 0 here: nothing to refuse.
        run.expect_status(1);
        return;
    }
    run.expect_status(2)
        .expect_error("cannot complete `aesenc xmm0,xmm1` (66 0f 38 dc c1)")
        .expect_error("at RIP 0x");
    // One line, log lines of a concurrent test's FERROVM_LOG aside.
    let lines = run.stderr.lines().filter(|l| !l.starts_with('['));
    assert_eq!(lines.count(), 1, "{}", run.stderr);
}
