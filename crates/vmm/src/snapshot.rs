//! Snapshot, restore and live migration, wired to the machine: what `crates/migration` needs
//! from a running VM (RAM, dirty pages, pause/resume, state) and the destination side.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hypervisor::{restore_vcpu_state, MemoryRegion, Vcpu, VcpuState, Vm};
use migration::{
    Bitmap, DirtySource, MigrationConfig, MigrationParams, MigrationReport, Progress, RamRange,
    StreamReader, VmControl, PAGE_SIZE,
};
use serde_json::{json, Value};

use crate::api::types as api;
use crate::api::{MachineOps, MigrateRequest};
use crate::control::RunControl;
use crate::error::{Error, Result};
use crate::memory::GuestMemory;
use crate::restore::{self, LazyRestore, RestoreOptions};
use crate::runstate::MigrationCancel;
use crate::state::{DeviceList, MachineState};
use crate::timers::TimerGate;

/// How long a pause may take before a snapshot or migration gives up (the guest runs on).
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a new connection to `--incoming` may take to send its configuration.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A destination that stops reading or answering for this long is treated as gone.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(30);

fn mig_err(what: &str) -> impl Fn(migration::Error) -> Error + '_ {
    move |e| Error::Migration(format!("{what}: {e}"))
}

/// Everything a snapshot or migration touches, shared with the API threads.
pub struct Core {
    pub memory: Arc<GuestMemory>,
    pub vm: Arc<dyn Vm>,
    /// Guest RAM's regions, as the migration stream and snapshots lay RAM out.
    pub regions: Vec<MemoryRegion>,
    /// The memory slots that hold them, in address order: one per region, or several where
    /// a region is split (a firmware machine's PAM blocks below 1 MiB).
    pub slots: Vec<MemoryRegion>,
    pub control: Arc<RunControl>,
    pub devices: DeviceList,
    /// The timer thread's gate (PIT and RTC deadlines), paused with the devices.
    pub timers: Arc<TimerGate>,
    pub config: MigrationConfig,
    pub msrs: Vec<u32>,
    /// The interrupt controllers (saved with the devices; asked before a save whether
    /// they can be).
    pub irqchip: Arc<dyn crate::irqchip::MachineIrqChip>,
    /// Whether the kernel's manual dirty-log protect is on (decided at the first migration).
    pub manual_protect: std::sync::OnceLock<bool>,
    /// Whether the accelerator tracks dirty pages (upstream bhyve does not): without it only
    /// warm migration is possible.
    pub dirty_tracking: bool,
    /// A net device's queues are the host kernel's (`vhost=on`): its writes to guest memory
    /// (received frames, used rings) reach no dirty log, so only warm migration is possible.
    pub vhost_net: bool,
    /// Set after a lazy restore: guest RAM is served from that snapshot file.
    pub restored: std::sync::OnceLock<Arc<LazyRestore>>,
    /// Set on the destination of a post-copy migration: its failure, if any.
    pub postcopy: std::sync::OnceLock<Arc<restore::postcopy::Postcopy>>,
    /// Set on the source when post-copy failed after the destination ran the guest: the
    /// machine ends with this error.
    pub guest_lost: std::sync::OnceLock<String>,
    /// The temporary file of a snapshot being written, removed if the machine ends first.
    pub snapshot_temp: std::sync::Mutex<SnapshotTemp>,
    /// The devices and timers of a guest the operator paused stay paused after a snapshot
    /// or a failed migration, until it resumes: nothing writes its disks meanwhile, and
    /// requests it queued before are served on resume (or by a restored copy).
    pub devices_held: std::sync::atomic::AtomicBool,
}

/// The temporary file of a snapshot in progress.
#[derive(Default)]
pub struct SnapshotTemp {
    path: Option<PathBuf>,
    /// The machine is ending: no new snapshot may start.
    closed: bool,
}

/// The migration config of a machine: what the destination must match.
pub fn migration_config(
    memory: u64,
    vcpus: u32,
    irqchip: &str,
    regions: &[MemoryRegion],
) -> MigrationConfig {
    MigrationConfig {
        memory_size: memory,
        vcpus,
        irqchip: irqchip.to_string(),
        ram_regions: regions
            .iter()
            .map(|r| RamRange {
                guest_addr: r.guest_addr,
                size: r.size,
            })
            .collect(),
        extra: Default::default(),
        devices: None,
    }
}

impl Core {
    /// Checked before a snapshot or migration pauses anything: fails, with the accelerator's
    /// own explanation, when the kernel cannot save the VM's in-kernel state; after a lazy
    /// restore, fails if a page of the snapshot proved bad (the guest is being stopped).
    /// Pages not loaded yet are read through guest memory, which installs them verified, so
    /// corrupt data never gets a fresh checksum.
    pub(crate) fn check_can_save(&self) -> Result<()> {
        self.irqchip.check_can_save()?;
        if let Some(m) = self.restored.get() {
            m.check_intact()?;
        }
        Ok(())
    }

