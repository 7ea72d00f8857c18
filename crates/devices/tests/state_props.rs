//! Property tests of device state restore (the JSON a snapshot or a migration carries):
//! arbitrary JSON and the fresh state with any node replaced by an extreme value give `Ok` or
//! a clean `Err`, never a panic, a hang or an unbounded allocation; a restored device saves a
//! state it accepts again and serves guest port accesses.

#[path = "support/state_harness.rs"]
mod state_harness;

use proptest::prelude::*;
use serde_json::{json, Value};
use state_harness::*;
use testkit::{bounded, Bounds};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

fn run(kind: usize, json: Vec<u8>, accesses: Vec<u8>) -> bool {
    let bounds = Bounds::alloc(256 * 1024 + 8 * json.len());
    bounded(bounds, move || check_restore(kind, &json, &accesses))
}

#[test]
fn fresh_states_restore() {
    for (kind, name) in DEVICES.iter().enumerate() {
        let json = serde_json::to_vec(&fresh_state(kind)).unwrap();
        let accesses = vec![0, 0, 0, 0, 1, 0, 1, 0x80];
        assert!(run(kind, json, accesses), "{name}");
    }
}

fn extreme() -> impl Strategy<Value = Value> {
    prop_oneof![
        proptest::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(255),
            json!(256),
            json!(65535),
            json!(65536),
            json!(u32::MAX),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(1e300),
            json!(-0.5),
            json!(true),
            json!(null),
            json!(""),
            json!([]),
            json!({}),
            json!(vec![0xffu8; 300]),
            json!(vec![0u8; 3]),
        ]),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
    ]
}

/// A fresh state with up to three nodes replaced.
fn mutated_state() -> impl Strategy<Value = (usize, Vec<u8>)> {
    (
        0..DEVICES.len(),
        proptest::collection::vec((any::<usize>(), extreme()), 1..=3),
    )
        .prop_map(|(kind, edits)| {
            let mut state = fresh_state(kind);
            for (target, with) in edits {
                let nodes = node_count(&state);
                // Never the root: a whole-state replacement is the arbitrary-JSON case.
                replace_node(&mut state, 1 + target % (nodes - 1).max(1), &with);
            }
            (kind, serde_json::to_vec(&state).unwrap())
        })
}

proptest! {
    // Explicit case counts (whatever PROPTEST_CASES says); no persistence file: failures
    // become named regression tests.
    #![proptest_config(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_states_give_ok_or_a_clean_error(
        (kind, json) in mutated_state(),
        accesses in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        run(kind, json, accesses);
    }

    #[test]
    fn arbitrary_bytes_give_ok_or_a_clean_error(
        kind in 0..DEVICES.len(),
        json in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        run(kind, json, vec![]);
    }
}

/// Writes the fresh states into `$FERROVM_FUZZ_CORPUS/device_state/` (run by
/// `make fuzz-seeds`), each with a few port accesses.
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir).join("device_state");
    std::fs::create_dir_all(&dir).unwrap();
    for (kind, name) in DEVICES.iter().enumerate() {
        let mut data = vec![kind as u8, 2, 0, 0, 0, 0, 1, 0, 1, 0x80];
        data.extend(serde_json::to_vec(&fresh_state(kind)).unwrap());
        std::fs::write(dir.join(name), &data).unwrap();
    }
}
