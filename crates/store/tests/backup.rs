//! Backups and restore as docs/operations.md#backups-and-restore says: a
//! consistent backup taken while the store serves (SQLite's `VACUUM INTO`
//! through a second connection; PostgreSQL's `pg_dump -Fc`), restored
//! (a copy of the file; `pg_restore` into a new database of another
//! cluster), and a fresh store on it replays every key completed before the
//! backup, an in-progress key is still held by its owner, a client writing
//! throughout the backup finds a consistent cut of its keys, and a key
//! completed after the backup runs again.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply, ClaimRequest};
use idemgate_core::scope::Scope;

use crate::support::*;

/// Leases and TTLs that outlast the test: what a restored store answers
/// then depends on the backup alone, not on the clock.
fn long_claim(s: &Scope) -> ClaimRequest {
    ClaimRequest {
        lease_ms: 10 * 60 * 1000,
        ttl_ms: 60 * 60 * 1000,
        ..claim(s, Some(1))
    }
}

/// What the live store holds when the backup is taken.
struct BeforeBackup {
    /// Completed keys and the body each stored.
    completed: Vec<(Scope, Vec<u8>)>,
    /// A key claimed and not completed, and its owner's fence.
    open: (Scope, u64),
}

/// A claim of `s` that must be owned: its fence.
async fn owned(c: &HttpClient, p: &StoreProcess, s: &Scope) -> u64 {
    let (reply, _) = claim_over_http(c, p, &long_claim(s)).await;
    match reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("expected Owned for {}, got {other:?}", s.key().as_str()),
    }
}

async fn complete_key(c: &HttpClient, p: &StoreProcess, s: &Scope, body: &[u8]) {
    let fence = owned(c, p, s).await;
    let (status, _) = http_complete(c, p, s, fence, body).await;
    assert_eq!(status, 200, "{}", p.log());
}

/// Three keys claimed and completed, one claimed and left in progress.
async fn fill(c: &HttpClient, p: &StoreProcess) -> BeforeBackup {
    let mut completed = Vec::new();
    for n in 0..3 {
        let s = scope(&format!("k-backup-done-{n}"));
        let body = format!("{{\"charge\":\"ch_{n}\",\"amount\":{}}}", 100 * (n + 1)).into_bytes();
        complete_key(c, p, &s, &body).await;
        completed.push((s, body));
    }
    let s = scope("k-backup-open");
    let fence = owned(c, p, &s).await;
    BeforeBackup {
        completed,
        open: (s, fence),
    }
}

/// The keys the writer claims and completes, one after another.
fn busy(n: usize) -> (Scope, Vec<u8>) {
    (
        scope(&format!("k-backup-busy-{n}")),
        format!("busy-{n}").into_bytes(),
    )
}

/// A client claiming and completing keys one after another while the
/// backup is taken, until `stop`; `done` counts the completed ones.
struct Writer {
    done: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn start(c: &HttpClient, p: &StoreProcess) -> Writer {
        let (done, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let (c, base) = (c.clone(), format!("http://{}", p.addr));
        let (d, st) = (done.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut n = 0;
            while !st.load(Ordering::SeqCst) {
                let (s, body) = busy(n);
                let r = request(
                    &c,
                    "POST",
                    &format!("{base}/v1/claim"),
                    Some(API),
                    encode_frame(&long_claim(&s), b""),
                )
                .await;
                assert_eq!(r.status, 200, "{:?}", r.body);
                let Ok((ClaimReply::Owned { fence }, _)) = decode_frame::<ClaimReply>(&r.body) else {
                    panic!("the writer's claim of {n} was not owned");
                };
                let r = request(
                    &c,
                    "POST",
                    &format!("{base}/v1/complete"),
                    Some(API),
                    encode_frame(&complete(&s, fence, 201), &body),
                )
                .await;
                assert_eq!(r.status, 200, "{:?}", r.body);
                n += 1;
                d.store(n, Ordering::SeqCst);
            }
        });
        Writer { done, stop, task }
    }

    /// Until `n` more keys are completed than now.
    async fn advance(&self, n: usize) {
        let target = self.done.load(Ordering::SeqCst) + n;
        let done = self.done.clone();
        eventually(
            "the writer to complete more keys",
            Duration::from_secs(30),
            || {
                let done = done.clone();
                async move { done.load(Ordering::SeqCst) >= target }
            },
        )
        .await;
    }

    /// Stops it: how many keys it completed.
    async fn stop(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        self.done.load(Ordering::SeqCst)
    }
}

/// The writer's keys as a restored store sees them: a consistent snapshot
/// holds a prefix of them completed (each replaying its own body), then at
/// most one in progress, then none of the rest. How many it replayed.
async fn check_writer(c: &HttpClient, p: &StoreProcess, written: usize) -> usize {
    let mut replayed = 0;
    let mut in_progress = 0;
    let mut absent = 0;
    for n in 0..written {
        let (s, body) = busy(n);
        let (reply, bytes) = claim_over_http(c, p, &long_claim(&s)).await;
        match reply {
            ClaimReply::Replay { status: 201, .. } => {
                assert!(
                    in_progress + absent == 0,
                    "key {n} completed after a later one was not"
                );
                assert_eq!(bytes, body, "key {n}");
                replayed += 1;
            }
            ClaimReply::InProgress { .. } => {
                assert!(in_progress + absent == 0, "key {n} in progress after a later one");
                in_progress += 1;
            }
            ClaimReply::Owned { .. } => absent += 1,
            other => panic!("key {n}: {other:?}"),
        }
    }
    replayed
}

