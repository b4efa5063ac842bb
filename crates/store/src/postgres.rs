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
//! with other replays (see [`crate::replays`]), not on the request path.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use idemgate_core::record::{self, ClaimDecision, RecordView, State, Transition};
use idemgate_core::scope::Scope;
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};

use crate::backend::*;
use crate::replays::ReplayTally;

const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE SEQUENCE IF NOT EXISTS idempotency_fence_seq;
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope_version TEXT COLLATE "C" NOT NULL CHECK (octet_length(scope_version) BETWEEN 1 AND 16),
    tenant TEXT COLLATE "C" NOT NULL CHECK (octet_length(tenant) BETWEEN 1 AND 255),
    principal TEXT COLLATE "C" NOT NULL CHECK (octet_length(principal) BETWEEN 1 AND 255),
    route TEXT COLLATE "C" NOT NULL CHECK (octet_length(route) BETWEEN 1 AND 255),
    namespace TEXT COLLATE "C" NOT NULL CHECK (namespace IN ('u', 's')),
    idem_key TEXT COLLATE "C" NOT NULL CHECK (octet_length(idem_key) BETWEEN 1 AND 255),
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    fingerprint TEXT CHECK (fingerprint IS NULL OR octet_length(fingerprint) = 64),
    fence BIGINT NOT NULL CHECK (fence > 0),
    lease_until BIGINT NOT NULL,
    ttl_ms BIGINT NOT NULL CHECK (ttl_ms >= 0),
    release_on_unknown BOOLEAN NOT NULL,
    response_status INTEGER CHECK (response_status IS NULL OR response_status BETWEEN 100 AND 999),
    response_headers TEXT CHECK (response_headers IS NULL OR octet_length(response_headers) <= 1048576),
    response_body BYTEA CHECK (response_body IS NULL OR octet_length(response_body) <= 67108864),
    body_stored BOOLEAN NOT NULL DEFAULT false,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    archived_at BIGINT,
    replay_count BIGINT NOT NULL DEFAULT 0 CHECK (replay_count >= 0),
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (state, lease_until);
CREATE INDEX IF NOT EXISTS idempotency_records_created ON idempotency_records (state, created_at);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at) WHERE archived_at IS NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);
"#,
    ),
    (
        2,
        r#"
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS generation BIGINT NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS attempt TEXT COLLATE "C" CHECK (attempt IS NULL OR octet_length(attempt) BETWEEN 1 AND 64);
UPDATE idempotency_records SET generation = fence;
CREATE TABLE IF NOT EXISTS idempotency_history (
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    state TEXT NOT NULL,
    fingerprint TEXT,
    fence BIGINT NOT NULL,
    lease_until BIGINT NOT NULL,
    ttl_ms BIGINT NOT NULL,
    release_on_unknown BOOLEAN NOT NULL,
    response_status INTEGER,
    response_headers TEXT,
    response_body BYTEA,
    body_stored BOOLEAN NOT NULL,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    archived_at BIGINT,
    replay_count BIGINT NOT NULL,
    generation BIGINT NOT NULL,
    attempt TEXT COLLATE "C",
    ended_at BIGINT NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, generation)
);
CREATE INDEX IF NOT EXISTS idempotency_history_ended ON idempotency_history (ended_at);
CREATE INDEX IF NOT EXISTS idempotency_history_tenant_key ON idempotency_history (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_events (
    id BIGSERIAL PRIMARY KEY,
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    generation BIGINT NOT NULL,
    at BIGINT NOT NULL,
    transition TEXT NOT NULL,
    attempt TEXT,
    fence BIGINT NOT NULL,
    fingerprint TEXT,
    status INTEGER,
    actor TEXT NOT NULL,
    detail TEXT,
    duration_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_events_tenant_key ON idempotency_events (tenant, idem_key);
CREATE INDEX IF NOT EXISTS idempotency_events_at ON idempotency_events (at);
CREATE TABLE IF NOT EXISTS idempotency_abandoned (
    scope_version TEXT COLLATE "C" NOT NULL,
    tenant TEXT COLLATE "C" NOT NULL,
    principal TEXT COLLATE "C" NOT NULL,
    route TEXT COLLATE "C" NOT NULL,
    namespace TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    attempt TEXT COLLATE "C" NOT NULL,
    at BIGINT NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, attempt)
);
"#,
    ),
];

