//! The growth soak (`make soak`, not in CI): the release store on SQLite,
//! pre-filled with millions of records, takes new keys and replays through
//! the real Envoy for half an hour, on a policy whose records live a minute
//! and whose archived metadata is kept two, so that the sweeper archives and
//! purges throughout. Every ten seconds it samples both processes' memory,
//! the database and WAL sizes and how far the sweeper lags behind what is
//! due. The run holds when memory is flat after warm-up, the WAL stops
//! growing, the sweeper keeps up, the store's p99.9 as Envoy sees it stays
//! under the filter's store timeout, and every answer is what the contract
//! says: a first execution or a marked replay of it, never an error.
//!
//! `GROWTH_SECONDS` (1800), `GROWTH_RECORDS` (2,000,000) and `GROWTH_RATE`
//! (requests per second, 200) size it.

// Test support: failing loudly is how a helper reports a broken run.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::report::{write, Row};
use e2e::stack::{Database, Options, Stack};
use e2e::{repo_root, Answer, Proc};

/// The filter's `store.timeout_ms` in envoy/chaos.yaml.
const STORE_TIMEOUT_MS: f64 = 1000.0;
const TTL_SECS: u64 = 60;
const RETENTION_SECS: u64 = 120;
const CLIENTS: u32 = 8;
/// Replays go to keys at most this old: well inside the TTL.
const REPLAY_WINDOW: Duration = Duration::from_secs(5);

fn setting(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    new_keys: u64,
    replays: u64,
    /// Answers that were neither, by what they were.
    errors: BTreeMap<String, u64>,
    latencies_us: Vec<u32>,
}

impl Seen {
    fn error(&mut self, what: String) {
        *self.errors.entry(what).or_default() += 1;
    }

    fn merge(&mut self, other: Seen) {
        self.new_keys += other.new_keys;
        self.replays += other.replays;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.latencies_us.extend(other.latencies_us);
    }

    fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

fn outcome(a: &Answer) -> String {
    a.problem().unwrap_or_else(|| a.status.to_string())
}

/// One client: a new key per tick, every fourth tick a replay of one of its
/// own recent keys, which must come back marked and byte for byte the same.
async fn client(url: Arc<str>, id: u32, period: Duration, deadline: Instant) -> Seen {
    let http = reqwest::Client::new();
    let mut seen = Seen::default();
    let mut recent: VecDeque<(Instant, String, bytes::Bytes)> = VecDeque::new();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let tenant = format!("tenant-{}", id % 4);
    let body = format!(r#"{{"amount": {id}, "currency": "EUR"}}"#);
    let mut n = 0u64;
    while Instant::now() < deadline {
        tick.tick().await;
        n += 1;
        while recent
            .front()
            .is_some_and(|(at, ..)| at.elapsed() > REPLAY_WINDOW)
        {
            recent.pop_front();
        }
        let replay = if n % 4 == 0 { recent.front().cloned() } else { None };
        let key = match &replay {
            Some((_, key, _)) => key.clone(),
            None => e2e::fresh_key(&format!("growth-{id}")),
        };
        let started = Instant::now();
        let request = http
            .post(&*url)
            .header("content-type", "application/json")
            .header("x-tenant-id", &tenant)
            .header("x-user-id", "soak")
            .header("idempotency-key", &key)
            .body(body.clone());
        let answer = match request.send().await {
            Ok(res) => Answer::of(res).await,
            Err(e) => {
                seen.error(format!(
                    "transport: {}",
                    if e.is_timeout() { "timeout" } else { "error" }
                ));
                continue;
            }
        };
        seen.latencies_us
            .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
        let replayed = answer.header("idempotent-replayed") == Some("true");
        match replay {
            Some((_, _, first)) if replayed && answer.body == first => seen.replays += 1,
            Some(_) => seen.error(format!("replay answered {}", outcome(&answer))),
            None if answer.status < 300 && !replayed => {
                seen.new_keys += 1;
                recent.push_back((Instant::now(), key, answer.body));
            }
            None => seen.error(format!("new key answered {}", outcome(&answer))),
        }
    }
    seen
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    envoy_kib: u64,
    store_kib: u64,
    db_bytes: u64,
    wal_bytes: u64,
    /// How long the oldest record due for archiving (or purging) has been
    /// waiting for the sweeper, in seconds.
    archive_lag: f64,
    purge_lag: f64,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Seconds since the oldest of `sql`'s due times (0 when nothing is due),
/// asked with the sweeper's own predicates so its indexes answer.
fn lag(db: &rusqlite::Connection, sql: &str, due_before: i64) -> f64 {
    let oldest: Option<i64> = db
        .query_row(sql, [due_before], |r| r.get(0))
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    oldest.map_or(0.0, |at| (due_before - at).max(0) as f64 / 1000.0)
}

fn sample(stack: &Stack, db_path: &Path, db: &rusqlite::Connection, started: Instant) -> Sample {
    let size = |p: PathBuf| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let now = now_ms();
    Sample {
        at: started.elapsed(),
        envoy_kib: stack.envoy.as_ref().and_then(Proc::rss_kib).unwrap_or(0),
        store_kib: stack.stores[0].proc.as_ref().and_then(Proc::rss_kib).unwrap_or(0),
        db_bytes: size(db_path.to_path_buf()),
        wal_bytes: size(db_path.with_extension("db-wal")),
        archive_lag: lag(
            db,
            "SELECT MIN(expires_at) FROM idempotency_records WHERE archived_at IS NULL AND expires_at <= ?1",
            now,
        ),
        purge_lag: lag(
            db,
            "SELECT MIN(archived_at) FROM idempotency_records WHERE archived_at IS NOT NULL AND archived_at <= ?1",
            now - RETENTION_SECS as i64 * 1000,
        ),
    }
}

/// Writes `records` completed records into the stopped store's database,
/// as `make bench` does (bench/fill.py): due far beyond the run.
fn fill(db_path: &Path, records: u64) {
    let python = std::env::var("IDEMGATE_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .arg(repo_root().join("bench/fill.py"))
        .arg("sqlite")
        .arg(db_path)
        .arg(records.to_string())
        .output()
        .unwrap_or_else(|e| panic!("bench/fill.py: {e}"));
    assert!(
        out.status.success(),
        "bench/fill.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The cumulative P99.9 of an Envoy histogram, in its unit, from `/stats`.
fn p999(stats: &str, name: &str) -> Option<f64> {
    let line = stats.lines().find(|l| l.starts_with(&format!("{name}: ")))?;
    let rest = line.split("P99.9(").nth(1)?;
    rest.split(')').next()?.split(',').nth(1)?.trim().parse().ok()
}

fn quantile(sorted: &[u32], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(i).map_or(0.0, |&us| us as f64 / 1000.0)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "half an hour: make soak runs it"]
async fn soak_growth_holds_memory_wal_and_sweeper_with_millions_of_records() {
    let secs = setting("GROWTH_SECONDS", 1800);
    let records = setting("GROWTH_RECORDS", 2_000_000);
    let rate = setting("GROWTH_RATE", 200).max(1);

    let mut options = Options::new("envoy/chaos.yaml", Database::Sqlite, 1);
    options.store_args = vec!["--audit-retention-secs".into(), RETENTION_SECS.to_string()];
    options.edit = Some(Box::new(|config: String| {
        let payments = r#""lease_seconds": 3},"#;
        assert!(
            config.contains(payments),
            "envoy/chaos.yaml changed its payments policy"
        );
        config.replacen(
            payments,
            &format!(r#""lease_seconds": 3, "ttl_seconds": {TTL_SECS}}},"#),
            1,
        )
    }));
    let mut stack = Stack::start(options).await;
    let db_path = PathBuf::from(
        stack
            .database_url
            .strip_prefix("sqlite://")
            .unwrap_or_else(|| panic!("not SQLite: {}", stack.database_url)),
    );
    let filled = Instant::now();
    stack.kill_store(0);
    fill(&db_path, records);
    println!(
        "growth: filled {records} records in {:.0} s",
        filled.elapsed().as_secs_f64()
    );
    stack.start_store(0);
    stack.wait_store(0).await;

    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let url: Arc<str> = stack.url("/pay").into();
    let period = Duration::from_secs_f64(f64::from(CLIENTS) / rate as f64);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(client(url.clone(), id, period, deadline)))
        .collect();
    let db = rusqlite::Connection::open_with_flags(&db_path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap_or_else(|e| panic!("open {}: {e}", db_path.display()));
    let mut samples = Vec::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(10).min(deadline - Instant::now())).await;
        let s = sample(&stack, &db_path, &db, started);
        println!("growth: {s:?}");
        samples.push(s);
    }
    let mut seen = Seen::default();
    for c in clients {
        seen.merge(c.await.unwrap_or_else(|e| panic!("a client failed: {e}")));
    }

    let envoy_stats = stack
        .admin_text("/stats?filter=^cluster\\.idempotency_store\\.")
        .await;
    let store_p999 = p999(&envoy_stats, "cluster.idempotency_store.upstream_rq_time");
    let store_metrics = reqwest::get(stack.store_url(0, "/metrics"))
        .await
        .unwrap_or_else(|e| panic!("store metrics: {e}"))
        .text()
        .await
        .unwrap_or_default();
    let sweeper_errors = metric(&store_metrics, "idemgate_store_sweeper_errors_total");
    let archived = metric(
        &store_metrics,
        "idemgate_store_sweeper_rows_total{action=\"archived\"}",
    );
    let purged = metric(
        &store_metrics,
        "idemgate_store_sweeper_rows_total{action=\"purged\"}",
    );
    let executions = stack.upstream.log();
    let mut per_key: BTreeMap<&str, u64> = BTreeMap::new();
    for e in &executions {
        *per_key.entry(e.key.as_str()).or_default() += 1;
    }
    let double_executions = per_key.values().filter(|&&n| n > 1).count();
    seen.latencies_us.sort_unstable();

    // After warm-up (a tenth of the run, once records expire, are archived
    // and purged at the rate they arrive), against the end.
    let warm = samples
        .iter()
        .find(|s| s.at >= Duration::from_secs((secs / 10).max(TTL_SECS + RETENTION_SECS)))
        .or(samples.first())
        .copied()
        .unwrap_or_else(|| panic!("no samples"));
    let end = *samples.last().unwrap_or(&warm);
    let flat = |warm: u64, end: u64| end <= warm + warm / 5 + 8 * 1024;
    let wal_max_warm = samples
        .iter()
        .filter(|s| s.at <= warm.at)
        .map(|s| s.wal_bytes)
        .max()
        .unwrap_or(0);
    let wal_max = samples.iter().map(|s| s.wal_bytes).max().unwrap_or(0);
    let (archive_lag, purge_lag) = samples.iter().fold((0f64, 0f64), |(a, p), s| {
        (a.max(s.archive_lag), p.max(s.purge_lag))
    });
    let db_end_vs_warm = end.db_bytes as f64 / warm.db_bytes.max(1) as f64;
    let mib = |b: u64| b as f64 / 1048576.0;
    let memory = format!(
        "Envoy {:.1} → {:.1} MiB, store {:.1} → {:.1} MiB",
        warm.envoy_kib as f64 / 1024.0,
        end.envoy_kib as f64 / 1024.0,
        warm.store_kib as f64 / 1024.0,
        end.store_kib as f64 / 1024.0,
    );
    let storage = format!(
        "database {:.0} → {:.0} MiB, WAL at most {:.1} MiB ({:.1} by warm-up)",
        mib(warm.db_bytes),
        mib(end.db_bytes),
        mib(wal_max),
        mib(wal_max_warm)
    );
    let sweeper = format!(
        "sweeper archived {archived:.0} and purged {purged:.0} records, lagged at most {archive_lag:.1} s \
         (archive) and {purge_lag:.1} s (purge), {sweeper_errors:.0} errors"
    );
    let latency = format!(
        "store p99.9 {} ms as Envoy saw it (timeout {STORE_TIMEOUT_MS:.0} ms); clients p50 {:.1}, p99 {:.1}, p99.9 {:.1} ms",
        store_p999.map_or("?".into(), |v| format!("{v:.1}")),
        quantile(&seen.latencies_us, 0.5),
        quantile(&seen.latencies_us, 0.99),
        quantile(&seen.latencies_us, 0.999),
    );
    println!(
        "growth: {memory}; {storage}; {sweeper}; {latency}; errors {:?}",
        seen.errors
    );

    let checks = [
        (warm.envoy_kib > 0 && warm.store_kib > 0, "memory was measured"),
        (
            flat(warm.envoy_kib, end.envoy_kib),
            "Envoy memory is flat after warm-up",
        ),
        (
            flat(warm.store_kib, end.store_kib),
            "store memory is flat after warm-up",
        ),
        (
            wal_max <= wal_max_warm + wal_max_warm / 2 + (4 << 20),
            "the WAL stops growing after warm-up",
        ),
        (db_end_vs_warm <= 1.10, "the database stops growing after warm-up"),
        (
            archive_lag <= 30.0 && purge_lag <= 30.0,
            "the sweeper keeps up (30 s)",
        ),
        (archived > 0.0 && purged > 0.0, "the sweeper archived and purged"),
        (sweeper_errors == 0.0, "no sweeper pass failed"),
        (
            store_p999.is_some_and(|v| v < STORE_TIMEOUT_MS),
            "store p99.9 under the filter's timeout",
        ),
        (
            seen.error_count() == 0,
            "every answer a first execution or its replay",
        ),
        (double_executions == 0, "no key executed twice"),
        (
            executions.len() as u64 == seen.new_keys,
            "one execution per new key",
        ),
    ];
    let failed: Vec<&str> = checks
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, what)| *what)
        .collect();
    write(&Row {
        run: &format!("growth soak ({secs} s, release store, SQLite, not in CI)"),
        load: format!(
            "{secs} s at {rate} requests/s over {CLIENTS} clients on {records} pre-filled records: \
             {} new keys, {} replays; records live {TTL_SECS} s, archived metadata {RETENTION_SECS} s; \
             {memory}; {storage}; {sweeper}; {latency}",
            seen.new_keys, seen.replays
        ),
        faults: "none".into(),
        hostile: "—".into(),
        fuzz_execs: "—".into(),
        violations: format!(
            "{} errors, {double_executions} double executions{}",
            seen.error_count(),
            if failed.is_empty() {
                String::new()
            } else {
                format!("; failed: {}", failed.join(", "))
            }
        ),
        passed: failed.is_empty(),
        table: "results",
    });
    assert!(
        failed.is_empty(),
        "growth soak failed: {failed:?}\n{memory}; {storage}; {sweeper}; {latency}; {:?}",
        seen.errors
    );
}
