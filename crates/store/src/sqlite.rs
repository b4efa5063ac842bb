//! SQLite, the embedded default: WAL, durable commits (`synchronous=FULL`)
//! with group commit, one writer, readers in parallel.
//!
//! Every write runs on one dedicated thread. It takes the first job from its
//! channel, drains whatever else is already queued, runs the whole batch in
//! one transaction (each job inside its own savepoint, so one failing job does
//! not undo the others), commits once, and only then answers every caller: 200
//! concurrent claims cost one fsync, not 200. Because this thread is the only
//! writer, "read the record, decide, write" needs no locking of its own, and
//! the fencing counter row is simply incremented in the same transaction.
//!
//! Claims that only need to answer (mismatch, in progress, unknown, expired)
//! or replay a completed record are decided on a reader connection first and
//! never queue behind writes. A replay's `replay_count` increment goes to the
//! writer afterwards without being awaited (see [`crate::replays`]).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use idemgate_core::record::{self, ClaimDecision, RecordView, State, Transition};
use idemgate_core::scope::Scope;
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::backend::*;
use crate::replays::ReplayTally;

const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        r#"
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope_version TEXT NOT NULL CHECK (length(CAST(scope_version AS BLOB)) BETWEEN 1 AND 16),
    tenant TEXT NOT NULL CHECK (length(CAST(tenant AS BLOB)) BETWEEN 1 AND 255),
    principal TEXT NOT NULL CHECK (length(CAST(principal AS BLOB)) BETWEEN 1 AND 255),
    route TEXT NOT NULL CHECK (length(CAST(route AS BLOB)) BETWEEN 1 AND 255),
    namespace TEXT NOT NULL CHECK (namespace IN ('u', 's')),
    idem_key TEXT NOT NULL CHECK (length(CAST(idem_key AS BLOB)) BETWEEN 1 AND 255),
    state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'unknown')),
    fingerprint TEXT CHECK (fingerprint IS NULL OR length(fingerprint) = 64),
    fence INTEGER NOT NULL CHECK (fence > 0),
    lease_until INTEGER NOT NULL,
    ttl_ms INTEGER NOT NULL CHECK (ttl_ms >= 0),
    release_on_unknown INTEGER NOT NULL CHECK (release_on_unknown IN (0, 1)),
    response_status INTEGER CHECK (response_status IS NULL OR response_status BETWEEN 100 AND 999),
    response_headers TEXT CHECK (response_headers IS NULL OR length(CAST(response_headers AS BLOB)) <= 1048576),
    response_body BLOB CHECK (response_body IS NULL OR length(response_body) <= 67108864),
    body_stored INTEGER NOT NULL DEFAULT 0 CHECK (body_stored IN (0, 1)),
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    archived_at INTEGER,
    replay_count INTEGER NOT NULL DEFAULT 0 CHECK (replay_count >= 0),
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_lease ON idempotency_records (state, lease_until);
CREATE INDEX IF NOT EXISTS idempotency_records_created ON idempotency_records (state, created_at);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at) WHERE archived_at IS NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_archived ON idempotency_records (archived_at) WHERE archived_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS idempotency_records_tenant_key ON idempotency_records (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_fence (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    value INTEGER NOT NULL
);
INSERT OR IGNORE INTO idempotency_fence (id, value) VALUES (1, 0);
"#,
    ),
    (
        2,
        r#"
ALTER TABLE idempotency_records ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN attempt TEXT CHECK (attempt IS NULL OR length(attempt) BETWEEN 1 AND 64);
UPDATE idempotency_records SET generation = fence;
CREATE TABLE IF NOT EXISTS idempotency_history (
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    state TEXT NOT NULL,
    fingerprint TEXT,
    fence INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    ttl_ms INTEGER NOT NULL,
    release_on_unknown INTEGER NOT NULL,
    response_status INTEGER,
    response_headers TEXT,
    response_body BLOB,
    body_stored INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    archived_at INTEGER,
    replay_count INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    attempt TEXT,
    ended_at INTEGER NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, generation)
);
CREATE INDEX IF NOT EXISTS idempotency_history_ended ON idempotency_history (ended_at);
CREATE INDEX IF NOT EXISTS idempotency_history_tenant_key ON idempotency_history (tenant, idem_key);
CREATE TABLE IF NOT EXISTS idempotency_events (
    id INTEGER PRIMARY KEY,
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    generation INTEGER NOT NULL,
    at INTEGER NOT NULL,
    transition TEXT NOT NULL,
    attempt TEXT,
    fence INTEGER NOT NULL,
    fingerprint TEXT,
    status INTEGER,
    actor TEXT NOT NULL,
    detail TEXT,
    duration_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_events_tenant_key ON idempotency_events (tenant, idem_key);
CREATE INDEX IF NOT EXISTS idempotency_events_at ON idempotency_events (at);
CREATE TABLE IF NOT EXISTS idempotency_abandoned (
    scope_version TEXT NOT NULL,
    tenant TEXT NOT NULL,
    principal TEXT NOT NULL,
    route TEXT NOT NULL,
    namespace TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    attempt TEXT NOT NULL,
    at INTEGER NOT NULL,
    PRIMARY KEY (scope_version, tenant, principal, route, namespace, idem_key, attempt)
);
"#,
    ),
];