// Request-path SQL is assembled at compile time (`concat!`), so no call
// formats a string before `prepare_cached` looks its statement up.
macro_rules! pk_where {
    () => {
        "scope_version = $1 AND tenant = $2 AND principal = $3 AND route = $4 AND namespace = $5 AND idem_key = $6"
    };
}
const PK_LIST: &str = "scope_version, tenant, principal, route, namespace, idem_key";
macro_rules! columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, fence, lease_until, ttl_ms, \
         release_on_unknown, response_status, response_headers, octet_length(response_body), body_stored, created_at, completed_at, \
         expires_at, archived_at, replay_count, generation, attempt"
    };
}
macro_rules! event_columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, generation, at, transition, attempt, fence, \
         fingerprint, status, actor, detail, duration_ms"
    };
}
/// Records a transition of the current record of `$1..$6`: `$7` now,
/// `$8` transition, `$9` actor, `$10` detail.
const EVENT_SQL: &str = concat!(
    "INSERT INTO idempotency_events (",
    event_columns!(),
    ") SELECT scope_version, tenant, principal, route, namespace, idem_key, generation, $7, $8, attempt, fence, \
     fingerprint, response_status, $9, $10, $7 - created_at FROM idempotency_records WHERE ",
    pk_where!(),
    " RETURNING ",
    event_columns!()
);
/// Moves the current generation of `$1..$6` to the history: `$7` how it
/// ended, `$8` now.
const HISTORY_SQL: &str = concat!(
    "INSERT INTO idempotency_history (scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, \
     fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, response_body, body_stored, \
     created_at, completed_at, expires_at, archived_at, replay_count, generation, attempt, ended_at) \
     SELECT scope_version, tenant, principal, route, namespace, idem_key, $7, fingerprint, fence, lease_until, ttl_ms, \
     release_on_unknown, response_status, response_headers, NULL, body_stored, created_at, completed_at, expires_at, \
     archived_at, replay_count, generation, attempt, $8 FROM idempotency_records WHERE ",
    pk_where!()
);
/// The current record of `$1..$6`, locked until the transaction ends.
const LOCK_SQL: &str = concat!(
    "SELECT state, fingerprint, fence, lease_until, ttl_ms, response_status, response_headers, response_body, \
     body_stored, completed_at, expires_at, archived_at IS NOT NULL AS archived, attempt FROM idempotency_records WHERE ",
    pk_where!(),
    " FOR UPDATE"
);

/// Insert if absent; otherwise the existing row. One statement, one round trip.
const CLAIM_SQL: &str = "WITH f AS (SELECT nextval('idempotency_fence_seq') AS fence), ins AS ( \
    INSERT INTO idempotency_records (scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, fence, \
        lease_until, ttl_ms, release_on_unknown, body_stored, created_at, replay_count, generation, attempt) \
    SELECT $1, $2, $3, $4, $5, $6, 'in_progress', $7, f.fence, $8, $9, $10, false, $11, 0, f.fence, $12 FROM f \
    ON CONFLICT DO NOTHING RETURNING fence), \
  ev AS (INSERT INTO idempotency_events (scope_version, tenant, principal, route, namespace, idem_key, generation, at, \
    transition, attempt, fence, fingerprint, status, actor, detail, duration_ms) \
    SELECT $1, $2, $3, $4, $5, $6, fence, $11, 'claimed', $12, fence, $7, NULL, 'filter', NULL, 0 FROM ins) \
  SELECT true AS inserted, fence, NULL::text AS state, NULL::text AS fingerprint, NULL::bigint AS lease_until, NULL::bigint AS ttl_ms, \
    NULL::integer AS response_status, NULL::text AS response_headers, NULL::bytea AS response_body, false AS body_stored, \
    NULL::bigint AS completed_at, NULL::bigint AS expires_at FROM ins \
  UNION ALL \
  SELECT false, fence, state, fingerprint, lease_until, ttl_ms, response_status, response_headers, \
    CASE WHEN state = 'completed' AND body_stored THEN response_body END, body_stored, completed_at, expires_at \
  FROM idempotency_records WHERE scope_version = $1 AND tenant = $2 AND principal = $3 AND route = $4 AND namespace = $5 \
    AND idem_key = $6 AND NOT EXISTS (SELECT 1 FROM ins)";

/// Pending replay counts, one row per record. The fence and state guard keep
/// a late count off a newer record under the same key.
const REPLAYS_SQL: &str = "UPDATE idempotency_records r SET replay_count = r.replay_count + v.n \
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bigint[], $8::bigint[]) \
      AS v(scope_version, tenant, principal, route, namespace, idem_key, fence, n) \
    WHERE r.scope_version = v.scope_version AND r.tenant = v.tenant AND r.principal = v.principal AND r.route = v.route \
      AND r.namespace = v.namespace AND r.idem_key = v.idem_key AND r.fence = v.fence AND r.state = 'completed'";

const MAX_ATTEMPTS: usize = 20;

pub struct Postgres {
    pool: Pool,
    replays: Arc<Replays>,
}

/// Replays served and not yet counted, and the one task at a time that
/// applies them.
struct Replays {
    pool: Pool,
    tally: ReplayTally,
    /// Held from taking a batch until it is applied, so a lookup that
    /// flushes also waits for a batch already on its way.
    flushing: tokio::sync::Mutex<()>,
}

impl Replays {
    async fn flush(&self) -> Result<()> {
        let _turn = self.flushing.lock().await;
        let mut batch = self.tally.take();
        if batch.is_empty() {
            return Ok(());
        }
        // Sorted, so replicas flushing at once take row locks in the same order.
        batch.sort_unstable();
        let mut cols: [Vec<&str>; 6] = Default::default();
        let (mut fences, mut counts) = (Vec::with_capacity(batch.len()), Vec::with_capacity(batch.len()));
        for ((key, fence), n) in &batch {
            for (col, v) in cols.iter_mut().zip(key) {
                col.push(v.as_str());
            }
            fences.push(i64_from(*fence));
            counts.push(i64_from(*n));
        }
        let client = self.pool.get().await.map_err(unavailable)?;
        let stmt = client.prepare_cached(REPLAYS_SQL).await.map_err(unavailable)?;
        let [c0, c1, c2, c3, c4, c5] = &cols;
        client
            .execute(&stmt, &[c0, c1, c2, c3, c4, c5, &fences, &counts])
            .await
            .map_err(unavailable)?;
        Ok(())
    }
}

