//! virtio-balloon (type 5, virtio 1.2 section 5.5): the host asks the guest to give back
//! `num_pages` 4 KiB pages; the driver puts the frame numbers of the pages it gave up on
//! the inflate queue (0) and of those it takes back on the deflate queue (1), and reports
//! its memory statistics on the stats queue (2, VIRTIO_BALLOON_F_STATS_VQ).
//!
//! An inflated page goes back to the host at once: `madvise(MADV_DONTNEED)` on its mapping
//! (`MADV_REMOVE` where guest RAM is a shared file mapping, whose pages DONTNEED would
//! not free). A deflated page needs nothing: the guest's next touch faults a fresh one in.
//! VIRTIO_BALLOON_F_MUST_TELL_HOST is not offered, so the driver may reuse pages before
//! telling. The stats buffer is held until the host wants fresh figures
//! ([`BalloonControl::request_stats`]): a device that returned it at once would have the
//! driver refill it in a loop.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::exit::Waker;
use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryRegion};

use crate::kind::{BuildContext, DeviceKind, OptionShape};
use crate::rng::COMMON_FEATURES;
use crate::worker::{QueueHandler, Workers};
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// The balloon's page size (VIRTIO_BALLOON_PFN_SHIFT 12), whatever the guest's.
pub const PAGE_SIZE: u64 = 4096;
pub const F_STATS_VQ: u64 = 1 << 1;
pub const F_DEFLATE_ON_OOM: u64 = 1 << 2;
const INFLATE: u16 = 0;
const DEFLATE: u16 = 1;
const STATS: u16 = 2;
/// `num_pages` and `actual`, both le32.
const CONFIG_LEN: u64 = 8;
const STATE_VERSION: u32 = 1;
/// Bytes of one `virtio_balloon_stat`: le16 tag, le64 value.
const STAT_LEN: usize = 10;

/// What the device and its worker share, and what the host side reads and changes.
pub struct BalloonControl {
    /// Pages the host asks for (`num_pages`).
    target_pages: AtomicU32,
    /// Pages the driver says it has given (`actual`).
    actual_pages: AtomicU32,
    /// Pages inflated and not deflated since the device started.
    inflated: AtomicU64,
    /// The latest statistics, by tag (VIRTIO_BALLOON_S_*).
    stats: Mutex<Vec<(u16, u64)>>,
    stats_wanted: AtomicBool,
    /// Wakes the worker for a stats request.
    wake: Arc<Waker>,
    /// The driver's interrupt, while the device runs (a new target raises a configuration
    /// change).
    interrupt: Mutex<Option<Arc<dyn Interrupt>>>,
}

impl BalloonControl {
    /// Asks the guest for `pages` pages in all.
    pub fn set_target(&self, pages: u32) {
        self.target_pages.store(pages, Ordering::SeqCst);
        if let Some(interrupt) = &*self.interrupt.lock().unwrap_or_else(|e| e.into_inner()) {
            interrupt.signal_config();
        }
    }

    pub fn target_pages(&self) -> u32 {
        self.target_pages.load(Ordering::SeqCst)
    }

    /// What the driver last wrote to `actual`.
    pub fn actual_pages(&self) -> u32 {
        self.actual_pages.load(Ordering::SeqCst)
    }

    /// Pages inflated (given back to the host) and not deflated since the device started.
    pub fn inflated_pages(&self) -> u64 {
        self.inflated.load(Ordering::SeqCst)
    }

    /// The statistics the driver last reported, (tag, value).
    pub fn stats(&self) -> Vec<(u16, u64)> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Gives the held stats buffer back, so the driver refills it with fresh figures.
    pub fn request_stats(&self) {
        self.stats_wanted.store(true, Ordering::SeqCst);
        if let Err(e) = self.wake.wake() {
            log::error!("virtio-balloon: cannot wake the worker: {e}");
        }
    }
}

#[derive(Serialize, Deserialize)]
struct BalloonState {
    target_pages: u32,
    actual_pages: u32,
}

/// A virtio-balloon device.
pub struct Balloon {
    config: BalloonConfig,
    control: Arc<BalloonControl>,
    workers: Workers,
}

impl Balloon {
    pub fn new(config: BalloonConfig) -> std::io::Result<Balloon> {
        let control = BalloonControl {
            target_pages: AtomicU32::new(config.target_pages()),
            actual_pages: AtomicU32::new(0),
            inflated: AtomicU64::new(0),
            stats: Mutex::new(Vec::new()),
            stats_wanted: AtomicBool::new(false),
            wake: Arc::new(Waker::new()?),
            interrupt: Mutex::new(None),
        };
        Ok(Balloon {
            config,
            control: Arc::new(control),
            workers: Workers::default(),
        })
    }

    /// What the host side (an API) reads and changes.
    pub fn control(&self) -> Arc<BalloonControl> {
        self.control.clone()
    }
}

