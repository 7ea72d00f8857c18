//! vhost-net: the host kernel serves a net device's queue pairs (`--net ...,vhost=on`).
//!
//! One `/dev/vhost-net` instance per queue pair, opened and owned when the device is made,
//! so a host without it fails at start-up. At activation [`VhostNet::start`] programs each
//! instance through the rust-vmm `vhost` crate's traits: the features (the driver's acked
//! ones that vhost decides on), the memory table (every guest RAM region with its host
//! address), then per ring its size, addresses, position, kick (the queue's notifier, the
//! KVM ioeventfd), call (the KVM irqfd of the queue's MSI-X vector) and backend (the pair's
//! tap queue). The control queue stays with the device's user-space thread.
//!
//! Pause detaches every backend (the kernel finishes what it holds) and reads each ring's
//! position back (VHOST_GET_VRING_BASE), so that `queue_states` is what a snapshot must
//! record; resume writes the positions and re-attaches the backends. Reset does the same
//! as pause and hands the queues back to the transport.
//!
//! The kernel calls sit behind the `vhost` crate's `VhostBackend`/`VhostNet` traits so the
//! programming can be checked without `/dev/vhost-net` (the unit tests use a recording
//! fake).

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use devices::exit::Waker;
use devices::LifecycleError;
use vhost::net::VhostNet as VhostNetOps;
use vhost::vhost_kern::PhysicalGuestAddressSpace;
use vhost::{VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::{QueueState, QueueT};
use vm_memory::{
    Address, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress,
};
use vmm_sys_util::eventfd::EventFd;

use crate::{ActivateError, ActiveQueue, Interrupt};

/// Path of the kernel's vhost-net device.
pub const VHOST_NET_DEVICE: &str = "/dev/vhost-net";

/// Feature bits that vhost-net implements (ring layout, buffers): the device offers them
/// only where the kernel does. The rest (MAC, status, control queue, offloads) are the
/// device's and the tap's.
pub const VHOST_FEATURES: u64 = 1 << VIRTIO_F_VERSION_1
    | 1 << VIRTIO_F_NOTIFY_ON_EMPTY
    | 1 << VIRTIO_RING_F_INDIRECT_DESC
    | 1 << VIRTIO_RING_F_EVENT_IDX
    | 1 << VIRTIO_NET_F_MRG_RXBUF;

/// Reads a ring's used index from guest memory (at `used_ring + 2`).
pub type UsedIndexReader = Box<dyn Fn(GuestAddress) -> Option<u16> + Send>;

/// What the device asks of its vhost data path (object-safe, so [`crate::net::Net`] holds
/// one whatever the kernel handle's type).
pub trait KernelDataPath: Send {
    /// Of [`VHOST_FEATURES`], those the kernel implements.
    fn features(&self) -> u64;
    /// Hands the pairs' queues to the kernel; `paused`: program them but leave the backends
    /// detached until [`KernelDataPath::resume`]. Each queue needs its irqfd in `calls`.
    fn start(
        &mut self,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        calls: Vec<OwnedFd>,
        read_used: UsedIndexReader,
        paused: bool,
    ) -> Result<(), ActivateError>;
    /// Detaches every backend and reads the rings' positions back.
    fn pause(&mut self) -> Result<(), String>;
    /// Writes the positions and re-attaches the backends.
    fn resume(&mut self) -> Result<(), String>;
    /// Pause, then give the queues back (device reset).
    fn stop(&mut self) -> Vec<ActiveQueue>;
    /// The rings' positions as of the last pause (the queues the kernel serves).
    fn queue_states(&self) -> Vec<(u16, QueueState)>;
    /// Whether the kernel serves queues now (started and not stopped).
    fn active(&self) -> bool;
}

/// One ring the kernel serves.
struct KernelRing {
    queue: ActiveQueue,
    /// The irqfd the kernel signals (kept open while programmed).
    call: EventFd,
}

impl KernelRing {
    /// Which vhost-net instance serves it, and its ring there (0 receive, 1 transmit).
    fn place(&self) -> (usize, usize) {
        (
            usize::from(self.queue.index / 2),
            usize::from(self.queue.index % 2),
        )
    }
}

/// vhost-net instances, one per queue pair, behind the `vhost` crate's traits.
pub struct VhostNet<B: VhostNetOps + Send> {
    backends: Vec<B>,
    /// The tap queue of each pair (the backend of both its rings).
    taps: Vec<File>,
    regions: Vec<VhostUserMemoryRegionInfo>,
    /// Of [`VHOST_FEATURES`], those every instance implements.
    offered: u64,
    rings: Vec<KernelRing>,
    read_used: Option<UsedIndexReader>,
    running: bool,
}

/// Why vhost-net cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct VhostOpenError(pub String);

/// Opens one `/dev/vhost-net` instance per tap queue for guest memory `mem` and makes this
/// process their owner.
pub fn open_kernel<AS>(
    mem: AS,
    taps: Vec<File>,
) -> Result<VhostNet<vhost::vhost_kern::net::Net<AS>>, VhostOpenError>
where
    AS: PhysicalGuestAddressSpace + Clone + Send,
{
    let regions = memory_regions(&*mem.memory());
    let backends = taps
        .iter()
        .map(|_| match vhost::vhost_kern::net::Net::new(mem.clone()) {
            Ok(net) => Ok(net),
            Err(vhost::Error::VhostOpen(e)) => Err(VhostOpenError(format!(
                "cannot open {VHOST_NET_DEVICE}: {e}"
            ))),
            Err(e) => Err(VhostOpenError(format!("{VHOST_NET_DEVICE}: {e}"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    VhostNet::new(backends, taps, regions)
}

/// Every RAM region as the kernel's memory table holds it: guest address, size, host address.
pub fn memory_regions<M: GuestMemoryBackend>(mem: &M) -> Vec<VhostUserMemoryRegionInfo> {
    mem.iter()
        .filter_map(|region| {
            let host = region.get_host_address(MemoryRegionAddress(0)).ok()?;
            Some(VhostUserMemoryRegionInfo {
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: host as u64,
                mmap_offset: 0,
                mmap_handle: -1,
            })
        })
        .collect()
}

fn vhost_err(what: &str, e: vhost::Error) -> String {
    format!("vhost-net {what}: {e}")
}

impl<B: VhostNetOps + Send> VhostNet<B> {
    /// Takes the instances (one per pair, with its tap queue) and makes this process their
    /// owner (VHOST_SET_OWNER); reads what they implement.
    pub fn new(
        backends: Vec<B>,
        taps: Vec<File>,
        regions: Vec<VhostUserMemoryRegionInfo>,
    ) -> Result<Self, VhostOpenError> {
        if backends.len() != taps.len() || backends.is_empty() {
            return Err(VhostOpenError(
                "one vhost-net instance per tap queue".into(),
            ));
        }
        let mut offered = VHOST_FEATURES;
        for backend in &backends {
            backend
                .set_owner()
                .map_err(|e| VhostOpenError(vhost_err("VHOST_SET_OWNER", e)))?;
            offered &= backend
                .get_features()
                .map_err(|e| VhostOpenError(vhost_err("VHOST_GET_FEATURES", e)))?;
        }
        Ok(VhostNet {
            backends,
            taps,
            regions,
            offered,
            rings: Vec::new(),
            read_used: None,
            running: false,
        })
    }

    /// Features, memory table and each ring's size, addresses, position, kick and call.
    fn program(&self, acked_features: u64) -> Result<(), String> {
        let features = acked_features & self.offered;
        for backend in &self.backends {
            backend
                .set_features(features)
                .map_err(|e| vhost_err("VHOST_SET_FEATURES", e))?;
            backend
                .set_mem_table(&self.regions)
                .map_err(|e| vhost_err("VHOST_SET_MEM_TABLE", e))?;
        }
        for ring in &self.rings {
            self.program_ring(ring)?;
        }
        Ok(())
    }

    fn program_ring(&self, ring: &KernelRing) -> Result<(), String> {
        let (pair, index) = ring.place();
        let backend = self
            .backends
            .get(pair)
            .ok_or_else(|| format!("vhost-net: no instance for queue {}", ring.queue.index))?;
        let queue = &ring.queue.queue;
        let config = VringConfigData {
            queue_max_size: queue.max_size(),
            queue_size: queue.size(),
            flags: 0,
            desc_table_addr: queue.desc_table(),
            used_ring_addr: queue.used_ring(),
            avail_ring_addr: queue.avail_ring(),
            log_addr: None,
        };
        let what = |call: &str| format!("{call} (queue {})", ring.queue.index);
        backend
            .set_vring_num(index, queue.size())
            .map_err(|e| vhost_err(&what("VHOST_SET_VRING_NUM"), e))?;
        backend
            .set_vring_addr(index, &config)
            .map_err(|e| vhost_err(&what("VHOST_SET_VRING_ADDR"), e))?;
        backend
            .set_vring_base(index, queue.next_avail())
            .map_err(|e| vhost_err(&what("VHOST_SET_VRING_BASE"), e))?;
        let kick = eventfd_of(&ring.queue.notify).map_err(|e| format!("vhost-net kick: {e}"))?;
        backend
            .set_vring_kick(index, &kick)
            .map_err(|e| vhost_err(&what("VHOST_SET_VRING_KICK"), e))?;
        backend
            .set_vring_call(index, &ring.call)
            .map_err(|e| vhost_err(&what("VHOST_SET_VRING_CALL"), e))
    }

    /// Attaches (`true`) or detaches every ring's tap queue.
    fn set_backends(&self, attach: bool) -> Result<(), String> {
        for ring in &self.rings {
            let (pair, index) = ring.place();
            let (Some(backend), Some(tap)) = (self.backends.get(pair), self.taps.get(pair)) else {
                continue;
            };
            backend
                .set_backend(index, attach.then_some(tap))
                .map_err(|e| {
                    vhost_err(
                        &format!("VHOST_NET_SET_BACKEND (queue {})", ring.queue.index),
                        e,
                    )
                })?;
        }
        Ok(())
    }

    /// Reads each ring's position back once its backend is detached.
    fn read_positions(&mut self) -> Result<(), String> {
        for ring in &mut self.rings {
            let (pair, index) = ring.place();
            let Some(backend) = self.backends.get(pair) else {
                continue;
            };
            let base = backend.get_vring_base(index).map_err(|e| {
                vhost_err(
                    &format!("VHOST_GET_VRING_BASE (queue {})", ring.queue.index),
                    e,
                )
            })?;
            // The split ring's position is 16 bits; the kernel returns it in a u32.
            let next_avail = base as u16;
            let queue = &mut ring.queue.queue;
            queue.set_next_avail(next_avail);
            let used_at = GuestAddress(queue.used_ring()).checked_add(2);
            let used = used_at.and_then(|at| self.read_used.as_ref().and_then(|read| read(at)));
            queue.set_next_used(used.unwrap_or(next_avail));
        }
        Ok(())
    }
}

/// A duplicate of a queue notifier's eventfd, as the vhost crate takes it.
fn eventfd_of(waker: &Waker) -> std::io::Result<EventFd> {
    // SAFETY: the notifier's eventfd is open while `waker` is borrowed.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(waker.poll_fd()) };
    let owned = borrowed.try_clone_to_owned()?;
    // SAFETY: `owned` is a new eventfd descriptor whose ownership moves to the EventFd.
    Ok(unsafe { EventFd::from_raw_fd(owned.into_raw_fd()) })
}

impl<B: VhostNetOps + Send> KernelDataPath for VhostNet<B> {
    fn features(&self) -> u64 {
        self.offered
    }

    fn start(
        &mut self,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        calls: Vec<OwnedFd>,
        read_used: UsedIndexReader,
        paused: bool,
    ) -> Result<(), ActivateError> {
        if queues.len() != calls.len() {
            return Err(ActivateError("vhost-net: one irqfd per queue".into()));
        }
        if self.active() {
            // Activated again without a reset in between: the old rings go first.
            drop(self.stop());
        }
        self.rings = queues
            .into_iter()
            .zip(calls)
            .map(|(queue, call)| KernelRing {
                queue,
                // SAFETY: `call` is an eventfd descriptor (the irqfd's duplicate) we own.
                call: unsafe { EventFd::from_raw_fd(call.into_raw_fd()) },
            })
            .collect();
        self.read_used = Some(read_used);
        self.program(acked_features).map_err(ActivateError)?;
        if !paused {
            self.set_backends(true).map_err(ActivateError)?;
            self.running = true;
        }
        Ok(())
    }

    fn pause(&mut self) -> Result<(), String> {
        if !self.running {
            return Ok(());
        }
        self.set_backends(false)?;
        self.running = false;
        self.read_positions()
    }

    fn resume(&mut self) -> Result<(), String> {
        if self.running || self.rings.is_empty() {
            return Ok(());
        }
        for ring in &self.rings {
            let (pair, index) = ring.place();
            if let Some(backend) = self.backends.get(pair) {
                backend
                    .set_vring_base(index, ring.queue.queue.next_avail())
                    .map_err(|e| vhost_err("VHOST_SET_VRING_BASE", e))?;
            }
        }
        self.set_backends(true)?;
        self.running = true;
        Ok(())
    }

    fn stop(&mut self) -> Vec<ActiveQueue> {
        if let Err(e) = self.pause() {
            log::error!("virtio-net: stopping vhost-net: {e}");
        }
        self.read_used = None;
        self.rings.drain(..).map(|ring| ring.queue).collect()
    }

    fn queue_states(&self) -> Vec<(u16, QueueState)> {
        self.rings
            .iter()
            .map(|ring| (ring.queue.index, ring.queue.queue.state()))
            .collect()
    }

    fn active(&self) -> bool {
        !self.rings.is_empty()
    }
}

impl super::Net {
    /// Lets the kernel serve the queue pairs (`vhost=on`) from the next activation.
    pub fn use_kernel_path(&mut self, kernel: Box<dyn KernelDataPath>) {
        self.kernel = Some(kernel);
    }

    /// Second descriptors of the tap queues, one per pair, for [`open_kernel`].
    pub fn tap_files(&self) -> std::io::Result<Vec<File>> {
        self.shared
            .taps
            .iter()
            .map(|t| t.try_clone_file())
            .collect()
    }

    /// With a kernel path, hands the pairs' queues to it and returns none. Returns them all,
    /// for the device's own threads, without one, or when a queue has no kernel interrupt
    /// route (the driver left MSI-X off, or the vector has no irqfd): the kernel could not
    /// interrupt the guest, so the device serves the queues itself and says so.
    pub(super) fn start_kernel_path<M>(
        &mut self,
        mem: &Arc<M>,
        by_pair: Vec<Vec<ActiveQueue>>,
        interrupt: &dyn Interrupt,
    ) -> Result<Vec<Vec<ActiveQueue>>, ActivateError>
    where
        M: vm_memory::GuestMemory + Send + Sync + 'static,
    {
        if self.kernel.is_none() {
            return Ok(by_pair);
        }
        let mut calls = Vec::new();
        for queue in by_pair.iter().flatten() {
            let Some(call) = interrupt.queue_irqfd(queue.index) else {
                log::warn!(
                    "virtio-net {}: vhost=on, but queue {} has no kernel interrupt route \
                     (MSI-X off or no irqfd): the VMM serves the queues itself",
                    self.options.tap,
                    queue.index
                );
                return Ok(by_pair);
            };
            calls.push(call);
        }
        let offloads = self.rx_offloads(self.acked_features);
        if let Some(tap) = self.shared.taps.first() {
            if let Err(e) = tap.set_offloads(offloads) {
                log::warn!("virtio-net: {}: {e}", tap.name());
            }
        }
        self.shared.refresh_steering();
        let (acked, paused) = (self.acked_features, self.workers.paused());
        let queues = by_pair.into_iter().flatten().collect();
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.start(acked, queues, calls, used_index_reader(mem.clone()), paused)?;
        }
        Ok(Vec::new())
    }

    pub(super) fn pause_kernel_path(&mut self) -> Result<(), LifecycleError> {
        let tap = &self.options.tap;
        match self.kernel.as_mut() {
            Some(kernel) => kernel
                .pause()
                .map_err(|e| LifecycleError(format!("virtio-net {tap}: {e}"))),
            None => Ok(()),
        }
    }

    pub(super) fn resume_kernel_path(&mut self) -> Result<(), LifecycleError> {
        let tap = &self.options.tap;
        match self.kernel.as_mut() {
            Some(kernel) => kernel
                .resume()
                .map_err(|e| LifecycleError(format!("virtio-net {tap}: {e}"))),
            None => Ok(()),
        }
    }
}

/// Reads a used index through any guest memory.
pub fn used_index_reader<M>(mem: Arc<M>) -> UsedIndexReader
where
    M: vm_memory::GuestMemory + Send + Sync + 'static,
{
    Box::new(move |at| {
        vm_memory::Bytes::read_obj::<u16>(&*mem, at)
            .ok()
            .map(u16::from_le)
    })
}

#[cfg(test)]
#[path = "vhost_tests.rs"]
mod tests;
