//! `ferrovm ctl`: one HTTP request to a running ferrovm over its API socket (the
//! `/api/v1/` endpoints of docs/api.md, with the types the server uses).
//!
//! Every wait has a limit (`--timeout`); a migration's wait is measured between changes of
//! its progress (asked on other connections), so a long migration that makes progress is
//! never cut off. Ctrl-C during
//! `migrate` asks the VMM to cancel the migration. Text from the VMM (which may come from a
//! migration peer) is printed with its control characters escaped.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vmm::api::client::{self, Answer, ClientError};
use vmm::api::endpoints::{call, Call};
use vmm::api::types::{
    MigrateRequest, MigrationProgress, MigrationStatus, ResumeRequest, SnapshotReport,
    SnapshotRequest, StateReply, VmInfo,
};

use crate::cli::{CtlArgs, CtlRequest, MigrateArgs};

/// How often a migration's progress is asked for (and Ctrl-C looked at).
const POLL: Duration = Duration::from_millis(500);

pub fn run(args: &CtlArgs) -> anyhow::Result<u8> {
    match &args.request {
        CtlRequest::Status => exchange::<call::Info>(args, &(), print_status),
        CtlRequest::Pause => exchange::<call::Pause>(args, &(), print_state),
        CtlRequest::Resume { force } => {
            exchange::<call::Resume>(args, &ResumeRequest { force: *force }, print_state)
        }
        CtlRequest::MigrateCancel => {
            exchange::<call::MigrationCancel>(args, &(), |_| println!("migration cancelled"))
        }
        CtlRequest::Shutdown => exchange::<call::Shutdown>(args, &(), print_state),
        CtlRequest::Snapshot { file } => {
            // The VMM resolves the path in its own working directory: send it absolute.
            let path = std::path::absolute(file)
                .with_context(|| format!("snapshot {}", file.display()))?;
            let request = SnapshotRequest {
                destination_url: format!("file://{}", path.display()),
            };
            exchange::<call::Snapshot>(args, &request, print_snapshot)
        }
        CtlRequest::Migrate(options) => {
            let answer = migrate(args, migrate_request(options))?;
            finish::<call::SendMigration>(args, &answer, crate::report::print_migration)
        }
    }
}

/// The body of `vm.send-migration` from `ctl migrate`'s options.
fn migrate_request(m: &MigrateArgs) -> MigrateRequest {
    MigrateRequest {
        destination: m.destination.clone(),
        local: false,
        max_bandwidth: m.max_bandwidth,
        downtime_ms: m.downtime_ms,
        max_rounds: m.max_rounds,
        max_time_s: m.max_time_s,
        auto_converge: m.auto_converge,
        warm: m.warm,
        connections: m.connections,
        compress: m.compress.clone(),
        post_copy: m.post_copy,
        post_copy_after_rounds: m.post_copy_after_rounds,
    }
}

/// Sends one request to the endpoint `E`, prints its reply with `show`.
fn exchange<E: Call>(
    args: &CtlArgs,
    body: &E::Body,
    show: impl FnOnce(&E::Reply),
) -> anyhow::Result<u8> {
    let timeout = Duration::from_secs(args.timeout);
    let answer = send::<E>(&args.api_socket, body, Some(timeout))?;
    finish::<E>(args, &answer, show)
}

fn send<E: Call>(
    socket: &Path,
    body: &E::Body,
    timeout: Option<Duration>,
) -> anyhow::Result<Answer> {
    client::send::<E>(socket, body, timeout).map_err(|e| match e {
        ClientError::Connect(e) => {
            anyhow::anyhow!("--api-socket {}: cannot connect: {e}", socket.display())
        }
        ClientError::Timeout(t) => anyhow::anyhow!(
            "the VMM did not answer within {} s (the request may still complete: see \
             `ctl status`; a longer wait: --timeout)",
            t.as_secs()
        ),
        other => anyhow::anyhow!("{other}"),
    })
}