    fn temp_state(&self) -> std::sync::MutexGuard<'_, SnapshotTemp> {
        self.snapshot_temp.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a snapshot's temporary file, never through a symlink or over another file,
    /// and records it for [`Core::abandon_snapshot`].
    fn create_snapshot_temp(&self, tmp: &Path) -> std::io::Result<File> {
        let mut temp = self.temp_state();
        if temp.closed {
            return Err(std::io::Error::other("the VM is shutting down"));
        }
        let create = || File::options().write(true).create_new(true).open(tmp);
        let file = match create() {
            // Left by an earlier process with our pid: ours to replace.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                std::fs::remove_file(tmp)?;
                create()?
            }
            other => other?,
        };
        temp.path = Some(tmp.to_path_buf());
        Ok(file)
    }

    /// Stops the machine for a snapshot or the last phase of a migration and returns every
    /// vCPU's state: first the timer thread and the devices, so that nothing raises an
    /// interrupt or touches guest memory once the vCPUs' state (their local APICs) is read,
    /// then the vCPUs: paused here, or, for a guest the operator paused (`paused`), captured
    /// where they are parked. On failure, whatever was paused here runs again.
    fn pause_machine(&self, paused: bool) -> Result<Vec<VcpuState>> {
        self.timers.pause();
        if let Err(e) = self.devices.pause() {
            self.timers.resume();
            return Err(e);
        }
        let vcpus = if paused {
            self.control.capture(self.msrs.clone(), PAUSE_TIMEOUT)
        } else {
            self.control
                .pause_and_capture(self.msrs.clone(), PAUSE_TIMEOUT)
        };
        vcpus.inspect_err(|_| {
            // Device errors are logged; the pause failure is the one to report.
            let _ = self.devices.resume();
            self.timers.resume();
        })
    }

    /// Undoes `pause_machine(paused)` in reverse order. A guest the operator paused stays
    /// paused whole, its devices and timers held with its vCPUs until it resumes
    /// ([`Core::resume_devices`]). Every part is resumed even if a device fails to; that
    /// failure is returned.
    fn resume_machine(&self, paused: bool) -> Result<()> {
        if paused {
            self.devices_held.store(true, Ordering::SeqCst);
            return Ok(());
        }
        self.control.resume();
        self.resume_devices()
    }

    /// Resumes the devices, then the timers (all of them even if a device fails to; that
    /// failure is returned).
    fn resume_devices(&self) -> Result<()> {
        self.devices_held.store(false, Ordering::SeqCst);
        let devices = self.devices.resume();
        self.timers.resume();
        devices
    }

    /// Removes the temporary file of a snapshot still being written, and refuses new ones:
    /// the machine ends.
    pub fn abandon_snapshot(&self) {
        let mut temp = self.temp_state();
        temp.closed = true;
        if let Some(path) = temp.path.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    fn machine_state(&self, vcpus: Vec<VcpuState>) -> Result<MachineState> {
        Ok(MachineState {
            format: crate::state::STATE_FORMAT,
            vcpus,
            // Saved with the devices (the `irqchip` device).
            kernel_irqchip: None,
            clock: self.vm.clock()?,
            devices: self.devices.save()?,
            predates_pci: false,
            pci_addressed: false,
            paused: false,
        })
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The figures of a migration, in the units `ctl` and docs/api.md use.
pub fn report_json(r: &MigrationReport) -> Value {
    json!({
        "rounds": r.rounds.iter().map(|s| json!({
            "index": s.index,
            "live": s.live,
            "duration_ms": ms(s.duration),
            "pages_sent": s.pages_sent,
            "zero_pages": s.zero_pages,
            "bytes_sent": s.bytes_sent,
            "dirty_pages_found": s.dirty_pages_found,
            "throttle_percent": s.throttle_percent,
        })).collect::<Vec<_>>(),
        "total_ms": ms(r.total_time),
        "downtime_ms": ms(r.downtime),
        "downtime_estimate_ms": ms(r.downtime_estimate),
        "stop_and_copy_ms": ms(r.stop_and_copy),
        "bytes_total": r.bytes_total,
        "pages_total": r.pages_total,
        "zero_pages_total": r.zero_pages_total,
        "touched_pages": r.touched_pages,
        "untouched_pages_skipped": r.untouched_pages_skipped,
        "swapped_pages": r.swapped_pages,
        "state_bytes": r.state_bytes,
        "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s,
        "converged": r.converged,
        "stop_reason": format!("{:?}", r.stop_reason),
        "max_throttle_percent": r.max_throttle_percent,
        "stages": r.stages,
        "compression": r.compression,
        "compressed_page_bytes": r.compressed_page_bytes,
        "compressed_frame_bytes": r.compressed_frame_bytes,
        "postcopy": r.postcopy,
    })
}

/// The engine's progress as the API reports it.
pub(crate) fn api_progress(p: &Progress) -> api::MigrationProgress {
    api::MigrationProgress {
        round: p.round.into(),
        bytes_sent: p.bytes_sent,
        bytes_remaining: p.bytes_remaining_estimate,
        dirty_rate: p.dirty_rate_pages_per_s,
        bandwidth: p.bandwidth_bytes_per_s,
    }
}

impl MachineOps for Core {
    /// Writes a snapshot file (format version 2, page images) beside `path` and renames it
    /// into place once complete and on disk: an existing file at `path` — even the one this
    /// guest was lazily restored from and still maps — is replaced whole, never rewritten in
    /// place, and a failed snapshot leaves it as it was.
    fn snapshot(&self, path: &Path, paused: bool) -> Result<api::SnapshotReport> {
        self.check_can_save()?;
        let started = Instant::now();
        let file_err = |reason: String| Error::File {
            path: path.to_path_buf(),
            reason,
        };
        let tmp = temp_path_beside(path)?;
        crate::files::require_replaceable(path, "snapshot")?;
        let file = self
            .create_snapshot_temp(&tmp)
            .map_err(|e| file_err(format!("cannot create snapshot: {e}")))?;
        let result = self.pause_machine(paused).and_then(|vcpus| {
            let result = self.machine_state(vcpus).and_then(|state| {
                let bytes = state.to_bytes()?;
                let data_pages = self.restored.get().map(|m| m.data_pages());
                let ram = migration::FileBackedRam::new(&*self.memory, data_pages);
                migration::snapshot_file(&ram, &self.config, &bytes, &file)
                    .map_err(mig_err("snapshot"))
            });
            let resumed = self.resume_machine(paused);
            result.and_then(|report| resumed.map(|()| report))
        });
        let paused_for = started.elapsed();
        // The guest runs again while the file goes to disk and into place.
        let result = result.and_then(|report| {
            file.sync_all()
                .and_then(|_| std::fs::rename(&tmp, path))
                .map_err(|e| file_err(format!("cannot write snapshot: {e}")))?;
            Ok(report)
        });
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        self.temp_state().path = None;
        let report = result?;
        Ok(api::SnapshotReport {
            path: path.to_string_lossy().into_owned(),
            paused_ms: ms(paused_for),
            total_ms: ms(started.elapsed()),
            bytes: report.bytes_total,
            file_bytes: report.file_bytes,
            pages: report.round.pages_sent,
            zero_pages: report.round.zero_pages,
            untouched_pages_skipped: report.untouched_pages_skipped,
        })
    }

    fn migrate(
        &self,
        request: &MigrateRequest,
        paused: bool,
        cancel: &MigrationCancel,
        progress: &mut dyn FnMut(api::MigrationProgress),
    ) -> Result<api::MigrationReport> {
        let here = where_guest_stays(paused);
        if let Some(path) = crate::local::unix_path(&request.destination) {
            return self.migrate_local(&path, request, paused, cancel, progress);
        }
        let addr = parse_tcp(&request.destination, "destination")?;
        self.check_can_save()
            .map_err(|e| Error::Migration(format!("{e} ({here})")))?;
        if !request.warm && !paused && self.vhost_net {
            return Err(Error::Migration(
                "live migration with vhost-net (--net ...,vhost=on) is not supported: the \
                 kernel's writes to guest memory are not tracked; use `migrate --warm` or a \
                 snapshot"
                    .into(),
            ));
        }
        if !request.warm && !paused && !self.dirty_tracking {
            return Err(Error::Migration(
                "live migration needs dirty-page tracking, which this accelerator lacks; \
                 use `migrate --warm` (pause, copy, resume on the destination) or a snapshot"
                    .into(),
            ));
        }
        let stream = connect(&addr).map_err(|e| match e {
            Error::Migration(m) => Error::Migration(format!("{m} ({here})")),
            other => other,
        })?;
        stream.set_write_timeout(Some(PEER_TIMEOUT))?;
        stream.set_read_timeout(Some(PEER_TIMEOUT))?;
        let _ = stream.set_nodelay(true);
        cancel.attach(stream.try_clone()?)?;
        let lanes = connect_lanes(&addr, request.connections, here)?;
        let result = self.migrate_over(stream, lanes, &addr, request, paused, cancel, progress);
        self.control.set_throttle(0);
        self.outcome_of(result, &addr, here, cancel)
    }

    fn resume_devices(&self, take_back: bool) -> Result<()> {
        self.resume_devices_for(take_back)
    }
}

/// What the API says of a guest whose migration failed.
pub(crate) fn where_guest_stays(paused: bool) -> &'static str {
    if paused {
        "the guest stays paused here"
    } else {
        "the guest keeps running here"
    }
}

impl Core {
    /// The API's answer for the migration engine's result.
    pub(crate) fn outcome_of(
        &self,
        result: migration::Result<MigrationReport>,
        addr: &str,
        here: &str,
        cancel: &MigrationCancel,
    ) -> Result<api::MigrationReport> {
        match result {
            // The destination runs the guest now; the API ends this copy once the reply is
            // written (the guest stays paused until then).
            Ok(report) => Ok(api::MigrationReport {
                report: report_json(&report),
            }),
            Err(e @ migration::Error::OutcomeUnknown { .. }) => {
                Err(Error::MigrationOutcomeUnknown(e.to_string()))
            }
            Err(e @ migration::Error::PostcopyLost { .. }) => {
                let _ = self.guest_lost.set(format!("migration to {addr}: {e}"));
                Err(Error::MigrationGuestLost(e.to_string()))
            }
            Err(_) if cancel.is_cancelled() => Err(Error::Migration(format!("cancelled ({here})"))),
            Err(e) => Err(Error::Migration(format!("{e} ({here})"))),
        }
    }

    /// [`MachineOps::resume_devices`]. Taking the guest back, the locks come first, so that
    /// a refusal leaves the devices paused; locks taken before one was refused are let go
    /// again (the other copy writes).
    fn resume_devices_for(&self, take_back: bool) -> Result<()> {
        if !take_back {
            let held = self.devices_held.load(Ordering::SeqCst);
            return if held { self.resume_devices() } else { Ok(()) };
        }
        if let Err(e) = self.devices.take_over() {
            let _ = self.devices.hand_over();
            return Err(Error::Conflict(format!(
                "cannot take the guest back: {e}; the migration's destination holds it and may \
                 be running the guest, so this copy stays paused (stop the destination first, \
                 or shut this copy down)"
            )));
        }
        self.resume_devices()
    }

    /// Runs the migration engine over a connected stream. A guest found paused is migrated
    /// warm (nothing can dirty its memory) and its state says so, so that the destination
    /// keeps it paused. On failure, the guest runs again only if it was running.
    #[allow(clippy::too_many_arguments)]
    fn migrate_over(
        &self,
        stream: TcpStream,
        lanes: Vec<TcpStream>,
        addr: &str,
        request: &MigrateRequest,
        paused: bool,
        cancel: &MigrationCancel,
        progress: &mut dyn FnMut(api::MigrationProgress),
    ) -> migration::Result<MigrationReport> {
        let ack_in = stream
            .try_clone()
            .map_err(|e| vm_error("the migration connection", e))?;
        let params = params_of(request)?;
        let warm = request.warm || paused;
        let mut live_dirty;
        let mut warm_dirty;
        let dirty: &mut dyn DirtySource = if warm {
            warm_dirty = NothingDirty::of(&self.regions);
            &mut warm_dirty
        } else {
            live_dirty = VmDirty {
                vm: self.vm.clone(),
                regions: self.regions.clone(),
                slots: self.slots.clone(),
                manual_protect: &self.manual_protect,
                memory: &self.memory,
            };
            &mut live_dirty
        };
        let mut control = VmPause::new(self, paused);
        if warm {
            // Warm migration: the guest stays paused from the first page to the hand-over.
            control.captured = Some(
                self.pause_machine(paused)
                    .map_err(|e| vm_error("pausing the machine", e))?,
            );
            control.paused = true;
        }
        // After a lazy restore, pages still mapped from the snapshot file hold data too.
        let data_pages = self.restored.get().map(|m| m.data_pages());
        let connect = || {
            let s = connect(addr).map_err(|e| std::io::Error::other(e.to_string()))?;
            s.set_write_timeout(Some(PEER_TIMEOUT))?;
            Ok(s)
        };
        let replies_from = stream
            .try_clone()
            .map_err(|e| vm_error("the migration connection", e))?;
        let replies = || {
            let reader = replies_from.try_clone()?;
            Ok(Box::new(reader) as Box<dyn std::io::Read + Send>)
        };
        let postcopy = request
            .post_copy_rounds()
            .map(|after_rounds| migration::PostcopySource {
                after_rounds,
                connect: &connect,
                spawn: &migration_thread,
                replies: &replies,
                timeout: PEER_TIMEOUT,
            });
        if postcopy.is_some() && warm {
            return Err(vm_error(
                "post-copy",
                "a paused (warm) migration has nothing to gain from post-copy; leave it out",
            ));
        }
        let result = migration::migrate_threaded(
            &migration::FileBackedRam::new(&*self.memory, data_pages),
            &self.config,
            dirty,
            &mut control,
            BufWriter::with_capacity(1 << 20, stream),
            lanes
                .into_iter()
                .map(|l| BufWriter::with_capacity(1 << 20, l))
                .collect(),
            BufReader::new(ack_in),
            &params,
            postcopy.as_ref(),
            |p: &Progress| {
                if p.phase == migration::Phase::WaitingAck {
                    cancel.final_state_sent();
                }
                progress(api_progress(p))
            },
            &migration_thread,
        );
        if result.as_ref().is_err_and(|e| !e.outcome_unknown()) && control.paused {
            // Paused before the engine ran (warm): the engine leaves that to us.
            let _ = control.resume();
        }
        result
    }
}

/// Starts one of a migration's threads (a data connection's or post-copy's) in the
/// migration role's sandbox.
fn migration_thread(
    name: String,
    body: Box<dyn FnOnce() + Send>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    sandbox::spawn(sandbox::Role::Migration, name, body)
}

/// Connections a migration uses by default: one per host CPU, at most 4.
pub fn default_connections() -> u32 {
    crate::host_cpus().min(4) as u32
}

/// Opens the data connections of a migration to `addr` (all but the control connection).
fn connect_lanes(addr: &str, requested: Option<u32>, here: &str) -> Result<Vec<TcpStream>> {
    let total = requested.unwrap_or_else(default_connections);
    if total == 0 || total > migration::MAX_DATA_CONNECTIONS + 1 {
        return Err(Error::Migration(format!(
            "--connections {total}: 1 to {} allowed ({here})",
            migration::MAX_DATA_CONNECTIONS + 1
        )));
    }
    (1..total)
        .map(|_| {
            let s = connect(addr).map_err(|e| match e {
                Error::Migration(m) => Error::Migration(format!("data connection: {m} ({here})")),
                other => other,
            })?;
            s.set_write_timeout(Some(PEER_TIMEOUT))?;
            s.set_read_timeout(Some(PEER_TIMEOUT))?;
            let _ = s.set_nodelay(true);
            Ok(s)
        })
        .collect()
}

/// The hidden temporary file a snapshot to `path` is written to before the rename.
fn temp_path_beside(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| Error::File {
        path: path.to_path_buf(),
        reason: "cannot create snapshot: not a file name".into(),
    })?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    Ok(path.with_file_name(tmp_name))
}

