//! The machine's state apart from RAM: what a snapshot or a migration carries in its `State`
//! frame. Serialised as JSON, versioned through the stream format.

use std::sync::{Arc, Mutex, MutexGuard};

use devices::acpi_pm::{AcpiPm, AcpiPmState};
use devices::fw_cfg::{FwCfg, FwCfgState};
use devices::i8042::{I8042State, I8042};
use devices::irqchip::{SplitIrqChip, SplitIrqChipState};
use devices::pit::{Pit, PitState};
use devices::rtc::{Rtc, RtcState};
use devices::serial::{SerialDevice, SerialState};
use devices::{DeviceState, Lifecycle};
use hypervisor::{ClockData, IrqChipState, VcpuState, Vm};
use pci::{HostBridge, PciBus};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Handles on the devices whose state travels with the machine.
#[derive(Clone)]
pub struct DeviceHandles {
    pub serial: Arc<Mutex<SerialDevice>>,
    pub i8042: Arc<Mutex<I8042>>,
    pub fw_cfg: Arc<Mutex<FwCfg>>,
    pub acpi_pm: Arc<Mutex<AcpiPm>>,
    /// Absent where the kernel models the RTC (bhyve).
    pub rtc: Option<Arc<Mutex<Rtc>>>,
    /// Split irqchip mode only.
    pub pit: Option<Arc<Mutex<Pit>>>,
    pub split: Option<Arc<SplitIrqChip>>,
    /// The PCI platform (see [`PciHandles`]).
    pub pci: PciHandles,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DevicesState {
    pub serial: SerialState,
    pub i8042: I8042State,
    pub fw_cfg: FwCfgState,
    pub acpi_pm: AcpiPmState,
    /// `None` where the kernel models the RTC; its state travels with the kernel's.
    #[serde(default)]
    pub rtc: Option<RtcState>,
    pub pit: Option<PitState>,
    pub split_irqchip: Option<SplitIrqChipState>,
    /// Absent in snapshots from before the PCI platform: it then stays as built.
    #[serde(default)]
    pub pci: Option<PciState>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub vcpus: Vec<VcpuState>,
    /// Kernel irqchip mode: the in-kernel PIC, IOAPIC and PIT.
    pub kernel_irqchip: Option<IrqChipState>,
    pub clock: ClockData,
    pub devices: DevicesState,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn restore_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::State(format!("{what}: {e}"))
}

/// Restores a device this machine may or may not have: both present, restore; both absent,
/// nothing to do; one without the other, the state belongs to another machine shape.
fn restore_if_present<D, S>(
    device: Option<&D>,
    state: Option<&S>,
    mismatch: &str,
    restore: impl FnOnce(&D, &S) -> Result<()>,
) -> Result<()> {
    match (device, state) {
        (Some(d), Some(s)) => restore(d, s),
        (None, None) => Ok(()),
        _ => Err(Error::State(mismatch.into())),
    }
}

// ---- PCI platform: its Lifecycle objects, saved and restored in this order ----

/// The PCI bus and its host bridge. Functions added later save their own state; the bus
/// records BAR placements and command registers and is restored after them.
#[derive(Clone)]
pub struct PciHandles {
    pub bus: Arc<PciBus>,
    pub host_bridge: Arc<Mutex<HostBridge>>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PciState {
    pub host_bridge: DeviceState,
    pub bus: DeviceState,
}

impl PciHandles {
    pub(crate) fn save(&self) -> Result<PciState> {
        let err = |e: devices::LifecycleError| Error::State(format!("PCI: {e}"));
        // Separate statements: the bus locks the host bridge too, so its guard must be gone.
        let host_bridge = lock(&self.host_bridge).save().map_err(err)?;
        let bus = self.bus.save().map_err(err)?;
        Ok(PciState { host_bridge, bus })
    }

    pub(crate) fn restore(&self, state: &PciState) -> Result<()> {
        lock(&self.host_bridge)
            .restore(&state.host_bridge)
            .map_err(|e| restore_err("PCI host bridge", e))?;
        self.bus
            .restore_saved(&state.bus)
            .map_err(|e| restore_err("PCI bus", e))
    }
}

// ---- end of PCI platform ----

impl DeviceHandles {
    pub fn save(&self) -> Result<DevicesState> {
        Ok(DevicesState {
            serial: lock(&self.serial).state(),
            i8042: lock(&self.i8042).state(),
            fw_cfg: lock(&self.fw_cfg).state(),
            acpi_pm: lock(&self.acpi_pm).state(),
            rtc: self.rtc.as_ref().map(|r| lock(r).state()),
            pit: self.pit.as_ref().map(|p| lock(p).state()),
            split_irqchip: self.split.as_ref().map(|s| s.state()),
            pci: Some(self.pci.save()?),
        })
    }

    pub fn restore(&self, state: &DevicesState) -> Result<()> {
        lock(&self.serial)
            .restore(&state.serial)
            .map_err(|e| restore_err("serial", e))?;
        lock(&self.i8042)
            .restore(&state.i8042)
            .map_err(|e| restore_err("i8042", e))?;
        lock(&self.fw_cfg)
            .restore(&state.fw_cfg)
            .map_err(|e| restore_err("fw_cfg", e))?;
        lock(&self.acpi_pm)
            .restore(&state.acpi_pm)
            .map_err(|e| restore_err("ACPI PM", e))?;
        restore_if_present(
            self.rtc.as_ref(),
            state.rtc.as_ref(),
            "the RTC state is from an accelerator that models it elsewhere",
            |rtc, s| lock(rtc).restore(s).map_err(|e| restore_err("RTC", e)),
        )?;
        restore_if_present(
            self.pit.as_ref(),
            state.pit.as_ref(),
            "the PIT belongs to another irqchip mode",
            |pit, s| lock(pit).restore(s).map_err(|e| restore_err("PIT", e)),
        )?;
        restore_if_present(
            self.split.as_ref(),
            state.split_irqchip.as_ref(),
            "the state is from another irqchip mode",
            |chip, s| chip.restore(s).map_err(|e| restore_err("irqchip", e)),
        )?;
        if let Some(pci) = &state.pci {
            self.pci.restore(pci)?;
        }
        Ok(())
    }
}

impl MachineState {
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::State(e.to_string()))
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).map_err(|e| Error::State(format!("malformed state: {e}")))
    }

    /// Restores everything but the vCPUs (which are restored on creation) and RAM.
    pub fn restore_platform(&self, vm: &dyn Vm, devices: &DeviceHandles) -> Result<()> {
        if let Some(chip) = &self.kernel_irqchip {
            vm.set_irqchip_state(chip)?;
        }
        devices.restore(&self.devices)?;
        vm.set_clock(&self.clock)?;
        Ok(())
    }
}
