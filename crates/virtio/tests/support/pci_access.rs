//! Guest accesses to the PCI transport of a real virtio-blk device: a sequence of [`Op`]s
//! (configuration-space and BAR reads and writes of any offset, size and value, interleaved
//! with the steps of a driver: feature negotiation, queue setup, DRIVER_OK, requests,
//! notifications, MSI-X programming, BAR moves). [`run`] checks after every access, with the
//! device paused so that its thread cannot race the observation, that
//!
//! - the device status holds only bits a driver may set plus DEVICE_NEEDS_RESET; it only
//!   gains bits until a reset clears it (so NEEDS_RESET is sticky); FEATURES_OK only with
//!   features the device offered, VERSION_1 among them; DRIVER_OK without FEATURES_OK only
//!   with NEEDS_RESET; the device runs only with DRIVER_OK and FEATURES_OK;
//! - every MSI-X vector is in the table or NO_VECTOR, and every vector fired or routed too;
//! - an enabled queue has a power-of-two size within the maximum and aligned rings;
//! - the INTx line is high exactly when the ISR is set, MSI-X is off and INTx is enabled;
//! - the notify addresses registered as ioeventfds are those of BAR0's current place;
//! - a paused transport saves, and the state restores into a fresh one;
//!
//! and at the end that a reset and a proper bring-up give a device that serves requests.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use devices::exit::Waker;
use devices::irqchip::{IrqChip, IrqPin};
use devices::{DeviceState, Lifecycle};
use pci::{MsiMessage, MsiTarget, PciDevice};
use serde_json::Value;
use virtio::transport::layout::{BarLayout, CommonCfg, NOTIFY_OFFSET};
use virtio::transport::NO_VECTOR;
use virtio::{IoEventError, IoEventRegistrar, VirtioPciDevice};
use virtio_bindings::bindings::virtio_blk::VIRTIO_BLK_T_OUT;
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};

use super::chains::{block_header, buffer, good_block_requests, SplitRing};
use super::*;

pub const ACKNOWLEDGE: u8 = VIRTIO_CONFIG_S_ACKNOWLEDGE as u8;
pub const DRIVER: u8 = VIRTIO_CONFIG_S_DRIVER as u8;
pub const DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
pub const FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
pub const FAILED: u8 = VIRTIO_CONFIG_S_FAILED as u8;
pub const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
/// The block device's queue size.
pub const QUEUE_MAX: u16 = 256;
/// The INTx line of the transport.
const INTX_GSI: u32 = 18;

/// One guest access, or one step of a driver (made of guest accesses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    BarRead {
        bar: usize,
        offset: u64,
        len: usize,
    },
    BarWrite {
        bar: usize,
        offset: u64,
        data: Vec<u8>,
    },
    ConfigRead {
        offset: u16,
    },
    ConfigWrite {
        offset: u16,
        sub: u8,
        data: Vec<u8>,
    },
    /// The bus placed BAR0 elsewhere (None: memory decoding off).
    BarMoved {
        base: Option<u64>,
    },
    /// A write of `device_status` (0 resets the device).
    Status(u8),
    /// ACKNOWLEDGE, DRIVER, the two feature words, FEATURES_OK.
    Negotiate(u64),
    /// Selects `queue`, writes its size and rings (the harness's own rings when None),
    /// enables it.
    SetupQueue {
        queue: u16,
        size: u16,
        rings: Option<(u64, u64, u64)>,
    },
    /// Adds DRIVER_OK to the status read back.
    DriverOk,
    /// MSI-X enable and function mask, through the capability.
    Msix {
        enable: bool,
        mask: bool,
    },
    /// Programs MSI-X table entry `entry` with a message, masked or not.
    Vector {
        entry: u16,
        masked: bool,
    },
    /// Writes `config_msix_vector`, and `queue_msix_vector` of the selected queue.
    SetVectors {
        config: u16,
        queue: u16,
    },
    /// Publishes a write request on the harness's rings of queue 0 and notifies it.
    Request {
        sector: u8,
    },
    /// Writes the notify address of `queue`.
    Kick {
        queue: u16,
    },
}

/// BAR0's layout for the block device (one queue, two MSI-X vectors).
pub fn layout() -> BarLayout {
    BarLayout::new(1, 2)
}

