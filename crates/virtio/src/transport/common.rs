//! The common configuration structure's registers, as the driver reads and writes them.
//!
//! Reads are served from an image of `struct virtio_pci_common_cfg` built from the
//! registers, so any access size reads the right bytes. A write is split into the fields
//! it touches; a field only partly covered keeps its other bytes (read-modify-write), and
//! the transport applies each field's new value in address order.

use std::mem::{offset_of, size_of};

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::IntoBytes;

use super::layout::CommonCfg;

/// "No MSI-X vector" in `config_msix_vector` and `queue_msix_vector`.
pub const NO_VECTOR: u16 = 0xffff;

/// A writable field of the common configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    DeviceFeatureSelect,
    DriverFeatureSelect,
    DriverFeature,
    ConfigMsixVector,
    DeviceStatus,
    QueueSelect,
    QueueSize,
    QueueMsixVector,
    QueueEnable,
    QueueDesc,
    QueueDriver,
    QueueDevice,
}

/// Every writable field with its offset and width.
const FIELDS: [(Field, usize, usize); 12] = [
    (
        Field::DeviceFeatureSelect,
        offset_of!(CommonCfg, device_feature_select),
        4,
    ),
    (
        Field::DriverFeatureSelect,
        offset_of!(CommonCfg, driver_feature_select),
        4,
    ),
    (
        Field::DriverFeature,
        offset_of!(CommonCfg, driver_feature),
        4,
    ),
    (
        Field::ConfigMsixVector,
        offset_of!(CommonCfg, config_msix_vector),
        2,
    ),
    (Field::DeviceStatus, offset_of!(CommonCfg, device_status), 1),
    (Field::QueueSelect, offset_of!(CommonCfg, queue_select), 2),
    (Field::QueueSize, offset_of!(CommonCfg, queue_size), 2),
    (
        Field::QueueMsixVector,
        offset_of!(CommonCfg, queue_msix_vector),
        2,
    ),
    (Field::QueueEnable, offset_of!(CommonCfg, queue_enable), 2),
    (Field::QueueDesc, offset_of!(CommonCfg, queue_desc), 8),
    (Field::QueueDriver, offset_of!(CommonCfg, queue_driver), 8),
    (Field::QueueDevice, offset_of!(CommonCfg, queue_device), 8),
];

/// One queue's registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRegs {
    /// What the driver wrote (checked when it enables the queue).
    pub size: u16,
    pub enabled: bool,
    pub desc: u64,
    pub driver: u64,
    pub device: u64,
    /// Where the device starts in the rings: 0, or the saved positions after a restore.
    pub next_avail: u16,
    pub next_used: u16,
}

impl QueueRegs {
    /// The reset state of a queue whose maximum size is `max_size`.
    pub fn new(max_size: u16) -> Self {
        QueueRegs {
            size: max_size,
            enabled: false,
            desc: 0,
            driver: 0,
            device: 0,
            next_avail: 0,
            next_used: 0,
        }
    }
}

/// The registers of the common configuration that belong to the transport (the MSI-X
/// vectors and the configuration generation live with the interrupt state, which device
/// threads share).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommonRegs {
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub driver_features: u64,
    /// The driver wrote a nonzero word beyond the 64 feature bits the device has.
    pub driver_features_beyond: bool,
    pub status: u8,
    pub queue_select: u16,
    pub queues: Vec<QueueRegs>,
}

impl CommonRegs {
    /// The reset state for queues of the given maximum sizes.
    pub fn new(queue_max_sizes: &[u16]) -> Self {
        CommonRegs {
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            driver_features_beyond: false,
            status: 0,
            queue_select: 0,
            queues: queue_max_sizes.iter().map(|&m| QueueRegs::new(m)).collect(),
        }
    }

    /// The selected queue, if it exists.
    pub fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(usize::from(self.queue_select))
    }

    /// The selected queue, if it exists.
    pub fn selected_mut(&mut self) -> Option<&mut QueueRegs> {
        self.queues.get_mut(usize::from(self.queue_select))
    }
}

/// What the image needs besides [`CommonRegs`].
pub struct ImageInputs {
    pub device_features: u64,
    pub config_msix_vector: u16,
    /// The selected queue's vector (NO_VECTOR if none is selected).
    pub queue_msix_vector: u16,
    pub config_generation: u8,
}

/// The common configuration as the driver sees it now.
pub fn image(regs: &CommonRegs, inputs: &ImageInputs) -> CommonCfg {
    let feature_word = |features: u64, select: u32| match select {
        0 => features as u32,
        1 => (features >> 32) as u32,
        _ => 0,
    };
    let queue = regs.selected();
    CommonCfg {
        device_feature_select: U32::new(regs.device_feature_select),
        device_feature: U32::new(feature_word(
            inputs.device_features,
            regs.device_feature_select,
        )),
        driver_feature_select: U32::new(regs.driver_feature_select),
        driver_feature: U32::new(feature_word(
            regs.driver_features,
            regs.driver_feature_select,
        )),
        config_msix_vector: U16::new(inputs.config_msix_vector),
        num_queues: U16::new(regs.queues.len() as u16), // bounded at construction
        device_status: regs.status,
        config_generation: inputs.config_generation,
        queue_select: U16::new(regs.queue_select),
        queue_size: U16::new(queue.map_or(0, |q| q.size)),
        queue_msix_vector: U16::new(inputs.queue_msix_vector),
        queue_enable: U16::new(queue.map_or(0, |q| u16::from(q.enabled))),
        queue_notify_off: U16::new(if queue.is_some() {
            regs.queue_select
        } else {
            0
        }),
        queue_desc: U64::new(queue.map_or(0, |q| q.desc)),
        queue_driver: U64::new(queue.map_or(0, |q| q.driver)),
        queue_device: U64::new(queue.map_or(0, |q| q.device)),
        queue_notif_config_data: U16::new(0),
        queue_reset: U16::new(0),
    }
}

/// Reads `data.len()` bytes at `offset` of `image` (bytes past its end read as zero).
pub fn read(image: &CommonCfg, offset: u64, data: &mut [u8]) {
    let bytes = image.as_bytes();
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|at| bytes.get(usize::try_from(at).ok()?))
            .copied()
            .unwrap_or(0);
    }
}

/// The fields a write of `data` at `offset` touches, each with its new value (the
/// untouched bytes of a partly written field taken from `image`), in address order.
pub fn fields_written(image: &CommonCfg, offset: u64, data: &[u8]) -> Vec<(Field, u64)> {
    let bytes = image.as_bytes();
    let Ok(start) = usize::try_from(offset) else {
        return Vec::new();
    };
    let end = start.saturating_add(data.len());
    FIELDS
        .iter()
        .filter(|&&(_, at, width)| at < end && start < at + width)
        .map(|&(field, at, width)| {
            let mut value = [0u8; 8];
            for (i, byte) in value.iter_mut().enumerate().take(width) {
                let pos = at + i;
                *byte = if (start..end).contains(&pos) {
                    data[pos - start]
                } else {
                    bytes[pos]
                };
            }
            (field, u64::from_le_bytes(value))
        })
        .collect()
}

const _: () = assert!(size_of::<CommonCfg>() == 0x3c);
