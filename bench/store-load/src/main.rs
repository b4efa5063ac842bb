//! Throughput and latency of claim+complete, then of replays (a claim of a
//! completed key), through the HTTP API and straight against the backend,
//! and of claims+completes sent N at a time as `/v1/batch`, side by side in
//! one run (ratios, not absolute numbers, are what to compare
//! across machines).
//!
//! `cargo run --release -p idemgate-store-load -- [--database-url URL] [--concurrency N] [--seconds S]`
//! (the binary is `idempotency-store-bench`). Without a URL it uses a fresh
//! SQLite file in the temp directory. It lives outside the store's crate so
//! that the service itself carries no HTTP client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idemgate_core::config::{AfterExpiry, OnUnknown};
use idemgate_core::key::Key;
use idemgate_core::protocol::{ClaimReply, ClaimRequest, CompleteRequest};
use idemgate_core::scope::{Namespace, Scope};
use idemgate_store::backend::{Backend, SweepReport};
use idemgate_store::database_url::{open_backend, BackendOptions};
use idemgate_store::sweeper::{sweep_all, SweepSettings};
use idemgate_store::{Clock, Store};

mod api;
mod counters;

use api::{http, http_batch, http_replay, serve};
use counters::{commit_counts, context_switches, cpu_us, stage_means, stage_totals};

#[derive(Parser)]
#[command(about = "Claims+completes per second and p50/p99, via HTTP and via the raw backend")]
struct Args {
    /// sqlite://FILE or postgres://…; default: a fresh SQLite file in the temp directory.
    #[arg(long)]
    database_url: Option<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// SQLite synchronous=NORMAL instead of FULL.
    #[arg(long)]
    sqlite_normal: bool,
    /// Only the new-key claims on the raw backend, then stop (to count the
    /// store's system calls per claim under `strace -c -f`).
    #[arg(long)]
    claims_only: bool,
    /// Calls per `/v1/batch` in the batch measurement (N claims in one
    /// request, then their N completes in another); 0 skips it.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// With `--claims-only`: a sweeper works (default batch, passes a second
    /// apart) while the claims run, as the store's own does, on whatever
    /// the database holds due (`bench/fill.py arm`).
    #[arg(long)]
    sweeping: bool,
}

/// The completion of `s`'s claim under `fence`: a `201` kept whole.
pub(crate) fn completion(s: Scope, fence: u64) -> CompleteRequest {
    CompleteRequest {
        scope: s,
        fence,
        status: 201,
        headers: vec![],
        body_stored: true,
        trace: Default::default(),
    }
}

fn request(scope: Scope) -> ClaimRequest {
    ClaimRequest {
        scope,
        fingerprint: None,
        lease_ms: 30_000,
        ttl_ms: 3_600_000,
        wait_ms: 0,
        after_expiry: AfterExpiry::Reject,
        on_unknown: OnUnknown::Conflict,
        attempt: None,
        deadline_ms: 0,
        trace: Default::default(),
    }
}

fn scope(run: &str, worker: usize, i: u64) -> Result<Scope, String> {
    let key = Key::try_from(format!("{run}-{worker}-{i}")).map_err(|e| e.to_string())?;
    Scope::new("bench", "*", "bench.create", Namespace::Client, key).map_err(|e| format!("{e:?}"))
}

struct Report {
    ops: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Report {
    fn print(&mut self, name: &str) {
        self.print_as(name, "claim+complete/s");
    }

    fn print_as(&mut self, name: &str, unit: &str) {
        self.latencies.sort();
        let pct = |p: f64| {
            let i = ((self.latencies.len() as f64 * p) as usize).min(self.latencies.len().saturating_sub(1));
            self.latencies
                .get(i)
                .map(|d| d.as_secs_f64() * 1000.0)
                .unwrap_or(0.0)
        };
        println!(
            "{name:<10} {:>10.0} {unit:<16}   p50 {:>7.2} ms   p99 {:>7.2} ms   p99.9 {:>7.2} ms   max {:>7.2} ms   ({} ops)",
            self.ops as f64 / self.elapsed.as_secs_f64(),
            pct(0.50),
            pct(0.99),
            pct(0.999),
            pct(1.0),
            self.ops
        );
    }
}

async fn measure<F, Fut>(concurrency: usize, seconds: u64, op: F) -> Result<Report, String>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    measure_n(concurrency, seconds, 1, op).await
}

