//! A batch on the writer's connection: one transaction, one commit, run by
//! the writer thread or by a caller that found the writer idle.
//!
//! Durability is decided per batch, before it begins (SQLite refuses to
//! change `synchronous` inside a transaction): a job is queued as durable
//! (the default) or relaxed (a completion, replay counts). With the store's
//! default `synchronous=FULL`, a batch that holds any durable job commits at
//! FULL (the WAL is synced before anyone is answered); a batch of relaxed
//! jobs only commits at NORMAL (no sync; on power loss it may be lost, a
//! killed process loses nothing). A relaxed job that finds it must be durable
//! after all says so ([`Writer::require_durable`]); its batch is then
//! followed by a small durable commit before anyone is answered, and since a
//! sync of the WAL covers every frame before it, that makes the whole batch
//! durable. That commit needs the write lock again, which another process
//! may have taken meanwhile: a caller's thread does not wait for it, and
//! leaves it and the batch's answers to the writer thread.
//!
//! Fences are allocated per batch ([`Fences`]): the counter row is read once
//! and written once, whatever the number of claims. That row is the only
//! part of the schema this module knows; nothing here knows what jobs do.

use std::cell::Cell;
use std::time::Instant;

use rusqlite::Connection;

use super::super::checkpoint::Checkpoints;
use super::{unavailable, Deliver, Durability, Ended, Job, Shared};
use crate::backend::{Result, StoreError, WriterStages};
use crate::row_mapping::u64_from;

/// What a job sees on the writer: the connection (it derefs to it), the
/// batch's fences, and a way to ask for a durable commit.
pub(in crate::sqlite) struct Writer<'c> {
    conn: &'c Connection,
    fences: &'c Fences,
    /// Set by the running job when it needs its commit durable.
    durable: &'c Cell<bool>,
}

impl std::ops::Deref for Writer<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Writer<'_> {
    /// The next fencing token: unique and larger than every one before it.
    pub(in crate::sqlite) fn next_fence(&self) -> Result<u64> {
        self.fences.next(self.conn)
    }

    /// This job was queued as relaxed, but its changes must be durable
    /// before its caller hears of them.
    pub(in crate::sqlite) fn require_durable(&self) {
        self.durable.set(true);
    }
}

/// The fencing tokens a batch hands out. The counter row is read when the
/// first claim of the batch needs a token, and the last token handed out is
/// written back once, after the jobs: a token taken by a job that was rolled
/// back is skipped, which is harmless (tokens only need to grow). The writer
/// holds the database's write lock for the whole batch, so another process
/// (the command line) reads the counter only after this batch's commit.
#[derive(Default)]
struct Fences {
    /// The last token handed out in this batch, once one has been.
    last: Cell<Option<u64>>,
}

impl Fences {
    fn next(&self, conn: &Connection) -> Result<u64> {
        let last = match self.last.get() {
            Some(last) => last,
            None => {
                let stored: i64 = conn
                    .prepare_cached("SELECT value FROM idempotency_fence WHERE id = 1")
                    .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
                    .map_err(unavailable)?;
                u64_from(stored, "fence")?
            }
        };
        let next = last
            .checked_add(1)
            .ok_or_else(|| StoreError::Corrupt("the fence counter is exhausted".into()))?;
        self.last.set(Some(next));
        Ok(next)
    }

    /// Writes the last token handed out, if any, before the batch commits.
    fn store(&self, conn: &Connection) -> rusqlite::Result<()> {
        let Some(last) = self.last.get() else {
            return Ok(());
        };
        conn.prepare_cached("UPDATE idempotency_fence SET value = ?1 WHERE id = 1")?
            .execute([crate::row_mapping::i64_from(last)])
            .map(drop)
    }
}

/// A durable commit that makes every commit before it durable too: it
/// writes one page, so the WAL is fsynced, and an fsync of the WAL covers
/// every frame written before. `may_wait`: as [`begin`].
fn durable_commit(conn: &Connection, may_wait: bool) -> rusqlite::Result<()> {
    begin(conn, may_wait)?;
    let touched = conn
        .prepare_cached("UPDATE idempotency_fence SET value = value WHERE id = 1")
        .and_then(|mut stmt| stmt.execute([]));
    match touched.and_then(|_| control(conn, "COMMIT")) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = control(conn, "ROLLBACK");
            Err(e)
        }
    }
}

