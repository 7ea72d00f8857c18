//! Errors of the migration crate. Every message names what was wrong and where (the byte
//! offset in the stream, the guest address, both values of a mismatch).

use std::io;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while writing, reading or applying a migration stream.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error from the underlying reader or writer.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The stream ended in the middle of something.
    #[error("migration stream cut short: it ends inside {what} (at byte {offset})")]
    Truncated { what: String, offset: u64 },
    /// The stream ended cleanly between frames, but before the `End` frame.
    #[error("migration stream ended at byte {offset} before its End frame (the sender stopped or the connection was lost)")]
    EndedEarly { offset: u64 },
    /// The first 8 bytes are not "FERROVM\0".
    #[error("not a ferrovm migration stream: the magic is {found:02x?}, expected \"FERROVM\\0\"")]
    BadMagic { found: [u8; 8] },
    /// The stream was written in a format version this build does not read.
    /// The stream was written in a format version this build does not read (or does not read
    /// here: a version 2 snapshot file is not a migration stream).
    #[error("unsupported migration stream version {found}: this ferrovm reads {supported}")]
    UnsupportedVersion { found: u32, supported: &'static str },
    /// Header flags this build does not know.
    #[error("migration stream header has unknown flags {flags:#x}")]
    UnknownHeaderFlags { flags: u32 },
    /// A checksum did not match: the stream is corrupted.
    #[error("migration stream corrupted: checksum mismatch in {what} at byte {offset} (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        what: String,
        offset: u64,
        stored: u32,
        computed: u32,
    },
    /// A frame kind that is unknown, or not allowed in this direction.
    #[error("migration stream corrupted: unknown frame kind {kind} at byte {offset}")]
    UnknownKind { kind: u8, offset: u64 },
    /// A frame longer than its kind allows.
    #[error("migration stream corrupted: {kind} frame at byte {offset} claims {length} bytes, more than the {max} allowed")]
    FrameTooLarge {
        kind: &'static str,
        length: u32,
        max: u32,
        offset: u64,
    },
    /// A frame whose fields are malformed (wrong length, reserved bits set, bad JSON, ...).
    #[error("migration stream corrupted: malformed {kind} frame at byte {offset}: {reason}")]
    Malformed {
        kind: &'static str,
        offset: u64,
        reason: String,
    },
    /// A page frame that points outside guest RAM or is not page-aligned.
    #[error("migration stream refers to guest pages {addr:#x}..{end:#x} ({count} pages) at byte {offset}: {reason}")]
    BadPageRange {
        addr: u64,
        end: u64,
        count: u64,
        offset: u64,
        reason: String,
    },
    /// Frames in an order the protocol does not allow.
    #[error("migration protocol error at byte {offset}: {reason}")]
    Protocol { offset: u64, reason: String },
    /// The source and destination machines differ.
    #[error(
        "machine mismatch: {field} differs: source {source_value}, destination {destination_value}"
    )]
    ConfigMismatch {
        field: String,
        source_value: String,
        destination_value: String,
    },
    /// A snapshot file shorter than the page image of one of its RAM regions: mapping it
    /// would leave guest pages past the end of the file.
    #[error("snapshot file cut short: it is {file_len} bytes, but the page image of the RAM region at guest address {region_addr:#x} ends at byte {end}")]
    ShortImage {
        file_len: u64,
        region_addr: u64,
        end: u64,
    },
    /// A page of a snapshot file's page image does not match its CRC in the table.
    #[error("snapshot file corrupted: guest page {addr:#x} (page data at byte {offset} of the file) fails its checksum (stored {stored:#010x}, computed {computed:#010x})")]
    PageCorrupt {
        addr: u64,
        offset: u64,
        stored: u32,
        computed: u32,
    },
    /// A page that holds data lies past the end of the snapshot file: the file was truncated
    /// after it was opened (while a lazily restored guest still needed it).
    #[error("snapshot file cut short: guest page {addr:#x} (page data at byte {offset} of the file) lies past the file's end (byte {file_len}): it was truncated after the restore began")]
    PagePastEnd {
        addr: u64,
        offset: u64,
        file_len: u64,
    },
    /// Non-zero bytes in a snapshot file's page image where the CRC table lists no data.
    #[error("snapshot file corrupted: guest page {addr:#x} (byte {offset} of the file) holds data, but the snapshot's page table lists none there")]
    UnlistedData { addr: u64, offset: u64 },
    /// Pages that failed their checksum during a live round and were never sent again.
    #[error("{count} guest pages arrived corrupted (first at guest address {first_addr:#x}) and were not sent again before the end of the migration")]
    TornPages { count: u64, first_addr: u64 },
    /// The source sent the guest's final state, then lost the destination before hearing
    /// whether it runs the guest (no `Ack`, no `Error`): the destination may be running it, so
    /// the source guest must stay paused.
    #[error("outcome unknown: the destination may be running the guest ({cause}); the guest stays paused here")]
    OutcomeUnknown { cause: String },
    /// The peer reported an error (an `Error` frame).
    #[error("post-copy failed and the guest is lost ({cause}): its memory was split between source and destination")]
    PostcopyLost { cause: String },
    #[error("the {peer} reported an error: {message}")]
    Peer { peer: &'static str, message: String },
    /// Guest RAM as described by the VMM is unusable (overlapping, unaligned, read-only...).
    #[error("guest RAM layout: {0}")]
    Layout(String),
    /// An error from the VMM's side of the traits (dirty log, pause, state...).
    #[error("{0}")]
    Vmm(String),
    /// A configuration value of the migration itself is invalid.
    #[error("invalid migration parameter: {0}")]
    Param(String),
}

impl Error {
    /// True for [`Error::OutcomeUnknown`]: the source guest must not run again on its own.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Error::OutcomeUnknown { .. })
    }

    /// An error raised by a [`crate::DirtySource`] or [`crate::VmControl`] implementation.
    pub fn vmm(message: impl std::fmt::Display) -> Self {
        Error::Vmm(message.to_string())
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