trait Described {
    fn describe(&self) -> String;
}

impl Described for tokio_postgres::Error {
    /// The server's own message; `Display` only says "db error".
    fn describe(&self) -> String {
        match self.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => self.to_string(),
        }
    }
}

impl Described for deadpool_postgres::PoolError {
    fn describe(&self) -> String {
        match self {
            deadpool_postgres::PoolError::Backend(e) => e.describe(),
            other => other.to_string(),
        }
    }
}

fn unavailable(e: impl Described) -> StoreError {
    StoreError::Unavailable(e.describe())
}

/// A scope's primary key columns, borrowed from the scope.
struct Pk<'s> {
    cols: [&'s str; 6],
}

impl<'s> Pk<'s> {
    fn new(s: &'s Scope) -> Pk<'s> {
        Pk {
            cols: [
                s.version(),
                s.tenant(),
                s.principal(),
                s.route(),
                s.namespace().as_str(),
                s.key().as_str(),
            ],
        }
    }

    fn from_cols(cols: &'s [String; 6]) -> Pk<'s> {
        Pk {
            cols: cols.each_ref().map(String::as_str),
        }
    }

    /// The six key parameters followed by `extra`.
    fn with<'a>(&'a self, extra: &[&'a (dyn ToSql + Sync)]) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut v: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(6 + extra.len());
        v.extend(self.cols.iter().map(|c| c as &(dyn ToSql + Sync)));
        v.extend_from_slice(extra);
        v
    }
}

impl Postgres {
    pub fn connect(url: &str, pool_size: usize) -> Result<Postgres> {
        let config: tokio_postgres::Config = url
            .parse()
            .map_err(|e| StoreError::Config(format!("bad postgres URL: {e}")))?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .build()
            .map_err(|e| StoreError::Config(format!("postgres pool: {e}")))?;
        let replays = Arc::new(Replays {
            pool: pool.clone(),
            tally: ReplayTally::default(),
            flushing: tokio::sync::Mutex::new(()),
        });
        Ok(Postgres { pool, replays })
    }

    /// Counts a replay; the first one since the last flush spawns the task
    /// that applies every pending count. Nobody waits for it.
    fn count_replay(&self, key: [String; 6], fence: u64) {
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
        scope: &Scope,
        work: impl for<'t> FnOnce(&'t Tx<'t>, &'t Pk<'t>, Option<Locked>) -> TxWork<'t, T> + Send,
    ) -> Result<T> {
        let pk = Pk::new(scope);
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let locked = lock(&tx, &pk).await?;
        let (out, events) = work(&tx, &pk, locked).await?;
        tx.commit().await.map_err(unavailable)?;
        log_all(&events);
        Ok(out)
    }

    /// A claim that must change an existing record (a new generation, or a
    /// lease that ran out turning unknown), decided again under the record's
    /// lock so that nothing that happened since (a completion, another
    /// claim) is overwritten. `None` when the record is gone.
    async fn change_claimed(
        &self,
        client: &mut deadpool_postgres::Object,
        req: &ClaimRequest,
        pk: &Pk<'_>,
        now: i64,
        deadline: Option<Instant>,
    ) -> Result<Option<ClaimOutcome>> {
        let tx = client.transaction().await.map_err(unavailable)?;
        let Some(((view, ttl_ms, headers, body), _, _)) = lock(&tx, pk).await? else {
            return Ok(None);
        };
        let mut events = Vec::new();
        let outcome = match record::decide_claim(Some(&view), req, now) {
            ClaimDecision::Answer(reply) => ClaimOutcome::answer(reply),
            ClaimDecision::Replay { status, completed_at } => {
                self.count_replay(pk.cols.map(String::from), view.fence);
                ClaimOutcome::replay(status, headers, completed_at, body)
            }
            ClaimDecision::Claim => {
                let ended = record::ended_as(view.state, Transition::Reclaimed);
                let stmt = tx.prepare_cached(HISTORY_SQL).await.map_err(unavailable)?;
                tx.execute(&stmt, &pk.with(&[&ended, &now]))
                    .await
                    .map_err(unavailable)?;
                let sql = concat!("UPDATE idempotency_records SET state = 'in_progress', fingerprint = $7, fence = nextval('idempotency_fence_seq'),                      lease_until = $8, ttl_ms = $9, release_on_unknown = $10, response_status = NULL, response_headers = NULL,                      response_body = NULL, body_stored = false, created_at = $11, completed_at = NULL, expires_at = NULL,                      archived_at = NULL, replay_count = 0, generation = currval('idempotency_fence_seq'), attempt = $12                      WHERE ", pk_where!(), " AND fence = $13 AND state = $14 RETURNING fence");
                let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
                let fingerprint = req.fingerprint.map(|f| f.to_hex());
                let lease_until = record::lease_until(now, req.lease_ms);
                let ttl_ms = i64_from(req.ttl_ms);
                let release = req.on_unknown == OnUnknown::Release;
                let attempt = req.attempt.as_ref().map(|a| a.as_str());
                let (old_fence, old_state) = (i64_from(view.fence), view.state.as_str());
                let row = tx
                    .query_one(
                        &stmt,
                        &pk.with(&[
                            &fingerprint,
                            &lease_until,
                            &ttl_ms,
                            &release,
                            &now,
                            &attempt,
                            &old_fence,
                            &old_state,
                        ]),
                    )
                    .await
                    .map_err(unavailable)?;
                let fence = u64_from(
                    row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    "fence",
                )?;
                events.extend(event(&tx, pk, (Transition::Reclaimed, actor::FILTER, None), now).await?);
                ClaimOutcome::answer(ClaimReply::Owned { fence })
            }
            ClaimDecision::BecomeUnknown => {
                set_unknown(&tx, pk, &view, record::unknown_expiry(now, ttl_ms)).await?;
                let by = (Transition::LeaseExpired, actor::FILTER, Some("unknown"));
                events.extend(event(&tx, pk, by, now).await?);
                ClaimOutcome {
                    reply: ClaimReply::Unknown,
                    body: Vec::new(),
                    became_unknown: true,
                }
            }
        };
        if matches!(outcome.reply, ClaimReply::Owned { .. }) && deadline.is_some_and(|d| Instant::now() >= d)
        {
            return Err(StoreError::Late);
        }
        tx.commit().await.map_err(unavailable)?;
        log_all(&events);
        Ok(Some(outcome))
    }

    async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(unavailable)
    }

    async fn query(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(sql).await.map_err(unavailable)?;
        client.query(&stmt, params).await.map_err(unavailable)
    }
}

/// A loaded record: what the rules need, the ttl stored at claim time, and
/// what a replay serves.
type Loaded = (RecordView, u64, Option<Vec<(String, String)>>, Vec<u8>);

fn view_from(row: &Row) -> Result<Loaded> {
    let g = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let state: String = row.try_get("state").map_err(g)?;
    let status: Option<i32> = row.try_get("response_status").map_err(g)?;
    let headers: Option<String> = row.try_get("response_headers").map_err(g)?;
    let body: Option<Vec<u8>> = row.try_get("response_body").map_err(g)?;
    let view = RecordView {
        state: State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("state {state:?}")))?,
        fingerprint: fingerprint_from(row.try_get("fingerprint").map_err(g)?)?,
        fence: u64_from(row.try_get("fence").map_err(g)?, "fence")?,
        lease_until: row.try_get("lease_until").map_err(g)?,
        status: status.map(|s| u16::try_from(s).unwrap_or(0)),
        body_stored: row.try_get("body_stored").map_err(g)?,
        completed_at: row.try_get("completed_at").map_err(g)?,
        expires_at: row.try_get("expires_at").map_err(g)?,
    };
    let ttl_ms = u64_from(row.try_get("ttl_ms").map_err(g)?, "ttl_ms")?;
    Ok((
        view,
        ttl_ms,
        decode_headers(headers.as_deref())?,
        body.unwrap_or_default(),
    ))
}