/// Runs one cached transaction-control statement. These run several times
/// per batch, so they are parsed once per connection, not on every use.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Sets `synchronous` for the next transaction, if it is not already so.
fn set_synchronous(conn: &Connection, full: bool, current: &mut bool) -> rusqlite::Result<()> {
    if *current != full {
        control(
            conn,
            if full {
                "PRAGMA synchronous=FULL"
            } else {
                "PRAGMA synchronous=NORMAL"
            },
        )?;
        *current = full;
    }
    Ok(())
}

/// What running one job inside the batch's transaction left behind.
struct Ran {
    /// Its changes are kept (it succeeded).
    kept: bool,
    /// It needs a durable commit.
    durable: bool,
    /// The transaction may be gone, or its state cannot be trusted: the
    /// whole batch must be rolled back and every job in it fail.
    lost: bool,
    deliver: Deliver,
}

/// Runs `job` inside the open transaction; `savepoint` keeps a failure from
/// undoing the batch's other jobs, as long as the failure was the job's own
/// (a refused change, a bad row). A failure that may have ended the
/// transaction ([`crate::sqlite::errors::unavailable`]) or broken the
/// savepoint loses the whole batch instead.
fn run_job(conn: &Connection, fences: &Fences, job: Job, savepoint: bool) -> Ran {
    let durable = Cell::new(job.durability == Durability::Durable);
    if savepoint {
        if let Err(e) = control(conn, "SAVEPOINT job") {
            tracing::error!("sqlite: savepoint: {e}");
            return Ran {
                kept: false,
                durable: false,
                lost: true,
                deliver: Box::new(move |_, _| drop(job)),
            };
        }
    }
    let w = Writer {
        conn,
        fences,
        durable: &durable,
    };
    let (ended, deliver) = (job.run)(&w);
    let ok = ended == Ended::Done;
    let mut lost = ended == Ended::Lost;
    if savepoint && !lost {
        let end = if ok {
            control(conn, "RELEASE job")
        } else {
            control(conn, "ROLLBACK TO job").and_then(|()| control(conn, "RELEASE job"))
        };
        if let Err(e) = end {
            tracing::error!("sqlite: savepoint: {e}");
            lost = true;
        }
    }
    // Whatever the errors said: no transaction open means it was rolled back.
    lost |= conn.is_autocommit();
    Ran {
        kept: ok && !lost,
        durable: ok && durable.get(),
        lost,
        deliver,
    }
}

/// The writer's connection and what it keeps between batches. Whoever holds
/// it runs the next batch: the writer thread, or a caller that found it idle
/// (see [`super::Engine::submit`]).
pub(super) struct WriterState {
    conn: Connection,
    synchronous_full: bool,
    /// `synchronous` as set on the connection now.
    full_now: bool,
    checkpoints: Checkpoints,
}

impl WriterState {
    pub(super) fn new(conn: Connection, synchronous_full: bool, checkpoints: Checkpoints) -> WriterState {
        WriterState {
            conn,
            synchronous_full,
            full_now: synchronous_full,
            checkpoints,
        }
    }

    /// The WAL's restart, left by a batch run where nobody may wait for it.
    pub(super) fn restart_wal(&mut self) {
        self.checkpoints.after_commit(&self.conn, true);
    }

    /// Makes every commit so far durable, with a durable commit of its own.
    pub(super) fn make_durable(&mut self, stages: &WriterStages, may_wait: bool) -> rusqlite::Result<()> {
        set_synchronous(&self.conn, true, &mut self.full_now)?;
        durable_commit(&self.conn, may_wait)?;
        stages.durable_commits.inc();
        Ok(())
    }

