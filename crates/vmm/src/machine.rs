//! The machine: accelerator, memory, devices, boot, vCPU threads and the main loop.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use crate::power::PowerControl;
use devices::acpi_pm::AcpiPm;
use devices::bus::{Bus, IoDispatcher};
use devices::debug_exit::DebugExit;
use devices::exit::{ExitReason, ExitRequest, Waker};
use devices::fw_cfg::FwCfg;
use devices::i8042::I8042;
use devices::irqchip::{IrqChip, IrqPin};
use devices::pit::Pit;
use devices::rtc::Rtc;
use devices::serial::SerialDevice;
use hypervisor::{open_accelerator_with, AccelOptions, SegmentRegister, StandardRegisters, Vcpu};
use pci::{HostBridge, PciBus, PciLayout, Window};

use crate::api::{Api, MachineInfo, MachineOps, Server};
use crate::config::{IrqChipKind, StartFrom, VmConfig};
use crate::control::RunControl;
use crate::error::{Error, Result};
use crate::firmware;
use crate::irqchip::MachineIrqChip;
use crate::memory::{self, GuestMemory};
use crate::platform::{add_virtio_devices, PciHandles, PlatformDevices, VirtioContext};
use crate::restore::RestoreOptions;
use crate::runstate::{RunState, Supervisor};
use crate::snapshot::{self, Core};
use crate::socket::SocketGuard;
use crate::state::{DeviceList, SharedDevice};
use crate::timers::{TimerDevices, TimerThread, TimerWake};
use crate::vcpu::{self, VcpuContext, VcpuThread};

/// How long the guest's last console output may take to reach its reader at exit.
const SERIAL_DRAIN_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(2);
/// The ACPI SCI line, as the FADT and MADT advertise it.
const ACPI_SCI_IRQ: u32 = 9;
/// The CMOS RTC's periodic/alarm/update interrupt.
const RTC_IRQ: u32 = 8;

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
    sandbox::start(config.seccomp)?;
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
}

