//! Property tests of the virtio devices' descriptor-chain handling: hostile descriptor tables,
//! indirect tables and available rings published to a running virtio-blk (on a temporary
//! image), virtio-rng and virtio-console. The device never panics or hangs, answers with used
//! entries that name the heads made available and claim no more than the chains' writable
//! bytes, writes guest RAM only inside those buffers and the used ring, halts a broken queue
//! with DEVICE_NEEDS_RESET, and serves a good request after a reset (see
//! `support/chains.rs`).

#![cfg(target_os = "linux")]

mod support;

use proptest::prelude::*;
use support::chain_input::{decode, encode, Builder};
use support::chains::*;
use support::{DATA_START, IMAGE_SECTORS, RAM_A, RAM_B};
use testkit::{bounded, Bounds};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

/// Runs a scenario under the time and allocation bounds. A device may buffer a whole request
/// (a console line, 64 KiB of random bytes), never an amount a descriptor length chose.
fn check(s: Scenario) -> Reach {
    bounded(Bounds::alloc(4 << 20), move || run(&s))
}

/// A length a driver might put in a descriptor, extremes included.
fn length() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => proptest::sample::select(vec![0u32, 1, 15, 16, 17, 511, 512, 513, 4096]),
        1 => proptest::sample::select(vec![0x1_0000, 0x4_0000, 0x7fff_ffff, 0x8000_0000, u32::MAX]),
        1 => any::<u32>(),
    ]
}

/// An address anywhere that matters: the data area, region B, across the hole, the rings, the
/// indirect tables, the top of the address space.
fn address() -> impl Strategy<Value = u64> {
    (0u8..8, any::<u32>())
        .prop_map(|(selector, value)| support::chain_input::decode_address(selector, value))
}

/// A sector near the interesting edges of the disk.
fn sector() -> impl Strategy<Value = u64> {
    prop_oneof![
        proptest::sample::select(vec![
            0,
            1,
            IMAGE_SECTORS - 1,
            IMAGE_SECTORS,
            u64::MAX / 512,
            u64::MAX
        ]),
        0..IMAGE_SECTORS + 4,
    ]
}

/// One request as a driver would write it: (type or buffer-only, sector, data, indirect).
#[derive(Clone, Debug)]
struct Request {
    request_type: u32,
    sector: u64,
    data: Option<(u32, bool)>,
    indirect: bool,
}

fn request() -> impl Strategy<Value = Request> {
    let request_type = prop_oneof![
        4 => proptest::sample::select(BLOCK_REQUEST_TYPES.to_vec()),
        1 => any::<u32>(),
    ];
    let data_len = prop_oneof![
        3 => proptest::sample::select(vec![512u32, 1024, 4096, 16, 32, 20]),
        1 => length(),
    ];
    let data = proptest::option::weighted(0.8, (data_len, any::<bool>()));
    (request_type, sector(), data, any::<bool>()).prop_map(
        |(request_type, sector, data, indirect)| Request {
            request_type,
            sector,
            data,
            indirect,
        },
    )
}

/// A change a broken or hostile driver makes to a descriptor it wrote.
#[derive(Clone, Debug)]
enum Corruption {
    Address(u64),
    Length(u32),
    Flags(u16),
    /// Toggles NEXT, WRITE or INDIRECT.
    Toggle(u16),
    Next(u16),
    /// Address and length together (a buffer across the hole or the top of the address space).
    Buffer(u64, u32),
}

fn corruption() -> impl Strategy<Value = (usize, bool, Corruption)> {
    let change = prop_oneof![
        address().prop_map(Corruption::Address),
        length().prop_map(Corruption::Length),
        any::<u16>().prop_map(Corruption::Flags),
        proptest::sample::select(vec![NEXT, WRITE, INDIRECT]).prop_map(Corruption::Toggle),
        prop_oneof![0u16..8, any::<u16>()].prop_map(Corruption::Next),
        (address(), length()).prop_map(|(a, l)| Corruption::Buffer(a, l)),
        (0u64..0x2000, 1u32..0x4000)
            .prop_map(|(below, len)| Corruption::Buffer(u64::MAX - below, len)),
    ];
    (any::<usize>(), any::<bool>(), change)
}

