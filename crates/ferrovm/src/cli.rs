//! The command line, as DESIGN.md fixes it. Options that ferrovm does not implement yet are
//! accepted by the parser and refused with "not supported yet", never ignored.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use hypervisor::AccelKind;

use vmm::config::{
    parse_boot_order, parse_memory_size, parse_serial, Devices, IrqChipKind, ShapeGiven, StartFrom,
    VmConfig, DEFAULT_FIRMWARE,
};
use vmm::device_kinds::{parse_option, OptionShape, KINDS};

#[derive(Parser, Debug)]
#[command(
    name = "ferrovm",
    version,
    about = "A virtual machine monitor for KVM and bhyve"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Boot a guest: a kernel, or firmware and a disk.
    Run(Box<RunArgs>),
    /// Control a running ferrovm through its API socket.
    Ctl(CtlArgs),
    /// Show the accelerator found and its capabilities.
    Accel(AccelArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum IrqChipArg {
    Kernel,
    Split,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum AccelArg {
    Auto,
    Kvm,
    Bhyve,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Kernel image: Linux bzImage, PVH ELF or Multiboot v1 ELF.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present_any = ["incoming", "restore", "firmware", "disk", "api_socket"]
    )]
    pub kernel: Option<PathBuf>,
    /// Boot through a BIOS firmware ROM (default without --kernel, when a --disk is given:
    /// Debian's SeaBIOS, /usr/share/seabios/bios-256k.bin). With --incoming: the ROM of
    /// the machine that migrates in.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kernel", "restore"])]
    pub firmware: Option<PathBuf>,
    /// The firmware's boot order: `disk` (every --disk in order) or disk ids, `diskN,...`
    /// (the N-th --disk from 0, or the `id=NAME` it was given).
    #[arg(long, value_name = "disk|diskN,...", conflicts_with_all = ["kernel", "restore"])]
    pub boot: Option<String>,
    /// Kernel command line (it may begin with a dash).
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    pub cmdline: Option<String>,
    /// Initial ramdisk.
    #[arg(long, value_name = "FILE")]
    pub initrd: Option<PathBuf>,
    /// Number of vCPUs (default 1; at most 254).
    #[arg(long, value_name = "N")]
    pub cpus: Option<u32>,
    /// Guest RAM: a number with a unit B, K/KiB, M/MiB, G/GiB or T/TiB; a bare number means
    /// MiB (default 256M).
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Where guest RAM lives: anonymous memory (default), a memfd, or a new (or empty) file;
    /// memfd or file is needed for a local update (`migrate unix:PATH`).
    #[arg(long, value_name = "anon|memfd|file:PATH")]
    pub memory_backend: Option<String>,
    /// Where the interrupt controllers live (default kernel).
    #[arg(long, value_enum)]
    pub irqchip: Option<IrqChipArg>,
    /// Accelerator.
    #[arg(long, value_enum, default_value = "auto")]
    pub accel: AccelArg,
    /// Serial console: stdio (input too when stdin is a terminal; Ctrl-A x quits), file:PATH,
    /// socket:PATH (a Unix socket, one client at a time) or none.
    #[arg(
        long,
        value_name = "stdio|file:PATH|socket:PATH|none",
        default_value = "stdio"
    )]
    pub serial: String,
    /// The devices: one option per registered kind (`--disk`, `--net`, `--vsock`,
    /// `--console`, `--rng`...), see `vmm::device_kinds`.
    #[command(flatten)]
    pub devices: DeviceArgs,
    /// Serve the control API on this Unix socket.
    #[arg(long, value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// Lock guest RAM in host memory.
    #[arg(long)]
    pub wired: bool,
    /// Wait for an incoming live migration (unix:PATH: a local update from a ferrovm on
    /// this host, which hands guest RAM over instead of copying it).
    #[arg(
        long,
        value_name = "tcp:HOST:PORT|unix:PATH",
        conflicts_with_all = ["restore", "kernel"]
    )]
    pub incoming: Option<String>,
    /// Restore a snapshot. Guest memory is mapped from the file and read as the guest
    /// touches it; its page data is verified in the background (a corrupt page stops the VM).
    /// The file must not be modified while the VM runs.
    #[arg(long, value_name = "FILE", conflicts_with = "kernel")]
    pub restore: Option<PathBuf>,
    /// With --restore: verify all page data before the guest runs.
    #[arg(long, requires = "restore")]
    pub restore_verify: bool,
    /// With --restore: copy every page into guest RAM before the guest runs (the VM then no
    /// longer depends on the file).
    #[arg(long, requires = "restore")]
    pub restore_eager: bool,
    /// With --restore: run the guest even on a disk image changed since the snapshot (by
    /// default such an image is refused: the guest's memory would not match it).
    #[arg(long, requires = "restore")]
    pub restore_allow_changed_disks: bool,
    /// System call filters on every thread (docs/security.md): `kill` stops the VMM with a
    /// message on a forbidden call, `log` lets the kernel log it, `off` installs none
    /// (default kill on x86-64 Linux, off elsewhere; FERROVM_SECCOMP sets the default).
    #[arg(long, value_enum, env = "FERROVM_SECCOMP", value_name = "off|log|kill")]
    pub seccomp: Option<SeccompArg>,
}

