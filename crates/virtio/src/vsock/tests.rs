//! The device against a driver written here (crate::test_driver): credit in both
//! directions, the bound on queued replies, the transport reset after a restore.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::Duration;

use vm_memory::{Address, GuestAddress, GuestMemoryMmap};

use super::protocol::*;
use super::*;
use crate::test_driver::{Buf, TestDriver};

const GUEST_CID: u64 = 3;
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vsock-unit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A virtio_vsock_hdr from the guest.
struct Hdr {
    src_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    op: u16,
    buf_alloc: u32,
    fwd_cnt: u32,
}

impl Hdr {
    fn new(src_port: u32, dst_port: u32, op: u16) -> Hdr {
        Hdr {
            src_cid: GUEST_CID,
            src_port,
            dst_port,
            len: 0,
            op,
            buf_alloc: 4096,
            fwd_cnt: 0,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(PACKET_HEADER_SIZE);
        b.extend(self.src_cid.to_le_bytes());
        b.extend(HOST_CID.to_le_bytes());
        b.extend(self.src_port.to_le_bytes());
        b.extend(self.dst_port.to_le_bytes());
        b.extend(self.len.to_le_bytes());
        b.extend(TYPE_STREAM.to_le_bytes());
        b.extend(self.op.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(self.buf_alloc.to_le_bytes());
        b.extend(self.fwd_cnt.to_le_bytes());
        b
    }
}

/// What the device put in a receive buffer: (op, src_port, dst_port, len, fwd_cnt, payload).
fn parse_rx(driver: &TestDriver, addr: GuestAddress) -> (u16, u32, u32, u32, u32, Vec<u8>) {
    let h = driver.read(addr, PACKET_HEADER_SIZE);
    let le32 = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().unwrap());
    let op = u16::from_le_bytes([h[30], h[31]]);
    let len = le32(24);
    let payload = driver.read(addr.unchecked_add(PACKET_HEADER_SIZE as u64), len as usize);
    (op, le32(16), le32(20), len, le32(40), payload)
}

struct Rig {
    driver: TestDriver,
    /// Kept for its worker and socket.
    _device: Vsock,
    dir: PathBuf,
}

impl Rig {
    fn new(name: &str, restored: bool) -> Rig {
        let driver = TestDriver::new(&[QUEUE_SIZE; 3]);
        let dir = scratch(name);
        let mut device = Vsock::new(GUEST_CID, dir.join("v.sock")).unwrap();
        if restored {
            let state = VirtioDevice::<GuestMemoryMmap>::save(&device).unwrap();
            VirtioDevice::<GuestMemoryMmap>::restore(&mut device, &state).unwrap();
        }
        let features = VirtioDevice::<GuestMemoryMmap>::features(&device);
        device
            .activate(
                driver.mem.clone(),
                features,
                driver.active_queues(),
                driver.interrupt(),
            )
            .unwrap();
        Rig {
            driver,
            _device: device,
            dir,
        }
    }

    fn send(&mut self, hdr: &Hdr, payload: &[u8]) {
        let addr = self.driver.alloc(4096 + payload.len() as u64);
        let mut bytes = hdr.bytes();
        bytes.extend_from_slice(payload);
        self.driver.write(addr, &bytes);
        self.driver
            .add_chain(TX, &[Buf::r(addr, bytes.len() as u32)]);
        self.driver.kick(TX);
    }

