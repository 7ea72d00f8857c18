//! The device's I/O thread: packets from the guest's transmit queue go to host sockets,
//! host socket data and control packets go into the receive queue, and a transport reset
//! goes into the event queue after a restore.
//!
//! Everything a guest can make the device hold is bounded: one staged receive packet, at
//! most [`MAX_CONTROL`] queued control packets besides the staged one (the transmit queue is not served beyond
//! that, so a guest that never reads cannot grow it), [`BUF_ALLOC`] bytes per connection
//! and [`MAX_CONNECTIONS`] connections.

// BTreeMap, not HashMap: no random seed (getrandom) on the activating vCPU thread.
use std::collections::{BTreeMap, VecDeque};
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::exit::Waker;
use virtio_queue::DescriptorChain;
use virtio_vsock::packet::VsockPacket;
use vm_memory::{Address, Bytes, GuestMemory};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::timerfd::TimerFd;

use super::connection::{ConnKey, ConnState, Connection, BUF_ALLOC};
use super::host::{self, LineStatus, PendingClient};
use super::protocol::*;
use crate::worker::QueueHandler;

/// Control packets waiting for receive buffers at most.
pub const MAX_CONTROL: usize = 256;
/// Open connections at most; further requests are reset.
pub const MAX_CONNECTIONS: usize = 256;
/// Host clients still sending their CONNECT line at most; each has
/// [`host::CONNECT_LINE_TIMEOUT`] to finish it, and a new client makes room by closing the
/// one that has waited longest.
pub const MAX_PENDING_CLIENTS: usize = 64;
/// Largest payload of one packet either way (Linux's VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PAYLOAD: u32 = 64 << 10;
/// How long a host client's CONNECT waits for the guest to accept (Firecracker's figure):
/// then the guest gets an RST and the client's socket is closed.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Host ports handed to host-initiated connections start here.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// A packet for the receive queue.
struct RxPacket {
    key: ConnKey,
    op: u16,
    flags: u32,
    /// RW only: the payload and how much of it the guest has got.
    payload: Vec<u8>,
    sent: usize,
}

impl RxPacket {
    fn control(key: ConnKey, op: u16, flags: u32) -> RxPacket {
        RxPacket {
            key,
            op,
            flags,
            payload: Vec::new(),
            sent: 0,
        }
    }
}

/// Who owns a descriptor in the epoll set.
#[derive(Clone, Copy)]
enum Owner {
    Listener,
    Timer,
    Pending,
    Conn(ConnKey),
}

/// What the device keeps across activations: the listening socket and the epoll set.
pub struct HostSide {
    pub socket: PathBuf,
    pub listener: UnixListener,
    pub epoll: Epoll,
    /// Fires at the earliest CONNECT deadline (made here: timerfd_create is not a call of
    /// the device threads).
    pub timer: Mutex<TimerFd>,
    /// The socket file's (device, inode), to remove it at the end only if still ours.
    file_id: Option<(u64, u64)>,
}

