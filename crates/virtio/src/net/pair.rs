//! One queue pair's I/O: frames from the tap into the receive queue's buffers, the transmit
//! queue's chains onto the tap.
//!
//! Receive: the handler reads a frame from the tap only when the worker looks for receive
//! work ([`QueueHandler::ready`]), keeps it while the driver has no buffer, and meanwhile
//! leaves the tap out of the worker's poll set, so a busy tap never makes the thread spin;
//! the driver's next notification of the receive queue delivers the frame. Without
//! VIRTIO_NET_F_MRG_RXBUF a frame longer than the chain it lands in is dropped (the chain
//! gets a used length of 0) and counted. With it, a frame takes as many chains as it needs
//! (`num_buffers` in the first chain's header says how many) and their used entries are
//! published together; while the driver has posted too few, the frame waits in the ring's
//! place. A frame that would need more chains than the ring holds, or meets a chain that
//! cannot take its share (not even the header, no writable byte), is dropped and counted,
//! and the chains it took come back with a used length of 0.
//!
//! Transmit: each chain is one frame, header first, written to the tap with one writev(2)
//! straight from guest memory. A chain shorter than the header, or longer than the largest
//! frame the negotiated offloads allow, is dropped and counted; either way the chain is
//! returned to the driver (used length 0), so nothing the guest sends blocks the queue.

use std::io::{self, Write};
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use devices::exit::Waker;
use virtio_queue::DescriptorChain;
use vm_memory::bitmap::BS;
use vm_memory::{GuestMemory, Permissions, VolatileSlice};

use super::recheck::{Recheck, TxBatching};
use super::tap::{Tap, VNET_HDR_LEN};
use super::Shared;
use crate::worker::QueueHandler;

/// Largest frame a tap hands over or takes, header included: a 64 KiB GSO frame with its
/// Ethernet and VLAN headers.
pub const MAX_GSO_FRAME: usize = VNET_HDR_LEN + 14 + 4 + 65535;
/// Largest frame without segmentation offload: a 1500-byte MTU frame with a VLAN tag.
pub const MAX_PLAIN_FRAME: usize = VNET_HDR_LEN + 14 + 4 + 1500;
/// Offset of `num_buffers` in `virtio_net_hdr_v1`.
const NUM_BUFFERS_OFFSET: usize = 10;

/// Frames dropped or moved, for the log and the tests.
#[derive(Default, Debug)]
pub struct Counters {
    pub tx_frames: AtomicU64,
    pub rx_frames: AtomicU64,
    /// Transmit chains shorter than the header or longer than the largest frame.
    pub tx_malformed: AtomicU64,
    /// Transmit frames the tap refused.
    pub tx_errors: AtomicU64,
    /// Received frames that did not fit the chain they were given (with mergeable buffers:
    /// that would need more chains than the receive ring holds).
    pub rx_too_long: AtomicU64,
    /// Received frames dropped on a receive chain that cannot take its part (mergeable
    /// buffers: shorter than the header, no writable byte, or outside RAM).
    pub rx_bad_chain: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Serves one receive queue and one transmit queue over one tap queue.
pub struct PairHandler {
    pub pair: u16,
    /// The driver enabled this pair's receive queue (else the tap is never polled).
    pub has_rx: bool,
    pub tap: Arc<Tap>,
    pub shared: Arc<Shared>,
    /// Pair 0 only: the tap offloads (TUNSETOFFLOAD flags, from the acked features) to set
    /// once its thread runs, together with which tap queues are attached.
    pub setup: Option<u32>,
    /// Largest transmit frame, header included.
    pub max_tx_frame: usize,
    /// VIRTIO_NET_F_MRG_RXBUF: a frame may span several receive chains.
    pub mergeable: bool,
    /// A frame read from the tap that waits for a receive buffer.
    pub pending_rx: Option<usize>,
    /// The tap queue failed a read (detached under the thread, or the interface gone): it
    /// is not polled again until the control queue changes the queues attached.
    /// Holds the steering generation at the failure.
    pub tap_failed: Option<u64>,
    pub rx_buf: Vec<u8>,
    /// Frames put into the receive queue so far.
    pub rx_delivered: u64,
    /// A frame without buffers: look again shortly rather than ask for a notification.
    pub rx_recheck: Recheck,
    /// After a burst: look again shortly rather than ask for the next frame's kick.
    pub tx: TxBatching,
}

impl PairHandler {
    fn rx_queue(&self) -> u16 {
        self.pair * 2
    }

    /// Whether the kernel steers frames to this pair: only the first `active_pairs` are
    /// attached (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET).
    fn attached(&self) -> bool {
        self.pair < self.shared.active_pairs.load(Ordering::SeqCst)
    }

