//! The control API: JSON lines over a Unix socket (protocol in docs/api.md).
//!
//! One request per line, one reply per line. Long requests (migrate) may send `progress`
//! lines before their final reply. Each connection is served on its own thread, so `status`
//! answers while a migration runs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use devices::exit::{ExitReason, ExitRequest};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::control::RunControl;
use crate::error::{Error, Result};

/// How long a pause may take before the request fails (and the guest keeps running).
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a request may ask of the machine beyond pausing it.
pub trait MachineOps: Send + Sync {
    /// Writes a snapshot of the paused machine to `path`.
    fn snapshot(&self, path: &Path) -> Result<Value>;
    /// Migrates the machine; `progress` receives one JSON object per update. On success the
    /// guest stays paused here and the caller ends this copy of the machine
    /// ([`ExitReason::Migrated`]) once the reply is on its way.
    fn migrate(&self, request: &MigrateRequest, progress: &mut dyn FnMut(Value)) -> Result<Value>;
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
}

/// One control request, as [`parse_request`] reads it.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    Pause,
    Resume,
    Shutdown,
    Snapshot { path: PathBuf },
    Migrate(MigrateRequest),
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
    pub control: Arc<RunControl>,
    pub exit: Arc<ExitRequest>,
    pub info: MachineInfo,
    pub ops: Option<Arc<dyn MachineOps>>,
    /// The last progress report of a migration in flight.
    pub migration: Mutex<Option<Value>>,
    /// One snapshot or migration at a time.
    busy: AtomicBool,
}

impl Api {
    pub fn new(control: Arc<RunControl>, exit: Arc<ExitRequest>, info: MachineInfo) -> Self {
        Api {
            control,
            exit,
            info,
            ops: None,
            migration: Mutex::new(None),
            busy: AtomicBool::new(false),
        }
    }

    fn status(&self) -> Value {
        let state = if self.exit.is_requested() {
            "stopping"
        } else if self.control.is_paused() {
            "paused"
        } else {
            "running"
        };
        json!({
            "ok": true,
            "state": state,
            "vcpus": self.info.vcpus,
            "memory_bytes": self.info.memory,
            "irqchip": self.info.irqchip,
            "migration": self.migration.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        })
    }

    fn exclusive<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(Error::Control(
                "a snapshot or migration is already in progress".into(),
            ));
        }
        let result = work();
        self.busy.store(false, Ordering::Release);
        result
    }

    /// Serves one request: the reply, and the exit to request once the reply has been
    /// written (so that the client hears about it before the process ends).
    fn handle(&self, line: &str, stream: &mut UnixStream) -> (Value, Option<ExitReason>) {
        let request = match parse_request(line.as_bytes()) {
            Ok(r) => r,
            Err(e) => return (error_reply(&e.to_string()), None),
        };
        let mut then_exit = None;
        let result = match request {
            Request::Status => return (self.status(), None),
            Request::Pause => self
                .control
                .pause(PAUSE_TIMEOUT)
                .map(|_| json!({"ok": true, "state": "paused"})),
            Request::Resume => {
                self.control.resume();
                Ok(json!({"ok": true, "state": "running"}))
            }
            Request::Shutdown => {
                then_exit = Some(ExitReason::PowerOff);
                Ok(json!({"ok": true, "state": "stopping"}))
            }
            Request::Snapshot { path } => match &self.ops {
                Some(ops) => self.exclusive(|| ops.snapshot(&path)),
                None => Err(Error::NotSupportedYet { option: "snapshot" }),
            },
            Request::Migrate(req) => match &self.ops {
                Some(ops) => self.exclusive(|| {
                    let mut progress = |p: Value| {
                        *self.migration.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
                        let _ = writeln!(stream, "{}", json!({"progress": p}));
                    };
                    let result = ops.migrate(&req, &mut progress);
                    *self.migration.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    if result.is_ok() {
                        // The destination runs the guest now: this copy must never run
                        // again (its vCPUs stay paused until the process ends).
                        then_exit = Some(ExitReason::Migrated);
                    }
                    result
                }),
                None => Err(Error::NotSupportedYet { option: "migrate" }),
            },
        };
        let reply = match result {
            Ok(v) => v,
            Err(e) => error_reply(&e.to_string()),
        };
        (reply, then_exit)
    }
}

fn error_reply(message: &str) -> Value {
    json!({"ok": false, "error": message})
}

/// Binds the socket, refusing to take over one a live process still serves.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::Option {
                option: "--api-socket",
                value: path.display().to_string(),
                reason: "another process is serving this socket".into(),
            });
        }
        // A stale socket from a process that is gone.
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|e| Error::Option {
        option: "--api-socket",
        value: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Serves the API until the process exits.
pub fn serve(listener: UnixListener, api: Arc<Api>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("api".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let api = api.clone();
                let _ = std::thread::Builder::new()
                    .name("api-conn".into())
                    .spawn(move || serve_connection(stream, &api));
            }
        })?;
    Ok(())
}

fn serve_connection(stream: UnixStream, api: &Api) {
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

use std::io::Read as _;

/// Removes the socket file when the machine stops.
pub struct SocketGuard(pub PathBuf);

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
