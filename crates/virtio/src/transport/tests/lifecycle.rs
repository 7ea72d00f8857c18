//! Pause, save, restore, resume (with re-kick), and the power-on reset.

use std::mem::offset_of;

use super::*;

/// A machine mid-flight: MSI-X on, both queues active, a few requests served.
fn busy_rig(mem: &Arc<Mem>) -> (Rig, [MockSplitQueue<'_, Mem>; 2]) {
    let mut rig = Rig::on(mem.clone());
    rig.dev.bar_moved(0, Some(0xc000_0000));
    rig.msix_control(true, false);
    for v in 0..3 {
        rig.program_vector(v);
    }
    rig.mask_vector(2, true);
    let mut rings = rig.bring_up(mem, EVENT_IDX);
    rig.set_config_vector(0);
    rig.set_queue_vector(0, 1);
    rig.set_queue_vector(1, 2);
    for _ in 0..3 {
        rings[0].add_chain(1).unwrap();
    }
    rings[1].add_chain(1).unwrap();
    assert_eq!(serve(&rig.log), 4);
    // Queue 1's vector is masked: its interrupt is pending.
    assert_eq!(rig.read(rig.dev.layout().pba_offset, 8), 0b100);
    lock(&rig.log).config = [9; 8];
    (rig, rings)
}

#[test]
fn save_restore_resume_round_trip() {
    let mem = memory();
    let (mut rig, mut rings) = busy_rig(&mem);
    rig.dev.pause().unwrap();
    assert_eq!(lock(&rig.log).calls.last(), Some(&"pause"));
    let saved = rig.dev.save().unwrap();
    let json = serde_json::to_string(&saved).unwrap();

    // A new machine over the same guest memory (as after a migration).
    let mut other = Rig::on(mem.clone());
    other.dev.bar_moved(0, Some(0xc000_0000));
    let state: DeviceState = serde_json::from_str(&json).unwrap();
    other.dev.restore(&state).unwrap();
    assert_eq!(lock(&other.log).config, [9; 8]);
    // Every MSI-X route is published again.
    let updates = other.msi.take();
    assert_eq!(updates.len(), 3);
    assert!(updates.contains(&MsiEvent::Update(2, None)));
    assert!(!other.dev.is_active(), "activation waits for resume");
    // The guest-visible registers are back.
    assert_eq!(other.status(), rig.status());
    assert_eq!(other.set_queue_vector(1, 2), 2);
    assert_eq!(other.dev.config_read(0x10), 0xc000_0004);
    assert_eq!(other.read(other.dev.layout().pba_offset, 8), 0b100);

    other.dev.resume().unwrap();
    assert!(other.dev.is_active());
    assert_eq!(lock(&other.log).calls, ["activate", "resume"]);
    let wakers = other.dev.notify_events();
    assert!(wakers.iter().all(|(_, w)| w.drain()), "every queue kicked");
    {
        let log = lock(&other.log);
        assert_eq!(log.features, VERSION_1 | EVENT_IDX);
        let positions: Vec<(u16, u16, u16, bool)> = log
            .queues
            .iter()
            .map(|q| {
                let s = q.queue.state();
                (q.index, s.next_avail, s.next_used, s.event_idx_enabled)
            })
            .collect();
        assert_eq!(positions, [(0, 3, 3, true), (1, 1, 1, true)]);
    }
    // The restored device carries on where the old one stopped.
    rings[0].add_chain(1).unwrap();
    assert_eq!(serve(&other.log), 1);
    assert_eq!(rings[0].used().idx().load(), 4);
    // A later save of the restored machine is the same state but for the positions moved.
    let again = other.dev.save().unwrap();
    assert_eq!(again.version, saved.version);
}

#[test]
fn save_of_an_idle_device_and_restore_without_activation() {
    let mut rig = Rig::new();
    rig.negotiate(VERSION_1);
    let saved = rig.dev.save().unwrap();
    let mut other = Rig::new();
    other.dev.restore(&saved).unwrap();
    other.dev.resume().unwrap();
    assert!(!other.dev.is_active());
    assert_eq!(lock(&other.log).calls, ["resume"]);
    assert_eq!(
        other.status(),
        STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK
    );
    assert_eq!(other.dev.save().unwrap(), saved);
}

#[test]
fn restore_with_rings_outside_memory_needs_reset_instead_of_failing() {
    let mem = memory();
    let (mut rig, _rings) = busy_rig(&mem);
    rig.dev.pause().unwrap();
    let saved = rig.dev.save().unwrap();
    // Restored onto a machine with less memory than the rings need.
    let small = Arc::new(Mem::from_ranges(&[(GuestAddress(0), 0x2000)]).unwrap());
    let mut other = Rig::on(small);
    other.dev.restore(&saved).unwrap();
    other.msi.take();
    other.dev.resume().unwrap();
    assert!(!other.dev.is_active());
    assert_ne!(other.status() & STATUS_NEEDS_RESET, 0);
    assert_eq!(other.msi.fires(), [0], "configuration interrupt");
}

#[test]
fn restore_refuses_states_that_cannot_be() {
    let mem = memory();
    let (mut rig, _rings) = busy_rig(&mem);
    rig.dev.pause().unwrap();
    let saved = rig.dev.save().unwrap();
    let mut other = Rig::new();
    let pristine = other.dev.save().unwrap();
    let tamper = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut state = saved.clone();
        f(&mut state.data);
        state
    };
    let bad = [
        tamper(&|d| d["queues"].as_array_mut().unwrap().truncate(1)),
        tamper(&|d| d["queues"][0]["msix_vector"] = 3.into()),
        tamper(&|d| d["queues"][0]["size"] = 12.into()),
        tamper(&|d| d["queues"][1]["desc"] = 0x1008.into()),
        tamper(&|d| d["config_msix_vector"] = 9.into()),
        tamper(&|d| d["status"] = (STATUS_ACKNOWLEDGE | STATUS_DRIVER_OK).into()),
        tamper(&|d| d["status"] = 0x3f.into()),
        tamper(&|d| d["driver_features"] = (1u64 << 5).into()),
        tamper(&|d| d["isr"] = 4.into()),
        tamper(&|d| d["header"]["command"] = 0xffff.into()),
        tamper(&|d| d["header"]["bar_address"] = 0xc000_0100u64.into()),
        tamper(&|d| {
            d["msix"]["table"]
                .as_array_mut()
                .unwrap()
                .pop()
                .map(drop)
                .unwrap()
        }),
        tamper(&|d| d["device"]["version"] = 8.into()),
        tamper(&|d| d["nonsense"] = 1.into()),
        DeviceState {
            version: 2,
            data: saved.data.clone(),
        },
    ];
    let err = other.dev.restore(&bad[0]).unwrap_err().to_string();
    assert!(err.contains("1 queues saved, this device has 2"), "{err}");
    for (i, state) in bad.iter().enumerate() {
        if i == 13 {
            // Unknown fields are ignored by serde; the rest is valid.
            continue;
        }
        assert!(other.dev.restore(state).is_err(), "case {i} accepted");
        assert_eq!(
            other.dev.save().unwrap(),
            pristine,
            "case {i} changed the state"
        );
    }
    assert!(other.msi.take().is_empty());
    assert!(lock(&other.log).restored.is_none());
    other.dev.restore(&saved).unwrap();
}