fn params_of(request: &MigrateRequest) -> migration::Result<MigrationParams> {
    let compression = match &request.compress {
        Some(c) => c.parse()?,
        None => migration::Compression::Auto,
    };
    Ok(MigrationParams {
        max_bandwidth: request.max_bandwidth,
        downtime_target: Duration::from_millis(request.downtime_ms.unwrap_or(50)),
        max_rounds: request.max_rounds.unwrap_or(30),
        max_time: request.max_time_s.map(Duration::from_secs),
        auto_converge: request.auto_converge,
        compression,
        shared_ram: false,
    })
}

/// Dirty pages from the kernel's dirty log, one bitmap per memory slot.
///
/// With manual protect (where the kernel has it), reading the log does not re-protect the
/// slot; the pages just read are cleared (re-protected) one call later, exactly those bits, so
/// a page written in between stays dirty for the next round.
struct VmDirty<'a> {
    vm: Arc<dyn Vm>,
    regions: Vec<MemoryRegion>,
    /// The slots whose logs make up the regions' bitmaps.
    slots: Vec<MemoryRegion>,
    manual_protect: &'a std::sync::OnceLock<bool>,
    /// Guest RAM as the VMM's devices write it, with their dirty bitmaps.
    memory: &'a GuestMemory,
}

fn vm_error(context: &str, e: impl std::fmt::Display) -> migration::Error {
    migration::Error::Io {
        context: context.to_string(),
        source: std::io::Error::other(e.to_string()),
    }
}

