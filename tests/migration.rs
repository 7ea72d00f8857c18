//! Snapshot/restore and live migration with guests that check their own memory, and failure
//! injection: whatever goes wrong, the source guest keeps running intact.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use common::relay::*;
use common::*;

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

fn free_port() -> u16 {
    let base = 20000 + (std::process::id() % 20000) as u16;
    base + NEXT_PORT.fetch_add(1, Ordering::SeqCst)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrovm-mig-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A ferrovm process whose serial output goes to a file we can watch.
struct Vm {
    child: Child,
    serial: PathBuf,
    stderr: PathBuf,
    socket: Option<PathBuf>,
}

impl Vm {
    fn start(args: &[&str], dir: &Path, name: &str, with_socket: bool) -> Vm {
        Vm::start_in(None, args, dir, name, with_socket)
    }

    fn start_in(netns: Option<&str>, args: &[&str], dir: &Path, name: &str, sock: bool) -> Vm {
        require_kvm();
        let serial = dir.join(format!("{name}.serial"));
        let stderr = dir.join(format!("{name}.stderr"));
        let socket = dir.join(format!("{name}.sock"));
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, FERROVM]);
                c
            }
            None => Command::new(FERROVM),
        };
        cmd.arg("run").args(args);
        cmd.arg("--serial")
            .arg(format!("file:{}", serial.display()));
        if sock {
            cmd.arg("--api-socket").arg(&socket);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start ferrovm");
        let mut vm = Vm {
            child,
            serial,
            stderr,
            socket: sock.then_some(socket),
        };
        if let Some(s) = &vm.socket {
            wait_until(Duration::from_secs(20), || s.exists(), "API socket");
        }
        // A destination is ready once it says where it listens; a migration started before
        // that line would find nobody there.
        if args.contains(&"--incoming") {
            vm.listening_line();
        }
        vm
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn ctl(&self, args: &[&str]) -> Run {
        let s = self.socket.as_ref().unwrap().to_str().unwrap().to_string();
        let mut all = vec!["ctl", "--api-socket", &s];
        all.extend_from_slice(args);
        ferrovm(&all, Duration::from_secs(300))
    }

    fn wait(&mut self, limit: Duration) -> (Option<i32>, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status.code(), self.errors());
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

    fn errors(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The address of the `listening on ADDRESS` line a destination prints first.
    fn listening_line(&mut self) -> String {
        let mut addr = None;
        wait_until(
            Duration::from_secs(20),
            || {
                addr = self.errors().lines().find_map(|l| {
                    l.trim()
                        .rsplit_once("listening on ")
                        .map(|(_, a)| a.to_string())
                });
                addr.is_some() || self.child.try_wait().unwrap().is_some()
            },
            "the destination's listening line",
        );
        addr.unwrap_or_else(|| panic!("no listening line: {}", self.errors()))
    }

    /// The port of the `listening on 127.0.0.1:PORT` line a destination prints first.
    fn listening_port(&mut self) -> u16 {
        let addr = self.listening_line();
        addr.rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in the listening line {addr}"))
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
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

/// The highest `pass N` a migrate-dirty guest has reported.
fn last_pass(serial: &str) -> u64 {
    serial
        .lines()
        .filter_map(|l| l.strip_prefix("migrate-dirty: pass "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .max()
        .unwrap_or(0)
}

fn assert_intact(serial: &str) {
    assert!(
        !serial.contains("FAIL"),
        "guest reported a failure:\n{serial}"
    );
}

fn dirty_guest(mib: u32) -> String {
    format!("mib={mib}")
}

/// Starts a dirtying guest and waits for it to report progress.
fn start_dirty_source(dir: &Path, extra: &[&str], mib: u32) -> Vm {
    start_dirty_source_with(dir, extra, &dirty_guest(mib))
}

fn start_dirty_source_with(dir: &Path, extra: &[&str], cmdline: &str) -> Vm {
    let kernel = guest("migrate-dirty");
    let mut args = vec!["--kernel", kernel.to_str().unwrap(), "--cmdline", cmdline];
    args.extend_from_slice(extra);
    let vm = Vm::start(&args, dir, "source", true);
    wait_until(
        Duration::from_secs(60),
        || last_pass(&vm.output()) >= 2,
        "the source guest's progress",
    );
    vm
}

#[test]
fn snapshot_and_restore_continue_where_the_guest_was() {
    let dir = scratch("snapshot");
    let mut source = start_dirty_source(&dir, &["--memory", "256M", "--cpus", "2"], 32);
    let snap = dir.join("vm.snap");
    // The guest reports its pass now and then, and runs on while the file is synced and
    // renamed: the snapshot holds a pass at least as far as the last one reported before.
    let before_snapshot = last_pass(&source.output());
    let run = source.ctl(&["--json", "snapshot", snap.to_str().unwrap()]);
    run.expect_status(0);
    assert!(source.running(), "the source runs on after a snapshot");
    source.ctl(&["shutdown"]).expect_status(0);
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0));
    assert_intact(&source.output());

    let restored = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "restored",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&restored.output()) >= 2,
        "the restored guest's progress",
    );
    let out = restored.output();
    assert_intact(&out);
    // The restored guest picks up from the snapshot's pass, it does not boot again.
    assert!(
        !out.contains("region"),
        "the restored guest booted afresh:\n{out}"
    );
    let first = out
        .lines()
        .filter_map(|l| l.strip_prefix("migrate-dirty: pass "))
        .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .next()
        .unwrap();
    assert!(
        first + 1 >= before_snapshot,
        "restored at pass {first}, snapshot taken after pass {before_snapshot}"
    );
    restored.ctl(&["shutdown"]).expect_status(0);
}

fn migrate_on_loopback(cpus: &str, irqchip: &str) {
    migrate_on_loopback_with(cpus, irqchip, &[]);
}

fn migrate_on_loopback_with(cpus: &str, irqchip: &str, options: &[&str]) {
    let dir = scratch(&format!("loop-{cpus}-{irqchip}-{}", options.join("")));
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let shape = ["--memory", "256M", "--cpus", cpus, "--irqchip", irqchip];
    let mut dest_args = vec!["--incoming", &listen];
    dest_args.extend_from_slice(&shape);
    let dest = Vm::start(&dest_args, &dir, "dest", true);
    let mut source = start_dirty_source(&dir, &shape, 32);
    let before = last_pass(&source.output());
    let mut args = vec!["--json", "migrate", &listen];
    args.extend_from_slice(options);
    let run = source.ctl(&args);
    run.expect_status(0);
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    let report = &reply["report"];
    assert!(report["rounds"].as_array().unwrap().len() >= 2, "{report}");
    if options.contains(&"lz4") || options.contains(&"zstd") {
        let packed = report["compressed_frame_bytes"].as_u64().unwrap();
        let raw = report["compressed_page_bytes"].as_u64().unwrap();
        assert!(packed > 0 && packed < raw, "nothing compressed: {report}");
    }
    assert!(report["downtime_ms"].as_f64().unwrap() > 0.0);
    eprintln!(
        "migration {cpus} vCPU {irqchip}: total {} ms, downtime {} ms, {} bytes",
        report["total_ms"], report["downtime_ms"], report["bytes_total"]
    );
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(
        status,
        Some(0),
        "the source exits 0 once the destination runs"
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > before,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
}

#[test]
fn live_migration_loopback_1_vcpu_kernel_irqchip() {
    migrate_on_loopback("1", "kernel");
}

#[test]
fn live_migration_loopback_2_vcpus_kernel_irqchip() {
    migrate_on_loopback("2", "kernel");
}

/// Page data compressed with zstd, and with LZ4 striped over two connections.
#[test]
fn live_migration_compressed_zstd() {
    migrate_on_loopback_with("1", "kernel", &["--compress", "zstd", "--connections", "1"]);
}

#[test]
fn live_migration_compressed_lz4_over_2_connections() {
    migrate_on_loopback_with("2", "kernel", &["--compress", "lz4", "--connections", "2"]);
}

/// Pages striped over four connections (three data connections beside the control one).
#[test]
fn live_migration_over_4_connections() {
    migrate_on_loopback_with("2", "kernel", &["--connections", "4"]);
}

#[test]
fn live_migration_loopback_1_vcpu_split_irqchip() {
    migrate_on_loopback("1", "split");
}

#[test]
fn live_migration_loopback_2_vcpus_split_irqchip() {
    migrate_on_loopback("2", "split");
}

/// Runs a migration that must fail, then checks that the source guest still runs intact.
fn failed_migration_leaves_source_running(
    name: &str,
    dest_memory: &str,
    fault: Option<Fault>,
    kill_dest_after: Option<Duration>,
) {
    failed_migration_over(
        name,
        dest_memory,
        fault.map(|f| (f, 0)),
        kill_dest_after,
        &[],
    );
}

/// [`failed_migration_leaves_source_running`] with more `migrate` options (such as
/// `--connections`), the fault on connection `nth` (0: control).
fn failed_migration_over(
    name: &str,
    dest_memory: &str,
    fault: Option<(Fault, usize)>,
    kill_dest_after: Option<Duration>,
    options: &[&str],
) -> Vm {
    let dir = scratch(name);
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--memory", dest_memory],
        &dir,
        "dest",
        false,
    );
    let mut source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    let target = match fault {
        Some((f, nth)) => format!("tcp:127.0.0.1:{}", relay_nth(f, nth, port)),
        None => listen.clone(),
    };
    let killer = kill_dest_after.map(|after| {
        let pid = dest.child.id() as i32;
        std::thread::spawn(move || {
            std::thread::sleep(after);
            // SAFETY: pid is the destination child, still owned (not reaped) by `dest`.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        })
    });
    // A low bandwidth keeps the migration in flight long enough for the faults.
    let mut args = vec!["migrate", &target, "--max-bandwidth", "20000000"];
    args.extend_from_slice(options);
    let run = source.ctl(&args);
    if let Some(k) = killer {
        k.join().unwrap();
    }
    assert_eq!(
        run.status,
        Some(2),
        "the migration must fail:\n{}",
        run.stdout
    );
    if !source.running() {
        let (status, err) = source.wait(Duration::from_secs(5));
        panic!("the source VMM exited ({status:?}): {err}");
    }
    eprintln!("{name}: source: {}", run.stderr.trim());
    if !run.stderr.contains("keeps running") {
        let _ = source.child.kill();
        let (_, err) = source.wait(Duration::from_secs(5));
        panic!(
            "the error says the guest runs on: {}; source: {err}",
            run.stderr
        );
    }
    let status = source.ctl(&["--json", "status"]);
    assert!(
        status.stdout.contains("\"state\":\"running\""),
        "{}",
        status.stdout
    );
    let after_failure = last_pass(&source.output());
    wait_until(
        Duration::from_secs(60),
        || last_pass(&source.output()) >= after_failure + 2,
        "the source guest to make progress after the failed migration",
    );
    assert_intact(&source.output());
    source.ctl(&["shutdown"]).expect_status(0);
    dest
}

#[test]
fn destination_with_other_memory_size_is_refused() {
    failed_migration_leaves_source_running("memsize", "512M", None, None);
}

#[test]
fn destination_killed_mid_round() {
    failed_migration_leaves_source_running(
        "killed",
        "256M",
        None,
        Some(Duration::from_millis(400)),
    );
}

/// Data connections: a cut data connection, and a cut control connection while data
/// connections carry pages, both fail the one migration and leave the source running.
#[test]
fn data_connection_cut_mid_stream() {
    failed_migration_over(
        "cut-data",
        "256M",
        Some((Fault::CutAfter(2 << 20), 2)),
        None,
        &["--connections", "3"],
    );
}

#[test]
fn control_connection_cut_with_data_connections() {
    failed_migration_over(
        "cut-control",
        "256M",
        Some((Fault::CutAfter(1 << 20), 0)),
        None,
        &["--connections", "3"],
    );
}

/// The destination killed while three connections carry round 0.
#[test]
fn destination_killed_mid_round_with_data_connections() {
    failed_migration_over(
        "killed-data",
        "256M",
        None,
        Some(Duration::from_millis(400)),
        &["--connections", "3"],
    );
}

/// Compressed streams cut on a data connection (zstd) and on the control connection (LZ4),
/// early: the dirtying guest's pages compress to almost nothing (a data connection may carry
/// little more than its header, `Join` and `RoundEnd` frames).
#[test]
fn compressed_stream_cut_mid_stream() {
    failed_migration_over(
        "cut-zstd",
        "256M",
        Some((Fault::CutAfter(100), 1)),
        None,
        &["--connections", "2", "--compress", "zstd"],
    );
    failed_migration_over(
        "cut-lz4",
        "256M",
        Some((Fault::CutAfter(4 << 10), 0)),
        None,
        &["--connections", "1", "--compress", "lz4"],
    );
}

/// A connection cut at a phase of the migration (`CutAtPhase`) on connection `nth`: the
/// source guest runs on intact, and the destination exits with one line saying why.
fn cut_in_phase(name: &str, phase: Phase, ways: Ways, nth: usize, options: &[&str]) {
    let fault = Fault::CutAtPhase(phase, ways);
    let mut dest = failed_migration_over(name, "256M", Some((fault, nth)), None, options);
    let (status, err) = dest.wait(Duration::from_secs(30));
    assert_ne!(status, Some(0), "the destination must fail: {err}");
    eprintln!("{name}: destination: {}", err.trim());
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("ferrovm:")).collect();
    assert_eq!(errors.len(), 1, "one line says why: {err}");
    assert!(errors[0].starts_with("ferrovm: migration: "), "{err}");
}

#[test]
fn cut_in_round_0() {
    cut_in_phase(
        "p0-one",
        Phase::RoundEnd(0),
        Ways::Both,
        0,
        &["--connections", "1"],
    );
    cut_in_phase(
        "p0-data",
        Phase::RoundEnd(0),
        Ways::Both,
        2,
        &["--connections", "3"],
    );
    cut_in_phase(
        "p0-zstd",
        Phase::RoundEnd(0),
        Ways::Both,
        0,
        &["--connections", "2", "--compress", "zstd"],
    );
}

#[test]
fn cut_in_a_later_round() {
    cut_in_phase(
        "p1-one",
        Phase::RoundEnd(1),
        Ways::Both,
        0,
        &["--connections", "1"],
    );
    cut_in_phase(
        "p1-data",
        Phase::RoundEnd(1),
        Ways::Both,
        1,
        &["--connections", "3"],
    );
    cut_in_phase(
        "p1-lz4",
        Phase::RoundEnd(1),
        Ways::Both,
        1,
        &["--connections", "2", "--compress", "lz4"],
    );
}

/// In the stop-and-copy (the guest paused, its state on the way): a data connection cut
/// both ways, or the control connection's stream cut (the destination's refusal still
/// reaches the source, which resumes). A control connection cut both ways at this point
/// leaves the outcome unknown to the source, which then keeps its guest paused (it might
/// run on the destination: `a_missing_ack_leaves_the_source_paused_with_an_unknown_outcome`
/// in the engine's tests).
#[test]
fn cut_in_the_stop_and_copy() {
    cut_in_phase(
        "pf-one",
        Phase::FinalRound,
        Ways::StreamOnly,
        0,
        &["--connections", "1"],
    );
    cut_in_phase(
        "pf-data",
        Phase::FinalRound,
        Ways::Both,
        2,
        &["--connections", "3"],
    );
    cut_in_phase(
        "pf-ctl",
        Phase::FinalRound,
        Ways::StreamOnly,
        0,
        &["--connections", "3"],
    );
    cut_in_phase(
        "pf-zstd",
        Phase::FinalRound,
        Ways::Both,
        1,
        &["--connections", "2", "--compress", "zstd"],
    );
}

#[test]
fn connection_cut_mid_stream() {
    failed_migration_leaves_source_running("cut", "256M", Some(Fault::CutAfter(3 << 20)), None);
}

/// A flipped byte in the stream's framing (here inside the configuration frame) fails the
/// migration. (A flipped byte inside page data sent while the guest runs is caught by that
/// page's CRC and the page is sent again, as a page torn by a vCPU write would be: the
/// migration then succeeds.)
#[test]
fn one_corrupted_byte_is_detected() {
    failed_migration_leaves_source_running("corrupt", "256M", Some(Fault::FlipByteAt(40)), None);
}

#[test]
fn corrupt_snapshot_is_refused_with_one_line() {
    let dir = scratch("badsnap");
    let junk = dir.join("junk.snap");
    std::fs::write(&junk, b"not a snapshot at all").unwrap();
    let run = ferrovm(
        &["run", "--restore", junk.to_str().unwrap()],
        Duration::from_secs(30),
    );
    run.expect_error("junk.snap");
    let missing = dir.join("missing.snap");
    ferrovm(
        &["run", "--restore", missing.to_str().unwrap()],
        Duration::from_secs(30),
    )
    .expect_error("missing.snap");
}

/// The `"pages"` figure of a `ctl --json snapshot` reply.
fn snapshot_pages(run: &Run) -> u64 {
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    reply["pages"].as_u64().unwrap()
}

/// A migrate-idle guest with 32 MiB of pattern pages (8192, 64 checked per 1 s tick, all of
/// them after tick 5), once it has passed its second tick.
fn idle_source_at_tick_2(dir: &Path) -> Vm {
    let kernel = guest("migrate-idle");
    let source = Vm::start(
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            // Enough ticks that the guest outlives a snapshot, a restore and a migration of
            // it on a loaded host (each tick is a second).
            "mib=32 ticks=10",
            "--memory",
            "256M",
        ],
        dir,
        "source",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || source.output().contains("tick 2 ok"),
        "the source guest's second tick",
    );
    source
}

/// Snapshot → lazy restore → snapshot again at once (the guest has touched none of its
/// region since the restore: those pages are only mapped from the first file, not present)
/// → restore → the guest verifies every page of its region. And a snapshot to the very file
/// the guest is mapped from replaces it without harming the running guest.
#[test]
fn lazily_restored_guest_snapshots_every_page_again() {
    let dir = scratch("relazy");
    let source = idle_source_at_tick_2(&dir);
    let first = dir.join("first.snap");
    let run = source.ctl(&["--json", "snapshot", first.to_str().unwrap()]);
    run.expect_status(0);
    let pages1 = snapshot_pages(&run);
    assert!(pages1 >= 8192, "{}", run.stdout);
    source.ctl(&["shutdown"]).expect_status(0);
    drop(source);
    let first_bytes = std::fs::read(&first).unwrap();

    // Taken as soon as the API answers, before the guest's next tick (it waits in HLT
    // for up to a second): none of the region's pages is present in the restored VMM.
    let lazy = Vm::start(&["--restore", first.to_str().unwrap()], &dir, "lazy", true);
    let second = dir.join("second.snap");
    let run = lazy.ctl(&["--json", "snapshot", second.to_str().unwrap()]);
    run.expect_status(0);
    let pages2 = snapshot_pages(&run);
    // Every page the first snapshot held is still there (the guest zeroes none).
    assert!(
        pages2 >= pages1,
        "second snapshot: {pages2} pages, first: {pages1}"
    );
    // The guest runs on; then a snapshot to the very file it is mapped from: replaced by a
    // rename, not rewritten under the running guest.
    wait_until(
        Duration::from_secs(30),
        || lazy.output().contains(" ok"),
        "a tick of the lazily restored guest",
    );
    lazy.ctl(&["snapshot", first.to_str().unwrap()])
        .expect_status(0);
    lazy.ctl(&["shutdown"]).expect_status(0);
    assert_intact(&lazy.output());
    drop(lazy);
    assert_ne!(
        std::fs::read(&first).unwrap(),
        first_bytes,
        "the snapshot to the same path replaced the file"
    );

    for (name, file) in [("from-second", &second), ("from-first", &first)] {
        let mut last = Vm::start(&["--restore", file.to_str().unwrap()], &dir, name, false);
        let (status, stderr) = last.wait(Duration::from_secs(120));
        let out = last.output();
        assert_eq!(status, Some(1), "{name}: {stderr}\n{out}");
        assert!(
            out.contains("all 8192 pages verified") && out.trim_end().ends_with("PASS"),
            "{name}:\n{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A lazily restored guest migrated live at once: round 0 sends the pages still only mapped
/// from the snapshot file too, and the destination's guest verifies all of them.
#[test]
fn lazily_restored_guest_migrates_every_page() {
    let dir = scratch("lazymig");
    let source = idle_source_at_tick_2(&dir);
    let snap = dir.join("vm.snap");
    source
        .ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    source.ctl(&["shutdown"]).expect_status(0);
    drop(source);

    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let mut dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        false,
    );
    let mut lazy = Vm::start(&["--restore", snap.to_str().unwrap()], &dir, "lazy", true);
    let run = lazy.ctl(&["--json", "migrate", &listen]);
    run.expect_status(0);
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    let sent = reply["report"]["pages_total"].as_u64().unwrap();
    assert!(sent >= 8192, "{reply}");
    let (status, _) = lazy.wait(Duration::from_secs(30));
    assert_eq!(
        status,
        Some(0),
        "the source exits once the destination runs"
    );
    let (status, stderr) = dest.wait(Duration::from_secs(120));
    let out = dest.output();
    assert_eq!(status, Some(1), "{stderr}\n{out}");
    assert!(
        out.contains("all 8192 pages verified") && out.trim_end().ends_with("PASS"),
        "{out}"
    );
    drop(dest);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A snapshot of a small idle guest, for damaging.
fn small_snapshot_file(dir: &Path) -> PathBuf {
    let kernel = guest("migrate-idle");
    let vm = Vm::start(
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "mib=8 tick_ms=100",
            "--memory",
            "64M",
        ],
        dir,
        "small",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || vm.output().contains("tick 1 ok"),
        "the guest's first tick",
    );
    let snap = dir.join("good.snap");
    vm.ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    vm.ctl(&["shutdown"]).expect_status(0);
    snap
}

fn le32(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Where the first region's page image starts, and the first byte of the CRC table (the first
/// `DataPages` frame's), in a version 2 snapshot file (docs/migration.md).
fn snapshot_layout(path: &Path) -> (u64, u64) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(le32(&b, 8), 2, "format version");
    let images = 20 + 8 + le32(&b, 24) + 4;
    assert_eq!(b[images], 11, "Images frame");
    let image0 = le64(&b, images + 8 + 8 + 16);
    let data_pages = images + 8 + le32(&b, images + 4) + 4;
    assert_eq!(b[data_pages], 12, "DataPages frame");
    (image0, (data_pages + 8 + 16) as u64)
}

fn damaged_copy(good: &Path, name: &str, damage: impl FnOnce(&std::fs::File, u64)) -> PathBuf {
    let bad = good.with_file_name(name);
    std::fs::copy(good, &bad).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&bad)
        .unwrap();
    let len = f.metadata().unwrap().len();
    damage(&f, len);
    bad
}

fn flip_byte(f: &std::fs::File, at: u64) {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x20], at).unwrap();
}