/// Gives the 4 KiB page at frame `pfn` back to the host. False if it is not all in RAM.
fn discard_page<M: GuestMemory>(mem: &M, pfn: u32) -> bool {
    let Some(ram) = mem.physical_memory() else {
        return false;
    };
    let Some((region, offset)) = ram.to_region_addr(GuestAddress(u64::from(pfn) * PAGE_SIZE))
    else {
        return false;
    };
    if offset.raw_value() + PAGE_SIZE > region.len() {
        return false;
    }
    let Ok(host) = region.get_host_address(offset) else {
        return false;
    };
    let advise = |advice| {
        // SAFETY: `host` is the start of a page-aligned 4 KiB range inside the region's
        // mapping (checked above); dropping its contents is what the guest asked for, and
        // the mapping stays valid (the next touch reads zeroes or the file's page).
        unsafe { libc::madvise(host.cast(), PAGE_SIZE as usize, advice) == 0 }
    };
    // A shared file mapping (memfd guest RAM) gives pages back only through REMOVE (Linux);
    // a private one (a snapshot mapped for a lazy restore) refuses REMOVE and drops its
    // copy on DONTNEED.
    #[cfg(target_os = "linux")]
    if region.file_offset().is_some() && advise(libc::MADV_REMOVE) {
        return true;
    }
    advise(libc::MADV_DONTNEED)
}

struct BalloonHandler {
    control: Arc<BalloonControl>,
}

impl BalloonHandler {
    /// The frame numbers of an inflate or deflate chain.
    fn frames<M: GuestMemory>(mem: &M, chain: DescriptorChain<&M>) -> Vec<u32> {
        let Ok(mut reader) = chain.reader(mem) else {
            return Vec::new();
        };
        let mut bytes = vec![0; reader.available_bytes()];
        if reader.read_exact(&mut bytes).is_err() {
            return Vec::new();
        }
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    fn read_stats<M: GuestMemory>(&self, mem: &M, chain: DescriptorChain<&M>) {
        let Ok(mut reader) = chain.reader(mem) else {
            return;
        };
        let mut bytes = vec![0; reader.available_bytes().min(64 * STAT_LEN)];
        if reader.read_exact(&mut bytes).is_err() {
            return;
        }
        let stats = bytes
            .chunks_exact(STAT_LEN)
            .map(|s| {
                let tag = u16::from_le_bytes([s[0], s[1]]);
                let mut value = [0; 8];
                value.copy_from_slice(&s[2..]);
                (tag, u64::from_le_bytes(value))
            })
            .collect();
        *self.control.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
    }
}

impl<M: GuestMemory> QueueHandler<M> for BalloonHandler {
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32 {
        match queue {
            INFLATE => {
                let frames = Self::frames(mem, chain);
                let given = frames.iter().filter(|&&pfn| discard_page(mem, pfn)).count();
                self.control
                    .inflated
                    .fetch_add(given as u64, Ordering::SeqCst);
            }
            DEFLATE => {
                let taken = Self::frames(mem, chain).len() as u64;
                let inflated = &self.control.inflated;
                let left = inflated.load(Ordering::SeqCst).saturating_sub(taken);
                inflated.store(left, Ordering::SeqCst);
            }
            STATS => {
                self.control.stats_wanted.store(false, Ordering::SeqCst);
                self.read_stats(mem, chain);
            }
            _ => {}
        }
        0
    }

