//! The control API: HTTP/1.1 on a Unix socket (docs/api.md, docs/api.yaml).
//!
//! - [`endpoints`] is the table of endpoints (method, path, body and reply types);
//! - [`request`] decodes method, path and body into a [`Request`] (pure, fuzzed);
//! - [`http`] is the transport: hyper on a current-thread tokio runtime on the API thread,
//!   with limits on connections, sizes and time;
//! - this module answers requests: [`Server`] holds the phase of the VMM (waiting for its
//!   configuration, as Firecracker does, or running a machine, whose state changes go through
//!   [`Supervisor`]);
//! - [`firecracker`] keeps the configuration set through Firecracker's pre-boot endpoints;
//! - [`client`] is the blocking client `ferrovm ctl` (through [`endpoints::call`]'s typed
//!   calls) and the tests use.

pub mod client;
pub mod endpoints;
pub mod firecracker;
pub mod http;
pub mod request;
pub mod types;

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use devices::exit::{ExitReason, ExitRequest};
use serde::Serialize;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::runstate::{MigrationCancel, RunState, Supervisor};
pub use request::{parse_request, Refusal, Request};
pub use types::MigrateRequest;
use types::*;

/// What a request may ask of the machine beyond pausing it.
pub trait MachineOps: Send + Sync {
    /// Writes a snapshot of the machine to `path`. `paused`: the guest is paused already
    /// (and stays so); otherwise it is paused for the snapshot and runs again after.
    fn snapshot(&self, path: &Path, paused: bool) -> Result<SnapshotReport>;
    /// Migrates the machine; `progress` receives every update; `cancel` stops it. `paused`: the guest is paused already, and stays paused here on failure (and on the
    /// destination). On success the guest stays paused here and the caller ends this copy of
    /// the machine ([`ExitReason::Migrated`]) once the reply is on its way.
    fn migrate(
        &self,
        request: &MigrateRequest,
        paused: bool,
        cancel: &MigrationCancel,
        progress: &mut dyn FnMut(MigrationProgress),
    ) -> Result<MigrationReport>;
    /// Before a paused guest's vCPUs run again: resumes the devices and timers a snapshot or
    /// a migration left paused with it. With `take_back` (a forced resume after a migration
    /// of unknown outcome) it first takes back the disk locks the hand-over may have released,
    /// and fails, with everything left as it was, if one is held elsewhere (the destination:
    /// it may be running the guest).
    fn resume_devices(&self, take_back: bool) -> Result<()>;
}

/// What the API reports about the machine.
#[derive(Clone, Debug)]
pub struct MachineInfo {
    pub vcpus: u32,
    pub memory: u64,
    pub irqchip: &'static str,
    /// The machine's devices, for `GET /vm/config`.
    pub devices: crate::config::Devices,
}

/// A reply: status, JSON body (none for 204), and the exit to request once it is written.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Option<Value>,
    pub then_exit: Option<ExitReason>,
}

impl Reply {
    fn ok(body: impl Serialize) -> Self {
        Reply {
            status: 200,
            body: Some(serde_json::to_value(body).unwrap_or(Value::Null)),
            then_exit: None,
        }
    }

    fn no_content() -> Self {
        Reply {
            status: 204,
            body: None,
            then_exit: None,
        }
    }

    /// An error reply: `{"fault_message": ...}`.
    pub fn fault(status: u16, message: impl Into<String>) -> Self {
        Reply {
            status,
            body: Some(json!({"fault_message": message.into()})),
            then_exit: None,
        }
    }

    fn from_error(e: &Error) -> Self {
        let status = match e {
            // Refused for the machine's state: nothing happened, it may be sent again later.
            Error::Conflict(_) => 409,
            Error::Migration(_)
            | Error::MigrationOutcomeUnknown(_)
            | Error::MigrationGuestLost(_)
            | Error::Io(_)
            | Error::State(_)
            | Error::Sandbox(_) => 500,
            _ => 400,
        };
        Reply::fault(status, e.to_string())
    }

    fn from_result<T: Serialize>(r: Result<T>) -> Self {
        match r {
            Ok(v) => Reply::ok(v),
            Err(e) => Reply::from_error(&e),
        }
    }
}

