use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use vm_memory::{GuestAddress, GuestMemoryMmap};

use virtio_queue::QueueT;
use vm_memory::Bytes;

use super::recheck::{Recheck, TxBatching};
use super::*;
use crate::test_driver::{Buf, TestDriver};
use crate::worker::{Worker, WorkerConfig};

#[test]
fn rarp_frame_names_the_mac_twice_and_is_padded() {
    let mac = [0x52, 0x54, 0, 1, 2, 3];
    let frame = rarp_frame(&mac);
    assert_eq!(frame.len(), VNET_HDR_LEN + 60);
    let eth = &frame[VNET_HDR_LEN..];
    assert_eq!(&eth[..6], &[0xff; 6]);
    assert_eq!(&eth[6..12], &mac);
    assert_eq!(&eth[12..14], &[0x80, 0x35]);
    assert_eq!(&eth[20..22], &[0, 3]);
    assert_eq!(&eth[22..28], &mac);
    assert_eq!(&eth[32..38], &mac);
}

const MAC: [u8; 6] = [0x52, 0x54, 0, 0xab, 0xcd, 0xef];

/// A device on a fresh tap (gone when the device is dropped); None where this process may
/// not create taps (not root), so those tests say so and stop.
fn device(pairs: u16) -> Option<Net> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "fvu{}x{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    match Net::new(NetOptions {
        tap: name,
        mac: MAC,
        queue_pairs: pairs,
        io_threads: pairs,
    }) {
        Ok(net) => Some(net),
        Err(e) => {
            eprintln!("no tap for this test ({e}): needs CAP_NET_ADMIN and /dev/net/tun");
            None
        }
    }
}

fn config(net: &Net, offset: u64, len: usize) -> Vec<u8> {
    let mut data = vec![0xaa; len];
    VirtioDevice::<GuestMemoryMmap>::read_config(net, offset, &mut data);
    data
}

#[test]
fn configuration_space_and_features() {
    let Some(net) = device(2) else { return };
    assert_eq!(config(&net, 0, 6), MAC);
    assert_eq!(config(&net, 6, 2), [VIRTIO_NET_S_LINK_UP as u8, 0]);
    assert_eq!(config(&net, 8, 2), [2, 0]);
    assert_eq!(
        config(&net, 9, 4),
        [0, 0, 0, 0],
        "beyond the fields reads zero"
    );
    assert_eq!(config(&net, u64::MAX, 2), [0, 0]);
    let features = VirtioDevice::<GuestMemoryMmap>::features(&net);
    for bit in [
        VIRTIO_NET_F_MAC,
        VIRTIO_NET_F_STATUS,
        VIRTIO_NET_F_CTRL_VQ,
        VIRTIO_NET_F_MQ,
        VIRTIO_NET_F_GUEST_ANNOUNCE,
    ] {
        assert_ne!(features & (1 << bit), 0, "feature {bit} not offered");
    }
    assert_ne!(features & (1 << VIRTIO_NET_F_MRG_RXBUF), 0);
    assert_eq!(
        VirtioDevice::<GuestMemoryMmap>::queue_max_sizes(&net).len(),
        5
    );
    let Some(single) = device(1) else { return };
    assert_eq!(
        VirtioDevice::<GuestMemoryMmap>::features(&single) & (1 << VIRTIO_NET_F_MQ),
        0
    );
}

fn activate(net: &mut Net, driver: &TestDriver, acked: u64) {
    VirtioDevice::<GuestMemoryMmap>::activate(
        net,
        driver.mem.clone(),
        acked,
        driver.active_queues(),
        driver.interrupt(),
    )
    .unwrap();
}

#[test]
fn mergeable_buffers_keep_segmentation_offloads_on_the_tap() {
    let Some(net) = device(1) else { return };
    let guest_offloads = 1 << VIRTIO_NET_F_GUEST_CSUM
        | 1 << VIRTIO_NET_F_GUEST_TSO4
        | 1 << VIRTIO_NET_F_GUEST_TSO6
        | 1 << VIRTIO_NET_F_GUEST_UFO;
    let all = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_UFO;
    assert_eq!(net.rx_offloads(guest_offloads), all);
    assert_eq!(
        net.rx_offloads(guest_offloads | 1 << VIRTIO_NET_F_MRG_RXBUF),
        all
    );
    assert_eq!(net.rx_offloads(1 << VIRTIO_NET_F_MRG_RXBUF), 0);
}

