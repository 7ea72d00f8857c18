//! A blocking client of the API over its Unix socket (hyper on a current-thread runtime),
//! for `ferrovm ctl` and the tests.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::endpoints::Call;

/// What a request can end in, besides a reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("no reply within {} s", .0.as_secs())]
    Timeout(Duration),
    #[error("{0}")]
    Http(String),
}

/// A reply: the status and the JSON body (`Null` when empty).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl Answer {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The fault message of an error reply.
    pub fn fault(&self) -> String {
        self.body["fault_message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("HTTP status {}", self.status))
    }
}

impl Answer {
    /// The body as the reply type `T` (an endpoint's [`Call::Reply`]).
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, ClientError> {
        T::deserialize(&self.body).map_err(|e| ClientError::Http(format!("malformed reply: {e}")))
    }
}

/// Sends `body` to the endpoint `E` (one without a path parameter) and waits for its reply,
/// at most `timeout` if given. A body of `()` is sent as none.
pub fn send<E: Call>(
    socket: &Path,
    body: &E::Body,
    timeout: Option<Duration>,
) -> Result<Answer, ClientError> {
    debug_assert!(
        !E::PATH.contains('{'),
        "{} needs its path parameter",
        E::PATH
    );
    let body = serde_json::to_value(body).map_err(|e| ClientError::Http(e.to_string()))?;
    call(
        socket,
        E::METHOD,
        E::PATH,
        (!body.is_null()).then_some(&body),
        timeout,
    )
}

/// Sends one request and waits for its reply, at most `timeout` if given.
pub fn call(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Option<Duration>,
) -> Result<Answer, ClientError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ClientError::Http(e.to_string()))?;
    let exchange = exchange(socket, method, path, body);
    runtime.block_on(async {
        match timeout {
            Some(t) => tokio::time::timeout(t, exchange)
                .await
                .map_err(|_| ClientError::Timeout(t))?,
            None => exchange.await,
        }
    })
}

async fn exchange(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Answer, ClientError> {
    let http = |e: &dyn std::fmt::Display| ClientError::Http(e.to_string());
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(ClientError::Connect)?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(&e))?;
    tokio::spawn(connection);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, "localhost");
    let bytes = match body {
        Some(v) => {
            request = request.header(CONTENT_TYPE, "application/json");
            Bytes::from(v.to_string())
        }
        None => Bytes::new(),
    };
    let request = request.body(Full::new(bytes)).map_err(|e| http(&e))?;
    let response = sender.send_request(request).await.map_err(|e| http(&e))?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| http(&e))?
        .to_bytes();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(|e| http(&format!("malformed reply: {e}")))?
    };
    Ok(Answer { status, body })
}
