//! Configuration space: identity, capabilities, BAR0, the PCI-configuration-access window,
//! the device-specific configuration.

use std::mem::offset_of;

use super::*;

fn config_byte(rig: &mut Rig, offset: u16) -> u8 {
    (rig.dev.config_read(offset & !3) >> (8 * (offset & 3))) as u8
}

fn config_u32(rig: &mut Rig, offset: u16) -> u32 {
    rig.dev.config_read(offset)
}

#[test]
fn identity_and_header() {
    let mut rig = Rig::new();
    assert_eq!(config_u32(&mut rig, 0), 0x1044_1af4, "1af4:1044 (rng)");
    assert_eq!(
        config_u32(&mut rig, 0x08),
        0x00ff_0001,
        "class 00ff00, revision 1"
    );
    assert_eq!(
        config_u32(&mut rig, 0x2c),
        0x0004_1af4,
        "subsystem 1af4:0004"
    );
    assert_eq!(config_byte(&mut rig, 0x0e), 0, "header type 0");
    assert_eq!(config_byte(&mut rig, 0x34), 0x40);
    assert_eq!(config_byte(&mut rig, 0x3d), 1, "INTA");
    assert_eq!(config_byte(&mut rig, 0x3c), INTX_GSI as u8);
    assert_eq!(config_u32(&mut rig, 0x04) >> 16, 0x10, "capability list");
    // Extended configuration space: nothing there.
    assert_eq!(config_u32(&mut rig, 0x100), 0);
    assert_eq!(config_u32(&mut rig, 0xffc), 0);
    // Read-only registers ignore writes.
    rig.dev.config_write(0, 0, &[0; 4]);
    rig.dev.config_write(0x08, 0, &[0xff; 4]);
    assert_eq!(config_u32(&mut rig, 0), 0x1044_1af4);
    assert_eq!(config_u32(&mut rig, 0x08), 0x00ff_0001);
    // The command register keeps only the bits this function has.
    rig.dev.config_write(0x04, 0, &[0xff, 0xff]);
    assert_eq!(config_u32(&mut rig, 0x04) & 0xffff, 0x0546);
    rig.dev.config_write(0x3c, 0, &[0x0b]);
    assert_eq!(config_byte(&mut rig, 0x3c), 0x0b);
}

#[test]
fn class_codes_by_device_type() {
    for (device_type, class) in [
        (crate::device_type::BLOCK, 0x01_80_00),
        (crate::device_type::NET, 0x02_00_00),
        (crate::device_type::CONSOLE, 0x07_80_00),
        (crate::device_type::RNG, 0x00_ff_00),
    ] {
        let id = identity(device_type).unwrap();
        assert_eq!(id.class_code, class);
        assert_eq!(id.device_id, 0x1040 + device_type as u16);
        assert_eq!(id.subsystem_id, device_type as u16);
    }
    assert!(identity(0x40).is_err());
}

#[test]
fn bar0_is_a_64_bit_memory_bar_that_sizes() {
    let mut rig = Rig::new();
    let bars = rig.dev.bars();
    assert_eq!(bars.len(), 1);
    assert_eq!(bars[0].kind, pci::BarKind::Memory64);
    assert!(!bars[0].prefetchable);
    let size = bars[0].size;
    assert!(size.is_power_of_two());
    let layout = *rig.dev.layout();
    assert!(layout.pba_offset + layout.pba_len <= size);
    rig.dev.config_write(0x10, 0, &[0xff; 4]);
    rig.dev.config_write(0x14, 0, &[0xff; 4]);
    assert_eq!(config_u32(&mut rig, 0x10), (!(size - 1) as u32) | 0b100);
    assert_eq!(config_u32(&mut rig, 0x14), 0xffff_ffff);
    rig.dev.config_write(0x10, 0, &0xc000_0000u32.to_le_bytes());
    rig.dev.config_write(0x14, 0, &[0; 4]);
    assert_eq!(config_u32(&mut rig, 0x10), 0xc000_0004);
    // BARs 2..5 are unimplemented.
    for bar in (0x18..0x28).step_by(4) {
        rig.dev.config_write(bar, 0, &[0xff; 4]);
        assert_eq!(config_u32(&mut rig, bar), 0);
    }
}

