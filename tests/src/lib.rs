//! Harness for the end-to-end tests: the real Envoy (from `ENVOY_BIN`) with the
//! built wasm module (`IDEMGATE_WASM`), the real store (`IDEMGATE_STORE_BIN`) on
//! a fresh SQLite file, and an in-process upstream that counts executions.
//!
//! [`stack::Stack`] starts all of it (ports picked free, readiness polled,
//! every process killed on drop, logs printed when a test fails);
//! [`Harness`] is its preset for `envoy/e2e.yaml` on one SQLite store. What
//! other test suites share (free ports, PostgreSQL clusters, processes,
//! waiting, the internals list) comes from `idemgate-testkit`.

// Test support: failing loudly is how a harness reports a broken environment.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

pub mod browser;
pub mod chaos;
pub use idemgate_testkit::pg;
pub mod proxy;
pub mod stack;
mod upstream;

pub use idemgate_testkit::{eventually, free_port, internals, poll, report, Proc, INTERNALS};
pub use stack::{bootstrap, Ports};
pub use upstream::{Execution, ExecutionLog, Upstream};

pub const API_TOKEN: &str = "e2e-api-token";
pub const ADMIN_TOKEN: &str = "e2e-admin-token";

pub fn env_path(name: &str, fallback: &str) -> PathBuf {
    std::env::var_os(name)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(fallback))
}

/// The wasm module under test (`IDEMGATE_WASM`, or the one `make wasm` builds).
pub fn wasm_path() -> PathBuf {
    env_path("IDEMGATE_WASM", "target/idemgate.wasm")
}

/// The Envoy binary (`ENVOY_BIN`, or the one `make setup` installs).
pub fn envoy_bin() -> PathBuf {
    env_path("ENVOY_BIN", ".tools/venv/bin/envoy")
}

/// The Python of the virtualenv `scripts/setup.sh` installs the SDKs and
/// grpcio into; `IDEMGATE_PYTHON` names another.
pub fn python() -> PathBuf {
    std::env::var_os("IDEMGATE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".tools/venv/bin/python"))
}

pub fn repo_root() -> PathBuf {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
    tests.parent().unwrap_or(tests).to_path_buf()
}

/// The stack most end-to-end tests run against: `envoy/e2e.yaml`, one store
/// on SQLite, a client without a timeout. Everything else is [`stack::Stack`]'s.
pub struct Harness(stack::Stack);

impl Harness {
    pub async fn start() -> Harness {
        Harness::start_with(|config| config).await
    }

    /// Starts with `envoy/e2e.yaml` changed by `edit` (after the ports are
    /// rewritten), e.g. to point the `express` cluster at a running app.
    pub async fn start_with(edit: impl FnOnce(String) -> String + Send + 'static) -> Harness {
        Harness::start_serving(edit, Vec::new()).await
    }

    /// [`Harness::start_with`], the store started with `store_args` too.
    pub async fn start_serving(
        edit: impl FnOnce(String) -> String + Send + 'static,
        store_args: Vec<String>,
    ) -> Harness {
        let mut options = stack::Options::new("envoy/e2e.yaml", stack::Database::Sqlite, 1);
        options.edit = Some(Box::new(edit));
        options.client_timeout = None;
        options.store_args = store_args;
        Harness(stack::Stack::start(options).await)
    }
}

impl Deref for Harness {
    type Target = stack::Stack;
    fn deref(&self) -> &stack::Stack {
        &self.0
    }
}

impl DerefMut for Harness {
    fn deref_mut(&mut self) -> &mut stack::Stack {
        &mut self.0
    }
}

/// The Express app of `tests/express` (default, non-strict routing) on
/// `port`, its npm packages installed into `tests/express/node_modules` first
/// if they are missing. Answers `POST /v1/payments` and counts executions
/// per key at `GET /executions`.
pub fn express(port: u16, log_dir: &Path) -> Proc {
    let app = repo_root().join("tests/express");
    if !app.join("node_modules/express").is_dir() {
        let status = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&app)
            .status()
            .unwrap_or_else(|e| panic!("npm (install Node.js and npm, or run scripts/setup.sh): {e}"));
        assert!(status.success(), "npm ci in {app:?} failed");
    }
    Proc::spawn(
        "express",
        Command::new("node").arg(app.join("app.js")).arg(port.to_string()),
        log_dir.join("express.log"),
    )
}

/// A parsed answer from Envoy.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    /// The answer, its body empty if reading it failed.
    pub async fn of(res: reqwest::Response) -> Answer {
        Answer::collect(res).await.0
    }

    /// Sends the request and reads its whole answer, within the request's
    /// own timeout (which covers the body too).
    pub async fn read(req: reqwest::RequestBuilder) -> reqwest::Result<Answer> {
        let (answer, body) = Answer::collect(req.send().await?).await;
        body.map(|()| answer)
    }

    /// The answer, and whether its body was read whole.
    async fn collect(res: reqwest::Response) -> (Answer, reqwest::Result<()>) {
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let (body, read) = match res.bytes().await {
            Ok(body) => (body, Ok(())),
            Err(e) => (bytes::Bytes::new(), Err(e)),
        };
        (
            Answer {
                status,
                headers,
                body,
            },
            read,
        )
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The problem `type` slug (after the last `/`), if this is a problem.
    pub fn problem(&self) -> Option<String> {
        if self.header("content-type") != Some("application/problem+json") {
            return None;
        }
        let t = self.json().get("type")?.as_str()?.to_string();
        t.rsplit('/').next().map(str::to_string)
    }
}

/// Send a request and collect the answer, failing the test on transport errors.
pub async fn send(req: reqwest::RequestBuilder) -> Answer {
    match req.send().await {
        Ok(res) => Answer::of(res).await,
        Err(e) => panic!("request failed: {e}"),
    }
}

/// Sends the request until it is answered with something other than `409
/// request-in-progress` (which must carry a short retry hint meanwhile).
pub async fn retry_until_settled(
    req: impl Fn() -> reqwest::RequestBuilder,
    within: std::time::Duration,
) -> Answer {
    poll("the retry to be answered", within, || async {
        let a = send(req()).await;
        if a.status == 409 && a.problem().as_deref() == Some("request-in-progress") {
            let hint: u64 = a.header("retry-after-ms").unwrap().parse().unwrap();
            assert!(hint <= 1_000, "{a:?}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            return None;
        }
        Some(a)
    })
    .await
}

/// Shared execution counts per Idempotency-Key value seen by the upstream.
pub type Executions = Arc<Mutex<HashMap<String, u64>>>;

pub fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Sends bytes no HTTP client would, and returns what came back.
pub async fn raw_request(port: u16, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr(port))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = stream.write_all(request).await;
    let mut out = vec![0u8; 4096];
    let n = stream.read(&mut out).await.unwrap_or(0);
    String::from_utf8_lossy(&out[..n]).into_owned()
}

/// A key no other test uses.
pub fn fresh_key(label: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{label}-{nanos:x}-{}", N.fetch_add(1, Ordering::SeqCst))
}
