//! virtio-blk over a disk image (a regular file or a block device, raw or qcow2).
//!
//! [`Block::new`] opens and locks the image named by [`BlockOptions`]; once the driver sets
//! DRIVER_OK, each request queue gets its own [`Worker`] thread, which reads and writes guest
//! memory straight from and to the image with preadv/pwritev (through an aligned bounce buffer
//! only where O_DIRECT needs one). Requests: IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES;
//! anything else is UNSUPP, anything malformed IOERR.
//!
//! Durability: with VIRTIO_BLK_F_FLUSH negotiated, FLUSH completes after fdatasync; a driver
//! that did not negotiate it gets write-through (every write synced before it completes).

mod chain;
mod image;
mod kind;
mod options;
#[cfg(target_os = "linux")]
mod ordered;
mod qcow2;
#[cfg(all(test, target_os = "linux"))]
mod qcow2_tests;
mod request;
mod sys;
#[cfg(all(test, target_os = "linux"))]
mod tests;

use std::sync::Arc;

use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use virtio_bindings::bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use vm_memory::GuestMemory;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{Immutable, IntoBytes, KnownLayout};

pub use image::{
    Bounce, DiskImage, ImageError, ImageErrorKind, ImageKind, ImageStamp, SECTOR_SIZE,
};
pub use options::{
    repeated_key, BlockOptions, CacheMode, FormatOptions, ImageFormat, MAX_QUEUES, MAX_SERIAL_LEN,
};
pub use qcow2::{parse_header, HeaderSummary, MAX_BACKING_DEPTH};
use request::{BlockHandler, MAX_RANGE_SECTORS, MAX_RANGE_SEGMENTS};

use crate::worker::Workers;
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};

/// Size of each request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Version of [`BlockState`]'s layout.
const STATE_VERSION: u32 = 1;

/// The configuration space up to `write_zeroes_may_unmap` (struct virtio_blk_config; the
/// secure-erase and zoned fields that follow stay zero as their features are not offered).
#[derive(IntoBytes, Immutable, KnownLayout, Default)]
#[repr(C)]
struct ConfigSpace {
    capacity: U64,
    size_max: U32,
    seg_max: U32,
    geometry: [u8; 4],
    blk_size: U32,
    physical_block_exp: u8,
    alignment_offset: u8,
    min_io_size: U16,
    opt_io_size: U32,
    wce: u8,
    unused: u8,
    num_queues: U16,
    max_discard_sectors: U32,
    max_discard_seg: U32,
    discard_sector_alignment: U32,
    max_write_zeroes_sectors: U32,
    max_write_zeroes_seg: U32,
    write_zeroes_may_unmap: u8,
    unused1: [u8; 3],
}

// Same offsets as the kernel's layout, as virtio-bindings has it.
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(ConfigSpace, blk_size) == offset_of!(virtio_blk_config, blk_size));
    assert!(offset_of!(ConfigSpace, num_queues) == offset_of!(virtio_blk_config, num_queues));
    assert!(
        offset_of!(ConfigSpace, max_discard_sectors)
            == offset_of!(virtio_blk_config, max_discard_sectors)
    );
    assert!(
        offset_of!(ConfigSpace, write_zeroes_may_unmap)
            == offset_of!(virtio_blk_config, write_zeroes_may_unmap)
    );
    assert!(
        std::mem::size_of::<ConfigSpace>()
            == offset_of!(virtio_blk_config, max_secure_erase_sectors)
    );
};

/// What a snapshot records of the device itself (the queues are the transport's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub capacity_sectors: u64,
    pub features: u64,
    pub acked_features: u64,
    pub num_queues: u16,
    /// The image file as it was when the state was saved (absent before this field existed,
    /// and for block devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageStamp>,
}

/// A virtio-blk device.
pub struct Block {
    image: Arc<DiskImage>,
    options: BlockOptions,
    config: Vec<u8>,
    workers: Workers,
    acked_features: u64,
}

impl Block {
    /// Opens (and locks) the image; fails naming the path and the cause.
    pub fn new(options: BlockOptions) -> Result<Block, ImageError> {
        let image = DiskImage::open(&options)?;
        let config = config_space(&image, options.queues);
        Ok(Block {
            image: Arc::new(image),
            options,
            config,
            workers: Workers::default(),
            acked_features: 0,
        })
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.image.sectors()
    }

    pub fn options(&self) -> &BlockOptions {
        &self.options
    }
}

fn config_space(image: &DiskImage, queues: u16) -> Vec<u8> {
    let sectors_per_block = image.block_size() / SECTOR_SIZE as u32;
    let config = ConfigSpace {
        capacity: image.sectors().into(),
        seg_max: u32::from(QUEUE_SIZE - 2).into(),
        blk_size: image.block_size().into(),
        num_queues: queues.into(),
        max_discard_sectors: MAX_RANGE_SECTORS.into(),
        max_discard_seg: MAX_RANGE_SEGMENTS.into(),
        // Hole punching frees whole 4 KiB blocks.
        discard_sector_alignment: sectors_per_block.max(8).into(),
        max_write_zeroes_sectors: MAX_RANGE_SECTORS.into(),
        max_write_zeroes_seg: MAX_RANGE_SEGMENTS.into(),
        write_zeroes_may_unmap: 1,
        ..Default::default()
    };
    config.as_bytes().to_vec()
}

