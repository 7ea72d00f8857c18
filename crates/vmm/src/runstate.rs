//! The machine's run state, and the one place every state change goes through.
//!
//! Pause, resume, snapshot, migration and shutdown each take the machine from one state to
//! another, and some take long (a snapshot writes all of RAM; a migration sends it over the
//! network). They are serialised here: while one is in progress, any other is refused with a
//! [`Error::Conflict`] naming what is in progress (the HTTP API's 409), instead of, say, a
//! `resume` un-pausing the guest under a snapshot that is still reading its memory.
//!
//! This module knows nothing of the wire format of the API: the HTTP server only parses
//! requests and formats replies.

use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crate::api::types::{MigrationProgress, MigrationReport, SnapshotReport};
use crate::api::{MachineOps, MigrateRequest};
use crate::control::RunControl;
use crate::error::{Error, Result};
use crate::power::PowerControl;

/// How long a pause may take before the request fails (and the guest keeps running).
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a forced resume after a migration of unknown outcome brought back, as `resume`
/// replies it.
pub const TAKEN_BACK: &str = "the guest runs here again: its disk locks were taken back, its \
                              devices and timers resumed with its vCPUs";

/// What the machine is doing between operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    Running,
    Paused,
    /// A migration sent the guest's final state but never heard whether the destination runs
    /// it: the guest stays paused here, since it must never run twice. Only `resume --force`
    /// (the operator checked the destination) or a shutdown leaves this state.
    MigrationOutcomeUnknown,
    /// The guest put the machine to sleep (ACPI S3): its vCPUs are stopped until a wake
    /// event or `resume`. Pausing, snapshots and migration are refused meanwhile.
    Suspended,
    /// Shutting down: nothing more is accepted.
    Stopping,
}

impl RunState {
    /// The name `status` reports.
    pub fn name(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::MigrationOutcomeUnknown => "migration-outcome-unknown",
            RunState::Suspended => "suspended",
            RunState::Stopping => "stopping",
        }
    }

    fn is_paused(self) -> bool {
        matches!(self, RunState::Paused | RunState::MigrationOutcomeUnknown)
    }
}

/// A state change in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Pause,
    Resume,
    Snapshot,
    Migration,
    Shutdown,
}

impl Operation {
    /// The name `status` reports.
    pub fn name(self) -> &'static str {
        match self {
            Operation::Pause => "pause",
            Operation::Resume => "resume",
            Operation::Snapshot => "snapshot",
            Operation::Migration => "migration",
            Operation::Shutdown => "shutdown",
        }
    }
}

