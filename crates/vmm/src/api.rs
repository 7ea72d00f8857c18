//! The control API: JSON lines over a Unix socket (protocol in docs/api.md).
//!
//! One request per line, one reply per line. Long requests (migrate) may send `progress`
//! lines before their final reply. Each connection is served on its own thread, so `status`
//! answers while a migration runs.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use devices::exit::{ExitReason, ExitRequest};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::runstate::{MigrationCancel, RunState, Supervisor};

/// What a request may ask of the machine beyond pausing it.
pub trait MachineOps: Send + Sync {
    /// Writes a snapshot of the machine to `path`. `paused`: the guest is paused already
    /// (and stays so); otherwise it is paused for the snapshot and runs again after.
    fn snapshot(&self, path: &Path, paused: bool) -> Result<Value>;
    /// Migrates the machine; `progress` receives one JSON object per update; `cancel` stops
    /// it. `paused`: the guest is paused already, and stays paused here on failure (and on the
    /// destination). On success the guest stays paused here and the caller ends this copy of
    /// the machine ([`ExitReason::Migrated`]) once the reply is on its way.
    fn migrate(
        &self,
        request: &MigrateRequest,
        paused: bool,
        cancel: &MigrationCancel,
        progress: &mut dyn FnMut(Value),
    ) -> Result<Value>;
}

#[derive(Debug, Clone, Deserialize)]
pub struct MigrateRequest {
    pub destination: String,
    #[serde(default)]
    pub max_bandwidth: Option<u64>,
    #[serde(default)]
    pub downtime_ms: Option<u64>,
    #[serde(default)]
    pub max_rounds: Option<u32>,
    #[serde(default)]
    pub max_time_s: Option<u64>,
    #[serde(default)]
    pub auto_converge: bool,
    /// Pause first, copy everything, resume on the destination (no dirty tracking needed).
    #[serde(default)]
    pub warm: bool,
    /// TCP connections to stripe the pages over (1 to 16; default: the host's CPUs, at most
    /// 4). A destination of a build without data connections needs 1.
    #[serde(default)]
    pub connections: Option<u32>,
    /// Compression of page data: "auto" (default: on while the link is slower than
    /// compressing), "none", "lz4" or "zstd".
    #[serde(default)]
    pub compress: Option<String>,
}

/// One control request, as [`parse_request`] reads it.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    Pause,
    Resume {
        /// Resume even though the last migration's outcome is unknown.
        #[serde(default)]
        force: bool,
    },
    Shutdown,
    Snapshot {
        path: PathBuf,
    },
    Migrate(MigrateRequest),
    MigrateCancel,
}

/// Parses one request line (untrusted bytes from the socket; no I/O, so it can be fuzzed).
pub fn parse_request(line: &[u8]) -> Result<Request> {
    serde_json::from_slice(line).map_err(|e| Error::Control(format!("bad request: {e}")))
}

/// What the API reports about the machine.
pub struct MachineInfo {
    pub vcpus: u32,
    pub memory: u64,
    pub irqchip: &'static str,
}

pub struct Api {
    pub supervisor: Arc<Supervisor>,
    pub exit: Arc<ExitRequest>,
    pub info: MachineInfo,
    /// The last progress report of a migration in flight.
    pub migration: Mutex<Option<Value>>,
    /// The serial console's output queue, for the count of bytes dropped.
    pub serial: Option<Arc<devices::output::OutputQueue>>,
}

impl Api {
    pub fn new(supervisor: Arc<Supervisor>, exit: Arc<ExitRequest>, info: MachineInfo) -> Self {
        Api {
            supervisor,
            exit,
            info,
            migration: Mutex::new(None),
            serial: None,
        }
    }

    fn status(&self) -> Value {
        let (state, busy) = self.supervisor.status();
        let state = if self.exit.is_requested() {
            RunState::Stopping
        } else {
            state
        };
        json!({
            "ok": true,
            "state": state.name(),
            "operation": busy.map(|op| op.name()),
            "vcpus": self.info.vcpus,
            "memory_bytes": self.info.memory,
            "irqchip": self.info.irqchip,
            "migration": self.migration.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            "serial_dropped_bytes": self.serial.as_ref().map_or(0, |q| q.dropped()),
        })
    }

    fn state_reply(state: RunState) -> Value {
        json!({"ok": true, "state": state.name()})
    }

