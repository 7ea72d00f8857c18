//! docs/api.yaml (the OpenAPI document) against the server: the same paths and methods as
//! [`vmm::api::endpoints::ENDPOINTS`], the same request and reply schema per endpoint, and for
//! every schema the same field names as its Rust type (a fully populated sample must
//! deserialize and serialize back with exactly the schema's properties) and the same required
//! fields (a field the type cannot do without is `required` in the schema, and the reverse,
//! except that a required field may be nullable).

use std::collections::BTreeSet;

use serde::{de::DeserializeOwned, Serialize};
use serde_json::{json, Value};
use vmm::api::endpoints::ENDPOINTS;
use vmm::api::types::*;
use vmm::api::MigrateRequest;

fn document() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/api.yaml");
    let text = std::fs::read_to_string(path).expect("docs/api.yaml");
    serde_norway::from_str(&text).expect("docs/api.yaml is YAML")
}

/// The schema name of a `$ref`.
fn ref_name(schema: &Value) -> Option<String> {
    schema["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
        .map(str::to_string)
}

/// Deserializes `v` as `T`; on success, serializes it back and returns its field names.
fn round_trip<T: DeserializeOwned + Serialize>(v: Value) -> Option<BTreeSet<String>> {
    let typed: T = serde_json::from_value(v).ok()?;
    let back = serde_json::to_value(typed).unwrap();
    Some(back.as_object().unwrap().keys().cloned().collect())
}

type Check = fn(Value) -> Option<BTreeSet<String>>;

/// Every schema's type and a sample with every field set.
fn samples() -> Vec<(&'static str, Check, Value)> {
    let progress = json!({"round": 3, "bytes_sent": 1, "bytes_remaining": 2, "dirty_rate": 1.5, "bandwidth": 2.5});
    let machine = json!({"vcpu_count": 2, "mem_size_mib": 256, "smt": false, "cpu_template": "None", "track_dirty_pages": true, "huge_pages": "None"});
    let boot = json!({"kernel_image_path": "/k", "boot_args": "a", "initrd_path": "/i"});
    let drive = json!({"drive_id": "d", "path_on_host": "/d", "is_root_device": true, "is_read_only": true, "partuuid": "p", "cache_type": "Unsafe", "io_engine": "Sync", "rate_limiter": {}});
    let net = json!({"iface_id": "n", "host_dev_name": "tap0", "guest_mac": "02:00:00:00:00:01", "rx_rate_limiter": {}, "tx_rate_limiter": {}});
    let vsock = json!({"guest_cid": 3, "uds_path": "/v", "vsock_id": "v"});
    vec![
        ("Fault", round_trip::<Fault>, json!({"fault_message": "x"})),
        (
            "VmmPing",
            round_trip::<VmmPing>,
            json!({"version": "1", "pid": 1}),
        ),
        (
            "VmInfo",
            round_trip::<VmInfo>,
            json!({"state": "running", "operation": "pause", "vcpus": 1, "memory_bytes": 1, "irqchip": "kernel", "migration": progress, "serial_dropped_bytes": 0}),
        ),
        (
            "StateReply",
            round_trip::<StateReply>,
            json!({"state": "running", "message": "taken back"}),
        ),
        (
            "ResumeRequest",
            round_trip::<ResumeRequest>,
            json!({"force": true}),
        ),
        (
            "SnapshotRequest",
            round_trip::<SnapshotRequest>,
            json!({"destination_url": "file:///s"}),
        ),
        (
            "RestoreRequest",
            round_trip::<RestoreRequest>,
            json!({"source_url": "file:///s", "prefault": true}),
        ),
        (
            "ReceiveMigrationRequest",
            round_trip::<ReceiveMigrationRequest>,
            json!({"receiver_url": "tcp:0.0.0.0:1"}),
        ),
        (
            "SnapshotReport",
            round_trip::<SnapshotReport>,
            json!({"path": "/s", "paused_ms": 1, "total_ms": 1, "bytes": 1, "file_bytes": 1, "pages": 1, "zero_pages": 1, "untouched_pages_skipped": 1}),
        ),
        (
            "MigrateRequest",
            round_trip::<MigrateRequest>,
            json!({"destination_url": "tcp:h:1", "local": false, "max_bandwidth": 1, "downtime_ms": 1, "max_rounds": 1, "max_time_s": 1, "auto_converge": true, "warm": true}),
        ),
        (
            "MigrationReport",
            round_trip::<MigrationReport>,
            json!({"report": {"total_ms": 1}}),
        ),
        (
            "MigrationProgress",
            round_trip::<MigrationProgress>,
            progress.clone(),
        ),
        (
            "MigrationStatus",
            round_trip::<MigrationStatus>,
            json!({"active": true, "progress": progress}),
        ),
        (
            "CancelReply",
            round_trip::<CancelReply>,
            json!({"cancelled": true}),
        ),
        (
            "FcInstanceInfo",
            round_trip::<FcInstanceInfo>,
            json!({"app_name": "a", "id": "i", "state": "Running", "vmm_version": "1"}),
        ),
        (
            "FcVersion",
            round_trip::<FcVersion>,
            json!({"firecracker_version": "1"}),
        ),
        (
            "FcMachineConfig",
            round_trip::<FcMachineConfig>,
            machine.clone(),
        ),
        ("FcBootSource", round_trip::<FcBootSource>, boot.clone()),
        ("FcDrive", round_trip::<FcDrive>, drive.clone()),
        (
            "FcNetworkInterface",
            round_trip::<FcNetworkInterface>,
            net.clone(),
        ),
        ("FcVsock", round_trip::<FcVsock>, vsock.clone()),
        (
            "FcAction",
            round_trip::<FcAction>,
            json!({"action_type": "InstanceStart"}),
        ),
        (
            "FcVmState",
            round_trip::<FcVmState>,
            json!({"state": "Paused"}),
        ),
        (
            "FcSnapshotCreate",
            round_trip::<FcSnapshotCreate>,
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "snapshot_type": "Full", "version": "1"}),
        ),
        (
            "FcMemBackend",
            round_trip::<FcMemBackend>,
            json!({"backend_type": "File", "backend_path": "/m"}),
        ),
        (
            "FcSnapshotLoad",
            round_trip::<FcSnapshotLoad>,
            json!({"snapshot_path": "/s", "mem_file_path": "/m", "mem_backend": {"backend_type": "File", "backend_path": "/m"}, "enable_diff_snapshots": false, "resume_vm": true}),
        ),
        (
            "FcFullConfig",
            round_trip::<FcFullConfig>,
            json!({"boot-source": boot, "machine-config": machine, "drives": [drive], "network-interfaces": [net], "vsock": vsock}),
        ),
    ]
}

