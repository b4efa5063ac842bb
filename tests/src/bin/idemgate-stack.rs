//! `idemgate-stack SHAPE [FLAGS] [-- STORE ARGS]`: the end-to-end tests' stack
//! (`e2e::stack`) for the scripts. It starts a named stack, prints one JSON
//! line on stdout once every part answers (addresses, each of Envoy's
//! listeners by name, PIDs, log files, the command line each process was
//! started with), holds it until SIGINT or
//! SIGTERM, then stops every process (SIGTERM, SIGKILL after 10 s, 120 s
//! for a store under --store-wrapper). If a process exits on its own
//! meanwhile, the stack stops and this exits 1.
//!
//! Shapes:
//!   demo      `make demo`: envoy/demo.yaml as written (Envoy 10000, admin
//!             9901), the store on 127.0.0.1:8787 and .demo/store.sock over a
//!             fresh .demo/store.db, payments on 8080, the gRPC ledger on 50051
//!   store     the store alone (bench/profile-store.sh, scripts/bench.sh)
//!   bench     an Envoy of bench/envoy.yaml (or --bootstrap), with its own
//!             store unless --no-store, in front of --upstream-port or, with
//!             --express, the bench's Express handler (alone with --no-store
//!             --no-envoy); with --callout-sink, bench/callout/sink.js where
//!             the store would be (--bootstrap bench/callout/envoy.yaml)
//!   ports N   N ports reserved for as long as it runs, for the ports a
//!             script hands to several stacks in turn (a store restarted on
//!             the port its Envoy points at)
//!
//! Flags: --database URL|sqlite, --store-port P, --store-socket PATH,
//! --store-bin PATH, --store-wrapper 'CMD ARGS', --store-log LEVEL,
//! --api-token T, --admin-token T, --no-store, --no-envoy, --bootstrap FILE,
//! --without-filter, --workers N, --upstream-port P, --express,
//! --callout-sink, --wasm PATH (the filter module, or the callout's), --echo
//! (every process's output on stderr, each line prefixed with its name).
//! The binaries are ENVOY_BIN, IDEMGATE_STORE_BIN, IDEMGATE_WASM and
//! IDEMGATE_PYTHON, as for the tests. Paths are relative to the repository's
//! root, which is its working directory.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use e2e::stack::{Database, Options, Ready, Service, Stack};
use serde_json::{json, Value};

const USAGE: &str =
    "usage: idemgate-stack demo|store|bench|ports N [FLAGS] [-- STORE ARGS] (see its source's first lines)";
/// The ports the demo's walkthrough names: Envoy, its admin, the store,
/// payments, the ledger.
const DEMO_PORTS: [u16; 5] = [10000, 9901, 8787, 8080, 50051];

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = std::env::set_current_dir(e2e::repo_root()) {
        eprintln!("idemgate-stack: {e}");
        return ExitCode::FAILURE;
    }
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemgate-stack: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Vec<String>) -> Result<ExitCode, String> {
    let (shape, rest) = args.split_first().ok_or(USAGE)?;
    if shape == "ports" {
        return hold_ports(rest).await;
    }
    let flags = Flags::parse(rest)?;
    let options = match shape.as_str() {
        "demo" => demo(&flags)?,
        "store" => store(&flags),
        "bench" => bench(&flags),
        _ => return Err(USAGE.into()),
    };
    // Watched from the start: a signal during start-up stops what started.
    let (tx, mut signal) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        signalled().await;
        let _ = tx.send(true);
    });
    let stack = tokio::select! {
        stack = Stack::start(options) => stack,
        _ = signal.wait_for(|s| *s) => return Ok(ExitCode::from(130)),
    };
    let echo = flags.echo.then(|| echo(&stack));
    let listeners = match stack.envoy {
        Some(_) => stack.listeners().await,
        None => Vec::new(),
    };
    println!("{}", describe(shape, &stack, &listeners));
    let code = hold(&stack, &signal).await;
    // A store under valgrind takes its time to exit and write its profile.
    let grace = match flags.store_wrapper.is_empty() {
        true => Duration::from_secs(10),
        false => Duration::from_secs(120),
    };
    stack.stop(grace).await;
    if let Some(echo) = echo {
        echo.store(true, Ordering::SeqCst);
        // The tails print what the processes wrote last before they end.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(code)
}

