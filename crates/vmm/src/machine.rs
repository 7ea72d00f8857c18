//! The machine: accelerator, memory, devices, boot, vCPU threads and the main loop.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use crate::power::PowerControl;
use devices::bus::IoDispatcher;
use devices::exit::{ExitReason, ExitRequest, Waker};
use devices::i8042::I8042;
use hypervisor::{open_accelerator_with, AccelOptions, SegmentRegister, StandardRegisters, Vcpu};

use crate::api::{Api, MachineInfo, MachineOps, Server};
use crate::config::{IrqChipKind, StartFrom, VmConfig};
use crate::control::RunControl;
use crate::device_manager::{ram_below_and_above_4g, DeviceContext, DeviceManager};
use crate::error::{Error, Result};
use crate::firmware;
use crate::memory::{self, GuestMemory};
use crate::restore::RestoreOptions;
use crate::runstate::{RunState, Supervisor};
use crate::snapshot::{self, Core};
use crate::socket::SocketGuard;
use crate::state::DeviceList;
use crate::timers::{TimerDevices, TimerThread};
use crate::vcpu::{self, VcpuContext, VcpuThread};

/// How long the guest's last console output may take to reach its reader at exit.
const SERIAL_DRAIN_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How the machine ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Guest(ExitReason),
    /// Stopped by SIGINT or SIGTERM.
    Signal(i32),
}

impl Outcome {
    /// The process exit status DESIGN.md fixes.
    pub fn exit_status(self) -> u8 {
        match self {
            // Truncated to 8 bits like every process status (QEMU's isa-debug-exit too).
            Outcome::Guest(reason) => reason.exit_status() as u8,
            Outcome::Signal(signo) => (128 + signo) as u8,
        }
    }
}

/// Builds the machine described by `config`, runs it to the end and tears it down.
pub fn run(config: VmConfig) -> Result<Outcome> {
    // Counted before any sandbox: the threads that migrate or build devices may not ask.
    crate::host_cpus();
    // First, so that every thread of the machine starts in its role's sandbox.
    sandbox::start_with(config.seccomp, &crate::device_kinds::sandbox_needs())?;
    if config.start == StartFrom::Api {
        return run_configured_by_api(config);
    }
    let machine = Machine::build(&config, None)?;
    machine.run()
}

/// `run --api-socket PATH` alone: serves the API and waits for a configuration through it
/// (Firecracker's pre-boot endpoints, a snapshot load, a restore or an incoming migration),
/// then builds and runs that machine. A configuration that cannot be built is refused to the
/// request that sent it, and the VMM goes on waiting.
fn run_configured_by_api(base: VmConfig) -> Result<Outcome> {
    let path = base.api_socket.clone().ok_or_else(|| {
        Error::Control(
            "give --kernel, --firmware, --disk, --restore, --incoming or --api-socket".into(),
        )
    })?;
    let (listener, _guard) = crate::socket::bind(&path)?;
    let (start_tx, starts) = std::sync::mpsc::channel();
    let server = Arc::new(Server::pre_boot(crate::api::firecracker::PreBoot::new(
        base, start_tx,
    )));
    crate::api::http::serve(listener, server.clone())?;
    log::info!("waiting for the VM's configuration on {}", path.display());
    // SIGINT/SIGTERM while waiting end the VMM as they end a running one (the socket removed).
    let _signals = SignalWatch::install()?;
    loop {
        let start = match starts.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(start) => start,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                match LAST_SIGNAL.load(Ordering::SeqCst) {
                    0 => continue,
                    signo => return Ok(Outcome::Signal(signo)),
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let built = check_same_file(start.same_file.as_ref())
            .and_then(|()| Machine::build(&start.config, Some(server.clone())));
        match built.map(|m| m.run()) {
            Err(e) => server.start_failed(e.to_string()),
            Ok(Err(e)) if !server.is_running() => return Err(e),
            Ok(outcome) => return outcome,
        }
    }
    Err(Error::Control("the API server stopped".into()))
}

/// A snapshot load's state and memory paths name one file (ferrovm's snapshot is one file).
fn check_same_file(paths: Option<&(std::path::PathBuf, std::path::PathBuf)>) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Some((state, mem)) = paths else {
        return Ok(());
    };
    let id = |p: &std::path::Path| {
        std::fs::metadata(p)
            .map(|m| (m.dev(), m.ino()))
            .map_err(|e| Error::File {
                path: p.to_path_buf(),
                reason: e.to_string(),
            })
    };
    if id(state)? != id(mem)? {
        return Err(Error::Option {
            option: "mem_file_path",
            value: mem.display().to_string(),
            reason: "not the snapshot file: ferrovm's snapshot is one file holding memory and \
                     state, and snapshot/create makes mem_file_path a hard link to it"
                .into(),
        });
    }
    Ok(())
}

/// How the API reaches the machine.
enum ApiSetup {
    /// `--api-socket` with a machine from the command line: served once it runs.
    Own(std::os::unix::net::UnixListener, MachineInfo, SocketGuard),
    /// Served already (it configured this machine): the machine is attached once it runs.
    Attached(Arc<Server>, MachineInfo),
}