/// Walks the capability list: (offset, id, bytes of the dwords after the header).
fn capabilities(rig: &mut Rig) -> Vec<(u16, u8, Vec<u8>)> {
    let mut caps = Vec::new();
    let mut at = u16::from(config_byte(rig, 0x34));
    while at != 0 && caps.len() < 16 {
        let bytes: Vec<u8> = (0..20u16).map(|i| config_byte(rig, at + i)).collect();
        caps.push((at, bytes[0], bytes));
        at = u16::from(caps.last().unwrap().2[1]);
    }
    caps
}

#[test]
fn capability_list_holds_msix_and_the_virtio_structures() {
    let mut rig = Rig::new();
    let layout = *rig.dev.layout();
    let caps = capabilities(&mut rig);
    assert_eq!(caps.len(), 6);
    let (at, id, msix) = &caps[0];
    assert_eq!((*at, *id), (0x40, 0x11));
    assert_eq!(u16::from_le_bytes([msix[2], msix[3]]), 2, "3 vectors");
    let dword = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    assert_eq!(dword(msix, 4), layout.table_offset as u32, "table in BAR0");
    assert_eq!(dword(msix, 8), layout.pba_offset as u32, "PBA in BAR0");
    let expect = [
        (1, 0x0, 0x3c),
        (3, 0x1000, 1),
        (4, 0x2000, 0x1000),
        (2, 0x3000, 8),
        (5, 0, 0),
    ];
    for ((_, id, cap), (cfg_type, offset, length)) in caps[1..].iter().zip(expect) {
        assert_eq!(*id, 0x09);
        assert_eq!(cap[3], cfg_type);
        assert_eq!(cap[4], 0, "BAR0");
        assert_eq!(dword(cap, 8), offset, "cfg_type {cfg_type}");
        assert_eq!(dword(cap, 12), length, "cfg_type {cfg_type}");
        let len = if matches!(cfg_type, 2 | 5) { 20 } else { 16 };
        assert_eq!(cap[2], len);
    }
    assert_eq!(dword(&caps[4].2, 16), 4, "notify_off_multiplier");
}

#[test]
fn msix_message_control_through_any_write_width() {
    let mut rig = Rig::new();
    let at = u16::from(CAP_MSIX);
    rig.dev.config_write(at, 2, &0xc000u16.to_le_bytes());
    assert_eq!(rig.dev.config_read(at) >> 16, 0xc002);
    rig.dev.config_write(at, 0, &0x0000_0000u32.to_le_bytes());
    assert_eq!(rig.dev.config_read(at) >> 16, 0x0002);
    rig.dev.config_write(at, 3, &[0x80]);
    assert_eq!(rig.dev.config_read(at) >> 16, 0x8002);
    // The table and PBA pointers are read-only.
    let before = rig.dev.config_read(at + 4);
    rig.dev.config_write(at + 4, 0, &[0; 4]);
    assert_eq!(rig.dev.config_read(at + 4), before);
}

/// Sets the window to `length` bytes at `offset` of BAR `bar`.
fn window(rig: &mut Rig, bar: u8, offset: u32, length: u32) {
    let cap = u16::from(layout::CAP_PCI_CFG);
    rig.dev.config_write(cap + 4, 0, &[bar]);
    rig.dev.config_write(cap + 8, 0, &offset.to_le_bytes());
    rig.dev.config_write(cap + 12, 0, &length.to_le_bytes());
}

fn window_read(rig: &mut Rig) -> u32 {
    rig.dev.config_read(u16::from(layout::PCI_CFG_DATA))
}

fn window_write(rig: &mut Rig, value: u32) {
    rig.dev
        .config_write(u16::from(layout::PCI_CFG_DATA), 0, &value.to_le_bytes());
}

