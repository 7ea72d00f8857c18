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
use serde_json::{json, Value};
use vmm::api::client::{call, Answer, ClientError};

use crate::cli::{CtlArgs, CtlRequest};

/// How often a migration's progress is asked for (and Ctrl-C looked at).
const POLL: Duration = Duration::from_millis(500);

/// The method, path and body of a request.
fn http_request(
    request: &CtlRequest,
) -> anyhow::Result<(&'static str, &'static str, Option<Value>)> {
    Ok(match request {
        CtlRequest::Status => ("GET", "/api/v1/vm.info", None),
        CtlRequest::Pause => ("PUT", "/api/v1/vm.pause", None),
        CtlRequest::Resume { force } => ("PUT", "/api/v1/vm.resume", Some(json!({"force": force}))),
        CtlRequest::MigrateCancel => ("PUT", "/api/v1/vm.migration-cancel", None),
        CtlRequest::Shutdown => ("PUT", "/api/v1/vm.shutdown", None),
        CtlRequest::Snapshot { file } => {
            // The VMM resolves the path in its own working directory: send it absolute.
            let path = std::path::absolute(file)
                .with_context(|| format!("snapshot {}", file.display()))?;
            let url = format!("file://{}", path.display());
            (
                "PUT",
                "/api/v1/vm.snapshot",
                Some(json!({"destination_url": url})),
            )
        }
        CtlRequest::Migrate {
            destination,
            max_bandwidth,
            downtime_ms,
            max_rounds,
            max_time_s,
            auto_converge,
            warm,
            connections,
            compress,
            post_copy,
            post_copy_after_rounds,
        } => (
            "PUT",
            "/api/v1/vm.send-migration",
            Some(json!({
                "destination_url": destination,
                "max_bandwidth": max_bandwidth,
                "downtime_ms": downtime_ms,
                "max_rounds": max_rounds,
                "max_time_s": max_time_s,
                "auto_converge": auto_converge,
                "warm": warm,
                "connections": connections,
                "compress": compress,
                "post_copy": post_copy,
                "post_copy_after_rounds": post_copy_after_rounds,
            })),
        ),
    })
}

fn send(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Option<Duration>,
) -> anyhow::Result<Answer> {
    call(socket, method, path, body, timeout).map_err(|e| match e {
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

pub fn run(args: &CtlArgs) -> anyhow::Result<u8> {
    let (method, path, body) = http_request(&args.request)?;
    let timeout = Duration::from_secs(args.timeout);
    let answer = if matches!(args.request, CtlRequest::Migrate { .. }) {
        migrate(args, path, body, timeout)?
    } else {
        send(&args.api_socket, method, path, body.as_ref(), Some(timeout))?
    };
    finish(args, &answer)
}

/// A migration: the request waits on a thread of its own while this one shows the progress
/// (asked on other connections), gives up when nothing moved for `timeout`, and asks the VMM
/// to cancel on Ctrl-C.
fn migrate(
    args: &CtlArgs,
    path: &'static str,
    body: Option<Value>,
    timeout: Duration,
) -> anyhow::Result<Answer> {
    interrupt::install()?;
    if let CtlRequest::Migrate {
        post_copy,
        post_copy_after_rounds,
        ..
    } = &args.request
    {
        if *post_copy || post_copy_after_rounds.is_some() {
            eprintln!(
                "post-copy: once the destination runs the guest, its memory is split between both \
                 hosts; if the link or either host fails before every page arrived, the guest \
                 is lost"
            );
        }
    }
    let socket = args.api_socket.clone();
    let (tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(send(&socket, "PUT", path, body.as_ref(), None));
    });
    let (mut last, mut last_change, mut shown) = (Value::Null, Instant::now(), false);
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
        let progress = send(
            &args.api_socket,
            "GET",
            "/api/v1/vm.migration-progress",
            None,
            Some(timeout),
        )
        .map(|a| a.body["progress"].clone())
        .unwrap_or(Value::Null);
        if progress != last {
            (last, last_change) = (progress, Instant::now());
            if !args.json && !last.is_null() {
                show_progress(&last);
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

/// Prints the final reply; fails with its error.
fn finish(args: &CtlArgs, answer: &Answer) -> anyhow::Result<u8> {
    if args.json {
        println!("{}", answer.body);
    }
    if !answer.is_success() {
        bail!("{}", printable(&answer.fault()));
    }
    if !args.json {
        print_human(&args.request, &answer.body);
    }
    Ok(0)
}

/// Ctrl-C during a migration: ask the VMM, on a second connection, to cancel it.
fn cancel_migration(socket: &Path, timeout: Duration) {
    eprintln!("\ncancelling the migration...");
    match send(
        socket,
        "PUT",
        "/api/v1/vm.migration-cancel",
        None,
        Some(timeout),
    ) {
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

fn text(v: &Value) -> String {
    printable(v.as_str().unwrap_or("?"))
}

fn show_progress(p: &Value) {
    let sent = p["bytes_sent"].as_u64().unwrap_or(0);
    let remaining = p["bytes_remaining"].as_u64().unwrap_or(0);
    let total = (sent + remaining).max(1);
    let width = 30;
    let filled = ((sent as f64 / total as f64) * width as f64) as usize;
    eprint!(
        "\r\x1b[K[{}{}] round {} sent {:.1} MiB, remaining {:.1} MiB, {:.1} MiB/s",
        "#".repeat(filled.min(width)),
        " ".repeat(width - filled.min(width)),
        p["round"].as_u64().unwrap_or(0),
        sent as f64 / 1048576.0,
        remaining as f64 / 1048576.0,
        p["bandwidth"].as_f64().unwrap_or(0.0) / 1048576.0,
    );
}

fn print_human(request: &CtlRequest, v: &Value) {
    match request {
        CtlRequest::Status => {
            println!("state:   {}", text(&v["state"]));
            if v["operation"].is_string() {
                println!("busy:    {} in progress", text(&v["operation"]));
            }
            println!("vCPUs:   {}", v["vcpus"]);
            println!(
                "memory:  {} MiB",
                v["memory_bytes"].as_u64().unwrap_or(0) >> 20
            );
            println!("irqchip: {}", text(&v["irqchip"]));
            let dropped = v["serial_dropped_bytes"].as_u64().unwrap_or(0);
            if dropped > 0 {
                println!("serial:  {dropped} bytes of output dropped (nobody read them)");
            }
            if let Some(counts) = v["instruction_completions"].as_object() {
                let list: Vec<String> = counts
                    .iter()
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect();
                if !list.is_empty() {
                    println!("completed: {}", printable(&list.join(", ")));
                }
            }
            if let Some(m) = v.get("migration").filter(|m| !m.is_null()) {
                println!("migration: {}", printable(&m.to_string()));
            }
        }
        CtlRequest::Migrate { .. } => crate::report::print_migration(v),
        CtlRequest::MigrateCancel => println!("migration cancelled"),
        CtlRequest::Snapshot { .. } => println!(
            "snapshot written: {} ({:.1} MiB of pages, guest paused {} ms)",
            text(&v["path"]),
            v["bytes"].as_u64().unwrap_or(0) as f64 / 1048576.0,
            v["paused_ms"].as_u64().unwrap_or(0),
        ),
        _ => {
            println!("{}", printable(v["state"].as_str().unwrap_or("ok")));
            if let Some(message) = v["message"].as_str() {
                println!("{}", printable(message));
            }
        }
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
