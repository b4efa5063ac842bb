use super::queue::MAX_BATCH;
use super::*;
use crate::sqlite::checkpoint::RESTART_FRAMES;
use crate::sqlite::connection::BUSY_TIMEOUT;

fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.db");
    let engine = Engine::open(path.to_str().unwrap(), true).unwrap();
    (dir, engine)
}

fn insert(n: i64) -> impl FnOnce(&Writer<'_>) -> Result<()> + Send + 'static {
    move |w| {
        w.execute("INSERT INTO t (x) VALUES (?1)", [n])
            .map(drop)
            .map_err(unavailable)
    }
}

/// A job whose statement failed with `code` (SQLITE_FULL, ...);
/// `rolled_back` says whether SQLite rolled the whole transaction back
/// as it did so (it may).
fn failing(code: i32, rolled_back: bool) -> impl FnOnce(&Writer<'_>) -> Result<()> + Send + 'static {
    move |w| {
        if rolled_back {
            w.execute_batch("ROLLBACK").unwrap();
        }
        let e = rusqlite::ffi::Error::new(code);
        Err(unavailable(rusqlite::Error::SqliteFailure(e, None)))
    }
}

async fn rows(engine: &Engine) -> Vec<i64> {
    engine
        .read(|c| {
            let mut stmt = c.prepare("SELECT x FROM t ORDER BY x").map_err(unavailable)?;
            let rows = stmt.query_map([], |r| r.get(0)).map_err(unavailable)?;
            rows.collect::<rusqlite::Result<Vec<i64>>>().map_err(unavailable)
        })
        .await
        .unwrap()
}

async fn batch_with_a_failure(code: i32, rolled_back: bool) -> (Vec<bool>, Vec<i64>) {
    let (_dir, engine) = engine();
    engine
        .write(Durability::Durable, |w| {
            w.execute_batch("CREATE TABLE t (x INTEGER)").map_err(unavailable)
        })
        .await
        .unwrap();
    let (a, pa) = Engine::job(Durability::Durable, insert(1));
    let (b, pb) = Engine::job(Durability::Durable, failing(code, rolled_back));
    let (c, pc) = Engine::job(Durability::Durable, insert(3));
    engine.submit(vec![a, b, c]).unwrap();
    let answered = vec![
        pa.wait().await.is_ok(),
        pb.wait().await.is_ok(),
        pc.wait().await.is_ok(),
    ];
    let after = engine.write(Durability::Durable, insert(4)).await;
    assert!(after.is_ok(), "the writer did not recover: {after:?}");
    (answered, rows(&engine).await)
}

/// Twice the pages the WAL holds before it starts over.
const WAL_BOUND: u64 = 2 * RESTART_FRAMES * 4096;

/// Commits of a page each, four times as many as start the WAL over, back
/// to back, run by the writer thread (`inline` false) or each on its
/// caller's thread: a WAL that never started over would hold them all.
async fn wal_after_back_to_back_commits(inline: bool) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.db");
    let engine = Engine::open(path.to_str().unwrap(), false).unwrap();
    engine
        .write(Durability::Relaxed, |w| {
            w.execute_batch("CREATE TABLE t (x BLOB)").map_err(unavailable)
        })
        .await
        .unwrap();
    for _ in 0..4 * RESTART_FRAMES {
        let page = |w: &Writer<'_>| {
            w.execute("INSERT INTO t (x) VALUES (zeroblob(4000))", [])
                .map(drop)
                .map_err(unavailable)
        };
        if inline {
            let (job, pending) = Engine::job(Durability::Relaxed, page);
            engine.submit(vec![job]).unwrap();
            pending.wait().await.unwrap();
        } else {
            engine.write(Durability::Relaxed, page).await.unwrap();
        }
    }
    std::fs::metadata(dir.path().join("engine.db-wal")).unwrap().len()
}

#[tokio::test]
async fn the_wal_starts_over_while_the_writer_never_rests() {
    let wal = wal_after_back_to_back_commits(false).await;
    assert!(wal < WAL_BOUND, "the WAL grew to {wal} bytes");
}

#[tokio::test]
async fn the_wal_starts_over_when_every_commit_runs_on_its_callers_thread() {
    // The restart waits for readers, so it is left to the writer thread.
    let wal = wal_after_back_to_back_commits(true).await;
    assert!(wal < WAL_BOUND, "the WAL grew to {wal} bytes");
}

async fn with_table() -> (tempfile::TempDir, Engine) {
    let (dir, engine) = engine();
    engine
        .write(Durability::Durable, |w| {
            w.execute_batch("CREATE TABLE t (x INTEGER)").map_err(unavailable)
        })
        .await
        .unwrap();
    (dir, engine)
}

