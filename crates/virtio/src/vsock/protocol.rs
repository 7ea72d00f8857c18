//! virtio-vsock wire constants (virtio 1.2, 5.10).

/// The host's context id.
pub const HOST_CID: u64 = 2;
/// The smallest context id a guest may have (0-2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;
/// Context ids are 32-bit in the socket API; -1U means "any".
pub const MAX_GUEST_CID: u64 = u32::MAX as u64 - 1;

pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const EVENT_QUEUE: u16 = 2;

pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive, send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// struct virtio_vsock_event id: the transport was reset (after a restore or migration),
/// every connection is gone.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

pub use virtio_vsock::packet::PKT_HEADER_SIZE as PACKET_HEADER_SIZE;
