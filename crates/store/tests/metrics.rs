//! The metrics an outage shows: calls the database fails are counted by
//! call, and the pool gauges follow the backend's connections.

use std::sync::Arc;

use idemgate_store::backend::{Backend, Call};
use idemgate_store::conditions::OPEN_RECORDS;
use idemgate_store::database_url::{open_backend, BackendOptions};
use idemgate_store::{Clock, Store};

use crate::support::*;

/// A gauge's or counter's value in the metrics text.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from\n{text}"))
}

#[tokio::test]
async fn calls_the_database_fails_are_counted_by_call() {
    // Nothing listens on this port: every connection is refused.
    let url = format!("postgres://idem@127.0.0.1:{}/idem", free_port());
    let opts = BackendOptions {
        pg_pool_size: Some(3),
        ..BackendOptions::default()
    };
    let backend: Arc<dyn Backend> = open_backend(&url, &opts).await.unwrap();
    let store = Store::new(backend, Clock::System);
    let s = scope("k-outage");
    assert!(store.complete(&complete(&s, 1, 201), b"{}").await.is_err());
    let answers = store
        .decide(vec![Call::Release(fence(&s, 1)), Call::Release(fence(&s, 2))])
        .await;
    assert!(answers.iter().all(Result::is_err));
    assert!(store.claim(&claim(&s, Some(1))).await.is_err());

    store.metrics.observe_pool(store.backend.pool());
    let text = store.metrics.render();
    assert_eq!(
        value(&text, r#"idemgate_store_call_errors_total{call="complete"}"#),
        1.0
    );
    assert_eq!(
        value(&text, r#"idemgate_store_call_errors_total{call="release"}"#),
        2.0
    );
    assert_eq!(
        value(&text, r#"idemgate_store_call_errors_total{call="claim"}"#),
        1.0
    );
    assert_eq!(
        value(&text, r#"idemgate_store_call_errors_total{call="abandon"}"#),
        0.0
    );
    assert_eq!(value(&text, "idemgate_store_pool_max_connections"), 3.0);
    assert_eq!(value(&text, "idemgate_store_pool_connections"), 0.0);
    assert_eq!(value(&text, "idemgate_store_pool_waiting"), 0.0);
    assert!(
        text.contains(r#"idemgate_store_build_info{version="0.1.0",backend="postgres"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn sqlite_times_each_stage_of_its_writes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(sqlite_backend(&dir).await, Clock::System);
    let s = scope("k-stages");
    store.claim(&claim(&s, Some(1))).await.unwrap();
    store.complete(&complete(&s, 1, 201), b"{}").await.unwrap();
    let text = store.metrics.render();
    // Migrations, the claim and the completion: one write each at least,
    // every one queued, run and committed.
    for stage in ["queued", "transaction", "commit"] {
        let count = value(&text, &format!("idemgate_store_write_{stage}_seconds_count"));
        let sum = value(&text, &format!("idemgate_store_write_{stage}_seconds_sum"));
        assert!(count >= 2.0 && sum > 0.0, "{stage}: {count} writes, {sum} s");
    }
}

/// The open records' gauges are sampled every sweeper pass: the statement
/// reads the in-progress and unknown records through their partial
/// indexes, never the whole table (which at 10^6 records took a quarter of
/// a second a pass, and held up claims).
#[tokio::test]
async fn sqlite_samples_the_open_records_through_their_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let _backend = sqlite_backend(&dir).await;
    let conn = rusqlite::Connection::open(dir.path().join("store.db")).unwrap();
    let mut plan = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {}", &*OPEN_RECORDS))
        .unwrap();
    let steps: Vec<String> = plan
        .query_map([], |row| row.get(3))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    let reads: Vec<&String> = steps
        .iter()
        .filter(|s| s.contains("idempotency_records"))
        .collect();
    assert!(!reads.is_empty(), "{steps:?}");
    for read in reads {
        assert!(
            ["idempotency_records_in_progress", "idempotency_records_unknown"]
                .iter()
                .any(|index| read.contains(&format!("USING INDEX {index}"))),
            "{read}, in {steps:?}"
        );
    }
}
