//! A Linux tap interface opened with a virtio-net header on every frame.
//!
//! [`Tap::open_queues`] attaches to the interface named (creating it when it does not exist)
//! with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, and `IFF_MULTI_QUEUE` when more than one queue
//! is asked for: each returned [`Tap`] is one queue of the interface, its own file
//! descriptor, non-blocking. Every frame read or written starts with a
//! `virtio_net_hdr_v1` ([`VNET_HDR_LEN`] bytes), so checksum and segmentation offloads pass
//! between the guest and the host's stack untouched. `unsafe` is confined to the ioctls.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// Length of the header in front of every frame: `virtio_net_hdr_v1`, which virtio 1.x
/// drivers use whether or not they negotiate VIRTIO_NET_F_MRG_RXBUF.
pub const VNET_HDR_LEN: usize = 12;

/// The offloads a tap can deliver to its reader (TUNSETOFFLOAD flags).
pub const TUN_F_CSUM: u32 = libc::TUN_F_CSUM;
pub const TUN_F_TSO4: u32 = libc::TUN_F_TSO4;
pub const TUN_F_TSO6: u32 = libc::TUN_F_TSO6;
pub const TUN_F_TSO_ECN: u32 = libc::TUN_F_TSO_ECN;
pub const TUN_F_UFO: u32 = libc::TUN_F_UFO;

/// `struct ifreq` as TUNSETIFF and TUNSETQUEUE read it: the name and the flags (the rest of
/// the 40-byte union unused).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReq {
    fn new(name: &str, flags: libc::c_int) -> io::Result<IfReq> {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "tap name {name:?} must be 1 to {} bytes",
                    libc::IFNAMSIZ - 1
                ),
            ));
        }
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: flags as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..bytes.len()].copy_from_slice(bytes);
        Ok(req)
    }
}

/// One queue of a tap interface.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
    /// Whether the queue is attached (TUNSETQUEUE refuses to attach it twice).
    attached: AtomicBool,
}

impl Tap {
    /// Opens `queues` queues of the tap `name` (creating it if needed), each with a
    /// virtio-net header and non-blocking.
    pub fn open_queues(name: &str, queues: u16) -> io::Result<Vec<Tap>> {
        let mut flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;
        if queues > 1 {
            flags |= libc::IFF_MULTI_QUEUE;
        }
        (0..queues.max(1))
            .map(|_| Tap::open_one(name, flags))
            .collect()
    }

    fn open_one(name: &str, flags: libc::c_int) -> io::Result<Tap> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| io::Error::new(e.kind(), format!("/dev/net/tun: {e}")))?;
        let mut req = IfReq::new(name, flags)?;
        // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which `req` lays out (40 bytes)
        // and which outlives the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        check(rc, "TUNSETIFF")?;
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer, valid for the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        check(rc, "TUNSETVNETHDRSZ")?;
        Ok(Tap {
            file,
            name: name.to_string(),
            attached: AtomicBool::new(true),
        })
    }

    /// The interface's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Which of the offloads `wanted` (TUN_F_* flags) the host's tap accepts: each is tried
    /// on its own, then the offloads are switched off again.
    pub fn probe_offloads(&self, wanted: u32) -> u32 {
        let accepted = [TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN, TUN_F_UFO]
            .into_iter()
            .filter(|f| wanted & f != 0)
            .fold(0, |acc, flag| {
                // TSO and UFO are only accepted together with checksum offload.
                let with = acc | flag | TUN_F_CSUM;
                if self.set_offloads(with).is_ok() {
                    acc | flag
                } else {
                    acc
                }
            });
        let _ = self.set_offloads(0);
        accepted
    }

    /// Tells the tap which offloads the reader handles (TUNSETOFFLOAD): frames it hands over
    /// may then carry partial checksums or be larger than the MTU.
    pub fn set_offloads(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        let rc = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                flags as libc::c_ulong,
            )
        };
        check(rc, "TUNSETOFFLOAD")
    }

    /// Attaches this queue to the interface or detaches it (TUNSETQUEUE): the kernel only
    /// steers frames to attached queues.
    pub fn set_attached(&self, attached: bool) -> io::Result<()> {
        if self.attached.load(Ordering::SeqCst) == attached {
            return Ok(());
        }
        let flag = if attached {
            libc::IFF_ATTACH_QUEUE
        } else {
            libc::IFF_DETACH_QUEUE
        };
        let mut req = IfReq::new(&self.name, flag)?;
        // SAFETY: TUNSETQUEUE reads a `struct ifreq`, which `req` lays out and outlives the call.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNSETQUEUE, &mut req) };
        check(rc, "TUNSETQUEUE")?;
        self.attached.store(attached, Ordering::SeqCst);
        Ok(())
    }

    /// Reads one frame (header first); `WouldBlock` when none is waiting.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (header first).
    pub fn write_frame(&self, frame: &[u8]) -> io::Result<usize> {
        (&self.file).write(frame)
    }

    /// Writes one frame gathered from `iovecs` (header first) with one writev(2).
    pub fn write_gathered(&self, iovecs: &[libc::iovec]) -> io::Result<usize> {
        let count = libc::c_int::try_from(iovecs.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: every iovec names memory valid for reads for the duration of the call (the
        // caller holds guards on the guest memory they point into); the kernel only reads it.
        let n = unsafe { libc::writev(self.file.as_raw_fd(), iovecs.as_ptr(), count) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// A second descriptor of this queue (for vhost-net, which takes the tap as its backend).
    pub fn try_clone_file(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// The descriptor to poll for frames.
    pub fn poll_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}
