//! QEMU's `isa-debug-exit` device: the guest ends the VM with a status of
//! its choosing.
//!
//! Test guests report pass/fail this way, and existing harnesses already
//! decode QEMU's convention (exit status `(v << 1) | 1`, so no guest-chosen
//! value can look like a clean 0), which is why ferrovm keeps it.

use std::sync::{Arc, Mutex};

use crate::bus::{Bus, BusDeviceMut, BusError};
use crate::exit::{ExitReason, ExitRequest};

/// The port QEMU's default `isa-debug-exit,iobase=0xf4` uses.
pub const DEBUG_EXIT_PORT: u64 = 0xf4;
/// Ports claimed: four, as QEMU's `isa-debug-exit,iosize=4` (its default), so that a 1-,
/// 2- or 4-byte write at 0xf4 all reach the device.
pub const DEBUG_EXIT_LEN: u64 = 4;

/// The debug-exit port. It has no guest-visible state to save.
#[derive(Debug)]
pub struct DebugExit {
    exit: Arc<ExitRequest>,
}

impl DebugExit {
    /// A device that records its exits in `exit`.
    pub fn new(exit: Arc<ExitRequest>) -> Self {
        DebugExit { exit }
    }

    /// Moves the device onto `bus` at port 0xf4.
    pub fn register(self, bus: &mut Bus) -> Result<Arc<Mutex<Self>>, BusError> {
        let dev = Arc::new(Mutex::new(self));
        bus.insert(dev.clone(), DEBUG_EXIT_PORT, DEBUG_EXIT_LEN)?;
        Ok(dev)
    }
}

impl BusDeviceMut for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    /// Any write of 1, 2 or 4 bytes anywhere in the range counts, as with QEMU's device; the
    /// status byte is the value's low byte (the first one: port I/O is little-endian).
    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Some(&v) = data.first() {
            self.exit.request(ExitReason::DebugExit(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Arc<ExitRequest>, Bus) {
        let exit = Arc::new(ExitRequest::new().unwrap());
        let mut bus = Bus::new();
        DebugExit::new(exit.clone()).register(&mut bus).unwrap();
        (exit, bus)
    }

    #[test]
    fn status_for_zero_and_255() {
        for (v, status) in [(0u8, 1), (1, 3), (0x10, 0x21), (255, 511)] {
            let (exit, bus) = setup();
            assert!(!exit.is_requested());
            assert!(bus.write(DEBUG_EXIT_PORT, &[v]));
            assert_eq!(exit.reason(), Some(ExitReason::DebugExit(v)));
            assert_eq!(exit.reason().unwrap().exit_status(), status);
        }
    }

    /// Test kernels built for QEMU's `-device isa-debug-exit,iobase=0xf4,iosize=4` write
    /// a byte, a word or a dword: the low byte is the value.
    #[test]
    fn byte_word_and_dword_writes_exit_with_the_low_byte() {
        for (data, v) in [
            (&[0x07][..], 7u8),
            (&[0x07, 0x56][..], 7),
            (&[0x31, 0x56, 0x34, 0x12][..], 0x31),
        ] {
            let (exit, bus) = setup();
            assert!(bus.write(DEBUG_EXIT_PORT, data), "{data:?}");
            assert_eq!(exit.reason(), Some(ExitReason::DebugExit(v)));
        }
        let (exit, bus) = setup();
        let mut d = [0xaa; 4];
        assert!(bus.read(DEBUG_EXIT_PORT, &mut d));
        assert_eq!(d, [0; 4]);
        assert!(!exit.is_requested());
    }

    #[test]
    fn first_write_wins_and_wide_writes() {
        let (exit, bus) = setup();
        assert!(bus.write(DEBUG_EXIT_PORT, &[]));
        assert!(!exit.is_requested());
        let mut d = [0xaa; 8];
        assert!(!bus.read(DEBUG_EXIT_PORT, &mut d)); // wider than the device
        assert!(bus.read(DEBUG_EXIT_PORT, &mut d[..1]));
        assert_eq!(d[0], 0);
        assert!(!exit.is_requested());
        assert!(bus.write(DEBUG_EXIT_PORT, &[7]));
        assert!(bus.write(DEBUG_EXIT_PORT, &[9]));
        assert_eq!(exit.reason(), Some(ExitReason::DebugExit(7)));

        // Called directly with a wide value: low byte counts.
        let exit = Arc::new(ExitRequest::new().unwrap());
        DebugExit::new(exit.clone()).write(0, &[0x34, 0x12, 0, 0]);
        assert_eq!(exit.reason(), Some(ExitReason::DebugExit(0x34)));
    }
}
