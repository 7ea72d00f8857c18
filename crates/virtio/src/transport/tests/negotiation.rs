//! Feature negotiation, queue setup, activation, device reset, DEVICE_NEEDS_RESET.

use std::mem::offset_of;

use super::*;

#[test]
fn device_features_are_the_devices_plus_the_transports() {
    let mut rig = Rig::new();
    let offered = rig.dev.offered_features();
    assert_eq!(offered, DEVICE_FEATURES | EVENT_IDX | (1 << 28));
    assert_eq!(offered & (1 << 34), 0, "RING_PACKED withheld");
    let select = offset_of!(CommonCfg, device_feature_select);
    let feature = offset_of!(CommonCfg, device_feature);
    for (word, expected) in [(0, offered as u32), (1, (offered >> 32) as u32), (2, 0)] {
        rig.common_write(select, 4, word);
        assert_eq!(rig.common_read(select, 4), word);
        assert_eq!(rig.common_read(feature, 4) as u32, expected);
    }
    // device_feature is read-only.
    rig.common_write(select, 4, 0);
    rig.common_write(feature, 4, 0);
    assert_eq!(rig.common_read(feature, 4) as u32, offered as u32);
}

#[test]
fn good_features_are_accepted() {
    let mut rig = Rig::new();
    let status = rig.negotiate(VERSION_1 | EVENT_IDX | 1);
    assert_eq!(
        status,
        STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK
    );
    // The driver reads back what it acked.
    let select = offset_of!(CommonCfg, driver_feature_select);
    let feature = offset_of!(CommonCfg, driver_feature);
    rig.common_write(select, 4, 1);
    assert_eq!(rig.common_read(feature, 4), 1);
    // Features are fixed once FEATURES_OK is set.
    rig.common_write(feature, 4, 0);
    assert_eq!(rig.common_read(feature, 4), 1);
}

#[test]
fn features_not_offered_are_refused() {
    let mut rig = Rig::new();
    // Bit 5 is not offered.
    let status = rig.negotiate(VERSION_1 | (1 << 5));
    assert_eq!(status & STATUS_FEATURES_OK, 0);
    assert_eq!(status, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    // RING_PACKED, which the device asked for but the transport withholds.
    assert_eq!(rig.negotiate(VERSION_1 | (1 << 34)) & STATUS_FEATURES_OK, 0);
    // A nonzero word beyond bit 63.
    rig.negotiate(VERSION_1);
    rig.set_status(0);
    rig.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    rig.common_write(offset_of!(CommonCfg, driver_feature_select), 4, 2);
    rig.common_write(offset_of!(CommonCfg, driver_feature), 4, 1);
    rig.common_write(offset_of!(CommonCfg, driver_feature_select), 4, 1);
    rig.common_write(offset_of!(CommonCfg, driver_feature), 4, 1);
    rig.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
    assert_eq!(rig.status() & STATUS_FEATURES_OK, 0);
    // Then a good set after a reset is accepted.
    assert_ne!(rig.negotiate(VERSION_1) & STATUS_FEATURES_OK, 0);
}

#[test]
fn version_1_is_required() {
    let mut rig = Rig::new();
    assert_eq!(rig.negotiate(1 | EVENT_IDX) & STATUS_FEATURES_OK, 0);
    // DRIVER_OK without FEATURES_OK: the device needs a reset, nothing starts.
    rig.driver_ok();
    assert_ne!(rig.status() & STATUS_NEEDS_RESET, 0);
    assert!(!rig.dev.is_active());
    assert!(lock(&rig.log).calls.iter().all(|c| *c != "activate"));
}

#[test]
fn queues_are_set_up_and_handed_to_the_device() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    assert_eq!(rig.common_read(offset_of!(CommonCfg, num_queues), 2), 2);
    // Each queue reports its maximum size and its own notify offset.
    for (q, max) in QUEUE_MAX.iter().enumerate() {
        rig.common_write(offset_of!(CommonCfg, queue_select), 2, q as u64);
        assert_eq!(
            rig.common_read(offset_of!(CommonCfg, queue_size), 2),
            u64::from(*max)
        );
        assert_eq!(
            rig.common_read(offset_of!(CommonCfg, queue_notify_off), 2),
            q as u64
        );
    }
    // A queue that does not exist reads as size 0.
    rig.common_write(offset_of!(CommonCfg, queue_select), 2, 5);
    assert_eq!(rig.common_read(offset_of!(CommonCfg, queue_size), 2), 0);

    let rings = rig.bring_up(&mem, EVENT_IDX);
    assert!(rig.dev.is_active());
    let log = lock(&rig.log);
    assert_eq!(log.calls, ["reset", "activate"]);
    assert_eq!(log.features, VERSION_1 | EVENT_IDX);
    assert_eq!(log.queues.len(), 2);
    for (active, ring) in log.queues.iter().zip(&rings) {
        let q = &active.queue;
        assert_eq!(q.desc_table(), ring.desc_table_addr().0);
        assert_eq!(q.avail_ring(), ring.avail_addr().0);
        assert_eq!(q.used_ring(), ring.used_addr().0);
        assert!(q.ready() && q.event_idx_enabled());
        assert_eq!(q.size(), QUEUE_MAX[usize::from(active.index)]);
    }
    assert!(Arc::ptr_eq(
        &log.queues[1].notify,
        &rig.dev.notify_events()[1].1
    ));
}

