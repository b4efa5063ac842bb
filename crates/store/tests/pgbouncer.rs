//! The store behind PgBouncer 1.18 in transaction mode, and why it needs
//! `--pg-pooler transaction` there: its session setup (`statement_timeout`
//! in the startup `options`) is refused, and statements prepared by name
//! meet other sessions' statements on shared server connections. (The
//! story suite runs through PgBouncer too: `stories::pgbouncer`.)

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::protocol::ClaimReply;
use idemgate_store::backend::Backend;
use idemgate_store::postgres::{PgSession, PgTimeouts, Pooler, Postgres};
use idemgate_store::sealing::Seal;
use idemgate_store::{Clock, Store};

use crate::support::pgbouncer::{PgBouncer, PoolMode};
use crate::support::*;

fn backend(url: &str, pooler: Pooler, timeouts: PgTimeouts) -> Arc<dyn Backend> {
    let session = PgSession {
        pooler,
        read_only: false,
    };
    let log_ids = idemgate_store::log_ids::LogIds::random().unwrap();
    Arc::new(Postgres::connect_with(url, 8, timeouts, session, log_ids, Seal::off()).unwrap())
}

/// `idempotency-store ARGS` on `url`: success and standard error.
fn store(url: &str, args: &[&str]) -> (bool, String) {
    let (ok, _, err) = store_out(url, args);
    (ok, err)
}

/// `idempotency-store ARGS` on `url`, as an operator runs it (the pooler
/// only as `args` name it): success, standard output and error.
fn store_out(url: &str, args: &[&str]) -> (bool, String, String) {
    idemgate_testkit::store::run(Path::new(env!("CARGO_BIN_EXE_idempotency-store")), url, args)
}

macro_rules! bouncer_or_skip {
    ($cluster:expr, $mode:expr, $size:expr, $ignore:expr) => {
        match PgBouncer::start($cluster, $mode, $size, $ignore) {
            Some(b) => b,
            None => {
                eprintln!("skipped: PgBouncer is not installed (scripts/setup.sh installs it; or set PGBOUNCER_BIN)");
                return;
            }
        }
    };
}

/// PgBouncer refuses the `options` startup parameter that carries the
/// store's `statement_timeout`: without `--pg-pooler transaction` the
/// store cannot even connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_setup_is_refused_and_the_transaction_setup_serves() {
    let cluster = pg::PgCluster::start();
    let bouncer = bouncer_or_skip!(&cluster, PoolMode::Transaction, 2, &[]);
    let url = bouncer.url("postgres");

    let refused = backend(&url, Pooler::Session, PgTimeouts::default())
        .migrate()
        .await;
    let err = refused
        .expect_err("a session setup through PgBouncer connected")
        .to_string();
    assert!(err.contains("unsupported startup parameter: options"), "{err}");

    // The binary, set up for the pooler: migrates, then serves claims.
    let (ok, err) = store(&url, &["--pg-pooler", "transaction", "migrate"]);
    assert!(ok, "migrate through PgBouncer: {err}");
    let mut served = StoreProcess::start_with(&url, "warn", |cmd| {
        cmd.env_remove("IDEMGATE_MIGRATE")
            .env("IDEMGATE_PG_POOLER", "transaction");
    })
    .await;
    let c = client();
    let s = scope("k-bounced");
    let (reply, _) = claim_over_http(&c, &served, &claim(&s, Some(1))).await;
    let ClaimReply::Owned { fence } = reply else {
        panic!("expected Owned, got {reply:?}");
    };
    let (status, _) = http_complete(&c, &served, &s, fence, b"paid").await;
    assert_eq!(status, 200, "{}", served.log());
    let (replay, body) = claim_over_http(&c, &served, &claim(&s, Some(1))).await;
    assert!(matches!(replay, ClaimReply::Replay { .. }), "{replay:?}");
    assert_eq!(body, b"paid");
    served.kill9();

    // `inspect` through PgBouncer: its transactions begin READ ONLY, and
    // the cluster's next transaction id does not move.
    let before = cluster.next_xid();
    let (ok, out, err) = store_out(
        &url,
        &[
            "--pg-pooler",
            "transaction",
            "inspect",
            "--tenant",
            "acme",
            "--key",
            "k-bounced",
        ],
    );
    assert!(ok, "inspect through PgBouncer: {err}");
    let history: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(history["records"][0]["state"], "completed", "{out}");
    assert_eq!(cluster.next_xid(), before, "inspect wrote");
}