type AckSender = migration::AckSender<snapshot::ReplyChannel>;

/// How the vCPUs get their first state.
enum Start {
    /// Already set: the boot protocol's entry state.
    Boot,
    Restore(std::path::PathBuf, RestoreOptions),
    Incoming(TcpListener),
    /// A local update whose hand-off (guest RAM) was accepted: the state follows.
    IncomingLocal(std::os::unix::net::UnixStream),
}

struct Machine {
    /// The firmware ROM's mapping and the shadow RAM (firmware machines), kept while the VM
    /// exists.
    _firmware: Option<firmware::FirmwareMemory>,
    /// Memory (kept alive while the VM runs: the kernel maps it), the VM and the devices.
    core: Arc<Core>,
    start: Start,
    /// `--incoming unix:PATH`'s listener, whose socket file goes with the machine.
    _local_listener: Option<crate::local::LocalListener>,
    vcpus: Vec<Box<dyn Vcpu>>,
    context: Arc<VcpuContext>,
    timers: Option<TimerDevices>,
    api: Option<ApiSetup>,
    /// A restored snapshot waits, paused, for a resume through the API.
    restore_paused: bool,
    /// COM1's output queue, drained at exit.
    serial_output: Option<Arc<devices::output::OutputQueue>>,
    /// The i8042, whose keyboard the API presses Ctrl+Alt+Del on.
    keyboard: Option<Arc<std::sync::Mutex<I8042>>>,
    /// The console's input (a terminal or a socket), started when the machine runs.
    serial_input: Option<crate::device_manager::ConsoleInput>,
}

fn open_kernel(config: &VmConfig, path: &std::path::Path) -> Result<File> {
    let file_error = |reason: String| Error::File {
        path: path.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| file_error(format!("cannot open: {e}")))?;
    if meta.is_dir() {
        return Err(file_error("is a directory, not a kernel image".into()));
    }
    if meta.len() == 0 {
        return Err(file_error("is empty".into()));
    }
    if meta.len() > config.memory {
        return Err(file_error(format!(
            "is larger ({} bytes) than guest memory ({} bytes)",
            meta.len(),
            config.memory
        )));
    }
    File::open(path).map_err(|e| file_error(format!("cannot open: {e}")))
}

/// The files a boot reads and the migration listener, opened before the VM exists: a bad
/// path or address fails before anything is created.
struct BootInputs {
    kernel: Option<File>,
    initrd: Option<File>,
    incoming: Option<TcpListener>,
    /// `--incoming unix:PATH`: the listener (its socket removed with the machine).
    local: Option<crate::local::LocalListener>,
}

impl BootInputs {
    fn open(config: &VmConfig) -> Result<Self> {
        let kernel = match &config.start {
            StartFrom::Kernel(path) => Some(open_kernel(config, path)?),
            _ => None,
        };
        let incoming = match &config.start {
            StartFrom::Incoming(addr) => Some(listen_for_migration(addr)?),
            _ => None,
        };
        let local = match &config.start {
            StartFrom::IncomingLocal(path) => Some(crate::local::listen(path)?),
            _ => None,
        };
        let initrd = match &config.initrd {
            Some(path) => {
                // A device or FIFO would be read as empty or hang: an initrd is a file.
                crate::files::require_regular(path, "initrd")?;
                Some(File::open(path).map_err(|e| Error::File {
                    path: path.clone(),
                    reason: format!("cannot open initrd: {e}"),
                })?)
            }
            None => None,
        };
        Ok(BootInputs {
            kernel,
            initrd,
            incoming,
            local,
        })
    }
}

/// Guest RAM and how the VM maps it.
struct MachineMemory {
    memory: GuestMemory,
    /// The layout snapshots and the migration stream see.
    regions: Vec<hypervisor::MemoryRegion>,
    /// The memory slots that hold it (several per region on a firmware machine).
    slots: Vec<hypervisor::MemoryRegion>,
    firmware: Option<firmware::FirmwareMemory>,
}

/// The memory phase: guest RAM mapped into the VM, with the firmware ROM where there is one.
/// RAM goes in before the interrupt controllers: on some hosts registering memory slots
/// after KVM_CREATE_IRQCHIP costs milliseconds more (measured: 5–7 ms against 0.2 ms).
fn map_memory(
    vm: &Arc<dyn hypervisor::Vm>,
    config: &VmConfig,
    rom: Option<&firmware::Rom>,
    source: memory::RamSource,
) -> Result<MachineMemory> {
    let memory = memory::create_guest_memory_from(config.memory, config.wired, source)?;
    let (regions, slots, firmware) = match rom {
        Some(rom) => firmware::map_guest_memory(vm, &memory, rom)?,
        None => {
            let regions = memory::map_into_vm(vm, &memory)?;
            (regions.clone(), regions, None)
        }
    };
    Ok(MachineMemory {
        memory,
        regions,
        slots,
        firmware,
    })
}