/// Records MSI-X routes and messages; remembers vectors beyond the table.
#[derive(Default)]
struct MsiLog {
    bad_vector: Mutex<Option<u16>>,
    fired: Mutex<u64>,
}

impl MsiTarget for MsiLog {
    fn update(&self, vector: u16, _message: Option<MsiMessage>) {
        if vector >= 2 {
            *self.bad_vector.lock().unwrap() = Some(vector);
        }
    }
    fn fire(&self, vector: u16) {
        if vector >= 2 {
            *self.bad_vector.lock().unwrap() = Some(vector);
        }
        *self.fired.lock().unwrap() += 1;
    }
}

/// The INTx line's level.
#[derive(Default)]
struct Line(AtomicBool);

impl IrqChip for Line {
    fn set_irq(&self, gsi: u32, level: bool) {
        assert_eq!(gsi, INTX_GSI);
        self.0.store(level, Ordering::SeqCst);
    }
}

/// The registered notify addresses; remembers a double registration or a stray removal.
#[derive(Default)]
struct Registrar {
    live: Mutex<HashSet<u64>>,
    misuse: Mutex<Option<String>>,
}

impl IoEventRegistrar for Registrar {
    fn register(&self, address: u64, _waker: &Waker) -> Result<(), IoEventError> {
        if !self.live.lock().unwrap().insert(address) {
            *self.misuse.lock().unwrap() = Some(format!("{address:#x} registered twice"));
        }
        Ok(())
    }
    fn unregister(&self, address: u64, _waker: &Waker) -> Result<(), IoEventError> {
        if !self.live.lock().unwrap().remove(&address) {
            *self.misuse.lock().unwrap() = Some(format!("{address:#x} was not registered"));
        }
        Ok(())
    }
}

/// A transport over a block device, with recording fakes around it.
pub struct Rig {
    pub dev: VirtioPciDevice<Mem>,
    pub mem: Arc<Mem>,
    msi: Arc<MsiLog>,
    line: Arc<Line>,
    registrar: Arc<Registrar>,
    /// The size last given to queue 0 with the harness's rings.
    ring_size: u16,
}

impl Rig {
    pub fn new(mem: Arc<Mem>) -> Rig {
        let msi = Arc::new(MsiLog::default());
        let line = Arc::new(Line::default());
        let registrar = Arc::new(Registrar::default());
        let dev = VirtioPciDevice::new(
            "pci-00:04.0".into(),
            Box::new(block_device()),
            mem.clone(),
            msi.clone(),
            IrqPin::new(line.clone(), INTX_GSI),
            Some(registrar.clone()),
        )
        .expect("a virtio-blk transport");
        Rig {
            dev,
            mem,
            msi,
            line,
            registrar,
            ring_size: QUEUE_MAX,
        }
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let mut data = vec![0u8; len];
        self.dev.bar_read(0, offset, &mut data);
        data
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.dev.bar_write(0, offset, data);
    }

    fn common_write(&mut self, field: usize, value: u64, len: usize) {
        self.write(field as u64, &value.to_le_bytes()[..len]);
    }

    /// The status as the driver reads it.
    pub fn status(&mut self) -> u8 {
        self.read(std::mem::offset_of!(CommonCfg, device_status) as u64, 1)[0]
    }

    fn set_status(&mut self, status: u8) {
        self.common_write(
            std::mem::offset_of!(CommonCfg, device_status),
            status.into(),
            1,
        );
    }
}

/// The harness's rings for queue 0 (those of [`super::chains`]).
fn standard_rings(size: u16) -> SplitRing {
    SplitRing::at(0, size)
}

