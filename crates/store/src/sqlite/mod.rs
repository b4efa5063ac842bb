//! SQLite, the embedded default: WAL, durable claims (`synchronous=FULL`)
//! with group commit, one writer, readers in parallel.
//!
//! Every write runs on the writer's one connection (`engine`), batched into
//! one transaction per group commit: on the request's own thread when the
//! writer is idle, on the writer thread otherwise. Because that connection
//! is the only one that writes, "read the record, decide, write" needs no
//! locking of its own, and fencing tokens are handed out per batch from one
//! counter row.
//!
//! A claim is looked at on a reader connection first (`claim`). Claims that
//! only need to answer (mismatch, in progress, unknown, expired) or replay a
//! completed record are decided there, in parallel, and never queue behind
//! writes; a replay's `replay_count` increment goes to the writer afterwards
//! without being awaited (see `crate::replays`). A claim that must write
//! is queued to the writer by the reader itself, so a new key costs one trip
//! off the async runtime, not two. The calls of one `/v1/batch` are looked
//! at together on one reader and written in one transaction.
//!
//! Completions commit without an fsync of their own (`synchronous=NORMAL`
//! for a batch that holds nothing else) unless the record's policy releases
//! unknown outcomes: losing one on power loss leaves the record in progress,
//! so it turns unknown when its lease runs out and is never executed again
//! (docs/contract.md §5).

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use async_trait::async_trait;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;
use rusqlite::{params, Connection, OptionalExtension};

use crate::backend::{
    Answer, Backend, Call, ClaimOutcome, KeyHistory, Listing, Lookup, OpenRecords, Peeked, PoolStats,
    RecordInfo, Resolution, Result, StoreError, SweepPolicy, SweepReport, WriterStages,
};
use crate::conditions::expand;
use crate::conditions::OPEN_RECORDS;
use crate::effects;
use crate::log_ids::LogIds;
use crate::replay_counts::ReplayTally;
use crate::row_mapping::i64_from;
use crate::sealing::Seal;

/// A statement about the current record: `?1` is its key (the scope
/// digest); the statement's own parameters start at `?2`.
macro_rules! key_where {
    () => {
        "scope_digest = ?1"
    };
}

mod checkpoint;
mod claim;
mod connection;
mod engine;
mod errors;
mod generation;
mod operations;
mod rows;
mod stored;
mod sweep;

use engine::{Durability, Engine, Writer};
use errors::unavailable;
use generation::{apply_replays, Journal};
use operations::load_and_carry_out;
use rows::{query_events, query_infos, INFO_COLUMNS};

/// The schema, one file per version, applied in order.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("migrations/0001_records.sql")),
    (2, include_str!("migrations/0002_generations.sql")),
    (3, include_str!("migrations/0003_event_reasons.sql")),
    (4, include_str!("migrations/0004_scope_digest.sql")),
    (5, include_str!("migrations/0005_response_keys.sql")),
    (6, include_str!("migrations/0006_event_generations.sql")),
    (7, include_str!("migrations/0007_stored_bytes.sql")),
    (8, include_str!("migrations/0008_event_codes.sql")),
];

/// Unknown records for operators: `?1` the limit.
static LIST_UNKNOWN: LazyLock<String> = LazyLock::new(|| {
    expand(&format!(
        "SELECT {}, NULL AS ended_at FROM idempotency_records WHERE {{unknown}} AND archived_at IS NULL \
         ORDER BY created_at LIMIT ?1",
        *INFO_COLUMNS
    ))
});
/// In-progress records created at `?1` or before: `?2` the limit.
static LIST_STUCK: LazyLock<String> = LazyLock::new(|| {
    expand(&format!(
        "SELECT {}, NULL AS ended_at FROM idempotency_records WHERE {{leased}} AND created_at <= ?1 \
         ORDER BY created_at LIMIT ?2",
        *INFO_COLUMNS
    ))
});
pub struct Sqlite {
    engine: Engine,
    /// Replays served from a reader, not yet counted in `replay_count`.
    replays: Arc<ReplayTally>,
    log_ids: LogIds,
    seal: Seal,
}

/// A writer job's answer and the transitions it recorded, logged once the
/// batch that carried them has committed.
type Logged = (Answer, Journal);

impl Sqlite {
    /// `seal`: how stored responses are sealed at rest.
    pub fn open(path: &str, synchronous_full: bool, log_ids: LogIds, seal: Seal) -> Result<Sqlite> {
        Ok(Sqlite {
            engine: Engine::open(path, synchronous_full)?,
            replays: Arc::default(),
            log_ids,
            seal,
        })
    }

