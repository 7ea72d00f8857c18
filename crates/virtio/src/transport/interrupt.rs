//! How the transport interrupts the driver: an MSI-X vector per queue and one for
//! configuration changes, or, while MSI-X is off, the ISR byte and the INTx line.
//!
//! Device I/O threads call [`VirtioInterrupt`] while vCPUs read the ISR byte, program the
//! MSI-X table and set vectors, so everything here sits behind one small mutex that is
//! never held while calling into the device. Under it the MSI-X code may call the
//! `MsiTarget` and the INTx code the `IrqChip`; neither may call back into the device (an
//! irqfd write on KVM, a lock-free MSI injection elsewhere). Lock order:
//! transport (the VMM's lock around the PCI function) → this mutex → MsiTarget / IrqChip.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use devices::irqchip::IrqPin;
use pci::msix::{Msix, MsixState, Notified};

use super::common::NO_VECTOR;
use crate::Interrupt;

/// ISR bit 0: a queue has used buffers.
pub const ISR_QUEUE: u8 = 1;
/// ISR bit 1: the device configuration changed.
pub const ISR_CONFIG: u8 = 2;

struct Lines {
    msix: Msix,
    isr: u8,
    /// The command register's INTx-disable bit.
    intx_disabled: bool,
    /// The level last driven on the INTx line.
    asserted: bool,
}

/// The transport's [`Interrupt`]: shared (in an `Arc`) by the transport and the device.
pub struct VirtioInterrupt {
    lines: Mutex<Lines>,
    intx: IrqPin,
    queue_vectors: Vec<AtomicU16>,
    config_vector: AtomicU16,
    config_generation: AtomicU8,
    /// Set by a device thread that found the driver broke the protocol; the transport ORs it
    /// into the device status as DEVICE_NEEDS_RESET until the driver resets the device.
    broken: AtomicBool,
}

