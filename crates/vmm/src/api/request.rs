//! Requests as the server receives them: method, path and body bytes (untrusted) to a typed
//! [`Request`], with no I/O, so it can be fuzzed. Unknown paths are 404s, a known path with
//! another method a 405, a body that is not the endpoint's type a 400 naming the field.

use serde::de::DeserializeOwned;

use super::types::*;
use super::MigrateRequest;

/// The prefix of ferrovm's own (Cloud-Hypervisor-style) endpoints.
pub const V1: &str = "/api/v1/";

/// One endpoint: method, path (`{id}` for a path parameter), the schema names of its
/// request and reply bodies (docs/api.yaml's `components/schemas`). Checked against the
/// OpenAPI document by a test.
pub struct Endpoint {
    pub method: &'static str,
    pub path: &'static str,
    pub request: Option<&'static str>,
    pub reply: Option<&'static str>,
}

const fn ep(
    method: &'static str,
    path: &'static str,
    request: Option<&'static str>,
    reply: Option<&'static str>,
) -> Endpoint {
    Endpoint {
        method,
        path,
        request,
        reply,
    }
}

/// Every endpoint the server answers.
pub const ENDPOINTS: &[Endpoint] = &[
    ep("GET", "/api/v1/vmm.ping", None, Some("VmmPing")),
    ep("GET", "/api/v1/vm.info", None, Some("VmInfo")),
    ep("PUT", "/api/v1/vm.pause", None, Some("StateReply")),
    ep(
        "PUT",
        "/api/v1/vm.resume",
        Some("ResumeRequest"),
        Some("StateReply"),
    ),
    ep("PUT", "/api/v1/vm.shutdown", None, Some("StateReply")),
    ep(
        "PUT",
        "/api/v1/vm.snapshot",
        Some("SnapshotRequest"),
        Some("SnapshotReport"),
    ),
    ep("PUT", "/api/v1/vm.restore", Some("RestoreRequest"), None),
    ep(
        "PUT",
        "/api/v1/vm.send-migration",
        Some("MigrateRequest"),
        Some("MigrationReport"),
    ),
    ep(
        "PUT",
        "/api/v1/vm.receive-migration",
        Some("ReceiveMigrationRequest"),
        None,
    ),
    ep(
        "GET",
        "/api/v1/vm.migration-progress",
        None,
        Some("MigrationStatus"),
    ),
    ep(
        "PUT",
        "/api/v1/vm.migration-cancel",
        None,
        Some("CancelReply"),
    ),
    ep("GET", "/", None, Some("FcInstanceInfo")),
    ep("GET", "/version", None, Some("FcVersion")),
    ep("GET", "/machine-config", None, Some("FcMachineConfig")),
    ep("PUT", "/machine-config", Some("FcMachineConfig"), None),
    ep("PUT", "/boot-source", Some("FcBootSource"), None),
    ep("PUT", "/drives/{drive_id}", Some("FcDrive"), None),
    ep(
        "PUT",
        "/network-interfaces/{iface_id}",
        Some("FcNetworkInterface"),
        None,
    ),
    ep("PUT", "/vsock", Some("FcVsock"), None),
    ep("PUT", "/actions", Some("FcAction"), None),
    ep("PATCH", "/vm", Some("FcVmState"), None),
    ep("PUT", "/snapshot/create", Some("FcSnapshotCreate"), None),
    ep("PUT", "/snapshot/load", Some("FcSnapshotLoad"), None),
    ep("GET", "/vm/config", None, Some("FcFullConfig")),
];

/// One request, decoded.
#[derive(Debug)]
pub enum Request {
    Ping,
    Info,
    Pause,
    Resume(ResumeRequest),
    Shutdown,
    Snapshot(SnapshotRequest),
    Restore(RestoreRequest),
    SendMigration(MigrateRequest),
    ReceiveMigration(ReceiveMigrationRequest),
    MigrationProgress,
    MigrationCancel,
    FcInstanceInfo,
    FcVersion,
    FcGetMachineConfig,
    FcPutMachineConfig(FcMachineConfig),
    FcBootSource(FcBootSource),
    FcDrive(String, FcDrive),
    FcNetworkInterface(String, FcNetworkInterface),
    FcVsock(FcVsock),
    FcAction(FcAction),
    FcPatchVm(FcVmState),
    FcSnapshotCreate(FcSnapshotCreate),
    FcSnapshotLoad(FcSnapshotLoad),
    FcVmConfig,
}