/// The accelerator, checked against the vCPUs the configuration asks for.
fn open_hypervisor(
    config: &VmConfig,
) -> Result<(Box<dyn hypervisor::Hypervisor>, hypervisor::Capabilities)> {
    let hv = open_accelerator_with(
        config.accel,
        AccelOptions {
            wired: config.wired,
        },
    )?;
    let caps = hv.capabilities();
    if config.cpus as usize > caps.max_vcpus {
        return Err(Error::Option {
            option: "--cpus",
            value: config.cpus.to_string(),
            reason: format!("the accelerator supports at most {} vCPUs", caps.max_vcpus),
        });
    }
    Ok((hv, caps))
}

/// With `--restore`, the snapshot decides the machine's shape (memory, vCPUs, irqchip,
/// firmware, devices).
fn shaped_by_snapshot(config: &VmConfig) -> Result<VmConfig> {
    let mut config = config.clone();
    let StartFrom::Restore(path) = &config.start else {
        return Ok(config);
    };
    let saved = snapshot::peek_snapshot_config(path)?;
    check_shape_against_snapshot(&config, &saved)?;
    crate::device_kinds::record::apply_to_restore(&mut config, saved.devices.as_ref())?;
    config.memory = saved.memory_size;
    config.memory_text = format!("{}", saved.memory_size);
    config.cpus = saved.vcpus;
    config.irqchip = match saved.irqchip.as_str() {
        "split" => IrqChipKind::Split,
        _ => IrqChipKind::Kernel,
    };
    config.firmware = saved
        .extra
        .get(firmware::CONFIG_KEY)
        .and_then(|identity| firmware::path_from_identity(identity));
    Ok(config)
}

/// The firmware-tables phase of a fresh boot: ACPI and MP tables and the kernel (the
/// BSP's entry state), or the BIOS alias below 1 MiB. Restored or incoming RAM already
/// holds them (no entry state then).
fn write_boot_image(
    config: &VmConfig,
    memory: &GuestMemory,
    inputs: &mut BootInputs,
    rom: Option<&firmware::Rom>,
    kernel_pm_timer: Option<u16>,
) -> Result<Option<boot::BootEntry>> {
    if let (StartFrom::Firmware, Some(rom)) = (&config.start, rom) {
        firmware::load_bios_alias(memory, rom)?;
    }
    let Some(kernel) = inputs.kernel.as_mut() else {
        return Ok(None);
    };
    let initrd = inputs.initrd.as_mut();
    load_firmware_and_kernel(config, memory, kernel, initrd, kernel_pm_timer).map(Some)
}

/// A fresh boot on a kernel that models the RTC: the time and the memory sizes firmware
/// would write (a restore brings them back with the kernel's state instead).
fn init_kernel_rtc(vm: &dyn hypervisor::Vm, config: &VmConfig) -> Result<()> {
    let (below_4g, above_4g) = ram_below_and_above_4g(config.memory);
    vm.init_kernel_rtc(
        unix_now_secs(),
        &devices::rtc::cmos_memory_sizes(below_4g, above_4g),
    )?;
    Ok(())
}

fn irqchip_name(kind: IrqChipKind) -> &'static str {
    match kind {
        IrqChipKind::Kernel => "kernel",
        IrqChipKind::Split => "split",
    }
}

/// What a snapshot or migration records of the machine's shape.
fn recorded_config(
    config: &VmConfig,
    regions: &[hypervisor::MemoryRegion],
    rom: Option<&firmware::Rom>,
) -> migration::MigrationConfig {
    let irqchip = irqchip_name(config.irqchip);
    let mut recorded = snapshot::migration_config(config.memory, config.cpus, irqchip, regions);
    recorded.devices = crate::device_kinds::record::DeviceRecord::value_of(config);
    if let Some(rom) = rom {
        recorded
            .extra
            .insert(firmware::CONFIG_KEY.into(), rom.identity());
    }
    recorded
}

/// How the API reaches this machine, if it has one.
fn api_setup(config: &VmConfig, attached: Option<Arc<Server>>) -> Result<Option<ApiSetup>> {
    let info = MachineInfo {
        vcpus: config.cpus,
        memory: config.memory,
        irqchip: irqchip_name(config.irqchip),
        devices: config.devices.clone(),
    };
    Ok(match (attached, &config.api_socket) {
        (Some(server), _) => Some(ApiSetup::Attached(server, info)),
        (None, Some(path)) => {
            let (listener, guard) = crate::socket::bind(path)?;
            Some(ApiSetup::Own(listener, info, guard))
        }
        (None, None) => None,
    })
}

