//! virtio-vsock (type 19): stream sockets between the guest and host processes, with
//! Firecracker's host-side convention so that its clients work unchanged.
//!
//! - The guest connects to host port P: the device connects to the Unix socket `PATH_P`.
//! - A host process connects to the Unix socket `PATH` (the device listens there) and
//!   writes `CONNECT P\n`; the device sends the guest a REQUEST for its port P and answers
//!   `OK <host port>\n` once the guest accepted, or closes the socket if it refused.
//!
//! Three queues (receive, transmit, event) are served on one I/O thread ([`muxer`]), which
//! also waits on the host sockets through an epoll set. Only the stream type is offered
//! (no VIRTIO_VSOCK_F_SEQPACKET). Packets are parsed with the rust-vmm `virtio-vsock`
//! crate. Connections do not survive a snapshot or a migration: the restored device sends
//! VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, as Firecracker does, and the guest starts afresh.

pub mod connection;
pub mod host;
pub mod muxer;
pub mod protocol;

use std::path::PathBuf;
use std::sync::Arc;

use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemory;

use crate::rng::COMMON_FEATURES;
use crate::worker::Workers;
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use muxer::{HostSide, Muxer};
use protocol::{MAX_GUEST_CID, MIN_GUEST_CID};

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
const QUEUE_COUNT: usize = 3;
const STATE_VERSION: u32 = 1;

/// What survives a snapshot: the guest's address. Connections do not.
#[derive(Serialize, Deserialize)]
struct VsockState {
    cid: u64,
}

/// Why a vsock device cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error(
        "cid {0} is reserved or out of range (a guest cid is {MIN_GUEST_CID} to {MAX_GUEST_CID})"
    )]
    BadCid(u64),
    #[error("cannot listen on {path}: {error}")]
    Listen {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
}

/// A virtio-vsock device.
pub struct Vsock {
    cid: u64,
    host: Arc<HostSide>,
    workers: Workers,
    /// Restored from a snapshot: the next activation announces a transport reset.
    reset_on_activate: bool,
}

impl Vsock {
    /// A device for guest `cid` listening on the Unix socket `socket`.
    pub fn new(cid: u64, socket: PathBuf) -> Result<Vsock, VsockError> {
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&cid) {
            return Err(VsockError::BadCid(cid));
        }
        let host = HostSide::new(socket.clone()).map_err(|error| VsockError::Listen {
            path: socket,
            error,
        })?;
        Ok(Vsock {
            cid,
            host: Arc::new(host),
            workers: Workers::default(),
            reset_on_activate: false,
        })
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }
}

impl Drop for Vsock {
    /// The socket file goes with the device (if it is still ours).
    fn drop(&mut self) {
        self.workers.stop();
        self.host.remove_socket_file();
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; QUEUE_COUNT]
    }

    fn features(&self) -> u64 {
        // Stream only: VIRTIO_VSOCK_F_STREAM absent means stream (virtio 1.2, 5.10.3).
        COMMON_FEATURES
    }

    /// struct virtio_vsock_config { le64 guest_cid; }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.cid.to_le_bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            *byte = usize::try_from(at)
                .ok()
                .and_then(|at| config.get(at).copied())
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.len() != QUEUE_COUNT {
            return Err(ActivateError(format!(
                "virtio-vsock: {} queues ready, expected {QUEUE_COUNT}",
                queues.len()
            )));
        }
        self.workers.stop();
        let reset = std::mem::take(&mut self.reset_on_activate);
        let muxer = Muxer::new(self.cid, self.host.clone(), reset)
            .map_err(|e| ActivateError(format!("virtio-vsock: {e}")))?;
        self.workers.spawn(
            "virtio-vsock".into(),
            mem,
            acked_features,
            queues,
            interrupt,
            muxer,
        )
    }

    fn workers(&self) -> Option<&Workers> {
        Some(&self.workers)
    }

    fn workers_mut(&mut self) -> Option<&mut Workers> {
        Some(&mut self.workers)
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(STATE_VERSION, &VsockState { cid: self.cid })
    }

    /// The guest knows its cid: a snapshot of another cid is refused. Connections of the
    /// saved machine are gone; the guest hears so when the device runs again.
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let saved: VsockState = state.parse("virtio-vsock", STATE_VERSION)?;
        if saved.cid != self.cid {
            return Err(StateError::new(
                "virtio-vsock",
                format!(
                    "the snapshot's guest has cid {}, this device (--vsock) {}",
                    saved.cid, self.cid
                ),
            ));
        }
        self.reset_on_activate = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
