//! PostgreSQL, for several store replicas sharing one database (≥ 13).
//!
//! A claim is one round trip in the common path: a single statement inserts
//! the record if absent and, if it was present, returns the existing row
//! instead. Under READ COMMITTED that statement can see neither (a competing
//! insert committed after our snapshot was taken but before our insert looked
//! for a conflict); we simply run it again. Changes to an existing record
//! (take-over, replay count, turning unknown) are guarded by the fence we read,
//! so two replicas deciding at once cannot both win; the loser re-reads.
//! Fencing tokens come from one global SEQUENCE.
//!
//! A replay is answered from the row that statement returned; its
//! `replay_count` increment is applied afterwards on a spawned task, batched
//! with other replays (see `crate::replays`), not on the request path.

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use async_trait::async_trait;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;

use crate::backend::{
    Answer, Backend, Call, ClaimOutcome, EventInfo, KeyHistory, Listing, Lookup, OpenRecords, Peeked,
    PoolStats, RecordInfo, Resolution, Result, StoreError, SweepPolicy, SweepReport,
};
use crate::conditions::expand;
use crate::conditions::OPEN_RECORDS;
use crate::log_ids::LogIds;
use crate::replay_counts::ReplayTally;
use crate::row_mapping::{i64_from, LoadedRecord, ScopeDigest};
use crate::sealing::Seal;

/// A statement about the current record: `$1` is its key (the scope
/// digest); the statement's own parameters start at `$2`.
macro_rules! key_where {
    () => {
        "scope_digest = $1"
    };
}

mod batch;
mod claim;
mod errors;
mod generation;
mod new_keys;
mod operations;
mod pool;
mod rows;
mod settings;
mod sweep;
mod tls;

use errors::unavailable;
use pool::{Connections, Tx};
use rows::{Param, INFO_COLUMNS};
pub use settings::{PgSession, PgTimeouts, Pooler};

/// The schema, one file per version, applied in order.
const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("migrations/0001_records.sql")),
    (2, include_str!("migrations/0002_generations.sql")),
    (3, include_str!("migrations/0003_event_reasons.sql")),
    (4, include_str!("migrations/0004_scope_digest.sql")),
    (5, include_str!("migrations/0005_response_keys.sql")),
    (6, include_str!("migrations/0006_event_generations.sql")),
    // 7 and 8 are SQLite's alone: a version names one change everywhere.
    (9, include_str!("migrations/0009_fence_floor.sql")),
];

/// The schema version this store reads and writes: the last migration's.
pub const LATEST_SCHEMA: i64 = 9;
const _: () = assert!(MIGRATIONS[MIGRATIONS.len() - 1].0 as i64 == LATEST_SCHEMA);

/// The first column of the first row of a simple query's answer, as an
/// integer (`None` when it is NULL or there is no row).
fn first_integer(messages: &[tokio_postgres::SimpleQueryMessage]) -> Result<Option<i64>> {
    let value = messages.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => Some(row.get(0).map(str::to_string)),
        _ => None,
    });
    match value.flatten() {
        None => Ok(None),
        Some(text) => text
            .parse()
            .map(Some)
            .map_err(|_| StoreError::Corrupt(format!("postgres: {text:?} is not a schema version"))),
    }
}

/// Pending replay counts, one row per record. The fence and state guard keep
/// a late count off a newer record under the same key.
static REPLAYS: LazyLock<String> = LazyLock::new(|| {
    expand(&format!(
        "UPDATE idempotency_records r SET replay_count = r.replay_count + v.n \
         FROM unnest($1::bytea[], $2::bigint[], $3::bigint[]) AS v(scope_digest, fence, n) \
         WHERE {} AND r.scope_digest = v.scope_digest AND r.fence = v.fence AND r.{{replayable}}",
        rows::one_row_estimate("v.fence", "v.n")
    ))
});

