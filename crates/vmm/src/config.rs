//! What the user asked for, validated before anything is created.

use std::path::PathBuf;

use crate::error::{Error, Result};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const DEFAULT_MEMORY: u64 = 256 * MIB;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqChipKind {
    Kernel,
    Split,
}

impl IrqChipKind {
    /// As `--irqchip` spells it.
    pub fn name(self) -> &'static str {
        match self {
            IrqChipKind::Kernel => "kernel",
            IrqChipKind::Split => "split",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SerialOutput {
    /// Output to stdout; input from stdin when it is a terminal.
    Stdio,
    File(PathBuf),
    /// A Unix socket the VMM listens on: one client at a time is the console.
    Socket(PathBuf),
    None,
}

/// How a disk's writes reach the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskCache {
    /// Through the host page cache; durability comes from FLUSH (or, without it, a sync of
    /// every write).
    Writeback,
    /// `O_DIRECT`: around the host page cache.
    None,
}

/// One `--disk PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub readonly: bool,
    /// What GET_ID returns (at most 20 bytes).
    pub serial: Option<String>,
    pub cache: DiskCache,
    pub queues: u16,
}

/// Longest serial a virtio-blk GET_ID can return.
pub const DISK_SERIAL_MAX: usize = 20;
/// Most queues a disk may have.
pub const DISK_QUEUES_MAX: u16 = 16;

/// One `--net tap=NAME[,mac=MAC][,queues=N][,iothreads=N][,vhost=on|off]`: a virtio-net
/// device on a tap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The tap interface, opened or created.
    pub tap: String,
    /// The guest's MAC; a locally administered one is made up when none is given.
    pub mac: Option<[u8; 6]>,
    /// Queue pairs (VIRTIO_NET_F_MQ above 1).
    pub queues: u16,
    /// `vhost=on`: the host kernel's vhost-net serves the queue pairs.
    pub vhost: bool,
    /// `iothreads=N`: threads serving the queue pairs; by default one per pair, at most as
    /// many as the host has CPUs beside the vCPUs ([`default_net_threads`]).
    pub iothreads: Option<u16>,
}

/// I/O threads for `pairs` queue pairs of a guest with `vcpus` vCPUs on a host with
/// `host_cpus` CPUs: one per pair, but no more than the CPUs the vCPUs leave (at least
/// one). Threads beyond those only take turns on the same CPUs, and each pays its own
/// wake-ups where one thread would serve several pairs per wake-up.
pub fn default_net_threads(pairs: u16, vcpus: u32, host_cpus: usize) -> u16 {
    let spare = host_cpus.saturating_sub(vcpus as usize).max(1);
    pairs.min(u16::try_from(spare).unwrap_or(u16::MAX)).max(1)
}

/// Most queue pairs a network device may have.
pub const NET_QUEUES_MAX: u16 = 16;

/// Where the virtio console's output goes, when there is one (`--console virtio`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsoleConfig {
    /// No virtio console: the 16550 is the console.
    Serial,
    /// A virtio console writing to the serial port's destination (stdout, a file).
    Virtio,
}

/// What the machine starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartFrom {
    Kernel(PathBuf),
    /// The firmware ROM in [`VmConfig::firmware`], from the reset vector.
    Firmware,
    /// A snapshot file; memory size, vCPUs and irqchip mode come from it.
    Restore(PathBuf),
    /// An incoming live migration on `HOST:PORT`.
    Incoming(String),
    /// A local update arriving on this Unix socket (`--incoming unix:PATH`).
    IncomingLocal(PathBuf),
    /// Nothing yet: the configuration comes through the API (`--api-socket` alone, as
    /// Firecracker starts).
    Api,
}