fn to_mig(e: hypervisor::HypervisorError) -> migration::Error {
    vm_error("dirty log", e)
}

impl DirtySource for VmDirty<'_> {
    fn start_tracking(&mut self) -> migration::Result<()> {
        // Must precede enabling dirty logging on the slots.
        let vm = &self.vm;
        let manual = *self.manual_protect.get_or_init(|| {
            vm.enable_manual_dirty_protect().unwrap_or_else(|e| {
                log::warn!("manual dirty-log protect unavailable: {e}");
                false
            })
        });
        log::info!("dirty logging, manual protect: {manual}");
        for s in &self.slots {
            self.vm.set_dirty_logging(s, true).map_err(to_mig)?;
        }
        // Discard what was logged while the slots were switched over.
        self.take_dirty().map(|_| ())
    }

    fn take_dirty(&mut self) -> migration::Result<Bitmap> {
        let mut words = Vec::with_capacity(self.regions.len());
        let manual = self.manual_protect.get().copied().unwrap_or(false);
        for r in &self.regions {
            let mut bits = vec![0u64; (r.size / PAGE_SIZE).div_ceil(64) as usize];
            let end = r.guest_addr + r.size;
            for s in self
                .slots
                .iter()
                .filter(|s| s.guest_addr >= r.guest_addr && s.guest_addr < end)
            {
                let slot_bits = self.vm.dirty_log(s.slot, s.size).map_err(to_mig)?;
                if manual {
                    self.vm
                        .clear_dirty_pages(s.slot, &slot_bits)
                        .map_err(to_mig)?;
                }
                let first_page = (s.guest_addr - r.guest_addr) / PAGE_SIZE;
                or_bits_at(&mut bits, &slot_bits, first_page, s.size / PAGE_SIZE);
            }
            add_device_writes(self.memory, r.guest_addr, &mut bits);
            words.push(bits);
        }
        Ok(Bitmap::from_words(words))
    }

    fn stop_tracking(&mut self) {
        for s in &self.slots {
            if let Err(e) = self.vm.set_dirty_logging(s, false) {
                log::warn!("dirty logging off for slot {}: {e}", s.slot);
            }
        }
    }
}