/// Like [`measure`] for an operation that carries `per_op` claims+completes.
async fn measure_n<F, Fut>(concurrency: usize, seconds: u64, per_op: usize, op: F) -> Result<Report, String>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0;
            while Instant::now() < deadline {
                let t = Instant::now();
                op(w, i).await?;
                lat.push(t.elapsed());
                i += 1;
            }
            Ok::<_, String>(lat)
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.map_err(|e| e.to_string())??);
    }
    Ok(Report {
        ops: latencies.len() * per_op,
        elapsed: start.elapsed(),
        latencies,
    })
}

async fn raw(backend: Arc<dyn Backend>, args: &Args) -> Result<Report, String> {
    measure(args.concurrency, args.seconds, move |w, i| {
        let backend = backend.clone();
        async move {
            let s = scope("raw", w, i)?;
            claim_and_complete(&backend, s, vec![]).await
        }
    })
    .await
}

/// New keys claimed straight on the backend, nothing else: what a claim
/// costs the store, and the context switches it takes (all threads).
async fn raw_claim(backend: Arc<dyn Backend>, args: &Args) -> Result<(Report, f64), String> {
    let before = context_switches();
    let cpu_before = cpu_us();
    let stages = stage_totals(&backend);
    let counts = commit_counts(&backend);
    let probe = backend.clone();
    let report = measure(args.concurrency, args.seconds, move |w, i| {
        let backend = backend.clone();
        async move {
            let s = scope("claim", w, i)?;
            let now = idemgate_store::clock::system_now();
            let out = backend
                .claim(&request(s), now, None)
                .await
                .map_err(|e| e.to_string())?;
            match out.reply {
                ClaimReply::Owned { .. } => Ok(()),
                other => Err(format!("unexpected {other:?}")),
            }
        }
    })
    .await?;
    let switches = context_switches().saturating_sub(before) as f64 / report.ops.max(1) as f64;
    // S_cpu of the bench's latency floor: the store's CPU for a claim's
    // database work, without HTTP.
    println!(
        "CPU per claim (the whole process, user + system): {:.0} µs",
        cpu_us().saturating_sub(cpu_before) as f64 / report.ops.max(1) as f64
    );
    let means = stage_means(&stages, &stage_totals(&probe));
    if !means.is_empty() {
        println!("write stages, mean: {means}");
    }
    let [commits, durable, checkpoints] = {
        let now = commit_counts(&probe);
        [0, 1, 2].map(|i| now[i] - counts[i])
    };
    if commits > 0.0 {
        // A durable commit syncs the WAL once; a checkpoint syncs the WAL
        // and the database file when it copies anything.
        println!(
            "commits {commits} ({durable} durable), WAL checkpoints {checkpoints}: {:.3} per durable commit",
            checkpoints / durable.max(1.0)
        );
    }
    Ok((report, switches))
}

/// The store's sweeper, passes a second apart, until told to stop; then
/// what it swept, and when it last archived or purged (the claims' own
/// leases run out too, after 30 s). Counted from the store's metrics, which
/// take every batch that committed, also in a pass that failed later.
fn sweeping(
    backend: Arc<dyn Backend>,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<(SweepReport, Duration)>,
) {
    let store = Store::new(backend, Clock::System);
    let settings = SweepSettings::default();
    let policy = settings.policy();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let task = tokio::spawn(async move {
        let (mut all, mut done) = (SweepReport::default(), Duration::ZERO);
        loop {
            if let Err(e) = sweep_all(&store, &policy).await {
                eprintln!("sweep failed: {e}");
            }
            let now = store.metrics.swept();
            if now.archived + now.purged > all.archived + all.purged {
                done = started.elapsed();
            }
            all = now;
            tokio::select! {
                _ = tokio::time::sleep(settings.interval) => {}
                _ = stopped.changed() => return (all, done),
            }
        }
    });
    (stop, task)
}

