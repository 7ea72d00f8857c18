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
    /// The device's guest-visible state.
    fn save(&self) -> Result<DeviceState, LifecycleError>;
    /// Loads a state `save` produced, refusing anything the device could never have had and
    /// then staying as it was.
    fn restore(&mut self, state: &DeviceState) -> Result<(), StateError>;
    /// Returns to the power-on state (a machine reset).
    fn reset(&mut self) {}
}
