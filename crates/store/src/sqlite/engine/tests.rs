use super::*;

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

#[tokio::test]
async fn the_wal_starts_over_while_the_writer_never_rests() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.db");
    let engine = Engine::open(path.to_str().unwrap(), false).unwrap();
    engine
        .write(Durability::Relaxed, |w| {
            w.execute_batch("CREATE TABLE t (x BLOB)").map_err(unavailable)
        })
        .await
        .unwrap();
    // 8,000 commits of a page each, back to back: a WAL that never
    // started over would hold them all (over 32 MiB).
    for _ in 0..8_000 {
        engine
            .write(Durability::Relaxed, |w| {
                w.execute("INSERT INTO t (x) VALUES (zeroblob(4000))", [])
                    .map(drop)
                    .map_err(unavailable)
            })
            .await
            .unwrap();
    }
    let wal = std::fs::metadata(dir.path().join("engine.db-wal")).unwrap().len();
    assert!(wal < 8 * 1024 * 1024, "the WAL grew to {wal} bytes");
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
