//! The tables' columns, once for both backends: their names, how a row turns
//! into the values the rest of the store uses, and the six key columns.
//!
//! Rows are read by column name through [`ColumnReader`], which each backend
//! implements for its own row type, so a statement's select list can be in
//! any order and the mapping is written only here.

use idemgate_core::config::OnUnknown;
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::key::Key;
use idemgate_core::record::{self, RecordView, Standing, State, Transition};
use idemgate_core::scope::{Namespace, Scope};

use crate::calls::ClaimOutcome;
use crate::error::{Result, StoreError};
use crate::records::{Actor, EventInfo, OpenRecords, RecordInfo};
pub use crate::scope_digest::ScopeDigest;
use crate::sealing::Seal;

/// The scope columns, in [`KeyColumns`] order.
pub const KEY_COLUMNS: &str = "scope_version, tenant, principal, route, namespace, idem_key";

/// Every column of a current record except its key (`scope_digest`), in
/// table order. The history table has the same ones followed by `ended_at`.
pub const RECORD_COLUMNS: [&str; 24] = [
    "scope_version",
    "tenant",
    "principal",
    "route",
    "namespace",
    "idem_key",
    "state",
    "fingerprint",
    "fence",
    "lease_until",
    "ttl_ms",
    "release_on_unknown",
    "response_status",
    "response_headers",
    "response_body",
    "body_stored",
    "created_at",
    "completed_at",
    "expires_at",
    "archived_at",
    "replay_count",
    "generation",
    "attempt",
    "response_key",
];

/// An event as operators and the log see it: its generation's scope,
/// attempt and fingerprint, with the event's own [`EVENT_OWN_COLUMNS`].
pub const EVENT_COLUMNS: &str = event_columns!();

/// An event row's columns, in table order (after its `id`): the event names
/// its generation, whose record, history row or purged generation holds the
/// rest of [`EVENT_COLUMNS`] (a generation is the fence its claim drew, so
/// the number names one generation of one key).
pub const EVENT_OWN_COLUMNS: &str =
    "generation, at, transition, fence, status, actor, detail, duration_ms, reason";

/// What an event reads of its generation, in the record, the history and
/// the purged generations alike; the generation first.
pub const GENERATION_OF_EVENT: &str =
    "generation, scope_version, tenant, principal, route, namespace, idem_key, attempt, fingerprint";

/// [`EVENT_COLUMNS`] one by one, for reading a row by position.
pub const EVENT_COLUMN_NAMES: &[&str] = &[
    "scope_version",
    "tenant",
    "principal",
    "route",
    "namespace",
    "idem_key",
    "generation",
    "at",
    "transition",
    "attempt",
    "fence",
    "fingerprint",
    "status",
    "actor",
    "detail",
    "duration_ms",
    "reason",
];

/// The events, as [`EVENT_COLUMNS`] and oldest first, of the generations
/// whose scope columns meet `matching`: current records, the history, and
/// generations purged before all their events were; at most `limit` (a
/// parameter). A key's generations are found through the tables' (tenant,
/// key) indexes, their events through the events' generation index.
pub fn events_matching(matching: &str, limit: &str) -> String {
    let select = event_select("e", "g");
    let g = GENERATION_OF_EVENT;
    format!(
        "SELECT {select} FROM (SELECT {g} FROM idempotency_records WHERE {matching} \
         UNION ALL SELECT {g} FROM idempotency_history WHERE {matching} \
         UNION ALL SELECT {g} FROM idempotency_purged_generations WHERE {matching}) g \
         JOIN idempotency_events e ON e.generation = g.generation ORDER BY e.id LIMIT {limit}"
    )
}

/// Forgets the purged generations none of whose events are left (a small
/// table: a generation lands there only for events younger than the
/// retention).
pub const PURGE_EVENTLESS_GENERATIONS: &str =
    "DELETE FROM idempotency_purged_generations WHERE NOT EXISTS (SELECT 1 FROM idempotency_events e \
     WHERE e.generation = idempotency_purged_generations.generation)";