/// The options of the registered device kinds, each as its kind spells it (see
/// `vmm::device_kinds::KINDS`): the values as given, by kind.
#[derive(Debug, Default)]
pub struct DeviceArgs {
    values: Vec<(usize, Vec<String>)>,
}

impl DeviceArgs {
    /// The devices, kind by kind in the registry's order (the order they take PCI slots),
    /// in the order given within a kind.
    fn parse(&self) -> anyhow::Result<Devices> {
        let mut devices = Devices::default();
        for (rank, values) in &self.values {
            for value in values {
                if let Some((id, config)) = parse_option(&KINDS[*rank], value)? {
                    devices.add(id, config)?;
                }
            }
        }
        Ok(devices)
    }
}

impl clap::FromArgMatches for DeviceArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut args = DeviceArgs::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        self.values.clear();
        for (rank, kind) in KINDS.iter().enumerate() {
            let values: Vec<String> = match kind.shape {
                OptionShape::Flag if matches.get_flag(kind.name) => vec![String::new()],
                OptionShape::Flag => Vec::new(),
                _ => matches
                    .get_many::<String>(kind.name)
                    .map(|v| v.cloned().collect())
                    .unwrap_or_default(),
            };
            self.values.push((rank, values));
        }
        Ok(())
    }
}

