//! The third-party vsock driver against the VMM's virtio-vsock: the `virtio-drivers`
//! crate's `VirtIOSocket` under its `VsockConnectionManager`, over its PCI transport, in
//! ring 3. `vd-vsock.c` calls [`vd_vsock_main`] with the ECAM base.
//!
//! 1. Connects to host port `port=` (default 1234), sends `bytes=` (default 64 KiB, several
//!    of its 16 KiB receive windows) of a pattern and checks the host's echo.
//! 2. Listens on `listen=` (default 5000) and echoes what a host client sends until the
//!    client closes.

use core::ffi::{c_char, CStr};

use crate::kit::{self, KitHal};
use crate::outln;
use virtio_drivers::device::socket::{
    VirtIOSocket, VsockAddr, VsockConnectionManager, VsockEventType, VMADDR_CID_HOST,
};
use virtio_drivers::transport::pci::bus::{Cam, MmioCam, PciRoot};
use virtio_drivers::transport::pci::{virtio_device_type, PciTransport};
use virtio_drivers::transport::DeviceType;
use virtio_drivers::Error;

type Outcome<T> = Result<T, &'static CStr>;
type Manager = VsockConnectionManager<KitHal, PciTransport>;

/// The guest's receive window per connection.
const WINDOW: u32 = 16 << 10;
/// Largest piece sent at once (the device's receive buffers hold 468 bytes of payload, and
/// the crate sends a piece only when the peer has credit for all of it).
const PIECE: usize = 1024;
/// The guest's own port for its connection to the host.
const LOCAL_PORT: u32 = 40000;
/// Polls without an event after which a wait gives up (~seconds of spinning).
const MAX_IDLE_POLLS: u64 = 200_000_000;

/// Ring-3 entry. NULL when everything passed, else a NUL-terminated reason.
#[no_mangle]
pub extern "C" fn vd_vsock_main(ecam_base: u64) -> *const c_char {
    kit::install_logger();
    match run(ecam_base) {
        Ok(()) => core::ptr::null(),
        Err(reason) => reason.as_ptr(),
    }
}

fn pattern(i: usize) -> u8 {
    (i ^ (i >> 8) ^ 0x3c) as u8
}

fn run(ecam_base: u64) -> Outcome<()> {
    // SAFETY: as in lib.rs: the identity-mapped ECAM window, used by nothing else here.
    let cam = unsafe { MmioCam::new(ecam_base as *mut u8, Cam::Ecam) };
    let mut root = PciRoot::new(cam);
    let function = root
        .enumerate_bus(0)
        .find(|(_, info)| virtio_device_type(info) == Some(DeviceType::Socket))
        .map(|(function, _)| function)
        .ok_or(c"no virtio-vsock device on bus 0")?;
    let transport = crate::transport(&mut root, function)?;
    let driver = VirtIOSocket::<KitHal, _>::new(transport).map_err(|e| {
        outln!("vd-vsock: VirtIOSocket::new: {}", e);
        c"VirtIOSocket::new failed"
    })?;
    let mut manager = Manager::new_with_capacity(driver, WINDOW);
    outln!(
        "vd-vsock: virtio-vsock at {}, guest cid {}",
        function,
        manager.guest_cid()
    );
    let bytes = kit::cmdline_uint(c"bytes", 64 << 10) as usize;
    let host = VsockAddr {
        cid: VMADDR_CID_HOST,
        port: kit::cmdline_uint(c"port", 1234) as u32,
    };
    echo_through_host(&mut manager, host, bytes)?;
    serve_echo(&mut manager, kit::cmdline_uint(c"listen", 5000) as u32)
}