/// A running machine, as the API sees it.
pub struct Api {
    pub supervisor: Arc<Supervisor>,
    pub exit: Arc<ExitRequest>,
    pub info: MachineInfo,
    /// The last progress report of a migration in flight.
    pub migration: Mutex<Option<MigrationProgress>>,
    /// The serial console's output queue, for the count of bytes dropped.
    pub serial: Option<Arc<devices::output::OutputQueue>>,
    /// The i8042, whose keyboard presses Ctrl+Alt+Del for `SendCtrlAltDel`.
    pub keyboard: Option<Arc<Mutex<devices::i8042::I8042>>>,
    /// The instruction completer, for its counts.
    pub completer: Option<Arc<complete::Completer>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `file:///abs` or `/abs` to an absolute path.
fn url_path(field: &str, url: &str) -> std::result::Result<PathBuf, Reply> {
    let path = url.strip_prefix("file://").unwrap_or(url);
    if path.starts_with('/') {
        Ok(PathBuf::from(path))
    } else {
        Err(Reply::fault(
            400,
            format!("{field} {url:?}: expected file:///ABSOLUTE/PATH or an absolute path"),
        ))
    }
}

impl Api {
    pub fn new(supervisor: Arc<Supervisor>, exit: Arc<ExitRequest>, info: MachineInfo) -> Self {
        Api {
            supervisor,
            exit,
            info,
            migration: Mutex::new(None),
            serial: None,
            keyboard: None,
            completer: None,
        }
    }

    /// The run state, `Stopping` once the guest or the operator ended the machine.
    fn state(&self) -> RunState {
        let (state, _) = self.supervisor.status();
        if self.exit.is_requested() {
            RunState::Stopping
        } else {
            state
        }
    }

    fn progress(&self) -> Option<MigrationProgress> {
        lock(&self.migration).clone()
    }

    pub fn info(&self) -> VmInfo {
        let (_, busy) = self.supervisor.status();
        VmInfo {
            state: self.state().name().into(),
            operation: busy.map(|op| op.name().into()),
            vcpus: self.info.vcpus,
            memory_bytes: self.info.memory,
            irqchip: self.info.irqchip.into(),
            migration: self.progress(),
            serial_dropped_bytes: self.serial.as_ref().map_or(0, |q| q.dropped()),
            instruction_completions: self
                .completer
                .as_ref()
                .map(|c| c.counts())
                .unwrap_or_default(),
        }
    }

    fn state_reply(state: RunState) -> StateReply {
        StateReply {
            state: state.name().into(),
            message: None,
        }
    }

    /// Firecracker's name of the state.
    pub fn fc_state(&self) -> &'static str {
        match self.state() {
            RunState::Running => "Running",
            _ => "Paused",
        }
    }

    /// Serves a request to a running machine.
    fn handle(&self, request: Request) -> Reply {
        let sup = &self.supervisor;
        match request {
            Request::Info => Reply::ok(self.info()),
            Request::Pause => Reply::from_result(sup.pause().map(Self::state_reply)),
            Request::Resume(r) => Reply::from_result(self.resume(r.force)),
            Request::Shutdown => match sup.shutdown() {
                Ok(()) => Reply {
                    then_exit: Some(ExitReason::PowerOff),
                    ..Reply::ok(Self::state_reply(RunState::Stopping))
                },
                Err(e) => Reply::from_error(&e),
            },
            Request::Snapshot(r) => match url_path("destination_url", &r.destination_url) {
                Ok(path) => Reply::from_result(self.snapshot(path, None)),
                Err(reply) => reply,
            },
            Request::SendMigration(r) => self.migrate(r),
            Request::MigrationProgress => Reply::ok(MigrationStatus {
                active: lock(&self.migration).is_some()
                    || sup.status().1 == Some(crate::runstate::Operation::Migration),
                progress: self.progress(),
            }),
            Request::MigrationCancel => Reply::from_result(
                sup.cancel_migration()
                    .map(|()| CancelReply { cancelled: true }),
            ),
            Request::FcPatchVm(r) => match r.state.as_str() {
                "Paused" => Reply::from_result(sup.pause().map(Self::state_reply)).or_no_content(),
                "Resumed" => Reply::from_result(self.resume(false)).or_no_content(),
                other => Reply::fault(400, format!("state {other:?}: expected Paused or Resumed")),
            },
            Request::FcSnapshotCreate(r) => firecracker::create_snapshot(&r, |path, link| {
                self.snapshot(path.to_path_buf(), link.map(Path::to_path_buf))
            }),
            Request::FcAction(a) if a.action_type == "SendCtrlAltDel" => self.send_ctrl_alt_del(),
            other => Reply::fault(
                400,
                format!("{}: the VM is already running", request_name(&other)),
            ),
        }
    }

