//! virtio 1.x devices and their PCI transport.
//!
//! A device model implements [`VirtioDevice`]: what it offers (type, features, queue
//! sizes, configuration space) and what it does once the driver sets DRIVER_OK
//! ([`VirtioDevice::activate`]): it gets its queues, each with the [`Waker`] that the
//! guest's notifications signal (an ioeventfd on KVM, a write from the transport
//! elsewhere), and an [`Interrupt`] to raise. Devices do their work on their own threads,
//! never on a vCPU thread.
//!
//! The PCI transport ([`VirtioPciDevice`]) turns a `VirtioDevice` into a `pci::PciDevice`.

pub mod transport;

use std::sync::Arc;

use devices::exit::Waker;
use devices::{DeviceState, LifecycleError, StateError};
use vm_memory::GuestMemory;

pub mod balloon;
pub mod block;
pub mod console;
pub mod kind;
#[cfg(target_os = "linux")]
pub mod net;
/// `--net`'s configuration, read on every host.
#[path = "net/config.rs"]
pub mod net_config;
pub mod rng;
#[cfg(all(test, target_os = "linux"))]
mod test_driver;
#[cfg(target_os = "linux")]
pub mod vsock;
/// `--vsock`'s configuration, read on every host.
#[path = "vsock/config.rs"]
pub mod vsock_config;
pub mod worker;

pub use transport::{IoEventError, IoEventRegistrar, VirtioInterrupt, VirtioPciDevice};
pub use worker::Workers;

/// Device type numbers (virtio 1.2, section 5).
pub mod device_type {
    pub const NET: u32 = 1;
    pub const BLOCK: u32 = 2;
    pub const CONSOLE: u32 = 3;
    pub const RNG: u32 = 4;
    pub const BALLOON: u32 = 5;
    pub const VSOCK: u32 = 19;
}

/// How a device tells the driver that a queue has used buffers or its configuration
/// changed. The transport implements it (MSI-X vector, or INTx plus the ISR byte).
pub trait Interrupt: Send + Sync {
    fn signal_queue(&self, queue: u16);
    fn signal_config(&self);
    /// The driver broke the protocol in a way the device cannot step over (a chain head
    /// beyond the queue): DEVICE_NEEDS_RESET and a configuration interrupt (virtio 1.2,
    /// 2.1.2). The device stops serving that queue until the driver resets it.
    fn needs_reset(&self);
    /// A duplicate of the eventfd that interrupts the driver for `queue` in the kernel (the
    /// KVM irqfd of the queue's MSI-X vector), for a device whose queue the kernel serves
    /// (vhost-net). `None` (the default) where there is none: MSI-X off (INTx), no vector,
    /// or no irqfd (bhyve, kernel eventfds off).
    fn queue_irqfd(&self, _queue: u16) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// One queue handed to a device at activation.
pub struct ActiveQueue {
    pub index: u16,
    pub queue: virtio_queue::Queue,
    /// Signalled on every guest notification of this queue.
    pub notify: Arc<Waker>,
}

/// Why a device cannot start with what the driver set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ActivateError(pub String);

/// A virtio device model, independent of the transport.
pub trait VirtioDevice<M: GuestMemory + Send + Sync + 'static>: Send {
    /// One of [`device_type`].
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> Vec<u16>;
    /// Feature bits the device offers (VIRTIO_F_VERSION_1 included).
    fn features(&self) -> u64;
    /// Reads the device-specific configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device-specific configuration space (ignored where read-only).
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// DRIVER_OK: start serving `queues` (the ready ones) with `acked_features`.
    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError>;
    /// The I/O threads the device serves its queues on, for a device that uses
    /// [`Workers`]: the default `reset`, `pause`, `resume` and `queue_states` forward to
    /// them. `None` (the default): the device implements those itself.
    fn workers(&self) -> Option<&Workers> {
        None
    }
    /// [`VirtioDevice::workers`], to change them.
    fn workers_mut(&mut self) -> Option<&mut Workers> {
        None
    }
    /// Device reset by the driver: stop serving (after finishing what is in flight) and
    /// give the queues back, their positions as the device left them. Default: stops the
    /// device's [`Workers`].
    fn reset(&mut self) -> Vec<ActiveQueue> {
        self.workers_mut().map(Workers::stop).unwrap_or_default()
    }
    /// Stop taking requests and complete those in flight (snapshot, migration). Default:
    /// pauses the device's [`Workers`].
    fn pause(&mut self) -> Result<(), LifecycleError> {
        self.workers_mut().map_or(Ok(()), Workers::pause)
    }
    /// Undo `pause`, re-checking every queue for work that arrived meanwhile. Default:
    /// resumes the device's [`Workers`].
    fn resume(&mut self) -> Result<(), LifecycleError> {
        self.workers_mut().map_or(Ok(()), Workers::resume)
    }
    /// Where the device is in each queue it serves (index, virtio-queue state), for the
    /// transport's `save`, which runs while the device is paused. `None`: the device
    /// cannot tell, and an active device of this kind cannot be saved. Default: what the
    /// device's [`Workers`] report, `None` without them.
    fn queue_states(&self) -> Option<Vec<(u16, virtio_queue::QueueState)>> {
        self.workers().and_then(Workers::queue_states)
    }
    /// Migration hand-over, source side: the destination holds the final state, so let go
    /// of what it must take over (a disk image's lock). Called with the device paused.
    fn hand_over(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// Takes those resources: a migration destination before its guest runs, or a source
    /// whose migration failed after `hand_over`.
    fn take_over(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// The device's own state (not the queues, which the transport saves).
    fn save(&self) -> Result<DeviceState, LifecycleError>;
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError>;
}
