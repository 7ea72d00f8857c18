//! Firecracker's endpoints: the configuration a VMM started without one collects before
//! `InstanceStart` (or a snapshot load, a restore, an incoming migration), mapped onto
//! ferrovm's [`VmConfig`]; and the snapshot files' mapping.
//!
//! Firecracker writes a snapshot as two files, the VM state and the guest memory. ferrovm's
//! snapshot is one file holding both (docs/migration.md): `snapshot/create` writes it at
//! `snapshot_path` and makes `mem_file_path` a second name of it (a hard link, no extra
//! space); `snapshot/load` reads `snapshot_path` and requires `mem_file_path`, if given, to
//! be that same file.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use super::types::*;
use super::{MachineInfo, Reply, Request};
use crate::config::{DeviceConfig, DeviceEntry, Devices, StartFrom, VmConfig, MIB};
use crate::error::Result;
use virtio::block::{BlockOptions, CacheMode, MAX_SERIAL_LEN};
use virtio::net_config::{format_mac, parse_mac, NetConfig};
use virtio::vsock_config::{vsock_cid_refusal, VsockConfig};

/// A configuration for the main thread to build and start.
pub struct StartRequest {
    pub config: VmConfig,
    /// A snapshot load's two paths, which must name one file (checked before the build,
    /// outside the API's sandbox).
    pub same_file: Option<(PathBuf, PathBuf)>,
}

/// What the request that starts the machine waits on.
pub struct StartWaiter {
    /// Given to the server: answered once the machine runs, or fails to start.
    pub reply: mpsc::Sender<std::result::Result<(), String>>,
    pub started: mpsc::Receiver<std::result::Result<(), String>>,
    /// The configuration, for `GET /vm/config` later.
    pub config: FcFullConfig,
}

pub enum PreBootReply {
    Now(Reply),
    Start(Box<StartWaiter>),
}

/// The configuration collected before the machine starts.
pub struct PreBoot {
    /// What the command line gave (serial, seccomp, accelerator...).
    base: VmConfig,
    machine: FcMachineConfig,
    boot: Option<FcBootSource>,
    /// Drives, network interfaces and vsock as they were put, under their ids.
    devices: Devices,
    /// The drive put with `is_root_device`.
    root_drive: Option<String>,
    /// A start was asked for and is in progress.
    pub(super) starting: bool,
    start: mpsc::Sender<StartRequest>,
}

fn bad(message: impl Into<String>) -> Reply {
    Reply::fault(400, message)
}

/// `GET /version`.
pub fn version() -> FcVersion {
    FcVersion {
        firecracker_version: env!("CARGO_PKG_VERSION").into(),
    }
}

/// `GET /machine-config` of a running machine.
pub fn machine_config_of(info: &MachineInfo) -> FcMachineConfig {
    FcMachineConfig {
        vcpu_count: info.vcpus,
        mem_size_mib: info.memory / MIB,
        smt: false,
        cpu_template: None,
        track_dirty_pages: false,
        huge_pages: None,
    }
}

/// `GET /vm/config` of a machine not configured through these endpoints.
pub fn full_config_of(info: &MachineInfo) -> FcFullConfig {
    fc_config(None, machine_config_of(info), &info.devices, None)
}

/// Firecracker's view of a configuration: the devices of the kinds it has (drives, network
/// interfaces, vsock), from the machine's device list.
fn fc_config(
    boot_source: Option<FcBootSource>,
    machine_config: FcMachineConfig,
    devices: &Devices,
    root_drive: Option<&str>,
) -> FcFullConfig {
    let mut config = FcFullConfig {
        boot_source,
        machine_config,
        drives: Vec::new(),
        network_interfaces: Vec::new(),
        vsock: None,
    };
    for entry in devices.iter() {
        match &entry.config {
            DeviceConfig::Disk(disk) => config.drives.push(FcDrive {
                drive_id: entry.id.clone(),
                path_on_host: disk.path.display().to_string(),
                is_root_device: root_drive == Some(entry.id.as_str()),
                is_read_only: disk.readonly,
                partuuid: None,
                cache_type: (disk.cache == CacheMode::Writeback).then(|| "Writeback".into()),
                io_engine: None,
                rate_limiter: None,
            }),
            DeviceConfig::Net(net) => config.network_interfaces.push(FcNetworkInterface {
                iface_id: entry.id.clone(),
                host_dev_name: net.tap.clone(),
                guest_mac: net.mac.as_ref().map(format_mac),
                rx_rate_limiter: None,
                tx_rate_limiter: None,
            }),
            DeviceConfig::Vsock(vsock) => {
                config.vsock = Some(FcVsock {
                    guest_cid: u32::try_from(vsock.cid).unwrap_or(u32::MAX),
                    uds_path: vsock.socket.display().to_string(),
                    vsock_id: None,
                })
            }
            _ => {}
        }
    }
    config
}

