//! The machine's devices as one platform: the legacy PC devices, the PCI bus with its host
//! bridge and the virtio functions the user asked for, assembled into the one lifecycle
//! list that snapshots and migration walk.

use std::sync::{Arc, Mutex};

use devices::irqchip::{IrqChip, IrqPin};
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use hypervisor::{Capabilities, Vm};
use pci::{HostBridge, IntxLine, IntxPin, PciBus};
use virtio::block::{Block, BlockOptions, CacheMode};
use virtio::console::{Console, ConsoleInput, ConsoleOutput};
use virtio::rng::Rng;
use virtio::{IoEventRegistrar, VirtioDevice, VirtioPciDevice};

use crate::config::{ConsoleConfig, DiskCache, DiskConfig, SerialOutput, VmConfig};
use crate::error::{Error, Result};
use crate::ioevents::VmIoEvents;
use crate::memory::GuestMemory;
use crate::msi::{GsiAllocator, VmMsiTarget};
use crate::state::{DeviceList, SharedDevice};

/// Highest GSI handed to device MSI routes (KVM's routing table holds 4096 entries).
const MAX_MSI_GSI: u32 = 4096;

/// PCI bus 0 and its host bridge.
#[derive(Clone)]
pub struct PciHandles {
    pub bus: Arc<PciBus>,
    pub host_bridge: Arc<Mutex<HostBridge>>,
}

/// One function's INTx pin as the interrupt line a transport drives: levels go through the
/// router, which ORs the functions sharing the GSI.
struct IntxPinChip(Mutex<IntxLine>);

impl IrqChip for IntxPinChip {
    fn set_irq(&self, _gsi: u32, level: bool) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).set(level);
    }
}

/// Every device model of a machine before its lifecycle list is made.
pub struct PlatformDevices {
    /// Serial, i8042, fw_cfg, ACPI PM, and the PIT and RTC where the VMM models them.
    pub legacy: Vec<SharedDevice>,
    pub pci: PciHandles,
    /// The interrupt controllers (absent only in tests of other parts).
    pub irqchip: Option<Arc<dyn crate::irqchip::MachineIrqChip>>,
}

/// The PCI bus in the lifecycle list: it records where each BAR decodes, and restoring it
/// after the functions re-derives the BAR dispatch from their restored registers.
struct PciBusLifecycle(Arc<PciBus>);

impl Lifecycle for PciBusLifecycle {
    fn id(&self) -> String {
        self.0.id()
    }
    fn save(&self) -> std::result::Result<DeviceState, LifecycleError> {
        self.0.save()
    }
    fn restore(&mut self, state: &DeviceState) -> std::result::Result<(), StateError> {
        self.0.restore_saved(state)
    }
    fn reset(&mut self) {
        self.0.reset_placements();
    }
}

impl PlatformDevices {
    /// The lifecycle list in restore order: the legacy devices, the PCI functions (host
    /// bridge first), the PCI bus, and the interrupt controller last, since restoring the
    /// others may drive its lines.
    pub fn into_list(self, functions: Vec<SharedDevice>) -> Result<DeviceList> {
        let mut list = DeviceList::default();
        let bridge: SharedDevice = self.pci.host_bridge;
        let bus: SharedDevice = Arc::new(Mutex::new(PciBusLifecycle(self.pci.bus)));
        let chip = self.irqchip.map(crate::irqchip::IrqChipDevice::shared);
        let ordered = self
            .legacy
            .into_iter()
            .chain(std::iter::once(bridge))
            .chain(functions)
            .chain(std::iter::once(bus))
            .chain(chip);
        for device in ordered {
            list.add(device)?;
        }
        Ok(list)
    }
}

/// What the virtio functions need from the machine.
pub struct VirtioContext<'a> {
    pub vm: &'a Arc<dyn Vm>,
    /// Injects MSIs where the kernel has no irqfd.
    pub irqchip: &'a Arc<dyn crate::irqchip::MachineIrqChip>,
    pub caps: &'a Capabilities,
    pub memory: &'a Arc<GuestMemory>,
    pub pci: &'a PciHandles,
}