impl VirtioInterrupt {
    /// Interrupts for `num_queues` queues through `msix`, or the INTx line `intx`.
    pub fn new(msix: Msix, intx: IrqPin, num_queues: usize) -> Self {
        VirtioInterrupt {
            lines: Mutex::new(Lines {
                msix,
                isr: 0,
                intx_disabled: false,
                asserted: false,
            }),
            intx,
            queue_vectors: (0..num_queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
            config_vector: AtomicU16::new(NO_VECTOR),
            config_generation: AtomicU8::new(0),
            broken: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lines> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drives the INTx line to what the state asks for, if that changed.
    fn update_line(&self, lines: &mut Lines) {
        let level = lines.isr != 0 && !lines.msix.enabled() && !lines.intx_disabled;
        if level != lines.asserted {
            lines.asserted = level;
            self.intx.set(level);
        }
    }

    fn signal(&self, vector: u16, isr_bit: u8) {
        let mut lines = self.lock();
        if lines.msix.enabled() {
            // NO_VECTOR: the driver asked for no interrupt from this source.
            if vector != NO_VECTOR && lines.msix.notify(vector) == Notified::NoSuchVector {
                log::debug!("virtio-pci: vector {vector} is beyond the MSI-X table");
            }
            return;
        }
        lines.isr |= isr_bit;
        self.update_line(&mut lines);
    }

    /// The driver read the ISR byte: returns it and clears it, lowering the line.
    pub fn take_isr(&self) -> u8 {
        let mut lines = self.lock();
        let isr = std::mem::take(&mut lines.isr);
        self.update_line(&mut lines);
        isr
    }

    /// Whether INTx is pending (the PCI status register's Interrupt Status bit).
    pub fn intx_pending(&self) -> bool {
        let lines = self.lock();
        lines.isr != 0 && !lines.msix.enabled()
    }

    /// The command register's INTx-disable bit changed.
    pub fn set_intx_disabled(&self, disabled: bool) {
        let mut lines = self.lock();
        lines.intx_disabled = disabled;
        self.update_line(&mut lines);
    }

    /// Runs `f` on the MSI-X state, then re-drives INTx (enabling MSI-X lowers it).
    pub fn with_msix<R>(&self, f: impl FnOnce(&mut Msix) -> R) -> R {
        let mut lines = self.lock();
        let result = f(&mut lines.msix);
        self.update_line(&mut lines);
        result
    }

    /// The MSI-X table size.
    pub fn vectors(&self) -> u16 {
        self.lock().msix.table_size()
    }

    /// The vector `value` names, or NO_VECTOR if the table has no such entry (what the
    /// driver reads back when a mapping fails).
    fn checked_vector(&self, value: u16) -> u16 {
        if value < self.vectors() {
            value
        } else {
            NO_VECTOR
        }
    }

    /// The configuration-change vector.
    pub fn config_vector(&self) -> u16 {
        self.config_vector.load(Ordering::Acquire)
    }

    /// The driver wrote `config_msix_vector`.
    pub fn set_config_vector(&self, value: u16) {
        let vector = self.checked_vector(value);
        self.config_vector.store(vector, Ordering::Release);
    }

    /// Queue `queue`'s vector (NO_VECTOR for a queue that does not exist).
    pub fn queue_vector(&self, queue: u16) -> u16 {
        self.queue_vectors
            .get(usize::from(queue))
            .map_or(NO_VECTOR, |v| v.load(Ordering::Acquire))
    }

    /// The driver wrote `queue_msix_vector` for `queue`.
    pub fn set_queue_vector(&self, queue: u16, value: u16) {
        let vector = self.checked_vector(value);
        if let Some(slot) = self.queue_vectors.get(usize::from(queue)) {
            slot.store(vector, Ordering::Release);
        }
    }

    /// The configuration generation.
    pub fn config_generation(&self) -> u8 {
        self.config_generation.load(Ordering::Acquire)
    }

    /// Device reset: every vector back to NO_VECTOR, the ISR cleared and the line low.
    /// The MSI-X table belongs to PCI and is left alone.
    pub fn reset_virtio(&self) {
        for slot in &self.queue_vectors {
            slot.store(NO_VECTOR, Ordering::Release);
        }
        self.config_vector.store(NO_VECTOR, Ordering::Release);
        self.broken.store(false, Ordering::Release);
        self.take_isr();
    }

    /// Whether a device thread reported a protocol error ([`Interrupt::needs_reset`]).
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Power-on: [`Self::reset_virtio`] plus the MSI-X state and the INTx-disable bit.
    pub fn reset(&self) {
        self.reset_virtio();
        let mut lines = self.lock();
        lines.msix.reset();
        lines.intx_disabled = false;
        self.update_line(&mut lines);
    }

    /// What [`Self::restore`] needs back.
    pub fn save(&self) -> InterruptSnapshot {
        let lines = self.lock();
        InterruptSnapshot {
            msix: lines.msix.save(),
            isr: lines.isr,
            config_vector: self.config_vector(),
            queue_vectors: (0..self.queue_vectors.len())
                .map(|q| self.queue_vector(q as u16))
                .collect(),
            config_generation: self.config_generation(),
        }
    }

    /// Checks a saved MSI-X state against this table without loading it.
    pub fn validate_msix(&self, state: &MsixState) -> Result<(), devices::StateError> {
        self.lock().msix.validate(state)
    }

    /// Loads a snapshot already validated (vectors, ISR bits, MSI-X state), publishing
    /// every MSI-X route and re-driving the INTx line.
    pub fn restore(&self, snapshot: &InterruptSnapshot, intx_disabled: bool) {
        for (slot, &vector) in self.queue_vectors.iter().zip(&snapshot.queue_vectors) {
            slot.store(vector, Ordering::Release);
        }
        self.config_vector
            .store(snapshot.config_vector, Ordering::Release);
        self.config_generation
            .store(snapshot.config_generation, Ordering::Release);
        let mut lines = self.lock();
        if let Err(e) = lines.msix.restore(&snapshot.msix) {
            log::error!("virtio-pci: MSI-X state refused after validation: {e}");
        }
        lines.isr = snapshot.isr;
        lines.intx_disabled = intx_disabled;
        // Drive the line even if the level looks unchanged: the irqchip was restored on its
        // own, and both must agree.
        let level = lines.isr != 0 && !lines.msix.enabled() && !intx_disabled;
        lines.asserted = level;
        self.intx.set(level);
    }
}

/// The interrupt part of the transport's saved state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterruptSnapshot {
    pub msix: MsixState,
    pub isr: u8,
    pub config_vector: u16,
    pub queue_vectors: Vec<u16>,
    pub config_generation: u8,
}

impl Interrupt for VirtioInterrupt {
    fn signal_queue(&self, queue: u16) {
        let Some(slot) = self.queue_vectors.get(usize::from(queue)) else {
            log::debug!("virtio-pci: interrupt for queue {queue}, which does not exist");
            return;
        };
        self.signal(slot.load(Ordering::Acquire), ISR_QUEUE);
    }

    fn signal_config(&self) {
        // The driver re-reads the configuration when the generation moved.
        self.config_generation.fetch_add(1, Ordering::AcqRel);
        self.signal(self.config_vector(), ISR_CONFIG);
    }

    fn needs_reset(&self) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.signal_config();
        }
    }

    fn queue_irqfd(&self, queue: u16) -> Option<std::os::fd::OwnedFd> {
        let vector = self.queue_vector(queue);
        if vector == NO_VECTOR {
            return None;
        }
        self.lock().msix.irqfd(vector)
    }
}