    /// Firecracker's `SendCtrlAltDel`: the keyboard presses and releases Ctrl+Alt+Del;
    /// 204 once the keys wait for the guest (which may ignore them), 409 while the
    /// keyboard's queue still holds earlier keys the guest has not read.
    fn send_ctrl_alt_del(&self) -> Reply {
        let Some(keyboard) = &self.keyboard else {
            return Reply::fault(400, "SendCtrlAltDel: this machine has no i8042 keyboard");
        };
        match lock(keyboard).send_ctrl_alt_del() {
            Ok(()) => Reply::no_content(),
            Err(full) => Reply::fault(409, format!("SendCtrlAltDel: {full}")),
        }
    }

    /// Writes a snapshot at `path`; `link`: a second name to give it (Firecracker's memory
    /// file), replacing only a regular file there.
    /// Resumes the guest on a migration thread: it may resume devices held since a snapshot,
    /// or take disk locks back (`force`), the migration role's calls.
    fn resume(&self, force: bool) -> Result<StateReply> {
        on_migration_thread(
            &self.supervisor,
            move |sup, _| resume_reply(sup, force),
            |_| {},
        )
    }

    fn snapshot(&self, path: PathBuf, link: Option<PathBuf>) -> Result<SnapshotReport> {
        let work = move |sup: &Supervisor, _: &mut dyn FnMut(MigrationProgress)| {
            let report = sup.snapshot(&path)?;
            if let Some(link) = link {
                link_snapshot(&path, &link)?;
            }
            Ok(report)
        };
        on_migration_thread(&self.supervisor, work, |_| {})
    }

    fn migrate(&self, request: MigrateRequest) -> Reply {
        if request.local && crate::local::unix_path(&request.destination).is_none() {
            return Reply::fault(
                400,
                "local: true needs a unix:PATH destination (a local update hands guest RAM \
                 over on the same host)",
            );
        }
        let progress = |p| *lock(&self.migration) = Some(p);
        let result = on_migration_thread(
            &self.supervisor,
            move |sup, progress| sup.migrate(&request, progress),
            progress,
        );
        *lock(&self.migration) = None;
        let lost = matches!(result, Err(Error::MigrationGuestLost(_)));
        let mut reply = Reply::from_result(result);
        if lost {
            // Neither copy of the guest is whole: this one stops, with the error.
            reply.then_exit = Some(ExitReason::Failed);
        } else if reply.status == 200 {
            // The destination runs the guest now: this copy must never run again (its vCPUs
            // stay paused until the process ends).
            reply.then_exit = Some(ExitReason::Migrated);
        }
        reply
    }
}

impl Reply {
    /// A success without a body (Firecracker's 204), or the error as it was.
    fn or_no_content(self) -> Self {
        if self.status == 200 {
            Reply::no_content()
        } else {
            self
        }
    }
}

/// Makes `link` a second name of the snapshot at `path`.
fn link_snapshot(path: &Path, link: &Path) -> Result<()> {
    let fail = |reason: String| Error::File {
        path: link.to_path_buf(),
        reason,
    };
    match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_file() => {
            std::fs::remove_file(link).map_err(|e| fail(format!("cannot replace it: {e}")))?
        }
        Ok(m) => {
            return Err(fail(format!(
                "exists and is {}: refusing to replace it",
                crate::files::kind_of(m.file_type())
            )))
        }
        Err(_) => {}
    }
    std::fs::hard_link(path, link).map_err(|e| {
        fail(format!(
            "cannot link it to the snapshot (it must be on the snapshot's file system): {e}"
        ))
    })
}

/// A short name of a request, for error messages: its endpoint's path.
fn request_name(request: &Request) -> &'static str {
    request::endpoint_of(request)
}

/// `vm.resume`'s reply: the state, and what a forced resume took back.
fn resume_reply(sup: &Supervisor, force: bool) -> Result<StateReply> {
    let (state, taken_back) = sup.resume_reporting(force)?;
    Ok(StateReply {
        message: taken_back.then(|| crate::runstate::TAKEN_BACK.into()),
        ..Api::state_reply(state)
    })
}

/// What the migration thread sends back to the API thread that started it.
enum Step<T> {
    Progress(MigrationProgress),
    Done(Result<T>),
}

