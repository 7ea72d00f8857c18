//! ferrovm's devices driven by Linux's own drivers (issue 23): the repository's test kernel
//! and busybox initramfs (`make linux`, guests/linux/) use each device as a user would, and
//! each test checks what the guest saw and what the host finds afterwards: an ext4
//! filesystem written by the guest is clean under `e2fsck` with every file as written, a
//! read-only disk is unchanged, `fstrim` frees the image's blocks, a qcow2 overlay written
//! by the guest is clean under `qemu-img check` and its base unchanged, TCP and vsock streams
//! arrive whole both ways, the guest's random bytes come from the virtio-rng device, its
//! console is the virtio console.
//!
//! Each boot takes minutes on this project's hosts (guest ring 0 is emulated), so these
//! tests are not part of `make test`: `make test-linux` runs them (`--ignored`).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::linux::*;
use common::socket_console::SocketConsole;
use common::vsock::connect_into_guest;
use common::*;

/// A scratch directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "ferrovm-linux-devices-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `len` bytes of a pseudo-random sequence (xorshift64*) named by `seed`: content both
/// sides know without shipping it twice.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Runs a host tool; panics with its output unless it exits 0.
fn host_tool(program: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (Debian package e2fsprogs)"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A 64 MiB ext4 image holding the files `files` (name, content) in its root, made on the
/// host with `mkfs.ext4 -d`. Inode tables and journal are written now, so the kernel's lazy
/// initialisation writes nothing behind the test's back.
fn ext4_image(scratch: &Scratch, name: &str, files: &[(&str, &[u8])]) -> PathBuf {
    let root = scratch.path(&format!("{name}.d"));
    std::fs::create_dir_all(&root).unwrap();
    for (file, content) in files {
        std::fs::write(root.join(file), content).unwrap();
    }
    let image = scratch.path(&format!("{name}.img"));
    host_tool(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            "-d",
            root.to_str().unwrap(),
            image.to_str().unwrap(),
            "64M",
        ],
    );
    image
}

/// A file of an ext4 image, read on the host with `debugfs` (no mount needed).
fn ext4_file(image: &Path, file: &str) -> Vec<u8> {
    host_tool(
        "debugfs",
        &["-R", &format!("cat {file}"), image.to_str().unwrap()],
    )
}

/// `e2fsck -fn`: a full check that changes nothing; exit status 0 means clean.
fn expect_clean_ext4(image: &Path) {
    host_tool("e2fsck", &["-fn", image.to_str().unwrap()]);
}

/// Bytes the host file system has allocated to `image`.
fn allocated_bytes(image: &Path) -> u64 {
    std::fs::metadata(image).unwrap().blocks() * 512
}