/// Why a request was not accepted: the HTTP status and the fault message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }
}

fn body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Refusal> {
    serde_json::from_slice(bytes).map_err(|e| Refusal::new(400, format!("bad request body: {e}")))
}

/// A body that may be absent (empty): then the type's default.
fn optional_body<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, Refusal> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        Ok(T::default())
    } else {
        body(bytes)
    }
}

/// A path parameter: non-empty, printable ASCII, no slash, at most 64 bytes.
fn path_id(id: &str) -> Result<String, Refusal> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(id.to_string())
    } else {
        Err(Refusal::new(
            400,
            format!("bad id {id:?}: 1-64 letters, digits, '_' or '-'"),
        ))
    }
}

/// Decodes a request. `path` may carry a query string, which is ignored.
pub fn parse_request(method: &str, path: &str, bytes: &[u8]) -> Result<Request, Refusal> {
    let path = path.split('?').next().unwrap_or(path);
    let known = ENDPOINTS.iter().any(|e| matches_path(e.path, path));
    let request = match (method, path) {
        ("GET", "/api/v1/vmm.ping") => Request::Ping,
        ("GET", "/api/v1/vm.info") => Request::Info,
        ("PUT", "/api/v1/vm.pause") => Request::Pause,
        ("PUT", "/api/v1/vm.resume") => Request::Resume(optional_body(bytes)?),
        ("PUT", "/api/v1/vm.shutdown") => Request::Shutdown,
        ("PUT", "/api/v1/vm.snapshot") => Request::Snapshot(body(bytes)?),
        ("PUT", "/api/v1/vm.restore") => Request::Restore(body(bytes)?),
        ("PUT", "/api/v1/vm.send-migration") => Request::SendMigration(body(bytes)?),
        ("PUT", "/api/v1/vm.receive-migration") => Request::ReceiveMigration(body(bytes)?),
        ("GET", "/api/v1/vm.migration-progress") => Request::MigrationProgress,
        ("PUT", "/api/v1/vm.migration-cancel") => Request::MigrationCancel,
        ("GET", "/") => Request::FcInstanceInfo,
        ("GET", "/version") => Request::FcVersion,
        ("GET", "/machine-config") => Request::FcGetMachineConfig,
        ("PUT", "/machine-config") => Request::FcPutMachineConfig(body(bytes)?),
        ("PUT", "/boot-source") => Request::FcBootSource(body(bytes)?),
        ("PUT", "/vsock") => Request::FcVsock(body(bytes)?),
        ("PUT", "/actions") => Request::FcAction(body(bytes)?),
        ("PATCH", "/vm") => Request::FcPatchVm(body(bytes)?),
        ("PUT", "/snapshot/create") => Request::FcSnapshotCreate(body(bytes)?),
        ("PUT", "/snapshot/load") => Request::FcSnapshotLoad(body(bytes)?),
        ("GET", "/vm/config") => Request::FcVmConfig,
        ("PUT", p) if p.starts_with("/drives/") => {
            let id = path_id(&p["/drives/".len()..])?;
            let drive: FcDrive = body(bytes)?;
            if drive.drive_id != id {
                return Err(Refusal::new(400, "drive_id differs from the path's id"));
            }
            Request::FcDrive(id, drive)
        }
        ("PUT", p) if p.starts_with("/network-interfaces/") => {
            let id = path_id(&p["/network-interfaces/".len()..])?;
            let iface: FcNetworkInterface = body(bytes)?;
            if iface.iface_id != id {
                return Err(Refusal::new(400, "iface_id differs from the path's id"));
            }
            Request::FcNetworkInterface(id, iface)
        }
        (_, "/logger")
        | (_, "/metrics")
        | (_, "/mmds")
        | (_, "/mmds/config")
        | (_, "/balloon")
        | (_, "/entropy")
        | (_, "/cpu-config") => {
            return Err(Refusal::new(
                400,
                format!("{path}: not supported by ferrovm (it logs to stderr, FERROVM_LOG)"),
            ))
        }
        _ if known => {
            return Err(Refusal::new(
                405,
                format!("{method} is not allowed on {path}"),
            ))
        }
        _ => return Err(Refusal::new(404, format!("no such endpoint: {path}"))),
    };
    Ok(request)
}

