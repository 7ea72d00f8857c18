//! The vhost-net programming checked against a recording fake of the kernel's calls.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use vhost::net::VhostNet as VhostNetOps;
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionBase};
use virtio_bindings::bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ};
use vm_memory::{Bytes, GuestMemoryMmap};

use super::*;
use crate::net::{Net, NetOptions};
use crate::test_driver::TestDriver;
use crate::VirtioDevice;

/// One kernel call as the fake saw it: (instance, ring) where it applies.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Owner(usize),
    GetFeatures(usize),
    Features(usize, u64),
    /// (guest address, size, host address) of each region.
    MemTable(usize, Vec<(u64, u64, u64)>),
    Num(usize, usize, u16),
    /// Descriptor table, available ring, used ring (guest addresses).
    Addr(usize, usize, [u64; 3]),
    Base(usize, usize, u16),
    GetBase(usize, usize),
    Kick(usize, usize),
    Irqfd(usize, usize),
    /// The backend's (device, inode), or None when detached.
    Backend(usize, usize, Option<(u64, u64)>),
}

#[derive(Default)]
struct Record {
    calls: Vec<Call>,
    /// The eventfds last given as kick and call, per (instance, ring).
    kicks: RingFds,
    callfds: RingFds,
    /// What GET_VRING_BASE answers, per (instance, ring).
    bases: HashMap<(usize, usize), u32>,
}

/// A vhost-net instance that records what it is told.
struct Fake {
    id: usize,
    features: u64,
    record: Arc<Mutex<Record>>,
}

type RingFds = HashMap<(usize, usize), EventFd>;

impl Fake {
    fn log(&self, call: Call) {
        self.record.lock().unwrap().calls.push(call);
    }

    /// Keeps a copy of the eventfd given for `ring` in the record's table `table`.
    fn keep(&self, ring: usize, fd: &EventFd, table: fn(&mut Record) -> &mut RingFds) {
        let copy = fd.try_clone().unwrap();
        table(&mut self.record.lock().unwrap()).insert((self.id, ring), copy);
    }
}

fn identity(fd: RawFd) -> (u64, u64) {
    // SAFETY: fstat writes into the zeroed struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the call; `st` is valid for writes.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    (st.st_dev, st.st_ino)
}

impl VhostBackend for Fake {
    fn get_features(&self) -> vhost::Result<u64> {
        self.log(Call::GetFeatures(self.id));
        Ok(self.features)
    }
    fn set_features(&self, features: u64) -> vhost::Result<()> {
        self.log(Call::Features(self.id, features));
        Ok(())
    }
    fn set_owner(&self) -> vhost::Result<()> {
        self.log(Call::Owner(self.id));
        Ok(())
    }
    fn reset_owner(&self) -> vhost::Result<()> {
        unimplemented!("the device never resets the owner")
    }
    fn set_mem_table(
        &self,
        regions: &[VhostUserMemoryRegionInfo],
    ) -> vhost::Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        let table = regions
            .iter()
            .map(|r| (r.guest_phys_addr, r.memory_size, r.userspace_addr))
            .collect();
        self.log(Call::MemTable(self.id, table));
        Ok(None)
    }
    fn set_log_base(&self, _: u64, _: Option<VhostUserDirtyLogRegion>) -> vhost::Result<()> {
        unimplemented!("no dirty logging")
    }
    fn set_log_fd(&self, _: RawFd) -> vhost::Result<()> {
        unimplemented!("no dirty logging")
    }
    fn set_vring_num(&self, ring: usize, num: u16) -> vhost::Result<()> {
        self.log(Call::Num(self.id, ring, num));
        Ok(())
    }
    fn set_vring_addr(&self, ring: usize, config: &VringConfigData) -> vhost::Result<()> {
        let addrs = [
            config.desc_table_addr,
            config.avail_ring_addr,
            config.used_ring_addr,
        ];
        self.log(Call::Addr(self.id, ring, addrs));
        Ok(())
    }
    fn set_vring_base(&self, ring: usize, base: u16) -> vhost::Result<()> {
        self.log(Call::Base(self.id, ring, base));
        Ok(())
    }
    fn get_vring_base(&self, ring: usize) -> vhost::Result<u32> {
        self.log(Call::GetBase(self.id, ring));
        let record = self.record.lock().unwrap();
        Ok(record.bases.get(&(self.id, ring)).copied().unwrap_or(0))
    }
    fn set_vring_call(&self, ring: usize, fd: &EventFd) -> vhost::Result<()> {
        self.log(Call::Irqfd(self.id, ring));
        self.keep(ring, fd, |r| &mut r.callfds);
        Ok(())
    }
    fn set_vring_kick(&self, ring: usize, fd: &EventFd) -> vhost::Result<()> {
        self.log(Call::Kick(self.id, ring));
        self.keep(ring, fd, |r| &mut r.kicks);
        Ok(())
    }
    fn set_vring_err(&self, _: usize, _: &EventFd) -> vhost::Result<()> {
        unimplemented!("no error eventfd")
    }
}

