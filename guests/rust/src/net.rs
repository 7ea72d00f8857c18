//! The `virtio-drivers` crate's `VirtIONetRaw` over its PCI transport: ARP for the host
//! peer, then UDP echoes checked byte for byte (the peer of tests/net.rs echoes UDP on
//! port 7777 of 10.0.2.2; the guest is 10.0.2.15). Everything runs in ring 3, polled.

use core::ffi::c_char;

use virtio_drivers::device::net::VirtIONetRaw;
use virtio_drivers::transport::pci::bus::{ConfigurationAccess, DeviceFunction, PciRoot};
use virtio_drivers::transport::pci::{virtio_device_type, PciTransport};
use virtio_drivers::transport::DeviceType;

use crate::kit::{self, KitHal};
use crate::{outln, transport, Outcome};

const QUEUE_SIZE: usize = 16;
/// Receive buffers kept posted.
const RX_BUFFERS: usize = 8;
const BUF_LEN: usize = 2048;
const MY_IP: [u8; 4] = [10, 0, 2, 15];
const PEER_IP: [u8; 4] = [10, 0, 2, 2];
const PORT: u16 = 7777;

type Net = VirtIONetRaw<KitHal, PciTransport, QUEUE_SIZE>;

extern "C" {
    fn tsc_hz() -> u64;
}

/// Ring-3 entry, called by `vd-net.c` with the ECAM base of bus 0.
#[no_mangle]
pub extern "C" fn vd_net_main(ecam_base: u64) -> *const c_char {
    kit::install_logger();
    match run(ecam_base) {
        Ok(()) => core::ptr::null(),
        Err(reason) => reason.as_ptr(),
    }
}

fn run(ecam_base: u64) -> Outcome<()> {
    // SAFETY: as in `vd_blk_main`: the ECAM window is identity-mapped and only this root
    // touches it.
    let cam = unsafe {
        virtio_drivers::transport::pci::bus::MmioCam::new(
            ecam_base as *mut u8,
            virtio_drivers::transport::pci::bus::Cam::Ecam,
        )
    };
    let mut root = PciRoot::new(cam);
    let function = root
        .enumerate_bus(0)
        .find(|(_, info)| virtio_device_type(info) == Some(DeviceType::Network))
        .map(|(function, _)| function)
        .ok_or(c"no virtio-net device on bus 0")?;
    echo(&mut root, function)
}

/// The posted receive buffers and the crate's tokens for them.
struct Receiver {
    bufs: [&'static mut [u8]; RX_BUFFERS],
    tokens: [u16; RX_BUFFERS],
}

impl Receiver {
    fn new(net: &mut Net) -> Outcome<Receiver> {
        let mut rx = Receiver {
            bufs: core::array::from_fn(|_| kit::dma_buffer(BUF_LEN)),
            tokens: [0; RX_BUFFERS],
        };
        for i in 0..RX_BUFFERS {
            rx.post(net, i)?;
        }
        Ok(rx)
    }

    fn post(&mut self, net: &mut Net, i: usize) -> Outcome<()> {
        // SAFETY: the buffer lives for the whole run and is not touched until its token
        // comes back from `poll_receive`.
        self.tokens[i] = unsafe { net.receive_begin(self.bufs[i]) }.map_err(|e| {
            outln!("vd-net: receive_begin: {}", e);
            c"receive_begin failed"
        })?;
        Ok(())
    }

