//! The machine's state apart from RAM: what a snapshot or a migration carries in its `State`
//! frame, serialised as JSON. Devices travel as one map from each device's id to its
//! versioned [`DeviceState`]; the machine's [`DeviceList`] names them, and nothing here lists
//! devices by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use devices::{DeviceState, Lifecycle};
use hypervisor::{ClockData, IrqChipState, VcpuState, Vm};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// The layout of [`MachineState`] this build writes. Format 1 (no `format` field) is what
/// builds before the device list wrote: one named field per device. Format 2 kept the
/// in-kernel interrupt controllers apart (`kernel_irqchip`) and the split ones as the device
/// `split_irqchip`; format 3 has both modes as the one device `irqchip`; format 4 saves the
/// machine's listed devices (virtio) under their device ids, not their PCI addresses
/// (`pci-00:03.0`). 1 to 3 are still read.
pub const STATE_FORMAT: u32 = 4;

/// A device as the machine's list holds it.
pub type SharedDevice = Arc<Mutex<dyn Lifecycle>>;

fn lock(device: &SharedDevice) -> MutexGuard<'_, dyn Lifecycle + 'static> {
    device.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every device of the machine, in one ordered list: what a snapshot saves, a migration
/// carries and a pause stops. Devices are paused, saved and restored in list order and
/// resumed in reverse; the machine adds its interrupt controller last, so that lines other
/// devices drive while they are restored end in the controller's saved state.
#[derive(Clone, Default)]
pub struct DeviceList {
    /// Each device with its id, read once when it was added (ids are stable).
    devices: Vec<(String, SharedDevice)>,
    /// (former id, id): the ids states before format 4 saved devices under.
    former_ids: Vec<(String, String)>,
}

impl DeviceList {
    /// Appends a device; refuses a second device with the same id.
    pub fn add(&mut self, device: SharedDevice) -> Result<()> {
        let id = lock(&device).id();
        if self.devices.iter().any(|(known, _)| *known == id) {
            return Err(Error::Devices(format!("two devices with the id {id:?}")));
        }
        self.devices.push((id, device));
        Ok(())
    }

    /// States before format 4 saved the device `id` as `former`.
    pub fn add_former_id(&mut self, former: String, id: String) {
        self.former_ids.push((former, id));
    }

    /// `states` with the former ids of this list's devices renamed to their ids.
    fn with_current_ids(
        &self,
        states: &BTreeMap<String, DeviceState>,
    ) -> BTreeMap<String, DeviceState> {
        let mut states = states.clone();
        for (former, id) in &self.former_ids {
            if let Some(state) = states.remove(former) {
                states.insert(id.clone(), state);
            }
        }
        states
    }

    /// The devices' ids, in list order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.devices.iter().map(|(id, _)| id.as_str())
    }

    /// Pauses every device. If one fails, those already paused are resumed again and the
    /// error names the device.
    pub fn pause(&self) -> Result<()> {
        for (i, (id, device)) in self.devices.iter().enumerate() {
            if let Err(e) = lock(device).pause() {
                // Errors resuming are logged; the pause failure is the one to report.
                let _ = self.resume_first(i);
                return Err(Error::Devices(format!("pausing {id}: {e}")));
            }
        }
        Ok(())
    }

    /// Resumes every device, even after one fails; the first failure is returned.
    pub fn resume(&self) -> Result<()> {
        self.resume_first(self.devices.len())
    }

    /// Resumes the first `count` devices, last first.
    fn resume_first(&self, count: usize) -> Result<()> {
        let mut first_error = None;
        for (id, device) in self.devices[..count].iter().rev() {
            if let Err(e) = lock(device).resume() {
                log::error!("resuming {id}: {e}");
                first_error.get_or_insert(Error::Devices(format!("resuming {id}: {e}")));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Migration hand-over on the source: every device lets go of what the destination must
    /// take over (disk image locks). Stops at the first failure, naming the device.
    pub fn hand_over(&self) -> Result<()> {
        for (id, device) in &self.devices {
            lock(device)
                .hand_over()
                .map_err(|e| Error::Devices(format!("handing over {id}: {e}")))?;
        }
        Ok(())
    }

    /// Every device takes what `hand_over` let go of: a migration destination before its
    /// guest runs, or a source taking it back. Stops at the first failure, naming it.
    pub fn take_over(&self) -> Result<()> {
        for (id, device) in &self.devices {
            lock(device)
                .take_over()
                .map_err(|e| Error::Devices(format!("{id}: {e}")))?;
        }
        Ok(())
    }

    /// Every device's state, by id.
    pub fn save(&self) -> Result<BTreeMap<String, DeviceState>> {
        self.devices
            .iter()
            .map(|(id, device)| {
                let state = lock(device)
                    .save()
                    .map_err(|e| Error::State(format!("saving {id}: {e}")))?;
                Ok((id.clone(), state))
            })
            .collect()
    }

    /// Hands each device the state saved under its id. The ids must match this machine's
    /// exactly: a state with a device this machine lacks, or without one it has, comes
    /// from another machine shape and is refused, naming the devices, before any device
    /// is touched.
    #[cfg(test)]
    pub fn restore(&self, states: &BTreeMap<String, DeviceState>) -> Result<()> {
        self.restore_keeping(states, &[])
    }

    /// [`DeviceList::restore`], except that the devices named in `keep` may be absent from
    /// `states`: they stay as built (a state from before they existed).
    pub fn restore_keeping(
        &self,
        states: &BTreeMap<String, DeviceState>,
        keep: &[&str],
    ) -> Result<()> {
        let ours: BTreeSet<&str> = self.ids().collect();
        let unknown: Vec<&str> = states
            .keys()
            .map(String::as_str)
            .filter(|id| !ours.contains(id))
            .collect();
        let missing: Vec<&str> = self
            .ids()
            .filter(|id| !states.contains_key(*id) && !keep.contains(id))
            .collect();
        if !unknown.is_empty() || !missing.is_empty() {
            return Err(Error::State(shape_mismatch(&unknown, &missing)));
        }
        for (id, device) in &self.devices {
            if let Some(state) = states.get(id) {
                lock(device)
                    .restore(state)
                    .map_err(|e| Error::State(format!("restoring {id}: {e}")))?;
            }
        }
        Ok(())
    }
}

fn shape_mismatch(unknown: &[&str], missing: &[&str]) -> String {
    let mut parts = Vec::new();
    if !unknown.is_empty() {
        parts.push(format!(
            "it has state for {} that this machine does not have",
            unknown.join(", ")
        ));
    }
    if !missing.is_empty() {
        parts.push(format!("it has no state for {}", missing.join(", ")));
    }
    format!(
        "the saved devices do not match this machine ({}): the state comes from a machine \
         of another shape (irqchip mode, accelerator or device set)",
        parts.join("; ")
    )
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineState {
    /// [`STATE_FORMAT`].
    pub format: u32,
    pub vcpus: Vec<VcpuState>,
    /// Formats 1 and 2 only (read, then moved into the `irqchip` device): the in-kernel PIC,
    /// IOAPIC and PIT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_irqchip: Option<IrqChipState>,
    pub clock: ClockData,
    /// Each device's state by its id.
    pub devices: BTreeMap<String, DeviceState>,
    /// Read from a format 1 state, made before machines had a PCI platform: its host
    /// bridge and bus stay as built.
    #[serde(skip)]
    pub predates_pci: bool,
    /// Read from a state before format 4: devices of the machine's list are saved under
    /// their PCI addresses.
    #[serde(skip)]
    pub pci_addressed: bool,
    /// The guest was paused when it was saved: a migration destination keeps it paused.
    #[serde(default)]
    pub paused: bool,
}

/// The devices every machine has had since the PCI platform (format 2); a format 1 state
/// lacks them.
const PCI_PLATFORM_IDS: [&str; 2] = ["pci-00:00.0", "pci-bus"];

/// The devices of a format 1 state: one field per device, named as the ids are now, and
/// `split_irqchip`; absent devices were `null`. Their payloads are the version 1 layouts.
fn devices_from_format_1(devices: Value) -> Result<BTreeMap<String, DeviceState>> {
    let Value::Object(fields) = devices else {
        return Err(Error::State(
            "malformed state: the devices are not an object".into(),
        ));
    };
    Ok(fields
        .into_iter()
        .filter(|(_, data)| !data.is_null())
        .map(|(id, data)| (id, DeviceState { version: 1, data }))
        .collect())
}

impl MachineState {
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::State(e.to_string()))
    }

    /// Reads a state of this build's format, or of format 1 (converted), and refuses a
    /// newer one with an error that says so.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let malformed = |e: serde_json::Error| Error::State(format!("malformed state: {e}"));
        let mut value: Value = serde_json::from_slice(bytes).map_err(malformed)?;
        let format = value.get("format").map_or(Some(1), Value::as_u64);
        match format {
            Some(1) => {
                let legacy = value
                    .get_mut("devices")
                    .map(Value::take)
                    .unwrap_or(Value::Null);
                let devices = devices_from_format_1(legacy)?;
                if let Value::Object(fields) = &mut value {
                    fields.insert("format".into(), STATE_FORMAT.into());
                    fields.insert(
                        "devices".into(),
                        serde_json::to_value(devices).map_err(malformed)?,
                    );
                }
                let mut state: MachineState = serde_json::from_value(value).map_err(malformed)?;
                state.predates_pci = true;
                state.pci_addressed = true;
                state.merge_irqchip_state()?;
                Ok(state)
            }
            Some(2) => {
                let mut state: MachineState = serde_json::from_value(value).map_err(malformed)?;
                state.pci_addressed = true;
                state.merge_irqchip_state()?;
                Ok(state)
            }
            Some(3) => {
                let mut state: MachineState = serde_json::from_value(value).map_err(malformed)?;
                state.pci_addressed = true;
                Ok(state)
            }
            Some(n) if n == u64::from(STATE_FORMAT) => {
                serde_json::from_value(value).map_err(malformed)
            }
            _ => Err(Error::State(format!(
                "state format {} was made by a newer build (this build reads formats 1 to \
                 {STATE_FORMAT})",
                value["format"]
            ))),
        }
    }

    /// Formats 1 and 2 kept the interrupt controllers apart: into the `irqchip` device.
    fn merge_irqchip_state(&mut self) -> Result<()> {
        use crate::irqchip::{IrqChipSavedState, IRQCHIP_ID, IRQCHIP_STATE_VERSION};
        let saved = match (
            self.kernel_irqchip.take(),
            self.devices.remove("split_irqchip"),
        ) {
            (Some(chips), None) => IrqChipSavedState::Kernel { chips },
            (None, Some(split)) => IrqChipSavedState::Split {
                chips: split
                    .parse("split irqchip", 1)
                    .map_err(|e| Error::State(e.to_string()))?,
            },
            (None, None) => return Ok(()),
            (Some(_), Some(_)) => {
                return Err(Error::State(
                    "malformed state: both kernel and split interrupt controllers".into(),
                ))
            }
        };
        let device = DeviceState::new(IRQCHIP_STATE_VERSION, &saved)
            .map_err(|e| Error::State(e.to_string()))?;
        self.devices.insert(IRQCHIP_ID.into(), device);
        Ok(())
    }

    /// Restores everything but the vCPUs (which are restored on creation) and RAM.
    pub fn restore_platform(&self, vm: &dyn Vm, devices: &DeviceList) -> Result<()> {
        let keep: &[&str] = if self.predates_pci {
            &PCI_PLATFORM_IDS
        } else {
            &[]
        };
        if self.pci_addressed {
            devices.restore_keeping(&devices.with_current_ids(&self.devices), keep)?;
        } else {
            devices.restore_keeping(&self.devices, keep)?;
        }
        vm.set_clock(&self.clock)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devices::{LifecycleError, StateError};
    use serde_json::json;

    /// A device holding one number; counts pauses and resumes, and can refuse to pause.
    struct Counter {
        id: &'static str,
        value: u64,
        paused: u32,
        resumed: u32,
        refuse_pause: bool,
    }

    fn counter(id: &'static str, value: u64) -> Arc<Mutex<Counter>> {
        Arc::new(Mutex::new(Counter {
            id,
            value,
            paused: 0,
            resumed: 0,
            refuse_pause: false,
        }))
    }

    impl Lifecycle for Counter {
        fn id(&self) -> String {
            self.id.into()
        }
        fn pause(&mut self) -> std::result::Result<(), LifecycleError> {
            if self.refuse_pause {
                return Err(LifecycleError("busy".into()));
            }
            self.paused += 1;
            Ok(())
        }
        fn resume(&mut self) -> std::result::Result<(), LifecycleError> {
            self.resumed += 1;
            Ok(())
        }
        fn save(&self) -> std::result::Result<DeviceState, LifecycleError> {
            DeviceState::new(1, &self.value)
        }
        fn restore(&mut self, state: &DeviceState) -> std::result::Result<(), StateError> {
            self.value = state.parse("counter", 1)?;
            Ok(())
        }
    }

    fn list(devices: &[&Arc<Mutex<Counter>>]) -> DeviceList {
        let mut list = DeviceList::default();
        for d in devices {
            let shared: SharedDevice = (*d).clone();
            list.add(shared).unwrap();
        }
        list
    }

    #[test]
    fn states_round_trip_by_id() {
        let (a, b) = (counter("a", 1), counter("b", 2));
        let saved = list(&[&a, &b]).save().unwrap();
        assert_eq!(saved.keys().collect::<Vec<_>>(), ["a", "b"]);
        let (c, d) = (counter("b", 0), counter("a", 0));
        list(&[&c, &d]).restore(&saved).unwrap();
        assert_eq!((c.lock().unwrap().value, d.lock().unwrap().value), (2, 1));
    }

    #[test]
    fn unknown_or_missing_ids_are_refused_by_name_before_anything_changes() {
        let (a, b) = (counter("serial", 1), counter("pit", 2));
        let saved = list(&[&a, &b]).save().unwrap();

        let (x, y) = (counter("serial", 9), counter("rtc", 9));
        let err = list(&[&x, &y]).restore(&saved).unwrap_err().to_string();
        assert!(
            err.contains("state for pit that this machine does not have"),
            "{err}"
        );
        assert!(err.contains("no state for rtc"), "{err}");
        assert_eq!(x.lock().unwrap().value, 9, "nothing restored");

        let only_serial = list(&[&counter("serial", 0)]);
        let err = only_serial.restore(&saved).unwrap_err().to_string();
        assert!(err.contains("pit") && !err.contains("no state"), "{err}");
        let with_extra = list(&[&counter("serial", 0), &counter("pit", 0), &y]);
        let err = with_extra.restore(&saved).unwrap_err().to_string();
        assert!(err.contains("no state for rtc"), "{err}");
        assert!(err.contains("another shape"), "{err}");
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let mut l = list(&[&counter("a", 1)]);
        let dup: SharedDevice = counter("a", 2);
        assert!(l.add(dup).unwrap_err().to_string().contains("\"a\""));
    }

    #[test]
    fn a_failed_pause_resumes_the_devices_already_paused() {
        let (a, b, c) = (counter("a", 0), counter("b", 0), counter("c", 0));
        b.lock().unwrap().refuse_pause = true;
        let err = list(&[&a, &b, &c]).pause().unwrap_err().to_string();
        assert!(err.contains("pausing b: busy"), "{err}");
        let a = a.lock().unwrap();
        assert_eq!((a.paused, a.resumed), (1, 1));
        assert_eq!(c.lock().unwrap().paused, 0);
    }

    #[test]
    fn format_1_states_are_converted_and_newer_ones_refused() {
        let v1 = json!({
            "vcpus": [],
            "kernel_irqchip": null,
            "clock": {"clock_ns": 5, "flags": 0},
            "devices": {
                "serial": {"scratch": 1},
                "i8042": {"ctr": 69},
                "rtc": null,
                "pit": null,
                "split_irqchip": devices::irqchip::SplitIrqChipState::default(),
            },
        });
        let state = MachineState::from_bytes(&serde_json::to_vec(&v1).unwrap()).unwrap();
        assert_eq!(state.format, STATE_FORMAT);
        assert_eq!(state.clock.clock_ns, 5);
        assert_eq!(
            state.devices.keys().collect::<Vec<_>>(),
            ["i8042", "irqchip", "serial"]
        );
        assert_eq!(state.devices["irqchip"].data["mode"], "split");
        assert_eq!(
            state.devices["i8042"],
            DeviceState {
                version: 1,
                data: json!({"ctr": 69})
            }
        );
        let again = MachineState::from_bytes(&state.to_bytes().unwrap()).unwrap();
        assert_eq!(again.devices, state.devices);

        let mut newer = serde_json::to_value(&state).unwrap();
        newer["format"] = json!(STATE_FORMAT + 1);
        let err = MachineState::from_bytes(&serde_json::to_vec(&newer).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("newer build") && err.contains(&format!("format {}", STATE_FORMAT + 1)),
            "{err}"
        );
    }

    /// States before format 4 saved the listed devices under their PCI addresses: they are
    /// restored into the devices of those addresses, now named by id.
    #[test]
    fn states_before_format_4_name_listed_devices_by_pci_address() {
        let (serial, disk) = (counter("serial", 0), counter("disk0", 0));
        let mut devices = list(&[&serial, &disk]);
        devices.add_former_id("pci-00:03.0".into(), "disk0".into());
        let v3 = json!({"format": 3, "vcpus": [], "clock": {"clock_ns": 5, "flags": 0},
            "devices": {"serial": {"version": 1, "data": 4},
                        "pci-00:03.0": {"version": 1, "data": 7}}});
        let state = MachineState::from_bytes(&serde_json::to_vec(&v3).unwrap()).unwrap();
        let vm = crate::irqchip::FakeVm::default();
        // The fake has no clock: the devices are restored before it is asked.
        let clock = state.restore_platform(&vm, &devices).unwrap_err();
        assert!(clock.to_string().contains("not in the fake"), "{clock}");
        assert_eq!(disk.lock().unwrap().value, 7);
        assert_eq!(serial.lock().unwrap().value, 4);
        // This format names them by id only.
        let mut v4 = v3.clone();
        v4["format"] = json!(4);
        let state = MachineState::from_bytes(&serde_json::to_vec(&v4).unwrap()).unwrap();
        let err = state.restore_platform(&vm, &devices).unwrap_err();
        assert!(err.to_string().contains("pci-00:03.0"), "{err}");
    }

    /// Format 2 kept the in-kernel controllers in `kernel_irqchip`: they become the
    /// `irqchip` device, and a state with both kinds is refused.
    #[test]
    fn format_2_interrupt_controllers_become_the_irqchip_device() {
        let chips = IrqChipState {
            backend: "kvm".into(),
            pic_master: vec![1; 16],
            ..Default::default()
        };
        let v2 = json!({
            "format": 2,
            "vcpus": [],
            "kernel_irqchip": chips,
            "clock": {"clock_ns": 5, "flags": 0},
            "devices": {"serial": {"version": 1, "data": {"scratch": 1}}},
        });
        let state = MachineState::from_bytes(&serde_json::to_vec(&v2).unwrap()).unwrap();
        assert!(state.kernel_irqchip.is_none());
        let device = &state.devices["irqchip"];
        assert_eq!(device.version, crate::irqchip::IRQCHIP_STATE_VERSION);
        assert_eq!(
            device
                .parse::<crate::irqchip::IrqChipSavedState>("irqchip", 1)
                .unwrap(),
            crate::irqchip::IrqChipSavedState::Kernel { chips }
        );
        let written = String::from_utf8(state.to_bytes().unwrap()).unwrap();
        assert!(!written.contains("kernel_irqchip"), "{written}");

        let mut both = v2.clone();
        both["devices"]["split_irqchip"] = json!({"version": 1, "data": {}});
        let err = MachineState::from_bytes(&serde_json::to_vec(&both).unwrap()).unwrap_err();
        assert!(err.to_string().contains("both"), "{err}");
    }

    /// A format 1 state as builds before the device list wrote it (the device structs
    /// themselves, by field) restores into the devices of a machine of the same shape.
    #[test]
    fn format_1_device_payloads_restore_into_real_devices() {
        use devices::irqchip::{IrqPin, SplitIrqChipState};
        use devices::{acpi_pm, fw_cfg, i8042, pit, rtc, serial};
        let exit = Arc::new(devices::ExitRequest::new().unwrap());
        let no_irq = Arc::new(serial::NoIrq);
        let vm = Arc::new(crate::irqchip::FakeVm::default());
        let chip = crate::irqchip::SplitMachineIrqChip::create(vm).unwrap();
        let shared: Vec<SharedDevice> = vec![
            Arc::new(Mutex::new(serial::SerialDevice::with_writer(
                Box::new(std::io::sink()),
                no_irq.clone(),
            ))),
            Arc::new(Mutex::new(i8042::I8042::new(exit.clone()))),
            Arc::new(Mutex::new(fw_cfg::FwCfg::new(1, 1 << 20))),
            Arc::new(Mutex::new(acpi_pm::AcpiPm::new(exit))),
            Arc::new(Mutex::new(pit::Pit::new())),
            Arc::new(Mutex::new(rtc::Rtc::new(IrqPin::new(no_irq, 8)))),
            crate::irqchip::IrqChipDevice::shared(Arc::new(chip)),
        ];
        let mut machine = DeviceList::default();
        for d in shared {
            machine.add(d).unwrap();
        }
        let serial_state = serial::SerialState {
            scratch: 0x42,
            ..Default::default()
        };
        let v1 = json!({
            "vcpus": [],
            "kernel_irqchip": null,
            "clock": {"clock_ns": 1, "flags": 0},
            "devices": {
                "serial": serial_state,
                "i8042": i8042::I8042State::default(),
                "fw_cfg": fw_cfg::FwCfgState::default(),
                "acpi_pm": acpi_pm::AcpiPm::new(Arc::new(devices::ExitRequest::new().unwrap()))
                    .state(),
                "rtc": rtc::RtcState::default(),
                "pit": pit::PitState::default(),
                "split_irqchip": SplitIrqChipState::default(),
            },
        });
        let state = MachineState::from_bytes(&serde_json::to_vec(&v1).unwrap()).unwrap();
        machine.restore(&state.devices).unwrap();
        assert_eq!(
            machine.save().unwrap()["serial"].data,
            serde_json::to_value(serial_state).unwrap()
        );
    }
}