impl HostSide {
    /// Binds the socket and watches it.
    pub fn new(socket: PathBuf) -> io::Result<HostSide> {
        let listener = host::bind_listener(&socket)?;
        let epoll = Epoll::new()?;
        let timer = TimerFd::new().map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        set_nonblocking(timer.as_raw_fd())?;
        for fd in [listener.as_raw_fd(), timer.as_raw_fd()] {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, fd as u64),
            )?;
        }
        Ok(HostSide {
            timer: Mutex::new(timer),
            file_id: file_id(&socket),
            socket,
            listener,
            epoll,
        })
    }

    fn timer_fd(&self) -> RawFd {
        self.timer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_raw_fd()
    }

    /// Removes the socket file if it is still the one bound here.
    pub fn remove_socket_file(&self) {
        if self.file_id.is_some() && file_id(&self.socket) == self.file_id {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// O_NONBLOCK on `fd`: the timer may be re-armed between epoll's report and its read,
/// which must then fail rather than wait for the new expiry.
fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL on a descriptor this process owns touch no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// The queue handler; see the module documentation.
pub struct Muxer {
    cid: u64,
    host: Arc<HostSide>,
    conns: BTreeMap<ConnKey, Connection>,
    pending: BTreeMap<RawFd, PendingClient>,
    owners: BTreeMap<RawFd, Owner>,
    /// Connections whose host socket has data, served in turn.
    readable: VecDeque<ConnKey>,
    control: VecDeque<RxPacket>,
    staged: Option<RxPacket>,
    /// A TRANSPORT_RESET waits for an event buffer.
    reset_event: bool,
    /// The transmit queue was left unserved because replies filled up: serve it again
    /// (the guest will not notify again for chains it already queued) once they drain.
    tx_throttled: bool,
    /// accept(2) failed (out of descriptors): the listener left the epoll set, or it would
    /// be reported readable again at once; it is back when a connection closes.
    listener_paused: bool,
    /// Woken when the receive queue has something new, so the worker serves it.
    rx_kick: Arc<Waker>,
    next_local_port: u32,
    scratch: Vec<u8>,
}

impl Muxer {
    pub fn new(cid: u64, host: Arc<HostSide>, reset_event: bool) -> io::Result<Muxer> {
        let mut owners = BTreeMap::new();
        owners.insert(host.listener.as_raw_fd(), Owner::Listener);
        owners.insert(host.timer_fd(), Owner::Timer);
        Ok(Muxer {
            cid,
            host,
            conns: BTreeMap::new(),
            pending: BTreeMap::new(),
            owners,
            readable: VecDeque::new(),
            control: VecDeque::new(),
            staged: None,
            reset_event,
            tx_throttled: false,
            listener_paused: false,
            rx_kick: Arc::new(Waker::new()?),
            next_local_port: FIRST_LOCAL_PORT,
            scratch: Vec::new(),
        })
    }

    fn kick_rx(&self) {
        if let Err(e) = self.rx_kick.wake() {
            log::error!("virtio-vsock: cannot wake the worker: {e}");
        }
    }

    fn push_control(&mut self, key: ConnKey, op: u16, flags: u32) {
        self.control.push_back(RxPacket::control(key, op, flags));
        self.kick_rx();
    }

    /// Queues a CREDIT_UPDATE unless one for the connection is queued already: a host
    /// socket taking guest bytes one at a time cannot grow the queue.
    fn push_credit_update(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if !std::mem::replace(&mut conn.credit_update_queued, true) {
            self.push_control(key, OP_CREDIT_UPDATE, 0);
        }
    }

    /// Drops a connection (its host socket closes) and tells the guest.
    fn reset(&mut self, key: ConnKey) {
        self.remove(key);
        self.push_control(key, OP_RST, 0);
    }

    fn remove(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.remove(&key) {
            let fd = conn.stream.as_raw_fd();
            self.owners.remove(&fd);
            if conn.registered != 0 {
                let _ = self
                    .host
                    .epoll
                    .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            }
        }
        self.readable.retain(|k| *k != key);
        self.pause_listener(false);
    }

    /// Registers for what the connection can act on now: input while the guest has credit
    /// and no read is due anyway, output while guest bytes wait for the host socket.
    fn update_interest(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        let mut wanted = EventSet::empty();
        let open = conn.state == ConnState::Established;
        let guest_receives = conn.guest_shutdown & SHUTDOWN_RCV == 0;
        if open && !conn.host_readable && !conn.host_eof && guest_receives && conn.peer_credit() > 0
        {
            wanted |= EventSet::IN;
        }
        if !conn.pending_to_host.is_empty() {
            wanted |= EventSet::OUT;
        }
        if wanted.bits() == conn.registered {
            return;
        }
        let fd = conn.stream.as_raw_fd();
        let op = match (conn.registered, wanted.is_empty()) {
            (0, _) => ControlOperation::Add,
            (_, true) => ControlOperation::Delete,
            _ => ControlOperation::Modify,
        };
        match self
            .host
            .epoll
            .ctl(op, fd, EpollEvent::new(wanted, fd as u64))
        {
            Ok(()) => conn.registered = wanted.bits(),
            Err(e) => {
                log::warn!("virtio-vsock: epoll on port {}: {e}", key.local_port);
                self.reset(key);
            }
        }
    }

    // ---- host events ----

    fn accept_clients(&mut self) {
        for _ in 0..MAX_PENDING_CLIENTS {
            let stream = match self.host.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    log::warn!(
                        "virtio-vsock: accept on {}: {e}",
                        self.host.socket.display()
                    );
                    return;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue; // dropped: closed
            }
            if self.pending.len() >= MAX_PENDING_CLIENTS {
                // Idle handshakes must not lock real clients out: the oldest goes.
                let oldest = self.pending.iter().min_by_key(|(_, c)| c.deadline);
                if let Some(fd) = oldest.map(|(fd, _)| *fd) {
                    self.drop_pending(fd);
                }
            }
            let fd = stream.as_raw_fd();
            let event = EpollEvent::new(EventSet::IN, fd as u64);
            if self
                .host
                .epoll
                .ctl(ControlOperation::Add, fd, event)
                .is_ok()
            {
                self.owners.insert(fd, Owner::Pending);
                self.pending.insert(fd, PendingClient::new(stream));
            }
        }
        self.arm_timer();
    }

    /// Forgets a host client still sending its line; closes it unless the caller keeps it.
    fn drop_pending(&mut self, fd: RawFd) -> Option<PendingClient> {
        let client = self.pending.remove(&fd)?;
        self.owners.remove(&fd);
        let _ = self
            .host
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        Some(client)
    }

    /// Takes the listener out of the epoll set (`pause`) or puts it back.
    fn pause_listener(&mut self, pause: bool) {
        if self.listener_paused == pause {
            return;
        }
        let fd = self.host.listener.as_raw_fd();
        let (op, events) = if pause {
            (ControlOperation::Delete, EventSet::empty())
        } else {
            (ControlOperation::Add, EventSet::IN)
        };
        match self
            .host
            .epoll
            .ctl(op, fd, EpollEvent::new(events, fd as u64))
        {
            Ok(()) => self.listener_paused = pause,
            Err(e) => log::warn!("virtio-vsock: epoll on the listener: {e}"),
        }
    }

    fn read_client_line(&mut self, fd: RawFd) {
        let Some(client) = self.pending.get_mut(&fd) else {
            return;
        };
        let status = client.read_line();
        if status == LineStatus::Partial {
            return;
        }
        let Some(client) = self.drop_pending(fd) else {
            return;
        };
        self.pause_listener(false);
        if let LineStatus::Connect(port) = status {
            self.connect_to_guest(client, port);
        }
    }

    /// A host client's `CONNECT port`: a REQUEST to the guest from a fresh host port.
    fn connect_to_guest(&mut self, client: PendingClient, peer_port: u32) {
        if self.conns.len() >= MAX_CONNECTIONS {
            return;
        }
        let Some(local_port) = self.free_local_port(peer_port) else {
            return;
        };
        let key = ConnKey {
            local_port,
            peer_port,
        };
        let fd = client.stream.as_raw_fd();
        let mut conn = Connection::new(client.stream, ConnState::Connecting);
        conn.connect_deadline = Some(Instant::now() + CONNECT_TIMEOUT);
        self.conns.insert(key, conn);
        self.owners.insert(fd, Owner::Conn(key));
        self.push_control(key, OP_REQUEST, 0);
        self.arm_timer();
    }

    /// Sets the timer to the earliest deadline of a CONNECT line or of the guest's answer
    /// (a spurious expiry is harmless).
    fn arm_timer(&self) {
        let answers = self
            .conns
            .values()
            .filter(|c| c.state == ConnState::Connecting)
            .filter_map(|c| c.connect_deadline);
        let lines = self.pending.values().map(|c| c.deadline);
        let Some(earliest) = answers.chain(lines).min() else {
            return;
        };
        let wait = earliest
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let mut timer = self.host.timer.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = timer.reset(wait, None) {
            log::warn!("virtio-vsock: cannot arm the CONNECT timer: {e}");
        }
    }

    /// The timer fired: host clients that did not send their line in time, or that the
    /// guest did not answer in time, are turned away.
    fn expire_connects(&mut self) {
        {
            let mut timer = self.host.timer.lock().unwrap_or_else(|e| e.into_inner());
            // Clears the expiry; non-blocking (an error if it was re-armed meanwhile).
            let _ = timer.wait();
        }
        let now = Instant::now();
        let silent: Vec<RawFd> = self
            .pending
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in silent {
            log::debug!("virtio-vsock: a host client sent no CONNECT line in time");
            self.drop_pending(fd);
        }
        let late: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == ConnState::Connecting)
            .filter(|(_, c)| c.connect_deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            log::debug!(
                "virtio-vsock: the guest did not accept port {}",
                key.peer_port
            );
            self.reset(key);
        }
        self.arm_timer();
    }

    fn free_local_port(&mut self, peer_port: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_local_port;
            self.next_local_port = self
                .next_local_port
                .checked_add(1)
                .unwrap_or(FIRST_LOCAL_PORT);
            let key = ConnKey {
                local_port: port,
                peer_port,
            };
            if !self.conns.contains_key(&key) {
                return Some(port);
            }
        }
        None
    }

    fn connection_event(&mut self, key: ConnKey, events: EventSet) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if events.intersects(EventSet::IN | EventSet::HANG_UP | EventSet::ERROR)
            && conn.state == ConnState::Established
            && !conn.host_readable
        {
            conn.host_readable = true;
            self.readable.push_back(key);
        }
        // A hung-up or failed socket is flushed too: the write fails and resets the
        // connection, rather than the event firing again and again.
        if events.intersects(EventSet::OUT | EventSet::HANG_UP | EventSet::ERROR) {
            self.flush(key);
        }
        self.update_interest(key);
    }

    /// Writes kept guest bytes to the host; finishes a connection the guest closed.
    fn flush(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.flush_to_host().is_err() {
            self.reset(key);
            return;
        }
        if conn.credit_update_due() {
            self.push_credit_update(key);
        }
        self.finish_shutdown(key);
    }

    /// Once every guest byte is out: a guest SHUTDOWN of both directions closes the
    /// connection (RST, as the protocol asks); of its sending side shuts the host's reading.
    fn finish_shutdown(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if !conn.pending_to_host.is_empty() {
            return;
        }
        if conn.guest_shutdown & SHUTDOWN_BOTH == SHUTDOWN_BOTH {
            self.reset(key);
        } else if conn.guest_shutdown & SHUTDOWN_SEND != 0 && !conn.host_write_shut {
            conn.host_write_shut = true;
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        }
    }

    // ---- guest packets ----

    fn handle_tx<B: vm_memory::bitmap::BitmapSlice>(&mut self, packet: &VsockPacket<'_, B>) {
        if packet.src_cid() != self.cid || packet.dst_cid() != HOST_CID {
            log::debug!(
                "virtio-vsock: packet from cid {} to cid {} dropped",
                packet.src_cid(),
                packet.dst_cid()
            );
            return;
        }
        let key = ConnKey {
            local_port: packet.dst_port(),
            peer_port: packet.src_port(),
        };
        if packet.type_() != TYPE_STREAM {
            if packet.op() != OP_RST {
                self.push_control(key, OP_RST, 0);
            }
            return;
        }
        if packet.op() == OP_REQUEST {
            self.guest_connect(key, packet.buf_alloc(), packet.fwd_cnt());
            return;
        }
        let Some(conn) = self.conns.get_mut(&key) else {
            if packet.op() != OP_RST {
                self.push_control(key, OP_RST, 0);
            }
            return;
        };
        conn.update_peer_credit(packet.buf_alloc(), packet.fwd_cnt());
        match packet.op() {
            OP_RESPONSE => self.guest_accepted(key),
            OP_RW => self.guest_data(key, packet),
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.push_credit_update(key),
            OP_SHUTDOWN => self.guest_shutdown(key, packet.flags()),
            OP_RST => self.remove(key),
            _ => self.reset(key),
        }
        self.update_interest(key);
    }

    /// A transmit packet whose payload spans several descriptors ([`gather_tx`]).
    fn handle_gathered_tx<M: GuestMemory>(
        &mut self,
        mem: &M,
        chain: DescriptorChain<&M>,
    ) -> Result<(), String> {
        let (header, mut payload) = gather_tx(mem, chain)?;
        let mut header_buf = [0u8; PACKET_HEADER_SIZE];
        // SAFETY: both buffers outlive the packet, which is dropped at the end of this
        // function, and nothing else touches them meanwhile.
        let mut packet = unsafe { VsockPacket::new(&mut header_buf, Some(&mut payload)) }
            .map_err(|e| e.to_string())?;
        packet
            .set_header_from_raw(&header)
            .map_err(|e| e.to_string())?;
        self.handle_tx(&packet);
        Ok(())
    }

    /// REQUEST: connect to `PATH_port`; RESPONSE or RST.
    fn guest_connect(&mut self, key: ConnKey, buf_alloc: u32, fwd_cnt: u32) {
        if self.conns.contains_key(&key) || self.conns.len() >= MAX_CONNECTIONS {
            self.reset(key);
            return;
        }
        let path = host::port_path(&self.host.socket, key.local_port);
        let stream = match host::connect_nonblocking(&path) {
            Ok(stream) => stream,
            Err(e) => {
                log::debug!("virtio-vsock: {}: {e}", path.display());
                self.push_control(key, OP_RST, 0);
                return;
            }
        };
        let fd = stream.as_raw_fd();
        let mut conn = Connection::new(stream, ConnState::Established);
        conn.update_peer_credit(buf_alloc, fwd_cnt);
        self.conns.insert(key, conn);
        self.owners.insert(fd, Owner::Conn(key));
        self.push_control(key, OP_RESPONSE, 0);
        self.update_interest(key);
    }

    /// RESPONSE to a host client's REQUEST: tell the client `OK <host port>`.
    fn guest_accepted(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.state != ConnState::Connecting {
            self.reset(key);
            return;
        }
        conn.state = ConnState::Established;
        let line = format!("OK {}\n", key.local_port);
        // A fresh socket takes a few bytes; one that does not has a client gone wrong.
        if conn.stream.write_all(line.as_bytes()).is_err() {
            self.reset(key);
        }
    }

    fn guest_data<B: vm_memory::bitmap::BitmapSlice>(
        &mut self,
        key: ConnKey,
        packet: &VsockPacket<'_, B>,
    ) {
        let len = packet.len() as usize;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        let refused = conn.state != ConnState::Established
            || conn.guest_shutdown & SHUTDOWN_SEND != 0
            || !conn.fits_window(len);
        if refused {
            log::debug!("virtio-vsock: data beyond the window or state on port {key:?}");
            self.reset(key);
            return;
        }
        self.scratch.resize(len, 0);
        let copied = packet
            .data_slice()
            .map_or(0, |slice| slice.copy_to(&mut self.scratch[..]));
        if copied != len || conn.send_to_host(&self.scratch).is_err() {
            self.reset(key);
            return;
        }
        if conn.credit_update_due() {
            self.push_credit_update(key);
        }
    }

    fn guest_shutdown(&mut self, key: ConnKey, flags: u32) {
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.guest_shutdown |= flags & SHUTDOWN_BOTH;
        }
        self.finish_shutdown(key);
    }

    // ---- the receive queue ----

    /// Makes sure a packet is staged for the receive queue if there is anything to send.
    fn stage(&mut self) -> bool {
        if let Some(staged) = &self.staged {
            // Data of a connection reset since is dropped.
            if staged.op != OP_RW || self.conns.contains_key(&staged.key) {
                return true;
            }
            self.staged = None;
        }
        if let Some(packet) = self.control.pop_front() {
            self.staged = Some(packet);
            return true;
        }
        for _ in 0..self.readable.len() {
            let Some(key) = self.readable.pop_front() else {
                break;
            };
            if let Some(packet) = self.read_host(key) {
                self.staged = Some(packet);
                return true;
            }
        }
        // Reading may have queued a SHUTDOWN or RST.
        if let Some(packet) = self.control.pop_front() {
            self.staged = Some(packet);
            return true;
        }
        false
    }

    /// Reads what the guest's credit allows from a readable host socket.
    fn read_host(&mut self, key: ConnKey) -> Option<RxPacket> {
        let conn = self.conns.get_mut(&key)?;
        let want = conn.peer_credit().min(MAX_PAYLOAD) as usize;
        if want == 0 || conn.host_eof || conn.state != ConnState::Established {
            conn.host_readable = false;
            self.update_interest(key);
            return None;
        }
        let mut payload = vec![0u8; want];
        let result = loop {
            match conn.stream.read(&mut payload) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        match result {
            Ok(0) => {
                conn.host_eof = true;
                conn.host_readable = false;
                self.push_control(key, OP_SHUTDOWN, SHUTDOWN_BOTH);
                self.update_interest(key);
                None
            }
            Ok(n) => {
                payload.truncate(n);
                conn.rx_cnt = conn.rx_cnt.wrapping_add(n as u32);
                // Maybe more: its turn comes again after the others'.
                self.readable.push_back(key);
                let mut packet = RxPacket::control(key, OP_RW, 0);
                packet.payload = payload;
                Some(packet)
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                conn.host_readable = false;
                self.update_interest(key);
                None
            }
            Err(_) => {
                self.reset(key);
                None
            }
        }
    }

    /// Writes the staged packet (or as much of its payload as the buffer holds) into a
    /// receive chain; returns the used length.
    fn fill_rx<M: GuestMemory>(&mut self, mem: &M, mut chain: DescriptorChain<&M>) -> u32 {
        let mut packet = match VsockPacket::from_rx_virtq_chain(mem, &mut chain, MAX_PAYLOAD) {
            Ok(packet) => packet,
            Err(e) => {
                log::debug!("virtio-vsock: unusable receive buffer: {e}");
                return 0;
            }
        };
        let Some(mut staged) = self.staged.take() else {
            return 0;
        };
        let room = packet.data_slice().map_or(0, |s| s.len());
        let rest = &staged.payload[staged.sent..];
        let n = rest.len().min(room);
        if let Some(slice) = packet.data_slice() {
            slice.copy_from(&rest[..n]);
        }
        staged.sent += n;
        let (buf_alloc, fwd_cnt) = match self.conns.get_mut(&staged.key) {
            Some(conn) => {
                conn.reported_fwd_cnt = conn.fwd_cnt;
                if staged.op == OP_CREDIT_UPDATE {
                    conn.credit_update_queued = false;
                }
                (BUF_ALLOC, conn.fwd_cnt)
            }
            None => (0, 0),
        };
        packet
            .set_src_cid(HOST_CID)
            .set_dst_cid(self.cid)
            .set_src_port(staged.key.local_port)
            .set_dst_port(staged.key.peer_port)
            .set_type(TYPE_STREAM)
            .set_op(staged.op)
            .set_flags(staged.flags)
            .set_len(n as u32)
            .set_buf_alloc(buf_alloc)
            .set_fwd_cnt(fwd_cnt);
        if staged.sent < staged.payload.len() {
            self.staged = Some(staged);
        }
        if self.tx_throttled && self.control.len() < MAX_CONTROL {
            self.tx_throttled = false;
            self.kick_rx(); // the worker then serves every queue, transmit included
        }
        (PACKET_HEADER_SIZE + n) as u32
    }

    fn fill_event<M: GuestMemory>(&mut self, mem: &M, chain: DescriptorChain<&M>) -> u32 {
        let Some(desc) = chain.clone().find(|d| d.is_write_only() && d.len() >= 4) else {
            return 0;
        };
        if mem
            .write_obj(EVENT_TRANSPORT_RESET.to_le(), desc.addr())
            .is_err()
        {
            return 0;
        }
        self.reset_event = false;
        4
    }
}