impl clap::Args for DeviceArgs {
    fn augment_args(command: clap::Command) -> clap::Command {
        use clap::{Arg, ArgAction};
        KINDS.iter().fold(command, |command, kind| {
            let help = match kind.shape {
                OptionShape::Flag => kind.help.to_string(),
                OptionShape::Once => format!("{} (`,id=NAME` names it)", kind.help),
                OptionShape::Repeated => {
                    format!("{}; repeatable (`,id=NAME` names it)", kind.help)
                }
            };
            let arg = Arg::new(kind.name).long(kind.name).help(help);
            let arg = match kind.shape {
                OptionShape::Flag => arg.action(ArgAction::SetTrue),
                OptionShape::Once => arg.value_name(kind.syntax).action(ArgAction::Set),
                OptionShape::Repeated => arg.value_name(kind.syntax).action(ArgAction::Append),
            };
            command.arg(arg)
        })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SeccompArg {
    Off,
    Log,
    Kill,
}

impl RunArgs {
    pub fn into_config(self) -> anyhow::Result<VmConfig> {
        self.check_restore_options()?;
        let (restore_verify, restore_eager) = (self.restore_verify, self.restore_eager);
        let devices = self.devices.parse()?;
        let has_disk = !devices.disk_ids().is_empty();
        let mut firmware = self.firmware;
        let start = match (self.kernel, self.restore, self.incoming) {
            (Some(kernel), None, None) => StartFrom::Kernel(kernel),
            (None, Some(file), None) => StartFrom::Restore(file),
            (None, None, Some(addr)) => vmm::incoming_start(&addr, "--incoming")?,
            (None, None, None) if firmware.is_some() || has_disk => {
                firmware.get_or_insert_with(|| PathBuf::from(DEFAULT_FIRMWARE));
                StartFrom::Firmware
            }
            // As Firecracker starts: the configuration comes through the API.
            (None, None, None) if self.api_socket.is_some() => StartFrom::Api,
            _ => bail!(
                "give exactly one of --kernel, --firmware (or a --disk), --restore and \
                 --incoming, or --api-socket alone to configure the VM through the API"
            ),
        };
        let boot_order = parse_boot_order(self.boot.as_deref().unwrap_or("disk"), &devices)?;
        let mut config = VmConfig::new(start);
        config.firmware = firmware;
        config.boot_order = boot_order;
        config.shape_given = ShapeGiven {
            memory: self.memory.is_some(),
            cpus: self.cpus.is_some(),
            irqchip: self.irqchip.is_some(),
        };
        if let Some(memory) = self.memory {
            config.memory = parse_memory_size(&memory)?;
            config.memory_text = memory;
        }
        if let Some(cpus) = self.cpus {
            config.cpus = cpus;
        }
        check_cpus(config.cpus)?;
        config.cmdline = self.cmdline.unwrap_or_default();
        config.initrd = self.initrd;
        config.irqchip = match self.irqchip {
            Some(IrqChipArg::Split) => IrqChipKind::Split,
            Some(IrqChipArg::Kernel) | None => IrqChipKind::Kernel,
        };
        config.accel = match self.accel {
            AccelArg::Auto => AccelKind::Auto,
            AccelArg::Kvm => AccelKind::Kvm,
            AccelArg::Bhyve => AccelKind::Bhyve,
        };
        config.serial = parse_serial(&self.serial)?;
        config.wired = self.wired;
        if let Some(backend) = &self.memory_backend {
            config.memory_backend = vmm::memory::MemoryBackend::parse(backend)?;
        }
        config.api_socket = self.api_socket;
        config.restore_verify = restore_verify;
        config.restore_eager = restore_eager;
        config.restore_allow_changed_disks = self.restore_allow_changed_disks;
        config.devices = devices;
        config.seccomp = match self.seccomp {
            Some(SeccompArg::Off) => sandbox::Mode::Off,
            Some(SeccompArg::Log) => sandbox::Mode::Log,
            Some(SeccompArg::Kill) => sandbox::Mode::Kill,
            None => sandbox::Mode::platform_default(),
        };
        Ok(config)
    }
}

impl RunArgs {
    /// A snapshot holds the kernel, its command line and initrd, in guest RAM: options for
    /// them are refused with `--restore`, never ignored.
    fn check_restore_options(&self) -> anyhow::Result<()> {
        if self.restore.is_none() {
            return Ok(());
        }
        let boot_only = [
            ("--cmdline", self.cmdline.is_some()),
            ("--initrd", self.initrd.is_some()),
        ];
        if let Some((option, _)) = boot_only.iter().find(|(_, given)| *given) {
            bail!("{option} cannot be used with --restore: the snapshot holds the booted guest");
        }
        Ok(())
    }
}

/// 1 to 254 vCPUs: xAPIC IDs are 8 bits, 0xff is the broadcast ID, and the MADT and MP
/// table describe no more. (The accelerator's own limit, if lower, is checked once it is
/// open.)
fn check_cpus(cpus: u32) -> anyhow::Result<()> {
    if cpus == 0 {
        bail!("--cpus 0: a guest needs at least one vCPU");
    }
    let max = boot::layout::MAX_CPUS;
    if cpus > max {
        bail!(
            "--cpus {cpus}: at most {max} vCPUs (xAPIC IDs are 8 bits and the firmware tables \
             describe no more)"
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The API socket of the ferrovm to control.
    #[arg(long, value_name = "PATH")]
    pub api_socket: PathBuf,
    /// Print one JSON object.
    #[arg(long, global = true)]
    pub json: bool,
    /// Seconds to wait for the reply; for `migrate`, between two progress reports.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    #[command(subcommand)]
    pub request: CtlRequest,
}

#[derive(Subcommand, Debug)]
pub enum CtlRequest {
    /// State, vCPUs, memory and migration progress.
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Let the vCPUs run again.
    Resume {
        /// Resume although the last migration's outcome is unknown (first make sure the
        /// destination does not run the guest: it must never run twice).
        #[arg(long)]
        force: bool,
    },
    /// Power the guest off.
    Shutdown,
    /// Write a snapshot of the machine to FILE.
    Snapshot { file: PathBuf },
    /// Live-migrate to a `ferrovm run --incoming` listener. Ctrl-C cancels it.
    Migrate(MigrateArgs),
    /// Stop the migration in progress; the guest runs on here (or stays paused if it was).
    MigrateCancel,
}

/// `ctl migrate`'s options (the fields of `vm.send-migration`'s body).
#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// tcp:HOST:PORT, or unix:PATH for a local update (guest RAM handed over, not copied)
    pub destination: String,
    #[arg(long, value_name = "BYTES_PER_S")]
    pub max_bandwidth: Option<u64>,
    #[arg(long, value_name = "N")]
    pub downtime_ms: Option<u64>,
    #[arg(long, value_name = "N")]
    pub max_rounds: Option<u32>,
    #[arg(long, value_name = "N")]
    pub max_time_s: Option<u64>,
    #[arg(long)]
    pub auto_converge: bool,
    /// Pause the guest first and copy everything (for accelerators without dirty tracking).
    #[arg(long)]
    pub warm: bool,
    /// TCP connections to stripe the pages over (default: host CPUs, at most 4; 1 for a
    /// destination of an earlier build).
    #[arg(long, value_name = "N")]
    pub connections: Option<u32>,
    /// Compress page data: auto (default: while the link is slower than compressing),
    /// none, lz4 or zstd. A destination of an earlier build needs none.
    #[arg(long, value_name = "auto|none|lz4|zstd")]
    pub compress: Option<String>,
    /// Post-copy at once: the destination runs the guest right away and fetches pages on
    /// demand. RISK: if the link fails before every page arrived, the guest is lost.
    #[arg(long, conflicts_with = "post_copy_after_rounds")]
    pub post_copy: bool,
    /// Pre-copy N rounds, then switch to post-copy (same risk as --post-copy).
    #[arg(long, value_name = "N")]
    pub post_copy_after_rounds: Option<u32>,
}

#[derive(Args, Debug)]
pub struct AccelArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Accelerator to query.
    #[arg(long, value_enum, default_value = "auto")]
    pub accel: AccelArg,
}

pub fn print_accel(args: &AccelArgs) -> anyhow::Result<()> {
    let kind = match args.accel {
        AccelArg::Auto => AccelKind::Auto,
        AccelArg::Kvm => AccelKind::Kvm,
        AccelArg::Bhyve => AccelKind::Bhyve,
    };
    let hv = hypervisor::open_accelerator(kind).context("accelerator")?;
    let mut caps = hv.capabilities();
    if caps.kernel_snapshot.is_none() {
        // Only a VM can tell (bhyve probes VM_SNAPSHOT_REQ when one is created): make one
        // and let it go again.
        if hv.create_vm().is_ok() {
            caps = hv.capabilities();
        }
    }
    if args.json {
        println!("{}", serde_json::to_string(&caps)?);
        return Ok(());
    }
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let maybe = |b: Option<bool>| match b {
        Some(b) => yes_no(b),
        None => "not reported by the kernel",
    };
    println!(
        "accelerator:               {} ({})",
        caps.accelerator, caps.backend
    );
    println!("api version:               {}", caps.api_version);
    println!("max vCPUs:                 {}", caps.max_vcpus);
    println!("memory slots:              {}", caps.max_memslots);
    println!("in-kernel irqchip:         {}", yes_no(caps.irqchip_kernel));
    println!("split irqchip:             {}", yes_no(caps.irqchip_split));
    println!("MSI injection:             {}", yes_no(caps.msi_injection));
    println!("irqfd:                     {}", yes_no(caps.irqfd));
    println!("ioeventfd:                 {}", yes_no(caps.ioeventfd));
    println!(
        "dirty log (bitmap):        {}",
        yes_no(caps.dirty_log_bitmap)
    );
    println!(
        "dirty log (ring):          {}",
        if caps.dirty_log_ring_bytes > 0 {
            format!("yes, up to {} bytes", caps.dirty_log_ring_bytes)
        } else {
            "no".into()
        }
    );
    println!(
        "dirty log manual protect:  {}",
        yes_no(caps.dirty_log_manual_protect)
    );
    println!("x2APIC API:                {}", yes_no(caps.x2apic_api));
    println!("user-space MSR exits:      {}", yes_no(caps.user_space_msr));
    println!("immediate exit:            {}", yes_no(caps.immediate_exit));
    println!(
        "XSAVE / XCRs:              {} / {}",
        yes_no(caps.xsave),
        yes_no(caps.xcrs)
    );
    println!("TSC control:               {}", yes_no(caps.tsc_control));
    println!(
        "snapshot, warm migration:  {}",
        match caps.kernel_snapshot {
            Some(true) => "yes",
            Some(false) if caps.accelerator == "bhyve" => {
                "no (needs a kernel built with `options BHYVE_SNAPSHOT`)"
            }
            Some(false) => "no (the kernel cannot save its VM state)",
            None => "unknown (no VM could be created to ask the kernel)",
        }
    );
    println!("TPR shadowing:             {}", maybe(caps.tpr_shadow));
    println!(
        "APIC virtualization:       {}",
        maybe(caps.apic_virtualization)
    );
    println!(
        "posted interrupts:         {}",
        maybe(caps.posted_interrupts)
    );
    println!(
        "guest hypercalls:          {}",
        if caps.hypercalls {
            "yes"
        } else {
            "no (KVM's PV IPIs, PV unhalt and directed yield are not offered)"
        }
    );
    println!("in-kernel RTC:             {}", yes_no(caps.rtc_in_kernel));
    println!(
        "in-kernel ACPI PM timer:   {}",
        match caps.pm_timer_port {
            Some(port) => format!("yes, port {port:#x}"),
            None => "no (ferrovm provides it)".into(),
        }
    );
    Ok(())
}

/// Help and version go to stdout with status 0; every other parse error is one line on
/// stderr with status 2.
pub fn report_usage_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    ) {
        let _ = err.print();
        return ExitCode::SUCCESS;
    }
    let rendered = err.render().to_string();
    let first = rendered
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("invalid command line")
        .trim_start_matches("error: ");
    eprintln!("ferrovm: {first}");
    ExitCode::from(2)
}

