//! `ferrovm ctl`: one request to a running ferrovm over its API socket.
//!
//! Every wait has a limit (`--timeout`); a migration's wait is measured between progress
//! reports, so a long migration that makes progress is never cut off. Ctrl-C during
//! `migrate` asks the VMM to cancel the migration. Text from the VMM (which may come from a
//! migration peer) is printed with its control characters escaped.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::cli::{CtlArgs, CtlRequest};

/// How often the wait for a reply looks at Ctrl-C.
const POLL: Duration = Duration::from_millis(200);

fn request_json(request: &CtlRequest) -> anyhow::Result<Value> {
    Ok(match request {
        CtlRequest::Status => json!({"op": "status"}),
        CtlRequest::Pause => json!({"op": "pause"}),
        CtlRequest::Resume { force } => json!({"op": "resume", "force": force}),
        CtlRequest::MigrateCancel => json!({"op": "migrate_cancel"}),
        CtlRequest::Shutdown => json!({"op": "shutdown"}),
        CtlRequest::Snapshot { file } => {
            // The VMM resolves the path in its own working directory: send it absolute.
            let path = std::path::absolute(file)
                .with_context(|| format!("snapshot {}", file.display()))?;
            json!({"op": "snapshot", "path": path})
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
        } => json!({
            "op": "migrate",
            "destination": destination,
            "max_bandwidth": max_bandwidth,
            "downtime_ms": downtime_ms,
            "max_rounds": max_rounds,
            "max_time_s": max_time_s,
            "auto_converge": auto_converge,
            "warm": warm,
            "connections": connections,
            "compress": compress,
        }),
    })
}

fn connect(socket: &Path, timeout: Duration) -> anyhow::Result<UnixStream> {
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("--api-socket {}: cannot connect", socket.display()))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_read_timeout(Some(POLL.min(timeout)))?;
    Ok(stream)
}

pub fn run(args: &CtlArgs) -> anyhow::Result<u8> {
    let request = request_json(&args.request)?;
    let timeout = Duration::from_secs(args.timeout);
    let mut stream = connect(&args.api_socket, timeout)?;
    let migrating = matches!(args.request, CtlRequest::Migrate { .. });
    if migrating {
        interrupt::install()?;
    }
    writeln!(stream, "{request}").context("sending the request")?;
    let mut reader = BufReader::new(stream);
    let mut progress_shown = false;
    let mut line = String::new();
    let mut last_heard = Instant::now();
    loop {
        if migrating && interrupt::take() {
            cancel_migration(&args.api_socket, timeout);
        }
        match reader.read_line(&mut line) {
            Ok(0) => bail!("the VMM closed the connection without a reply"),
            Ok(_) if !line.ends_with('\n') => continue,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if last_heard.elapsed() >= timeout {
                    bail!(
                        "the VMM did not answer within {} s (the request may still complete: \
                         see `ctl status`; a longer wait: --timeout)",
                        timeout.as_secs()
                    );
                }
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("reading the reply"),
        }
        last_heard = Instant::now();
        let value: Value = serde_json::from_str(&line).context("malformed reply")?;
        line.clear();
        if let Some(progress) = value.get("progress") {
            if !args.json {
                show_progress(progress);
                progress_shown = true;
            }
            continue;
        }
        if progress_shown {
            eprintln!();
        }
        return finish(args, &value);
    }
}

/// Prints the final reply; fails with its error.
fn finish(args: &CtlArgs, value: &Value) -> anyhow::Result<u8> {
    if args.json {
        println!("{value}");
    }
    if value["ok"] != json!(true) {
        bail!(
            "{}",
            printable(value["error"].as_str().unwrap_or("request failed"))
        );
    }
    if !args.json {
        print_human(&args.request, value);
    }
    Ok(0)
}

/// Ctrl-C during a migration: ask the VMM, on a second connection, to cancel it.
fn cancel_migration(socket: &Path, timeout: Duration) {
    eprintln!("\ncancelling the migration...");
    let outcome = connect(socket, timeout).and_then(|mut s| {
        s.set_read_timeout(Some(timeout))?;
        writeln!(s, "{}", json!({"op": "migrate_cancel"}))?;
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply)?;
        Ok(serde_json::from_str::<Value>(&reply)?)
    });
    match outcome {
        Ok(v) if v["ok"] == json!(true) => {}
        Ok(v) => eprintln!(
            "cannot cancel: {}",
            printable(v["error"].as_str().unwrap_or("refused"))
        ),
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
            if let Some(m) = v.get("migration").filter(|m| !m.is_null()) {
                println!("migration: {}", printable(&m.to_string()));
            }
        }
        CtlRequest::Migrate { .. } => crate::report::print_migration(v),
        CtlRequest::MigrateCancel => println!("migration cancelled"),
        _ => println!("{}", printable(v["state"].as_str().unwrap_or("ok"))),
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
