//! Property tests of the virtio PCI transport: arbitrary sequences of configuration-space and
//! BAR accesses (any offset, size and value) interleaved with a driver's steps (feature
//! negotiation, queue setup, DRIVER_OK, requests, MSI-X programming) on the transport of a
//! real virtio-blk device. Never a panic; after every access the status, vectors, queues,
//! INTx line and ioeventfd registrations obey the transport's invariants; the state saves
//! and restores; a reset and a proper bring-up serve requests (see `support/pci_access.rs`).

#![cfg(target_os = "linux")]

mod support;

use proptest::prelude::*;
use support::pci_access::*;
use support::pci_input::{bring_up, decode, decode_offset, encode};
use testkit::{bounded, Bounds};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

fn check(ops: Vec<Op>) -> Reach {
    bounded(Bounds::alloc(4 << 20), move || run(&ops))
}

/// Bytes a driver might write: small numbers, status bits, addresses, or anything.
fn value(max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    let word = prop_oneof![
        0u64..4,
        proptest::sample::select(vec![0x7u64, 0xb, 0xf, 0x8f, 0x40, 0x80, 0xffff, 0x1000]),
        (0u64..0x100).prop_map(|page| page << 12),
        any::<u64>(),
    ];
    (word, 0..=max_len).prop_map(|(word, len)| {
        let mut bytes = word.to_le_bytes().to_vec();
        bytes.resize(len, 0);
        bytes
    })
}

fn bar_offset() -> impl Strategy<Value = u64> {
    (0u8..8, any::<u32>()).prop_map(|(selector, v)| decode_offset(selector, v))
}

fn bar() -> impl Strategy<Value = usize> {
    prop_oneof![7 => Just(0usize), 1 => Just(2usize)]
}

fn raw_access() -> impl Strategy<Value = Op> {
    let config_offset = prop_oneof![4 => 0u16..0x100, 1 => any::<u16>()];
    prop_oneof![
        (bar(), bar_offset(), 0usize..=16).prop_map(|(bar, offset, len)| Op::BarRead {
            bar,
            offset,
            len
        }),
        (bar(), bar_offset(), value(16)).prop_map(|(bar, offset, data)| Op::BarWrite {
            bar,
            offset,
            data
        }),
        config_offset
            .clone()
            .prop_map(|offset| Op::ConfigRead { offset }),
        (config_offset, 0u8..5, value(8)).prop_map(|(offset, sub, data)| Op::ConfigWrite {
            offset,
            sub,
            data
        }),
        proptest::option::of(any::<u64>().prop_map(|b| b & !0xfff))
            .prop_map(|base| Op::BarMoved { base }),
        // The command register's INTx-disable bit (byte 1, bit 2).
        any::<bool>().prop_map(|off| Op::ConfigWrite {
            offset: 4,
            sub: 1,
            data: vec![u8::from(off) << 2]
        }),
    ]
}

fn rings() -> impl Strategy<Value = Option<(u64, u64, u64)>> {
    let address = prop_oneof![
        (0u64..0x40).prop_map(|page| page << 12),
        (0u64..0x4_0000),
        any::<u64>(),
    ];
    proptest::option::weighted(0.3, (address.clone(), address.clone(), address))
}

fn driver_step() -> impl Strategy<Value = Op> {
    let vector = prop_oneof![0u16..3, Just(0xffff), any::<u16>()];
    prop_oneof![
        proptest::sample::select(vec![0u8, 1, 3, 0xb, 0xf, 0x8f, 0x40, 0x80, 0x4f])
            .prop_map(Op::Status),
        prop_oneof![
            Just(VERSION_1),
            Just(VERSION_1 | 1 << 28 | 1 << 29 | 1 << 9),
            any::<u64>(),
        ]
        .prop_map(Op::Negotiate),
        (
            prop_oneof![Just(0u16), any::<u16>()],
            proptest::sample::select(vec![1u16, 2, 16, 256, 0, 3, 512, 0xffff]),
            rings()
        )
            .prop_map(|(queue, size, rings)| Op::SetupQueue { queue, size, rings }),
        Just(Op::DriverOk),
        (any::<bool>(), any::<bool>()).prop_map(|(enable, mask)| Op::Msix { enable, mask }),
        (vector.clone(), any::<bool>()).prop_map(|(entry, masked)| Op::Vector { entry, masked }),
        (vector.clone(), vector).prop_map(|(config, queue)| Op::SetVectors { config, queue }),
        any::<u8>().prop_map(|sector| Op::Request { sector }),
        prop_oneof![Just(0u16), any::<u16>()].prop_map(|queue| Op::Kick { queue }),
    ]
}

/// A sequence, starting half the time from a device a driver brought up.
fn sequence() -> impl Strategy<Value = Vec<Op>> {
    let steps = proptest::collection::vec(prop_oneof![raw_access(), driver_step()], 0..40);
    let start = proptest::option::of((
        any::<u64>(),
        proptest::sample::select(vec![1u16, 8, 256]),
        any::<bool>(),
    ));
    (start, steps).prop_map(|(start, steps)| {
        let mut ops = start.map_or_else(Vec::new, |(features, size, msix)| {
            bring_up(features & 0x3000_0600, size, msix, 2)
        });
        ops.extend(steps);
        ops
    })
}

#[test]
fn a_driver_brings_the_device_up() {
    for msix in [false, true] {
        let reach = check(bring_up(0, 16, msix, 3));
        assert!(reach.running > 0);
    }
}