/// `PUT /snapshot/create`: `write` writes ferrovm's snapshot at the path it is given (and
/// links `mem_file_path` to it, see the module documentation).
pub fn create_snapshot(
    request: &FcSnapshotCreate,
    write: impl FnOnce(&Path, Option<&Path>) -> Result<SnapshotReport>,
) -> Reply {
    if !matches!(request.snapshot_type.as_deref(), None | Some("Full")) {
        return bad("snapshot_type: only Full snapshots (ferrovm has no diff snapshots)");
    }
    if request.version.is_some() {
        return bad("version: not supported (ferrovm writes its own snapshot format)");
    }
    let (state, mem) = (
        Path::new(&request.snapshot_path),
        Path::new(&request.mem_file_path),
    );
    if !state.is_absolute() || !mem.is_absolute() {
        return bad("snapshot_path and mem_file_path must be absolute paths");
    }
    let link = (state != mem).then_some(mem);
    match write(state, link) {
        Ok(_) => Reply {
            status: 204,
            body: None,
            then_exit: None,
        },
        Err(e) => Reply::from_error(&e),
    }
}

impl PreBoot {
    pub fn new(base: VmConfig, start: mpsc::Sender<StartRequest>) -> Self {
        PreBoot {
            machine: FcMachineConfig {
                vcpu_count: base.cpus,
                mem_size_mib: base.memory / MIB,
                smt: false,
                cpu_template: None,
                track_dirty_pages: false,
                huge_pages: None,
            },
            base,
            boot: None,
            devices: Devices::default(),
            root_drive: None,
            starting: false,
            start,
        }
    }

    fn full_config(&self) -> FcFullConfig {
        fc_config(
            self.boot.clone(),
            self.machine.clone(),
            &self.ordered_devices(),
            self.root_drive.as_deref(),
        )
    }

    /// The devices as the machine gets them: the root drive first (as /dev/vda), then by
    /// kind.
    fn ordered_devices(&self) -> Devices {
        let mut devices = self.devices.clone();
        devices
            .0
            .sort_by_key(|d| Some(d.id.as_str()) != self.root_drive.as_deref());
        devices.sort_by_kind();
        devices
    }

    /// Puts `config` under `id`, replacing the device of that id (which must be of the
    /// same kind).
    fn put_device(&mut self, id: String, config: DeviceConfig) -> Reply {
        if let Some(slot) = self.devices.0.iter_mut().find(|d| d.id == id) {
            if slot.config.kind().name != config.kind().name {
                return bad(format!("{id}: another kind of device has this id"));
            }
            slot.config = config;
            return Reply::no_content();
        }
        match self.devices.add(Some(id), config) {
            Ok(_) => Reply::no_content(),
            Err(e) => bad(e.to_string()),
        }
    }

    fn info(&self) -> VmInfo {
        VmInfo {
            state: "not-started".into(),
            operation: self.starting.then(|| "start".into()),
            vcpus: self.machine.vcpu_count,
            memory_bytes: self.machine.mem_size_mib * MIB,
            irqchip: self.base.irqchip.name().into(),
            migration: None,
            serial_dropped_bytes: 0,
            instruction_completions: Default::default(),
        }
    }

    /// Answers a request before the machine exists.
    pub fn handle(&mut self, request: Request) -> PreBootReply {
        if self.starting {
            return PreBootReply::Now(Reply::fault(409, "the VM is starting"));
        }
        let reply = match request {
            Request::Info => Reply::ok(self.info()),
            Request::FcInstanceInfo => Reply::ok(FcInstanceInfo {
                app_name: "ferrovm".into(),
                id: "ferrovm".into(),
                state: "Not started".into(),
                vmm_version: env!("CARGO_PKG_VERSION").into(),
            }),
            Request::FcVersion => Reply::ok(version()),
            Request::FcGetMachineConfig => Reply::ok(self.machine.clone()),
            Request::FcVmConfig => Reply::ok(self.full_config()),
            Request::MigrationProgress => Reply::ok(MigrationStatus {
                active: false,
                progress: None,
            }),
            Request::FcPutMachineConfig(m) => self.set_machine(m),
            Request::FcBootSource(b) => {
                self.boot = Some(b);
                Reply::no_content()
            }
            Request::FcDrive(id, d) => self.set_drive(id, d),
            Request::FcNetworkInterface(id, n) => self.set_net(id, n),
            Request::FcVsock(v) => self.set_vsock(v),
            Request::FcAction(a) if a.action_type == "InstanceStart" => {
                return self.start_with(self.boot_config(), None)
            }
            Request::FcSnapshotLoad(l) => return self.load(l),
            Request::Restore(r) => return self.restore(r),
            Request::ReceiveMigration(r) => return self.receive(r),
            Request::FcAction(a) => bad(format!(
                "action_type {:?}: expected InstanceStart before the VM runs",
                a.action_type
            )),
            other => bad(format!(
                "{}: the VM is not started yet",
                super::request_name(&other)
            )),
        };
        PreBootReply::Now(reply)
    }