fn corrupt(s: &mut Scenario, (index, in_indirect, change): (usize, bool, Corruption)) {
    let table = match s.indirect.iter_mut().find(|t| !t.is_empty()) {
        Some(table) if in_indirect => table,
        _ => &mut s.table,
    };
    if table.is_empty() {
        return;
    }
    let n = table.len();
    let desc = &mut table[index % n];
    match change {
        Corruption::Address(addr) => desc.addr = addr,
        Corruption::Length(len) => desc.len = len,
        Corruption::Flags(flags) => desc.flags = flags,
        Corruption::Toggle(bit) => desc.flags ^= bit,
        Corruption::Next(next) => desc.next = next,
        Corruption::Buffer(addr, len) => (desc.addr, desc.len) = (addr, len),
    }
}

/// Requests built by a driver, published in up to four batches, then corrupted.
#[derive(Clone, Debug)]
struct Plan {
    target: Target,
    event_idx: bool,
    size_log: u32,
    requests: Vec<Request>,
    splits: Vec<usize>,
    corruptions: Vec<(usize, bool, Corruption)>,
    /// Heads beyond what was built (any value) as (batch, position, head), inserted.
    stray_heads: Vec<(usize, usize, u16)>,
    /// (batch, index) published instead of the honest available index.
    bogus_index: Option<(usize, u16)>,
    used_event: u16,
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        proptest::sample::select(Target::ALL.to_vec()),
        any::<bool>(),
        0u32..=8,
        proptest::collection::vec(request(), 1..12),
        proptest::collection::vec(0usize..12, 0..3),
        proptest::collection::vec(corruption(), 0..4),
        proptest::collection::vec(
            (
                0usize..4,
                0usize..16,
                prop_oneof![3 => 0u16..8, 1 => any::<u16>()],
            ),
            0..3,
        ),
        proptest::option::weighted(0.05, (0usize..4, any::<u16>())),
        any::<u16>(),
    )
        .prop_map(
            |(
                target,
                event_idx,
                size_log,
                requests,
                splits,
                corruptions,
                stray_heads,
                bogus_index,
                used_event,
            )| Plan {
                target,
                event_idx,
                size_log,
                requests,
                splits,
                corruptions,
                stray_heads,
                bogus_index,
                used_event,
            },
        )
}

/// The builder's chain for `r`: a block request, or for the other devices its data buffer
/// alone (or a chain of it and a readable header-sized buffer).
fn build_request(b: &mut Builder, r: &Request) -> Option<u16> {
    if b.scenario.target == Target::Block {
        return b.block(r.request_type, r.sector, r.data, r.indirect);
    }
    let (len, writes) = r.data.unwrap_or((16, false));
    let data = b.alloc(len.min(0x1_0000));
    let mut bufs = vec![(data, len, writes)];
    if r.request_type.is_multiple_of(3) {
        bufs.insert(0, (b.alloc(16), 16, false));
    }
    b.chain(&bufs, r.indirect)
}

fn scenario(plan: Plan) -> Scenario {
    let mut b = Builder::new(plan.target, 1 << plan.size_log, plan.event_idx);
    let heads: Vec<u16> = plan
        .requests
        .iter()
        .filter_map(|r| build_request(&mut b, r))
        .collect();
    let mut splits: Vec<usize> = plan.splits.iter().map(|&s| s.min(heads.len())).collect();
    splits.sort_unstable();
    let mut start = 0;
    for end in splits.into_iter().chain([heads.len()]) {
        b.publish(heads[start..end.max(start)].to_vec());
        start = end.max(start);
    }
    let mut s = b.scenario;
    // A driver never publishes more than a queue's worth at once.
    for batch in &mut s.batches {
        batch.heads.truncate(usize::from(s.queue_size));
        batch.used_event = plan.used_event;
    }
    for (batch, position, head) in plan.stray_heads {
        let n = s.batches.len();
        let heads = &mut s.batches[batch % n].heads;
        heads.insert(position.min(heads.len()), head);
    }
    if let Some((batch, index)) = plan.bogus_index {
        let n = s.batches.len();
        s.batches[batch % n].avail_idx = Some(index);
    }
    plan.corruptions
        .into_iter()
        .for_each(|c| corrupt(&mut s, c));
    s
}

