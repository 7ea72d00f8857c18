//! Guest accesses: BAR0's regions, the common configuration's registers, the device
//! status state machine, and the PCI configuration space.

use std::sync::Arc;

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemory;

use super::common::{self, Field, ImageInputs, QueueRegs};
use super::config_space::{WriteEffect, COMMAND_INTX_DISABLE};
use super::layout::{Region, BAR_INDEX, CAP_COMMON, CAP_MSIX, PCI_CFG_DATA};
use super::notify::notified_queue;
use super::*;
use crate::{ActiveQueue, Interrupt};

impl<M: GuestMemory + Send + Sync + 'static> VirtioPciDevice<M> {
    /// A guest read of BAR0.
    pub(super) fn read_bar0(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        match self.layout.region(offset) {
            Region::Common(at) => common::read(&self.common_image(), at, data),
            Region::Isr(_) => {
                if let Some(first) = data.first_mut() {
                    *first = self.interrupt.take_isr();
                }
            }
            Region::Device(at) => {
                let len = data.len().min((layout::DEVICE_LEN - at) as usize);
                self.device.read_config(at, &mut data[..len]);
            }
            Region::MsixTable(at) => self.interrupt.with_msix(|m| m.read_table(at, data)),
            Region::MsixPba(at) => self.interrupt.with_msix(|m| m.read_pba(at, data)),
            Region::Notify(_) | Region::Unused => {}
        }
    }

    /// A guest write of BAR0.
    pub(super) fn write_bar0(&mut self, offset: u64, data: &[u8]) {
        match self.layout.region(offset) {
            Region::Common(at) => {
                let image = self.common_image();
                for (field, value) in common::fields_written(&image, at, data) {
                    self.write_common(field, value);
                }
            }
            Region::Device(at) => {
                let len = data.len().min((layout::DEVICE_LEN - at) as usize);
                self.device.write_config(at, &data[..len]);
            }
            Region::Notify(at) => self.notify(at),
            Region::MsixTable(at) => self.interrupt.with_msix(|m| m.write_table(at, data)),
            Region::MsixPba(at) => self.interrupt.with_msix(|m| m.write_pba(at, data)),
            Region::Isr(_) | Region::Unused => {}
        }
    }

    fn notify(&self, offset: u64) {
        let waker = notified_queue(offset).and_then(|q| self.notifiers.get(usize::from(q)));
        if let Some(waker) = waker {
            if let Err(e) = waker.wake() {
                log::error!("{}: cannot signal a queue notification: {e}", self.id);
            }
        }
    }

    pub(super) fn common_image(&self) -> layout::CommonCfg {
        let mut image = common::image(
            &self.common,
            &ImageInputs {
                device_features: self.offered_features,
                config_msix_vector: self.interrupt.config_vector(),
                queue_msix_vector: self.interrupt.queue_vector(self.common.queue_select),
                config_generation: self.interrupt.config_generation(),
            },
        );
        if self.interrupt.broken() {
            image.device_status |= STATUS_NEEDS_RESET;
        }
        image
    }

    fn write_common(&mut self, field: Field, value: u64) {
        let regs = &mut self.common;
        match field {
            Field::DeviceFeatureSelect => regs.device_feature_select = value as u32,
            Field::DriverFeatureSelect => regs.driver_feature_select = value as u32,
            Field::DriverFeature => self.write_driver_features(value as u32),
            Field::ConfigMsixVector => self.interrupt.set_config_vector(value as u16),
            Field::DeviceStatus => self.write_status(value as u8),
            Field::QueueSelect => regs.queue_select = value as u16,
            Field::QueueMsixVector => {
                if regs.selected().is_some() {
                    self.interrupt
                        .set_queue_vector(regs.queue_select, value as u16);
                }
            }
            Field::QueueEnable => {
                if value == 1 {
                    self.enable_queue();
                }
            }
            Field::QueueSize | Field::QueueDesc | Field::QueueDriver | Field::QueueDevice => {
                self.write_queue_register(field, value)
            }
        }
    }

    fn write_driver_features(&mut self, word: u32) {
        let regs = &mut self.common;
        if regs.status & STATUS_FEATURES_OK != 0 {
            return; // fixed once negotiated
        }
        let word = u64::from(word);
        match regs.driver_feature_select {
            0 => regs.driver_features = (regs.driver_features & !0xffff_ffff) | word,
            1 => regs.driver_features = (regs.driver_features & 0xffff_ffff) | (word << 32),
            _ => regs.driver_features_beyond |= word != 0,
        }
    }

    /// Queue size and ring addresses: writable until the queue is enabled.
    fn write_queue_register(&mut self, field: Field, value: u64) {
        let driver_ok = self.common.status & STATUS_DRIVER_OK != 0;
        let Some(queue) = self
            .common
            .selected_mut()
            .filter(|q| !q.enabled && !driver_ok)
        else {
            return;
        };
        match field {
            Field::QueueSize => queue.size = value as u16,
            Field::QueueDesc => queue.desc = value,
            Field::QueueDriver => queue.driver = value,
            Field::QueueDevice => queue.device = value,
            _ => {}
        }
    }

    /// The driver wrote 1 to `queue_enable`: checks the size and ring alignment now.
    fn enable_queue(&mut self) {
        let index = usize::from(self.common.queue_select);
        if self.common.status & STATUS_DRIVER_OK != 0 {
            return; // enabling after DRIVER_OK needs VIRTIO_F_RING_RESET, not offered
        }
        let (Some(regs), Some(&max)) = (
            self.common.queues.get(index).copied(),
            self.queue_max_sizes.get(index),
        ) else {
            return;
        };
        if regs.enabled {
            return;
        }
        match queue_from_registers(&regs, max, false) {
            Ok(_) => {
                if let Some(queue) = self.common.queues.get_mut(index) {
                    queue.enabled = true;
                }
            }
            Err(e) => self.fail(&format!("queue {index}: {e}")),
        }
    }

    /// A write of `device_status`.
    fn write_status(&mut self, value: u8) {
        if value == 0 {
            self.reset_virtio();
            return;
        }
        let old = self.common.status;
        let mut new = old | (value & STATUS_DRIVER_BITS);
        if new & !old & STATUS_FEATURES_OK != 0 && !self.features_acceptable() {
            log::warn!(
                "{}: FEATURES_OK refused for driver features {:#x}",
                self.id,
                self.common.driver_features
            );
            new &= !STATUS_FEATURES_OK;
        }
        self.common.status = new;
        if new & !old & STATUS_DRIVER_OK != 0 && new & STATUS_NEEDS_RESET == 0 {
            if new & STATUS_FEATURES_OK == 0 {
                self.fail("DRIVER_OK without FEATURES_OK");
            } else {
                self.activate();
            }
        }
    }

    /// The driver's features are a subset of those offered, VERSION_1 among them.
    fn features_acceptable(&self) -> bool {
        let acked = self.common.driver_features;
        acked & !self.offered_features == 0
            && !self.common.driver_features_beyond
            && acked & (1 << VIRTIO_F_VERSION_1) != 0
    }

    /// Hands the enabled queues to the device. Any queue the guest set up wrong, or a
    /// device that cannot start, leaves the device needing a reset.
    pub(super) fn activate(&mut self) {
        let features = self.common.driver_features;
        let event_idx = features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::new();
        for (index, regs) in self.common.queues.iter().enumerate() {
            if !regs.enabled {
                continue;
            }
            let max = self.queue_max_sizes[index];
            let queue = queue_from_registers(regs, max, event_idx).and_then(|q| {
                if q.is_valid(&*self.mem) {
                    Ok(q)
                } else {
                    Err("rings outside guest memory".to_string())
                }
            });
            match queue {
                Ok(queue) => queues.push(ActiveQueue {
                    index: index as u16, // at most MAX_QUEUES
                    queue,
                    notify: self.notifiers[index].clone(),
                }),
                Err(e) => return self.fail(&format!("queue {index}: {e}")),
            }
        }
        let interrupt: Arc<dyn Interrupt> = self.interrupt.clone();
        match self
            .device
            .activate(self.mem.clone(), features, queues, interrupt)
        {
            Ok(()) => self.active = true,
            Err(e) => self.fail(&format!("device did not start: {e}")),
        }
    }

    /// The device cannot go on: DEVICE_NEEDS_RESET, and a configuration interrupt if the
    /// driver already set DRIVER_OK (virtio 1.2, 2.1.2).
    fn fail(&mut self, why: &str) {
        log::error!("{}: needs reset: {why}", self.id);
        self.common.status |= STATUS_NEEDS_RESET;
        if self.common.status & STATUS_DRIVER_OK != 0 {
            self.interrupt.signal_config();
        }
    }

    /// Device reset (the driver wrote 0 to `device_status`): the device stops and gives
    /// its queues back; every register and vector returns to its reset value.
    pub(super) fn reset_virtio(&mut self) {
        drop(self.device.reset());
        self.active = false;
        self.activate_on_resume = false;
        self.common = CommonRegs::new(&self.queue_max_sizes);
        self.interrupt.reset_virtio();
        for waker in &self.notifiers {
            waker.drain();
        }
    }

    /// A configuration-space read of dword `offset`.
    pub(super) fn read_config_dword(&mut self, offset: u16) -> u32 {
        let offset = usize::from(offset & !3);
        let msix = usize::from(CAP_MSIX);
        if (msix..msix + pci::msix::MSIX_CAP_LEN).contains(&offset) {
            let cap = self.interrupt.with_msix(|m| m.capability(CAP_COMMON));
            let at = offset - msix;
            return u32::from_le_bytes([cap[at], cap[at + 1], cap[at + 2], cap[at + 3]]);
        }
        if offset >= config_space::CONFIG_SIZE {
            return 0;
        }
        if offset == usize::from(PCI_CFG_DATA) {
            self.window_read();
        }
        self.config.read(offset, self.interrupt.intx_pending())
    }

    /// A configuration-space write of `data` at byte `sub` of dword `offset`.
    pub(super) fn write_config_bytes(&mut self, offset: u16, sub: u8, data: &[u8]) {
        if sub > 3 {
            return; // not a byte of this dword
        }
        let start = usize::from(offset & !3) + usize::from(sub);
        let data = &data[..data.len().min(4 - usize::from(sub))];
        let msix = usize::from(CAP_MSIX);
        if (msix..msix + pci::msix::MSIX_CAP_LEN).contains(&start) {
            self.interrupt
                .with_msix(|m| m.write_capability(start - msix, data));
            return;
        }
        if start >= config_space::CONFIG_SIZE {
            return;
        }
        match self.config.write(start, data) {
            WriteEffect::Command => {
                let disabled = self.config.regs.command & COMMAND_INTX_DISABLE != 0;
                self.interrupt.set_intx_disabled(disabled);
            }
            WriteEffect::WindowWrite => self.window_write(),
            WriteEffect::None => {}
        }
    }

    /// The window's BAR access, if the driver set up one this function can do: BAR0, 1,
    /// 2 or 4 bytes, aligned.
    fn window_access(&self) -> Option<(u64, usize)> {
        let window = self.config.regs.window;
        let len = window.length as usize;
        let aligned = matches!(len, 1 | 2 | 4) && (window.offset as usize).is_multiple_of(len);
        (usize::from(window.bar) == BAR_INDEX && aligned).then_some((u64::from(window.offset), len))
    }

    fn window_read(&mut self) {
        if let Some((offset, len)) = self.window_access() {
            let mut data = [0u8; 4];
            self.read_bar0(offset, &mut data[..len]);
            self.config.regs.window.data = data;
        }
    }

    fn window_write(&mut self) {
        if let Some((offset, len)) = self.window_access() {
            let data = self.config.regs.window.data;
            self.write_bar0(offset, &data[..len]);
        }
    }
}

/// A queue built from the registers: the size a power of two no larger than `max`, the
/// rings aligned as the spec requires. Positions come from the registers too (non-zero
/// only after a restore).
pub(super) fn queue_from_registers(
    regs: &QueueRegs,
    max: u16,
    event_idx: bool,
) -> Result<Queue, String> {
    Queue::try_from(QueueState {
        max_size: max,
        next_avail: regs.next_avail,
        next_used: regs.next_used,
        event_idx_enabled: event_idx,
        size: regs.size,
        ready: true,
        desc_table: regs.desc,
        avail_ring: regs.driver,
        used_ring: regs.device,
    })
    .map_err(|e| format!("size {} or ring addresses refused: {e}", regs.size))
}