/// The header and payload of a transmit chain whose payload spans several device-readable
/// descriptors after the header (Linux's non-linear skbs): at most [`MAX_PAYLOAD`] bytes,
/// as many as the header's `len` says.
fn gather_tx<M: GuestMemory>(
    mem: &M,
    mut chain: DescriptorChain<&M>,
) -> Result<(Vec<u8>, Vec<u8>), String> {
    let head = chain.next().ok_or("no descriptor")?;
    if head.is_write_only() || (head.len() as usize) < PACKET_HEADER_SIZE {
        return Err("header descriptor".into());
    }
    let mut header = vec![0u8; PACKET_HEADER_SIZE];
    mem.read_slice(&mut header, head.addr())
        .map_err(|e| e.to_string())?;
    // struct virtio_vsock_hdr: le32 len at byte 24.
    let len = u32::from_le_bytes(header[24..28].try_into().unwrap());
    if len > MAX_PAYLOAD {
        return Err(format!("payload of {len} bytes"));
    }
    let mut payload = vec![0u8; len as usize];
    let mut filled = 0;
    let mut pieces = vec![(
        head.addr().unchecked_add(PACKET_HEADER_SIZE as u64),
        head.len() as usize - PACKET_HEADER_SIZE,
    )];
    for desc in chain {
        if desc.is_write_only() {
            return Err("device-writable descriptor".into());
        }
        pieces.push((desc.addr(), desc.len() as usize));
    }
    for (addr, size) in pieces {
        let take = size.min(payload.len() - filled);
        mem.read_slice(&mut payload[filled..filled + take], addr)
            .map_err(|e| e.to_string())?;
        filled += take;
    }
    if filled < payload.len() {
        return Err(format!("{filled} of {len} payload bytes"));
    }
    Ok((header, payload))
}

