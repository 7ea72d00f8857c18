//! The bodies of the HTTP API's requests and replies, shared by the server and `ferrovm ctl`
//! (and checked against docs/api.yaml by a test). Two families:
//!
//! - ferrovm's own, under `/api/v1/` with Cloud Hypervisor's endpoint and field names where
//!   it has the operation (`vm.info`, `vm.send-migration` with `destination_url`, ...);
//! - Firecracker's, at its paths and with its field names, so that its SDKs drive ferrovm.
//!
//! Request bodies refuse unknown fields: a field ferrovm does not implement is a 400 naming
//! it, never silently ignored. New optional knobs get `#[serde(default)]`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Every error reply: Firecracker's shape, used by both families.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub fault_message: String,
}

/// `GET /api/v1/vm.info`: what the machine is and does.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmInfo {
    /// `not-started`, `running`, `paused`, `migration-outcome-unknown`, `stopping`.
    pub state: String,
    /// The state change in progress: `pause`, `resume`, `snapshot`, `migration`, `shutdown`.
    pub operation: Option<String>,
    pub vcpus: u32,
    pub memory_bytes: u64,
    pub irqchip: String,
    /// The last progress report while a migration runs.
    pub migration: Option<MigrationProgress>,
    /// Guest console output dropped because nobody read it.
    pub serial_dropped_bytes: u64,
    /// Instructions the kernel's emulator rejected and ferrovm completed, by mnemonic
    /// (empty on hosts that run guest ring 0 in hardware).
    #[serde(default)]
    pub instruction_completions: std::collections::BTreeMap<String, u64>,
}

/// `GET /api/v1/vmm.ping`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmmPing {
    pub version: String,
    pub pid: u32,
}

/// The reply of pause, resume and shutdown.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateReply {
    pub state: String,
    /// What else happened (a forced resume says what it took back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `PUT /api/v1/vm.resume` (the body is optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Resume even though the last migration's outcome is unknown.
    #[serde(default)]
    pub force: bool,
}

/// `PUT /api/v1/vm.snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// `file:///abs/path` or `/abs/path`: the snapshot file (one file, not a directory).
    pub destination_url: String,
}

/// `PUT /api/v1/vm.restore` (before the machine starts).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    /// `file:///abs/path` or `/abs/path`: a snapshot file.
    pub source_url: String,
    /// Copy every page into guest RAM before the guest runs (`--restore-eager`).
    #[serde(default)]
    pub prefault: bool,
}

/// `PUT /api/v1/vm.receive-migration` (before the machine starts).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveMigrationRequest {
    /// `tcp:HOST:PORT` to listen on.
    pub receiver_url: String,
}

/// What the snapshot writer reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotReport {
    /// The snapshot file.
    pub path: String,
    /// Milliseconds, with a fraction (as the server has always sent them).
    pub paused_ms: f64,
    pub total_ms: f64,
    pub bytes: u64,
    pub file_bytes: u64,
    pub pages: u64,
    pub zero_pages: u64,
    pub untouched_pages_skipped: u64,
}

/// One migration progress report (`GET /api/v1/vm.migration-progress`, `vm.info`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationProgress {
    pub round: u64,
    pub bytes_sent: u64,
    pub bytes_remaining: u64,
    /// Pages dirtied per second.
    pub dirty_rate: f64,
    /// Bytes per second.
    pub bandwidth: f64,
}

/// `GET /api/v1/vm.migration-progress`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationStatus {
    /// Whether a migration is in progress.
    pub active: bool,
    pub progress: Option<MigrationProgress>,
}

/// `PUT /api/v1/vm.migration-cancel`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelReply {
    pub cancelled: bool,
}

/// The reply of a successful `vm.send-migration`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationReport {
    /// Per round `index`, `duration_ms`, `pages_sent`, `zero_pages`, `bytes_sent`,
    /// `dirty_pages_found`; `total_ms`, `downtime_ms`, `bytes_total`, `converged`.
    pub report: Value,
}

impl MigrationReport {
    /// The figures `ferrovm ctl` shows, read from `report`.
    pub fn figures(&self) -> Result<MigrationFigures, serde_json::Error> {
        MigrationFigures::deserialize(&self.report)
    }
}

/// The figures of a [`MigrationReport`] that `ferrovm ctl` shows (the report has more);
/// absent ones read as zero, as an older server may leave some out.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct MigrationFigures {
    pub rounds: Vec<RoundFigures>,
    pub total_ms: f64,
    pub downtime_ms: f64,
    pub bytes_total: u64,
    pub converged: bool,
    /// After a switch to post-copy.
    pub postcopy: Option<PostcopyFigures>,
}

/// One round of a [`MigrationFigures`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RoundFigures {
    pub index: u64,
    pub duration_ms: f64,
    pub pages_sent: u64,
    pub zero_pages: u64,
    pub bytes_sent: u64,
    pub dirty_pages_found: u64,
}

/// What post-copy did, in a [`MigrationFigures`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PostcopyFigures {
    pub after_rounds: u64,
    pub missing_pages: u64,
    pub pages_on_demand: u64,
    pub pages_streamed: u64,
    pub requests: u64,
    pub bytes: u64,
    pub time_to_residency_ms: f64,
}

