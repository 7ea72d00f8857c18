//! `--seccomp`: a forbidden system call on any thread ends the VMM with one clear line and
//! status 2 (`kill`, the default), or is let through (`log`, `off`).
//!
//! `FERROVM_SECCOMP_SELFTEST=ROLE` makes every thread of that role call getpgid(0), which no
//! role allows, right after installing its filter. That the normal guests run under the
//! default `kill` is what the other suites show.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

/// `ferrovm ARGS` with `FERROVM_SECCOMP_SELFTEST=role` (none if empty), until it exits.
fn selftest(role: &str, args: &[&str]) -> Run {
    finish(start(role, args), args)
}

fn start(role: &str, args: &[&str]) -> Child {
    Command::new(FERROVM)
        .args(args)
        .env("FERROVM_SECCOMP_SELFTEST", role)
        .env_remove("FERROVM_SECCOMP")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferrovm")
}

/// Waits for `child` (killing it after [`LIMIT`]) and collects what it printed.
fn finish(mut child: Child, args: &[&str]) -> Run {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("ferrovm {args:?} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    Run {
        status: status.code(),
        signal: status.signal(),
        stdout,
        stderr,
        elapsed: started.elapsed(),
        max_rss_kib: 0,
    }
}

fn hello() -> String {
    require_kvm();
    guest("hello").to_str().unwrap().to_owned()
}

fn forbidden_call_message(thread: &str, role: &str) -> String {
    format!(
        "seccomp: thread {thread} (role {role}) made the forbidden system call getpgid \
         (number 121)"
    )
}

#[test]
fn a_forbidden_call_on_a_vcpu_stops_the_vmm_by_default() {
    let kernel = hello();
    selftest("vcpu", &["run", "--kernel", &kernel])
        .expect_error(&forbidden_call_message("vcpu0", "vcpu"));
}

#[test]
fn every_kind_of_thread_of_a_boot_is_filtered() {
    let kernel = hello();
    for (role, thread) in [
        ("main", "main"),
        ("launcher", "launcher"),
        ("timer", "timers"),
        ("device-io", "serial-out"),
    ] {
        selftest(role, &["run", "--kernel", &kernel, "--seccomp", "kill"])
            .expect_error(&forbidden_call_message(thread, role));
    }
}

#[test]
fn an_smp_guest_is_stopped_by_whichever_vcpu_calls_first() {
    let kernel = hello();
    let run = selftest("vcpu", &["run", "--kernel", &kernel, "--cpus", "2"]);
    run.expect_status(2);
    assert!(
        run.stderr
            .contains("(role vcpu) made the forbidden system call getpgid"),
        "{}",
        run.stderr
    );
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-seccomp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn wait_for(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < LIMIT, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn idle_with_api(role: &str, socket: &Path) -> (Child, Vec<String>) {
    require_kvm();
    let kernel = guest("idle").to_str().unwrap().to_owned();
    let args: Vec<String> = [
        "run",
        "--kernel",
        &kernel,
        "--memory",
        "64M",
        "--api-socket",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([socket.to_str().unwrap().to_owned()])
    .collect();
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    (start(role, &refs), args)
}

#[test]
fn the_api_threads_are_filtered() {
    let dir = scratch("api");
    let socket = dir.join("api.sock");
    let (vm, args) = idle_with_api("api", &socket);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    finish(vm, &refs).expect_error(&forbidden_call_message("api", "api"));
}

/// A snapshot runs on a migration thread of its own, not on the API thread that asked.
#[test]
fn a_snapshot_runs_on_a_filtered_migration_thread() {
    let dir = scratch("migration");
    let socket = dir.join("api.sock");
    let (vm, args) = idle_with_api("migration", &socket);
    wait_for(&socket);
    let snapshot = dir.join("snap");
    let ctl = ferrovm(
        &[
            "ctl",
            "--api-socket",
            socket.to_str().unwrap(),
            "snapshot",
            snapshot.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert_ne!(
        ctl.status,
        Some(0),
        "the snapshot cannot succeed: {}",
        ctl.stdout
    );
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    finish(vm, &refs).expect_error(&forbidden_call_message("migration", "migration"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `log` and `off` let the call through: the guest runs to its end as usual.
#[test]
fn log_and_off_let_the_vmm_run_on() {
    let kernel = hello();
    for mode in ["log", "off"] {
        let run = selftest("vcpu", &["run", "--kernel", &kernel, "--seccomp", mode]);
        run.expect_status(0)
            .expect_stdout("ferrovm hello: 1 vCPU(s)");
        assert!(
            run.stderr.contains(&format!(
                "seccomp self-test: thread vcpu0 (role vcpu) made a forbidden call and runs \
                 on (--seccomp {mode})"
            )),
            "{mode}: {}",
            run.stderr
        );
    }
}

#[test]
fn the_mode_may_come_from_the_environment() {
    let kernel = hello();
    let run = {
        let child = Command::new(FERROVM)
            .args(["run", "--kernel", &kernel])
            .env("FERROVM_SECCOMP_SELFTEST", "vcpu")
            .env("FERROVM_SECCOMP", "log")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        finish(child, &["run"])
    };
    run.expect_status(0);
}

#[test]
fn mistakes_in_the_options_are_one_clear_error() {
    let kernel = hello();
    let run = ferrovm(&["run", "--kernel", &kernel, "--seccomp", "strict"], LIMIT);
    run.expect_status(2);
    assert!(run.stderr.contains("--seccomp"), "{}", run.stderr);
    selftest("gpu", &["run", "--kernel", &kernel])
        .expect_error("gpu is not a thread role (FERROVM_SECCOMP_SELFTEST)");
}

/// Naming a migration's destination by host name runs glibc's resolver (nscd socket, the
/// /etc files) on the filtered migration thread: a refused connection is the only error.
#[test]
fn a_destination_named_by_host_name_is_resolved_under_the_filter() {
    let dir = scratch("resolve");
    let socket = dir.join("api.sock");
    let (vm, args) = idle_with_api("", &socket);
    wait_for(&socket);
    // A port nobody listens on any more.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = socket.to_str().unwrap();
    let run = ferrovm(
        &[
            "ctl",
            "--api-socket",
            s,
            "migrate",
            &format!("tcp:localhost:{port}"),
        ],
        LIMIT,
    );
    run.expect_error("Connection refused");
    ferrovm(&["ctl", "--api-socket", s, "shutdown"], LIMIT).expect_status(0);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    finish(vm, &refs).expect_status(0);
    let _ = std::fs::remove_dir_all(&dir);
}