#[derive(Default)]
struct Flags {
    database: Option<String>,
    store_port: Option<u16>,
    store_socket: Option<PathBuf>,
    store_bin: Option<PathBuf>,
    store_wrapper: Vec<String>,
    store_log: Option<String>,
    api_token: Option<String>,
    admin_token: Option<String>,
    no_store: bool,
    no_envoy: bool,
    bootstrap: Option<String>,
    without_filter: bool,
    workers: Option<u32>,
    upstream_port: Option<u16>,
    express: bool,
    callout_sink: bool,
    wasm: Option<PathBuf>,
    echo: bool,
    store_args: Vec<String>,
}

impl Flags {
    fn parse(args: &[String]) -> Result<Flags, String> {
        let mut flags = Flags::default();
        let mut args = args.iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().cloned().ok_or(format!("{flag} needs a value"));
            let port = |v: String| v.parse::<u16>().map_err(|e| format!("{flag} {v}: {e}"));
            match flag.as_str() {
                "--database" => flags.database = Some(value()?),
                "--store-port" => flags.store_port = Some(port(value()?)?),
                "--store-socket" => flags.store_socket = Some(value()?.into()),
                "--store-bin" => flags.store_bin = Some(value()?.into()),
                "--store-wrapper" => {
                    flags.store_wrapper = value()?.split_whitespace().map(String::from).collect()
                }
                "--store-log" => flags.store_log = Some(value()?),
                "--api-token" => flags.api_token = Some(value()?),
                "--admin-token" => flags.admin_token = Some(value()?),
                "--no-store" => flags.no_store = true,
                "--no-envoy" => flags.no_envoy = true,
                "--bootstrap" => flags.bootstrap = Some(value()?),
                "--without-filter" => flags.without_filter = true,
                "--workers" => flags.workers = Some(value()?.parse().map_err(|e| format!("--workers: {e}"))?),
                "--upstream-port" => flags.upstream_port = Some(port(value()?)?),
                "--express" => flags.express = true,
                "--callout-sink" => flags.callout_sink = true,
                "--wasm" => flags.wasm = Some(value()?.into()),
                "--echo" => flags.echo = true,
                "--" => {
                    flags.store_args = args.by_ref().cloned().collect();
                }
                _ => return Err(format!("unknown flag {flag}; {USAGE}")),
            }
        }
        Ok(flags)
    }

    /// The options every shape takes from the flags.
    fn apply(&self, options: &mut Options, tokens: (&'static str, &'static str)) {
        options.api_token = leak(self.api_token.as_deref().unwrap_or(tokens.0));
        options.admin_token = leak(self.admin_token.as_deref().unwrap_or(tokens.1));
        options.store_log = leak(self.store_log.as_deref().unwrap_or("warn"));
        options.store_port = self.store_port;
        options.store_socket.clone_from(&self.store_socket);
        options.store_bin.clone_from(&self.store_bin);
        options.store_wrapper.clone_from(&self.store_wrapper);
        options.store_args.clone_from(&self.store_args);
        options.upstream_port = self.upstream_port;
        if let Some(workers) = self.workers {
            options.concurrency = workers;
        }
        if self.no_store {
            options.replicas = 0;
        }
        if self.no_envoy {
            options.envoy = false;
        }
    }

    fn database(&self) -> Database {
        match self.database.as_deref() {
            None | Some("sqlite") => Database::Sqlite,
            Some(url) => Database::Url(url.into()),
        }
    }
}