fn conflict(message: impl Into<String>) -> Error {
    Error::Conflict(message.into())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stops a migration in progress: shuts its connection down, which fails the migration at
/// its next read or write (the engine then resumes the guest if it was running). Refused
/// once the guest's final state has been sent: from then on only the destination can say
/// whether it runs the guest.
#[derive(Default)]
pub struct MigrationCancel {
    cancelled: AtomicBool,
    inner: Mutex<CancelInner>,
}

#[derive(Default)]
struct CancelInner {
    stream: Option<CancelStream>,
    final_state_sent: bool,
}

/// A migration's connection: TCP, or a Unix socket for a local update.
pub enum CancelStream {
    Tcp(TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl From<TcpStream> for CancelStream {
    fn from(s: TcpStream) -> Self {
        CancelStream::Tcp(s)
    }
}

impl From<std::os::unix::net::UnixStream> for CancelStream {
    fn from(s: std::os::unix::net::UnixStream) -> Self {
        CancelStream::Unix(s)
    }
}

impl MigrationCancel {
    /// The migration's connection, for [`MigrationCancel::cancel`] to shut down. Fails if
    /// the migration was cancelled already.
    pub fn attach(&self, stream: impl Into<CancelStream>) -> Result<()> {
        let mut inner = lock(&self.inner);
        if self.is_cancelled() {
            return Err(Error::Migration("cancelled".into()));
        }
        inner.stream = Some(stream.into());
        Ok(())
    }

    /// From now on the migration cannot be cancelled.
    pub fn final_state_sent(&self) {
        lock(&self.inner).final_state_sent = true;
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    fn cancel(&self) -> Result<()> {
        let inner = lock(&self.inner);
        if inner.final_state_sent {
            return Err(conflict(
                "the migration has sent the guest's final state and waits for the destination: \
                 it can no longer be cancelled",
            ));
        }
        self.cancelled.store(true, Ordering::Release);
        let _ = match &inner.stream {
            Some(CancelStream::Tcp(s)) => s.shutdown(Shutdown::Both),
            Some(CancelStream::Unix(s)) => s.shutdown(Shutdown::Both),
            None => Ok(()),
        };
        Ok(())
    }
}

struct Inner {
    state: RunState,
    busy: Option<Operation>,
    cancel: Option<Arc<MigrationCancel>>,
}

/// The run state and the operations that change it.
pub struct Supervisor {
    inner: Mutex<Inner>,
    control: Arc<RunControl>,
    ops: Option<Arc<dyn MachineOps>>,
    power: OnceLock<Arc<PowerControl>>,
}

/// An operation in progress: ends (and lets the next one in) when dropped.
struct Busy<'a> {
    supervisor: &'a Supervisor,
    from: RunState,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut inner = lock(&self.supervisor.inner);
        inner.busy = None;
        inner.cancel = None;
    }
}

impl Busy<'_> {
    fn settle(&self, state: RunState) {
        lock(&self.supervisor.inner).state = state;
    }
}

impl Supervisor {
    /// A supervisor of a machine that starts in `state` (paused: an incoming migration of a
    /// paused guest).
    pub fn new(
        control: Arc<RunControl>,
        ops: Option<Arc<dyn MachineOps>>,
        state: RunState,
    ) -> Self {
        Supervisor {
            inner: Mutex::new(Inner {
                state,
                busy: None,
                cancel: None,
            }),
            control,
            ops,
            power: OnceLock::new(),
        }
    }

    /// Connects the machine's sleep state: `status` then reports "suspended" while the guest
    /// sleeps in S3, and `resume` wakes it.
    pub fn set_power(&self, power: Arc<PowerControl>) {
        let _ = self.power.set(power);
    }

    fn suspended(&self) -> bool {
        self.power.get().is_some_and(|p| p.is_suspended())
    }

    /// The state, and the operation in progress if any.
    pub fn status(&self) -> (RunState, Option<Operation>) {
        let inner = lock(&self.inner);
        match inner.state {
            RunState::Running if self.suspended() => (RunState::Suspended, inner.busy),
            state => (state, inner.busy),
        }
    }

    /// Starts `op`, or refuses it when another is in progress or the machine is stopping.
    fn begin(&self, op: Operation) -> Result<Busy<'_>> {
        let mut inner = lock(&self.inner);
        if inner.state == RunState::Stopping {
            return Err(conflict("the VM is shutting down"));
        }
        if let Some(busy) = inner.busy {
            return Err(conflict(format!("a {} is in progress", busy.name())));
        }
        let wakes = matches!(op, Operation::Resume | Operation::Shutdown);
        if !wakes && self.suspended() {
            return Err(conflict(
                "the guest is suspended (ACPI S3): its vCPUs wait for a wake event; \
                 `resume` wakes it",
            ));
        }
        inner.busy = Some(op);
        Ok(Busy {
            supervisor: self,
            from: inner.state,
        })
    }

    fn ops(&self, what: &'static str) -> Result<&Arc<dyn MachineOps>> {
        self.ops
            .as_ref()
            .ok_or(Error::NotSupportedYet { option: what })
    }

    /// Stops the vCPUs. Pausing a paused machine is not an error.
    pub fn pause(&self) -> Result<RunState> {
        let busy = self.begin(Operation::Pause)?;
        if busy.from == RunState::Running {
            self.control.pause(PAUSE_TIMEOUT)?;
            busy.settle(RunState::Paused);
            return Ok(RunState::Paused);
        }
        Ok(busy.from)
    }

    /// Lets the vCPUs run again. After a migration whose outcome is unknown, only with
    /// `force` (the operator made sure the destination does not run the guest).
    pub fn resume(&self, force: bool) -> Result<RunState> {
        self.resume_reporting(force).map(|(state, _)| state)
    }

    /// [`Supervisor::resume`], also saying whether the whole machine was taken back from a
    /// migration whose outcome was unknown.
    pub fn resume_reporting(&self, force: bool) -> Result<(RunState, bool)> {
        let busy = self.begin(Operation::Resume)?;
        match busy.from {
            RunState::MigrationOutcomeUnknown if !force => Err(conflict(
                "the outcome of the last migration is unknown: the destination may be running \
                 the guest; make sure it is not, then resume with force (`ctl resume --force`)",
            )),
            RunState::MigrationOutcomeUnknown => {
                // The final phase stopped more than the vCPUs: the disk locks (if handed
                // over), devices and timers come back first, or nothing does.
                self.ops("resume --force")?.resume_devices(true)?;
                self.control.resume();
                busy.settle(RunState::Running);
                log::warn!("resumed by force after a migration of unknown outcome: {TAKEN_BACK}");
                Ok((RunState::Running, true))
            }
            RunState::Paused => {
                if let Some(ops) = &self.ops {
                    ops.resume_devices(false)?;
                }
                self.control.resume();
                busy.settle(RunState::Running);
                Ok((RunState::Running, false))
            }
            RunState::Running if self.suspended() => {
                if let Some(power) = self.power.get() {
                    power.wake(devices::acpi_pm::WakeEvent::Resume);
                }
                Ok((RunState::Running, false))
            }
            other => Ok((other, false)),
        }
    }

    /// Enters [`RunState::Stopping`]; the caller then ends the machine. Refused while
    /// another operation is in progress (cancel a migration first); a machine already
    /// stopping (the guest powered off meanwhile) is not an error.
    pub fn shutdown(&self) -> Result<()> {
        if lock(&self.inner).state == RunState::Stopping {
            return Ok(());
        }
        let busy = self.begin(Operation::Shutdown)?;
        busy.settle(RunState::Stopping);
        Ok(())
    }

    /// The machine is ending for another reason (the guest, a signal): refuse what follows.
    pub fn stopping(&self) {
        lock(&self.inner).state = RunState::Stopping;
    }

    /// Writes a snapshot to `path`. The guest is paused for it if it runs, and left as it
    /// was found.
    pub fn snapshot(&self, path: &Path) -> Result<SnapshotReport> {
        let ops = self.ops("snapshot")?;
        let busy = self.begin(Operation::Snapshot)?;
        ops.snapshot(path, busy.from.is_paused())
    }

    /// Migrates the machine (see [`MachineOps::migrate`]). On success the guest stays
    /// paused here and the caller ends the machine; on a failure the guest is left running
    /// or paused as it was found, except when the outcome is unknown (the destination may
    /// be running it): then it stays paused in [`RunState::MigrationOutcomeUnknown`].
    pub fn migrate(
        &self,
        request: &MigrateRequest,
        progress: &mut dyn FnMut(MigrationProgress),
    ) -> Result<MigrationReport> {
        let ops = self.ops("migrate")?;
        let busy = self.begin(Operation::Migration)?;
        if busy.from == RunState::MigrationOutcomeUnknown {
            return Err(conflict(
                "the outcome of the last migration is unknown: the destination may be running \
                 the guest; it cannot be migrated again from here",
            ));
        }
        let cancel = Arc::new(MigrationCancel::default());
        lock(&self.inner).cancel = Some(cancel.clone());
        let result = ops.migrate(request, busy.from.is_paused(), &cancel, progress);
        match &result {
            Ok(_) => busy.settle(RunState::Stopping),
            Err(Error::MigrationOutcomeUnknown(_)) => {
                busy.settle(RunState::MigrationOutcomeUnknown)
            }
            Err(Error::MigrationGuestLost(_)) => busy.settle(RunState::Stopping),
            Err(_) => {}
        }
        result
    }

    /// Cancels the migration in progress.
    pub fn cancel_migration(&self) -> Result<()> {
        let cancel = {
            let inner = lock(&self.inner);
            match (&inner.busy, &inner.cancel) {
                (Some(Operation::Migration), Some(cancel)) => cancel.clone(),
                _ => return Err(conflict("no migration is in progress")),
            }
        };
        cancel.cancel()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Machine operations that block until told to finish, to hold an operation open.
    struct Gate {
        started: Mutex<mpsc::Sender<()>>,
        finish: Mutex<mpsc::Receiver<Result<()>>>,
        seen_paused: Mutex<Vec<bool>>,
    }

    impl MachineOps for Gate {
        fn snapshot(&self, path: &Path, paused: bool) -> Result<SnapshotReport> {
            lock(&self.seen_paused).push(paused);
            let _ = lock(&self.started).send(());
            lock(&self.finish).recv().unwrap()?;
            Ok(SnapshotReport {
                path: path.display().to_string(),
                paused_ms: 0.0,
                total_ms: 0.0,
                bytes: 0,
                file_bytes: 0,
                pages: 0,
                zero_pages: 0,
                untouched_pages_skipped: 0,
            })
        }

        fn migrate(
            &self,
            _: &MigrateRequest,
            paused: bool,
            cancel: &MigrationCancel,
            _: &mut dyn FnMut(MigrationProgress),
        ) -> Result<MigrationReport> {
            lock(&self.seen_paused).push(paused);
            let _ = lock(&self.started).send(());
            let outcome = lock(&self.finish).recv().unwrap();
            if cancel.is_cancelled() {
                return Err(Error::Migration("cancelled".into()));
            }
            outcome.map(|_| MigrationReport {
                report: serde_json::Value::Null,
            })
        }

        fn resume_devices(&self, take_back: bool) -> Result<()> {
            match take_back {
                true => lock(&self.finish).recv().unwrap(),
                false => Ok(()),
            }
        }
    }

    fn gate() -> (Arc<Gate>, mpsc::Receiver<()>, mpsc::Sender<Result<()>>) {
        let (started_tx, started_rx) = mpsc::channel();
        let (finish_tx, finish_rx) = mpsc::channel();
        let gate = Arc::new(Gate {
            started: Mutex::new(started_tx),
            finish: Mutex::new(finish_rx),
            seen_paused: Mutex::new(Vec::new()),
        });
        (gate, started_rx, finish_tx)
    }

    /// A supervisor over a machine without vCPUs, whose pause and resume cannot fail: it
    /// starts in `state` as if it had been paused before.
    fn supervisor(gate: &Arc<Gate>, state: RunState) -> Arc<Supervisor> {
        let control = Arc::new(RunControl::default());
        control.set_kickers(Vec::new());
        let ops: Arc<dyn MachineOps> = gate.clone();
        Arc::new(Supervisor::new(control, Some(ops), state))
    }

    fn request() -> MigrateRequest {
        serde_json::from_str(r#"{"destination":"tcp:127.0.0.1:1"}"#).unwrap()
    }

    fn conflict_text(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::Conflict(m)) => m,
            other => panic!("expected a conflict, got {other:?}"),
        }
    }

    #[test]
    fn nothing_changes_the_state_during_a_snapshot() {
        let (gate, started, finish) = gate();
        let sup = supervisor(&gate, RunState::Running);
        let s = sup.clone();
        let snapshot = std::thread::spawn(move || s.snapshot(Path::new("/x")));
        started.recv().unwrap();
        assert_eq!(sup.status(), (RunState::Running, Some(Operation::Snapshot)));
        let m = conflict_text(sup.resume(false));
        assert_eq!(m, "a snapshot is in progress");
        conflict_text(sup.pause());
        conflict_text(sup.shutdown());
        conflict_text(sup.snapshot(Path::new("/y")));
        conflict_text(sup.migrate(&request(), &mut |_| {}));
        assert_eq!(
            conflict_text(sup.cancel_migration()),
            "no migration is in progress"
        );
        finish.send(Ok(())).unwrap();
        snapshot.join().unwrap().unwrap();
        assert_eq!(sup.status(), (RunState::Running, None));
        assert_eq!(*lock(&gate.seen_paused), [false]);
    }

    #[test]
    fn a_paused_machine_is_snapshotted_and_migrated_paused_and_stays_paused() {
        let (gate, started, finish) = gate();
        let sup = supervisor(&gate, RunState::Paused);
        finish.send(Ok(())).unwrap();
        sup.snapshot(Path::new("/x")).unwrap();
        started.recv().unwrap();
        assert_eq!(sup.status().0, RunState::Paused);
        finish
            .send(Err(Error::Migration("refused".into())))
            .unwrap();
        sup.migrate(&request(), &mut |_| {}).unwrap_err();
        assert_eq!(sup.status(), (RunState::Paused, None));
        assert_eq!(*lock(&gate.seen_paused), [true, true]);
    }

    #[test]
    fn resume_during_a_migration_is_refused_and_cancel_stops_it() {
        let (gate, started, finish) = gate();
        let sup = supervisor(&gate, RunState::Running);
        let s = sup.clone();
        let migration = std::thread::spawn(move || s.migrate(&request(), &mut |_| {}));
        started.recv().unwrap();
        assert_eq!(
            conflict_text(sup.resume(false)),
            "a migration is in progress"
        );
        sup.cancel_migration().unwrap();
        finish.send(Ok(())).unwrap();
        let e = migration.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("cancelled"), "{e}");
        assert_eq!(sup.status(), (RunState::Running, None));
    }

    #[test]
    fn an_unknown_outcome_keeps_the_guest_paused_until_a_forced_resume() {
        let (gate, _started, finish) = gate();
        let sup = supervisor(&gate, RunState::Running);
        finish
            .send(Err(Error::MigrationOutcomeUnknown("no ack".into())))
            .unwrap();
        sup.migrate(&request(), &mut |_| {}).unwrap_err();
        assert_eq!(sup.status().0, RunState::MigrationOutcomeUnknown);
        assert!(conflict_text(sup.resume(false)).contains("--force"));
        assert!(conflict_text(sup.migrate(&request(), &mut |_| {})).contains("unknown"));
        assert_eq!(sup.pause().unwrap(), RunState::MigrationOutcomeUnknown);
        // The machine cannot be taken back (the destination holds a disk): it stays put.
        finish.send(Err(conflict("disk d.img: locked"))).unwrap();
        assert!(conflict_text(sup.resume(true)).contains("locked"));
        assert_eq!(sup.status().0, RunState::MigrationOutcomeUnknown);
        finish.send(Ok(())).unwrap();
        assert_eq!(
            sup.resume_reporting(true).unwrap(),
            (RunState::Running, true)
        );
        sup.shutdown().unwrap();
        assert_eq!(conflict_text(sup.pause()), "the VM is shutting down");
        // Shutting down twice (or after the guest ended) is not an error.
        sup.shutdown().unwrap();
    }
}
