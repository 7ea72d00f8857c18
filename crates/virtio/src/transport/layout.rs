//! Where the transport's structures live: the regions of BAR0 and the capabilities in
//! configuration space, with their byte layouts (virtio 1.2, section 4.1.4).
//!
//! BAR0 is one 64-bit, non-prefetchable memory BAR. 64-bit so the VMM may place it in
//! either PCI window (the 32-bit one by default); non-prefetchable because reading the ISR
//! byte clears it. Every region starts on its own 4 KiB page, so the MSI-X table and PBA
//! share a page with nothing else (as the PCI spec recommends) and a region could be mapped
//! or trapped on its own.

use std::mem::size_of;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{Immutable, IntoBytes, KnownLayout};

/// The BAR that holds everything.
pub const BAR_INDEX: usize = 0;
const PAGE: u64 = 0x1000;

/// Common configuration at the start of BAR0.
pub const COMMON_OFFSET: u64 = 0;
/// The ISR status byte.
pub const ISR_OFFSET: u64 = PAGE;
/// The device-specific configuration.
pub const DEVICE_OFFSET: u64 = 2 * PAGE;
/// Length of the device-specific configuration window.
pub const DEVICE_LEN: u64 = PAGE;
/// The notification region: queue `q` is notified at `NOTIFY_OFFSET + 4 * q`.
pub const NOTIFY_OFFSET: u64 = 3 * PAGE;
/// Bytes between the notification addresses of consecutive queues.
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;

/// Configuration-space capability structures and their offsets.
pub const CAP_MSIX: u8 = 0x40;
pub const CAP_COMMON: u8 = 0x4c;
pub const CAP_ISR: u8 = 0x5c;
pub const CAP_DEVICE: u8 = 0x6c;
pub const CAP_NOTIFY: u8 = 0x7c;
pub const CAP_PCI_CFG: u8 = 0x90;
/// Offset of `pci_cfg_data` inside the PCI-configuration-access capability.
pub const PCI_CFG_DATA: u8 = CAP_PCI_CFG + 16;
/// One past the last capability byte.
pub const CAPS_END: u8 = CAP_PCI_CFG + size_of::<VirtioPciCfgCap>() as u8;

/// `cfg_type` values of the virtio vendor capabilities.
pub const CFG_TYPE_COMMON: u8 = 1;
pub const CFG_TYPE_NOTIFY: u8 = 2;
pub const CFG_TYPE_ISR: u8 = 3;
pub const CFG_TYPE_DEVICE: u8 = 4;
pub const CFG_TYPE_PCI: u8 = 5;

/// `struct virtio_pci_cap`.
#[derive(Clone, Copy, Debug, Default, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct VirtioPciCap {
    pub cap_vndr: u8,
    pub cap_next: u8,
    pub cap_len: u8,
    pub cfg_type: u8,
    pub bar: u8,
    pub id: u8,
    pub padding: [u8; 2],
    pub offset: U32,
    pub length: U32,
}

/// `struct virtio_pci_notify_cap`.
#[derive(Clone, Copy, Debug, Default, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct VirtioPciNotifyCap {
    pub cap: VirtioPciCap,
    pub notify_off_multiplier: U32,
}

/// `struct virtio_pci_cfg_cap`.
#[derive(Clone, Copy, Debug, Default, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct VirtioPciCfgCap {
    pub cap: VirtioPciCap,
    pub pci_cfg_data: [u8; 4],
}

/// `struct virtio_pci_common_cfg` (with the two virtio 1.2 fields at the end, which read
/// as zero: their features are not offered).
#[derive(Clone, Copy, Debug, Default, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct CommonCfg {
    pub device_feature_select: U32,
    pub device_feature: U32,
    pub driver_feature_select: U32,
    pub driver_feature: U32,
    pub config_msix_vector: U16,
    pub num_queues: U16,
    pub device_status: u8,
    pub config_generation: u8,
    pub queue_select: U16,
    pub queue_size: U16,
    pub queue_msix_vector: U16,
    pub queue_enable: U16,
    pub queue_notify_off: U16,
    pub queue_desc: U64,
    pub queue_driver: U64,
    pub queue_device: U64,
    pub queue_notif_config_data: U16,
    pub queue_reset: U16,
}

/// Where one BAR0 access lands, with the offset inside that region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    Common(u64),
    Isr(u64),
    Device(u64),
    Notify(u64),
    MsixTable(u64),
    MsixPba(u64),
    /// Padding between regions, or beyond the last.
    Unused,
}