/// A key completed on the live store after the backup was taken, and its
/// fence: the last the live store drew.
async fn after_backup(c: &HttpClient, p: &StoreProcess) -> (Scope, u64) {
    let s = scope("k-backup-after");
    let fence = owned(c, p, &s).await;
    let (status, _) = http_complete(c, p, &s, fence, b"{\"charge\":\"ch_after\"}").await;
    assert_eq!(status, 200, "{}", p.log());
    let (reply, _) = claim_over_http(c, p, &long_claim(&s)).await;
    assert!(matches!(reply, ClaimReply::Replay { .. }), "{reply:?}");
    (s, fence)
}

/// What a store on the restored backup answers.
async fn check_restored(c: &HttpClient, p: &StoreProcess, before: &BeforeBackup, after: &(Scope, u64)) {
    // Every key completed before the backup replays its stored response.
    for (s, body) in &before.completed {
        let (reply, replayed) = claim_over_http(c, p, &long_claim(s)).await;
        match reply {
            ClaimReply::Replay { status, .. } => assert_eq!(status, 201, "{}", s.key().as_str()),
            other => panic!("expected Replay for {}, got {other:?}", s.key().as_str()),
        }
        assert_eq!(&replayed, body, "{}", s.key().as_str());
    }
    // The key in progress at the backup is still held by its owner, whose
    // completion with its fence is then accepted and replayed.
    let (s, fence) = &before.open;
    let (reply, _) = claim_over_http(c, p, &long_claim(s)).await;
    assert!(
        matches!(reply, ClaimReply::InProgress { .. }),
        "expected InProgress, got {reply:?}"
    );
    let (status, _) = http_complete(c, p, s, *fence, b"{\"charge\":\"ch_open\"}").await;
    assert_eq!(status, 200, "{}", p.log());
    let (reply, replayed) = claim_over_http(c, p, &long_claim(s)).await;
    assert!(
        matches!(reply, ClaimReply::Replay { status: 201, .. }),
        "{reply:?}"
    );
    assert_eq!(replayed, b"{\"charge\":\"ch_open\"}");
    // A key completed after the backup is not in it: a retry runs again,
    // under a fence above every fence the live store drew, so a late
    // settlement of what the restore lost cannot land on it.
    let (s, lost) = after;
    let (reply, _) = claim_over_http(c, p, &long_claim(s)).await;
    let ClaimReply::Owned { fence } = reply else {
        panic!("a key completed after the backup: expected Owned, got {reply:?}");
    };
    assert!(
        fence > *lost,
        "fence {fence} drawn again after a restore (the live store drew up to {lost})"
    );
    let (status, _) = http_complete(c, p, s, *lost, b"{\"charge\":\"ch_lost\"}").await;
    assert_eq!(status, 409, "a completion under a fence the restore lost");
    assert!(!p.log().contains("ERROR"), "{}", p.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_online_backup_restored_replays_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let live = dir.path().join("store.db");
    let copy = dir.path().join("backup.db");
    let c = client();
    let mut p = StoreProcess::start(&format!("sqlite://{}", live.display())).await;
    let before = fill(&c, &p).await;
    let writer = Writer::start(&c, &p);
    writer.advance(5).await;

    // The online backup, through a second connection while the store serves
    // and the writer writes.
    let conn = rusqlite::Connection::open(&live).unwrap();
    conn.execute("VACUUM INTO ?1", [copy.to_str().unwrap()]).unwrap();
    drop(conn);
    assert!(copy.exists(), "VACUUM INTO wrote no file");

    writer.advance(2).await;
    let written = writer.stop().await;
    let after = after_backup(&c, &p).await;
    p.kill9();

    // Restore: the store opens the backup file as its database.
    let restored = dir.path().join("restored.db");
    std::fs::copy(&copy, &restored).unwrap();
    let q = StoreProcess::start(&format!("sqlite://{}", restored.display())).await;
    check_restored(&c, &q, &before, &after).await;
    let replayed = check_writer(&c, &q, written).await;
    assert!(
        (5..written).contains(&replayed),
        "{replayed} of {written} replayed"
    );
}

/// `tool args` from the PostgreSQL binaries' directory: its standard error
/// when it fails.
fn pg_tool(tool: &str, args: &[&str]) {
    let exe = pg::bin_dir().join(tool);
    let out = Command::new(&exe)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_dump_restored_into_another_cluster_replays_its_keys() {
    let primary = pg::PgCluster::start();
    let url = primary.fresh_database().await;
    let c = client();
    let mut p = StoreProcess::start(&url).await;
    let before = fill(&c, &p).await;
    let writer = Writer::start(&c, &p);
    writer.advance(5).await;

    // The dump, taken while the store serves and the writer writes: one
    // snapshot of the database.
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("store.dump");
    pg_tool("pg_dump", &["-Fc", "-f", dump.to_str().unwrap(), "-d", &url]);

    writer.advance(2).await;
    let written = writer.stop().await;
    let after = after_backup(&c, &p).await;
    p.kill9();
    drop(primary);

    // Restore into a new database of another cluster.
    let other = pg::PgCluster::start();
    other.query("CREATE DATABASE restored");
    let restored = other.url("restored");
    pg_tool(
        "pg_restore",
        &[
            "--exit-on-error",
            "--single-transaction",
            "-d",
            &restored,
            dump.to_str().unwrap(),
        ],
    );
    let q = StoreProcess::start(&restored).await;
    check_restored(&c, &q, &before, &after).await;
    let replayed = check_writer(&c, &q, written).await;
    assert!(
        (5..written).contains(&replayed),
        "{replayed} of {written} replayed"
    );
}