    /// Gives `n` receive buffers of `size` bytes; returns their addresses.
    fn give_rx(&mut self, n: usize, size: u32) -> Vec<GuestAddress> {
        let addrs: Vec<_> = (0..n)
            .map(|_| {
                let a = self.driver.alloc(u64::from(size));
                self.driver.add_chain(RX, &[Buf::w(a, size)]);
                a
            })
            .collect();
        self.driver.kick(RX);
        addrs
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn reserved_cids_are_refused_and_the_config_holds_the_cid() {
    let dir = scratch("cid");
    for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
        assert!(matches!(
            Vsock::new(cid, dir.join("v.sock")),
            Err(VsockError::BadCid(_))
        ));
    }
    let mut device = Vsock::new(42, dir.join("v.sock")).unwrap();
    let mut config = [0xffu8; 12];
    VirtioDevice::<GuestMemoryMmap>::read_config(&device, 0, &mut config);
    assert_eq!(config, [42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let mut high = [0xffu8; 2];
    VirtioDevice::<GuestMemoryMmap>::read_config(&device, u64::MAX, &mut high);
    assert_eq!(high, [0, 0]);
    let state = VirtioDevice::<GuestMemoryMmap>::save(&device).unwrap();
    drop(device);
    let mut other = Vsock::new(43, dir.join("v.sock")).unwrap();
    let err = VirtioDevice::<GuestMemoryMmap>::restore(&mut other, &state).unwrap_err();
    assert!(err.to_string().contains("cid 42"), "{err}");
    device = Vsock::new(42, dir.join("w.sock")).unwrap();
    VirtioDevice::<GuestMemoryMmap>::restore(&mut device, &state).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn data_to_the_guest_respects_its_credit() {
    let mut rig = Rig::new("credit", false);
    let listener = UnixListener::bind(rig.dir.join("v.sock_77")).unwrap();
    let mut hdr = Hdr::new(9000, 77, OP_REQUEST);
    hdr.buf_alloc = 100;
    rig.send(&hdr, &[]);
    let rx = rig.give_rx(4, 4096);
    let (mut host, _) = listener.accept().unwrap();
    assert_eq!(rig.driver.wait_used(RX, 1)[0].1, PACKET_HEADER_SIZE as u32);
    assert_eq!(parse_rx(&rig.driver, rx[0]).0, OP_RESPONSE);
    host.write_all(&[7u8; 1000]).unwrap();
    let used = rig.driver.wait_used(RX, 1);
    let (op, src, dst, len, _, payload) = parse_rx(&rig.driver, rx[1]);
    assert_eq!((op, src, dst, len), (OP_RW, 77, 9000, 100));
    assert_eq!(used[0].1, PACKET_HEADER_SIZE as u32 + 100);
    assert_eq!(payload, [7u8; 100]);
    // The guest's window is full: nothing more until it says it consumed.
    rig.driver.assert_no_used(RX, Duration::from_millis(100));
    let mut update = Hdr::new(9000, 77, OP_CREDIT_UPDATE);
    update.buf_alloc = 100;
    update.fwd_cnt = 100;
    rig.send(&update, &[]);
    rig.driver.wait_used(RX, 1);
    assert_eq!(parse_rx(&rig.driver, rx[2]).3, 100);
    // Guest data reaches the host, and the device's fwd_cnt says so.
    let mut data = Hdr::new(9000, 77, OP_RW);
    (data.len, data.buf_alloc, data.fwd_cnt) = (5, 100, 100);
    rig.send(&data, b"hello");
    let mut got = [0u8; 5];
    host.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");
    let mut request = Hdr::new(9000, 77, OP_CREDIT_REQUEST);
    (request.buf_alloc, request.fwd_cnt) = (100, 100);
    rig.send(&request, &[]);
    rig.driver.wait_used(RX, 1);
    let (op, _, _, _, fwd_cnt, _) = parse_rx(&rig.driver, rx[3]);
    assert_eq!((op, fwd_cnt), (OP_CREDIT_UPDATE, 5));
}

/// Linux 6.12 sends a payload above 32 KiB as a non-linear skb: the header in one
/// descriptor, the payload in page fragments of one descriptor each. All of it reaches the
/// host (such packets used to be dropped, and the guest's stream stalled).
#[test]
fn a_payload_spread_over_several_descriptors_reaches_the_host() {
    let mut rig = Rig::new("fragments", false);
    let listener = UnixListener::bind(rig.dir.join("v.sock_78")).unwrap();
    let mut hdr = Hdr::new(9001, 78, OP_REQUEST);
    hdr.buf_alloc = 1 << 20;
    rig.send(&hdr, &[]);
    let rx = rig.give_rx(1, 4096);
    let (mut host, _) = listener.accept().unwrap();
    rig.driver.wait_used(RX, 1);
    assert_eq!(parse_rx(&rig.driver, rx[0]).0, OP_RESPONSE);

    let payload: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    let mut data = Hdr::new(9001, 78, OP_RW);
    (data.len, data.buf_alloc) = (payload.len() as u32, 1 << 20);
    let header = rig.driver.alloc(PACKET_HEADER_SIZE as u64);
    rig.driver.write(header, &data.bytes());
    let (first, second) = payload.split_at(32 << 10);
    let a = rig.driver.alloc(first.len() as u64);
    rig.driver.write(a, first);
    let b = rig.driver.alloc(second.len() as u64);
    rig.driver.write(b, second);
    rig.driver.add_chain(
        TX,
        &[
            Buf::r(header, PACKET_HEADER_SIZE as u32),
            Buf::r(a, first.len() as u32),
            Buf::r(b, second.len() as u32),
        ],
    );
    rig.driver.kick(TX);
    let mut got = vec![0u8; payload.len()];
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.read_exact(&mut got).unwrap();
    assert!(got == payload, "the host got other bytes");
}

#[test]
fn replies_queue_up_to_the_bound_then_transmit_waits() {
    let mut rig = Rig::new("bound", false);
    // Each packet for no connection asks for an RST; the guest gives no receive buffers.
    let first = 200;
    for i in 0..first {
        rig.send(&Hdr::new(i, 4000, OP_RW), &[]);
    }
    rig.driver.wait_used(TX, first as u16);
    for i in 0..100 {
        rig.send(&Hdr::new(first + i, 4000, OP_RW), &[]);
    }
    // The queued replies, and one staged for the next receive buffer.
    let bound = muxer::MAX_CONTROL as u16 + 1;
    rig.driver.wait_used(TX, bound - first as u16);
    rig.driver.assert_no_used(TX, Duration::from_millis(100));
    // Receive buffers drain the replies and transmit goes on.
    let rx = rig.give_rx(128, 256);
    rig.driver.wait_used(RX, 128);
    let (op, _, dst, ..) = parse_rx(&rig.driver, rx[0]);
    assert_eq!((op, dst), (OP_RST, 0));
    rig.driver.wait_used(TX, 300 - bound);
}

#[test]
fn a_restored_device_announces_a_transport_reset() {
    let mut rig = Rig::new("reset", true);
    let event = rig.driver.alloc(8);
    rig.driver.write(event, &[0xff; 8]);
    rig.driver.add_chain(EVENT, &[Buf::w(event, 8)]);
    rig.driver.kick(EVENT);
    assert_eq!(rig.driver.wait_used(EVENT, 1)[0].1, 4);
    assert_eq!(
        rig.driver.read(event, 8),
        [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]
    );
    // Once only.
    let again = rig.driver.alloc(8);
    rig.driver.add_chain(EVENT, &[Buf::w(again, 8)]);
    rig.driver.kick(EVENT);
    rig.driver.assert_no_used(EVENT, Duration::from_millis(100));
}

#[test]
fn a_fresh_device_sends_no_reset_event() {
    let mut rig = Rig::new("fresh", false);
    let event = rig.driver.alloc(8);
    rig.driver.add_chain(EVENT, &[Buf::w(event, 8)]);
    rig.driver.kick(EVENT);
    rig.driver.assert_no_used(EVENT, Duration::from_millis(100));
}

/// A host client's `CONNECT port`: the guest gets a REQUEST from a fresh host port; its
/// RESPONSE makes the device answer `OK <port>`, an RST closes the client's socket, and a
/// malformed line is closed without a word to the guest.
#[test]
fn host_clients_connect_with_a_connect_line() {
    use std::os::unix::net::UnixStream;
    let mut rig = Rig::new("connect", false);
    let socket = rig.dir.join("v.sock");
    let rx = rig.give_rx(4, 4096);

    let mut accepted = UnixStream::connect(&socket).unwrap();
    accepted.write_all(b"CONNECT 5000\n").unwrap();
    rig.driver.wait_used(RX, 1);
    let (op, host_port, guest_port, ..) = parse_rx(&rig.driver, rx[0]);
    assert_eq!((op, guest_port), (OP_REQUEST, 5000));
    rig.send(&Hdr::new(5000, host_port, OP_RESPONSE), &[]);
    let mut line = [0u8; 16];
    let n = accepted.read(&mut line).unwrap();
    assert_eq!(&line[..n], format!("OK {host_port}\n").as_bytes());

    let mut refused = UnixStream::connect(&socket).unwrap();
    refused.write_all(b"CONNECT 6000\n").unwrap();
    rig.driver.wait_used(RX, 1);
    let (op, other_port, guest_port, ..) = parse_rx(&rig.driver, rx[1]);
    assert_eq!((op, guest_port), (OP_REQUEST, 6000));
    assert_ne!(other_port, host_port);
    rig.send(&Hdr::new(6000, other_port, OP_RST), &[]);
    refused
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(refused.read(&mut line).unwrap(), 0, "closed on RST");

    let mut bad = UnixStream::connect(&socket).unwrap();
    bad.write_all(b"HELLO 1\n").unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(bad.read(&mut line).unwrap(), 0, "closed on a bad line");
    rig.driver.assert_no_used(RX, Duration::from_millis(100));
}

/// A guest that never answers a host client's REQUEST: after CONNECT_TIMEOUT the client's
/// socket is closed and the guest gets an RST.
#[test]
fn an_unanswered_connect_times_out() {
    use std::os::unix::net::UnixStream;
    let mut rig = Rig::new("timeout", false);
    let rx = rig.give_rx(2, 4096);
    let mut client = UnixStream::connect(rig.dir.join("v.sock")).unwrap();
    client.write_all(b"CONNECT 7000\n").unwrap();
    rig.driver.wait_used(RX, 1);
    let (op, host_port, ..) = parse_rx(&rig.driver, rx[0]);
    assert_eq!(op, OP_REQUEST);
    let start = std::time::Instant::now();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(client.read(&mut [0u8; 8]).unwrap(), 0);
    assert!(start.elapsed() >= muxer::CONNECT_TIMEOUT - Duration::from_millis(100));
    rig.driver.wait_used(RX, 1);
    let (op, src, dst, ..) = parse_rx(&rig.driver, rx[1]);
    assert_eq!((op, src, dst), (OP_RST, host_port, 7000));
}

/// Host clients that connect and never send their CONNECT line used to be kept for ever,
/// and once there were MAX_PENDING_CLIENTS of them every other client was closed at once.
/// Now a new client makes room by closing the oldest, and each is closed after
/// CONNECT_LINE_TIMEOUT.
#[test]
fn idle_host_clients_time_out_and_never_lock_real_ones_out() {
    use std::os::unix::net::UnixStream;
    let mut rig = Rig::new("idle", false);
    let socket = rig.dir.join("v.sock");
    let rx = rig.give_rx(1, 4096);
    let idle: Vec<UnixStream> = (0..muxer::MAX_PENDING_CLIENTS + 8)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let start = std::time::Instant::now();
    let mut client = UnixStream::connect(&socket).unwrap();
    client.write_all(b"CONNECT 5000\n").unwrap();
    rig.driver.wait_used(RX, 1);
    assert!(
        start.elapsed() < host::CONNECT_LINE_TIMEOUT,
        "not served at once"
    );
    let (op, _, guest_port, ..) = parse_rx(&rig.driver, rx[0]);
    assert_eq!((op, guest_port), (OP_REQUEST, 5000));
    for mut stream in idle {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(
            stream.read(&mut [0u8; 8]).unwrap(),
            0,
            "an idle client is kept"
        );
    }
    assert!(start.elapsed() < host::CONNECT_LINE_TIMEOUT * 3);
}
