//! Zero-copy sending on Linux: guest pages go into a pipe by reference (`vmsplice`) and from
//! the pipe into the socket (`splice`), so the socket holds references to guest memory
//! instead of a copy of it (on loopback the receiver's `read` is then the only copy).
//!
//! Only guest memory is spliced by reference. Frame headers and trailers live in a reused
//! arena that is overwritten before the kernel transmits them, so they are copied into the
//! pipe with a plain `write`.
//!
//! Because the kernel reads guest pages when it transmits (or, on loopback, when the receiver
//! reads), a page the guest changes after its CRC was computed reaches the destination
//! changed: the receiver's per-page CRC check marks it torn in a live round, and the page,
//! being dirty, is sent again in the next round. In the final round the guest is paused.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Size asked for the pipe (`F_SETPIPE_SZ`): 256 pages in flight per `splice`.
const PIPE_BYTES: libc::c_int = 1 << 20;

/// A pipe between the sender and its socket, with the bytes it holds.
pub(crate) struct SplicePipe {
    read_end: OwnedFd,
    write_end: OwnedFd,
    /// Bytes put into the pipe and not yet spliced into the socket.
    queued: usize,
}

/// One piece of a batch going into the pipe.
pub(crate) enum Piece<'a> {
    /// Bytes the caller will reuse: copied into the pipe.
    Copy(&'a [u8]),
    /// Guest memory, put into the pipe by reference. The caller guarantees the range stays
    /// mapped while the call runs; the kernel holds its own page references afterwards.
    Reference(*const u8, usize),
}

impl Piece<'_> {
    pub fn len(&self) -> usize {
        match *self {
            Piece::Copy(b) => b.len(),
            Piece::Reference(_, len) => len,
        }
    }

    /// The piece without its first `skip` bytes (`skip` at most its length).
    pub fn from(&self, skip: usize) -> Piece<'_> {
        match *self {
            Piece::Copy(b) => Piece::Copy(&b[skip..]),
            Piece::Reference(ptr, len) => Piece::Reference(ptr.wrapping_add(skip), len - skip),
        }
    }
}

/// True for the errors that mean "this kernel or file cannot splice": fall back to `writev`.
pub(crate) fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS))
}

fn check(rc: libc::ssize_t) -> io::Result<usize> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

impl SplicePipe {
    /// A pipe whose write end never blocks (a full pipe answers `EAGAIN`, and the sender then
    /// drains it into the socket), enlarged to 1 MiB when the kernel allows.
    pub fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for the kernel to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both descriptors are fresh and owned by nobody else.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let w = write_end.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own, with integer arguments only.
        if unsafe { libc::fcntl(w, libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(w, libc::F_SETPIPE_SZ, PIPE_BYTES) } < 0 {
            log::debug!(
                "F_SETPIPE_SZ {PIPE_BYTES}: {} (the pipe keeps its default size)",
                io::Error::last_os_error()
            );
        }
        Ok(SplicePipe {
            read_end,
            write_end,
            queued: 0,
        })
    }

    /// Bytes waiting in the pipe.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Puts as much of `piece` into the pipe as fits; `Ok(0)` when the pipe is full.
    pub fn put(&mut self, piece: &Piece<'_>) -> io::Result<usize> {
        let fd = self.write_end.as_raw_fd();
        loop {
            let rc = match *piece {
                // SAFETY: `bytes` is a live slice; write copies out of it.
                Piece::Copy(bytes) => unsafe {
                    libc::write(fd, bytes.as_ptr().cast(), bytes.len())
                },
                Piece::Reference(ptr, len) => {
                    let iov = libc::iovec {
                        iov_base: ptr.cast_mut().cast(),
                        iov_len: len,
                    };
                    // SAFETY: the iovec describes mapped memory (the caller's guarantee);
                    // vmsplice only reads it (no SPLICE_F_GIFT) and takes its own
                    // references to the pages.
                    unsafe { libc::vmsplice(fd, &iov, 1, libc::SPLICE_F_NONBLOCK) }
                }
            };
            match check(rc) {
                Ok(n) => {
                    self.queued += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) => return Err(e),
            }
        }
    }

    /// Moves up to everything queued into `sock`; returns the bytes moved (at least 1).
    /// `more`: more data follows at once (the socket may hold back a partial segment).
    pub fn splice_into(&mut self, sock: RawFd, more: bool) -> io::Result<usize> {
        let flags = libc::SPLICE_F_MOVE | if more { libc::SPLICE_F_MORE } else { 0 };
        loop {
            // SAFETY: plain descriptors and null offsets (both are streams); the kernel moves
            // page references from the pipe to the socket.
            let rc = unsafe {
                libc::splice(
                    self.read_end.as_raw_fd(),
                    std::ptr::null_mut(),
                    sock,
                    std::ptr::null_mut(),
                    self.queued,
                    flags,
                )
            };
            match check(rc) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the peer accepts no more data",
                    ))
                }
                Ok(n) => {
                    self.queued -= n.min(self.queued);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads back up to `buf.len()` queued bytes (to send them with a plain write when the
    /// socket refuses `splice`).
    pub fn read_back(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let len = buf.len().min(self.queued);
        loop {
            // SAFETY: `buf` is a live, writable buffer of at least `len` bytes.
            let rc = unsafe { libc::read(self.read_end.as_raw_fd(), buf.as_mut_ptr().cast(), len) };
            match check(rc) {
                Ok(0) if len > 0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the pipe holds fewer bytes than were put in",
                    ))
                }
                Ok(n) => {
                    self.queued -= n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}
