//! The API's transport: HTTP/1.1 (hyper) on the Unix socket, served by one `api` thread
//! running a current-thread tokio runtime; each request is answered on an `api-request`
//! thread of its own (a pause may wait 5 s, a snapshot or migration much longer: meanwhile
//! other connections are served), bounded by the cap on connections.
//!
//! Limits, so a hostile or careless client cannot exhaust the VMM: at most
//! [`MAX_CONNECTIONS`] connections (more get a 429 and are closed), request headers of at most
//! [`MAX_HEADER_BYTES`] (431) sent within [`HEADER_TIMEOUT`], a body of at most [`MAX_BODY`]
//! (413) sent within [`BODY_TIMEOUT`] (408), and only clients of the VMM's own user or root
//! (403).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use devices::exit::ExitReason;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::{parse_request, Reply, Server};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// The largest request body.
pub const MAX_BODY: usize = 64 * 1024;
/// The largest request head (hyper's read buffer).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// How long a client may take to send a request's head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `server` on `listener` until the process exits.
pub fn serve(
    listener: std::os::unix::net::UnixListener,
    server: Arc<Server>,
) -> std::io::Result<()> {
    sandbox::spawn(sandbox::Role::Api, "api", move || {
        if let Err(e) = listener.set_nonblocking(true) {
            return log::error!("API: cannot listen: {e}");
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build();
        match runtime {
            Ok(rt) => rt.block_on(accept_loop(listener, server)),
            Err(e) => log::error!("API: cannot start its event loop: {e}"),
        }
    })?;
    Ok(())
}

async fn accept_loop(listener: std::os::unix::net::UnixListener, server: Arc<Server>) {
    let listener = match tokio::net::UnixListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => return log::error!("API: cannot listen: {e}"),
    };
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: try again shortly rather than spin.
                log::warn!("API: accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if !peer_allowed(&stream) {
            log::warn!("API: refused a connection from another user");
            tokio::spawn(refuse(
                stream,
                403,
                "permission denied: this API serves its own user and root only",
            ));
            continue;
        }
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            tokio::spawn(refuse(stream, 429, "too many connections: try again later"));
            continue;
        }
        let (server, active) = (server.clone(), active.clone());
        tokio::spawn(async move {
            serve_connection(stream, server).await;
            active.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

fn peer_allowed(stream: &UnixStream) -> bool {
    stream
        .peer_cred()
        .is_ok_and(|cred| crate::socket::uid_allowed(cred.uid()))
}

/// Answers a connection that will not be served with `status` and closes it. The request is
/// read first (briefly), so that the client reads the answer rather than a reset.
async fn refuse(mut stream: UnixStream, status: u16, message: &'static str) {
    let mut scratch = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut scratch)).await;
    let body = serde_json::json!({ "fault_message": message }).to_string();
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let text = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(text.as_bytes())).await;
    let _ = stream.shutdown().await;
}

async fn serve_connection(stream: UnixStream, server: Arc<Server>) {
    // An exit (shutdown, migrated) asked for by a reply on this connection: requested once
    // the connection has written it and closed.
    let pending_exit = Arc::new(Mutex::new(None::<ExitReason>));
    let service = {
        let (server, pending_exit) = (server.clone(), pending_exit.clone());
        service_fn(move |request| respond(request, server.clone(), pending_exit.clone()))
    };
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    if let Err(e) = connection.await {
        log::debug!("API: connection ended: {e}");
    }
    let exit = pending_exit
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(reason) = exit {
        server.request_exit(reason);
    }
}

async fn respond(
    request: hyper::Request<Incoming>,
    server: Arc<Server>,
    pending_exit: Arc<Mutex<Option<ExitReason>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = request.method().as_str().to_string();
    let path = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let body = Limited::new(request.into_body(), MAX_BODY).collect();
    let reply = match tokio::time::timeout(BODY_TIMEOUT, body).await {
        Err(_) => Reply::fault(408, "the request body did not arrive in time"),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Reply::fault(413, format!("request body larger than {MAX_BODY} bytes"))
        }
        Ok(Err(e)) => Reply::fault(400, format!("reading the request body: {e}")),
        Ok(Ok(body)) => match parse_request(&method, &path, &body.to_bytes()) {
            Ok(request) => answer_on_thread(server, request).await,
            Err(refusal) => Reply::fault(refusal.status, refusal.message),
        },
    };
    let close = reply.then_exit.is_some();
    if let Some(reason) = reply.then_exit {
        *pending_exit.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
    }
    Ok(http_response(reply, close))
}

/// Answers `request` on a thread of its own, which may block (a pause, a snapshot, a
/// migration) without holding up other connections.
async fn answer_on_thread(server: Arc<Server>, request: super::Request) -> Reply {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = sandbox::spawn(sandbox::Role::Api, "api-request", move || {
        let reply = server.handle(request);
        if let Err(reply) = tx.send(reply) {
            // The client is gone; what the request did still ends the VMM if it must.
            if let Some(reason) = reply.then_exit {
                server.request_exit(reason);
            }
        }
    });
    if let Err(e) = spawned {
        return Reply::fault(500, format!("cannot start a thread for the request: {e}"));
    }
    rx.await
        .unwrap_or_else(|_| Reply::fault(500, "the request ended without a reply"))
}

fn http_response(reply: Reply, close: bool) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut builder = Response::builder().status(status);
    if close {
        builder = builder.header(CONNECTION, "close");
    }
    let body = match reply.body {
        Some(value) => {
            builder = builder.header(CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(value.to_string()))
        }
        None => Full::new(Bytes::new()),
    };
    builder
        .body(body)
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}
