//! virtio-net (type 1) on a Linux tap interface.
//!
//! [`Net::new`] opens the tap (one queue per queue pair, `IFF_MULTI_QUEUE` for more than
//! one) with a virtio-net header on every frame and offers the offloads the host's tap
//! accepts. Once the driver sets DRIVER_OK each queue pair is served by its own I/O thread
//! ([`pair::PairHandler`]), and the control queue by another ([`ctrl::CtrlHandler`]).
//!
//! Queues: receive 2k and transmit 2k+1 for pair k, then the control queue (index 2N with
//! VIRTIO_NET_F_MQ, 2 without). Only the first pair is used until the driver sets more with
//! VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET; the tap queues of unused pairs are detached so the host
//! steers no frame to them.
//!
//! After a restore or an incoming migration the device announces the guest: it writes
//! RARP frames with the guest's MAC on the tap (so switches learn where it went, as QEMU's
//! announce does: the first at once, the others 50 and 200 ms later, see [`announce`])
//! and, with VIRTIO_NET_F_GUEST_ANNOUNCE, sets VIRTIO_NET_S_ANNOUNCE and interrupts, so the
//! guest sends its own gratuitous ARPs and acknowledges on the control queue.

pub mod announce;
mod ctrl;
pub mod group;
pub mod pair;
pub mod recheck;
pub mod tap;
#[cfg(test)]
mod tests;
pub mod vhost;

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use devices::exit::Waker;
use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use virtio_bindings::bindings::virtio_net::*;
use virtio_queue::QueueState;
use vm_memory::GuestMemory;

use crate::rng::COMMON_FEATURES;
use crate::worker::Workers;
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use group::PairGroup;
pub use pair::Counters;
use pair::{PairHandler, MAX_GSO_FRAME, MAX_PLAIN_FRAME};
use tap::{Tap, TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN, TUN_F_UFO, VNET_HDR_LEN};

/// Size of every queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most queue pairs a device may have.
pub const MAX_QUEUE_PAIRS: u16 = 16;
/// RARP frames written on the tap after a restore or an incoming migration.
pub const ANNOUNCE_FRAMES: usize = 3;
const STATE_VERSION: u32 = 1;

/// What `--net` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetOptions {
    /// The tap interface (created if it does not exist).
    pub tap: String,
    pub mac: [u8; 6],
    /// Queue pairs offered (VIRTIO_NET_F_MQ above 1).
    pub queue_pairs: u16,
    /// Threads serving the pairs the driver uses (consecutive pairs share one), at most one
    /// per pair.
    pub io_threads: u16,
}

/// What the device, its I/O threads and its control queue share.
pub struct Shared {
    /// The configuration space's `status` (LINK_UP, ANNOUNCE).
    pub status: AtomicU16,
    /// Queue pairs in use (1 until VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET).
    pub active_pairs: AtomicU16,
    pub counters: Counters,
    pub taps: Vec<Arc<Tap>>,
    /// One per pair: woken when the pair is attached or detached.
    pub steering_wakers: Vec<Arc<Waker>>,
    /// Counts changes of the attached queues.
    pub steering_generation: AtomicU64,
    /// Serialises changes of the attached queues (the control queue's thread and pair 0's).
    steering: Mutex<()>,
}

impl Shared {
    /// Uses the first `pairs` queue pairs: attaches their tap queues, detaches the others
    /// and wakes every pair's thread to look at its tap again.
    pub fn set_active_pairs(&self, pairs: u16) {
        let _serial = self.steering.lock().unwrap_or_else(|e| e.into_inner());
        self.active_pairs.store(pairs, Ordering::SeqCst);
        self.apply_steering(pairs);
    }

    /// Re-applies the current pair count to the tap queues (after an activation).
    pub fn refresh_steering(&self) {
        let _serial = self.steering.lock().unwrap_or_else(|e| e.into_inner());
        self.apply_steering(self.active_pairs.load(Ordering::SeqCst));
    }

