//! A configurable stack for the chaos, soak and security runs: the real Envoy
//! on any bootstrap from `envoy/`, one or more store replicas on SQLite or a
//! throwaway PostgreSQL cluster, and the in-process upstream. Unlike
//! [`crate::Harness`], every part can be killed (SIGKILL) and restarted on its
//! port, and every process start gets its own log file, so the logs of a whole
//! run can be audited afterwards.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::{env_path, eventually, free_port, Proc, Upstream, ADMIN_TOKEN};
use idemgate_testkit::pg::PgCluster;

pub enum Database {
    Sqlite,
    Postgres,
}

pub struct Options {
    /// Relative to the repository root, e.g. `envoy/chaos.yaml`.
    pub bootstrap: &'static str,
    pub database: Database,
    pub replicas: usize,
    /// The filter's `store.token` in that bootstrap.
    pub api_token: &'static str,
    /// Extra Envoy arguments, e.g. a component log level.
    pub envoy_args: Vec<String>,
    /// `RUST_LOG` of the store.
    pub store_log: &'static str,
}

impl Options {
    pub fn new(bootstrap: &'static str, database: Database, replicas: usize) -> Options {
        Options {
            bootstrap,
            database,
            replicas,
            api_token: crate::API_TOKEN,
            envoy_args: Vec::new(),
            store_log: "info",
        }
    }
}

pub struct Replica {
    pub proc: Option<Proc>,
    pub port: u16,
}

pub struct Stack {
    pub dir: tempfile::TempDir,
    pub upstream: Upstream,
    pub pg: Option<PgCluster>,
    pub database_url: String,
    pub stores: Vec<Replica>,
    pub envoy: Option<Proc>,
    pub port: u16,
    pub admin_port: u16,
    pub client: reqwest::Client,
    options: Options,
    config_path: PathBuf,
    /// Every log file any process of this stack ever wrote.
    logs: Vec<PathBuf>,
    starts: usize,
}