/// Unknown records for operators: `$1` the limit.
static LIST_UNKNOWN: LazyLock<String> = LazyLock::new(|| {
    expand(&format!(
        "SELECT {}, NULL::bigint AS ended_at FROM idempotency_records WHERE {{unknown}} AND archived_at IS NULL \
         ORDER BY created_at LIMIT $1",
        *INFO_COLUMNS
    ))
});
/// In-progress records created at `$1` or before: `$2` the limit.
static LIST_STUCK: LazyLock<String> = LazyLock::new(|| {
    expand(&format!(
        "SELECT {}, NULL::bigint AS ended_at FROM idempotency_records WHERE {{leased}} AND created_at <= $1 \
         ORDER BY created_at LIMIT $2",
        *INFO_COLUMNS
    ))
});
/// The longest one sweep pass may take, client side.
const SWEEP_BOUND: std::time::Duration = std::time::Duration::from_secs(60);

pub struct Postgres {
    connections: Connections,
    replays: Arc<ReplayCounts>,
    log_ids: LogIds,
    pub(super) seal: Seal,
}

/// Replays served and not yet counted, and the one task at a time that
/// applies them.
struct ReplayCounts {
    connections: Connections,
    tally: ReplayTally,
    /// Held from taking a batch until it is applied, so a lookup that
    /// flushes also waits for a batch already on its way.
    flushing: tokio::sync::Mutex<()>,
}

impl ReplayCounts {
    async fn flush(&self) -> Result<()> {
        let _turn = self.flushing.lock().await;
        let mut batch = self.tally.take();
        if batch.is_empty() {
            return Ok(());
        }
        // Sorted, so replicas flushing at once take row locks in the same order.
        batch.sort_unstable();
        let mut keys: Vec<&[u8]> = Vec::with_capacity(batch.len());
        let (mut fences, mut counts) = (Vec::with_capacity(batch.len()), Vec::with_capacity(batch.len()));
        for ((key, fence), n) in &batch {
            keys.push(key.as_bytes());
            fences.push(i64_from(*fence));
            counts.push(i64_from(*n));
        }
        self.connections
            .query(&REPLAYS, &[&keys, &fences, &counts])
            .await
            .map(drop)
    }
}

/// What a transaction's work returns: its answer and the events to log once
/// it has committed.
type TxWork<'t, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(T, Vec<EventInfo>)>> + Send + 't>>;

impl Postgres {
    /// `seal`: how stored responses are sealed at rest.
    pub fn connect(
        url: &str,
        pool_size: usize,
        timeouts: PgTimeouts,
        log_ids: LogIds,
        seal: Seal,
    ) -> Result<Postgres> {
        Postgres::connect_with(url, pool_size, timeouts, PgSession::default(), log_ids, seal)
    }

    /// [`Postgres::connect`] with sessions set up as `session` says.
    pub fn connect_with(
        url: &str,
        pool_size: usize,
        timeouts: PgTimeouts,
        session: PgSession,
        log_ids: LogIds,
        seal: Seal,
    ) -> Result<Postgres> {
        let connections = Connections::open(url, pool_size, timeouts, session)?;
        let replays = Arc::new(ReplayCounts {
            connections: connections.clone(),
            tally: ReplayTally::default(),
            flushing: tokio::sync::Mutex::new(()),
        });
        Ok(Postgres {
            connections,
            replays,
            log_ids,
            seal,
        })
    }

    /// The schema version the database is at (`None`: never migrated),
    /// read without locking or writing anything.
    pub async fn schema_version(&self) -> Result<Option<i64>> {
        let mut client = self.connections.client().await?;
        // In a transaction, which carries the session's settings behind a
        // transaction pooler. Simple queries: nothing is prepared, whatever
        // pools the connections.
        let tx = client.begin().await?;
        let exists = tx
            .simple_query("SELECT 1 WHERE to_regclass('idempotency_schema_migrations') IS NOT NULL")
            .await
            .map_err(unavailable)?;
        let version = match first_integer(&exists)? {
            None => None,
            Some(_) => first_integer(
                &tx.simple_query("SELECT max(version) FROM idempotency_schema_migrations")
                    .await
                    .map_err(unavailable)?,
            )?,
        };
        tx.commit().await?;
        Ok(version)
    }

