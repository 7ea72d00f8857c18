//! Snapshot/restore and live migration for ferrovm: a versioned, framed, checksummed stream
//! of guest memory and device/vCPU state, touched-page discovery, and the pre-copy engine.
//!
//! The crate is generic: the VMM plugs in guest RAM ([`GuestRam`], implemented for vm-memory
//! collections of [`HostMappedRegion`]s such as `GuestMemoryMmap`), the dirty log
//! ([`DirtySource`]) and control of the VM ([`VmControl`]); the device/vCPU state is an
//! opaque blob. The stream format is described byte by byte in `docs/migration.md`.
//!
//! - source: [`migrate`] (live, with a reply channel), [`snapshot_file`] (a snapshot file with
//!   page images, format version 2) or [`snapshot`] (a snapshot as a stream, version 1);
//! - destination: [`receive`] (then restore, resume, and `ack`); for snapshot files
//!   [`SnapshotImage`] (version 2: map the page images lazily, or load them) and
//!   [`restore_from`] (version 1).

mod bitmap;
mod compress;
mod config;
mod dedup;
mod error;
mod image;
mod lanes;
mod pages;
mod postcopy;
mod precopy;
mod ram;
mod receive;
mod resident;
mod senders;
mod shared_ram;
mod sink;
mod stages;
mod stream;

pub use bitmap::{words_for, Bitmap};
pub use compress::{Codec, Compression};
pub use config::{ConfigCheck, MigrationConfig};
pub use error::{Error, Result};
pub use image::{
    snapshot_file, snapshot_version, LoadReport, SnapshotImage, VerifyReport, IMAGE_ALIGN,
};
pub use lanes::{ParallelReceive, SpawnLane};
pub use pages::is_zero;
pub use postcopy::{
    Arrival, ArrivalReader, PostcopyIncoming, PostcopyReport, PostcopySource, Record, Switch,
    MAX_REQUEST_PAGES,
};
pub use precopy::{
    migrate, migrate_threaded, snapshot, DirtySource, MigrationParams, MigrationReport, Phase,
    Progress, RoundStats, SnapshotReport, StopReason, VmControl, THROTTLE_STEPS,
};
pub use ram::{FileBackedRam, GuestRam, HostMappedRegion, RamRange, RamRegion, PAGE_SIZE};
pub use receive::{
    receive, receive_parallel, restore_from, AckSender, IncomingReport, IncomingResult,
    IncomingRound, Restored,
};
pub use resident::{touched_pages, Residency, ResidencyMethod};
pub use shared_ram::receive_shared_ram;
pub use stages::{DestinationStages, SourceStages};
pub use stream::{
    encode_frame, page_crc, pages_frame_len, send_reply, wait_ack, CompressedPages, EndInfo, Frame,
    Header, Kind, PagesHeader, RegionImage, RoundEndInfo, StreamReader, StreamWriter, FLAG_LIVE,
    FORMAT_VERSION, FRAME_HEADER_LEN, FRAME_TRAILER_LEN, HEADER_LEN, MAGIC, MAX_COMPRESSED_PAGES,
    MAX_DATA_CONNECTIONS, MAX_DATA_PAGES_PER_FRAME, MAX_FRAME_PAYLOAD, MAX_IMAGE_REGIONS,
    MAX_PAGES_PER_FRAME, MAX_STATE_TOTAL, PAGES_FIXED_LEN, SAME_PAGE_FRAME_LEN, SNAPSHOT_VERSION,
    ZERO_PAGES_FRAME_LEN,
};