    fn apply_steering(&self, pairs: u16) {
        self.steering_generation.fetch_add(1, Ordering::SeqCst);
        if self.taps.len() > 1 {
            for (k, tap) in self.taps.iter().enumerate() {
                if let Err(e) = tap.set_attached(k < usize::from(pairs)) {
                    log::warn!("virtio-net: {} queue {k}: {e}", tap.name());
                }
            }
        }
        for waker in &self.steering_wakers {
            let _ = waker.wake();
        }
    }
}

/// The device's own saved state (the queues are the transport's).
#[derive(Serialize, Deserialize)]
struct NetState {
    mac: [u8; 6],
    active_pairs: u16,
    status: u16,
}

/// A virtio-net device on a tap.
pub struct Net {
    options: NetOptions,
    shared: Arc<Shared>,
    /// TUN_F_* offloads the host's tap accepted.
    tap_offloads: u32,
    workers: Workers,
    acked_features: u64,
    interrupt: Option<Arc<dyn Interrupt>>,
    /// Restored: announce the guest at the next resume.
    announce_pending: bool,
    /// Restored pairs in use, applied at the next activation instead of 1.
    restored_pairs: Option<u16>,
    /// `vhost=on`: the kernel serves the queue pairs ([`vhost`]).
    kernel: Option<Box<dyn vhost::KernelDataPath>>,
    /// The RARP frames still to come after a restore.
    announcer: announce::Announcer,
    /// One per pair: its queues' re-check timers.
    timers: Vec<PairTimers>,
}

/// A pair's re-check timers (made at start-up: the I/O threads may not create them).
struct PairTimers {
    rx: Arc<recheck::RecheckTimer>,
    tx: Arc<recheck::RecheckTimer>,
}

impl PairTimers {
    fn new() -> std::io::Result<PairTimers> {
        Ok(PairTimers {
            rx: Arc::new(recheck::RecheckTimer::new()?),
            tx: Arc::new(recheck::RecheckTimer::new()?),
        })
    }
}

impl Net {
    /// Opens the tap named in `options`.
    pub fn new(options: NetOptions) -> std::io::Result<Net> {
        let pairs = options.queue_pairs.clamp(1, MAX_QUEUE_PAIRS);
        let taps: Vec<Arc<Tap>> = Tap::open_queues(&options.tap, pairs)?
            .into_iter()
            .map(Arc::new)
            .collect();
        let wanted = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO;
        let tap_offloads = taps.first().map_or(0, |t| t.probe_offloads(wanted));
        let timers = (0..pairs)
            .map(|_| PairTimers::new())
            .collect::<std::io::Result<Vec<_>>>()?;
        let steering_wakers = (0..pairs)
            .map(|_| Waker::new().map(Arc::new))
            .collect::<std::io::Result<_>>()?;
        let shared = Arc::new(Shared {
            status: AtomicU16::new(VIRTIO_NET_S_LINK_UP as u16),
            active_pairs: AtomicU16::new(1),
            counters: Counters::default(),
            taps,
            steering_wakers,
            steering_generation: AtomicU64::new(0),
            steering: Mutex::new(()),
        });
        Ok(Net {
            options: NetOptions {
                queue_pairs: pairs,
                ..options
            },
            shared,
            tap_offloads,
            workers: Workers::default(),
            acked_features: 0,
            interrupt: None,
            announce_pending: false,
            restored_pairs: None,
            kernel: None,
            announcer: announce::Announcer::default(),
            timers,
        })
    }

