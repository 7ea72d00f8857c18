//! Property tests of the control API's request parsing ([`vmm::api::parse_request`]) on
//! untrusted bytes: anything gives a request or a clean error, never a panic, a hang, a stack
//! overflow or an allocation out of proportion to the line; what is accepted is exactly what
//! the line says.

use proptest::prelude::*;
use serde_json::{json, Value};
use testkit::{apply_all, bounded, mutations, Bounds};
use vmm::api::{parse_request, Request};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

/// Valid request lines, one per request kind (the examples of docs/api.md).
pub const SEEDS: [&str; 7] = [
    r#"{"op":"status"}"#,
    r#"{"op":"pause"}"#,
    r#"{"op":"resume"}"#,
    r#"{"op":"shutdown"}"#,
    r#"{"op":"snapshot","path":"/tmp/vm.snap"}"#,
    r#"{"op":"migrate","destination":"tcp:127.0.0.1:7000"}"#,
    r#"{"op":"migrate","destination":"tcp:[::1]:7000","max_bandwidth":125000000,"downtime_ms":50,"max_rounds":30,"max_time_s":600,"auto_converge":true,"warm":false}"#,
];

/// Parses `line` under bounds and checks that an accepted request is what the line says.
fn parse_checked(line: Vec<u8>) -> Option<Request> {
    let bounds = Bounds::alloc(64 * 1024 + 8 * line.len());
    let input = line.clone();
    let parsed = bounded(bounds, move || parse_request(&input).ok());
    if let Some(request) = &parsed {
        check_accepted(&line, request);
    }
    parsed
}

fn check_accepted(line: &[u8], request: &Request) {
    let value: Value = serde_json::from_slice(line).expect("accepted, so it is JSON");
    let op = value["op"].as_str().expect("accepted, so it has an op");
    let expected_op = match request {
        Request::Status => "status",
        Request::Pause => "pause",
        Request::Resume { force } => {
            assert_eq!(value["force"].as_bool().unwrap_or(false), *force);
            "resume"
        }
        Request::Shutdown => "shutdown",
        Request::Snapshot { path } => {
            assert_eq!(value["path"].as_str(), path.to_str());
            "snapshot"
        }
        Request::Migrate(m) => {
            assert_eq!(value["destination"].as_str(), Some(m.destination.as_str()));
            assert_eq!(value["max_bandwidth"].as_u64(), m.max_bandwidth);
            assert_eq!(value["max_rounds"].as_u64(), m.max_rounds.map(u64::from));
            assert_eq!(value["warm"].as_bool().unwrap_or(false), m.warm);
            "migrate"
        }
        Request::MigrateCancel => "migrate_cancel",
    };
    assert_eq!(op, expected_op);
}

#[test]
fn every_seed_parses() {
    for seed in SEEDS {
        assert!(parse_checked(seed.as_bytes().to_vec()).is_some(), "{seed}");
    }
}

#[test]
fn deep_nesting_and_huge_numbers_are_clean_errors() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(parse_checked(deep.into_bytes()).is_none());
    let deep_object = format!(
        r#"{{"op":"status","x":{}1{}}}"#,
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    assert!(parse_checked(deep_object.into_bytes()).is_none());
    let big = br#"{"op":"migrate","destination":"x","max_rounds":99999999999999999999}"#;
    assert!(parse_checked(big.to_vec()).is_none());
}

/// A JSON value of any shape, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,16}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Objects with a known or unknown `op` and fields of the requests set to any value.
fn request_object() -> impl Strategy<Value = Vec<u8>> {
    let op = prop_oneof![
        proptest::sample::select(vec![
            "status", "pause", "resume", "shutdown", "snapshot", "migrate", "Status", ""
        ])
        .prop_map(Value::from),
        json_value(),
    ];
    let field = proptest::sample::select(vec![
        "path",
        "destination",
        "max_bandwidth",
        "downtime_ms",
        "max_rounds",
        "max_time_s",
        "auto_converge",
        "warm",
        "op",
        "extra",
    ]);
    (op, proptest::collection::vec((field, json_value()), 0..5)).prop_map(|(op, fields)| {
        let mut object = serde_json::Map::new();
        object.insert("op".into(), op);
        for (k, v) in fields {
            object.insert(k.into(), v);
        }
        serde_json::to_vec(&Value::Object(object)).unwrap()
    })
}

proptest! {
    // Explicit case counts (whatever PROPTEST_CASES says); no persistence file: failures
    // become named regression tests.
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_bytes_give_a_request_or_a_clean_error(
        line in proptest::collection::vec(any::<u8>(), 0..512)
    ) {
        parse_checked(line);
    }

    #[test]
    fn request_shaped_objects_parse_to_what_they_say(line in request_object()) {
        parse_checked(line);
    }

    #[test]
    fn mutated_requests_give_a_request_or_a_clean_error(
        (i, ms) in (0..SEEDS.len(), mutations(&[]))
    ) {
        parse_checked(apply_all(SEEDS[i].as_bytes(), &ms));
    }
}

/// Writes the seeds into `$FERROVM_FUZZ_CORPUS/api_request/` (run by `make fuzz-seeds`).
#[test]
#[ignore = "writes the fuzz corpus seeds; run by make fuzz-seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("FERROVM_FUZZ_CORPUS") else {
        panic!("set FERROVM_FUZZ_CORPUS to the fuzz corpus directory");
    };
    let dir = std::path::Path::new(&dir).join("api_request");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, seed) in SEEDS.iter().enumerate() {
        std::fs::write(dir.join(format!("request-{i}")), seed).unwrap();
    }
}
