//! The I/O thread a virtio device serves its queues on.
//!
//! A [`Worker`] owns one or more [`ActiveQueue`]s and a [`QueueHandler`] that turns one
//! descriptor chain into one used entry. The thread sleeps in poll(2) on each queue's
//! [`Waker`], on a control waker and on any extra wakers the handler names (input ready for a
//! receive queue); poll(2) rather than epoll so that the same code runs on FreeBSD.
//!
//! Pause is cooperative and exact: the thread finishes the chain it is handling, writes its
//! used entry, signals the driver, publishes the queue positions and parks;
//! [`Worker::pause`] returns once it has parked, so the device is quiescent and
//! [`Worker::queue_states`] is what a snapshot must record. Resume re-checks every queue, so
//! work the driver queued meanwhile is served. Stop hands the queues back.
//!
//! Every wait of the controlling thread is bounded ([`QUIESCE_TIMEOUT`]): a worker stuck in a
//! system call (a hung network file system) makes `pause` fail and `stop` give up on it
//! rather than hang the VMM.

use std::io;
use std::num::Wrapping;
use std::os::unix::io::RawFd;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use devices::exit::Waker;
use devices::LifecycleError;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

use crate::{ActivateError, ActiveQueue, Interrupt};

/// How long `pause` and `stop` wait for a worker to finish the request in hand.
pub const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);

/// Completions after which the driver is signalled even in the middle of a batch, so that a
/// long batch does not hold back the first completions.
const SIGNAL_BATCH: u32 = 16;

/// What a device does with the chains of its queues.
pub trait QueueHandler<M: GuestMemory>: Send + 'static {
    /// Serves one descriptor chain taken from queue `queue` (its [`ActiveQueue::index`]);
    /// returns the number of bytes written into the chain's device-writable buffers, the
    /// used entry's length. Must not panic or block without bound on guest data.
    fn handle(&mut self, mem: &M, queue: u16, chain: DescriptorChain<&M>) -> u32;

    /// Whether one request of `queue` may span several chains: its chains then go to
    /// [`QueueHandler::handle_chains`] instead of [`QueueHandler::handle`].
    fn multi_chain(&self, _queue: u16) -> bool {
        false
    }

    /// Serves one request of `queue` that takes as many chains as it needs from `chains`
    /// (a received frame spread over mergeable buffers; the queue holds `ring_size`). Returns
    /// the used entries (head, length) of the chains it took, in the order taken, which the
    /// worker publishes together; `None` when the chains available do not suffice, which
    /// puts every chain it took back in the ring until the driver adds more.
    fn handle_chains<'m>(
        &mut self,
        _mem: &'m M,
        _queue: u16,
        _ring_size: u16,
        _chains: &mut dyn Iterator<Item = DescriptorChain<&'m M>>,
    ) -> Option<Vec<(u16, u32)>> {
        None
    }

    /// Whether a chain of `queue` can be served now. A receive queue says no while it has no
    /// input: its chains stay in the available ring until an extra waker fires.
    fn ready(&mut self, _queue: u16) -> bool {
        true
    }

    /// Whether the driver need not notify `queue` after the worker has served it: a
    /// receive queue that still holds buffers is looked at again when input arrives, so
    /// the driver's kicks for every buffer it adds (each a VM exit) would be wasted.
    fn notifications_off(&mut self, _queue: u16) -> bool {
        false
    }

    /// Wakers besides the queues' own that make the worker re-check every queue.
    fn extra_wakers(&self) -> Vec<Arc<Waker>> {
        Vec::new()
    }

    /// Descriptors besides the wakers (a tap's, an epoll set of host sockets) whose
    /// readability makes the worker call [`QueueHandler::fds_ready`] and re-check every
    /// queue. Asked before every wait, so a handler leaves out an input it cannot take yet
    /// (no receive buffers) instead of making the worker spin on it.
    fn poll_fds(&mut self) -> Vec<RawFd> {
        Vec::new()
    }

    /// One of [`QueueHandler::poll_fds`] is readable. A handler that does not consume the
    /// input here must leave the descriptor out of its next `poll_fds` or consume it while
    /// serving, or the worker spins.
    fn fds_ready(&mut self) {}
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Command {
    Run,
    Pause,
    Stop,
}

struct Shared {
    command: Command,
    parked: bool,
    exited: bool,
    /// Queue positions published when the worker parked.
    parked_states: Vec<(u16, QueueState)>,
}

/// What the controlling thread and the worker thread share.
struct Control {
    shared: Mutex<Shared>,
    changed: Condvar,
    /// Set with any command but Run: the worker stops taking chains.
    yield_now: AtomicBool,
    waker: Waker,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn command(&self) -> Command {
        self.lock().command
    }

