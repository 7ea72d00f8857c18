//! Where PCI functions' MSI-X messages go: the VMM's side of `pci::MsiTarget`.
//!
//! On KVM every unmasked vector gets a GSI route and an irqfd, so firing it from a device
//! thread is one eventfd write and the kernel injects the interrupt. Where the kernel has
//! no irqfd (bhyve), firing sends the message through `Vm::signal_msi`. Neither path waits
//! for a vCPU.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use devices::exit::Waker;
use hypervisor::{MsiMessage, Vm, FIRST_MSI_GSI};

use crate::irqchip::MachineIrqChip;

/// Hands out GSIs for device MSI routes, one per vector that is ever unmasked.
pub struct GsiAllocator {
    next: AtomicU32,
    /// One past the last GSI the kernel accepts.
    limit: u32,
}

impl GsiAllocator {
    pub fn new(limit: u32) -> Self {
        GsiAllocator {
            next: AtomicU32::new(FIRST_MSI_GSI),
            limit,
        }
    }

    fn allocate(&self) -> Option<u32> {
        self.next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |gsi| {
                (gsi < self.limit).then_some(gsi + 1)
            })
            .ok()
    }
}

/// A vector's kernel route: its GSI and the eventfd registered as its irqfd.
struct Irqfd {
    gsi: u32,
    event: Waker,
}

#[derive(Default)]
struct VectorState {
    message: Option<MsiMessage>,
    irqfd: Option<Irqfd>,
}

/// One PCI function's MSI-X vectors.
pub struct VmMsiTarget {
    vm: Arc<dyn Vm>,
    /// Injects the messages that have no irqfd.
    irqchip: Arc<dyn MachineIrqChip>,
    gsis: Option<Arc<GsiAllocator>>,
    vectors: RwLock<Vec<VectorState>>,
}

impl VmMsiTarget {
    /// `gsis` is `Some` where the kernel has irqfds (`Capabilities::irqfd`).
    pub fn new(
        vm: Arc<dyn Vm>,
        irqchip: Arc<dyn MachineIrqChip>,
        gsis: Option<Arc<GsiAllocator>>,
        vectors: u16,
    ) -> Self {
        VmMsiTarget {
            vm,
            irqchip,
            gsis,
            vectors: RwLock::new((0..vectors).map(|_| VectorState::default()).collect()),
        }
    }

    /// Creates the vector's irqfd on first use; `None` when the kernel route cannot be made
    /// (then the vector falls back to `signal_msi`).
    fn route(&self, slot: &mut VectorState, msi: MsiMessage) -> Option<()> {
        let gsis = self.gsis.as_ref()?;
        if slot.irqfd.is_none() {
            let gsi = gsis.allocate()?;
            let event = Waker::new().ok()?;
            self.vm.set_msi_route(gsi, Some(msi)).ok()?;
            if let Err(e) = self.vm.register_irqfd(event.wake_fd(), gsi) {
                log::warn!("irqfd for GSI {gsi}: {e}; injecting from user space");
                let _ = self.vm.set_msi_route(gsi, None);
                return None;
            }
            slot.irqfd = Some(Irqfd { gsi, event });
            return Some(());
        }
        let gsi = slot.irqfd.as_ref()?.gsi;
        self.vm.set_msi_route(gsi, Some(msi)).ok()
    }
}

impl pci::MsiTarget for VmMsiTarget {
    fn update(&self, vector: u16, message: Option<pci::MsiMessage>) {
        let mut vectors = self.vectors.write().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = vectors.get_mut(usize::from(vector)) else {
            return;
        };
        let message = message.map(|m| MsiMessage {
            address: m.address,
            data: m.data,
        });
        slot.message = message;
        // A masked vector keeps its irqfd; the transport never fires it while masked.
        if let Some(msi) = message {
            if self.route(slot, msi).is_none() {
                if let Some(fd) = slot.irqfd.take() {
                    let _ = self.vm.unregister_irqfd(fd.event.wake_fd(), fd.gsi);
                }
            }
        }
    }

    fn fire(&self, vector: u16) {
        let vectors = self.vectors.read().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = vectors.get(usize::from(vector)) else {
            return;
        };
        match (&slot.irqfd, slot.message) {
            (Some(fd), Some(_)) => {
                if let Err(e) = fd.event.wake() {
                    log::warn!("MSI-X vector {vector}: irqfd write: {e}");
                }
            }
            (None, Some(msi)) => {
                if let Err(e) = self.irqchip.send_msi(msi) {
                    log::warn!("MSI-X vector {vector}: {e}");
                }
            }
            (_, None) => {}
        }
    }

    fn irqfd(&self, vector: u16) -> Option<std::os::fd::OwnedFd> {
        let vectors = self.vectors.read().unwrap_or_else(|e| e.into_inner());
        let fd = vectors
            .get(usize::from(vector))?
            .irqfd
            .as_ref()?
            .event
            .wake_fd();
        // SAFETY: `fd` is the irqfd's eventfd, open while the read lock is held; the
        // duplicate is a new descriptor the caller owns.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        borrowed.try_clone_to_owned().ok()
    }
}

impl Drop for VmMsiTarget {
    fn drop(&mut self) {
        let vectors = self.vectors.get_mut().unwrap_or_else(|e| e.into_inner());
        for fd in vectors.iter_mut().filter_map(|v| v.irqfd.take()) {
            let _ = self.vm.unregister_irqfd(fd.event.wake_fd(), fd.gsi);
            let _ = self.vm.set_msi_route(fd.gsi, None);
        }
    }
}
