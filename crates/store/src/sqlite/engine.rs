//! The connections: one writer thread with group commit, and readers.
//!
//! The writer takes the first job from its channel, drains whatever else is
//! already queued, runs the whole batch in one transaction (each job inside
//! its own savepoint, so one failing job does not undo the others), commits
//! once, and only then answers every caller: 200 concurrent claims cost one
//! fsync, not 200. Because this thread is the only writer, "read the record,
//! decide, write" needs no locking of its own. Nothing here knows what the
//! jobs do.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use rusqlite::Connection;

use crate::backend::{Result, StoreError};

const READERS: usize = 4;
const MAX_BATCH: usize = 256;

/// Hands a job's result to its caller once the batch's commit is known.
type Deliver = Box<dyn FnOnce(std::result::Result<(), String>) + Send>;
/// Runs on the writer; says whether its savepoint is kept, and how to deliver.
type Job = Box<dyn FnOnce(&Connection) -> (bool, Deliver) + Send>;

pub(crate) fn unavailable(e: rusqlite::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

pub(super) struct Engine {
    writer: Mutex<mpsc::Sender<Job>>,
    readers: Arc<Vec<Mutex<Connection>>>,
    next_reader: AtomicUsize,
    /// Transactions committed by the writer (each one fsync with FULL).
    commits: Arc<AtomicU64>,
}

fn open_connection(path: &str, synchronous_full: bool) -> Result<Connection> {
    let conn = Connection::open(path).map_err(unavailable)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(unavailable)?;
    // Room for every statement the writer repeats (queries and transaction
    // control), so none is evicted and parsed again.
    conn.set_prepared_statement_cache_capacity(64);
    let sync = if synchronous_full { "FULL" } else { "NORMAL" };
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous={sync}; PRAGMA foreign_keys=ON;"
    ))
    .map_err(unavailable)?;
    Ok(conn)
}

impl Engine {
    pub(super) fn open(path: &str, synchronous_full: bool) -> Result<Engine> {
        let writer = open_connection(path, synchronous_full)?;
        let readers = (0..READERS)
            .map(|_| open_connection(path, synchronous_full).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        let (tx, rx) = mpsc::channel::<Job>();
        let commits = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&commits);
        std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || writer_loop(writer, rx, &counter))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the sqlite writer: {e}")))?;
        Ok(Engine {
            writer: Mutex::new(tx),
            readers: Arc::new(readers),
            next_reader: AtomicUsize::new(0),
            commits,
        })
    }

    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Runs `f` on the writer thread inside the next group commit; its
    /// result once that commit is durable.
    pub(super) async fn write<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let out = f(conn);
            let ok = out.is_ok();
            let deliver: Deliver = Box::new(move |commit| {
                let _ = tx.send(commit.map_err(StoreError::Unavailable).and(out));
            });
            (ok, deliver)
        });
        self.enqueue(job)?;
        rx.await
            .map_err(|_| StoreError::Unavailable("the sqlite writer dropped the job".into()))?
    }

    /// Queues `f` with the writer's next batch without waiting for it; a
    /// failure is only logged, as `what`.
    pub(super) fn write_detached(
        &self,
        what: &'static str,
        f: impl FnOnce(&Connection) -> Result<()> + Send + 'static,
    ) {
        let job: Job = Box::new(move |conn| {
            let applied = f(conn);
            if let Err(e) = &applied {
                tracing::warn!("sqlite: {what} lost: {e}");
            }
            let deliver: Deliver = Box::new(move |commit| {
                if let Err(e) = commit {
                    tracing::warn!("sqlite: {what} lost: {e}");
                }
            });
            (applied.is_ok(), deliver)
        });
        if let Err(e) = self.enqueue(job) {
            tracing::warn!("sqlite: {what} not applied: {e}");
        }
    }

    fn enqueue(&self, job: Job) -> Result<()> {
        let sender = self
            .writer
            .lock()
            .map_err(|_| StoreError::Unavailable("writer lock poisoned".into()))?;
        sender
            .send(job)
            .map_err(|_| StoreError::Unavailable("the sqlite writer has stopped".into()))
    }

    /// Runs `f` on one of the reader connections, off the async runtime.
    pub(super) async fn read<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let i = self.next_reader.fetch_add(1, Ordering::Relaxed) % self.readers.len();
        let readers = Arc::clone(&self.readers);
        tokio::task::spawn_blocking(move || {
            // A std Mutex: the guard lives only inside this blocking closure.
            let conn = readers[i]
                .lock()
                .map_err(|_| StoreError::Unavailable("reader lock poisoned".into()))?;
            f(&conn)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("reader task: {e}")))?
    }
}

/// Runs one cached transaction-control statement. These run several times
/// per job, so they are parsed once per connection, not on every use.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

fn writer_loop(conn: Connection, rx: mpsc::Receiver<Job>, commits: &AtomicU64) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if let Err(e) = control(&conn, "BEGIN IMMEDIATE") {
            // Dropping the jobs drops their reply channels: callers see an error.
            tracing::error!("sqlite: cannot begin a transaction: {e}");
            continue;
        }
        let mut delivers = Vec::with_capacity(batch.len());
        for job in batch {
            if let Err(e) = control(&conn, "SAVEPOINT job") {
                tracing::error!("sqlite: savepoint: {e}");
                continue;
            }
            let (ok, deliver) = job(&conn);
            let end = if ok {
                control(&conn, "RELEASE job")
            } else {
                control(&conn, "ROLLBACK TO job").and_then(|()| control(&conn, "RELEASE job"))
            };
            if let Err(e) = end {
                tracing::error!("sqlite: savepoint: {e}");
            }
            delivers.push(deliver);
        }
        let commit = control(&conn, "COMMIT").map_err(|e| e.to_string());
        if commit.is_err() {
            let _ = control(&conn, "ROLLBACK");
        } else {
            commits.fetch_add(1, Ordering::Relaxed);
        }
        for deliver in delivers {
            deliver(commit.clone());
        }
    }
}