    /// Frames moved and dropped so far.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    fn pairs(&self) -> u16 {
        self.options.queue_pairs
    }

    /// The configuration space: mac, status, max_virtqueue_pairs.
    fn config_bytes(&self) -> [u8; 10] {
        let mut config = [0u8; 10];
        config[..6].copy_from_slice(&self.options.mac);
        let status = self.shared.status.load(Ordering::SeqCst);
        config[6..8].copy_from_slice(&status.to_le_bytes());
        config[8..10].copy_from_slice(&self.pairs().to_le_bytes());
        config
    }

    /// TUNSETOFFLOAD flags for what the driver accepts on receive. With
    /// VIRTIO_NET_F_MRG_RXBUF a large (GSO) frame is spread over as many receive buffers as
    /// it needs, so the offloads are the same either way.
    fn rx_offloads(&self, acked: u64) -> u32 {
        [
            (VIRTIO_NET_F_GUEST_CSUM, TUN_F_CSUM),
            (VIRTIO_NET_F_GUEST_TSO4, TUN_F_TSO4),
            (VIRTIO_NET_F_GUEST_TSO6, TUN_F_TSO6),
            (VIRTIO_NET_F_GUEST_ECN, TUN_F_TSO_ECN),
            (VIRTIO_NET_F_GUEST_UFO, TUN_F_UFO),
        ]
        .into_iter()
        .filter(|(feature, _)| acked & (1 << feature) != 0)
        .fold(0, |flags, (_, flag)| flags | flag)
    }

    /// The largest frame the driver may transmit with the offloads it acked.
    fn max_tx_frame(acked: u64) -> usize {
        let gso = [
            VIRTIO_NET_F_HOST_TSO4,
            VIRTIO_NET_F_HOST_TSO6,
            VIRTIO_NET_F_HOST_UFO,
        ];
        if gso.iter().any(|f| acked & (1 << f) != 0) {
            MAX_GSO_FRAME
        } else {
            MAX_PLAIN_FRAME
        }
    }

    /// RARP frames with the guest's MAC on the tap, and the guest asked to announce itself.
    fn announce(&mut self) {
        let frame = rarp_frame(&self.options.mac);
        if let Some(tap) = self.shared.taps.first() {
            self.announcer = announce::Announcer::start(tap.clone(), frame, ANNOUNCE_FRAMES);
        }
        if self.acked_features & (1 << VIRTIO_NET_F_GUEST_ANNOUNCE) != 0 {
            if let Some(interrupt) = &self.interrupt {
                self.shared
                    .status
                    .fetch_or(VIRTIO_NET_S_ANNOUNCE as u16, Ordering::SeqCst);
                interrupt.signal_config();
            }
        }
    }
}