fn info_from(row: &Row) -> Result<RecordInfo> {
    let g = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let text = |i: usize| row.try_get::<_, String>(i).map_err(g);
    let scope = scope_from(&text(1)?, &text(2)?, &text(3)?, &text(4)?, &text(5)?)?;
    let status: Option<i32> = row.try_get(12).map_err(g)?;
    let headers: Option<String> = row.try_get(13).map_err(g)?;
    let body_len: Option<i32> = row.try_get(14).map_err(g)?;
    Ok(RecordInfo {
        log_id: scope.log_id(),
        scope,
        state: text(6)?,
        fingerprint: row.try_get(7).map_err(g)?,
        fence: u64_from(row.try_get(8).map_err(g)?, "fence")?,
        lease_until: row.try_get(9).map_err(g)?,
        ttl_ms: u64_from(row.try_get(10).map_err(g)?, "ttl_ms")?,
        on_unknown: on_unknown_from(row.try_get(11).map_err(g)?),
        status: status.map(|s| u16::try_from(s).unwrap_or(0)),
        headers: decode_headers(headers.as_deref())?,
        body_stored: row.try_get(15).map_err(g)?,
        body_len: body_len.map(|l| u64::try_from(l).unwrap_or(0)),
        created_at: row.try_get(16).map_err(g)?,
        completed_at: row.try_get(17).map_err(g)?,
        expires_at: row.try_get(18).map_err(g)?,
        archived_at: row.try_get(19).map_err(g)?,
        replay_count: u64_from(row.try_get(20).map_err(g)?, "replay_count")?,
        generation: u64_from(row.try_get(21).map_err(g)?, "generation")?,
        attempt: row.try_get(22).map_err(g)?,
        ended_at: row.try_get(23).map_err(g)?,
    })
}

fn event_from(row: &Row) -> Result<EventInfo> {
    let g = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let text = |i: usize| row.try_get::<_, String>(i).map_err(g);
    let scope = scope_from(&text(1)?, &text(2)?, &text(3)?, &text(4)?, &text(5)?)?;
    let status: Option<i32> = row.try_get(12).map_err(g)?;
    Ok(EventInfo {
        log_id: scope.log_id(),
        scope,
        generation: u64_from(row.try_get(6).map_err(g)?, "generation")?,
        at: row.try_get(7).map_err(g)?,
        transition: text(8)?,
        attempt: row.try_get(9).map_err(g)?,
        fence: u64_from(row.try_get(10).map_err(g)?, "fence")?,
        fingerprint: row.try_get(11).map_err(g)?,
        status: status.map(|s| u16::try_from(s).unwrap_or(0)),
        actor: text(13)?,
        detail: row.try_get(14).map_err(g)?,
        duration_ms: row.try_get(15).map_err(g)?,
    })
}

