//! The control API: `ferrovm ctl` against a running guest.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn ctl(socket: &str, args: &[&str]) -> Run {
    let mut all = vec!["ctl", "--api-socket", socket];
    all.extend_from_slice(args);
    ferrovm(&all, Duration::from_secs(30))
}

fn wait_for_socket(path: &std::path::Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "API socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn status_pause_resume_shutdown() {
    require_kvm();
    let dir = std::env::temp_dir().join(format!("ferrovm-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("api.sock");
    let kernel = guest("idle");
    let mut vm = Command::new(FERROVM)
        .args(["run", "--kernel", kernel.to_str().unwrap(), "--cpus", "2"])
        .args(["--memory", "128M", "--serial", "none", "--api-socket"])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_socket(&socket);
    let s = socket.to_str().unwrap();

    let run = ctl(s, &["--json", "status"]);
    run.expect_status(0);
    let status: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(status["state"], "running");
    assert_eq!(status["vcpus"], 2);
    assert_eq!(status["memory_bytes"], 128u64 << 20);
    assert_eq!(status["irqchip"], "kernel");

    ctl(s, &["pause"]).expect_status(0).expect_stdout("paused");
    let run = ctl(s, &["--json", "status"]);
    assert!(
        run.stdout.contains("\"state\":\"paused\""),
        "{}",
        run.stdout
    );
    ctl(s, &["resume"])
        .expect_status(0)
        .expect_stdout("running");
    let run = ctl(s, &["status"]);
    run.expect_status(0).expect_stdout("state:   running");

    // A second VMM may not take over a live socket.
    let run = ferrovm(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--api-socket",
            s,
        ],
        Duration::from_secs(30),
    );
    run.expect_error("another process is serving this socket");

    ctl(s, &["shutdown"]).expect_status(0);
    let status = vm.wait().unwrap();
    assert_eq!(status.code(), Some(0), "power-off through the API exits 0");
    assert!(!socket.exists(), "the socket file is removed on exit");
}

#[test]
fn ctl_without_a_vmm_is_one_clear_error() {
    let run = ctl("/nonexistent/ferrovm.sock", &["status"]);
    run.expect_error("cannot connect");
}
