//! Lazy restore with verify-on-fault: no page of a snapshot becomes visible to the guest
//! before its checksum is verified. A damaged page, or a file changed or truncated under a
//! running restored guest, stops the VM with one line naming the file and the page, and the
//! guest never prints anything derived from bad data. Good snapshots restore and run on,
//! and a lazily restored guest can be snapshotted and migrated again.
//!
//! The guest is migrate-idle (docs: guests/migrate-idle.c): a 32 MiB region of pattern
//! pages in a 256 MiB machine, checked every tick. `FERROVM_RESTORE_PREFETCH=off` keeps the
//! prefetcher out, so that only the guest's own faults (or the VMM's reads) bring pages in.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const REGION_BASE: u64 = 16 << 20;
const REGION_PAGES: u64 = 8192;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-restore-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A ferrovm process with its serial output and its stderr in files.
struct Vm {
    child: Child,
    serial: PathBuf,
    socket: PathBuf,
    stderr: PathBuf,
}

impl Vm {
    fn start(args: &[&str], dir: &Path, name: &str, env: &[(&str, &str)]) -> Vm {
        require_kvm();
        let serial = dir.join(format!("{name}.serial"));
        let socket = dir.join(format!("{name}.sock"));
        let stderr = dir.join(format!("{name}.stderr"));
        let child = Command::new(FERROVM)
            .arg("run")
            .args(args)
            .arg("--serial")
            .arg(format!("file:{}", serial.display()))
            .arg("--api-socket")
            .arg(&socket)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start ferrovm");
        let mut vm = Vm {
            child,
            serial,
            socket,
            stderr,
        };
        // A restore that fails at once may end before it ever serves the API.
        wait_until(
            Duration::from_secs(30),
            || vm.socket.exists() || vm.child.try_wait().unwrap().is_some(),
            "API socket",
        );
        vm
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn ctl(&self, args: &[&str]) -> Run {
        let s = self.socket.to_str().unwrap();
        ferrovm(
            &[&["ctl", "--api-socket", s][..], args].concat(),
            Duration::from_secs(120),
        )
    }

    /// Waits for the process to end: its status and stderr.
    fn wait(&mut self, limit: Duration) -> (Option<i32>, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status.code(), self.stderr());
            }
            assert!(
                start.elapsed() < limit,
                "VM did not exit within {limit:?}; serial:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The highest tick a migrate-idle guest reported.
fn last_tick(serial: &str) -> Option<u64> {
    serial
        .lines()
        .filter_map(|l| l.strip_prefix("migrate-idle: tick "))
        .filter_map(|rest| rest.strip_suffix(" ok")?.parse().ok())
        .max()
}

/// Boots migrate-idle with `cmdline` (plus `mib=32`), waits for its second tick and
/// snapshots it to `dir/name.snap`; the source is shut down. Returns the file and the last
/// tick reported before the snapshot.
fn snapshot_of_idle_guest(dir: &Path, name: &str, cmdline: &str) -> (PathBuf, u64) {
    let kernel = guest("migrate-idle");
    let cmdline = format!("mib=32 {cmdline}");
    let source = Vm::start(
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            &cmdline,
            "--memory",
            "256M",
        ],
        dir,
        &format!("{name}-source"),
        &[],
    );
    wait_until(
        Duration::from_secs(60),
        || last_tick(&source.output()) >= Some(2),
        "the source guest's second tick",
    );
    let snap = dir.join(format!("{name}.snap"));
    let tick = last_tick(&source.output()).unwrap();
    source
        .ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    source.ctl(&["shutdown"]).expect_status(0);
    (snap, tick)
}

fn le32(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

/// Where the page data of guest page `addr` lies in a version 2 snapshot file (the first
/// RAM region's image; docs/migration.md).
fn page_offset(path: &Path, addr: u64) -> u64 {
    let b = std::fs::read(path).unwrap();
    assert_eq!(le32(&b, 8), 2, "format version");
    let images = 20 + 8 + le32(&b, 24) + 4;
    assert_eq!(b[images], 11, "Images frame");
    let image0 = u64::from_le_bytes(b[images + 32..images + 40].try_into().unwrap());
    image0 + addr
}

/// Flips one bit of the byte at each of `offsets` in the file, in place.
fn flip_bytes(path: &Path, offsets: impl IntoIterator<Item = u64>) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    for at in offsets {
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
    }
}

/// Asserts one error line naming the file and the bad page, and a guest that printed
/// nothing at all after the restore (every tick of a `verify=all` guest reads every page,
/// the bad one included, before it prints).
fn assert_stopped_on(status: Option<i32>, stderr: &str, file: &Path, page: &str, cause: &str) {
    assert_eq!(status, Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line expected:\n{stderr}");
    let line = lines[0];
    for needle in [
        &file.display().to_string()[..],
        page,
        cause,
        "the restored guest was stopped",
    ] {
        assert!(line.contains(needle), "{needle:?} missing from: {line}");
    }
}

/// The case: one flipped byte in a page the guest reads at once after the restore.
/// The guest must never see it: whether the guest's fault or the prefetcher meets the page
/// first, the VM stops with status 2 and one line, and the guest prints nothing.
#[test]
fn a_flipped_byte_stops_the_guest_before_it_reads_the_page() {
    let dir = scratch("flipped");
    let (good, _) = snapshot_of_idle_guest(&dir, "good", "verify=all tick_ms=200");
    let page = REGION_BASE + 5 * 4096;
    let bad = dir.join("bad.snap");
    std::fs::copy(&good, &bad).unwrap();
    flip_bytes(&bad, [page_offset(&bad, page) + 100]);
    for (name, env) in [
        ("prefetch", &[][..]),
        ("on-demand", &[("FERROVM_RESTORE_PREFETCH", "off")][..]),
    ] {
        let mut vm = Vm::start(&["--restore", bad.to_str().unwrap()], &dir, name, env);
        let (status, stderr) = vm.wait(Duration::from_secs(60));
        assert_stopped_on(
            status,
            &stderr,
            &bad,
            "guest page 0x1005000",
            "fails its checksum",
        );
        let out = vm.output();
        assert!(out.trim().is_empty(), "{name}: the guest printed:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A good snapshot restores, and the guest continues from its tick and verifies every page
/// at its end; once the prefetch is complete the file is no longer needed: it is truncated
/// and deleted under the running guest, which still verifies every page each tick.
#[test]
fn a_good_snapshot_restores_and_the_file_can_go_once_loaded() {
    let dir = scratch("good");
    let (snap, tick) = snapshot_of_idle_guest(&dir, "good", "verify=all tick_ms=200 ticks=20");
    let mut vm = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "restored",
        &[("FERROVM_LOG", "info")],
    );
    // The pager's last word once every page is in.
    wait_until(
        Duration::from_secs(60),
        || vm.stderr().contains("the guest no longer needs the file"),
        "the end of the prefetch",
    );
    let f = std::fs::OpenOptions::new().write(true).open(&snap).unwrap();
    f.set_len(0).unwrap();
    std::fs::remove_file(&snap).unwrap();
    let gone_at = last_tick(&vm.output());
    let (status, stderr) = vm.wait(Duration::from_secs(60));
    let out = vm.output();
    assert_eq!(status, Some(1), "{stderr}\n{out}");
    assert!(
        last_tick(&out) > gone_at,
        "no tick after the file went:\n{out}"
    );
    assert!(!out.contains("FAIL") && !out.contains(" holds "), "{out}");
    let first = out.lines().find_map(last_tick).unwrap();
    assert!(
        first > tick,
        "restored at tick {first}, snapshot after tick {tick}"
    );
    assert!(
        out.contains(&format!("all {REGION_PAGES} pages verified"))
            && out.trim_end().ends_with("PASS"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Restores with pages brought in only by faults, waits for the guest's first tick, then
/// damages the file with `damage` and waits for the guest to stop.
fn damaged_under_the_guest(name: &str, damage: impl FnOnce(&Path), page: &str, cause: &str) {
    let dir = scratch(name);
    // A rotating sample of 64 pages a tick: new pages every tick, and new 64 KiB blocks every
    // 16 ticks (1.6 s).
    let (snap, _) = snapshot_of_idle_guest(&dir, "base", "tick_ms=100");
    let mut vm = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "restored",
        &[("FERROVM_RESTORE_PREFETCH", "off")],
    );
    wait_until(
        Duration::from_secs(60),
        || vm.output().contains(" ok"),
        "a tick of the restored guest",
    );
    damage(&snap);
    let (status, stderr) = vm.wait(Duration::from_secs(60));
    assert_stopped_on(status, &stderr, &snap, page, cause);
    let out = vm.output();
    assert!(!out.contains("FAIL") && !out.contains(" holds "), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The file truncated under a running, lazily restored guest: a clear error naming the file
/// and the page, never a corrupt guest or a bare "Bad address".
#[test]
fn a_file_truncated_under_the_guest_stops_it_with_one_line() {
    damaged_under_the_guest(
        "truncated",
        |snap| {
            let cut = page_offset(snap, 0);
            let f = std::fs::OpenOptions::new().write(true).open(snap).unwrap();
            f.set_len(cut).unwrap();
        },
        "guest page 0x",
        "truncated after the restore began",
    );
}

/// The file rewritten under a running, lazily restored guest: every page of the guest's
/// region changes in the file, so the next page the guest needs fails its checksum.
#[test]
fn a_file_changed_under_the_guest_stops_it_with_one_line() {
    damaged_under_the_guest(
        "changed",
        |snap| {
            let first = page_offset(snap, REGION_BASE);
            flip_bytes(snap, (0..REGION_PAGES).map(|p| first + p * 4096 + 8));
        },
        "guest page 0x",
        "fails its checksum",
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn snapshot_pages(run: &Run) -> u64 {
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    reply["pages"].as_u64().unwrap()
}

/// A guest restored with pages brought in only by faults is snapshotted at once (the
/// snapshot's reads of guest memory are served by the pager, verified) and migrated; the
/// second snapshot and the migration's destination both hold every page, which the guest
/// verifies. The restored guests are paused first, so that none reaches its last tick
/// before the snapshot or the migration is done, however slow the host.
#[test]
fn a_restored_guest_can_be_snapshotted_and_migrated_again() {
    let dir = scratch("again");
    let (snap, _) = snapshot_of_idle_guest(&dir, "first", "tick_ms=200 ticks=8");
    let on_demand = [("FERROVM_RESTORE_PREFETCH", "off")];

    let lazy = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "lazy",
        &on_demand,
    );
    lazy.ctl(&["pause"]).expect_status(0);
    let second = dir.join("second.snap");
    let run = lazy.ctl(&["--json", "snapshot", second.to_str().unwrap()]);
    run.expect_status(0);
    assert!(snapshot_pages(&run) >= REGION_PAGES, "{}", run.stdout);
    lazy.ctl(&["shutdown"]).expect_status(0);
    drop(lazy);
    let mut again = Vm::start(&["--restore", second.to_str().unwrap()], &dir, "again", &[]);
    let (status, stderr) = again.wait(Duration::from_secs(120));
    let out = again.output();
    assert_eq!(status, Some(1), "{stderr}\n{out}");
    assert!(
        out.contains(&format!("all {REGION_PAGES} pages verified")),
        "{out}"
    );

    let listen = format!("tcp:127.0.0.1:{}", free_port());
    let mut dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        &[],
    );
    let mut lazy = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "lazy2",
        &on_demand,
    );
    lazy.ctl(&["pause"]).expect_status(0);
    let run = lazy.ctl(&["--json", "migrate", &listen]);
    let (status, stderr) = lazy.wait(Duration::from_secs(60));
    assert_eq!(run.status, Some(0), "{}\nsource: {stderr}", run.stderr);
    assert_eq!(
        status,
        Some(0),
        "the source exits once the destination runs: {stderr}"
    );
    // The guest arrives paused, as it left.
    dest.ctl(&["resume"]).expect_status(0);
    let (status, stderr) = dest.wait(Duration::from_secs(120));
    let out = dest.output();
    assert_eq!(status, Some(1), "{stderr}\n{out}");
    assert!(
        out.contains(&format!("all {REGION_PAGES} pages verified"))
            && out.trim_end().ends_with("PASS"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a userfaultfd (`FERROVM_USERFAULTFD=off` stands in for a kernel that refuses
/// one), the restore says so and checks all page data before the guest runs: a damaged page
/// is refused before the guest ever ran, and a good snapshot runs on.
#[test]
fn without_userfaultfd_everything_is_checked_first() {
    let dir = scratch("fallback");
    let (good, tick) = snapshot_of_idle_guest(&dir, "good", "verify=all tick_ms=200 ticks=6");
    let off = [("FERROVM_USERFAULTFD", "off")];
    let mut vm = Vm::start(&["--restore", good.to_str().unwrap()], &dir, "good", &off);
    let (status, stderr) = vm.wait(Duration::from_secs(60));
    let out = vm.output();
    assert_eq!(status, Some(1), "{stderr}\n{out}");
    assert!(
        stderr.contains("userfaultfd is not available") && stderr.contains("FERROVM_USERFAULTFD"),
        "{stderr}"
    );
    assert!(
        last_tick(&out) > Some(tick) && out.trim_end().ends_with("PASS"),
        "{out}"
    );

    let bad = dir.join("bad.snap");
    std::fs::copy(&good, &bad).unwrap();
    flip_bytes(&bad, [page_offset(&bad, REGION_BASE + 4096) + 9]);
    let mut vm = Vm::start(&["--restore", bad.to_str().unwrap()], &dir, "bad", &off);
    let (status, stderr) = vm.wait(Duration::from_secs(60));
    assert_eq!(status, Some(2), "{stderr}");
    let line = stderr.lines().last().unwrap_or_default();
    assert!(
        line.contains(&bad.display().to_string()) && line.contains("guest page 0x1001000"),
        "{stderr}"
    );
    assert!(vm.output().trim().is_empty(), "{}", vm.output());
    let _ = std::fs::remove_dir_all(&dir);
}