/// Claims `s` straight on the backend and completes it with a small JSON body.
async fn claim_and_complete(
    backend: &Arc<dyn Backend>,
    s: Scope,
    headers: Vec<(String, String)>,
) -> Result<(), String> {
    let now = idemgate_store::clock::system_now();
    let out = backend
        .claim(&request(s.clone()), now, None)
        .await
        .map_err(|e| e.to_string())?;
    let ClaimReply::Owned { fence } = out.reply else {
        return Err(format!("unexpected {:?}", out.reply));
    };
    let c = CompleteRequest {
        headers,
        ..completion(s, fence)
    };
    backend
        .complete(&c, b"{\"ok\":true}", now)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Keys completed once, for the replay measurements: one per worker.
async fn completed_keys(backend: &Arc<dyn Backend>, args: &Args) -> Result<Vec<Scope>, String> {
    let mut keys = Vec::new();
    for w in 0..args.concurrency {
        let s = scope("replay", w, 0)?;
        let json = vec![("content-type".into(), "application/json".into())];
        claim_and_complete(backend, s.clone(), json).await?;
        keys.push(s);
    }
    Ok(keys)
}

fn expect_replay(reply: &ClaimReply) -> Result<(), String> {
    match reply {
        ClaimReply::Replay { .. } => Ok(()),
        other => Err(format!("unexpected {other:?}")),
    }
}

async fn raw_replay(backend: Arc<dyn Backend>, keys: Arc<Vec<Scope>>, args: &Args) -> Result<Report, String> {
    measure(args.concurrency, args.seconds, move |w, _| {
        let backend = backend.clone();
        let keys = keys.clone();
        async move {
            let s = keys.get(w).cloned().ok_or("no key")?;
            let now = idemgate_store::clock::system_now();
            let out = backend
                .claim(&request(s), now, None)
                .await
                .map_err(|e| e.to_string())?;
            expect_replay(&out.reply)
        }
    })
    .await
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    if args.batch > idemgate_core::protocol::MAX_BATCH {
        return Err(format!(
            "--batch is at most {}",
            idemgate_core::protocol::MAX_BATCH
        ));
    }
    let url = args.database_url.clone().unwrap_or_else(|| {
        let dir = std::env::temp_dir().join(format!("idemgate-bench-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        format!("sqlite://{}", dir.join("bench.db").display())
    });
    let opts = BackendOptions {
        sqlite_synchronous_full: Some(!args.sqlite_normal),
        pg_pool_size: Some(args.concurrency.max(4)),
        ..Default::default()
    };
    let backend = open_backend(&url, &opts).await.map_err(|e| e.to_string())?;
    backend.migrate().await.map_err(|e| e.to_string())?;
    println!(
        "backend {}  concurrency {}  {} s each{}",
        backend.name(),
        args.concurrency,
        args.seconds,
        if url.starts_with("sqlite") && !args.sqlite_normal {
            "  (synchronous=FULL, group commit)"
        } else {
            ""
        }
    );
    let sweeping = args.sweeping.then(|| sweeping(backend.clone()));
    let (mut c, switches) = raw_claim(backend.clone(), &args).await?;
    c.print_as("raw db", "claim/s");
    if let Some((stop, sweeping)) = sweeping {
        let _ = stop.send(true);
        let (report, done) = sweeping.await.map_err(|e| e.to_string())?;
        println!(
            "swept meanwhile: {report:?}, the last archived or purged {:.1} s in",
            done.as_secs_f64()
        );
    }
    println!("context switches per claim (all threads): {switches:.1}");
    if args.claims_only {
        return Ok(());
    }
    let mut r = raw(backend.clone(), &args).await?;
    r.print("raw db");
    let post = serve(backend.clone()).await?;
    let mut h = http(post.clone(), &args).await?;
    h.print("http");
    println!(
        "http / raw throughput: {:.2}",
        (h.ops as f64 / h.elapsed.as_secs_f64()) / (r.ops as f64 / r.elapsed.as_secs_f64()).max(1e-9)
    );
    if args.batch > 0 {
        http_batch(post.clone(), &args)
            .await?
            .print(&format!("http x{}", args.batch));
    }
    // Retries of completed keys: one claim each, answered with the stored response.
    let keys = Arc::new(completed_keys(&backend, &args).await?);
    raw_replay(backend, keys.clone(), &args)
        .await?
        .print_as("raw db", "replay/s");
    http_replay(post, keys, &args).await?.print_as("http", "replay/s");
    if args.database_url.is_none() {
        if let Some(path) = url.strip_prefix("sqlite://") {
            if let Some(dir) = std::path::Path::new(path).parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
    Ok(())
}
