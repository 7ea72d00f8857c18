//! firecracker-go-sdk v1.0.0 drives ferrovm with its own default handlers
//! (tests/go/fcsdk/main.go): configure a machine with a drive, a network interface (a tap)
//! and a vsock device, InstanceStart, pause, snapshot, stop, load the snapshot in a new
//! ferrovm (the devices come back from the snapshot's record), resume. The program is built with Go (modules from the Go
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

/// The `pass N` numbers a migrate-dirty serial log reports, in order.
fn passes(log: &Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("migrate-dirty: pass "))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect()
}

/// The tap the SDK's network interface names (the VMM creates it).
const TAP: &str = "fcsdk0";

/// Deletes the tap when the test ends, passed or not.
struct TapGuard;

impl Drop for TapGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", TAP])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

#[test]
fn firecracker_go_sdk_drives_a_whole_life() {
    require_kvm();
    let program = fcsdk_program();
    let dir = std::env::temp_dir().join(format!("ferrovm-fcsdk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = guest("migrate-dirty");
    // The drive: a small raw image.
    std::fs::File::create(dir.join("disk.img"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let tap = TapGuard;
    drop(TapGuard); // a tap left by an earlier run
    let out = Command::new(&program)
        .arg(FERROVM)
        .arg(&kernel)
        .arg(&dir)
        .arg(TAP)
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
    let first = passes(&dir.join("first.serial"));
    let second = passes(&dir.join("second.serial"));
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
        !Path::new("/sys/class/net").join(TAP).exists(),
        "the tap {TAP} is still there"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