/// `field` of a marker line as a number.
fn number(line: &str, key: &str) -> u64 {
    field(line, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {key}= in {line}"))
}

/// Boots the test kernel with the serial console, running `tests` (comma-separated).
fn boot(cpus: u32, tests: &str, extra: &[&str]) -> Run {
    require_kvm();
    let args = linux_run_args(cpus, &format!("console=ttyS0 ferrovm.test={tests}"), extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ferrovm(&args, BOOT_LIMIT)
}

/// Three disks in one boot (a boot costs minutes here): on `vda` Linux mounts the ext4
/// filesystem the host made, reads the host's file and writes new files; `e2fsck -fn` on
/// the host finds the image clean and every file as the guest wrote it. `vdb` is
/// `readonly`: Linux sees it read-only, raw and file writes fail, the image is unchanged
/// to the byte. On `vdc` the guest deletes a 4 MiB file and runs `fstrim`: the device
/// punches holes, and the image's allocated blocks shrink by the file's size.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_blk_ext4_readonly_and_trim() {
    let scratch = Scratch::new("blk");
    let seed = pattern(1, 1 << 20);
    let ext4 = ext4_image(&scratch, "ext4", &[("seed.bin", &seed)]);
    let readonly_seed = pattern(2, 256 << 10);
    let readonly = ext4_image(&scratch, "readonly", &[("seed.bin", &readonly_seed)]);
    let readonly_before = std::fs::read(&readonly).unwrap();
    let fill = pattern(3, 4 << 20);
    let trim = ext4_image(&scratch, "trim", &[("fill.bin", &fill)]);
    let trim_before = allocated_bytes(&trim);

    let run = boot(
        1,
        "disk-ext4,disk-readonly,disk-trim",
        &[
            "--disk",
            ext4.to_str().unwrap(),
            "--disk",
            &format!("{},readonly", readonly.display()),
            "--disk",
            trim.to_str().unwrap(),
        ],
    );
    expect_clean_poweroff(&run);

    // ext4 written by the guest.
    let line = one_marker(&run, "FERROVM-EXT4");
    let seed_sum = sha256(&seed);
    assert_eq!(field(line, "seed"), Some(seed_sum.as_str()), "{line}");
    assert_eq!(field(line, "copy"), Some(seed_sum.as_str()), "{line}");
    let small = number(line, "small");
    assert!(small > 0, "{line}");
    expect_clean_ext4(&ext4);
    assert!(
        ext4_file(&ext4, "/guest/copy.bin") == seed,
        "/guest/copy.bin differs from the host's seed.bin"
    );
    assert!(
        ext4_file(&ext4, "/guest/slice.bin") == seed[3 * 4096..8 * 4096],
        "/guest/slice.bin is not blocks 3-7 of seed.bin"
    );
    for i in 0..small {
        let text = ext4_file(&ext4, &format!("/guest/small-{i}.txt"));
        assert_eq!(
            String::from_utf8_lossy(&text),
            format!("ferrovm guest file {i}\n")
        );
    }

    // The read-only disk.
    let line = one_marker(&run, "FERROVM-READONLY");
    assert_eq!(field(line, "ro"), Some("1"), "{line}");
    assert_eq!(field(line, "raw-write"), Some("refused"), "{line}");
    assert_eq!(field(line, "mount"), Some("ro"), "{line}");
    assert_eq!(field(line, "file-write"), Some("refused"), "{line}");
    let readonly_sum = sha256(&readonly_seed);
    assert_eq!(field(line, "seed"), Some(readonly_sum.as_str()), "{line}");
    assert!(
        std::fs::read(&readonly).unwrap() == readonly_before,
        "the read-only image changed"
    );

    // fstrim.
    let line = one_marker(&run, "FERROVM-TRIM");
    assert_eq!(field(line, "status"), Some("0"), "{line}");
    assert!(number(line, "granularity") > 0, "no discard: {line}");
    assert!(number(line, "trimmed") >= fill.len() as u64, "{line}");
    let trim_after = allocated_bytes(&trim);
    assert!(
        trim_after + fill.len() as u64 <= trim_before,
        "the image still holds {trim_after} bytes (before: {trim_before}, the file: {})",
        fill.len()
    );
    expect_clean_ext4(&trim);
    eprintln!(
        "linux blk: {:.1} s; trim image {trim_before} -> {trim_after} bytes allocated",
        run.elapsed.as_secs_f64()
    );
}

/// `qemu-img ARGS` (Debian's qemu-utils), which must succeed.
fn qemu_img(args: &[&str]) {
    host_tool("qemu-img", args);
}

/// Linux mounts an ext4 filesystem through a qcow2 overlay whose base is the raw image the
/// host made, reads the host's file and writes new ones (the `disk-ext4` script). Afterwards
/// `qemu-img check` finds the overlay clean, the base is unchanged to the byte, and the
/// overlay's contents (as `qemu-img convert` reads them) pass `e2fsck -fn` with every file as
/// the guest wrote it.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_blk_ext4_on_a_qcow2_overlay() {
    let scratch = Scratch::new("blk-qcow2");
    let seed = pattern(4, 1 << 20);
    let base = ext4_image(&scratch, "base", &[("seed.bin", &seed)]);
    let base_before = std::fs::read(&base).unwrap();
    let overlay = scratch.path("overlay.qcow2");
    let overlay_arg = overlay.to_str().unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.img",
        "-F",
        "raw",
        overlay_arg,
    ]);

    let run = boot(1, "disk-ext4", &["--disk", overlay_arg]);
    expect_clean_poweroff(&run);
    let line = one_marker(&run, "FERROVM-EXT4");
    let seed_sum = sha256(&seed);
    assert_eq!(field(line, "copy"), Some(seed_sum.as_str()), "{line}");
    let small = number(line, "small");

    qemu_img(&["check", "-q", overlay_arg]);
    assert!(
        std::fs::read(&base).unwrap() == base_before,
        "the base image changed"
    );
    let flat = scratch.path("flat.img");
    qemu_img(&["convert", "-O", "raw", overlay_arg, flat.to_str().unwrap()]);
    expect_clean_ext4(&flat);
    assert!(ext4_file(&flat, "/guest/copy.bin") == seed);
    for i in 0..small {
        let text = ext4_file(&flat, &format!("/guest/small-{i}.txt"));
        assert_eq!(
            String::from_utf8_lossy(&text),
            format!("ferrovm guest file {i}\n")
        );
    }
    eprintln!(
        "linux blk on qcow2: {:.1} s, {small} small files",
        run.elapsed.as_secs_f64()
    );
}