/// ORs the first `pages` bits of `src` (a slot's log) into `dst` (its region's bitmap) from
/// bit `first_page` on.
fn or_bits_at(dst: &mut [u64], src: &[u64], first_page: u64, pages: u64) {
    if first_page.is_multiple_of(64) {
        let start = (first_page / 64) as usize;
        for (d, s) in dst.iter_mut().skip(start).zip(src) {
            *d |= s;
        }
        return;
    }
    for page in 0..pages {
        let set = src
            .get((page / 64) as usize)
            .is_some_and(|w| w & (1 << (page % 64)) != 0);
        let at = first_page + page;
        if let (true, Some(w)) = (set, dst.get_mut((at / 64) as usize)) {
            *w |= 1 << (at % 64);
        }
    }
}

/// ORs into `bits` (KVM's log of the region at `guest_addr`) the pages the VMM's own devices
/// wrote since the last call, and clears those. Both bitmaps have one bit per 4 KiB page from
/// the region's start.
#[cfg(target_os = "linux")]
fn add_device_writes(memory: &GuestMemory, guest_addr: u64, bits: &mut [u64]) {
    use vm_memory::bitmap::AtomicBitmap;
    use vm_memory::{GuestAddress, GuestMemoryBackend, MmapRegion};
    let Some(region) = memory.find_region(GuestAddress(guest_addr)) else {
        return;
    };
    let mapping: &MmapRegion<AtomicBitmap> = region;
    for (word, device) in bits.iter_mut().zip(mapping.bitmap().get_and_reset()) {
        *word |= device;
    }
}

