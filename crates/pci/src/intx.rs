//! Legacy INTx interrupts: which GSI a (slot, pin) reaches, and the wired-OR of the
//! functions sharing it.
//!
//! Device `d`'s pin `p` (0 = INTA#) is wired to GSI `16 + (d + p) % 4`, the swizzle the
//! DSDT's `_PRT` declares. The lines are level-triggered and shared, so a line stays
//! asserted while any function on it asserts: [`IntxRouter`] keeps one bit per (slot,
//! pin) and drives [`IrqChip::set_irq`] with their OR (KVM's IRQ line ioctl keeps a
//! single level per line for user space, so the OR must happen here).

use std::sync::{Arc, Mutex};

use devices::irqchip::IrqChip;

use crate::config::{ConfigSpace, IntxPin};

/// The first of the four GSIs PCI INTx lines use.
pub const INTX_GSI_BASE: u32 = 16;
/// How many GSIs the INTx lines are spread over.
pub const INTX_GSI_COUNT: u32 = 4;

/// The GSI that pin `pin` of the function in slot `slot` asserts.
pub fn intx_gsi(slot: u8, pin: IntxPin) -> u32 {
    INTX_GSI_BASE + (u32::from(slot) + pin.index()) % INTX_GSI_COUNT
}

/// Drives the shared INTx GSIs as the OR of the functions' pins.
pub struct IntxRouter {
    chip: Arc<dyn IrqChip>,
    /// Per GSI, one bit per slot * 4 + pin asserting it. The lock is held across
    /// `set_irq` so that the chip sees levels in the order the masks changed.
    asserted: Mutex<[u128; INTX_GSI_COUNT as usize]>,
}

impl IntxRouter {
    /// Lines of `chip`.
    pub fn new(chip: Arc<dyn IrqChip>) -> Arc<Self> {
        Arc::new(IntxRouter {
            chip,
            asserted: Mutex::new([0; INTX_GSI_COUNT as usize]),
        })
    }

    /// The line of `pin` in `slot`, for the function there to drive. Slots above 31 do
    /// not exist on the bus and are refused.
    pub fn line(self: &Arc<Self>, slot: u8, pin: IntxPin) -> Option<IntxLine> {
        if slot >= crate::bus::NUM_SLOTS {
            return None;
        }
        Some(IntxLine {
            router: self.clone(),
            slot,
            pin,
            driven: false,
        })
    }

    fn set(&self, slot: u8, pin: IntxPin, level: bool) {
        let gsi = intx_gsi(slot, pin);
        let bit = 1u128 << (u32::from(slot) * 4 + pin.index());
        let mut asserted = self.asserted.lock().unwrap_or_else(|e| e.into_inner());
        let mask = &mut asserted[(gsi - INTX_GSI_BASE) as usize];
        let before = *mask != 0;
        if level {
            *mask |= bit;
        } else {
            *mask &= !bit;
        }
        let after = *mask != 0;
        if before != after {
            self.chip.set_irq(gsi, after);
        }
    }
}

/// One function's INTx pin. Dropping it deasserts the pin.
pub struct IntxLine {
    router: Arc<IntxRouter>,
    slot: u8,
    pin: IntxPin,
    driven: bool,
}

impl IntxLine {
    /// The GSI this pin reaches.
    pub fn gsi(&self) -> u32 {
        intx_gsi(self.slot, self.pin)
    }

    /// Asserts or deasserts the pin, whatever the command register says.
    pub fn set(&mut self, level: bool) {
        if level != self.driven {
            self.driven = level;
            self.router.set(self.slot, self.pin, level);
        }
    }

    /// Whether the pin is asserted now.
    pub fn asserted(&self) -> bool {
        self.driven
    }

    /// What a function calls whenever its interrupt condition or its command register
    /// changes: the status register's interrupt bit follows `pending`, and the pin is
    /// asserted while `pending` and INTx is not disabled.
    pub fn update(&mut self, config: &mut ConfigSpace, pending: bool) {
        config.set_interrupt_status(pending);
        self.set(pending && !config.intx_disabled());
    }
}

impl Drop for IntxLine {
    fn drop(&mut self) {
        self.set(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PciIds, COMMAND_INTX_DISABLE};

    #[derive(Default)]
    struct Recorder(Mutex<Vec<(u32, bool)>>);

    impl IrqChip for Recorder {
        fn set_irq(&self, gsi: u32, level: bool) {
            self.0.lock().unwrap().push((gsi, level));
        }
    }

    #[test]
    fn swizzle() {
        assert_eq!(intx_gsi(0, IntxPin::A), 16);
        assert_eq!(intx_gsi(1, IntxPin::A), 17);
        assert_eq!(intx_gsi(3, IntxPin::B), 16);
        assert_eq!(intx_gsi(31, IntxPin::D), 18);
        for slot in 0..32u8 {
            for pin in [IntxPin::A, IntxPin::B, IntxPin::C, IntxPin::D] {
                let gsi = intx_gsi(slot, pin);
                assert_eq!(gsi, 16 + (u32::from(slot) + pin.index()) % 4);
            }
        }
    }

    #[test]
    fn shared_line_is_wired_or() {
        let chip = Arc::new(Recorder::default());
        let router = IntxRouter::new(chip.clone());
        // Slots 1 (INTA) and 5 (INTA) share GSI 17.
        let mut a = router.line(1, IntxPin::A).unwrap();
        let mut b = router.line(5, IntxPin::A).unwrap();
        assert_eq!((a.gsi(), b.gsi()), (17, 17));
        a.set(true);
        b.set(true);
        a.set(false);
        assert!(b.asserted() && !a.asserted());
        b.set(false);
        a.set(false);
        assert_eq!(*chip.0.lock().unwrap(), vec![(17, true), (17, false)]);
        assert!(router.line(32, IntxPin::A).is_none());
        b.set(true);
        drop(b);
        assert_eq!(chip.0.lock().unwrap().last(), Some(&(17, false)));
    }

    #[test]
    fn update_follows_intx_disable() {
        let chip = Arc::new(Recorder::default());
        let router = IntxRouter::new(chip.clone());
        let mut line = router.line(2, IntxPin::A).unwrap();
        let mut config = ConfigSpace::new(PciIds {
            vendor: 1,
            device: 2,
            revision: 0,
            class: 0,
            subsystem_vendor: 0,
            subsystem: 0,
        });
        config.set_interrupt_pin(Some(IntxPin::A));
        config.write(4, 0, &COMMAND_INTX_DISABLE.to_le_bytes());
        line.update(&mut config, true);
        assert!(!line.asserted());
        assert_ne!(config.read(4) >> 16 & 8, 0, "status shows it pending");
        config.write(4, 0, &[0, 0]);
        line.update(&mut config, true);
        assert!(line.asserted());
        line.update(&mut config, false);
        assert_eq!(config.read(4) >> 16 & 8, 0);
        assert_eq!(*chip.0.lock().unwrap(), vec![(18, true), (18, false)]);
    }
}
