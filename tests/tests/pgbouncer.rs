//! The chaos traffic through Envoy with the stores behind a real PgBouncer
//! 1.18 in transaction mode (`--pg-pooler transaction`): two store
//! replicas, fewer server connections than store connections, and mid-run
//! PgBouncer killed and restarted (every client and server connection
//! dropped at once), then a store replica SIGKILLed and restarted. Then the
//! chaos audit: double executions, executions without a claim, burnt keys,
//! every answer against the contract, and 503s only near the faults.
//! `make chaos` runs it (`--ignored`); without PgBouncer it is skipped, with
//! its reason, and its row says so.

// Test support: failing loudly is how a helper reports a broken run.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::chaos::{at_full_speed, audit, now_ms, Traffic};
use e2e::report::{write, Row};
use e2e::stack::{Database, Options, Stack};
use idemgate_testkit::pg::PgCluster;
use idemgate_testkit::pgbouncer::{PgBouncer, PoolMode};

const RUN: &str = "chaos through PgBouncer (transaction mode), 2 store replicas";
const WORKERS: u64 = 12;
const TRAFFIC: Duration = Duration::from_secs(20);
const BOUNCER_RESTART_AT: Duration = Duration::from_secs(5);
const STORE_KILL_AT: Duration = Duration::from_secs(11);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a `make chaos` run: about half a minute"]
async fn chaos_through_pgbouncer_in_transaction_mode() {
    let faults = "PgBouncer SIGKILLed and restarted, a store replica SIGKILLed and restarted";
    let cluster = PgCluster::start();
    let Some(mut bouncer) = PgBouncer::start(&cluster, PoolMode::Transaction, 8, &[]) else {
        return idemgate_testkit::report::verdict(RUN, "—", faults)
            .skip("PgBouncer is not installed (scripts/setup.sh installs it; or set PGBOUNCER_BIN)");
    };
    let mut options = Options::new("envoy/chaos.yaml", Database::Url(bouncer.url("postgres")), 2);
    options.store_args = vec!["--pg-pooler".into(), "transaction".into()];
    let mut stack = Stack::start(options).await;
    let traffic = Traffic::new(stack.url(""));
    let started = Instant::now();
    let workers = at_full_speed(&traffic, WORKERS, started + TRAFFIC);

    tokio::time::sleep_until((started + BOUNCER_RESTART_AT).into()).await;
    let bouncer_at = now_ms();
    tokio::task::block_in_place(|| bouncer.restart());
    let bouncer_back = now_ms();
    tokio::time::sleep_until((started + STORE_KILL_AT).into()).await;
    let store_at = now_ms();
    stack.kill_store(0);
    stack.start_store(0);
    stack.wait_store(0).await;
    let store_back = now_ms();
    for w in workers {
        w.await.unwrap_or_else(|e| panic!("a worker failed: {e}"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    stack.wait_envoy().await;
    let mut report = audit(&stack, &traffic).await;
    report.bound_unavailable(&[
        ("PgBouncer restart", bouncer_at, bouncer_back),
        ("store kill", store_at, store_back),
    ]);
    let unavailable = traffic.store_unavailable();
    let window = format!(
        "PgBouncer back {} ms after its kill, the store replica ready {} ms after its kill; \
         {unavailable} answers 503 store-unavailable",
        bouncer_back - bouncer_at,
        store_back - store_at
    );
    println!("{RUN}: {window}; {}", report.summary());
    let passed = report.total_violations() == 0 && report.executions > 0 && report.replays_checked > 0;
    write(&Row {
        run: &format!("{RUN} ({} s)", TRAFFIC.as_secs()),
        load: report.load(
            TRAFFIC,
            WORKERS,
            "2 store replicas, 8 server connections",
            elapsed,
        ),
        faults: format!("{faults}: {window}"),
        hostile: report.hostile(),
        fuzz_execs: "—".into(),
        violations: report.verdict(),
        passed,
        table: "results",
    });
    assert!(
        passed,
        "{window}\n{}\nPgBouncer:\n{}",
        report.summary(),
        bouncer.log()
    );
}
