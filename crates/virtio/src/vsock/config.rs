//! virtio-vsock as a device kind: `--vsock cid=N,socket=PATH`, Firecracker's `PUT /vsock`.
//! Compiled on every host (the device itself is Linux only), so that configurations read
//! the same everywhere.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vm_memory::GuestMemory;

use crate::kind::{refuse_repeated_keys, BuildContext, DeviceKind, OptionShape};
use crate::VirtioDevice;

/// The guest's context id and the Unix socket host processes connect to (guest
/// connections to host port P go to `PATH_P`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockConfig {
    pub cid: u64,
    pub socket: PathBuf,
}

/// The smallest guest context id (0-2 are reserved; 2 is the host).
pub const MIN_VSOCK_CID: u64 = 3;

/// Why `cid` cannot be a guest's context id, if it cannot (0-2 reserved, u32::MAX is "any").
pub fn vsock_cid_refusal(cid: u64) -> Option<String> {
    (!(MIN_VSOCK_CID..u64::from(u32::MAX)).contains(&cid))
        .then(|| format!("cid {cid} is reserved or too large (3 to {})", u32::MAX - 1))
}

impl std::str::FromStr for VsockConfig {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (mut cid, mut socket) = (None, None);
        refuse_repeated_keys(text.split(','), &[])?;
        for part in text.split(',') {
            match part.split_once('=') {
                Some(("cid", n)) => {
                    let n: u64 = n
                        .parse()
                        .map_err(|_| format!("cid {n:?} is not a number"))?;
                    if let Some(why) = vsock_cid_refusal(n) {
                        return Err(why);
                    }
                    cid = Some(n);
                }
                Some(("socket", path)) if !path.is_empty() => socket = Some(PathBuf::from(path)),
                _ => return Err(format!("unknown or empty part {part:?}")),
            }
        }
        match (cid, socket) {
            (Some(cid), Some(socket)) => Ok(VsockConfig { cid, socket }),
            _ => Err("expected cid=N,socket=PATH".into()),
        }
    }
}

impl<M: GuestMemory + Send + Sync + 'static> DeviceKind<M> for VsockConfig {
    const SYNTAX: &'static str = "cid=N,socket=PATH";
    const HELP: &'static str = "A virtio-vsock device: guest context id N (3 or more) and the \
        Unix socket host processes connect to (`CONNECT port`); guest connections to host \
        port P go to `PATH_P` (Firecracker's convention). Linux only";
    const SHAPE: OptionShape = OptionShape::Once;
    /// Its host sockets in an epoll set, host clients accepted on the device's socket (made
    /// non-blocking), guest connections to PATH_port (a non-blocking Unix connect), a
    /// guest's SHUTDOWN passed on to the host socket; the timer of host clients' CONNECT
    /// requests (a timerfd made at start-up).
    const SANDBOX: &'static str = "epoll_wait\nepoll_ctl\naccept4\nioctl FIONBIO\n\
        socket AF_UNIX\nconnect\nshutdown\nrecvfrom\ntimerfd_settime";

    fn parse(text: &str) -> Result<Option<Self>, String> {
        text.parse().map(Some)
    }

    fn label(&self) -> String {
        format!("cid={},socket={}", self.cid, self.socket.display())
    }

    fn create(&self, _ctx: &BuildContext<M>) -> Result<Box<dyn VirtioDevice<M>>, String> {
        #[cfg(target_os = "linux")]
        {
            let device = crate::vsock::Vsock::new(self.cid, self.socket.clone())
                .map_err(|e| e.to_string())?;
            Ok(Box::new(device))
        }
        #[cfg(not(target_os = "linux"))]
        Err("virtio-vsock is supported on Linux only".into())
    }

    fn guest_difference(&self, recorded: &Self) -> Option<String> {
        (self.cid != recorded.cid).then(|| format!("with cid {}", recorded.cid))
    }
}