/// Waits for one connection on a non-blocking listener (`accept` is its accept call) until
/// `BOOT_LIMIT`: the guest connects once it has booted, minutes from now.
fn accept_within<T>(accept: impl Fn() -> std::io::Result<T>) -> T {
    let start = Instant::now();
    loop {
        match accept() {
            Ok(stream) => return stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(start.elapsed() < BOOT_LIMIT, "the guest never connected");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Reads `stream` to its end; returns the bytes and how long they took from the first.
fn read_all(mut stream: impl Read) -> (Vec<u8>, Duration) {
    let mut bytes = Vec::new();
    let mut first = [0u8; 1];
    let n = stream.read(&mut first).expect("reading the guest's stream");
    let start = Instant::now();
    bytes.extend_from_slice(&first[..n]);
    stream
        .read_to_end(&mut bytes)
        .expect("reading the guest's stream");
    (bytes, start.elapsed())
}

fn mib_per_s(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / (1 << 20) as f64 / seconds
}

/// The test's network namespace, deleted when dropped.
struct Namespace(String);

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// What moves over TCP each way. Every byte a guest socket moves is copied and checksummed
/// by the guest kernel, in emulated ring 0 on this project's hosts: about 60 KiB/s there,
/// so 2 MiB takes half a minute each way.
const TCP_BYTES: usize = 2 << 20;

/// virtio-net on a tap in a network namespace: Linux's driver sees the MAC given on the
/// command line, the guest pings the host's end of the tap (3 of 3 answered), receives a
/// stream the host sends over TCP and sends it back; both ends check the other's checksum.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_net_ping_and_tcp_both_ways() {
    require_kvm();
    let ns = Namespace(format!("ferrovm-ldev-{}", std::process::id()));
    let mac = "52:54:00:fe:0d:01";
    tap_namespace(&ns.0, "ldevtap0", false, None);
    let (to_guest, from_guest) = in_namespace(&ns.0, || {
        let bind = |port| {
            let listener = TcpListener::bind(("10.0.2.2", port)).unwrap();
            listener.set_nonblocking(true).unwrap();
            listener
        };
        (bind(5001), bind(5002))
    });
    let data = Arc::new(pattern(4, TCP_BYTES));
    let sender: JoinHandle<()> = {
        let data = data.clone();
        std::thread::spawn(move || {
            let (mut stream, _) = accept_within(|| to_guest.accept());
            stream.set_nonblocking(false).unwrap();
            stream.write_all(&data).expect("sending to the guest");
            stream.shutdown(Shutdown::Write).unwrap();
        })
    };
    let receiver = std::thread::spawn(move || {
        let (stream, _) = accept_within(|| from_guest.accept());
        stream.set_nonblocking(false).unwrap();
        read_all(stream)
    });

    let args = linux_run_args(
        1,
        "console=ttyS0 ferrovm.test=net ferrovm.net.addr=10.0.2.15/24 ferrovm.net.peer=10.0.2.2",
        &["--net", &format!("tap=ldevtap0,mac={mac}")],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = ferrovm_in_namespace(&ns.0, &args, BOOT_LIMIT);
    expect_clean_poweroff(&run);

    let up = one_marker(&run, "FERROVM-NET-UP");
    assert_eq!(field(up, "mac"), Some(mac), "{up}");
    assert_eq!(field(up, "ping-received"), Some("3"), "{up}");
    let received = one_marker(&run, "FERROVM-NET-RECEIVED");
    assert_eq!(number(received, "bytes"), TCP_BYTES as u64, "{received}");
    let sum = sha256(&data);
    assert_eq!(field(received, "sha256"), Some(sum.as_str()), "{received}");
    sender.join().unwrap();
    let (back, took) = receiver.join().unwrap();
    assert_eq!(back.len(), TCP_BYTES, "bytes the guest sent back");
    assert!(back == *data, "the guest sent back other bytes");
    let in_seconds: f64 = field(received, "seconds").unwrap().parse().unwrap();
    eprintln!(
        "linux net: {:.1} s; TCP host to guest {:.3} MiB/s (guest's clock), guest to host \
         {:.3} MiB/s (host's clock)",
        run.elapsed.as_secs_f64(),
        mib_per_s(TCP_BYTES, in_seconds),
        mib_per_s(TCP_BYTES, took.as_secs_f64())
    );
}

/// virtio-net with 2 queue pairs and 2 vCPUs on a multi-queue tap: Linux makes 2 receive
/// and 2 transmit queues, pings from each CPU are answered, and each transmit queue carried
/// traffic; with the link down a ping fails, and once it is up again pings are answered.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_net_two_queue_pairs_and_link_down_up() {
    require_kvm();
    let ns = Namespace(format!("ferrovm-lmq-{}", std::process::id()));
    tap_namespace(&ns.0, "ldevmq0", true, None);
    let args = linux_run_args(
        2,
        "console=ttyS0 ferrovm.test=net-queues",
        &["--net", "tap=ldevmq0,queues=2"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = ferrovm_in_namespace(&ns.0, &args, BOOT_LIMIT);
    expect_clean_poweroff(&run);
    let line = one_marker(&run, "FERROVM-NET-QUEUES");
    assert_eq!(number(line, "rx"), 2, "{line}");
    assert_eq!(number(line, "tx"), 2, "{line}");
    for key in ["cpu0", "cpu1", "up"] {
        assert_eq!(number(line, key), 3, "{key}: {line}");
    }
    assert_eq!(
        number(line, "down"),
        0,
        "a ping went through a link that was down: {line}"
    );
    let irqs = one_marker(&run, "FERROVM-NET-IRQS");
    for queue in ["output.0", "output.1"] {
        let count = irqs
            .split_whitespace()
            .find_map(|kv| kv.split_once('=').filter(|(k, _)| k.ends_with(queue)))
            .map(|(_, n)| n.parse::<u64>().unwrap());
        assert!(
            count.is_some_and(|n| n > 0),
            "{queue} carried nothing: {irqs}"
        );
    }
}

/// What moves over vsock each way.
const VSOCK_BYTES: usize = 1 << 20;

/// virtio-vsock with the host socket convention, both ways: a host process connects to the
/// device's socket with `CONNECT 5000` once the guest listens, sends 1 MiB and shuts its
/// side; the guest (whose own side is shut at once) stores it until the end, then connects
/// to host port 1234 (`SOCKET_1234`) and sends it back. Both ends check the other's bytes.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_vsock_host_to_guest_and_back() {
    require_kvm();
    let scratch = Scratch::new("vsock");
    let socket = scratch.path("vsock.sock");
    let from_guest = UnixListener::bind(format!("{}_1234", socket.display())).unwrap();
    from_guest.set_nonblocking(true).unwrap();
    let data = Arc::new(pattern(5, VSOCK_BYTES));
    let sender = {
        let (socket, data) = (socket.clone(), data.clone());
        std::thread::spawn(move || {
            let (mut stream, _) = connect_into_guest(&socket, 5000, BOOT_LIMIT);
            stream.write_all(&data).expect("sending into the guest");
            stream.shutdown(Shutdown::Write).unwrap();
            // The guest shut its side at once: nothing comes back on this connection.
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).unwrap();
            assert!(rest.is_empty(), "the guest sent {} bytes", rest.len());
        })
    };
    let receiver = std::thread::spawn(move || {
        let (stream, _) = accept_within(|| from_guest.accept());
        stream.set_nonblocking(false).unwrap();
        read_all(stream)
    });

    let run = boot(
        1,
        "vsock-data",
        &["--vsock", &format!("cid=3,socket={}", socket.display())],
    );
    expect_clean_poweroff(&run);
    let received = one_marker(&run, "FERROVM-VSOCK-RECEIVED");
    assert_eq!(number(received, "bytes"), VSOCK_BYTES as u64, "{received}");
    let sum = sha256(&data);
    assert_eq!(field(received, "sha256"), Some(sum.as_str()), "{received}");
    sender.join().unwrap();
    let (back, took) = receiver.join().unwrap();
    assert_eq!(back.len(), VSOCK_BYTES, "bytes the guest sent back");
    assert!(back == *data, "the guest sent back other bytes");
    let in_seconds: f64 = field(received, "seconds").unwrap().parse().unwrap();
    eprintln!(
        "linux vsock: {:.1} s; host to guest {:.3} MiB/s (guest's clock), guest to host \
         {:.3} MiB/s (host's clock)",
        run.elapsed.as_secs_f64(),
        mib_per_s(VSOCK_BYTES, in_seconds),
        mib_per_s(VSOCK_BYTES, took.as_secs_f64())
    );
}

/// virtio-rng and the virtio console in one boot, with `console=hvc0` as the only console:
/// the kernel's messages and every marker reach the host through hvc0 (the kernel lists
/// hvc0 as its console); Linux's hw_random core uses `virtio_rng.0`, and `/dev/hwrng`
/// yields full reads that differ from each other and from zeros.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_rng_and_console() {
    require_kvm();
    let args = linux_run_args(
        1,
        "console=hvc0 ferrovm.test=console,rng",
        &["--rng", "--console", "virtio"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = ferrovm(&args, BOOT_LIMIT);
    // Not expect_clean_poweroff: the kernel's last line ("reboot: Power down") never reaches
    // hvc0. Linux 6.12 breaks and resets every virtio device in its shutdown pass
    // (virtio_dev_shutdown) before it prints that line, so the console driver drops it.
    let end = one_marker(&run, "FERROVM-TEST-END");
    assert_eq!(field(end, "status"), Some("0"), "{}", run.stdout);
    run.expect_status(0);
    let console = one_marker(&run, "FERROVM-CONSOLE");
    assert_eq!(field(console, "active"), Some("hvc0"), "{console}");
    let rng = one_marker(&run, "FERROVM-RNG");
    assert_eq!(field(rng, "current"), Some("virtio_rng.0"), "{rng}");
    assert_eq!(field(rng, "bytes"), Some("512"), "{rng}");
    let zeros = sha256(&[0u8; 512]);
    let (first, second) = (field(rng, "first"), field(rng, "second"));
    assert_ne!(first, second, "two reads gave the same bytes: {rng}");
    for sum in [first, second] {
        assert_ne!(sum, Some(zeros.as_str()), "{rng}");
    }
}

/// virtio-balloon under Linux's virtio_balloon driver: asked for 64 of its 256 MiB at start,
/// the guest gives them (its MemTotal settles below 192 MiB; about 240 MiB without a
/// balloon) and writes `actual`; the device gave every page it got back to the host
/// (madvise), as its log line says.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_balloon_gives_pages_back() {
    std::env::set_var("FERROVM_LOG", "info");
    let run = boot(1, "balloon", &["--balloon", "size_mib=64,stats=on"]);
    expect_clean_poweroff(&run);
    let balloon = one_marker(&run, "FERROVM-BALLOON");
    assert_ne!(field(balloon, "driver"), Some("none"), "{balloon}");
    let memtotal: u64 = field(balloon, "memtotal_kib").unwrap().parse().unwrap();
    assert!(memtotal < (256 - 64) << 10, "{balloon}");
    let gave = "the guest gave the 16384 pages asked for (16384 given back to the host)";
    assert!(run.stderr.contains(gave), "{}", run.stderr);
    eprintln!(
        "linux balloon: {:.1} s, MemTotal {memtotal} KiB",
        run.elapsed.as_secs_f64()
    );
}
/// A shell on hvc0: with `--console virtio --serial socket:PATH` the socket's client is the
/// virtio console's input and output. Linux's getty runs on hvc0 (the kernel's only
/// console); the client logs in, the shell says its terminal is /dev/hvc0 and echoes what
/// was typed, and `poweroff` ends the machine with status 0.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_login_on_hvc0_through_the_serial_socket() {
    require_kvm();
    let dir = Scratch::new("hvc0");
    let socket = dir.path("console.sock");
    let serial = format!("socket:{}", socket.display());
    let args = linux_run_args(
        1,
        "console=hvc0",
        &["--console", "virtio", "--serial", &serial],
    );
    let mut vmm = Command::new(FERROVM)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut console = SocketConsole::connect(&socket);
    console.wait_for("FERROVM-LOGIN tty=hvc0");
    console.wait_for("ferrovm login:");
    console.type_line("root");
    console.wait_for("Password:");
    console.type_line("ferrovm");
    console.wait_for("root@ferrovm:~#");
    console.type_line("echo on=$(tty) product=$((6 * 7))");
    console.wait_for("on=/dev/hvc0 product=42");
    console.type_line("poweroff");
    let status = wait_child(&mut vmm, BOOT_LIMIT);
    let mut stderr = String::new();
    let _ = vmm.stderr.take().unwrap().read_to_string(&mut stderr);
    assert_eq!(status, Some(0), "{stderr}");
}

/// What a `disk-writers` block holds: its header, then zeros to 4 KiB.
fn writer_block(w: u64, k: u64) -> Vec<u8> {
    let mut block = format!("ferrovm-block w={w} k={k}\n").into_bytes();
    block.resize(4096, 0);
    block
}

/// An empty (sparse) raw disk image of `mib` MiB.
fn raw_image(scratch: &Scratch, name: &str, mib: u64) -> PathBuf {
    let image = scratch.path(name);
    std::fs::File::create(&image)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    image
}

/// Block `block` of `image` is the one writer `w` wrote as its `k`th.
fn expect_writer_block(image: &[u8], block: u64, w: u64, k: u64) {
    let at = (block * 4096) as usize;
    let found = &image[at..at + 4096];
    assert!(
        found == writer_block(w, k),
        "block {block} (writer {w}, #{k}) is not on the image: {:?}",
        String::from_utf8_lossy(&found[..40])
    );
}

/// Four writers, pinned to the two vCPUs in turn, on a disk with 4 request queues: every
/// `dd conv=fsync` of every writer is on the image afterwards, and more than one request
/// queue carried the writes (Linux gives the disk one queue per CPU, up to the 4 offered).
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_virtio_blk_multiqueue_concurrent_writers() {
    let scratch = Scratch::new("writers");
    let image = raw_image(&scratch, "raw.img", 16);
    let disk = format!("{},queues=4", image.display());
    let run = boot(2, "disk-writers", &["--disk", &disk]);
    expect_clean_poweroff(&run);
    let line = one_marker(&run, "FERROVM-WRITERS");
    assert_eq!(number(line, "cpus"), 2, "{line}");
    assert_eq!(number(line, "queues"), 2, "one queue per CPU: {line}");
    let (writers, blocks) = (number(line, "writers"), number(line, "blocks"));
    assert_eq!(
        markers(&run, "FERROVM-SYNCED").len() as u64,
        writers * blocks
    );
    let written = std::fs::read(&image).unwrap();
    for w in 0..writers {
        for k in 0..blocks {
            expect_writer_block(&written, w * blocks + k, w, k);
        }
    }
    let queues = one_marker(&run, "FERROVM-WRITERS-QUEUES");
    let busy: Vec<&str> = queues
        .split_whitespace()
        .filter(|kv| kv.rsplit_once('=').is_some_and(|(_, n)| n != "0"))
        .collect();
    assert!(
        busy.len() >= 2,
        "one request queue did all the work: {queues}"
    );
}

/// kill -9 of the VMM while four writers run: every block whose `dd conv=fsync` had
/// returned in the guest (it said so on the console before the kill) is on the image.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_synced_writes_survive_kill_9() {
    use std::io::BufRead;
    require_kvm();
    let scratch = Scratch::new("kill9");
    let image = raw_image(&scratch, "raw.img", 64);
    let cmdline = "console=ttyS0 ferrovm.test=disk-writers ferrovm.writers.blocks=2000";
    let args = linux_run_args(1, cmdline, &["--disk", image.to_str().unwrap()]);
    let mut vmm = Command::new(FERROVM)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut synced = Vec::new();
    let start = Instant::now();
    for line in std::io::BufReader::new(vmm.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        assert!(start.elapsed() < BOOT_LIMIT, "too slow");
        if let Some(fields) = line.trim_end().strip_prefix("FERROVM-SYNCED ") {
            let n = |key| field(fields, key).unwrap().parse::<u64>().unwrap();
            synced.push((n("block"), n("w"), n("k")));
            if synced.len() == 40 {
                vmm.kill().unwrap();
                break;
            }
        }
        assert!(!line.contains("FERROVM-TEST-END"), "ended before the kill");
    }
    assert_eq!(synced.len(), 40, "the writers never got going");
    let _ = vmm.wait();
    let written = std::fs::read(&image).unwrap();
    for (block, w, k) in synced {
        expect_writer_block(&written, block, w, k);
    }
}