// SQL is assembled at compile time (`concat!`), so no call formats a string
// before `prepare_cached` looks its statement up.
macro_rules! pk_where {
    () => {
        "scope_version = ?1 AND tenant = ?2 AND principal = ?3 AND route = ?4 AND namespace = ?5 AND idem_key = ?6"
    };
}
macro_rules! pk_list {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key"
    };
}
macro_rules! columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, fence, lease_until, ttl_ms, \
         release_on_unknown, response_status, response_headers, length(response_body), body_stored, created_at, completed_at, \
         expires_at, archived_at, replay_count, generation, attempt"
    };
}
/// A record's stored columns, in the history table's order.
macro_rules! record_columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, state, fingerprint, fence, lease_until, ttl_ms, \
         release_on_unknown, response_status, response_headers, response_body, body_stored, created_at, completed_at, \
         expires_at, archived_at, replay_count, generation, attempt"
    };
}
macro_rules! event_columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, generation, at, transition, attempt, fence, \
         fingerprint, status, actor, detail, duration_ms"
    };
}
const READERS: usize = 4;
const MAX_BATCH: usize = 256;

type Deliver = Box<dyn FnOnce(std::result::Result<(), String>) + Send>;
type Job = Box<dyn FnOnce(&Connection) -> (bool, Deliver) + Send>;

pub struct Sqlite {
    writer: Mutex<mpsc::Sender<Job>>,
    readers: Arc<Vec<Mutex<Connection>>>,
    next_reader: AtomicUsize,
    /// Transactions committed by the writer (each one fsync with FULL).
    commits: Arc<AtomicU64>,
    /// Replays served from a reader, not yet counted in `replay_count`.
    replays: Arc<ReplayTally>,
}

fn unavailable(e: rusqlite::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
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

impl Sqlite {
    pub fn open(path: &str, synchronous_full: bool) -> Result<Sqlite> {
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
        Ok(Sqlite {
            writer: Mutex::new(tx),
            readers: Arc::new(readers),
            next_reader: AtomicUsize::new(0),
            commits,
            replays: Arc::default(),
        })
    }

    /// How many transactions the writer has committed: with group commit,
    /// far fewer than the writes it carried out.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// [`Self::write`] for jobs that record transitions: their events are
    /// logged once the batch that carried them has committed.
    async fn write_logged<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, &mut Journal) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        let (out, journal) = self
            .write(move |conn| {
                let mut journal = Journal::new();
                f(conn, &mut journal).map(|out| (out, journal))
            })
            .await?;
        journal.iter().for_each(EventInfo::log);
        Ok(out)
    }

    /// Runs `f` on the writer thread inside the next group commit.
    async fn write<R: Send + 'static>(
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

    fn enqueue(&self, job: Job) -> Result<()> {
        let sender = self
            .writer
            .lock()
            .map_err(|_| StoreError::Unavailable("writer lock poisoned".into()))?;
        sender
            .send(job)
            .map_err(|_| StoreError::Unavailable("the sqlite writer has stopped".into()))
    }

    /// Counts a replay served from a reader. The first replay since the last
    /// flush queues one job that applies every pending count with the
    /// writer's next batch; nobody waits for it.
    fn count_replay(&self, key: [String; 6], fence: u64) {
        if !self.replays.add(key, fence) {
            return;
        }
        let tally = Arc::clone(&self.replays);
        let job: Job = Box::new(move |conn| {
            let applied = apply_replays(conn, &tally);
            if let Err(e) = &applied {
                tracing::warn!("sqlite: replay counts lost: {e}");
            }
            let deliver: Deliver = Box::new(|commit| {
                if let Err(e) = commit {
                    tracing::warn!("sqlite: replay counts lost: {e}");
                }
            });
            (applied.is_ok(), deliver)
        });
        if let Err(e) = self.enqueue(job) {
            tracing::warn!("sqlite: replay counts not applied: {e}");
        }
    }

    /// Runs `f` on one of the reader connections, off the async runtime.
    async fn read<R: Send + 'static>(
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

/// The primary key columns of a scope, in `pk_where!` order.
fn pk(s: &Scope) -> [&str; 6] {
    [
        s.version(),
        s.tenant(),
        s.principal(),
        s.route(),
        s.namespace().as_str(),
        s.key().as_str(),
    ]
}

/// A loaded row: what the rules need plus what a replay serves.
struct Loaded {
    view: RecordView,
    ttl_ms: u64,
    headers: Option<Vec<(String, String)>>,
    /// Archived records are history: no fence opens them again.
    archived: bool,
    attempt: Option<String>,
}

/// The events a writer job recorded, logged after its commit.
type Journal = Vec<EventInfo>;