    fn send(&self, command: Command) {
        self.yield_now
            .store(command != Command::Run, Ordering::SeqCst);
        self.lock().command = command;
        self.changed.notify_all();
        if let Err(e) = self.waker.wake() {
            log::error!("cannot wake a virtio worker: {e}");
        }
    }

    /// Waits until `done` holds or the worker exits; false on timeout.
    fn wait_for(&self, done: impl Fn(&Shared) -> bool) -> bool {
        let deadline = Instant::now() + QUIESCE_TIMEOUT;
        let mut shared = self.lock();
        while !done(&shared) && !shared.exited {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            shared = match self.changed.wait_timeout(shared, left) {
                Ok((guard, _)) => guard,
                Err(e) => e.into_inner().0,
            };
        }
        done(&shared)
    }
}

/// Marks the worker exited however its thread ends (a panic included), so that nobody waits
/// for a dead thread.
struct ExitGuard(Arc<Control>);

impl Drop for ExitGuard {
    fn drop(&mut self) {
        let mut shared = self.0.lock();
        shared.exited = true;
        shared.parked = false;
        drop(shared);
        self.0.changed.notify_all();
    }
}

/// A running I/O thread; see the module documentation.
pub struct Worker {
    name: String,
    control: Arc<Control>,
    thread: Option<JoinHandle<Vec<ActiveQueue>>>,
}

/// How a worker starts.
pub struct WorkerConfig<M> {
    /// The thread's name (shown by `ps -T` and in logs).
    pub name: String,
    pub mem: Arc<M>,
    pub queues: Vec<ActiveQueue>,
    pub interrupt: Arc<dyn Interrupt>,
    /// VIRTIO_F_RING_EVENT_IDX was negotiated.
    pub event_idx: bool,
    /// Start parked (a device activated while the machine is paused, e.g. on restore); the
    /// first [`Worker::resume`] serves the queues.
    pub start_paused: bool,
}

impl Worker {
    /// Starts the thread.
    pub fn spawn<M, H>(config: WorkerConfig<M>, handler: H) -> io::Result<Worker>
    where
        M: GuestMemory + Send + Sync + 'static,
        H: QueueHandler<M>,
    {
        let initial = if config.start_paused {
            Command::Pause
        } else {
            Command::Run
        };
        let control = Arc::new(Control {
            shared: Mutex::new(Shared {
                command: initial,
                parked: false,
                exited: false,
                parked_states: Vec::new(),
            }),
            changed: Condvar::new(),
            yield_now: AtomicBool::new(config.start_paused),
            waker: Waker::new()?,
        });
        let name = config.name.clone();
        let mut queues = config.queues;
        for q in &mut queues {
            q.queue.set_event_idx(config.event_idx);
        }
        let mut state = WorkerThread {
            control: control.clone(),
            mem: config.mem,
            halted: vec![false; queues.len()],
            queues,
            interrupt: config.interrupt,
            extra: handler.extra_wakers(),
            handler,
        };
        let thread = sandbox::spawn(sandbox::Role::DeviceIo, name.clone(), move || {
            let _guard = ExitGuard(state.control.clone());
            state.run();
            state.queues
        })?;
        Ok(Worker {
            name,
            control,
            thread: Some(thread),
        })
    }

    /// Asks the worker to park without waiting; [`Worker::wait_paused`] waits. Pausing
    /// several workers this way lets them drain in parallel.
    pub fn request_pause(&self) {
        if self.control.command() == Command::Run {
            self.control.send(Command::Pause);
        }
    }

    /// Waits until the worker has parked (its last request completed and signalled).
    pub fn wait_paused(&self) -> Result<(), LifecycleError> {
        if self.control.wait_for(|s| s.parked) {
            return Ok(());
        }
        let why = if self.control.lock().exited {
            "has stopped"
        } else {
            "did not finish its request in time"
        };
        Err(LifecycleError(format!("virtio worker {} {why}", self.name)))
    }

    /// Parks the worker: returns once the device is quiescent.
    pub fn pause(&self) -> Result<(), LifecycleError> {
        self.request_pause();
        self.wait_paused()
    }

    /// Lets a parked worker run again; it re-checks every queue.
    pub fn resume(&self) -> Result<(), LifecycleError> {
        let shared = self.control.lock();
        if shared.exited {
            return Err(LifecycleError(format!(
                "virtio worker {} has stopped",
                self.name
            )));
        }
        let paused = shared.command == Command::Pause;
        drop(shared);
        if paused {
            self.control.send(Command::Run);
        }
        Ok(())
    }