/// Options hold `&'static str`s, as the tests' constants are; a flag lives
/// as long as the process anyway.
fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn demo(flags: &Flags) -> Result<Options, String> {
    for port in DEMO_PORTS {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Err(format!(
                "port {port} is already in use (another demo still running?); stop that first"
            ));
        }
    }
    // A fresh store each time: the upstream's payments live in memory, so
    // records from an earlier run would replay payments it no longer knows.
    std::fs::create_dir_all(".demo").map_err(|e| format!(".demo: {e}"))?;
    for file in ["store.db", "store.db-wal", "store.db-shm", "store.sock"] {
        let _ = std::fs::remove_file(format!(".demo/{file}"));
    }
    let database = Database::Url("sqlite://.demo/store.db".into());
    let mut options = Options::new("envoy/demo.yaml", database, 1);
    flags.apply(&mut options, ("demo-api-token", "demo-admin-token"));
    options.as_written = true;
    options.store_log = leak(&std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()));
    options.store_socket = Some(".demo/store.sock".into());
    options.upstream_port = Some(8080);
    options.envoy_log = [
        "-l",
        "warn",
        "--component-log-level",
        "wasm:info",
        "--log-format",
        "%l: %v",
    ]
    .map(String::from)
    .to_vec();
    let python = e2e::python().display().to_string();
    options.services = vec![
        Service {
            name: "payments",
            command: ["target/debug/payments", "--listen", "127.0.0.1:8080"]
                .map(String::from)
                .to_vec(),
            env: Vec::new(),
            ready: Ready::Http("http://127.0.0.1:8080/_demo/executions".into()),
        },
        Service {
            name: "ledger",
            command: vec![
                python,
                "-u".into(),
                "examples/ledger/ledger.py".into(),
                "serve".into(),
                "50051".into(),
            ],
            env: Vec::new(),
            ready: Ready::Listening(50051),
        },
    ];
    Ok(options)
}

fn store(flags: &Flags) -> Options {
    let mut options = Options::new("bench/envoy.yaml", flags.database(), 1);
    flags.apply(&mut options, ("bench-api-token", "bench-admin-token"));
    options.envoy = false;
    options
}

fn bench(flags: &Flags) -> Options {
    let bootstrap = leak(flags.bootstrap.as_deref().unwrap_or("bench/envoy.yaml"));
    let mut options = Options::new(bootstrap, flags.database(), 1);
    flags.apply(&mut options, ("bench-api-token", "bench-admin-token"));
    options.envoy_log = ["-l", "warn"].map(String::from).to_vec();
    if flags.without_filter {
        options.edit = Some(Box::new(without_filter));
    }
    if let Some(wasm) = &flags.wasm {
        options.wasm = Some(wasm.clone());
        // The callout microbenchmark's module stands where idemgate's would.
        let module = format!("filename: {}", wasm.display());
        let edit = options.edit.take();
        options.edit = Some(Box::new(move |config: String| {
            let config = config.replace("filename: target/callout.wasm", &module);
            match edit {
                Some(edit) => edit(config),
                None => config,
            }
        }));
    }
    if flags.callout_sink {
        // The sink stands where the store would: its cluster is the store's.
        let port = flags.store_port.unwrap_or_else(e2e::free_port);
        options.store_port = Some(port);
        options.replicas = 0;
        options.services.push(Service {
            name: "sink",
            command: ["node", "bench/callout/sink.js"].map(String::from).to_vec(),
            env: vec![("SINK_PORT".into(), port.to_string())],
            ready: Ready::Http(format!("http://127.0.0.1:{port}/")),
        });
    }
    if flags.express {
        let port = flags.upstream_port.unwrap_or_else(e2e::free_port);
        options.upstream_port = Some(port);
        options.services.push(Service {
            name: "upstream",
            command: ["node", "bench/peer/app.js"].map(String::from).to_vec(),
            env: vec![
                ("BENCH_MODE".into(), "plain".into()),
                ("PORT".into(), port.to_string()),
            ],
            ready: Ready::Http(format!("http://127.0.0.1:{port}/_bench/ready")),
        });
    }
    options
}

/// A bench bootstrap without the lines between `# BEGIN idemgate` and
/// `# END idemgate`: the same Envoy, the filter and its store cluster gone.
fn without_filter(config: String) -> String {
    let mut inside = false;
    let mut kept = String::new();
    for line in config.lines() {
        let marker = line.trim();
        if marker == "# BEGIN idemgate" {
            inside = true;
        }
        if !inside {
            kept.push_str(line);
            kept.push('\n');
        }
        if marker == "# END idemgate" {
            inside = false;
        }
    }
    kept
}