    /// Runs `batch` in one transaction, commits it once, then answers every
    /// job. `may_wait`: this thread may wait for locks (another process's
    /// write lock, the WAL's restart); if not, what would wait is left to
    /// the writer thread: a batch whose transaction could not begin at once
    /// is handed back untouched, and a durable commit that could not begin
    /// after the batch's commit is left to it with the batch's answers.
    pub(super) fn run(&mut self, batch: Vec<Job>, shared: &Shared, may_wait: bool) -> BatchEnd {
        let began = Instant::now();
        // Decided before BEGIN: SQLite does not change it inside a transaction.
        let synchronous_full = self.synchronous_full;
        let full = synchronous_full && batch.iter().any(|j| j.durability == Durability::Durable);
        if let Err(e) = set_synchronous(&self.conn, full, &mut self.full_now) {
            tracing::error!("sqlite: cannot set synchronous: {e}");
            return BatchEnd::Done;
        }
        match begin(&self.conn, may_wait) {
            Ok(()) => {}
            Err(e) if !may_wait && is_busy(&e) => return BatchEnd::Busy(batch),
            Err(e) => {
                // Dropping the jobs drops their reply channels: callers see an error.
                tracing::error!("sqlite: cannot begin a transaction: {e}");
                return BatchEnd::Done;
            }
        }
        for job in &batch {
            let waited = began.saturating_duration_since(job.queued_at);
            shared.stages.queued.observe(waited.as_secs_f64());
        }
        let conn = &self.conn;
        let fences = Fences::default();
        let lone = batch.len() == 1;
        let mut delivers = Vec::with_capacity(batch.len());
        let (mut kept, mut need_durable, mut lost) = (0usize, false, false);
        for job in batch {
            if lost {
                // Not run: outside a transaction its writes would commit one
                // by one. Dropping it drops its reply channel: its caller
                // sees an error.
                continue;
            }
            let ran = run_job(conn, &fences, job, !lone);
            kept += usize::from(ran.kept);
            need_durable |= ran.durable;
            lost |= ran.lost;
            delivers.push(ran.deliver);
        }
        let committing = Instant::now();
        shared
            .stages
            .transaction
            .observe(committing.saturating_duration_since(began).as_secs_f64());
        // `None`: committed, not yet durable; the writer thread makes it so,
        // then answers.
        let commit = if lost {
            // The transaction is gone or cannot be trusted: nothing of the
            // batch is kept, and nobody is told otherwise. The ROLLBACK
            // fails harmlessly if SQLite already rolled back.
            let _ = control(conn, "ROLLBACK");
            tracing::error!(
                "sqlite: a batch of {} jobs was rolled back: the database refused a write",
                delivers.len()
            );
            Some(Err(
                "the database refused a write; the transaction was rolled back".to_string(),
            ))
        } else if kept == 0 {
            // Nothing to keep (a lone job failed): its writes are undone.
            Some(control(conn, "ROLLBACK").map_err(|e| e.to_string()))
        } else {
            let end = fences.store(conn).and_then(|()| control(conn, "COMMIT"));
            match end {
                Ok(()) => {
                    shared.stages.commits.inc();
                    if full {
                        shared.stages.durable_commits.inc();
                        Some(Ok(()))
                    } else if synchronous_full && need_durable {
                        // A relaxed batch with a job that must be durable.
                        match self.make_durable(&shared.stages, may_wait) {
                            Err(e) if !may_wait && is_busy(&e) => None,
                            synced => Some(synced.map_err(not_durable)),
                        }
                    } else {
                        Some(Ok(()))
                    }
                }
                Err(e) => {
                    let _ = control(conn, "ROLLBACK");
                    Some(Err(e.to_string()))
                }
            }
        };
        shared.stages.commit.observe(committing.elapsed().as_secs_f64());
        match commit {
            Some(commit) => {
                for deliver in delivers {
                    deliver(commit.clone(), &shared.stages.answered);
                }
            }
            None => shared.sync_later(delivers),
        }
        match self.checkpoints.after_commit(&self.conn, may_wait) {
            true => BatchEnd::RestartDue,
            false => BatchEnd::Done,
        }
    }
}

/// How a batch run went, for what is left to the writer thread.
pub(super) enum BatchEnd {
    Done,
    /// Committed and answered; the WAL's restart is due.
    RestartDue,
    /// Not begun: another connection holds the write lock.
    Busy(Vec<Job>),
}

/// What the callers of a batch whose durable commit failed are told.
pub(super) fn not_durable(e: rusqlite::Error) -> String {
    format!("the commit could not be made durable: {e}")
}

fn is_busy(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
}

/// `BEGIN IMMEDIATE`, waiting up to the busy timeout for another
/// connection's write lock only if `may_wait`.
fn begin(conn: &Connection, may_wait: bool) -> rusqlite::Result<()> {
    if may_wait {
        return control(conn, "BEGIN IMMEDIATE");
    }
    conn.busy_timeout(std::time::Duration::ZERO)?;
    let begun = control(conn, "BEGIN IMMEDIATE");
    conn.busy_timeout(crate::sqlite::connection::BUSY_TIMEOUT)?;
    begun
}