#[test]
fn paths_and_methods_match_the_server() {
    let doc = document();
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let request =
                ref_name(&operation["requestBody"]["content"]["application/json"]["schema"]);
            let success = operation["responses"]
                .as_object()
                .unwrap()
                .iter()
                .find(|(status, _)| status.starts_with('2'))
                .map(|(_, r)| r.clone())
                .unwrap_or(Value::Null);
            let reply = ref_name(&success["content"]["application/json"]["schema"]);
            documented.insert((method.to_uppercase(), path.clone(), request, reply));
        }
    }
    let served: BTreeSet<_> = ENDPOINTS
        .iter()
        .map(|e| {
            (
                e.method.to_string(),
                e.path.to_string(),
                e.request.map(str::to_string),
                e.reply.map(str::to_string),
            )
        })
        .collect();
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "served but not documented (or with other schemas): {missing:#?}\n\
         documented but not served: {extra:#?}"
    );
}

#[test]
fn schemas_match_the_types() {
    let doc = document();
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    let samples = samples();
    let typed: BTreeSet<_> = samples.iter().map(|(n, _, _)| n.to_string()).collect();
    let documented: BTreeSet<_> = schemas.keys().cloned().collect();
    assert_eq!(
        typed, documented,
        "schemas without a type, or types without a schema"
    );
    for (name, check, sample) in samples {
        let schema = &schemas[name];
        let properties: BTreeSet<String> = schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let fields = check(sample.clone())
            .unwrap_or_else(|| panic!("{name}: the sample does not deserialize"));
        assert_eq!(
            fields, properties,
            "{name}: the type's fields and the schema's properties"
        );
        let required: BTreeSet<String> = schema["required"]
            .as_array()
            .map(|r| r.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default();
        for field in &properties {
            let mut without = sample.clone();
            without.as_object_mut().unwrap().remove(field);
            let optional = check(without).is_some();
            let nullable = schema["properties"][field]["nullable"] == json!(true);
            match (optional, required.contains(field)) {
                (false, false) => {
                    panic!("{name}.{field}: the type requires it, the schema does not")
                }
                (true, true) if !nullable => {
                    panic!("{name}.{field}: required in the schema, optional in the type")
                }
                _ => {}
            }
        }
    }
}

/// Unknown fields are refused, never ignored, by every request type.
#[test]
fn request_types_refuse_unknown_fields() {
    for endpoint in ENDPOINTS.iter().filter(|e| e.request.is_some()) {
        let name = endpoint.request.unwrap();
        let (_, check, sample) = samples().into_iter().find(|(n, _, _)| *n == name).unwrap();
        let mut extra = sample;
        extra["surprise"] = json!(1);
        assert!(check(extra).is_none(), "{name} accepted an unknown field");
    }
}
