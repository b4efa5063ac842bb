//! What the store shows of its records: a record as stored, its events, a
//! key's whole history, the actors events name, and the records the
//! monitoring watches. The column mapping reads rows into these, so they
//! sit below both it and the [`Backend`](crate::backend::Backend) trait.

use idemgate_core::config::OnUnknown;
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;
use serde::{Deserialize, Serialize};

use crate::log_ids::LogIds;

/// Everything stored about a record except its body, for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordInfo {
    pub scope: Scope,
    /// The keyed hash that names this record in logs
    /// ([`crate::log_ids::LogIds`]); filled in by [`KeyHistory::label`] or
    /// [`label_records`] before the record leaves the store.
    pub log_id: String,
    pub state: String,
    pub fingerprint: Option<String>,
    pub fence: u64,
    pub lease_until: i64,
    pub ttl_ms: u64,
    pub on_unknown: OnUnknown,
    pub status: Option<u16>,
    pub headers: Option<Vec<(String, String)>>,
    /// The id of the key that sealed the stored response (headers and
    /// body); `None`: stored in plaintext.
    #[serde(default)]
    pub response_key: Option<String>,
    pub body_stored: bool,
    /// Length of the stored body; `None` once archived (the body is dropped).
    pub body_len: Option<u64>,
    pub created_at: i64,
    pub completed_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub archived_at: Option<i64>,
    pub replay_count: u64,
    /// Names the generation: the fencing token it was claimed with.
    pub generation: u64,
    /// The claim attempt that opened the generation.
    pub attempt: Option<String>,
    /// `None` for the current generation; when it left for the history.
    pub ended_at: Option<i64>,
}

/// Every generation of a key and every event, for operators.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyHistory {
    /// The current generation(s) first, then earlier ones, newest first.
    pub records: Vec<RecordInfo>,
    /// Oldest first.
    pub events: Vec<EventInfo>,
}

/// One transition of a record (see [`idemgate_core::record::Transition`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventInfo {
    pub scope: Scope,
    /// As [`RecordInfo::log_id`].
    pub log_id: String,
    pub generation: u64,
    pub at: i64,
    pub transition: String,
    pub attempt: Option<String>,
    pub fence: u64,
    pub fingerprint: Option<String>,
    pub status: Option<u16>,
    /// `filter` or `sweeper`; for an operator's change, the operator's
    /// identity as the trusted authenticating proxy gave it
    /// (`alice@example.com`), or `cli:NAME` for the name a command-line
    /// operator declared (`--actor`).
    pub actor: String,
    pub detail: Option<String>,
    /// Since the generation was claimed.
    pub duration_ms: i64,
    /// Why an operator made this transition (a resolution's reason); kept in
    /// the history only, never written to the log.
    #[serde(default)]
    pub reason: Option<String>,
}

impl KeyHistory {
    /// Names every record and event as the logs do.
    pub fn label(&mut self, ids: &LogIds) {
        label_records(&mut self.records, ids);
        for e in &mut self.events {
            e.log_id = ids.of(&e.scope);
        }
    }
}

/// Names every record as the logs do.
pub fn label_records(records: &mut [RecordInfo], ids: &LogIds) {
    for r in records {
        r.log_id = ids.of(&r.scope);
    }
}

impl EventInfo {
    /// The event's structured log line: what operators monitor. The record
    /// and the request fingerprint are named by their keyed hashes under
    /// `ids`, never by the bare digests (contract §9); `trace` names the
    /// client request of the call that caused it, as Envoy's access log and
    /// traces do.
    pub fn log(&self, ids: &LogIds, trace: &Trace) {
        let fingerprint = self
            .fingerprint
            .as_deref()
            .map_or_else(|| "-".to_string(), |f| ids.of_fingerprint(f));
        tracing::info!(
            target: "idemgate::events",
            event = %self.transition,
            tenant = %self.scope.tenant(),
            route = %self.scope.route(),
            record = %ids.of(&self.scope),
            generation = self.generation,
            fence = self.fence,
            fingerprint = %fingerprint,
            replayed = false,
            status = self.status.unwrap_or(0),
            duration_ms = self.duration_ms,
            actor = %self.actor,
            detail = self.detail.as_deref().unwrap_or("-"),
            attempt = self.attempt.as_deref().unwrap_or("-"),
            request_id = trace.request_id.as_deref().unwrap_or("-"),
            trace_id = trace.trace_id.as_deref().unwrap_or("-"),
        );
    }
}

/// Who caused a transition. An operator's changes name the operator
/// ([`Resolution::by`](crate::backend::Resolution::by));
/// [`OPERATOR`](actor::OPERATOR) is only what
/// [`Backend::purge`](crate::backend::Backend::purge) writes, which the
/// store's own surfaces never call.
pub mod actor {
    pub const FILTER: &str = "filter";
    pub const SWEEPER: &str = "sweeper";
    pub const OPERATOR: &str = "operator";
    /// The names the store writes itself: no operator may take one.
    pub const RESERVED: &[&str] = &[FILTER, SWEEPER, OPERATOR];
    /// What a command-line operator's declared name is written after.
    pub const CLI_PREFIX: &str = "cli:";
}

/// The records that want watching, at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenRecords {
    /// Creation time of the oldest in-progress record.
    pub oldest_in_progress: Option<i64>,
    /// Unknown records not archived: each waits for an operator.
    pub unknown: u64,
    /// Creation time of the oldest of them.
    pub oldest_unknown: Option<i64>,
}