/// A VMM whose console lines are collected by a thread as they come.
struct Watched {
    child: std::process::Child,
    lines: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Watched {
    fn spawn(args: &[String]) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(FERROVM)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                sink.lock().unwrap().push(line.trim_end().to_string());
            }
        });
        Watched { child, lines }
    }

    /// The numbers of the `FERROVM-COUNT i=N` lines so far.
    fn counts(&self) -> Vec<u64> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter_map(|l| l.strip_prefix("FERROVM-COUNT i="))
            .map(|n| n.parse().unwrap())
            .collect()
    }

    fn wait_for_count(&self, at_least: u64) {
        let start = Instant::now();
        while self.counts().last().is_none_or(|&n| n < at_least) {
            assert!(
                start.elapsed() < BOOT_LIMIT,
                "no count {at_least}:\n{}",
                self.lines.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn wait(&mut self) -> Option<i32> {
        let code = wait_child(&mut self.child, BOOT_LIMIT);
        // The reader thread has the last lines once the pipe closed.
        std::thread::sleep(Duration::from_millis(200));
        code
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running Linux snapshotted mid-count: the counting process appends each number to a
/// file on ext4 and syncs. The machine is paused, snapshotted and killed with kill -9; the
/// restored machine counts on from where it was, the file holds 1..N once each, and
/// `e2fsck -fn` finds the filesystem clean.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_snapshot_kill_and_restore_counts_on() {
    require_kvm();
    let scratch = Scratch::new("snapshot");
    let image = ext4_image(&scratch, "count", &[]);
    let socket = scratch.path("api.sock");
    let snapshot = scratch.path("linux.snap");
    let cmdline = "console=ttyS0 ferrovm.test=counter ferrovm.counter.until=12";
    let mut args = linux_run_args(1, cmdline, &["--disk", image.to_str().unwrap()]);
    args.extend(["--api-socket".into(), socket.display().to_string()]);
    let mut first = Watched::spawn(&args);
    first.wait_for_count(4);
    let ctl = |args: &[&str]| {
        let mut all = vec!["ctl", "--api-socket", socket.to_str().unwrap()];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(300)).expect_status(0);
    };
    ctl(&["pause"]);
    ctl(&["snapshot", snapshot.to_str().unwrap()]);
    let last_before = *first.counts().last().unwrap();
    first.child.kill().unwrap();
    first.wait();
    assert!(last_before < 12, "counted to the end before the snapshot");

    let restore = ["run", "--restore", snapshot.to_str().unwrap()].map(String::from);
    let mut second = Watched::spawn(&restore);
    assert_eq!(second.wait(), Some(0), "the restored guest powers off");
    let after = second.counts();
    assert!(
        after.first().is_some_and(|&n| n <= last_before + 1) && after.last() == Some(&12),
        "before the snapshot up to {last_before}, after it {after:?}"
    );
    assert!(after.windows(2).all(|w| w[1] == w[0] + 1), "{after:?}");
    let lines = second.lines.lock().unwrap().join("\n");
    assert!(lines.contains("FERROVM-TEST-END status=0"), "{lines}");
    expect_clean_ext4(&image);
    let count = String::from_utf8(ext4_file(&image, "/count")).unwrap();
    let expected: String = (1..=12).map(|n| format!("{n}\n")).collect();
    assert_eq!(count, expected, "/count is not 1..12 once each");
}

/// A destination VMM waiting for a migration on `listen` with the disk `image`; it listens
/// by the time its API socket exists.
fn migration_destination(scratch: &Scratch, name: &str, listen: &str, image: &Path) -> Watched {
    let socket = scratch.path(&format!("{name}.sock"));
    let args = [
        "run",
        "--incoming",
        listen,
        "--memory",
        "256M",
        "--disk",
        image.to_str().unwrap(),
        "--api-socket",
        socket.to_str().unwrap(),
    ]
    .map(String::from);
    let vmm = Watched::spawn(&args);
    let start = Instant::now();
    while !socket.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name} never listened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    vmm
}

/// A running Linux with a process appending to ext4 and syncing, live-migrated over
/// loopback three ways: a migration to nobody fails and the source counts on; pre-copy to
/// a first destination, which counts on; post-copy from there to a second one, where the
/// count ends and the guest powers off. `/count` holds 1..N once each and `e2fsck -fn` is
/// clean: no write was lost or repeated across the hand-overs of the disk.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn linux_live_migration_pre_copy_post_copy_and_failed() {
    require_kvm();
    let scratch = Scratch::new("migrate");
    let image = ext4_image(&scratch, "count", &[]);
    let socket = scratch.path("source.sock");
    let until = 40;
    let cmdline = format!("console=ttyS0 ferrovm.test=counter ferrovm.counter.until={until}");
    let mut args = linux_run_args(1, &cmdline, &["--disk", image.to_str().unwrap()]);
    args.extend(["--api-socket".into(), socket.display().to_string()]);
    let mut source = Watched::spawn(&args);
    source.wait_for_count(3);
    let migrate = |socket: &Path, extra: &[&str], to: &str| {
        let mut all = vec!["ctl", "--api-socket", socket.to_str().unwrap(), "migrate"];
        all.extend_from_slice(extra);
        all.push(to);
        ferrovm(&all, Duration::from_secs(600))
    };

    let nobody = format!("tcp:127.0.0.1:{}", unused_port());
    let failed = migrate(&socket, &[], &nobody);
    assert_eq!(failed.status, Some(2), "{}", failed.stdout);
    let seen = *source.counts().last().unwrap();
    source.wait_for_count(seen + 1);

    let first_listen = format!("tcp:127.0.0.1:{}", unused_port());
    let mut first = migration_destination(&scratch, "first", &first_listen, &image);
    migrate(&socket, &[], &first_listen).expect_status(0);
    assert_eq!(
        source.wait(),
        Some(0),
        "the source ends once the destination runs"
    );
    let before = *source.counts().last().unwrap();
    first.wait_for_count(before + 1);

    let second_listen = format!("tcp:127.0.0.1:{}", unused_port());
    let mut second = migration_destination(&scratch, "second", &second_listen, &image);
    let first_socket = scratch.path("first.sock");
    migrate(&first_socket, &["--post-copy"], &second_listen).expect_status(0);
    assert_eq!(first.wait(), Some(0));
    assert_eq!(
        second.wait(),
        Some(0),
        "the guest powers off on the last destination"
    );

    let all: Vec<u64> = [&source, &first, &second]
        .iter()
        .flat_map(|vmm| vmm.counts())
        .collect();
    assert!(all.windows(2).all(|w| w[1] == w[0] + 1), "{all:?}");
    assert_eq!(all.last(), Some(&until));
    expect_clean_ext4(&image);
    let count = String::from_utf8(ext4_file(&image, "/count")).unwrap();
    let expected: String = (1..=until).map(|n| format!("{n}\n")).collect();
    assert_eq!(count, expected, "/count is not 1..{until} once each");
}
