//! The one lifecycle every device follows: pause, resume, save, restore, reset.
//!
//! The machine keeps its devices in one list of [`Lifecycle`] objects. A snapshot or a
//! migration pauses all of them (each finishes its in-flight work: a block device completes
//! every request it has taken off a queue and writes its used entries), then saves each by
//! its [`Lifecycle::id`], then captures the vCPUs. Restore hands each device the state saved
//! under its id. Nothing in the VMM lists devices by hand.

use serde::{Deserialize, Serialize};

use crate::state::StateError;

/// A device's saved state: its own serde payload, tagged with the version of its layout so
/// a later build can refuse (or convert) an older one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceState {
    pub version: u32,
    pub data: serde_json::Value,
}

impl DeviceState {
    /// Wraps a device's state struct.
    pub fn new<T: Serialize>(version: u32, state: &T) -> Result<Self, LifecycleError> {
        let data = serde_json::to_value(state).map_err(|e| LifecycleError(e.to_string()))?;
        Ok(DeviceState { version, data })
    }

    /// Unwraps a state saved by [`DeviceState::new`], refusing any version but `version`.
    pub fn parse<T: for<'de> Deserialize<'de>>(
        &self,
        device: &'static str,
        version: u32,
    ) -> Result<T, StateError> {
        if self.version != version {
            return Err(StateError::new(
                device,
                format!(
                    "state version {} (this build reads {version})",
                    self.version
                ),
            ));
        }
        serde_json::from_value(self.data.clone())
            .map_err(|e| StateError::new(device, format!("malformed: {e}")))
    }
}

/// Why a device could not pause, resume or save.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LifecycleError(pub String);

