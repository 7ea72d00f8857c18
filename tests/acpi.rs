//! ACPI S3 (suspend to RAM): guests/s3-resume.c puts the machine to sleep through PM1a_CNT
//! (once or several times in a row) and checks, from the 16-bit trampoline its FACS waking vector points at, that it woke in
//! real mode at the right address with WAK_STS (and RTC_STS for the RTC alarm) set and its
//! RAM intact. Direct kernel boot (ferrovm jumps to the waking vector itself), the API's
//! view of a sleeping guest, and a SeaBIOS boot (SeaBIOS's resume path jumps to the vector).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

const SEABIOS: &str = "/usr/share/seabios/bios-256k.bin";
const WOKE: &str = "s3: woke in real mode at 3000:0000, PM1_STS wak";

fn expect_pass(run: &Run) {
    assert_eq!(
        run.status,
        Some(1),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    assert!(run.stdout.contains("PASS"), "{}", run.stdout);
}

#[test]
fn s3_rtc_alarm_wakes_a_direct_boot_at_the_waking_vector() {
    // Twice in a row with 2 vCPUs: the APs go back to wait-for-SIPI each time.
    let cases = [
        (&["--cpus", "2", "--cmdline", "cycles=2"][..], 2),
        (&["--irqchip", "split"][..], 1),
    ];
    for (extra, sleeps) in cases {
        let started = Instant::now();
        let run = run_guest("s3-resume", extra);
        expect_pass(&run);
        run.expect_stdout("entering S3 (wake: RTC alarm)")
            .expect_stdout(&format!("s3: {sleeps} sleep(s), every wake-up checked"));
        let woke = format!("{WOKE} rtc, RTC_C alarm, RAM intact (64 KiB)");
        assert_eq!(run.stdout.matches(&woke).count(), sleeps, "{}", run.stdout);
        // Each alarm is 2 s ahead (1-2 s after the suspend, by the seconds register).
        assert!(
            started.elapsed() >= Duration::from_secs(sleeps as u64),
            "{extra:?}"
        );
    }
}

#[test]
fn s3_x_waking_vector_resumes_in_32_bit_protected_mode() {
    let run = run_guest("s3-resume", &["--cmdline", "vector=x32"]);
    expect_pass(&run);
    run.expect_stdout("s3: woke in 32-bit protected mode (CR0 0x11) at 0x3")
        .expect_stdout("PM1_STS wak rtc, RTC_C alarm, RAM intact");
}

#[test]
fn s3_without_a_waking_vector_stops_the_vmm_with_one_line() {
    let run = run_guest("s3-resume", &["--cmdline", "vector=none"]);
    run.expect_error("resume from S3: the OS set no waking vector in the FACS at 0xe01c0");
    assert!(!run.stdout.contains("s3: woke"), "{}", run.stdout);
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-acpi-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn ctl(socket: &Path, args: &[&str]) -> Run {
    let mut all = vec!["ctl", "--api-socket", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    ferrovm(&all, Duration::from_secs(30))
}

/// Polls `ctl status` until it reports `state` (the guest gets there by itself).
fn wait_for_state(socket: &Path, state: &str) {
    let start = Instant::now();
    loop {
        if socket.exists() && ctl(socket, &["status"]).stdout.contains(state) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never reached {state}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn s3_api_reports_suspended_refuses_a_snapshot_and_resume_wakes() {
    require_kvm();
    let dir = scratch("api");
    let socket = dir.join("api.sock");
    let kernel = guest("s3-resume");
    let snapshot = dir.join("snap");
    let mut during = String::new();
    let run = ferrovm_with(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "wake=api",
            "--api-socket",
            socket.to_str().unwrap(),
        ],
        Duration::from_secs(60),
        |_| {
            wait_for_state(&socket, "state:   suspended");
            ctl(&socket, &["snapshot", snapshot.to_str().unwrap()])
                .expect_error("the guest is suspended (ACPI S3)");
            ctl(&socket, &["pause"]).expect_error("the guest is suspended (ACPI S3)");
            during = ctl(&socket, &["resume"]).stdout;
        },
    );
    assert!(during.contains("running"), "{during}");
    expect_pass(&run);
    run.expect_stdout(&format!("{WOKE}, RTC_C no-alarm, RAM intact"));
    assert!(
        !snapshot.exists(),
        "a snapshot of a suspended guest was written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn s3_firmware_boot_resumes_through_seabios() {
    require_kvm();
    assert!(
        Path::new(SEABIOS).exists(),
        "{SEABIOS} is missing: install Debian's seabios package"
    );
    let guests = std::env::var_os("FERROVM_GUESTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/guests"));
    let disk = format!("{},readonly", guests.join("disk/s3-resume.img").display());
    let run = ferrovm(&["run", "--disk", &disk], Duration::from_secs(180));
    expect_pass(&run);
    run.expect_stdout("SeaBIOS (version")
        .expect_stdout(&format!("{WOKE} rtc, RTC_C alarm, RAM intact"));
}
