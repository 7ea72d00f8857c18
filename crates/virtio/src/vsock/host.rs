//! The host side of virtio-vsock: the Unix socket host processes connect to, and the
//! per-port sockets the VMM connects to for the guest (Firecracker's convention).

use std::io::{self, ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Longest `CONNECT <port>\n` line a host client may send, newline included.
pub const MAX_CONNECT_LINE: usize = 32;
/// How long a host client may take to send its `CONNECT` line before it is closed: one that
/// never sends it must not hold a slot for ever.
pub const CONNECT_LINE_TIMEOUT: Duration = Duration::from_secs(2);

/// Binds the device's listening socket at `path`, mode 0600. An existing socket file is
/// replaced only if nobody listens on it; anything else at `path` is an error.
pub fn bind_listener(path: &Path) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    ErrorKind::AddrInUse,
                    "another process listens on this socket",
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(_) => {
            return Err(io::Error::new(
                ErrorKind::AlreadyExists,
                "the path exists and is not a socket",
            ))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    // Host processes of the same user only: the socket reaches into the guest.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The socket a guest connection to host port `port` goes to: `PATH_port`.
pub fn port_path(base: &Path, port: u32) -> PathBuf {
    let mut name = base.as_os_str().to_owned();
    name.push(format!("_{port}"));
    PathBuf::from(name)
}

/// Connects to the Unix socket at `path` without blocking: a listener whose backlog is full
/// refuses (EAGAIN) instead of holding the device's thread.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: an all-zero sockaddr_un is a valid (unnamed) address to fill in.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let flags = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: plain socket(2); the result is checked and owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that outlives the call.
    let rc = unsafe { libc::connect(owned.as_raw_fd(), (&raw const addr).cast(), len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

/// A host client that connected to the device's socket and has not finished its
/// `CONNECT <port>\n` line yet.
pub struct PendingClient {
    pub stream: UnixStream,
    line: Vec<u8>,
    /// When the client is closed if its line is not complete.
    pub deadline: Instant,
}

/// What reading a pending client's line gave.
#[derive(Debug, PartialEq, Eq)]
pub enum LineStatus {
    /// Not complete yet.
    Partial,
    /// `CONNECT <port>`.
    Connect(u32),
    /// A malformed or overlong line, or the client went away: drop it.
    Bad,
}

impl PendingClient {
    pub fn new(stream: UnixStream) -> PendingClient {
        PendingClient {
            stream,
            line: Vec::new(),
            deadline: Instant::now() + CONNECT_LINE_TIMEOUT,
        }
    }

    /// Reads what has arrived of the line, a byte at a time so that nothing the client
    /// sends after it (stream data) is taken here.
    pub fn read_line(&mut self) -> LineStatus {
        let mut byte = [0u8; 1];
        while self.line.len() < MAX_CONNECT_LINE {
            match self.stream.read(&mut byte) {
                Ok(0) => return LineStatus::Bad,
                Ok(_) if byte[0] == b'\n' => return parse_connect(&self.line),
                Ok(_) => self.line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return LineStatus::Partial,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return LineStatus::Bad,
            }
        }
        LineStatus::Bad
    }
}

/// Parses `CONNECT <port>` (without its newline).
pub fn parse_connect(line: &[u8]) -> LineStatus {
    let Ok(text) = std::str::from_utf8(line) else {
        return LineStatus::Bad;
    };
    let text = text.strip_suffix('\r').unwrap_or(text);
    match text.strip_prefix("CONNECT ").map(str::parse::<u32>) {
        Some(Ok(port)) => LineStatus::Connect(port),
        _ => LineStatus::Bad,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52"), LineStatus::Connect(52));
        assert_eq!(parse_connect(b"CONNECT 52\r"), LineStatus::Connect(52));
        assert_eq!(parse_connect(b"CONNECT -1"), LineStatus::Bad);
        assert_eq!(parse_connect(b"CONNECT 4294967296"), LineStatus::Bad);
        assert_eq!(parse_connect(b"connect 5"), LineStatus::Bad);
        assert_eq!(parse_connect(b"\xff"), LineStatus::Bad);
    }

    #[test]
    fn port_paths_follow_firecracker() {
        assert_eq!(
            port_path(Path::new("/tmp/v.sock"), 1234),
            PathBuf::from("/tmp/v.sock_1234")
        );
    }

    #[test]
    fn a_stale_socket_is_replaced_a_live_one_refused() {
        let dir = std::env::temp_dir().join(format!("vsock-host-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.sock");
        let live = bind_listener(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let err = bind_listener(&path).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AddrInUse);
        drop(live); // the file stays behind, stale
        bind_listener(&path).unwrap();
        let file = dir.join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(
            bind_listener(&file).unwrap_err().kind(),
            ErrorKind::AlreadyExists
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