    /// The queue positions as the worker left them when it parked (empty while it runs).
    pub fn queue_states(&self) -> Vec<(u16, QueueState)> {
        let shared = self.control.lock();
        if shared.parked {
            shared.parked_states.clone()
        } else {
            Vec::new()
        }
    }

    /// Finishes the request in hand, ends the thread and returns its queues; an empty list if
    /// the thread does not end within [`QUIESCE_TIMEOUT`] (it is then left behind).
    pub fn stop(mut self) -> Vec<ActiveQueue> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Vec<ActiveQueue> {
        let Some(thread) = self.thread.take() else {
            return Vec::new();
        };
        self.control.send(Command::Stop);
        if !self.control.wait_for(|s| s.exited) {
            log::error!(
                "virtio worker {} did not stop within {:?}; leaving it behind",
                self.name,
                QUIESCE_TIMEOUT
            );
            return Vec::new();
        }
        thread.join().unwrap_or_else(|_| {
            log::error!("virtio worker {} panicked", self.name);
            Vec::new()
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A device's I/O threads and whether the device is paused: what every device's `activate`,
/// `reset`, `pause`, `resume` and `queue_states` share.
#[derive(Default)]
pub struct Workers {
    workers: Vec<Worker>,
    paused: bool,
}

impl Workers {
    /// Between `pause` and `resume`.
    pub fn paused(&self) -> bool {
        self.paused
    }

    /// Starts a thread named `name` serving `queues` with `handler`; parked if the device
    /// is paused. On failure every thread of the set is stopped.
    pub fn spawn<M, H>(
        &mut self,
        name: String,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
        handler: H,
    ) -> Result<(), ActivateError>
    where
        M: GuestMemory + Send + Sync + 'static,
        H: QueueHandler<M>,
    {
        let config = WorkerConfig {
            event_idx: acked_features & 1 << VIRTIO_RING_F_EVENT_IDX != 0,
            start_paused: self.paused,
            name,
            mem,
            queues,
            interrupt,
        };
        let name = config.name.clone();
        match Worker::spawn(config, handler) {
            Ok(worker) => {
                self.workers.push(worker);
                Ok(())
            }
            Err(e) => {
                self.stop();
                Err(ActivateError(format!(
                    "{name}: cannot start its worker: {e}"
                )))
            }
        }
    }

    /// Stops every thread and hands their queues back.
    pub fn stop(&mut self) -> Vec<ActiveQueue> {
        self.workers.drain(..).flat_map(Worker::stop).collect()
    }

    /// Asks every thread to pause, then waits for each (they drain in parallel).
    pub fn pause(&mut self) -> Result<(), LifecycleError> {
        self.paused = true;
        self.workers.iter().for_each(Worker::request_pause);
        self.workers.iter().try_for_each(Worker::wait_paused)
    }

    pub fn resume(&mut self) -> Result<(), LifecycleError> {
        self.paused = false;
        self.workers.iter().try_for_each(Worker::resume)
    }

    /// Every served queue's position; empty before activation.
    pub fn queue_states(&self) -> Option<Vec<(u16, QueueState)>> {
        Some(self.workers.iter().flat_map(Worker::queue_states).collect())
    }
}

/// The worker thread's own state.
struct WorkerThread<M, H> {
    control: Arc<Control>,
    mem: Arc<M>,
    queues: Vec<ActiveQueue>,
    interrupt: Arc<dyn Interrupt>,
    extra: Vec<Arc<Waker>>,
    handler: H,
    /// Queues the driver broke (see [`Interrupt::needs_reset`]): not served until reset.
    halted: Vec<bool>,
}

impl<M, H> WorkerThread<M, H>
where
    M: GuestMemory + Send + Sync + 'static,
    H: QueueHandler<M>,
{
    fn run(&mut self) {
        // A restored queue may hold requests nobody will notify again.
        if self.control.command() == Command::Run {
            self.serve_all();
        }
        loop {
            match self.control.command() {
                Command::Stop => return,
                Command::Pause => {
                    self.park();
                    continue;
                }
                Command::Run => {}
            }
            let ready = match self.wait_events() {
                Ok(ready) => ready,
                Err(e) => {
                    log::error!("virtio worker poll failed, stopping: {e}");
                    return;
                }
            };
            self.dispatch(&ready);
        }
    }

    /// Blocks in poll(2); returns the readiness of [control, queues..., extra...].
    fn wait_events(&mut self) -> io::Result<Vec<bool>> {
        let handler_fds = self.handler.poll_fds();
        let fds: Vec<RawFd> = std::iter::once(self.control.waker.poll_fd())
            .chain(self.queues.iter().map(|q| q.notify.poll_fd()))
            .chain(self.extra.iter().map(|w| w.poll_fd()))
            .chain(handler_fds)
            .collect();
        let own = 1 + self.queues.len() + self.extra.len();
        poll_readable(&fds, own)
    }

    fn dispatch(&mut self, ready: &[bool]) {
        if ready.first() == Some(&true) {
            self.control.waker.drain();
        }
        let queue_count = self.queues.len();
        for slot in 0..queue_count {
            if ready.get(slot + 1) == Some(&true) {
                self.queues[slot].notify.drain();
                self.serve(slot);
            }
        }
        let mut extra_fired = false;
        for (i, waker) in self.extra.iter().enumerate() {
            if ready.get(1 + queue_count + i) == Some(&true) {
                waker.drain();
                extra_fired = true;
            }
        }
        let handler_first = 1 + queue_count + self.extra.len();
        if ready.iter().skip(handler_first).any(|&r| r) {
            self.handler.fds_ready();
            extra_fired = true;
        }
        if extra_fired {
            self.serve_all();
        }
    }

    fn park(&mut self) {
        let states = self
            .queues
            .iter()
            .map(|q| (q.index, q.queue.state()))
            .collect();
        let mut shared = self.control.lock();
        shared.parked_states = states;
        shared.parked = true;
        self.control.changed.notify_all();
        while shared.command == Command::Pause {
            shared = match self.control.changed.wait(shared) {
                Ok(guard) => guard,
                Err(e) => e.into_inner(),
            };
        }
        shared.parked = false;
        let run = shared.command == Command::Run;
        drop(shared);
        if run {
            self.serve_all();
        }
    }

    fn serve_all(&mut self) {
        for slot in 0..self.queues.len() {
            self.serve(slot);
        }
    }

    /// Serves queue `slot` until it is empty, the handler cannot go on, or a command asks
    /// the worker to yield; signals the driver for what it completed.
    fn serve(&mut self, slot: usize) {
        if self.halted.get(slot).copied().unwrap_or(true) {
            return;
        }
        let mem = self.mem.clone();
        let mem: &M = &mem;
        let mut pending_signal = 0u32;
        let mut idle_passes = 0;
        let mut starved_passes = 0u32;
        loop {
            let queue = &mut self.queues[slot].queue;
            if let Err(e) = queue.disable_notification(mem) {
                log::warn!("virtio queue: cannot disable notifications: {e}");
            }
            let (served, starved) = self.serve_available(slot, mem, &mut pending_signal);
            if self.control.yield_now.load(Ordering::SeqCst) {
                break;
            }
            let index = self.queues[slot].index;
            if self.handler.notifications_off(index) {
                break;
            }
            if let Some(seen_end) = starved {
                // Each pass that finds more chains looks at one more at least, and a ring
                // holds `size` of them: a driver that juggles its index cannot keep us here.
                starved_passes += 1;
                let limit = u32::from(self.queues[slot].queue.size()) + 2;
                if self.await_more_chains(slot, mem, seen_end) && starved_passes <= limit {
                    continue;
                }
                break;
            }
            let queue = &mut self.queues[slot].queue;
            let more = queue.enable_notification(mem).unwrap_or(false);
            // `more` after a pass that served nothing is the normal race with a driver that
            // published a chain while notifications were off (it saw NO_NOTIFY, so it will not
            // notify): one more pass serves it. A second idle pass means the chains cannot be
            // served now (the ring is unreadable), and looping on would spin; a handler not
            // ready for the chains waits for its input instead.
            idle_passes = if served == 0 { idle_passes + 1 } else { 0 };
            if !more || idle_passes >= 2 || (served == 0 && !self.handler.ready(index)) {
                break;
            }
        }
        self.signal(slot, mem, &mut pending_signal);
    }

    /// Handles chains until none is left or the queue is halted; returns how many requests
    /// it handled, and for a request left waiting for more chains than the driver made
    /// available, the available index the handler looked up to.
    fn serve_available(&mut self, slot: usize, mem: &M, pending: &mut u32) -> (u32, Option<u16>) {
        let mut served = 0;
        // Halted here or before: the chains behind the broken entry stay unserved.
        while !self.control.yield_now.load(Ordering::SeqCst) && !self.halted[slot] {
            let index = self.queues[slot].index;
            if !self.handler.ready(index) {
                break;
            }
            if self.handler.multi_chain(index) {
                match self.serve_multi(slot, mem) {
                    Multi::Served(entries) => {
                        served += 1;
                        *pending += entries;
                        if *pending >= SIGNAL_BATCH {
                            self.signal(slot, mem, pending);
                        }
                        continue;
                    }
                    Multi::Starved(seen_end) => return (served, Some(seen_end)),
                    Multi::Stop => break,
                }
            }
            let chain = match self.queues[slot].queue.iter(mem) {
                Ok(mut available) => available.next(),
                Err(virtio_queue::Error::InvalidAvailRingIndex) => {
                    // More chains than the queue holds: the driver lost track of the ring.
                    self.halt(slot, "the available index is more than a queue ahead");
                    break;
                }
                Err(e) => {
                    // A ring virtio-queue will not serve (at guest address 0); the guest's doing,
                    // so not worth more than a debug line on every notification.
                    log::debug!("virtio queue {index}: cannot read the available ring: {e}");
                    None
                }
            };
            let Some(chain) = chain else {
                break;
            };
            let head = chain.head_index();
            if head >= self.queues[slot].queue.size() {
                // No used entry can name this chain: the ring is beyond repair.
                self.halt(slot, &format!("available head {head} is beyond the queue"));
                break;
            }
            let len = self.handler.handle(mem, index, chain);
            if let Err(e) = self.queues[slot].queue.add_used(mem, head, len) {
                log::error!("virtio queue {index}: cannot add used entry: {e}");
            }
            served += 1;
            *pending += 1;
            if *pending >= SIGNAL_BATCH {
                self.signal(slot, mem, pending);
            }
        }
        (served, None)
    }

    /// Serves one request over as many chains as the handler takes; see
    /// [`QueueHandler::handle_chains`]. Chains it did not use go back to the ring.
    fn serve_multi(&mut self, slot: usize, mem: &M) -> Multi {
        let index = self.queues[slot].index;
        let queue = &mut self.queues[slot].queue;
        let start = Wrapping(queue.next_avail());
        let size = queue.size();
        let mut bad_head = None;
        let mut seen = Wrapping(0u16);
        let outcome = match queue.iter(mem) {
            Ok(available) => {
                let mut chains = available.map_while(|chain| {
                    let head = chain.head_index();
                    if head >= size {
                        bad_head = Some(head);
                        return None;
                    }
                    seen += Wrapping(1);
                    Some(chain)
                });
                self.handler.handle_chains(mem, index, size, &mut chains)
            }
            Err(virtio_queue::Error::InvalidAvailRingIndex) => {
                self.halt(slot, "the available index is more than a queue ahead");
                return Multi::Stop;
            }
            Err(e) => {
                log::debug!("virtio queue {index}: cannot read the available ring: {e}");
                return Multi::Stop;
            }
        };
        let queue = &mut self.queues[slot].queue;
        let taken = outcome.as_ref().map_or(0, Vec::len);
        queue.set_next_avail((start + Wrapping(taken as u16)).0);
        if let Some(entries) = outcome.as_ref().filter(|e| !e.is_empty()) {
            if let Err(e) = publish_together(queue, mem, entries) {
                log::error!("virtio queue {index}: cannot add used entries: {e}");
            }
        }
        if let Some(head) = bad_head {
            self.halt(slot, &format!("available head {head} is beyond the queue"));
            return Multi::Stop;
        }
        match outcome {
            Some(entries) if !entries.is_empty() => Multi::Served(entries.len() as u32),
            Some(_) => Multi::Stop,
            None => Multi::Starved((start + seen).0),
        }
    }

    /// A request waits for more chains than the driver has made available (up to
    /// `seen_end`): asks the driver to notify when it adds one. With EVENT_IDX that means
    /// avail_event at `seen_end`, not at next_avail, which the waiting request's chains sit
    /// behind (a driver already past it would never notify). True if chains arrived
    /// meanwhile, so the caller looks again.
    fn await_more_chains(&mut self, slot: usize, mem: &M, seen_end: u16) -> bool {
        let queue = &mut self.queues[slot].queue;
        if let Err(e) = queue.enable_notification(mem) {
            log::warn!("virtio queue: cannot enable notifications: {e}");
        }
        if queue.event_idx_enabled() {
            let offset = USED_RING_HEADER + USED_ELEMENT * u64::from(queue.size());
            let stored = GuestAddress(queue.used_ring())
                .checked_add(offset)
                .map(|addr| mem.store(u16::to_le(seen_end), addr, Ordering::Relaxed));
            if !matches!(stored, Some(Ok(()))) {
                log::debug!("virtio queue: cannot write avail_event");
            }
        }
        fence(Ordering::SeqCst);
        queue
            .avail_idx(mem, Ordering::Acquire)
            .is_ok_and(|idx| idx.0 != seen_end)
    }

    /// The driver broke queue `slot` beyond repair: stop serving it until the device is
    /// reset, and tell the driver (DEVICE_NEEDS_RESET).
    fn halt(&mut self, slot: usize, why: &str) {
        log::error!("virtio queue {}: {why}; halted", self.queues[slot].index);
        self.halted[slot] = true;
        self.interrupt.needs_reset();
    }

    fn signal(&mut self, slot: usize, mem: &M, pending: &mut u32) {
        if *pending == 0 {
            return;
        }
        let added = std::mem::take(pending);
        let queue = &mut self.queues[slot];
        if needs_notification(&mut queue.queue, mem, added) {
            self.interrupt.signal_queue(queue.index);
        }
    }
}

/// What [`WorkerThread::serve_multi`] did.
enum Multi {
    /// One request, this many used entries published.
    Served(u32),
    /// The request waits for more chains; the available index the handler looked up to.
    Starved(u16),
    /// Nothing to do now (no request, or the queue is unreadable or halted).
    Stop,
}

/// Split ring layout (virtio 1.x, 2.7): flags and idx, then the elements.
const USED_RING_HEADER: u64 = 4;
const USED_ELEMENT: u64 = 8;
const AVAIL_RING_HEADER: u64 = 4;
const AVAIL_ELEMENT: u64 = 2;

/// Writes `entries` into the used ring at next_used onwards, then moves the used index once
/// (Release, after the entries): the driver sees all of them or none. virtio-queue's
/// `add_used` publishes the index after every entry, which would expose part of a frame
/// spread over several buffers.
fn publish_together<M: GuestMemory>(
    queue: &mut Queue,
    mem: &M,
    entries: &[(u16, u32)],
) -> Result<(), virtio_queue::Error> {
    use virtio_queue::Error;
    let size = queue.size();
    if size == 0 {
        return Err(Error::InvalidSize);
    }
    let used_ring = GuestAddress(queue.used_ring());
    let mut next = Wrapping(queue.next_used());
    for &(head, len) in entries {
        let offset = USED_RING_HEADER + u64::from(next.0 % size) * USED_ELEMENT;
        let addr = used_ring
            .checked_add(offset)
            .ok_or(Error::AddressOverflow)?;
        let element = [u32::from(head).to_le(), len.to_le()];
        mem.write_obj(element, addr).map_err(Error::GuestMemory)?;
        next += Wrapping(1);
    }
    let idx_addr = used_ring.checked_add(2).ok_or(Error::AddressOverflow)?;
    mem.store(u16::to_le(next.0), idx_addr, Ordering::Release)
        .map_err(Error::GuestMemory)?;
    queue.set_next_used(next.0);
    Ok(())
}

/// Whether the driver wants an interrupt for the `added` used entries since the last
/// check. virtio-queue's `needs_notification` counts only the entries of `add_used`, not
/// those [`publish_together`] wrote, so with EVENT_IDX the window is computed here (the
/// same test: used_event within the entries just added).
fn needs_notification<M: GuestMemory>(queue: &mut Queue, mem: &M, added: u32) -> bool {
    // Also resets virtio-queue's own count; it fences the used ring writes.
    let theirs = queue.needs_notification(mem).unwrap_or(true);
    if !queue.event_idx_enabled() {
        return theirs;
    }
    let offset = AVAIL_RING_HEADER + AVAIL_ELEMENT * u64::from(queue.size());
    let used_event = GuestAddress(queue.avail_ring())
        .checked_add(offset)
        .and_then(|addr| mem.load::<u16>(addr, Ordering::Relaxed).ok());
    let Some(used_event) = used_event.map(u16::from_le) else {
        return true;
    };
    let next_used = Wrapping(queue.next_used());
    u32::from((next_used - Wrapping(used_event) - Wrapping(1)).0) < added
}

/// poll(2) on `fds` for readability, without timeout; retries on EINTR. An error on one
/// of the first `own` descriptors (the worker's wakers) is fatal; one on a handler's
/// descriptor counts as readiness, and the handler finds the error when it reads.
fn poll_readable(fds: &[RawFd], own: usize) -> io::Result<Vec<bool>> {
    let mut pollfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `pollfds` is a valid array of `pollfds.len()` entries that outlives the call.
        let rc = unsafe { libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, -1) };
        if rc >= 0 {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    let bad = libc::POLLERR | libc::POLLNVAL;
    if let Some(p) = pollfds.iter().take(own).find(|p| p.revents & bad != 0) {
        return Err(io::Error::other(format!(
            "descriptor {} is invalid or in error",
            p.fd
        )));
    }
    Ok(pollfds
        .iter()
        .map(|p| p.revents & (libc::POLLIN | libc::POLLHUP | bad) != 0)
        .collect())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::mpsc;

    use vm_memory::GuestMemoryMmap;

    use super::*;
    use crate::test_driver::{Buf, TestDriver};

    /// Records what it handles; optionally blocks each request until released.
    #[derive(Clone)]
    struct Probe {
        handled: Arc<Mutex<Vec<(u16, u16)>>>,
        ready_calls: Arc<AtomicU32>,
        open: Arc<AtomicBool>,
        /// ready() calls still to answer "not ready" before `open` decides.
        refusals: Arc<AtomicU32>,
        gate: Option<Arc<Mutex<mpsc::Receiver<()>>>>,
        started: Option<mpsc::SyncSender<()>>,
        extra: Vec<Arc<Waker>>,
        /// Handed out once by `poll_fds`.
        own_fd: Arc<Mutex<Option<RawFd>>>,
    }

    impl Probe {
        fn new() -> Probe {
            Probe {
                handled: Arc::default(),
                ready_calls: Arc::default(),
                open: Arc::new(AtomicBool::new(true)),
                refusals: Arc::default(),
                gate: None,
                started: None,
                extra: Vec::new(),
                own_fd: Arc::default(),
            }
        }
        fn handled(&self) -> Vec<(u16, u16)> {
            self.handled.lock().unwrap().clone()
        }
    }

    impl QueueHandler<GuestMemoryMmap> for Probe {
        fn handle(
            &mut self,
            _: &GuestMemoryMmap,
            q: u16,
            chain: DescriptorChain<&GuestMemoryMmap>,
        ) -> u32 {
            if let Some(started) = &self.started {
                started.send(()).unwrap();
            }
            if let Some(gate) = &self.gate {
                gate.lock().unwrap().recv().unwrap();
            }
            self.handled.lock().unwrap().push((q, chain.head_index()));
            7
        }
        fn ready(&mut self, _: u16) -> bool {
            self.ready_calls.fetch_add(1, Ordering::SeqCst);
            let refused = self
                .refusals
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            !refused && self.open.load(Ordering::SeqCst)
        }
        fn extra_wakers(&self) -> Vec<Arc<Waker>> {
            self.extra.clone()
        }
        fn poll_fds(&mut self) -> Vec<RawFd> {
            self.own_fd.lock().unwrap().take().into_iter().collect()
        }
    }

    fn spawn(driver: &TestDriver, probe: &Probe, start_paused: bool) -> Worker {
        let config = WorkerConfig {
            name: "test-worker".into(),
            mem: driver.mem.clone(),
            queues: driver.active_queues(),
            interrupt: driver.interrupt(),
            event_idx: false,
            start_paused,
        };
        Worker::spawn(config, probe.clone()).unwrap()
    }

    fn one_buffer_chain(driver: &mut TestDriver, q: usize) -> u16 {
        let buf = driver.alloc(64);
        driver.add_chain(q, &[Buf::w(buf, 64)])
    }

    #[test]
    fn serves_every_queue_and_signals() {
        let mut driver = TestDriver::new(&[16, 16]);
        let probe = Probe::new();
        let worker = spawn(&driver, &probe, false);
        let a = one_buffer_chain(&mut driver, 0);
        let b = one_buffer_chain(&mut driver, 1);
        driver.kick(0);
        driver.kick(1);
        assert_eq!(driver.wait_used(0, 1), vec![(u32::from(a), 7)]);
        assert_eq!(driver.wait_used(1, 1), vec![(u32::from(b), 7)]);
        driver.interrupt.wait_count(0, 1);
        driver.interrupt.wait_count(1, 1);
        let queues = worker.stop();
        assert_eq!(queues.len(), 2);
        assert_eq!(queues[0].queue.next_avail(), 1);
        assert_eq!(queues[1].queue.next_used(), 1);
    }

    #[test]
    fn pause_waits_for_the_request_in_hand_then_resume_serves_the_rest() {
        let mut driver = TestDriver::new(&[16]);
        let mut probe = Probe::new();
        let (release, gate) = mpsc::channel();
        let (started_tx, started) = mpsc::sync_channel(16);
        probe.gate = Some(Arc::new(Mutex::new(gate)));
        probe.started = Some(started_tx);
        let worker = Arc::new(spawn(&driver, &probe, false));
        one_buffer_chain(&mut driver, 0);
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        started.recv_timeout(Duration::from_secs(5)).unwrap();

        let pauser = {
            let worker = worker.clone();
            std::thread::spawn(move || worker.pause())
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !pauser.is_finished(),
            "pause returned with a request in flight"
        );
        release.send(()).unwrap();
        pauser.join().unwrap().unwrap();
        // The request in hand completed; the second stays in the ring.
        assert_eq!(driver.wait_used(0, 1).len(), 1);
        let states = worker.queue_states();
        assert_eq!(states.len(), 1);
        assert_eq!((states[0].1.next_avail, states[0].1.next_used), (1, 1));

        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        driver.assert_no_used(0, Duration::from_millis(50));
        release.send(()).unwrap();
        release.send(()).unwrap();
        worker.resume().unwrap();
        assert_eq!(driver.wait_used(0, 2).len(), 2);
        assert_eq!(probe.handled().len(), 3);
    }

    #[test]
    fn nothing_behind_a_head_beyond_the_queue_is_served() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        let _worker = spawn(&driver, &probe, false);
        let good = one_buffer_chain(&mut driver, 0);
        driver.publish(0, 16);
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        assert_eq!(driver.wait_used(0, 1), vec![(u32::from(good), 7)]);
        driver.assert_no_used(0, Duration::from_millis(50));
        assert!(
            driver.interrupt.broken.load(Ordering::SeqCst),
            "no DEVICE_NEEDS_RESET"
        );
        assert_eq!(probe.handled().len(), 1);
    }

    #[test]
    fn started_paused_serves_nothing_until_resumed() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        one_buffer_chain(&mut driver, 0);
        let worker = spawn(&driver, &probe, true);
        worker.wait_paused().unwrap();
        driver.kick(0);
        driver.assert_no_used(0, Duration::from_millis(50));
        worker.resume().unwrap();
        assert_eq!(driver.wait_used(0, 1).len(), 1);
    }

    #[test]
    fn a_bogus_available_index_halts_the_queue_without_spinning() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        let worker = spawn(&driver, &probe, false);
        driver.set_avail_idx(0, 1000);
        driver.kick(0);
        std::thread::sleep(Duration::from_millis(100));
        let calls = probe.ready_calls.load(Ordering::SeqCst);
        assert!(calls < 10, "worker spun: {calls} attempts");
        assert_eq!(driver.used_idx(0), 0);
        assert!(
            driver.interrupt.broken.load(Ordering::SeqCst),
            "no DEVICE_NEEDS_RESET"
        );
        // Halted: an honest index afterwards is not served until the device is reset.
        driver.set_avail_idx(0, 0);
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        driver.assert_no_used(0, Duration::from_millis(30));
        // It still obeys control requests.
        worker.pause().unwrap();
        assert_eq!(worker.stop().len(), 1);
    }

    #[test]
    fn an_extra_waker_rechecks_queues_the_handler_was_not_ready_for() {
        let mut driver = TestDriver::new(&[16]);
        let mut probe = Probe::new();
        let input = Arc::new(Waker::new().unwrap());
        probe.extra = vec![input.clone()];
        probe.open.store(false, Ordering::SeqCst);
        let _worker = spawn(&driver, &probe, false);
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        driver.assert_no_used(0, Duration::from_millis(50));
        probe.open.store(true, Ordering::SeqCst);
        input.wake().unwrap();
        assert_eq!(driver.wait_used(0, 1).len(), 1);
    }

    /// A pass that served nothing, followed by chains the driver published while
    /// notifications were off (so it did not notify): the worker looks once more and serves
    /// them. The refused ready() stands in for the chain arriving just after the pass looked.
    #[test]
    fn chains_published_during_an_idle_pass_are_served_without_a_notification() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        probe.refusals.store(1, Ordering::SeqCst);
        let head = one_buffer_chain(&mut driver, 0);
        let _worker = spawn(&driver, &probe, false);
        assert_eq!(driver.wait_used(0, 1), vec![(u32::from(head), 7)]);
    }

    #[test]
    fn an_error_on_a_handler_descriptor_is_not_fatal() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        // A pipe whose read end is closed: poll reports POLLERR on the write end.
        let mut ends = [0; 2];
        // SAFETY: `ends` has room for the two descriptors pipe(2) returns.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        // SAFETY: the read end is ours and not used again.
        unsafe { libc::close(ends[0]) };
        *probe.own_fd.lock().unwrap() = Some(ends[1]);
        let _worker = spawn(&driver, &probe, false);
        // Past its first look at the queues and into poll(2).
        std::thread::sleep(Duration::from_millis(50));
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        assert_eq!(driver.wait_used(0, 1).len(), 1, "the worker stopped");
        // SAFETY: the write end is ours; the worker no longer polls it.
        unsafe { libc::close(ends[1]) };
    }

    #[test]
    fn stop_while_paused_returns_the_queues() {
        let mut driver = TestDriver::new(&[16]);
        let probe = Probe::new();
        let worker = spawn(&driver, &probe, false);
        one_buffer_chain(&mut driver, 0);
        driver.kick(0);
        driver.wait_used(0, 1);
        worker.pause().unwrap();
        let queues = worker.stop();
        assert_eq!(queues[0].queue.next_used(), 1);
    }
}
