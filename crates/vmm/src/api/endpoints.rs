//! The one table of the API's endpoints. Each line gives an endpoint's name (its
//! [`Request`] variant), method, path, request body and reply; from it come the request
//! parser's dispatch ([`ENDPOINTS`]), [`Request::endpoint`], the typed calls of the client
//! ([`call`]) and the schema names docs/api.yaml is checked against (a test). Adding an
//! endpoint is one line here, its [`Request`] variant, its handler and its documentation.
//!
//! Body kinds: `none`; `body T` (required); `optional T` (an empty body is `T::default()`);
//! `by_id T` (the path's `{id}` parameter, which must equal the id field of the body).

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::request::{body, body_for_id, optional_body, Refusal, Request};

/// One endpoint: its name (the [`Request`] variant), method, path (`{id}` for a path
/// parameter) and the schema names of its request and reply bodies (docs/api.yaml's
/// `components/schemas`, which are the Rust type names).
pub struct Endpoint {
    pub name: &'static str,
    pub method: &'static str,
    pub path: &'static str,
    pub request: Option<&'static str>,
    pub reply: Option<&'static str>,
    /// Decodes the body, given the path parameter (empty when the path has none).
    pub(super) decode: Decode,
}

type Decode = fn(&str, &[u8]) -> Result<Request, Refusal>;

/// An endpoint as the client calls it: where, and the types of its request and reply
/// bodies (`()` when there is none: no body is sent, an empty reply is expected).
pub trait Call {
    const METHOD: &'static str;
    const PATH: &'static str;
    type Body: Serialize;
    type Reply: DeserializeOwned;
}

macro_rules! endpoints {
    ($($name:ident: $method:ident $path:literal, $kind:ident $($body:ident)?, reply $reply:ident;)*) => {
        /// Every endpoint the server answers.
        pub static ENDPOINTS: &[Endpoint] = &[$(Endpoint {
            name: stringify!($name),
            method: stringify!($method),
            path: $path,
            request: endpoints!(@schema $($body)?),
            reply: endpoints!(@schema_or_none $reply),
            decode: endpoints!(@decode $name $kind $($body)?),
        },)*];

        impl Request {
            /// The name of the endpoint the request was decoded from.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Request::$name { .. } => stringify!($name),)*
                }
            }
        }

        /// One type per endpoint, named as its [`Request`] variant, for the typed client.
        pub mod call {
            use super::Call;
            use crate::api::types;
            $(
                #[doc = concat!("`", stringify!($method), " ", $path, "`")]
                pub struct $name;

                impl Call for $name {
                    const METHOD: &'static str = stringify!($method);
                    const PATH: &'static str = $path;
                    type Body = endpoints!(@type $($body)?);
                    type Reply = endpoints!(@type_or_unit $reply);
                }
            )*
        }
    };
    (@schema) => { None };
    (@schema $body:ident) => { Some(stringify!($body)) };
    (@schema_or_none none) => { None };
    (@schema_or_none $reply:ident) => { Some(stringify!($reply)) };
    (@type) => { () };
    (@type $body:ident) => { types::$body };
    (@type_or_unit none) => { () };
    (@type_or_unit $reply:ident) => { types::$reply };
    (@decode $name:ident none) => { |_, _| Ok(Request::$name) };
    (@decode $name:ident body $body:ident) => { |_, bytes| Ok(Request::$name(body(bytes)?)) };
    (@decode $name:ident optional $body:ident) => {
        |_, bytes| Ok(Request::$name(optional_body(bytes)?))
    };
    (@decode $name:ident by_id $body:ident) => {
        |id, bytes| {
            let (id, body) = body_for_id(id, bytes)?;
            Ok(Request::$name(id, body))
        }
    };
}

endpoints! {
    Ping: GET "/api/v1/vmm.ping", none, reply VmmPing;
    Info: GET "/api/v1/vm.info", none, reply VmInfo;
    Pause: PUT "/api/v1/vm.pause", none, reply StateReply;
    Resume: PUT "/api/v1/vm.resume", optional ResumeRequest, reply StateReply;
    Shutdown: PUT "/api/v1/vm.shutdown", none, reply StateReply;
    Snapshot: PUT "/api/v1/vm.snapshot", body SnapshotRequest, reply SnapshotReport;
    Restore: PUT "/api/v1/vm.restore", body RestoreRequest, reply none;
    SendMigration: PUT "/api/v1/vm.send-migration", body MigrateRequest, reply MigrationReport;
    ReceiveMigration: PUT "/api/v1/vm.receive-migration", body ReceiveMigrationRequest, reply none;
    MigrationProgress: GET "/api/v1/vm.migration-progress", none, reply MigrationStatus;
    MigrationCancel: PUT "/api/v1/vm.migration-cancel", none, reply CancelReply;
    FcInstanceInfo: GET "/", none, reply FcInstanceInfo;
    FcVersion: GET "/version", none, reply FcVersion;
    FcGetMachineConfig: GET "/machine-config", none, reply FcMachineConfig;
    FcPutMachineConfig: PUT "/machine-config", body FcMachineConfig, reply none;
    FcBootSource: PUT "/boot-source", body FcBootSource, reply none;
    FcDrive: PUT "/drives/{drive_id}", by_id FcDrive, reply none;
    FcNetworkInterface: PUT "/network-interfaces/{iface_id}", by_id FcNetworkInterface, reply none;
    FcVsock: PUT "/vsock", body FcVsock, reply none;
    FcAction: PUT "/actions", body FcAction, reply none;
    FcPatchVm: PATCH "/vm", body FcVmState, reply none;
    FcSnapshotCreate: PUT "/snapshot/create", body FcSnapshotCreate, reply none;
    FcSnapshotLoad: PUT "/snapshot/load", body FcSnapshotLoad, reply none;
    FcVmConfig: GET "/vm/config", none, reply FcFullConfig;
}

impl Request {
    /// The endpoint the request was decoded from.
    pub fn endpoint(&self) -> &'static Endpoint {
        let name = self.name();
        ENDPOINTS
            .iter()
            .find(|e| e.name == name)
            .expect("every Request variant has a line in ENDPOINTS")
    }
}
