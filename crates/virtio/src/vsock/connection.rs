//! One stream connection between a guest port and a host Unix socket, with the virtio-vsock
//! credit accounting of both directions (virtio 1.2, 5.10.6.3).

use std::collections::VecDeque;
use std::io::{self, ErrorKind, Write};
use std::os::unix::net::UnixStream;

/// Bytes the device buffers per connection for the host socket: the receive window
/// (`buf_alloc`) it advertises to the guest. A guest that sends beyond it is reset.
pub const BUF_ALLOC: u32 = 128 << 10;
/// Forwarded bytes the guest has not been told about after which the device sends a
/// CREDIT_UPDATE on its own: the guest then always sees most of the window free.
pub const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 4;

/// (host port, guest port): how packets name a connection.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    /// A host client asked for it: REQUEST sent, waiting for the guest's RESPONSE.
    Connecting,
    Established,
}

/// A connection and its host socket.
pub struct Connection {
    pub stream: UnixStream,
    pub state: ConnState,
    /// The guest's receive window and how much of what it received it has consumed.
    pub peer_buf_alloc: u32,
    pub peer_fwd_cnt: u32,
    /// Bytes sent to the guest (wrapping, as the protocol counts).
    pub rx_cnt: u32,
    /// Guest bytes written to the host socket, and the value last told to the guest.
    pub fwd_cnt: u32,
    pub reported_fwd_cnt: u32,
    /// Guest bytes the host socket has not taken yet (at most [`BUF_ALLOC`]).
    pub pending_to_host: VecDeque<u8>,
    /// The host socket has data (epoll said so; cleared when a read would block).
    pub host_readable: bool,
    /// The host closed its end (a read returned 0).
    pub host_eof: bool,
    /// VIRTIO_VSOCK_SHUTDOWN_* flags the guest sent.
    pub guest_shutdown: u32,
    /// Whether the write side of the host socket is shut (the guest will send no more).
    pub host_write_shut: bool,
    /// The epoll events registered for the socket (empty: not registered).
    pub registered: u32,
    /// A CREDIT_UPDATE for this connection waits in the control queue.
    pub credit_update_queued: bool,
    /// Connecting: when the host client gives up waiting for the guest.
    pub connect_deadline: Option<std::time::Instant>,
}

impl Connection {
    pub fn new(stream: UnixStream, state: ConnState) -> Connection {
        Connection {
            stream,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            rx_cnt: 0,
            fwd_cnt: 0,
            reported_fwd_cnt: 0,
            pending_to_host: VecDeque::new(),
            host_readable: false,
            host_eof: false,
            guest_shutdown: 0,
            host_write_shut: false,
            registered: 0,
            credit_update_queued: false,
            connect_deadline: None,
        }
    }

    /// Records the credit fields every guest packet carries.
    pub fn update_peer_credit(&mut self, buf_alloc: u32, fwd_cnt: u32) {
        self.peer_buf_alloc = buf_alloc;
        self.peer_fwd_cnt = fwd_cnt;
    }

    /// Bytes the guest can take now. A guest whose counters go backwards gets nothing
    /// rather than an enormous window.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = self.rx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether `len` more guest bytes fit in what the device advertised.
    pub fn fits_window(&self, len: usize) -> bool {
        self.pending_to_host.len() + len <= BUF_ALLOC as usize
    }

    /// Whether the guest should hear about the bytes forwarded since the last report.
    pub fn credit_update_due(&self) -> bool {
        self.fwd_cnt.wrapping_sub(self.reported_fwd_cnt) >= CREDIT_UPDATE_THRESHOLD
    }

    /// Sends guest bytes to the host socket: directly while nothing waits, the rest kept.
    /// Errors other than a full socket mean the host end is gone.
    pub fn send_to_host(&mut self, data: &[u8]) -> io::Result<()> {
        let mut written = 0;
        if self.pending_to_host.is_empty() {
            written = write_some(&mut self.stream, data)?;
            self.fwd_cnt = self.fwd_cnt.wrapping_add(written as u32);
        }
        self.pending_to_host.extend(&data[written..]);
        Ok(())
    }

    /// Writes what the host socket takes of the kept bytes.
    pub fn flush_to_host(&mut self) -> io::Result<()> {
        while !self.pending_to_host.is_empty() {
            let (front, _) = self.pending_to_host.as_slices();
            let n = write_some(&mut self.stream, front)?;
            if n == 0 {
                break;
            }
            self.pending_to_host.drain(..n);
            self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
        }
        Ok(())
    }
}

/// Writes as much of `data` as the non-blocking socket takes (0 if it is full).
fn write_some(stream: &mut UnixStream, data: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < data.len() {
        match stream.write(&data[done..]) {
            Ok(0) => return Err(io::Error::from(ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_never_exceeds_the_window() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut c = Connection::new(a, ConnState::Established);
        c.update_peer_credit(1000, 0);
        assert_eq!(c.peer_credit(), 1000);
        c.rx_cnt = 600;
        assert_eq!(c.peer_credit(), 400);
        c.update_peer_credit(1000, 600);
        assert_eq!(c.peer_credit(), 1000);
        // A guest claiming to have consumed more than it got.
        c.update_peer_credit(1000, 5000);
        assert_eq!(c.peer_credit(), 0);
        // Counters wrap.
        c.rx_cnt = 10;
        c.update_peer_credit(1000, u32::MAX - 9);
        assert_eq!(c.peer_credit(), 980);
    }

    #[test]
    fn a_full_host_socket_keeps_the_rest_within_the_window() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut c = Connection::new(a, ConnState::Established);
        let chunk = vec![7u8; 64 << 10];
        let mut sent = 0;
        while c.fits_window(chunk.len()) && sent < 64 << 20 {
            c.send_to_host(&chunk).unwrap();
            sent += chunk.len();
        }
        assert!(!c.pending_to_host.is_empty());
        assert!(c.pending_to_host.len() <= BUF_ALLOC as usize);
        assert_eq!(c.fwd_cnt as usize + c.pending_to_host.len(), sent);
        drop(b);
        assert!(c.flush_to_host().is_err());
    }
}
