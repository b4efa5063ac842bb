//! The connections: one writer with group commit, and readers; the WAL's
//! checkpoints are `super::checkpoint`'s.
//!
//! The writer takes the first group of jobs from its queue, drains whatever
//! else is already queued, runs the whole batch in one transaction, commits
//! once, and only then answers every caller: 200 concurrent claims cost one
//! fsync, not 200. A request's writes run on its own thread when the writer
//! is idle ([`Engine::submit`]): at low load a claim then costs one sync and
//! no thread wake-ups; while a batch runs, the writes that arrive meanwhile
//! queue for the writer thread, which takes them as the next batch, and so
//! do those that arrive while it has work of its own waiting. Writes no
//! request waits for (the sweeper, operators, replay counts) are only ever
//! run by the writer thread. Each job of a batch with several runs
//! inside its own savepoint, so one failing job does not undo the others; a
//! batch of one job needs none (if it fails, the transaction is rolled back
//! instead). A group (the calls of one `/v1/batch`) is never split across
//! transactions. Whoever runs a batch holds the writer's connection, the
//! only one that writes, so "read the record, decide, write" needs no
//! locking of its own. How a batch commits, and how durably, is
//! [`writer`]'s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;
use rusqlite::Connection;

use super::checkpoint::Checkpoints;
use super::connection::open_connection;
use super::errors::unavailable;
use crate::backend::{Outage, Result, StoreError, WriterStages};

mod queue;
mod writer;

use queue::{Group, Queue, Queued};
pub(super) use writer::Writer;
use writer::{BatchEnd, WriterState};

const READERS: usize = 4;

/// Hands a job's result to its caller once the batch's commit is known;
/// the histogram times the hand-over ([`WriterStages::answered`]).
type Deliver = Box<dyn FnOnce(std::result::Result<(), String>, &Histogram) + Send>;
/// Runs on the writer; says how it ended, and how to deliver.
type Run = Box<dyn FnOnce(&Writer<'_>) -> (Ended, Deliver) + Send>;

/// How a job ended inside its batch's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its changes are to be kept.
    Done,
    /// It failed on its own (a refused change, a bad row): its changes
    /// alone are undone.
    Failed,
    /// It failed with [`StoreError::TransactionLost`]: the transaction may
    /// be gone, and the whole batch with it.
    Lost,
}

impl Ended {
    fn of<R>(out: &Result<R>) -> Ended {
        match out {
            Ok(_) => Ended::Done,
            Err(StoreError::TransactionLost(_)) => Ended::Lost,
            Err(_) => Ended::Failed,
        }
    }
}

/// What a caller is told of an error: a lost transaction is, to it, an
/// unavailable database.
pub(super) fn to_caller<R>(out: Result<R>) -> Result<R> {
    out.map_err(|e| match e {
        StoreError::TransactionLost(source) => StoreError::Unavailable {
            outage: Outage::Database,
            source,
        },
        other => other,
    })
}

/// How a job's commit must reach the disk before its caller is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Durability {
    /// Fsynced (at the store's `synchronous=FULL`).
    Durable,
    /// May be lost on power loss or an operating system crash, until a later
    /// durable commit; never torn, and never lost when only the process dies.
    Relaxed,
}

/// One piece of work for the writer.
pub(super) struct Job {
    run: Run,
    durability: Durability,
    /// When it was made, just before it was handed to the writer.
    queued_at: Instant,
}

impl Job {
    fn new(run: Run, durability: Durability) -> Job {
        Job {
            run,
            durability,
            queued_at: Instant::now(),
        }
    }
}

/// A job's result, when it was handed over, and where to time the hand-over.
type Delivered<R> = (Result<R>, Instant, Histogram);

/// Where a job's result arrives once its batch has committed.
pub(super) struct Pending<R>(tokio::sync::oneshot::Receiver<Delivered<R>>);

impl<R> Pending<R> {
    pub(super) async fn wait(self) -> Result<R> {
        let (out, sent, answered) = self
            .0
            .await
            .map_err(|_| StoreError::internal("the sqlite writer dropped the job"))?;
        answered.observe(sent.elapsed().as_secs_f64());
        out
    }
}

