//! What operators and the monitoring read: a key's generations and events,
//! the unknown and stuck listings, the open records. Each picks and orders
//! rows as the SQL backends' statements do (`sqlite` `lookup`,
//! `LIST_UNKNOWN`, `LIST_STUCK`, [`crate::conditions::OPEN_RECORDS`]), with
//! the same conditions ([`crate::conditions`]).

use idemgate_core::config::OnUnknown;
use idemgate_core::record::Standing;
use idemgate_core::scope::Scope;

use super::tables::{Current, Generation, Tables};
use crate::backend::{KeyHistory, Listing, Lookup, OpenRecords, RecordInfo, Result};
use crate::conditions;
use crate::row_mapping::{decode_headers, i64_from};

/// Whether `scope` is one of the records `q` looks for: its tenant and
/// key, and each other component `q` names.
fn matches(q: &Lookup, scope: &Scope) -> bool {
    scope.tenant() == q.tenant
        && scope.key().as_str() == q.key
        && q.route.as_deref().is_none_or(|r| scope.route() == r)
        && q.principal.as_deref().is_none_or(|p| scope.principal() == p)
        && q.namespace.is_none_or(|n| scope.namespace() == n)
}

/// A generation as operators see it (`ended_at`: `None` while current).
fn info(row: &Generation, state: Standing, ended_at: Option<i64>) -> Result<RecordInfo> {
    Ok(RecordInfo {
        scope: row.scope.clone(),
        log_id: String::new(),
        state,
        fingerprint: row.fingerprint.map(|f| f.to_hex()),
        fence: row.fence,
        lease_until: row.lease_until,
        ttl_ms: row.ttl_ms,
        on_unknown: if row.release_on_unknown {
            OnUnknown::Release
        } else {
            OnUnknown::Conflict
        },
        status: row.status,
        headers: decode_headers(row.headers.as_deref())?,
        response_key: None,
        body_stored: row.body_stored,
        body_len: row
            .body
            .as_ref()
            .map(|b| u64::try_from(b.len()).unwrap_or(u64::MAX)),
        created_at: row.created_at,
        completed_at: row.completed_at,
        expires_at: row.expires_at,
        archived_at: row.archived_at,
        replay_count: row.replay_count,
        generation: row.generation,
        attempt: row.attempt.clone(),
        ended_at,
    })
}

fn current_info(c: &Current) -> Result<RecordInfo> {
    info(&c.row, Standing::In(c.state), None)
}

/// Every generation of the records `q` looks for, current ones first, then
/// the newest first (at most `limit`), and their events, oldest first (at
/// most 16 a generation asked for).
pub(super) fn lookup(t: &Tables, q: &Lookup, limit: u32) -> Result<KeyHistory> {
    let mut current: Vec<&Current> = t.records.values().filter(|c| matches(q, &c.row.scope)).collect();
    current.sort_by_key(|c| std::cmp::Reverse(c.row.generation));
    let mut ended: Vec<_> = t.history.iter().filter(|e| matches(q, &e.row.scope)).collect();
    ended.sort_by_key(|e| std::cmp::Reverse(e.row.generation));
    let records = current
        .into_iter()
        .map(current_info)
        .chain(ended.into_iter().map(|e| info(&e.row, e.state, Some(e.ended_at))))
        .take(as_count(limit))
        .collect::<Result<Vec<_>>>()?;
    let events = t
        .events
        .iter()
        .filter(|e| matches(q, &e.scope))
        .take(as_count(limit.saturating_mul(16)))
        .cloned()
        .collect();
    Ok(KeyHistory { records, events })
}

/// Unknown records, or in-progress ones created `older_than_ms` before
/// `now` or earlier: the oldest first, at most `limit`.
pub(super) fn list(t: &Tables, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
    let picked: Box<dyn Fn(&Current) -> bool> = match which {
        Listing::Unknown => Box::new(|c| conditions::unknown(c.state) && c.row.archived_at.is_none()),
        Listing::Stuck { older_than_ms } => {
            let before = now.saturating_sub(i64_from(older_than_ms));
            Box::new(move |c| conditions::leased(c.state) && c.row.created_at <= before)
        }
    };
    let mut records: Vec<&Current> = t.records.values().filter(|c| picked(c)).collect();
    records.sort_by_key(|c| (c.row.created_at, c.rowid));
    records
        .into_iter()
        .take(as_count(limit))
        .map(current_info)
        .collect()
}

/// What the monitoring samples.
pub(super) fn open_records(t: &Tables) -> OpenRecords {
    let leased = t.records.values().filter(|c| conditions::leased(c.state));
    let unknown: Vec<&Current> = t
        .records
        .values()
        .filter(|c| conditions::unknown(c.state) && c.row.archived_at.is_none())
        .collect();
    OpenRecords {
        oldest_in_progress: leased.map(|c| c.row.created_at).min(),
        unknown: u64::try_from(unknown.len()).unwrap_or(u64::MAX),
        oldest_unknown: unknown.iter().map(|c| c.row.created_at).min(),
    }
}

/// A limit as a count of rows.
pub(super) fn as_count(limit: u32) -> usize {
    usize::try_from(limit).unwrap_or(usize::MAX)
}