/// Firecracker's command line, as its SDKs start the VMM (`--api-sock PATH [--id ID]
/// [--no-seccomp]`): the same as `run --api-socket PATH [--seccomp off]`, the VM then being
/// configured through the API. Returns `None` for ferrovm's own command line; options of
/// Firecracker's that ferrovm does not have are refused, never ignored.
pub fn firecracker_args(
    args: &[std::ffi::OsString],
) -> Option<anyhow::Result<Vec<std::ffi::OsString>>> {
    let first = args.get(1)?.to_str()?;
    if !matches!(first, "--api-sock" | "--id" | "--no-seccomp") {
        return None;
    }
    Some(translate_firecracker_args(&args[1..]).map(|rest| {
        let mut out = vec![args[0].clone(), "run".into()];
        out.extend(rest);
        out
    }))
}

fn translate_firecracker_args(
    args: &[std::ffi::OsString],
) -> anyhow::Result<Vec<std::ffi::OsString>> {
    let mut out = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let mut value = |name: &str| {
            iter.next()
                .cloned()
                .with_context(|| format!("{name}: a value is required"))
        };
        match arg.to_str().unwrap_or("") {
            "--api-sock" => {
                out.push("--api-socket".into());
                out.push(value("--api-sock")?);
            }
            // The VM's name in Firecracker's logs and metrics; ferrovm has neither.
            "--id" => {
                value("--id")?;
            }
            "--no-seccomp" => out.extend(["--seccomp".into(), "off".into()]),
            other => bail!(
                "{other}: not supported in Firecracker's command line (ferrovm accepts \
                 --api-sock, --id and --no-seccomp; its own filters replace \
                 --seccomp-filter)"
            ),
        }
    }
    Ok(out)
}
