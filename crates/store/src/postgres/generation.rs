//! The steps every operation is made of, inside a transaction: lock the
//! record, record a transition, end a generation, turn one unknown.
//! Statements address the current record by its key, `$1`; their own
//! parameters start at `$2`.

use std::sync::LazyLock;

use idemgate_core::record::{self, Standing, State, Transition};

use super::pool::{On, Tx};
use super::rows::{Bind, Param, LOADED};
use crate::backend::{Actor, EventInfo, Result};
use crate::row_mapping::{event_select, i64_from, LoadedRecord, ScopeDigest, EVENT_OWN_COLUMNS};
use crate::shared_statements::{DELETE_RECORD, TO_HISTORY};

/// A transition, who caused it, and an optional detail.
pub(super) type By<'a> = (Transition, &'a Actor, Option<&'a str>);

/// Runs a statement about the record of `key`, its own parameters from `$2`.
pub(super) async fn execute(tx: &Tx<'_>, sql: &str, key: &ScopeDigest, extra: &[Param<'_>]) -> Result<u64> {
    tx.execute(sql, &key.bind(extra)).await
}

/// A transition of the current record, written in `tx` and returned for the log.
pub(super) async fn event(tx: &Tx<'_>, key: &ScopeDigest, by: By<'_>, now: i64) -> Result<Vec<EventInfo>> {
    noted_event(tx, key, by, None, now).await
}

/// [`event`] with an operator's reason, kept in the event row. The row
/// names its generation; the scope, attempt and fingerprint the log shows
/// are read off the record.
pub(super) async fn noted_event(
    tx: &Tx<'_>,
    key: &ScopeDigest,
    by: By<'_>,
    reason: Option<&str>,
    now: i64,
) -> Result<Vec<EventInfo>> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        event_of(
            "",
            &format!(
                "SELECT generation, $2::bigint, $3::text, fence, response_status, $4::text, $5::text, \
                 $2 - created_at, $6::text FROM idempotency_records WHERE {}",
                key_where!()
            ),
            concat!("idempotency_records g WHERE ", key_where!()),
        )
    });
    let (transition, actor, detail) = by;
    let (name, actor) = (transition.as_str(), actor.as_str());
    let rows = tx
        .query(&SQL, &key.bind(&[&now, &name, &actor, &detail, &reason]))
        .await?;
    rows.iter().map(EventInfo::read).collect()
}

/// A statement that inserts the event `values` selects (its
/// [`EVENT_OWN_COLUMNS`]) and returns it as [`crate::row_mapping::EVENT_COLUMNS`],
/// its generation's columns taken from `generation` (a table or a common
/// table expression of `with`, named `g`, with its condition), which has
/// the generation's one row.
pub(super) fn event_of(with: &str, values: &str, generation: &str) -> String {
    format!(
        "WITH {with}ev AS (INSERT INTO idempotency_events ({EVENT_OWN_COLUMNS}) {values} \
         RETURNING {EVENT_OWN_COLUMNS}) SELECT {} FROM ev, {generation}",
        event_select("ev", "g")
    )
}

/// Moves the current generation to the history as `ended`.
pub(super) async fn to_history(tx: &Tx<'_>, key: &ScopeDigest, ended: Standing, now: i64) -> Result<()> {
    execute(tx, TO_HISTORY.postgres(), key, &[&ended.as_str(), &now])
        .await
        .map(drop)
}

/// Ends the current generation (state `last`): its event (with an
/// operator's reason), its move to the history, and the key is free.
pub(super) async fn end_generation(
    tx: &Tx<'_>,
    key: &ScopeDigest,
    last: State,
    (by, reason): (By<'_>, Option<&str>),
    now: i64,
) -> Result<Vec<EventInfo>> {
    let events = noted_event(tx, key, by, reason, now).await?;
    to_history(tx, key, record::ended_as(last, by.0), now).await?;
    execute(tx, DELETE_RECORD.postgres(), key, &[]).await?;
    Ok(events)
}

/// The current record, locked for the rest of `tx`, and its stored body.
pub(super) async fn lock(tx: &Tx<'_>, key: &ScopeDigest) -> Result<Option<(LoadedRecord, Vec<u8>)>> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {LOADED}, response_body FROM idempotency_records WHERE {} FOR UPDATE",
            key_where!()
        )
    });
    let stmt = tx.prepare(&SQL).await?;
    let Some(row) = tx.opt(&stmt, &key.bind(&[])).await? else {
        return Ok(None);
    };
    use crate::row_mapping::ColumnReader;
    let body = row.optional_bytes("response_body")?.unwrap_or_default();
    Ok(Some((LoadedRecord::read(&row)?, body)))
}

/// Turns an in-progress record unknown until `expires_at`
/// ([`record::unknown_expiry`]), guarded by the fence and state it was read with.
pub(super) async fn set_unknown(
    tx: &Tx<'_>,
    key: &ScopeDigest,
    read_with: (u64, State),
    expires_at: i64,
) -> Result<()> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "UPDATE idempotency_records SET state = {}, expires_at = $3 WHERE {} AND fence = $2 AND state = $4",
            crate::conditions::state(State::Unknown),
            key_where!()
        )
    });
    let (fence, state) = (i64_from(read_with.0), read_with.1.as_str());
    execute(tx, &SQL, key, &[&fence, &expires_at, &state])
        .await
        .map(drop)
}
