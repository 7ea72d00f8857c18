//! virtio-net as a device kind: `--net tap=NAME[,mac=MAC][,queues=N][,iothreads=N]
//! [,vhost=on|off]`, Firecracker's network interfaces. Compiled on every host (the device
//! itself is Linux only), so that configurations read the same everywhere.

use serde::{Deserialize, Serialize};

use crate::kind::{refuse_repeated_keys, BuildContext, DeviceKind, OptionShape};
use crate::VirtioDevice;

/// Most queue pairs a network device may have.
pub const NET_QUEUES_MAX: u16 = 16;

/// A virtio-net device on a tap.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// The tap interface, opened or created.
    pub tap: String,
    /// The guest's MAC; a locally administered one is made up when none is given.
    #[serde(default)]
    pub mac: Option<[u8; 6]>,
    /// Queue pairs (VIRTIO_NET_F_MQ above 1).
    #[serde(default = "one")]
    pub queues: u16,
    /// `vhost=on`: the host kernel's vhost-net serves the queue pairs.
    #[serde(default)]
    pub vhost: bool,
    /// `iothreads=N`: threads serving the queue pairs; by default one per pair, at most as
    /// many as the host has CPUs beside the vCPUs ([`default_net_threads`]).
    #[serde(default)]
    pub iothreads: Option<u16>,
}

fn one() -> u16 {
    1
}

impl NetConfig {
    /// A single-queue interface on `tap`.
    pub fn on_tap(tap: &str) -> NetConfig {
        NetConfig {
            tap: tap.to_string(),
            mac: None,
            queues: 1,
            vhost: false,
            iothreads: None,
        }
    }

    fn apply(&mut self, field: &str) -> Result<(), String> {
        let count = |key: &str, n: &str| {
            n.parse()
                .ok()
                .filter(|q| (1..=NET_QUEUES_MAX).contains(q))
                .ok_or_else(|| format!("{key}={n}: expected 1 to {NET_QUEUES_MAX}"))
        };
        match field.split_once('=') {
            Some(("tap", name)) if !name.is_empty() && name.len() < 16 => {
                self.tap = name.to_string()
            }
            Some(("tap", _)) => return Err("tap=NAME: 1 to 15 bytes".into()),
            Some(("mac", mac)) => {
                self.mac = Some(parse_mac(mac).ok_or_else(|| {
                    format!(
                        "mac={mac}: expected six hex bytes like 52:54:00:12:34:56, unicast, not \
                         all zeroes"
                    )
                })?)
            }
            Some(("queues", n)) => self.queues = count("queues", n)?,
            Some(("iothreads", n)) => self.iothreads = Some(count("iothreads", n)?),
            Some(("vhost", "off")) => self.vhost = false,
            Some(("vhost", "on")) => self.vhost = true,
            _ => return Err(format!("unknown net option {field:?}")),
        }
        Ok(())
    }
}

impl std::str::FromStr for NetConfig {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut net = NetConfig::on_tap("");
        refuse_repeated_keys(text.split(','), &[])?;
        for field in text.split(',') {
            net.apply(field)?;
        }
        if net.tap.is_empty() {
            return Err(
                "expected tap=NAME[,mac=MAC][,queues=N][,iothreads=N][,vhost=on|off]".into(),
            );
        }
        Ok(net)
    }
}

/// I/O threads for `pairs` queue pairs of a guest with `vcpus` vCPUs on a host with
/// `host_cpus` CPUs: one per pair, but no more than the CPUs the vCPUs leave (at least
/// one). Threads beyond those only take turns on the same CPUs, and each pays its own
/// wake-ups where one thread would serve several pairs per wake-up.
pub fn default_net_threads(pairs: u16, vcpus: u32, host_cpus: usize) -> u16 {
    let spare = host_cpus.saturating_sub(vcpus as usize).max(1);
    pairs.min(u16::try_from(spare).unwrap_or(u16::MAX)).max(1)
}

/// A unicast MAC written as six colon-separated hex bytes; not all zeroes (no station has
/// that address, and frames to it go nowhere).
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    (parts.next().is_none() && mac[0] & 1 == 0 && mac != [0; 6]).then_some(mac)
}

/// A MAC as `parse_mac` reads it.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