/// Elsewhere there is no dirty log to complete (live migration needs one).
#[cfg(not(target_os = "linux"))]
fn add_device_writes(_memory: &GuestMemory, _guest_addr: u64, _bits: &mut [u64]) {}

/// Warm migration: the guest is paused before the first page is sent, so nothing changes.
pub(crate) struct NothingDirty {
    region_pages: Vec<u64>,
}

impl NothingDirty {
    pub(crate) fn of(regions: &[MemoryRegion]) -> Self {
        NothingDirty {
            region_pages: regions.iter().map(|r| r.size / PAGE_SIZE).collect(),
        }
    }
}

impl DirtySource for NothingDirty {
    fn start_tracking(&mut self) -> migration::Result<()> {
        Ok(())
    }

    fn take_dirty(&mut self) -> migration::Result<Bitmap> {
        Ok(Bitmap::new(&self.region_pages))
    }

    fn stop_tracking(&mut self) {}
}

pub(crate) struct VmPause<'a> {
    core: &'a Core,
    captured: Option<Vec<VcpuState>>,
    paused: bool,
    /// The guest was paused before the migration: it stays paused whatever happens.
    was_paused: bool,
}

impl<'a> VmPause<'a> {
    /// Control of `core`'s guest, found running or (`was_paused`) paused by the operator.
    pub(crate) fn new(core: &'a Core, was_paused: bool) -> Self {
        VmPause {
            core,
            captured: None,
            paused: false,
            was_paused,
        }
    }
}

impl VmControl for VmPause<'_> {
    fn pause(&mut self) -> migration::Result<()> {
        if self.paused {
            // Warm migration paused the guest (and saved its vCPUs) before the first page.
            return Ok(());
        }
        let states = self
            .core
            .pause_machine(false)
            .map_err(|e| vm_error("pausing the machine", e))?;
        self.captured = Some(states);
        self.paused = true;
        Ok(())
    }

    fn resume(&mut self) -> migration::Result<()> {
        if !std::mem::take(&mut self.paused) {
            return Ok(());
        }
        self.core
            .resume_machine(self.was_paused)
            .map_err(|e| vm_error("resuming the machine", e))
    }

    fn save_state(&mut self) -> migration::Result<Vec<u8>> {
        let vcpus = self
            .captured
            .take()
            .ok_or_else(|| vm_error("saving state", "the vCPUs are not paused"))?;
        let mut state = self
            .core
            .machine_state(vcpus)
            .map_err(|e| vm_error("saving state", e))?;
        state.paused = self.was_paused;
        state.to_bytes().map_err(|e| vm_error("saving state", e))
    }

    fn throttle(&mut self, percent: u8) {
        self.core.control.set_throttle(percent);
    }

    fn hand_over(&mut self) -> migration::Result<()> {
        self.core
            .devices
            .hand_over()
            .map_err(|e| vm_error("handing over", e))
    }

    fn take_back(&mut self) -> migration::Result<()> {
        self.core
            .devices
            .take_over()
            .map_err(|e| vm_error("taking the disks back", e))
    }
}

