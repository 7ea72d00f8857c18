//! Tests of the PCI transport, driving it as a guest driver would, with a loopback device
//! over real guest memory and virtio-queue's mock driver-side rings.

mod config;
mod lifecycle;
mod negotiation;
mod random;
mod signals;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use devices::exit::Waker;
use devices::irqchip::{IrqChip, IrqPin};
use devices::{DeviceState, Lifecycle, LifecycleError, StateError};
use pci::{MsiMessage, MsiTarget, PciDevice};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{QueueOwnedT, QueueState, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::layout::{self, CommonCfg, CAP_MSIX, COMMON_OFFSET, ISR_OFFSET};
use super::*;
use crate::{ActivateError, ActiveQueue, Interrupt, VirtioDevice};

pub type Mem = GuestMemoryMmap<()>;

/// The loopback device's two queues.
pub const QUEUE_MAX: [u16; 2] = [16, 8];
/// Device feature bit 0, and VERSION_1.
pub const DEVICE_FEATURES: u64 = 1 | (1 << 32);
pub const VERSION_1: u64 = 1 << 32;
pub const EVENT_IDX: u64 = 1 << 29;
pub const INTX_GSI: u32 = 17;

/// What the loopback device went through, shared with the test.
#[derive(Default)]
pub struct DeviceLog {
    pub calls: Vec<&'static str>,
    pub features: u64,
    pub queues: Vec<ActiveQueue>,
    pub interrupt: Option<Arc<dyn Interrupt>>,
    pub mem: Option<Arc<Mem>>,
    pub config: [u8; 8],
    pub restored: Option<DeviceState>,
    pub refuse_activate: bool,
}

/// A device that completes every chain with zero bytes written, when told to.
pub struct Loopback(pub Arc<Mutex<DeviceLog>>);

impl Loopback {
    pub fn new() -> (Box<Self>, Arc<Mutex<DeviceLog>>) {
        let log = Arc::new(Mutex::new(DeviceLog::default()));
        (Box::new(Loopback(log.clone())), log)
    }
}

pub fn lock(log: &Arc<Mutex<DeviceLog>>) -> MutexGuard<'_, DeviceLog> {
    log.lock().unwrap()
}

/// Completes every available chain of every active queue; returns how many, and signals
/// the queues that need it (what a device's I/O thread does).
pub fn serve(log: &Arc<Mutex<DeviceLog>>) -> usize {
    let mut log = lock(log);
    let mem = log.mem.clone().unwrap();
    let interrupt = log.interrupt.clone().unwrap();
    let mut done = 0;
    for active in &mut log.queues {
        let mut heads = Vec::new();
        while let Some(chain) = active.queue.iter(&*mem).unwrap().next() {
            heads.push(chain.head_index());
        }
        if heads.is_empty() {
            continue;
        }
        for head in heads {
            active.queue.add_used(&*mem, head, 0).unwrap();
            done += 1;
        }
        if active.queue.needs_notification(&*mem).unwrap() {
            interrupt.signal_queue(active.index);
        }
    }
    done
}

