//! The sweeper's phases stand alone: a damaged record is left as it is and
//! the rest of its batch is swept; a phase that fails is rolled back alone,
//! and leases still run out and records still expire meanwhile.

use std::sync::Arc;

use idemgate_core::protocol::ClaimReply;
use idemgate_store::backend::{Backend, SweepPolicy, SweepReport};
use idemgate_store::{Clock, Store};

use crate::support::*;

const T0: i64 = 1_800_000_000_000;

/// How each backend spells the damage and the refusal.
struct Sql {
    /// A fingerprint no store writes, for the record of key `k-damaged`.
    damage: &'static str,
    /// Every delete of an event refused, which fails the purge phase.
    refuse_purges: &'static str,
    allow_purges: &'static str,
}

const SQLITE: Sql = Sql {
    // 32 characters of text: the CHECK counts them as the 32 bytes a
    // fingerprint takes, but a fingerprint is stored as bytes, never text.
    damage: "UPDATE idempotency_records SET fingerprint = 'abcdefghijklmnopqrstuvwxyz012345' \
             WHERE idem_key = 'k-damaged'",
    refuse_purges: "CREATE TRIGGER refuse_purges BEFORE DELETE ON idempotency_events \
                    BEGIN SELECT RAISE(ABORT, 'events are kept'); END",
    allow_purges: "DROP TRIGGER refuse_purges",
};

const POSTGRES: Sql = Sql {
    damage: "UPDATE idempotency_records SET fingerprint = repeat('z', 64) WHERE idem_key = 'k-damaged'",
    refuse_purges: "CREATE FUNCTION refuse_purges() RETURNS trigger LANGUAGE plpgsql AS \
                    $$ BEGIN RAISE EXCEPTION 'events are kept'; END $$; \
                    CREATE TRIGGER refuse_purges BEFORE DELETE ON idempotency_events \
                    FOR EACH ROW EXECUTE FUNCTION refuse_purges()",
    allow_purges: "DROP TRIGGER refuse_purges ON idempotency_events",
};

async fn owned(store: &Store, key: &str) -> u64 {
    match store.claim(&claim(&scope(key), Some(1))).await.unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("{key}: {other:?}"),
    }
}

async fn sweep(b: &dyn Backend, now: i64, audit_retention_ms: u64) -> SweepReport {
    let policy = SweepPolicy {
        batch: 100,
        audit_retention_ms,
    };
    b.sweep(now, &policy).await.unwrap()
}

/// The reply a retry of `key` gets now.
async fn retried(store: &Store, key: &str) -> ClaimReply {
    store.claim(&claim(&scope(key), Some(1))).await.unwrap().reply
}

async fn phases_stand_alone(b: Arc<dyn Backend>, sql: Sql, run: impl Fn(&str)) {
    let clock = Clock::manual(T0);
    let store = Store::new(b.clone(), clock.clone());
    owned(&store, "k-lease").await;
    for key in ["k-damaged", "k-expired"] {
        let f = owned(&store, key).await;
        store
            .complete(&complete(&scope(key), f, 201), b"{}")
            .await
            .unwrap();
    }
    run(sql.damage);
    // Past the lease (1 s) and the completed records' expiry (10 s).
    clock.advance(11_000);
    let report = sweep(b.as_ref(), clock.now(), u64::MAX / 4).await;
    assert_eq!(
        (
            report.marked_unknown,
            report.archived,
            report.unreadable,
            report.failed_phases
        ),
        (1, 1, 1, 0),
        "{report:?}"
    );
    assert!(matches!(retried(&store, "k-lease").await, ClaimReply::Unknown));
    assert!(matches!(
        retried(&store, "k-expired").await,
        ClaimReply::Expired { .. }
    ));
    // Left as it is: met again, and still not archived.
    let again = sweep(b.as_ref(), clock.now(), u64::MAX / 4).await;
    assert_eq!((again.archived, again.unreadable), (0, 1), "{again:?}");

    // A phase that fails on every pass: the purge of what is past the
    // retention (k-expired's archived generation and its events).
    run(sql.refuse_purges);
    owned(&store, "k-lease-2").await;
    clock.advance(2_000);
    let metrics = &store.metrics;
    let errors = metrics.sweeper_errors.get();
    let policy = SweepPolicy {
        batch: 100,
        audit_retention_ms: 1_000,
    };
    let report = idemgate_store::sweeper::sweep_all(&store, &policy).await.unwrap();
    assert_eq!(
        (report.marked_unknown, report.purged, report.failed_phases),
        (1, 0, 1),
        "{report:?}"
    );
    assert!(matches!(retried(&store, "k-lease-2").await, ClaimReply::Unknown));
    assert_eq!(
        metrics.sweeper_errors.get(),
        errors + 1,
        "a pass with a failed phase is an error"
    );
    assert_eq!(metrics.sweeper_last_success.get(), 0.0, "and no success");
    assert!(
        matches!(retried(&store, "k-expired").await, ClaimReply::Expired { .. }),
        "not purged"
    );

    run(sql.allow_purges);
    let report = sweep(b.as_ref(), clock.now(), 1_000).await;
    assert_eq!(
        (report.failed_phases, report.purged >= 1),
        (0, true),
        "{report:?}"
    );
    assert!(
        matches!(retried(&store, "k-expired").await, ClaimReply::Owned { .. }),
        "purged: the key is free"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_stand_alone_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let b = sqlite_backend(&dir).await;
    let conn = rusqlite::Connection::open(dir.path().join("store.db")).unwrap();
    conn.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    phases_stand_alone(b, SQLITE, |sql| conn.execute_batch(sql).unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_stand_alone_on_postgres() {
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let db = url.rsplit('/').next().unwrap().to_string();
    let b = pg_backend(&url).await;
    phases_stand_alone(b, POSTGRES, |sql| drop(cluster.query_in(&db, sql))).await;
}

/// Savepoints behind a transaction pooler: the batch is one transaction,
/// so its savepoints stay on one server connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_stand_alone_through_pgbouncer() {
    let Some(bounced) = shared_bouncer() else {
        return;
    };
    let url = bounced.fresh_database().await;
    let db = url.rsplit('/').next().unwrap().to_string();
    let b = bounced_backend(&url, idemgate_store::sealing::Seal::off()).await;
    phases_stand_alone(b, POSTGRES, |sql| drop(bounced.cluster.query_in(&db, sql))).await;
}