    /// Refuses a schema this store cannot use as it is: behind (not yet
    /// migrated: `idempotency-store migrate` does that, as the schema's
    /// owner) or ahead (a newer store migrated it).
    pub async fn require_current_schema(&self) -> Result<()> {
        let applied = self.schema_version().await?;
        crate::backend::known_schema(applied, Some(LATEST_SCHEMA))?;
        if applied == Some(LATEST_SCHEMA) {
            return Ok(());
        }
        let at = applied.map_or_else(|| "not created".to_string(), |v| format!("at version {v}"));
        Err(StoreError::Config(format!(
            "the database's schema is {at}, this store needs version {LATEST_SCHEMA}: \
             run `idempotency-store migrate` as the schema's owner first, or pass --migrate to `serve` \
             (docs/operations.md#roles-and-migrations)"
        )))
    }

    /// Logs events that have been committed, caused by a call that serves
    /// the request `trace` names.
    fn log_all(&self, events: &[EventInfo], trace: &Trace) {
        events.iter().for_each(|e| e.log(&self.log_ids, trace));
    }

    /// Counts a replay; the first one since the last flush spawns the task
    /// that applies every pending count. Nobody waits for it.
    fn count_replay(&self, key: ScopeDigest, fence: u64) {
        if self.replays.tally.add(key, fence) {
            let replays = Arc::clone(&self.replays);
            tokio::spawn(async move {
                if let Err(e) = replays.flush().await {
                    tracing::warn!("postgres: replay counts lost: {e}");
                }
            });
        }
    }

    /// Runs `work` in a transaction that holds the lock on the scope's
    /// record (if any); its events are logged once it has committed.
    async fn in_tx<T: Send>(
        &self,
        (scope, trace): (&Scope, &Trace),
        work: impl for<'t> FnOnce(&'t Tx<'t>, &'t ScopeDigest, Option<LoadedRecord>) -> TxWork<'t, T> + Send,
    ) -> Result<T> {
        let key = ScopeDigest::of(scope);
        let mut client = self.connections.client().await?;
        let tx = client.begin().await?;
        let locked = generation::lock(&tx, &key).await?.map(|(loaded, _)| loaded);
        let (out, events) = work(&tx, &key, locked).await?;
        tx.commit().await?;
        self.log_all(&events, trace);
        Ok(out)
    }

    async fn infos(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<RecordInfo>> {
        let rows = self.connections.query(sql, params).await?;
        rows.iter().map(|r| RecordInfo::read(r, &self.seal)).collect()
    }
}

#[async_trait]
impl Backend for Postgres {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn log_ids(&self) -> &LogIds {
        &self.log_ids
    }

    async fn migrate(&self) -> Result<()> {
        // A current schema is left alone: no lock, no DDL, so a role
        // without DDL rights may call this.
        if self.schema_version().await? == Some(LATEST_SCHEMA) {
            return Ok(());
        }
        let mut client = self.connections.client().await?;
        let tx = client.begin().await?;
        // Replicas starting together take turns; the lock ends with the transaction.
        // A migration may rewrite a large table: the per-statement bound is
        // for the request path.
        tx.batch_execute(
            "SET LOCAL statement_timeout = 0; SELECT pg_advisory_xact_lock(7201865443); \
             CREATE TABLE IF NOT EXISTS idempotency_schema_migrations \
             (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)",
        )
        .await
        .map_err(unavailable)?;
        let applied = tx
            .simple_query("SELECT max(version) FROM idempotency_schema_migrations")
            .await
            .map_err(unavailable)?;
        let applied = first_integer(&applied)?;
        crate::backend::known_schema(applied, Some(LATEST_SCHEMA))?;
        for (version, sql) in MIGRATIONS {
            if applied.is_some_and(|a| a >= i64::from(*version)) {
                continue;
            }
            tx.batch_execute(sql).await.map_err(unavailable)?;
            tx.batch_execute(&format!(
                "INSERT INTO idempotency_schema_migrations (version, applied_at) VALUES ({version}, {})",
                crate::clock::system_now()
            ))
            .await
            .map_err(unavailable)?;
        }
        tx.commit().await
    }