    /// Serves one request: the reply, and the exit to request once the reply has been
    /// written (so that the client hears about it before the process ends).
    fn handle(&self, line: &str, stream: &mut UnixStream) -> (Value, Option<ExitReason>) {
        let request = match parse_request(line.as_bytes()) {
            Ok(r) => r,
            Err(e) => return (error_reply(&e.to_string()), None),
        };
        let mut then_exit = None;
        let sup = &self.supervisor;
        let result = match request {
            Request::Status => return (self.status(), None),
            Request::Pause => sup.pause().map(Self::state_reply),
            Request::Resume { force } => sup.resume(force).map(Self::state_reply),
            Request::Shutdown => sup.shutdown().map(|()| {
                then_exit = Some(ExitReason::PowerOff);
                Self::state_reply(RunState::Stopping)
            }),
            Request::Snapshot { path } => {
                on_migration_thread(sup, move |sup, _| sup.snapshot(&path), |_| {})
            }
            Request::MigrateCancel => sup
                .cancel_migration()
                .map(|()| json!({"ok": true, "cancelled": true})),
            Request::Migrate(req) => {
                let mut progress = |p: Value| {
                    *self.migration.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
                    let _ = writeln!(stream, "{}", json!({"progress": p}));
                };
                let result = on_migration_thread(
                    sup,
                    move |sup, progress| sup.migrate(&req, progress),
                    &mut progress,
                );
                *self.migration.lock().unwrap_or_else(|e| e.into_inner()) = None;
                if result.is_ok() {
                    // The destination runs the guest now: this copy must never run
                    // again (its vCPUs stay paused until the process ends).
                    then_exit = Some(ExitReason::Migrated);
                }
                result
            }
        };
        let reply = match result {
            Ok(v) => v,
            // Refused for the machine's state (HTTP's 409), not failed: nothing happened.
            Err(e @ Error::Conflict(_)) => {
                json!({"ok": false, "error": e.to_string(), "conflict": true})
            }
            Err(e) => error_reply(&e.to_string()),
        };
        (reply, then_exit)
    }
}

/// What the migration thread sends back to the API thread that started it.
enum Step {
    Progress(Value),
    Done(Result<Value>),
}

/// Runs a snapshot or a migration on a thread of its own (role `migration`): the API threads,
/// which parse what clients send, are then not allowed the file and network calls it makes.
/// Its progress reports come back here, to `progress`, which writes them to the client.
fn on_migration_thread(
    supervisor: &Arc<Supervisor>,
    work: impl FnOnce(&Supervisor, &mut dyn FnMut(Value)) -> Result<Value> + Send + 'static,
    mut progress: impl FnMut(Value),
) -> Result<Value> {
    let (tx, steps) = std::sync::mpsc::channel();
    let sup = supervisor.clone();
    sandbox::spawn(sandbox::Role::Migration, "migration", move || {
        let reports = tx.clone();
        let mut report = move |p: Value| {
            let _ = reports.send(Step::Progress(p));
        };
        let result = work(&sup, &mut report);
        let _ = tx.send(Step::Done(result));
    })
    .map_err(|e| Error::Control(format!("cannot start the migration thread: {e}")))?;
    for step in steps {
        match step {
            Step::Progress(p) => progress(p),
            Step::Done(result) => return result,
        }
    }
    Err(Error::Control(
        "the migration thread ended without a result".into(),
    ))
}

fn error_reply(message: &str) -> Value {
    json!({"ok": false, "error": message})
}

/// Serves the API until the process exits.
pub fn serve(listener: UnixListener, api: Arc<Api>) -> std::io::Result<()> {
    sandbox::spawn(sandbox::Role::Api, "api", move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let api = api.clone();
            let _ = sandbox::spawn(sandbox::Role::Api, "api-conn", move || {
                serve_connection(stream, &api)
            });
        }
    })?;
    Ok(())
}

/// Answers the first request of a client that may not use the API with the reason, and
/// closes the connection.
fn refuse_connection(mut stream: UnixStream, who: &str) {
    log::warn!("API: refused a connection from {who}");
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(1)));
    let mut line = String::new();
    let _ = BufReader::new((&stream).take(1 << 20)).read_line(&mut line);
    let reply = error_reply("permission denied: this API serves its own user and root only");
    let _ = writeln!(stream, "{reply}");
}

fn serve_connection(stream: UnixStream, api: &Api) {
    match crate::socket::peer_allowed(&stream) {
        Ok(true) => {}
        Ok(false) => return refuse_connection(stream, "another user"),
        Err(e) => return refuse_connection(stream, &format!("an unknown user ({e})")),
    }
    let Ok(reader_half) = stream.try_clone() else {
        return;
    };
    let mut writer = stream;
    // Bounded lines: a client cannot make the VMM buffer without limit.
    let mut reader = BufReader::new(reader_half.take(1 << 20));
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.trim().is_empty() {
            continue;
        }
        let (reply, then_exit) = api.handle(line.trim(), &mut writer);
        let written = writeln!(writer, "{reply}").and_then(|()| writer.flush());
        // Whether or not the client is still there to read it.
        if let Some(reason) = then_exit {
            api.exit.request(reason);
        }
        if written.is_err() {
            return;
        }
    }
}