/// Runs a snapshot or a migration on a thread of its own (role `migration`): the API threads,
/// which parse what clients send, are then not allowed the file and network calls it makes.
/// Its progress reports come back here, to `progress`.
fn on_migration_thread<T: Send + 'static>(
    supervisor: &Arc<Supervisor>,
    work: impl FnOnce(&Supervisor, &mut dyn FnMut(MigrationProgress)) -> Result<T> + Send + 'static,
    mut progress: impl FnMut(MigrationProgress),
) -> Result<T> {
    let (tx, steps) = mpsc::channel();
    let sup = supervisor.clone();
    sandbox::spawn(sandbox::Role::Migration, "migration", move || {
        let reports = tx.clone();
        let mut report = move |p| {
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

/// The phase of the VMM the API serves.
enum Phase {
    /// Waiting for its configuration (`run --api-socket` alone, as Firecracker starts).
    PreBoot(Box<firecracker::PreBoot>),
    Running(Arc<Api>),
}

/// What the API serves: the pre-boot configuration, then the running machine.
pub struct Server {
    phase: Mutex<Phase>,
    /// The reply to the `InstanceStart` (or snapshot load, restore, receive) that is starting
    /// the machine: sent when the machine runs or fails to start.
    pending_start: Mutex<Option<mpsc::Sender<std::result::Result<(), String>>>>,
    /// The configuration set through Firecracker's endpoints, for `GET /vm/config`.
    fc_config: Mutex<Option<FcFullConfig>>,
}

impl Server {
    /// A server for a machine that runs already.
    pub fn running(api: Arc<Api>) -> Self {
        Server {
            phase: Mutex::new(Phase::Running(api)),
            pending_start: Mutex::new(None),
            fc_config: Mutex::new(None),
        }
    }

    /// A server waiting for its configuration.
    pub fn pre_boot(pre_boot: firecracker::PreBoot) -> Self {
        Server {
            phase: Mutex::new(Phase::PreBoot(Box::new(pre_boot))),
            pending_start: Mutex::new(None),
            fc_config: Mutex::new(None),
        }
    }

    /// The machine runs: from now on requests go to it, and the request that started it
    /// gets its reply.
    pub fn attach(&self, api: Arc<Api>) {
        *lock(&self.phase) = Phase::Running(api);
        if let Some(tx) = lock(&self.pending_start).take() {
            let _ = tx.send(Ok(()));
        }
    }

    /// Ends the machine (a shutdown or a migration whose reply has been written).
    pub fn request_exit(&self, reason: ExitReason) {
        if let Phase::Running(api) = &*lock(&self.phase) {
            api.exit.request(reason);
        }
    }

    /// Whether a machine was attached.
    pub fn is_running(&self) -> bool {
        matches!(*lock(&self.phase), Phase::Running(_))
    }

    /// The machine could not be built: the request that asked for it gets the error, and
    /// the server goes on waiting for a configuration.
    pub fn start_failed(&self, error: String) {
        if let Phase::PreBoot(p) = &mut *lock(&self.phase) {
            p.starting = false;
        }
        if let Some(tx) = lock(&self.pending_start).take() {
            let _ = tx.send(Err(error));
        }
    }

    /// Answers one request.
    pub fn handle(&self, request: Request) -> Reply {
        if let Request::Ping = request {
            return Reply::ok(VmmPing {
                version: env!("CARGO_PKG_VERSION").into(),
                pid: std::process::id(),
            });
        }
        let mut phase = lock(&self.phase);
        let pre_boot = match &mut *phase {
            Phase::Running(api) => {
                let api = api.clone();
                drop(phase);
                return self.handle_running(&api, request);
            }
            Phase::PreBoot(p) => p,
        };
        match pre_boot.handle(request) {
            firecracker::PreBootReply::Now(reply) => reply,
            firecracker::PreBootReply::Start(waiter) => {
                *lock(&self.pending_start) = Some(waiter.reply);
                *lock(&self.fc_config) = Some(waiter.config);
                drop(phase);
                match waiter.started.recv() {
                    Ok(Ok(())) => Reply::no_content(),
                    Ok(Err(e)) => Reply::fault(400, format!("the VM could not start: {e}")),
                    Err(_) => Reply::fault(500, "the VMM ended while starting the VM"),
                }
            }
        }
    }

    fn handle_running(&self, api: &Api, request: Request) -> Reply {
        match request {
            Request::FcInstanceInfo => Reply::ok(FcInstanceInfo {
                app_name: "ferrovm".into(),
                id: "ferrovm".into(),
                state: api.fc_state().into(),
                vmm_version: env!("CARGO_PKG_VERSION").into(),
            }),
            Request::FcVersion => Reply::ok(firecracker::version()),
            Request::FcGetMachineConfig => Reply::ok(firecracker::machine_config_of(&api.info)),
            Request::FcVmConfig => match lock(&self.fc_config).clone() {
                Some(config) => Reply::ok(config),
                None => Reply::ok(firecracker::full_config_of(&api.info)),
            },
            other => api.handle(other),
        }
    }
}
