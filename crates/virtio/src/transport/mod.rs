//! The virtio 1.x PCI transport (modern only): [`VirtioPciDevice`] turns a
//! [`VirtioDevice`] into a `pci::PciDevice`.
//!
//! The function is `1af4:(1040 + device type)`, revision 1, with one 64-bit memory BAR
//! (see [`layout`] for what lives where), the virtio vendor capabilities (common, notify,
//! ISR, device, PCI-configuration access) and an MSI-X capability with one vector per
//! queue plus one for configuration changes. INTx (pin A) is used while MSI-X is off.
//!
//! Guest accesses arrive on vCPU threads; the device works on its own threads and
//! interrupts through [`VirtioInterrupt`], which never takes the transport's lock.

mod common;
mod config_space;
mod interrupt;
pub mod layout;
mod notify;
mod registers;
mod state;

#[cfg(all(test, target_os = "linux"))]
mod tests;

use std::fmt;
use std::sync::Arc;

use devices::exit::Waker;
use devices::irqchip::IrqPin;
use pci::msix::{Msix, MsixLocation};
use pci::MsiTarget;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{Queue, QueueState};
use vm_memory::GuestMemory;

use crate::VirtioDevice;
use common::CommonRegs;
use config_space::{ConfigSpace, Identity};
use layout::BarLayout;

pub use common::NO_VECTOR;
pub use interrupt::VirtioInterrupt;
pub use notify::{IoEventError, IoEventRegistrar};

/// PCI vendor ID of virtio devices.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Modern virtio device IDs are this plus the device type.
pub const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;
/// Most queues a device may have (the notify region and MSI-X table stay small).
pub const MAX_QUEUES: usize = 1024;

const STATUS_ACKNOWLEDGE: u8 = VIRTIO_CONFIG_S_ACKNOWLEDGE as u8;
const STATUS_DRIVER: u8 = VIRTIO_CONFIG_S_DRIVER as u8;
const STATUS_DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
const STATUS_FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
const STATUS_NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
const STATUS_FAILED: u8 = VIRTIO_CONFIG_S_FAILED as u8;
/// The status bits a driver may set.
const STATUS_DRIVER_BITS: u8 =
    STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK | STATUS_FEATURES_OK | STATUS_FAILED;

/// Transport feature bits (28..=41) the transport implements; it withholds the others.
const TRANSPORT_FEATURES: u64 =
    (1 << VIRTIO_RING_F_INDIRECT_DESC) | (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << VIRTIO_F_VERSION_1);
const TRANSPORT_FEATURE_RANGE: u64 = ((1 << 42) - 1) & !((1 << 28) - 1);

/// Why a transport could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("virtio device has {0} queues (1..={MAX_QUEUES} supported)")]
    QueueCount(usize),
    #[error("queue {0}: maximum size {1} is not a power of two in 1..=32768")]
    QueueSize(usize, u16),
    #[error("virtio device type {0} has no PCI device ID")]
    DeviceType(u32),
    #[error("MSI-X: {0}")]
    Msix(#[from] pci::msix::MsixError),
    #[error("queue notifier: {0}")]
    Waker(#[from] std::io::Error),
}

/// A virtio device on PCI.
pub struct VirtioPciDevice<M: GuestMemory + Send + Sync + 'static> {
    id: String,
    device: Box<dyn VirtioDevice<M>>,
    mem: Arc<M>,
    queue_max_sizes: Vec<u16>,
    /// The features the driver is offered: the device's plus the transport's.
    offered_features: u64,
    layout: BarLayout,
    config: ConfigSpace,
    common: CommonRegs,
    interrupt: Arc<VirtioInterrupt>,
    notifiers: Vec<Arc<Waker>>,
    ioevents: notify::IoEvents,
    /// The device is serving its queues (between `activate` and `reset`).
    active: bool,
    /// Restored as active: `resume` activates the device and re-kicks its queues.
    activate_on_resume: bool,
}