/// What every vCPU thread shares: the buses, the interrupt controllers and the controls.
fn vcpu_context(
    pio: Arc<IoDispatcher>,
    mmio: Arc<IoDispatcher>,
    exit: Arc<ExitRequest>,
    irqchip: &Arc<dyn crate::irqchip::MachineIrqChip>,
    power: Arc<PowerControl>,
    guest_memory: &Arc<GuestMemory>,
) -> Arc<VcpuContext> {
    Arc::new(VcpuContext {
        pio,
        mmio,
        exit,
        stop: Arc::new(AtomicBool::new(false)),
        sample_rip: rip_sample_period().is_some(),
        irqchip: irqchip.clone(),
        control: Arc::new(RunControl::default()),
        power,
        completer: Arc::new(complete::Completer::new()),
        ram: Arc::new(memory::CompletionRam(guest_memory.clone())),
    })
}

/// The vCPUs phase: each with its CPUID; the BSP at the kernel's entry or the reset vector.
fn create_vcpus(
    hv: &dyn hypervisor::Hypervisor,
    vm: &Arc<dyn hypervisor::Vm>,
    config: &VmConfig,
    entry: Option<&boot::BootEntry>,
    caps: &hypervisor::Capabilities,
) -> Result<Vec<Box<dyn Vcpu>>> {
    let cpu_setup = crate::cpu_setup::CpuSetup::new(hv, caps)?;
    let mut vcpus = Vec::new();
    for id in 0..config.cpus {
        let vcpu = vm.create_vcpu(id)?;
        cpu_setup.configure(vcpu.as_ref(), id, config.cpus)?;
        if let (0, Some(entry)) = (id, entry) {
            set_boot_registers(vcpu.as_ref(), entry)?;
        }
        if id == 0 && config.start == StartFrom::Firmware {
            firmware::set_reset_registers(vcpu.as_ref())?;
        }
        vcpus.push(vcpu);
    }
    Ok(vcpus)
}

/// How the vCPUs get their first state.
fn start_of(
    config: &VmConfig,
    incoming: Option<TcpListener>,
    local: Option<std::os::unix::net::UnixStream>,
) -> Start {
    if let Some(stream) = local {
        return Start::IncomingLocal(stream);
    }
    match (&config.start, incoming) {
        (StartFrom::Restore(path), _) => Start::Restore(
            path.clone(),
            RestoreOptions {
                verify_first: config.restore_verify,
                // Locking guest RAM reads all of it anyway: copy it in.
                eager: config.restore_eager || config.wired,
                no_prefetch: RestoreOptions::no_prefetch_from_env(),
            },
        ),
        (_, Some(listener)) => Start::Incoming(listener),
        _ => Start::Boot,
    }
}

impl Machine {
    /// Builds the machine in phases: memory, interrupt controllers, firmware tables and
    /// kernel, devices (the device manager's own phases), then the vCPUs.
    fn build(config: &VmConfig, attached: Option<Arc<Server>>) -> Result<Self> {
        let config = &shaped_by_snapshot(config)?;
        let rom = firmware::rom_for(config)?;
        memory::validate_size(config.memory, &config.memory_text)?;
        let mut inputs = BootInputs::open(config)?;
        // A local update's destination binds the API socket before it waits for its source
        // (the file tells it is there); any other machine once it is built, as clients take
        // the file for readiness.
        let mut attached = attached;
        let early_api = match inputs.local {
            Some(_) => Some(api_setup(config, attached.take())?),
            None => None,
        };
        let (hv, caps) = open_hypervisor(config)?;
        // A local update: the source's guest RAM, once a source connects.
        let (local, source) = match &inputs.local {
            Some(listener) => {
                let accepted = listener.accept(config.memory)?;
                let ram = memory::RamSource::HandedOver(accepted.ram);
                (Some(accepted.stream), ram)
            }
            None => (None, memory::RamSource::New(&config.memory_backend)),
        };
        let vm = hv.create_vm()?;
        let ram = map_memory(&vm, config, rom.as_ref(), source)?;
        // Asked again now that the VM exists: bhyve probes its snapshot support on creation.
        let irqchip = crate::irqchip::create(&vm, config.irqchip, &hv.capabilities())?;
        let entry = write_boot_image(
            config,
            &ram.memory,
            &mut inputs,
            rom.as_ref(),
            caps.pm_timer_port,
        )?;
        let exit = Arc::new(ExitRequest::new()?);
        let memory = Arc::new(ram.memory);
        let power = Arc::new(PowerControl::new(
            config.cpus,
            config.firmware.is_some(),
            memory.clone(),
        ));
        let devices = DeviceManager::build(&DeviceContext {
            config,
            vm: &vm,
            caps: &caps,
            irqchip: &irqchip,
            memory: &memory,
            exit: &exit,
            power: &power,
            firmware: ram.firmware.as_ref(),
        })?;
        if caps.rtc_in_kernel && (entry.is_some() || config.start == StartFrom::Firmware) {
            init_kernel_rtc(vm.as_ref(), config)?;
        }
        let context = vcpu_context(devices.pio, devices.mmio, exit, &irqchip, power, &memory);
        let core = Arc::new(Core {
            config: recorded_config(config, &ram.regions, rom.as_ref()),
            memory,
            vm: vm.clone(),
            regions: ram.regions,
            slots: ram.slots,
            control: context.control.clone(),
            devices: devices.list,
            timers: devices.timers.gate.clone(),
            msrs: hv.msr_index_list()?,
            irqchip,
            manual_protect: Default::default(),
            dirty_tracking: caps.dirty_log_bitmap,
            vhost_net: config
                .devices
                .any(|d| matches!(d, crate::config::DeviceConfig::Net(n) if n.vhost)),
            restored: Default::default(),
            postcopy: Default::default(),
            guest_lost: Default::default(),
            snapshot_temp: Default::default(),
            devices_held: Default::default(),
        });
        Ok(Machine {
            _firmware: ram.firmware,
            core,
            vcpus: create_vcpus(hv.as_ref(), &vm, config, entry.as_ref(), &caps)?,
            context,
            timers: Some(devices.timers),
            api: match early_api {
                Some(api) => api,
                None => api_setup(config, attached)?,
            },
            restore_paused: config.start_paused,
            start: start_of(config, inputs.incoming, local),
            _local_listener: inputs.local,
            serial_output: devices.serial_output,
            keyboard: devices.keyboard,
            serial_input: devices.serial_input,
        })
    }