/// Which of the machine's shape options the user gave (rather than left at their default):
/// with `--restore` they are checked against the snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShapeGiven {
    pub memory: bool,
    pub cpus: bool,
    pub irqchip: bool,
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Which of memory, cpus and irqchip the user gave.
    pub shape_given: ShapeGiven,
    pub start: StartFrom,
    pub cmdline: String,
    pub initrd: Option<PathBuf>,
    pub cpus: u32,
    pub memory: u64,
    /// `--memory` as the user wrote it, for error messages.
    pub memory_text: String,
    pub irqchip: IrqChipKind,
    pub accel: hypervisor::AccelKind,
    pub serial: SerialOutput,
    pub wired: bool,
    /// `--memory-backend`: anonymous memory, or a file a local update can hand over.
    pub memory_backend: crate::memory::MemoryBackend,
    pub api_socket: Option<PathBuf>,
    /// `--restore-verify`: check all of a snapshot's page data before the guest runs.
    pub restore_verify: bool,
    /// `--disk`, in order: the first is the first virtio-blk device on the PCI bus.
    pub disks: Vec<DiskConfig>,
    pub console: ConsoleConfig,
    /// `--rng`: a virtio-rng device fed by the host's getrandom.
    pub rng: bool,
    /// `--vsock`: a virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// `--net`, in order: each a virtio-net device on a tap.
    pub nets: Vec<NetConfig>,
    /// `--restore-eager`: copy a snapshot's pages into guest RAM before the guest runs,
    /// instead of mapping the file.
    pub restore_eager: bool,
    /// `--restore-allow-changed-disks`: restore even onto disk images changed since the
    /// snapshot.
    pub restore_allow_changed_disks: bool,
    /// `--seccomp`: what the threads' system call filters do with a forbidden call.
    pub seccomp: sandbox::Mode,
    /// `--firmware`: the ROM of a firmware boot, or of the machine an incoming migration
    /// brings (its layout has the ROM and the shadow RAM).
    pub firmware: Option<PathBuf>,
    /// `--boot`: the disks the firmware tries, in order, as indices into `disks`.
    pub boot_order: Vec<usize>,
    /// A restored snapshot waits, paused, to be resumed through the API (Firecracker's
    /// `resume_vm: false`).
    pub start_paused: bool,
}

/// The firmware `ferrovm run` uses when a disk is given without a kernel: Debian's SeaBIOS
/// (package `seabios`), the 256 KiB build QEMU's PC machines use.
pub const DEFAULT_FIRMWARE: &str = "/usr/share/seabios/bios-256k.bin";

impl VmConfig {
    pub fn new(start: StartFrom) -> Self {
        VmConfig {
            shape_given: ShapeGiven::default(),
            start,
            cmdline: String::new(),
            initrd: None,
            cpus: 1,
            memory: DEFAULT_MEMORY,
            memory_text: "256M".into(),
            irqchip: IrqChipKind::Kernel,
            accel: hypervisor::AccelKind::Auto,
            serial: SerialOutput::Stdio,
            wired: false,
            memory_backend: Default::default(),
            api_socket: None,
            restore_verify: false,
            restore_eager: false,
            restore_allow_changed_disks: false,
            seccomp: sandbox::Mode::platform_default(),
            disks: Vec::new(),
            console: ConsoleConfig::Serial,
            rng: false,
            vsock: None,
            nets: Vec::new(),
            firmware: None,
            boot_order: Vec::new(),
            start_paused: false,
        }
    }
}

/// Parses `--boot`: `disk` (every disk, in the order given) or a comma-separated list of
/// `diskN` (the N-th `--disk`, from 0), for a machine with `disks` disks.
pub fn parse_boot_order(text: &str, disks: usize) -> Result<Vec<usize>> {
    let bad = |reason: String| Error::Option {
        option: "--boot",
        value: text.to_string(),
        reason,
    };
    if text == "disk" {
        return Ok((0..disks).collect());
    }
    let mut order = Vec::new();
    for item in text.split(',') {
        let index: usize = item
            .strip_prefix("disk")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| bad(format!("{item:?}: expected disk or diskN")))?;
        if index >= disks {
            return Err(bad(format!(
                "{item}: there are {disks} disk(s), numbered from disk0"
            )));
        }
        if order.contains(&index) {
            return Err(bad(format!("{item} is listed twice")));
        }
        order.push(index);
    }
    Ok(order)
}