/// `tcp:HOST:PORT` → `HOST:PORT`.
pub fn parse_tcp(text: &str, option: &'static str) -> Result<String> {
    let bad = |reason: &str| Error::Option {
        option,
        value: text.to_string(),
        reason: reason.to_string(),
    };
    let rest = text
        .strip_prefix("tcp:")
        .ok_or_else(|| bad("expected tcp:HOST:PORT"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("expected tcp:HOST:PORT"))?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(bad("expected tcp:HOST:PORT with a port number"));
    }
    Ok(rest.to_string())
}

fn connect(addr: &str) -> Result<TcpStream> {
    let targets = addr
        .to_socket_addrs()
        .map_err(|e| Error::Migration(format!("destination {addr}: {e}")))?;
    let mut last = None;
    for target in targets {
        match TcpStream::connect_timeout(&target, Duration::from_secs(10)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(Error::Migration(format!(
        "destination {addr}: {}",
        last.map(|e| e.to_string())
            .unwrap_or_else(|| "no address".into())
    )))
}

/// Reads the machine configuration at the start of a snapshot file.
pub fn peek_snapshot_config(path: &Path) -> Result<MigrationConfig> {
    // Opening a FIFO would wait for a writer forever; a device is no snapshot either.
    crate::files::require_regular(path, "snapshot")?;
    let file = File::open(path).map_err(|e| Error::File {
        path: path.to_path_buf(),
        reason: format!("cannot open snapshot: {e}"),
    })?;
    let mut reader = StreamReader::snapshot_file(BufReader::new(file));
    match reader.next_frame() {
        Ok(migration::Frame::Config(config)) => Ok(config),
        Ok(_) => Err(Error::File {
            path: path.to_path_buf(),
            reason: "not a ferrovm snapshot: it does not start with a configuration".into(),
        }),
        Err(e) => Err(Error::File {
            path: path.to_path_buf(),
            reason: format!("not a valid ferrovm snapshot: {e}"),
        }),
    }
}

/// Loads RAM and the machine state of a snapshot: serves the file's page images lazily,
/// verified on fault, or loads them (see `restore.rs`). Returns the lazy restore, if any
/// (its pager is running).
pub fn load_snapshot(
    path: &Path,
    memory: &GuestMemory,
    expected: &MigrationConfig,
    options: RestoreOptions,
    exit: &Arc<devices::exit::ExitRequest>,
) -> Result<(MachineState, Option<Arc<LazyRestore>>)> {
    let loaded = restore::load(path, memory, expected, options, exit)?;
    log::info!("snapshot {} restored: {}", path.display(), loaded.figures);
    match MachineState::from_bytes(&loaded.state) {
        Ok(state) => Ok((state, loaded.lazy)),
        Err(e) => {
            if let Some(m) = loaded.lazy {
                m.stop();
            }
            Err(e)
        }
    }
}

/// An incoming migration: the accepted connection's RAM is applied as it arrives; returns
/// the machine state and the sender of the final acknowledgement.
pub struct Incoming {
    pub state: MachineState,
    pub ack: migration::AckSender<ReplyChannel>,
    pub figures: Value,
    /// Set when the source switched to post-copy: pages still to come.
    pub postcopy: Option<migration::PostcopyIncoming>,
}

/// The destination's reply channel, watched for its first frame: until the destination has
/// accepted the source's configuration (`Ready`), no guest page has been written.
pub struct ReplyChannel {
    stream: Box<dyn ReplyStream>,
    first_frame_seen: bool,
    /// Set when the first frame written is `Ready`.
    accepted: Arc<std::sync::atomic::AtomicBool>,
}

/// A connection the destination replies on: TCP, or a local update's Unix socket.
pub trait ReplyStream: std::io::Write + Send {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl ReplyStream for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

impl ReplyStream for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, timeout)
    }
}

