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
    let run = run_guest("complete", &["--memory", "64M"]);
    run.expect_status(1);
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
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
}
