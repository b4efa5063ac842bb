//! The stack every end-to-end test runs against: the real Envoy on a
//! bootstrap from `envoy/` (its ports and wasm path rewritten for the test),
//! one or more store replicas on SQLite or a throwaway PostgreSQL cluster,
//! and the in-process upstream. Ports are picked free, each reserved for
//! the life of this process (`free_port`), so no other test binary or
//! script's stack takes one while a part restarts on it; readiness is
//! polled; every part can be killed (SIGKILL) and restarted on its port, and
//! every process start gets its own log file, so the logs of a whole run can
//! be audited afterwards. [`crate::Harness`] is its preset for `envoy/e2e.yaml`;
//! `idemgate-stack` (src/bin) holds the demo's and the bench's stacks for the
//! scripts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{env_path, eventually, free_port, Proc, Upstream, ADMIN_TOKEN};
use idemgate_testkit::pg::PgCluster;

mod query;
mod services;

pub use services::{command_line, Ready, Service};

pub enum Database {
    Sqlite,
    Postgres,
    /// A database the test runs itself, e.g. a primary and its standby
    /// behind one multi-host URL.
    Url(String),
}

/// A change to the bootstrap text, made after its ports are rewritten.
pub type Edit = Box<dyn FnOnce(String) -> String + Send>;

pub struct Options {
    /// Relative to the repository root, e.g. `envoy/chaos.yaml`.
    pub bootstrap: &'static str,
    pub database: Database,
    pub replicas: usize,
    /// The filter's `store.token` in that bootstrap.
    pub api_token: &'static str,
    /// The store's operator token.
    pub admin_token: &'static str,
    /// Extra Envoy arguments, e.g. a component log level.
    pub envoy_args: Vec<String>,
    /// `RUST_LOG` of the store.
    pub store_log: &'static str,
    /// E.g. point the `express` cluster at a running app.
    pub edit: Option<Edit>,
    /// The test client's timeout per request (`None`: none).
    pub client_timeout: Option<Duration>,
    /// Environment variables of the Envoy process.
    pub envoy_env: Vec<(&'static str, &'static str)>,
    /// Where the bootstrap's upstream (port 8080) points instead of the
    /// in-process [`Upstream`], e.g. the demo's payments service.
    pub upstream_port: Option<u16>,
    /// The filter module and the store binary, when not this build's (an
    /// earlier release's, for the mixed-version tests).
    pub wasm: Option<PathBuf>,
    pub store_bin: Option<PathBuf>,
    /// Extra arguments of `idempotency-store serve`.
    pub store_args: Vec<String>,
    /// Envoy may be hot restarted ([`Stack::hot_restart`]); otherwise it
    /// runs with `--disable-hot-restart`.
    pub hot_restart: bool,
    /// Envoy's worker threads.
    pub concurrency: u32,
    /// Envoy's log level and format arguments.
    pub envoy_log: Vec<String>,
    /// Whether the stack runs an Envoy at all (not for the store alone).
    pub envoy: bool,
    /// The bootstrap as written, on its own ports ([`BOOTSTRAP_PORTS`], the
    /// store's 8787) and paths, which are relative to the working directory
    /// (the repository's root): an operator's stack, the demo's.
    pub as_written: bool,
    /// The store's port: where Envoy's store cluster points and the one
    /// replica listens (none is started when `replicas` is 0). The caller
    /// holds its reservation, e.g. across stacks that restart the store.
    pub store_port: Option<u16>,
    /// A Unix socket the one replica listens on too, and Envoy's store
    /// cluster reaches it at (a `pipe` address).
    pub store_socket: Option<PathBuf>,
    /// A command the store runs under, e.g. `valgrind --tool=callgrind`.
    pub store_wrapper: Vec<String>,
    /// Started, in order, before the stores and Envoy.
    pub services: Vec<Service>,
}

impl Options {
    pub fn new(bootstrap: &'static str, database: Database, replicas: usize) -> Options {
        Options {
            bootstrap,
            database,
            replicas,
            api_token: crate::API_TOKEN,
            admin_token: ADMIN_TOKEN,
            envoy_args: Vec::new(),
            store_log: "info",
            edit: None,
            client_timeout: Some(Duration::from_secs(20)),
            envoy_env: Vec::new(),
            upstream_port: None,
            wasm: None,
            store_bin: None,
            store_args: Vec::new(),
            hot_restart: false,
            concurrency: 2,
            envoy_log: ["-l", "info", "--log-format", "[%Y-%m-%d %T.%e][%l][%n] %v"]
                .map(String::from)
                .to_vec(),
            envoy: true,
            as_written: false,
            store_port: None,
            store_socket: None,
            store_wrapper: Vec::new(),
            services: Vec::new(),
        }
    }
}