impl VhostNetOps for Fake {
    fn set_backend(&self, ring: usize, fd: Option<&File>) -> vhost::Result<()> {
        let id = fd.map(|f| identity(f.as_raw_fd()));
        self.log(Call::Backend(self.id, ring, id));
        Ok(())
    }
}

/// What vhost offers in these tests: no indirect descriptors.
const KERNEL_FEATURES: u64 =
    1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX | 1 << VIRTIO_NET_F_MRG_RXBUF | 1 << 27; // VHOST_NET_F_VIRTIO_NET_HDR: the device never asks for it

struct Setup {
    vhost: VhostNet<Fake>,
    record: Arc<Mutex<Record>>,
    taps: Vec<(u64, u64)>,
    _tap_files: Vec<tempfile_like::TempFile>,
}

/// Anonymous files standing in for tap queues (distinct inodes).
mod tempfile_like {
    pub struct TempFile(pub std::fs::File);
    pub fn new() -> TempFile {
        let name = std::ffi::CString::new("tap-stand-in").unwrap();
        // SAFETY: memfd_create takes a valid C string and flags; it returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a new descriptor we own.
        TempFile(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }
}

fn setup(pairs: usize, regions: Vec<VhostUserMemoryRegionInfo>) -> Setup {
    let record = Arc::new(Mutex::new(Record::default()));
    let backends = (0..pairs)
        .map(|id| Fake {
            id,
            features: KERNEL_FEATURES,
            record: record.clone(),
        })
        .collect();
    let files: Vec<_> = (0..pairs).map(|_| tempfile_like::new()).collect();
    let taps = files.iter().map(|f| identity(f.0.as_raw_fd())).collect();
    let clones = files.iter().map(|f| f.0.try_clone().unwrap()).collect();
    let vhost = VhostNet::new(backends, clones, regions).unwrap();
    Setup {
        vhost,
        record,
        taps,
        _tap_files: files,
    }
}

fn take_calls(record: &Arc<Mutex<Record>>) -> Vec<Call> {
    std::mem::take(&mut record.lock().unwrap().calls)
}

/// One eventfd per queue standing for its MSI-X vector's irqfd, and the duplicates the
/// transport would hand over.
/// Starts `s` with only VERSION_1 acked on `queues` of `driver`, each with a fresh irqfd
/// (their other ends are returned, to keep open); `paused` as for `start`.
fn start_v1(
    s: &mut Setup,
    driver: &TestDriver,
    queues: Vec<ActiveQueue>,
    paused: bool,
) -> (Vec<EventFd>, Result<(), ActivateError>) {
    let (events, calls) = irqfds(queues.len());
    let reader = used_index_reader(driver.mem.clone());
    let started = s
        .vhost
        .start(1 << VIRTIO_F_VERSION_1, queues, calls, reader, paused);
    (events, started)
}

fn irqfds(n: usize) -> (Vec<EventFd>, Vec<OwnedFd>) {
    let events: Vec<EventFd> = (0..n)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let dups = events
        .iter()
        .map(|e| {
            // SAFETY: the eventfd is open while `events` lives.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(e.as_raw_fd()) };
            fd.try_clone_to_owned().unwrap()
        })
        .collect();
    (events, dups)
}

#[test]
fn the_memory_table_holds_every_ram_region_with_its_host_address() {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(0), 2 << 20),
        (GuestAddress(0x1_0000_0000), 1 << 20),
    ])
    .unwrap();
    let regions = memory_regions(&mem);
    let table: Vec<_> = regions
        .iter()
        .map(|r| (r.guest_phys_addr, r.memory_size, r.userspace_addr))
        .collect();
    let host = |at: u64| mem.get_host_address(GuestAddress(at)).unwrap() as u64;
    assert_eq!(
        table,
        vec![
            (0, 2 << 20, host(0)),
            (0x1_0000_0000, 1 << 20, host(0x1_0000_0000)),
        ]
    );
}

