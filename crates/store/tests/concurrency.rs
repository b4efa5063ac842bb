//! 200 concurrent claims of one tuple: exactly one owner, on both backends
//! and across two store processes sharing one PostgreSQL.

use std::sync::Arc;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply};
use idemgate_store::backend::Backend;
use idemgate_store::{Clock, Store};

use crate::support::*;

const CLAIMS: usize = 200;

fn count(replies: &[ClaimReply]) -> (usize, usize) {
    let owned = replies
        .iter()
        .filter(|r| matches!(r, ClaimReply::Owned { .. }))
        .count();
    let in_progress = replies
        .iter()
        .filter(|r| matches!(r, ClaimReply::InProgress { .. }))
        .count();
    (owned, in_progress)
}

async fn race(backend: Arc<dyn Backend>) {
    let store = Store::new(backend, Clock::System);
    let s = scope("k-race");
    let barrier = Arc::new(tokio::sync::Barrier::new(CLAIMS));
    let tasks: Vec<_> = (0..CLAIMS)
        .map(|_| {
            let (store, s, barrier) = (store.clone(), s.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut req = claim(&s, Some(1));
                req.lease_ms = 60_000;
                barrier.wait().await;
                store.claim(&req).await.unwrap().reply
            })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert_eq!(count(&replies), (1, CLAIMS - 1), "{replies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_claims_have_one_owner_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    race(sqlite_backend(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_claims_have_one_owner_on_postgres() {
    let cluster = pg::PgCluster::start();
    let url = cluster.fresh_database().await;
    race(pg_backend(&url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_store_processes_sharing_postgres_have_one_owner() {
    let cluster = pg::PgCluster::start();
    let url = cluster.fresh_database().await;
    let a = StoreProcess::start(&url).await;
    let b = StoreProcess::start(&url).await;
    let s = scope("k-two-processes");
    let mut req = claim(&s, Some(1));
    req.lease_ms = 60_000;
    let frame = encode_frame(&req, b"");
    let c = client();
    let barrier = Arc::new(tokio::sync::Barrier::new(CLAIMS));
    let tasks: Vec<_> = (0..CLAIMS)
        .map(|i| {
            let url = if i % 2 == 0 {
                a.url("/v1/claim")
            } else {
                b.url("/v1/claim")
            };
            let (c, frame, barrier) = (c.clone(), frame.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = request(&c, "POST", &url, Some(API), frame).await;
                assert_eq!(r.status, 200, "{:?}", r.body);
                decode_frame::<ClaimReply>(&r.body).unwrap().0
            })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert_eq!(count(&replies), (1, CLAIMS - 1), "{replies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sqlite_claims_share_commits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let sqlite = Arc::new(idemgate_store::sqlite::Sqlite::open(path.to_str().unwrap(), true).unwrap());
    sqlite.migrate().await.unwrap();
    let before = sqlite.commits();
    let barrier = Arc::new(tokio::sync::Barrier::new(CLAIMS));
    let tasks: Vec<_> = (0..CLAIMS)
        .map(|i| {
            let (sqlite, barrier) = (sqlite.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                sqlite
                    .claim(&claim(&scope(&format!("k-group-{i}")), Some(1)), 0, None)
                    .await
                    .unwrap()
                    .reply
            })
        })
        .collect();
    for t in tasks {
        assert!(matches!(t.await.unwrap(), ClaimReply::Owned { .. }));
    }
    let commits = sqlite.commits() - before;
    assert!(
        commits < CLAIMS as u64 / 2,
        "{CLAIMS} claims took {commits} commits: no group commit"
    );
}