async fn hold_ports(args: &[String]) -> Result<ExitCode, String> {
    let n: usize = args.first().and_then(|n| n.parse().ok()).ok_or(USAGE)?;
    let ports: Vec<u16> = (0..n).map(|_| e2e::free_port()).collect();
    println!("{}", json!({ "ports": ports, "pid": std::process::id() }));
    signalled().await;
    Ok(ExitCode::SUCCESS)
}

/// SIGINT or SIGTERM.
async fn signalled() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("idemgate-stack: no signal handler ({e}); holding until killed")
        }
    }
}

/// Until a signal (success) or a process of the stack exits on its own.
async fn hold(stack: &Stack, signal: &tokio::sync::watch::Receiver<bool>) -> ExitCode {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if *signal.borrow() {
            return ExitCode::SUCCESS;
        }
        if let Some(gone) = stack.processes().find(|p| !p.alive()) {
            // A terminal's Ctrl-C reaches the whole process group at once:
            // a child that ended on it is not one that died.
            tokio::time::sleep(Duration::from_millis(500)).await;
            if *signal.borrow() {
                return ExitCode::SUCCESS;
            }
            eprintln!(
                "idemgate-stack: {} exited on its own; its log: {}",
                gone.name(),
                gone.log_path().display()
            );
            return ExitCode::FAILURE;
        }
    }
}

/// The stack as one JSON object: what a script needs to reach and watch it.
fn describe(shape: &str, stack: &Stack, listeners: &[(String, u16)]) -> Value {
    let proc = |p: &e2e::Proc| json!({ "pid": p.pid(), "log": p.log_path() });
    let stores: Vec<Value> = (stack.stores.iter())
        .filter_map(|r| Some((r.port, r.proc.as_ref()?)))
        .map(|(port, p)| json!({ "address": format!("127.0.0.1:{port}"), "port": port, "pid": p.pid(), "log": p.log_path() }))
        .collect();
    let services: serde_json::Map<String, Value> = (stack.services.iter())
        .map(|p| (p.name().to_string(), proc(p)))
        .collect();
    let commands: serde_json::Map<String, Value> = (stack.commands.iter())
        .map(|(name, line)| (name.to_string(), json!(line)))
        .collect();
    json!({
        "stack": shape,
        "pid": std::process::id(),
        "dir": stack.dir.path(),
        "envoy": stack.envoy.as_ref().map(|p| json!({
            "address": format!("127.0.0.1:{}", stack.port),
            "port": stack.port,
            "admin": stack.admin_port,
            "listeners": listeners.iter().map(|(name, port)| (name.clone(), json!(port))).collect::<serde_json::Map<_, _>>(),
            "pid": p.pid(),
            "log": p.log_path(),
        })),
        "stores": stores,
        "database": stack.database_url,
        "services": services,
        "commands": commands,
    })
}

/// Tails every process's log onto stderr, each line prefixed with its name,
/// until the returned flag is set (and the logs are read to their end).
fn echo(stack: &Stack) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    for p in stack.processes() {
        let (name, path, done) = (p.name(), p.log_path().to_path_buf(), done.clone());
        std::thread::spawn(move || tail(name, &path, &done));
    }
    done
}

fn tail(name: &str, path: &std::path::Path, done: &AtomicBool) {
    use std::io::{BufRead, Write};
    let Ok(file) = std::fs::File::open(path) else {
        return;
    };
    let mut reader = std::io::BufReader::new(file);
    let mut line = String::new();
    loop {
        let finished = done.load(Ordering::SeqCst);
        match reader.read_line(&mut line) {
            Ok(n) if n > 0 && line.ends_with('\n') => {
                let _ = write!(std::io::stderr().lock(), "[{name}] {line}");
                line.clear();
            }
            Ok(_) if finished => return,
            Ok(_) => std::thread::sleep(Duration::from_millis(100)),
            Err(_) => return,
        }
    }
}