#[test]
fn well_formed_requests_are_served() {
    for target in Target::ALL {
        for size_log in [0, 3, 8] {
            let request = Request {
                request_type: BLOCK_REQUEST_TYPES[0],
                sector: 2,
                data: Some((512, true)),
                indirect: size_log == 0,
            };
            let plan = Plan {
                target,
                event_idx: size_log == 3,
                size_log,
                requests: vec![request; 3],
                splits: vec![1],
                corruptions: vec![],
                stray_heads: vec![],
                bogus_index: None,
                used_event: 0,
            };
            check(scenario(plan));
        }
    }
}

#[test]
fn the_byte_form_round_trips() {
    let plan = Plan {
        target: Target::Block,
        event_idx: true,
        size_log: 4,
        requests: vec![
            request_of(1, 3, Some((512, false)), true),
            request_of(0, 3, Some((512, true)), false),
        ],
        splits: vec![1],
        corruptions: vec![],
        stray_heads: vec![(0, 1, 9)],
        bogus_index: Some((1, 7)),
        used_event: 3,
    };
    let s = scenario(plan);
    assert_eq!(decode(&encode(&s)), s);
}

fn request_of(
    type_index: usize,
    sector: u64,
    data: Option<(u32, bool)>,
    indirect: bool,
) -> Request {
    Request {
        request_type: BLOCK_REQUEST_TYPES[type_index],
        sector,
        data,
        indirect,
    }
}

/// The generated scenarios mostly get their answers checked in full, reach halted queues on
/// every device, and sometimes make a device rewrite its own rings.
#[test]
fn scenarios_reach_deep() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut checked, mut halted, mut rewrote, cases) = (0, 0, 0, 64);
    for _ in 0..cases {
        let reach = check(scenario(plan().new_tree(&mut runner).unwrap().current()));
        checked += reach.checked_chains;
        halted += usize::from(reach.halted);
        rewrote += usize::from(reach.rewrote_input);
    }
    assert!(
        checked > 3 * cases && halted > cases / 16 && rewrote < cases / 4,
        "checked {checked}, halted {halted}, rewrote {rewrote}"
    );
}

proptest! {
    // Explicit case counts (whatever PROPTEST_CASES says); no persistence file: failures
    // become named regression tests.
    #![proptest_config(ProptestConfig {
        cases: 256,
        max_shrink_iters: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn corrupted_driver_chains_are_answered_or_halt_the_queue(plan in plan()) {
        check(scenario(plan));
    }

    #[test]
    fn arbitrary_rings_are_answered_or_halt_the_queue(
        data in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        check(decode(&data));
    }
}

// The RAM layout the scenarios assume.
const _: () = {
    assert!(RINGS_END <= INDIRECT_BASE);
    assert!(INDIRECT_BASE + MAX_INDIRECT_TABLES as u64 * INDIRECT_STRIDE <= DATA_START);
    assert!(RAM_A.0 + RAM_A.1 < RAM_B.0);
};

/// An available index more than a queue ahead of the device: the queue cannot be trusted, so
/// the device halts it with DEVICE_NEEDS_RESET (it used to ignore the ring silently, leaving
/// the driver waiting forever).
#[test]
fn an_available_index_beyond_the_queue_halts_it() {
    for target in Target::ALL {
        let mut b = Builder::new(target, 16, false);
        let head = build_request(&mut b, &request_of(0, 0, Some((512, true)), false)).unwrap();
        b.publish(vec![head]);
        b.scenario.batches[0].avail_idx = Some(1000);
        check(b.scenario);
    }
}

/// A device-writable buffer that runs past the top of the address space: its end wraps to low
/// guest addresses, where the device must not write (the block device put its status byte
/// there: in the descriptor table).
#[test]
fn a_buffer_wrapping_the_address_space_is_not_written() {
    for target in Target::ALL {
        let mut b = Builder::new(target, 8, false);
        let header = b.alloc(16);
        b.fill(header, block_header(BLOCK_REQUEST_TYPES[0], 0));
        let head = b.chain(
            &[(header, 16, false), (u64::MAX - 0xfff, 0x1800, true)],
            false,
        );
        b.publish(vec![head.unwrap()]);
        check(b.scenario);
    }
}