    fn set_machine(&mut self, m: FcMachineConfig) -> Reply {
        if m.vcpu_count == 0 || m.vcpu_count > boot::layout::MAX_CPUS {
            return bad(format!(
                "vcpu_count {}: 1 to {}",
                m.vcpu_count,
                boot::layout::MAX_CPUS
            ));
        }
        if m.mem_size_mib < 2 || m.mem_size_mib > (1 << 24) {
            return bad(format!("mem_size_mib {}: 2 to 16777216", m.mem_size_mib));
        }
        if m.smt {
            return bad("smt: not supported (each vCPU is one core)");
        }
        if !matches!(m.cpu_template.as_deref(), None | Some("None")) {
            return bad("cpu_template: not supported (the guest sees the host's CPU)");
        }
        if !matches!(m.huge_pages.as_deref(), None | Some("None")) {
            return bad(
                "huge_pages: not supported (guest RAM is advised for transparent huge pages)",
            );
        }
        self.machine = m;
        Reply::no_content()
    }

    fn set_drive(&mut self, id: String, d: FcDrive) -> Reply {
        if d.rate_limiter.is_some() {
            return bad("rate_limiter: not supported");
        }
        if d.partuuid.is_some() {
            return bad("partuuid: not supported (the root device is /dev/vda)");
        }
        if !matches!(d.io_engine.as_deref(), None | Some("Sync")) {
            return bad("io_engine: only Sync");
        }
        if !matches!(
            d.cache_type.as_deref(),
            None | Some("Unsafe") | Some("Writeback")
        ) {
            return bad("cache_type: Unsafe or Writeback");
        }
        if d.is_root_device
            && self
                .root_drive
                .as_ref()
                .is_some_and(|root| *root != d.drive_id)
        {
            return bad("is_root_device: another drive is the root device");
        }
        if d.is_root_device {
            self.root_drive = Some(d.drive_id.clone());
        } else if self.root_drive.as_ref() == Some(&id) {
            self.root_drive = None;
        }
        self.put_device(id, DeviceConfig::Disk(disk_of(&d)))
    }

    fn set_vsock(&mut self, v: FcVsock) -> Reply {
        if let Some(why) = vsock_cid_refusal(u64::from(v.guest_cid)) {
            return bad(format!("guest_cid: {why}"));
        }
        if v.uds_path.is_empty() {
            return bad("uds_path: empty");
        }
        let vsock = VsockConfig {
            cid: u64::from(v.guest_cid),
            socket: PathBuf::from(&v.uds_path),
        };
        // One vsock device: a second PUT replaces it.
        let id = self
            .devices
            .iter()
            .find(|d| matches!(d.config, DeviceConfig::Vsock(_)))
            .map_or_else(|| "vsock0".to_string(), |d| d.id.clone());
        self.put_device(id, DeviceConfig::Vsock(vsock))
    }

    fn set_net(&mut self, id: String, n: FcNetworkInterface) -> Reply {
        if n.rx_rate_limiter.is_some() || n.tx_rate_limiter.is_some() {
            return bad("rx_rate_limiter, tx_rate_limiter: not supported");
        }
        let mut net = NetConfig::on_tap(&n.host_dev_name);
        if let Some(mac) = &n.guest_mac {
            match parse_mac(mac) {
                Some(mac) => net.mac = Some(mac),
                None => {
                    return bad(format!(
                        "guest_mac {mac:?}: expected six hex bytes, aa:bb:cc:dd:ee:ff, a \
                         unicast address, not all zeroes"
                    ))
                }
            }
        }
        self.put_device(id, DeviceConfig::Net(net))
    }

