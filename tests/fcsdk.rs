//! firecracker-go-sdk v1.0.0 drives ferrovm with its own default handlers
//! (tests/go/fcsdk/main.go): configure a machine with a drive, a network interface (a tap)
//! and a vsock device, InstanceStart, pause, snapshot, stop, load the snapshot in a new
//! ferrovm (the devices come back from the snapshot's record), resume; with the
//! migrate-dirty guest, and with blk-stress, which uses the drive across the load; and in
//! `make test-linux` with the Linux test guest, which counts on an ext4 root drive across
//! the load and powers off by itself. The program is built with Go (modules from the Go
//! proxy; `make test` builds it first and passes it in FERROVM_FCSDK).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// The `go` binary: on PATH, or where Debian's golang-go or the upstream tarball put it.
fn go() -> PathBuf {
    let candidates = ["go", "/usr/local/go/bin/go", "/usr/lib/go/bin/go"];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| {
            Command::new(p)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("Go is missing: scripts/install-deps.sh installs Debian's golang-go")
}

/// The SDK test program, built unless FERROVM_FCSDK names it.
fn fcsdk_program() -> PathBuf {
    if let Some(path) = std::env::var_os("FERROVM_FCSDK") {
        return PathBuf::from(path);
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fcsdk");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/go/fcsdk");
    let built = Command::new(go())
        .args(["build", "-o"])
        .arg(&out)
        .arg(".")
        .current_dir(&source)
        .env("GOFLAGS", "-mod=mod")
        .output()
        .expect("running go build");
    assert!(
        built.status.success(),
        "go build failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    out
}

/// The progress numbers a guest's serial log reports, in order: migrate-dirty's `pass N`,
/// or blk-stress's `round N ok:` (a round writes the disk and reads it back, checked).
fn progress(log: &Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.strip_prefix("migrate-dirty: pass ")
                .or_else(|| {
                    l.strip_prefix("stress: round ")
                        .filter(|r| r.contains(" ok: "))
                })
                .or_else(|| l.trim_end().strip_prefix("FERROVM-COUNT i="))
        })
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect()
}

/// Deletes the tap (which the VMM creates for the SDK's network interface) when the test
/// ends, passed or not.
struct TapGuard(&'static str);

impl Drop for TapGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", self.0])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// migrate-dirty: the guest dirties its memory, and the loaded VM goes on counting.
#[test]
fn firecracker_go_sdk_drives_a_whole_life() {
    whole_life("migrate-dirty", "fcsdk0");
}

/// blk-stress: the guest writes and reads back its drive in rounds, and the loaded VM's
/// rounds go on checking out: the rebuilt disk works.
#[test]
fn a_loaded_snapshot_gets_its_disk_back() {
    whole_life("blk-stress", "fcsdk1");
}

/// The Linux test guest through the SDK: its counter runs on the drive, an ext4 image, across
/// the snapshot and load; the loaded VM counts to 20 and powers off. Afterwards the drive's
/// filesystem is clean and `/count` holds 1..20 once each.
#[test]
#[ignore = "Linux guest: make test-linux"]
fn firecracker_go_sdk_drives_a_linux_guest() {
    let kernel = common::linux::linux_dir().join("vmlinux");
    let dir = whole_life_of(&kernel, "linux", "fcsdk2");
    let image = dir.join("disk.img");
    let check = Command::new("e2fsck")
        .args(["-fn", image.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let count = Command::new("debugfs")
        .args(["-R", "cat /count", image.to_str().unwrap()])
        .output()
        .unwrap();
    let expected: String = (1..=20).map(|n| format!("{n}\n")).collect();
    assert_eq!(String::from_utf8_lossy(&count.stdout), expected);
    let _ = std::fs::remove_dir_all(&dir);
}

fn whole_life(guest_name: &str, tap_name: &'static str) {
    let dir = whole_life_of(&guest(guest_name), guest_name, tap_name);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The drive the guest gets: a sparse raw image (blk-stress works on its first 2 MiB), or
/// for Linux an empty ext4 filesystem.
fn make_drive(image: &Path, linux: bool) {
    if !linux {
        std::fs::File::create(image)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        return;
    }
    let made = Command::new("mkfs.ext4")
        .args(["-q", "-F", image.to_str().unwrap(), "64M"])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
}

/// Runs the SDK program with `kernel` and checks the two serial logs; returns its
/// directory, where the drive's image still is.
fn whole_life_of(kernel: &Path, name: &str, tap_name: &'static str) -> PathBuf {
    require_kvm();
    let program = fcsdk_program();
    let dir = std::env::temp_dir().join(format!("ferrovm-fcsdk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    make_drive(&dir.join("disk.img"), name == "linux");
    drop(TapGuard(tap_name)); // a tap left by an earlier run
    let tap = TapGuard(tap_name);
    let out = Command::new(&program)
        .arg(FERROVM)
        .arg(kernel)
        .arg(&dir)
        .arg(tap_name)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.lines().last() == Some("PASS"),
        "the SDK program failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    // The guest's own word: it counted passes in the first VMM, and went on from where the
    // snapshot left it in the second (the count lives in guest memory and never decreases).
    let first = progress(&dir.join("first.serial"));
    let second = progress(&dir.join("second.serial"));
    assert!(first.len() >= 2, "first VM: {first:?}");
    assert!(!second.is_empty(), "the loaded VM printed no pass");
    let at_snapshot = *first.last().unwrap();
    assert!(
        second[0] >= at_snapshot && second.windows(2).all(|w| w[0] <= w[1]),
        "passes went backwards: first {first:?}, second {second:?}"
    );
    // ferrovm's snapshot is one file; the memory file is a second name of it.
    use std::os::unix::fs::MetadataExt;
    let (state, mem) = (
        std::fs::metadata(dir.join("vm.snap")).unwrap(),
        std::fs::metadata(dir.join("vm.mem")).unwrap(),
    );
    assert_eq!((state.dev(), state.ino()), (mem.dev(), mem.ino()));
    drop(tap);
    assert!(
        !Path::new("/sys/class/net").join(tap_name).exists(),
        "the tap {tap_name} is still there"
    );
    dir
}