    /// The stats buffer stays with the device until fresh figures are asked for.
    fn ready(&mut self, queue: u16) -> bool {
        queue != STATS || self.control.stats_wanted.load(Ordering::SeqCst)
    }

    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        vec![self.control.wake.clone()]
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Balloon {
    fn device_type(&self) -> u32 {
        device_type::BALLOON
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        let queues = if self.config.stats { 3 } else { 2 };
        vec![QUEUE_SIZE; queues]
    }

    fn features(&self) -> u64 {
        let mut features = COMMON_FEATURES;
        if self.config.stats {
            features |= F_STATS_VQ;
        }
        if self.config.deflate_on_oom {
            features |= F_DEFLATE_ON_OOM;
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; CONFIG_LEN as usize];
        config[..4].copy_from_slice(&self.control.target_pages().to_le_bytes());
        config[4..].copy_from_slice(&self.control.actual_pages().to_le_bytes());
        data.fill(0);
        let start = offset.min(CONFIG_LEN) as usize;
        let end = (start + data.len()).min(CONFIG_LEN as usize);
        data[..end - start].copy_from_slice(&config[start..end]);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` is the driver's; a partial write changes the bytes it covers.
        if offset < 4 || offset + data.len() as u64 > CONFIG_LEN {
            return;
        }
        let mut actual = self.control.actual_pages().to_le_bytes();
        let at = (offset - 4) as usize;
        actual[at..at + data.len()].copy_from_slice(data);
        let actual = u32::from_le_bytes(actual);
        let before = self.control.actual_pages.swap(actual, Ordering::SeqCst);
        let target = self.control.target_pages();
        if actual != before && actual == target && target > 0 {
            log::info!(
                "virtio-balloon: the guest gave the {actual} pages asked for ({} given back to \
                 the host)",
                self.control.inflated_pages()
            );
        }
    }

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.iter().any(|q| q.index > STATS) || queues.len() < 2 {
            return Err(ActivateError(format!(
                "virtio-balloon: queues {:?} ready, expected inflate, deflate and maybe stats",
                queues.iter().map(|q| q.index).collect::<Vec<_>>()
            )));
        }
        self.workers.stop();
        *self
            .control
            .interrupt
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(interrupt.clone());
        let handler = BalloonHandler {
            control: self.control.clone(),
        };
        self.workers.spawn(
            "virtio-balloon".into(),
            mem,
            acked_features,
            queues,
            interrupt,
            handler,
        )
    }

    fn workers(&self) -> Option<&Workers> {
        Some(&self.workers)
    }

    fn workers_mut(&mut self) -> Option<&mut Workers> {
        Some(&mut self.workers)
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        let state = BalloonState {
            target_pages: self.control.target_pages(),
            actual_pages: self.control.actual_pages(),
        };
        DeviceState::new(STATE_VERSION, &state)
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let state: BalloonState = state.parse("virtio-balloon", STATE_VERSION)?;
        let control = &self.control;
        control
            .target_pages
            .store(state.target_pages, Ordering::SeqCst);
        control
            .actual_pages
            .store(state.actual_pages, Ordering::SeqCst);
        Ok(())
    }
}

/// virtio-balloon as a device kind: `--balloon size_mib=N[,deflate_on_oom=on][,stats=on]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BalloonConfig {
    /// What the host asks the guest to give back at start, in MiB.
    pub size_mib: u32,
    /// VIRTIO_BALLOON_F_DEFLATE_ON_OOM: the guest may take pages back when it runs out.
    pub deflate_on_oom: bool,
    /// VIRTIO_BALLOON_F_STATS_VQ: the guest reports its memory statistics.
    pub stats: bool,
}

impl BalloonConfig {
    /// `size_mib` in balloon pages.
    pub fn target_pages(&self) -> u32 {
        self.size_mib.saturating_mul((1 << 20) / PAGE_SIZE as u32)
    }
}

impl std::str::FromStr for BalloonConfig {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut config = BalloonConfig::default();
        crate::kind::refuse_repeated_keys(text.split(','), &[])?;
        let on_off = |key: &str, value: &str| match value {
            "on" => Ok(true),
            "off" => Ok(false),
            _ => Err(format!("{key}={value}: expected on or off")),
        };
        for item in text.split(',') {
            match item.split_once('=') {
                Some(("size_mib", n)) => {
                    config.size_mib =
                        n.parse()
                            .ok()
                            .filter(|&n: &u32| n < 1 << 20)
                            .ok_or_else(|| {
                                format!("size_mib={n}: expected a number of MiB below 1048576")
                            })?
                }
                Some(("deflate_on_oom", v)) => config.deflate_on_oom = on_off("deflate_on_oom", v)?,
                Some(("stats", v)) => config.stats = on_off("stats", v)?,
                _ => return Err(format!("unknown balloon option {item:?}")),
            }
        }
        Ok(config)
    }
}

impl<M: GuestMemory + Send + Sync + 'static> DeviceKind<M> for BalloonConfig {
    const SYNTAX: &'static str = "size_mib=N[,deflate_on_oom=on|off][,stats=on|off]";
    const HELP: &'static str = "A virtio-balloon device asking the guest for N MiB back";
    const SHAPE: OptionShape = OptionShape::Once;
    /// Inflated pages of a shared (memfd) guest RAM mapping go back with MADV_REMOVE.
    const SANDBOX: &'static str = "madvise MADV_REMOVE";

    fn parse(text: &str) -> Result<Option<Self>, String> {
        text.parse().map(Some)
    }

    fn label(&self) -> String {
        format!("size_mib={}", self.size_mib)
    }

    fn create(&self, _ctx: &BuildContext<M>) -> Result<Box<dyn VirtioDevice<M>>, String> {
        Ok(Box::new(
            Balloon::new(self.clone()).map_err(|e| e.to_string())?,
        ))
    }

    fn guest_difference(&self, recorded: &Self) -> Option<String> {
        let features = |c: &BalloonConfig| (c.deflate_on_oom, c.stats);
        (features(self) != features(recorded)).then(|| {
            format!(
                "with deflate_on_oom={} and stats={}",
                recorded.deflate_on_oom, recorded.stats
            )
        })
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use vm_memory::GuestMemoryMmap;

    use super::*;
    use crate::test_driver::{Buf, TestDriver};

    fn activated(driver: &TestDriver, config: BalloonConfig) -> Balloon {
        let mut balloon = Balloon::new(config).unwrap();
        let features = VirtioDevice::<GuestMemoryMmap>::features(&balloon);
        balloon
            .activate(
                driver.mem.clone(),
                features,
                driver.active_queues(),
                driver.interrupt(),
            )
            .unwrap();
        balloon
    }

    fn frames(pfns: &[u32]) -> Vec<u8> {
        pfns.iter().flat_map(|p| p.to_le_bytes()).collect()
    }

    /// Inflated pages are given back to the host (they read as zeroes again), deflated
    /// ones counted back; the configuration space carries the target and the driver's
    /// `actual`; the stats buffer is held until fresh figures are asked for.
    #[test]
    fn inflated_pages_go_back_to_the_host_and_stats_wait_for_a_request() {
        let mut driver = TestDriver::new(&[QUEUE_SIZE; 3]);
        let config: BalloonConfig = "size_mib=2,stats=on,deflate_on_oom=on".parse().unwrap();
        let mut balloon = activated(&driver, config);
        let device: &mut dyn VirtioDevice<GuestMemoryMmap> = &mut balloon;
        assert_eq!(device.features() & (F_STATS_VQ | F_DEFLATE_ON_OOM), 0b110);
        let mut target = [0u8; 4];
        device.read_config(0, &mut target);
        assert_eq!(u32::from_le_bytes(target), 512, "2 MiB in 4 KiB pages");
        device.write_config(4, &300u32.to_le_bytes());
        device.write_config(0, &7u32.to_le_bytes());
        let mut config = [0u8; 8];
        device.read_config(0, &mut config);
        assert_eq!(
            config,
            [0, 2, 0, 0, 44, 1, 0, 0],
            "num_pages kept, actual 300"
        );

        let pages = [driver.alloc(PAGE_SIZE), driver.alloc(PAGE_SIZE)];
        for page in pages {
            driver.write(page, &[0xa5; PAGE_SIZE as usize]);
        }
        let pfns: Vec<u32> = pages.iter().map(|p| (p.0 / PAGE_SIZE) as u32).collect();
        let list = driver.alloc(16);
        // Two frames in RAM and one far beyond it, which is skipped.
        driver.write(list, &frames(&[pfns[0], pfns[1], u32::MAX]));
        driver.add_chain(INFLATE as usize, &[Buf::r(list, 12)]);
        driver.kick(INFLATE as usize);
        driver.wait_used(INFLATE as usize, 1);
        for page in pages {
            assert_eq!(
                driver.read(page, PAGE_SIZE as usize),
                [0; PAGE_SIZE as usize]
            );
        }
        let control = balloon.control();
        assert_eq!(control.inflated_pages(), 2);

        driver.write(list, &frames(&pfns[..1]));
        driver.add_chain(DEFLATE as usize, &[Buf::r(list, 4)]);
        driver.kick(DEFLATE as usize);
        driver.wait_used(DEFLATE as usize, 1);
        assert_eq!(control.inflated_pages(), 1);

        let stats = driver.alloc(2 * STAT_LEN as u64);
        let mut figures = Vec::new();
        for (tag, value) in [(4u16, 1000u64), (5, 4096)] {
            figures.extend(tag.to_le_bytes());
            figures.extend(value.to_le_bytes());
        }
        driver.write(stats, &figures);
        driver.add_chain(STATS as usize, &[Buf::r(stats, 2 * STAT_LEN as u32)]);
        driver.kick(STATS as usize);
        driver.assert_no_used(STATS as usize, std::time::Duration::from_millis(100));
        control.request_stats();
        driver.wait_used(STATS as usize, 1);
        assert_eq!(control.stats(), [(4, 1000), (5, 4096)]);

        // Target and actual are saved.
        control.set_target(100);
        let device: &mut dyn VirtioDevice<GuestMemoryMmap> = &mut balloon;
        let saved = device.save().unwrap();
        let mut restored = Balloon::new(BalloonConfig::default()).unwrap();
        VirtioDevice::<GuestMemoryMmap>::restore(&mut restored, &saved).unwrap();
        let control = restored.control();
        assert_eq!((control.target_pages(), control.actual_pages()), (100, 300));
    }

    #[test]
    fn options() {
        let config: BalloonConfig = "size_mib=64".parse().unwrap();
        assert_eq!((config.target_pages(), config.stats), (16384, false));
        for bad in [
            "size_mib=x",
            "size_mib=1048576",
            "stats=yes",
            "size=1",
            "stats=on,stats=off",
        ] {
            assert!(bad.parse::<BalloonConfig>().is_err(), "{bad}");
        }
    }
}
