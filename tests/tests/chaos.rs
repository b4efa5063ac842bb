//! Exactly-once under faults: mixed traffic through the real Envoy, on routes
//! with every `on_unknown` and `after_expiry` mode, while store replicas are
//! SIGKILLed and restarted or frozen past the filter's store timeout, Envoy
//! is restarted and upstream connections are reset; then the audit in
//! `e2e::chaos` compares the upstream's executions, the store's whole history
//! (every generation of every key) and every answer.
//!
//! `CHAOS_SECONDS` sets the traffic time per run (20 s here, 60 s under
//! `make chaos`). The soak run is `#[ignore]`d: `make soak` runs it.

// Test support: failing loudly is how a helper reports a broken run.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::chaos::{at_full_speed, audit, inject_faults, worker, Traffic};
use e2e::report::{write, Row};
use e2e::stack::{Database, Options, Stack};
use e2e::Proc;

const WORKERS: u64 = 12;

fn seconds(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The chaos run's clients: every scenario at full speed until `deadline`.
fn chaos_workers(traffic: &Arc<Traffic>, deadline: Instant) -> Vec<tokio::task::JoinHandle<()>> {
    at_full_speed(traffic, WORKERS, deadline)
}

async fn join(workers: Vec<tokio::task::JoinHandle<()>>) {
    for w in workers {
        w.await.unwrap_or_else(|e| panic!("a worker failed: {e}"));
    }
}

async fn chaos_run(run: &str, database: Database, replicas: usize) {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let secs = seconds("CHAOS_SECONDS", 20);
    let mut stack = Stack::start(Options::new("envoy/chaos.yaml", database, replicas)).await;
    let traffic = Traffic::new(stack.url(""));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let workers = chaos_workers(&traffic, deadline);
    let faults = inject_faults(&mut stack, deadline, Duration::from_millis(1_800)).await;
    join(workers).await;
    let elapsed = started.elapsed().as_secs_f64();
    // Everything is up again (inject_faults leaves it so); wait for health.
    stack.wait_envoy().await;
    let mut report = audit(&stack, &traffic).await;
    report.excuse(|at| faults.left_unknown_by_contract(at));
    report.bound_unavailable(&faults.windows);
    let left_excused = report.judge_left_detached(&faults);
    println!("{run}: {secs} s, {}; {}", faults.summary(), report.summary());
    for key in &report.unknown_by_contract {
        println!("{run}: left unknown by contract: {key}");
    }
    for line in report.routes() {
        println!("{run}: route {line}");
    }
    println!("{run}: {}", report.grpc());
    println!(
        "{run}: {} responses of at least 400 KiB ({} near 4 MiB); {} clients left a detached request, their keys ended {:?}",
        report.large_responses, report.huge_responses, report.left_detached, report.left_detached_ended
    );
    for why in &left_excused {
        println!("{run}: a detached request whose client left ended unknown: {why}");
    }
    let enough_faults = faults.store_kills >= 1 && faults.store_stalls >= 1 && faults.envoy_restarts >= 1;
    // Every route ran, and some responses were near or above their limits.
    let exercised = report.executions > 0
        && report.replays_checked > 0
        && e2e::chaos::ROUTES
            .iter()
            .all(|r| report.by_route.get(r.name).is_some_and(|t| t.executions > 0))
        && report.large_responses > 0;
    write(&Row {
        run: &format!("{run} ({secs} s)"),
        load: format!(
            "{secs} s, {WORKERS} clients: {} requests ({:.0}/s), {} upstream executions, {} scopes",
            report.requests,
            report.requests as f64 / elapsed,
            report.executions,
            report.scopes
        ),
        faults: faults.summary(),
        hostile: report.hostile(),
        fuzz_execs: "—".into(),
        violations: report.verdict(),
        passed: enough_faults && exercised && report.total_violations() == 0,
        table: "results",
    });
    // Which fault each burnt key follows.
    for (key, at) in report.burnt_keys.iter().zip(&report.burnt_at) {
        println!("{run}: {key}: claimed {}", faults.near(*at));
    }
    assert!(enough_faults, "too short to inject faults");
    assert!(exercised, "{}", report.summary());
    assert_eq!(report.total_violations(), 0, "{}", report.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_sqlite_executes_every_key_at_most_once_and_keeps_the_contract() {
    chaos_run("chaos, SQLite", Database::Sqlite, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_postgresql_executes_every_key_at_most_once_and_keeps_the_contract() {
    chaos_run("chaos, PostgreSQL", Database::Postgres, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_with_two_store_replicas_on_postgresql_executes_every_key_at_most_once() {
    chaos_run("chaos, 2 store replicas on PostgreSQL", Database::Postgres, 2).await;
}

/// `make soak`: moderate load without faults for `SOAK_SECONDS` (600); Envoy's
/// and the store's memory after warm-up and at the end must be flat, and no
/// request may fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "ten minutes; run by make soak"]
async fn soak_holds_memory_flat_with_zero_errors() {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let secs = seconds("SOAK_SECONDS", 600);
    let warmup = Duration::from_secs((secs / 10).max(5));
    let stack = Stack::start(Options::new("envoy/chaos.yaml", Database::Sqlite, 1)).await;
    let traffic = Traffic::new(stack.url(""));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let workers: Vec<_> = (0..4)
        .map(|id| {
            tokio::spawn(worker(
                traffic.clone(),
                id,
                deadline,
                u64::MAX,
                Duration::from_millis(20),
                70,
            ))
        })
        .collect();
    let rss = |stack: &Stack| {
        let envoy = stack.envoy.as_ref().and_then(Proc::rss_kib).unwrap_or(0);
        let store = stack.stores[0].proc.as_ref().and_then(Proc::rss_kib).unwrap_or(0);
        (envoy, store)
    };
    tokio::time::sleep(warmup).await;
    let (envoy_warm, store_warm) = rss(&stack);
    join(workers).await;
    let (envoy_end, store_end) = rss(&stack);
    // Where store errors come from, if any: timeouts, resets, health checks.
    let stats = stack
        .admin_text("/stats?filter=^cluster\\.idempotency_store\\.")
        .await;
    let store_stats: Vec<&str> = stats
        .lines()
        .filter(|l| {
            [
                "health_check.failure",
                "upstream_rq_timeout",
                "upstream_cx_destroy_remote_with_active_rq",
                "upstream_cx_connect_fail",
                "upstream_rq_pending_failure_eject",
                "upstream_cx_none_healthy",
            ]
            .iter()
            .any(|s| l.contains(s))
        })
        .collect();
    println!("soak: store cluster: {store_stats:?}");
    let elapsed = started.elapsed().as_secs_f64();
    let mut report = audit(&stack, &traffic).await;
    report.bound_unavailable(&[]);
    let errors = report.transport_errors
        + report
            .by_outcome
            .iter()
            .filter(|(k, _)| k.starts_with('5'))
            .map(|(_, v)| v)
            .sum::<usize>()
        + report.by_outcome.get("store-unavailable").copied().unwrap_or(0);
    let mib = |kib: u64| kib as f64 / 1024.0;
    let memory = format!(
        "Envoy {:.1} → {:.1} MiB, store {:.1} → {:.1} MiB (after {} s warm-up → end)",
        mib(envoy_warm),
        mib(envoy_end),
        mib(store_warm),
        mib(store_end),
        warmup.as_secs()
    );
    println!("soak: {secs} s; {memory}; {errors} errors; {}", report.summary());
    // Flat: at most 20 % plus 8 MiB of growth after warm-up.
    let flat = |warm: u64, end: u64| end <= warm + warm / 5 + 8 * 1024;
    let measured = envoy_warm > 0 && store_warm > 0;
    let memory_flat = flat(envoy_warm, envoy_end) && flat(store_warm, store_end);
    write(&Row {
        run: &format!("soak ({secs} s, release store, not in CI)"),
        load: format!(
            "{secs} s, 4 clients: {} requests ({:.0}/s); {memory}",
            report.requests,
            report.requests as f64 / elapsed
        ),
        faults: "none".into(),
        hostile: report.hostile(),
        fuzz_execs: "—".into(),
        violations: format!("{errors} errors, {} violations", report.total_violations()),
        passed: measured && memory_flat && errors == 0 && report.total_violations() == 0,
        table: "results",
    });
    assert!(measured, "could not read memory");
    assert!(flat(envoy_warm, envoy_end), "Envoy memory grew: {memory}");
    assert!(flat(store_warm, store_end), "store memory grew: {memory}");
    assert_eq!(errors, 0, "{}", report.summary());
    assert_eq!(report.total_violations(), 0, "{}", report.summary());
}

/// A run against a sabotaged stack (8 s of chaos traffic while `during`
/// runs), audited like any other; its row goes to the oracles table.
async fn sabotaged<F, Fut>(name: &str, options: Options, during: F) -> e2e::chaos::Audit
where
    F: FnOnce(Rc<Stack>, Instant) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let stack = Rc::new(Stack::start(options).await);
    let traffic = Traffic::new(stack.url(""));
    let deadline = Instant::now() + Duration::from_secs(8);
    let workers = chaos_workers(&traffic, deadline);
    during(stack.clone(), deadline).await;
    join(workers).await;
    let report = audit(&stack, &traffic).await;
    println!("sabotaged ({name}): {}", report.summary());
    report
}

fn oracle_row(name: &str, sabotage: &str, report: &e2e::chaos::Audit, caught: String, passed: bool) {
    write(&Row {
        run: &format!("oracle: {name} (8 s)"),
        load: format!(
            "8 s, {WORKERS} clients: {} requests, {} upstream executions",
            report.requests, report.executions
        ),
        faults: format!("{sabotage} (sabotage)"),
        hostile: report.hostile(),
        fuzz_execs: "—".into(),
        violations: format!("caught: {caught}"),
        passed,
        table: "oracles",
    });
}

/// The audit must be able to fail: Envoy retrying a covered route on a reset
/// sends a claimed request to the upstream twice behind the filter's back
/// (the reason every bootstrap sets `num_retries: 0`), and the audit has to
/// report the double executions that follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_reports_double_executions_when_envoy_retries_a_covered_route() {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let mut options = Options::new("envoy/chaos.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(|yaml: String| {
        let safe = "retry_policy: {num_retries: 0}";
        assert!(
            yaml.contains(safe),
            "envoy/chaos.yaml no longer disables retries where this test expects"
        );
        yaml.replace(safe, "retry_policy: {retry_on: reset, num_retries: 2}")
    }));
    let report = sabotaged("retry_on: reset", options, |_, _| async {}).await;
    let caught = !report.double_executions.is_empty();
    oracle_row(
        "Envoy retries a covered route on reset",
        "retry_on: reset on the covered route",
        &report,
        format!("{} double executions", report.double_executions.len()),
        caught,
    );
    assert!(
        caught,
        "the audit missed the double executions of a retried route: {}",
        report.summary()
    );
}

/// Failing open while the store stalls forwards duplicates without
/// deduplication: the audit must see them run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_reports_double_executions_when_the_filter_fails_open() {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let mut options = Options::new("envoy/chaos.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(|yaml: String| {
        let lease = "\"lease_seconds\":";
        assert!(yaml.contains(lease), "envoy/chaos.yaml's policies changed shape");
        yaml.replace(lease, &format!("\"failure_mode\": \"open\", {lease}"))
    }));
    // Stalls of three store timeouts each, so that many requests fail open
    // (a shorter stall lets queued calls through once it ends).
    let report = sabotaged("fail-open", options, |stack, deadline| async move {
        while Instant::now() + Duration::from_millis(3_500) < deadline {
            tokio::time::sleep(Duration::from_millis(500)).await;
            stack.signal_store(0, true);
            tokio::time::sleep(Duration::from_millis(3_000)).await;
            stack.signal_store(0, false);
        }
    })
    .await;
    // Failing open runs requests the store never claimed, again for a key
    // executed before: both are the dedupe failing.
    let unclaimed = report
        .violations
        .iter()
        .filter(|v| v.contains("has no claim before it"))
        .count();
    let caught = !report.double_executions.is_empty() || unclaimed > 0;
    oracle_row(
        "the filter fails open while the store stalls",
        "failure_mode: open, store stalls",
        &report,
        format!(
            "{} double executions, {unclaimed} executions without a claim",
            report.double_executions.len()
        ),
        caught,
    );
    assert!(
        caught,
        "the audit missed the double executions of failing open: {}",
        report.summary()
    );
}

