//! Existing databases migrate in place: a database at schema version 2
//! (records keyed by their six scope columns), with rows as that version
//! wrote them, is migrated by the current store, which then finds every
//! record by its scope's digest, replays, completes, sweeps, and shows the
//! earlier generations and events to operators (an event whose generation
//! was purged before it among them). Written once, run on both
//! backends. A row whose state, transition or actor no store writes is
//! refused as corrupt.

use std::sync::Arc;

use idemgate_core::protocol::{Attempt, ClaimReply, FenceReply};
use idemgate_store::backend::{Backend, Lookup, StoreError, SweepPolicy};
use idemgate_store::database_url::{open_backend, BackendOptions};
use idemgate_store::{Clock, Store};

use crate::support::*;

mod checks;
mod schema;

const T0: i64 = 1_800_000_000_000;
const FAR: i64 = T0 + 1_000_000_000;

/// Rows the store wrote at schema version 2, with `{b}` standing for a
/// boolean (`0`/`1` or `false`/`true`) and `{blob}` for a byte string.
const ROWS: &str = "
INSERT INTO idempotency_records (scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint,
    fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, response_body, body_stored,
    created_at, completed_at, expires_at, archived_at, replay_count, generation, attempt) VALUES
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 'completed', '{fp}', 5, {t1}, 10000, {false}, 201,
   '[[\"content-type\",\"application/json\"]]', {blob}, {true}, {t0}, {t1}, {far}, NULL, 2, 5, '{filter}-5'),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-open', 'in_progress', NULL, 6, {far}, 10000, {false}, NULL,
   NULL, NULL, {false}, {t0}, NULL, NULL, NULL, 0, 6, NULL),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-abandoned', 'in_progress', NULL, 7, {far}, 10000, {false},
   NULL, NULL, NULL, {false}, {t0}, NULL, NULL, NULL, 0, 7, '{filter}-7');
INSERT INTO idempotency_history (scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint,
    fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, response_body, body_stored,
    created_at, completed_at, expires_at, archived_at, replay_count, generation, attempt, ended_at) VALUES
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 'released', '{fp}', 3, {t0}, 10000, {false}, NULL, NULL,
   NULL, {false}, {t0}, NULL, NULL, NULL, 0, 3, '{filter}-3', {t0});
INSERT INTO idempotency_events (scope_version, tenant, principal, route, namespace, idem_key, generation, at,
    transition, attempt, fence, fingerprint, status, actor, detail, duration_ms) VALUES
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 2, {t0}, 'claimed', '{filter}-2', 2, '{fp}', NULL, 'filter', NULL, 0),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 3, {t0}, 'claimed', NULL, 3, NULL, NULL, 'filter', NULL, 0),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 3, {t0}, 'resolved', NULL, 3, NULL, NULL, 'operator', 'release', 0),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 5, {t0}, 'claimed', NULL, 5, NULL, NULL, 'filter', NULL, 0),
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-done', 5, {t1}, 'completed', NULL, 5, NULL, 201, 'filter', NULL, 1);
INSERT INTO idempotency_abandoned (scope_version, tenant, principal, route, namespace, idem_key, attempt, at) VALUES
  ('v1', 'acme', 'alice', 'payments.create', 'u', 'k-abandoned', '{filter}-7', {t0});
";

fn rows(t: &str, f: &str, blob: &str) -> String {
    ROWS.replace("{true}", t)
        .replace("{false}", f)
        .replace("{blob}", blob)
        .replace("{t0}", &T0.to_string())
        .replace("{t1}", &(T0 + 1).to_string())
        .replace("{far}", &FAR.to_string())
        .replace("{fp}", &fp(1).to_hex())
        .replace("{filter}", FILTER_ATTEMPTS)
}

/// The prefix of the attempt ids a filter draws (then `-` and a counter).
const FILTER_ATTEMPTS: &str = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e";

fn filter_attempt(n: u64) -> Option<String> {
    Some(format!("{FILTER_ATTEMPTS}-{n:x}"))
}

/// The current store on a database it did not create.
async fn migrated(url: &str) -> Arc<dyn Backend> {
    let b = open_backend(url, &BackendOptions::default()).await.unwrap();
    b.migrate().await.unwrap();
    // Migrating again changes nothing.
    b.migrate().await.unwrap();
    b
}

