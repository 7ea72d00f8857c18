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

/// An idle guest in a scratch directory, its API on `api.sock` there and ready.
struct IdleVm {
    dir: std::path::PathBuf,
    socket: std::path::PathBuf,
    child: std::process::Child,
}

impl IdleVm {
    fn start(name: &str) -> IdleVm {
        let dir = scratch(name);
        let socket = dir.join("api.sock");
        let child = idle_vm(&socket);
        wait_for_socket(&socket);
        IdleVm { dir, socket, child }
    }

    fn socket(&self) -> &str {
        self.socket.to_str().unwrap()
    }

    /// Shuts the guest down through `ctl` and removes the directory.
    fn shut_down(mut self) {
        ctl(self.socket(), &["shutdown"]).expect_status(0);
        self.child.wait().unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
    let vm = IdleVm::start("snapfiles");
    let dir = vm.dir.clone();
    let s = vm.socket();
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
    vm.shut_down();
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

/// A VMM waiting for its configuration on `socket` (`run --api-socket` alone).
fn unconfigured_vm(socket: &std::path::Path, serial: &std::path::Path) -> std::process::Child {
    let serial = format!("file:{}", serial.display());
    let vm = Command::new(FERROVM)
        .args(["run", "--serial", &serial, "--api-socket"])
        .arg(socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_socket(socket);
    vm
}

/// A VMM that a failed assertion must not leave running.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `console` blocks of docs/api.md: `$ ` command lines, each with its expected output.
fn documented_sessions() -> Vec<Vec<(String, Vec<String>)>> {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.md")).unwrap();
    let mut sessions = Vec::new();
    let mut current: Option<Vec<(String, Vec<String>)>> = None;
    for line in doc.lines() {
        match (&mut current, line) {
            (None, "```console") => current = Some(Vec::new()),
            (Some(_), "```") => sessions.push(current.take().unwrap()),
            (Some(steps), l) => match l.strip_prefix("$ ") {
                Some(command) => steps.push((command.to_string(), Vec::new())),
                None => steps
                    .last_mut()
                    .expect("output before a command")
                    .1
                    .push(l.into()),
            },
            (None, _) => {}
        }
    }
    assert!(sessions.len() >= 2, "docs/api.md lost its curl examples");
    sessions
}

/// Every `curl` example of docs/api.md, run as written against a real VMM (each block in a
/// VMM of its own, in order: the first writes the snapshot the second loads), so the doc
/// cannot rot.
#[test]
fn the_documented_curl_examples_work() {
    require_kvm();
    let dir = scratch("doc");
    let socket = dir.join("vm.sock");
    let guests = guest("idle").parent().unwrap().to_path_buf();
    let replace = |text: &str| {
        text.replace("/tmp/vm.sock", socket.to_str().unwrap())
            .replace("/tmp/vm.snap", dir.join("vm.snap").to_str().unwrap())
            .replace("target/guests/", &format!("{}/", guests.display()))
    };
    for (i, session) in documented_sessions().into_iter().enumerate() {
        let mut vm = KillOnDrop(unconfigured_vm(&socket, &dir.join(format!("serial-{i}"))));
        for (command, expected) in session {
            let out = Command::new("sh")
                .arg("-c")
                .arg(replace(&command))
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let got: Vec<&str> = stdout.lines().collect();
            let want: Vec<String> = expected.iter().map(|l| replace(l)).collect();
            assert_eq!(got, want, "$ {command}");
        }
        let status = vm.0.wait().unwrap();
        assert_eq!(status.code(), Some(0), "session {i} ends with vm.shutdown");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One raw HTTP exchange: writes `request`, returns the status code of the reply and the
/// reply (`None`: the VMM closed the connection without one).
fn raw_exchange(socket: &std::path::Path, request: &[u8]) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let _ = stream.write_all(request);
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_string)
                })
                .and_then(|n| n.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= length {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&reply).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    Some((status, text))
}

fn api(
    socket: &std::path::Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let body: Option<serde_json::Value> = body.map(|b| serde_json::from_str(b).unwrap());
    let answer = vmm::api::client::call(
        socket,
        method,
        path,
        body.as_ref(),
        Some(Duration::from_secs(30)),
    )
    .unwrap();
    (answer.status, answer.body)
}

/// Malformed and careless requests get the status each must get, and the VMM serves on.
#[test]
fn malformed_requests_get_their_status() {
    require_kvm();
    let vm = IdleVm::start("malformed");
    let socket = vm.socket.clone();
    let put = |path: &str, body: &str| {
        raw_exchange(
            &socket,
            format!(
                "PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap()
    };
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/api/v1/vm.snapshot", "{not json", 400, "bad request body"),
        (
            "/api/v1/vm.snapshot",
            r#"{"destination_url":"relative/path"}"#,
            400,
            "absolute",
        ),
        (
            "/api/v1/vm.resume",
            r#"{"force":true,"extra":1}"#,
            400,
            "unknown field `extra`",
        ),
        (
            "/api/v1/vm.send-migration",
            r#"{"destination_url":"tcp:127.0.0.1:1","local":true}"#,
            400,
            "local: true needs a unix:PATH destination",
        ),
        ("/api/v1/vm.nothing", "", 404, "no such endpoint"),
        ("/api/v1/vm.info", "", 405, "PUT is not allowed"),
        (
            "/actions",
            r#"{"action_type":"InstanceStart"}"#,
            400,
            "already running",
        ),
        (
            "/drives/a%2Fb",
            r#"{"drive_id":"a","path_on_host":"/x","is_root_device":false}"#,
            400,
            "bad id",
        ),
        ("/logger", r#"{"log_path":"/tmp/x"}"#, 400, "not supported"),
    ];
    for (path, body, status, needle) in cases {
        let (got, text) = put(path, body);
        assert_eq!(got, *status, "PUT {path} {body}: {text}");
        assert!(text.contains(needle), "PUT {path} {body}: {text}");
        assert!(text.contains("\"fault_message\""), "{text}");
    }
    // A body over 64 KiB: 413, before it is read in full.
    let big = "x".repeat(100 * 1024);
    assert_eq!(put("/api/v1/vm.resume", &big).0, 413);
    // A head over 16 KiB: 431.
    let huge_header = format!(
        "GET /api/v1/vm.info HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n",
        "y".repeat(32 * 1024)
    );
    assert_eq!(
        raw_exchange(&socket, huge_header.as_bytes()).map(|r| r.0),
        Some(431)
    );
    // Not HTTP at all: 400, or the connection closed.
    if let Some((status, text)) = raw_exchange(&socket, b"\x16\x03\x01 hello\r\n\r\n") {
        assert_eq!(status, 400, "{text}");
    }
    let (status, info) = api(&socket, "GET", "/api/v1/vm.info", None);
    assert_eq!((status, info["state"].as_str()), (200, Some("running")));
    vm.shut_down();
}

/// More than 16 connections get 429 (not a thread each); a client that sends nothing, or a
/// body that never arrives, is cut off; conflicting state changes get 409 while a migration
/// hangs on a silent destination, which a cancel ends with the guest running.
#[test]
fn careless_clients_and_conflicts() {
    require_kvm();
    let dir = scratch("careless");
    let socket = dir.join("api.sock");
    let mut vm = idle_vm(&socket);
    wait_for_socket(&socket);
    let idle: Vec<_> = (0..16)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let refused = raw_exchange(&socket, b"GET /api/v1/vm.info HTTP/1.1\r\nHost: x\r\n\r\n");
    let (status, text) = refused.expect("an answer, not a closed connection");
    assert_eq!(status, 429, "{text}");
    // Silent clients are closed after 10 s; then the API serves again.
    let started = Instant::now();
    for mut stream in idle {
        use std::io::Read;
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut buf = [0u8; 64];
        assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    // A body announced but never sent: 408 after 10 s.
    let slow = raw_exchange(
        &socket,
        b"PUT /api/v1/vm.resume HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{",
    );
    assert_eq!(slow.map(|r| r.0), Some(408));

    // A destination that accepts and never answers: the migration waits on it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp:{}", silent.local_addr().unwrap());
    let migrating = {
        let socket = socket.clone();
        let body = format!(r#"{{"destination_url":"{url}"}}"#);
        std::thread::spawn(move || api(&socket, "PUT", "/api/v1/vm.send-migration", Some(&body)))
    };
    let _peer = silent.accept().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while api(&socket, "GET", "/api/v1/vm.info", None).1["operation"] != "migration" {
        assert!(
            Instant::now() < deadline,
            "the migration never showed in vm.info"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (method, path, body) in [
        ("PUT", "/api/v1/vm.resume", None),
        ("PUT", "/api/v1/vm.pause", None),
        ("PATCH", "/vm", Some(r#"{"state":"Paused"}"#)),
        (
            "PUT",
            "/api/v1/vm.snapshot",
            Some(r#"{"destination_url":"file:///tmp/never.snap"}"#),
        ),
        (
            "PUT",
            "/snapshot/create",
            Some(r#"{"snapshot_path":"/tmp/never.snap","mem_file_path":"/tmp/never.mem"}"#),
        ),
        ("PUT", "/api/v1/vm.shutdown", None),
    ] {
        let (status, reply) = api(&socket, method, path, body);
        assert_eq!(status, 409, "{method} {path}: {reply}");
        assert_eq!(
            reply["fault_message"], "a migration is in progress",
            "{method} {path}"
        );
    }
    assert!(!std::path::Path::new("/tmp/never.snap").exists());
    let (status, progress) = api(&socket, "GET", "/api/v1/vm.migration-progress", None);
    assert_eq!((status, progress["active"].as_bool()), (200, Some(true)));
    assert_eq!(
        api(&socket, "PUT", "/api/v1/vm.migration-cancel", None).0,
        200
    );
    let (status, reply) = migrating.join().unwrap();
    assert_eq!(status, 500, "{reply}");
    assert!(
        reply["fault_message"]
            .as_str()
            .unwrap()
            .contains("cancelled"),
        "{reply}"
    );
    let (_, info) = api(&socket, "GET", "/api/v1/vm.info", None);
    assert_eq!(
        (info["state"].as_str(), info["operation"].as_str()),
        (Some("running"), None)
    );
    // A snapshot of a paused guest works and leaves it paused.
    assert_eq!(api(&socket, "PUT", "/api/v1/vm.pause", None).0, 200);
    let snap = dir.join("paused.snap");
    let body = format!(r#"{{"destination_url":"file://{}"}}"#, snap.display());
    let (status, report) = api(&socket, "PUT", "/api/v1/vm.snapshot", Some(&body));
    assert_eq!(status, 200, "{report}");
    assert!(report["pages"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(
        api(&socket, "GET", "/api/v1/vm.info", None).1["state"],
        "paused"
    );
    assert_eq!(api(&socket, "PUT", "/api/v1/vm.shutdown", None).0, 200);
    assert_eq!(vm.wait().unwrap().code(), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A VMM waiting for its configuration answers Firecracker's pre-boot queries, refuses a
/// start it cannot build and goes on waiting, and ends on SIGTERM like a running one (128 +
/// 15, its socket removed).
#[test]
fn an_unconfigured_vmm_waits_and_ends_on_sigterm() {
    require_kvm();
    let dir = scratch("preboot");
    let socket = dir.join("api.sock");
    let mut vm = unconfigured_vm(&socket, &dir.join("serial"));
    let (status, info) = api(&socket, "GET", "/", None);
    assert_eq!((status, info["state"].as_str()), (200, Some("Not started")));
    assert_eq!(
        api(&socket, "PATCH", "/vm", Some(r#"{"state":"Paused"}"#)).0,
        400
    );
    let start = Some(r#"{"action_type":"InstanceStart"}"#);
    let (status, reply) = api(&socket, "PUT", "/actions", start);
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["fault_message"]
            .as_str()
            .unwrap()
            .contains("no boot source"),
        "{reply}"
    );
    let boot = Some(r#"{"kernel_image_path":"/nonexistent/kernel"}"#);
    assert_eq!(api(&socket, "PUT", "/boot-source", boot).0, 204);
    let (status, reply) = api(&socket, "PUT", "/actions", start);
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["fault_message"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/kernel"),
        "{reply}"
    );
    for mac in ["02:00:00:00:01", "00:00:00:00:00:00", "01:00:5e:00:00:01"] {
        let bad_mac =
            format!(r#"{{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"{mac}"}}"#);
        let (status, reply) = api(&socket, "PUT", "/network-interfaces/eth0", Some(&bad_mac));
        assert_eq!(status, 400, "{mac}: {reply}");
    }
    let net = Some(r#"{"iface_id":"eth0","host_dev_name":"tap0","guest_mac":"02:00:00:00:00:01"}"#);
    assert_eq!(api(&socket, "PUT", "/network-interfaces/eth0", net).0, 204);
    let host_cid = Some(r#"{"guest_cid":2,"uds_path":"/tmp/v.sock"}"#);
    let (status, reply) = api(&socket, "PUT", "/vsock", host_cid);
    assert_eq!(status, 400, "{reply}");
    assert!(reply["fault_message"]
        .as_str()
        .unwrap()
        .contains("guest_cid: cid 2 is reserved"));
    let (_, config) = api(&socket, "GET", "/vm/config", None);
    assert_eq!(
        config["network-interfaces"][0]["host_dev_name"], "tap0",
        "{config}"
    );
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(vm.id() as i32, libc::SIGTERM) };
    assert_eq!(vm.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    assert!(!socket.exists(), "the socket is removed");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Firecracker's `SendCtrlAltDel`: the kbd-cad guest reads Ctrl+Alt+Del's make and break
/// codes from the i8042 through IRQ 1, in set 1 with translation on and set 2 with it off,
/// under both interrupt controllers.
#[test]
fn send_ctrl_alt_del_reaches_the_guest_keyboard() {
    require_kvm();
    for (irqchip, xlate) in [("kernel", 1), ("split", 0)] {
        let dir = scratch(&format!("cad-{irqchip}"));
        let socket = dir.join("api.sock");
        let serial = dir.join("serial.txt");
        let kernel = guest("kbd-cad");
        let child = Command::new(FERROVM)
            .args(["run", "--kernel", kernel.to_str().unwrap()])
            .args(["--memory", "64M", "--irqchip", irqchip])
            .args(["--cmdline", &format!("xlate={xlate}")])
            .args(["--serial", &format!("file:{}", serial.display())])
            .arg("--api-socket")
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut vm = KillOnDrop(child);
        wait_for_socket(&socket);
        let output = || std::fs::read_to_string(&serial).unwrap_or_default();
        let start = Instant::now();
        while !output().contains("kbd-cad: ready") {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{irqchip}: the guest never got ready: {}",
                output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (status, body) = api(
            &socket,
            "PUT",
            "/actions",
            Some(r#"{"action_type":"SendCtrlAltDel"}"#),
        );
        assert_eq!(status, 204, "{irqchip}: {body}");
        let deadline = Instant::now() + Duration::from_secs(60);
        let code = loop {
            if let Some(code) = vm.0.try_wait().unwrap() {
                break code.code();
            }
            assert!(Instant::now() < deadline, "{irqchip}: {}", output());
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = output();
        assert!(text.contains("PASS"), "{irqchip} xlate={xlate}: {text}");
        assert!(
            text.contains(&format!("scancode set {}", if xlate == 1 { 1 } else { 2 })),
            "{text}"
        );
        // Debug-exit 0 (pass) is exit status (0 << 1) | 1.
        assert_eq!(code, Some(1), "{irqchip}: {text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A guest that never reads its keyboard: the keys of two `SendCtrlAltDel`s wait (the
/// first byte in the output buffer, 15 in the 16-byte queue); a third gets 409, and the
/// VMM serves on.
#[test]
fn send_ctrl_alt_del_to_an_unread_keyboard_is_refused_once_full() {
    require_kvm();
    let dir = scratch("cad-full");
    let socket = dir.join("api.sock");
    let _vm = KillOnDrop(idle_vm(&socket));
    wait_for_socket(&socket);
    let cad = Some(r#"{"action_type":"SendCtrlAltDel"}"#);
    for _ in 0..2 {
        let (status, body) = api(&socket, "PUT", "/actions", cad);
        assert_eq!(status, 204, "{body}");
    }
    let (status, body) = api(&socket, "PUT", "/actions", cad);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["fault_message"]
            .as_str()
            .is_some_and(|m| m.contains("keyboard queue is full")),
        "{body}"
    );
    let (status, _) = api(&socket, "GET", "/api/v1/vm.info", None);
    assert_eq!(status, 200);
    let _ = std::fs::remove_dir_all(&dir);
}
