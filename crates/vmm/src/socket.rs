//! The API's Unix socket: created safely, served only to our own user, removed only if it is
//! still ours. Independent of the protocol spoken over it.
//!
//! - `bind` never replaces anything but a stale socket: a regular file, a directory, a
//!   symlink or a socket another process still serves at the path is refused.
//! - The socket file is mode 0600 whatever the umask: it is bound inside a private (0700)
//!   directory beside the path, chmod-ed there, then hard-linked into place (which fails
//!   rather than replace anything that appeared meanwhile).
//! - Connections from another user (other than root) are refused (`peer_allowed`).
//! - On exit the file is removed only if it is still the one we created (same device and
//!   inode): another VMM may have taken the path over since.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

use crate::files::kind_of;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

fn refuse(option: &'static str, path: &Path, reason: impl Into<String>) -> Error {
    Error::Option {
        option,
        value: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Removes a stale socket at `path`; refuses anything else that is there.
fn clear_stale(option: &'static str, path: &Path) -> Result<()> {
    let refuse = |path: &Path, reason: String| refuse(option, path, reason);
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(refuse(path, e.to_string())),
    };
    if !meta.file_type().is_socket() {
        return Err(refuse(
            path,
            format!(
                "exists and is {}, not a socket: refusing to replace it",
                kind_of(meta.file_type())
            ),
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(refuse(
            path,
            "another process is serving this socket".into(),
        )),
        // Nobody listens: a socket left by a process that is gone.
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(path)
            .map_err(|e| refuse(path, format!("cannot remove the stale socket: {e}"))),
        Err(e) => Err(refuse(
            path,
            format!("cannot tell whether it is in use: {e}"),
        )),
    }
}

/// A private directory beside `path`, removed with everything in it when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn beside(path: &Path, tag: &str) -> std::io::Result<Self> {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = parent.join(format!(".ferrovm-{tag}.{}", std::process::id()));
        let mut builder = std::fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(&dir)?;
        Ok(PrivateDir(dir))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds the API socket at `path` (see the module documentation).
pub fn bind(path: &Path) -> Result<(UnixListener, SocketGuard)> {
    bind_for(path, "--api-socket")
}

/// Binds a socket at `path` for the command-line `option` that named it, which errors
/// name (see the module documentation).
pub fn bind_for(path: &Path, option: &'static str) -> Result<(UnixListener, SocketGuard)> {
    clear_stale(option, path)?;
    let io_err = |e: std::io::Error| refuse(option, path, e.to_string());
    let tag = option.trim_start_matches('-');
    let private = PrivateDir::beside(path, tag).map_err(io_err)?;
    let inside = private.0.join("api.sock");
    let listener = UnixListener::bind(&inside).map_err(io_err)?;
    std::fs::set_permissions(&inside, std::fs::Permissions::from_mode(0o600)).map_err(io_err)?;
    std::fs::hard_link(&inside, path).map_err(|e| match e.kind() {
        ErrorKind::AlreadyExists => refuse(option, path, "another process created it meanwhile"),
        _ => io_err(e),
    })?;
    let meta = std::fs::symlink_metadata(path).map_err(io_err)?;
    Ok((
        listener,
        SocketGuard {
            path: path.to_path_buf(),
            identity: (meta.dev(), meta.ino()),
        },
    ))
}

/// Whether a connected client may use the API: our own user, or root.
pub fn peer_allowed(stream: &UnixStream) -> std::io::Result<bool> {
    Ok(uid_allowed(peer_uid(stream)?))
}

/// Whether a client of user `uid` may use the API: our own user, or root.
pub fn uid_allowed(uid: libc::uid_t) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let ours = unsafe { libc::geteuid() };
    uid == ours || uid == 0
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn peer_uid(stream: &UnixStream) -> std::io::Result<libc::uid_t> {
    use std::os::unix::io::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the fd is a live socket; `cred` and `len` are valid for writes of the sizes
    // given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn peer_uid(stream: &UnixStream) -> std::io::Result<libc::uid_t> {
    use std::os::unix::io::AsRawFd;
    let (mut uid, mut gid) = (0, 0);
    // SAFETY: the fd is a live socket; `uid` and `gid` are valid for writes.
    let rc = unsafe { libc::getpeereid(stream.as_raw_fd(), &mut uid, &mut gid) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(uid)
}

/// Removes the socket file when the machine stops, if it is still the one we created.
pub struct SocketGuard {
    path: PathBuf,
    identity: (u64, u64),
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.identity => {
                let _ = std::fs::remove_file(&self.path);
            }
            Ok(_) => log::info!(
                "{} is no longer our socket: left in place",
                self.path.display()
            ),
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrovm-sock-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn only_a_stale_socket_is_replaced() {
        let dir = scratch("stale");
        let file = dir.join("file");
        std::fs::write(&file, b"precious").unwrap();
        let e = bind(&file).err().unwrap().to_string();
        assert!(e.contains("is a regular file, not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let e = bind(&link).err().unwrap().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert!(bind(&dir).err().unwrap().to_string().contains("directory"));

        let live = dir.join("live.sock");
        let other = UnixListener::bind(&live).unwrap();
        let e = bind(&live).err().unwrap().to_string();
        assert!(e.contains("another process is serving"), "{e}");
        drop(other);
        // The listener is gone, its file stays: stale, replaced.
        let (_listener, guard) = bind(&live).unwrap();
        let mode = std::fs::metadata(&live).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(guard);
        assert!(!live.exists());
        // No private directory left behind.
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 2, "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_socket_taken_over_is_left_in_place() {
        let dir = scratch("takeover");
        let path = dir.join("api.sock");
        let (listener, guard) = bind(&path).unwrap();
        drop(listener);
        std::fs::remove_file(&path).unwrap();
        let _other = UnixListener::bind(&path).unwrap();
        drop(guard);
        assert!(path.exists(), "the other process's socket was removed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn our_own_connections_are_allowed() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(peer_allowed(&a).unwrap());
    }
}
