//! Queue notifications: each queue's [`Waker`], and their registration as ioeventfds.
//!
//! A driver notifies queue `q` by writing to BAR0 offset `NOTIFY_OFFSET + 4 * q`. When
//! the write exits to the VMM, the transport wakes the queue's waker itself. Where the
//! hypervisor can turn such writes into an eventfd signal in the kernel (KVM ioeventfd),
//! the VMM implements [`IoEventRegistrar`] and the transport registers every notify
//! address whenever BAR0 moves, so a notification never costs the vCPU a trip to user
//! space, and the vCPU never does device work.

use std::fmt;
use std::sync::Arc;

use devices::exit::Waker;

use super::layout::{NOTIFY_OFFSET, NOTIFY_OFF_MULTIPLIER};

/// Why the VMM could not register a notify address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IoEventError(pub String);

/// Registers guest-physical notify addresses with the hypervisor; the VMM implements it
/// (on KVM with `Vm::register_ioeventfd(waker.poll_fd(), Mmio(address), 0, None)`).
pub trait IoEventRegistrar: Send + Sync {
    /// From now on, a guest write of any width to `address` signals `waker`.
    fn register(&self, address: u64, waker: &Waker) -> Result<(), IoEventError>;
    /// Undoes [`IoEventRegistrar::register`] of the same `address` and `waker`.
    fn unregister(&self, address: u64, waker: &Waker) -> Result<(), IoEventError>;
}

/// BAR0-relative notify offset of queue `queue`.
pub fn notify_offset(queue: u16) -> u64 {
    NOTIFY_OFFSET + u64::from(queue) * u64::from(NOTIFY_OFF_MULTIPLIER)
}

/// The queue a write at `offset` into the notification region notifies.
pub fn notified_queue(offset: u64) -> Option<u16> {
    u16::try_from(offset / u64::from(NOTIFY_OFF_MULTIPLIER)).ok()
}

/// The registrations of one function's notify addresses.
pub struct IoEvents {
    registrar: Option<Arc<dyn IoEventRegistrar>>,
    /// BAR0's base while the addresses are registered with the hypervisor.
    registered_at: Option<u64>,
}

impl fmt::Debug for IoEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoEvents")
            .field("registrar", &self.registrar.is_some())
            .field("registered_at", &self.registered_at)
            .finish()
    }
}

impl IoEvents {
    pub fn new(registrar: Option<Arc<dyn IoEventRegistrar>>) -> Self {
        IoEvents {
            registrar,
            registered_at: None,
        }
    }

    /// Where the addresses are registered now (BAR0's base), if they are.
    pub fn registered_at(&self) -> Option<u64> {
        self.registered_at
    }

    /// BAR0 now decodes at `base` (None: not at all): moves the registrations. If the
    /// hypervisor refuses one, none stay registered and every notification reaches the
    /// transport's BAR write path instead, which works everywhere.
    pub fn bar_moved(&mut self, base: Option<u64>, wakers: &[Arc<Waker>]) {
        let Some(registrar) = self.registrar.clone() else {
            return;
        };
        if let Some(old) = self.registered_at.take() {
            unregister_all(&*registrar, old, wakers);
        }
        let Some(base) = base else {
            return;
        };
        for (queue, waker) in wakers.iter().enumerate() {
            let address = base.wrapping_add(notify_offset(queue as u16)); // queue counts fit u16
            if let Err(e) = registrar.register(address, waker) {
                log::warn!(
                    "virtio-pci: no ioeventfd for notify address {address:#x} ({e}); \
                     notifications go through the VMM"
                );
                unregister_all(&*registrar, base, &wakers[..queue]);
                return;
            }
        }
        self.registered_at = Some(base);
    }
}

fn unregister_all(registrar: &dyn IoEventRegistrar, base: u64, wakers: &[Arc<Waker>]) {
    for (queue, waker) in wakers.iter().enumerate() {
        let address = base.wrapping_add(notify_offset(queue as u16));
        if let Err(e) = registrar.unregister(address, waker) {
            log::warn!("virtio-pci: cannot unregister notify address {address:#x}: {e}");
        }
    }
}