/// Creates the virtio functions `config` asks for (disks in order, then the console and
/// the rng) and puts them on the PCI bus. Returns them for the lifecycle list.
pub fn add_virtio_devices(config: &VmConfig, ctx: &VirtioContext) -> Result<Vec<SharedDevice>> {
    let kernel_paths = kernel_eventfds_wanted();
    let gsis = (kernel_paths && ctx.caps.irqfd).then(|| Arc::new(GsiAllocator::new(MAX_MSI_GSI)));
    let ioevents: Option<Arc<dyn IoEventRegistrar>> = (kernel_paths && ctx.caps.ioeventfd)
        .then(|| Arc::new(VmIoEvents { vm: ctx.vm.clone() }) as Arc<dyn IoEventRegistrar>);
    let mut models: Vec<(&str, Box<dyn VirtioDevice<GuestMemory>>)> = Vec::new();
    for disk in &config.disks {
        models.push(("virtio-blk", Box::new(open_disk(disk, config)?)));
    }
    if config.console == ConsoleConfig::Virtio {
        models.push(("virtio-console", Box::new(open_console(&config.serial)?)));
    }
    if config.rng {
        models.push(("virtio-rng", Box::new(Rng::new())));
    }
    let kernel_queues = kernel_paths && ctx.caps.irqfd && ctx.caps.ioeventfd;
    for net in &config.nets {
        let threads = net.iothreads.unwrap_or_else(|| {
            crate::config::default_net_threads(net.queues, config.cpus, crate::host_cpus())
        });
        models.push((
            "virtio-net",
            open_net(net, threads, ctx.memory, kernel_queues)?,
        ));
    }
    if let Some(vsock) = &config.vsock {
        models.push(("virtio-vsock", open_vsock(vsock)?));
    }
    let mut functions = Vec::new();
    for (kind, model) in models {
        functions.push(plug(ctx, kind, model, gsis.clone(), ioevents.clone())?);
    }
    Ok(functions)
}

/// `FERROVM_KERNEL_EVENTFDS=off` makes the devices take the paths of a kernel without
/// irqfd and ioeventfd (bhyve's): notifications as MMIO exits, MSIs injected from user space.
/// For tests and diagnosis; the kernel paths are used wherever they exist otherwise.
fn kernel_eventfds_wanted() -> bool {
    std::env::var("FERROVM_KERNEL_EVENTFDS").map_or(true, |v| v != "off")
}

/// Wraps one device model in the virtio-pci transport and adds it to the bus.
fn plug(
    ctx: &VirtioContext,
    kind: &str,
    model: Box<dyn VirtioDevice<GuestMemory>>,
    gsis: Option<Arc<GsiAllocator>>,
    ioevents: Option<Arc<dyn IoEventRegistrar>>,
) -> Result<SharedDevice> {
    let pci_err = |e: pci::PciError| Error::Devices(format!("{kind}: {e}"));
    let slot = ctx
        .pci
        .bus
        .free_slot()
        .ok_or(pci::PciError::NoFreeSlot)
        .map_err(pci_err)?;
    let line = ctx
        .pci
        .bus
        .intx_line(slot, IntxPin::A)
        .ok_or(pci::PciError::BadSlot(slot))
        .map_err(pci_err)?;
    let intx = IrqPin::new(
        Arc::new(IntxPinChip(Mutex::new(line))),
        pci::intx_gsi(slot, IntxPin::A),
    );
    let vectors = model.queue_max_sizes().len() as u16 + 1;
    let msi = Arc::new(VmMsiTarget::new(
        ctx.vm.clone(),
        ctx.irqchip.clone(),
        gsis,
        vectors,
    ));
    let id = format!("pci-00:{slot:02x}.0");
    let function = VirtioPciDevice::new(id, model, ctx.memory.clone(), msi, intx, ioevents)
        .map_err(|e| Error::Devices(format!("{kind}: {e}")))?;
    let function = Arc::new(Mutex::new(function));
    ctx.pci
        .bus
        .add_device_at(slot, function.clone())
        .map_err(pci_err)?;
    Ok(function)
}