struct Shared {
    queue: Mutex<Queue>,
    /// The writer thread waits here for work.
    work: Condvar,
    /// Held by whoever runs a batch.
    writer: Mutex<WriterState>,
    readers: Vec<Mutex<Connection>>,
    next_reader: AtomicUsize,
    /// The writer's stage timers and its commit and checkpoint counters.
    stages: WriterStages,
    /// Reads in flight, and of those the ones holding a reader connection.
    reading: AtomicUsize,
    reading_held: AtomicUsize,
}

/// Counts one while alive (a read in flight, a reader held).
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize) -> Counted<'a> {
        count.fetch_add(1, Ordering::Relaxed);
        Counted(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The connections right now: readers in use and waited for, jobs queued
/// for the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct EngineLoad {
    pub readers: usize,
    pub readers_held: usize,
    pub reads_waiting: usize,
    pub writer_queue: usize,
}

impl Shared {
    fn queue(&self) -> Result<MutexGuard<'_, Queue>> {
        self.queue
            .lock()
            .map_err(|_| StoreError::internal("the sqlite writer's queue is poisoned"))
    }

    /// Takes the next batch, and runs it if there is one; a restart left
    /// for the writer thread is noted. `may_wait`: as [`WriterState::run`];
    /// a caller that may not wait only takes requests' own writes.
    fn run_next(&self, writer: &mut WriterState, may_wait: bool) -> Result<()> {
        let batch = { self.queue()?.next_batch(!may_wait) };
        if batch.is_empty() {
            return Ok(());
        }
        match writer.run(batch, self, may_wait) {
            BatchEnd::Done => {}
            BatchEnd::RestartDue => {
                self.queue()?.restart_due = true;
                self.work.notify_one();
            }
            BatchEnd::Busy(batch) => {
                // First in line again, for the writer thread, which waits.
                self.queue()?.groups.push_front(Group {
                    jobs: batch,
                    here: false,
                });
                self.work.notify_one();
            }
        }
        Ok(())
    }

    /// Leaves the answers of a committed batch to the writer thread, which
    /// makes the commit durable before it answers.
    fn sync_later(&self, delivers: Vec<Deliver>) {
        match self.queue() {
            Ok(mut queue) => {
                queue.sync_due.extend(delivers);
                self.work.notify_one();
            }
            Err(e) => {
                let e = e.to_string();
                for deliver in delivers {
                    deliver(Err(e.clone()), &self.stages.answered);
                }
            }
        }
    }

    /// The writer broke (a job panicked while holding it): every queued job
    /// is dropped, so its caller sees an error, and no more are taken.
    fn stop(&self) {
        let mut queue = match self.queue.lock() {
            Ok(queue) => queue,
            Err(poisoned) => poisoned.into_inner(),
        };
        queue.stopped = true;
        queue.groups.clear();
        queue.sync_due.clear();
        self.work.notify_all();
    }
}

/// Runs batches as they are queued, and what batches run elsewhere left
/// to it: the syncs their callers may not wait for, and the WAL's restarts.
/// Returns once the engine is dropped and its queue is empty.
fn writer_thread(shared: &Shared) {
    loop {
        let (restart, sync_due) = {
            let Ok(mut queue) = shared.queue.lock() else {
                return;
            };
            while !queue.has_work() {
                if queue.stopped {
                    return;
                }
                queue = match shared.work.wait(queue) {
                    Ok(queue) => queue,
                    Err(_) => return,
                };
            }
            (
                std::mem::take(&mut queue.restart_due),
                std::mem::take(&mut queue.sync_due),
            )
        };
        let Ok(mut writer) = shared.writer.lock() else {
            shared.stop();
            return;
        };
        if !sync_due.is_empty() {
            let synced = writer
                .make_durable(&shared.stages, true)
                .map_err(writer::not_durable);
            for deliver in sync_due {
                deliver(synced.clone(), &shared.stages.answered);
            }
        }
        if restart {
            writer.restart_wal();
        }
        if shared.run_next(&mut writer, true).is_err() {
            drop(writer);
            shared.stop();
            return;
        }
    }
}

/// The writer's queue and the readers; cheap to clone. The writer thread
/// stops when the last clone is dropped (and the checkpointer with it).
#[derive(Clone)]
pub(super) struct Engine {
    shared: Arc<Shared>,
    _open: Arc<Open>,
}