#[test]
fn pci_cfg_window_reaches_bar0() {
    let mut rig = Rig::new();
    let cap = u16::from(layout::CAP_PCI_CFG);
    // num_queues, 2 bytes.
    window(&mut rig, 0, offset_of!(CommonCfg, num_queues) as u32, 2);
    assert_eq!(rig.dev.config_read(cap + 4) & 0xff, 0);
    assert_eq!(rig.dev.config_read(cap + 8), 0x12);
    assert_eq!(rig.dev.config_read(cap + 12), 2);
    assert_eq!(window_read(&mut rig) & 0xffff, 2);
    // Write the device status through the window (1 byte), read it back directly.
    window(&mut rig, 0, offset_of!(CommonCfg, device_status) as u32, 1);
    window_write(&mut rig, u32::from(STATUS_ACKNOWLEDGE));
    assert_eq!(rig.status(), STATUS_ACKNOWLEDGE);
    // 4 bytes of the device configuration.
    lock(&rig.log).config = [1, 2, 3, 4, 5, 6, 7, 8];
    window(&mut rig, 0, layout::DEVICE_OFFSET as u32 + 4, 4);
    assert_eq!(window_read(&mut rig), 0x0807_0605);
    window_write(&mut rig, 0x0b0a_0908);
    assert_eq!(lock(&rig.log).config, [1, 2, 3, 4, 8, 9, 10, 11]);
    // The ISR read through the window clears it too.
    rig.dev.interrupt().signal_queue(0);
    window(&mut rig, 0, layout::ISR_OFFSET as u32, 1);
    assert_eq!(window_read(&mut rig) & 0xff, 1);
    assert!(!rig.lines.level(INTX_GSI));
    assert_eq!(rig.read_isr(), 0);
    // A notify through the window.
    window(&mut rig, 0, layout::NOTIFY_OFFSET as u32 + 4, 2);
    window_write(&mut rig, 1);
    assert!(rig.dev.notify_events()[1].1.drain());
}

#[test]
fn pci_cfg_window_ignores_what_it_cannot_do() {
    let mut rig = Rig::new();
    let status = offset_of!(CommonCfg, device_status) as u32;
    for (bar, offset, length) in [
        (1, status, 1),      // not BAR0
        (0, status, 3),      // odd length
        (0, status + 1, 2),  // unaligned
        (0, status, 8),      // too long
        (0xff, u32::MAX, 4), // nonsense
    ] {
        window(&mut rig, bar, offset, length);
        window_write(&mut rig, 0x0f);
        assert_eq!(
            rig.status(),
            0,
            "bar {bar} offset {offset:#x} length {length}"
        );
        // The read leaves the data register as it was.
        assert_eq!(window_read(&mut rig), 0x0f);
    }
}

#[test]
fn device_configuration_passes_through() {
    let mut rig = Rig::new();
    lock(&rig.log).config = [0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17];
    assert_eq!(rig.read(layout::DEVICE_OFFSET, 8), 0x1716_1514_1312_1110);
    assert_eq!(rig.read(layout::DEVICE_OFFSET + 6, 2), 0x1716);
    rig.write(layout::DEVICE_OFFSET + 1, 1, 0xaa);
    assert_eq!(lock(&rig.log).config[1], 0xaa);
    // The last bytes of the window reach the device clipped to the window.
    assert_eq!(
        rig.read(layout::DEVICE_OFFSET + layout::DEVICE_LEN - 2, 8),
        0
    );
}

#[test]
fn common_configuration_reads_at_any_width() {
    let mut rig = Rig::new();
    rig.common_write(offset_of!(CommonCfg, queue_select), 2, 1);
    // queue_select and queue_size in one 4-byte read.
    assert_eq!(
        rig.common_read(offset_of!(CommonCfg, queue_select), 4),
        1 | (u64::from(QUEUE_MAX[1]) << 16)
    );
    // One byte of num_queues.
    assert_eq!(rig.common_read(offset_of!(CommonCfg, num_queues), 1), 2);
    // Past the structure: zeros, up to the ISR page.
    assert_eq!(rig.read(0x3c, 4), 0);
    assert_eq!(rig.read(0x800, 8), 0);
    // A 2-byte write that straddles status and generation sets only the status.
    rig.common_write(offset_of!(CommonCfg, device_status), 2, 0xff01);
    assert_eq!(rig.status(), STATUS_ACKNOWLEDGE);
    assert_eq!(
        rig.common_read(offset_of!(CommonCfg, config_generation), 1),
        0
    );
}
