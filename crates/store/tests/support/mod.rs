//! Test harness: throwaway PostgreSQL clusters, the store started in-process
//! or as the real binary, and a small HTTP client.

pub use idemgate_testkit::{free_port, pg, pgbouncer};

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemgate_core::config::{AfterExpiry, OnUnknown};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::key::Key;
use idemgate_core::protocol::{
    decode_frame, encode_frame, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use idemgate_core::scope::{Namespace, Scope};
use idemgate_store::backend::Backend;
use idemgate_store::database_url::{open_backend, BackendOptions};
use idemgate_store::postgres::PgTimeouts;
use idemgate_store::sealing::Seal;
pub use idemgate_testkit::{eventually, Proc};

pub const API: &str = "api-token";
pub const ADMIN: &str = "admin-token";

/// The secret the tests' authenticating proxy sends with every request.
pub const PROXY_SECRET: &str = "proxy-secret-0123456789abcdef";
/// The operator that proxy names.
pub const ALICE: &str = "alice@example.com";

/// A store's operators behind the tests' proxy: identities believed with
/// [`PROXY_SECRET`] only (no trusted peer).
pub fn behind_proxy() -> idemgate_store::console::ConsoleSettings {
    idemgate_store::console::ConsoleSettings {
        operators: idemgate_store::auth::OperatorSource {
            secret: Some(idemgate_store::auth::Credential::new(PROXY_SECRET)),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The headers the tests' proxy adds to a request of `operator`.
pub fn as_operator(operator: &str) -> [(&'static str, &str); 2] {
    [
        ("x-forwarded-email", operator),
        ("x-idemgate-proxy-secret", PROXY_SECRET),
    ]
}

pub fn scope_of(tenant: &str, principal: &str, route: &str, ns: Namespace, key: &str) -> Scope {
    Scope::new(
        tenant,
        principal,
        route,
        ns,
        Key::try_from(key.to_string()).unwrap(),
    )
    .unwrap()
}

pub fn scope(key: &str) -> Scope {
    scope_of("acme", "alice", "payments.create", Namespace::Client, key)
}

pub fn fp(b: u8) -> Fingerprint {
    Fingerprint::try_from(format!("{b:02x}").repeat(32)).unwrap()
}

pub fn claim(scope: &Scope, fingerprint: Option<u8>) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        fingerprint: fingerprint.map(fp),
        lease_ms: 1_000,
        ttl_ms: 10_000,
        wait_ms: 0,
        after_expiry: AfterExpiry::Reject,
        on_unknown: OnUnknown::Conflict,
        attempt: None,
        deadline_ms: 0,
        trace: Default::default(),
    }
}

pub fn complete(scope: &Scope, fence: u64, status: u16) -> CompleteRequest {
    CompleteRequest {
        scope: scope.clone(),
        fence,
        status,
        headers: vec![("content-type".into(), "application/json".into())],
        body_stored: true,
        trace: Default::default(),
    }
}

pub fn fence(scope: &Scope, fence: u64) -> FenceRequest {
    FenceRequest {
        scope: scope.clone(),
        fence,
        trace: Default::default(),
    }
}

/// A fresh SQLite backend in its own directory, migrated.
pub async fn sqlite_backend(dir: &tempfile::TempDir) -> Arc<dyn Backend> {
    sqlite_backend_sealed(dir, Seal::off()).await
}

/// [`sqlite_backend`] sealing stored responses with `seal`.
pub async fn sqlite_backend_sealed(dir: &tempfile::TempDir, seal: Seal) -> Arc<dyn Backend> {
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    backend_at(&url, seal).await
}

/// A migrated backend at `url`, sealing stored responses with `seal`.
pub async fn backend_at(url: &str, seal: Seal) -> Arc<dyn Backend> {
    // Connecting and waiting for a connection get longer than production's
    // defaults: with every test of the binary on two cores, opening a
    // connection has taken over 500 ms. The bounds themselves are tested in
    // faults.rs, with their own settings.
    let pg_timeouts = PgTimeouts {
        connect: Duration::from_secs(5),
        wait: Duration::from_secs(5),
        ..PgTimeouts::default()
    };
    let opts = BackendOptions {
        seal,
        pg_timeouts,
        ..BackendOptions::default()
    };
    let b = open_backend(url, &opts).await.unwrap();
    b.migrate().await.unwrap();
    b
}

/// Two response keys, `a` and `b` (32 bytes each, base64).
pub const KEY_A: &str = "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
pub const KEY_B: &str = "b:HxweHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";

/// Sealing with the key file `text`.
pub fn seal(text: &str) -> Seal {
    Seal::parse(text).unwrap()
}

/// A throwaway PostgreSQL cluster shared by the tests that run at the same
/// time; it stops when the last of them lets go of it.
pub fn shared_cluster() -> Arc<pg::PgCluster> {
    static SHARED: Mutex<Weak<pg::PgCluster>> = Mutex::new(Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cluster) = shared.upgrade() {
        return cluster;
    }
    let cluster = Arc::new(pg::PgCluster::start());
    *shared = Arc::downgrade(&cluster);
    cluster
}

/// PgBouncer in transaction mode in front of a throwaway cluster.
pub struct Bounced {
    pub cluster: Arc<pg::PgCluster>,
    pub bouncer: pgbouncer::PgBouncer,
}

impl Bounced {
    /// A new, empty database, reached through PgBouncer.
    pub async fn fresh_database(&self) -> String {
        let direct = self.cluster.fresh_database().await;
        let name = direct.rsplit('/').next().unwrap_or_default();
        self.bouncer.url(name)
    }
}

/// [`Bounced`], shared like [`shared_cluster`]; `None` (said on standard
/// error) when PgBouncer is not installed.
pub fn shared_bouncer() -> Option<Arc<Bounced>> {
    static SHARED: Mutex<Weak<Bounced>> = Mutex::new(Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(bounced) = shared.upgrade() {
        return Some(bounced);
    }
    // A cluster of its own: the other variants' connections never wait
    // behind PgBouncer's.
    let cluster = Arc::new(pg::PgCluster::start());
    // Fewer server connections than a store's pool: transactions of
    // different clients take turns on the same server connections.
    let Some(bouncer) = pgbouncer::PgBouncer::start(&cluster, pgbouncer::PoolMode::Transaction, 4, &[])
    else {
        eprintln!("skipped: PgBouncer is not installed (scripts/setup.sh installs it; or set PGBOUNCER_BIN)");
        return None;
    };
    let bounced = Arc::new(Bounced { cluster, bouncer });
    *shared = Arc::downgrade(&bounced);
    Some(bounced)
}

/// A migrated backend at `url` (through a pooler in transaction mode),
/// sealing stored responses with `seal`.
pub async fn bounced_backend(url: &str, seal: Seal) -> Arc<dyn Backend> {
    bounced_backend_with(url, seal, idemgate_store::postgres::PgTimeouts::default()).await
}

/// [`bounced_backend`] with these timeouts.
pub async fn bounced_backend_with(
    url: &str,
    seal: Seal,
    timeouts: idemgate_store::postgres::PgTimeouts,
) -> Arc<dyn Backend> {
    use idemgate_store::postgres::{PgSession, Pooler, Postgres};
    let session = PgSession {
        pooler: Pooler::Transaction,
        read_only: false,
    };
    let log_ids = idemgate_store::log_ids::LogIds::random().unwrap();
    let b: Arc<dyn Backend> =
        Arc::new(Postgres::connect_with(url, 16, timeouts, session, log_ids, seal).unwrap());
    b.migrate().await.unwrap();
    b
}

pub async fn pg_backend(url: &str) -> Arc<dyn Backend> {
    let b = open_backend(url, &BackendOptions::default()).await.unwrap();
    b.migrate().await.unwrap();
    b
}

pub struct HttpReply {
    pub status: u16,
    pub body: Bytes,
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn request(
    c: &HttpClient,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Vec<u8>,
) -> HttpReply {
    let mut req = hyper::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = c
        .request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    HttpReply { status, body }
}

/// The real binary, killed (SIGKILL) when dropped.
pub struct StoreProcess {
    proc: Proc,
    pub addr: String,
}

impl StoreProcess {
    pub async fn start(database_url: &str) -> StoreProcess {
        StoreProcess::start_logging(database_url, "warn").await
    }

    /// Started with `RUST_LOG=rust_log`; [`StoreProcess::log`] reads what it wrote.
    pub async fn start_logging(database_url: &str, rust_log: &str) -> StoreProcess {
        StoreProcess::start_with(database_url, rust_log, |_| {}).await
    }

    /// [`StoreProcess::start_logging`] with more on the command line.
    pub async fn start_with(
        database_url: &str,
        rust_log: &str,
        more: impl FnOnce(&mut std::process::Command),
    ) -> StoreProcess {
        let port = free_port();
        let bin = std::path::Path::new(env!("CARGO_BIN_EXE_idempotency-store"));
        let log = std::env::temp_dir().join(format!("idempotency-store-test-{port}.log"));
        let mut cmd = idemgate_testkit::store::serve(bin, port, database_url, API, ADMIN, rust_log);
        more(&mut cmd);
        let proc = Proc::spawn("store", &mut cmd, log);
        let p = StoreProcess {
            proc,
            addr: format!("127.0.0.1:{port}"),
        };
        let c = client();
        let url = format!("http://{}/readyz", p.addr);
        eventually("the store to be ready", Duration::from_secs(30), || {
            let (c, url) = (c.clone(), url.clone());
            async move { matches!(c.get(url.parse().unwrap()).await, Ok(r) if r.status() == 200) }
        })
        .await;
        p
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Everything the process logged so far.
    pub fn log(&self) -> String {
        self.proc.log()
    }

    pub fn kill9(&mut self) {
        self.proc.kill();
    }
}

/// A POST to the in-process app as `token`: status, headers and body.
pub async fn post_in_process(
    state: &idemgate_store::AppState,
    path: &str,
    token: &str,
    body: Vec<u8>,
) -> (u16, axum::http::HeaderMap, Vec<u8>) {
    post_in_process_with(state, path, token, body, &[]).await
}

/// [`post_in_process`] with more headers.
pub async fn post_in_process_with(
    state: &idemgate_store::AppState,
    path: &str,
    token: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (u16, axum::http::HeaderMap, Vec<u8>) {
    use tower::ServiceExt;
    let mut req = axum::http::Request::builder()
        .method("POST")
        .uri(path)
        .header("authorization", format!("Bearer {token}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(axum::body::Body::from(body)).unwrap();
    let resp = idemgate_store::app(state.clone()).oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status.as_u16(),
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

/// `idempotency-store serve` with the test credentials, `database_url` and
/// `args`, for a start that must fail: its standard error.
pub fn serve_refused(database_url: &str, args: &[&std::ffi::OsStr]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .args([
            "serve",
            "--api-token",
            API,
            "--admin-token",
            ADMIN,
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--database-url", database_url])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the store started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A claim over HTTP answered 200: the reply and the stored response body.
pub async fn claim_over_http(c: &HttpClient, p: &StoreProcess, req: &ClaimRequest) -> (ClaimReply, Vec<u8>) {
    let r = request(c, "POST", &p.url("/v1/claim"), Some(API), encode_frame(req, b"")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let (reply, bytes) = decode_frame::<ClaimReply>(&r.body).unwrap();
    (reply, bytes.to_vec())
}

/// A claim over HTTP: the store's status and, on 200, its reply.
pub async fn http_claim(c: &HttpClient, p: &StoreProcess, req: &ClaimRequest) -> (u16, Option<ClaimReply>) {
    let r = request(c, "POST", &p.url("/v1/claim"), Some(API), encode_frame(req, b"")).await;
    let reply = (r.status == 200).then(|| decode_frame::<ClaimReply>(&r.body).unwrap().0);
    (r.status, reply)
}

/// A completion over HTTP: the store's status and, on 200, its reply.
pub async fn http_complete(
    c: &HttpClient,
    p: &StoreProcess,
    s: &Scope,
    fence: u64,
    body: &[u8],
) -> (u16, Option<FenceReply>) {
    let r = request(
        c,
        "POST",
        &p.url("/v1/complete"),
        Some(API),
        encode_frame(&complete(s, fence, 201), body),
    )
    .await;
    let reply = (r.status == 200).then(|| decode_frame::<FenceReply>(&r.body).unwrap().0);
    (r.status, reply)
}
