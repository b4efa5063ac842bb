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
    let sqlite = Arc::new(
        idemgate_store::sqlite::Sqlite::open(
            path.to_str().unwrap(),
            true,
            idemgate_store::log_ids::LogIds::random().unwrap(),
            idemgate_store::sealing::Seal::off(),
        )
        .unwrap(),
    );
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
    let mut fences = std::collections::BTreeSet::new();
    for t in tasks {
        match t.await.unwrap() {
            ClaimReply::Owned { fence } => assert!(fences.insert(fence), "fence {fence} handed out twice"),
            other => panic!("{other:?}"),
        }
    }
    // Fences are taken per batch (the counter is read and written once per
    // commit); every claim still gets its own, and the next batch goes on
    // from the last.
    let next = sqlite
        .claim(&claim(&scope("k-group-next"), Some(1)), 0, None)
        .await
        .unwrap()
        .reply;
    assert!(
        matches!(next, ClaimReply::Owned { fence } if fence > *fences.last().unwrap()),
        "{next:?}"
    );
    let commits = sqlite.commits() - before - 1;
    assert!(
        commits < CLAIMS as u64 / 2,
        "{CLAIMS} claims took {commits} commits: no group commit"
    );
}

/// An owner completing just as a retry finds its lease run out: whichever
/// lands first, the other must see it. A completion acknowledged and then
/// overwritten by a takeover would lose the response and run the operation
/// twice.
async fn takeover_races_completion(backend: Arc<dyn Backend>) {
    use idemgate_core::config::OnUnknown;
    use idemgate_core::protocol::FenceReply;
    let clock = Clock::manual(1_000_000);
    let store = Store::new(backend, clock.clone());
    for on_unknown in [OnUnknown::Release, OnUnknown::Conflict] {
        let mut outcomes = std::collections::HashMap::new();
        for i in 0..60 {
            let s = scope(&format!("k-takeover-{on_unknown:?}-{i}"));
            let mut req = claim(&s, Some(1));
            req.on_unknown = on_unknown;
            let ClaimReply::Owned { fence: owner } = store.claim(&req).await.unwrap().reply else {
                panic!("first claim not owned")
            };
            clock.advance(req.lease_ms as i64);
            let (done, retry) = tokio::join!(
                {
                    let store = store.clone();
                    let s = s.clone();
                    tokio::spawn(
                        async move { store.complete(&complete(&s, owner, 201), b"paid").await.unwrap() },
                    )
                },
                {
                    let (store, req) = (store.clone(), req.clone());
                    tokio::spawn(async move { store.claim(&req).await.unwrap().reply })
                }
            );
            let (done, retry) = (done.unwrap(), retry.unwrap());
            let after = store.claim(&req).await.unwrap().reply;
            match (&done, &retry) {
                // The completion won: the retry saw it, or turned the record
                // unknown first and the completion (current fence) resolved it.
                (FenceReply::Done, ClaimReply::Replay { .. } | ClaimReply::Unknown) => {
                    assert!(
                        matches!(after, ClaimReply::Replay { status: 201, .. }),
                        "{i}: {after:?}"
                    );
                }
                // The takeover won: the late completion was refused.
                (FenceReply::Stale, ClaimReply::Owned { .. }) => {
                    assert!(matches!(after, ClaimReply::InProgress { .. }), "{i}: {after:?}");
                }
                other => panic!("{on_unknown:?} {i}: completion and takeover both acted: {other:?}"),
            }
            *outcomes.entry(matches!(done, FenceReply::Done)).or_insert(0) += 1;
        }
        eprintln!("{on_unknown:?}: completion won / takeover won = {outcomes:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_never_overwrites_a_completion_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    takeover_races_completion(sqlite_backend(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_never_overwrites_a_completion_on_postgres() {
    let cluster = pg::PgCluster::start();
    let url = cluster.fresh_database().await;
    takeover_races_completion(pg_backend(&url).await).await;
}