impl VirtioDevice<Mem> for Loopback {
    fn device_type(&self) -> u32 {
        crate::device_type::RNG
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        QUEUE_MAX.to_vec()
    }
    fn features(&self) -> u64 {
        // Bit 34 (RING_PACKED) is a transport bit the transport withholds.
        DEVICE_FEATURES | (1 << 34)
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let log = self.0.lock().unwrap();
        for (i, b) in data.iter_mut().enumerate() {
            *b = log.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut log = self.0.lock().unwrap();
        for (i, b) in data.iter().enumerate() {
            if let Some(slot) = log.config.get_mut(offset as usize + i) {
                *slot = *b;
            }
        }
    }
    fn activate(
        &mut self,
        mem: Arc<Mem>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
        interrupt: Arc<dyn Interrupt>,
    ) -> Result<(), ActivateError> {
        let mut log = self.0.lock().unwrap();
        log.calls.push("activate");
        if log.refuse_activate {
            return Err(ActivateError("refused".into()));
        }
        log.features = acked_features;
        log.queues = queues;
        log.interrupt = Some(interrupt);
        log.mem = Some(mem);
        Ok(())
    }
    fn reset(&mut self) -> Vec<ActiveQueue> {
        let mut log = self.0.lock().unwrap();
        log.calls.push("reset");
        log.interrupt = None;
        std::mem::take(&mut log.queues)
    }
    fn pause(&mut self) -> Result<(), LifecycleError> {
        self.0.lock().unwrap().calls.push("pause");
        Ok(())
    }
    fn resume(&mut self) -> Result<(), LifecycleError> {
        self.0.lock().unwrap().calls.push("resume");
        Ok(())
    }
    fn queue_states(&self) -> Option<Vec<(u16, QueueState)>> {
        let log = self.0.lock().unwrap();
        Some(
            log.queues
                .iter()
                .map(|q| (q.index, q.queue.state()))
                .collect(),
        )
    }
    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(7, &self.0.lock().unwrap().config)
    }
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let config: [u8; 8] = state.parse("loopback", 7)?;
        let mut log = self.0.lock().unwrap();
        log.config = config;
        log.restored = Some(state.clone());
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsiEvent {
    Update(u16, Option<MsiMessage>),
    Fire(u16),
}

/// Records what the transport asks of the MSI side.
#[derive(Default)]
pub struct MsiLog(Mutex<Vec<MsiEvent>>);

impl MsiLog {
    pub fn take(&self) -> Vec<MsiEvent> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
    pub fn fires(&self) -> Vec<u16> {
        self.take()
            .into_iter()
            .filter_map(|e| match e {
                MsiEvent::Fire(v) => Some(v),
                MsiEvent::Update(..) => None,
            })
            .collect()
    }
}

impl MsiTarget for MsiLog {
    fn update(&self, vector: u16, message: Option<MsiMessage>) {
        self.0
            .lock()
            .unwrap()
            .push(MsiEvent::Update(vector, message));
    }
    fn fire(&self, vector: u16) {
        self.0.lock().unwrap().push(MsiEvent::Fire(vector));
    }
}

/// Records line levels.
#[derive(Default)]
pub struct Lines(Mutex<Vec<(u32, bool)>>);

impl Lines {
    pub fn level(&self, gsi: u32) -> bool {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .rev()
            .find(|(g, _)| *g == gsi)
            .is_some_and(|(_, l)| *l)
    }
    pub fn changes(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

impl IrqChip for Lines {
    fn set_irq(&self, gsi: u32, level: bool) {
        self.0.lock().unwrap().push((gsi, level));
    }
}

/// Records ioeventfd registrations; refuses addresses in `refuse`.
#[derive(Default)]
pub struct Registrar {
    pub live: Mutex<HashSet<u64>>,
    pub refuse: Mutex<HashSet<u64>>,
}

impl IoEventRegistrar for Registrar {
    fn register(&self, address: u64, _waker: &Waker) -> Result<(), IoEventError> {
        if self.refuse.lock().unwrap().contains(&address) {
            return Err(IoEventError("refused".into()));
        }
        assert!(
            self.live.lock().unwrap().insert(address),
            "registered twice"
        );
        Ok(())
    }
    fn unregister(&self, address: u64, _waker: &Waker) -> Result<(), IoEventError> {
        assert!(self.live.lock().unwrap().remove(&address), "not registered");
        Ok(())
    }
}

/// A transport over a loopback device, and everything around it.
pub struct Rig {
    pub dev: VirtioPciDevice<Mem>,
    pub log: Arc<Mutex<DeviceLog>>,
    pub msi: Arc<MsiLog>,
    pub lines: Arc<Lines>,
    pub registrar: Arc<Registrar>,
}

pub fn memory() -> Arc<Mem> {
    Arc::new(Mem::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap())
}

impl Rig {
    pub fn new() -> Self {
        Self::on(memory())
    }

    pub fn on(mem: Arc<Mem>) -> Self {
        let (device, log) = Loopback::new();
        let msi = Arc::new(MsiLog::default());
        let lines = Arc::new(Lines::default());
        let registrar = Arc::new(Registrar::default());
        let dev = VirtioPciDevice::new(
            "pci-00:03.0".into(),
            device,
            mem,
            msi.clone(),
            IrqPin::new(lines.clone(), INTX_GSI),
            Some(registrar.clone()),
        )
        .unwrap();
        Rig {
            dev,
            log,
            msi,
            lines,
            registrar,
        }
    }

    pub fn read(&mut self, offset: u64, len: usize) -> u64 {
        let mut data = [0u8; 8];
        self.dev.bar_read(0, offset, &mut data[..len]);
        u64::from_le_bytes(data)
    }

    pub fn write(&mut self, offset: u64, len: usize, value: u64) {
        self.dev.bar_write(0, offset, &value.to_le_bytes()[..len]);
    }

    pub fn common_read(&mut self, field: usize, len: usize) -> u64 {
        self.read(COMMON_OFFSET + field as u64, len)
    }

    pub fn common_write(&mut self, field: usize, len: usize, value: u64) {
        self.write(COMMON_OFFSET + field as u64, len, value)
    }

    pub fn status(&mut self) -> u8 {
        self.common_read(std::mem::offset_of!(CommonCfg, device_status), 1) as u8
    }

    pub fn set_status(&mut self, status: u8) {
        self.common_write(
            std::mem::offset_of!(CommonCfg, device_status),
            1,
            status.into(),
        )
    }

    /// Acknowledges the device and writes the driver features; returns the status read
    /// back after asking for FEATURES_OK.
    pub fn negotiate(&mut self, features: u64) -> u8 {
        self.set_status(0);
        self.set_status(STATUS_ACKNOWLEDGE);
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        let select = std::mem::offset_of!(CommonCfg, driver_feature_select);
        let feature = std::mem::offset_of!(CommonCfg, driver_feature);
        for word in 0..2u64 {
            self.common_write(select, 4, word);
            self.common_write(feature, 4, (features >> (32 * word)) & 0xffff_ffff);
        }
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        self.status()
    }

    /// Programs queue `index` to use `ring`'s addresses and `size` entries, then enables it.
    pub fn setup_queue(&mut self, index: u16, ring: &MockSplitQueue<Mem>, size: u16) {
        self.common_write(
            std::mem::offset_of!(CommonCfg, queue_select),
            2,
            index.into(),
        );
        self.common_write(std::mem::offset_of!(CommonCfg, queue_size), 2, size.into());
        let desc = std::mem::offset_of!(CommonCfg, queue_desc);
        let driver = std::mem::offset_of!(CommonCfg, queue_driver);
        let device = std::mem::offset_of!(CommonCfg, queue_device);
        // The 64-bit fields as two dwords, as Linux writes them.
        for (field, address) in [
            (desc, ring.desc_table_addr().0),
            (driver, ring.avail_addr().0),
            (device, ring.used_addr().0),
        ] {
            self.common_write(field, 4, address & 0xffff_ffff);
            self.common_write(field + 4, 4, address >> 32);
        }
        self.common_write(std::mem::offset_of!(CommonCfg, queue_enable), 2, 1);
    }

    pub fn driver_ok(&mut self) {
        let status = self.status();
        self.set_status(status | STATUS_DRIVER_OK);
    }

    pub fn read_isr(&mut self) -> u8 {
        self.read(ISR_OFFSET, 1) as u8
    }

    /// Writes MSI-X message control (enable, function mask) through configuration space.
    pub fn msix_control(&mut self, enable: bool, function_mask: bool) {
        let high = (u8::from(enable) << 7) | (u8::from(function_mask) << 6);
        self.dev.config_write(u16::from(CAP_MSIX), 3, &[high]);
    }

    /// Programs MSI-X entry `vector` with a message whose data is `0x40 + vector`,
    /// unmasked.
    pub fn program_vector(&mut self, vector: u16) {
        let entry = self.dev.layout().table_offset + 16 * u64::from(vector);
        self.write(entry, 8, 0xfee0_0000);
        self.write(entry + 8, 4, 0x40 + u64::from(vector));
        self.write(entry + 12, 4, 0);
    }

    pub fn mask_vector(&mut self, vector: u16, masked: bool) {
        let entry = self.dev.layout().table_offset + 16 * u64::from(vector);
        self.write(entry + 12, 4, u64::from(masked));
    }

    /// Sets queue `queue`'s MSI-X vector and returns what the device reads back.
    pub fn set_queue_vector(&mut self, queue: u16, vector: u16) -> u16 {
        self.common_write(
            std::mem::offset_of!(CommonCfg, queue_select),
            2,
            queue.into(),
        );
        let field = std::mem::offset_of!(CommonCfg, queue_msix_vector);
        self.common_write(field, 2, vector.into());
        self.common_read(field, 2) as u16
    }

    pub fn set_config_vector(&mut self, vector: u16) -> u16 {
        let field = std::mem::offset_of!(CommonCfg, config_msix_vector);
        self.common_write(field, 2, vector.into());
        self.common_read(field, 2) as u16
    }

    /// Negotiates VERSION_1 (+ `extra`), sets up both queues on mock rings and sets
    /// DRIVER_OK. The rings live at 0x1000 and 0x4000.
    pub fn bring_up<'m>(&mut self, mem: &'m Mem, extra: u64) -> [MockSplitQueue<'m, Mem>; 2] {
        assert_ne!(
            self.negotiate(VERSION_1 | extra) & STATUS_FEATURES_OK,
            0,
            "FEATURES_OK refused"
        );
        let rings = [
            MockSplitQueue::create(mem, GuestAddress(0x1000), QUEUE_MAX[0]),
            MockSplitQueue::create(mem, GuestAddress(0x4000), QUEUE_MAX[1]),
        ];
        self.setup_queue(0, &rings[0], QUEUE_MAX[0]);
        self.setup_queue(1, &rings[1], QUEUE_MAX[1]);
        self.driver_ok();
        rings
    }
}

/// The guest-physical address of the notify slot of `queue` when BAR0 sits at `base`.
pub fn notify_address(base: u64, queue: u16) -> u64 {
    base + layout::NOTIFY_OFFSET + 4 * u64::from(queue)
}