/// Every device's lifecycle. Methods are called from the VMM's control path, never from a
/// vCPU thread's exit handler, and with every vCPU parked for `save` and `restore`.
pub trait Lifecycle: Send {
    /// Names the device in saved state; stable across builds ("serial", "pci-00:03.0").
    fn id(&self) -> String;
    /// Stops taking new work and finishes what is in flight, so that `save` sees a quiescent
    /// device. Calling it twice is harmless.
    fn pause(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// Undoes `pause`; a device restored while paused starts its work here (a virtio device
    /// re-kicks every queue).
    fn resume(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// Migration hand-over, source side: the destination holds the final state, so let go
    /// of the host resources it must take over (a disk image's lock). The machine is paused.
    fn hand_over(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// Takes those resources: a migration destination before its guest runs, or a source
    /// whose migration failed after `hand_over`.
    fn take_over(&mut self) -> Result<(), LifecycleError> {
        Ok(())
    }
    /// The device's guest-visible state.
    fn save(&self) -> Result<DeviceState, LifecycleError>;
    /// Loads a state `save` produced, refusing anything the device could never have had and
    /// then staying as it was.
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError>;
    /// Returns to the power-on state (a machine reset).
    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::acpi_pm::{AcpiPm, AcpiPmState};
    use crate::exit::ExitRequest;
    use crate::fw_cfg::{FwCfg, FwCfgState};
    use crate::i8042::{I8042State, I8042};
    use crate::irqchip::IrqPin;
    use crate::pit::{Pit, PitState};
    use crate::rtc::Rtc;
    use crate::serial::{NoIrq, SerialDevice, SerialState};

    fn exit() -> Arc<ExitRequest> {
        Arc::new(ExitRequest::new().unwrap())
    }

    fn serial() -> SerialDevice {
        SerialDevice::with_writer(Box::new(std::io::sink()), Arc::new(NoIrq))
    }

    /// Saves `from`, restores the state into `into` through the trait, and checks both now
    /// save the same; then checks that a state of another version is refused, naming the
    /// device, and leaves `into` as it was.
    fn round_trip(from: &dyn Lifecycle, into: &mut dyn Lifecycle, name: &str) {
        let saved = from.save().unwrap();
        assert_eq!(saved.version, 1, "{name}");
        into.restore(&saved).unwrap();
        assert_eq!(into.save().unwrap().data, saved.data, "{name}");
        let newer = DeviceState {
            version: 2,
            data: saved.data.clone(),
        };
        let err = into.restore(&newer).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("version 2"), "{err}");
        let garbage = DeviceState {
            version: 1,
            data: serde_json::json!({"nonsense": true}),
        };
        let err = into.restore(&garbage).unwrap_err().to_string();
        assert!(err.contains("malformed"), "{err}");
        assert_eq!(into.save().unwrap().data, saved.data, "{name}");
    }

    #[test]
    fn every_device_round_trips_through_device_state() {
        let mut s = serial();
        s.restore(&SerialState {
            scratch: 0x5a,
            interrupt_enable: 0x01,
            in_buffer: b"hi".to_vec(),
            ..Default::default()
        })
        .unwrap();
        round_trip(&s, &mut serial(), "serial");

        let mut k = I8042::new(exit());
        k.restore(&I8042State {
            ctr: 0x45,
            output: Some(0xfa),
            ..Default::default()
        })
        .unwrap();
        round_trip(&k, &mut I8042::new(exit()), "i8042");

        let mut f = FwCfg::new(2, 1 << 20);
        f.restore(&FwCfgState {
            selector: 0x19,
            offset: 3,
        })
        .unwrap();
        round_trip(&f, &mut FwCfg::new(2, 1 << 20), "fw_cfg");

        // A stopped clock, so the timer reads the same in both saves.
        let pm = || AcpiPm::with_clock(exit(), Arc::new(|| 5_000_000));
        round_trip(&pm(), &mut pm(), "ACPI PM");

        let rtc = Rtc::new(IrqPin::new(Arc::new(NoIrq), 8));
        round_trip(&rtc, &mut Rtc::new(IrqPin::new(Arc::new(NoIrq), 8)), "RTC");

        let mut pit = Pit::new();
        pit.restore(&PitState {
            port_b: 0x02,
            ..Default::default()
        })
        .unwrap();
        round_trip(&pit, &mut Pit::new(), "PIT");
        // The interrupt controllers' state (both modes, one format) is the vmm crate's
        // `irqchip` device, tested there.
    }

    /// `reset` brings each device back to what a new one saves.
    #[test]
    fn reset_returns_to_power_on() {
        let mut devices: Vec<(Box<dyn Lifecycle>, Box<dyn Lifecycle>)> = vec![
            (Box::new(serial()), Box::new(serial())),
            (Box::new(I8042::new(exit())), Box::new(I8042::new(exit()))),
            (
                Box::new(FwCfg::new(1, 1 << 20)),
                Box::new(FwCfg::new(1, 1 << 20)),
            ),
            (Box::new(Pit::new()), Box::new(Pit::new())),
        ];
        // Something other than power-on in each: the state of a used device of its kind.
        let used: Vec<serde_json::Value> = vec![
            serde_json::to_value(SerialState {
                scratch: 7,
                interrupt_enable: 0x03,
                ..Default::default()
            })
            .unwrap(),
            serde_json::to_value(I8042State {
                ctr: 0x20,
                output: Some(1),
                ..Default::default()
            })
            .unwrap(),
            serde_json::to_value(FwCfgState {
                selector: 0,
                offset: 2,
            })
            .unwrap(),
            serde_json::to_value(PitState {
                port_b: 0x02,
                ..Default::default()
            })
            .unwrap(),
        ];
        for ((device, fresh), data) in devices.iter_mut().zip(used) {
            let id = device.id();
            device.restore(&DeviceState { version: 1, data }).unwrap();
            assert_ne!(device.save().unwrap(), fresh.save().unwrap(), "{id}");
            device.reset();
            assert_eq!(device.save().unwrap(), fresh.save().unwrap(), "{id}");
        }
    }

    #[test]
    fn acpi_pm_reset_clears_the_registers_and_keeps_the_timer() {
        let mut pm = AcpiPm::new(exit());
        let before = pm.state();
        pm.restore(&AcpiPmState {
            pm1_enable: 0x0001,
            pm1_control: 0x0400,
            ..before
        })
        .unwrap();
        Lifecycle::reset(&mut pm);
        let after = pm.state();
        assert_eq!(
            (after.pm1_status, after.pm1_enable, after.pm1_control),
            (0, 0, 0)
        );
        assert!(after.timer_ticks >= before.timer_ticks);
    }

    #[test]
    fn rtc_reset_is_the_chip_reset_input() {
        use crate::irqchip::IrqChip;
        use crate::rtc::RtcState;
        use std::sync::atomic::{AtomicBool, Ordering};

        #[derive(Default)]
        struct Line(AtomicBool);
        impl IrqChip for Line {
            fn set_irq(&self, _: u32, level: bool) {
                self.0.store(level, Ordering::SeqCst);
            }
        }
        let line = Arc::new(Line::default());
        let mut rtc = Rtc::new(IrqPin::new(line.clone(), 8));
        let mut s = RtcState::default();
        s.cmos[0x0b] |= 0x40 | 0x08; // PIE, SQWE
        s.cmos[0x0c] = 0x80 | 0x40; // IRQF, PF
        s.cmos[0x20] = 0xab; // CMOS RAM
        s.offset_secs = 3600;
        rtc.restore(&s).unwrap();
        assert!(line.0.load(Ordering::SeqCst));
        Lifecycle::reset(&mut rtc);
        let after = rtc.state();
        assert!(!line.0.load(Ordering::SeqCst), "IRQ 8 must drop");
        assert_eq!(after.cmos[0x0b], RtcState::default().cmos[0x0b]);
        assert_eq!(after.cmos[0x0c], 0);
        assert_eq!((after.cmos[0x20], after.offset_secs), (0xab, 3600));
    }
}
