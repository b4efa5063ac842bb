//! The store's statements on PostgreSQL, whatever the planner estimates:
//! none is compiled by JIT, and no statement of a sweeper pass reads a
//! table whole. Read from `pg_stat_statements`, on a cluster that compiles
//! every statement it may.

use std::sync::Arc;

use idemgate_core::protocol::ClaimReply;
use idemgate_store::backend::{Backend, SweepPolicy};
use idemgate_store::sealing::Seal;
use idemgate_store::sweeper::SweepSettings;
use idemgate_store::{Clock, Store};

use crate::support::pgbouncer::{PgBouncer, PoolMode};
use crate::support::*;

const NOW: i64 = 1_800_000_000_000;
const DAY: i64 = 86_400_000;
/// The statements `pg_stat_statements` counted on the store's tables, not
/// the test's own reads of it.
const ON_THE_STORE: &str = "query LIKE '%idempotency_%' AND query NOT LIKE '%pg_stat_statements%'";

/// A cluster that counts each statement's work and JIT-compiles every
/// statement that has anything to compile (a cost above 0), and a fresh
/// database on it that counts from now; `None` (said on standard error)
/// when this PostgreSQL has no JIT.
async fn counting_cluster() -> Option<(pg::PgCluster, String)> {
    let cluster = pg::PgCluster::start_with(&[
        ("shared_preload_libraries", "pg_stat_statements"),
        ("jit_above_cost", "0"),
    ]);
    if cluster.query("SELECT pg_jit_available()") != "t" {
        eprintln!("skipped: this PostgreSQL has no JIT (its llvmjit library is not installed)");
        return None;
    }
    let url = cluster.fresh_database().await;
    let db = url.rsplit('/').next().unwrap_or_default().to_owned();
    cluster.query_in(&db, "CREATE EXTENSION pg_stat_statements");
    Some((cluster, db))
}

/// Claims a key, completes it, replays it, and runs a sweeper pass.
async fn exchange(b: Arc<dyn Backend>, key: &str) {
    let store = Store::new(b.clone(), Clock::manual(NOW));
    let s = scope(key);
    let fence = match store.claim(&claim(&s, Some(1))).await.unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("expected Owned, got {other:?}"),
    };
    store.complete(&complete(&s, fence, 201), b"done").await.unwrap();
    let replay = store.claim(&claim(&s, Some(1))).await.unwrap().reply;
    assert!(
        matches!(replay, ClaimReply::Replay { status: 201, .. }),
        "{replay:?}"
    );
    b.sweep(NOW, &SweepSettings::default().policy()).await.unwrap();
}

/// The statements on the store's tables that were JIT-compiled.
fn compiled(cluster: &pg::PgCluster, db: &str) -> String {
    cluster.query_in(
        db,
        &format!(
            "SELECT string_agg(left(query, 160), E'\\n') FROM pg_stat_statements \
             WHERE jit_functions > 0 AND {ON_THE_STORE}"
        ),
    )
}

/// The server compiles a statement when its estimated cost is high, which
/// for a sweeper's pick that expects few rows is its whole index range;
/// under load the compiling alone took longer than the statement timeout.
/// The store turns JIT off for its sessions, and behind a transaction
/// pooler for each transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_statement_of_the_store_is_jit_compiled() {
    let Some((cluster, db)) = counting_cluster().await else {
        return;
    };
    let b = pg_backend(&cluster.url(&db)).await;
    // This cluster compiles what anyone else sends.
    cluster.query_in(&db, "SELECT count(*) FROM idempotency_records");
    assert_ne!(compiled(&cluster, &db), "", "the cluster compiled nothing");
    cluster.query_in(&db, "SELECT pg_stat_statements_reset()");

    exchange(b, "k-jit-session").await;
    assert_eq!(
        compiled(&cluster, &db),
        "",
        "compiled in the store's own sessions"
    );

    let Some(bouncer) = PgBouncer::start(&cluster, PoolMode::Transaction, 4, &[]) else {
        eprintln!("skipped behind PgBouncer: it is not installed (scripts/setup.sh installs it; or set PGBOUNCER_BIN)");
        return;
    };
    exchange(
        bounced_backend(&bouncer.url(&db), Seal::off()).await,
        "k-jit-pooler",
    )
    .await;
    assert_eq!(
        compiled(&cluster, &db),
        "",
        "compiled behind a transaction pooler"
    );
}

/// Events past the audit retention that lie at the end of the table, while
/// the planner's statistics say a share of the table is due: a sweeper pass
/// takes a batch of them through the index on their time, not from a
/// sequential scan that expected to meet them early and reads the whole
/// table instead (on a large store, past the statement timeout on every
/// pass, so the pass never committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeper_pass_reads_no_table_whole() {
    let Some((cluster, db)) = counting_cluster().await else {
        return;
    };
    let b = pg_backend(&cluster.url(&db)).await;
    // 200,000 recent events in random time order, then 10,000 past the
    // retention, written last.
    let events = |count: u32, at: String| {
        format!(
            "INSERT INTO idempotency_events (generation, at, transition, fence, status, actor, duration_ms) \
             SELECT i, {at}, 'completed', i, 201, 'filter', 3 FROM generate_series(1, {count}) i"
        )
    };
    cluster.query_in(
        &db,
        &events(200_000, format!("{NOW} - (random() * {DAY})::bigint")),
    );
    cluster.query_in(&db, &events(10_000, format!("{} + i", NOW - 40 * DAY)));
    cluster.query_in(&db, "ANALYZE idempotency_events");
    let pages: u64 = cluster
        .query_in(
            &db,
            "SELECT relpages FROM pg_class WHERE relname = 'idempotency_events'",
        )
        .parse()
        .unwrap();
    cluster.query_in(&db, "SELECT pg_stat_statements_reset()");

    // A small batch: each of its rows costs a few page reads of its own.
    let policy = SweepPolicy {
        batch: 100,
        audit_retention_ms: 30 * DAY as u64,
    };
    let report = b.sweep(NOW, &policy).await.unwrap();
    assert_eq!(report.events_purged, 100, "{report:?}");

    let read = cluster.query_in(
        &db,
        &format!(
            "SELECT coalesce(string_agg((shared_blks_hit + shared_blks_read) / calls || ' ' || query, E'\\n'), '') \
             FROM pg_stat_statements WHERE {ON_THE_STORE}"
        ),
    );
    for line in read.lines() {
        let (blocks, query) = line.split_once(' ').unwrap();
        let blocks: u64 = blocks.parse().unwrap();
        assert!(
            blocks < pages / 4,
            "{blocks} pages read (the events take {pages}) by {query}"
        );
    }
}
