//! `--net tap=...,vhost=on`: the host kernel's vhost-net serves the queue pairs.
//!
//! Each test makes its own network namespace holding a tap (`vtap0`, 10.0.2.2/24) and runs
//! ferrovm in it. Where `/dev/vhost-net` is missing (the machine these tests were written
//! on) `vhost=on` must fail at start-up with one error line naming the device and the errno;
//! where it exists, net-echo must pass with the kernel serving its queues against a UDP echo
//! peer in the namespace.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const TAP: &str = "vtap0";
const VHOST_NET: &str = "/dev/vhost-net";

/// UDP echo on 10.0.2.2:7777 (net-echo's peer; the namespace's kernel answers ARP and ICMP).
const ECHO: &str = r#"
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("10.0.2.2", 7777))
print("ready", flush=True)
while True:
    data, addr = u.recvfrom(65536)
    u.sendto(data, addr)
"#;

/// A namespace with the tap up at 10.0.2.2; removed on drop.
struct Namespace {
    name: String,
    echo: Option<Child>,
}

impl Namespace {
    fn new(test: &str) -> Namespace {
        require_kvm();
        let name = format!("fvhost-{}-{test}", std::process::id());
        tap_namespace(&name, TAP, false, None);
        Namespace { name, echo: None }
    }

    fn start_echo(&mut self) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "python3", "-c", ECHO])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the echo peer");
        let mut line = [0u8; 6];
        use std::io::Read;
        child
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut line)
            .unwrap();
        assert_eq!(&line, b"ready\n");
        self.echo = Some(child);
    }

    /// Runs ferrovm in the namespace to its end (at most 120 s): status and stderr.
    fn ferrovm(&self, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, FERROVM, "run"])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ferrovm");
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if let Some(mut echo) = self.echo.take() {
            let _ = echo.kill();
            let _ = echo.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// The one non-empty stderr line of a run that must have failed at start-up.
fn one_error_line(status: Option<i32>, stderr: &str) -> String {
    assert_eq!(status, Some(2), "stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line:\n{stderr}");
    lines[0].to_string()
}

/// Without /dev/vhost-net: one error naming the device and why it cannot be opened, never a
/// silent fallback to the VMM's own queues. With it: net-echo passes on the kernel's queues.
#[test]
fn vhost_on_uses_dev_vhost_net_or_fails_naming_it() {
    let mut ns = Namespace::new("open");
    let kernel = guest("net-echo");
    let net = format!("tap={TAP},vhost=on");
    let cmdline = "rounds=10 pings=2 irq=1";
    let args = [
        "--kernel",
        kernel.to_str().unwrap(),
        "--net",
        &net,
        "--cmdline",
        cmdline,
    ];
    if !Path::new(VHOST_NET).exists() {
        let (status, stdout, stderr) = ns.ferrovm(&args, &[]);
        let line = one_error_line(status, &stderr);
        for needle in [
            "--net",
            "vhost=on",
            "cannot open /dev/vhost-net",
            "No such file or directory",
        ] {
            assert!(line.contains(needle), "{needle:?} missing: {line}");
        }
        assert!(
            !stdout.contains("net-echo"),
            "the guest must not run: {stdout}"
        );
        return;
    }
    ns.start_echo();
    let (status, stdout, stderr) = ns.ferrovm(&args, &[]);
    assert_eq!(status, Some(1), "{stdout}\n--- stderr\n{stderr}");
    assert!(stdout.contains("net-echo: 10 UDP echoes"), "{stdout}");
    assert!(stdout.trim_end().ends_with("PASS"), "{stdout}");
    assert!(!stderr.contains("serves the queues itself"), "{stderr}");
}

/// Without the kernel's irqfd and ioeventfd (here: turned off) vhost-net cannot interrupt
/// the guest or take its notifications: refused at start-up, by name.
#[test]
fn vhost_on_without_kernel_eventfds_is_refused() {
    let ns = Namespace::new("eventfds");
    let kernel = guest("net-echo");
    let net = format!("tap={TAP},vhost=on");
    let (status, _, stderr) = ns.ferrovm(
        &["--kernel", kernel.to_str().unwrap(), "--net", &net],
        &[("FERROVM_KERNEL_EVENTFDS", "off")],
    );
    let line = one_error_line(status, &stderr);
    assert!(line.contains("vhost=on"), "{line}");
    assert!(line.contains("irqfd and ioeventfd"), "{line}");
}