/// BAR0's regions for a device with a given number of queues and MSI-X vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarLayout {
    pub notify_len: u64,
    pub table_offset: u64,
    pub table_len: u64,
    pub pba_offset: u64,
    pub pba_len: u64,
    /// BAR0's size: a power of two covering every region.
    pub size: u64,
}

impl BarLayout {
    /// The layout for `num_queues` queues and `vectors` MSI-X table entries.
    pub fn new(num_queues: u16, vectors: u16) -> Self {
        let notify_len = u64::from(num_queues) * u64::from(NOTIFY_OFF_MULTIPLIER);
        let table_offset = NOTIFY_OFFSET + notify_len.next_multiple_of(PAGE).max(PAGE);
        let table_len = pci::msix::table_bytes(vectors);
        let pba_offset = table_offset + table_len.next_multiple_of(PAGE);
        let pba_len = pci::msix::pba_bytes(vectors);
        let end = pba_offset + pba_len.next_multiple_of(PAGE);
        BarLayout {
            notify_len,
            table_offset,
            table_len,
            pba_offset,
            pba_len,
            size: end.next_power_of_two(),
        }
    }

    /// The region holding BAR0 offset `offset`.
    pub fn region(&self, offset: u64) -> Region {
        let within = |start: u64, len: u64| offset >= start && offset - start < len;
        if within(COMMON_OFFSET, size_of::<CommonCfg>() as u64) {
            Region::Common(offset - COMMON_OFFSET)
        } else if offset == ISR_OFFSET {
            Region::Isr(0)
        } else if within(DEVICE_OFFSET, DEVICE_LEN) {
            Region::Device(offset - DEVICE_OFFSET)
        } else if within(NOTIFY_OFFSET, self.notify_len) {
            Region::Notify(offset - NOTIFY_OFFSET)
        } else if within(self.table_offset, self.table_len) {
            Region::MsixTable(offset - self.table_offset)
        } else if within(self.pba_offset, self.pba_len) {
            Region::MsixPba(offset - self.pba_offset)
        } else {
            Region::Unused
        }
    }

    /// The virtio vendor capabilities, each as its offset in configuration space and its
    /// bytes (the PCI-configuration-access one without its guest-written fields).
    pub fn vendor_capabilities(&self) -> Vec<(u8, Vec<u8>)> {
        let plain = |cfg_type, next, offset, length| {
            vendor_cap(cfg_type, next, size_of::<VirtioPciCap>(), offset, length)
        };
        let common_len = size_of::<CommonCfg>() as u64;
        let notify = VirtioPciNotifyCap {
            cap: vendor_cap(
                CFG_TYPE_NOTIFY,
                CAP_PCI_CFG,
                size_of::<VirtioPciNotifyCap>(),
                NOTIFY_OFFSET,
                self.notify_len,
            ),
            notify_off_multiplier: U32::new(NOTIFY_OFF_MULTIPLIER),
        };
        let pci_cfg = VirtioPciCfgCap {
            cap: vendor_cap(CFG_TYPE_PCI, 0, size_of::<VirtioPciCfgCap>(), 0, 0),
            pci_cfg_data: [0; 4],
        };
        let common = plain(CFG_TYPE_COMMON, CAP_ISR, COMMON_OFFSET, common_len);
        let isr = plain(CFG_TYPE_ISR, CAP_DEVICE, ISR_OFFSET, 1);
        let device = plain(CFG_TYPE_DEVICE, CAP_NOTIFY, DEVICE_OFFSET, DEVICE_LEN);
        vec![
            (CAP_COMMON, common.as_bytes().to_vec()),
            (CAP_ISR, isr.as_bytes().to_vec()),
            (CAP_DEVICE, device.as_bytes().to_vec()),
            (CAP_NOTIFY, notify.as_bytes().to_vec()),
            (CAP_PCI_CFG, pci_cfg.as_bytes().to_vec()),
        ]
    }
}

/// A virtio capability header of `len` bytes, pointing at `length` bytes at `offset` of
/// BAR0.
fn vendor_cap(cfg_type: u8, next: u8, len: usize, offset: u64, length: u64) -> VirtioPciCap {
    VirtioPciCap {
        cap_vndr: VENDOR_CAP_ID,
        cap_next: next,
        cap_len: len as u8, // the structures are 16 or 20 bytes
        cfg_type,
        bar: BAR_INDEX as u8,
        offset: U32::new(offset as u32), // BAR offsets stay far below 4 GiB
        length: U32::new(length as u32),
        ..Default::default()
    }
}

/// The vendor-specific capability ID the virtio capabilities use.
const VENDOR_CAP_ID: u8 = 0x09;
