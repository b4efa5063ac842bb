//! What the store shows of its records: a record as stored, its events, a
//! key's whole history, the actors events name, and the records the
//! monitoring watches. The column mapping reads rows into these, so they
//! sit below both it and the [`Backend`](crate::backend::Backend) trait.

use idemgate_core::config::OnUnknown;
use idemgate_core::record::{Standing, Transition};
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
    /// The record's state while the generation is current; once it ended,
    /// how it ended ([`idemgate_core::record::ended_as`]).
    pub state: Standing,
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
    pub transition: Transition,
    pub attempt: Option<String>,
    pub fence: u64,
    pub fingerprint: Option<String>,
    pub status: Option<u16>,
    pub actor: Actor,
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

/// Who caused a transition: `filter` or `sweeper`; for an operator's
/// change, the operator ([`Resolution::by`](crate::backend::Resolution::by)).
/// [`Actor::Operator`] is what events from before operators were named
/// hold: the store reads it, and keeps the name from any operator, but no
/// longer writes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Actor {
    Filter,
    Sweeper,
    Operator,
    /// An operator's identity as the trusted authenticating proxy gave it
    /// (`alice@example.com`), or `cli:NAME` for the name a command-line
    /// operator declared (`--actor`).
    Named(String),
}

impl Actor {
    /// The names the store writes itself: no operator may take one.
    pub const RESERVED: [Actor; 3] = [Actor::Filter, Actor::Sweeper, Actor::Operator];
    /// What a command-line operator's declared name is written after.
    pub const CLI_PREFIX: &'static str = "cli:";

    /// The spelling in the events table, the logs and the admin API.
    pub fn as_str(&self) -> &str {
        match self {
            Actor::Filter => "filter",
            Actor::Sweeper => "sweeper",
            Actor::Operator => "operator",
            Actor::Named(name) => name,
        }
    }

    /// An actor as [`Actor::as_str`] spells it: a reserved name is the
    /// store's own, any other names an operator. `None` for an empty name,
    /// which no event is written with.
    pub fn parse(s: &str) -> Option<Actor> {
        if s.is_empty() {
            return None;
        }
        Some(
            Actor::RESERVED
                .into_iter()
                .find(|a| a.as_str() == s)
                .unwrap_or_else(|| Actor::Named(s.to_string())),
        )
    }
}

impl std::fmt::Display for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Actor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Actor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Actor, D::Error> {
        let s = String::deserialize(d)?;
        Actor::parse(&s).ok_or_else(|| serde::de::Error::custom("an empty actor"))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_actor_reads_back_as_it_was_written() {
        for a in Actor::RESERVED {
            assert_eq!(Actor::parse(a.as_str()), Some(a));
        }
        let alice = Actor::Named("alice@example.com".into());
        assert_eq!(Actor::parse("alice@example.com"), Some(alice.clone()));
        assert_eq!(
            Actor::parse("cli:bob").map(|a| a.to_string()),
            Some("cli:bob".into())
        );
        assert_eq!(Actor::parse(""), None);
        assert_eq!(
            serde_json::to_string(&alice).ok().as_deref(),
            Some("\"alice@example.com\"")
        );
        assert_eq!(
            serde_json::from_str::<Actor>("\"sweeper\"").ok(),
            Some(Actor::Sweeper)
        );
        assert!(serde_json::from_str::<Actor>("\"\"").is_err());
    }
}
