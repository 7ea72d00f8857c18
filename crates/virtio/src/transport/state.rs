//! The transport's lifecycle: pause, resume, save, restore, reset, and the
//! `pci::PciDevice` entry points.

use serde::{Deserialize, Serialize};

use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use pci::msix::MsixState;
use pci::{BarKind, BarRequest, PciDevice};
use vm_memory::GuestMemory;

use super::common::{CommonRegs, QueueRegs, NO_VECTOR};
use super::config_space::{HeaderRegs, COMMAND_INTX_DISABLE, COMMAND_MEMORY};
use super::interrupt::{InterruptSnapshot, ISR_CONFIG, ISR_QUEUE};
use super::layout::BAR_INDEX;
use super::registers::queue_from_registers;
use super::*;

/// Layout version of [`TransportState`].
const STATE_VERSION: u32 = 1;
const STATE_DEVICE: &str = "virtio-pci";

/// One queue, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedQueue {
    pub size: u16,
    pub enabled: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
    pub msix_vector: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
}

/// Everything the transport saves, the device's own state included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransportState {
    pub header: HeaderRegs,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub driver_features: u64,
    pub driver_features_beyond: bool,
    pub status: u8,
    pub config_generation: u8,
    pub queue_select: u16,
    pub config_msix_vector: u16,
    pub queues: Vec<SavedQueue>,
    pub isr: u8,
    pub msix: MsixState,
    pub device: DeviceState,
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioPciDevice<M> {
    /// The queues as saved: the registers, and where the device is in each ring.
    fn saved_queues(&self, vectors: &[u16]) -> Result<Vec<SavedQueue>, LifecycleError> {
        let live = if self.active {
            let states = self.device.queue_states().ok_or_else(|| {
                LifecycleError(format!(
                    "{}: the device cannot report its queue positions",
                    self.id
                ))
            })?;
            Some(states)
        } else {
            None
        };
        let event_idx = self.common.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut saved = Vec::with_capacity(self.common.queues.len());
        for (index, regs) in self.common.queues.iter().enumerate() {
            let (mut next_avail, mut next_used) = (regs.next_avail, regs.next_used);
            if let (Some(states), true) = (&live, regs.enabled) {
                let state = states
                    .iter()
                    .find(|(q, _)| usize::from(*q) == index)
                    .map(|(_, s)| s)
                    .ok_or_else(|| {
                        LifecycleError(format!("{}: no state for queue {index}", self.id))
                    })?;
                (next_avail, next_used) = (state.next_avail, state.next_used);
            }
            saved.push(SavedQueue {
                size: regs.size,
                enabled: regs.enabled,
                desc: regs.desc,
                driver: regs.driver,
                device: regs.device,
                msix_vector: vectors.get(index).copied().unwrap_or(NO_VECTOR),
                next_avail,
                next_used,
                event_idx: event_idx && regs.enabled,
            });
        }
        Ok(saved)
    }

    /// Checks a saved state against this function; returns the interrupt snapshot to load.
    fn validate(&self, state: &TransportState) -> Result<InterruptSnapshot, StateError> {
        let bad = |detail: String| StateError::new(STATE_DEVICE, detail);
        self.config.check(&state.header).map_err(bad)?;
        if state.queues.len() != self.queue_max_sizes.len() {
            return Err(bad(format!(
                "{} queues saved, this device has {}: not the same device configuration",
                state.queues.len(),
                self.queue_max_sizes.len()
            )));
        }
        let vectors = self.interrupt.vectors();
        let vector_ok = |v: u16| v == NO_VECTOR || v < vectors;
        if !vector_ok(state.config_msix_vector) {
            return Err(bad(format!("config vector {}", state.config_msix_vector)));
        }
        self.validate_status(state).map_err(bad)?;
        let event_idx = state.driver_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        for (index, q) in state.queues.iter().enumerate() {
            if !vector_ok(q.msix_vector) {
                return Err(bad(format!("queue {index}: vector {}", q.msix_vector)));
            }
            if q.event_idx != (event_idx && q.enabled) {
                return Err(bad(format!(
                    "queue {index}: event_idx disagrees with features"
                )));
            }
            if q.enabled {
                queue_from_registers(&saved_registers(q), self.queue_max_sizes[index], false)
                    .map_err(|e| bad(format!("queue {index}: {e}")))?;
            }
        }
        if state.isr & !(ISR_QUEUE | ISR_CONFIG) != 0 {
            return Err(bad(format!("ISR {:#x}", state.isr)));
        }
        self.interrupt.validate_msix(&state.msix)?;
        Ok(InterruptSnapshot {
            msix: state.msix.clone(),
            isr: state.isr,
            config_vector: state.config_msix_vector,
            queue_vectors: state.queues.iter().map(|q| q.msix_vector).collect(),
            config_generation: state.config_generation,
        })
    }

    /// The status a driver could have reached with these features.
    fn validate_status(&self, state: &TransportState) -> Result<(), String> {
        let status = state.status;
        if status & !(STATUS_DRIVER_BITS | STATUS_NEEDS_RESET) != 0 {
            return Err(format!("status {status:#x}"));
        }
        // A driver that sets DRIVER_OK without FEATURES_OK leaves the device failed.
        let unnegotiated = STATUS_DRIVER_OK | STATUS_NEEDS_RESET;
        if status & (unnegotiated | STATUS_FEATURES_OK) == STATUS_DRIVER_OK {
            return Err(format!("status {status:#x}: DRIVER_OK without FEATURES_OK"));
        }
        let features = state.driver_features;
        let accepted = features & !self.offered_features == 0
            && !state.driver_features_beyond
            && features & (1 << VIRTIO_F_VERSION_1) != 0;
        if status & STATUS_FEATURES_OK != 0 && !accepted {
            return Err(format!("FEATURES_OK with driver features {features:#x}"));
        }
        Ok(())
    }

    /// Loads a validated state into the registers.
    fn apply(&mut self, state: &TransportState, interrupt: &InterruptSnapshot) {
        self.config.regs = state.header;
        let mut common = CommonRegs::new(&self.queue_max_sizes);
        common.device_feature_select = state.device_feature_select;
        common.driver_feature_select = state.driver_feature_select;
        common.driver_features = state.driver_features;
        common.driver_features_beyond = state.driver_features_beyond;
        common.status = state.status;
        common.queue_select = state.queue_select;
        common.queues = state.queues.iter().map(saved_registers).collect();
        self.common = common;
        let intx_disabled = state.header.command & COMMAND_INTX_DISABLE != 0;
        self.interrupt.restore(interrupt, intx_disabled);
        let running = STATUS_DRIVER_OK | STATUS_NEEDS_RESET;
        self.activate_on_resume = state.status & running == STATUS_DRIVER_OK;
    }
}

