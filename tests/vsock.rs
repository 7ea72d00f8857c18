//! virtio-vsock end to end: real guests under KVM open stream connections through the
//! device with Firecracker's host-side convention. The host side of each test is here: an
//! echo server on `PATH_port` for guest-initiated connections, and a client that connects to
//! `PATH`, writes `CONNECT port` and checks `OK <port>` for host-initiated ones. Data
//! integrity is checked at both ends, with more data than one credit window either way.
//! Also: hostile packets from the guest, and connections across a snapshot (the restored
//! guest sees a transport reset and connects afresh).

mod common;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;

/// The host port vsock-echo connects to, and the guest port it listens on.
const HOST_PORT: u32 = 1234;
const GUEST_PORT: u32 = 5000;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-vsock-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The pattern the host sends into the guest (the guest echoes it).
fn pattern(i: u64) -> u8 {
    (i ^ (i >> 8) ^ (i >> 16) ^ 0xa5) as u8
}

/// Echoes every connection to `PATH_port` until `stop`; returns the bytes echoed per
/// connection.
fn echo_server(listener: UnixListener, stop: Arc<AtomicBool>) -> JoinHandle<Vec<u64>> {
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let mut echoed = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    let mut total = 0u64;
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if stream.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                                total += n as u64;
                            }
                        }
                    }
                    echoed.push(total);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("echo server accept: {e}"),
            }
        }
        echoed
    })
}

/// Connects to the device's socket with `CONNECT port`, retrying while the guest refuses
/// (it is not listening yet); returns the stream and the host port the VMM named.
fn connect_into_guest(socket: &Path, port: u32, limit: Duration) -> (UnixStream, u32) {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < limit,
            "the guest did not accept CONNECT {port}"
        );
        let Ok(mut stream) = UnixStream::connect(socket) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        stream
            .write_all(format!("CONNECT {port}\n").as_bytes())
            .unwrap();
        let mut line = String::new();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        // The VMM closes the socket if the guest answers RST.
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let local: u32 = line
            .strip_prefix("OK ")
            .and_then(|rest| rest.trim_end().parse().ok())
            .unwrap_or_else(|| panic!("bad answer to CONNECT: {line:?}"));
        assert!(reader.buffer().is_empty(), "data before the guest sent any");
        return (stream, local);
    }
}

/// Sends `total` pattern bytes into the guest's echo and checks what comes back.
fn host_echo_through_guest(socket: PathBuf, total: u64) -> JoinHandle<u64> {
    std::thread::spawn(move || {
        let (stream, local) = connect_into_guest(&socket, GUEST_PORT, Duration::from_secs(90));
        assert!(local >= 1024, "host port {local}");
        let mut writer = stream.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            let chunk: Vec<u8> = (0..total).map(pattern).collect();
            writer.write_all(&chunk).unwrap();
        });
        let mut reader = stream;
        reader
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut got = 0u64;
        let mut buf = vec![0u8; 64 << 10];
        while got < total {
            let n = reader.read(&mut buf).expect("reading the guest's echo");
            assert!(n > 0, "the guest closed after {got} of {total} bytes");
            for (i, &b) in buf[..n].iter().enumerate() {
                let at = got + i as u64;
                assert_eq!(b, pattern(at), "byte {at} of the guest's echo");
            }
            got += n as u64;
        }
        sender.join().unwrap();
        got
    })
}

/// The host side of one vsock-echo run: the echo server and the client into the guest.
struct HostSide {
    stop: Arc<AtomicBool>,
    server: JoinHandle<Vec<u64>>,
    client: JoinHandle<u64>,
}