/// A receive queue (size `ring`) served with mergeable buffers by a pair handler that holds
/// `frame` as if just read from the tap.
fn merged_receiver(net: &Net, ring: u16, frame: &[u8], event_idx: bool) -> (TestDriver, Worker) {
    let driver = TestDriver::new(&[ring]);
    let mut rx_buf = vec![0; MAX_GSO_FRAME];
    rx_buf[..frame.len()].copy_from_slice(frame);
    let handler = PairHandler {
        pair: 0,
        has_rx: true,
        tap: net.shared.taps[0].clone(),
        shared: net.shared.clone(),
        setup: None,
        max_tx_frame: MAX_GSO_FRAME,
        mergeable: true,
        pending_rx: Some(frame.len()),
        tap_failed: None,
        rx_buf,
        rx_delivered: 0,
        rx_recheck: Recheck::new(net.timers[0].rx.clone()),
        tx: TxBatching::new(net.timers[0].tx.clone()),
    };
    let config = WorkerConfig {
        name: "net-rx-test".into(),
        mem: driver.mem.clone(),
        queues: driver.active_queues(),
        interrupt: driver.interrupt(),
        event_idx,
        start_paused: false,
    };
    let worker = Worker::spawn(config, handler).unwrap();
    (driver, worker)
}

/// A frame with a recognisable byte at every position, `len` bytes header included.
fn patterned_frame(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// Posts `count` receive chains of `size` bytes each; their addresses.
fn post_chains(driver: &mut TestDriver, count: usize, size: u32) -> Vec<GuestAddress> {
    (0..count)
        .map(|_| {
            let buf = driver.alloc(u64::from(size));
            driver.add_chain(0, &[Buf::w(buf, size)]);
            buf
        })
        .collect()
}

/// The frame as the driver reassembles it from the used entries; checks num_buffers.
fn reassemble(driver: &TestDriver, bufs: &[GuestAddress], used: &[(u32, u32)]) -> Vec<u8> {
    let mut frame = Vec::new();
    for (i, &(head, len)) in used.iter().enumerate() {
        assert_eq!(head as usize, i, "chains used out of order");
        frame.extend(driver.read(bufs[i], len as usize));
    }
    let num_buffers = u16::from_le_bytes([frame[10], frame[11]]);
    assert_eq!(usize::from(num_buffers), used.len(), "num_buffers");
    frame
}

#[test]
fn a_tso_frame_spreads_over_mergeable_chains_published_at_once() {
    let Some(net) = device(1) else { return };
    let frame = patterned_frame(MAX_GSO_FRAME);
    let (mut driver, _worker) = merged_receiver(&net, 64, &frame, true);
    driver.set_used_event(0, 0);
    let bufs = post_chains(&mut driver, 50, 1530);
    let needed = MAX_GSO_FRAME.div_ceil(1530) as u16;
    // Watch the used index while the device works: it goes from 0 to `needed` in one step.
    let watcher = {
        let mem = driver.mem.clone();
        let used_idx_at = GuestAddress(driver.active_queues()[0].queue.used_ring() + 2);
        std::thread::spawn(move || {
            let mut seen = vec![0u16];
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while seen.last() != Some(&needed) && std::time::Instant::now() < deadline {
                let idx = u16::from_le(mem.read_obj(used_idx_at).unwrap());
                if seen.last() != Some(&idx) {
                    seen.push(idx);
                }
            }
            seen
        })
    };
    driver.kick(0);
    let used = driver.wait_used(0, needed);
    assert_eq!(watcher.join().unwrap(), vec![0, needed]);
    assert!(used[..used.len() - 1].iter().all(|&(_, len)| len == 1530));
    let mut got = reassemble(&driver, &bufs, &used);
    got[10..12].copy_from_slice(&frame[10..12]);
    assert!(got == frame, "the frame came out different");
    // EVENT_IDX: used_event 0 lies among the entries just published.
    driver.interrupt.wait_count(0, 1);
    assert_eq!(net.counters().rx_frames.load(Ordering::SeqCst), 1);
    driver.assert_no_used(0, Duration::from_millis(20));
}

#[test]
fn a_frame_waits_until_the_driver_posts_enough_chains() {
    let Some(net) = device(1) else { return };
    let frame = patterned_frame(8000);
    let (mut driver, _worker) = merged_receiver(&net, 16, &frame, true);
    let mut bufs = post_chains(&mut driver, 3, 1530);
    driver.kick(0);
    driver.assert_no_used(0, Duration::from_millis(50));
    // EVENT_IDX: notify me when you add a chain beyond the three I looked at (avail_event
    // 3), not beyond next_avail (0), which the driver has already passed.
    let used_ring = driver.active_queues()[0].queue.used_ring();
    let avail_event: u16 = driver
        .mem
        .read_obj(GuestAddress(used_ring + 4 + 8 * 16))
        .unwrap();
    assert_eq!(u16::from_le(avail_event), 3);
    bufs.extend(post_chains(&mut driver, 3, 1530));
    driver.kick(0);
    let used = driver.wait_used(0, 6);
    let mut got = reassemble(&driver, &bufs, &used);
    got[10..12].copy_from_slice(&frame[10..12]);
    assert!(got == frame, "the frame came out different");
    assert_eq!(used[5].1, 8000 - 5 * 1530);
}

#[test]
fn receive_chains_that_cannot_take_a_frame_come_back_empty() {
    let Some(net) = device(1) else { return };
    let counters = || {
        let c = net.counters();
        (
            c.rx_frames.load(Ordering::SeqCst),
            c.rx_bad_chain.load(Ordering::SeqCst),
            c.rx_too_long.load(Ordering::SeqCst),
        )
    };
    // A first chain shorter than the header.
    let frame = patterned_frame(1000);
    let (mut driver, worker) = merged_receiver(&net, 16, &frame, false);
    post_chains(&mut driver, 1, 4);
    driver.kick(0);
    assert_eq!(driver.wait_used(0, 1), vec![(0, 0)]);
    assert_eq!(counters(), (0, 1, 0));
    drop(worker);
    // A later chain with no writable byte.
    let (mut driver, worker) = merged_receiver(&net, 16, &frame, false);
    post_chains(&mut driver, 1, 600);
    let read_only = driver.alloc(600);
    driver.add_chain(0, &[Buf::r(read_only, 600)]);
    driver.kick(0);
    assert_eq!(driver.wait_used(0, 2), vec![(0, 0), (1, 0)]);
    assert_eq!(counters(), (0, 2, 0));
    drop(worker);
    // Tiny buffers: the whole ring would not hold the frame.
    let (mut driver, _worker) = merged_receiver(&net, 16, &frame, false);
    post_chains(&mut driver, 16, 16);
    driver.kick(0);
    let used = driver.wait_used(0, 16);
    assert!(used.iter().all(|&(_, len)| len == 0));
    assert_eq!(counters(), (0, 2, 1));
}

#[test]
fn transmit_chains_the_device_cannot_use_come_back_empty() {
    let Some(mut net) = device(1) else { return };
    let mut driver = TestDriver::new(&[16, 16, 16]);
    activate(&mut net, &driver, COMMON_FEATURES);
    let buf = driver.alloc(0x20000);
    let short = driver.add_chain(1, &[Buf::r(buf, 4)]);
    let writable = driver.add_chain(1, &[Buf::w(buf, 64)]);
    let long = driver.add_chain(1, &[Buf::r(buf, 1024), Buf::r(buf, 1024)]);
    let outside = driver.add_chain(1, &[Buf::r(GuestAddress(1 << 40), 64)]);
    let good = driver.add_chain(1, &[Buf::r(buf, 60 + VNET_HDR_LEN as u32)]);
    driver.kick(1);
    let used = driver.wait_used(1, 5);
    let heads: Vec<u32> = [short, writable, long, outside, good]
        .iter()
        .map(|&h| u32::from(h))
        .collect();
    assert_eq!(used, heads.iter().map(|&h| (h, 0)).collect::<Vec<_>>());
    let counters = net.counters();
    assert_eq!(counters.tx_malformed.load(Ordering::SeqCst), 4);
    // The tap is down, so the kernel refuses the good frame: counted either way.
    let written =
        counters.tx_frames.load(Ordering::SeqCst) + counters.tx_errors.load(Ordering::SeqCst);
    assert_eq!(written, 1);
}

/// Sends one control command; the used length and the answer byte.
fn control(driver: &mut TestDriver, queue: usize, command: &[u8]) -> (u32, u8) {
    let out = driver.alloc(64);
    let ack = driver.alloc(1);
    driver.write(out, command);
    driver.write(ack, &[0xff]);
    driver.add_chain(queue, &[Buf::r(out, command.len() as u32), Buf::w(ack, 1)]);
    driver.kick(queue);
    let used = driver.wait_used(queue, 1);
    (used[0].1, driver.read(ack, 1)[0])
}

#[test]
fn control_queue_sets_pairs_and_acknowledges_announcements() {
    let Some(mut net) = device(2) else { return };
    let mut driver = TestDriver::new(&[16, 16, 16, 16, 16]);
    let acked = COMMON_FEATURES
        | 1 << VIRTIO_NET_F_CTRL_VQ
        | 1 << VIRTIO_NET_F_MQ
        | 1 << VIRTIO_NET_F_GUEST_ANNOUNCE;
    activate(&mut net, &driver, acked);
    let (ok, err) = (VIRTIO_NET_OK as u8, VIRTIO_NET_ERR as u8);
    let mq = VIRTIO_NET_CTRL_MQ as u8;
    assert_eq!(control(&mut driver, 4, &[mq, 0, 2, 0]), (1, ok));
    assert_eq!(net.shared.active_pairs.load(Ordering::SeqCst), 2);
    assert_eq!(control(&mut driver, 4, &[mq, 0, 0, 0]), (1, err));
    assert_eq!(control(&mut driver, 4, &[mq, 0, 3, 0]), (1, err));
    assert_eq!(control(&mut driver, 4, &[mq, 0, 1]), (1, err));
    assert_eq!(control(&mut driver, 4, &[99, 0]), (1, err));
    assert_eq!(control(&mut driver, 4, &[mq]), (1, err));
    assert_eq!(net.shared.active_pairs.load(Ordering::SeqCst), 2);

    net.shared
        .status
        .fetch_or(VIRTIO_NET_S_ANNOUNCE as u16, Ordering::SeqCst);
    let announce = VIRTIO_NET_CTRL_ANNOUNCE as u8;
    assert_eq!(control(&mut driver, 4, &[announce, 0]), (1, ok));
    assert_eq!(config(&net, 6, 2), [VIRTIO_NET_S_LINK_UP as u8, 0]);

    // No byte for the answer: returned with length 0.
    let out = driver.alloc(2);
    driver.add_chain(4, &[Buf::r(out, 2)]);
    driver.kick(4);
    assert_eq!(driver.wait_used(4, 1)[0].1, 0);
    // The queues go back on reset.
    assert_eq!(VirtioDevice::<GuestMemoryMmap>::reset(&mut net).len(), 5);
    assert_eq!(net.shared.active_pairs.load(Ordering::SeqCst), 1);
}

#[test]
fn receive_queue_without_buffers_is_not_served_and_pauses_cleanly() {
    let Some(mut net) = device(1) else { return };
    let driver = TestDriver::new(&[16, 16, 16]);
    activate(&mut net, &driver, COMMON_FEATURES);
    driver.assert_no_used(0, Duration::from_millis(50));
    VirtioDevice::<GuestMemoryMmap>::pause(&mut net).unwrap();
    let states = VirtioDevice::<GuestMemoryMmap>::queue_states(&net).unwrap();
    assert_eq!(states.len(), 3);
    let saved = VirtioDevice::<GuestMemoryMmap>::save(&net).unwrap();
    VirtioDevice::<GuestMemoryMmap>::resume(&mut net).unwrap();
    // A restore marks the guest for an announcement at the next resume.
    VirtioDevice::<GuestMemoryMmap>::restore(&mut net, &saved).unwrap();
    assert!(net.announce_pending);
    VirtioDevice::<GuestMemoryMmap>::resume(&mut net).unwrap();
    assert!(!net.announce_pending);
}