#[test]
fn queue_registers_read_back_and_freeze_once_enabled() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    rig.negotiate(VERSION_1);
    let ring = MockSplitQueue::create(&*mem, GuestAddress(0x1000), 8);
    rig.setup_queue(0, &ring, 8);
    let desc = offset_of!(CommonCfg, queue_desc);
    assert_eq!(rig.common_read(desc, 8), 0x1000);
    assert_eq!(rig.common_read(offset_of!(CommonCfg, queue_enable), 2), 1);
    // Writes after enabling are ignored.
    rig.common_write(desc, 8, 0x8000);
    rig.common_write(offset_of!(CommonCfg, queue_size), 2, 4);
    assert_eq!(rig.common_read(desc, 8), 0x1000);
    assert_eq!(rig.common_read(offset_of!(CommonCfg, queue_size), 2), 8);
    // Only queue 0 is enabled: only it is handed over.
    rig.driver_ok();
    assert_eq!(lock(&rig.log).queues.len(), 1);
    assert_eq!(lock(&rig.log).queues[0].queue.size(), 8);
    assert!(!lock(&rig.log).queues[0].queue.event_idx_enabled());
}

#[test]
fn bad_queue_sizes_are_caught_at_enable() {
    let mem = memory();
    for size in [0u16, 12, 32] {
        let mut rig = Rig::on(mem.clone());
        rig.negotiate(VERSION_1);
        let ring = MockSplitQueue::create(&*mem, GuestAddress(0x1000), 16);
        rig.setup_queue(0, &ring, size);
        assert_eq!(rig.common_read(offset_of!(CommonCfg, queue_enable), 2), 0);
        assert_ne!(rig.status() & STATUS_NEEDS_RESET, 0, "size {size}");
        rig.driver_ok();
        assert!(!rig.dev.is_active());
    }
}

#[test]
fn rings_outside_memory_need_a_reset_and_say_so() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    rig.negotiate(VERSION_1);
    // The used ring runs past the end of guest memory.
    let ring = MockSplitQueue::create(&*mem, GuestAddress(0x1000), 16);
    rig.setup_queue(0, &ring, 16);
    rig.common_write(offset_of!(CommonCfg, queue_select), 2, 1);
    rig.common_write(offset_of!(CommonCfg, queue_device), 8, 0xf_fffc);
    rig.common_write(offset_of!(CommonCfg, queue_enable), 2, 1);
    let generation = rig.common_read(offset_of!(CommonCfg, config_generation), 1);
    rig.driver_ok();
    assert_ne!(rig.status() & STATUS_NEEDS_RESET, 0);
    assert_ne!(rig.status() & STATUS_DRIVER_OK, 0);
    assert!(!rig.dev.is_active());
    assert!(lock(&rig.log).calls.iter().all(|c| *c != "activate"));
    // A configuration interrupt told the driver (INTx here: MSI-X is off).
    assert_eq!(rig.read_isr(), 2);
    assert_ne!(
        rig.common_read(offset_of!(CommonCfg, config_generation), 1),
        generation
    );
    // A reset recovers.
    rig.set_status(0);
    assert_eq!(rig.status(), 0);
    rig.bring_up(&mem, 0);
    assert!(rig.dev.is_active());
}

#[test]
fn a_device_that_cannot_start_needs_a_reset() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    lock(&rig.log).refuse_activate = true;
    rig.bring_up(&mem, 0);
    assert_ne!(rig.status() & STATUS_NEEDS_RESET, 0);
    assert!(!rig.dev.is_active());
}

#[test]
fn device_reset_returns_everything_to_reset_values() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    rig.msix_control(true, false);
    rig.bring_up(&mem, EVENT_IDX);
    assert_eq!(rig.set_queue_vector(1, 2), 2);
    assert_eq!(rig.set_config_vector(0), 0);
    rig.dev.notify_events()[0].1.wake().unwrap();
    rig.set_status(0);
    assert!(!rig.dev.is_active());
    assert_eq!(lock(&rig.log).calls.last(), Some(&"reset"));
    assert_eq!(rig.status(), 0);
    let status = offset_of!(CommonCfg, device_status);
    for field in [
        offset_of!(CommonCfg, queue_select),
        offset_of!(CommonCfg, driver_feature),
        offset_of!(CommonCfg, queue_enable),
        offset_of!(CommonCfg, queue_desc),
        status,
    ] {
        assert_eq!(rig.common_read(field, 2), 0, "field at {field:#x}");
    }
    assert_eq!(rig.common_read(offset_of!(CommonCfg, queue_size), 2), 16);
    assert_eq!(rig.set_queue_vector(1, NO_VECTOR), NO_VECTOR);
    assert_eq!(
        rig.common_read(offset_of!(CommonCfg, config_msix_vector), 2),
        u64::from(NO_VECTOR)
    );
    rig.common_write(offset_of!(CommonCfg, queue_select), 2, 1);
    assert_eq!(
        rig.common_read(offset_of!(CommonCfg, queue_msix_vector), 2),
        u64::from(NO_VECTOR)
    );
    // A stale notification does not survive the reset.
    assert!(!rig.dev.notify_events()[0].1.drain());
    // MSI-X itself belongs to PCI and stays enabled.
    let control = rig.dev.config_read(u16::from(CAP_MSIX)) >> 16;
    assert_ne!(control & 0x8000, 0);
}

#[test]
fn the_device_keeps_serving_after_activation() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    let mut rings = rig.bring_up(&mem, 0);
    rings[0].add_chain(2).unwrap();
    rings[0].add_chain(1).unwrap();
    rings[1].add_chain(1).unwrap();
    assert_eq!(serve(&rig.log), 3);
    assert_eq!(rings[0].used().idx().load(), 2);
    assert_eq!(rings[1].used().idx().load(), 1);
}