/// Carries out one step.
pub fn apply(rig: &mut Rig, op: &Op) {
    match op {
        Op::BarRead { bar, offset, len } => {
            let mut data = vec![0u8; *len];
            rig.dev.bar_read(*bar, *offset, &mut data);
        }
        Op::BarWrite { bar, offset, data } => rig.dev.bar_write(*bar, *offset, data),
        Op::ConfigRead { offset } => drop(rig.dev.config_read(*offset)),
        Op::ConfigWrite { offset, sub, data } => rig.dev.config_write(*offset, *sub, data),
        Op::BarMoved { base } => rig.dev.bar_moved(0, *base),
        Op::Status(status) => rig.set_status(*status),
        Op::Negotiate(features) => negotiate(rig, *features),
        Op::SetupQueue { queue, size, rings } => setup_queue(rig, *queue, *size, *rings),
        Op::DriverOk => {
            let status = rig.status();
            rig.set_status(status | DRIVER_OK);
        }
        Op::Msix { enable, mask } => {
            let control = (u8::from(*enable) << 7) | (u8::from(*mask) << 6);
            rig.dev.config_write(0x40, 3, &[control]);
        }
        Op::Vector { entry, masked } => {
            let at = layout().table_offset + 16 * u64::from(*entry);
            rig.write(at, &0xfee0_0000u64.to_le_bytes());
            rig.write(at + 8, &(0x30 + u32::from(*entry)).to_le_bytes());
            rig.write(at + 12, &u32::from(*masked).to_le_bytes());
        }
        Op::SetVectors { config, queue } => {
            rig.common_write(
                std::mem::offset_of!(CommonCfg, config_msix_vector),
                (*config).into(),
                2,
            );
            rig.common_write(
                std::mem::offset_of!(CommonCfg, queue_msix_vector),
                (*queue).into(),
                2,
            );
        }
        Op::Request { sector } => publish_write(rig, *sector),
        Op::Kick { queue } => {
            rig.write(NOTIFY_OFFSET + 4 * u64::from(*queue), &queue.to_le_bytes())
        }
    }
}

fn negotiate(rig: &mut Rig, features: u64) {
    rig.set_status(ACKNOWLEDGE);
    rig.set_status(ACKNOWLEDGE | DRIVER);
    let select = std::mem::offset_of!(CommonCfg, driver_feature_select);
    let feature = std::mem::offset_of!(CommonCfg, driver_feature);
    for word in 0..2u64 {
        rig.common_write(select, word, 4);
        rig.common_write(feature, (features >> (32 * word)) & 0xffff_ffff, 4);
    }
    rig.set_status(ACKNOWLEDGE | DRIVER | FEATURES_OK);
}

fn setup_queue(rig: &mut Rig, queue: u16, size: u16, rings: Option<(u64, u64, u64)>) {
    rig.common_write(
        std::mem::offset_of!(CommonCfg, queue_select),
        queue.into(),
        2,
    );
    rig.common_write(std::mem::offset_of!(CommonCfg, queue_size), size.into(), 2);
    let (desc, driver, device) = rings.unwrap_or_else(|| {
        let ring = standard_rings(size);
        (ring.desc, ring.avail, ring.used)
    });
    if rings.is_none() && queue == 0 && size.is_power_of_two() && size <= QUEUE_MAX {
        rig.ring_size = size;
    }
    for (field, address) in [
        (std::mem::offset_of!(CommonCfg, queue_desc), desc),
        (std::mem::offset_of!(CommonCfg, queue_driver), driver),
        (std::mem::offset_of!(CommonCfg, queue_device), device),
    ] {
        // As Linux writes them: two dwords.
        rig.common_write(field, address & 0xffff_ffff, 4);
        rig.common_write(field + 4, address >> 32, 4);
    }
    rig.common_write(std::mem::offset_of!(CommonCfg, queue_enable), 1, 2);
}

/// A one-sector write on the harness's rings, notified; not waited for (the queue may not be
/// set up as the harness thinks).
fn publish_write(rig: &mut Rig, sector: u8) {
    let ring = standard_rings(rig.ring_size);
    let (table, header, data, status) = (
        DATA_START,
        DATA_START + 0x100,
        DATA_START + 0x1000,
        DATA_START + 0x200,
    );
    let write = |addr: u64, bytes: &[u8]| rig.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    write(header, &block_header(VIRTIO_BLK_T_OUT, u64::from(sector)));
    write(data, &[sector; 512]);
    let chain = [
        buffer(header, 16, false, Some(1)),
        buffer(data, 512, false, Some(2)),
        buffer(status, 1, true, None),
    ];
    let idx = ring.used_idx(&rig.mem);
    ring.publish_indirect(&rig.mem, idx, table, &chain);
    rig.write(NOTIFY_OFFSET, &0u16.to_le_bytes());
}

/// What the checks carry from one access to the next.
#[derive(Clone, Copy, Default)]
struct Seen {
    status: u8,
}

/// How deep a sequence went: the checks after which the device was running, or needed a
/// reset, and the MSI-X messages it sent.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reach {
    pub running: usize,
    pub needs_reset: usize,
    pub msi_fired: u64,
}