/// Alive while an [`Engine`] is: the writer thread holds [`Shared`], not this.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        if let Ok(mut queue) = self.0.queue.lock() {
            queue.stopped = true;
        }
        self.0.work.notify_all();
    }
}

/// Logs a detached write that was dropped without running (its batch could
/// not begin, or the writer stopped), as it logs one that failed.
struct NotRun(Option<&'static str>);

impl NotRun {
    fn ran(&mut self) {
        self.0 = None;
    }
}

impl Drop for NotRun {
    fn drop(&mut self) {
        if let Some(what) = self.0 {
            tracing::warn!("sqlite: {what} lost: the writer did not run it");
        }
    }
}

impl Engine {
    pub(super) fn open(path: &str, synchronous_full: bool) -> Result<Engine> {
        let writer = open_connection(path, synchronous_full)?;
        let readers = (0..READERS)
            .map(|_| open_connection(path, synchronous_full).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        let stages = WriterStages::default();
        let checkpoints = Checkpoints::start(
            &writer,
            open_connection(path, synchronous_full)?,
            stages.checkpoints.clone(),
        )?;
        let shared = Arc::new(Shared {
            queue: Mutex::default(),
            work: Condvar::new(),
            writer: Mutex::new(WriterState::new(writer, synchronous_full, checkpoints)),
            readers,
            next_reader: AtomicUsize::new(0),
            stages,
            reading: AtomicUsize::new(0),
            reading_held: AtomicUsize::new(0),
        });
        let theirs = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || writer_thread(&theirs))
            .map_err(|e| StoreError::internal(format!("cannot start the sqlite writer: {e}")))?;
        Ok(Engine {
            _open: Arc::new(Open(Arc::clone(&shared))),
            shared,
        })
    }

    /// Transactions committed by the writer, and how many of them durably.
    pub(super) fn commits(&self) -> (u64, u64) {
        let stages = &self.shared.stages;
        (stages.commits.get(), stages.durable_commits.get())
    }

    /// The writer's stage timers.
    pub(super) fn stages(&self) -> WriterStages {
        self.shared.stages.clone()
    }

    pub(super) fn load(&self) -> EngineLoad {
        let s = &self.shared;
        let reading = s.reading.load(Ordering::Relaxed);
        let held = s.reading_held.load(Ordering::Relaxed);
        EngineLoad {
            readers: s.readers.len(),
            readers_held: held.min(s.readers.len()),
            reads_waiting: reading.saturating_sub(held),
            writer_queue: s.queue().map_or(0, |q| q.jobs()),
        }
    }

    /// A writer job running `f`, and where its result arrives once the
    /// batch that carried it has committed (as durably as `durability` says).
    pub(super) fn job<R: Send + 'static>(
        durability: Durability,
        f: impl FnOnce(&Writer<'_>) -> Result<R> + Send + 'static,
    ) -> (Job, Pending<R>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let run: Run = Box::new(move |w| {
            let out = f(w);
            let ended = Ended::of(&out);
            let deliver: Deliver = Box::new(move |commit, answered| {
                let out = commit
                    .map_err(|e| StoreError::unavailable(Outage::Database, e))
                    .and(to_caller(out));
                let _ = tx.send((out, Instant::now(), answered.clone()));
            });
            (ended, deliver)
        });
        (Job::new(run, durability), Pending(rx))
    }

    /// Queues `jobs` to run in one transaction, and runs the next batch
    /// here, on the caller's thread, if the writer is idle: its caller's
    /// answer is then ready when this returns, with no thread woken on the
    /// way. Otherwise the writer thread takes them with its next batch.
    /// Callable from any thread: a reader queues the writes it found
    /// necessary without a trip back to the async runtime. Blocks for one
    /// batch of requests' own writes at most (its commit's sync included),
    /// and never for a lock.
    pub(super) fn submit(&self, jobs: Vec<Job>) -> Result<()> {
        let shared = &self.shared;
        match self.enqueue(jobs, true)? {
            Queued::Nothing => return Ok(()),
            // The writer thread's own work goes first: callers that took the
            // writer whenever it was free could keep a restart, a sync or a
            // sweep from that thread for as long as they kept coming.
            Queued::BehindTheWritersOwn => {
                shared.work.notify_one();
                return Ok(());
            }
            Queued::Ready => {}
        }
        match shared.writer.try_lock() {
            Ok(mut writer) => {
                let ran = shared.run_next(&mut writer, false);
                drop(writer);
                if ran.is_err() {
                    shared.stop();
                }
                // What arrived meanwhile is the writer thread's.
                if shared.queue().is_ok_and(|q| q.has_work()) {
                    shared.work.notify_one();
                }
            }
            Err(TryLockError::WouldBlock) => shared.work.notify_one(),
            Err(TryLockError::Poisoned(_)) => shared.stop(),
        }
        Ok(())
    }

    /// Queues `jobs` for the writer thread, which runs them with its next
    /// batch: for writes whose caller is no request (the sweeper, an
    /// operator, replay counts), which need not hold up the caller's thread.
    fn hand_over(&self, jobs: Vec<Job>) -> Result<()> {
        if !matches!(self.enqueue(jobs, false)?, Queued::Nothing) {
            self.shared.work.notify_one();
        }
        Ok(())
    }

    /// Adds a group to the queue (`here`: see [`Group`]).
    fn enqueue(&self, jobs: Vec<Job>, here: bool) -> Result<Queued> {
        if jobs.is_empty() {
            return Ok(Queued::Nothing);
        }
        let mut queue = self.shared.queue()?;
        if queue.stopped {
            return Err(StoreError::internal("the sqlite writer has stopped"));
        }
        queue.groups.push_back(Group { jobs, here });
        Ok(match queue.writer_thread_due() {
            true => Queued::BehindTheWritersOwn,
            false => Queued::Ready,
        })
    }

    /// Runs `f` on the writer thread inside the next group commit; its
    /// result once that commit is as durable as `durability` says.
    pub(super) async fn write<R: Send + 'static>(
        &self,
        durability: Durability,
        f: impl FnOnce(&Writer<'_>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (job, pending) = Engine::job(durability, f);
        self.hand_over(vec![job])?;
        pending.wait().await
    }

    /// Queues `f` with the writer's next batch without waiting for it; a
    /// failure is only logged, as `what`.
    pub(super) fn write_detached(
        &self,
        what: &'static str,
        durability: Durability,
        f: impl FnOnce(&Writer<'_>) -> Result<()> + Send + 'static,
    ) {
        let mut not_run = NotRun(Some(what));
        let run: Run = Box::new(move |w| {
            not_run.ran();
            let applied = f(w);
            let ended = Ended::of(&applied);
            if let Err(e) = &applied {
                tracing::warn!("sqlite: {what} lost: {e}");
            }
            let deliver: Deliver = Box::new(move |commit, _| {
                if let Err(e) = commit {
                    tracing::warn!("sqlite: {what} lost: {e}");
                }
            });
            (ended, deliver)
        });
        // Refused only once the writer has stopped: the job, dropped, says so.
        let _ = self.hand_over(vec![Job::new(run, durability)]);
    }

    /// Runs `f` on a reader connection here, on the caller's thread, if one
    /// is free: a claim's short look at its record then costs no trip to
    /// another thread and back. With every reader busy, as [`Engine::read`].
    pub(super) async fn read_here<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let shared = &self.shared;
        let first = shared.next_reader.fetch_add(1, Ordering::Relaxed);
        let n = shared.readers.len();
        for i in 0..n {
            if let Ok(conn) = shared.readers[(first + i) % n].try_lock() {
                let _reading = Counted::new(&shared.reading);
                let _held = Counted::new(&shared.reading_held);
                return to_caller(f(&conn));
            }
        }
        self.read(f).await
    }

    /// Runs `f` on one of the reader connections, off the async runtime.
    pub(super) async fn read<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let shared = Arc::clone(&self.shared);
        tokio::task::spawn_blocking(move || {
            let _reading = Counted::new(&shared.reading);
            let i = shared.next_reader.fetch_add(1, Ordering::Relaxed) % shared.readers.len();
            // A std Mutex: the guard lives only inside this blocking closure.
            let conn = shared.readers[i]
                .lock()
                .map_err(|_| StoreError::internal("reader lock poisoned"))?;
            let _held = Counted::new(&shared.reading_held);
            to_caller(f(&conn))
        })
        .await
        .map_err(|e| StoreError::internal(format!("reader task: {e}")))?
    }
}

#[cfg(test)]
mod tests;
