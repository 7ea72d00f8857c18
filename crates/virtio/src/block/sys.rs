//! The system calls of a raw image that differ between hosts: locks, sizes of block
//! devices, vectored I/O, hole punching and zeroing.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;

use super::image::{Direction, ImageKind};

#[cfg(target_os = "linux")]
pub use linux::*;
#[cfg(not(target_os = "linux"))]
pub use other::*;

#[cfg(target_os = "linux")]
mod linux {
    use super::*;

    /// BLKDISCARD and BLKZEROOUT (linux/fs.h): _IO(0x12, 119) and _IO(0x12, 127).
    const BLKDISCARD: libc::c_ulong = 0x1277;
    const BLKZEROOUT: libc::c_ulong = 0x127f;

    pub fn lock(file: &File, readonly: bool) -> io::Result<()> {
        let lock_type = if readonly {
            libc::F_RDLCK
        } else {
            libc::F_WRLCK
        };
        // SAFETY: an all-zero flock is a valid value; the fields that matter are set below.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = lock_type as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        // An OFD lock belongs to this open file description: a second open conflicts even in
        // this process, and closing another descriptor of the file does not drop it.
        // SAFETY: `fl` is a valid flock for the duration of the call.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn unlock(file: &File) -> io::Result<()> {
        // SAFETY: an all-zero flock is a valid value; the fields that matter are set below.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_UNLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        // SAFETY: `fl` is a valid flock for the duration of the call.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn is_lock_conflict(e: &io::Error) -> bool {
        matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES))
    }

    pub fn is_unsupported(e: &io::Error) -> bool {
        matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::ENOSYS) | Some(libc::EINVAL)
        )
    }

    pub fn device_size(file: &File) -> io::Result<u64> {
        use std::io::{Seek, SeekFrom};
        let mut f = file;
        f.seek(SeekFrom::End(0))
    }

    pub fn vectored(
        file: &File,
        dir: Direction,
        iovecs: &[libc::iovec],
        offset: u64,
    ) -> io::Result<usize> {
        let offset =
            i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        loop {
            // SAFETY: every iovec points into guest memory that the caller's slices keep
            // mapped, within each slice's length; the kernel touches nothing else.
            let rc = unsafe {
                match dir {
                    Direction::Read => libc::preadv(
                        file.as_raw_fd(),
                        iovecs.as_ptr(),
                        iovecs.len() as i32,
                        offset,
                    ),
                    Direction::Write => libc::pwritev(
                        file.as_raw_fd(),
                        iovecs.as_ptr(),
                        iovecs.len() as i32,
                        offset,
                    ),
                }
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: plain system call on an owned descriptor.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, len) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn block_ioctl(file: &File, request: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range: [u64; 2] = [offset, len];
        // SAFETY: BLKDISCARD and BLKZEROOUT read two u64s (start, length) from the pointer.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), request, range.as_ptr()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn deallocate(file: &File, kind: ImageKind, offset: u64, len: u64) -> io::Result<()> {
        match kind {
            ImageKind::File => fallocate(
                file,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ),
            ImageKind::BlockDevice => block_ioctl(file, BLKDISCARD, offset, len),
        }
    }

    pub fn zero_range(
        file: &File,
        kind: ImageKind,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> io::Result<()> {
        match kind {
            ImageKind::BlockDevice => block_ioctl(file, BLKZEROOUT, offset, len),
            ImageKind::File if unmap => deallocate(file, kind, offset, len).or_else(|_| {
                fallocate(
                    file,
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                )
            }),
            ImageKind::File => fallocate(
                file,
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ),
        }
    }
}

/// FreeBSD (and other Unixes): flock, fspacectl where there is one, plain writes otherwise.
#[cfg(not(target_os = "linux"))]
mod other {
    use super::*;

    pub fn lock(file: &File, readonly: bool) -> io::Result<()> {
        let op = if readonly {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        // SAFETY: plain system call on an owned descriptor. flock locks belong to the open
        // file description, like Linux's OFD locks.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn unlock(file: &File) -> io::Result<()> {
        // SAFETY: plain system call on an owned descriptor.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn is_lock_conflict(e: &io::Error) -> bool {
        e.kind() == io::ErrorKind::WouldBlock
    }

    pub fn is_unsupported(e: &io::Error) -> bool {
        matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP)
                | Some(libc::ENOTTY)
                | Some(libc::ENOSYS)
                | Some(libc::ENODEV)
                | Some(libc::EINVAL)
        )
    }

    #[cfg(target_os = "freebsd")]
    pub fn device_size(file: &File) -> io::Result<u64> {
        /// DIOCGMEDIASIZE (sys/disk.h): _IOR('d', 129, off_t).
        const DIOCGMEDIASIZE: libc::c_ulong = 0x4008_6481;
        let mut size: libc::off_t = 0;
        // SAFETY: DIOCGMEDIASIZE writes one off_t to the pointer.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), DIOCGMEDIASIZE, &mut size) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        u64::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
    }

    #[cfg(not(target_os = "freebsd"))]
    pub fn device_size(file: &File) -> io::Result<u64> {
        use std::io::{Seek, SeekFrom};
        let mut f = file;
        f.seek(SeekFrom::End(0))
    }

    pub fn vectored(
        file: &File,
        dir: Direction,
        iovecs: &[libc::iovec],
        offset: u64,
    ) -> io::Result<usize> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        loop {
            // SAFETY: every iovec points into guest memory that the caller's slices keep
            // mapped, within each slice's length; the kernel touches nothing else.
            let rc = unsafe {
                match dir {
                    Direction::Read => libc::preadv(
                        file.as_raw_fd(),
                        iovecs.as_ptr(),
                        iovecs.len() as i32,
                        offset,
                    ),
                    Direction::Write => libc::pwritev(
                        file.as_raw_fd(),
                        iovecs.as_ptr(),
                        iovecs.len() as i32,
                        offset,
                    ),
                }
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    #[cfg(target_os = "freebsd")]
    pub fn deallocate(file: &File, _kind: ImageKind, offset: u64, len: u64) -> io::Result<()> {
        /// SPACECTL_DEALLOC (sys/fcntl.h).
        const SPACECTL_DEALLOC: libc::c_int = 1;
        let (Ok(r_offset), Ok(r_len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len))
        else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        let mut range = libc::spacectl_range { r_offset, r_len };
        // fspacectl may stop early and report the rest; bounded by the range shrinking.
        while range.r_len > 0 {
            let request = range;
            // SAFETY: both pointers are valid spacectl_range structs for the call.
            let rc = unsafe {
                libc::fspacectl(file.as_raw_fd(), SPACECTL_DEALLOC, &request, 0, &mut range)
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            if range.r_len >= request.r_len {
                break;
            }
        }
        Ok(())
    }

    #[cfg(not(target_os = "freebsd"))]
    pub fn deallocate(_file: &File, _kind: ImageKind, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }

    pub fn zero_range(
        file: &File,
        kind: ImageKind,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> io::Result<()> {
        if unmap {
            deallocate(file, kind, offset, len)
        } else {
            Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
        }
    }
}
