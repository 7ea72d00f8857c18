//! The console's input: `guests/serial-echo.c` echoes what it reads from COM1, driven
//! through `--serial socket:PATH` and through a pseudo-terminal on standard input (raw
//! mode while the VMM runs, the terminal's settings back afterwards, Ctrl-A x to quit).

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::io::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-serial-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running `ferrovm run` on serial-echo, its output collected as it comes.
struct Vm {
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

fn collect(mut pipe: impl Read + Send + 'static) -> Arc<Mutex<Vec<u8>>> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let sink = buf.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut chunk) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    buf
}

impl Vm {
    fn start(serial: &str, stdin: Stdio) -> Vm {
        require_kvm();
        let kernel = guest("serial-echo");
        let mut child = Command::new(FERROVM)
            .args([
                "run",
                "--kernel",
                kernel.to_str().unwrap(),
                "--serial",
                serial,
            ])
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ferrovm");
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Vm {
            child,
            stdout,
            stderr,
        }
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().unwrap()).into_owned()
    }

    fn wait_for_stdout(&self, needle: &str) {
        wait_until(
            Duration::from_secs(30),
            || self.output().contains(needle),
            || format!("stdout never showed {needle:?}:\n{}", self.output()),
        );
    }

    /// The exit status, within 30 s.
    fn status(mut self) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status
                    .code()
                    .unwrap_or_else(|| panic!("killed: {status:?}"));
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "ferrovm did not exit\n--- stdout\n{}\n--- stderr\n{}",
                    self.output(),
                    String::from_utf8_lossy(&self.stderr.lock().unwrap())
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A test that fails leaves no VMM behind.
impl Drop for Vm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{}", what());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn connect(path: &Path) -> UnixStream {
    let mut last = None;
    for _ in 0..500 {
        match UnixStream::connect(path) {
            Ok(s) => return s,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("cannot connect to {}: {last:?}", path.display());
}

/// Reads from `stream` until `needle` arrives; returns everything read.
fn read_until(stream: &mut UnixStream, needle: &[u8]) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(needle.len()).any(|w| w == needle) {
        let n = stream.read(&mut chunk).expect("read the console socket");
        assert!(
            n > 0,
            "the socket closed; got {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&chunk[..n]);
    }
    got
}

#[test]
fn a_socket_client_is_the_console_both_ways() {
    let dir = scratch("socket");
    let path = dir.join("console.sock");
    let vm = Vm::start(&format!("socket:{}", path.display()), Stdio::null());
    let mut client = connect(&path);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    // Far more than the UART's 64-byte FIFO at once: the rest must wait, not be lost.
    let typed: Vec<u8> = (0..3000u32).map(|i| b'0' + (i % 75) as u8).collect();
    client.write_all(&typed).unwrap();
    client.write_all(&[0x04]).unwrap();
    let echoed = read_until(&mut client, b"PASS");
    let sum: u64 = typed.iter().map(|&b| u64::from(b)).sum();
    let text = String::from_utf8_lossy(&echoed);
    assert!(
        echoed.windows(typed.len()).any(|w| w == typed),
        "the echo differs from what was sent:\n{text}"
    );
    assert!(
        text.contains(&format!("serial-echo: 3000 bytes, sum {sum}")),
        "{text}"
    );
    assert_eq!(vm.status(), 1);
    assert!(!path.exists(), "the socket is removed at exit");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn one_socket_client_at_a_time() {
    let dir = scratch("second");
    let path = dir.join("console.sock");
    let vm = Vm::start(&format!("socket:{}", path.display()), Stdio::null());
    let mut first = connect(&path);
    first.write_all(b"one").unwrap();
    read_until(&mut first, b"one");
    let mut second = UnixStream::connect(&path).unwrap();
    second
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8];
    assert_eq!(
        second.read(&mut byte).unwrap(),
        0,
        "the second client is closed"
    );
    // The first one is still the console, and a client that left makes room for another.
    first.write_all(b"two").unwrap();
    read_until(&mut first, b"two");
    drop(first);
    let mut third = connect(&path);
    third.write_all(b"three\x04").unwrap();
    let got = read_until(&mut third, b"PASS");
    assert!(String::from_utf8_lossy(&got).contains("three"));
    assert_eq!(vm.status(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_console_socket_replaces_nothing_but_a_stale_socket() {
    let dir = scratch("refuse");
    let file = dir.join("precious");
    std::fs::write(&file, b"keep me").unwrap();
    let kernel = guest("serial-echo");
    let serial = format!("socket:{}", file.display());
    let run = ferrovm(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--serial",
            &serial,
        ],
        Duration::from_secs(30),
    );
    run.expect_error("--serial");
    assert!(run.stderr.contains("not a socket"), "{}", run.stderr);
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pseudo-terminal: the VMM gets the slave as its standard input.
struct Pty {
    master: File,
    slave: File,
}

impl Pty {
    fn open() -> Pty {
        let (mut master, mut slave) = (-1, -1);
        // SAFETY: openpty writes two descriptors; the name, termios and size are optional.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both descriptors are new and owned by nothing else.
        unsafe {
            Pty {
                master: File::from_raw_fd(master),
                slave: File::from_raw_fd(slave),
            }
        }
    }

    fn settings(&self) -> libc::termios {
        // SAFETY: an all-zero termios is valid for tcgetattr to fill.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: the slave is an open terminal; `t` is valid for writes.
        assert_eq!(
            unsafe { libc::tcgetattr(self.slave.as_raw_fd(), &mut t) },
            0
        );
        t
    }

    fn is_raw(&self) -> bool {
        let t = self.settings();
        t.c_lflag & (libc::ICANON | libc::ECHO | libc::ISIG) == 0
    }
}

fn same_settings(a: &libc::termios, b: &libc::termios) -> bool {
    (a.c_iflag, a.c_oflag, a.c_cflag, a.c_lflag) == (b.c_iflag, b.c_oflag, b.c_cflag, b.c_lflag)
        && a.c_cc == b.c_cc
}

/// Starts the VMM on the pty, waits for raw mode and the guest.
fn start_on_terminal(pty: &Pty) -> Vm {
    let vm = Vm::start("stdio", Stdio::from(pty.slave.try_clone().unwrap()));
    wait_until(
        Duration::from_secs(30),
        || pty.is_raw(),
        || "the terminal never went into raw mode".into(),
    );
    vm.wait_for_stdout("serial-echo: ready");
    vm
}

#[test]
fn the_terminal_is_raw_while_running_and_ctrl_a_x_quits() {
    let mut pty = Pty::open();
    let before = pty.settings();
    assert!(!pty.is_raw());
    let vm = start_on_terminal(&pty);
    // Ctrl-C is a byte for the guest now, and Ctrl-A Ctrl-A one literal Ctrl-A.
    pty.master.write_all(b"hi\x03\x01\x01!").unwrap();
    vm.wait_for_stdout("hi\x03\x01!");
    pty.master.write_all(b"\x01x").unwrap();
    assert_eq!(
        vm.status(),
        0,
        "Ctrl-A x ends the VMM with status 0, as QEMU"
    );
    assert!(
        same_settings(&before, &pty.settings()),
        "terminal settings restored"
    );
}

#[test]
fn the_terminal_is_restored_when_the_guest_ends_and_on_sigterm() {
    let mut pty = Pty::open();
    let before = pty.settings();
    let vm = start_on_terminal(&pty);
    pty.master.write_all(b"done\x04").unwrap();
    vm.wait_for_stdout("PASS");
    assert_eq!(vm.status(), 1);
    assert!(
        same_settings(&before, &pty.settings()),
        "restored after the guest ended"
    );

    let vm = start_on_terminal(&pty);
    // SAFETY: the child is alive (it is waiting for input) and ours.
    unsafe { libc::kill(vm.child.id() as i32, libc::SIGTERM) };
    assert_eq!(vm.status(), 128 + libc::SIGTERM);
    assert!(
        same_settings(&before, &pty.settings()),
        "restored after SIGTERM"
    );
}