/// Parses a memory size: a whole number with a unit B, K/KiB, M/MiB, G/GiB or T/TiB (powers
/// of 1024; the letter in either case); a bare number means MiB, as with QEMU's `-m`. Any
/// other suffix is refused ("512MB" is ambiguous, "512X" a typo).
pub fn parse_memory_size(text: &str) -> Result<u64> {
    let bad = || Error::Option {
        option: "--memory",
        value: text.to_string(),
        reason: "expected a size such as 512M, 2G or 1GiB (units B, K/KiB, M/MiB, G/GiB, T/TiB)"
            .into(),
    };
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(bad());
    }
    let number: u64 = t[..digits_end].parse().map_err(|_| bad())?;
    let unit = &t[digits_end..];
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "M" | "MIB" => 20,
        "B" => 0,
        "K" | "KIB" => 10,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(bad()),
    };
    number
        .checked_mul(1u64 << shift)
        .filter(|v| v >> shift == number)
        .ok_or_else(bad)
}

/// Fails, naming the key, if one of `items` is given twice (the last would win silently).
fn refuse_repeated_keys<'a>(
    items: impl IntoIterator<Item = &'a str>,
    aliases: &[(&str, &'a str)],
) -> std::result::Result<(), String> {
    match virtio::block::repeated_key(items, aliases) {
        Some(key) => Err(format!("{key} is given twice")),
        None => Ok(()),
    }
}

/// Parses one `--disk` value.
pub fn parse_disk(text: &str) -> Result<DiskConfig> {
    let bad = |reason: String| Error::Option {
        option: "--disk",
        value: text.to_string(),
        reason,
    };
    let mut fields = text.split(',');
    let path = fields.next().unwrap_or_default();
    if path.is_empty() {
        return Err(bad(
            "expected PATH[,readonly][,serial=S][,cache=writeback|none][,queues=N]".into(),
        ));
    }
    refuse_repeated_keys(fields.clone(), &[("ro", "readonly")]).map_err(bad)?;
    let mut disk = DiskConfig {
        path: PathBuf::from(path),
        readonly: false,
        serial: None,
        cache: DiskCache::Writeback,
        queues: 1,
    };
    for field in fields {
        match field.split_once('=') {
            None if field == "readonly" || field == "ro" => disk.readonly = true,
            Some(("serial", s)) if s.len() <= DISK_SERIAL_MAX && s.is_ascii() => {
                disk.serial = Some(s.to_string())
            }
            Some(("serial", _)) => {
                return Err(bad(format!(
                    "serial must be ASCII and at most {DISK_SERIAL_MAX} bytes"
                )))
            }
            Some(("cache", "writeback")) => disk.cache = DiskCache::Writeback,
            Some(("cache", "none")) => disk.cache = DiskCache::None,
            Some(("cache", other)) => {
                return Err(bad(format!("cache={other}: expected writeback or none")))
            }
            Some(("queues", n)) => {
                disk.queues = n
                    .parse()
                    .ok()
                    .filter(|q| (1..=DISK_QUEUES_MAX).contains(q))
                    .ok_or_else(|| bad(format!("queues={n}: expected 1 to {DISK_QUEUES_MAX}")))?
            }
            _ => return Err(bad(format!("unknown disk option {field:?}"))),
        }
    }
    Ok(disk)
}

/// `--vsock cid=N,socket=PATH`: the guest's context id and the Unix socket host processes
/// connect to (guest connections to host port P go to `PATH_P`).
#[derive(Clone, Debug, PartialEq, Eq)]
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

/// Parses `--vsock cid=N,socket=PATH`.
pub fn parse_vsock(text: &str) -> Result<VsockConfig> {
    let bad = |reason: String| Error::Option {
        option: "--vsock",
        value: text.to_string(),
        reason,
    };
    let (mut cid, mut socket) = (None, None);
    refuse_repeated_keys(text.split(','), &[]).map_err(bad)?;
    for part in text.split(',') {
        match part.split_once('=') {
            Some(("cid", n)) => {
                let n: u64 = n
                    .parse()
                    .map_err(|_| bad(format!("cid {n:?} is not a number")))?;
                if let Some(why) = vsock_cid_refusal(n) {
                    return Err(bad(why));
                }
                cid = Some(n);
            }
            Some(("socket", path)) if !path.is_empty() => socket = Some(PathBuf::from(path)),
            _ => return Err(bad(format!("unknown or empty part {part:?}"))),
        }
    }
    match (cid, socket) {
        (Some(cid), Some(socket)) => Ok(VsockConfig { cid, socket }),
        _ => Err(bad("expected cid=N,socket=PATH".into())),
    }
}

/// Parses one `--net` value.
pub fn parse_net(text: &str) -> Result<NetConfig> {
    let bad = |reason: String| Error::Option {
        option: "--net",
        value: text.to_string(),
        reason,
    };
    let mut net = NetConfig {
        tap: String::new(),
        mac: None,
        queues: 1,
        vhost: false,
        iothreads: None,
    };
    refuse_repeated_keys(text.split(','), &[]).map_err(bad)?;
    for field in text.split(',') {
        match field.split_once('=') {
            Some(("tap", name)) if !name.is_empty() && name.len() < 16 => {
                net.tap = name.to_string()
            }
            Some(("tap", _)) => return Err(bad("tap=NAME: 1 to 15 bytes".into())),
            Some(("mac", mac)) => {
                net.mac = Some(parse_mac(mac).ok_or_else(|| {
                    bad(format!(
                        "mac={mac}: expected six hex bytes like 52:54:00:12:34:56, unicast, not \
                         all zeroes"
                    ))
                })?)
            }
            Some(("queues", n)) => {
                net.queues = n
                    .parse()
                    .ok()
                    .filter(|q| (1..=NET_QUEUES_MAX).contains(q))
                    .ok_or_else(|| bad(format!("queues={n}: expected 1 to {NET_QUEUES_MAX}")))?
            }
            Some(("iothreads", n)) => {
                net.iothreads = Some(
                    n.parse()
                        .ok()
                        .filter(|t| (1..=NET_QUEUES_MAX).contains(t))
                        .ok_or_else(|| {
                            bad(format!("iothreads={n}: expected 1 to {NET_QUEUES_MAX}"))
                        })?,
                )
            }
            Some(("vhost", "off")) => net.vhost = false,
            Some(("vhost", "on")) => net.vhost = true,
            _ => return Err(bad(format!("unknown net option {field:?}"))),
        }
    }
    if net.tap.is_empty() {
        return Err(bad(
            "expected tap=NAME[,mac=MAC][,queues=N][,iothreads=N][,vhost=on|off]".into(),
        ));
    }
    Ok(net)
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

/// Parses `--console`.
pub fn parse_console(text: &str) -> Result<ConsoleConfig> {
    match text {
        "virtio" => Ok(ConsoleConfig::Virtio),
        "serial" => Ok(ConsoleConfig::Serial),
        _ => Err(Error::Option {
            option: "--console",
            value: text.to_string(),
            reason: "expected virtio or serial".into(),
        }),
    }
}

pub fn parse_serial(text: &str) -> Result<SerialOutput> {
    match text {
        "stdio" => Ok(SerialOutput::Stdio),
        "none" => Ok(SerialOutput::None),
        _ => match text.split_once(':') {
            Some(("file", path)) if !path.is_empty() => Ok(SerialOutput::File(path.into())),
            Some(("socket", path)) if !path.is_empty() => Ok(SerialOutput::Socket(path.into())),
            _ => Err(Error::Option {
                option: "--serial",
                value: text.to_string(),
                reason: "expected stdio, none, file:PATH or socket:PATH".into(),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vsock_options_parse_and_refuse_reserved_cids() {
        let ok = parse_vsock("cid=3,socket=/tmp/v.sock").unwrap();
        assert_eq!(ok.cid, 3);
        assert_eq!(ok.socket, PathBuf::from("/tmp/v.sock"));
        let swapped = parse_vsock("socket=/s,cid=4294967294").unwrap();
        assert_eq!(swapped.cid, u64::from(u32::MAX) - 1);
        for (text, why) in [
            ("cid=2,socket=/s", "reserved"),
            ("cid=4294967295,socket=/s", "reserved"),
            ("cid=,socket=/s", "not a number"),
            ("cid=3", "expected cid=N,socket=PATH"),
            ("socket=/s", "expected cid=N,socket=PATH"),
            ("cid=3,socket=", "unknown or empty"),
            ("cid=3,socket=/s,port=1", "unknown or empty"),
        ] {
            let err = parse_vsock(text).unwrap_err().to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }

    #[test]
    fn repeated_keys_and_the_zero_mac_are_refused() {
        for (err, key) in [
            (parse_disk("d.img,cache=none,cache=writeback"), "cache"),
            (parse_disk("d.img,readonly,ro"), "readonly"),
        ] {
            assert!(err
                .unwrap_err()
                .to_string()
                .contains(&format!("{key} is given twice")));
        }
        let net = parse_net("tap=a,tap=b").unwrap_err().to_string();
        assert!(net.contains("tap is given twice"), "{net}");
        let vsock = parse_vsock("cid=3,cid=4,socket=/s")
            .unwrap_err()
            .to_string();
        assert!(vsock.contains("cid is given twice"), "{vsock}");
        assert_eq!(parse_mac("00:00:00:00:00:00"), None);
        assert_eq!(parse_mac("ff:ff:ff:ff:ff:ff"), None);
        assert!(parse_mac("02:00:00:00:00:00").is_some());
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory_size("256").unwrap(), 256 * MIB);
        assert_eq!(parse_memory_size("256M").unwrap(), 256 * MIB);
        assert_eq!(parse_memory_size("1G").unwrap(), GIB);
        assert_eq!(parse_memory_size("2GiB").unwrap(), 2 * GIB);
        assert_eq!(parse_memory_size("4096k").unwrap(), 4 * MIB);
        assert_eq!(parse_memory_size("0").unwrap(), 0);
        assert_eq!(parse_memory_size("512B").unwrap(), 512);
        assert_eq!(parse_memory_size("3t").unwrap(), 3 << 40);
        assert_eq!(parse_memory_size("64KiB").unwrap(), 64 << 10);
        for bad in [
            "",
            "G",
            "12X",
            "512MB",
            "1Gi",
            "2GB",
            "1iB",
            "5BB",
            "-1",
            "1.5G",
            "99999999999999999999",
            "18446744073709551615T",
        ] {
            assert!(parse_memory_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn disks() {
        let d = parse_disk("/img").unwrap();
        assert_eq!(d.path, PathBuf::from("/img"));
        assert!(!d.readonly && d.serial.is_none() && d.queues == 1);
        assert_eq!(d.cache, DiskCache::Writeback);
        let d = parse_disk("a.img,readonly,serial=disk0,cache=none,queues=4").unwrap();
        assert!(d.readonly);
        assert_eq!(d.serial.as_deref(), Some("disk0"));
        assert_eq!(d.cache, DiskCache::None);
        assert_eq!(d.queues, 4);
        for bad in [
            "",
            ",readonly",
            "a,queues=0",
            "a,queues=17",
            "a,queues=x",
            "a,cache=unsafe",
            "a,serial=123456789012345678901",
            "a,bogus",
            "a,readonly=yes",
        ] {
            let e = parse_disk(bad).unwrap_err().to_string();
            assert!(e.contains("--disk"), "{bad}: {e}");
        }
    }

    #[test]
    fn net_options() {
        let net = parse_net("tap=tap0,mac=52:54:00:aa:bb:0c,queues=2,vhost=off").unwrap();
        assert_eq!(net.tap, "tap0");
        assert_eq!(net.mac, Some([0x52, 0x54, 0, 0xaa, 0xbb, 0x0c]));
        assert_eq!(net.queues, 2);
        assert_eq!(parse_net("tap=t").unwrap().queues, 1);
        for bad in [
            "",
            "tap=",
            "mac=52:54:00:00:00:01",
            "tap=t,mac=01:00:00:00:00:01",
            "tap=t,mac=52:54:00:00:00",
            "tap=t,queues=0",
            "tap=t,queues=17",
            "tap=t,vhost=yes",
            "tap=t,speed=10",
            "tap=abcdefghijklmnopq",
        ] {
            let e = parse_net(bad).unwrap_err().to_string();
            assert!(e.contains("--net"), "{bad}: {e}");
        }
        assert!(parse_net("tap=t,vhost=on").unwrap().vhost);
        assert!(parse_net("tap=t,vhost=on,vhost=off").is_err());
        assert!(!parse_net("tap=t").unwrap().vhost);
        assert_eq!(parse_net("tap=t,iothreads=3").unwrap().iothreads, Some(3));
        assert_eq!(parse_net("tap=t").unwrap().iothreads, None);
        for bad in [
            "tap=t,iothreads=0",
            "tap=t,iothreads=17",
            "tap=t,iothreads=x",
        ] {
            let e = parse_net(bad).unwrap_err().to_string();
            assert!(e.contains("iothreads="), "{bad}: {e}");
        }
    }

    #[test]
    fn net_threads_by_default_fit_beside_the_vcpus() {
        // Plenty of CPUs: a thread per pair.
        assert_eq!(default_net_threads(4, 4, 16), 4);
        // 2 CPUs, 1 vCPU: both pairs on the one spare CPU's thread.
        assert_eq!(default_net_threads(2, 1, 2), 1);
        // No spare CPU at all: still one thread.
        assert_eq!(default_net_threads(8, 8, 4), 1);
        assert_eq!(default_net_threads(1, 1, 64), 1);
    }

    #[test]
    fn boot_orders() {
        assert_eq!(parse_boot_order("disk", 3).unwrap(), vec![0, 1, 2]);
        assert_eq!(parse_boot_order("disk", 0).unwrap(), Vec::<usize>::new());
        assert_eq!(parse_boot_order("disk1,disk0", 2).unwrap(), vec![1, 0]);
        for bad in [
            "",
            "cdrom",
            "disk2",
            "disk0,disk0",
            "disk-1",
            "disk0,",
            "net",
        ] {
            let e = parse_boot_order(bad, 2).unwrap_err().to_string();
            assert!(e.contains("--boot"), "{bad}: {e}");
        }
    }

    #[test]
    fn serial_outputs() {
        assert_eq!(parse_serial("stdio").unwrap(), SerialOutput::Stdio);
        assert_eq!(parse_serial("none").unwrap(), SerialOutput::None);
        assert_eq!(
            parse_serial("file:/tmp/x").unwrap(),
            SerialOutput::File("/tmp/x".into())
        );
        assert_eq!(
            parse_serial("socket:/run/c.sock").unwrap(),
            SerialOutput::Socket("/run/c.sock".into())
        );
        assert!(parse_serial("file:").is_err());
        assert!(parse_serial("socket:").is_err());
        assert!(parse_serial("tcp:1").is_err());
    }
}
