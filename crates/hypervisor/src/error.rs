use std::io;

/// Errors from the accelerator layer. Each names the kernel operation that failed so a
/// VMM error line can say what went wrong without the caller knowing the backend.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    #[error("{path} is not available: {source}")]
    DeviceUnavailable { path: String, source: io::Error },
    #[error("{0}")]
    Unsupported(String),
    #[error("{op} failed: {source}")]
    Ioctl { op: &'static str, source: io::Error },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, HypervisorError>;

impl HypervisorError {
    /// Wraps a kvm-ioctls / vmm-sys-util errno with the name of the operation (the KVM
    /// backend's errors; bhyve's ioctls report `io::Error`s).
    #[cfg(target_os = "linux")]
    pub(crate) fn ioctl(op: &'static str, errno: vmm_sys_util::errno::Error) -> Self {
        HypervisorError::Ioctl {
            op,
            source: io::Error::from_raw_os_error(errno.errno()),
        }
    }
}