    /// Loads a snapshot or receives a migration into the machine before it runs. Returns
    /// the acknowledgement to send once the guest runs (incoming migration), and whether the
    /// guest starts paused (it was paused on the migration's source).
    fn prepare_start(&mut self) -> Result<(Option<AckSender>, bool)> {
        let state = match std::mem::replace(&mut self.start, Start::Boot) {
            Start::Boot => return Ok((None, false)),
            Start::Restore(path, options) => {
                let (state, mapped) = snapshot::load_snapshot(
                    &path,
                    &self.core.memory,
                    &self.core.config,
                    options,
                    &self.context.exit,
                )?;
                if let Some(m) = mapped {
                    let _ = self.core.restored.set(m);
                }
                (state, None)
            }
            Start::IncomingLocal(stream) => {
                let incoming = crate::local::receive(stream, &self.core.config)?;
                log::info!("local update received: {}", incoming.figures);
                (incoming.state, Some(incoming.ack))
            }
            Start::Incoming(listener) => {
                let incoming =
                    snapshot::receive_migration(&listener, &self.core.memory, &self.core.config)?;
                log::info!("migration received: {}", incoming.figures);
                if let Some(pc) = incoming.postcopy {
                    // Before anything restores state: every touch of a missing page waits.
                    let started =
                        crate::restore::postcopy::start(pc, &self.core.memory, &self.context.exit);
                    match started {
                        Ok(p) => {
                            let _ = self.core.postcopy.set(p);
                        }
                        Err(e) => {
                            let mut ack = incoming.ack;
                            let _ = ack.fail(&format!("destination: {e}"));
                            return Err(Error::Migration(format!("post-copy: {e}")));
                        }
                    }
                }
                (incoming.state, Some(incoming.ack))
            }
        };
        let (state, mut ack) = state;
        // A snapshot always runs; a migrated guest stays paused if it was paused, which
        // only an API can end. Devices are restored paused and resumed as the guest starts:
        // a device with work of its own (a virtio queue) takes it up only then.
        let paused = (ack.is_some() && state.paused) || self.restore_paused;
        let restored = if paused && self.api.is_none() {
            Err(Error::Migration(
                "the guest was paused on the source, and this destination has no \
                 --api-socket to resume it"
                    .into(),
            ))
        } else {
            self.core
                .devices
                .pause()
                .and_then(|_| state.restore_platform(self.core.vm.as_ref(), &self.core.devices))
                .and_then(|_| snapshot::restore_vcpus(&self.vcpus, &state.vcpus))
                .and_then(|_| match ack.as_mut() {
                    Some(ack) => take_over_from_source(ack, &self.core.devices),
                    None => Ok(()),
                })
                .and_then(|_| self.core.devices.resume())
        };
        match restored {
            Ok(()) => Ok((ack, paused)),
            Err(e) => {
                if let Some(mut ack) = ack {
                    let _ = ack.fail(&e.to_string());
                }
                if let Some(m) = self.core.restored.get() {
                    m.stop();
                }
                Err(e)
            }
        }
    }