#[tokio::test]
async fn a_write_submitted_to_an_idle_writer_is_committed_on_its_callers_thread() {
    let (_dir, engine) = with_table().await;
    // The writer thread, which created the table, lets go of the writer
    // once its batch is answered.
    while engine.shared.writer.try_lock().is_err() {
        tokio::task::yield_now().await;
    }
    let here = std::thread::current().id();
    let (job, mut pending) = Engine::job(Durability::Durable, move |w| {
        insert(1)(w).map(|()| std::thread::current().id())
    });
    engine.submit(vec![job]).unwrap();
    // Answered before anything was awaited: no other thread took part.
    let (ran_on, _, _) = pending.0.try_recv().expect("answered when submit returned");
    assert_eq!(ran_on.unwrap(), here);
    assert_eq!(engine.commits(), (2, 2));
    assert_eq!(rows(&engine).await, [1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_from_many_threads_at_once_are_all_committed() {
    // Callers race each other for the writer and its thread: a write
    // queued while another caller's batch runs must not be left behind.
    let (_dir, engine) = with_table().await;
    let tasks = (0..16i64).map(|t| {
        let engine = engine.clone();
        tokio::spawn(async move {
            for i in 0..50 {
                let (job, pending) = Engine::job(Durability::Durable, insert(t * 50 + i));
                engine.submit(vec![job]).unwrap();
                pending.wait().await.unwrap();
            }
        })
    });
    let all = futures_util::future::join_all(tasks);
    let done = tokio::time::timeout(std::time::Duration::from_secs(120), all).await;
    assert!(done.is_ok(), "a write was never committed");
    assert_eq!(rows(&engine).await, (0..800).collect::<Vec<i64>>());
}

#[tokio::test]
async fn the_writer_and_the_checkpointer_stop_with_the_engine() {
    let (_dir, engine) = with_table().await;
    engine.write(Durability::Durable, insert(1)).await.unwrap();
    let shared = Arc::downgrade(&engine.shared);
    drop(engine);
    // The writer thread holds the engine's state until it returns; the
    // checkpointer ends when that state (its nudges' sender) is dropped.
    for _ in 0..100 {
        if shared.upgrade().is_none() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the writer thread still runs after its engine was dropped");
}

#[tokio::test]
async fn a_disk_full_that_ended_the_transaction_fails_the_whole_batch_and_commits_none_of_it() {
    let (answered, rows) = batch_with_a_failure(rusqlite::ffi::SQLITE_FULL, true).await;
    assert_eq!(answered, [false, false, false]);
    assert_eq!(rows, [4], "a job ran outside the batch's transaction");
}

#[tokio::test]
async fn a_disk_full_inside_a_batch_fails_the_whole_batch_even_if_the_transaction_survived() {
    let (answered, rows) = batch_with_a_failure(rusqlite::ffi::SQLITE_FULL, false).await;
    assert_eq!(answered, [false, false, false]);
    assert_eq!(rows, [4]);
}

#[tokio::test]
async fn io_errors_a_read_only_file_and_busy_fail_the_whole_batch_too() {
    use rusqlite::ffi::{SQLITE_BUSY, SQLITE_IOERR, SQLITE_IOERR_FSYNC, SQLITE_READONLY};
    for code in [SQLITE_IOERR, SQLITE_IOERR_FSYNC, SQLITE_READONLY, SQLITE_BUSY] {
        let (answered, rows) = batch_with_a_failure(code, false).await;
        assert_eq!(answered, [false, false, false], "code {code}");
        assert_eq!(rows, [4], "code {code}");
    }
}

#[tokio::test]
async fn callers_see_an_unavailable_database_never_a_lost_transaction() {
    let (_dir, engine) = engine();
    let full = rusqlite::ffi::SQLITE_FULL;
    let written = engine.write(Durability::Durable, failing(full, false)).await;
    assert!(
        matches!(
            written,
            Err(StoreError::Unavailable {
                outage: Outage::Database,
                ..
            })
        ),
        "{written:?}"
    );
    let read = engine
        .read(move |_| {
            let e = rusqlite::ffi::Error::new(full);
            Err::<(), _>(unavailable(rusqlite::Error::SqliteFailure(e, None)))
        })
        .await;
    assert!(
        matches!(
            read,
            Err(StoreError::Unavailable {
                outage: Outage::Database,
                ..
            })
        ),
        "{read:?}"
    );
}

#[tokio::test]
async fn a_job_that_fails_on_its_own_is_undone_alone() {
    // A constraint violation ends the statement, never the transaction.
    let (answered, rows) = batch_with_a_failure(rusqlite::ffi::SQLITE_CONSTRAINT, false).await;
    assert_eq!(answered, [true, false, true]);
    assert_eq!(rows, [1, 3, 4]);
}

/// Submits `job`, which meets another connection's write lock: the
/// caller's thread must not wait for it.
fn submit_without_waiting(engine: &Engine, job: Job) {
    let submitted = Instant::now();
    engine.submit(vec![job]).unwrap();
    assert!(
        submitted.elapsed() < BUSY_TIMEOUT / 5,
        "the caller's thread waited {:?} for the lock",
        submitted.elapsed()
    );
}

/// Lets go of `other`'s write lock in a moment.
fn release_later(other: Connection) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        other.execute_batch("ROLLBACK").unwrap();
    })
}

#[tokio::test]
async fn another_connections_write_lock_is_waited_for_by_the_writer_thread_not_the_caller() {
    let (dir, engine) = with_table().await;
    // Another process (the command line, say) holds the write lock.
    let other = Connection::open(dir.path().join("engine.db")).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let (job, pending) = Engine::job(Durability::Durable, insert(1));
    submit_without_waiting(&engine, job);
    let released = release_later(other);
    pending.wait().await.unwrap();
    released.join().unwrap();
    assert_eq!(rows(&engine).await, [1]);
}

#[tokio::test]
async fn the_load_counts_the_jobs_waiting_for_the_writer() {
    let (_dir, engine) = with_table().await;
    let held = engine.shared.writer.lock().unwrap();
    let pending: Vec<_> = (0..3)
        .map(|i| {
            let (job, pending) = Engine::job(Durability::Durable, insert(i));
            engine.hand_over(vec![job]).unwrap();
            pending
        })
        .collect();
    assert_eq!(engine.load().writer_queue, 3);
    drop(held);
    for p in pending {
        p.wait().await.unwrap();
    }
    assert_eq!(engine.load().writer_queue, 0);
}

#[test]
fn a_caller_takes_only_requests_writes_and_the_writer_thread_takes_the_rest() {
    let job = || Engine::job(Durability::Durable, insert(0)).0;
    let group = |n: usize, here: bool| Group {
        jobs: (0..n).map(|_| job()).collect(),
        here,
    };
    let mut queue = Queue::default();
    // A sweep, handed over first, then two requests' writes.
    queue
        .groups
        .extend([group(1, false), group(2, true), group(1, true)]);
    assert_eq!(
        queue.next_batch(true).len(),
        3,
        "a caller runs the requests' writes"
    );
    assert_eq!(queue.jobs(), 1, "and leaves the sweep to the writer thread");
    assert_eq!(queue.next_batch(false).len(), 1);
    // A batch takes whole groups while they fit.
    queue.groups.extend([group(MAX_BATCH - 1, true), group(2, true)]);
    assert_eq!(queue.next_batch(false).len(), MAX_BATCH - 1);
    assert_eq!(queue.next_batch(false).len(), 2);
    queue.groups.extend([group(MAX_BATCH + 1, true)]);
    assert_eq!(
        queue.next_batch(false).len(),
        MAX_BATCH + 1,
        "a group is never split"
    );
}

/// Where the WAL hook below lets another connection take the write lock,
/// once: the database, and where that connection goes.
type LockAfterCommit = (std::path::PathBuf, std::sync::mpsc::Sender<Connection>);
static LOCK_AFTER_COMMIT: Mutex<Option<LockAfterCommit>> = Mutex::new(None);

/// A WAL hook runs after its commit has let go of the write lock: another
/// connection (another process, in production) takes it right there.
fn take_the_write_lock(_: &rusqlite::hooks::Wal, _: std::ffi::c_int) -> rusqlite::Result<()> {
    if let Some((path, sender)) = LOCK_AFTER_COMMIT.lock().unwrap().take() {
        let other = Connection::open(path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        sender.send(other).unwrap();
    }
    Ok(())
}

#[tokio::test]
async fn a_durable_commit_another_connections_lock_holds_up_is_left_to_the_writer_thread() {
    let (dir, engine) = with_table().await;
    // The row a durable commit of its own writes.
    engine
        .write(Durability::Durable, |w| {
            w.execute_batch(
                "CREATE TABLE idempotency_fence (id INTEGER PRIMARY KEY, value INTEGER NOT NULL); \
                 INSERT INTO idempotency_fence VALUES (1, 0)",
            )
            .map_err(unavailable)
        })
        .await
        .unwrap();
    while engine.shared.writer.try_lock().is_err() {
        tokio::task::yield_now().await;
    }
    let (sender, taken) = std::sync::mpsc::channel();
    *LOCK_AFTER_COMMIT.lock().unwrap() = Some((dir.path().join("engine.db"), sender));
    // A relaxed write that must be durable after all (a completion whose
    // policy releases unknown outcomes): after its commit comes a durable
    // one, which finds the write lock taken.
    let (job, pending) = Engine::job(Durability::Relaxed, |w| {
        w.wal_hook(Some(take_the_write_lock));
        w.require_durable();
        insert(1)(w)
    });
    submit_without_waiting(&engine, job);
    let other = taken
        .try_recv()
        .expect("the other connection took the lock after the commit");
    let durable = engine.commits().1;
    let released = release_later(other);
    pending.wait().await.expect("answered once durable");
    released.join().unwrap();
    assert_eq!(
        engine.commits().1,
        durable + 1,
        "the writer thread's durable commit"
    );
    assert_eq!(rows(&engine).await, [1]);
}
