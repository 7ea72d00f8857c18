//! virtio-blk, virtio-rng and virtio-console on the PCI bus, end to end: real guests under
//! KVM drive the devices (the project's own drivers and the third-party `virtio-drivers`
//! crate) and report what they saw; the tests check those reports, the VMM's status, and
//! the disk image from the host side. Also: durability across a SIGKILL, image locks, bad
//! options, and a guest with requests in flight carried across a snapshot and a live
//! migration.

mod common;

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::relay::*;
use common::*;

/// Every test image: 16 MiB, sparse.
const IMAGE_BYTES: u64 = 16 << 20;
const IMAGE_SECTORS: u64 = IMAGE_BYTES / 512;
/// The sectors blk-stress works on by default: [0, 4096), two shares of 2048.
const STRESS_SECTORS: u64 = 4096;

/// A fresh scratch directory for one test, under the build's target directory.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("virtio-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A sparse image of [`IMAGE_BYTES`] (reads as zeroes).
fn sparse_image(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    File::create(&path).unwrap().set_len(IMAGE_BYTES).unwrap();
    path
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `--disk` value: the image path followed by `options` (e.g. ",queues=2").
fn disk(image: &Path, options: &str) -> String {
    format!("{}{options}", image.display())
}

/// The guest reported PASS and the VMM exited 1 (the guest's PASS exit), with no failure
/// line on the way.
fn expect_pass(run: &Run) {
    run.expect_status(1);
    assert_eq!(run.last_line(), "PASS", "{}", run.stdout);
    assert!(!run.stdout.contains("FAIL"), "{}", run.stdout);
    assert!(
        !run.stderr.contains("panicked"),
        "the VMM panicked:\n{}",
        run.stderr
    );
}

fn expect_lines(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "output lacks {needle:?}:\n{text}");
    }
}

/// The feature bits after "<label> 0x" on the line starting with `prefix`.
fn hex_after(text: &str, prefix: &str, label: &str) -> u64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line:\n{text}"));
    let rest = &line[line.find(label).expect(label) + label.len()..];
    let hex: String = rest
        .trim_start_matches("0x")
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect();
    u64::from_str_radix(&hex, 16).unwrap()
}

const VIRTIO_BLK_F_RO: u64 = 1 << 5;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
const VIRTIO_BLK_F_DISCARD: u64 = 1 << 13;
const VIRTIO_BLK_F_WRITE_ZEROES: u64 = 1 << 14;
const VIRTIO_F_VERSION_1: u64 = 1 << 32;

// ---- 1. blk-rw ----

/// blk-rw on a fresh writable image: everything it checks, and the features it was offered.
fn blk_rw_read_write(name: &str, cpus: &str, irqchip: &str, options: &str) {
    let dir = scratch(name);
    let image = sparse_image(&dir, "disk.img");
    let disk = disk(&image, &format!(",serial=ferrovm-disk0{options}"));
    let cmdline = format!("serial=ferrovm-disk0 capacity={IMAGE_SECTORS}");
    let r = run_guest(
        "blk-rw",
        &[
            "--cpus",
            cpus,
            "--irqchip",
            irqchip,
            "--disk",
            &disk,
            "--cmdline",
            &cmdline,
        ],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "virtio: type 2 at 00:01.0 (1af4:1042), config via ECAM at 0xe0000000",
            "blk-rw: CF8 and ECAM agree on 2 functions",
            "queue 0 size 256, indirect, event-idx, MSI-X completion",
            "blk-rw: capacity 32768 sectors (16 MiB), block size ",
            "blk-rw: wrote 256 sectors at 0 in ",
            ", FLUSH ok",
            "blk-rw: read back 256 sectors in ",
            ": identical",
            "blk-rw: GET_ID \"ferrovm-disk0\"",
            "blk-rw: DISCARD 64 sectors at 64 (alignment ",
            "): reads back zeroes",
            "blk-rw: WRITE_ZEROES 64 sectors at 128: reads back zeroes",
            " MSI-X interrupts, ",
            " 0 missed",
        ],
    );
    let offered = hex_after(&r.stdout, "blk-rw: features", "offered ");
    let wanted =
        VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES;
    assert_eq!(offered & wanted, wanted, "offered {offered:#x}");
    assert_eq!(offered & VIRTIO_BLK_F_RO, 0, "a writable disk offers RO");
    // The guest wrote its pattern over sectors 0-63 (64-255 were discarded or zeroed after).
    let mut head = vec![0u8; 64 * 512];
    File::open(&image)
        .unwrap()
        .read_exact_at(&mut head, 0)
        .unwrap();
    assert!(
        head.chunks(512).all(|s| s.iter().any(|&b| b != 0)),
        "the guest's writes are not in the image"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blk_rw_1_vcpu_kernel_irqchip() {
    blk_rw_read_write("rw-1-kernel", "1", "kernel", "");
}

#[test]
fn blk_rw_4_vcpus_kernel_irqchip() {
    blk_rw_read_write("rw-4-kernel", "4", "kernel", "");
}

#[test]
fn blk_rw_1_vcpu_split_irqchip() {
    blk_rw_read_write("rw-1-split", "1", "split", "");
}

#[test]
fn blk_rw_4_vcpus_split_irqchip() {
    blk_rw_read_write("rw-4-split", "4", "split", "");
}

/// Whether the file system under `dir` accepts O_DIRECT opens.
fn direct_io_supported(dir: &Path) -> bool {
    let probe = dir.join("o_direct.probe");
    File::create(&probe).unwrap().set_len(4096).unwrap();
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe);
    let _ = std::fs::remove_file(&probe);
    match opened {
        Ok(_) => true,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => false,
        Err(e) => panic!("O_DIRECT probe: {e}"),
    }
}

