//! `ferrovm ctl`: one request to a running ferrovm over its API socket.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::cli::{CtlArgs, CtlRequest};

pub fn run(args: &CtlArgs) -> anyhow::Result<u8> {
    let request = match &args.request {
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
        } => json!({
            "op": "migrate",
            "destination": destination,
            "max_bandwidth": max_bandwidth,
            "downtime_ms": downtime_ms,
            "max_rounds": max_rounds,
            "max_time_s": max_time_s,
            "auto_converge": auto_converge,
            "warm": warm,
        }),
    };
    let socket = &args.api_socket;
    let mut stream = UnixStream::connect(socket)
        .with_context(|| format!("--api-socket {}: cannot connect", socket.display()))?;
    writeln!(stream, "{request}").context("sending the request")?;
    let reader = BufReader::new(stream);
    let mut progress_shown = false;
    for line in reader.lines() {
        let line = line.context("reading the reply")?;
        let value: Value = serde_json::from_str(&line).context("malformed reply")?;
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
        if value["ok"] != json!(true) {
            let message = value["error"].as_str().unwrap_or("request failed");
            if args.json {
                println!("{value}");
            }
            bail!("{message}");
        }
        if args.json {
            println!("{value}");
        } else {
            print_human(&args.request, &value);
        }
        return Ok(0);
    }
    bail!("the VMM closed the connection without a reply")
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
            println!("state:   {}", v["state"].as_str().unwrap_or("?"));
            if let Some(op) = v["operation"].as_str() {
                println!("busy:    {op} in progress");
            }
            println!("vCPUs:   {}", v["vcpus"]);
            println!(
                "memory:  {} MiB",
                v["memory_bytes"].as_u64().unwrap_or(0) >> 20
            );
            println!("irqchip: {}", v["irqchip"].as_str().unwrap_or("?"));
            if let Some(m) = v.get("migration").filter(|m| !m.is_null()) {
                println!("migration: {m}");
            }
        }
        CtlRequest::Migrate { .. } => crate::report::print_migration(v),
        CtlRequest::MigrateCancel => println!("migration cancelled"),
        _ => println!("{}", v["state"].as_str().unwrap_or("ok")),
    }
}