/// Records a transition of the current record of `key` (which must exist).
fn event(
    conn: &Connection,
    key: &[&str; 6],
    (transition, actor, detail): (Transition, &str, Option<&str>),
    now: i64,
    journal: &mut Journal,
) -> Result<()> {
    let sql = concat!(
        "INSERT INTO idempotency_events (",
        event_columns!(),
        ") SELECT scope_version, tenant, principal, route, namespace, idem_key, generation, ?7, ?8, attempt, fence, \
         fingerprint, response_status, ?9, ?10, ?7 - created_at FROM idempotency_records WHERE ",
        pk_where!(),
        " RETURNING ",
        event_columns!()
    );
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    let rows = stmt
        .query_map(
            params![
                key[0],
                key[1],
                key[2],
                key[3],
                key[4],
                key[5],
                now,
                transition.as_str(),
                actor,
                detail
            ],
            event_from_row,
        )
        .map_err(unavailable)?;
    for row in rows {
        journal.push(row.map_err(unavailable)??);
    }
    Ok(())
}

fn event_from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<EventInfo, StoreError>> {
    let text = |i| r.get::<_, String>(i);
    let (c1, c2, c3, c4, c5) = (text(1)?, text(2)?, text(3)?, text(4)?, text(5)?);
    let generation: i64 = r.get(6)?;
    let at: i64 = r.get(7)?;
    let transition = text(8)?;
    let attempt: Option<String> = r.get(9)?;
    let fence: i64 = r.get(10)?;
    let fingerprint: Option<String> = r.get(11)?;
    let status: Option<i64> = r.get(12)?;
    let actor = text(13)?;
    let detail: Option<String> = r.get(14)?;
    let duration_ms: i64 = r.get(15)?;
    Ok((|| {
        let scope = scope_from(&c1, &c2, &c3, &c4, &c5)?;
        Ok(EventInfo {
            log_id: scope.log_id(),
            scope,
            generation: u64_from(generation, "generation")?,
            at,
            transition,
            attempt,
            fence: u64_from(fence, "fence")?,
            fingerprint,
            status: status.map(|s| u16::try_from(s).unwrap_or(0)),
            actor,
            detail,
            duration_ms,
        })
    })())
}

/// Moves the current generation of `key` to the history as `ended`.
fn to_history(conn: &Connection, key: &[&str; 6], ended: &str, now: i64) -> Result<()> {
    let sql = concat!(
        "INSERT INTO idempotency_history (",
        record_columns!(),
        ", ended_at) SELECT scope_version, tenant, principal, route, namespace, idem_key, ?7, fingerprint, fence, \
         lease_until, ttl_ms, release_on_unknown, response_status, response_headers, NULL, body_stored, created_at, \
         completed_at, expires_at, archived_at, replay_count, generation, attempt, ?8 FROM idempotency_records WHERE ",
        pk_where!()
    );
    conn.prepare_cached(sql)
        .map_err(unavailable)?
        .execute(params![
            key[0], key[1], key[2], key[3], key[4], key[5], ended, now
        ])
        .map_err(unavailable)?;
    Ok(())
}

/// Ends the current generation of `key` (state `last`): its event, its move
/// to the history, and the key is free.
fn end_generation(
    conn: &Connection,
    key: &[&str; 6],
    last: State,
    by: (Transition, &str, Option<&str>),
    now: i64,
    journal: &mut Journal,
) -> Result<()> {
    event(conn, key, by, now, journal)?;
    to_history(conn, key, record::ended_as(last, by.0), now)?;
    delete(conn, key)?;
    Ok(())
}

fn load(conn: &Connection, key: &[&str; 6]) -> Result<Option<Loaded>> {
    load_with(conn, key, |loaded, _| Ok(loaded))
}

/// Loads a row and hands it to `f` together with a reader of its stored body,
/// so a replay gets status, headers and body from one statement while other
/// decisions never copy the body.
fn load_with<T>(
    conn: &Connection,
    key: &[&str; 6],
    f: impl FnOnce(Option<Loaded>, &dyn Fn() -> Result<Vec<u8>>) -> Result<T>,
) -> Result<T> {
    let sql = concat!("SELECT state, fingerprint, fence, lease_until, ttl_ms, response_status, response_headers, body_stored, completed_at, expires_at, \
         archived_at IS NOT NULL, response_body, attempt FROM idempotency_records WHERE ", pk_where!());
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    let mut rows = stmt
        .query(params![key[0], key[1], key[2], key[3], key[4], key[5]])
        .map_err(unavailable)?;
    let Some(r) = rows.next().map_err(unavailable)? else {
        return f(None, &|| Ok(Vec::new()));
    };
    let cols = (|| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, i64>(4)?,
            r.get::<_, Option<i64>>(5)?,
            r.get::<_, Option<String>>(6)?,
            r.get::<_, bool>(7)?,
            r.get::<_, Option<i64>>(8)?,
            r.get::<_, Option<i64>>(9)?,
            r.get::<_, bool>(10)?,
            r.get::<_, Option<String>>(12)?,
        ))
    })()
    .map_err(unavailable)?;
    let (
        state,
        fp,
        fence,
        lease_until,
        ttl_ms,
        status,
        headers,
        body_stored,
        completed_at,
        expires_at,
        archived,
        attempt,
    ) = cols;
    let loaded = Loaded {
        view: RecordView {
            state: State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("state {state:?}")))?,
            fingerprint: fingerprint_from(fp)?,
            fence: u64_from(fence, "fence")?,
            lease_until,
            status: status.map(|s| u16::try_from(s).unwrap_or(0)),
            body_stored,
            completed_at,
            expires_at,
        },
        ttl_ms: u64_from(ttl_ms, "ttl_ms")?,
        headers: decode_headers(headers.as_deref())?,
        archived,
        attempt,
    };
    let body = || {
        r.get::<_, Option<Vec<u8>>>(11)
            .map(Option::unwrap_or_default)
            .map_err(unavailable)
    };
    f(Some(loaded), &body)
}