impl<M: GuestMemory + Send + Sync + 'static> fmt::Debug for VirtioPciDevice<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("id", &self.id)
            .field("common", &self.common)
            .field("active", &self.active)
            .finish_non_exhaustive()
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioPciDevice<M> {
    /// Wraps `device` as PCI function `id` ("pci-00:03.0", the name its state is saved
    /// under). Its queues live in `mem`; MSI-X messages go to `msi`; INTx drives `intx`
    /// (the GSI of the slot's pin A); `ioevents`, if the hypervisor has them, registers
    /// the notify addresses whenever BAR0 moves.
    pub fn new(
        id: String,
        device: Box<dyn VirtioDevice<M>>,
        mem: Arc<M>,
        msi: Arc<dyn MsiTarget>,
        intx: IrqPin,
        ioevents: Option<Arc<dyn IoEventRegistrar>>,
    ) -> Result<Self, TransportError> {
        let queue_max_sizes = checked_queue_sizes(device.queue_max_sizes())?;
        let num_queues = queue_max_sizes.len() as u16; // at most MAX_QUEUES
        let vectors = num_queues + 1;
        let layout = BarLayout::new(num_queues, vectors);
        let msix = Msix::new(vectors, msix_location(&layout), msi)?;
        let identity = identity(device.device_type())?;
        let interrupt_line = u8::try_from(intx.gsi()).unwrap_or(0xff);
        let capabilities = layout.vendor_capabilities();
        let config = ConfigSpace::new(&identity, layout.size, interrupt_line, &capabilities);
        let notifiers = (0..num_queues)
            .map(|_| Waker::new().map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let offered_features = (device.features() & !TRANSPORT_FEATURE_RANGE) | TRANSPORT_FEATURES;
        Ok(VirtioPciDevice {
            id,
            common: CommonRegs::new(&queue_max_sizes),
            interrupt: Arc::new(VirtioInterrupt::new(msix, intx, queue_max_sizes.len())),
            queue_max_sizes,
            offered_features,
            layout,
            config,
            device,
            mem,
            notifiers,
            ioevents: notify::IoEvents::new(ioevents),
            active: false,
            activate_on_resume: false,
        })
    }

    /// Each queue's notify address (relative to BAR0) and the waker a write there
    /// signals, for a VMM that registers ioeventfds itself.
    pub fn notify_events(&self) -> Vec<(u64, Arc<Waker>)> {
        self.notifiers
            .iter()
            .enumerate()
            .map(|(queue, waker)| (notify::notify_offset(queue as u16), waker.clone()))
            .collect()
    }

    /// The interrupt the device raises (also handed to it at activation).
    pub fn interrupt(&self) -> Arc<VirtioInterrupt> {
        self.interrupt.clone()
    }

    /// BAR0's layout.
    pub fn layout(&self) -> &BarLayout {
        &self.layout
    }

    /// The feature bits offered to the driver.
    pub fn offered_features(&self) -> u64 {
        self.offered_features
    }

    /// The device status register.
    pub fn status(&self) -> u8 {
        if self.interrupt.broken() {
            self.common.status | STATUS_NEEDS_RESET
        } else {
            self.common.status
        }
    }

    /// BAR0's base while the notify addresses are registered as ioeventfds.
    pub fn ioevents_registered_at(&self) -> Option<u64> {
        self.ioevents.registered_at()
    }

    /// Whether the device is serving its queues.
    pub fn is_active(&self) -> bool {
        self.active
    }
}

/// The device's queue sizes, checked.
fn checked_queue_sizes(sizes: Vec<u16>) -> Result<Vec<u16>, TransportError> {
    if sizes.is_empty() || sizes.len() > MAX_QUEUES {
        return Err(TransportError::QueueCount(sizes.len()));
    }
    for (queue, &size) in sizes.iter().enumerate() {
        if Queue::try_from(QueueState {
            max_size: size,
            size,
            ..Default::default()
        })
        .is_err()
        {
            return Err(TransportError::QueueSize(queue, size));
        }
    }
    Ok(sizes)
}

fn msix_location(layout: &BarLayout) -> MsixLocation {
    MsixLocation {
        table_bar: layout::BAR_INDEX as u8,
        table_offset: layout.table_offset as u32, // the BAR stays far below 4 GiB
        pba_bar: layout::BAR_INDEX as u8,
        pba_offset: layout.pba_offset as u32,
    }
}

/// The IDs and class of a device type (classes as QEMU gives them, block excepted).
fn identity(device_type: u32) -> Result<Identity, TransportError> {
    let type_id = u16::try_from(device_type)
        .ok()
        .filter(|t| *t < 0x40)
        .ok_or(TransportError::DeviceType(device_type))?;
    let class_code = match device_type {
        crate::device_type::BLOCK => 0x01_80_00, // mass storage, other
        crate::device_type::NET => 0x02_00_00,   // Ethernet
        crate::device_type::CONSOLE | crate::device_type::VSOCK => 0x07_80_00, // communication, other
        _ => 0x00_ff_00,
    };
    Ok(Identity {
        vendor_id: VIRTIO_PCI_VENDOR,
        device_id: VIRTIO_PCI_DEVICE_BASE + type_id,
        revision: 1,
        class_code,
        subsystem_vendor_id: VIRTIO_PCI_VENDOR,
        subsystem_id: type_id,
    })
}