    /// How many transactions the writer has committed: with group commit,
    /// far fewer than the writes it carried out.
    pub fn commits(&self) -> u64 {
        self.engine.commits().0
    }

    /// Of [`Sqlite::commits`], how many were fsynced before anyone was
    /// answered (all of them at `synchronous=NORMAL`: none).
    pub fn durable_commits(&self) -> u64 {
        self.engine.commits().1
    }

    /// A writer job that records transitions: its events are logged once the
    /// batch that carried them has committed.
    async fn write_logged<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Writer<'_>, &mut Journal) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (out, journal) = self
            .engine
            .write(Durability::Durable, move |w| {
                let mut journal = Journal::new();
                f(w, &mut journal).map(|out| (out, journal))
            })
            .await?;
        journal.iter().for_each(|e| e.log(&self.log_ids, &Trace::NONE));
        Ok(out)
    }

    /// Decides `calls` together: claims are looked at on one reader, and
    /// every write they and the other calls need goes to the writer as one
    /// group (one transaction, a savepoint per call).
    async fn decide_calls(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        let n = calls.len();
        let traces: Vec<Trace> = calls.iter().map(|c| c.trace().clone()).collect();
        let settled: Result<Vec<Slot>> = if calls.iter().any(|c| matches!(c, Call::Claim { .. })) {
            let (engine, replays, seal) = (self.engine.clone(), Arc::clone(&self.replays), self.seal.clone());
            self.engine
                .read_here(move |conn| Ok(decide_on_reader(conn, (&engine, &replays, &seal), calls, now)))
                .await
        } else {
            Ok(queue_writes(&self.engine, &self.seal, calls, now))
        };
        let slots = match settled {
            Ok(slots) => slots,
            Err(e) => return (0..n).map(|_| Err(e.clone())).collect(),
        };
        let mut answers = Vec::with_capacity(n);
        for (slot, trace) in slots.into_iter().zip(&traces) {
            answers.push(match slot {
                Slot::Ready(answer) => engine::to_caller(answer),
                Slot::Pending(pending) => pending.wait().await.map(|(answer, journal)| {
                    journal.iter().for_each(|e| e.log(&self.log_ids, trace));
                    answer
                }),
            });
        }
        answers
    }

    async fn decide_one(&self, call: Call, now: i64) -> Result<Answer> {
        self.decide_calls(vec![call], now)
            .await
            .pop()
            .unwrap_or_else(|| Err(StoreError::internal("no answer")))
    }
}

/// Where a call's answer comes from.
enum Slot {
    /// Decided without writing (or refused).
    Ready(Result<Answer>),
    /// From the writer, once its batch has committed.
    Pending(engine::Pending<Logged>),
}