#[test]
fn opening_owns_each_instance_and_offers_what_every_one_implements() {
    let s = setup(2, Vec::new());
    assert_eq!(
        take_calls(&s.record),
        vec![
            Call::Owner(0),
            Call::GetFeatures(0),
            Call::Owner(1),
            Call::GetFeatures(1),
        ]
    );
    assert_eq!(
        s.vhost.features(),
        KERNEL_FEATURES & VHOST_FEATURES,
        "only the bits vhost decides on, as far as it implements them"
    );
}

#[test]
fn start_programs_every_ring_then_attaches_the_taps() {
    let driver = TestDriver::new(&[16, 16, 16, 16]);
    let regions = memory_regions(&*driver.mem);
    let table: Vec<_> = regions
        .iter()
        .map(|r| (r.guest_phys_addr, r.memory_size, r.userspace_addr))
        .collect();
    let mut s = setup(2, regions);
    take_calls(&s.record);
    let queues = driver.active_queues();
    let addrs: Vec<[u64; 3]> = queues
        .iter()
        .map(|q| {
            [
                q.queue.desc_table(),
                q.queue.avail_ring(),
                q.queue.used_ring(),
            ]
        })
        .collect();
    let (calls_in, calls_out) = irqfds(4);
    let acked = 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_NET_F_MAC
        | 1 << VIRTIO_NET_F_MRG_RXBUF;
    let reader = used_index_reader(driver.mem.clone());
    s.vhost
        .start(acked, queues, calls_out, reader, false)
        .unwrap();

    let features =
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX | 1 << VIRTIO_NET_F_MRG_RXBUF;
    let mut expected = Vec::new();
    for id in 0..2 {
        expected.push(Call::Features(id, features));
        expected.push(Call::MemTable(id, table.clone()));
    }
    for (q, addr) in addrs.iter().enumerate() {
        let (id, ring) = (q / 2, q % 2);
        expected.extend([
            Call::Num(id, ring, 16),
            Call::Addr(id, ring, *addr),
            Call::Base(id, ring, 0),
            Call::Kick(id, ring),
            Call::Irqfd(id, ring),
        ]);
    }
    for q in 0..4 {
        expected.push(Call::Backend(q / 2, q % 2, Some(s.taps[q / 2])));
    }
    assert_eq!(take_calls(&s.record), expected);

    // The kick is the queue's notifier and the call the queue's irqfd: a write on what the
    // kernel got reaches the device's eventfd.
    let record = s.record.lock().unwrap();
    for (q, call) in calls_in.iter().enumerate() {
        let place = (q / 2, q % 2);
        driver.kick(q);
        assert_eq!(record.kicks[&place].read().unwrap(), 1, "queue {q} kick");
        record.callfds[&place].write(1).unwrap();
        assert_eq!(call.read().unwrap(), 1, "queue {q} call");
    }
}

#[test]
fn pause_detaches_and_reads_the_positions_back_and_resume_rearms() {
    let driver = TestDriver::new(&[16, 16]);
    let mut s = setup(1, memory_regions(&*driver.mem));
    let queues = driver.active_queues();
    let used: Vec<u64> = queues.iter().map(|q| q.queue.used_ring()).collect();
    let (_events, started) = start_v1(&mut s, &driver, queues, false);
    started.unwrap();
    take_calls(&s.record);
    // Where the kernel stands: 5 chains taken from the receive ring, 3 from the transmit
    // one, each with its used entry written.
    s.record
        .lock()
        .unwrap()
        .bases
        .extend([((0, 0), 5), ((0, 1), 3)]);
    driver
        .mem
        .write_obj(5u16.to_le(), GuestAddress(used[0] + 2))
        .unwrap();
    driver
        .mem
        .write_obj(3u16.to_le(), GuestAddress(used[1] + 2))
        .unwrap();

    s.vhost.pause().unwrap();
    assert_eq!(
        take_calls(&s.record),
        vec![
            Call::Backend(0, 0, None),
            Call::Backend(0, 1, None),
            Call::GetBase(0, 0),
            Call::GetBase(0, 1),
        ]
    );
    let states = s.vhost.queue_states();
    let positions: Vec<_> = states
        .iter()
        .map(|(q, st)| (*q, st.next_avail, st.next_used))
        .collect();
    assert_eq!(positions, vec![(0, 5, 5), (1, 3, 3)]);
    s.vhost.pause().unwrap();
    assert!(
        take_calls(&s.record).is_empty(),
        "a second pause does nothing"
    );

    s.vhost.resume().unwrap();
    assert_eq!(
        take_calls(&s.record),
        vec![
            Call::Base(0, 0, 5),
            Call::Base(0, 1, 3),
            Call::Backend(0, 0, Some(s.taps[0])),
            Call::Backend(0, 1, Some(s.taps[0])),
        ]
    );
}