impl<M: GuestMemory> QueueHandler<M> for Muxer {
    fn handle(&mut self, mem: &M, queue: u16, mut chain: DescriptorChain<&M>) -> u32 {
        match queue {
            RX_QUEUE => self.fill_rx(mem, chain),
            TX_QUEUE => {
                let whole = chain.clone();
                match VsockPacket::from_tx_virtq_chain(mem, &mut chain, MAX_PAYLOAD) {
                    Ok(packet) => self.handle_tx(&packet),
                    // The crate reads a payload from one descriptor only; Linux 6.12 sends
                    // one above 32 KiB in page fragments, a descriptor each.
                    Err(virtio_vsock::packet::Error::DescriptorLengthTooSmall) => {
                        if let Err(e) = self.handle_gathered_tx(mem, whole) {
                            log::debug!("virtio-vsock: bad transmit chain: {e}");
                        }
                    }
                    Err(e) => log::debug!("virtio-vsock: bad transmit chain: {e}"),
                }
                0
            }
            EVENT_QUEUE => self.fill_event(mem, chain),
            _ => 0,
        }
    }

    fn ready(&mut self, queue: u16) -> bool {
        match queue {
            RX_QUEUE => self.stage(),
            // Replies wait for receive buffers: a guest that gives none stops being served.
            TX_QUEUE => {
                self.tx_throttled = self.control.len() >= MAX_CONTROL;
                !self.tx_throttled
            }
            EVENT_QUEUE => self.reset_event,
            _ => false,
        }
    }

    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        vec![self.rx_kick.clone()]
    }

    fn poll_fds(&mut self) -> Vec<RawFd> {
        vec![self.host.epoll.as_raw_fd()]
    }

    fn fds_ready(&mut self) {
        let mut events = [EpollEvent::default(); 64];
        let count = match self.host.epoll.wait(0, &mut events) {
            Ok(n) => n,
            Err(e) => {
                log::warn!("virtio-vsock: epoll_wait: {e}");
                return;
            }
        };
        for event in &events[..count] {
            let fd = event.fd();
            match self.owners.get(&fd).copied() {
                Some(Owner::Listener) => self.accept_clients(),
                Some(Owner::Timer) => self.expire_connects(),
                Some(Owner::Pending) => self.read_client_line(fd),
                Some(Owner::Conn(key)) => self.connection_event(key, event.event_set()),
                None => {
                    let _ =
                        self.host
                            .epoll
                            .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                }
            }
        }
    }
}

impl Drop for Muxer {
    /// The host sockets close with the connections; their epoll entries go with them.
    fn drop(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.remove(key);
        }
        for fd in self.pending.keys() {
            let _ = self
                .host
                .epoll
                .ctl(ControlOperation::Delete, *fd, EpollEvent::default());
        }
        // The next activation's muxer expects it in the set.
        self.pause_listener(false);
    }
}