    /// Work the thread does once, on itself (its seccomp profile allows the ioctl).
    fn set_up(&mut self) {
        if let Some(flags) = self.setup.take() {
            if let Err(e) = self.tap.set_offloads(flags) {
                log::warn!("virtio-net: {}: {e}", self.tap.name());
            }
            self.shared.refresh_steering();
        }
    }

    /// Reads the next frame from the tap into `rx_buf`, unless one is waiting already.
    fn fetch_frame(&mut self) -> bool {
        if self.pending_rx.is_some() {
            return true;
        }
        if !self.attached() {
            return false;
        }
        match self.tap.read_frame(&mut self.rx_buf) {
            Ok(n) if n >= VNET_HDR_LEN => {
                self.pending_rx = Some(n);
                true
            }
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => false,
            Err(e) => {
                if self.tap_failed.is_none() {
                    log::warn!("virtio-net: reading {}: {e}", self.tap.name());
                }
                self.tap_failed = Some(self.shared.steering_generation.load(Ordering::SeqCst));
                false
            }
        }
    }

    fn receive<M: GuestMemory>(&mut self, mem: &M, chain: DescriptorChain<&M>) -> u32 {
        let Some(len) = self.pending_rx.take() else {
            return 0;
        };
        let Ok(mut writer) = chain.writer(mem) else {
            Counters::bump(&self.shared.counters.rx_too_long);
            return 0;
        };
        if writer.available_bytes() < len {
            log::debug!(
                "virtio-net: a {len}-byte frame does not fit a {}-byte buffer",
                writer.available_bytes()
            );
            Counters::bump(&self.shared.counters.rx_too_long);
            return 0;
        }
        let frame = &mut self.rx_buf[..len];
        // Every frame takes exactly one buffer, VIRTIO_NET_F_MRG_RXBUF or not (with it, the
        // tap is kept from sending frames larger than the MTU: see `Net::rx_offloads`).
        frame[NUM_BUFFERS_OFFSET..VNET_HDR_LEN].copy_from_slice(&1u16.to_le_bytes());
        if writer.write_all(frame).is_err() {
            return writer.bytes_written() as u32;
        }
        Counters::bump(&self.shared.counters.rx_frames);
        self.rx_delivered += 1;
        len as u32
    }

    /// Puts the pending frame into as many chains as it needs (mergeable buffers); the
    /// used entries, or None to wait for more chains. See the module documentation.
    fn receive_merged<'m, M: GuestMemory>(
        &mut self,
        mem: &'m M,
        ring_size: u16,
        chains: &mut dyn Iterator<Item = DescriptorChain<&'m M>>,
    ) -> Option<Vec<(u16, u32)>> {
        let Some(len) = self.pending_rx else {
            return Some(Vec::new());
        };
        let shared = self.shared.clone();
        let mut parts = Vec::new();
        let mut room = 0usize;
        while room < len {
            let Some(chain) = chains.next() else {
                if parts.len() < usize::from(ring_size) {
                    return None;
                }
                // The whole ring would not hold it: it never will.
                return Some(self.drop_frame(parts, &shared.counters.rx_too_long));
            };
            let head = chain.head_index();
            let writer = chain.writer(mem).ok();
            let usable = writer.as_ref().map_or(0, |w| w.available_bytes());
            parts.push((head, writer));
            if usable == 0 || (parts.len() == 1 && usable < VNET_HDR_LEN) {
                return Some(self.drop_frame(parts, &shared.counters.rx_bad_chain));
            }
            room += usable;
        }
        let count = u16::try_from(parts.len()).unwrap_or(u16::MAX);
        let frame = &mut self.rx_buf[..len];
        frame[NUM_BUFFERS_OFFSET..VNET_HDR_LEN].copy_from_slice(&count.to_le_bytes());
        let mut rest: &[u8] = frame;
        let mut used = Vec::with_capacity(parts.len());
        for (head, writer) in parts {
            let mut written = 0;
            if let Some(mut writer) = writer {
                let take = rest.len().min(writer.available_bytes());
                // A failed write leaves what reached the guest, as for one chain.
                let _ = writer.write_all(&rest[..take]);
                written = writer.bytes_written();
                rest = &rest[take..];
            }
            used.push((head, written as u32));
        }
        self.pending_rx = None;
        Counters::bump(&self.shared.counters.rx_frames);
        self.rx_delivered += 1;
        Some(used)
    }

    /// Drops the pending frame, counting it; the chains it took come back empty.
    fn drop_frame<W>(&mut self, parts: Vec<(u16, W)>, counter: &AtomicU64) -> Vec<(u16, u32)> {
        log::debug!(
            "virtio-net: a {:?}-byte frame does not fit the receive chains",
            self.pending_rx
        );
        self.pending_rx = None;
        Counters::bump(counter);
        parts.into_iter().map(|(head, _)| (head, 0)).collect()
    }