#[test]
fn started_paused_attaches_nothing_until_resumed() {
    let driver = TestDriver::new(&[16, 16]);
    let mut s = setup(1, memory_regions(&*driver.mem));
    let mut queues = driver.active_queues();
    queues[0].queue.set_next_avail(9); // a restored position
    let (_events, started) = start_v1(&mut s, &driver, queues, true);
    started.unwrap();
    let calls = take_calls(&s.record);
    assert!(calls.contains(&Call::Base(0, 0, 9)));
    assert!(!calls.iter().any(|c| matches!(c, Call::Backend(..))));
    s.vhost.resume().unwrap();
    let calls = take_calls(&s.record);
    assert_eq!(calls.last(), Some(&Call::Backend(0, 1, Some(s.taps[0]))));
}

#[test]
fn stop_detaches_the_backends_and_hands_the_queues_back() {
    let driver = TestDriver::new(&[16, 16]);
    let mut s = setup(1, memory_regions(&*driver.mem));
    let (_events, started) = start_v1(&mut s, &driver, driver.active_queues(), false);
    started.unwrap();
    assert!(s.vhost.active());
    take_calls(&s.record);
    s.record.lock().unwrap().bases.insert((0, 1), 4);
    let queues = s.vhost.stop();
    assert_eq!(
        take_calls(&s.record),
        vec![
            Call::Backend(0, 0, None),
            Call::Backend(0, 1, None),
            Call::GetBase(0, 0),
            Call::GetBase(0, 1),
        ]
    );
    let indexes: Vec<_> = queues
        .iter()
        .map(|q| (q.index, q.queue.next_avail()))
        .collect();
    assert_eq!(indexes, vec![(0, 0), (1, 4)]);
    assert!(!s.vhost.active());
    assert!(s.vhost.queue_states().is_empty());
}

#[test]
fn a_ring_outside_the_instances_is_refused() {
    let driver = TestDriver::new(&[16, 16, 16]);
    let mut s = setup(1, memory_regions(&*driver.mem));
    let (_events, started) = start_v1(&mut s, &driver, driver.active_queues(), false);
    let e = started.unwrap_err();
    assert!(e.0.contains("queue 2"), "{e}");
}

/// A device on a fresh tap with the fake kernel path; None where this process may not
/// create taps (not root).
fn device_with_fake(pairs: u16) -> Option<(Net, Arc<Mutex<Record>>)> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "fvh{}x{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let options = NetOptions {
        tap: name,
        mac: [0x52, 0x54, 0, 1, 2, 3],
        queue_pairs: pairs,
        io_threads: pairs,
    };
    let mut net = match Net::new(options) {
        Ok(net) => net,
        Err(e) => {
            eprintln!("no tap for this test ({e}): needs CAP_NET_ADMIN and /dev/net/tun");
            return None;
        }
    };
    let record = Arc::new(Mutex::new(Record::default()));
    let backends = (0..usize::from(pairs))
        .map(|id| Fake {
            id,
            features: KERNEL_FEATURES,
            record: record.clone(),
        })
        .collect();
    let kernel = VhostNet::new(backends, net.tap_files().unwrap(), Vec::new()).unwrap();
    net.use_kernel_path(Box::new(kernel));
    Some((net, record))
}

/// The test driver's interrupt, with an irqfd for every queue (MSI-X on, KVM).
struct IrqfdInterrupt(Vec<EventFd>);