impl Stack {
    pub async fn start(options: Options) -> Stack {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let upstream = Upstream::start().await;
        let (pg, database_url) = match options.database {
            Database::Sqlite => (
                None,
                format!("sqlite://{}", dir.path().join("store.db").display()),
            ),
            Database::Postgres => {
                let pg = PgCluster::start();
                let url = pg.url("postgres");
                (Some(pg), url)
            }
        };
        let stores: Vec<Replica> = (0..options.replicas.max(1))
            .map(|_| Replica {
                proc: None,
                port: free_port(),
            })
            .collect();
        let (port, admin_port) = (free_port(), free_port());
        let store_endpoints = stores
            .iter()
            .map(|r| {
                format!(
                    "{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}",
                    r.port
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let config = crate::bootstrap(options.bootstrap, port, admin_port, upstream.addr.port()).replace(
            "{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8787}}}}",
            &store_endpoints,
        );
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("write envoy config: {e}"));
        let mut stack = Stack {
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap_or_else(|e| panic!("client: {e}")),
            dir,
            upstream,
            pg,
            database_url,
            stores,
            envoy: None,
            port,
            admin_port,
            options,
            config_path,
            logs: Vec::new(),
            starts: 0,
        };
        for i in 0..stack.stores.len() {
            stack.start_store(i);
            stack.wait_store(i).await;
        }
        stack.start_envoy();
        stack.wait_envoy().await;
        stack
    }

    fn next_log(&mut self, name: &str) -> PathBuf {
        self.starts += 1;
        let path = self.dir.path().join(format!("{:03}-{name}.log", self.starts));
        self.logs.push(path.clone());
        path
    }

    /// Starts replica `i` on its port (after a kill, on the same database).
    pub fn start_store(&mut self, i: usize) {
        let log = self.next_log(&format!("store{i}"));
        let bin = env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store");
        let port = self.stores[i].port;
        let proc = Proc::spawn(
            "store",
            Command::new(bin)
                .arg("serve")
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--database-url", &self.database_url])
                .args([
                    "--api-token",
                    self.options.api_token,
                    "--admin-token",
                    ADMIN_TOKEN,
                ])
                .args(["--pg-pool-size", "8"])
                .env("RUST_LOG", self.options.store_log),
            log,
        );
        self.stores[i].proc = Some(proc);
    }

    /// SIGKILL, no goodbye.
    pub fn kill_store(&mut self, i: usize) {
        if let Some(mut p) = self.stores[i].proc.take() {
            p.kill();
        }
    }

    /// Freezes replica `i` (SIGSTOP) or lets it run again (SIGCONT): a store
    /// that holds every connection and answers nothing, as an fsync stall, a
    /// checkpoint or a lock wait would, on either backend.
    pub fn signal_store(&self, i: usize, stop: bool) {
        let Some(pid) = self.stores[i].proc.as_ref().and_then(Proc::pid) else {
            return;
        };
        let signal = if stop { "-STOP" } else { "-CONT" };
        let status = Command::new("kill").args([signal, &pid.to_string()]).status();
        if !matches!(status, Ok(s) if s.success()) {
            panic!("kill {signal} {pid}: {status:?}");
        }
    }

    pub fn store_url(&self, i: usize, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.stores[i].port)
    }

    pub async fn wait_store(&self, i: usize) {
        let url = self.store_url(i, "/readyz");
        let client = self.client.clone();
        eventually("the store to be ready", Duration::from_secs(30), || {
            let (client, url) = (client.clone(), url.clone());
            async move { matches!(client.get(&url).send().await, Ok(r) if r.status() == 200) }
        })
        .await;
    }

    pub fn start_envoy(&mut self) {
        let log = self.next_log("envoy");
        let envoy_bin = env_path("ENVOY_BIN", ".tools/venv/bin/envoy");
        let proc = Proc::spawn(
            "envoy",
            Command::new(&envoy_bin)
                .arg("-c")
                .arg(&self.config_path)
                .args(["--concurrency", "2", "--disable-hot-restart", "-l", "info"])
                .args(&self.options.envoy_args)
                .args(["--log-format", "[%Y-%m-%d %T.%e][%l][%n] %v"]),
            log,
        );
        self.envoy = Some(proc);
    }

    pub fn kill_envoy(&mut self) {
        if let Some(mut p) = self.envoy.take() {
            p.kill();
        }
    }

    /// Ready, and every store endpoint passed its health check: otherwise the
    /// first requests after a start meet "no healthy host".
    pub async fn wait_envoy(&self) {
        let ready = format!("http://127.0.0.1:{}/ready", self.admin_port);
        let clusters = format!("http://127.0.0.1:{}/clusters", self.admin_port);
        let client = self.client.clone();
        let wanted = self.stores.iter().filter(|r| r.proc.is_some()).count();
        eventually("envoy to be ready", Duration::from_secs(60), || {
            let (client, ready, clusters) = (client.clone(), ready.clone(), clusters.clone());
            async move {
                if !matches!(client.get(&ready).send().await, Ok(r) if r.status() == 200) {
                    return false;
                }
                let text = match client.get(&clusters).send().await {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(_) => return false,
                };
                let healthy = text
                    .lines()
                    .filter(|l| l.starts_with("idempotency_store::") && l.contains("::health_flags::healthy"))
                    .count();
                healthy >= wanted
            }
        })
        .await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The store's records with this tenant and key (any replica that answers).
    pub async fn records(
        &self,
        tenant: &str,
        principal: &str,
        route: &str,
        key: &str,
    ) -> Option<Vec<serde_json::Value>> {
        for i in 0..self.stores.len() {
            let query =
                serde_json::json!({"tenant": tenant, "principal": principal, "route": route, "key": key});
            let res = self
                .client
                .post(self.store_url(i, "/admin/v1/records/lookup"))
                .bearer_auth(ADMIN_TOKEN)
                .header("content-type", "application/json")
                .body(query.to_string())
                .send()
                .await;
            if let Ok(r) = res {
                if r.status() == 200 {
                    let bytes = r.bytes().await.unwrap_or_default();
                    // The current generation; earlier ones (released,
                    // abandoned, replaced) are history, not records.
                    if let Ok(serde_json::Value::Object(mut v)) = serde_json::from_slice(&bytes) {
                        if let Some(serde_json::Value::Array(records)) = v.remove("records") {
                            return Some(records.into_iter().filter(|r| r["ended_at"].is_null()).collect());
                        }
                    }
                }
            }
        }
        None
    }

    /// Every generation of the key (current ones have `ended_at: null`) and
    /// every event, as the admin lookup answers them: `{"records", "events"}`
    /// (any replica that answers).
    pub async fn history(
        &self,
        tenant: &str,
        principal: &str,
        route: &str,
        key: &str,
    ) -> Option<serde_json::Value> {
        for i in 0..self.stores.len() {
            let query = serde_json::json!({
                "tenant": tenant, "principal": principal, "route": route, "key": key, "limit": 1000
            });
            let res = self
                .client
                .post(self.store_url(i, "/admin/v1/records/lookup"))
                .bearer_auth(ADMIN_TOKEN)
                .header("content-type", "application/json")
                .body(query.to_string())
                .send()
                .await;
            if let Ok(r) = res {
                if r.status() == 200 {
                    let bytes = r.bytes().await.unwrap_or_default();
                    if let Ok(v @ serde_json::Value::Object(_)) = serde_json::from_slice(&bytes) {
                        if v["records"].is_array() && v["events"].is_array() {
                            return Some(v);
                        }
                    }
                }
            }
        }
        None
    }

    /// Records still in progress (any age).
    pub async fn in_progress(&self) -> Option<Vec<serde_json::Value>> {
        let res = self
            .client
            .get(self.store_url(0, "/admin/v1/records/stuck?older_than_ms=0&limit=1000"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .ok()?;
        let bytes = res.bytes().await.ok()?;
        match serde_json::from_slice(&bytes).ok()? {
            serde_json::Value::Array(v) => Some(v),
            _ => None,
        }
    }

    /// Every log line any process of this stack wrote, with its file name.
    pub fn log_lines(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for path in &self.logs {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read(path).unwrap_or_default();
            for line in String::from_utf8_lossy(&text).lines() {
                out.push((name.clone(), line.to_string()));
            }
        }
        out
    }

    /// Resident memory of a process in KiB (Linux `/proc`).
    pub fn rss_kib(proc: &Proc) -> Option<u64> {
        let pid = proc.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.kill_envoy();
        for i in 0..self.stores.len() {
            self.kill_store(i);
        }
    }
}