    fn run(mut self) -> Result<Outcome> {
        let (mut ack, start_paused) = self.prepare_start()?;
        if start_paused {
            // The vCPUs park before their first entry into the guest.
            self.context.control.start_paused();
        }
        let signals = SignalWatch::install()?;
        let _console = match self.serial_input.take() {
            Some((device, input)) => Some(input.start(device, self.context.exit.clone())?),
            None => None,
        };
        // Built, restored or received: from here on the main thread only starts, watches and
        // stops the machine.
        sandbox::enter(sandbox::Role::Main)?;
        let timer_thread = match self.timers.take() {
            Some(devices) if devices.has_timers() => Some(TimerThread::spawn(devices)?),
            // Nothing to drive (bhyve: the PIT and RTC are in the kernel).
            _ => None,
        };
        let (threads, mut start_error) = self.spawn_vcpus();
        if let (Some(ack), None) = (ack.as_mut(), &start_error) {
            // The guest runs here now: tell the source it may exit.
            if let Err(e) = ack.ack() {
                // The source will resume its own copy: this one must not run on.
                start_error = Some(Error::Migration(format!(
                    "cannot acknowledge the migration ({e}); stopping this copy"
                )));
            }
        }
        let supervisor = self.supervisor(start_paused);
        let _socket = self.serve_api(&supervisor, start_error.is_none())?;
        let outcome = if start_error.is_none() {
            signals.wait(&self.context.exit, rip_sample_period(), &threads)
        } else {
            None
        };
        supervisor.stopping();
        // A snapshot still being written when the machine ends is abandoned: no half-written
        // temporary file of the guest's size is left behind.
        self.core.abandon_snapshot();
        let failures = stop_vcpus(&self.context, threads);
        if let Some(t) = timer_thread {
            t.stop();
        }
        self.finish_serial_output();
        self.conclude(outcome, start_error, failures)
    }

    /// Starts one thread per vCPU, until one fails to start (its error is returned beside
    /// the threads that run), and hands their kickers to whoever kicks them.
    fn spawn_vcpus(&mut self) -> (Vec<VcpuThread>, Option<Error>) {
        let mut threads = Vec::new();
        let mut start_error = None;
        for vcpu in self.vcpus.drain(..) {
            match vcpu::spawn(vcpu, self.context.clone()) {
                Ok(t) => {
                    if t.id == 0 {
                        self.context.irqchip.set_bsp_kicker(t.kicker);
                    }
                    threads.push(t)
                }
                Err(e) => {
                    start_error = Some(e);
                    break;
                }
            }
        }
        let kickers = || threads.iter().map(|t| t.kicker).collect();
        self.context.control.set_kickers(kickers());
        self.context.power.set_kickers(kickers());
        (threads, start_error)
    }

    /// What the API drives the running machine through.
    fn supervisor(&self, start_paused: bool) -> Arc<Supervisor> {
        let initial = if start_paused {
            RunState::Paused
        } else {
            RunState::Running
        };
        let ops: Arc<dyn MachineOps> = self.core.clone();
        let supervisor = Arc::new(Supervisor::new(
            self.context.control.clone(),
            Some(ops),
            initial,
        ));
        supervisor.set_power(self.context.power.clone());
        supervisor
    }

    /// Serves the API once the machine runs (`started`); returns the socket's guard, which
    /// removes the socket when the machine ends.
    fn serve_api(
        &mut self,
        supervisor: &Arc<Supervisor>,
        started: bool,
    ) -> Result<Option<SocketGuard>> {
        Ok(match self.api.take() {
            Some(ApiSetup::Own(listener, info, guard)) if started => {
                let api = self.api_of(supervisor, info);
                crate::api::http::serve(listener, Arc::new(Server::running(api)))?;
                Some(guard)
            }
            Some(ApiSetup::Attached(server, info)) if started => {
                server.attach(self.api_of(supervisor, info));
                None
            }
            Some(ApiSetup::Own(_, _, guard)) => Some(guard),
            _ => None,
        })
    }

    /// How the machine ended, once every thread stopped: a lost or corrupt guest and a
    /// failed start come before the guest's own outcome.
    fn conclude(
        &self,
        outcome: Option<Outcome>,
        start_error: Option<Error>,
        failures: Vec<Error>,
    ) -> Result<Outcome> {
        // A lazily restored snapshot whose page data proved corrupt: that is the error, however
        // the guest ended.
        let corrupt = self.core.restored.get().and_then(|m| {
            m.stop();
            m.failure()
        });
        let lost = self
            .core
            .postcopy
            .get()
            .and_then(|p| p.failure())
            .or_else(|| self.core.guest_lost.get().cloned())
            .map(Error::MigrationGuestLost);
        if let Some(e) = lost.or(start_error).or(corrupt) {
            return Err(e);
        }
        match outcome {
            Some(Outcome::Guest(ExitReason::Failed)) => {
                Err(Error::Control("the VMM stopped the guest".into()))
            }
            Some(Outcome::Guest(ExitReason::VcpuFailed(_))) | None => Err(failures
                .into_iter()
                .next()
                .unwrap_or_else(|| Error::Devices("a vCPU stopped without a reason".into()))),
            Some(outcome) => Ok(outcome),
        }
    }
}

impl Machine {
    fn api_of(&self, supervisor: &Arc<Supervisor>, info: MachineInfo) -> Arc<Api> {
        let mut api = Api::new(supervisor.clone(), self.context.exit.clone(), info);
        api.serial = self.serial_queue();
        api.keyboard = self.keyboard.clone();
        api.completer = Some(self.context.completer.clone());
        Arc::new(api)
    }