/// Runs `ops` and checks the invariants after each (see the module documentation); then
/// checks a reset and a proper bring-up. Returns how deep the sequence went.
pub fn run(ops: &[Op]) -> Reach {
    watch_device_threads();
    let mem = ram();
    let mut rig = Rig::new(mem.clone());
    let (mut seen, mut reach) = (Seen::default(), Reach::default());
    for (i, op) in ops.iter().enumerate() {
        apply(&mut rig, op);
        seen = check(&mut rig, seen).unwrap_or_else(|e| panic!("after access {i} ({op:x?}): {e}"));
        reach.running += usize::from(rig.dev.is_active());
        reach.needs_reset += usize::from(seen.status & NEEDS_RESET != 0);
    }
    reach.msi_fired = *rig.msi.fired.lock().unwrap();
    restore_into_fresh(&mut rig, &mem);
    bring_up_and_serve(&mut rig);
    reach
}

/// Checks the invariants with the device paused; returns what the next check compares with.
fn check(rig: &mut Rig, before: Seen) -> Result<Seen, String> {
    rig.dev.pause().map_err(|e| format!("pause: {e}"))?;
    let result = check_paused(rig, before);
    rig.dev.resume().map_err(|e| format!("resume: {e}"))?;
    result
}

fn check_paused(rig: &mut Rig, before: Seen) -> Result<Seen, String> {
    let saved = rig
        .dev
        .save()
        .map_err(|e| format!("a paused transport does not save: {e}"))?;
    let state = &saved.data;
    let status = rig.status();
    if status != rig.dev.status() || Some(u64::from(status)) != state["status"].as_u64() {
        return Err(format!(
            "status {status:#x} read, {:#x} held, {} saved",
            rig.dev.status(),
            state["status"]
        ));
    }
    check_status(rig, state, status, before.status)?;
    check_vectors(rig, state)?;
    check_queues(state)?;
    check_lines(rig, state)?;
    Ok(Seen { status })
}

fn json_u64(state: &Value, field: &str) -> Result<u64, String> {
    state[field]
        .as_u64()
        .ok_or_else(|| format!("saved state without {field}"))
}

/// The status rules of virtio 1.2, 2.1 and 3.1.1, as the device can enforce them.
fn check_status(rig: &Rig, state: &Value, status: u8, before: u8) -> Result<(), String> {
    let allowed = ACKNOWLEDGE | DRIVER | DRIVER_OK | FEATURES_OK | FAILED | NEEDS_RESET;
    if status & !allowed != 0 {
        return Err(format!("status {status:#x} has bits no driver sets"));
    }
    if status != 0 && status & before != before {
        return Err(format!(
            "status went from {before:#x} to {status:#x} without a reset"
        ));
    }
    let features = json_u64(state, "driver_features")?;
    let beyond = state["driver_features_beyond"].as_bool() == Some(true);
    let acceptable =
        features & !rig.dev.offered_features() == 0 && features & VERSION_1 != 0 && !beyond;
    if status & FEATURES_OK != 0 && !acceptable {
        return Err(format!("FEATURES_OK with driver features {features:#x}"));
    }
    if status & (DRIVER_OK | FEATURES_OK | NEEDS_RESET) == DRIVER_OK {
        return Err(format!(
            "status {status:#x}: DRIVER_OK without FEATURES_OK nor NEEDS_RESET"
        ));
    }
    if rig.dev.is_active() && status & (DRIVER_OK | FEATURES_OK) != DRIVER_OK | FEATURES_OK {
        return Err(format!("the device runs with status {status:#x}"));
    }
    if status == 0 && rig.dev.is_active() {
        return Err("the device runs after a reset".into());
    }
    Ok(())
}

/// Every vector is in the table (2 entries) or NO_VECTOR, in the registers and in what the
/// MSI target saw.
fn check_vectors(rig: &Rig, state: &Value) -> Result<(), String> {
    let valid = |v: u64| v == u64::from(NO_VECTOR) || v < 2;
    let config = json_u64(state, "config_msix_vector")?;
    let interrupt = rig.dev.interrupt();
    if !valid(config) || u64::from(interrupt.config_vector()) != config {
        return Err(format!("config vector {config}"));
    }
    let queue = interrupt.queue_vector(0);
    if !valid(queue.into()) {
        return Err(format!("queue vector {queue}"));
    }
    if let Some(vector) = *rig.msi.bad_vector.lock().unwrap() {
        return Err(format!(
            "MSI-X vector {vector} routed or fired, beyond the table"
        ));
    }
    Ok(())
}