/// A migration: the request waits on a thread of its own while this one shows the progress
/// (asked on other connections), gives up when nothing moved for `--timeout`, and asks the
/// VMM to cancel on Ctrl-C.
fn migrate(args: &CtlArgs, request: MigrateRequest) -> anyhow::Result<Answer> {
    interrupt::install()?;
    if request.post_copy_rounds().is_some() {
        eprintln!(
            "post-copy: once the destination runs the guest, its memory is split between both \
             hosts; if the link or either host fails before every page arrived, the guest \
             is lost"
        );
    }
    let timeout = Duration::from_secs(args.timeout);
    let socket = args.api_socket.clone();
    let (tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(send::<call::SendMigration>(&socket, &request, None));
    });
    let (mut last, mut last_change, mut shown) = (None, Instant::now(), false);
    loop {
        match done.recv_timeout(POLL) {
            Ok(answer) => {
                if shown {
                    eprintln!();
                }
                return answer;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                bail!("the request ended without a reply")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if interrupt::take() {
            cancel_migration(&args.api_socket, timeout);
        }
        let progress = migration_progress(&args.api_socket, timeout);
        if progress != last {
            (last, last_change) = (progress, Instant::now());
            if let Some(p) = last.as_ref().filter(|_| !args.json) {
                show_progress(p);
                shown = true;
            }
        } else if last_change.elapsed() >= timeout {
            bail!(
                "the migration made no progress for {} s (it may still complete: see `ctl \
                 status`; a longer wait: --timeout)",
                timeout.as_secs()
            );
        }
    }
}

/// The last progress report of the migration in flight, if the VMM gives one.
fn migration_progress(socket: &Path, timeout: Duration) -> Option<MigrationProgress> {
    let answer = send::<call::MigrationProgress>(socket, &(), Some(timeout)).ok()?;
    let status: MigrationStatus = answer.decode().ok()?;
    status.progress
}

/// Prints the final reply of the endpoint `E`; fails with its error.
fn finish<E: Call>(
    args: &CtlArgs,
    answer: &Answer,
    show: impl FnOnce(&E::Reply),
) -> anyhow::Result<u8> {
    if args.json {
        println!("{}", answer.body);
    }
    if !answer.is_success() {
        bail!("{}", printable(&answer.fault()));
    }
    if !args.json {
        show(&answer.decode::<E::Reply>()?);
    }
    Ok(0)
}

/// Ctrl-C during a migration: ask the VMM, on a second connection, to cancel it.
fn cancel_migration(socket: &Path, timeout: Duration) {
    eprintln!("\ncancelling the migration...");
    match send::<call::MigrationCancel>(socket, &(), Some(timeout)) {
        Ok(a) if a.is_success() => {}
        Ok(a) => eprintln!("cannot cancel: {}", printable(&a.fault())),
        Err(e) => eprintln!("cannot cancel: {e}"),
    }
}

/// `text` with every control character escaped: replies may carry text from a migration
/// peer, which must not drive the terminal.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn show_progress(p: &MigrationProgress) {
    let total = (p.bytes_sent + p.bytes_remaining).max(1);
    let width = 30;
    let filled = ((p.bytes_sent as f64 / total as f64) * width as f64) as usize;
    eprint!(
        "\r\x1b[K[{}{}] round {} sent {:.1} MiB, remaining {:.1} MiB, {:.1} MiB/s",
        "#".repeat(filled.min(width)),
        " ".repeat(width - filled.min(width)),
        p.round,
        p.bytes_sent as f64 / 1048576.0,
        p.bytes_remaining as f64 / 1048576.0,
        p.bandwidth / 1048576.0,
    );
}

fn print_status(info: &VmInfo) {
    println!("state:   {}", printable(&info.state));
    if let Some(operation) = &info.operation {
        println!("busy:    {} in progress", printable(operation));
    }
    println!("vCPUs:   {}", info.vcpus);
    println!("memory:  {} MiB", info.memory_bytes >> 20);
    println!("irqchip: {}", printable(&info.irqchip));
    if info.serial_dropped_bytes > 0 {
        println!(
            "serial:  {} bytes of output dropped (nobody read them)",
            info.serial_dropped_bytes
        );
    }
    let completed: Vec<String> = (info.instruction_completions.iter())
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
    if !completed.is_empty() {
        println!("completed: {}", printable(&completed.join(", ")));
    }
    if let Some(m) = &info.migration {
        let figures = serde_json::to_string(m).unwrap_or_default();
        println!("migration: {}", printable(&figures));
    }
}

fn print_snapshot(report: &SnapshotReport) {
    println!(
        "snapshot written: {} ({:.1} MiB of pages, guest paused {} ms)",
        printable(&report.path),
        report.bytes as f64 / 1048576.0,
        report.paused_ms as u64,
    );
}

/// The reply of pause, resume and shutdown.
fn print_state(reply: &StateReply) {
    println!("{}", printable(&reply.state));
    if let Some(message) = &reply.message {
        println!("{}", printable(message));
    }
}

/// SIGINT as a flag the reply loop polls (only while `migrate` waits).
mod interrupt {
    use super::*;

    static INTERRUPTED: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_sigint(_: libc::c_int) {
        INTERRUPTED.store(true, Ordering::SeqCst);
    }

    pub fn install() -> anyhow::Result<()> {
        // SAFETY: an all-zero sigaction is a valid value to fill in; the handler only stores
        // to an atomic, which is async-signal-safe. No SA_RESTART: the read returns EINTR.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            let handler: extern "C" fn(libc::c_int) = on_sigint;
            action.sa_sigaction = handler as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("installing the Ctrl-C handler");
        }
        Ok(())
    }

    /// Whether Ctrl-C was pressed since the last call.
    pub fn take() -> bool {
        INTERRUPTED.swap(false, Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            printable("refused \u{1b}[2J\u{1b}]0;pwned\u{7}\r\nok é"),
            "refused \\u{1b}[2J\\u{1b}]0;pwned\\u{7}\\r\\nok é"
        );
    }
}
