//! Notifications (waker, ioeventfd registration) and interrupts (MSI-X, INTx + ISR).

use std::mem::offset_of;

use super::*;

#[test]
fn a_notify_write_wakes_its_queue() {
    let mut rig = Rig::new();
    let events = rig.dev.notify_events();
    assert_eq!(events[0].0, layout::NOTIFY_OFFSET);
    assert_eq!(events[1].0, layout::NOTIFY_OFFSET + 4);
    // Linux writes the queue index as 16 bits at the queue's address.
    rig.write(events[1].0, 2, 1);
    assert!(events[1].1.drain());
    assert!(!events[0].1.drain());
    rig.write(events[0].0, 4, 0);
    assert!(events[0].1.drain());
    assert!(!events[1].1.drain());
    // Past the region: nothing.
    rig.write(layout::NOTIFY_OFFSET + 8, 2, 2);
    assert!(!events[0].1.drain() && !events[1].1.drain());
}

#[test]
fn ioeventfds_follow_bar0() {
    let mut rig = Rig::new();
    let registered = |rig: &Rig| {
        let mut v: Vec<u64> = rig.registrar.live.lock().unwrap().iter().copied().collect();
        v.sort();
        v
    };
    rig.dev.bar_moved(0, Some(0xc000_0000));
    assert_eq!(
        registered(&rig),
        [
            notify_address(0xc000_0000, 0),
            notify_address(0xc000_0000, 1)
        ]
    );
    assert_eq!(rig.dev.ioevents_registered_at(), Some(0xc000_0000));
    // BAR0's register follows the bus.
    assert_eq!(rig.dev.config_read(0x10), 0xc000_0004);
    assert_eq!(rig.dev.config_read(0x14), 0);
    rig.dev.bar_moved(0, Some(0x10_0000_0000));
    assert_eq!(
        registered(&rig),
        [
            notify_address(0x10_0000_0000, 0),
            notify_address(0x10_0000_0000, 1)
        ]
    );
    assert_eq!(rig.dev.config_read(0x14), 0x10);
    rig.dev.bar_moved(0, None);
    assert!(registered(&rig).is_empty());
    assert_eq!(rig.dev.ioevents_registered_at(), None);
    // Another BAR index means nothing to this function.
    rig.dev.bar_moved(2, Some(0xd000_0000));
    assert!(registered(&rig).is_empty());

    // A hypervisor that refuses one address: none stay registered, and the notify
    // write path still wakes the queue.
    rig.registrar
        .refuse
        .lock()
        .unwrap()
        .insert(notify_address(0xc000_0000, 1));
    rig.dev.bar_moved(0, Some(0xc000_0000));
    assert!(registered(&rig).is_empty());
    assert_eq!(rig.dev.ioevents_registered_at(), None);
    rig.write(layout::NOTIFY_OFFSET + 4, 2, 1);
    assert!(rig.dev.notify_events()[1].1.drain());
}

#[test]
fn msix_routes_each_queue_to_its_vector() {
    let mem = memory();
    let mut rig = Rig::on(mem.clone());
    let mut rings = rig.bring_up(&mem, 0);
    rig.msix_control(true, false);
    for v in 0..3 {
        rig.program_vector(v);
    }
    let updates = rig.msi.take();
    assert_eq!(updates.len(), 3);
    assert!(updates.contains(&MsiEvent::Update(
        2,
        Some(MsiMessage {
            address: 0xfee0_0000,
            data: 0x42
        })
    )));
    assert_eq!(rig.set_config_vector(0), 0);
    assert_eq!(rig.set_queue_vector(0, 1), 1);
    assert_eq!(rig.set_queue_vector(1, 2), 2);
    // Beyond the table (3 entries): the mapping fails and reads back NO_VECTOR.
    assert_eq!(rig.set_queue_vector(1, 3), NO_VECTOR);
    assert_eq!(rig.set_config_vector(0x7ff), NO_VECTOR);
    assert_eq!(rig.set_queue_vector(1, 2), 2);
    assert_eq!(rig.set_config_vector(0), 0);

    rings[1].add_chain(1).unwrap();
    serve(&rig.log);
    assert_eq!(rig.msi.fires(), [2]);
    rings[0].add_chain(1).unwrap();
    serve(&rig.log);
    assert_eq!(rig.msi.fires(), [1]);
    rig.dev.interrupt().signal_config();
    assert_eq!(rig.msi.fires(), [0]);
    // With MSI-X on, neither the ISR nor the line is touched.
    assert_eq!(rig.read_isr(), 0);
    assert!(!rig.lines.level(INTX_GSI));
    // NO_VECTOR: no interrupt at all.
    rig.set_queue_vector(0, NO_VECTOR);
    rig.dev.interrupt().signal_queue(0);
    assert!(rig.msi.take().is_empty());
}