/// Cut, damaged tables and damaged pages: refused with one line before the guest runs; a
/// damaged page under a lazy restore stops the guest as soon as the background check finds
/// it, with one line naming the page.
#[test]
fn damaged_snapshot_files_are_refused_with_one_line() {
    let dir = scratch("damaged");
    let good = small_snapshot_file(&dir);
    let (image0, crc_table) = snapshot_layout(&good);
    // The guest's region: 8 MiB at 16 MiB (migrate-idle's default base).
    let data = image0 + (16 << 20);
    let run = |file: &Path, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--restore",
            file.to_str().unwrap(),
            "--serial",
            "none",
        ];
        args.extend_from_slice(extra);
        ferrovm(&args, Duration::from_secs(60))
    };

    let cut_in_pages = damaged_copy(&good, "cut-pages.snap", |f, _| {
        f.set_len(data + (4 << 20) + 100).unwrap()
    });
    run(&cut_in_pages, &[]).expect_error("cut-pages.snap: bad snapshot: snapshot file cut short");
    // All the data there, but the file ends before the end of the region's image (the last
    // pages of RAM are untouched: holes).
    let short_image = damaged_copy(&good, "short-image.snap", |f, len| {
        f.set_len(len - 4096).unwrap()
    });
    run(&short_image, &[]).expect_error("short-image.snap: bad snapshot: snapshot file cut short");
    let cut_in_frames = damaged_copy(&good, "cut-frames.snap", |f, _| {
        f.set_len(crc_table + 10).unwrap()
    });
    run(&cut_in_frames, &[])
        .expect_error("cut-frames.snap: bad snapshot: migration stream cut short");
    let bad_table = damaged_copy(&good, "bad-table.snap", |f, _| flip_byte(f, crc_table + 5));
    run(&bad_table, &[]).expect_error("bad-table.snap: bad snapshot: migration stream corrupted: checksum mismatch in the DataPages frame");

    let bad_page = damaged_copy(&good, "bad-page.snap", |f, _| {
        flip_byte(f, data + 3 * 4096 + 100)
    });
    let page = "guest page 0x1003000";
    for extra in [&["--restore-verify"][..], &["--restore-eager"][..]] {
        let r = run(&bad_page, extra);
        r.expect_error(page);
        assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
    }
    // Lazily: the guest may run for a moment, then the check stops it.
    let r = run(&bad_page, &[]);
    r.expect_error(page);
    assert!(
        r.stderr.contains("the restored guest was stopped"),
        "{}",
        r.stderr
    );

    // The undamaged file restores in every mode (and the good guest just runs on).
    for (name, extra) in [
        ("lazy", &[][..]),
        ("verify", &["--restore-verify"][..]),
        ("eager", &["--restore-eager"][..]),
    ] {
        let mut vm = Vm::start(
            &[&["--restore", good.to_str().unwrap()], extra].concat(),
            &dir,
            name,
            false,
        );
        wait_until(
            Duration::from_secs(30),
            || vm.output().contains(" ok"),
            "a tick of the restored guest",
        );
        assert!(vm.running());
        assert_intact(&vm.output());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two hosts: network namespaces joined by a veth pair.
#[test]
fn live_migration_between_two_network_namespaces() {
    require_kvm();
    let tag = format!("fv{}", std::process::id() % 100000);
    let (ns_a, ns_b) = (format!("{tag}a"), format!("{tag}b"));
    let sh = |cmd: &str| {
        let status = Command::new("sh").arg("-c").arg(cmd).status().unwrap();
        assert!(status.success(), "{cmd}");
    };
    let cleanup = format!("ip netns del {ns_a} 2>/dev/null; ip netns del {ns_b} 2>/dev/null; true");
    sh(&cleanup);
    sh(&format!("ip netns add {ns_a} && ip netns add {ns_b}"));
    sh(&format!(
        "ip link add {tag}x netns {ns_a} type veth peer name {tag}y netns {ns_b}"
    ));
    sh(&format!("ip -n {ns_a} addr add 10.213.0.1/30 dev {tag}x && ip -n {ns_a} link set {tag}x up && ip -n {ns_a} link set lo up"));
    sh(&format!("ip -n {ns_b} addr add 10.213.0.2/30 dev {tag}y && ip -n {ns_b} link set {tag}y up && ip -n {ns_b} link set lo up"));

    let dir = scratch("netns");
    let kernel = guest("migrate-dirty");
    let dest = Vm::start_in(
        Some(&ns_b),
        &["--incoming", "tcp:10.213.0.2:7400", "--memory", "256M"],
        &dir,
        "dest",
        true,
    );
    let mut source = Vm::start_in(
        Some(&ns_a),
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            "mib=32",
            "--memory",
            "256M",
        ],
        &dir,
        "source",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&source.output()) >= 2,
        "source progress",
    );
    let before = last_pass(&source.output());
    let run = source.ctl(&["migrate", "tcp:10.213.0.2:7400"]);
    run.expect_status(0).expect_stdout("downtime");
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0));
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > before,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
    sh(&cleanup);
}

