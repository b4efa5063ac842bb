//! The steps every operation is made of, on the writer: record a
//! transition, start a generation, end one, turn one unknown. Statements
//! address the current record by its key, `?1`; their own parameters start
//! at `?2`.

use std::sync::LazyLock;

use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::ClaimRequest;
use idemgate_core::record::{self, Standing, State, Transition};
use rusqlite::Connection;

use super::errors::unavailable;
use super::rows::{query_events, Bind, INSERT_GENERATION, REPLACE_GENERATION};
use super::stored::{StoredActor, StoredAttempt, StoredFingerprint, StoredTransition};
use crate::backend::{Actor, EventInfo, Result};
use crate::conditions;
use crate::replay_counts::ReplayKey;
use crate::row_mapping::{i64_from, KeyColumns, ScopeDigest, EVENT_OWN_COLUMNS};
use crate::shared_statements::{DELETE_RECORD, TO_HISTORY};

/// The events a writer job recorded, logged after its commit.
pub(super) type Journal = Vec<EventInfo>;

/// A transition, who caused it, and an optional detail.
pub(super) type By<'a> = (Transition, &'a Actor, Option<&'a str>);

/// Records a transition of the current record of `key` (which must exist).
pub(super) fn event(
    conn: &Connection,
    key: &ScopeDigest,
    by: By<'_>,
    now: i64,
    journal: &mut Journal,
) -> Result<()> {
    noted_event(conn, key, by, None, now, journal)
}

/// [`event`] with an operator's reason, kept in the event row. The event
/// is read off the record as operators will see it, then its own columns
/// are written: the row names its generation instead of copying its scope.
pub(super) fn noted_event(
    conn: &Connection,
    key: &ScopeDigest,
    by: By<'_>,
    reason: Option<&str>,
    now: i64,
    journal: &mut Journal,
) -> Result<()> {
    const SQL: &str = concat!(
        "SELECT scope_version, tenant, principal, route, namespace, idem_key, generation, ?2, ?3, attempt, fence, \
         fingerprint, response_status, ?4, ?5, ?2 - created_at, ?6 FROM idempotency_records WHERE ",
        key_where!()
    );
    static INSERT: LazyLock<String> = LazyLock::new(|| {
        format!(
            "INSERT INTO idempotency_events ({EVENT_OWN_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
        )
    });
    let (transition, actor, detail) = by;
    let (transition, actor) = (StoredTransition(transition), StoredActor(actor));
    let events = query_events(
        conn,
        SQL,
        &key.bind(&[&now, &transition, &actor, &detail, &reason]),
    )?;
    let mut insert = conn.prepare_cached(&INSERT).map_err(unavailable)?;
    for e in &events {
        insert
            .execute(rusqlite::params![
                i64_from(e.generation),
                e.at,
                StoredTransition(e.transition),
                i64_from(e.fence),
                e.status,
                StoredActor(&e.actor),
                e.detail,
                e.duration_ms,
                e.reason,
            ])
            .map_err(unavailable)?;
    }
    journal.extend(events);
    Ok(())
}

/// Moves the current generation of `key` to the history as `ended`.
pub(super) fn to_history(conn: &Connection, key: &ScopeDigest, ended: Standing, now: i64) -> Result<()> {
    conn.prepare_cached(TO_HISTORY.sqlite())
        .map_err(unavailable)?
        .execute(key.bind(&[&ended.as_str(), &now]).as_slice())
        .map_err(unavailable)?;
    Ok(())
}

/// Ends the current generation of `key` (state `last`): its event (with an
/// operator's reason), its move to the history, and the key is free.
pub(super) fn end_generation(
    conn: &Connection,
    key: &ScopeDigest,
    last: State,
    (by, reason): (By<'_>, Option<&str>),
    now: i64,
    journal: &mut Journal,
) -> Result<()> {
    noted_event(conn, key, by, reason, now, journal)?;
    to_history(conn, key, record::ended_as(last, by.0), now)?;
    execute(conn, DELETE_RECORD.sqlite(), key, &[])
}

/// Runs a statement about the record of `key`, its own parameters from `?2`.
pub(super) fn execute(
    conn: &Connection,
    sql: &str,
    key: &ScopeDigest,
    extra: &[&dyn rusqlite::ToSql],
) -> Result<()> {
    conn.prepare_cached(sql)
        .map_err(unavailable)?
        .execute(key.bind(extra).as_slice())
        .map_err(unavailable)?;
    Ok(())
}

/// Inserts a new generation claimed by `req` with `fence`. With `replace`
/// false it does nothing if a record is there (`false`); with `true` it
/// overwrites it (the caller moved it to the history first).
pub(super) fn insert_generation(
    conn: &Connection,
    req: &ClaimRequest,
    key: &ScopeDigest,
    fence: u64,
    now: i64,
    replace: bool,
) -> Result<bool> {
    let sql: &str = if replace {
        &REPLACE_GENERATION
    } else {
        &INSERT_GENERATION
    };
    let columns = KeyColumns::of(&req.scope);
    let fingerprint = StoredFingerprint(req.fingerprint);
    let (fence, lease_until, ttl_ms) = (
        i64_from(fence),
        record::lease_until(now, req.lease_ms),
        i64_from(req.ttl_ms),
    );
    let release = req.on_unknown == OnUnknown::Release;
    let attempt = StoredAttempt(req.attempt.as_ref().map(|a| a.as_str()));
    let mut params: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(14);
    params.push(key);
    params.extend(columns.0.iter().map(|c| c as &dyn rusqlite::ToSql));
    params.extend_from_slice(&[
        &fingerprint,
        &fence,
        &lease_until,
        &ttl_ms,
        &release,
        &now,
        &attempt,
    ]);
    let n = conn
        .prepare_cached(sql)
        .map_err(unavailable)?
        .execute(params.as_slice())
        .map_err(unavailable)?;
    Ok(n > 0)
}

/// Turns the record unknown until `expires_at` ([`record::unknown_expiry`]).
/// No guard: the writer is the only one that changes records, so the record
/// is as its job read it.
pub(super) fn set_unknown(conn: &Connection, key: &ScopeDigest, expires_at: i64) -> Result<()> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "UPDATE idempotency_records SET state = {}, expires_at = ?2 WHERE {}",
            conditions::state(State::Unknown),
            key_where!()
        )
    });
    execute(conn, &SQL, key, &[&expires_at])
}

/// Adds the pending replay counts; only ever called on the writer. The fence
/// and state guard keep a late count off a newer record under the same key.
pub(super) fn apply_replays(conn: &Connection, batch: Vec<(ReplayKey, u64)>) -> Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    static SQL: LazyLock<String> = LazyLock::new(|| {
        conditions::expand(concat!(
            "UPDATE idempotency_records SET replay_count = replay_count + ?3 WHERE ",
            key_where!(),
            " AND fence = ?2 AND {replayable}"
        ))
    });
    let mut stmt = conn.prepare_cached(&SQL).map_err(unavailable)?;
    for ((key, fence), n) in batch {
        stmt.execute(key.bind(&[&i64_from(fence), &i64_from(n)]).as_slice())
            .map_err(unavailable)?;
    }
    Ok(())
}