/// [`EVENT_COLUMNS`] as a select list of an event row `event` joined to
/// its generation's row `generation`.
pub fn event_select(event: &str, generation: &str) -> String {
    let own: Vec<&str> = EVENT_OWN_COLUMNS.split(", ").collect();
    EVENT_COLUMN_NAMES
        .iter()
        .map(|c| {
            let from = if own.contains(c) { event } else { generation };
            format!("{from}.{c}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`RECORD_COLUMNS`] joined for a statement, each column written as `each`
/// says (`None`: its plain name).
pub fn record_list(each: impl Fn(&str) -> Option<String>) -> String {
    RECORD_COLUMNS
        .iter()
        .map(|c| each(c).unwrap_or_else(|| (*c).to_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The six columns of a record's scope, in table order ([`Scope::parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyColumns<'a>(pub [&'a str; 6]);

impl<'a> KeyColumns<'a> {
    pub fn of(s: &'a Scope) -> KeyColumns<'a> {
        KeyColumns(s.parts())
    }
}

impl OpenRecords {
    /// The row of [`crate::conditions::OPEN_RECORDS`].
    pub fn read(row: &impl ColumnReader) -> Result<OpenRecords> {
        Ok(OpenRecords {
            oldest_in_progress: row.optional_int("oldest_in_progress")?,
            unknown: row.unsigned("unknown")?,
            oldest_unknown: row.optional_int("oldest_unknown")?,
        })
    }
}

/// A database row read by column name; each backend implements it for its
/// own row type. Integer columns of any width read as `i64`.
pub trait ColumnReader {
    fn text(&self, name: &str) -> Result<String>;
    fn optional_text(&self, name: &str) -> Result<Option<String>>;
    fn int(&self, name: &str) -> Result<i64>;
    fn optional_int(&self, name: &str) -> Result<Option<i64>>;
    fn flag(&self, name: &str) -> Result<bool>;
    fn optional_bytes(&self, name: &str) -> Result<Option<Vec<u8>>>;

    fn unsigned(&self, name: &str) -> Result<u64> {
        u64_from(self.int(name)?, name)
    }

    /// `fingerprint`, stored as the API's hex unless the backend says otherwise.
    fn fingerprint(&self) -> Result<Option<Fingerprint>> {
        self.optional_text("fingerprint")?
            .map(|h| Fingerprint::try_from(h).map_err(|e| StoreError::Corrupt(format!("fingerprint: {e}"))))
            .transpose()
    }

    /// `attempt` as the API's id; a backend may store it otherwise.
    fn attempt(&self) -> Result<Option<String>> {
        self.optional_text("attempt")
    }

    /// The six key columns as a validated scope.
    fn scope(&self) -> Result<Scope> {
        let key =
            Key::try_from(self.text("idem_key")?).map_err(|e| StoreError::Corrupt(format!("key: {e}")))?;
        let namespace = match self.text("namespace")?.as_str() {
            "u" => Namespace::Client,
            "s" => Namespace::Server,
            other => return Err(StoreError::Corrupt(format!("namespace {other:?}"))),
        };
        Scope::new(
            &self.text("tenant")?,
            &self.text("principal")?,
            &self.text("route")?,
            namespace,
            key,
        )
        .map_err(|e| StoreError::Corrupt(format!("scope: {e:?}")))
    }

    /// The record's primary key, for statements that pick rows.
    fn scope_digest(&self) -> Result<ScopeDigest> {
        match self.optional_bytes("scope_digest")? {
            Some(bytes) => ScopeDigest::from_bytes(&bytes),
            None => Err(StoreError::Corrupt("scope_digest is NULL".into())),
        }
    }

    /// A current record's `state`.
    fn state(&self) -> Result<State> {
        let state = self.text("state")?;
        State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("state {state:?}")))
    }

    /// A generation's `state`: a [`State`] while it is current (`ended`
    /// false), what [`record::ended_as`] wrote once it ended.
    fn standing(&self, ended: bool) -> Result<Standing> {
        if !ended {
            return self.state().map(Standing::In);
        }
        let state = self.text("state")?;
        Standing::parse(&state)
            .filter(|s| Standing::endings().any(|e| e == *s))
            .ok_or_else(|| StoreError::Corrupt(format!("ended generation's state {state:?}")))
    }

    fn transition(&self) -> Result<Transition> {
        let t = self.text("transition")?;
        Transition::parse(&t).ok_or_else(|| StoreError::Corrupt(format!("transition {t:?}")))
    }

    fn actor(&self) -> Result<Actor> {
        let actor = self.text("actor")?;
        Actor::parse(&actor).ok_or_else(|| StoreError::Corrupt(format!("actor {actor:?}")))
    }

    fn status(&self, name: &str) -> Result<Option<u16>> {
        Ok(self.optional_int(name)?.map(|s| u16::try_from(s).unwrap_or(0)))
    }
}

/// What the rules and the operations need of the current record: its view
/// for [`idemgate_core::record`], plus what a replay serves.
#[derive(Debug, Clone)]
pub struct LoadedRecord {
    pub view: RecordView,
    pub ttl_ms: u64,
    /// The headers column as stored (sealed when `response_key` is set).
    pub headers_column: Option<String>,
    /// The key that sealed the stored response; `None`: plaintext.
    pub response_key: Option<String>,
    /// The claim's `on_unknown` was `release`: an unknown outcome frees the key.
    pub release_on_unknown: bool,
}

impl LoadedRecord {
    /// Whether `complete`, `release` or `mark-unknown` with `fence` may act:
    /// [`record::may_fence`], and archived records are history.
    pub fn may_fence(&self, fence: u64) -> bool {
        !self.view.archived && record::may_fence(self.view.state, self.view.fence, fence)
    }

    /// Whether an operator may resolve it: [`record::is_open`] (in progress
    /// or unknown, the states a fence call acts on, and not archived).
    pub fn is_open(&self) -> bool {
        record::is_open(self.view.state, self.view.archived)
    }

    /// A replay of this record (the record of `key`): its stored headers
    /// and `body` (the body column as read), opened with `seal`.
    pub fn replay(
        &self,
        seal: &Seal,
        key: &ScopeDigest,
        (status, completed_at): (u16, i64),
        body: Vec<u8>,
    ) -> Result<ClaimOutcome> {
        let (id, fence) = (self.response_key.as_deref(), self.view.fence);
        let headers = seal.open_headers(id, key, fence, self.headers_column.clone())?;
        let body = seal.open_body(id, key, fence, body)?;
        Ok(ClaimOutcome::replay(
            status,
            decode_headers(headers.as_deref())?,
            completed_at,
            body,
        ))
    }

    /// Reads `state`, `fingerprint`, `fence`, `lease_until`, `ttl_ms`,
    /// `response_status`, `response_headers`, `response_key`, `body_stored`,
    /// `completed_at`, `expires_at`, `archived` (a flag), `attempt` and
    /// `release_on_unknown`.
    pub fn read(row: &impl ColumnReader) -> Result<LoadedRecord> {
        Ok(LoadedRecord {
            view: RecordView {
                state: row.state()?,
                fingerprint: row.fingerprint()?,
                fence: row.unsigned("fence")?,
                lease_until: row.int("lease_until")?,
                status: row.status("response_status")?,
                body_stored: row.flag("body_stored")?,
                completed_at: row.optional_int("completed_at")?,
                expires_at: row.optional_int("expires_at")?,
                archived: row.flag("archived")?,
                attempt: row.attempt()?,
            },
            ttl_ms: row.unsigned("ttl_ms")?,
            headers_column: row.optional_text("response_headers")?,
            response_key: row.optional_text("response_key")?,
            release_on_unknown: row.flag("release_on_unknown")?,
        })
    }
}

impl RecordInfo {
    /// Reads [`RECORD_COLUMNS`] with `body_len` in place of the body, and
    /// `ended_at` (NULL for a current record); sealed headers are opened
    /// with `seal`. Headers that do not open are left out (with a warning),
    /// so a lost key never hides a record's history from operators.
    pub fn read(row: &impl ColumnReader, seal: &Seal) -> Result<RecordInfo> {
        let scope = row.scope()?;
        let response_key = row.optional_text("response_key")?;
        let fence = row.unsigned("fence")?;
        let column = row.optional_text("response_headers")?;
        let headers =
            match seal.open_headers(response_key.as_deref(), &ScopeDigest::of(&scope), fence, column) {
                Ok(json) => decode_headers(json.as_deref())?,
                Err(e) => {
                    tracing::warn!("a record's stored headers are not shown: {e}");
                    None
                }
            };
        let ended_at = row.optional_int("ended_at")?;
        Ok(RecordInfo {
            log_id: String::new(),
            scope,
            state: row.standing(ended_at.is_some())?,
            fingerprint: row.fingerprint()?.map(|f| f.to_hex()),
            fence,
            lease_until: row.int("lease_until")?,
            ttl_ms: row.unsigned("ttl_ms")?,
            on_unknown: if row.flag("release_on_unknown")? {
                OnUnknown::Release
            } else {
                OnUnknown::Conflict
            },
            status: row.status("response_status")?,
            headers,
            response_key,
            body_stored: row.flag("body_stored")?,
            body_len: row
                .optional_int("body_len")?
                .map(|l| u64::try_from(l).unwrap_or(0)),
            created_at: row.int("created_at")?,
            completed_at: row.optional_int("completed_at")?,
            expires_at: row.optional_int("expires_at")?,
            archived_at: row.optional_int("archived_at")?,
            replay_count: row.unsigned("replay_count")?,
            generation: row.unsigned("generation")?,
            attempt: row.attempt()?,
            ended_at,
        })
    }
}

impl EventInfo {
    /// Reads [`EVENT_COLUMNS`].
    pub fn read(row: &impl ColumnReader) -> Result<EventInfo> {
        let scope = row.scope()?;
        Ok(EventInfo {
            log_id: String::new(),
            scope,
            generation: row.unsigned("generation")?,
            at: row.int("at")?,
            transition: row.transition()?,
            attempt: row.attempt()?,
            fence: row.unsigned("fence")?,
            fingerprint: row.fingerprint()?.map(|f| f.to_hex()),
            status: row.status("status")?,
            actor: row.actor()?,
            detail: row.optional_text("detail")?,
            duration_ms: row.int("duration_ms")?,
            reason: row.optional_text("reason")?,
        })
    }
}

/// The decoded headers column.
pub fn decode_headers(json: Option<&str>) -> Result<Option<Vec<(String, String)>>> {
    match json {
        None => Ok(None),
        Some(s) => serde_json::from_str(s)
            .map(Some)
            .map_err(|e| StoreError::Corrupt(format!("headers column: {e}"))),
    }
}

pub fn encode_headers(headers: &[(String, String)]) -> String {
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_string())
}

pub fn u64_from(v: i64, what: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("negative {what}")))
}

pub fn i64_from(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_row_and_its_generation_make_the_event_columns() {
        let mut from_both: Vec<&str> = EVENT_OWN_COLUMNS.split(", ").collect();
        from_both.extend(GENERATION_OF_EVENT.split(", "));
        for c in EVENT_COLUMN_NAMES {
            assert!(from_both.contains(c), "{c}");
        }
    }

    #[test]
    fn the_event_column_names_are_the_event_columns() {
        assert_eq!(
            EVENT_COLUMN_NAMES.join(", "),
            EVENT_COLUMNS.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
}