    fn transmit<M: GuestMemory>(&mut self, mem: &M, chain: DescriptorChain<&M>) -> u32 {
        let counters = &self.shared.counters;
        let Some(slices) = transmit_slices(mem, chain, self.max_tx_frame) else {
            Counters::bump(&counters.tx_malformed);
            return 0;
        };
        self.tx.sent_one();
        // Straight from guest memory to the tap: the guards keep the views valid meanwhile.
        let guards: Vec<_> = slices.iter().map(|s| s.ptr_guard()).collect();
        let iovecs: Vec<libc::iovec> = guards
            .iter()
            .zip(&slices)
            .map(|(guard, slice)| libc::iovec {
                iov_base: guard.as_ptr() as *mut libc::c_void,
                iov_len: slice.len(),
            })
            .collect();
        match self.tap.write_gathered(&iovecs) {
            Ok(_) => Counters::bump(&counters.tx_frames),
            Err(e) => {
                log::debug!("virtio-net: writing {}: {e}", self.tap.name());
                Counters::bump(&counters.tx_errors);
            }
        }
        0
    }
}

/// Host views of a transmit chain's buffers; None if a buffer is device-writable or outside
/// RAM, or the frame (header included) is shorter than the header or longer than `max`.
fn transmit_slices<'m, M: GuestMemory>(
    mem: &'m M,
    chain: DescriptorChain<&'m M>,
    max: usize,
) -> Option<Vec<VolatileSlice<'m, BS<'m, M::Bitmap>>>> {
    let mut slices = Vec::new();
    let mut total = 0usize;
    for desc in chain {
        if desc.is_write_only() {
            return None;
        }
        let len = usize::try_from(desc.len()).ok()?;
        total = total.checked_add(len).filter(|&t| t <= max)?;
        for slice in mem.get_slices(desc.addr(), len, Permissions::Read).ok()? {
            slices.push(slice.ok()?);
        }
    }
    (total >= VNET_HDR_LEN).then_some(slices)
}

impl<M: GuestMemory> QueueHandler<M> for PairHandler {
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32 {
        self.set_up();
        if queue == self.rx_queue() {
            self.receive(mem, chain)
        } else {
            self.transmit(mem, chain)
        }
    }

    fn multi_chain(&self, queue: u16) -> bool {
        self.mergeable && queue == self.rx_queue()
    }

    fn handle_chains<'m>(
        &mut self,
        mem: &'m M,
        queue: u16,
        ring_size: u16,
        chains: &mut dyn Iterator<Item = DescriptorChain<&'m M>>,
    ) -> Option<Vec<(u16, u32)>> {
        self.set_up();
        if queue != self.rx_queue() {
            return Some(Vec::new());
        }
        self.receive_merged(mem, ring_size, chains)
    }

    fn ready(&mut self, queue: u16) -> bool {
        self.set_up();
        queue != self.rx_queue() || self.fetch_frame()
    }

    fn notifications_off(&mut self, queue: u16) -> bool {
        // Receive buffers are looked for when a frame arrives; the driver needs to kick
        // only once the device holds a frame it has no buffer for, and not even then while
        // it is draining the ring. A transmit queue stays quiet while bursts keep coming
        // (see `recheck`).
        if queue != self.rx_queue() {
            return self.tx.notifications_off();
        }
        if self.pending_rx.is_none() {
            self.rx_recheck.clear();
            return true;
        }
        self.rx_recheck.defer(self.rx_delivered)
    }

    fn fds_ready(&mut self) {
        self.rx_recheck.take_expiry();
        self.tx.take_expiry();
    }

    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        // Woken when the control queue attaches or detaches this pair.
        self.shared
            .steering_wakers
            .get(usize::from(self.pair))
            .cloned()
            .into_iter()
            .collect()
    }

    fn poll_fds(&mut self) -> Vec<RawFd> {
        self.set_up();
        // A frame in hand waits for the driver's receive notification, not for the tap.
        // A change of the attached queues gives a failed tap another chance.
        let generation = self.shared.steering_generation.load(Ordering::SeqCst);
        if self.tap_failed.is_some_and(|failed| failed != generation) {
            self.tap_failed = None;
        }
        let failed = self.tap_failed.is_some();
        let timers = [&self.rx_recheck, self.tx.recheck()];
        let mut fds: Vec<RawFd> = timers.iter().filter_map(|r| r.poll_fd()).collect();
        if self.has_rx && !failed && self.pending_rx.is_none() && self.attached() {
            fds.push(self.tap.poll_fd());
        }
        fds
    }
}