    /// The machine `InstanceStart` boots.
    fn boot_config(&self) -> std::result::Result<VmConfig, Reply> {
        let boot = self
            .boot
            .as_ref()
            .ok_or_else(|| bad("InstanceStart: no boot source (PUT /boot-source first)"))?;
        let mut config = self.base.clone();
        config.start = StartFrom::Kernel(PathBuf::from(&boot.kernel_image_path));
        config.initrd = boot.initrd_path.as_ref().map(PathBuf::from);
        config.cpus = self.machine.vcpu_count;
        config.memory = self.machine.mem_size_mib * MIB;
        config.memory_text = format!("{}M", self.machine.mem_size_mib);
        config.shape_given.cpus = true;
        config.shape_given.memory = true;
        // The root device first, as /dev/vda, named on the command line as Firecracker does.
        let mut cmdline = boot.boot_args.clone().unwrap_or_default();
        let root = self.root_drive.as_ref().and_then(|id| self.devices.get(id));
        if let Some(DeviceEntry {
            config: DeviceConfig::Disk(root),
            ..
        }) = root
        {
            let mode = if root.readonly { "ro" } else { "rw" };
            cmdline = format!("{cmdline} root=/dev/vda {mode}").trim().to_string();
        }
        config.cmdline = cmdline;
        config.devices = self.ordered_devices();
        Ok(config)
    }

    fn load(&mut self, l: FcSnapshotLoad) -> PreBootReply {
        if l.enable_diff_snapshots {
            return PreBootReply::Now(bad("enable_diff_snapshots: not supported"));
        }
        let mem = match (&l.mem_file_path, &l.mem_backend) {
            (Some(_), Some(_)) => {
                return PreBootReply::Now(bad("give mem_file_path or mem_backend, not both"))
            }
            (Some(p), None) => Some(p.clone()),
            (None, Some(b)) if b.backend_type == "File" => Some(b.backend_path.clone()),
            (None, Some(b)) => {
                return PreBootReply::Now(bad(format!(
                    "mem_backend.backend_type {:?}: only File",
                    b.backend_type
                )))
            }
            (None, None) => None,
        };
        let state = PathBuf::from(&l.snapshot_path);
        let mut config = self.base.clone();
        config.start = StartFrom::Restore(state.clone());
        config.start_paused = !l.resume_vm;
        // Devices put before the load are checked against the snapshot's recorded ones;
        // with none, the snapshot's are rebuilt (docs/api.md).
        config.devices = self.ordered_devices();
        self.start_with(Ok(config), mem.map(|m| (state, PathBuf::from(m))))
    }

    fn restore(&mut self, r: RestoreRequest) -> PreBootReply {
        let path = match super::url_path("source_url", &r.source_url) {
            Ok(p) => p,
            Err(reply) => return PreBootReply::Now(reply),
        };
        let mut config = self.base.clone();
        config.start = StartFrom::Restore(path);
        config.restore_eager = r.prefault;
        self.start_with(Ok(config), None)
    }

    fn receive(&mut self, r: ReceiveMigrationRequest) -> PreBootReply {
        let start = match crate::incoming_start(&r.receiver_url, "receiver_url") {
            Ok(start) => start,
            Err(e) => return PreBootReply::Now(bad(e.to_string())),
        };
        // The machine must be the source's: vCPUs and memory as PUT /machine-config set them.
        let mut config = self.base.clone();
        config.start = start;
        config.cpus = self.machine.vcpu_count;
        config.memory = self.machine.mem_size_mib * MIB;
        config.memory_text = format!("{}M", self.machine.mem_size_mib);
        config.devices = self.ordered_devices();
        self.start_with(Ok(config), None)
    }

    fn start_with(
        &mut self,
        config: std::result::Result<VmConfig, Reply>,
        same_file: Option<(PathBuf, PathBuf)>,
    ) -> PreBootReply {
        let config = match config {
            Ok(c) => c,
            Err(reply) => return PreBootReply::Now(reply),
        };
        if self.start.send(StartRequest { config, same_file }).is_err() {
            return PreBootReply::Now(Reply::fault(500, "the VMM is not waiting for a start"));
        }
        self.starting = true;
        let (reply, started) = mpsc::channel();
        PreBootReply::Start(Box::new(StartWaiter {
            reply,
            started,
            config: self.full_config(),
        }))
    }
}

fn disk_of(d: &FcDrive) -> BlockOptions {
    // Firecracker answers GET_ID with the drive's id.
    let mut serial = d.drive_id.clone();
    serial.truncate(MAX_SERIAL_LEN);
    BlockOptions {
        readonly: d.is_read_only,
        serial: Some(serial),
        ..BlockOptions::new(&d.path_on_host)
    }
}