/// Opens a `--disk` image of the machine `config` describes.
fn open_disk(disk: &DiskConfig, config: &VmConfig) -> Result<Block> {
    use crate::config::StartFrom;
    // A migration destination takes the locks from its source at the hand-over.
    let defer_lock = matches!(
        config.start,
        StartFrom::Incoming(_) | StartFrom::IncomingLocal(_)
    );
    let expect_unchanged =
        matches!(config.start, StartFrom::Restore(_)) && !config.restore_allow_changed_disks;
    let options = BlockOptions {
        path: disk.path.clone(),
        readonly: disk.readonly,
        serial: disk.serial.clone(),
        cache: match disk.cache {
            DiskCache::Writeback => CacheMode::Writeback,
            DiskCache::None => CacheMode::None,
        },
        queues: disk.queues,
        defer_lock,
        expect_unchanged,
    };
    Block::new(options).map_err(|e| Error::Option {
        option: "--disk",
        value: disk.path.display().to_string(),
        reason: e.what,
    })
}

/// `--vsock`: the device and its listening socket.
#[cfg(target_os = "linux")]
fn open_vsock(vsock: &crate::config::VsockConfig) -> Result<Box<dyn VirtioDevice<GuestMemory>>> {
    let device =
        virtio::vsock::Vsock::new(vsock.cid, vsock.socket.clone()).map_err(|e| Error::Option {
            option: "--vsock",
            value: format!("cid={},socket={}", vsock.cid, vsock.socket.display()),
            reason: e.to_string(),
        })?;
    Ok(Box::new(device))
}

#[cfg(not(target_os = "linux"))]
fn open_vsock(_vsock: &crate::config::VsockConfig) -> Result<Box<dyn VirtioDevice<GuestMemory>>> {
    Err(Error::Option {
        option: "--vsock",
        value: String::new(),
        reason: "virtio-vsock is supported on Linux only".into(),
    })
}

/// `--net`: a virtio-net device on its tap (Linux only). `vhost=on` needs the kernel's
/// irqfd and ioeventfd (`kernel_queues`) and `/dev/vhost-net`; without either it is refused.
fn open_net(
    net: &crate::config::NetConfig,
    io_threads: u16,
    memory: &Arc<GuestMemory>,
    kernel_queues: bool,
) -> Result<Box<dyn VirtioDevice<GuestMemory>>> {
    let refuse = |reason: String| Error::Option {
        option: "--net",
        value: format!("tap={}", net.tap),
        reason,
    };
    #[cfg(target_os = "linux")]
    {
        let mut mac = [0u8; 6];
        match net.mac {
            Some(given) => mac = given,
            None => {
                // Locally administered, unicast, QEMU's 52:54:00 prefix.
                mac[..3].copy_from_slice(&[0x52, 0x54, 0x00]);
                virtio::rng::fill_random(&mut mac[3..]).map_err(|e| refuse(e.to_string()))?;
            }
        }
        let options = virtio::net::NetOptions {
            tap: net.tap.clone(),
            mac,
            queue_pairs: net.queues,
            io_threads,
        };
        if net.vhost && !kernel_queues {
            return Err(refuse(
                "vhost=on: vhost-net needs the accelerator's irqfd and ioeventfd \
                 (KVM, with FERROVM_KERNEL_EVENTFDS not off); use vhost=off"
                    .into(),
            ));
        }
        let mut device = virtio::net::Net::new(options).map_err(|e| refuse(e.to_string()))?;
        if net.vhost {
            let taps = device.tap_files().map_err(|e| refuse(e.to_string()))?;
            let kernel = virtio::net::vhost::open_kernel(memory.clone(), taps)
                .map_err(|e| refuse(format!("vhost=on: {e}")))?;
            device.use_kernel_path(Box::new(kernel));
            log::info!("virtio-net {}: queues served by vhost-net", net.tap);
        }
        Ok(Box::new(device))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (memory, kernel_queues, io_threads);
        Err(refuse("virtio-net needs a Linux tap device".into()))
    }
}

/// `--console virtio`: hvc0 writes where the serial port would.
fn open_console(serial: &SerialOutput) -> Result<Console> {
    let output = match serial {
        SerialOutput::Stdio => ConsoleOutput::Stdout,
        SerialOutput::File(path) => ConsoleOutput::File(path.clone()),
        SerialOutput::None | SerialOutput::Socket(_) => {
            return Err(Error::Option {
                option: "--console",
                value: "virtio".into(),
                reason: "the virtio console writes where --serial does, which must be stdio \
                         or a file"
                    .into(),
            })
        }
    };
    Console::new(output, ConsoleInput::None).map_err(|e| Error::Option {
        option: "--console",
        value: "virtio".into(),
        reason: e.to_string(),
    })
}
