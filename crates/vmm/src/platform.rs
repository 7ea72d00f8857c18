//! The machine's devices as one platform: the legacy PC devices, the PCI bus with its host
//! bridge and the devices of the machine's list (each built by its kind, see
//! `device_kinds`), assembled into the one lifecycle list that snapshots and migration
//! walk.

use std::sync::{Arc, Mutex};

use devices::irqchip::{IrqChip, IrqPin};
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use hypervisor::{Capabilities, Vm};
use pci::{HostBridge, IntxLine, IntxPin, PciBus};
use virtio::console::Console;
use virtio::kind::{BuildContext, Start};
use virtio::{IoEventRegistrar, VirtioDevice, VirtioPciDevice};

use crate::config::{StartFrom, VmConfig};
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

/// A device of the machine's list on the PCI bus.
pub struct PlacedDevice {
    /// Its device id, which is also its id in saved state.
    pub id: String,
    pub slot: u8,
    pub function: SharedDevice,
}

/// Creates the devices `config` lists (each through its kind, `device_kinds`) and puts
/// them on the PCI bus, in list order. Every device is made before any takes a slot.
/// `console`: hvc0 as the machine's console made it (`--console virtio`).
pub fn add_virtio_devices(
    config: &VmConfig,
    ctx: &VirtioContext,
    console: Option<Console>,
) -> Result<Vec<PlacedDevice>> {
    let kernel_paths = kernel_eventfds_wanted();
    let gsis = (kernel_paths && ctx.caps.irqfd).then(|| Arc::new(GsiAllocator::new(MAX_MSI_GSI)));
    let ioevents: Option<Arc<dyn IoEventRegistrar>> = (kernel_paths && ctx.caps.ioeventfd)
        .then(|| Arc::new(VmIoEvents { vm: ctx.vm.clone() }) as Arc<dyn IoEventRegistrar>);
    let build = BuildContext {
        memory: ctx.memory,
        start: match &config.start {
            StartFrom::Incoming(_) | StartFrom::IncomingLocal(_) => Start::Incoming,
            StartFrom::Restore(_) => Start::Restore {
                images_may_change: config.restore_allow_changed_disks,
            },
            _ => Start::Boot,
        },
        vcpus: config.cpus,
        host_cpus: crate::host_cpus(),
        kernel_queues: kernel_paths && ctx.caps.irqfd && ctx.caps.ioeventfd,
        console: Mutex::new(console),
    };
    let mut models = Vec::new();
    for entry in config.devices.iter() {
        let model = entry
            .config
            .create(&build)
            .map_err(|reason| Error::Option {
                option: entry.config.kind().option,
                value: entry.config.label(),
                reason,
            })?;
        models.push((entry, model));
    }
    models
        .into_iter()
        .map(|(entry, model)| plug(ctx, &entry.id, model, gsis.clone(), ioevents.clone()))
        .collect()
}

/// `FERROVM_KERNEL_EVENTFDS=off` makes the devices take the paths of a kernel without
/// irqfd and ioeventfd (bhyve's): notifications as MMIO exits, MSIs injected from user space.
/// For tests and diagnosis; the kernel paths are used wherever they exist otherwise.
fn kernel_eventfds_wanted() -> bool {
    std::env::var("FERROVM_KERNEL_EVENTFDS").map_or(true, |v| v != "off")
}

/// Wraps one device model in the virtio-pci transport and adds it to the bus as `id`.
fn plug(
    ctx: &VirtioContext,
    id: &str,
    model: Box<dyn VirtioDevice<GuestMemory>>,
    gsis: Option<Arc<GsiAllocator>>,
    ioevents: Option<Arc<dyn IoEventRegistrar>>,
) -> Result<PlacedDevice> {
    let pci_err = |e: pci::PciError| Error::Devices(format!("{id}: {e}"));
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
    let function = VirtioPciDevice::new(id.into(), model, ctx.memory.clone(), msi, intx, ioevents)
        .map_err(|e| Error::Devices(format!("{id}: {e}")))?;
    let function = Arc::new(Mutex::new(function));
    ctx.pci
        .bus
        .add_device_at(slot, function.clone())
        .map_err(pci_err)?;
    Ok(PlacedDevice {
        id: id.into(),
        slot,
        function,
    })
}
