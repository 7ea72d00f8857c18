//! Running `ferrovm` on the test guests, with a time limit, capturing what the guest printed.

#![allow(dead_code)]

pub mod linux;
pub mod relay;
pub mod socket_console;
pub mod terminal;
pub mod vsock;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const FERROVM: &str = env!("CARGO_BIN_EXE_ferrovm");

/// Fails loudly (never skips) when the accelerator is missing.
pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "/dev/kvm is missing: guest tests need the KVM accelerator and are not skipped"
    );
}

pub fn guest(name: &str) -> PathBuf {
    let dir = std::env::var_os("FERROVM_GUESTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/guests"));
    let path = dir.join(format!("{name}.elf"));
    assert!(
        path.exists(),
        "{} is missing: build the guests with `make guests`",
        path.display()
    );
    path
}

pub struct Run {
    pub status: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// Peak resident set of the ferrovm process, in KiB.
    pub max_rss_kib: i64,
}

impl Run {
    /// Asserts the exit status, showing everything the run printed when it differs.
    pub fn expect_status(&self, status: i32) -> &Self {
        assert_eq!(
            self.status,
            Some(status),
            "unexpected exit status\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout,
            self.stderr
        );
        self
    }

    pub fn expect_stdout(&self, needle: &str) -> &Self {
        assert!(
            self.stdout.contains(needle),
            "stdout lacks {needle:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout,
            self.stderr
        );
        self
    }

    /// The last non-empty line the guest printed.
    pub fn last_line(&self) -> &str {
        self.stdout
            .lines()
            .rev()
            .map(|l| l.trim_end_matches('\r'))
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
    }

    /// Asserts a VMM error: status 2 and one line on stderr containing `needle`.
    pub fn expect_error(&self, needle: &str) -> &Self {
        self.expect_status(2);
        let lines: Vec<&str> = self.stderr.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            lines.len(),
            1,
            "expected one error line, got:\n{}",
            self.stderr
        );
        assert!(
            lines[0].contains(needle),
            "error line lacks {needle:?}: {}",
            lines[0]
        );
        self
    }
}

/// Runs `ferrovm ARGS...`, killing it after `limit`.
pub fn ferrovm(args: &[&str], limit: Duration) -> Run {
    ferrovm_with(args, limit, |_| {})
}

/// Like [`ferrovm`], calling `during(pid)` once the process has started.
pub fn ferrovm_with(args: &[&str], limit: Duration, during: impl FnOnce(i32)) -> Run {
    let mut command = Command::new(FERROVM);
    command.args(args);
    run_limited(command, args, limit, during)
}

/// Like [`ferrovm`], inside the network namespace `ns` (`ip netns exec`, which execs ferrovm,
/// so the process and its exit status are ferrovm's own).
pub fn ferrovm_in_namespace(ns: &str, args: &[&str], limit: Duration) -> Run {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", ns, FERROVM]).args(args);
    run_limited(command, args, limit, |_| {})
}

/// Runs `command` (ferrovm with `args`), killing it after `limit`.
fn run_limited(
    mut command: Command,
    args: &[&str],
    limit: Duration,
    during: impl FnOnce(i32),
) -> Run {
    let start = Instant::now();
    // Reaped with wait4 below rather than Child::wait, to get the child's own rusage.
    #[allow(clippy::zombie_processes)]
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferrovm");
    let pid = child.id() as i32;
    let mut stdout_pipe = child.stdout.take().unwrap();
    let mut stderr_pipe = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout_pipe.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr_pipe.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    during(pid);
    let reaped = Arc::new(AtomicBool::new(false));
    let killer = {
        let deadline = start + limit;
        let reaped = reaped.clone();
        std::thread::spawn(move || {
            while Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                if reaped.load(Ordering::SeqCst) {
                    return false;
                }
            }
            // SAFETY: pid is our child and not reaped yet (wait4 below is still blocked on
            // it), so the id cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            true
        })
    };
    let mut wstatus = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child; wstatus and usage are valid for writes.
    let rc = unsafe { libc::wait4(pid, &mut wstatus, 0, &mut usage) };
    reaped.store(true, Ordering::SeqCst);
    assert_eq!(rc, pid, "wait4 failed");
    let elapsed = start.elapsed();
    let timed_out = killer.join().unwrap();
    let stdout = out_reader.join().unwrap();
    let stderr = err_reader.join().unwrap();
    assert!(
        !timed_out,
        "ferrovm {args:?} did not finish within {limit:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    let (status, signal) = if libc::WIFEXITED(wstatus) {
        (Some(libc::WEXITSTATUS(wstatus)), None)
    } else {
        (None, Some(libc::WTERMSIG(wstatus)))
    };
    Run {
        status,
        signal,
        stdout,
        stderr,
        elapsed,
        max_rss_kib: usage.ru_maxrss,
    }
}

pub fn run_guest(name: &str, extra: &[&str]) -> Run {
    require_kvm();
    let kernel = guest(name);
    let mut args = vec!["run", "--kernel", kernel.to_str().unwrap()];
    args.extend_from_slice(extra);
    ferrovm(&args, Duration::from_secs(120))
}

/// Makes the network namespace `ns` afresh (its loopback up) holding the tap `tap` with a
/// virtio-net header (and `multi_queue`, or the MAC `mac`, when asked), up at 10.0.2.2/24.
pub fn tap_namespace(ns: &str, tap: &str, multi_queue: bool, mac: Option<&str>) {
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
    ip(&["netns", "add", ns]);
    ip(&["-n", ns, "link", "set", "lo", "up"]);
    let mut tuntap = vec![
        "-n", ns, "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr",
    ];
    if multi_queue {
        tuntap.push("multi_queue");
    }
    ip(&tuntap);
    if let Some(mac) = mac {
        ip(&["-n", ns, "link", "set", tap, "address", mac]);
    }
    ip(&["-n", ns, "addr", "add", "10.0.2.2/24", "dev", tap]);
    ip(&["-n", ns, "link", "set", tap, "up"]);
}

/// Runs `ip` with `args` (network namespaces, taps, addresses); panics with its stderr if it
/// fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a thread that has entered the network namespace `ns` (made by `ip netns add`):
/// the sockets it opens live in that namespace, whichever thread uses them afterwards.
pub fn in_namespace<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns on a namespace file descriptor we hold; it changes only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// Waits for `child` to end; kills it and fails the test after `limit`. Its exit code.
pub fn wait_child(child: &mut std::process::Child, limit: Duration) -> Option<i32> {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ferrovm did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The SHA-256 of `bytes` as `sha256sum` prints it.
pub fn sha256(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// A TCP port on 127.0.0.1 that nobody listens on now.
pub fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
