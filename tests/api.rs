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

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-api-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn idle_vm(socket: &std::path::Path) -> std::process::Child {
    let kernel = guest("idle");
    Command::new(FERROVM)
        .args(["run", "--kernel", kernel.to_str().unwrap()])
        .args(["--memory", "64M", "--serial", "none", "--api-socket"])
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// `--api-socket` never replaces a file that is not a stale socket (it used to delete a
/// regular file there); the socket is 0600 whatever the umask; and a VMM leaves in place a
/// socket path that another VMM took over meanwhile (it used to remove it on exit).
#[test]
fn the_api_socket_destroys_nothing() {
    require_kvm();
    let dir = scratch("sockfiles");
    let kernel = guest("idle");
    let precious = dir.join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let run = ferrovm(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--api-socket",
            precious.to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    run.expect_error("is a regular file, not a socket: refusing to replace it");
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");

    let socket = dir.join("api.sock");
    let mut vm = idle_vm(&socket);
    wait_for_socket(&socket);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    // Another VMM takes the path over (the first one's file removed by hand).
    std::fs::remove_file(&socket).unwrap();
    let other = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // SAFETY: signalling our own child, not reaped yet.
    unsafe { libc::kill(vm.id() as i32, libc::SIGTERM) };
    let status = vm.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    assert!(
        socket.exists(),
        "the exiting VMM removed a socket another process serves"
    );
    drop(other);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ctl snapshot` never turns a device node, a FIFO or a symlink into a plain file (the
/// temporary file used to be renamed over whatever was there).
#[test]
fn snapshots_replace_only_regular_files() {
    require_kvm();
    let dir = scratch("snapfiles");
    let socket = dir.join("api.sock");
    let mut vm = idle_vm(&socket);
    wait_for_socket(&socket);
    let s = socket.to_str().unwrap();
    let fifo = dir.join("fifo");
    let device = dir.join("null");
    let target = dir.join("target");
    let link = dir.join("link");
    std::fs::write(&target, b"untouched").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let c = |p: &std::path::Path| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated paths; a FIFO and a char device like /dev/null (1, 3).
    unsafe {
        assert_eq!(libc::mkfifo(c(&fifo).as_ptr(), 0o600), 0);
        assert_eq!(
            libc::mknod(
                c(&device).as_ptr(),
                libc::S_IFCHR | 0o600,
                libc::makedev(1, 3)
            ),
            0
        );
    }
    use std::os::unix::fs::FileTypeExt;
    for (path, kind) in [
        (&fifo, "a FIFO"),
        (&device, "a device node"),
        (&link, "a symbolic link"),
    ] {
        let run = ctl(s, &["snapshot", path.to_str().unwrap()]);
        run.expect_error(&format!(
            "exists and is {kind}, not a regular file: refusing to replace it"
        ));
    }
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(std::fs::symlink_metadata(&device)
        .unwrap()
        .file_type()
        .is_char_device());
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"untouched");
    // A regular file is replaced.
    ctl(s, &["snapshot", target.to_str().unwrap()]).expect_status(0);
    assert_ne!(std::fs::read(&target).unwrap(), b"untouched");

    // Restoring from a FIFO used to wait for a writer forever.
    let run = ferrovm(
        &["run", "--restore", fifo.to_str().unwrap()],
        Duration::from_secs(30),
    );
    run.expect_error("snapshot must be a regular file; this is a FIFO");
    ctl(s, &["shutdown"]).expect_status(0);
    vm.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pipe whose reader never reads, already full: any blocking write to it hangs.
fn full_pipe() -> (std::fs::File, std::fs::File) {
    use std::os::unix::io::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: `fds` is valid for two descriptors; both are owned by the Files below only.
    let (read_end, write_end) = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    use std::io::Write;
    use std::os::unix::io::AsRawFd;
    let fd = write_end.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
    let mut w = &write_end;
    while w.write(&[b'x'; 4096]).is_ok() {}
    // Blocking again, as a child's inherited stdout would be.
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
    (read_end, write_end)
}

/// Nobody reads the guest's console (`ferrovm run | less`, not scrolled): pause, snapshot,
/// status and shutdown still work (the vCPU used to block in write(2), so that pause failed
/// and shutdown and SIGTERM waited for the reader), and the exit is not held up.
#[test]
fn an_unread_console_never_blocks_the_vmm() {
    require_kvm();
    let dir = scratch("stalled");
    let socket = dir.join("api.sock");
    let (_read_end, write_end) = full_pipe();
    let kernel = guest("migrate-dirty");
    let mut vm = Command::new(FERROVM)
        .args([
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "mib=8",
        ])
        .args(["--memory", "64M", "--api-socket"])
        .arg(&socket)
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_socket(&socket);
    let s = socket.to_str().unwrap();
    // Let the guest print into the full pipe.
    std::thread::sleep(Duration::from_millis(500));
    ctl(s, &["pause"]).expect_status(0).expect_stdout("paused");
    let snap = dir.join("vm.snap");
    ctl(s, &["snapshot", snap.to_str().unwrap()]).expect_status(0);
    ctl(s, &["resume"]).expect_status(0);
    let run = ctl(s, &["--json", "status"]);
    let status: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert!(status["serial_dropped_bytes"].is_u64(), "{status}");
    let started = Instant::now();
    ctl(s, &["shutdown"]).expect_status(0);
    let code = vm.wait().unwrap();
    assert_eq!(code.code(), Some(0));
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut err = String::new();
    use std::io::Read;
    vm.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("not reading"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ctl` gives up on a VMM that does not answer (it used to wait forever).
#[test]
fn ctl_gives_up_on_a_silent_vmm() {
    let dir = scratch("silent");
    let socket = dir.join("silent.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let s = socket.to_str().unwrap();
    let run = ferrovm(
        &["ctl", "--api-socket", s, "--timeout", "1", "status"],
        Duration::from_secs(20),
    );
    run.expect_error("the VMM did not answer within 1 s");
    assert!(run.elapsed < Duration::from_secs(5), "{:?}", run.elapsed);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Another user is refused even where the socket's mode would let it connect.
#[test]
fn other_users_are_refused() {
    require_kvm();
    let dir = scratch("otheruser");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.join("api.sock");
    let mut vm = idle_vm(&socket);
    wait_for_socket(&socket);
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    use std::os::unix::process::CommandExt;
    let out = Command::new(FERROVM)
        .args(["ctl", "--api-socket", socket.to_str().unwrap(), "status"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("permission denied: this API serves its own user and root only"),
        "{stderr}"
    );
    ctl(socket.to_str().unwrap(), &["shutdown"]).expect_status(0);
    vm.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