const SYNTAX: &str = "tap=NAME[,mac=MAC][,queues=N][,iothreads=N][,vhost=on|off]";
const HELP: &str = "A virtio-net device on a tap interface (created if it does not exist). \
    `iothreads=N`: host threads for its queue pairs (default: one per pair, no more than the \
    CPUs the vCPUs leave). `vhost=on`: the host kernel serves its queues (/dev/vhost-net, \
    KVM only)";

/// Frames written to a tap straight from guest memory (writev; reads are allowed to every
/// device), a tap's offloads and which of its queues are attached.
#[cfg(target_os = "linux")]
const SANDBOX: &str = "writev\nioctl TUNSETOFFLOAD\nioctl TUNSETQUEUE";

impl NetConfig {
    fn guest_difference(&self, recorded: &NetConfig) -> Option<String> {
        if let (Some(given), Some(saved)) = (self.mac, recorded.mac) {
            if given != saved {
                return Some(format!("with mac={}", format_mac(&saved)));
            }
        }
        (self.queues != recorded.queues).then(|| format!("with queues={}", recorded.queues))
    }
}

/// Guest memory as the VMM maps it on Linux: what vhost-net is given.
#[cfg(target_os = "linux")]
type MappedMemory = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;

#[cfg(target_os = "linux")]
impl DeviceKind<MappedMemory> for NetConfig {
    const SYNTAX: &'static str = SYNTAX;
    const HELP: &'static str = HELP;
    const SHAPE: OptionShape = OptionShape::Repeated;
    const SANDBOX: &'static str = SANDBOX;

    fn parse(text: &str) -> Result<Option<Self>, String> {
        text.parse().map(Some)
    }

    fn label(&self) -> String {
        format!("tap={}", self.tap)
    }

    fn create(
        &self,
        ctx: &BuildContext<MappedMemory>,
    ) -> Result<Box<dyn VirtioDevice<MappedMemory>>, String> {
        let mut mac = [0u8; 6];
        match self.mac {
            Some(given) => mac = given,
            None => {
                // Locally administered, unicast, QEMU's 52:54:00 prefix.
                mac[..3].copy_from_slice(&[0x52, 0x54, 0x00]);
                crate::rng::fill_random(&mut mac[3..]).map_err(|e| e.to_string())?;
            }
        }
        let io_threads = self
            .iothreads
            .unwrap_or_else(|| default_net_threads(self.queues, ctx.vcpus, ctx.host_cpus));
        let options = crate::net::NetOptions {
            tap: self.tap.clone(),
            mac,
            queue_pairs: self.queues,
            io_threads,
        };
        if self.vhost && !ctx.kernel_queues {
            return Err(
                "vhost=on: vhost-net needs the accelerator's irqfd and ioeventfd \
                 (KVM, with FERROVM_KERNEL_EVENTFDS not off); use vhost=off"
                    .into(),
            );
        }
        let mut device = crate::net::Net::new(options).map_err(|e| e.to_string())?;
        if self.vhost {
            let taps = device.tap_files().map_err(|e| e.to_string())?;
            let kernel = crate::net::vhost::open_kernel(ctx.memory.clone(), taps)
                .map_err(|e| format!("vhost=on: {e}"))?;
            device.use_kernel_path(Box::new(kernel));
            log::info!("virtio-net {}: queues served by vhost-net", self.tap);
        }
        Ok(Box::new(device))
    }

    fn guest_difference(&self, recorded: &Self) -> Option<String> {
        NetConfig::guest_difference(self, recorded)
    }
}

#[cfg(not(target_os = "linux"))]
impl<M: vm_memory::GuestMemory + Send + Sync + 'static> DeviceKind<M> for NetConfig {
    const SYNTAX: &'static str = SYNTAX;
    const HELP: &'static str = HELP;
    const SHAPE: OptionShape = OptionShape::Repeated;

    fn parse(text: &str) -> Result<Option<Self>, String> {
        text.parse().map(Some)
    }

    fn label(&self) -> String {
        format!("tap={}", self.tap)
    }

    fn create(&self, _ctx: &BuildContext<M>) -> Result<Box<dyn VirtioDevice<M>>, String> {
        Err("virtio-net needs a Linux tap device; not supported on this host".into())
    }

    fn guest_difference(&self, recorded: &Self) -> Option<String> {
        NetConfig::guest_difference(self, recorded)
    }
}