#[test]
fn the_byte_form_round_trips() {
    let mut ops = bring_up(1 << 29, 8, true, 2);
    ops.extend([
        Op::BarRead {
            bar: 2,
            offset: 0x3000,
            len: 4,
        },
        Op::BarWrite {
            bar: 0,
            offset: 0x14,
            data: vec![0],
        },
        Op::ConfigWrite {
            offset: 0x90,
            sub: 2,
            data: vec![1, 2, 3],
        },
        Op::ConfigRead { offset: 0xa0 },
        Op::BarMoved { base: None },
        Op::BarMoved {
            base: Some(0xc000_0000),
        },
        Op::SetupQueue {
            queue: 3,
            size: 7,
            rings: Some((1, 2, 3)),
        },
        Op::Kick { queue: 9 },
    ]);
    assert_eq!(decode(&encode(&ops)), ops);
}

/// Writing DRIVER_OK before FEATURES_OK leaves the device failed: NEEDS_RESET, and it does
/// not run.
#[test]
fn driver_ok_without_features_ok_needs_reset() {
    check(vec![
        Op::Status(ACKNOWLEDGE | DRIVER),
        Op::SetupQueue {
            queue: 0,
            size: 16,
            rings: None,
        },
        Op::Status(ACKNOWLEDGE | DRIVER | DRIVER_OK),
        Op::Request { sector: 1 },
    ]);
}

/// The generated sequences reach a running device, one that needs a reset, and MSI-X
/// messages: the invariants are checked where they matter.
#[test]
fn sequences_reach_deep() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut total = Reach::default();
    for _ in 0..32 {
        let ops = sequence().new_tree(&mut runner).unwrap().current();
        let reach = check(ops);
        total.running += reach.running;
        total.needs_reset += reach.needs_reset;
        total.msi_fired += reach.msi_fired;
    }
    assert!(
        total.running > 100 && total.needs_reset > 10 && total.msi_fired > 0,
        "{total:?}"
    );
}

proptest! {
    // Explicit case counts (whatever PROPTEST_CASES says); no persistence file: failures
    // become named regression tests.
    #![proptest_config(ProptestConfig {
        cases: 128,
        max_shrink_iters: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn accesses_keep_the_transport_invariants(ops in sequence()) {
        check(ops);
    }

    #[test]
    fn arbitrary_bytes_keep_the_transport_invariants(
        data in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        check(decode(&data));
    }
}

/// Sets the PCI-configuration-access window (capability at 0x90) to 1 byte at BAR0 offset
/// 0x14 (device_status), then writes and reads it through the window.
fn window_seed() -> Vec<Op> {
    let dword = |offset: u16, value: u32| Op::ConfigWrite {
        offset,
        sub: 0,
        data: value.to_le_bytes().to_vec(),
    };
    vec![
        dword(0x94, 0),
        dword(0x98, 0x14),
        dword(0x9c, 1),
        Op::ConfigWrite {
            offset: 0xa0,
            sub: 0,
            data: vec![ACKNOWLEDGE],
        },
        Op::ConfigRead { offset: 0xa0 },
    ]
}

/// A bring-up with MSI-X, then the table and PBA read, and a request while the function is
/// masked (its message pending until unmasked).
fn msix_seed() -> Vec<Op> {
    let mut ops = bring_up(0, 8, true, 1);
    ops.extend([
        Op::BarRead {
            bar: 0,
            offset: layout().table_offset,
            len: 16,
        },
        Op::BarRead {
            bar: 0,
            offset: layout().pba_offset,
            len: 8,
        },
        Op::Msix {
            enable: true,
            mask: true,
        },
        Op::Request { sector: 9 },
        Op::Msix {
            enable: true,
            mask: false,
        },
    ]);
    ops
}

/// BAR0 placed, unplaced, and placed elsewhere around a bring-up.
fn bar_moves_seed() -> Vec<Op> {
    let mut ops = vec![
        Op::BarMoved {
            base: Some(0xc000_0000),
        },
        Op::BarMoved { base: None },
    ];
    ops.extend(bring_up(0, 2, false, 1));
    ops.push(Op::BarMoved {
        base: Some(0xd000_0000),
    });
    ops
}

/// The seeds of the `virtio_pci_access` fuzz target: bring-ups with and without MSI-X, a
/// reset in the middle, the PCI-configuration-access window, MSI-X table and PBA reads, the
/// whole configuration space, BAR moves.
fn fuzz_seeds() -> Vec<(&'static str, Vec<Op>)> {
    let event_idx = 1 << 29;
    let mut reset_midway = bring_up(0, 16, false, 1);
    reset_midway.extend(bring_up(event_idx, 256, true, 2));
    let config_space = (0..64)
        .map(|dword| Op::ConfigRead { offset: dword * 4 })
        .collect();
    vec![
        ("bring-up", bring_up(0, 16, false, 2)),
        ("bring-up-msix", bring_up(event_idx, 256, true, 3)),
        ("reset-midway", reset_midway),
        ("pci-cfg-window", window_seed()),
        ("msix", msix_seed()),
        ("config-space", config_space),
        ("bar-moves", bar_moves_seed()),
    ]
}

/// Writes the seeds into `$FERROVM_FUZZ_CORPUS/virtio_pci_access/` (run by
/// `make fuzz-seeds`).
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir).join("virtio_pci_access");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, ops) in fuzz_seeds() {
        let bytes = encode(&ops);
        assert_eq!(decode(&bytes), ops, "{name}");
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// The seeds hold, as the fuzz target runs them.
#[test]
fn fuzz_seeds_run() {
    for (_, ops) in fuzz_seeds() {
        check(ops);
    }
}
