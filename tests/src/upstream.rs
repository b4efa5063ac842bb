//! An upstream that counts how often each Idempotency-Key was executed, with
//! knobs (request headers) to be slow, fail, reset or answer big.
//!
//! It speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on one port, and
//! answers a gRPC unary call (`content-type: application/grpc`) as a gRPC
//! server would: one message frame and `grpc-status: 0` in the trailers, or
//! a trailers-only status. Its knobs are request metadata, as for HTTP:
//! `x-test-delay-ms`, `x-test-reset`, `x-test-control` (in the trailers) and
//! `x-test-grpc-status` (a status other than `OK`, after acting).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::Executions;

pub struct Upstream {
    pub addr: SocketAddr,
    executions: Executions,
    task: tokio::task::JoinHandle<()>,
    /// Every execution in arrival order, for audits.
    log: ExecutionLog,
    /// Open connections, so a fault can reset them all at once.
    connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

/// One request the upstream acted on.
#[derive(Debug, Clone)]
pub struct Execution {
    /// 1-based arrival order; the response body carries it as `execution`.
    pub n: u64,
    /// When the request arrived (wall clock, milliseconds since the Unix
    /// epoch, the store's clock on this machine): it ran inside the claim
    /// generation that was opened last before this moment.
    pub at_ms: i64,
    pub key: String,
    pub tenant: String,
    pub user: String,
    pub path: String,
    /// SHA-256 of the request body, hex.
    pub body_sha256: String,
    /// What the upstream answered (or was about to answer, if it reset);
    /// 200 for a gRPC call, whose status is [`Execution::grpc_status`].
    pub status: u16,
    pub control: Option<String>,
    /// The response body it sent; empty when it reset instead. For a gRPC
    /// call, its message frames (none for a trailers-only answer).
    pub response: Bytes,
    /// A gRPC call's status (`None`: an HTTP request).
    pub grpc_status: Option<u8>,
    /// A gRPC call's status fields as it sent them, lower-case: its
    /// trailers, or, for a trailers-only answer, its header fields.
    pub grpc_fields: Vec<(String, String)>,
    pub reset: bool,
    /// The names of the request's header fields, lower-case, in order.
    pub header_names: Vec<String>,
}

pub type ExecutionLog = Arc<Mutex<Vec<Execution>>>;

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug)]
struct Reset;

impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("reset on request")
    }
}

