//! How the backend talks to vmm.ko: every ioctl and mmap goes through [`VmmTransport`] (one
//! per VM device), VM creation and destruction through [`VmmControl`]. The real
//! implementations are a file descriptor on /dev/vmm/NAME ([`FdTransport`], compiled on every
//! Unix so the code keeps building here) and, on FreeBSD, [`freebsd::FreeBsdControl`]; the
//! tests use a fake that records requests and answers like a kernel.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::abi::{ioc_len, Abi};

/// The per-VM device: /dev/vmm/NAME.
pub trait VmmTransport: Send + Sync {
    /// Issues `request` with `arg` as the argument structure. The kernel copies in (and, for
    /// `_IOWR`, back out) `IOCPARM_LEN(request)` bytes of `arg`; pointer fields inside `arg`
    /// are followed by the kernel, so they must point at live memory.
    fn ioctl(&self, request: u64, arg: &mut [u8]) -> io::Result<()>;

    /// Makes the host range `addr .. addr + len` show guest-physical memory `gpa .. gpa +
    /// len` (mmap of the device at offset = GPA, `MAP_SHARED | MAP_FIXED`), replacing what
    /// was mapped there. Pages of the old mapping that were already touched are copied into
    /// guest memory first, so nothing written before is lost.
    ///
    /// # Safety
    /// `addr .. addr + len` must be a mapping the caller owns and that nothing else uses
    /// while it is replaced; afterwards it aliases guest memory.
    unsafe fn map_guest_memory(&self, addr: u64, len: u64, gpa: u64) -> io::Result<()>;
}

/// What the host offers, read once when the accelerator is opened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostInfo {
    /// `kern.osrelease`, e.g. "14.3-RELEASE".
    pub os_release: String,
    /// `hw.vmm.maxcpu`.
    pub max_vcpus: usize,
    /// "VT-x" or "AMD-V" (`hw.vmm.vmx.initialized` / `hw.vmm.svm.*`).
    pub vendor: String,
    /// `hw.vmm.vmx.cap.tpr_shadowing` (Intel only; `Some(false)` on AMD).
    pub tpr_shadow: Option<bool>,
    /// `hw.vmm.vmx.cap.virtual_interrupt_delivery`.
    pub apic_virtualization: Option<bool>,
    /// `hw.vmm.vmx.cap.posted_interrupts`.
    pub posted_interrupts: Option<bool>,
    /// `hw.vmm.vmx.cap.unrestricted_guest` (real mode without emulation; APs need it).
    pub unrestricted_guest: Option<bool>,
}

/// Creates and destroys VMs (/dev/vmmctl on FreeBSD 15, the `hw.vmm.create` and
/// `hw.vmm.destroy` sysctls on 14).
pub trait VmmControl: Send + Sync {
    /// The layout family of the running kernel.
    fn abi(&self) -> Abi;
    fn host_info(&self) -> HostInfo;
    /// Creates VM `name` and opens its device.
    fn create_vm(&self, name: &str) -> io::Result<Arc<dyn VmmTransport>>;
    fn destroy_vm(&self, name: &str) -> io::Result<()>;
}

/// An open /dev/vmm/NAME.
pub struct FdTransport {
    file: File,
}

impl FdTransport {
    pub fn new(file: File) -> Self {
        FdTransport { file }
    }
}