/// Copies `config[offset..]` into `data`, zeros past its end.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if let Some(src) = config.get(start..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; usize::from(self.options.queues)]
    }

    fn features(&self) -> u64 {
        let mut bits = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_INDIRECT_DESC,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_BLK_F_SEG_MAX,
            VIRTIO_BLK_F_BLK_SIZE,
            VIRTIO_BLK_F_FLUSH,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | 1 << bit);
        if self.options.readonly {
            bits |= 1 << VIRTIO_BLK_F_RO;
        } else {
            bits |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        if self.options.queues > 1 {
            bits |= 1 << VIRTIO_BLK_F_MQ;
        }
        bits
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Nothing is writable: VIRTIO_BLK_F_CONFIG_WCE is not offered.
        log::debug!(
            "virtio-blk: ignored config write of {} bytes at {offset}",
            data.len()
        );
    }

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.is_empty() || queues.len() > usize::from(self.options.queues) {
            return Err(ActivateError(format!(
                "virtio-blk: {} queues ready, expected 1 to {}",
                queues.len(),
                self.options.queues
            )));
        }
        self.workers.stop();
        let flush = acked_features & 1 << VIRTIO_BLK_F_FLUSH != 0;
        let serial = self.options.serial.as_deref().unwrap_or("");
        for queue in queues {
            let handler = BlockHandler::new(self.image.clone(), flush, serial);
            self.workers.spawn(
                format!("virtio-blk-q{}", queue.index),
                mem.clone(),
                acked_features,
                vec![queue],
                interrupt.clone(),
                handler,
            )?;
        }
        self.acked_features = acked_features;
        Ok(())
    }

    fn reset(&mut self) -> Vec<ActiveQueue> {
        self.acked_features = 0;
        self.workers.stop()
    }

    fn workers(&self) -> Option<&Workers> {
        Some(&self.workers)
    }

    fn workers_mut(&mut self) -> Option<&mut Workers> {
        Some(&mut self.workers)
    }

    fn hand_over(&mut self) -> Result<(), LifecycleError> {
        self.image.unlock().map_err(|e| {
            LifecycleError(format!("disk {}: unlock: {e}", self.image.path().display()))
        })
    }

    fn take_over(&mut self) -> Result<(), LifecycleError> {
        self.image.lock().map_err(|e| LifecycleError(e.to_string()))
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        // A qcow2 image's cached metadata goes to the file first: the stamp recorded below
        // must be the file's final state, and the file alone the whole disk.
        self.image.settle().map_err(|e| {
            LifecycleError(format!("disk {}: flush: {e}", self.image.path().display()))
        })?;
        let state = BlockState {
            capacity_sectors: self.image.sectors(),
            features: VirtioDevice::<M>::features(self),
            acked_features: self.acked_features,
            num_queues: self.options.queues,
            image: self.image.stamp().map_err(|e| {
                LifecycleError(format!("disk {}: fstat: {e}", self.image.path().display()))
            })?,
        };
        DeviceState::new(STATE_VERSION, &state)
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let saved: BlockState = state.parse("virtio-blk", STATE_VERSION)?;
        let refuse = |why: String| Err(StateError::new("virtio-blk", why));
        if saved.capacity_sectors != self.image.sectors() {
            return refuse(format!(
                "{} has {} sectors, the saved disk had {}: not the same image",
                self.image.path().display(),
                self.image.sectors(),
                saved.capacity_sectors
            ));
        }
        let offered = VirtioDevice::<M>::features(self);
        let readonly_bit = 1u64 << VIRTIO_BLK_F_RO;
        if (saved.features ^ offered) & readonly_bit != 0 {
            // The driver was told whether it may write: a disk that changed its mind under
            // it fails every write (or hides that writes are allowed).
            let mode = |features: u64| match features & readonly_bit {
                0 => "writable",
                _ => "read-only",
            };
            return refuse(format!(
                "{}: the saved disk was {}, this one is {}: not the same disk configuration",
                self.image.path().display(),
                mode(saved.features),
                mode(offered)
            ));
        }
        if saved.acked_features & !offered != 0 {
            return refuse(format!(
                "the driver negotiated features {:#x} this disk does not offer ({offered:#x}; readonly differs?)",
                saved.acked_features
            ));
        }
        if saved.num_queues != self.options.queues {
            return refuse(format!(
                "{} queues saved, {} configured",
                saved.num_queues, self.options.queues
            ));
        }
        self.check_unchanged(saved.image.as_ref())?;
        self.acked_features = saved.acked_features;
        Ok(())
    }
}

impl Block {
    /// With [`BlockOptions::expect_unchanged`] (a snapshot restore), refuses an image file
    /// that is not as it was when `saved` was taken: the guest's memory would not match it.
    fn check_unchanged(&self, saved: Option<&ImageStamp>) -> Result<(), StateError> {
        let Some(saved) = saved.filter(|_| self.options.expect_unchanged) else {
            return Ok(());
        };
        let path = self.image.path().display();
        let now = self
            .image
            .stamp()
            .map_err(|e| StateError::new("virtio-blk", format!("disk {path}: fstat: {e}")))?;
        let difference = match now {
            Some(now) => saved.difference(&now),
            None => Some("another file (a block device now)"),
        };
        match difference {
            None => Ok(()),
            Some(how) => Err(StateError::new(
                "virtio-blk",
                format!(
                    "disk {path} is not the image the snapshot was taken with: {how}; the \
                     guest's memory would not match it (--restore-allow-changed-disks runs \
                     it anyway)"
                ),
            )),
        }
    }
}