/// Decodes a request in the form the fuzz target and property tests feed: `METHOD PATH`, a
/// line feed, then the body.
pub fn parse_wire(data: &[u8]) -> Result<Request, Refusal> {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let head = std::str::from_utf8(&data[..split])
        .map_err(|_| Refusal::new(400, "the request line is not UTF-8"))?;
    let (method, path) = head
        .split_once(' ')
        .ok_or_else(|| Refusal::new(400, "expected METHOD PATH"))?;
    let body = data.get(split + 1..).unwrap_or_default();
    parse_request(method, path, body)
}

/// The endpoint path a request was decoded from (its pattern, `{id}` for a parameter).
pub fn endpoint_of(request: &Request) -> &'static str {
    match request {
        Request::Ping => "/api/v1/vmm.ping",
        Request::Info => "/api/v1/vm.info",
        Request::Pause => "/api/v1/vm.pause",
        Request::Resume(_) => "/api/v1/vm.resume",
        Request::Shutdown => "/api/v1/vm.shutdown",
        Request::Snapshot(_) => "/api/v1/vm.snapshot",
        Request::Restore(_) => "/api/v1/vm.restore",
        Request::SendMigration(_) => "/api/v1/vm.send-migration",
        Request::ReceiveMigration(_) => "/api/v1/vm.receive-migration",
        Request::MigrationProgress => "/api/v1/vm.migration-progress",
        Request::MigrationCancel => "/api/v1/vm.migration-cancel",
        Request::FcInstanceInfo => "/",
        Request::FcVersion => "/version",
        Request::FcGetMachineConfig | Request::FcPutMachineConfig(_) => "/machine-config",
        Request::FcBootSource(_) => "/boot-source",
        Request::FcDrive(..) => "/drives/{drive_id}",
        Request::FcNetworkInterface(..) => "/network-interfaces/{iface_id}",
        Request::FcVsock(_) => "/vsock",
        Request::FcAction(_) => "/actions",
        Request::FcPatchVm(_) => "/vm",
        Request::FcSnapshotCreate(_) => "/snapshot/create",
        Request::FcSnapshotLoad(_) => "/snapshot/load",
        Request::FcVmConfig => "/vm/config",
    }
}

/// Whether `path` is an instance of the endpoint path `pattern` (`{id}` matches one
/// segment).
pub fn matches_path(pattern: &str, path: &str) -> bool {
    let (mut a, mut b) = (pattern.split('/'), path.split('/'));
    loop {
        match (a.next(), b.next()) {
            (None, None) => return true,
            (Some(p), Some(s)) if p == s || (p.starts_with('{') && !s.is_empty()) => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_paths_and_bodies() {
        assert!(matches!(
            parse_request("GET", "/api/v1/vm.info?x=1", b""),
            Ok(Request::Info)
        ));
        assert_eq!(parse_request("GET", "/nope", b"").unwrap_err().status, 404);
        assert_eq!(
            parse_request("GET", "/api/v1/vm.pause", b"")
                .unwrap_err()
                .status,
            405
        );
        assert_eq!(
            parse_request("DELETE", "/drives/root", b"")
                .unwrap_err()
                .status,
            405
        );
        let e = parse_request(
            "PUT",
            "/machine-config",
            br#"{"vcpu_count":1,"mem_size_mib":64,"x":1}"#,
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("unknown field `x`"), "{}", e.message);
        let e = parse_request(
            "PUT",
            "/drives/a",
            br#"{"drive_id":"b","path_on_host":"/x","is_root_device":false}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("differs"), "{}", e.message);
        assert!(matches!(
            parse_request("PUT", "/api/v1/vm.resume", b""),
            Ok(Request::Resume(ResumeRequest { force: false }))
        ));
        assert_eq!(
            parse_request("PUT", "/logger", b"{}").unwrap_err().status,
            400
        );
    }
}
