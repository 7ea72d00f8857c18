//! System control port A (port 0x92, "fast A20 and reset"), as the PIIX chipsets have it.
//!
//! Bit 1 gates address line 20 and bit 0 pulses the CPU's reset line when it goes from 0
//! to 1. BIOS code and boot loaders enable A20 through it (SeaBIOS does, and falls back to
//! it from INT 15h AX=2401h). ferrovm's CPUs always run with A20 enabled (KVM has no A20
//! mask), so the bit is stored and read back; a guest that clears it to wrap addresses at
//! 1 MiB does not get the wrap-around, which the first clear logs. A reset ends the VM, as
//! the i8042's does.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::exit::{ExitReason, ExitRequest};
use crate::lifecycle::{DeviceState, Lifecycle, LifecycleError};
use crate::state::StateError;

/// The port.
pub const PORT: u64 = 0x92;
/// Bit 0: a rising edge resets the CPU.
const FAST_RESET: u8 = 1 << 0;
/// Bit 1: A20 enabled.
const A20: u8 = 1 << 1;
/// The bits a guest can set (the others read as 0 on the PIIX: no security lock, no LEDs).
const WRITABLE: u8 = FAST_RESET | A20;
/// After reset: A20 enabled (as SeaBIOS and every OS expect of a VM), no reset pending.
const RESET_VALUE: u8 = A20;

const STATE_VERSION: u32 = 1;

/// Saved state: the register's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Port92State {
    value: u8,
}

/// The device; see the module documentation.
#[derive(Debug)]
pub struct Port92 {
    value: u8,
    exit: Arc<ExitRequest>,
    warned_a20: bool,
}

impl Port92 {
    /// A port whose fast reset ends the VM through `exit`.
    pub fn new(exit: Arc<ExitRequest>) -> Self {
        Port92 {
            value: RESET_VALUE,
            exit,
            warned_a20: false,
        }
    }

    /// Moves the device onto `bus` at port 0x92.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), PORT, 1)?;
        Ok(dev)
    }
}

impl BusDeviceMut for Port92 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = self.value;
        }
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        let Some(&byte) = data.first() else {
            return;
        };
        let value = byte & WRITABLE;
        if value & A20 == 0 && !self.warned_a20 {
            self.warned_a20 = true;
            log::warn!("port 0x92: the guest disabled A20; addresses do not wrap at 1 MiB here");
        }
        let rising_reset = value & FAST_RESET != 0 && self.value & FAST_RESET == 0;
        self.value = value;
        if rising_reset {
            self.exit.request(ExitReason::Reset);
        }
    }
}

impl Lifecycle for Port92 {
    fn id(&self) -> String {
        "port92".into()
    }

    fn save(&self) -> Result<DeviceState, LifecycleError> {
        DeviceState::new(STATE_VERSION, &Port92State { value: self.value })
    }

    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
        let s: Port92State = state.parse("port 0x92", STATE_VERSION)?;
        if s.value & !WRITABLE != 0 {
            return Err(StateError::new(
                "port 0x92",
                format!("value {:#04x} has reserved bits", s.value),
            ));
        }
        self.value = s.value;
        Ok(())
    }

    fn reset(&mut self) {
        self.value = RESET_VALUE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Bus, Arc<Mutex<Port92>>, Arc<ExitRequest>) {
        let exit = Arc::new(ExitRequest::new().unwrap());
        let mut bus = Bus::new();
        let dev = Port92::new(exit.clone()).register(&mut bus).unwrap();
        (bus, dev, exit)
    }

    fn read(bus: &Bus) -> u8 {
        let mut d = [0xaa];
        assert!(bus.read(PORT, &mut d));
        d[0]
    }

    #[test]
    fn a20_reads_back_and_reserved_bits_read_zero() {
        let (bus, _, exit) = setup();
        assert_eq!(read(&bus), A20);
        assert!(bus.write(PORT, &[0xfa]));
        assert_eq!(read(&bus), A20);
        assert!(bus.write(PORT, &[0]));
        assert_eq!(read(&bus), 0);
        assert!(bus.write(PORT, &[A20]));
        assert_eq!(read(&bus), A20);
        assert_eq!(exit.reason(), None);
    }

    #[test]
    fn rising_bit_0_resets() {
        let (bus, dev, exit) = setup();
        assert!(bus.write(PORT, &[A20 | FAST_RESET]));
        assert_eq!(exit.reason(), Some(ExitReason::Reset));
        // Saved with the bit set, restored, it does not reset again until it rises again.
        let state = dev.lock().unwrap().save().unwrap();
        let (bus2, dev2, exit2) = setup();
        dev2.lock().unwrap().restore(&state).unwrap();
        assert!(bus2.write(PORT, &[A20 | FAST_RESET]));
        assert_eq!(exit2.reason(), None);
        assert!(bus2.write(PORT, &[A20]));
        assert!(bus2.write(PORT, &[A20 | FAST_RESET]));
        assert_eq!(exit2.reason(), Some(ExitReason::Reset));
        dev2.lock().unwrap().reset();
        assert_eq!(read(&bus2), A20);
        drop(bus);
    }

    #[test]
    fn bad_states_are_refused() {
        let (_, dev, _) = setup();
        let bad = DeviceState {
            version: STATE_VERSION,
            data: serde_json::json!({ "value": 0x80 }),
        };
        assert!(dev.lock().unwrap().restore(&bad).is_err());
        let bad = DeviceState {
            version: 9,
            data: serde_json::json!({ "value": 2 }),
        };
        assert!(dev.lock().unwrap().restore(&bad).is_err());
        // Wider or empty accesses never panic.
        let mut d = Port92::new(Arc::new(ExitRequest::new().unwrap()));
        d.write(0, &[]);
        d.read(0, &mut []);
        let mut wide = [0xff; 4];
        d.read(0, &mut wide);
        assert_eq!(wide, [A20, 0, 0, 0]);
    }
}