/// An enabled queue passed the checks of queue_enable.
fn check_queues(state: &Value) -> Result<(), String> {
    let queues = state["queues"]
        .as_array()
        .ok_or("saved state without queues")?;
    for (i, q) in queues.iter().enumerate() {
        if q["enabled"].as_bool() != Some(true) {
            continue;
        }
        let size = json_u64(q, "size")?;
        let aligned = json_u64(q, "desc")? % 16 == 0
            && json_u64(q, "driver")? % 2 == 0
            && json_u64(q, "device")? % 4 == 0;
        if !size.is_power_of_two() || size > u64::from(QUEUE_MAX) || !aligned {
            return Err(format!("queue {i} enabled as {q}"));
        }
    }
    Ok(())
}

/// The INTx line and the ioeventfd registrations agree with the registers.
fn check_lines(rig: &Rig, state: &Value) -> Result<(), String> {
    let isr = json_u64(state, "isr")?;
    if isr & !3 != 0 {
        return Err(format!("ISR {isr:#x}"));
    }
    let msix = state["msix"]["enabled"].as_bool() == Some(true);
    let intx_disabled = json_u64(&state["header"], "command")? & 0x400 != 0;
    let level = rig.line.0.load(Ordering::SeqCst);
    if level != (isr != 0 && !msix && !intx_disabled) {
        return Err(format!(
            "INTx line {level} with ISR {isr:#x}, MSI-X {msix}, INTx disabled {intx_disabled}"
        ));
    }
    if let Some(misuse) = rig.registrar.misuse.lock().unwrap().clone() {
        return Err(format!("ioeventfd: {misuse}"));
    }
    let live = rig.registrar.live.lock().unwrap().clone();
    let expected: HashSet<u64> = rig
        .dev
        .ioevents_registered_at()
        .map(|base| HashSet::from([base.wrapping_add(NOTIFY_OFFSET)]))
        .unwrap_or_default();
    if live != expected {
        return Err(format!(
            "ioeventfds at {live:x?}, BAR0 notify addresses {expected:x?}"
        ));
    }
    Ok(())
}

/// The state of a paused transport restores into a fresh one over the same RAM, which then
/// resumes and resets.
fn restore_into_fresh(rig: &mut Rig, mem: &Arc<Mem>) {
    rig.dev.pause().expect("pause");
    let saved: DeviceState = rig.dev.save().expect("a paused transport saves");
    let mut other = Rig::new(mem.clone());
    other.dev.restore(&saved).unwrap_or_else(|e| {
        panic!(
            "a state the transport reached is refused: {e}\n{}",
            saved.data
        )
    });
    other.dev.resume().expect("resume of the restored copy");
    other.dev.reset();
    rig.dev.resume().expect("resume");
}

/// Resets the device through its status, checks the reset state, brings it up as a driver
/// would and serves a write and a read.
fn bring_up_and_serve(rig: &mut Rig) {
    rig.set_status(0);
    assert_eq!(rig.status(), 0, "status after reset");
    assert!(!rig.dev.is_active(), "running after reset");
    let interrupt = rig.dev.interrupt();
    assert_eq!(
        (interrupt.config_vector(), interrupt.queue_vector(0)),
        (NO_VECTOR, NO_VECTOR)
    );
    negotiate(rig, VERSION_1);
    assert_eq!(
        rig.status(),
        ACKNOWLEDGE | DRIVER | FEATURES_OK,
        "VERSION_1 alone refused"
    );
    for ring in [0x0u64, 0x1000, 0x2000] {
        rig.mem
            .write_slice(&[0; 0x1000], GuestAddress(ring))
            .unwrap();
    }
    setup_queue(rig, 0, 16, None);
    let status = rig.status();
    rig.set_status(status | DRIVER_OK);
    assert_eq!(
        rig.status(),
        ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        "bring-up"
    );
    let mem = rig.mem.clone();
    let rig = std::cell::RefCell::new(rig);
    let kick = || rig.borrow_mut().write(NOTIFY_OFFSET, &0u16.to_le_bytes());
    good_block_requests(
        &mem,
        &standard_rings(16),
        DATA_START,
        DATA_START + 0x1000,
        &kick,
    );
}