fn next_fence(conn: &Connection) -> Result<u64> {
    let v: i64 = conn
        .prepare_cached("UPDATE idempotency_fence SET value = value + 1 WHERE id = 1 RETURNING value")
        .map_err(unavailable)?
        .query_row([], |r| r.get(0))
        .map_err(unavailable)?;
    u64_from(v, "fence")
}

/// Adds the pending replay counts; only ever called on the writer. The fence
/// and state guard keep a late count off a newer record under the same key.
fn apply_replays(conn: &Connection, tally: &ReplayTally) -> Result<()> {
    let batch = tally.take();
    if batch.is_empty() {
        return Ok(());
    }
    let sql = concat!(
        "UPDATE idempotency_records SET replay_count = replay_count + ?8 WHERE ",
        pk_where!(),
        " AND fence = ?7 AND state = 'completed'"
    );
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    for ((key, fence), n) in batch {
        stmt.execute(params![
            key[0],
            key[1],
            key[2],
            key[3],
            key[4],
            key[5],
            i64_from(fence),
            i64_from(n)
        ])
        .map_err(unavailable)?;
    }
    Ok(())
}

/// What a reader's look at a claim's record found.
enum Probe {
    /// An answer that changes nothing.
    Answer(ClaimReply),
    /// A replay of the completed record with this fence.
    Replay(ClaimOutcome, u64),
    /// No record: the writer inserts one unless another claim got there first.
    Absent,
    /// A record the writer must change (take over, turn unknown): it loads
    /// and decides again, since the record may have changed since.
    Write,
}

/// A fresh generation's row; the caller says what a record already there gets.
macro_rules! insert_generation {
    ($on_conflict:literal) => {
        concat!(
            "INSERT INTO idempotency_records (",
            record_columns!(),
            ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'in_progress', ?7, ?8, ?9, ?10, ?11, NULL, NULL, NULL, 0, ?12, NULL, NULL, NULL, 0, ?8, ?13) \
             ON CONFLICT (scope_version, tenant, principal, route, namespace, idem_key) DO ",
            $on_conflict
        )
    };
}

/// Inserts a new generation claimed by `req` with `fence`. With `replace`
/// false it does nothing if a record is there (`false`); with `true` it
/// overwrites it (the caller moved it to the history first).
fn insert_generation(
    conn: &Connection,
    req: &ClaimRequest,
    key: &[&str; 6],
    fence: u64,
    now: i64,
    replace: bool,
) -> Result<bool> {
    let sql = if replace {
        insert_generation!(
            "UPDATE SET state = excluded.state, fingerprint = excluded.fingerprint, fence = excluded.fence, \
             lease_until = excluded.lease_until, ttl_ms = excluded.ttl_ms, release_on_unknown = excluded.release_on_unknown, \
             response_status = NULL, response_headers = NULL, response_body = NULL, body_stored = 0, \
             created_at = excluded.created_at, completed_at = NULL, expires_at = NULL, archived_at = NULL, replay_count = 0, \
             generation = excluded.generation, attempt = excluded.attempt"
        )
    } else {
        insert_generation!("NOTHING")
    };
    let n = conn
        .prepare_cached(sql)
        .map_err(unavailable)?
        .execute(params![
            key[0],
            key[1],
            key[2],
            key[3],
            key[4],
            key[5],
            req.fingerprint.map(|f| f.to_hex()),
            i64_from(fence),
            record::lease_until(now, req.lease_ms),
            i64_from(req.ttl_ms),
            req.on_unknown == OnUnknown::Release,
            now,
            req.attempt.as_ref().map(|a| a.as_str()),
        ])
        .map_err(unavailable)?;
    Ok(n > 0)
}

/// A new key's claim, on the writer, when a reader saw no record: one insert
/// that does nothing if a record appeared since, which is exactly when
/// `decide_claim` would no longer say `Claim` unconditionally. `None` sends
/// the claim through [`claim_on_writer`]; the fence it took then goes unused,
/// which is harmless: fences only need to grow.
fn claim_absent(
    conn: &Connection,
    req: &ClaimRequest,
    key: &[&str; 6],
    now: i64,
    journal: &mut Journal,
) -> Result<Option<u64>> {
    let fence = next_fence(conn)?;
    if !insert_generation(conn, req, key, fence, now, false)? {
        return Ok(None);
    }
    event(
        conn,
        key,
        (Transition::Claimed, actor::FILTER, None),
        now,
        journal,
    )?;
    Ok(Some(fence))
}

