//! ferrovm's devices driven by Linux's own drivers (issue 23): the repository's test kernel
//! and busybox initramfs (`make linux`, guests/linux/) use each device as a user would, and
//! each test checks what the guest saw and what the host finds afterwards: an ext4
//! filesystem written by the guest is clean under `e2fsck` with every file as written, a
//! read-only disk is unchanged, `fstrim` frees the image's blocks, TCP and vsock streams
//! arrive whole both ways, the guest's random bytes come from the virtio-rng device.
//!
//! Each boot takes minutes on this project's hosts (guest ring 0 is emulated), so these
//! tests are not part of `make test`: `make test-linux` runs them (`--ignored`).

mod common;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::linux::*;
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

/// SHA-256 of `bytes` in hex, as the guest's busybox `sha256sum` prints it.
fn sha256(bytes: &[u8]) -> String {
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