/// Warm migration (what an accelerator without dirty tracking, such as upstream bhyve, can
/// do): the guest is paused from the first page to the hand-over, and continues intact.
#[test]
fn warm_migration_pauses_copies_and_resumes_on_the_destination() {
    let dir = scratch("warm");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        true,
    );
    let mut source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    let before = last_pass(&source.output());
    let run = source.ctl(&["--json", "migrate", "--warm", &listen]);
    run.expect_status(0);
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    let report = &reply["report"];
    // Nothing is re-sent: everything went while the guest was paused.
    let resent: u64 = report["rounds"].as_array().unwrap()[1..]
        .iter()
        .map(|r| r["pages_sent"].as_u64().unwrap())
        .sum();
    assert_eq!(resent, 0, "{report}");
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0));
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > before,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
}

/// `ferrovm ctl` against a socket, from any thread.
fn ctl_at(socket: &Path, args: &[&str]) -> Run {
    let s = socket.to_str().unwrap();
    let mut all = vec!["ctl", "--api-socket", s];
    all.extend_from_slice(args);
    ferrovm(&all, Duration::from_secs(300))
}

fn json_of(run: &Run) -> serde_json::Value {
    serde_json::from_str(run.stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", run.stdout, run.stderr))
}

/// Waits until `status` reports `operation`; false if `done` says it ended first.
fn wait_for_operation(vm: &Vm, operation: &str, mut done: impl FnMut() -> bool) -> bool {
    loop {
        let status = json_of(&vm.ctl(&["--json", "status"]));
        if status["operation"] == operation {
            return true;
        }
        if done() {
            return false;
        }
    }
}

/// Every state change is refused while a snapshot is written (a `resume` used to un-pause
/// the guest under it, so that the file failed its checksums at restore; a `pause` replied
/// "paused" and the guest ran again when the snapshot ended); the snapshot restores intact.
#[test]
fn state_changes_during_a_snapshot_are_refused() {
    let dir = scratch("snaprace");
    let source = start_dirty_source(&dir, &["--memory", "512M"], 256);
    let snap = dir.join("vm.snap");
    let (socket, file) = (source.socket.clone().unwrap(), snap.clone());
    let writer = std::thread::spawn(move || {
        ctl_at(&socket, &["--json", "snapshot", file.to_str().unwrap()])
    });
    assert!(
        wait_for_operation(&source, "snapshot", || writer.is_finished()),
        "the snapshot ended before status showed it"
    );
    for request in [&["resume"][..], &["pause"], &["shutdown"]] {
        let run = source.ctl(request);
        assert_eq!(run.status, Some(2), "{request:?} was not refused");
        assert!(
            run.stderr.contains("a snapshot is in progress"),
            "{request:?}: {}",
            run.stderr
        );
    }
    writer.join().unwrap().expect_status(0);
    let status = json_of(&source.ctl(&["--json", "status"]));
    assert_eq!(status["state"], "running", "{status}");
    source.ctl(&["shutdown"]).expect_status(0);
    drop(source);

    let restored = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "restored",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&restored.output()) >= 2,
        "the restored guest's progress",
    );
    assert_intact(&restored.output());
    restored.ctl(&["shutdown"]).expect_status(0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A warm migration pauses the guest for its whole copy: a `resume` then is refused (it
/// used to un-pause the guest mid-copy).
#[test]
fn resume_during_a_warm_migration_is_refused() {
    let dir = scratch("warmrace");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--memory", "512M"],
        &dir,
        "dest",
        true,
    );
    let mut source = start_dirty_source(&dir, &["--memory", "512M"], 128);
    let socket = source.socket.clone().unwrap();
    let target = listen.clone();
    let migration = std::thread::spawn(move || {
        // Slow enough for the requests below to land during the copy.
        ctl_at(
            &socket,
            &["migrate", "--warm", &target, "--max-bandwidth", "100000000"],
        )
    });
    assert!(
        wait_for_operation(&source, "migration", || migration.is_finished()),
        "the migration ended before status showed it"
    );
    let run = source.ctl(&["resume"]);
    assert_eq!(run.status, Some(2), "resume was not refused");
    assert!(
        run.stderr.contains("a migration is in progress"),
        "{}",
        run.stderr
    );
    migration.join().unwrap().expect_status(0);
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0));
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) >= 1,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
}