    /// Gives the guest's last console output a moment to reach its reader, and says how much
    /// was dropped because nobody read it.
    fn finish_serial_output(&self) {
        let Some(queue) = self.serial_queue() else {
            return;
        };
        if !queue.drain(SERIAL_DRAIN_AT_EXIT) {
            log::warn!(
                "serial: the reader of the guest's output is not reading; not waiting for it"
            );
        }
        let dropped = queue.dropped();
        if dropped > 0 {
            log::warn!(
                "serial: {dropped} bytes of guest output were dropped: its reader did not keep up"
            );
        }
    }

    fn serial_queue(&self) -> Option<Arc<devices::output::OutputQueue>> {
        self.serial_output.clone()
    }
}

/// With `--restore`, the snapshot decides the machine's shape: a `--memory`, `--cpus` or
/// `--irqchip` given anyway must match it.
fn check_shape_against_snapshot(
    config: &VmConfig,
    saved: &migration::MigrationConfig,
) -> Result<()> {
    let given = config.shape_given;
    let irqchip = match config.irqchip {
        IrqChipKind::Kernel => "kernel",
        IrqChipKind::Split => "split",
    };
    let checks = [
        (
            "--memory",
            given.memory && config.memory != saved.memory_size,
            config.memory_text.clone(),
            format!("{} MiB of RAM", saved.memory_size >> 20),
        ),
        (
            "--cpus",
            given.cpus && config.cpus != saved.vcpus,
            config.cpus.to_string(),
            saved.vcpus.to_string(),
        ),
        (
            "--irqchip",
            given.irqchip && irqchip != saved.irqchip,
            irqchip.to_string(),
            saved.irqchip.clone(),
        ),
    ];
    match checks.into_iter().find(|(_, differs, _, _)| *differs) {
        Some((option, _, value, saved_value)) => Err(Error::Option {
            option,
            value,
            reason: format!(
                "the snapshot's machine has {saved_value} (leave the option out with --restore)"
            ),
        }),
        None => Ok(()),
    }
}

/// Binds the `--incoming` listener and says where it listens (the port the system picked
/// for port 0).
fn listen_for_migration(addr: &str) -> Result<TcpListener> {
    let error = |e: std::io::Error| Error::Option {
        option: "--incoming",
        value: format!("tcp:{addr}"),
        reason: e.to_string(),
    };
    let listener = TcpListener::bind(addr).map_err(error)?;
    let local = listener.local_addr().map_err(error)?;
    eprintln!("listening on {local}");
    Ok(listener)
}

/// How long a migration destination waits for its source to let go of the disks.
const HANDOVER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A migration destination with the state applied: asks the source to let go of its disk
/// image locks and takes them, before the guest runs here. The source lets go as soon as it
/// reads the request, so a lock still held is retried until [`HANDOVER_TIMEOUT`].
fn take_over_from_source(ack: &mut AckSender, devices: &DeviceList) -> Result<()> {
    ack.handover().map_err(|e| {
        Error::Migration(format!("cannot ask the source to hand its disks over: {e}"))
    })?;
    let deadline = std::time::Instant::now() + HANDOVER_TIMEOUT;
    loop {
        match devices.take_over() {
            Ok(()) => return Ok(()),
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(Error::Migration(format!(
                    "the source did not hand its disks over: {e}"
                )))
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
}

/// Writes the firmware tables and loads the kernel: the BSP's entry state.
fn load_firmware_and_kernel(
    config: &VmConfig,
    guest_memory: &GuestMemory,
    kernel: &mut File,
    initrd: Option<&mut File>,
    kernel_pm_timer: Option<u16>,
) -> Result<boot::BootEntry> {
    let StartFrom::Kernel(path) = &config.start else {
        return Err(Error::Devices("no kernel to load".into()));
    };
    let firmware_err = |e: String| Error::Firmware(e);
    // The FADT points at the kernel's PM timer when it has one (bhyve), else at ferrovm's.
    let pm_timer = kernel_pm_timer.unwrap_or(boot::acpi::PM_TMR_BLK);
    let rsdp = boot::acpi::create_acpi_tables(guest_memory, config.cpus, config.memory, pm_timer)
        .map_err(|e| firmware_err(e.to_string()))?;
    boot::mptable::create_mptable(guest_memory, config.cpus)
        .map_err(|e| firmware_err(e.to_string()))?;
    let boot_config = boot::BootConfig {
        cmdline: config.cmdline.clone(),
        mem_size: config.memory,
        rsdp: Some(rsdp),
        // A Multiboot command line starts with the kernel's path, as GRUB and QEMU pass it.
        image_name: Some(path.display().to_string()),
    };
    boot::load_kernel_with_config(
        guest_memory,
        kernel,
        initrd.map(|f| f as &mut dyn boot::ReadSeek),
        &boot_config,
    )
    .map_err(|source| Error::Kernel {
        path: path.clone(),
        source,
    })
}

/// Stops every vCPU thread (flag, then kick so a thread inside the guest returns) and
/// collects their failures.
fn stop_vcpus(context: &VcpuContext, threads: Vec<VcpuThread>) -> Vec<Error> {
    context.stop.store(true, Ordering::Release);
    for t in &threads {
        if let Err(e) = t.kicker.kick() {
            log::warn!("cannot kick vCPU {}: {e}", t.id);
        }
    }
    let mut failures = Vec::new();
    for t in threads {
        match t.handle.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failures.push(e),
            Err(_) => failures.push(Error::Vcpu {
                id: t.id,
                reason: "thread panicked".into(),
            }),
        }
    }
    failures
}

fn unix_now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Register state for a 32-bit flat protected-mode entry with paging off, which every boot
/// protocol ferrovm loads (PVH, Multiboot, the Linux 32-bit boot protocol) starts in.
fn set_boot_registers(vcpu: &dyn Vcpu, entry: &boot::BootEntry) -> Result<()> {
    let segment = |selector: u16| {
        let d = boot::gdt::boot_segment(selector).ok_or_else(|| {
            Error::Devices(format!(
                "boot GDT has no descriptor for selector {selector:#x}"
            ))
        })?;
        Ok::<_, Error>(SegmentRegister {
            base: d.base,
            limit: d.limit,
            selector,
            type_: d.type_,
            present: d.present,
            dpl: d.dpl,
            db: d.db,
            s: d.s,
            l: d.l,
            g: d.g,
            avl: d.avl,
            unusable: false,
        })
    };
    let mut sregs = vcpu.sregs()?;
    let code = segment(entry.code_selector)?;
    let data = segment(entry.data_selector)?;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.gdt.base = entry.gdt_base;
    sregs.gdt.limit = entry.gdt_limit;
    // PE and ET; paging, long mode and caches are the guest's business.
    sregs.cr0 = 0x11;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs)?;
    vcpu.set_regs(&StandardRegisters {
        rip: entry.entry_point,
        rax: u64::from(entry.eax),
        rbx: u64::from(entry.ebx),
        rsi: u64::from(entry.esi),
        rsp: entry.stack_pointer.map(u64::from).unwrap_or(0),
        // Bit 1 is reserved and must be set; interrupts off.
        rflags: 0x2,
        ..Default::default()
    })?;
    Ok(())
}

