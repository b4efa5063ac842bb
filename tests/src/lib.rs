//! Harness for the end-to-end tests: the real Envoy (from `ENVOY_BIN`) with the
//! built wasm module (`IDEMGATE_WASM`), the real store (`IDEMGATE_STORE_BIN`) on
//! a fresh SQLite file, and an in-process upstream that counts executions.
//!
//! Ports are picked free, readiness is polled, every process is killed on drop,
//! and when a test fails the Envoy and store logs are printed.

// Test support: failing loudly is how a harness reports a broken environment.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub mod chaos;
pub use idemgate_testkit::pg;
pub mod proxy;
pub mod report;
pub mod stack;
mod upstream;

pub use upstream::{Execution, ExecutionLog, Upstream};

pub const API_TOKEN: &str = "e2e-api-token";
pub const ADMIN_TOKEN: &str = "e2e-admin-token";

fn env_path(name: &str, fallback: &str) -> PathBuf {
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

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub use idemgate_testkit::free_port;

/// A process whose output goes to a log file we can print on failure.
pub struct Proc {
    name: &'static str,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap_or_else(|e| panic!("log file {log:?}: {e}"));
        let err = out.try_clone().unwrap_or_else(|e| panic!("log file: {e}"));
        let child = cmd
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc {
            name,
            child: Some(child),
            log,
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("===== {} log =====\n{}", self.name, self.log());
        }
    }
}

/// Polls `probe` until it is true, or fails the test after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    poll(what, within, || {
        let fut = probe();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `probe` until it yields a value, or fails the test after `within`.
pub async fn poll<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub upstream: Upstream,
    pub store: Proc,
    pub store_port: u16,
    pub envoy: Proc,
    pub port: u16,
    pub admin_port: u16,
    pub client: reqwest::Client,
}

/// A bootstrap from the repository with its listener, admin and upstream
/// ports and its wasm path rewritten for this test.
pub fn bootstrap(file: &str, port: u16, admin_port: u16, upstream_port: u16) -> String {
    std::fs::read_to_string(repo_root().join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .replace("port_value: 10000", &format!("port_value: {port}"))
        .replace("port_value: 9901", &format!("port_value: {admin_port}"))
        .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
        .replace(
            "filename: target/idemgate.wasm",
            &format!("filename: {}", wasm_path().display()),
        )
}

impl Harness {
    pub async fn start() -> Harness {
        Harness::start_with(|config| config).await
    }

    /// Starts with `envoy/e2e.yaml` changed by `edit` (after the ports are
    /// rewritten), e.g. to point the `express` cluster at a running app.
    pub async fn start_with(edit: impl FnOnce(String) -> String) -> Harness {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let upstream = Upstream::start().await;
        let store_port = free_port();
        let store = start_store(dir.path(), store_port);
        let (port, admin_port) = (free_port(), free_port());
        let config = edit(
            bootstrap("envoy/e2e.yaml", port, admin_port, upstream.addr.port())
                .replace("port_value: 8787", &format!("port_value: {store_port}")),
        );
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("write envoy config: {e}"));
        let envoy_bin = envoy_bin();
        let envoy = Proc::spawn(
            "envoy",
            Command::new(&envoy_bin)
                .arg("-c")
                .arg(&config_path)
                .args(["--concurrency", "2", "--disable-hot-restart", "-l", "info"])
                .args(["--log-format", "[%Y-%m-%d %T.%e][%l][%n] %v"]),
            dir.path().join("envoy.log"),
        );
        let harness = Harness {
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap_or_else(|e| panic!("client: {e}")),
            dir,
            upstream,
            store,
            store_port,
            envoy,
            port,
            admin_port,
        };
        harness.wait_store().await;
        let admin = format!("http://127.0.0.1:{admin_port}/ready");
        let client = harness.client.clone();
        eventually("envoy to be ready", Duration::from_secs(60), || {
            let (client, admin) = (client.clone(), admin.clone());
            async move { matches!(client.get(&admin).send().await, Ok(r) if r.status() == 200) }
        })
        .await;
        harness
    }

    pub async fn wait_store(&self) {
        let url = format!("http://127.0.0.1:{}/readyz", self.store_port);
        let client = self.client.clone();
        eventually("the store to be ready", Duration::from_secs(30), || {
            let (client, url) = (client.clone(), url.clone());
            async move { matches!(client.get(&url).send().await, Ok(r) if r.status() == 200) }
        })
        .await;
    }

    pub fn restart_store(&mut self) {
        self.store.kill();
        self.store = start_store(self.dir.path(), self.store_port);
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// A POST through Envoy with an optional key, as alice of tenant-a.
    pub fn post(&self, path: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
        self.post_as("tenant-a", "alice", path, key, body)
    }

    pub fn post_as(
        &self,
        tenant: &str,
        user: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .header("x-tenant-id", tenant)
            .header("x-user-id", user)
            .body(body.to_string());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req
    }

    /// The filter's counter `name` (e.g. `requests_owned`) as Envoy's
    /// Prometheus endpoint shows it.
    pub async fn counter(&self, name: &str) -> u64 {
        let url = format!("http://127.0.0.1:{}/stats/prometheus", self.admin_port);
        let text = match self.client.get(url).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let metric = format!("idemgate_{name}");
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(n, _)| n.split('{').next() == Some(metric.as_str()))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }

    /// The key's current generation (`null` when there is none: never
    /// claimed, or released).
    pub async fn current_record(
        &self,
        route: &str,
        tenant: &str,
        principal: &str,
        key: &str,
    ) -> serde_json::Value {
        let history = self.history(route, tenant, principal, key).await;
        match history["records"].as_array().and_then(|r| r.first()) {
            Some(r) if r["ended_at"].is_null() => r.clone(),
            _ => serde_json::Value::Null,
        }
    }

    /// The store's admin view of a key: every generation and event, as JSON.
    pub async fn history(&self, route: &str, tenant: &str, principal: &str, key: &str) -> serde_json::Value {
        let url = format!("http://127.0.0.1:{}/admin/v1/records/lookup", self.store_port);
        let query = serde_json::json!({"route": route, "tenant": tenant, "principal": principal, "key": key});
        match self
            .client
            .post(url)
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/json")
            .body(query.to_string())
            .send()
            .await
        {
            Ok(r) if r.status() == 200 => r.json_value().await,
            _ => serde_json::Value::Null,
        }
    }
}

trait JsonValue {
    async fn json_value(self) -> serde_json::Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> serde_json::Value {
        let bytes = self.bytes().await.unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null)
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

fn start_store(dir: &Path, port: u16) -> Proc {
    let bin = env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store");
    Proc::spawn(
        "store",
        Command::new(bin)
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args([
                "--database-url",
                &format!("sqlite://{}", dir.join("store.db").display()),
            ])
            .args(["--api-token", API_TOKEN, "--admin-token", ADMIN_TOKEN])
            .env("RUST_LOG", "info"),
        dir.join(format!("store-{port}.log")),
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
    pub async fn of(res: reqwest::Response) -> Answer {
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let body = res.bytes().await.unwrap_or_default();
        Answer {
            status,
            headers,
            body,
        }
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