impl ReplyChannel {
    /// Replies of a local update (its configuration was accepted with the hand-off).
    pub fn local(stream: std::os::unix::net::UnixStream) -> Self {
        ReplyChannel {
            stream: Box::new(stream),
            first_frame_seen: true,
            accepted: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }
}

/// The `Ready` frame's kind byte (docs/migration.md).
const READY_KIND: u8 = 8;

impl std::io::Write for ReplyChannel {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.stream.write(buf)?;
        if !self.first_frame_seen && n > 0 {
            self.first_frame_seen = true;
            if buf[0] == READY_KIND {
                self.accepted
                    .store(true, std::sync::atomic::Ordering::Release);
                // A source that passed the handshake gets the patience a migration needs.
                self.stream.set_read_timeout(Some(PEER_TIMEOUT))?;
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// Waits on `listener` for a migration and receives it. A connection that fails before its
/// configuration is accepted (a port scanner, garbage, a peer that closes, a mismatched
/// machine) is logged and the wait goes on; a failure after that ends the wait (guest RAM
/// then holds part of a guest).
pub fn receive_migration(
    listener: &TcpListener,
    memory: &GuestMemory,
    expected: &MigrationConfig,
) -> Result<Incoming> {
    loop {
        let (stream, peer) = listener.accept()?;
        log::info!("incoming migration from {peer}");
        let accepted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reply = ReplyChannel {
            stream: Box::new(stream.try_clone()?),
            first_frame_seen: false,
            accepted: accepted.clone(),
        };
        match receive_from(listener, stream, reply, memory, expected) {
            Ok(incoming) => return Ok(incoming),
            Err(e) if !accepted.load(std::sync::atomic::Ordering::Acquire) => {
                log::warn!(
                    "incoming connection from {peer} refused: {e}; still waiting for a migration"
                );
            }
            Err(e) => {
                let reason = match e {
                    Error::Migration(m) => m,
                    other => other.to_string(),
                };
                return Err(Error::Migration(format!(
                    "incoming migration from {peer}: {reason}"
                )));
            }
        }
    }
}

fn receive_from(
    listener: &TcpListener,
    stream: TcpStream,
    reply: ReplyChannel,
    memory: &GuestMemory,
    expected: &MigrationConfig,
) -> Result<Incoming> {
    // Until its configuration is accepted, a peer that says nothing is not a migration.
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    // Replies are small frames written one after another (Handover, then Ack): without
    // this, Nagle's algorithm holds the Ack until the source's delayed ACK of the Handover
    // (40 ms on Linux), all of it downtime.
    let _ = stream.set_nodelay(true);
    stream.set_write_timeout(Some(PEER_TIMEOUT))?;
    let started = Instant::now();
    let parallel = migration::ParallelReceive {
        listener,
        spawn: &migration_thread,
        timeout: PEER_TIMEOUT,
    };
    // Not buffered here: the receiver reads through a small buffer of its own, and page data
    // goes from the socket straight into guest memory (a buffer in front would copy it).
    let result = migration::receive_parallel(memory, stream, reply, expected, Some(&parallel))
        .map_err(|e| Error::Migration(e.to_string()))?;
    Ok(Incoming {
        state: MachineState::from_bytes(&result.state)?,
        ack: result.ack,
        postcopy: result.postcopy,
        figures: json!({
            "receive_ms": ms(started.elapsed()),
            "bytes": result.report.bytes_total,
            "stages": result.report.stages,
        }),
    })
}

/// Restores every vCPU (not yet running) from the saved states.
pub fn restore_vcpus(vcpus: &[Box<dyn Vcpu>], states: &[VcpuState]) -> Result<()> {
    if vcpus.len() != states.len() {
        return Err(Error::State(format!(
            "the state has {} vCPUs, this machine {}",
            states.len(),
            vcpus.len()
        )));
    }
    for (vcpu, state) in vcpus.iter().zip(states) {
        restore_vcpu_state(vcpu.as_ref(), state)
            .map_err(|e| Error::State(format!("vCPU {}: {e}", vcpu.id())))?;
    }
    Ok(())
}

#[cfg(test)]
mod slot_bitmap_tests {
    use super::or_bits_at;

    #[test]
    fn slot_logs_land_at_their_page_offsets() {
        // A region of 256 pages split as a firmware machine splits its low RAM.
        let mut region = vec![0u64; 4];
        // Slot at page 0, 192 pages: pages 0 and 191 dirty.
        or_bits_at(&mut region, &[1, 0, 1 << 63], 0, 192);
        // Slot at page 192 (word-aligned), 4 pages: page 1 of it.
        or_bits_at(&mut region, &[0b10], 192, 4);
        // Slot at page 196 (not word-aligned), 4 pages: its pages 0 and 3.
        or_bits_at(&mut region, &[0b1001], 196, 4);
        // Bits past the slot's pages are ignored.
        or_bits_at(&mut region, &[u64::MAX], 250, 4);
        assert_eq!(region[0], 1);
        assert_eq!(region[2], 1 << 63);
        assert_eq!(region[3], 1 << 1 | 1 << 4 | 1 << 7 | 0b1111 << 58);
        // Nothing is written past the region.
        or_bits_at(&mut region, &[u64::MAX], 254, 8);
        assert_eq!(region.len(), 4);
    }
}