/// A virtio-blk request whose device-readable data is `data` (segments of a DISCARD or
/// WRITE_ZEROES, or sectors to write).
fn block_with_data(b: &mut Builder, request_type: u32, sector: u64, data: Vec<u8>) -> u16 {
    let header = b.alloc(16);
    b.fill(header, block_header(request_type, sector));
    let buf = b.alloc(data.len() as u32);
    let len = data.len() as u32;
    b.fill(buf, data);
    let status = b.alloc(1);
    b.chain(
        &[(header, 16, false), (buf, len, false), (status, 1, true)],
        false,
    )
    .unwrap()
}

/// One DISCARD or WRITE_ZEROES segment.
fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
    let mut raw = sector.to_le_bytes().to_vec();
    raw.extend_from_slice(&sectors.to_le_bytes());
    raw.extend_from_slice(&flags.to_le_bytes());
    raw
}

/// The seeds of the `virtio_blk_chains` fuzz target: each request type, direct and behind
/// indirect tables, several batches, and a few broken drivers.
fn fuzz_seeds() -> Vec<(&'static str, Scenario)> {
    let [read, write, flush, get_id, discard, zeroes] = BLOCK_REQUEST_TYPES;
    let mut seeds = Vec::new();
    let mut b = Builder::new(Target::Block, 16, false);
    let heads = vec![
        b.block(read, 0, Some((512, true)), false).unwrap(),
        b.block(write, 1, Some((1024, false)), false).unwrap(),
        b.block(flush, 0, None, false).unwrap(),
        b.block(get_id, 0, Some((20, true)), false).unwrap(),
    ];
    b.publish(heads);
    seeds.push(("requests", b.scenario));

    let mut b = Builder::new(Target::Block, 256, true);
    let first = b.block(read, 7, Some((4096, true)), true).unwrap();
    let second = block_with_data(&mut b, discard, 0, segment(8, 8, 0));
    let third = block_with_data(
        &mut b,
        zeroes,
        0,
        [segment(16, 8, 1), segment(40, 1, 0)].concat(),
    );
    b.publish(vec![first]);
    b.publish(vec![second, third]);
    seeds.push(("indirect-event-idx-ranges", b.scenario));

    let mut b = Builder::new(Target::Block, 1, false);
    let head = b
        .block(write, IMAGE_SECTORS - 1, Some((512, false)), true)
        .unwrap();
    b.publish(vec![head]);
    b.publish(vec![head]);
    seeds.push(("one-entry-queue", b.scenario));

    seeds.extend(hostile_seeds());
    seeds
}

/// Seeds of broken drivers: a looping chain, a head beyond the queue with a chain behind it,
/// a buffer that wraps around the address space, an available index far ahead.
fn hostile_seeds() -> Vec<(&'static str, Scenario)> {
    let [read, _, _, get_id, _, _] = BLOCK_REQUEST_TYPES;
    let mut b = Builder::new(Target::Block, 8, false);
    let head = b.block(read, 0, Some((512, true)), false).unwrap();
    b.scenario.table[2].flags |= NEXT; // status -> header: a loop
    b.publish(vec![head, 9, head]);
    let looping = b.scenario;

    let mut b = Builder::new(Target::Block, 8, false);
    let header = b.alloc(16);
    b.fill(header, block_header(get_id, 0));
    let head = b.chain(
        &[(header, 16, false), (u64::MAX - 0xfff, 0x1800, true)],
        false,
    );
    b.publish(vec![head.unwrap()]);
    b.scenario.batches[0].avail_idx = Some(40);
    vec![
        ("loop-then-bad-head", looping),
        ("wrapping-buffer-bogus-index", b.scenario),
    ]
}

/// Writes the seeds into `$FERROVM_FUZZ_CORPUS/virtio_blk_chains/` (run by
/// `make fuzz-seeds`).
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir).join("virtio_blk_chains");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, scenario) in fuzz_seeds() {
        let bytes = encode(&scenario);
        assert_eq!(decode(&bytes), scenario, "{name}");
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// The seeds hold, as the fuzz target runs them.
#[test]
fn fuzz_seeds_run() {
    for (_, scenario) in fuzz_seeds() {
        check(scenario);
    }
}