type Tx<'a> = deadpool_postgres::Transaction<'a>;

/// A transition of the current record, written in `tx` and returned for the log.
async fn event(
    tx: &Tx<'_>,
    pk: &Pk<'_>,
    (t, actor, detail): (Transition, &str, Option<&str>),
    now: i64,
) -> Result<Vec<EventInfo>> {
    let stmt = tx.prepare_cached(EVENT_SQL).await.map_err(unavailable)?;
    let name = t.as_str();
    let rows = tx
        .query(&stmt, &pk.with(&[&now, &name, &actor, &detail]))
        .await
        .map_err(unavailable)?;
    rows.iter().map(event_from).collect()
}

/// Ends the current generation (state `last`): its event, its move to the
/// history, and the key is free.
async fn end_generation(
    tx: &Tx<'_>,
    pk: &Pk<'_>,
    last: State,
    by: (Transition, &str, Option<&str>),
    now: i64,
) -> Result<Vec<EventInfo>> {
    let events = event(tx, pk, by, now).await?;
    let ended = record::ended_as(last, by.0);
    let stmt = tx.prepare_cached(HISTORY_SQL).await.map_err(unavailable)?;
    tx.execute(&stmt, &pk.with(&[&ended, &now]))
        .await
        .map_err(unavailable)?;
    let stmt = tx
        .prepare_cached(concat!("DELETE FROM idempotency_records WHERE ", pk_where!()))
        .await
        .map_err(unavailable)?;
    tx.execute(&stmt, &pk.with(&[])).await.map_err(unavailable)?;
    Ok(events)
}

/// The current record, locked for the rest of `tx`: its view, ttl, whether
/// it is archived and the attempt that claimed it.
async fn lock(tx: &Tx<'_>, pk: &Pk<'_>) -> Result<Option<Locked>> {
    let stmt = tx.prepare_cached(LOCK_SQL).await.map_err(unavailable)?;
    let Some(row) = tx.query_opt(&stmt, &pk.with(&[])).await.map_err(unavailable)? else {
        return Ok(None);
    };
    let g = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let archived: bool = row.try_get("archived").map_err(g)?;
    let attempt: Option<String> = row.try_get("attempt").map_err(g)?;
    Ok(Some((view_from(&row)?, archived, attempt)))
}

/// Turns an in-progress record unknown, guarded by the fence and state it was read with.
async fn set_unknown(tx: &Tx<'_>, pk: &Pk<'_>, view: &RecordView, expires_at: i64) -> Result<()> {
    let sql = concat!(
        "UPDATE idempotency_records SET state = 'unknown', expires_at = $8 WHERE ",
        pk_where!(),
        " AND fence = $7 AND state = $9"
    );
    let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
    let (fence, state) = (i64_from(view.fence), view.state.as_str());
    tx.execute(&stmt, &pk.with(&[&fence, &expires_at, &state]))
        .await
        .map_err(unavailable)?;
    Ok(())
}

/// A locked record: what the rules need, whether it is archived, and the
/// attempt that claimed it.
type Locked = (Loaded, bool, Option<String>);

type TxWork<'t, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(T, Vec<EventInfo>)>> + Send + 't>>;

fn log_all(events: &[EventInfo]) {
    events.iter().for_each(EventInfo::log);
}