/// A paused guest is snapshotted and migrated paused: it stays paused here after the
/// snapshot and after a failed migration, and on the destination after a successful one.
#[test]
fn a_paused_guest_is_snapshotted_and_migrated_and_stays_paused() {
    let dir = scratch("paused");
    let source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    source.ctl(&["pause"]).expect_status(0);
    let at_pause = last_pass(&source.output());
    let snap = dir.join("vm.snap");
    source
        .ctl(&["snapshot", snap.to_str().unwrap()])
        .expect_status(0);
    assert_eq!(
        json_of(&source.ctl(&["--json", "status"]))["state"],
        "paused"
    );

    // A destination that refuses (another memory size): the guest stays paused.
    let mut wrong = Vm::start(
        &["--incoming", "tcp:127.0.0.1:0", "--memory", "512M"],
        &dir,
        "wrong",
        false,
    );
    let listen = format!("tcp:127.0.0.1:{}", listening_port(&mut wrong));
    let run = source.ctl(&["migrate", &listen]);
    assert_eq!(run.status, Some(2), "{}", run.stdout);
    assert!(run.stderr.contains("stays paused"), "{}", run.stderr);
    assert_eq!(
        json_of(&source.ctl(&["--json", "status"]))["state"],
        "paused"
    );
    drop(wrong);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        last_pass(&source.output()),
        at_pause,
        "the paused guest ran"
    );

    // A live migration of the paused guest: it arrives paused and runs once resumed there.
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        true,
    );
    let mut source = source;
    source.ctl(&["migrate", &listen]).expect_status(0);
    let (status, err) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0), "{err}");
    assert_eq!(json_of(&dest.ctl(&["--json", "status"]))["state"], "paused");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        last_pass(&dest.output()) == 0,
        "the destination ran the paused guest"
    );
    dest.ctl(&["resume"]).expect_status(0);
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > at_pause,
        "the migrated guest's progress once resumed",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);

    // The snapshot of the paused guest restores and runs.
    let restored = Vm::start(
        &["--restore", snap.to_str().unwrap()],
        &dir,
        "restored",
        true,
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&restored.output()) > at_pause,
        "the restored guest's progress",
    );
    assert_intact(&restored.output());
    restored.ctl(&["shutdown"]).expect_status(0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM while a snapshot is written: the hidden temporary file (as large as the guest's
/// touched memory) is removed, not left behind.
#[test]
fn sigterm_during_a_snapshot_leaves_no_temporary_file() {
    let dir = scratch("snapterm");
    let mut source = start_dirty_source(&dir, &["--memory", "512M"], 256);
    let snap = dir.join("vm.snap");
    let (socket, file) = (source.socket.clone().unwrap(), snap.clone());
    let writer = std::thread::spawn(move || {
        ctl_at(&socket, &["--json", "snapshot", file.to_str().unwrap()])
    });
    assert!(
        wait_for_operation(&source, "snapshot", || writer.is_finished()),
        "the snapshot ended before status showed it"
    );
    // SAFETY: signalling our own child, not reaped yet.
    unsafe { libc::kill(source.child.id() as i32, libc::SIGTERM) };
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(128 + libc::SIGTERM));
    let _ = writer.join();
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The "listening on HOST:PORT" line of a destination started with port 0.
fn listening_port(vm: &mut Vm) -> u16 {
    vm.listening_port()
}

/// A destination waiting with `--incoming tcp:127.0.0.1:0` says which port it got, and
/// connections that close at once or send garbage are logged and the wait goes on (one used
/// to end the destination); then a real migration arrives.
#[test]
fn stray_connections_do_not_end_the_waiting_destination() {
    let dir = scratch("stray");
    let mut dest = Vm::start(
        &["--incoming", "tcp:127.0.0.1:0", "--memory", "256M"],
        &dir,
        "dest",
        true,
    );
    let port = listening_port(&mut dest);
    drop(TcpStream::connect(("127.0.0.1", port)).unwrap());
    let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.0\r\nHost: localhost\r\nAccept: */*\r\n\r\n")
        .unwrap();
    let mut reply = Vec::new();
    let _ = garbage.read_to_end(&mut reply);
    drop(garbage);
    // One that says nothing at all.
    let silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(dest.running(), "a stray connection ended the destination");

    let mut source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    let before = last_pass(&source.output());
    let listen = format!("tcp:127.0.0.1:{port}");
    source.ctl(&["migrate", &listen]).expect_status(0);
    drop(silent);
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0));
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > before,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
}

/// A fake destination whose refusal carries terminal escape codes: `ctl` prints them
/// escaped (they used to reach the terminal raw).
#[test]
fn a_peers_escape_codes_never_reach_the_terminal() {
    let dir = scratch("escapes");
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    let refuser = std::thread::spawn(move || {
        let (mut conn, _) = fake.accept().unwrap();
        // Header and Config arrive first; then the refusal, as the reply channel carries it.
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf);
        let frame = migration::encode_frame(&migration::Frame::Error(
            "no\u{1b}[2J\u{1b}]0;owned\u{7}".into(),
        ))
        .unwrap();
        conn.write_all(&frame).unwrap();
        let _ = conn.read(&mut buf);
    });
    let source = start_dirty_source(&dir, &["--memory", "64M"], 8);
    let run = source.ctl(&["migrate", &format!("tcp:127.0.0.1:{port}")]);
    assert_eq!(run.status, Some(2));
    assert!(!run.stderr.contains('\u{1b}'), "{:?}", run.stderr);
    assert!(run.stderr.contains("no\\u{1b}[2J"), "{}", run.stderr);
    refuser.join().unwrap();
    source.ctl(&["shutdown"]).expect_status(0);
}

/// Ctrl-C on `ctl migrate` cancels the migration: the guest runs on here. And
/// `ctl migrate-cancel` stops a migration of a paused guest, which stays paused.
#[test]
fn a_migration_is_cancelled_and_the_guest_is_left_as_it_was() {
    let dir = scratch("cancel");
    let mut dests = Vec::new();
    let mut start_dest = |name: &str| {
        let port = free_port();
        let listen = format!("tcp:127.0.0.1:{port}");
        // With an API socket, which start waits for: the destination listens by then.
        dests.push(Vm::start(
            &["--incoming", &listen, "--memory", "256M"],
            &dir,
            name,
            true,
        ));
        listen
    };
    let source = start_dirty_source(&dir, &["--memory", "256M"], 64);
    let socket = source.socket.clone().unwrap();
    let s = socket.to_str().unwrap().to_string();
    let listen = start_dest("dest1");
    let slow = ["--max-bandwidth", "4000000"];
    let args = [&["ctl", "--api-socket", &s, "migrate", &listen][..], &slow].concat();
    let run = ferrovm_with(&args, Duration::from_secs(120), |pid| {
        wait_until(
            Duration::from_secs(30),
            || !json_of(&source.ctl(&["--json", "status"]))["migration"].is_null(),
            "the migration's first progress report",
        );
        // SAFETY: pid is the ctl child, not reaped yet.
        unsafe { libc::kill(pid, libc::SIGINT) };
    });
    assert_eq!(run.status, Some(2), "{}", run.stdout);
    assert!(
        run.stderr
            .contains("cancelled (the guest keeps running here)"),
        "{}",
        run.stderr
    );
    assert_eq!(
        json_of(&source.ctl(&["--json", "status"]))["state"],
        "running"
    );
    let after = last_pass(&source.output());
    wait_until(
        Duration::from_secs(60),
        || last_pass(&source.output()) > after,
        "the source guest's progress after the cancelled migration",
    );

    source.ctl(&["pause"]).expect_status(0);
    let listen = start_dest("dest2");
    let migration =
        std::thread::spawn(move || ctl_at(&socket, &[&["migrate", &listen][..], &slow].concat()));
    assert!(
        wait_for_operation(&source, "migration", || migration.is_finished()),
        "the migration ended before status showed it"
    );
    source.ctl(&["migrate-cancel"]).expect_status(0);
    let run = migration.join().unwrap();
    assert!(
        run.stderr
            .contains("cancelled (the guest stays paused here)"),
        "{}",
        run.stderr
    );
    assert_eq!(
        json_of(&source.ctl(&["--json", "status"]))["state"],
        "paused"
    );
    source
        .ctl(&["migrate-cancel"])
        .expect_error("no migration is in progress");
    source.ctl(&["resume"]).expect_status(0);
    assert_intact(&source.output());
    source.ctl(&["shutdown"]).expect_status(0);
}

/// The final acknowledgement is lost: the destination runs the guest, so the source must not
/// (both used to run it). The source keeps it paused, says the outcome is unknown, and
/// resumes only when forced.
#[test]
fn a_lost_final_ack_never_lets_the_guest_run_twice() {
    let dir = scratch("lostack");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        true,
    );
    let source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    let relay = ack_swallowing_relay(port);
    let run = source.ctl(&["migrate", &format!("tcp:127.0.0.1:{relay}")]);
    assert_eq!(run.status, Some(2), "{}", run.stdout);
    assert!(
        run.stderr
            .contains("outcome unknown: the destination may be running the guest"),
        "{}",
        run.stderr
    );
    let status = json_of(&source.ctl(&["--json", "status"]));
    assert_eq!(status["state"], "migration-outcome-unknown", "{status}");
    source
        .ctl(&["status"])
        .expect_stdout("migration-outcome-unknown");
    let refused = source.ctl(&["resume"]);
    assert_eq!(refused.status, Some(2));
    assert!(refused.stderr.contains("--force"), "{}", refused.stderr);
    // The destination runs the guest; the source's copy stays still.
    let at_source = last_pass(&source.output());
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > at_source,
        "the destination's progress",
    );
    assert_eq!(last_pass(&source.output()), at_source, "the source ran too");
    assert_intact(&dest.output());
    // The operator decides: here, the source copy goes.
    source.ctl(&["shutdown"]).expect_status(0);
    dest.ctl(&["shutdown"]).expect_status(0);
}

/// `--restore` with options the snapshot decides: boot-only options are refused, and a shape
/// option must match the snapshot's machine, naming both values (they were ignored).
#[test]
fn restore_refuses_options_it_would_ignore() {
    let dir = scratch("restoreopts");
    let good = small_snapshot_file(&dir);
    let g = good.to_str().unwrap();
    let run = |extra: &[&str]| {
        let args = [&["run", "--restore", g, "--serial", "none"][..], extra].concat();
        ferrovm(&args, Duration::from_secs(60))
    };
    run(&["--cmdline", "x=1"]).expect_error("--cmdline cannot be used with --restore");
    let initrd = dir.join("initrd");
    std::fs::write(&initrd, b"initrd").unwrap();
    run(&["--initrd", initrd.to_str().unwrap()])
        .expect_error("--initrd cannot be used with --restore");
    run(&["--kernel", g]).expect_error("--kernel");
    run(&["--memory", "128M"])
        .expect_error("--memory 128M: the snapshot's machine has 64 MiB of RAM");
    run(&["--cpus", "2"]).expect_error("--cpus 2: the snapshot's machine has 1");
    run(&["--irqchip", "split"]).expect_error("--irqchip split: the snapshot's machine has kernel");
    // Matching values are fine.
    let mut vm = Vm::start(
        &[
            "--restore",
            g,
            "--memory",
            "64M",
            "--cpus",
            "1",
            "--irqchip",
            "kernel",
        ],
        &dir,
        "matching",
        false,
    );
    wait_until(
        Duration::from_secs(30),
        || vm.output().contains(" ok"),
        "a tick of the restored guest",
    );
    assert!(vm.running());
    let _ = std::fs::remove_dir_all(&dir);
}

// Post-copy

/// Migrates a dirtying guest with post-copy `options` and checks that it goes on intact on
/// the destination, with the post-copy figures reported.
fn post_copy_on_loopback(cpus: &str, options: &[&str]) {
    post_copy_of(cpus, options, &dirty_guest(32));
}

/// Restoring KVM's wall clock MSR makes KVM write the page it names, before the guest
/// runs: the destination asks for that page while the source waits for its reply, and
/// gets it (the source used to answer requests only after the reply, and both waited until
/// the migration failed with its outcome unknown; found with Linux's kvmclock).
#[test]
fn post_copy_when_applying_the_state_needs_a_page() {
    post_copy_of(
        "1",
        &["--post-copy"],
        &format!("{} wallclock=1", dirty_guest(32)),
    );
}

fn post_copy_of(cpus: &str, options: &[&str], guest_cmdline: &str) {
    let dir = scratch(&format!(
        "postcopy-{cpus}-{}-{}",
        options.join(""),
        guest_cmdline.len()
    ));
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let shape = ["--memory", "256M", "--cpus", cpus];
    let mut dest_args = vec!["--incoming", &listen];
    dest_args.extend_from_slice(&shape);
    let mut dest = Vm::start(&dest_args, &dir, "dest", true);
    let mut source = start_dirty_source_with(&dir, &shape, guest_cmdline);
    let before = last_pass(&source.output());
    let mut args = vec!["--json", "migrate", &listen];
    args.extend_from_slice(options);
    let run = source.ctl(&args);
    run.expect_status(0);
    assert!(
        run.stderr.contains("the guest is lost"),
        "the risk is stated: {}",
        run.stderr
    );
    let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    let report = &reply["report"];
    let pc = &report["postcopy"];
    assert!(pc.is_object(), "no post-copy figures: {report}");
    let missing = pc["missing_pages"].as_u64().unwrap();
    let demand = pc["pages_on_demand"].as_u64().unwrap();
    let streamed = pc["pages_streamed"].as_u64().unwrap();
    assert_eq!(demand + streamed, missing, "{pc}");
    assert!(missing > 0, "{pc}");
    assert_eq!(report["stop_reason"], "Postcopy", "{report}");
    eprintln!(
        "post-copy {cpus} vCPU {options:?}: total {} ms, downtime {} ms, residency {} ms, \
         {demand} pages on demand, {streamed} streamed",
        report["total_ms"], report["downtime_ms"], pc["time_to_residency_ms"]
    );
    let (status, _) = source.wait(Duration::from_secs(30));
    assert_eq!(
        status,
        Some(0),
        "the source exits 0 once every page is over"
    );
    wait_until(
        Duration::from_secs(60),
        || last_pass(&dest.output()) > before + 2,
        "the migrated guest's progress",
    );
    assert_intact(&dest.output());
    dest.ctl(&["shutdown"]).expect_status(0);
    let (status, err) = dest.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0), "{err}");
}

#[test]
fn post_copy_at_once_1_vcpu() {
    post_copy_on_loopback("1", &["--post-copy"]);
}

#[test]
fn post_copy_at_once_2_vcpus() {
    post_copy_on_loopback("2", &["--post-copy"]);
}

#[test]
fn post_copy_after_2_rounds_1_vcpu() {
    post_copy_on_loopback("1", &["--post-copy-after-rounds", "2"]);
}

#[test]
fn post_copy_after_2_rounds_2_vcpus() {
    post_copy_on_loopback("2", &["--post-copy-after-rounds", "2"]);
}

#[test]
fn post_copy_cut_before_the_switch_leaves_the_source_running() {
    // Round 0 takes seconds at 20 MB/s: the cut comes long before the switch. Without
    // compression: the dirtying guest's pages compress so well that a compressed stream
    // could end below the cut and the migration succeed.
    failed_migration_over(
        "postcopy-cut-before",
        "256M",
        Some((Fault::CutAfter(3 << 20), 0)),
        None,
        &[
            "--post-copy-after-rounds",
            "2",
            "--connections",
            "1",
            "--compress",
            "none",
        ],
    );
}

/// Lines of `text` that say the guest is lost.
fn loss_lines(text: &str) -> usize {
    text.lines()
        .filter(|l| l.contains("the guest is lost"))
        .count()
}

#[test]
fn post_copy_cut_after_the_switch_loses_the_guest_on_both_sides_in_one_line() {
    let dir = scratch("postcopy-cut-after");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let mut dest = Vm::start(
        &["--incoming", &listen, "--memory", "256M"],
        &dir,
        "dest",
        false,
    );
    let mut source = start_dirty_source(&dir, &["--memory", "256M"], 32);
    // With one connection, the post-copy connection is the relay's second: cut it after
    // 2 MiB of pages, with the guest running on the destination.
    let relay = relay_nth(Fault::CutAfter(2 << 20), 1, port);
    let target = format!("tcp:127.0.0.1:{relay}");
    let started = Instant::now();
    let run = source.ctl(&[
        "migrate",
        &target,
        "--post-copy",
        "--connections",
        "1",
        "--max-bandwidth",
        "20000000",
    ]);
    assert_eq!(
        run.status,
        Some(2),
        "the migration must fail:\n{}",
        run.stdout
    );
    assert!(run.stderr.contains("the guest is lost"), "{}", run.stderr);
    let (src_status, src_err) = source.wait(Duration::from_secs(30));
    let (dst_status, dst_err) = dest.wait(Duration::from_secs(30));
    eprintln!("source: {src_err}\ndestination: {dst_err}");
    assert!(started.elapsed() < Duration::from_secs(60), "no hang");
    assert_ne!(src_status, Some(0), "the source stops: {src_err}");
    assert_ne!(dst_status, Some(0), "the destination stops: {dst_err}");
    assert_eq!(loss_lines(&src_err), 1, "one line on the source: {src_err}");
    assert_eq!(
        loss_lines(&dst_err),
        1,
        "one line on the destination: {dst_err}"
    );
}

/// A dirtying guest of 256 MiB in a memfd.
fn memfd_source(dir: &Path) -> Vm {
    start_dirty_source(dir, &["--memory", "256M", "--memory-backend", "memfd"], 32)
}

/// A local update's destination: `--incoming unix:PATH` with the source's shape.
fn local_destination(dir: &Path, name: &str, memory: &str) -> (Vm, String) {
    let url = format!("unix:{}", dir.join(format!("{name}.update")).display());
    let dest = Vm::start(&["--incoming", &url, "--memory", memory], dir, name, true);
    (dest, url)
}

/// After an update: the old process exited 0 and the guest goes on, intact, in the new one
/// (past pass `before`).
fn took_over(old: &mut Vm, new: &Vm, before: u64) {
    let (status, err) = old.wait(Duration::from_secs(30));
    assert_eq!(status, Some(0), "the old process exits 0: {err}");
    wait_until(
        Duration::from_secs(60),
        || last_pass(&new.output()) > before,
        "the updated guest's progress",
    );
    assert_intact(&new.output());
}

/// Local updates, one after the other: each new process maps the guest RAM the previous one
/// handed over (no page is sent), the old one exits 0, and the guest keeps checking every
/// page it wrote.
#[test]
fn local_update_10_times_in_a_row() {
    let dir = scratch("local-10");
    let mut current = memfd_source(&dir);
    for i in 0..10 {
        let (dest, url) = local_destination(&dir, &format!("gen{i}"), "256M");
        let before = last_pass(&current.output());
        let run = current.ctl(&["--json", "migrate", &url]);
        run.expect_status(0);
        let reply: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
        let report = &reply["report"];
        assert_eq!(
            report["pages_total"], 0,
            "a local update copies no page: {report}"
        );
        assert_eq!(report["rounds"].as_array().unwrap().len(), 0, "{report}");
        eprintln!(
            "local update {i}: total {} ms, downtime {} ms, {} bytes",
            report["total_ms"], report["downtime_ms"], report["bytes_total"]
        );
        took_over(&mut current, &dest, before);
        current = dest;
    }
    let passes = last_pass(&current.output());
    wait_until(
        Duration::from_secs(60),
        || last_pass(&current.output()) >= passes + 2,
        "progress after the last update",
    );
    assert_intact(&current.output());
    current.ctl(&["shutdown"]).expect_status(0);
}

/// The source's migration failed with the guest running on, intact.
fn assert_source_runs_on(source: &mut Vm, run: &Run) {
    assert_eq!(run.status, Some(2), "the update must fail:\n{}", run.stdout);
    assert!(
        source.running(),
        "the source VMM exited: {}",
        source.errors()
    );
    assert!(
        run.stderr.contains("keeps running") && run.stderr.trim().lines().count() == 1,
        "one line saying the guest runs on: {}",
        run.stderr
    );
    let after = last_pass(&source.output());
    wait_until(
        Duration::from_secs(60),
        || last_pass(&source.output()) >= after + 2,
        "the source guest to make progress after the failed update",
    );
    assert_intact(&source.output());
}

/// The new process is killed (SIGKILL) while the update is in flight: it was stopped before
/// it could accept, so the source has handed guest RAM over and waits for it. The old
/// process runs the guest on, and a second update (to a new process) then succeeds.
#[test]
fn local_update_destination_killed_mid_transfer() {
    let dir = scratch("local-killed");
    let mut source = memfd_source(&dir);
    let (mut dest, url) = local_destination(&dir, "victim", "256M");
    let pid = dest.child.id() as i32;
    // SAFETY: pid is the destination child, still owned (not reaped) by `dest`.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let run = source.ctl(&["migrate", &url]);
    killer.join().unwrap();
    let _ = dest.wait(Duration::from_secs(10));
    eprintln!("killed destination: source: {}", run.stderr.trim());
    assert_source_runs_on(&mut source, &run);

    let (next, url) = local_destination(&dir, "next", "256M");
    let before = last_pass(&source.output());
    source.ctl(&["migrate", &url]).expect_status(0);
    took_over(&mut source, &next, before);
    next.ctl(&["shutdown"]).expect_status(0);
}

/// What a local update refuses, each with one line and the guest running on: anonymous guest
/// RAM (nothing to hand over), and a destination of another memory size (it refuses the
/// hand-off and goes on waiting).
#[test]
fn local_update_refusals_leave_the_guest_running() {
    let dir = scratch("local-refused");
    let mut anon = start_dirty_source(&dir, &["--memory", "256M"], 32);
    let (_dest, url) = local_destination(&dir, "for-anon", "256M");
    let run = anon.ctl(&["migrate", &url]);
    assert!(
        run.stderr.contains("--memory-backend memfd"),
        "{}",
        run.stderr
    );
    assert_source_runs_on(&mut anon, &run);
    anon.ctl(&["shutdown"]).expect_status(0);

    let dir = scratch("local-refused-size");
    let mut source = memfd_source(&dir);
    let (mut wrong, url) = local_destination(&dir, "wrong", "512M");
    let run = source.ctl(&["migrate", &url]);
    assert!(run.stderr.contains("--memory"), "{}", run.stderr);
    assert_source_runs_on(&mut source, &run);
    assert!(
        wrong.running(),
        "the refusing destination waits on: {}",
        wrong.errors()
    );
    source.ctl(&["shutdown"]).expect_status(0);
}
