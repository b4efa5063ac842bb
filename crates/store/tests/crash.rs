//! `kill -9` the real binary between claim and complete, restart it on the
//! same database: the claim is still there and turns unknown after its lease;
//! a completed record survives.
//!
//! What a crash may lose (docs/contract.md §5): a completion commits without
//! an fsync of its own unless the claim's policy releases unknown outcomes,
//! so a power loss (SQLite) or a database crash (PostgreSQL) may undo it. The
//! record is then in progress again and turns unknown when its lease runs
//! out: never a second execution. Claims are always durable before they are
//! answered.

use std::path::Path;
use std::time::Duration;

use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{encode_frame, ClaimReply, ClaimRequest, FenceReply};
use idemgate_core::scope::Scope;
use idemgate_store::backend::KeyHistory;

use crate::support::*;

async fn crash_and_restart(url: &str) {
    let c = client();
    let mut p = StoreProcess::start(url).await;
    let open = scope("k-crash-open");
    let mut open_req = claim(&open, Some(1));
    open_req.lease_ms = 1_500;
    let (reply, _) = claim_over_http(&c, &p, &open_req).await;
    assert!(matches!(reply, ClaimReply::Owned { .. }), "{reply:?}");

    let done = scope("k-crash-done");
    let (reply, _) = claim_over_http(&c, &p, &claim(&done, Some(1))).await;
    let ClaimReply::Owned { fence } = reply else {
        panic!("{reply:?}")
    };
    let r = request(
        &c,
        "POST",
        &p.url("/v1/complete"),
        Some(API),
        encode_frame(&complete(&done, fence, 201), b"kept"),
    )
    .await;
    assert_eq!(r.status, 200);

    p.kill9();
    let p = StoreProcess::start(url).await;

    let (reply, body) = claim_over_http(&c, &p, &claim(&done, Some(1))).await;
    assert!(
        matches!(reply, ClaimReply::Replay { status: 201, .. }),
        "{reply:?}"
    );
    assert_eq!(body, b"kept");

    let (reply, _) = claim_over_http(&c, &p, &open_req).await;
    assert!(
        matches!(reply, ClaimReply::InProgress { .. } | ClaimReply::Unknown),
        "the claim survived: {reply:?}"
    );
    eventually(
        "the crashed owner's record to turn unknown",
        Duration::from_secs(15),
        || {
            let (c, p, req) = (&c, &p, &open_req);
            async move { claim_over_http(c, p, req).await.0 == ClaimReply::Unknown }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_store_keeps_its_records_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    crash_and_restart(&format!("sqlite://{}", dir.path().join("store.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_store_keeps_its_records_on_postgres() {
    let cluster = pg::PgCluster::start();
    crash_and_restart(&cluster.fresh_database().await).await;
}

async fn complete_over_http(c: &HttpClient, p: &StoreProcess, s: &Scope, fence: u64, body: &[u8]) {
    assert_eq!(
        http_complete(c, p, s, fence, body).await,
        (200, Some(FenceReply::Done))
    );
}

async fn owned(c: &HttpClient, p: &StoreProcess, req: &ClaimRequest) -> u64 {
    match claim_over_http(c, p, req).await.0 {
        ClaimReply::Owned { fence } => fence,
        other => panic!("expected Owned, got {other:?}"),
    }
}

async fn history(c: &HttpClient, p: &StoreProcess, key: &str) -> KeyHistory {
    let q = serde_json::json!({ "tenant": "acme", "key": key });
    let r = request(
        c,
        "POST",
        &p.url(idemgate_store::admin::LOOKUP_PATH),
        Some(ADMIN),
        serde_json::to_vec(&q).unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    serde_json::from_slice(&r.body).unwrap()
}

/// After a completion was lost: retries of the claim are answered in
/// progress until the owner's lease runs out, then unknown; none of them is
/// ever allowed to run the request again.
async fn a_lost_completion_turns_unknown(c: &HttpClient, p: &StoreProcess, req: &ClaimRequest) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    loop {
        let (reply, _) = claim_over_http(c, p, req).await;
        assert!(
            matches!(reply, ClaimReply::InProgress { .. } | ClaimReply::Unknown),
            "a retry after the lost completion got {reply:?} (after {seen:?})"
        );
        if reply == ClaimReply::Unknown {
            break;
        }
        seen.push(reply);
        assert!(
            std::time::Instant::now() < deadline,
            "the record never turned unknown: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let h = history(c, p, req.scope.key().as_str()).await;
    let events: Vec<&str> = h.events.iter().map(|e| e.transition.as_str()).collect();
    assert_eq!(events, ["claimed", "lease_expired"], "{h:?}");
}

/// The database files as a power loss would leave them: SQLite's WAL is
/// copied while no process has it open, and the wal-index is rebuilt from it.
fn copy_database(from: &Path, to: &Path) {
    for suffix in ["", "-wal"] {
        let name = format!("store.db{suffix}");
        let _ = std::fs::remove_file(to.join(&name));
        if from.join(&name).exists() {
            std::fs::copy(from.join(&name), to.join(&name)).unwrap();
        }
    }
    let _ = std::fs::remove_file(to.join("store.db-shm"));
}

/// SQLite at the default `synchronous=FULL`: the claim's commit is fsynced,
/// the completion's is not. Losing it is simulated by putting back the
/// files as they were when the claim was answered, which is all a power loss
/// right after the completion is guaranteed to leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_lost_on_power_loss_turns_unknown_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    let c = client();
    let mut p = StoreProcess::start(&url).await;
    let s = scope("k-lost-completion");
    let mut req = claim(&s, Some(1));
    req.lease_ms = 1_500;
    let fence = owned(&c, &p, &req).await;
    p.kill9();
    copy_database(dir.path(), snapshot.path());

    let mut p = StoreProcess::start(&url).await;
    complete_over_http(&c, &p, &s, fence, b"done").await;
    p.kill9();
    // Power loss: the completion's commit never reached the disk.
    copy_database(snapshot.path(), dir.path());

    let p = StoreProcess::start(&url).await;
    a_lost_completion_turns_unknown(&c, &p, &req).await;
}

/// On SQLite a claim is fsynced before it is answered, and so is every batch
/// that holds one; a completion alone is not, unless the claim's policy
/// frees the key on an unknown outcome (a lost completion would then allow
/// a second execution).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_claims_are_fsynced_and_completions_are_not() {
    use idemgate_store::backend::{Answer, Backend, Call};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let sqlite = idemgate_store::sqlite::Sqlite::open(
        path.to_str().unwrap(),
        true,
        idemgate_store::log_ids::LogIds::random().unwrap(),
        idemgate_store::sealing::Seal::off(),
    )
    .unwrap();
    sqlite.migrate().await.unwrap();
    let commits = || (sqlite.commits(), sqlite.durable_commits());
    let owned = |out: idemgate_store::backend::ClaimOutcome| match out.reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("{other:?}"),
    };
    let start = commits();
    let after = |c: (u64, u64)| (c.0 - start.0, c.1 - start.1);

    let a = scope("k-durable-a");
    let fa = owned(sqlite.claim(&claim(&a, Some(1)), 0, None).await.unwrap());
    assert_eq!(after(commits()), (1, 1), "a claim is fsynced");
    sqlite.complete(&complete(&a, fa, 201), b"a", 1).await.unwrap();
    assert_eq!(after(commits()), (2, 1), "a completion is not");

    let b = scope("k-durable-b");
    let mut released = claim(&b, Some(1));
    released.on_unknown = OnUnknown::Release;
    let fb = owned(sqlite.claim(&released, 2, None).await.unwrap());
    assert_eq!(after(commits()), (3, 2));
    sqlite.complete(&complete(&b, fb, 201), b"b", 3).await.unwrap();
    assert_eq!(
        after(commits()),
        (4, 3),
        "under on_unknown: release a lost completion would free the key: it is fsynced"
    );

    // A claim and a completion in one batch: one commit, fsynced.
    let c = scope("k-durable-c");
    let fc = owned(sqlite.claim(&claim(&c, Some(1)), 4, None).await.unwrap());
    let d = scope("k-durable-d");
    let calls = vec![
        Call::Complete {
            req: complete(&c, fc, 201),
            body: bytes::Bytes::from_static(b"c"),
        },
        Call::Claim {
            req: claim(&d, Some(1)),
            deadline: None,
        },
    ];
    let answers = sqlite.decide(calls, 5).await;
    assert!(
        matches!(answers[0], Ok(Answer::Fence(FenceReply::Done))),
        "{answers:?}"
    );
    assert!(matches!(answers[1], Ok(Answer::Claim(_))), "{answers:?}");
    assert_eq!(after(commits()), (6, 5), "the batch holds a claim: it is fsynced");
}

/// PostgreSQL: a completion commits with `synchronous_commit = off`, so a
/// crash of the database server right after it may lose it (the WAL writer
/// is slowed down here so that it has not written it out yet). The claim
/// survives, and so does the completion of a claim whose policy releases
/// unknown outcomes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_lost_in_a_database_crash_turns_unknown_on_postgres() {
    let cluster = pg::PgCluster::start_with(&[("wal_writer_delay", "10000ms")]);
    let url = cluster.fresh_database().await;
    let c = client();
    let mut p = StoreProcess::start(&url).await;

    let kept = scope("k-kept-completion");
    let mut kept_req = claim(&kept, Some(1));
    kept_req.on_unknown = OnUnknown::Release;
    let kept_fence = owned(&c, &p, &kept_req).await;
    let lost = scope("k-lost-completion");
    let mut lost_req = claim(&lost, Some(1));
    lost_req.lease_ms = 1_500;
    let lost_fence = owned(&c, &p, &lost_req).await;

    complete_over_http(&c, &p, &kept, kept_fence, b"kept").await;
    complete_over_http(&c, &p, &lost, lost_fence, b"lost").await;
    // The last completion was committed without waiting for the WAL: its
    // commit record is still in the server's memory (the WAL writer comes by
    // every 10 s here, and nothing else has run since).
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let written: bool = db
        .query_one("SELECT pg_current_wal_lsn() >= pg_current_wal_insert_lsn()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!written, "the completion waited for the WAL to be written");
    drop(db);
    p.kill9();
    cluster.crash_and_restart();

    let p = StoreProcess::start(&url).await;
    let (reply, body) = claim_over_http(&c, &p, &kept_req).await;
    assert!(
        matches!(reply, ClaimReply::Replay { status: 201, .. }),
        "{reply:?}"
    );
    assert_eq!(body, b"kept");
    a_lost_completion_turns_unknown(&c, &p, &lost_req).await;
}