/// Read, decide with the shared rules, write: only ever called on the writer.
fn claim_on_writer(
    conn: &Connection,
    req: &ClaimRequest,
    now: i64,
    journal: &mut Journal,
) -> Result<ClaimOutcome> {
    let key = pk(&req.scope);
    let (loaded, decision, body) = load_with(conn, &key, |loaded, body| {
        let decision = record::decide_claim(loaded.as_ref().map(|l| &l.view), req, now);
        let body = match decision {
            ClaimDecision::Replay { .. } => body()?,
            _ => Vec::new(),
        };
        Ok((loaded, decision, body))
    })?;
    match decision {
        ClaimDecision::Answer(reply) => Ok(ClaimOutcome::answer(reply)),
        ClaimDecision::Claim => {
            // The generation it replaces keeps its row in the history.
            let transition = match &loaded {
                Some(old) => {
                    to_history(
                        conn,
                        &key,
                        record::ended_as(old.view.state, Transition::Reclaimed),
                        now,
                    )?;
                    Transition::Reclaimed
                }
                None => Transition::Claimed,
            };
            let fence = next_fence(conn)?;
            insert_generation(conn, req, &key, fence, now, true)?;
            event(conn, &key, (transition, actor::FILTER, None), now, journal)?;
            Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }))
        }
        ClaimDecision::Replay { status, completed_at } => {
            let sql = concat!(
                "UPDATE idempotency_records SET replay_count = replay_count + 1 WHERE ",
                pk_where!()
            );
            conn.prepare_cached(sql)
                .map_err(unavailable)?
                .execute(params![key[0], key[1], key[2], key[3], key[4], key[5]])
                .map_err(unavailable)?;
            let headers = loaded.and_then(|l| l.headers);
            Ok(ClaimOutcome::replay(status, headers, completed_at, body))
        }
        ClaimDecision::BecomeUnknown => {
            let ttl_ms = loaded.map(|l| l.ttl_ms).unwrap_or(0);
            set_unknown(conn, &key, record::unknown_expiry(now, ttl_ms))?;
            event(
                conn,
                &key,
                (Transition::LeaseExpired, actor::FILTER, Some("unknown")),
                now,
                journal,
            )?;
            Ok(ClaimOutcome {
                reply: ClaimReply::Unknown,
                body: Vec::new(),
                became_unknown: true,
            })
        }
    }
}

fn info_from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<RecordInfo, StoreError>> {
    // Column 0 is the scope version, which `scope_from` supplies itself.
    let cols = (
        r.get::<_, String>(1)?,
        r.get::<_, String>(2)?,
        r.get::<_, String>(3)?,
        r.get::<_, String>(4)?,
        r.get::<_, String>(5)?,
    );
    let state: String = r.get(6)?;
    let fingerprint: Option<String> = r.get(7)?;
    let fence: i64 = r.get(8)?;
    let lease_until: i64 = r.get(9)?;
    let ttl_ms: i64 = r.get(10)?;
    let release: bool = r.get(11)?;
    let status: Option<i64> = r.get(12)?;
    let headers: Option<String> = r.get(13)?;
    let body_len: Option<i64> = r.get(14)?;
    let body_stored: bool = r.get(15)?;
    let created_at: i64 = r.get(16)?;
    let completed_at: Option<i64> = r.get(17)?;
    let expires_at: Option<i64> = r.get(18)?;
    let archived_at: Option<i64> = r.get(19)?;
    let replay_count: i64 = r.get(20)?;
    let generation: i64 = r.get(21)?;
    let attempt: Option<String> = r.get(22)?;
    let ended_at: Option<i64> = r.get(23)?;
    Ok((|| {
        let scope = scope_from(&cols.0, &cols.1, &cols.2, &cols.3, &cols.4)?;
        Ok(RecordInfo {
            log_id: scope.log_id(),
            scope,
            state,
            fingerprint,
            fence: u64_from(fence, "fence")?,
            lease_until,
            ttl_ms: u64_from(ttl_ms, "ttl_ms")?,
            on_unknown: on_unknown_from(release),
            status: status.map(|s| u16::try_from(s).unwrap_or(0)),
            headers: decode_headers(headers.as_deref())?,
            body_stored,
            body_len: body_len.map(|l| u64::try_from(l).unwrap_or(0)),
            created_at,
            completed_at,
            expires_at,
            archived_at,
            replay_count: u64_from(replay_count, "replay_count")?,
            generation: u64_from(generation, "generation")?,
            attempt,
            ended_at,
        })
    })())
}

fn query_infos(conn: &Connection, sql: &str, params: &[&dyn rusqlite::ToSql]) -> Result<Vec<RecordInfo>> {
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    let rows = stmt.query_map(params, info_from_row).map_err(unavailable)?;
    let mut out = Vec::new();
    for row in rows {
        out.push(row.map_err(unavailable)??);
    }
    Ok(out)
}

/// Deletes a record; `true` when there was one.
fn delete(conn: &Connection, key: &[&str; 6]) -> Result<bool> {
    let sql = concat!("DELETE FROM idempotency_records WHERE ", pk_where!());
    let n = conn
        .prepare_cached(sql)
        .map_err(unavailable)?
        .execute(params![key[0], key[1], key[2], key[3], key[4], key[5]])
        .map_err(unavailable)?;
    Ok(n > 0)
}