async fn everything_survives_the_migration(b: Arc<dyn Backend>) {
    let clock = Clock::manual(T0 + 10);
    let store = Store::new(b.clone(), clock.clone());
    // Found by digest: the completed record replays with its stored response,
    // to the same fingerprint only.
    let mismatch = store.claim(&claim(&scope("k-done"), Some(2))).await.unwrap();
    assert!(
        matches!(mismatch.reply, ClaimReply::Mismatch),
        "{:?}",
        mismatch.reply
    );
    let out = store.claim(&claim(&scope("k-done"), Some(1))).await.unwrap();
    assert!(
        matches!(out.reply, ClaimReply::Replay { status: 201, .. }),
        "{:?}",
        out.reply
    );
    assert_eq!(out.body, b"old");
    // The open record is still open, and its owner completes it.
    let open = scope("k-open");
    assert!(matches!(
        store.claim(&claim(&open, None)).await.unwrap().reply,
        ClaimReply::InProgress { .. }
    ));
    assert_eq!(
        store.complete(&complete(&open, 6, 200), b"new").await.unwrap(),
        FenceReply::Done
    );
    assert_eq!(store.claim(&claim(&open, None)).await.unwrap().body, b"new");
    // The abandoned attempt that landed is released by the sweeper.
    let report = b
        .sweep(
            clock.now(),
            &SweepPolicy {
                batch: 100,
                audit_retention_ms: u64::MAX / 4,
            },
        )
        .await
        .unwrap();
    assert_eq!(report.abandoned, 1, "{report:?}");
    let mut again = claim(&scope("k-abandoned"), None);
    again.attempt = Some(Attempt::try_from("a2".to_string()).unwrap());
    // Fences keep growing from where the old schema left them.
    match store.claim(&again).await.unwrap().reply {
        ClaimReply::Owned { fence } => assert!(fence > 7, "{fence}"),
        other => panic!("{other:?}"),
    }
    // Operators see every generation and event, old and new.
    let h = b
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-done".into(),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    let gens: Vec<(u64, &str)> = h
        .records
        .iter()
        .map(|r| (r.generation, r.state.as_str()))
        .collect();
    assert_eq!(gens, [(5, "completed"), (3, "released")]);
    assert_eq!(h.records[0].replay_count, 3, "two counted before, one since");
    let kept: Vec<_> = (h.records.iter())
        .map(|r| (r.fingerprint.clone(), r.attempt.clone()))
        .collect();
    assert_eq!(
        kept,
        [
            (Some(fp(1).to_hex()), filter_attempt(5)),
            (Some(fp(1).to_hex()), filter_attempt(3))
        ]
    );
    let events: Vec<(&str, u64, &str)> = (h.events.iter())
        .map(|e| (e.transition.as_str(), e.generation, e.actor.as_str()))
        .collect();
    assert_eq!(
        events,
        [
            ("claimed", 2, "filter"),
            ("claimed", 3, "filter"),
            ("resolved", 3, "operator"),
            ("claimed", 5, "filter"),
            ("completed", 5, "filter")
        ]
    );
    // An event whose generation was purged before it keeps its scope and attempt.
    assert_eq!(h.events[0].scope, scope("k-done"));
    assert_eq!(h.events[0].attempt, filter_attempt(2));
    assert_eq!(h.events[0].fingerprint, Some(fp(1).to_hex()));
    // A new key is claimed as usual, and a second claim of it finds it.
    let fresh = scope("k-fresh");
    assert!(matches!(
        store.claim(&claim(&fresh, None)).await.unwrap().reply,
        ClaimReply::Owned { .. }
    ));
    assert!(matches!(
        store.claim(&claim(&fresh, None)).await.unwrap().reply,
        ClaimReply::InProgress { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_database_migrates_in_place_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(concat!(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL);",
            include_str!("../src/sqlite/migrations/0001_records.sql"),
            include_str!("../src/sqlite/migrations/0002_generations.sql"),
            "INSERT INTO schema_migrations VALUES (1, 0), (2, 0);",
            "UPDATE idempotency_fence SET value = 7;"
        ))
        .unwrap();
        conn.execute_batch(&rows("1", "0", "X'6F6C64'")).unwrap();
    }
    let b = migrated(&format!("sqlite://{}", path.display())).await;
    everything_survives_the_migration(b).await;
    // Kept as bytes: the fingerprints, and the filter's attempt ids.
    let conn = rusqlite::Connection::open(&path).unwrap();
    let kinds = |sql: &str| -> Vec<String> {
        let mut stmt = conn.prepare(sql).unwrap();
        let rows = stmt.query_map([], |r| r.get::<_, String>(0)).unwrap();
        rows.map(Result::unwrap).collect()
    };
    for table in [
        "idempotency_records",
        "idempotency_history",
        "idempotency_purged_generations",
    ] {
        let sql = format!(
            "SELECT typeof(fingerprint) || ' ' || typeof(attempt) FROM {table} WHERE fingerprint IS NOT NULL"
        );
        assert_eq!(kinds(&sql), ["blob blob"], "{table}");
    }
    let sql = "SELECT typeof(attempt) FROM idempotency_records WHERE attempt IS NOT NULL ORDER BY fence";
    assert_eq!(
        kinds(sql),
        ["blob", "text"],
        "k-done's, then the id a2 of k-abandoned's new claim"
    );
}

/// SQLite keeps records in the order they were claimed (0007: a rowid
/// table), not in their digests' random order: the rows that a batch of
/// completions or a sweep writes share pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_records_in_the_order_they_were_claimed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let store = Store::new(
        migrated(&format!("sqlite://{}", path.display())).await,
        Clock::manual(T0),
    );
    let keys = ["k-3", "k-1", "k-4", "k-2", "k-5"];
    for key in keys {
        store.claim(&claim(&scope(key), Some(1))).await.unwrap();
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mut stmt = conn
        .prepare("SELECT idem_key FROM idempotency_records ORDER BY rowid")
        .unwrap();
    let order: Vec<String> = stmt
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(order, keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_database_migrates_in_place_on_postgres() {
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    db.batch_execute(concat!(
        "CREATE TABLE idempotency_schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL);",
        include_str!("../src/postgres/migrations/0001_records.sql"),
        include_str!("../src/postgres/migrations/0002_generations.sql"),
        "INSERT INTO idempotency_schema_migrations VALUES (1, 0), (2, 0);",
        "SELECT setval('idempotency_fence_seq', 7);"
    ))
    .await
    .unwrap();
    db.batch_execute(&rows("true", "false", "'\\x6f6c64'::bytea"))
        .await
        .unwrap();
    drop(db);
    let _ = task.await;
    let b = migrated(&url).await;
    everything_survives_the_migration(b).await;
}

/// Runs `sql` on the database of `url`, as an operator would.
async fn execute(url: &str, sql: &str) {
    match url.strip_prefix("sqlite://") {
        Some(path) => rusqlite::Connection::open(path)
            .unwrap()
            .execute_batch(sql)
            .unwrap(),
        None => {
            let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
            let task = tokio::spawn(conn);
            db.batch_execute(sql).await.unwrap();
            drop(db);
            let _ = task.await;
        }
    }
}

/// An event names its generation; when the sweeper purges the generation
/// before one of its events (here an event dated after it ended), the
/// event still shows its scope and attempt until it is purged too.
async fn an_event_outlives_its_generation(url: &str) {
    let b = migrated(url).await;
    let clock = Clock::manual(T0);
    let store = Store::new(b.clone(), clock.clone());
    let s = scope("k-outlived");
    let mut req = claim(&s, None);
    req.attempt = Some(Attempt::try_from("a-outlived".to_string()).unwrap());
    let ClaimReply::Owned { fence: f } = store.claim(&req).await.unwrap().reply else {
        panic!("not owned");
    };
    assert_eq!(store.release(&fence(&s, f)).await.unwrap(), FenceReply::Done);
    execute(
        url,
        &format!(
            "UPDATE idempotency_events SET at = {} WHERE id = (SELECT max(id) FROM idempotency_events)",
            T0 + 60_000
        ),
    )
    .await;
    let lookup = Lookup {
        tenant: s.tenant().into(),
        key: s.key().as_str().into(),
        ..Default::default()
    };
    let before = b.lookup(&lookup, 10).await.unwrap();
    let sweep = |at: i64| {
        let b = b.clone();
        async move {
            let policy = SweepPolicy {
                batch: 100,
                audit_retention_ms: 30_000,
            };
            b.sweep(at, &policy).await.unwrap()
        }
    };
    let report = sweep(T0 + 40_000).await;
    assert_eq!((report.purged, report.events_purged), (1, 1), "{report:?}");
    let h = b.lookup(&lookup, 10).await.unwrap();
    assert!(h.records.is_empty(), "{h:?}");
    assert_eq!(h.events, before.events[1..], "the released event, as before");
    assert_eq!(h.events[0].attempt.as_deref(), Some("a-outlived"));
    let report = sweep(T0 + 100_000).await;
    assert_eq!((report.purged, report.events_purged), (0, 1), "{report:?}");
    assert_eq!(b.lookup(&lookup, 10).await.unwrap(), Default::default());
    let count = "SELECT count(*) FROM idempotency_purged_generations";
    match url.strip_prefix("sqlite://") {
        Some(path) => {
            let n: i64 = rusqlite::Connection::open(path)
                .unwrap()
                .query_row(count, [], |r| r.get(0))
                .unwrap();
            assert_eq!(n, 0, "its generation goes with it");
        }
        None => execute(url, &format!("DO $$ BEGIN ASSERT ({count}) = 0; END $$")).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_outlives_its_generation_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    an_event_outlives_its_generation(&format!("sqlite://{}", dir.path().join("store.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_outlives_its_generation_on_postgres() {
    let cluster = shared_cluster();
    an_event_outlives_its_generation(&cluster.fresh_database().await).await;
}

/// A store rolled back without its database refuses to start: it would
/// misread a schema a newer store wrote.
async fn a_newer_schema_is_refused(url: &str, mark_newer: &str) {
    migrated(url).await;
    execute(url, mark_newer).await;
    let b = open_backend(url, &BackendOptions::default()).await.unwrap();
    let err = b.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("schema is at version 999, newer than this store's"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_a_newer_store_migrated_is_refused_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    a_newer_schema_is_refused(&url, "INSERT INTO schema_migrations VALUES (999, 0)").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_a_newer_store_migrated_is_refused_on_postgres() {
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    a_newer_schema_is_refused(&url, "INSERT INTO idempotency_schema_migrations VALUES (999, 0)").await;
}

/// A row whose state, transition or actor is none the store writes is
/// corrupt: the lookup says so instead of showing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_with_a_state_transition_or_actor_the_store_never_writes_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let b = migrated(&format!("sqlite://{}", path.display())).await;
    let store = Store::new(b.clone(), Clock::manual(T0));
    let s = scope("k-ended");
    let ClaimReply::Owned { fence: f } = store.claim(&claim(&s, None)).await.unwrap().reply else {
        panic!("not owned");
    };
    assert_eq!(store.release(&fence(&s, f)).await.unwrap(), FenceReply::Done);
    assert!(matches!(
        store.claim(&claim(&s, None)).await.unwrap().reply,
        ClaimReply::Owned { .. }
    ));
    let lookup = Lookup {
        tenant: s.tenant().into(),
        key: s.key().as_str().into(),
        ..Default::default()
    };
    let h = b.lookup(&lookup, 10).await.unwrap();
    let gens: Vec<(&str, bool)> = (h.records.iter())
        .map(|r| (r.state.as_str(), r.ended_at.is_some()))
        .collect();
    assert_eq!(gens, [("in_progress", false), ("released", true)]);
    let conn = rusqlite::Connection::open(&path).unwrap();
    // A damaged file is not held to the current records' state CHECK.
    conn.execute_batch("PRAGMA ignore_check_constraints = ON")
        .unwrap();
    for (spoil, mend) in [
        // The events as SQLite codes them (`sqlite::stored`): no transition
        // is 10, no actor of the store's 3, and a reserved name is written
        // as its code, never as text.
        (
            "UPDATE idempotency_events SET transition = 10 WHERE transition = 3",
            "UPDATE idempotency_events SET transition = 3 WHERE transition = 10",
        ),
        (
            "UPDATE idempotency_events SET transition = 'released' WHERE transition = 3",
            "UPDATE idempotency_events SET transition = 3 WHERE transition = 'released'",
        ),
        (
            "UPDATE idempotency_events SET actor = '' WHERE transition = 3",
            "UPDATE idempotency_events SET actor = 0 WHERE actor = ''",
        ),
        (
            "UPDATE idempotency_events SET actor = 3 WHERE transition = 3",
            "UPDATE idempotency_events SET actor = 0 WHERE actor = 3",
        ),
        (
            "UPDATE idempotency_events SET actor = 'filter' WHERE transition = 3",
            "UPDATE idempotency_events SET actor = 0 WHERE actor = 'filter'",
        ),
        // A state, but no ended generation's.
        (
            "UPDATE idempotency_history SET state = 'in_progress'",
            "UPDATE idempotency_history SET state = 'released'",
        ),
        // How a generation ends, but no current record's state.
        (
            "UPDATE idempotency_records SET state = 'released'",
            "UPDATE idempotency_records SET state = 'in_progress'",
        ),
    ] {
        conn.execute_batch(spoil).unwrap();
        match b.lookup(&lookup, 10).await {
            Err(StoreError::Corrupt(_)) => {}
            other => panic!("{spoil}: {other:?}"),
        }
        conn.execute_batch(mend).unwrap();
        assert_eq!(b.lookup(&lookup, 10).await.unwrap(), h, "{mend}");
    }
}