impl HostSide {
    fn start(socket: &Path, bytes: u64) -> HostSide {
        let listener = UnixListener::bind(port_path(socket, HOST_PORT)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        HostSide {
            server: echo_server(listener, stop.clone()),
            client: host_echo_through_guest(socket.to_path_buf(), bytes),
            stop,
        }
    }

    /// Stops the server; the bytes it echoed per connection and those the client checked.
    fn finish(self) -> (Vec<u64>, u64) {
        let client = self.client.join().expect("host client");
        self.stop.store(true, Ordering::SeqCst);
        (self.server.join().expect("echo server"), client)
    }
}

fn port_path(socket: &Path, port: u32) -> PathBuf {
    PathBuf::from(format!("{}_{port}", socket.display()))
}

fn vsock_arg(socket: &Path) -> String {
    format!("cid=3,socket={}", socket.display())
}

/// vsock-echo both ways with `bytes` each, in `irqchip` mode.
fn echo_both_ways(name: &str, irqchip: &str, bytes: u64) {
    require_kvm();
    let dir = scratch(name);
    let socket = dir.join("v.sock");
    let host = HostSide::start(&socket, bytes);
    let kernel = guest("vsock-echo");
    let cmdline = format!("bytes={bytes}");
    let vsock = vsock_arg(&socket);
    let args = [
        "run",
        "--kernel",
        kernel.to_str().unwrap(),
        "--vsock",
        &vsock,
        "--irqchip",
        irqchip,
        "--cmdline",
        &cmdline,
    ];
    let run = ferrovm(&args, Duration::from_secs(120));
    // PASS: the guest's exit code 0 through the debug-exit port is status 1.
    run.expect_status(1)
        .expect_stdout(&format!(
            "vsock-echo: guest->host port {HOST_PORT}: {bytes} bytes echoed intact"
        ))
        .expect_stdout(&format!(
            "vsock-echo: host->guest port {GUEST_PORT}: {bytes} bytes echoed back"
        ));
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    let (echoed, checked) = host.finish();
    assert_eq!(echoed, [bytes], "the echo server's connections");
    assert_eq!(checked, bytes);
    assert!(!socket.exists(), "the device's socket is left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn echo_both_ways_kernel_irqchip() {
    // 1 MiB: 16 of the guest's windows, 8 of the device's.
    echo_both_ways("kernel", "kernel", 1 << 20);
}

#[test]
fn echo_both_ways_split_irqchip() {
    echo_both_ways("split", "split", 512 << 10);
}

#[test]
fn echo_both_ways_without_kernel_eventfds() {
    require_kvm();
    let dir = scratch("user-paths");
    let socket = dir.join("v.sock");
    let bytes = 256u64 << 10;
    let host = HostSide::start(&socket, bytes);
    let kernel = guest("vsock-echo");
    let cmdline = format!("bytes={bytes}");
    let vsock = vsock_arg(&socket);
    let mut child = Command::new(FERROVM)
        .args([
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--vsock",
            &vsock,
        ])
        .args(["--cmdline", &cmdline])
        .env("FERROVM_KERNEL_EVENTFDS", "off")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_child(&mut child, Duration::from_secs(120));
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(status, Some(1), "{out}");
    assert!(out.contains("bytes echoed back"), "{out}");
    let (echoed, checked) = host.finish();
    assert_eq!((echoed, checked), (vec![bytes], bytes));
    let _ = std::fs::remove_dir_all(&dir);
}

fn wait_child(child: &mut Child, limit: Duration) -> Option<i32> {
    let start = Instant::now();
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

#[test]
fn bad_vsock_options_are_refused() {
    let dir = scratch("options");
    let kernel = guest("vsock-echo");
    let k = kernel.to_str().unwrap();
    let socket = dir.join("v.sock");
    let cases = [
        (format!("cid=2,socket={}", socket.display()), "reserved"),
        (format!("cid=x,socket={}", socket.display()), "not a number"),
        ("cid=3".to_string(), "expected cid=N,socket=PATH"),
        (
            format!("cid=3,socket={},mtu=5", socket.display()),
            "unknown",
        ),
    ];
    for (value, why) in cases {
        ferrovm(
            &["run", "--kernel", k, "--vsock", &value],
            Duration::from_secs(30),
        )
        .expect_status(2)
        .expect_error(why);
    }
    // Somebody listens there already.
    let _live = UnixListener::bind(&socket).unwrap();
    let value = vsock_arg(&socket);
    ferrovm(
        &["run", "--kernel", k, "--vsock", &value],
        Duration::from_secs(30),
    )
    .expect_status(2)
    .expect_error("another process listens");
    let _ = std::fs::remove_dir_all(&dir);
}