impl VmmTransport for FdTransport {
    fn ioctl(&self, request: u64, arg: &mut [u8]) -> io::Result<()> {
        if arg.len() < ioc_len(request) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "ioctl {request:#x} takes {} bytes, got {}",
                    ioc_len(request),
                    arg.len()
                ),
            ));
        }
        // SAFETY: `arg` is at least IOCPARM_LEN(request) bytes long (checked above), which
        // is all the kernel copies in and out; embedded pointers are the caller's contract.
        let rc = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                request as _,
                arg.as_mut_ptr().cast::<libc::c_void>(),
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    unsafe fn map_guest_memory(&self, addr: u64, len: u64, gpa: u64) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        let len_usize = usize::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mapping too large"))?;
        let offset = libc::off_t::try_from(gpa)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "GPA out of range"))?;
        let page = 4096usize;
        let pages = len_usize.div_ceil(page);
        let old = addr as *mut u8;

        // Which pages of the old mapping hold data (anything never touched reads as zero in
        // both mappings and need not be copied, so a large guest costs nothing here).
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is a mapping the caller owns; mincore only reports residency.
        let rc = unsafe { libc::mincore(old.cast(), len_usize, resident.as_mut_ptr().cast()) };
        let copy_needed = rc == 0 && resident.iter().any(|r| r & 1 != 0);
        if copy_needed {
            // SAFETY: a fresh shared mapping of the device at a kernel-chosen address.
            let scratch = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len_usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    offset,
                )
            };
            if scratch == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            for (i, r) in resident.iter().enumerate() {
                if r & 1 != 0 {
                    let at = i * page;
                    let n = page.min(len_usize - at);
                    // SAFETY: both ranges are `len` bytes long, mapped, and distinct.
                    unsafe {
                        std::ptr::copy_nonoverlapping(old.add(at), scratch.cast::<u8>().add(at), n)
                    };
                }
            }
            // SAFETY: unmapping the scratch mapping made above.
            unsafe { libc::munmap(scratch, len_usize) };
        }
        #[allow(unused_mut)]
        let mut flags = libc::MAP_SHARED | libc::MAP_FIXED;
        // Guest memory stays out of ferrovm's core dumps, as bhyve(8) does it.
        #[cfg(target_os = "freebsd")]
        {
            flags |= libc::MAP_NOCORE;
        }
        // SAFETY: the caller owns `addr .. addr + len` and lets it be replaced.
        let mapped = unsafe {
            libc::mmap(
                old.cast(),
                len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                offset,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(target_os = "freebsd")]
pub mod freebsd {
    //! FreeBSD: /dev/vmmctl (15) or the `hw.vmm.create` sysctl (14), sysctls for the host.

    use std::ffi::CString;
    use std::fs::{File, OpenOptions};
    use std::io;
    use std::path::Path;
    use std::sync::Arc;

    use zerocopy::{FromZeros, IntoBytes};

    use super::{FdTransport, HostInfo, VmmControl, VmmTransport};
    use crate::bhyve::abi::{
        Abi, VmmctlVm, VMMCTL_CREATE_DESTROY_ON_CLOSE, VMMCTL_VM_CREATE, VMMCTL_VM_DESTROY,
        VM_NAME_BUF,
    };

    pub const VMMCTL: &str = "/dev/vmmctl";

    pub struct FreeBsdControl {
        /// /dev/vmmctl on FreeBSD 15; VMs created with DESTROY_ON_CLOSE die with it.
        ctl: Option<File>,
        abi: Abi,
        host: HostInfo,
    }

    fn sysctl_raw(name: &str, buf: Option<&mut [u8]>) -> io::Result<usize> {
        let cname = CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mut len: libc::size_t = buf.as_ref().map_or(0, |b| b.len());
        let ptr = buf.map_or(std::ptr::null_mut(), |b| b.as_mut_ptr().cast());
        // SAFETY: `ptr` is null or points at `len` writable bytes; the name is NUL-ended.
        let rc = unsafe { libc::sysctlbyname(cname.as_ptr(), ptr, &mut len, std::ptr::null(), 0) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(len)
        }
    }

    fn sysctl_write(name: &str, value: &[u8]) -> io::Result<()> {
        let cname = CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: the new value is `value.len()` readable bytes; no old value is read.
        let rc = unsafe {
            libc::sysctlbyname(
                cname.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                value.as_ptr().cast(),
                value.len(),
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    fn sysctl_int(name: &str) -> Option<i64> {
        let mut buf = [0u8; 8];
        let len = sysctl_raw(name, Some(&mut buf)).ok()?;
        match len {
            4 => Some(i64::from(i32::from_ne_bytes(buf[..4].try_into().ok()?))),
            8 => Some(i64::from_ne_bytes(buf)),
            _ => None,
        }
    }

    fn sysctl_string(name: &str) -> Option<String> {
        let mut buf = [0u8; 256];
        let len = sysctl_raw(name, Some(&mut buf)).ok()?;
        let s = &buf[..len];
        let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
        Some(String::from_utf8_lossy(&s[..end]).into_owned())
    }

    impl FreeBsdControl {
        /// Finds vmm.ko's control interface. Fails when the module is not loaded.
        pub fn open() -> io::Result<Self> {
            let (ctl, abi) = if Path::new(VMMCTL).exists() {
                // vmmctl refuses descriptors opened without FWRITE.
                let file = OpenOptions::new().read(true).write(true).open(VMMCTL)?;
                (Some(file), Abi::FreeBsd15)
            } else if sysctl_raw("hw.vmm.create", None).is_ok() {
                (None, Abi::FreeBsd14)
            } else {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "/dev/vmm is absent: vmm.ko is not loaded (kldload vmm)",
                ));
            };
            Ok(FreeBsdControl {
                ctl,
                abi,
                host: Self::read_host_info(),
            })
        }

        fn read_host_info() -> HostInfo {
            let flag = |name: &str| sysctl_int(name).map(|v| v != 0);
            let intel = flag("hw.vmm.vmx.initialized") == Some(true);
            let (tpr, apicv, posted, ug) = if intel {
                (
                    flag("hw.vmm.vmx.cap.tpr_shadowing"),
                    flag("hw.vmm.vmx.cap.virtual_interrupt_delivery"),
                    flag("hw.vmm.vmx.cap.posted_interrupts"),
                    flag("hw.vmm.vmx.cap.unrestricted_guest"),
                )
            } else {
                // bhyve on AMD has no AVIC: every TPR write is intercepted or emulated.
                (Some(false), Some(false), Some(false), Some(true))
            };
            HostInfo {
                os_release: sysctl_string("kern.osrelease").unwrap_or_default(),
                max_vcpus: sysctl_int("hw.vmm.maxcpu")
                    .and_then(|v| usize::try_from(v).ok())
                    .unwrap_or(1),
                vendor: if intel { "VT-x" } else { "AMD-V" }.into(),
                tpr_shadow: tpr,
                apic_virtualization: apicv,
                posted_interrupts: posted,
                unrestricted_guest: ug,
            }
        }

        fn vmmctl(&self, request: u64, name: &str, flags: u32) -> io::Result<()> {
            let ctl = self.ctl.as_ref().ok_or(io::ErrorKind::Unsupported)?;
            let mut arg = VmmctlVm::new_zeroed();
            if name.len() >= VM_NAME_BUF {
                return Err(io::ErrorKind::InvalidInput.into());
            }
            arg.name[..name.len()].copy_from_slice(name.as_bytes());
            arg.flags = flags;
            FdTransport::new(ctl.try_clone()?).ioctl(request, arg.as_mut_bytes())
        }
    }

    impl VmmControl for FreeBsdControl {
        fn abi(&self) -> Abi {
            self.abi
        }

        fn host_info(&self) -> HostInfo {
            self.host.clone()
        }

        fn create_vm(&self, name: &str) -> io::Result<Arc<dyn VmmTransport>> {
            match self.abi {
                Abi::FreeBsd15 => {
                    // Kernels that know the flag destroy the VM if ferrovm dies; 15.0 calls
                    // the field reserved and refuses a non-zero value.
                    match self.vmmctl(VMMCTL_VM_CREATE, name, VMMCTL_CREATE_DESTROY_ON_CLOSE) {
                        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                            self.vmmctl(VMMCTL_VM_CREATE, name, 0)?
                        }
                        other => other?,
                    }
                }
                Abi::FreeBsd14 => sysctl_write("hw.vmm.create", name.as_bytes())?,
            }
            let path = format!("/dev/vmm/{name}");
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(file) => Ok(Arc::new(FdTransport::new(file))),
                Err(e) => {
                    let _ = self.destroy_vm(name);
                    Err(io::Error::new(e.kind(), format!("{path}: {e}")))
                }
            }
        }

        fn destroy_vm(&self, name: &str) -> io::Result<()> {
            match self.abi {
                Abi::FreeBsd15 => self.vmmctl(VMMCTL_VM_DESTROY, name, 0),
                Abi::FreeBsd14 => sysctl_write("hw.vmm.destroy", name.as_bytes()),
            }
        }
    }
}