impl Interrupt for IrqfdInterrupt {
    fn signal_queue(&self, _: u16) {}
    fn signal_config(&self) {}
    fn needs_reset(&self) {}
    fn queue_irqfd(&self, queue: u16) -> Option<OwnedFd> {
        let event = self.0.get(usize::from(queue))?;
        // SAFETY: the eventfd is open while `self` lives.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(event.as_raw_fd()) };
        fd.try_clone_to_owned().ok()
    }
}

type Device = dyn VirtioDevice<GuestMemoryMmap>;

#[test]
fn the_device_offers_the_ring_features_only_where_vhost_does() {
    let Some((net, _)) = device_with_fake(1) else {
        return;
    };
    let features = <Net as VirtioDevice<GuestMemoryMmap>>::features(&net);
    assert_eq!(features & 1 << VIRTIO_RING_F_INDIRECT_DESC, 0);
    for bit in [
        VIRTIO_F_VERSION_1,
        VIRTIO_RING_F_EVENT_IDX,
        VIRTIO_NET_F_MRG_RXBUF,
        VIRTIO_NET_F_MAC,
    ] {
        assert_ne!(features & 1 << bit, 0, "feature {bit}");
    }
}

#[test]
fn the_kernel_serves_the_pairs_and_the_control_queue_stays_in_user_space() {
    let Some((mut net, record)) = device_with_fake(1) else {
        return;
    };
    let driver = TestDriver::new(&[16, 16, 16]);
    let (events, _) = irqfds(3);
    let interrupt = Arc::new(IrqfdInterrupt(events));
    let device: &mut Device = &mut net;
    let acked = device.features() & !(1 << VIRTIO_NET_F_MQ);
    device
        .activate(driver.mem.clone(), acked, driver.active_queues(), interrupt)
        .unwrap();
    let calls = take_calls(&record);
    assert!(calls.contains(&Call::Backend(0, 0, Some(tap_identity(&net)))));
    assert!(calls.contains(&Call::Backend(0, 1, Some(tap_identity(&net)))));
    let device: &mut Device = &mut net;
    device.pause().unwrap();
    let mut served: Vec<u16> = device.queue_states().unwrap().iter().map(|s| s.0).collect();
    served.sort();
    assert_eq!(
        served,
        vec![0, 1, 2],
        "the kernel's two rings and the control queue"
    );
    let calls = take_calls(&record);
    assert!(calls.contains(&Call::GetBase(0, 0)) && calls.contains(&Call::GetBase(0, 1)));
    device.resume().unwrap();
    let mut back: Vec<u16> = device.reset().iter().map(|q| q.index).collect();
    back.sort();
    assert_eq!(back, vec![0, 1, 2], "reset hands every queue back");
    assert!(take_calls(&record).contains(&Call::Backend(0, 1, None)));
}

#[test]
fn without_an_irqfd_the_device_serves_the_queues_itself() {
    let Some((mut net, record)) = device_with_fake(1) else {
        return;
    };
    let driver = TestDriver::new(&[16, 16, 16]);
    let device: &mut Device = &mut net;
    let acked = device.features();
    // The test driver's interrupt has no irqfd: the driver left MSI-X off (INTx).
    device
        .activate(
            driver.mem.clone(),
            acked,
            driver.active_queues(),
            driver.interrupt(),
        )
        .unwrap();
    let calls = take_calls(&record);
    assert!(
        !calls
            .iter()
            .any(|c| matches!(c, Call::Backend(..) | Call::Features(..))),
        "{calls:?}"
    );
    assert!(!net.kernel.as_ref().unwrap().active());
    let device: &mut Device = &mut net;
    device.pause().unwrap();
    assert_eq!(
        device.queue_states().unwrap().len(),
        3,
        "all on the device's threads"
    );
    device.resume().unwrap();
    assert_eq!(device.reset().len(), 3);
}

fn tap_identity(net: &Net) -> (u64, u64) {
    identity(net.shared.taps[0].poll_fd())
}

#[test]
fn a_second_start_without_a_reset_detaches_the_old_rings_first() {
    let driver = TestDriver::new(&[16, 16]);
    let mut s = setup(1, memory_regions(&*driver.mem));
    for round in 0..2 {
        let (_events, started) = start_v1(&mut s, &driver, driver.active_queues(), false);
        started.unwrap();
        let calls = take_calls(&s.record);
        let detached = calls.contains(&Call::Backend(0, 0, None));
        assert_eq!(detached, round == 1, "round {round}: {calls:?}");
    }
    assert_eq!(s.vhost.queue_states().len(), 2);
}