/// `PUT /api/v1/vm.send-migration`: Cloud Hypervisor's `destination_url` and ferrovm's knobs.
/// New knobs must have a default (older clients leave them out).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// `tcp:HOST:PORT`, or `unix:PATH` for a local update.
    #[serde(rename = "destination_url", alias = "destination")]
    pub destination: String,
    /// Cloud Hypervisor's same-host migration: with a `unix:PATH` destination (which is a
    /// local update either way).
    #[serde(default)]
    pub local: bool,
    /// Bytes per second.
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
    /// Switch to post-copy right away (no pre-copy round): the destination runs the guest at
    /// once and fetches missing pages on demand. If the link fails before every page is
    /// there, the guest is lost.
    #[serde(default)]
    pub post_copy: bool,
    /// Pre-copy this many rounds, then switch to post-copy (same risk as `post_copy`).
    #[serde(default)]
    pub post_copy_after_rounds: Option<u32>,
}

impl MigrateRequest {
    /// The live rounds before the switch to post-copy, if post-copy is asked for.
    pub fn post_copy_rounds(&self) -> Option<u32> {
        self.post_copy_after_rounds
            .or(if self.post_copy { Some(0) } else { None })
    }
}

// ---- Firecracker ----

/// `GET /` (Firecracker's InstanceInfo).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcInstanceInfo {
    pub app_name: String,
    pub id: String,
    /// `Not started`, `Running`, `Paused`.
    pub state: String,
    pub vmm_version: String,
}

/// `GET /version`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcVersion {
    pub firecracker_version: String,
}

/// `GET|PUT /machine-config`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FcMachineConfig {
    pub vcpu_count: u32,
    pub mem_size_mib: u64,
    /// Simultaneous multithreading: only `false`.
    #[serde(default)]
    pub smt: bool,
    /// Only `None` (or absent): ferrovm gives the guest the host's CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    /// Accepted either way: ferrovm tracks dirty pages when a migration needs them.
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// Only `None` (or absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huge_pages: Option<String>,
}

/// `PUT /boot-source`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FcBootSource {
    pub kernel_image_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
}

/// `PUT /drives/{drive_id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FcDrive {
    pub drive_id: String,
    pub path_on_host: String,
    pub is_root_device: bool,
    #[serde(default)]
    pub is_read_only: bool,
    /// Only absent: the root device is named `/dev/vdX`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partuuid: Option<String>,
    /// `Unsafe` or `Writeback`: both map to ferrovm's write-back cache, which honours
    /// FLUSH (so `Unsafe` is made safe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_type: Option<String>,
    /// Only `Sync` (or absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_engine: Option<String>,
    /// Refused: ferrovm has no rate limiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<Value>,
}

/// `PUT /network-interfaces/{iface_id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FcNetworkInterface {
    pub iface_id: String,
    pub host_dev_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
    /// Refused: ferrovm has no rate limiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_rate_limiter: Option<Value>,
    /// Refused: ferrovm has no rate limiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_rate_limiter: Option<Value>,
}

/// `PUT /vsock`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FcVsock {
    pub guest_cid: u32,
    pub uds_path: String,
    /// Firecracker before 1.0 required it; accepted and ignored (it names nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_id: Option<String>,
}

/// `PUT /actions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcAction {
    /// `InstanceStart` or `SendCtrlAltDel`.
    pub action_type: String,
}

/// `PATCH /vm`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcVmState {
    /// `Paused` or `Resumed`.
    pub state: String,
}

/// `PUT /snapshot/create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcSnapshotCreate {
    /// Where ferrovm's snapshot file (vCPU and device state with all of guest RAM) goes.
    pub snapshot_path: String,
    /// Made a second name (hard link) of the same file: ferrovm's format is one file.
    pub mem_file_path: String,
    /// Only `Full` (or absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_type: Option<String>,
    /// Firecracker's snapshot format version: refused if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// `mem_backend` of `PUT /snapshot/load`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcMemBackend {
    /// Only `File`.
    pub backend_type: String,
    pub backend_path: String,
}

/// `PUT /snapshot/load`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcSnapshotLoad {
    pub snapshot_path: String,
    /// If given, must name the same file as `snapshot_path` (see `FcSnapshotCreate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_file_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_backend: Option<FcMemBackend>,
    /// Accepted when false.
    #[serde(default)]
    pub enable_diff_snapshots: bool,
    /// Run the guest at once; otherwise it waits, paused, for `PATCH /vm`.
    #[serde(default)]
    pub resume_vm: bool,
}

/// `GET /vm/config`: the configuration as Firecracker reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcFullConfig {
    #[serde(
        rename = "boot-source",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub boot_source: Option<FcBootSource>,
    #[serde(rename = "machine-config")]
    pub machine_config: FcMachineConfig,
    pub drives: Vec<FcDrive>,
    #[serde(rename = "network-interfaces")]
    pub network_interfaces: Vec<FcNetworkInterface>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub vsock: Option<FcVsock>,
}