#[test]
fn masked_vectors_stay_pending_until_unmasked() {
    let mut rig = Rig::new();
    rig.msix_control(true, false);
    rig.program_vector(1);
    rig.set_queue_vector(0, 1);
    rig.msi.take();
    let interrupt = rig.dev.interrupt();
    rig.mask_vector(1, true);
    assert_eq!(rig.msi.take(), [MsiEvent::Update(1, None)]);
    interrupt.signal_queue(0);
    interrupt.signal_queue(0);
    assert!(rig.msi.take().is_empty());
    let pba = rig.dev.layout().pba_offset;
    assert_eq!(rig.read(pba, 8), 0b10);
    rig.mask_vector(1, false);
    let message = Some(MsiMessage {
        address: 0xfee0_0000,
        data: 0x41,
    });
    assert_eq!(
        rig.msi.take(),
        [MsiEvent::Update(1, message), MsiEvent::Fire(1)]
    );
    assert_eq!(rig.read(pba, 8), 0);
    // Function mask: the same through message control.
    rig.msix_control(true, true);
    interrupt.signal_queue(0);
    assert_eq!(rig.msi.take(), [MsiEvent::Update(1, None)]);
    rig.msix_control(true, false);
    assert_eq!(
        rig.msi.take(),
        [MsiEvent::Update(1, message), MsiEvent::Fire(1)]
    );
    // The table reads back through the BAR.
    let entry = rig.dev.layout().table_offset + 16;
    assert_eq!(rig.read(entry, 8), 0xfee0_0000);
    assert_eq!(rig.read(entry + 8, 4), 0x41);
    assert_eq!(rig.read(entry + 12, 4), 0);
}

#[test]
fn intx_follows_the_isr_byte() {
    let mut rig = Rig::new();
    let interrupt = rig.dev.interrupt();
    let generation = offset_of!(CommonCfg, config_generation);
    assert!(!rig.lines.level(INTX_GSI));
    interrupt.signal_queue(1);
    assert!(rig.lines.level(INTX_GSI));
    // The PCI status register shows the pending interrupt.
    assert_ne!(rig.dev.config_read(0x04) & (0x08 << 16), 0);
    interrupt.signal_config();
    assert_eq!(rig.common_read(generation, 1), 1);
    // Reading the ISR returns both causes, clears them and lowers the line.
    assert_eq!(rig.read_isr(), 3);
    assert!(!rig.lines.level(INTX_GSI));
    assert_eq!(rig.read_isr(), 0);
    assert_eq!(rig.dev.config_read(0x04) & (0x08 << 16), 0);
    // A 4-byte read of the ISR region also clears it.
    interrupt.signal_queue(0);
    assert_eq!(rig.read(ISR_OFFSET, 4), 1);
    assert!(!rig.lines.level(INTX_GSI));
    // INTx disabled in the command register: the ISR is set, the line stays low until
    // INTx is enabled again.
    rig.dev.config_write(0x04, 1, &[0x04]);
    interrupt.signal_queue(0);
    assert!(!rig.lines.level(INTX_GSI));
    rig.dev.config_write(0x04, 1, &[0x00]);
    assert!(rig.lines.level(INTX_GSI));
    // Enabling MSI-X lowers the line.
    rig.msix_control(true, false);
    assert!(!rig.lines.level(INTX_GSI));
    rig.msix_control(false, false);
    assert!(rig.lines.level(INTX_GSI));
    assert_eq!(rig.read_isr(), 1);
    // The line is driven only when its level changes.
    let changes = rig.lines.changes();
    rig.read_isr();
    assert_eq!(rig.lines.changes(), changes);
}

#[test]
fn device_threads_and_vcpus_race_without_losing_an_interrupt() {
    let mut rig = Rig::new();
    rig.msix_control(true, false);
    rig.program_vector(1);
    rig.set_queue_vector(0, 1);
    let interrupt = rig.dev.interrupt();
    let signaller = std::thread::spawn(move || {
        for _ in 0..20_000 {
            interrupt.signal_queue(0);
        }
    });
    // The vCPU side masks and unmasks meanwhile.
    let mut rounds = 0;
    while !signaller.is_finished() && rounds < 100_000 {
        rig.mask_vector(1, rounds % 2 == 0);
        rounds += 1;
    }
    signaller.join().unwrap();
    rig.mask_vector(1, false);
    // Every masked signal ends up delivered: nothing stays pending.
    assert_eq!(rig.read(rig.dev.layout().pba_offset, 8), 0);
    assert!(!rig.msi.fires().is_empty());
}

#[test]
fn intx_race_leaves_line_and_isr_in_agreement() {
    let mut rig = Rig::new();
    let interrupt = rig.dev.interrupt();
    let signaller = std::thread::spawn(move || {
        for _ in 0..20_000 {
            interrupt.signal_queue(0);
        }
    });
    while !signaller.is_finished() {
        rig.read_isr();
    }
    signaller.join().unwrap();
    let pending = rig.read_isr() != 0;
    // Whatever the interleaving, the line ends low once the ISR has been read.
    assert!(!rig.lines.level(INTX_GSI), "pending={pending}");
    rig.dev.interrupt().signal_queue(0);
    assert!(rig.lines.level(INTX_GSI));
}