struct Machine {
    /// The firmware ROM's mapping and the shadow RAM (firmware machines), kept while the VM
    /// exists.
    _firmware: Option<firmware::FirmwareMemory>,
    /// Memory (kept alive while the VM runs: the kernel maps it), the VM and the devices.
    core: Arc<Core>,
    start: Start,
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
    /// COM1's input (a terminal or a socket), started when the machine runs.
    serial_input: Option<(
        Arc<std::sync::Mutex<SerialDevice>>,
        crate::console::SerialInput,
    )>,
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

impl Machine {
    fn build(config: &VmConfig, attached: Option<Arc<Server>>) -> Result<Self> {
        // A snapshot decides the machine's shape.
        let mut config = config.clone();
        if let StartFrom::Restore(path) = &config.start {
            let saved = snapshot::peek_snapshot_config(path)?;
            check_shape_against_snapshot(&config, &saved)?;
            crate::recorded::apply_to_restore(&mut config, saved.devices.as_ref())?;
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
        }
        let config = &config;
        let rom = firmware::rom_for(config)?;
        memory::validate_size(config.memory, &config.memory_text)?;
        let mut kernel = match &config.start {
            StartFrom::Kernel(path) => Some(open_kernel(config, path)?),
            _ => None,
        };
        let incoming = match &config.start {
            StartFrom::Incoming(addr) => Some(listen_for_migration(addr)?),
            _ => None,
        };
        if let Some(path) = &config.initrd {
            // A device or FIFO would be read as empty or hang: an initrd is a file.
            crate::files::require_regular(path, "initrd")?;
        }
        let mut initrd = match &config.initrd {
            Some(path) => Some(File::open(path).map_err(|e| Error::File {
                path: path.clone(),
                reason: format!("cannot open initrd: {e}"),
            })?),
            None => None,
        };

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
        let vm = hv.create_vm()?;
        // RAM before the interrupt controllers: on some hosts registering memory slots after
        // KVM_CREATE_IRQCHIP costs milliseconds more (measured: 5–7 ms against 0.2 ms).
        let guest_memory = memory::create_guest_memory(config.memory, config.wired)?;
        let (regions, slots, firmware_memory) = match &rom {
            Some(rom) => firmware::map_guest_memory(&vm, &guest_memory, rom)?,
            None => {
                let regions = memory::map_into_vm(&vm, &guest_memory)?;
                (regions.clone(), regions, None)
            }
        };
        // Asked again now that the VM exists: bhyve probes its snapshot support on creation.
        let irqchip = crate::irqchip::create(&vm, config.irqchip, &hv.capabilities())?;

        let entry = match kernel.as_mut() {
            Some(kernel) => Some(load_firmware_and_kernel(
                config,
                &guest_memory,
                kernel,
                initrd.as_mut(),
                caps.pm_timer_port,
            )?),
            // Restored or incoming RAM already holds the firmware tables and the kernel.
            None => None,
        };
        let firmware_boot = config.start == StartFrom::Firmware;
        if let (true, Some(rom)) = (firmware_boot, &rom) {
            firmware::load_bios_alias(&guest_memory, rom)?;
        }

        let exit = Arc::new(ExitRequest::new()?);
        let timer_wake = Arc::new(TimerWake::default());
        let guest_memory = Arc::new(guest_memory);
        let power = Arc::new(PowerControl::new(
            config.cpus,
            config.firmware.is_some(),
            guest_memory.clone(),
        ));
        let (pio, mmio, timers, mut platform) = build_buses(
            config,
            &exit,
            &irqchip,
            &timer_wake,
            caps.rtc_in_kernel,
            &power,
        )?;
        let piix = match &firmware_memory {
            Some(_) => firmware::add_piix(&platform.pci)?,
            None => Vec::new(),
        };
        let functions = add_virtio_devices(
            config,
            &VirtioContext {
                vm: &vm,
                irqchip: &irqchip,
                caps: &caps,
                memory: &guest_memory,
                pci: &platform.pci,
            },
        )?;
        if let Some(fw) = &firmware_memory {
            let machine = firmware::MachineParts {
                pci: &platform.pci,
                fw_cfg: &platform.fw_cfg,
                virtio: &functions,
                kernel_pm_timer: caps.pm_timer_port,
            };
            firmware::attach(fw, config, &machine)?;
        }
        let serial_output = platform.serial_output.clone();
        let keyboard = platform.keyboard.clone();
        let serial_input = platform.serial_input.take();
        let device_list = platform.into_list(piix.into_iter().chain(functions).collect())?;
        if caps.rtc_in_kernel && (entry.is_some() || firmware_boot) {
            // A fresh boot: the kernel's RTC gets the time and the memory sizes firmware
            // would write (a restore brings them back with the kernel's state instead).
            let (below_4g, above_4g) = ram_below_and_above_4g(config.memory);
            vm.init_kernel_rtc(
                unix_now_secs(),
                &devices::rtc::cmos_memory_sizes(below_4g, above_4g),
            )?;
        }
        let context = Arc::new(VcpuContext {
            pio: Arc::new(IoDispatcher::new("pio", Arc::new(pio))),
            mmio: Arc::new(IoDispatcher::new("mmio", Arc::new(mmio))),
            exit,
            stop: Arc::new(AtomicBool::new(false)),
            sample_rip: rip_sample_period().is_some(),
            irqchip: irqchip.clone(),
            control: Arc::new(RunControl::default()),
            power,
            completer: Arc::new(complete::Completer::new()),
            ram: Arc::new(memory::CompletionRam(guest_memory.clone())),
        });

        let irqchip_name = match config.irqchip {
            IrqChipKind::Kernel => "kernel",
            IrqChipKind::Split => "split",
        };
        let mut migration_config =
            snapshot::migration_config(config.memory, config.cpus, irqchip_name, &regions);
        migration_config.devices = crate::recorded::DeviceRecord::value_of(config);
        if let Some(rom) = &rom {
            migration_config
                .extra
                .insert(firmware::CONFIG_KEY.into(), rom.identity());
        }
        let core = Arc::new(Core {
            memory: guest_memory.clone(),
            vm: vm.clone(),
            config: migration_config,
            regions,
            slots,
            control: context.control.clone(),
            devices: device_list,
            timers: timers.gate.clone(),
            msrs: hv.msr_index_list()?,
            irqchip: irqchip.clone(),
            manual_protect: Default::default(),
            dirty_tracking: caps.dirty_log_bitmap,
            vhost_net: config.nets.iter().any(|n| n.vhost),
            restored: Default::default(),
            postcopy: Default::default(),
            guest_lost: Default::default(),
            snapshot_temp: Default::default(),
            devices_held: Default::default(),
        });
        let info = MachineInfo {
            vcpus: config.cpus,
            memory: config.memory,
            irqchip: irqchip_name,
        };
        let api = match (attached, &config.api_socket) {
            (Some(server), _) => Some(ApiSetup::Attached(server, info)),
            (None, Some(path)) => {
                let (listener, guard) = crate::socket::bind(path)?;
                Some(ApiSetup::Own(listener, info, guard))
            }
            (None, None) => None,
        };

        let cpu_setup = crate::cpu_setup::CpuSetup::new(hv.as_ref())?;
        let mut vcpus = Vec::new();
        for id in 0..config.cpus {
            let vcpu = vm.create_vcpu(id)?;
            cpu_setup.configure(vcpu.as_ref(), id, config.cpus)?;
            if let (0, Some(entry)) = (id, &entry) {
                set_boot_registers(vcpu.as_ref(), entry)?;
            }
            if id == 0 && firmware_boot {
                firmware::set_reset_registers(vcpu.as_ref())?;
            }
            vcpus.push(vcpu);
        }
        let start = match (&config.start, incoming) {
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
        };
        Ok(Machine {
            _firmware: firmware_memory,
            core,
            vcpus,
            context,
            timers: Some(timers),
            api,
            restore_paused: config.start_paused,
            start,
            serial_output,
            keyboard,
            serial_input,
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
            Some((com1, input)) => Some(input.start(com1, self.context.exit.clone())?),
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
        self.context
            .control
            .set_kickers(threads.iter().map(|t| t.kicker).collect());
        self.context
            .power
            .set_kickers(threads.iter().map(|t| t.kicker).collect());
        if let (Some(ack), None) = (ack.as_mut(), &start_error) {
            // The guest runs here now: tell the source it may exit.
            if let Err(e) = ack.ack() {
                // The source will resume its own copy: this one must not run on.
                start_error = Some(Error::Migration(format!(
                    "cannot acknowledge the migration ({e}); stopping this copy"
                )));
            }
        }
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
        let _socket = match self.api.take() {
            Some(ApiSetup::Own(listener, info, guard)) if start_error.is_none() => {
                let api = self.api_of(&supervisor, info);
                crate::api::http::serve(listener, Arc::new(Server::running(api)))?;
                Some(guard)
            }
            Some(ApiSetup::Attached(server, info)) if start_error.is_none() => {
                server.attach(self.api_of(&supervisor, info));
                None
            }
            Some(ApiSetup::Own(_, _, guard)) => Some(guard),
            _ => None,
        };
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

/// Guest RAM below the 32-bit MMIO hole and above 4 GiB, as firmware reports it.
fn ram_below_and_above_4g(memory: u64) -> (u64, u64) {
    let below_4g = memory.min(boot::layout::MMIO_HOLE_START);
    (below_4g, memory - below_4g)
}

fn unix_now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn build_buses(
    config: &VmConfig,
    exit: &Arc<ExitRequest>,
    chip: &Arc<dyn MachineIrqChip>,
    timer_wake: &Arc<TimerWake>,
    rtc_in_kernel: bool,
    power: &Arc<PowerControl>,
) -> Result<(Bus, Bus, TimerDevices, PlatformDevices)> {
    let devices_err = |e: devices::bus::BusError| Error::Devices(e.to_string());
    let irqchip: &Arc<dyn IrqChip> = &(chip.clone() as Arc<dyn IrqChip>);
    let mut pio = Bus::new();
    let mut mmio = Bus::new();
    let mut pit = None;
    chip.register(&mut pio, &mut mmio)?;
    if chip.kind() == IrqChipKind::Split {
        let mut model = Pit::new();
        model.set_waker(timer_wake.clone());
        pit = Some(model.register(&mut pio).map_err(devices_err)?);
    }
    // Where the kernel owns ports 0x70-0x71 (bhyve), a model here would never be reached.
    let rtc = if rtc_in_kernel {
        None
    } else {
        let mut rtc = Rtc::new(IrqPin::new(irqchip.clone(), RTC_IRQ));
        rtc.set_waker(timer_wake.clone());
        let (below_4g, above_4g) = ram_below_and_above_4g(config.memory);
        rtc.set_memory_sizes(below_4g, above_4g);
        Some(rtc.register(&mut pio).map_err(devices_err)?)
    };
    let com1_irq = Arc::new(IrqPin::new(irqchip.clone(), devices::serial::COM1_IRQ));
    let com1 = crate::console::build_com1(&config.serial, com1_irq, &mut pio)?;
    let (serial, serial_output) = (com1.device.clone(), com1.output);
    let serial_input = com1.input.map(|input| (com1.device, input));
    DebugExit::new(exit.clone())
        .register(&mut pio)
        .map_err(devices_err)?;
    let keyboard_irq = IrqPin::new(irqchip.clone(), devices::i8042::KEYBOARD_IRQ);
    let i8042 = I8042::new(exit.clone())
        .with_keyboard_irq(keyboard_irq)
        .register(&mut pio)
        .map_err(devices_err)?;
    let mut fw_cfg = FwCfg::new(config.cpus as u16, config.memory);
    fw_cfg
        .add_file("etc/ferrovm/cmdline", config.cmdline.as_bytes().to_vec())
        .map_err(|e| Error::Devices(e.to_string()))?;
    let fw_cfg = fw_cfg.register(&mut pio).map_err(devices_err)?;
    let fw_cfg_handle = fw_cfg.clone();
    let acpi_pm = AcpiPm::new(exit.clone())
        .with_sci(Arc::new(IrqPin::new(irqchip.clone(), ACPI_SCI_IRQ)))
        .with_sleep_control(power.clone())
        .register(&mut pio)
        .map_err(devices_err)?;
    power.attach(acpi_pm.clone(), rtc.clone());
    let pci = build_pci(
        config.memory,
        config.firmware.is_some(),
        irqchip,
        &mut pio,
        &mut mmio,
    )?;
    // The PIIX reset control register (0xcf9) resets the machine, which ends the VM.
    let reset_exit = exit.clone();
    pci.bus.set_reset_handler(Arc::new(move || {
        reset_exit.request(devices::exit::ExitReason::Reset);
    }));
    let keyboard = Some(i8042.clone());
    let mut legacy: Vec<SharedDevice> = vec![serial, i8042, fw_cfg, acpi_pm];
    if config.firmware.is_some() {
        legacy.extend(firmware::add_legacy_devices(&mut pio, exit).map_err(devices_err)?);
    }
    legacy.extend(pit.iter().map(|d| d.clone() as SharedDevice));
    legacy.extend(rtc.iter().map(|d| d.clone() as SharedDevice));
    let devices = PlatformDevices {
        fw_cfg: fw_cfg_handle,
        serial_output,
        serial_input,
        keyboard,
        legacy,
        pci,
        irqchip: Some(chip.clone()),
    };
    let timers = TimerDevices {
        pit,
        rtc,
        irqchip: irqchip.clone(),
        wake: timer_wake.clone(),
        gate: Arc::default(),
    };
    Ok((pio, mmio, timers, devices))
}

/// The PCI platform of every machine: bus 0 with the host bridge in slot 0, configuration
/// mechanism #1 and the I/O BAR window on `pio`, ECAM and the memory BAR windows on `mmio`,
/// in the windows `boot::layout` fixes (and the firmware tables describe), INTx lines on
/// `irqchip`. Functions are added with `PciBus::add_device` through the returned handle
/// before the vCPUs start; `PciBus::intx_line` gives a function its INTx line.
fn build_pci(
    memory: u64,
    firmware: bool,
    irqchip: &Arc<dyn IrqChip>,
    pio: &mut Bus,
    mmio: &mut Bus,
) -> Result<PciHandles> {
    use boot::layout::{
        pci_mmio64_start, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_IO_SIZE, PCI_IO_START,
        PCI_MMIO32_SIZE, PCI_MMIO32_START, PCI_MMIO64_SIZE,
    };
    let pci_err = |e: pci::PciError| Error::Devices(e.to_string());
    let layout = PciLayout {
        ecam: Window::new(PCI_ECAM_START, PCI_ECAM_SIZE),
        // BIOS firmware places BARs itself, anywhere in the hole below the IOAPIC (SeaBIOS:
        // downwards from there); the bus decodes all of it, ECAM excepted.
        mmio32: if firmware {
            Window::new(
                PCI_MMIO32_START,
                boot::layout::IOAPIC_START - PCI_MMIO32_START,
            )
        } else {
            Window::new(PCI_MMIO32_START, PCI_MMIO32_SIZE)
        },
        mmio64: Window::new(pci_mmio64_start(memory), PCI_MMIO64_SIZE),
        io: Window::new(PCI_IO_START, PCI_IO_SIZE),
    };
    let bus = Arc::new(PciBus::new(layout, irqchip.clone()).map_err(pci_err)?);
    let host_bridge = Arc::new(std::sync::Mutex::new(HostBridge::new()));
    bus.add_device_at(0, host_bridge.clone()).map_err(pci_err)?;
    bus.register(pio, mmio)
        .map_err(|e| Error::Devices(format!("PCI: {e}")))?;
    Ok(PciHandles { bus, host_bridge })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config_read(pio: &Bus, reg: u32) -> u32 {
        assert!(pio.write(0xcf8, &(0x8000_0000 | reg).to_le_bytes()));
        let mut data = [0u8; 4];
        assert!(pio.read(0xcfc, &mut data));
        u32::from_le_bytes(data)
    }

    /// What the guest changed on the PCI platform comes back through the machine state.
    #[test]
    fn pci_platform_round_trips_through_the_machine_state() {
        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        let irqchip: Arc<dyn IrqChip> = Arc::new(devices::serial::NoIrq);
        let source = build_pci(256 << 20, false, &irqchip, &mut pio, &mut mmio).unwrap();
        assert_eq!(config_read(&pio, 0), 0x1237_8086);
        // PAM1 and the interrupt line through ECAM, the command register through CF8.
        assert!(mmio.write(0xe000_005a, &[0x33]));
        assert!(mmio.write(0xe000_003c, &[0x0b]));
        assert!(pio.write(0xcf8, &0x8000_0004u32.to_le_bytes()));
        assert!(pio.write(0xcfc, &[0x02, 0x04]));
        let saved = as_list(&source).save().unwrap();
        let json = serde_json::to_vec(&saved).unwrap();

        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        let target = build_pci(256 << 20, false, &irqchip, &mut pio, &mut mmio).unwrap();
        as_list(&target)
            .restore(&serde_json::from_slice(&json).unwrap())
            .unwrap();
        assert_eq!(config_read(&pio, 0x58) >> 16 & 0xff, 0x33, "PAM1");
        assert_eq!(config_read(&pio, 4) & 0xffff, 0x0402, "command");
        assert_eq!(lock_host_bridge(&target).pam()[1], 0x33);
        assert_eq!(config_read(&pio, 0x3c) & 0xff, 0x0b, "interrupt line");
    }

    /// A machine's lifecycle list holding only the PCI platform.
    fn as_list(pci: &PciHandles) -> crate::state::DeviceList {
        PlatformDevices {
            fw_cfg: Arc::new(std::sync::Mutex::new(FwCfg::new(1, 256 << 20))),
            serial_output: None,
            serial_input: None,
            keyboard: None,
            legacy: Vec::new(),
            pci: pci.clone(),
            irqchip: None,
        }
        .into_list(Vec::new())
        .unwrap()
    }

    fn lock_host_bridge(pci: &PciHandles) -> std::sync::MutexGuard<'_, HostBridge> {
        pci.host_bridge.lock().unwrap()
    }
}