/// A RARP request (reverse request, opcode 3) from `mac` with a zero virtio-net header, as
/// switches learn a moved guest's port from it: broadcast, padded to 60 bytes.
pub fn rarp_frame(mac: &[u8; 6]) -> Vec<u8> {
    let mut frame = vec![0u8; VNET_HDR_LEN];
    frame.extend_from_slice(&[0xff; 6]);
    frame.extend_from_slice(mac);
    frame.extend_from_slice(&[0x80, 0x35]); // ETH_P_RARP
    frame.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 3]); // Ethernet, IPv4, reverse request
    frame.extend_from_slice(mac); // sender hardware address
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(mac); // target hardware address
    frame.extend_from_slice(&[0; 4]);
    frame.resize(VNET_HDR_LEN + 60, 0);
    frame
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Net {
    fn device_type(&self) -> u32 {
        device_type::NET
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE; usize::from(self.pairs()) * 2 + 1]
    }

    fn features(&self) -> u64 {
        let mut features = COMMON_FEATURES
            | 1 << VIRTIO_NET_F_MRG_RXBUF
            | 1 << VIRTIO_NET_F_MAC
            | 1 << VIRTIO_NET_F_STATUS
            | 1 << VIRTIO_NET_F_CTRL_VQ
            | 1 << VIRTIO_NET_F_GUEST_ANNOUNCE;
        if self.pairs() > 1 {
            features |= 1 << VIRTIO_NET_F_MQ;
        }
        if let Some(kernel) = &self.kernel {
            features &= !vhost::VHOST_FEATURES | kernel.features();
        }
        if self.tap_offloads & TUN_F_CSUM != 0 {
            // The tap takes partial checksums and GSO frames from us whenever it has the
            // header; these the guest may send.
            features |= 1 << VIRTIO_NET_F_CSUM
                | 1 << VIRTIO_NET_F_HOST_TSO4
                | 1 << VIRTIO_NET_F_HOST_TSO6
                | 1 << VIRTIO_NET_F_HOST_UFO
                | 1 << VIRTIO_NET_F_GUEST_CSUM;
        }
        for (flag, feature) in [
            (TUN_F_TSO4, VIRTIO_NET_F_GUEST_TSO4),
            (TUN_F_TSO6, VIRTIO_NET_F_GUEST_TSO6),
            (TUN_F_TSO_ECN, VIRTIO_NET_F_GUEST_ECN),
            (TUN_F_UFO, VIRTIO_NET_F_GUEST_UFO),
        ] {
            if self.tap_offloads & flag != 0 {
                features |= 1 << feature;
            }
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            let at = usize::try_from(offset).ok().and_then(|o| o.checked_add(i));
            *byte = at.and_then(|at| config.get(at)).copied().unwrap_or(0);
        }
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The MAC is writable only in legacy devices; virtio 1.x has nothing to write here.
    }

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        self.workers.stop();
        self.acked_features = acked_features;
        self.interrupt = Some(interrupt.clone());
        let mq = acked_features & (1 << VIRTIO_NET_F_MQ) != 0;
        let usable_pairs = if mq { self.pairs() } else { 1 };
        let active = self.restored_pairs.take().unwrap_or(1).min(usable_pairs);
        self.shared.active_pairs.store(active, Ordering::SeqCst);
        let ctrl_index = usable_pairs * 2;
        let mut by_pair: Vec<Vec<ActiveQueue>> = (0..usable_pairs).map(|_| Vec::new()).collect();
        let mut ctrl = Vec::new();
        for queue in queues {
            match usize::from(queue.index / 2) {
                _ if queue.index == ctrl_index => ctrl.push(queue),
                pair if pair < by_pair.len() => by_pair[pair].push(queue),
                _ => log::debug!("virtio-net: queue {} is not used", queue.index),
            }
        }
        let by_pair = self.start_kernel_path(&mem, by_pair, interrupt.as_ref())?;
        self.spawn_pairs(by_pair, &mem, &interrupt)?;
        if !ctrl.is_empty() {
            let handler = ctrl::CtrlHandler {
                shared: self.shared.clone(),
                acked_features,
                max_pairs: usable_pairs,
            };
            self.workers.spawn(
                "virtio-net-ctrl".into(),
                mem,
                acked_features,
                ctrl,
                interrupt,
                handler,
            )?;
        }
        Ok(())
    }

    fn reset(&mut self) -> Vec<ActiveQueue> {
        self.announcer.cancel();
        let mut queues = self.workers.stop();
        queues.extend(self.kernel.as_mut().map(|k| k.stop()).unwrap_or_default());
        self.shared
            .status
            .store(VIRTIO_NET_S_LINK_UP as u16, Ordering::SeqCst);
        self.shared.active_pairs.store(1, Ordering::SeqCst);
        self.interrupt = None;
        queues
    }

    fn pause(&mut self) -> Result<(), LifecycleError> {
        self.announcer.cancel();
        self.workers.pause()?;
        self.pause_kernel_path()
    }

    fn resume(&mut self) -> Result<(), LifecycleError> {
        self.resume_kernel_path()?;
        self.workers.resume()?;
        if std::mem::take(&mut self.announce_pending) {
            self.announce();
        }
        Ok(())
    }

    fn queue_states(&self) -> Option<Vec<(u16, QueueState)>> {
        let mut states = self.workers.queue_states()?;
        if let Some(kernel) = &self.kernel {
            states.extend(kernel.queue_states());
        }
        Some(states)
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        let state = NetState {
            mac: self.options.mac,
            active_pairs: self.shared.active_pairs.load(Ordering::SeqCst),
            status: self.shared.status.load(Ordering::SeqCst),
        };
        DeviceState::new(STATE_VERSION, &state)
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let state = state.parse::<NetState>("virtio-net", STATE_VERSION)?;
        self.options.mac = state.mac;
        self.shared.status.store(state.status, Ordering::SeqCst);
        self.restored_pairs = Some(state.active_pairs.max(1));
        self.announce_pending = true;
        Ok(())
    }
}

