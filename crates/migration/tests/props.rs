//! Property tests of the migration stream, the reply channel and the snapshot file on
//! untrusted input: arbitrary bytes and structured mutations of valid seeds (with and without
//! their CRCs fixed up, so the mutations reach the checks behind the checksums) give `Ok` or
//! a clean `Err`, never a panic, a hang or an allocation sized by a length field; accepted
//! frames re-encode to their bytes, accepted snapshots load only the pages they list.

#[path = "support/harness.rs"]
mod harness;

use harness::*;
use migration::{MAX_FRAME_PAYLOAD, PAGE_SIZE};
use proptest::prelude::*;
use testkit::{apply_all, bounded, mutations, Bounds};
use vm_memory::{Bytes, GuestAddress};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

/// A frame's payload may be buffered whole (8 MiB); the receiver's buffer, the verifier's
/// chunk and copies of the input come on top.
fn bounds_for(input_len: usize) -> Bounds {
    Bounds::alloc(MAX_FRAME_PAYLOAD as usize + (1 << 20) + 2 * input_len)
}

/// Runs the check of `mode` (as in [`harness::fuzz_one`]) under bounds.
fn run(mode: u8, input: Vec<u8>) {
    let mut data = vec![mode];
    data.extend_from_slice(&input);
    bounded(bounds_for(input.len()), move || fuzz_one(&data));
}

#[test]
fn seeds_are_accepted_and_restore_the_source() {
    let source = source_ram();
    for live in [false, true] {
        let stream = seed_stream(live);
        assert!(check_receive(&stream), "live = {live}");
        assert_eq!(check_frames(&stream, false), if live { 13 } else { 8 });
        let ram = small_ram();
        migration::restore_from(&ram, stream.as_slice(), &config()).unwrap();
        for addr in harness::DATA_PAGES {
            let mut got = vec![0u8; PAGE_SIZE as usize];
            ram.read_slice(&mut got, GuestAddress(addr)).unwrap();
            assert_eq!(got, page(addr), "page {addr:#x}");
        }
    }
    let same = seed_stream_same_page();
    assert!(check_receive(&same));
    let ram = small_ram();
    migration::restore_from(&ram, same.as_slice(), &config()).unwrap();
    let mut got = vec![0u8; PAGE_SIZE as usize];
    ram.read_slice(&mut got, GuestAddress(0x1000)).unwrap();
    assert_eq!(got, page(0), "the SamePage copy");
    let file = seed_snapshot_file();
    assert!(check_snapshot_file(&file));
    assert_eq!(check_frames(&file, true), 6);
    assert_eq!(check_replies(&seed_replies()), 4);
    drop(source);
}

/// A seed, the first frame's offset, and its mode for [`run`].
fn seeds() -> Vec<(Vec<u8>, usize, u8)> {
    vec![
        (seed_stream(false), 20, 0),
        (seed_stream(true), 20, 0),
        (seed_stream(true), 20, 1),
        (seed_stream_same_page(), 20, 0),
        (seed_snapshot_file(), 20, 2),
        (seed_replies(), 0, 3),
    ]
}

fn mutated_seed() -> impl Strategy<Value = (u8, Vec<u8>)> {
    let seeds = seeds();
    (0..seeds.len(), any::<bool>()).prop_flat_map(move |(i, fix_crcs)| {
        let (bytes, start, mode) = seeds[i].clone();
        let fields = frame_fields(&bytes, start);
        mutations(&fields).prop_map(move |ms| {
            let mode = if fix_crcs { mode | 0x80 } else { mode };
            (mode, apply_all(&bytes, &ms))
        })
    })
}

/// Random frames behind a valid header (version 1 or 2), or no header at all.
fn random_input() -> impl Strategy<Value = (u8, Vec<u8>)> {
    (
        0u8..4,
        any::<bool>(),
        0usize..3,
        proptest::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(mode, fix_crcs, header, body)| {
            let mut input = match header {
                0 => seed_stream(false)[..20].to_vec(),
                1 => seed_snapshot_file()[..20].to_vec(),
                _ => Vec::new(),
            };
            input.extend(body);
            (if fix_crcs { mode | 0x80 } else { mode }, input)
        })
}

proptest! {
    // Explicit case counts (whatever PROPTEST_CASES says); no persistence file: failures
    // become named regression tests.
    #![proptest_config(ProptestConfig {
        cases: 250,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_frames_give_ok_or_a_clean_error((mode, input) in random_input()) {
        run(mode, input);
    }

    #[test]
    fn mutated_seeds_give_ok_or_a_clean_error((mode, input) in mutated_seed()) {
        run(mode, input);
    }
}

/// Writes the seeds into `$FERROVM_FUZZ_CORPUS/migration_stream/` and `snapshot_file/` (run
/// by `make fuzz-seeds`), each behind its mode byte (see `harness::fuzz_one`).
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir);
    let names = [
        "stream",
        "live-stream",
        "live-frames",
        "snapshot",
        "replies",
    ];
    for ((bytes, _, mode), name) in seeds().into_iter().zip(names) {
        let target = if mode == 2 {
            "snapshot_file"
        } else {
            "migration_stream"
        };
        std::fs::create_dir_all(dir.join(target)).unwrap();
        for (fix, suffix) in [(0u8, ""), (0x80, "-fixcrc")] {
            let mut data = vec![mode | fix];
            data.extend_from_slice(&bytes);
            std::fs::write(dir.join(target).join(format!("{name}{suffix}")), &data).unwrap();
        }
    }
}