#[test]
fn restore_onto_an_active_device_stops_it_first() {
    let mem = memory();
    let (mut rig, _rings) = busy_rig(&mem);
    let saved = rig.dev.save().unwrap();
    rig.set_status(0);
    rig.bring_up(&mem, 0);
    rig.dev.restore(&saved).unwrap();
    assert_eq!(lock(&rig.log).calls.last(), Some(&"reset"));
    assert!(!rig.dev.is_active());
    rig.dev.resume().unwrap();
    assert!(rig.dev.is_active());
    assert_eq!(lock(&rig.log).features, VERSION_1 | EVENT_IDX);
}

#[test]
fn a_device_without_queue_states_cannot_be_saved_while_active() {
    struct Opaque(Loopback);
    impl VirtioDevice<Mem> for Opaque {
        fn device_type(&self) -> u32 {
            self.0.device_type()
        }
        fn queue_max_sizes(&self) -> Vec<u16> {
            self.0.queue_max_sizes()
        }
        fn features(&self) -> u64 {
            self.0.features()
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            self.0.read_config(offset, data)
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            self.0.write_config(offset, data)
        }
        fn activate(
            &mut self,
            mem: Arc<Mem>,
            features: u64,
            queues: Vec<ActiveQueue>,
            interrupt: Arc<dyn Interrupt>,
        ) -> Result<(), ActivateError> {
            self.0.activate(mem, features, queues, interrupt)
        }
        fn reset(&mut self) -> Vec<ActiveQueue> {
            self.0.reset()
        }
        fn pause(&mut self) -> Result<(), LifecycleError> {
            self.0.pause()
        }
        fn resume(&mut self) -> Result<(), LifecycleError> {
            self.0.resume()
        }
        fn save(&self) -> Result<DeviceState, LifecycleError> {
            self.0.save()
        }
        fn restore(&mut self, state: &DeviceState) -> Result<(), StateError> {
            self.0.restore(state)
        }
    }
    let mem = memory();
    let (device, _log) = Loopback::new();
    let mut dev = VirtioPciDevice::new(
        "pci-00:04.0".into(),
        Box::new(Opaque(*device)),
        mem.clone(),
        Arc::new(MsiLog::default()),
        IrqPin::disconnected(INTX_GSI),
        None,
    )
    .unwrap();
    assert!(dev.save().is_ok(), "idle: nothing to ask the device");
    let mut rig = Rig::on(mem.clone());
    std::mem::swap(&mut rig.dev, &mut dev);
    rig.bring_up(&mem, 0);
    let err = rig.dev.save().unwrap_err();
    assert!(err.0.contains("queue positions"), "{err}");
}

#[test]
fn power_on_reset() {
    let mem = memory();
    let (mut rig, _rings) = busy_rig(&mem);
    rig.dev.config_write(0x04, 0, &[0x06, 0x04]);
    rig.dev.config_write(0x0c, 0, &[0x10, 0x20]);
    rig.dev.reset();
    assert!(!rig.dev.is_active());
    assert_eq!(rig.status(), 0);
    // MSI-X off, every entry masked, nothing pending.
    assert_eq!(rig.dev.config_read(u16::from(CAP_MSIX)) >> 16, 2);
    let table = rig.dev.layout().table_offset;
    assert_eq!(rig.read(table + 12, 4), 1);
    assert_eq!(rig.read(table, 8), 0);
    assert_eq!(rig.read(rig.dev.layout().pba_offset, 8), 0);
    // BAR0 and memory decoding stay where the VMM put them.
    assert_eq!(rig.dev.config_read(0x10), 0xc000_0004);
    assert_eq!(rig.dev.config_read(0x04) & 0xffff, 0x0002);
    assert_eq!(rig.dev.config_read(0x0c) & 0xffff, 0);
    assert_eq!(
        rig.common_read(offset_of!(CommonCfg, config_msix_vector), 2),
        u64::from(NO_VECTOR)
    );
}