/// A filter after idemgate on the response path (before it in the chain)
/// strips `Idempotent-Replayed`: replays reach clients looking like fresh
/// executions, and the audit must notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_reports_replays_stripped_of_their_mark() {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let mut options = Options::new("envoy/chaos.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(|yaml: String| {
        let chain = "http_filters:\n          - name: idemgate";
        assert!(
            yaml.contains(chain),
            "envoy/chaos.yaml's filter chain changed shape"
        );
        yaml.replacen(
            chain,
            "http_filters:
          - name: envoy.filters.http.lua
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_response(handle)
                    handle:headers():remove(\"idempotent-replayed\")
                  end
          - name: idemgate",
            1,
        )
    }));
    let report = sabotaged("Idempotent-Replayed stripped", options, |_, _| async {}).await;
    let unmarked = report
        .violations
        .iter()
        .filter(|v| v.contains("without Idempotent-Replayed"))
        .count();
    oracle_row(
        "replays stripped of Idempotent-Replayed",
        "a Lua filter removes the header from responses",
        &report,
        format!("{unmarked} executions answered unmarked more than once"),
        unmarked > 0,
    );
    assert!(
        unmarked > 0,
        "the audit missed unmarked replays: {}",
        report.summary()
    );
}

/// A store that loses completed records lets retries run again: the audit
/// must see the double executions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_reports_double_executions_when_the_store_loses_completions() {
    let _one = crate::ONE_AT_A_TIME.lock().await;
    let options = Options::new("envoy/chaos.yaml", Database::Sqlite, 1);
    let report = sabotaged("completions lost", options, |stack, deadline| async move {
        let path = stack.database_url.trim_start_matches("sqlite://").to_string();
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                let db = rusqlite::Connection::open(path).unwrap();
                db.busy_timeout(Duration::from_secs(2)).unwrap();
                db.execute("DELETE FROM idempotency_records WHERE state = 'completed'", [])
                    .unwrap();
            })
            .await
            .unwrap();
        }
    })
    .await;
    let caught = !report.double_executions.is_empty();
    oracle_row(
        "the store loses completed records",
        "completed records deleted every 300 ms",
        &report,
        format!(
            "{} double executions, {} other violations",
            report.double_executions.len(),
            report.violations.len()
        ),
        caught,
    );
    assert!(
        caught,
        "the audit missed re-executions after lost completions: {}",
        report.summary()
    );
}