/// What a writer job does for one call.
type Work = Box<dyn FnOnce(&Writer<'_>, &mut Journal) -> Result<Answer> + Send>;

/// The writer job that carries out `call` (a claim that no reader looked at
/// goes to [`claim::write_job`] as if its record were absent: its insert
/// finds out).
fn write_job(call: Call, seal: &Seal, now: i64) -> (engine::Job, engine::Pending<Logged>) {
    let seal = seal.clone();
    let (durability, work): (Durability, Work) = match call {
        Call::Claim { req, deadline } => return claim::write_job(req, seal, deadline, now, true),
        Call::Complete { req, body } => (
            // Durable after all when the record's policy frees the key on
            // an unknown outcome (the effect's `durable`, see `operations`).
            Durability::Relaxed,
            Box::new(move |w, journal| {
                let body = req.body_stored.then_some(&body[..]);
                let effect_of = |l: Option<&_>| effects::complete(l, &req, body, now);
                load_and_carry_out(w, journal, (&req.scope, &seal), now, effect_of).map(Answer::Fence)
            }),
        ),
        Call::Release(req) => (
            Durability::Durable,
            Box::new(move |w, journal| {
                let effect_of = |l: Option<&_>| effects::release(l, &req.scope, req.fence);
                load_and_carry_out(w, journal, (&req.scope, &seal), now, effect_of).map(Answer::Fence)
            }),
        ),
        Call::MarkUnknown(req) => (
            Durability::Durable,
            Box::new(move |w, journal| {
                let effect_of = |l: Option<&_>| effects::mark_unknown(l, req.fence, now);
                load_and_carry_out(w, journal, (&req.scope, &seal), now, effect_of).map(Answer::Fence)
            }),
        ),
        Call::Abandon(req) => (
            Durability::Durable,
            Box::new(move |w, journal| {
                let effect_of = |l: Option<&_>| effects::abandon(l, &req.scope, req.attempt.as_str());
                load_and_carry_out(w, journal, (&req.scope, &seal), now, effect_of).map(Answer::Fence)
            }),
        ),
    };
    Engine::job(durability, move |w| {
        let mut journal = Journal::new();
        work(w, &mut journal).map(|answer| (answer, journal))
    })
}

/// Queues the writes of `calls` as one group; where each answer will come from.
fn queue_writes(engine: &Engine, seal: &Seal, calls: Vec<Call>, now: i64) -> Vec<Slot> {
    let (jobs, pending): (Vec<_>, Vec<_>) = calls.into_iter().map(|c| write_job(c, seal, now)).unzip();
    submit(engine, jobs, pending.into_iter().map(Slot::Pending).collect())
}

/// On a reader: decides the claims it can, then queues every write as one
/// group, from this thread.
fn decide_on_reader(
    conn: &Connection,
    (engine, replays, seal): (&Engine, &Arc<ReplayTally>, &Seal),
    calls: Vec<Call>,
    now: i64,
) -> Vec<Slot> {
    let mut jobs = Vec::with_capacity(calls.len());
    let mut slots = Vec::with_capacity(calls.len());
    for call in calls {
        let job = match call {
            Call::Claim { req, deadline } => {
                match claim::probe(conn, (engine, replays, seal), req, deadline, now) {
                    Ok(claim::Probed::Decided(outcome)) => {
                        slots.push(Slot::Ready(Ok(Answer::Claim(outcome))));
                        continue;
                    }
                    Ok(claim::Probed::Write(job, pending)) => (job, pending),
                    Err(e) => {
                        slots.push(Slot::Ready(Err(e)));
                        continue;
                    }
                }
            }
            other => write_job(other, seal, now),
        };
        jobs.push(job.0);
        slots.push(Slot::Pending(job.1));
    }
    submit(engine, jobs, slots)
}

fn submit(engine: &Engine, jobs: Vec<engine::Job>, slots: Vec<Slot>) -> Vec<Slot> {
    match engine.submit(jobs) {
        Ok(()) => slots,
        // The jobs are gone, and with them their senders: every pending
        // answer fails with the writer's error.
        Err(e) => slots
            .into_iter()
            .map(|slot| match slot {
                Slot::Pending(_) => Slot::Ready(Err(e.clone())),
                ready => ready,
            })
            .collect(),
    }
}

fn fence_answer(answer: Result<Answer>) -> Result<FenceReply> {
    match answer? {
        Answer::Fence(reply) => Ok(reply),
        Answer::Claim(_) => Err(StoreError::internal("a claim's answer to a fence call")),
    }
}

#[async_trait]
impl Backend for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn log_ids(&self) -> &LogIds {
        &self.log_ids
    }

    async fn migrate(&self) -> Result<()> {
        self.engine
            .write(Durability::Durable, |conn| {
                conn.execute_batch("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)")
                    .map_err(unavailable)?;
                let applied: Option<i64> = conn
                    .query_row("SELECT max(version) FROM schema_migrations", [], |r| r.get(0))
                    .map_err(unavailable)?;
                crate::backend::known_schema(applied, MIGRATIONS.last().map(|(v, _)| *v))?;
                for (version, sql) in MIGRATIONS {
                    let done: Option<i64> = conn
                        .query_row("SELECT version FROM schema_migrations WHERE version = ?1", [version], |r| r.get(0))
                        .optional()
                        .map_err(unavailable)?;
                    if done.is_none() {
                        conn.execute_batch(sql).map_err(unavailable)?;
                        conn.execute(
                            "INSERT INTO schema_migrations (version, applied_at) VALUES (?1, ?2)",
                            params![version, crate::clock::system_now()],
                        )
                        .map_err(unavailable)?;
                    }
                }
                // Fences never go back: a file copied back from a backup holds
                // the counter as it was then, behind fences handed out since.
                // Every one of those is below the clock of its moment (the
                // counter moves one a claim, the clock a million a second).
                conn.execute(
                    "UPDATE idempotency_fence SET value = max(value, ?1) WHERE id = 1",
                    [crate::clock::system_now_us()],
                )
                .map_err(unavailable)?;
                Ok(())
            })
            .await
    }

    async fn ping(&self) -> Result<()> {
        self.engine
            .read(|conn| {
                conn.query_row("SELECT value FROM idempotency_fence WHERE id = 1", [], |r| {
                    r.get::<_, i64>(0)
                })
                .map_err(unavailable)?;
                Ok(())
            })
            .await
    }

    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Peeked> {
        let (engine, replays, seal) = (self.engine.clone(), Arc::clone(&self.replays), self.seal.clone());
        let req = req.clone();
        self.engine
            .read(move |conn| claim::peek(conn, (&engine, &replays, &seal), &req, now))
            .await
    }

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        let call = Call::Claim {
            req: req.clone(),
            deadline,
        };
        match self.decide_one(call, now).await? {
            Answer::Claim(outcome) => Ok(outcome),
            Answer::Fence(_) => Err(StoreError::internal("a fence answer to a claim")),
        }
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        let body = if req.body_stored {
            bytes::Bytes::copy_from_slice(body)
        } else {
            bytes::Bytes::new()
        };
        let call = Call::Complete {
            req: req.clone(),
            body,
        };
        fence_answer(self.decide_one(call, now).await)
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        fence_answer(self.decide_one(Call::Release(req.clone()), now).await)
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        fence_answer(self.decide_one(Call::Abandon(req.clone()), now).await)
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        fence_answer(self.decide_one(Call::MarkUnknown(req.clone()), now).await)
    }

    async fn decide(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        self.decide_calls(calls, now).await
    }

    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        // Operators see every replay served so far: pending counts are
        // applied first (and any flush already queued is committed by then).
        let tally = Arc::clone(&self.replays);
        if let Err(e) = self
            .engine
            .write(Durability::Relaxed, move |w| apply_replays(w, tally.take()))
            .await
        {
            tracing::warn!("sqlite: replay counts not applied before a lookup: {e}");
        }
        let q = q.clone();
        let seal = self.seal.clone();
        self.engine
            .read(move |conn| {
                const MATCH: &str = "tenant = ?1 AND idem_key = ?2 AND (?3 IS NULL OR route = ?3) \
                                     AND (?4 IS NULL OR principal = ?4) AND (?5 IS NULL OR namespace = ?5)";
                let ns = q.namespace.map(|n| n.as_str());
                let sql = format!(
                    "SELECT {cols}, NULL AS ended_at, 1 AS current FROM idempotency_records WHERE {MATCH} \
                     UNION ALL SELECT {cols}, ended_at, 0 FROM idempotency_history WHERE {MATCH} \
                     ORDER BY current DESC, generation DESC LIMIT ?6",
                    cols = *INFO_COLUMNS
                );
                let records = query_infos(
                    conn,
                    &sql,
                    params![q.tenant, q.key, q.route, q.principal, ns, limit],
                    &seal,
                )?;
                let sql = crate::row_mapping::events_matching(MATCH, "?6");
                let events_limit = limit.saturating_mul(16);
                let events = query_events(
                    conn,
                    &sql,
                    params![q.tenant, q.key, q.route, q.principal, ns, events_limit],
                )?;
                Ok(KeyHistory { records, events })
            })
            .await
    }

    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        let seal = self.seal.clone();
        self.engine
            .read(move |conn| match which {
                Listing::Unknown => query_infos(conn, &LIST_UNKNOWN, params![limit], &seal),
                Listing::Stuck { older_than_ms } => {
                    let before = now.saturating_sub(i64_from(older_than_ms));
                    query_infos(conn, &LIST_STUCK, params![before, limit], &seal)
                }
            })
            .await
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool> {
        let (scope, how, reason) = (scope.clone(), how.clone(), reason.map(str::to_string));
        let seal = self.seal.clone();
        self.write_logged(move |w, journal| {
            let effect_of = |l: Option<&_>| effects::resolve(l, &how, reason.as_deref(), now);
            load_and_carry_out(w, journal, (&scope, &seal), now, effect_of)
        })
        .await
    }

    /// A batch in slices of at most `sweep::SLICE` records a phase, each
    /// its own writer job: requests queued meanwhile wait for one slice,
    /// never for the whole batch.
    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        let mut left = policy.batch;
        while left > 0 {
            let slice = SweepPolicy {
                batch: left.min(sweep::SLICE),
                ..*policy
            };
            let seal = self.seal.clone();
            let part = self
                .write_logged(move |w, journal| sweep::sweep(w, journal, &seal, now, slice))
                .await?;
            report.add(part);
            if !part.full(slice.batch) {
                break;
            }
            left -= slice.batch;
        }
        Ok(report)
    }

    async fn open_records(&self) -> Result<OpenRecords> {
        self.engine
            .read(|conn| {
                let rows = rows::query_all(conn, &OPEN_RECORDS, &[], |row| OpenRecords::read(row))?;
                Ok(rows.into_iter().next().unwrap_or_default())
            })
            .await
    }

    fn writer_stages(&self) -> Option<WriterStages> {
        Some(self.engine.stages())
    }

    fn pool(&self) -> PoolStats {
        let load = self.engine.load();
        PoolStats {
            size: load.readers as u64,
            max_size: load.readers as u64,
            available: (load.readers - load.readers_held) as u64,
            waiting: load.reads_waiting as u64,
            writer_queue: Some(load.writer_queue as u64),
        }
    }
}