fn set_unknown(conn: &Connection, key: &[&str; 6], expires_at: i64) -> Result<()> {
    let sql = concat!(
        "UPDATE idempotency_records SET state = 'unknown', expires_at = ?7 WHERE ",
        pk_where!()
    );
    conn.prepare_cached(sql)
        .map_err(unavailable)?
        .execute(params![
            key[0], key[1], key[2], key[3], key[4], key[5], expires_at
        ])
        .map_err(unavailable)?;
    Ok(())
}

/// Changes a record only if the caller holds its current fence and it is
/// still open; `record::may_fence` is the rule, checked on the writer.
fn fenced(conn: &Connection, key: &[&str; 6], fence: u64) -> Result<Option<Loaded>> {
    Ok(load(conn, key)?.filter(|l| !l.archived && record::may_fence(l.view.state, l.view.fence, fence)))
}

#[async_trait]
impl Backend for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> Result<()> {
        self.write(|conn| {
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
        self.read(|conn| {
            conn.query_row("SELECT value FROM idempotency_fence WHERE id = 1", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(unavailable)?;
            Ok(())
        })
        .await
    }

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        // Answers and replays change nothing the caller waits for: they are
        // decided on a reader, in parallel, from the last committed state.
        // One copy of the request, shared by the reader's and the writer's job.
        let req = Arc::new(req.clone());
        let shared = Arc::clone(&req);
        let probe = self
            .read(move |conn| {
                let probe = &*shared;
                load_with(conn, &pk(&probe.scope), |loaded, body| {
                    let Some(loaded) = loaded else {
                        return Ok(Probe::Absent);
                    };
                    Ok(match record::decide_claim(Some(&loaded.view), probe, now) {
                        ClaimDecision::Answer(reply) => Probe::Answer(reply),
                        ClaimDecision::Replay { status, completed_at } => {
                            let outcome = ClaimOutcome::replay(status, loaded.headers, completed_at, body()?);
                            Probe::Replay(outcome, loaded.view.fence)
                        }
                        ClaimDecision::Claim | ClaimDecision::BecomeUnknown => Probe::Write,
                    })
                })
            })
            .await?;
        let absent = match probe {
            Probe::Answer(reply) => return Ok(ClaimOutcome::answer(reply)),
            Probe::Replay(outcome, fence) => {
                self.count_replay(pk(&req.scope).map(String::from), fence);
                return Ok(outcome);
            }
            Probe::Absent => true,
            Probe::Write => false,
        };
        self.write_logged(move |conn, journal| {
            // Nobody waits for this claim any more: committing it would only
            // leave a record that its filter is abandoning.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(StoreError::Late);
            }
            if absent {
                if let Some(fence) = claim_absent(conn, &req, &pk(&req.scope), now, journal)? {
                    return Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }));
                }
            }
            claim_on_writer(conn, &req, now, journal)
        })
        .await
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        let scope = req.scope.clone();
        let (fence, status, headers, body_stored) = (
            req.fence,
            req.status,
            encode_headers(&req.headers),
            req.body_stored,
        );
        let body = body_stored.then(|| body.to_vec());
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            let Some(loaded) = fenced(conn, &key, fence)? else {
                return Ok(FenceReply::Stale);
            };
            let sql = concat!("UPDATE idempotency_records SET state = 'completed', response_status = ?7, response_headers = ?8, \
                 response_body = ?9, body_stored = ?10, completed_at = ?11, expires_at = ?12, lease_until = ?11 WHERE ", pk_where!());
            conn.prepare_cached(sql)
                .map_err(unavailable)?
                .execute(params![
                    key[0],
                    key[1],
                    key[2],
                    key[3],
                    key[4],
                    key[5],
                    status,
                    headers,
                    body,
                    body_stored,
                    now,
                    record::completion_expiry(now, loaded.ttl_ms),
                ])
                .map_err(unavailable)?;
            event(conn, &key, (Transition::Completed, actor::FILTER, None), now, journal)?;
            Ok(FenceReply::Done)
        })
        .await
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let scope = req.scope.clone();
        let fence = req.fence;
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            let Some(loaded) = fenced(conn, &key, fence)? else {
                return Ok(FenceReply::Stale);
            };
            let by = (Transition::Released, actor::FILTER, None);
            end_generation(conn, &key, loaded.view.state, by, now, journal)?;
            Ok(FenceReply::Done)
        })
        .await
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        let scope = req.scope.clone();
        let attempt = req.attempt.clone();
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            match load(conn, &key)? {
                Some(l) if !l.archived && record::may_abandon(l.view.state, l.attempt.as_deref(), attempt.as_str()) => {
                    let by = (Transition::Abandoned, actor::FILTER, None);
                    end_generation(conn, &key, l.view.state, by, now, journal)?;
                    Ok(FenceReply::Done)
                }
                Some(_) => Ok(FenceReply::Stale),
                None => {
                    let sql = "INSERT INTO idempotency_abandoned (scope_version, tenant, principal, route, namespace, idem_key, \
                               attempt, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) ON CONFLICT DO NOTHING";
                    conn.prepare_cached(sql)
                        .map_err(unavailable)?
                        .execute(params![key[0], key[1], key[2], key[3], key[4], key[5], attempt.as_str(), now])
                        .map_err(unavailable)?;
                    Ok(FenceReply::Done)
                }
            }
        })
        .await
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let scope = req.scope.clone();
        let fence = req.fence;
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            let Some(loaded) = fenced(conn, &key, fence)? else {
                return Ok(FenceReply::Stale);
            };
            if loaded.view.state == State::Unknown {
                return Ok(FenceReply::Done);
            }
            set_unknown(conn, &key, record::unknown_expiry(now, loaded.ttl_ms))?;
            event(
                conn,
                &key,
                (Transition::MarkedUnknown, actor::FILTER, None),
                now,
                journal,
            )?;
            Ok(FenceReply::Done)
        })
        .await
    }

    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        // Operators see every replay served so far: pending counts are
        // applied first (and any flush already queued is committed by then).
        let tally = Arc::clone(&self.replays);
        if let Err(e) = self.write(move |conn| apply_replays(conn, &tally)).await {
            tracing::warn!("sqlite: replay counts not applied before a lookup: {e}");
        }
        let q = q.clone();
        self.read(move |conn| {
            const MATCH: &str = "tenant = ?1 AND idem_key = ?2 AND (?3 IS NULL OR route = ?3) \
                                 AND (?4 IS NULL OR principal = ?4) AND (?5 IS NULL OR namespace = ?5)";
            let ns = q.namespace.map(|n| n.as_str());
            let sql = format!(
                "SELECT {cols}, NULL, 1 AS current FROM idempotency_records WHERE {MATCH} \
                 UNION ALL SELECT {cols}, ended_at, 0 FROM idempotency_history WHERE {MATCH} \
                 ORDER BY current DESC, generation DESC LIMIT ?6",
                cols = columns!()
            );
            let records = query_infos(
                conn,
                &sql,
                params![q.tenant, q.key, q.route, q.principal, ns, limit],
            )?;
            let sql = format!(
                "SELECT {} FROM idempotency_events WHERE {MATCH} ORDER BY id LIMIT ?6",
                event_columns!()
            );
            let mut stmt = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows = stmt
                .query_map(
                    params![
                        q.tenant,
                        q.key,
                        q.route,
                        q.principal,
                        ns,
                        limit.saturating_mul(16)
                    ],
                    event_from_row,
                )
                .map_err(unavailable)?;
            let mut events = Vec::new();
            for row in rows {
                events.push(row.map_err(unavailable)??);
            }
            Ok(KeyHistory { records, events })
        })
        .await
    }

    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        self.read(move |conn| match which {
            Listing::Unknown => {
                let sql = concat!("SELECT ", columns!(), ", NULL FROM idempotency_records WHERE state = 'unknown' AND archived_at IS NULL ORDER BY created_at LIMIT ?1");
                query_infos(conn, sql, params![limit])
            }
            Listing::Stuck { older_than_ms } => {
                let sql = concat!("SELECT ", columns!(), ", NULL FROM idempotency_records WHERE state = 'in_progress' AND created_at <= ?1 ORDER BY created_at LIMIT ?2");
                let before = now.saturating_sub(i64_from(older_than_ms));
                query_infos(conn, sql, params![before, limit])
            }
        })
        .await
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, now: i64) -> Result<bool> {
        let scope = scope.clone();
        let how = how.clone();
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            let Some(loaded) = load(conn, &key)? else {
                return Ok(false);
            };
            if loaded.archived || !matches!(loaded.view.state, State::InProgress | State::Unknown) {
                return Ok(false);
            }
            match how {
                Resolution::Release => {
                    let by = (Transition::Resolved, actor::OPERATOR, Some("release"));
                    end_generation(conn, &key, loaded.view.state, by, now, journal)?;
                }
                Resolution::Complete { status, headers, body } => {
                    // A new fence: the old owner's late completion must not
                    // overwrite what the operator decided.
                    let fence = next_fence(conn)?;
                    let sql = concat!("UPDATE idempotency_records SET state = 'completed', fence = ?7, response_status = ?8, response_headers = ?9, \
                         response_body = ?10, body_stored = 1, completed_at = ?11, expires_at = ?12, lease_until = ?11 WHERE ", pk_where!());
                    conn.execute(
                        sql,
                        params![
                            key[0],
                            key[1],
                            key[2],
                            key[3],
                            key[4],
                            key[5],
                            i64_from(fence),
                            status,
                            encode_headers(&headers),
                            body.into_bytes(),
                            now,
                            record::completion_expiry(now, loaded.ttl_ms),
                        ],
                    )
                    .map_err(unavailable)?;
                    event(conn, &key, (Transition::Resolved, actor::OPERATOR, Some("complete")), now, journal)?;
                }
            }
            Ok(true)
        })
        .await
    }

    async fn purge(&self, scope: &Scope, now: i64) -> Result<bool> {
        let scope = scope.clone();
        self.write_logged(move |conn, journal| {
            let key = pk(&scope);
            let Some(loaded) = load(conn, &key)? else {
                return Ok(false);
            };
            end_generation(
                conn,
                &key,
                loaded.view.state,
                (Transition::Purged, actor::OPERATOR, None),
                now,
                journal,
            )?;
            Ok(true)
        })
        .await
    }

    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let SweepPolicy {
            batch,
            audit_retention_ms,
        } = *policy;
        self.write_logged(move |conn, journal| {
            let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
            let mut report = SweepReport::default();
            let picked = |sql: &str, at: i64| -> Result<Vec<[String; 6]>> {
                let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
                let rows = stmt
                    .query_map(params![at, batch], |r| {
                        Ok([r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?])
                    })
                    .map_err(unavailable)?;
                rows.collect::<rusqlite::Result<_>>().map_err(unavailable)
            };
            // Leases that ran out: released or turned unknown, as the claim's policy said.
            for k in picked(concat!("SELECT ", pk_list!(), " FROM idempotency_records WHERE state = 'in_progress' AND lease_until <= ?1 \
                                     AND release_on_unknown = 1 LIMIT ?2"), now)? {
                let key = k.each_ref().map(String::as_str);
                end_generation(conn, &key, State::InProgress, (Transition::LeaseExpired, actor::SWEEPER, Some("released")), now, journal)?;
                report.released += 1;
            }
            for k in picked(concat!("SELECT ", pk_list!(), " FROM idempotency_records WHERE state = 'in_progress' AND lease_until <= ?1 \
                                     AND release_on_unknown = 0 LIMIT ?2"), now)? {
                let key = k.each_ref().map(String::as_str);
                let ttl_ms: i64 = conn
                    .prepare_cached(concat!("SELECT ttl_ms FROM idempotency_records WHERE ", pk_where!()))
                    .map_err(unavailable)?
                    .query_row(params![key[0], key[1], key[2], key[3], key[4], key[5]], |r| r.get(0))
                    .map_err(unavailable)?;
                set_unknown(conn, &key, record::unknown_expiry(now, u64_from(ttl_ms, "ttl_ms")?))?;
                event(conn, &key, (Transition::LeaseExpired, actor::SWEEPER, Some("unknown")), now, journal)?;
                report.marked_unknown += 1;
            }
            // Claims that landed after their filter had abandoned them.
            for k in picked("SELECT r.scope_version, r.tenant, r.principal, r.route, r.namespace, r.idem_key \
                                     FROM idempotency_abandoned a JOIN idempotency_records r USING (scope_version, tenant, principal, route, namespace, idem_key, attempt) \
                                     WHERE r.state IN ('in_progress', 'unknown') AND r.archived_at IS NULL AND ?1 = ?1 LIMIT ?2", now)? {
                let key = k.each_ref().map(String::as_str);
                let Some(loaded) = load(conn, &key)? else { continue };
                end_generation(conn, &key, loaded.view.state, (Transition::Abandoned, actor::SWEEPER, None), now, journal)?;
                report.abandoned += 1;
            }
            conn.prepare_cached("DELETE FROM idempotency_abandoned WHERE at <= ?1")
                .map_err(unavailable)?
                .execute(params![now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS)])
                .map_err(unavailable)?;
            // Expired records: body dropped, metadata kept.
            for k in picked(concat!("SELECT ", pk_list!(), " FROM idempotency_records WHERE archived_at IS NULL AND expires_at <= ?1 LIMIT ?2"), now)? {
                let key = k.each_ref().map(String::as_str);
                let sql = concat!("UPDATE idempotency_records SET archived_at = ?7, response_body = NULL WHERE ", pk_where!());
                conn.prepare_cached(sql)
                    .map_err(unavailable)?
                    .execute(params![key[0], key[1], key[2], key[3], key[4], key[5], now])
                    .map_err(unavailable)?;
                event(conn, &key, (Transition::Archived, actor::SWEEPER, None), now, journal)?;
                report.archived += 1;
            }
            // Past the audit retention: archived generations, history, events.
            let cutoff = now.saturating_sub(i64_from(audit_retention_ms));
            let purged = conn
                .execute(
                    "DELETE FROM idempotency_records WHERE rowid IN (SELECT rowid FROM idempotency_records \
                     WHERE archived_at IS NOT NULL AND archived_at <= ?1 LIMIT ?2)",
                    params![cutoff, batch],
                )
                .map_err(unavailable)?
                + conn
                    .execute(
                        "DELETE FROM idempotency_history WHERE rowid IN (SELECT rowid FROM idempotency_history \
                         WHERE ended_at <= ?1 LIMIT ?2)",
                        params![cutoff, batch],
                    )
                    .map_err(unavailable)?;
            report.purged = count(purged);
            report.events_purged = count(
                conn.execute(
                    "DELETE FROM idempotency_events WHERE id IN (SELECT id FROM idempotency_events WHERE at <= ?1 LIMIT ?2)",
                    params![cutoff, batch],
                )
                .map_err(unavailable)?,
            );
            Ok(report)
        })
        .await
    }

    async fn oldest_in_progress(&self) -> Result<Option<i64>> {
        self.read(|conn| {
            conn.query_row(
                "SELECT min(created_at) FROM idempotency_records WHERE state = 'in_progress'",
                [],
                |r| r.get(0),
            )
            .map_err(unavailable)
        })
        .await
    }
}
