//! Property tests of the control API's request decoding ([`vmm::api::request::parse_wire`]:
//! method, path and body) on untrusted bytes: anything gives a request or a clean refusal
//! (404, 405 or 400), never a panic, a hang, a stack overflow or an allocation out of
//! proportion to the input; what is accepted is exactly what the request says.

use proptest::prelude::*;
use serde_json::{json, Value};
use testkit::{apply_all, bounded, mutations, Bounds};
use vmm::api::request::{endpoint_of, matches_path, parse_wire, Request};

#[global_allocator]
static ALLOC: testkit::PeakAlloc = testkit::PeakAlloc;

/// Valid requests (`METHOD PATH`, a line feed, the body), one per kind of body.
pub const SEEDS: [&str; 12] = [
    "GET /api/v1/vm.info\n",
    "PUT /api/v1/vm.pause\n",
    "PUT /api/v1/vm.resume\n{\"force\":true}",
    "PUT /api/v1/vm.shutdown\n",
    "PUT /api/v1/vm.snapshot\n{\"destination_url\":\"file:///tmp/vm.snap\"}",
    "PUT /api/v1/vm.send-migration\n{\"destination_url\":\"tcp:127.0.0.1:7000\"}",
    "PUT /api/v1/vm.send-migration\n{\"destination_url\":\"tcp:[::1]:7000\",\"max_bandwidth\":125000000,\"downtime_ms\":50,\"max_rounds\":30,\"max_time_s\":600,\"auto_converge\":true,\"warm\":false}",
    "PUT /machine-config\n{\"vcpu_count\":2,\"mem_size_mib\":256,\"smt\":false}",
    "PUT /boot-source\n{\"kernel_image_path\":\"/k.elf\",\"boot_args\":\"console=ttyS0\"}",
    "PUT /drives/root\n{\"drive_id\":\"root\",\"path_on_host\":\"/d.img\",\"is_root_device\":true,\"is_read_only\":false}",
    "PUT /actions\n{\"action_type\":\"InstanceStart\"}",
    "PUT /snapshot/create\n{\"snapshot_path\":\"/s\",\"mem_file_path\":\"/m\"}",
];

/// Decodes `input` under bounds and checks that an accepted request is what it says.
fn parse_checked(input: Vec<u8>) -> Option<Request> {
    let bounds = Bounds::alloc(64 * 1024 + 8 * input.len());
    let copy = input.clone();
    let parsed = bounded(bounds, move || parse_wire(&copy));
    match parsed {
        Ok(request) => {
            check_accepted(&input, &request);
            Some(request)
        }
        Err(refusal) => {
            assert!([400, 404, 405].contains(&refusal.status), "{refusal:?}");
            None
        }
    }
}

fn check_accepted(input: &[u8], request: &Request) {
    let split = input
        .iter()
        .position(|&b| b == b'\n')
        .unwrap_or(input.len());
    let head = std::str::from_utf8(&input[..split]).unwrap();
    let path = head.split_once(' ').unwrap().1.split('?').next().unwrap();
    assert!(
        matches_path(endpoint_of(request), path),
        "{path} gave {request:?}"
    );
    let body: Value =
        serde_json::from_slice(input.get(split + 1..).unwrap_or_default()).unwrap_or(Value::Null);
    match request {
        Request::Resume(r) => assert_eq!(body["force"].as_bool().unwrap_or(false), r.force),
        Request::Snapshot(s) => {
            assert_eq!(
                body["destination_url"].as_str(),
                Some(s.destination_url.as_str())
            )
        }
        Request::SendMigration(m) => {
            let url = body.get("destination_url").or(body.get("destination"));
            assert_eq!(url.and_then(Value::as_str), Some(m.destination.as_str()));
            assert_eq!(body["max_bandwidth"].as_u64(), m.max_bandwidth);
            assert_eq!(body["max_rounds"].as_u64(), m.max_rounds.map(u64::from));
            assert_eq!(body["warm"].as_bool().unwrap_or(false), m.warm);
        }
        Request::FcPutMachineConfig(c) => {
            assert_eq!(body["vcpu_count"].as_u64(), Some(u64::from(c.vcpu_count)));
            assert_eq!(body["mem_size_mib"].as_u64(), Some(c.mem_size_mib));
        }
        Request::FcDrive(id, d) => {
            assert_eq!(id, &d.drive_id);
            assert_eq!(body["path_on_host"].as_str(), Some(d.path_on_host.as_str()));
        }
        _ => {}
    }
}

#[test]
fn every_seed_parses() {
    for seed in SEEDS {
        assert!(parse_checked(seed.as_bytes().to_vec()).is_some(), "{seed}");
    }
}

#[test]
fn deep_nesting_and_huge_numbers_are_clean_errors() {
    let deep = format!(
        "PUT /actions\n{}{}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(parse_checked(deep.into_bytes()).is_none());
    let deep_object = format!(
        r#"PUT /api/v1/vm.resume
{{"force":true,"x":{}1{}}}"#,
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    assert!(parse_checked(deep_object.into_bytes()).is_none());
    let big = b"PUT /api/v1/vm.send-migration\n{\"destination_url\":\"x\",\"max_rounds\":99999999999999999999}";
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

/// Known or unknown endpoints with objects whose fields are the requests' set to any value.
fn request_object() -> impl Strategy<Value = Vec<u8>> {
    let head = proptest::sample::select(vec![
        "PUT /api/v1/vm.resume",
        "PUT /api/v1/vm.snapshot",
        "PUT /api/v1/vm.send-migration",
        "PUT /machine-config",
        "PUT /drives/root",
        "PUT /drives/a/b",
        "PATCH /vm",
        "GET /vm",
        "PUT /api/v1/vm.Info",
    ]);
    let field = proptest::sample::select(vec![
        "force",
        "destination_url",
        "destination",
        "max_bandwidth",
        "max_rounds",
        "warm",
        "vcpu_count",
        "mem_size_mib",
        "drive_id",
        "path_on_host",
        "is_root_device",
        "state",
        "extra",
    ]);
    (head, proptest::collection::vec((field, json_value()), 0..6)).prop_map(|(head, fields)| {
        let object: serde_json::Map<String, Value> = fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let mut bytes = format!("{head}\n").into_bytes();
        bytes.extend(serde_json::to_vec(&Value::Object(object)).unwrap());
        bytes
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
        input in proptest::collection::vec(any::<u8>(), 0..512)
    ) {
        parse_checked(input);
    }

    #[test]
    fn request_shaped_objects_parse_to_what_they_say(input in request_object()) {
        parse_checked(input);
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
