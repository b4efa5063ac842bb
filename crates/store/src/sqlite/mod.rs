//! SQLite, the embedded default: WAL, durable commits (`synchronous=FULL`)
//! with group commit, one writer, readers in parallel.
//!
//! Every write runs on one dedicated thread ([`engine`]), batched into one
//! transaction per group commit. Because that thread is the only writer,
//! "read the record, decide, write" needs no locking of its own, and the
//! fencing counter row is simply incremented in the same transaction.
//!
//! Claims that only need to answer (mismatch, in progress, unknown, expired)
//! or replay a completed record are decided on a reader connection first and
//! never queue behind writes ([`claim`]). A replay's `replay_count` increment
//! goes to the writer afterwards without being awaited (see
//! [`crate::replays`]).

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use async_trait::async_trait;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::Scope;
use rusqlite::{params, Connection, OptionalExtension};

use crate::backend::{
    Backend, ClaimOutcome, EventInfo, KeyHistory, Listing, Lookup, RecordInfo, Resolution, Result,
    SweepPolicy, SweepReport,
};
use crate::columns::i64_from;
use crate::conditions::expand;
use crate::replays::ReplayTally;

/// The six key parameters, `?1`..`?6`; a statement's own start at `?7`.
macro_rules! key_where {
    () => {
        "scope_version = ?1 AND tenant = ?2 AND principal = ?3 AND route = ?4 AND namespace = ?5 AND idem_key = ?6"
    };
}

mod claim;
mod engine;
mod generation;
mod operations;
mod rows;
mod sweep;

use engine::{unavailable, Engine};
use generation::{apply_replays, Journal};
use rows::{query_events, query_infos, INFO_COLUMNS};

/// The schema, one file per version, applied in order.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("migrations/0001_records.sql")),
    (2, include_str!("migrations/0002_generations.sql")),
    (3, include_str!("migrations/0003_event_reasons.sql")),
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
static OLDEST_IN_PROGRESS: LazyLock<String> =
    LazyLock::new(|| expand("SELECT min(created_at) FROM idempotency_records WHERE {leased}"));

pub struct Sqlite {
    engine: Engine,
    /// Replays served from a reader, not yet counted in `replay_count`.
    replays: Arc<ReplayTally>,
}

impl Sqlite {
    pub fn open(path: &str, synchronous_full: bool) -> Result<Sqlite> {
        Ok(Sqlite {
            engine: Engine::open(path, synchronous_full)?,
            replays: Arc::default(),
        })
    }

    /// How many transactions the writer has committed: with group commit,
    /// far fewer than the writes it carried out.
    pub fn commits(&self) -> u64 {
        self.engine.commits()
    }

    /// A writer job that records transitions: its events are logged once the
    /// batch that carried them has committed.
    async fn write_logged<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, &mut Journal) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (out, journal) = self
            .engine
            .write(move |conn| {
                let mut journal = Journal::new();
                f(conn, &mut journal).map(|out| (out, journal))
            })
            .await?;
        journal.iter().for_each(EventInfo::log);
        Ok(out)
    }

    /// Counts a replay served from a reader. The first replay since the last
    /// flush queues one job that applies every pending count with the
    /// writer's next batch; nobody waits for it.
    fn count_replay(&self, key: [String; 6], fence: u64) {
        if self.replays.add(key, fence) {
            let tally = Arc::clone(&self.replays);
            self.engine
                .write_detached("replay counts", move |conn| apply_replays(conn, &tally));
        }
    }
}

#[async_trait]
impl Backend for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> Result<()> {
        self.engine
            .write(|conn| {
                conn.execute_batch("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)")
                    .map_err(unavailable)?;
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

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        self.claim_record(req, now, deadline).await
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        let req = req.clone();
        let body = req.body_stored.then(|| body.to_vec());
        self.write_logged(move |conn, journal| {
            operations::complete(conn, journal, &req, body.as_deref(), now)
        })
        .await
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let req = req.clone();
        self.write_logged(move |conn, journal| operations::release(conn, journal, &req, now))
            .await
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        let req = req.clone();
        self.write_logged(move |conn, journal| operations::abandon(conn, journal, &req, now))
            .await
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let req = req.clone();
        self.write_logged(move |conn, journal| operations::mark_unknown(conn, journal, &req, now))
            .await
    }

    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        // Operators see every replay served so far: pending counts are
        // applied first (and any flush already queued is committed by then).
        let tally = Arc::clone(&self.replays);
        if let Err(e) = self.engine.write(move |conn| apply_replays(conn, &tally)).await {
            tracing::warn!("sqlite: replay counts not applied before a lookup: {e}");
        }
        let q = q.clone();
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
                )?;
                let sql = format!(
                    "SELECT {} FROM idempotency_events WHERE {MATCH} ORDER BY id LIMIT ?6",
                    crate::columns::EVENT_COLUMNS
                );
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
        self.engine
            .read(move |conn| match which {
                Listing::Unknown => query_infos(conn, &LIST_UNKNOWN, params![limit]),
                Listing::Stuck { older_than_ms } => {
                    let before = now.saturating_sub(i64_from(older_than_ms));
                    query_infos(conn, &LIST_STUCK, params![before, limit])
                }
            })
            .await
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool> {
        let (scope, how, reason) = (scope.clone(), how.clone(), reason.map(str::to_string));
        self.write_logged(move |conn, journal| {
            operations::resolve(conn, journal, &scope, (how, reason.as_deref()), now)
        })
        .await
    }

    async fn purge(&self, scope: &Scope, now: i64) -> Result<bool> {
        let scope = scope.clone();
        self.write_logged(move |conn, journal| operations::purge(conn, journal, &scope, now))
            .await
    }

    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let policy = *policy;
        self.write_logged(move |conn, journal| sweep::sweep(conn, journal, now, policy))
            .await
    }

    async fn oldest_in_progress(&self) -> Result<Option<i64>> {
        self.engine
            .read(|conn| {
                conn.prepare_cached(&OLDEST_IN_PROGRESS)
                    .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
                    .map_err(unavailable)
            })
            .await
    }
}
