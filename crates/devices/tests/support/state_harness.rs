//! Harness for the device state carried by snapshots and migrations (JSON, untrusted: it comes
//! from a file or a peer), shared by the property tests (`tests/state_props.rs`) and the fuzz
//! target (`fuzz/`, which includes this file): restore a state into a fresh device, and when
//! it is accepted, check that the device saves a state it accepts again, and serve guest port
//! accesses from the restored state.

#![allow(dead_code)]

use std::sync::Arc;

use devices::acpi_pm::{AcpiPm, AcpiPmState};
use devices::bus::BusDeviceMut;
use devices::exit::ExitRequest;
use devices::fw_cfg::{FwCfg, FwCfgState};
use devices::i8042::{I8042State, I8042};
use devices::irqchip::IrqPin;
use devices::pit::{Pit, PitState};
use devices::rtc::{Rtc, RtcState};
use devices::serial::{NoIrq, SerialDevice, SerialState};
use serde_json::Value;

/// The devices whose state travels with a machine, by index.
pub const DEVICES: [&str; 6] = ["serial", "i8042", "acpi_pm", "fw_cfg", "rtc", "pit"];

/// A device as the harness drives it.
pub trait Subject: BusDeviceMut {
    /// Parses `json` as this device's state and restores it.
    fn restore_json(&mut self, json: &[u8]) -> Result<(), String>;
    /// The device's state as JSON.
    fn save_json(&self) -> Vec<u8>;
}

macro_rules! subject {
    ($device:ty, $state:ty) => {
        impl Subject for $device {
            fn restore_json(&mut self, json: &[u8]) -> Result<(), String> {
                let state: $state = serde_json::from_slice(json).map_err(|e| e.to_string())?;
                self.restore(&state).map_err(|e| e.to_string())
            }
            fn save_json(&self) -> Vec<u8> {
                serde_json::to_vec(&self.state()).expect("a state serialises")
            }
        }
    };
}

subject!(SerialDevice, SerialState);
subject!(I8042, I8042State);
subject!(AcpiPm, AcpiPmState);
subject!(FwCfg, FwCfgState);
subject!(Rtc, RtcState);
subject!(Pit, PitState);

fn exit() -> Arc<ExitRequest> {
    Arc::new(ExitRequest::new().expect("creating an exit request"))
}

/// A fresh device of kind `kind` (an index into [`DEVICES`], taken modulo its length).
pub fn fresh(kind: usize) -> Box<dyn Subject> {
    match kind % DEVICES.len() {
        0 => Box::new(SerialDevice::with_writer(
            Box::new(std::io::sink()),
            Arc::new(NoIrq),
        )),
        1 => Box::new(I8042::new(exit())),
        2 => Box::new(AcpiPm::new(exit())),
        3 => Box::new(FwCfg::new(2, 256 << 20)),
        4 => Box::new(Rtc::new(IrqPin::disconnected(8))),
        _ => Box::new(Pit::new()),
    }
}

/// The state of a fresh device of kind `kind`, as a JSON value.
pub fn fresh_state(kind: usize) -> Value {
    serde_json::from_slice(&fresh(kind).save_json()).unwrap()
}

/// Restores `json` into a fresh device of kind `kind`. When accepted: the device's own saved
/// state restores into another fresh device, the device serves the port accesses encoded in
/// `accesses` (4 bytes each: offset, size, direction, value), and its state after them is
/// accepted too. Returns whether `json` was accepted.
pub fn check_restore(kind: usize, json: &[u8], accesses: &[u8]) -> bool {
    let mut device = fresh(kind);
    if device.restore_json(json).is_err() {
        return false;
    }
    let saved = device.save_json();
    if let Err(e) = fresh(kind).restore_json(&saved) {
        panic!("{}: its own saved state is refused: {e}", DEVICES[kind % 6]);
    }
    for access in accesses.chunks_exact(4) {
        let offset = u64::from(access[0] % 16);
        let len = [1usize, 2, 4][usize::from(access[1] % 3)];
        if access[2] & 1 == 0 {
            let mut data = [0u8; 4];
            device.read(offset, &mut data[..len]);
        } else {
            device.write(offset, &[access[3]; 4][..len]);
        }
    }
    let after = device.save_json();
    if let Err(e) = fresh(kind).restore_json(&after) {
        panic!(
            "{}: its saved state after guest accesses is refused: {e}",
            DEVICES[kind % 6]
        );
    }
    true
}

/// Replaces node `target` (depth-first order, the root is 0) of `value` with `replacement`;
/// returns how many nodes were counted (so a caller can take `target` modulo the count).
pub fn replace_node(value: &mut Value, target: usize, replacement: &Value) -> usize {
    fn walk(v: &mut Value, target: usize, next: &mut usize, with: &Value) -> bool {
        if *next == target {
            *v = with.clone();
            return true;
        }
        *next += 1;
        match v {
            Value::Array(items) => items.iter_mut().any(|i| walk(i, target, next, with)),
            Value::Object(map) => map.values_mut().any(|i| walk(i, target, next, with)),
            _ => false,
        }
    }
    let mut count = 0;
    walk(value, target, &mut count, replacement);
    count
}

/// Number of nodes of `value`.
pub fn node_count(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(node_count).sum(),
        Value::Object(map) => map.values().map(node_count).sum(),
        _ => 0,
    }
}

/// The fuzz target's entry: byte 0 picks the device, byte 1 the number of port accesses that
/// follow (4 bytes each), the rest is the state's JSON.
pub fn fuzz_one(data: &[u8]) {
    let [kind, n, rest @ ..] = data else {
        return;
    };
    let split = (usize::from(*n) * 4).min(rest.len());
    let (accesses, json) = rest.split_at(split);
    check_restore(usize::from(*kind), json, accesses);
}