#[async_trait]
impl Backend for Postgres {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> Result<()> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        // Replicas starting together take turns; the lock ends with the transaction.
        tx.execute("SELECT pg_advisory_xact_lock(7201865443)", &[])
            .await
            .map_err(unavailable)?;
        tx.batch_execute("CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)")
            .await
            .map_err(unavailable)?;
        for (version, sql) in MIGRATIONS {
            let done = tx
                .query_opt(
                    "SELECT version FROM idempotency_schema_migrations WHERE version = $1",
                    &[version],
                )
                .await
                .map_err(unavailable)?;
            if done.is_none() {
                tx.batch_execute(sql).await.map_err(unavailable)?;
                tx.execute(
                    "INSERT INTO idempotency_schema_migrations (version, applied_at) VALUES ($1, $2)",
                    &[version, &crate::clock::system_now()],
                )
                .await
                .map_err(unavailable)?;
            }
        }
        tx.commit().await.map_err(unavailable)
    }

    async fn ping(&self) -> Result<()> {
        self.query("SELECT 1 FROM idempotency_records LIMIT 1", &[])
            .await
            .map(|_| ())
    }

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        let pk = Pk::new(&req.scope);
        let fingerprint = req.fingerprint.map(|f| f.to_hex());
        let lease_until = record::lease_until(now, req.lease_ms);
        let ttl_ms = i64_from(req.ttl_ms);
        let release = req.on_unknown == OnUnknown::Release;
        let attempt = req.attempt.as_ref().map(|a| a.as_str());
        let mut client = self.client().await?;
        let claim_stmt = client.prepare_cached(CLAIM_SQL).await.map_err(unavailable)?;
        for _ in 0..MAX_ATTEMPTS {
            // Nobody waits for this claim any more: committing it would only
            // leave a record that its filter is abandoning.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(StoreError::Late);
            }
            let params = pk.with(&[&fingerprint, &lease_until, &ttl_ms, &release, &now, &attempt]);
            let query = client.query(&claim_stmt, &params);
            let rows = match deadline {
                None => query.await,
                Some(d) => match tokio::time::timeout_at(d.into(), query).await {
                    Ok(rows) => rows,
                    Err(_) => {
                        // Stuck past its caller's deadline (a lock wait, a slow
                        // commit): cancelled at the server so that it does not
                        // land later. One that lands anyway is abandoned.
                        let cancel = client.cancel_token();
                        tokio::spawn(async move {
                            if let Err(e) = cancel.cancel_query(NoTls).await {
                                tracing::warn!("postgres: could not cancel a late claim: {e}");
                            }
                        });
                        return Err(StoreError::Late);
                    }
                },
            }
            .map_err(unavailable)?;
            let Some(row) = rows.first() else {
                // Lost a race with a concurrent insert we cannot see yet: look again.
                continue;
            };
            let corrupt = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
            if row.try_get::<_, bool>("inserted").map_err(corrupt)? {
                let fence = u64_from(row.try_get("fence").map_err(corrupt)?, "fence")?;
                EventInfo {
                    log_id: req.scope.log_id(),
                    scope: req.scope.clone(),
                    generation: fence,
                    at: now,
                    transition: Transition::Claimed.as_str().into(),
                    attempt: attempt.map(String::from),
                    fence,
                    fingerprint,
                    status: None,
                    actor: actor::FILTER.into(),
                    detail: None,
                    duration_ms: 0,
                }
                .log();
                return Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }));
            }
            let (view, _, headers, body) = view_from(row)?;
            match record::decide_claim(Some(&view), req, now) {
                ClaimDecision::Answer(reply) => return Ok(ClaimOutcome::answer(reply)),
                ClaimDecision::Replay { status, completed_at } => {
                    // Served from the committed row this statement returned.
                    self.count_replay(pk.cols.map(String::from), view.fence);
                    return Ok(ClaimOutcome::replay(status, headers, completed_at, body));
                }
                ClaimDecision::Claim | ClaimDecision::BecomeUnknown => {
                    if let Some(out) = self.change_claimed(&mut client, req, &pk, now, deadline).await? {
                        return Ok(out);
                    }
                }
            }
            // The record went away between our read and our lock: decide again.
        }
        Err(StoreError::Unavailable(
            "claim kept racing with concurrent changes".into(),
        ))
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        let pk = Pk::new(&req.scope);
        // The WHERE clause is record::may_fence; expires_at is
        // record::completion_expiry with the ttl stored at claim time.
        let sql = concat!("WITH done AS (UPDATE idempotency_records SET state = 'completed', response_status = $8, response_headers = $9, response_body = $10, \
             body_stored = $11, completed_at = $12, expires_at = $12 + ttl_ms, lease_until = $12 \
             WHERE ", pk_where!(), " AND fence = $7 AND state IN ('in_progress', 'unknown') AND archived_at IS NULL \
             RETURNING scope_version, tenant, principal, route, namespace, idem_key, generation, attempt, fence, fingerprint, response_status, created_at) \
             INSERT INTO idempotency_events (", event_columns!(), ") SELECT scope_version, tenant, principal, route, namespace, idem_key, \
             generation, $12, 'completed', attempt, fence, fingerprint, response_status, 'filter', NULL, $12 - created_at FROM done \
             RETURNING ", event_columns!());
        let fence = i64_from(req.fence);
        let status = i32::from(req.status);
        let headers = encode_headers(&req.headers);
        let body: Option<&[u8]> = if req.body_stored { Some(body) } else { None };
        let rows = self
            .query(
                sql,
                &pk.with(&[&fence, &status, &headers, &body, &req.body_stored, &now]),
            )
            .await?;
        let events = rows.iter().map(event_from).collect::<Result<Vec<_>>>()?;
        log_all(&events);
        Ok(if events.is_empty() {
            FenceReply::Stale
        } else {
            FenceReply::Done
        })
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let fence = req.fence;
        self.in_tx(&req.scope, move |tx, pk, locked| {
            Box::pin(async move {
                let Some((loaded, archived, _)) = locked else {
                    return Ok((FenceReply::Stale, Vec::new()));
                };
                if archived || !record::may_fence(loaded.0.state, loaded.0.fence, fence) {
                    return Ok((FenceReply::Stale, Vec::new()));
                }
                let by = (Transition::Released, actor::FILTER, None);
                Ok((
                    FenceReply::Done,
                    end_generation(tx, pk, loaded.0.state, by, now).await?,
                ))
            })
        })
        .await
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let fence = req.fence;
        self.in_tx(&req.scope, move |tx, pk, locked| {
            Box::pin(async move {
                let Some((loaded, archived, _)) = locked else {
                    return Ok((FenceReply::Stale, Vec::new()));
                };
                let (view, ttl_ms) = (&loaded.0, loaded.1);
                if archived || !record::may_fence(view.state, view.fence, fence) {
                    return Ok((FenceReply::Stale, Vec::new()));
                }
                if view.state == State::Unknown {
                    return Ok((FenceReply::Done, Vec::new()));
                }
                set_unknown(tx, pk, view, record::unknown_expiry(now, ttl_ms)).await?;
                let by = (Transition::MarkedUnknown, actor::FILTER, None);
                Ok((FenceReply::Done, event(tx, pk, by, now).await?))
            })
        })
        .await
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        let attempt = req.attempt.clone();
        self.in_tx(&req.scope, move |tx, pk, locked| {
            Box::pin(async move {
                match locked {
                    Some((loaded, archived, stored))
                        if !archived && record::may_abandon(loaded.0.state, stored.as_deref(), attempt.as_str()) =>
                    {
                        let by = (Transition::Abandoned, actor::FILTER, None);
                        Ok((FenceReply::Done, end_generation(tx, pk, loaded.0.state, by, now).await?))
                    }
                    Some(_) => Ok((FenceReply::Stale, Vec::new())),
                    None => {
                        // The claim may still be on its way: the sweeper
                        // releases it if it lands under this attempt.
                        let sql = "INSERT INTO idempotency_abandoned (scope_version, tenant, principal, route, namespace, idem_key, \
                                   attempt, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING";
                        let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
                        let attempt = attempt.as_str();
                        tx.execute(&stmt, &pk.with(&[&attempt, &now])).await.map_err(unavailable)?;
                        Ok((FenceReply::Done, Vec::new()))
                    }
                }
            })
        })
        .await
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
            cols = columns!()
        );
        let ns = q.namespace.map(|n| n.as_str().to_string());
        let limit = i64::from(limit);
        let params: [&(dyn ToSql + Sync); 6] = [&q.tenant, &q.key, &q.route, &q.principal, &ns, &limit];
        let records = self
            .query(&sql, &params)
            .await?
            .iter()
            .map(info_from)
            .collect::<Result<Vec<_>>>()?;
        let sql = format!(
            "SELECT {} FROM idempotency_events WHERE {MATCH} ORDER BY id LIMIT $6",
            event_columns!()
        );
        let events_limit = limit.saturating_mul(16);
        let events = self
            .query(
                &sql,
                &[&q.tenant, &q.key, &q.route, &q.principal, &ns, &events_limit],
            )
            .await?
            .iter()
            .map(event_from)
            .collect::<Result<Vec<_>>>()?;
        Ok(KeyHistory { records, events })
    }

    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        let limit = i64::from(limit);
        let rows = match which {
            Listing::Unknown => {
                let sql = concat!("SELECT ", columns!(), ", NULL::bigint FROM idempotency_records WHERE state = 'unknown' AND archived_at IS NULL ORDER BY created_at LIMIT $1");
                self.query(sql, &[&limit]).await?
            }
            Listing::Stuck { older_than_ms } => {
                let sql = concat!("SELECT ", columns!(), ", NULL::bigint FROM idempotency_records WHERE state = 'in_progress' AND created_at <= $1 ORDER BY created_at LIMIT $2");
                let before = now.saturating_sub(i64_from(older_than_ms));
                self.query(sql, &[&before, &limit]).await?
            }
        };
        rows.iter().map(info_from).collect()
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, now: i64) -> Result<bool> {
        let how = how.clone();
        self.in_tx(scope, move |tx, pk, locked| {
            Box::pin(async move {
                let Some((loaded, archived, _)) = locked else {
                    return Ok((false, Vec::new()));
                };
                if archived || !matches!(loaded.0.state, State::InProgress | State::Unknown) {
                    return Ok((false, Vec::new()));
                }
                let events = match how {
                    Resolution::Release => {
                        let by = (Transition::Resolved, actor::OPERATOR, Some("release"));
                        end_generation(tx, pk, loaded.0.state, by, now).await?
                    }
                    Resolution::Complete { status, headers, body } => {
                        // A new fence: the old owner's late completion must not
                        // overwrite what the operator decided.
                        let sql = concat!("UPDATE idempotency_records SET state = 'completed', fence = nextval('idempotency_fence_seq'), response_status = $7, \
                             response_headers = $8, response_body = $9, body_stored = true, completed_at = $10, expires_at = $10 + ttl_ms, \
                             lease_until = $10 WHERE ", pk_where!());
                        let status = i32::from(status);
                        let headers = encode_headers(&headers);
                        let body = body.as_bytes();
                        let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
                        tx.execute(&stmt, &pk.with(&[&status, &headers, &body, &now])).await.map_err(unavailable)?;
                        event(tx, pk, (Transition::Resolved, actor::OPERATOR, Some("complete")), now).await?
                    }
                };
                Ok((true, events))
            })
        })
        .await
    }

    async fn purge(&self, scope: &Scope, now: i64) -> Result<bool> {
        self.in_tx(scope, move |tx, pk, locked| {
            Box::pin(async move {
                let Some((loaded, _, _)) = locked else {
                    return Ok((false, Vec::new()));
                };
                let by = (Transition::Purged, actor::OPERATOR, None);
                Ok((true, end_generation(tx, pk, loaded.0.state, by, now).await?))
            })
        })
        .await
    }

    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let batch = i64::from(policy.batch);
        let mut report = SweepReport::default();
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let mut events = Vec::new();
        let pick = |cond: &str| {
            format!("SELECT {PK_LIST} FROM idempotency_records WHERE {cond} ORDER BY {PK_LIST} LIMIT $2 FOR UPDATE SKIP LOCKED")
        };
        let keys = |rows: Vec<Row>| -> Result<Vec<[String; 6]>> {
            rows.iter()
                .map(|r| {
                    let g = |i: usize| {
                        r.try_get::<_, String>(i)
                            .map_err(|e| StoreError::Corrupt(e.to_string()))
                    };
                    Ok([g(0)?, g(1)?, g(2)?, g(3)?, g(4)?, g(5)?])
                })
                .collect()
        };
        // Leases that ran out: released or turned unknown, as the claim's policy said.
        let sql = pick("state = 'in_progress' AND lease_until <= $1 AND release_on_unknown");
        for key in keys(tx.query(&sql, &[&now, &batch]).await.map_err(unavailable)?)? {
            let pk = Pk::from_cols(&key);
            let by = (Transition::LeaseExpired, actor::SWEEPER, Some("released"));
            events.extend(end_generation(&tx, &pk, State::InProgress, by, now).await?);
            report.released += 1;
        }
        let sql = pick("state = 'in_progress' AND lease_until <= $1 AND NOT release_on_unknown");
        for key in keys(tx.query(&sql, &[&now, &batch]).await.map_err(unavailable)?)? {
            let pk = Pk::from_cols(&key);
            let sql = concat!(
                "UPDATE idempotency_records SET state = 'unknown', expires_at = $7 + ttl_ms WHERE ",
                pk_where!(),
                " AND state = 'in_progress'"
            );
            let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
            tx.execute(&stmt, &pk.with(&[&now])).await.map_err(unavailable)?;
            let by = (Transition::LeaseExpired, actor::SWEEPER, Some("unknown"));
            events.extend(event(&tx, &pk, by, now).await?);
            report.marked_unknown += 1;
        }
        // Claims that landed after their filter had abandoned them.
        let sql = format!(
            "SELECT {PK_LIST} FROM idempotency_records r WHERE state IN ('in_progress', 'unknown') AND archived_at IS NULL \
             AND EXISTS (SELECT 1 FROM idempotency_abandoned a WHERE (a.scope_version, a.tenant, a.principal, a.route, a.namespace, \
             a.idem_key, a.attempt) = (r.scope_version, r.tenant, r.principal, r.route, r.namespace, r.idem_key, r.attempt)) \
             AND $1::bigint IS NOT NULL ORDER BY {PK_LIST} LIMIT $2 FOR UPDATE SKIP LOCKED"
        );
        for key in keys(tx.query(&sql, &[&now, &batch]).await.map_err(unavailable)?)? {
            let pk = Pk::from_cols(&key);
            let Some((loaded, _, _)) = lock(&tx, &pk).await? else {
                continue;
            };
            let by = (Transition::Abandoned, actor::SWEEPER, None);
            events.extend(end_generation(&tx, &pk, loaded.0.state, by, now).await?);
            report.abandoned += 1;
        }
        let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
        tx.execute("DELETE FROM idempotency_abandoned WHERE at <= $1", &[&forget])
            .await
            .map_err(unavailable)?;
        // Expired records: body dropped, metadata kept.
        let sql = pick("archived_at IS NULL AND expires_at <= $1");
        for key in keys(tx.query(&sql, &[&now, &batch]).await.map_err(unavailable)?)? {
            let pk = Pk::from_cols(&key);
            let sql = concat!(
                "UPDATE idempotency_records SET archived_at = $7, response_body = NULL WHERE ",
                pk_where!()
            );
            let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
            tx.execute(&stmt, &pk.with(&[&now])).await.map_err(unavailable)?;
            events.extend(event(&tx, &pk, (Transition::Archived, actor::SWEEPER, None), now).await?);
            report.archived += 1;
        }
        // Past the audit retention: archived generations, history, events.
        let cutoff = now.saturating_sub(i64_from(policy.audit_retention_ms));
        let params: [&(dyn ToSql + Sync); 2] = [&cutoff, &batch];
        report.purged = tx
            .execute(
                &format!("DELETE FROM idempotency_records WHERE ({PK_LIST}) IN ({})", pick("archived_at IS NOT NULL AND archived_at <= $1")),
                &params,
            )
            .await
            .map_err(unavailable)?
            + tx
                .execute(
                    "DELETE FROM idempotency_history WHERE ctid IN (SELECT ctid FROM idempotency_history WHERE ended_at <= $1 LIMIT $2)",
                    &params,
                )
                .await
                .map_err(unavailable)?;
        report.events_purged = tx
            .execute(
                "DELETE FROM idempotency_events WHERE id IN (SELECT id FROM idempotency_events WHERE at <= $1 LIMIT $2)",
                &params,
            )
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        log_all(&events);
        Ok(report)
    }

    async fn oldest_in_progress(&self) -> Result<Option<i64>> {
        let rows = self
            .query(
                "SELECT min(created_at) FROM idempotency_records WHERE state = 'in_progress'",
                &[],
            )
            .await?;
        match rows.first() {
            Some(row) => row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string())),
            None => Ok(None),
        }
    }
}
