//! Where a migration's time goes, per stage, on each side: reported with the migration so
//! that a slow run can be told apart from a slow link (docs/migration.md, "Profile").

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::precopy::ms;

/// The source's time per stage, summed over all rounds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SourceStages {
    /// Finding the touched pages for round 0 (pagemap) and reading the dirty log.
    #[serde(rename = "scan_ms", serialize_with = "ms")]
    pub scan: Duration,
    /// Reading each page to send: zero check and CRC-32.
    #[serde(rename = "inspect_ms", serialize_with = "ms")]
    pub inspect: Duration,
    /// Compressing page data (part of `inspect_ms`'s thread, not of it).
    #[serde(rename = "compress_ms", serialize_with = "ms")]
    pub compress: Duration,
    /// In `writev`: the kernel copying into the socket, or waiting for the peer to read.
    #[serde(rename = "write_ms", serialize_with = "ms")]
    pub write: Duration,
    /// Waiting for the destination's `RoundAck` after a round was written.
    #[serde(rename = "round_ack_wait_ms", serialize_with = "ms")]
    pub round_ack_wait: Duration,
}

/// The destination's time per stage, summed over all rounds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DestinationStages {
    /// Populating guest memory ahead of the data (`MADV_POPULATE_WRITE`): the first-touch
    /// page faults, taken in one call per frame instead of one per page inside `read`.
    #[serde(rename = "populate_ms", serialize_with = "ms")]
    pub populate: Duration,
    /// In `read` for page data: the kernel's copy from the socket into guest memory, or
    /// waiting for the source.
    #[serde(rename = "read_ms", serialize_with = "ms")]
    pub read: Duration,
    /// Checking the CRC-32 of each page received.
    #[serde(rename = "crc_ms", serialize_with = "ms")]
    pub crc: Duration,
    /// Zeroing pages that a `ZeroPages` frame names and that held data.
    #[serde(rename = "zero_ms", serialize_with = "ms")]
    pub zero: Duration,
}

/// Adds the time since `since` to `total` and returns now.
pub(crate) fn lap(total: &mut Duration, since: Instant) -> Instant {
    let now = Instant::now();
    *total += now.duration_since(since);
    now
}