/// cache=none opens the image with O_DIRECT: the guest works as with the page cache, or,
/// where the file system refuses O_DIRECT, the VMM says so in one line.
#[test]
fn blk_rw_with_cache_none() {
    let dir = scratch("cache-none");
    if direct_io_supported(&dir) {
        blk_rw_read_write("cache-none-run", "1", "kernel", ",cache=none");
    } else {
        let image = sparse_image(&dir, "disk.img");
        let disk = disk(&image, ",cache=none");
        run_guest("blk-rw", &["--disk", &disk]).expect_error("refuses O_DIRECT (cache=none)");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A read-only disk: RO offered, reads work, the write is refused with IOERR, and the image
/// is byte for byte what it was.
#[test]
fn blk_rw_readonly_disk() {
    let dir = scratch("readonly");
    let image = sparse_image(&dir, "disk.img");
    let before: Vec<u8> = (0..256 * 512).map(|i| (i % 251) as u8).collect();
    OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap()
        .write_all_at(&before, 0)
        .unwrap();
    let r = run_guest(
        "blk-rw",
        &["--disk", &disk(&image, ",readonly"), "--cmdline", "ro=1"],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &["blk-rw: read-only: RO offered, read 256 sectors, write refused with IOERR, data unchanged"],
    );
    let offered = hex_after(&r.stdout, "blk-rw: features", "offered ");
    assert_ne!(offered & VIRTIO_BLK_F_RO, 0, "offered {offered:#x}");
    assert_eq!(
        offered & (VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES),
        0,
        "a read-only disk offers discard or write-zeroes: {offered:#x}"
    );
    let mut after = vec![0u8; before.len()];
    File::open(&image)
        .unwrap()
        .read_exact_at(&mut after, 0)
        .unwrap();
    assert!(after == before, "the read-only image changed");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- what blk-stress leaves in an image, read from the host ----

const STRESS_MAGIC: u64 = 0x5353_4552_5453_5646; // "FVSTRESS"

/// blk-stress's sector `sector` at generation `gen` (guests/blk-stress.c), without the
/// trailing CRC (bytes 508-511, derived from the rest).
fn stress_sector(sector: u64, gen: u64) -> Vec<u8> {
    let mut x = sector.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ gen.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ STRESS_MAGIC;
    let mut words = vec![STRESS_MAGIC, sector, gen];
    for _ in 3..64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        words.push(x);
    }
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(508);
    bytes
}

/// The generation of each of blk-stress's sectors in `image` (0: never written), each
/// sector checked against the pattern its header names.
fn stress_generations(image: &Path) -> Vec<u64> {
    let mut data = vec![0u8; (STRESS_SECTORS * 512) as usize];
    File::open(image)
        .unwrap()
        .read_exact_at(&mut data, 0)
        .unwrap();
    data.chunks(512)
        .enumerate()
        .map(|(sector, bytes)| {
            if bytes.iter().all(|&b| b == 0) {
                return 0;
            }
            let gen = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
            assert!(
                bytes[..508] == stress_sector(sector as u64, gen)[..],
                "sector {sector} of {} is not blk-stress's generation {gen}",
                image.display()
            );
            gen
        })
        .collect()
}

/// The highest `stress: round N ok` in `output`.
fn last_round(output: &str) -> u64 {
    rounds(output).max().unwrap_or(0)
}

fn rounds(output: &str) -> impl Iterator<Item = u64> + '_ {
    output
        .lines()
        .filter_map(|l| l.strip_prefix("stress: round "))
        // A line cut short by a kill counts only once it says the round is done.
        .filter(|rest| rest.contains(" ok: "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// `check=1` over `image` (2 queues, as the writers used): the guest reads every sector
/// back and PASSes. Returns its output.
fn stress_check(image: &Path, extra_cmdline: &str) -> Run {
    let cmdline = format!("check=1 wait=hlt {extra_cmdline}");
    let r = run_guest(
        "blk-stress",
        &[
            "--cpus",
            "2",
            "--disk",
            &disk(image, ",queues=2"),
            "--cmdline",
            &cmdline,
        ],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "stress: check mode: reading only",
            "stress: check passed: 4096 sectors verified",
        ],
    );
    r
}

// ---- 2. blk-stress ----

/// The interrupts blk-stress counted for `queue` on its CPU `cpu`.
fn queue_interrupts(output: &str, queue: u32, cpu: u32) -> u64 {
    let prefix = format!("stress: queue {queue}: ");
    let line = output
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line:\n{output}"));
    let suffix = format!(" interrupts on cpu {cpu},");
    let head = &line[..line.find(&suffix).unwrap_or_else(|| panic!("{line}"))];
    head.rsplit(' ').next().unwrap().parse().unwrap()
}

fn stress_two_queues(irqchip: &str, gen0: u64) {
    let dir = scratch(&format!("stress-{irqchip}"));
    let image = sparse_image(&dir, "disk.img");
    let cmdline = format!("rounds=3 gen0={gen0} wait=hlt");
    let r = run_guest(
        "blk-stress",
        &[
            "--cpus",
            "4",
            "--irqchip",
            irqchip,
            "--disk",
            &disk(&image, ",queues=2"),
            "--cmdline",
            &cmdline,
        ],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "stress: 2 queue(s) (device has 2), 2 CPU(s) driving them, 32 in flight per queue, MSI-X, indirect, event-idx, sectors [0, 4096)",
            "stress: queue 0 -> MSI-X entry 1 -> vector 0x51 -> cpu 0",
            "stress: queue 1 -> MSI-X entry 2 -> vector 0x52 -> cpu 1",
            "stress: round 1 ok: 2 queues x 2048 sectors, 32 in flight",
            "stress: round 3 ok: 2 queues x 2048 sectors, 32 in flight",
            "stress: 3 rounds, 24576 requests, every sector read back verified",
        ],
    );
    for (queue, cpu) in [(0, 0), (1, 1)] {
        let interrupts = queue_interrupts(&r.stdout, queue, cpu);
        assert!(interrupts > 0, "queue {queue}: no interrupt on cpu {cpu}");
    }
    let last = gen0 + 2;
    // The image as the host sees it: every sector at the last round's generation.
    assert!(stress_generations(&image).iter().all(|&g| g == last));
    // A second VM verifies what the first wrote; a wrong expectation fails it.
    let r = stress_check(&image, &format!("gen={last}"));
    for (q, range) in [(0, "[0, 2048)"), (1, "[2048, 4096)")] {
        let line = format!("stress: check: queue {q} sectors {range}: 2048 at generation {last}");
        expect_lines(&r.stdout, &[&line]);
    }
    let wrong = format!("check=1 gen={}", last + 1);
    let r = run_guest(
        "blk-stress",
        &["--disk", &disk(&image, ",queues=2"), "--cmdline", &wrong],
    );
    r.expect_status(3)
        .expect_stdout("FAIL: check: queue 0: newest generation");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blk_stress_2_queues_4_vcpus_kernel_irqchip() {
    stress_two_queues("kernel", 1);
}

#[test]
fn blk_stress_2_queues_4_vcpus_split_irqchip() {
    stress_two_queues("split", 20);
}

// ---- 3. blk-hostile ----

/// Malformed chains, bad addresses and out-of-range indexes: the device answers each as the
/// spec allows (or asks for a reset), keeps serving good requests, and the VMM runs on to
/// the guest's PASS.
#[test]
fn blk_hostile_every_case_handled() {
    let dir = scratch("hostile");
    let image = sparse_image(&dir, "disk.img");
    let r = run_guest("blk-hostile", &["--disk", s(&image)]);
    expect_pass(&r);
    let cases: Vec<&str> = r
        .stdout
        .lines()
        .filter(|l| l.starts_with("hostile: ") && l.contains(" -> "))
        .collect();
    assert_eq!(cases.len(), 14, "{}", r.stdout);
    for case in &cases {
        assert!(
            case.contains("-> allowed") || case.contains("-> served (tolerated)"),
            "{case}"
        );
        assert!(case.contains("; reset: good read ok ("), "{case}");
    }
    expect_lines(
        &r.stdout,
        &[
            "hostile: head-out-of-range (available head index >= queue size): NEEDS_RESET + config interrupt -> allowed",
            "hostile: data-beyond-ram (data buffer beyond RAM): status IOERR",
            "hostile: 14 cases: ",
            "; 0 wrong; the device recovered after every reset",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- 4. rng, console, virtio-drivers ----

#[test]
fn rng_reads_differ() {
    for (irqchip, cmdline, summary) in [
        (
            "kernel",
            "",
            "rng: 4 reads of 64 bytes, none constant, all different",
        ),
        (
            "split",
            "reads=8 bytes=4096",
            "rng: 8 reads of 4096 bytes, none constant, all different",
        ),
    ] {
        let r = run_guest(
            "rng",
            &["--rng", "--irqchip", irqchip, "--cmdline", cmdline],
        );
        expect_pass(&r);
        expect_lines(
            &r.stdout,
            &[
                "virtio: type 4 at 00:01.0 (1af4:1044)",
                "MSI-X completion",
                summary,
            ],
        );
    }
}

/// A driver that polls leaves MSI-X off, so the device drives its INTx line, which the VMM
/// lowers again when it tears the device down at exit (on the main thread, under seccomp).
#[test]
fn rng_polled_with_intx_exits_cleanly() {
    let r = run_guest("rng", &["--rng", "--cmdline", "irq=0"]);
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "polled completion",
            "rng: 4 reads of 64 bytes, none constant, all different (4 completions, 0 interrupts)",
        ],
    );
    assert!(!r.stderr.contains("seccomp"), "{}", r.stderr);
}

const CONSOLE_LINES: [&str; 2] = [
    "virtio-console: hello from hvc0 ferrovm-test\n",
    "virtio-console: three buffers, one line\n",
];

/// hvc0 writes where the serial console writes: the VMM's stdout here.
#[test]
fn console_lines_on_stdout() {
    let r = run_guest(
        "console",
        &["--console", "virtio", "--cmdline", "tag=ferrovm-test"],
    );
    expect_pass(&r);
    expect_lines(&r.stdout, &CONSOLE_LINES);
    expect_lines(
        &r.stdout,
        &[
            "virtio: type 3 at 00:01.0 (1af4:1043)",
            &format!(
                "console: 2 lines sent on the transmitq: {} bytes in 1 buffer, {} bytes in a chain of 3",
                CONSOLE_LINES[0].len(),
                CONSOLE_LINES[1].len()
            ),
        ],
    );
}

/// ... and into the --serial file, each line once.
#[test]
fn console_lines_in_the_serial_file() {
    let dir = scratch("console-file");
    let file = dir.join("serial.txt");
    let serial = format!("file:{}", file.display());
    let r = run_guest(
        "console",
        &[
            "--console",
            "virtio",
            "--serial",
            &serial,
            "--irqchip",
            "split",
            "--cmdline",
            "tag=ferrovm-test",
        ],
    );
    r.expect_status(1);
    assert!(!r.stdout.contains("virtio-console"), "{}", r.stdout);
    let text = std::fs::read_to_string(&file).unwrap();
    for line in CONSOLE_LINES {
        assert_eq!(text.matches(line).count(), 1, "{line:?} in:\n{text}");
    }
    assert!(text.trim_end().ends_with("PASS"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn third_party_driver(irqchip: &str) {
    let dir = scratch(&format!("vd-{irqchip}"));
    let image = sparse_image(&dir, "disk.img");
    let r = run_guest(
        "virtio-drivers-blk",
        &[
            "--irqchip",
            irqchip,
            "--disk",
            &disk(&image, ",serial=vd-disk0"),
            "--rng",
            "--cmdline",
            "serial=vd-disk0",
        ],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "vd-blk: ECAM at 0xe0000000",
            "vd-blk: pci 00:00.0 8086:1237 (class 06.00, rev 02) Standard None",
            "vd-blk: pci 00:01.0 1af4:1042 (class 01.80, rev 01) Standard Some(Block)",
            "1af4:1044 (class 00.ff, rev 01) Standard Some(EntropySource)",
            "vd-blk: virtio-blk at 00:01.0: capacity 32768 sectors, read-write, queue size 16",
            "vd-blk: wrote 64 sectors at 0 in ",
            ", flushed, read back in ",
            ": identical",
            "vd-blk: GET_ID \"vd-disk0\"",
            "vd-blk: virtio-rng: 2 reads of 32 bytes, not constant, different",
        ],
    );
    assert!(!r.stdout.contains("virtio-drivers: WARN"), "{}", r.stdout);
    // The same driver against a read-only disk.
    let r = run_guest(
        "virtio-drivers-blk",
        &[
            "--irqchip",
            irqchip,
            "--disk",
            &disk(&image, ",readonly"),
            "--cmdline",
            "ro=1",
        ],
    );
    expect_pass(&r);
    expect_lines(
        &r.stdout,
        &[
            "capacity 32768 sectors, read-only",
            "vd-blk: read-only: write refused with IOERR, data unchanged",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn virtio_drivers_crate_kernel_irqchip() {
    third_party_driver("kernel");
}

#[test]
fn virtio_drivers_crate_split_irqchip() {
    third_party_driver("split");
}

// ---- VMs that run in the background ----

/// A ferrovm process whose serial output goes to a file the test watches.
struct Vm {
    child: Child,
    serial: PathBuf,
    socket: Option<PathBuf>,
}

impl Vm {
    fn start(args: &[&str], dir: &Path, name: &str, with_socket: bool) -> Vm {
        require_kvm();
        let serial = dir.join(format!("{name}.serial"));
        let socket = dir.join(format!("{name}.sock"));
        let mut cmd = Command::new(FERROVM);
        cmd.arg("run")
            .args(args)
            .arg("--serial")
            .arg(format!("file:{}", serial.display()));
        if with_socket {
            cmd.arg("--api-socket").arg(&socket);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start ferrovm");
        let mut vm = Vm {
            child,
            serial,
            socket: with_socket.then_some(socket),
        };
        if let Some(socket) = vm.socket.clone() {
            let exited = |vm: &mut Vm| vm.child.try_wait().unwrap().is_some();
            wait_until(Duration::from_secs(20), "the API socket", || {
                assert!(!exited(&mut vm), "ferrovm exited: {}", vm.stderr());
                socket.exists()
            });
        }
        vm
    }

    /// A blk-stress guest writing forever on the `--disk` value `disk` (2 queues).
    fn stress(disk: &str, dir: &Path, name: &str) -> Vm {
        Vm::stress_with(disk, dir, name, &[])
    }

    /// [`Vm::stress`] with more `run` options.
    fn stress_with(disk: &str, dir: &Path, name: &str, extra: &[&str]) -> Vm {
        let kernel = guest("blk-stress");
        let mut args = vec![
            "--kernel",
            s(&kernel),
            "--cpus",
            "2",
            "--disk",
            disk,
            "--cmdline",
            "rounds=0 wait=hlt",
        ];
        args.extend_from_slice(extra);
        Vm::start(&args, dir, name, true)
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn ctl(&self, args: &[&str]) -> Run {
        let socket = s(self.socket.as_ref().unwrap()).to_string();
        let mut all = vec!["ctl", "--api-socket", &socket];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(120))
    }

    fn stderr(&mut self) -> String {
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        err
    }

    /// Shuts the VM down (status 0, no failure from its blk-stress guest), then checks the
    /// guest's `image` from a second VM.
    fn shut_down_intact(&mut self, image: &Path) {
        self.ctl(&["shutdown"]).expect_status(0);
        let (status, _) = self.wait(Duration::from_secs(30));
        assert_eq!(status, Some(0));
        assert!(!self.output().contains("FAIL"), "{}", self.output());
        stress_check(image, "");
    }

    /// Waits for the VMM to exit: its status and what it wrote on stderr.
    fn wait(&mut self, limit: Duration) -> (Option<i32>, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status.code(), self.stderr());
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!(
                    "VM did not exit within {limit:?}; serial:\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and waits for it to be gone.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits until the guest has printed round `round` (and failed nothing).
    fn wait_for_round(&mut self, round: u64, what: &str) {
        wait_until(Duration::from_secs(90), what, || {
            let out = self.output();
            assert!(!out.contains("FAIL"), "{what}: the guest failed:\n{out}");
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "{what}: ferrovm exited ({status}):\n{out}\n{}",
                    self.stderr()
                );
            }
            last_round(&out) >= round
        });
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_until(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- 5. durability ----

/// Every round ends with a FLUSH before the guest reports it; a VMM killed with SIGKILL right
/// after has left every flushed sector in the image, and a second VM agrees. (A killed
/// process leaves the host's page cache behind: this shows that the VMM acknowledges no
/// FLUSH while it still holds writes itself; with cache=none the writes went around the
/// page cache too.)
fn flushed_writes_survive_sigkill(cache: &str) {
    let dir = scratch(&format!("durability-{cache}"));
    let image = sparse_image(&dir, "disk.img");
    let options = format!(",queues=2,cache={cache}");
    let mut vm = Vm::stress(&disk(&image, &options), &dir, "writer");
    vm.wait_for_round(2, "two flushed rounds");
    vm.kill();
    // The last round reported before the kill was flushed; the next may be half written.
    let flushed = last_round(&vm.output());
    let gens = stress_generations(&image);
    let (low, high) = (gens.iter().min().unwrap(), gens.iter().max().unwrap());
    assert!(
        *low >= flushed && *high <= flushed + 1,
        "round {flushed} was flushed, the image holds generations {low}..={high}"
    );
    let r = stress_check(&image, "");
    let expected = format!("at generation {high}");
    expect_lines(&r.stdout, &[&expected]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flushed_writes_survive_sigkill_cache_writeback() {
    flushed_writes_survive_sigkill("writeback");
}

#[test]
fn flushed_writes_survive_sigkill_cache_none() {
    let dir = scratch("durability-probe");
    if direct_io_supported(&dir) {
        flushed_writes_survive_sigkill("none");
    } else {
        eprintln!("the test directory refuses O_DIRECT: blk_rw_with_cache_none checks the error");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- 6. image locks ----

/// A VMM holding `image` (with `options`) while its guest idles.
fn idle_holder(image: &Path, options: &str, dir: &Path, name: &str) -> Vm {
    let idle = guest("idle");
    let disk = disk(image, options);
    let vm = Vm::start(&["--kernel", s(&idle), "--disk", &disk], dir, name, false);
    wait_until(Duration::from_secs(20), "the idle guest", || {
        vm.output().contains("idle: halting")
    });
    vm
}

/// One writer per image: a second VMM, writable or read-only, is refused with one line
/// naming the image. Read-only openers share the image with each other but not with a
/// writer (the lock is exclusive for a writable disk, shared for a read-only one).
#[test]
fn an_image_has_one_writer() {
    let dir = scratch("locks");
    let image = sparse_image(&dir, "disk.img");
    let expect_locked = |options: &str, cmdline: &str| {
        let r = run_guest(
            "blk-rw",
            &["--disk", &disk(&image, options), "--cmdline", cmdline],
        );
        r.expect_error("locked by another process");
        assert!(r.stderr.contains(s(&image)), "{}", r.stderr);
    };

    let writer = idle_holder(&image, "", &dir, "writer");
    expect_locked("", "");
    expect_locked(",readonly", "ro=1");
    drop(writer);

    let reader = idle_holder(&image, ",readonly", &dir, "reader");
    expect_locked("", "");
    let r = run_guest(
        "blk-rw",
        &["--disk", &disk(&image, ",readonly"), "--cmdline", "ro=1"],
    );
    expect_pass(&r);
    drop(reader);
    // The holder gone (killed), its lock went with it.
    expect_pass(&run_guest("blk-rw", &["--disk", s(&image)]));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- 7. bad input ----

/// Runs ferrovm without the capabilities that let root ignore file permissions.
fn ferrovm_without_dac_override(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(FERROVM);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null());
    // SAFETY: prctl is async-signal-safe and touches only the child's own capability
    // bounding set; after exec, root's permitted set is that bounding set.
    unsafe {
        cmd.pre_exec(|| {
            // CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (linux/capability.h). Refused without
            // CAP_SETPCAP: then the tests do not run as root, and permissions apply anyway.
            for cap in [1, 2] {
                libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0);
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("run ferrovm");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Refused before the guest runs: status 2, one line naming the option or the file.
#[test]
fn bad_disks_are_refused_with_one_line() {
    let dir = scratch("bad");
    let image = sparse_image(&dir, "disk.img");
    let missing = dir.join("missing.img");
    let cases = [
        (
            disk(&missing, ""),
            "missing.img: cannot open: No such file or directory",
        ),
        (disk(&dir, ""), "is a directory"),
        (
            "/dev/null".to_string(),
            "/dev/null: not a regular file or a block device",
        ),
        (disk(&image, ",queues=0"), "queues=0: expected 1 to 16"),
        (disk(&image, ",queues=17"), "queues=17: expected 1 to 16"),
        (
            disk(&image, ",cache=x"),
            "cache=x: expected writeback or none",
        ),
        (
            disk(&image, ",serial=abcdefghijklmnopqrstu"),
            "serial must be ASCII and at most 20 bytes",
        ),
        (disk(&image, ",bogus"), "unknown disk option \"bogus\""),
        (String::new(), "--disk : expected PATH[,readonly]"),
    ];
    for (value, reason) in &cases {
        let r = run_guest("blk-rw", &["--disk", value]);
        r.expect_error(reason);
        // The line names the option as given.
        r.expect_error(&format!("--disk {value}"));
    }
    // Two disks on one image: the second open is refused by the first's lock.
    let r = run_guest("blk-rw", &["--disk", s(&image), "--disk", s(&image)]);
    r.expect_error("locked by another process");

    // An unreadable file. Tests run as root, whom permissions do not stop: this VMM runs
    // without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH.
    let locked_out = dir.join("mode-000.img");
    File::create(&locked_out)
        .unwrap()
        .set_len(IMAGE_BYTES)
        .unwrap();
    std::fs::set_permissions(&locked_out, std::fs::Permissions::from_mode(0o000)).unwrap();
    let kernel = guest("blk-rw");
    for options in ["", ",readonly"] {
        let value = disk(&locked_out, options);
        let (status, stderr) =
            ferrovm_without_dac_override(&["run", "--kernel", s(&kernel), "--disk", &value]);
        assert_eq!(status, Some(2), "{stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].contains("mode-000.img: cannot open: Permission denied"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- 8. snapshot and restore ----

/// A snapshot taken with requests in flight restores with the same disk, and the guest
/// carries on where it was: its next rounds verify, nothing fails, and the image checks out.
/// The snapshot holds the devices' state and their recorded configuration, not the image:
/// the restoring VMM rebuilds the disk from the record when no --disk is given; a --disk
/// given must match what the guest saw (queue count, read-only setting), and an image of
/// another capacity is refused by the device's own check.
#[test]
fn snapshot_with_requests_in_flight_restores_with_the_same_disk() {
    let dir = scratch("snapshot");
    let image = sparse_image(&dir, "disk.img");
    let mut source = Vm::stress(&disk(&image, ",queues=2"), &dir, "source");
    source.wait_for_round(2, "the source's second round");
    let snap = dir.join("vm.snap");
    let before = last_round(&source.output());
    source.ctl(&["snapshot", s(&snap)]).expect_status(0);
    // The image is not in the snapshot: the source resumes after it and must not get far
    // (a whole round would overwrite sectors the restored guest still has to read back).
    // What it writes meanwhile the restored guest writes again, so the restores below allow
    // the changed image (a_disk_written_after_the_snapshot_is_refused: the default).
    source.kill();
    let source_last = last_round(&source.output());
    assert!(!source.output().contains("FAIL"), "{}", source.output());

    let restore = |extra: &[&str]| {
        let mut args = vec!["run", "--restore", s(&snap), "--serial", "none"];
        args.extend_from_slice(&["--restore-allow-changed-disks"]);
        args.extend_from_slice(extra);
        ferrovm(&args, Duration::from_secs(60))
    };
    let bigger = dir.join("bigger.img");
    File::create(&bigger)
        .unwrap()
        .set_len(2 * IMAGE_BYTES)
        .unwrap();
    restore(&["--disk", &disk(&bigger, ",queues=2")]).expect_error("not the same image");
    restore(&["--disk", &disk(&image, ",queues=1")]).expect_error("disk0 with queues=2");
    restore(&["--disk", &disk(&image, ",queues=2,readonly")]).expect_error("disk0 writable");

    // No --disk: the disk comes back from the snapshot's record, at the image's path.
    let mut restored = Vm::start(
        &["--restore", s(&snap), "--restore-allow-changed-disks"],
        &dir,
        "restored",
        true,
    );
    // Past every round the source reached, so the image holds only the restored guest's
    // latest two generations.
    restored.wait_for_round(source_last + 2, "the restored guest's rounds");
    let out = restored.output();
    assert!(!out.contains("stress: 2 queue(s)"), "booted afresh:\n{out}");
    let first = rounds(&out).next().unwrap();
    assert!(
        (before + 1..=source_last + 1).contains(&first),
        "the restored guest's first round is {first}; the snapshot was taken after round \
         {before} (the source reached {source_last})"
    );
    restored.shut_down_intact(&image);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restore used to accept a disk written after the snapshot (only its size was checked):
/// the guest then ran on a disk newer than its memory. The snapshot records the image file
/// as it was; a restore refuses an image written since with one line naming it, unless
/// `--restore-allow-changed-disks`. A snapshot of a paused guest, whose image nothing writes
/// afterwards, restores and runs on.
#[test]
fn a_disk_written_after_the_snapshot_is_refused() {
    let dir = scratch("changed-disk");
    let image = sparse_image(&dir, "disk.img");
    let mut source = Vm::stress(&disk(&image, ",queues=2"), &dir, "source");
    source.wait_for_round(1, "the source's first round");
    let stale = dir.join("stale.snap");
    source.ctl(&["snapshot", s(&stale)]).expect_status(0);
    let at_snapshot = last_round(&source.output());
    // A whole round after the snapshot: the image holds writes the snapshot's guest never made.
    source.wait_for_round(at_snapshot + 2, "rounds after the snapshot");
    source.ctl(&["pause"]).expect_status(0);
    let kept = dir.join("kept.snap");
    source.ctl(&["snapshot", s(&kept)]).expect_status(0);
    source.kill();

    let refused = ferrovm(
        &["run", "--restore", s(&stale), "--serial", "none"],
        Duration::from_secs(60),
    );
    refused
        .expect_error(&format!("disk {} is not the image the snapshot", s(&image)))
        .expect_error("written since")
        .expect_error("--restore-allow-changed-disks");
    let mut restored = Vm::start(&["--restore", s(&kept)], &dir, "restored", true);
    restored.ctl(&["resume"]).expect_status(0);
    let resumed_at = last_round(&source.output());
    restored.wait_for_round(resumed_at + 1, "the restored guest's rounds");
    restored.shut_down_intact(&image);
    // The operator's choice: it runs (and the guest may well find what it did not write).
    let mut forced = Vm::start(
        &["--restore", s(&stale), "--restore-allow-changed-disks"],
        &dir,
        "forced",
        true,
    );
    std::thread::sleep(Duration::from_secs(2));
    match forced.child.try_wait().unwrap() {
        None => drop(forced.ctl(&["status"]).expect_status(0)),
        Some(status) => assert_ne!(status.code(), Some(2), "{}", forced.stderr()),
    }
    drop(forced);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- 9. live migration ----

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Migrates a blk-stress guest over loopback from a VMM on `source_disk` to one on
/// `dest_disk` (`--disk` values naming the same storage); the guest goes on verifying its
/// rounds on the destination; then `check=1` over `image`.
fn migrate_stress(dir: &Path, image: &Path, source_disk: &str, dest_disk: &str) {
    let listen = format!("tcp:127.0.0.1:{}", free_port());
    let mut dest = Vm::start(
        &["--incoming", &listen, "--cpus", "2", "--disk", dest_disk],
        dir,
        "dest",
        true,
    );
    let mut source = Vm::stress(source_disk, dir, "source");
    source.wait_for_round(2, "the source's second round");
    let run = source.ctl(&["--json", "migrate", &listen]);
    run.expect_status(0);
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    eprintln!(
        "blk-stress migration: downtime {} ms",
        reply["report"]["downtime_ms"]
    );
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(
        status,
        Some(0),
        "the source exits 0 once the destination runs"
    );
    let source_last = last_round(&source.output());
    assert!(!source.output().contains("FAIL"), "{}", source.output());
    // The destination's serial file starts empty: its first round continues the source's.
    dest.wait_for_round(source_last + 2, "the migrated guest's rounds");
    let first = rounds(&dest.output()).next().unwrap();
    assert!(first <= source_last + 1, "{}", dest.output());
    assert!(
        !dest.output().contains("stress: 2 queue(s)"),
        "{}",
        dest.output()
    );
    dest.shut_down_intact(image);
}

/// A blk-stress source (2 vCPUs, 2 queues on `image`) and a destination waiting on the same
/// image; the source has finished a round.
fn stress_pair(dir: &Path, image: &Path) -> (Vm, Vm, u16) {
    let both = disk(image, ",queues=2");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--cpus", "2", "--disk", &both],
        dir,
        "dest",
        true,
    );
    let mut source = Vm::stress(&both, dir, "source");
    source.wait_for_round(1, "the source's first round");
    (source, dest, port)
}

/// Migrates `source` through a relay on `relay`: the outcome must be unknown.
fn migrate_into_the_unknown(source: &Vm, relay: u16) {
    let run = source.ctl(&["migrate", &format!("tcp:127.0.0.1:{relay}")]);
    assert_eq!(run.status, Some(2), "{}", run.stdout);
    assert!(run.stderr.contains("outcome unknown"), "{}", run.stderr);
    source
        .ctl(&["status"])
        .expect_stdout("migration-outcome-unknown");
}

/// `ctl resume --force` after a migration of unknown outcome used to resume only the vCPUs:
/// the devices paused for the final phase stayed paused, and the guest's next batch never
/// completed. Here every connection is cut as the source sends its End frame; the forced
/// resume brings the whole machine back, says so, and the guest's rounds go on with the image
/// locked by the source.
#[test]
fn a_forced_resume_after_an_unknown_outcome_brings_the_devices_back() {
    let dir = scratch("forced-resume");
    let image = sparse_image(&dir, "disk.img");
    let (mut source, _dest, port) = stress_pair(&dir, &image);
    let relay = relay_nth(Fault::CutAtPhase(Phase::End, Ways::Both), 0, port);
    migrate_into_the_unknown(&source, relay);
    let at = last_round(&source.output());
    let resumed = source.ctl(&["resume", "--force"]);
    resumed.expect_status(0);
    source.wait_for_round(at + 2, "rounds after the forced resume");
    resumed
        .expect_stdout("running")
        .expect_stdout("disk locks were taken back, its devices and timers resumed");
    let second = run_guest("blk-rw", &["--disk", s(&image)]);
    second.expect_error("locked by another process");
    source.shut_down_intact(&image);
    let _ = std::fs::remove_dir_all(&dir);
}

/// After the hand-over, with the final `Ack` lost, the destination holds the image's lock and
/// runs the guest: a forced resume is refused with one line naming the image, and the source
/// stays paused. Once the destination is gone, the forced resume takes the lock back (a second
/// VMM can no longer open the image writable, as it could before).
#[test]
fn a_forced_resume_takes_the_disk_locks_back_or_says_why_not() {
    let dir = scratch("forced-locks");
    let image = sparse_image(&dir, "disk.img");
    let (source, mut dest, port) = stress_pair(&dir, &image);
    migrate_into_the_unknown(&source, ack_swallowing_relay(port));
    let refused = source.ctl(&["resume", "--force"]);
    refused
        .expect_error("cannot take the guest back")
        .expect_error(s(&image))
        .expect_error("locked by another process");
    source
        .ctl(&["status"])
        .expect_stdout("migration-outcome-unknown");
    dest.kill();
    source
        .ctl(&["resume", "--force"])
        .expect_status(0)
        .expect_stdout("disk locks were taken back");
    let second = run_guest("blk-rw", &["--disk", s(&image)]);
    second.expect_error("locked by another process");
    source.ctl(&["shutdown"]).expect_status(0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A loop device over an image, detached when dropped.
struct LoopDevice(String);

impl LoopDevice {
    fn attach(image: &Path) -> Option<LoopDevice> {
        let out = Command::new("losetup")
            .args(["--find", "--show", s(image)])
            .output()
            .ok()?;
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !dev.is_empty()).then_some(LoopDevice(dev))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// The destination reaches the source's image through another path (a loop device over
/// it, as a host would see a shared LUN), so the image locks do not meet: the device state
/// travels with requests in flight, and the guest's reads on the destination find what it
/// wrote on the source. The destination uses cache=none, so that no page cache of the loop
/// device stands between the two.
#[test]
fn live_migration_with_requests_in_flight_storage_seen_as_a_block_device() {
    let dir = scratch("migrate-loop");
    let image = sparse_image(&dir, "disk.img");
    let Some(loop_device) = LoopDevice::attach(&image) else {
        eprintln!("no loop device available: migration onto a block device not exercised");
        return;
    };
    let source_disk = disk(&image, ",queues=2");
    let dest_disk = format!("{},queues=2,cache=none", loop_device.0);
    migrate_stress(&dir, &image, &source_disk, &dest_disk);
    drop(loop_device);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Source and destination on one host share the image's path. The source holds the image's
/// exclusive lock while it runs, so the destination must be able to start before it can
/// take that lock: the source hands the lock over once the destination has the state.
#[test]
fn live_migration_with_requests_in_flight_shared_image() {
    let dir = scratch("migrate-shared");
    let image = sparse_image(&dir, "disk.img");
    let both = disk(&image, ",queues=2");
    migrate_stress(&dir, &image, &both, &both);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Local updates (guest RAM in a memfd handed to a new process on the same host) of a guest
/// with requests in flight on a shared image, three in a row: each new process takes the
/// image's lock at the hand-over, the guest's rounds go on verified, and the image is intact
/// at the end.
#[test]
fn local_updates_with_requests_in_flight() {
    let dir = scratch("local-update-blk");
    let image = sparse_image(&dir, "disk.img");
    let both = disk(&image, ",queues=2");
    let mut current = Vm::stress_with(&both, &dir, "gen0", &["--memory-backend", "memfd"]);
    current.wait_for_round(2, "the first process's second round");
    for i in 1..=3 {
        let url = format!("unix:{}", dir.join(format!("gen{i}.update")).display());
        let args = ["--incoming", &url, "--cpus", "2", "--disk", &both];
        let mut next = Vm::start(&args, &dir, &format!("gen{i}"), true);
        let run = current.ctl(&["--json", "migrate", &url]);
        run.expect_status(0);
        let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
        eprintln!("blk-stress local update {i}: {}", reply["report"]);
        let (status, err) = current.wait(Duration::from_secs(30));
        assert_eq!(status, Some(0), "the old process exits 0: {err}");
        assert!(!current.output().contains("FAIL"), "{}", current.output());
        let last = last_round(&current.output());
        next.wait_for_round(last + 2, "the updated guest's rounds");
        current = next;
    }
    current.shut_down_intact(&image);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without irqfd and ioeventfd (a kernel like bhyve's; forced here with
/// FERROVM_KERNEL_EVENTFDS=off), queue notifications reach the transport as MMIO exits and
/// MSI-X vectors are injected from user space: the same guest passes in both irqchip modes.
#[test]
fn user_space_notify_and_msi_injection() {
    for irqchip in ["kernel", "split"] {
        let dir = scratch(&format!("no-eventfds-{irqchip}"));
        let image = sparse_image(&dir, "disk.img");
        let disk = disk(&image, ",queues=2");
        let out = std::process::Command::new(common::FERROVM)
            .env("FERROVM_KERNEL_EVENTFDS", "off")
            .args(["run", "--kernel", s(&common::guest("blk-stress"))])
            .args(["--cpus", "2", "--irqchip", irqchip, "--disk", &disk])
            .args(["--cmdline", "rounds=2 sectors=1024"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("ferrovm runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{irqchip}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        expect_lines(&stdout, &["every sector read back verified", "PASS"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// With MSI-X left off, completions arrive as INTx: the function's interrupt line is the
/// GSI the _PRT gives its slot, level-triggered through the I/O APIC in both irqchip modes,
/// lowered when the driver reads the ISR.
#[test]
fn intx_completions_in_both_irqchip_modes() {
    for irqchip in ["kernel", "split"] {
        let dir = scratch(&format!("intx-{irqchip}"));
        let image = sparse_image(&dir, "disk.img");
        let disk = disk(&image, "");
        let r = run_guest(
            "blk-intx",
            &["--irqchip", irqchip, "--disk", &disk, "--cmdline", "n=16"],
        );
        expect_pass(&r);
        expect_lines(
            &r.stdout,
            &[
                "intx: slot 1 INTA# -> GSI 17 -> vector 0x60, level-triggered",
                "intx: 16 reads",
                "16 with the queue bit",
            ],
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

// ---- 11. qcow2 images ----

/// `qemu-img ARGS` (Debian's qemu-utils; scripts/install-deps.sh installs it).
fn qemu_img(args: &[&str]) -> std::process::Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("run qemu-img (Debian's qemu-utils)")
}

fn qemu_img_ok(args: &[&str]) -> String {
    let out = qemu_img(args);
    assert!(
        out.status.success(),
        "qemu-img {args:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh qcow2 image of [`IMAGE_BYTES`] made by `qemu-img create` with `options`.
fn new_qcow2(dir: &Path, name: &str, options: &[&str]) -> PathBuf {
    let path = dir.join(name);
    let size = IMAGE_BYTES.to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    args.extend_from_slice(options);
    args.extend_from_slice(&[s(&path), &size]);
    qemu_img_ok(&args);
    path
}

/// `qemu-img check`: no corruption (it exits 2 for that, 3 for leaks alone); the leaked
/// clusters it counted.
fn qemu_img_check(image: &Path) -> u64 {
    let out = qemu_img(&["check", "--output=json", s(image)]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("qemu-img check: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(
        matches!(out.status.code(), Some(0) | Some(3)),
        "qemu-img check {}: {report}",
        image.display()
    );
    assert_eq!(report["corruptions"].as_u64().unwrap_or(0), 0, "{report}");
    assert_eq!(report["check-errors"].as_u64().unwrap_or(0), 0, "{report}");
    report["leaks"].as_u64().unwrap_or(0)
}

/// blk-stress writing `rounds` rounds of `sectors` sectors from `start`, from generation
/// `gen0`, on the `--disk` value `disk`; it must PASS.
fn stress_rounds(disk: &str, start: u64, sectors: u64, gen0: u64, rounds: u64) {
    let cmdline = format!("start={start} sectors={sectors} gen0={gen0} rounds={rounds} wait=hlt");
    let r = run_guest(
        "blk-stress",
        &["--cpus", "2", "--disk", disk, "--cmdline", &cmdline],
    );
    expect_pass(&r);
}

/// A plain qcow2, a compressed one (`qemu-img convert -c`) and an overlay on a raw base
/// (relative backing name) are written by blk-stress; each raw reference gets the same
/// writes. Afterwards `qemu-img check` finds every image clean, `qemu-img compare` finds
/// each equal to its reference, and the base is unchanged.
#[test]
fn qcow2_images_written_by_a_guest_agree_with_qemu_img() {
    let dir = scratch("qcow2-agree");
    let base = sparse_image(&dir, "base.img");
    stress_rounds(&disk(&base, ",queues=2"), 0, STRESS_SECTORS, 1, 1);
    let base_bytes = std::fs::read(&base).unwrap();
    let plain = new_qcow2(&dir, "plain.qcow2", &[]);
    let compressed = dir.join("compressed.qcow2");
    qemu_img_ok(&["convert", "-c", "-O", "qcow2", s(&base), s(&compressed)]);
    let overlay = new_qcow2(&dir, "overlay.qcow2", &["-b", "base.img", "-F", "raw"]);
    let empty_ref = sparse_image(&dir, "empty-ref.img");
    let base_ref = dir.join("base-ref.img");
    std::fs::copy(&base, &base_ref).unwrap();
    // Half the region rewritten twice, from sector 1024; the rest stays as it was.
    for image in [&plain, &compressed, &overlay, &empty_ref, &base_ref] {
        stress_rounds(&disk(image, ",queues=2"), 1024, 2048, 2, 2);
    }
    for (image, reference) in [
        (&plain, &empty_ref),
        (&compressed, &base_ref),
        (&overlay, &base_ref),
    ] {
        assert_eq!(qemu_img_check(image), 0, "{}", image.display());
        qemu_img_ok(&["compare", "-q", s(image), s(reference)]);
    }
    assert!(
        std::fs::read(&base).unwrap() == base_bytes,
        "the base was written"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The generations blk-stress left in sectors [start, start + STRESS_SECTORS) of the raw
/// file `raw` (0: never written), each sector checked against the pattern it names.
fn stress_generations_at(raw: &Path, start: u64) -> Vec<u64> {
    let mut data = vec![0u8; (STRESS_SECTORS * 512) as usize];
    File::open(raw)
        .unwrap()
        .read_exact_at(&mut data, start * 512)
        .unwrap();
    data.chunks(512)
        .enumerate()
        .map(|(i, bytes)| {
            let sector = start + i as u64;
            if bytes.iter().all(|&b| b == 0) {
                return 0;
            }
            let gen = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
            assert!(
                bytes[..508] == stress_sector(sector, gen)[..],
                "sector {sector} is not blk-stress's generation {gen}"
            );
            gen
        })
        .collect()
}

/// 30 times: a blk-stress guest writes a region of its own (so every run allocates new
/// clusters, L2 tables and refcount blocks: 4 KiB clusters) and the VMM is killed with
/// SIGKILL at a random moment. Every time `qemu-img check` finds no corruption (leaked
/// clusters allowed: docs/disks.md), and every round the guest saw flushed is in the image.
#[test]
fn qcow2_survives_sigkill_at_random_points() {
    const KILLS: u64 = 30;
    let dir = scratch("qcow2-kill");
    let image = dir.join("disk.qcow2");
    let size = (KILLS * STRESS_SECTORS * 512).to_string();
    qemu_img_ok(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=4096",
        s(&image),
        &size,
    ]);
    let kernel = guest("blk-stress");
    let raw = dir.join("view.raw");
    let mut seed = u64::from(std::process::id()) | 1;
    let mut leaks = Vec::new();
    for i in 0..KILLS {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let start = i * STRESS_SECTORS;
        let cmdline = format!("rounds=0 wait=hlt start={start} sectors={STRESS_SECTORS}");
        let args = [
            "--kernel",
            s(&kernel),
            "--cpus",
            "2",
            "--disk",
            &disk(&image, ",queues=2"),
            "--cmdline",
            &cmdline,
        ];
        let mut vm = Vm::start(&args, &dir, &format!("w{i}"), false);
        std::thread::sleep(Duration::from_millis(100 + seed % 2400));
        vm.kill();
        let out = vm.output();
        assert!(!out.contains("FAIL"), "run {i}:\n{out}");
        leaks.push(qemu_img_check(&image));
        let _ = std::fs::remove_file(&raw);
        qemu_img_ok(&["convert", "-O", "raw", s(&image), s(&raw)]);
        // The serial file may lag the guest by a line (its writer thread was killed too), so
        // `flushed` may be one round short, never ahead: every sector must be at least there.
        let flushed = last_round(&out);
        let gens = stress_generations_at(&raw, start);
        let (low, high) = (gens.iter().min().unwrap(), gens.iter().max().unwrap());
        assert!(
            *low >= flushed && *high <= flushed + 2,
            "run {i}: round {flushed} was flushed, the image holds generations {low}..={high}"
        );
    }
    eprintln!("qcow2 SIGKILLs: leaked clusters after each: {leaks:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Live migration of a blk-stress guest on a qcow2 overlay: the destination opens the same
/// file before the hand-over and reads its metadata again when it takes the lock.
#[test]
fn live_migration_with_a_qcow2_overlay() {
    let dir = scratch("qcow2-migrate");
    let _base = sparse_image(&dir, "base.img");
    let image = new_qcow2(&dir, "overlay.qcow2", &["-b", "base.img", "-F", "raw"]);
    let both = disk(&image, ",queues=2");
    migrate_stress(&dir, &image, &both, &both);
    assert_eq!(qemu_img_check(&image), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest on a qcow2 disk (4 KiB clusters) is paused in its first round, while the image's
/// new L2 tables and refcounts are still only in memory, and snapshotted: the snapshot writes
/// them out (on its filtered migration thread) before it records the file, so the restore
/// accepts the file and the guest runs on.
#[test]
fn snapshot_of_a_guest_on_a_qcow2_disk_restores() {
    let dir = scratch("qcow2-snapshot");
    let image = new_qcow2(&dir, "disk.qcow2", &["-o", "cluster_size=4096"]);
    let mut source = Vm::stress(&disk(&image, ",queues=2"), &dir, "source");
    wait_until(Duration::from_secs(60), "the source's first writes", || {
        source.output().contains("stress: queue 1 ->")
    });
    std::thread::sleep(Duration::from_millis(200));
    source.ctl(&["pause"]).expect_status(0);
    let snap = dir.join("vm.snap");
    source.ctl(&["snapshot", s(&snap)]).expect_status(0);
    let at_snapshot = last_round(&source.output());
    source.kill();
    let mut restored = Vm::start(&["--restore", s(&snap)], &dir, "restored", true);
    restored.ctl(&["resume"]).expect_status(0);
    restored.wait_for_round(at_snapshot + 2, "the restored guest's rounds");
    restored.shut_down_intact(&image);
    assert_eq!(qemu_img_check(&image), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A qcow2 image ferrovm cannot use ends the VMM with one line naming the image.
#[test]
fn a_broken_qcow2_chain_is_one_error_line() {
    let dir = scratch("qcow2-refused");
    let image = new_qcow2(
        &dir,
        "overlay.qcow2",
        &["-u", "-b", "gone.img", "-F", "raw"],
    );
    run_guest("blk-rw", &["--disk", s(&image)])
        .expect_error("gone.img")
        .expect_error("cannot open");
    let raw = sparse_image(&dir, "raw.img");
    run_guest("blk-rw", &["--disk", &disk(&raw, ",format=qcow2")])
        .expect_error("not a qcow2 image");
    let _ = std::fs::remove_dir_all(&dir);
}

/// blk-rw on a qcow2 image opened with O_DIRECT (`cache=none`): imago pads the metadata
/// writes (an 8-byte L1 entry among them) to the alignment O_DIRECT needs.
#[test]
fn qcow2_with_cache_none() {
    let dir = scratch("qcow2-direct");
    if !direct_io_supported(&dir) {
        eprintln!("the test directory refuses O_DIRECT: not exercised");
        return;
    }
    let image = new_qcow2(&dir, "disk.qcow2", &[]);
    let r = run_guest(
        "blk-rw",
        &["--disk", &disk(&image, ",cache=none,serial=ferrovm-disk0")],
    );
    expect_pass(&r);
    assert_eq!(qemu_img_check(&image), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