impl std::error::Error for Reset {}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("upstream bind: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("upstream addr: {e}"));
        let executions: Executions = Arc::default();
        let log: ExecutionLog = Arc::default();
        let connections: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let counter = Arc::new(AtomicU64::new(0));
        let (shared, shared_log, open) = (executions.clone(), log.clone(), connections.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (executions, counter, log) = (shared.clone(), counter.clone(), shared_log.clone());
                let conn = tokio::spawn(async move {
                    let service =
                        service_fn(move |req| handle(req, executions.clone(), counter.clone(), log.clone()));
                    // HTTP/1.1, or HTTP/2 with prior knowledge (gRPC).
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                if let Ok(mut open) = open.lock() {
                    open.retain(|c| !c.is_finished());
                    open.push(conn.abort_handle());
                }
            }
        });
        Upstream {
            addr,
            executions,
            task,
            log,
            connections,
        }
    }

    /// A copy of the execution log.
    pub fn log(&self) -> Vec<Execution> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Drops every open connection at once, in-flight requests included (the
    /// peer sees a reset); returns how many were open.
    pub fn reset_connections(&self) -> usize {
        let open: Vec<_> = self
            .connections
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default();
        let n = open.iter().filter(|c| !c.is_finished()).count();
        for conn in open {
            conn.abort();
        }
        n
    }

    /// How many times a request with this key reached the upstream.
    pub fn executions(&self, key: &str) -> u64 {
        self.executions
            .lock()
            .map(|m| m.get(key).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.executions.lock().map(|m| m.values().sum()).unwrap_or(0)
    }
}

async fn handle(
    req: Request<Incoming>,
    executions: Executions,
    counter: Arc<AtomicU64>,
    log: ExecutionLog,
) -> Result<Response<Body>, Reset> {
    let grpc = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        return handle_grpc(req, executions, counter, log).await;
    }
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let header_names = req.headers().keys().map(|n| n.as_str().to_string()).collect();
    let key = header("idempotency-key").unwrap_or_default();
    let delay: u64 = header("x-test-delay-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let status: u16 = header("x-test-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201);
    let control = header("x-test-control");
    let reset = header("x-test-reset").is_some();
    let big: Option<usize> = header("x-test-body-size").and_then(|v| v.parse().ok());
    let path = req.uri().path().to_string();
    let tenant = header("x-tenant-id").unwrap_or_default();
    let user = header("x-user-id").unwrap_or_default();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if let Ok(mut m) = executions.lock() {
        *m.entry(key.clone()).or_default() += 1;
    }
    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
    let body_sha256 = {
        use sha2::{Digest, Sha256};
        hex_of(&Sha256::digest(&body))
    };
    let payload = match big {
        Some(size) => Bytes::from(vec![b'x'; size]),
        None => Bytes::from(
            serde_json::json!({"execution": n, "path": path, "request": String::from_utf8_lossy(&body)})
                .to_string(),
        ),
    };
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    if let Ok(mut l) = log.lock() {
        l.push(Execution {
            n,
            at_ms,
            key: key.clone(),
            tenant,
            user,
            path: path.clone(),
            body_sha256,
            status,
            control: control.clone(),
            response: if reset { Bytes::new() } else { payload.clone() },
            reset,
            header_names,
            grpc_status: None,
            grpc_fields: Vec::new(),
        });
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if reset {
        return Err(Reset);
    }
    let mut res = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("location", format!("/pay/{n}"))
        .header("x-payment-id", format!("pay_{n}"))
        .header("x-not-replayed", "1")
        .header("set-cookie", "session=secret");
    if let Some(control) = control {
        res = res.header("idempotency-control", control);
    }
    Ok(res
        .body(full(payload))
        .unwrap_or_else(|_| Response::new(full(Bytes::new()))))
}

/// A response body: whole, with trailers or not.
type Body = BoxBody<Bytes, std::convert::Infallible>;

fn full(bytes: Bytes) -> Body {
    Full::new(bytes).boxed()
}

/// A gRPC unary call: logged like an HTTP request (its body digest is the
/// request message's, without the frame's 5-byte prefix), then answered with
/// a message frame (`{"execution": n, ...}`) and `grpc-status: 0` in the
/// trailers, or, for `x-test-grpc-status`, trailers-only with that status
/// and `grpc-message: acted, then failed: execution n`.
async fn handle_grpc(
    req: Request<Incoming>,
    executions: Executions,
    counter: Arc<AtomicU64>,
    log: ExecutionLog,
) -> Result<Response<Body>, Reset> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let header_names = req.headers().keys().map(|n| n.as_str().to_string()).collect();
    let key = header("idempotency-key").unwrap_or_default();
    let delay: u64 = header("x-test-delay-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let code: u8 = header("x-test-grpc-status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let control = header("x-test-control");
    let reset = header("x-test-reset").is_some();
    let path = req.uri().path().to_string();
    let tenant = header("x-tenant-id").unwrap_or_default();
    let user = header("x-user-id").unwrap_or_default();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let message = grpc_message(&body).unwrap_or(&body[..]);
    if let Ok(mut m) = executions.lock() {
        *m.entry(key.clone()).or_default() += 1;
    }
    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
    let body_sha256 = {
        use sha2::{Digest, Sha256};
        hex_of(&Sha256::digest(message))
    };
    // OK: a message and the status in the trailers; any other status:
    // trailers-only, as gRPC servers answer an error.
    let (frames, fields) = if code == 0 {
        let payload =
            serde_json::json!({"execution": n, "path": path, "request": String::from_utf8_lossy(message)})
                .to_string();
        let mut frame = vec![0];
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload.as_bytes());
        (
            Bytes::from(frame),
            vec![("grpc-status".to_string(), "0".to_string())],
        )
    } else {
        let fields = vec![
            ("content-type".to_string(), "application/grpc".to_string()),
            ("grpc-status".to_string(), code.to_string()),
            (
                "grpc-message".to_string(),
                format!("acted, then failed: execution {n}"),
            ),
        ];
        (Bytes::new(), fields)
    };
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    if let Ok(mut l) = log.lock() {
        l.push(Execution {
            n,
            at_ms,
            key,
            tenant,
            user,
            path,
            body_sha256,
            status: 200,
            control: control.clone(),
            response: if reset { Bytes::new() } else { frames.clone() },
            reset,
            header_names,
            grpc_status: Some(code),
            grpc_fields: fields.clone(),
        });
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if reset {
        // The handler's error resets the stream (RST_STREAM).
        return Err(Reset);
    }
    let mut map = HeaderMap::new();
    for (name, value) in &fields {
        if let (Ok(name), Ok(value)) = (
            hyper::header::HeaderName::from_bytes(name.as_bytes()),
            hyper::header::HeaderValue::from_str(value),
        ) {
            map.append(name, value);
        }
    }
    if let Some(control) = control.as_deref().and_then(|c| c.parse().ok()) {
        map.append("idempotency-control", control);
    }
    let res = if code == 0 {
        let trailers = async move { Some(Ok(map)) };
        let mut res = Response::new(Full::new(frames).with_trailers(trailers).boxed());
        res.headers_mut().insert(
            "content-type",
            hyper::header::HeaderValue::from_static("application/grpc"),
        );
        res
    } else {
        let mut res = Response::new(full(Bytes::new()));
        *res.headers_mut() = map;
        res
    };
    Ok(res)
}

/// The message of a request's single gRPC frame (`None`: not one frame).
fn grpc_message(body: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    let message = body.get(5..5 + len)?;
    (body.len() == 5 + len).then_some(message)
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