impl Drop for Net {
    /// Says what the guest's frames cost it, when some were dropped.
    fn drop(&mut self) {
        let c = &self.shared.counters;
        let malformed = c.tx_malformed.load(Ordering::Relaxed);
        let refused = c.tx_errors.load(Ordering::Relaxed);
        let too_long = c.rx_too_long.load(Ordering::Relaxed);
        let bad_chain = c.rx_bad_chain.load(Ordering::Relaxed);
        if malformed + refused + too_long + bad_chain > 0 {
            log::warn!(
                "virtio-net {}: dropped {malformed} malformed transmit chains, {refused} frames \
                 the tap refused, {too_long} received frames longer than their buffers, \
                 {bad_chain} received frames on unusable buffers",
                self.options.tap
            );
        }
    }
}

impl Net {
    /// How many I/O threads serve `pairs` queue pairs.
    fn io_threads(&self, pairs: usize) -> usize {
        usize::from(self.options.io_threads).clamp(1, pairs.max(1))
    }

    /// Starts the I/O threads of the pairs that have queues, consecutive pairs together on
    /// [`Net::io_threads`] threads.
    fn spawn_pairs<M: GuestMemory + Send + Sync + 'static>(
        &mut self,
        by_pair: Vec<Vec<ActiveQueue>>,
        mem: &Arc<M>,
        interrupt: &Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        let served: Vec<(u16, Vec<ActiveQueue>)> = (0u16..)
            .zip(by_pair)
            .filter(|(_, queues)| !queues.is_empty())
            .collect();
        let threads = self.io_threads(served.len());
        let per_thread = served.len().div_ceil(threads).max(1);
        let used = served.len().div_ceil(per_thread);
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        log::info!(
            "virtio-net {}: {} queue pair{} on {used} I/O thread{}",
            self.options.tap,
            served.len(),
            plural(served.len()),
            plural(used)
        );
        let mut served = served.into_iter().peekable();
        while served.peek().is_some() {
            let mut group = PairGroup {
                first: served.peek().map_or(0, |(pair, _)| *pair),
                pairs: Vec::new(),
            };
            let mut queues = Vec::new();
            for (pair, pair_queues) in served.by_ref().take(per_thread) {
                group.pairs.push(self.pair_handler(pair, &pair_queues)?);
                queues.extend(pair_queues);
            }
            let name = format!("virtio-net-q{}", group.first);
            self.workers.spawn(
                name,
                mem.clone(),
                self.acked_features,
                queues,
                interrupt.clone(),
                group,
            )?;
        }
        Ok(())
    }

    /// The handler of pair `pair`, served on `queues` (its receive and transmit queues).
    fn pair_handler(
        &self,
        pair: u16,
        queues: &[ActiveQueue],
    ) -> Result<PairHandler, ActivateError> {
        let Some(tap) = self.shared.taps.get(usize::from(pair)).cloned() else {
            return Err(ActivateError(format!(
                "virtio-net: no tap queue for pair {pair}"
            )));
        };
        let acked = self.acked_features;
        let Some(timers) = self.timers.get(usize::from(pair)) else {
            return Err(ActivateError(format!(
                "virtio-net: no re-check timers for pair {pair}"
            )));
        };
        Ok(PairHandler {
            pair,
            has_rx: queues.iter().any(|q| q.index == pair * 2),
            tap,
            shared: self.shared.clone(),
            // Pair 0 sets the tap's offloads and which queues are attached, on its thread.
            setup: (pair == 0).then(|| self.rx_offloads(acked)),
            max_tx_frame: Net::max_tx_frame(acked),
            mergeable: acked & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0,
            pending_rx: None,
            tap_failed: None,
            rx_buf: vec![0; MAX_GSO_FRAME],
            rx_delivered: 0,
            rx_recheck: recheck::Recheck::new(timers.rx.clone()),
            tx: recheck::TxBatching::new(timers.tx.clone()),
        })
    }
}