fn failed(what: &'static CStr, e: Error) -> &'static CStr {
    outln!("vd-vsock: {}: {}", what.to_str().unwrap_or("?"), e);
    what
}

fn echo_through_host(m: &mut Manager, host: VsockAddr, total: usize) -> Outcome<()> {
    m.connect(host, LOCAL_PORT)
        .map_err(|e| failed(c"connect", e))?;
    let mut idle = 0u64;
    loop {
        match m.poll().map_err(|e| failed(c"poll", e))? {
            Some(event) if event.event_type == VsockEventType::Connected => break,
            Some(event) => {
                outln!("vd-vsock: {:?} while connecting", event.event_type);
                return Err(c"the host refused the connection");
            }
            None => idle = tick(idle, c"no answer to the connection request")?,
        }
    }
    let (mut sent, mut got) = (0usize, 0usize);
    let mut piece = [0u8; PIECE];
    let mut back = [0u8; PIECE];
    idle = 0;
    while got < total {
        let mut progress = false;
        if sent < total {
            let n = PIECE.min(total - sent);
            for (i, b) in piece[..n].iter_mut().enumerate() {
                *b = pattern(sent + i);
            }
            match m.send(host, LOCAL_PORT, &piece[..n]) {
                Ok(()) => {
                    sent += n;
                    progress = true;
                }
                Err(Error::SocketDeviceError(_)) => {} // no credit yet
                Err(e) => return Err(failed(c"send", e)),
            }
        }
        if let Some(event) = m.poll().map_err(|e| failed(c"poll", e))? {
            progress = true;
            if let VsockEventType::Disconnected { .. } = event.event_type {
                return Err(c"the host closed before echoing everything");
            }
        }
        let n = m
            .recv(host, LOCAL_PORT, &mut back)
            .map_err(|e| failed(c"recv", e))?;
        if n > 0 {
            if let Some(at) = (0..n).find(|&i| back[i] != pattern(got + i)) {
                outln!("vd-vsock: echo byte {} is 0x{:02x}", got + at, back[at]);
                return Err(c"the host's echo differs");
            }
            got += n;
            progress = true;
            m.update_credit(host, LOCAL_PORT)
                .map_err(|e| failed(c"credit update", e))?;
        }
        idle = if progress {
            0
        } else {
            tick(idle, c"the echo stalled")?
        };
    }
    m.force_close(host, LOCAL_PORT)
        .map_err(|e| failed(c"close", e))?;
    outln!(
        "vd-vsock: guest->host port {}: {} bytes echoed intact",
        host.port,
        total
    );
    Ok(())
}

/// Accepts one connection on `port` and echoes it until the peer closes.
fn serve_echo(m: &mut Manager, port: u32) -> Outcome<()> {
    m.listen(port);
    outln!("vd-vsock: listening on port {}", port);
    let mut idle = 0u64;
    let peer = loop {
        match m.poll().map_err(|e| failed(c"poll", e))? {
            Some(event) if event.event_type == VsockEventType::ConnectionRequest => {
                break event.source
            }
            _ => idle = tick(idle, c"nobody connected")?,
        }
    };
    let mut buf = [0u8; PIECE];
    let (mut echoed, mut pending) = (0usize, 0usize);
    let mut open = true;
    idle = 0;
    while open || pending > 0 {
        let mut progress = false;
        if let Some(event) = m.poll().map_err(|e| failed(c"poll", e))? {
            progress = true;
            if let VsockEventType::Disconnected { .. } = event.event_type {
                open = false;
            }
        }
        if pending == 0 && open {
            pending = m.recv(peer, port, &mut buf).unwrap_or(0);
            if pending > 0 {
                m.update_credit(peer, port)
                    .map_err(|e| failed(c"credit update", e))?;
            }
        }
        if pending > 0 {
            match m.send(peer, port, &buf[..pending]) {
                Ok(()) => {
                    echoed += pending;
                    pending = 0;
                    progress = true;
                }
                Err(Error::SocketDeviceError(_)) if open => {}
                Err(e) => return Err(failed(c"echo send", e)),
            }
        }
        idle = if progress {
            0
        } else {
            tick(idle, c"the host's stream stalled")?
        };
    }
    outln!(
        "vd-vsock: host->guest port {}: {} bytes echoed back",
        port,
        echoed
    );
    Ok(())
}

fn tick(idle: u64, why: &'static CStr) -> Outcome<u64> {
    if idle >= MAX_IDLE_POLLS {
        return Err(why);
    }
    core::hint::spin_loop();
    Ok(idle + 1)
}
