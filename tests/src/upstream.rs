//! An upstream that counts how often each Idempotency-Key was executed, with
//! knobs (request headers) to be slow, fail, reset or answer big.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
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
    /// What the upstream answered (or was about to answer, if it reset).
    pub status: u16,
    pub control: Option<String>,
    /// The response body it sent; empty when it reset instead.
    pub response: Bytes,
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
                    let _ = hyper::server::conn::http1::Builder::new()
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
) -> Result<Response<Full<Bytes>>, Reset> {
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
        .body(Full::new(payload))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new()))))
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