/// With `options` let through (ignored), named prepared statements still
/// fail: a server connection keeps the statements one client prepared on
/// it, and the next process's first statement has the same name (`s0`).
/// One server connection makes it certain. Unnamed statements never meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_statements_collide_on_a_shared_server_connection_and_unnamed_ones_do_not() {
    let cluster = pg::PgCluster::start();
    let bouncer = bouncer_or_skip!(&cluster, PoolMode::Transaction, 1, &["options"]);
    let url = bouncer.url("postgres");
    let (ok, err) = store(&url, &["--pg-pooler", "transaction", "migrate"]);
    assert!(ok, "{err}");

    for run in 0..3 {
        let (ok, err) = store(&url, &["--pg-pooler", "transaction", "sweep"]);
        assert!(ok, "sweep {run} with unnamed statements: {err}");
    }
    let (ok, err) = store(&url, &["--pg-pooler", "session", "sweep"]);
    assert!(ok, "the first process with named statements: {err}");
    let (ok, err) = store(&url, &["--pg-pooler", "session", "sweep"]);
    assert!(
        !ok && err.contains("prepared statement \"s0\" already exists"),
        "{err}"
    );
    // The leftovers are no trouble for unnamed statements.
    let (ok, err) = store(&url, &["--pg-pooler", "transaction", "sweep"]);
    assert!(ok, "{err}");
}

/// Behind the pooler each transaction sets its own `statement_timeout`
/// (`SET LOCAL`): a statement stuck behind a lock is cancelled by the
/// server after it, not left to the store's own call bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_transaction_bounds_its_statements() {
    let cluster = Arc::new(pg::PgCluster::start());
    let bouncer = bouncer_or_skip!(&cluster, PoolMode::Transaction, 4, &[]);
    let timeouts = PgTimeouts {
        statement: Duration::from_millis(200),
        ..PgTimeouts::default()
    };
    let b = backend(&bouncer.url("postgres"), Pooler::Transaction, timeouts);
    b.migrate().await.unwrap();
    let store = Store::new(b.clone(), Clock::manual(1_800_000_000_000));
    let s = scope("k-locked");
    let fence = match store.claim(&claim(&s, Some(1))).await.unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("expected Owned, got {other:?}"),
    };
    // Another session holds the record's row lock for 3 s.
    let holder = {
        let cluster = Arc::clone(&cluster);
        std::thread::spawn(move || {
            cluster.query("BEGIN; SELECT 1 FROM idempotency_records FOR UPDATE; SELECT pg_sleep(3); COMMIT")
        })
    };
    let locked = (0..300).any(|_| {
        cluster.query("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(3)%' AND pid <> pg_backend_pid()")
            != "0"
            || {
                std::thread::sleep(Duration::from_millis(10));
                false
            }
    });
    assert!(locked, "the lock holder never started");
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let err = store
        .complete(&complete(&s, fence, 201), b"late")
        .await
        .expect_err("a completion waited out the lock");
    let took = started.elapsed();
    assert!(err.to_string().contains("statement timeout"), "{err}");
    assert!(
        took < timeouts.call(),
        "cancelled after {took:?}, not by the server"
    );
    holder.join().unwrap();
}

/// A switchover behind PgBouncer in transaction mode: the primary stops
/// cleanly, its standby is promoted, and the former primary comes back as a
/// standby of it on the same port. PgBouncer keeps the store's connections
/// open and hands them server connections to the demoted server, where
/// every write is refused. Those pooled connections are dropped, not reused:
/// the next claim opens a new one, which passes the demoted server over and
/// lands on the new primary, the URL's second host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_a_demoted_primary_are_dropped_for_the_next_host() {
    let a = pg::PgCluster::start();
    let direct = a.fresh_database().await;
    let db = direct.rsplit('/').next().unwrap().to_string();
    let bouncer = bouncer_or_skip!(&a, PoolMode::Transaction, 2, &[]);
    let b = tokio::task::block_in_place(|| pg::PgCluster::standby_of(&a, &[]));
    let url = format!(
        "postgres://idem@127.0.0.1:{},127.0.0.1:{}/{db}?target_session_attrs=read-write",
        bouncer.port, b.port
    );
    let store = backend(&url, Pooler::Transaction, PgTimeouts::default());
    store.migrate().await.unwrap();
    let store = Store::new(store, Clock::System);
    let s = scope("k-before-switchover");
    let fence = match store.claim(&claim(&s, Some(1))).await.unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("expected Owned, got {other:?}"),
    };
    store.complete(&complete(&s, fence, 201), b"paid").await.unwrap();

    tokio::task::block_in_place(|| {
        a.stop();
        b.promote();
        a.follow(&b);
    });
    assert_eq!(a.query("SELECT pg_is_in_recovery()"), "t");

    let s = scope("k-after-switchover");
    let started = Instant::now();
    let mut refused = 0;
    let fence = loop {
        match store.claim(&claim(&s, Some(1))).await {
            Ok(outcome) => match outcome.reply {
                ClaimReply::Owned { fence } => break fence,
                other => panic!("a fresh key was answered {other:?}"),
            },
            Err(e) => {
                refused += 1;
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "still refused after {refused} claims in {:?}: {e}",
                    started.elapsed()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "after the switchover: claimed after {refused} refusals, {:?}",
        started.elapsed()
    );
    store.complete(&complete(&s, fence, 201), b"paid").await.unwrap();
    assert_eq!(
        b.query_in(
            &db,
            "SELECT count(*) FROM idempotency_records WHERE response_status = 201"
        ),
        "2"
    );
}
