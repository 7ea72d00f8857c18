//! Requests as the server receives them: method, path and body bytes (untrusted) to a typed
//! [`Request`], with no I/O, so it can be fuzzed. Unknown paths are 404s, a known path with
//! another method a 405, a body that is not the endpoint's type a 400 naming the field.

use serde::de::DeserializeOwned;

pub use super::endpoints::{Endpoint, ENDPOINTS};
use super::types::*;

/// The prefix of ferrovm's own (Cloud-Hypervisor-style) endpoints.
pub const V1: &str = "/api/v1/";

/// One request, decoded. Each variant has its line in [`ENDPOINTS`].
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

pub(super) fn body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Refusal> {
    serde_json::from_slice(bytes).map_err(|e| Refusal::new(400, format!("bad request body: {e}")))
}

/// A body that may be absent (empty): then the type's default.
pub(super) fn optional_body<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, Refusal> {
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

/// Firecracker's endpoints ferrovm does not implement: a 400 that says so, not a 404.
const UNSUPPORTED: &[&str] = &[
    "/logger",
    "/metrics",
    "/mmds",
    "/mmds/config",
    "/balloon",
    "/entropy",
    "/cpu-config",
];

/// A body that names its object by an id also given in the path (`PUT /drives/{drive_id}`).
pub trait IdInPath {
    /// The body field that holds the id.
    const ID_FIELD: &'static str;
    fn id(&self) -> &str;
}

impl IdInPath for FcDrive {
    const ID_FIELD: &'static str = "drive_id";
    fn id(&self) -> &str {
        &self.drive_id
    }
}

impl IdInPath for FcNetworkInterface {
    const ID_FIELD: &'static str = "iface_id";
    fn id(&self) -> &str {
        &self.iface_id
    }
}

/// The path's id and the body, which must name the same id.
pub(super) fn body_for_id<T: DeserializeOwned + IdInPath>(
    id: &str,
    bytes: &[u8],
) -> Result<(String, T), Refusal> {
    let id = path_id(id)?;
    let value: T = body(bytes)?;
    if value.id() != id {
        return Err(Refusal::new(
            400,
            format!("{} differs from the path's id", T::ID_FIELD),
        ));
    }
    Ok((id, value))
}

/// The path parameter if `path` is one of `pattern` (empty if the pattern has none). For
/// `/drives/{drive_id}` it is everything after `/drives/`, refused when decoded if it is not
/// one clean segment.
fn parameter<'a>(pattern: &str, path: &'a str) -> Option<&'a str> {
    match pattern.split_once('{') {
        Some((prefix, _)) => path.strip_prefix(prefix),
        None => (pattern == path).then_some(""),
    }
}

/// Decodes a request. `path` may carry a query string, which is ignored.
pub fn parse_request(method: &str, path: &str, bytes: &[u8]) -> Result<Request, Refusal> {
    let path = path.split('?').next().unwrap_or(path);
    for endpoint in ENDPOINTS.iter().filter(|e| e.method == method) {
        if let Some(parameter) = parameter(endpoint.path, path) {
            return (endpoint.decode)(parameter, bytes);
        }
    }
    if UNSUPPORTED.contains(&path) {
        return Err(Refusal::new(
            400,
            format!("{path}: not supported by ferrovm (it logs to stderr, FERROVM_LOG)"),
        ));
    }
    if ENDPOINTS.iter().any(|e| matches_path(e.path, path)) {
        return Err(Refusal::new(
            405,
            format!("{method} is not allowed on {path}"),
        ));
    }
    Err(Refusal::new(404, format!("no such endpoint: {path}")))
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
    request.endpoint().path
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
