//! virtio-rng (entropy device, type 4): one queue whose device-writable buffers are filled
//! from the host's getrandom(2), at most [`MAX_BYTES_PER_REQUEST`] per chain.

use std::io::{self, Write};
use std::sync::Arc;

use devices::{DeviceState, LifecycleError, StateError};
use serde::{Deserialize, Serialize};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::DescriptorChain;
use vm_memory::GuestMemory;

use crate::worker::{QueueHandler, Workers};
use crate::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most random bytes one chain gets, however large its buffers: a guest cannot make the
/// device spend unbounded time (or host entropy) on one request.
pub const MAX_BYTES_PER_REQUEST: usize = 64 << 10;
const STATE_VERSION: u32 = 1;

/// Features shared by the simple devices: virtio 1.x, indirect descriptors, event index.
pub(crate) const COMMON_FEATURES: u64 =
    1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_INDIRECT_DESC | 1 << VIRTIO_RING_F_EVENT_IDX;

/// Nothing to save but the fact that the device exists.
#[derive(Serialize, Deserialize)]
struct RngState {}

/// A virtio-rng device.
#[derive(Default)]
pub struct Rng {
    workers: Workers,
}

impl Rng {
    pub fn new() -> Rng {
        Rng::default()
    }
}

/// Fills `buf` from the kernel's random source.
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "freebsd"))]
    {
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`.
            let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
                continue;
            }
            done += n as usize;
        }
        Ok(())
    }
    #[cfg(not(any(target_os = "linux", target_os = "freebsd")))]
    {
        use std::io::Read;
        std::fs::File::open("/dev/urandom")?.read_exact(buf)
    }
}

struct RngHandler {
    scratch: Vec<u8>,
}

impl<M: GuestMemory> QueueHandler<M> for RngHandler {
    fn handle(&mut self, mem: &M, _queue: u16, chain: DescriptorChain<&M>) -> u32 {
        // A chain with a buffer outside guest RAM gets nothing.
        let Ok(mut writer) = chain.writer(mem) else {
            return 0;
        };
        let n = writer.available_bytes().min(MAX_BYTES_PER_REQUEST);
        self.scratch.resize(n, 0);
        if let Err(e) = fill_random(&mut self.scratch) {
            log::error!("virtio-rng: getrandom failed: {e}");
            return 0;
        }
        if writer.write_all(&self.scratch).is_err() {
            return writer.bytes_written() as u32;
        }
        n as u32
    }
}

impl<M: GuestMemory + Send + Sync + 'static> VirtioDevice<M> for Rng {
    fn device_type(&self) -> u32 {
        device_type::RNG
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        COMMON_FEATURES
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // virtio-rng has no configuration space.
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: Arc<M>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        if queues.len() != 1 {
            return Err(ActivateError(format!(
                "virtio-rng: {} queues ready, expected 1",
                queues.len()
            )));
        }
        self.workers.stop();
        let handler = RngHandler {
            scratch: Vec::new(),
        };
        self.workers.spawn(
            "virtio-rng".into(),
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
        DeviceState::new(STATE_VERSION, &RngState {})
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        state
            .parse::<RngState>("virtio-rng", STATE_VERSION)
            .map(drop)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use vm_memory::{Address, GuestMemoryMmap};

    use super::*;
    use crate::test_driver::{Buf, TestDriver, RAM_SIZE};

    fn activated(driver: &TestDriver) -> Rng {
        let mut rng = Rng::new();
        let features = VirtioDevice::<GuestMemoryMmap>::features(&rng);
        rng.activate(
            driver.mem.clone(),
            features,
            driver.active_queues(),
            driver.interrupt(),
        )
        .unwrap();
        rng
    }

    #[test]
    fn fills_buffers_with_varying_bytes() {
        let mut driver = TestDriver::new(&[QUEUE_SIZE]);
        let _rng = activated(&driver);
        let (a, b) = (driver.alloc(1024), driver.alloc(1024));
        // Two buffers in one chain, a second chain.
        driver.add_chain(0, &[Buf::w(a, 512), Buf::w(a.unchecked_add(512), 512)]);
        driver.add_chain(0, &[Buf::w(b, 1024)]);
        driver.kick(0);
        let used = driver.wait_used(0, 2);
        assert_eq!(used.iter().map(|u| u.1).collect::<Vec<_>>(), [1024, 1024]);
        let (x, y) = (driver.read(a, 1024), driver.read(b, 1024));
        assert_ne!(x, y);
        for bytes in [&x, &y] {
            let distinct = bytes.iter().collect::<std::collections::HashSet<_>>().len();
            assert!(distinct > 128, "only {distinct} distinct byte values");
        }
        driver.interrupt.wait_count(0, 1);
    }

    #[test]
    fn bounds_requests_and_skips_bad_chains() {
        let mut driver = TestDriver::new(&[QUEUE_SIZE]);
        let _rng = activated(&driver);
        let big = driver.alloc(1 << 20);
        driver.add_chain(0, &[Buf::w(big, 1 << 20)]);
        let readable = driver.alloc(64);
        driver.add_chain(0, &[Buf::r(readable, 64)]);
        let outside = vm_memory::GuestAddress(RAM_SIZE + 4096);
        driver.add_chain(0, &[Buf::w(readable, 64), Buf::w(outside, 64)]);
        driver.kick(0);
        let used = driver.wait_used(0, 3);
        assert_eq!(used.iter().map(|u| u.1).collect::<Vec<_>>(), [65536, 0, 0]);
        let tail = driver.read(big.unchecked_add(65536), 4096);
        assert!(tail.iter().all(|&b| b == 0), "wrote past the bound");
    }
}

/// virtio-rng as a device kind (`--rng`). Nothing to configure.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngConfig {}

impl<M: GuestMemory + Send + Sync + 'static> crate::kind::DeviceKind<M> for RngConfig {
    const SYNTAX: &'static str = "";
    const HELP: &'static str = "Add a virtio-rng device fed by the host's getrandom";
    const SHAPE: crate::kind::OptionShape = crate::kind::OptionShape::Flag;
    const SANDBOX: &'static str = "getrandom";

    fn parse(_text: &str) -> Result<Option<Self>, String> {
        Ok(Some(RngConfig {}))
    }

    fn label(&self) -> String {
        "virtio-rng".into()
    }

    fn create(
        &self,
        _ctx: &crate::kind::BuildContext<M>,
    ) -> Result<Box<dyn VirtioDevice<M>>, String> {
        Ok(Box::new(Rng::new()))
    }

    fn guest_difference(&self, _recorded: &Self) -> Option<String> {
        None
    }
}
