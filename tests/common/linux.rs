//! Booting the repository's Linux test guest (`make linux`, guests/linux/) and reading the
//! `FERROVM-` marker lines its tests print (guests/linux/README.md).

use std::path::PathBuf;
use std::time::Duration;

use super::Run;

/// A boot that reaches userspace takes one to three minutes here (guest ring 0 is emulated),
/// longer on a loaded host.
pub const BOOT_LIMIT: Duration = Duration::from_secs(1200);

/// Kernel command-line options every boot uses besides the console: quiet RCU stall and NMI
/// watchdogs (a vCPU waiting minutes in emulated ring 0 is not a stall here), and no
/// `rep movs`/`rep stos` in the kernel's page clearing and copies, which this host's
/// emulator runs one iteration at a time (docs/linux-guest.md: it halves a boot).
pub const QUIET_CMDLINE: &str =
    "nmi_watchdog=0 rcupdate.rcu_cpu_stall_suppress=1 tsc=reliable clearcpuid=erms,fsrm,rep_good";

/// The directory with `vmlinux` and `initramfs.cpio` (`FERROVM_LINUX`, else target/linux).
pub fn linux_dir() -> PathBuf {
    let dir = std::env::var_os("FERROVM_LINUX")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/linux"));
    // The uncompressed initramfs: gunzip in emulated ring 0 costs about a minute per boot.
    for file in ["vmlinux", "initramfs.cpio"] {
        assert!(
            dir.join(file).exists(),
            "{} is missing: build the Linux test guest with `make linux`",
            dir.join(file).display()
        );
    }
    dir
}

/// `ferrovm run` arguments for the test kernel with `cpus` vCPUs, the kernel command line
/// `QUIET_CMDLINE` plus `cmdline` (which names the console), then `extra`.
pub fn linux_run_args(cpus: u32, cmdline: &str, extra: &[&str]) -> Vec<String> {
    let initrd = linux_dir().join("initramfs.cpio");
    let mut args = kernel_args(cpus, cmdline);
    args.extend(["--initrd".to_string(), initrd.to_str().unwrap().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `ferrovm run` arguments for the test kernel with no initramfs: `cpus` vCPUs, the kernel
/// command line `QUIET_CMDLINE` plus `cmdline` (the caller adds the root disk).
pub fn kernel_args(cpus: u32, cmdline: &str) -> Vec<String> {
    let vmlinux = linux_dir().join("vmlinux");
    [
        "run",
        "--kernel",
        vmlinux.to_str().unwrap(),
        "--memory",
        "256M",
        "--cpus",
        &cpus.to_string(),
        "--cmdline",
        &format!("{QUIET_CMDLINE} {cmdline}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The lines of the guest's output that start with `prefix` (the marker and a space).
pub fn markers<'a>(run: &'a Run, prefix: &str) -> Vec<&'a str> {
    let start = format!("{prefix} ");
    run.stdout
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix(start.as_str()))
        .collect()
}

/// `key=value` from a marker line's fields.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// The one line of marker `prefix`.
pub fn one_marker<'a>(run: &'a Run, prefix: &str) -> &'a str {
    let found = markers(run, prefix);
    assert_eq!(
        found.len(),
        1,
        "{prefix}: {found:?}\n--- stdout\n{}\n--- stderr\n{}",
        run.stdout,
        run.stderr
    );
    found[0]
}

/// The test scripts ended with status 0 and the machine powered off through ACPI S5.
pub fn expect_clean_poweroff(run: &Run) {
    let end = one_marker(run, "FERROVM-TEST-END");
    assert_eq!(field(end, "status"), Some("0"), "{}", run.stdout);
    run.expect_status(0);
    assert!(run.stdout.contains("reboot: Power down"), "{}", run.stdout);
}