    async fn database_now_us(&self) -> Result<Option<i64>> {
        let rows = self
            .connections
            .query(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                &[],
            )
            .await?;
        Ok(rows.first().map(|r| r.get::<_, i64>(0)))
    }

    async fn ping(&self) -> Result<()> {
        self.connections
            .query("SELECT 1 FROM idempotency_records LIMIT 1", &[])
            .await
            .map(drop)
    }

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        self.connections
            .bounded(self.claim_record(req, now, deadline))
            .await
    }

    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Peeked> {
        self.peek_record(req, now).await
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        self.connections
            .bounded(self.complete_record(req, body, now))
            .await
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.connections.bounded(self.release_record(req, now)).await
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.connections.bounded(self.mark_record_unknown(req, now)).await
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        self.connections.bounded(self.abandon_record(req, now)).await
    }

    async fn decide(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        self.decide_batch(calls, now).await
    }

    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        // Operators see every replay this process served so far.
        if let Err(e) = self.replays.flush().await {
            tracing::warn!("postgres: replay counts not applied before a lookup: {e}");
        }
        const MATCH: &str = "tenant = $1 AND idem_key = $2 AND ($3::text IS NULL OR route = $3) \
                             AND ($4::text IS NULL OR principal = $4) AND ($5::text IS NULL OR namespace = $5)";
        let sql = format!(
            "SELECT {cols}, NULL::bigint AS ended_at, true AS current FROM idempotency_records WHERE {MATCH} \
             UNION ALL SELECT {cols}, ended_at, false FROM idempotency_history WHERE {MATCH} \
             ORDER BY current DESC, generation DESC LIMIT $6",
            cols = *INFO_COLUMNS
        );
        let ns = q.namespace.map(|n| n.as_str().to_string());
        let limit = i64::from(limit);
        let records = self
            .infos(&sql, &[&q.tenant, &q.key, &q.route, &q.principal, &ns, &limit])
            .await?;
        let sql = crate::row_mapping::events_matching(MATCH, "$6");
        let events_limit = limit.saturating_mul(16);
        let events = self
            .connections
            .query(
                &sql,
                &[&q.tenant, &q.key, &q.route, &q.principal, &ns, &events_limit],
            )
            .await?
            .iter()
            .map(EventInfo::read)
            .collect::<Result<Vec<_>>>()?;
        Ok(KeyHistory { records, events })
    }

    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        let limit = i64::from(limit);
        match which {
            Listing::Unknown => self.infos(&LIST_UNKNOWN, &[&limit]).await,
            Listing::Stuck { older_than_ms } => {
                let before = now.saturating_sub(i64_from(older_than_ms));
                self.infos(&LIST_STUCK, &[&before, &limit]).await
            }
        }
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool> {
        self.connections
            .bounded(self.resolve_record(scope, how, reason, now))
            .await
    }

    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        // Many statements, each bounded by the server; this bounds a sweep
        // stuck behind a network that stopped answering, so the next one runs.
        self.connections
            .within(SWEEP_BOUND, self.sweep_once(now, policy))
            .await
    }

    async fn open_records(&self) -> Result<OpenRecords> {
        match self.connections.query(&OPEN_RECORDS, &[]).await?.first() {
            Some(row) => OpenRecords::read(row),
            None => Ok(OpenRecords::default()),
        }
    }

    fn pool(&self) -> PoolStats {
        let status = self.connections.status();
        PoolStats {
            size: status.size as u64,
            max_size: status.max_size as u64,
            available: status.available as u64,
            waiting: status.waiting as u64,
            writer_queue: None,
        }
    }
}