fn saved_registers(q: &SavedQueue) -> QueueRegs {
    QueueRegs {
        size: q.size,
        enabled: q.enabled,
        desc: q.desc,
        driver: q.driver,
        device: q.device,
        next_avail: q.next_avail,
        next_used: q.next_used,
    }
}

impl<M: GuestMemory + Send + Sync + 'static> Lifecycle for VirtioPciDevice<M> {
    fn id(&self) -> String {
        self.id.clone()
    }

    fn pause(&mut self) -> Result<(), LifecycleError> {
        self.device.pause()
    }

    fn hand_over(&mut self) -> Result<(), LifecycleError> {
        self.device.hand_over()
    }

    fn take_over(&mut self) -> Result<(), LifecycleError> {
        self.device.take_over()
    }

    /// Resumes the device. One restored as active is activated again (then resumed, in
    /// case it was paused before the restore) and every queue is kicked, so requests the
    /// guest queued before the snapshot are seen.
    fn resume(&mut self) -> Result<(), LifecycleError> {
        if !std::mem::take(&mut self.activate_on_resume) {
            return self.device.resume();
        }
        self.activate();
        if !self.active {
            return Ok(()); // the guest sees DEVICE_NEEDS_RESET
        }
        self.device.resume()?;
        for (waker, regs) in self.notifiers.iter().zip(&self.common.queues) {
            if regs.enabled {
                waker
                    .wake()
                    .map_err(|e| LifecycleError(format!("{}: kick: {e}", self.id)))?;
            }
        }
        Ok(())
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        let snapshot = self.interrupt.save();
        let state = TransportState {
            header: self.config.regs,
            device_feature_select: self.common.device_feature_select,
            driver_feature_select: self.common.driver_feature_select,
            driver_features: self.common.driver_features,
            driver_features_beyond: self.common.driver_features_beyond,
            status: self.status(),
            config_generation: snapshot.config_generation,
            queue_select: self.common.queue_select,
            config_msix_vector: snapshot.config_vector,
            queues: self.saved_queues(&snapshot.queue_vectors)?,
            isr: snapshot.isr,
            msix: snapshot.msix,
            device: self.device.save()?,
        };
        DeviceState::new(STATE_VERSION, &state)
    }

    /// Validates everything first; the device's own state is loaded last, so a refusal
    /// leaves the function as it was (unless it was serving its queues, in which case it
    /// is stopped first and left reset).
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let state: TransportState = state.parse(STATE_DEVICE, STATE_VERSION)?;
        let interrupt = self.validate(&state)?;
        if self.active {
            self.reset_virtio();
        }
        self.device.restore(&state.device)?;
        self.apply(&state, &interrupt);
        Ok(())
    }

    /// Power-on state. BAR0's address and memory decoding stay as the VMM, acting as the
    /// firmware, set them before the guest first ran.
    fn reset(&mut self) {
        self.reset_virtio();
        self.interrupt.reset();
        let kept = self.config.regs;
        self.config.regs = HeaderRegs {
            command: kept.command & COMMAND_MEMORY,
            bar_address: kept.bar_address,
            interrupt_line: kept.interrupt_line,
            ..Default::default()
        };
    }
}

impl<M: GuestMemory + Send + Sync + 'static> PciDevice for VirtioPciDevice<M> {
    fn bars(&self) -> Vec<BarRequest> {
        vec![BarRequest {
            index: BAR_INDEX,
            size: self.layout.size,
            kind: BarKind::Memory64,
            prefetchable: false,
        }]
    }

    fn config_read(&mut self, offset: u16) -> u32 {
        self.read_config_dword(offset)
    }

    fn config_write(&mut self, offset: u16, sub: u8, data: &[u8]) {
        self.write_config_bytes(offset, sub, data)
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if bar == BAR_INDEX {
            self.read_bar0(offset, data);
        } else {
            data.fill(0);
        }
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar == BAR_INDEX {
            self.write_bar0(offset, data);
        }
    }

    /// Keeps BAR0's register in step with where the bus placed it, and moves the
    /// ioeventfd registrations.
    fn bar_moved(&mut self, bar: usize, base: Option<u64>) {
        if bar != BAR_INDEX {
            return;
        }
        if let Some(base) = base {
            self.config.regs.bar_address = base & !(self.layout.size - 1);
        }
        self.ioevents.bar_moved(base, &self.notifiers);
    }
}