    /// The next frame, copied into `out`; its length, or None if nothing came in time.
    fn recv(&mut self, net: &mut Net, out: &mut [u8], deadline: u64) -> Outcome<Option<usize>> {
        loop {
            if let Some(token) = net.poll_receive() {
                let i = self
                    .tokens
                    .iter()
                    .position(|&t| t == token)
                    .ok_or(c"unknown receive token")?;
                // SAFETY: the token is the one `receive_begin` returned for this buffer.
                let (hdr, len) = unsafe { net.receive_complete(token, self.bufs[i]) }
                    .map_err(|_| c"receive_complete failed")?;
                let n = len.min(out.len());
                out[..n].copy_from_slice(&self.bufs[i][hdr..hdr + n]);
                self.post(net, i)?;
                return Ok(Some(n));
            }
            if kit::rdtsc() > deadline {
                return Ok(None);
            }
            core::hint::spin_loop();
        }
    }
}

fn deadline(ms: u64) -> u64 {
    // SAFETY: the C side measured the TSC at CPL 0 before entering ring 3; later calls
    // only return the cached value.
    kit::rdtsc() + ms * unsafe { tsc_hz() } / 1000
}

fn echo(root: &mut PciRoot<impl ConfigurationAccess>, function: DeviceFunction) -> Outcome<()> {
    let mut net = Net::new(transport(root, function)?).map_err(|e| {
        outln!("vd-net: VirtIONetRaw::new: {}", e);
        c"VirtIONetRaw::new failed"
    })?;
    let mac = net.mac_address();
    outln!("vd-net: virtio-net at {}: mac {:02x?}", function, mac);
    let mut rx = Receiver::new(&mut net)?;
    let peer = resolve(&mut net, &mut rx, &mac)?;
    outln!("vd-net: peer {:02x?}", peer);
    let rounds = kit::cmdline_uint(c"rounds", 10);
    let mut frame = [0u8; BUF_LEN];
    let mut got = [0u8; BUF_LEN];
    for seq in 0..rounds {
        let payload: [u8; 100] = core::array::from_fn(|i| (seq as u8).wrapping_mul(31) ^ i as u8);
        let len = udp_frame(&mut frame, &mac, &peer, &payload);
        net.send(&frame[..len]).map_err(|_| c"send failed")?;
        let end = deadline(2000);
        loop {
            let n = rx.recv(&mut net, &mut got, end)?.ok_or(c"no UDP echo")?;
            if is_echo(&got[..n], &payload) {
                break;
            }
        }
    }
    outln!("vd-net: {} UDP echoes intact", rounds);
    Ok(())
}

fn resolve(net: &mut Net, rx: &mut Receiver, mac: &[u8; 6]) -> Outcome<[u8; 6]> {
    let mut frame = [0u8; 64];
    let mut got = [0u8; BUF_LEN];
    for _ in 0..20 {
        frame[..6].fill(0xff);
        frame[6..12].copy_from_slice(mac);
        frame[12..14].copy_from_slice(&[0x08, 0x06]);
        frame[14..22].copy_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        frame[22..28].copy_from_slice(mac);
        frame[28..32].copy_from_slice(&MY_IP);
        frame[32..38].fill(0);
        frame[38..42].copy_from_slice(&PEER_IP);
        net.send(&frame[..42]).map_err(|_| c"send failed")?;
        let end = deadline(300);
        while let Some(n) = rx.recv(net, &mut got, end)? {
            let f = &got[..n];
            if n >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2] && f[28..32] == PEER_IP {
                let mut peer = [0u8; 6];
                peer.copy_from_slice(&f[22..28]);
                return Ok(peer);
            }
        }
    }
    Err(c"no ARP reply from the peer")
}

/// Ethernet + IPv4 + UDP (no UDP checksum) to the peer's port; returns the length.
fn udp_frame(f: &mut [u8], mac: &[u8; 6], peer: &[u8; 6], payload: &[u8]) -> usize {
    f[..6].copy_from_slice(peer);
    f[6..12].copy_from_slice(mac);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let total = (20 + 8 + payload.len()) as u16;
    let ip = &mut f[14..34];
    ip.copy_from_slice(&[
        0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[12..16].copy_from_slice(&MY_IP);
    ip[16..20].copy_from_slice(&PEER_IP);
    let sum = checksum(ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let udp = &mut f[34..42];
    udp[..2].copy_from_slice(&45000u16.to_be_bytes());
    udp[2..4].copy_from_slice(&PORT.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp[6..8].fill(0);
    f[42..42 + payload.len()].copy_from_slice(payload);
    42 + payload.len()
}

fn is_echo(f: &[u8], payload: &[u8]) -> bool {
    f.len() >= 42 + payload.len()
        && f[12..14] == [0x08, 0x00]
        && f[23] == 17
        && f[26..30] == PEER_IP
        && f[34..36] == PORT.to_be_bytes()
        && &f[42..42 + payload.len()] == payload
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0)))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