/// `FERROVM_SAMPLE_RIP_MS=N`: kick every vCPU each N ms and log where it was.
fn rip_sample_period() -> Option<i32> {
    std::env::var("FERROVM_SAMPLE_RIP_MS")
        .ok()?
        .parse()
        .ok()
        .filter(|ms: &i32| *ms > 0)
}

/// SIGINT and SIGTERM turned into a readable descriptor the main loop polls beside the
/// guest's exit requests.
struct SignalWatch {
    waker: Waker,
}

/// The `Waker::wake_fd` of the live `SignalWatch`, or -1.
static SIGNAL_WAKE_FD: AtomicI32 = AtomicI32::new(-1);
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

type SignalHandler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

extern "C" fn on_stop_signal(signo: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    LAST_SIGNAL.store(signo, Ordering::SeqCst);
    crate::console::terminal::restore();
    let fd = SIGNAL_WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        let one: u64 = 1;
        // SAFETY: write(2) of an 8-byte local is async-signal-safe; an 8-byte 1 is what a
        // `Waker::wake_fd` takes.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

/// Installs `handler` for `signo`, all signals blocked while it runs. Done with sigaction
/// directly: vmm-sys-util's helper exists on Linux only.
fn install_signal_handler(signo: libc::c_int, handler: SignalHandler) -> std::io::Result<()> {
    // SAFETY: an all-zero sigaction is a valid value to fill in, and the pointers passed are
    // to that live local; the handler makes only async-signal-safe calls.
    let rc = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigfillset(&mut action.sa_mask);
        libc::sigaction(signo, &action, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl SignalWatch {
    fn install() -> Result<Self> {
        let waker = Waker::new()?;
        SIGNAL_WAKE_FD.store(waker.wake_fd(), Ordering::SeqCst);
        for signo in [libc::SIGINT, libc::SIGTERM] {
            install_signal_handler(signo, on_stop_signal)?;
        }
        Ok(SignalWatch { waker })
    }

    /// Blocks until the guest asks to stop or a stop signal arrives.
    fn wait(
        &self,
        exit: &ExitRequest,
        sample: Option<i32>,
        threads: &[VcpuThread],
    ) -> Option<Outcome> {
        loop {
            if let Some(reason) = exit.reason() {
                return Some(Outcome::Guest(reason));
            }
            let signo = LAST_SIGNAL.load(Ordering::SeqCst);
            if signo != 0 {
                return Some(Outcome::Signal(signo));
            }
            let mut fds = [
                libc::pollfd {
                    fd: exit.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.waker.poll_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a valid array of two pollfd structures for the whole call.
            let timeout = sample.unwrap_or(-1);
            // SAFETY: as above.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if rc == 0 {
                for t in threads {
                    let _ = t.kicker.kick();
                }
            }
            if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                log::error!("poll: {}", std::io::Error::last_os_error());
                return None;
            }
        }
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        SIGNAL_WAKE_FD.store(-1, Ordering::SeqCst);
    }
}