/// The listener, admin, upstream and store ports a bootstrap of `envoy/`
/// (or `bench/`) is written with.
pub const BOOTSTRAP_PORTS: Ports = Ports {
    listener: 10000,
    admin: 9901,
    upstream: 8080,
};
const BOOTSTRAP_STORE_PORT: u16 = 8787;

/// Envoy's listener, admin and upstream ports in a bootstrap of `envoy/`.
pub struct Ports {
    pub listener: u16,
    pub admin: u16,
    pub upstream: u16,
}

/// A bootstrap from the repository with its listener, admin and upstream
/// ports and its wasm path rewritten for this test.
pub fn bootstrap(file: &str, ports: &Ports) -> String {
    bootstrap_with(file, ports, &crate::wasm_path())
}

/// [`bootstrap`] loading the filter from `wasm`.
pub fn bootstrap_with(file: &str, ports: &Ports, wasm: &Path) -> String {
    std::fs::read_to_string(crate::repo_root().join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .replace("port_value: 10000", &format!("port_value: {}", ports.listener))
        .replace("port_value: 9901", &format!("port_value: {}", ports.admin))
        .replace("port_value: 8080", &format!("port_value: {}", ports.upstream))
        .replace(
            "filename: target/idemgate.wasm",
            &format!("filename: {}", wasm.display()),
        )
}

/// The store cluster's one endpoint in a bootstrap of `envoy/`, replaced by
/// one endpoint per replica...
const STORE_ENDPOINT: &str =
    "{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8787}}}}";
/// ...and so is the demo's, the store's Unix socket.
const DEMO_STORE_ENDPOINT: &str = "{endpoint: {address: {pipe: {path: .demo/store.sock}}}}";

fn store_endpoints(ports: impl Iterator<Item = u16>) -> String {
    ports
        .map(|port| STORE_ENDPOINT.replace("8787", &port.to_string()))
        .collect::<Vec<_>>()
        .join(", ")
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
    pub services: Vec<Proc>,
    /// The command line each process was last started with, by name.
    pub commands: Vec<(&'static str, String)>,
    pub port: u16,
    pub admin_port: u16,
    pub client: reqwest::Client,
    options: Options,
    config_path: PathBuf,
    /// Every log file any process of this stack ever wrote.
    logs: Vec<PathBuf>,
    starts: usize,
    /// The running Envoy's hot restart epoch.
    epoch: u32,
}

impl Stack {
    pub async fn start(mut options: Options) -> Stack {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let upstream = Upstream::start().await;
        let (pg, database_url) = match &options.database {
            Database::Sqlite => (
                None,
                format!("sqlite://{}", dir.path().join("store.db").display()),
            ),
            Database::Postgres => {
                let pg = PgCluster::start();
                let url = pg.url("postgres");
                (Some(pg), url)
            }
            Database::Url(url) => (None, url.clone()),
        };
        let replicas = match options.store_port {
            Some(_) => options.replicas.min(1),
            None => options.replicas,
        };
        let stores: Vec<Replica> = (0..replicas)
            .map(|_| Replica {
                proc: None,
                port: options.store_port.unwrap_or_else(|| match options.as_written {
                    true => BOOTSTRAP_STORE_PORT,
                    false => free_port(),
                }),
            })
            .collect();
        let upstream_port = options.upstream_port.unwrap_or(upstream.addr.port());
        let ports = match (options.as_written, options.envoy) {
            (true, _) => BOOTSTRAP_PORTS,
            (false, true) => Ports {
                listener: free_port(),
                admin: free_port(),
                upstream: upstream_port,
            },
            (false, false) => Ports {
                listener: 0,
                admin: 0,
                upstream: upstream_port,
            },
        };
        let config_path = match options.as_written {
            true => PathBuf::from(options.bootstrap),
            false => dir.path().join("envoy.yaml"),
        };
        if options.envoy && !options.as_written {
            let wasm = options.wasm.clone().unwrap_or_else(crate::wasm_path);
            let endpoints = match (&options.store_socket, options.store_port) {
                (Some(socket), _) => {
                    DEMO_STORE_ENDPOINT.replace(".demo/store.sock", &socket.display().to_string())
                }
                (None, Some(port)) => store_endpoints([port].into_iter()),
                (None, None) => store_endpoints(stores.iter().map(|r| r.port)),
            };
            let mut config = bootstrap_with(options.bootstrap, &ports, &wasm)
                .replace(STORE_ENDPOINT, &endpoints)
                .replace(DEMO_STORE_ENDPOINT, &endpoints);
            if let Some(edit) = options.edit.take() {
                config = edit(config);
            }
            std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("write envoy config: {e}"));
        }
        let mut client = reqwest::Client::builder().pool_max_idle_per_host(0);
        if let Some(timeout) = options.client_timeout {
            client = client.timeout(timeout);
        }
        let mut stack = Stack {
            client: client.build().unwrap_or_else(|e| panic!("client: {e}")),
            dir,
            upstream,
            pg,
            database_url,
            stores,
            envoy: None,
            services: Vec::new(),
            commands: Vec::new(),
            port: ports.listener,
            admin_port: ports.admin,
            options,
            config_path,
            logs: Vec::new(),
            starts: 0,
            epoch: 0,
        };
        stack.start_services().await;
        for i in 0..stack.stores.len() {
            stack.start_store(i);
            stack.wait_store(i).await;
        }
        if stack.options.envoy {
            stack.start_envoy();
            stack.wait_envoy().await;
        }
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
        let bin = (self.options.store_bin.clone())
            .unwrap_or_else(|| env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store"));
        let mut serve = idemgate_testkit::store::serve(
            &bin,
            self.stores[i].port,
            &self.database_url,
            self.options.api_token,
            self.options.admin_token,
            self.options.store_log,
        );
        if let Some(socket) = &self.options.store_socket {
            serve.arg("--listen").arg(format!("unix:{}", socket.display()));
        }
        if self.database_url.starts_with("postgres") {
            serve.args(["--pg-pool-size", "8"]);
        }
        serve.args(&self.options.store_args);
        if let Some((wrapper, args)) = self.options.store_wrapper.split_first() {
            let mut wrapped = Command::new(wrapper);
            wrapped.args(args).arg(serve.get_program()).args(serve.get_args());
            wrapped.envs(serve.get_envs().filter_map(|(k, v)| Some((k, v?))));
            serve = wrapped;
        }
        self.commands.push(("store", command_line(&serve)));
        let proc = Proc::spawn("store", &mut serve, log);
        self.stores[i].proc = Some(proc);
    }

    /// Every replica replaced by the store binary `bin`, one at a time, on
    /// the same database and port: an upgrade or a rollback of the store.
    pub async fn replace_stores(&mut self, bin: PathBuf) {
        self.options.store_bin = Some(bin);
        for i in 0..self.stores.len() {
            self.kill_store(i);
            self.start_store(i);
            self.wait_store(i).await;
        }
    }

    /// Envoy restarted with the filter module `wasm`: an upgrade or a
    /// rollback of the sidecars.
    pub async fn replace_filter(&mut self, wasm: PathBuf) {
        let old = self.options.wasm.clone().unwrap_or_else(crate::wasm_path);
        let (from, to) = (
            format!("filename: {}", old.display()),
            format!("filename: {}", wasm.display()),
        );
        self.options.wasm = Some(wasm);
        self.replace_config(|config| config.replace(&from, &to)).await;
    }

    /// Envoy restarted on its bootstrap as `edit` leaves it.
    pub async fn replace_config(&mut self, edit: impl FnOnce(String) -> String) {
        let config =
            std::fs::read_to_string(&self.config_path).unwrap_or_else(|e| panic!("read envoy config: {e}"));
        std::fs::write(&self.config_path, edit(config)).unwrap_or_else(|e| panic!("write envoy config: {e}"));
        self.kill_envoy();
        self.start_envoy();
        self.wait_envoy().await;
    }

    /// Envoy's bootstrap as this stack runs it.
    pub fn config(&self) -> String {
        std::fs::read_to_string(&self.config_path).unwrap_or_else(|e| panic!("read envoy config: {e}"))
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
        if let Some(proc) = &self.stores[i].proc {
            signal(proc, if stop { "-STOP" } else { "-CONT" });
        }
    }

    pub fn store_url(&self, i: usize, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.stores[i].port)
    }

    pub async fn wait_store(&self, i: usize) {
        let url = self.store_url(i, "/readyz");
        // Under a wrapper (valgrind) the store starts many times slower.
        let within = match self.options.store_wrapper.is_empty() {
            true => Duration::from_secs(30),
            false => Duration::from_secs(180),
        };
        eventually("the store to be ready", within, || async {
            // One that exited (a bad flag, its port taken) never will be.
            let proc = self.stores[i].proc.as_ref();
            assert!(proc.is_some_and(Proc::alive), "store {i} exited during start-up");
            self.answers_200(&url).await
        })
        .await;
    }

    async fn answers_200(&self, url: &str) -> bool {
        matches!(self.client.get(url).send().await, Ok(r) if r.status() == 200)
    }

    pub fn start_envoy(&mut self) {
        let log = self.next_log("envoy");
        let envoy_bin = crate::envoy_bin();
        let base_id_path = self.dir.path().join("envoy-base-id");
        let restart: Vec<String> = match (self.options.hot_restart, self.epoch) {
            (false, _) => vec!["--disable-hot-restart".into()],
            // A base id of its own, so tests running side by side never
            // share hot restart shared memory.
            (true, 0) => vec![
                "--use-dynamic-base-id".into(),
                "--base-id-path".into(),
                base_id_path.display().to_string(),
            ],
            (true, epoch) => {
                let base_id = std::fs::read_to_string(&base_id_path)
                    .unwrap_or_else(|e| panic!("{base_id_path:?}: {e}"));
                let base_id = base_id.trim().to_string();
                vec![
                    "--base-id".into(),
                    base_id,
                    "--restart-epoch".into(),
                    epoch.to_string(),
                ]
            }
        };
        let mut envoy = Command::new(&envoy_bin);
        envoy
            .arg("-c")
            .arg(&self.config_path)
            .args(["--concurrency", &self.options.concurrency.to_string()])
            .args(&restart)
            .args(&self.options.envoy_args)
            .args(&self.options.envoy_log)
            .envs(self.options.envoy_env.iter().copied());
        self.commands.push(("envoy", command_line(&envoy)));
        self.envoy = Some(Proc::spawn("envoy", &mut envoy, log));
    }

    pub fn kill_envoy(&mut self) {
        if let Some(mut p) = self.envoy.take() {
            p.kill();
        }
    }

    /// SIGTERM, as a container runtime stops Envoy; returns once it exited.
    pub async fn terminate_envoy(&mut self) {
        if let Some(p) = self.envoy.take() {
            signal(&p, "-TERM");
            eventually("envoy to exit", Duration::from_secs(30), || async { !p.alive() }).await;
        }
    }

    /// Starts Envoy's next hot restart epoch on the same config (needs
    /// [`Options::hot_restart`]) and waits until it is ready; the new epoch
    /// takes the listeners over and the returned one drains, then exits
    /// (`--drain-time-s`, `--parent-shutdown-time-s` among
    /// [`Options::envoy_args`]).
    pub async fn hot_restart(&mut self) -> Option<Proc> {
        assert!(
            self.options.hot_restart,
            "the stack was started without hot restart"
        );
        let parent = self.envoy.take();
        self.epoch += 1;
        self.start_envoy();
        self.wait_envoy().await;
        parent
    }

    /// What the running Envoy wrote so far.
    pub fn envoy_log(&self) -> String {
        self.envoy.as_ref().map(Proc::log).unwrap_or_default()
    }

    /// Ready, and every store endpoint passed its health check: otherwise the
    /// first requests after a start meet "no healthy host".
    pub async fn wait_envoy(&self) {
        let ready = self.admin_url("/ready");
        let wanted = self.stores.iter().filter(|r| r.proc.is_some()).count();
        eventually("envoy to be ready", Duration::from_secs(60), || async {
            assert!(
                self.envoy.as_ref().is_some_and(Proc::alive),
                "envoy exited during start-up"
            );
            if !self.answers_200(&ready).await {
                return false;
            }
            let healthy = self
                .admin_text("/clusters")
                .await
                .lines()
                .filter(|l| l.starts_with("idempotency_store::") && l.contains("::health_flags::healthy"))
                .count();
            healthy >= wanted
        })
        .await;
    }
}

/// Sends `sig` (`-STOP`, `-TERM`...) to a process of the stack.
fn signal(proc: &Proc, sig: &str) {
    let Some(pid) = proc.pid() else { return };
    let status = Command::new("kill").args([sig, &pid.to_string()]).status();
    if !matches!(status, Ok(s) if s.success()) {
        panic!("kill {sig} {pid}: {status:?}");
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.kill_envoy();
        for i in 0..self.stores.len() {
            self.kill_store(i);
        }
        // Only ports this process reserved are released; the store port a
        // caller passed in stays its own.
        let stores = self.stores.iter().map(|r| r.port);
        for port in [self.port, self.admin_port].into_iter().chain(stores) {
            if Some(port) != self.options.store_port {
                idemgate_testkit::release(port);
            }
        }
    }
}
