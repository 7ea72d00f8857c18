//! The firmware debug console at port 0x402 (QEMU's `isa-debugcon` port, where SeaBIOS
//! writes its log). Each line is logged at debug level under the `firmware` target, so
//! `FERROVM_LOG=debug` shows what the firmware did. Reads return 0xe9, the value QEMU's
//! device returns, by which firmware recognises it.

use std::sync::{Arc, Mutex};

use crate::bus::{Bus, BusDeviceMut, BusError};

/// The port.
pub const PORT: u64 = 0x402;
/// What a read returns: "a debug console is here".
const PRESENT: u8 = 0xe9;
/// A line longer than this is logged in pieces.
const MAX_LINE: usize = 512;

/// The device: a line buffer.
#[derive(Debug, Default)]
pub struct DebugCon {
    line: Vec<u8>,
}

impl DebugCon {
    /// Moves the device onto `bus` at port 0x402.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), PORT, 1)?;
        Ok(dev)
    }

    fn flush(&mut self) {
        if !self.line.is_empty() {
            log::debug!(target: "firmware", "{}", String::from_utf8_lossy(&self.line).trim_end());
            self.line.clear();
        }
    }
}

impl BusDeviceMut for DebugCon {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(PRESENT);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        // Only the first byte of a wider write is a character.
        let Some(&c) = data.first() else {
            return;
        };
        if !log::log_enabled!(target: "firmware", log::Level::Debug) {
            return;
        }
        if c == b'\n' || self.line.len() >= MAX_LINE {
            self.flush();
        }
        if c != b'\n' {
            self.line.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_identify_and_writes_never_grow_unbounded() {
        let mut bus = Bus::new();
        let dev = DebugCon::default().register(&mut bus).unwrap();
        let mut d = [0];
        assert!(bus.read(PORT, &mut d));
        assert_eq!(d, [PRESENT]);
        for _ in 0..10_000 {
            assert!(bus.write(PORT, b"x"));
        }
        assert!(dev.lock().unwrap().line.len() <= MAX_LINE);
        dev.lock().unwrap().write(0, &[]);
    }
}
