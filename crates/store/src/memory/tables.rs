//! The tables as plain values, and the steps every operation is made of:
//! record a transition, start a generation, end one, turn one unknown. They
//! are the SQL backends' tables and steps (`sqlite::generation`) with the
//! same columns and the same results, so an effect carried out here leaves
//! what it leaves there.

use std::collections::BTreeMap;
use std::sync::Arc;

use idemgate_core::config::OnUnknown;
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::protocol::ClaimRequest;
use idemgate_core::record::{self, RecordView, Standing, State};
use idemgate_core::scope::Scope;

use crate::effects::By;
use crate::records::EventInfo;
use crate::row_mapping::{LoadedRecord, ScopeDigest};

/// The events an operation recorded, logged once it is done.
pub(super) type Journal = Vec<EventInfo>;

/// A generation's columns but its state: a current record's, or a history
/// row's.
#[derive(Debug, Clone)]
pub(super) struct Generation {
    pub(super) scope: Scope,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) fence: u64,
    pub(super) lease_until: i64,
    pub(super) ttl_ms: u64,
    pub(super) release_on_unknown: bool,
    pub(super) status: Option<u16>,
    /// The stored headers as the headers column holds them unsealed
    /// ([`crate::row_mapping::encode_headers`]).
    pub(super) headers: Option<String>,
    /// The stored body; `None` when none is kept (not stored, archived,
    /// or the generation ended).
    pub(super) body: Option<Arc<[u8]>>,
    pub(super) body_stored: bool,
    pub(super) created_at: i64,
    pub(super) completed_at: Option<i64>,
    pub(super) expires_at: Option<i64>,
    pub(super) archived_at: Option<i64>,
    pub(super) replay_count: u64,
    pub(super) generation: u64,
    pub(super) attempt: Option<String>,
}

/// The current record of a key.
#[derive(Debug, Clone)]
pub(super) struct Current {
    pub(super) row: Generation,
    pub(super) state: State,
    /// The order in which keys got their row, kept while the key has one
    /// (a takeover replaces the row in place): where the SQL backends'
    /// orders tie, SQLite's rows come in this order, and so do these.
    pub(super) rowid: u64,
}

/// A generation that ended: how ([`record::ended_as`]) and when.
#[derive(Debug, Clone)]
pub(super) struct Ended {
    pub(super) row: Generation,
    pub(super) state: Standing,
    pub(super) ended_at: i64,
}

/// Everything the store keeps.
#[derive(Debug, Default)]
pub(super) struct Tables {
    /// Current records, by their key.
    pub(super) records: BTreeMap<ScopeDigest, Current>,
    /// Ended generations, in the order they ended; append-only but for the
    /// retention's purge.
    pub(super) history: Vec<Ended>,
    /// Every transition, oldest first; each names its generation's scope,
    /// attempt and fingerprint as operators see them.
    pub(super) events: Vec<EventInfo>,
    /// Abandoned attempts whose claims may still land: when each abandon
    /// was remembered.
    pub(super) abandoned: BTreeMap<(ScopeDigest, String), i64>,
    /// The last fence drawn: fences (and so generations) come from this
    /// one sequence.
    fence: u64,
    /// The last [`Current::rowid`] given.
    rows: u64,
    /// Operations that changed a row, and how many of them durably.
    pub(super) commits: (u64, u64),
    /// Purges that removed rows: the history and the events only grow
    /// between them.
    pub(super) purges: u64,
}

/// The tables at one moment: the current records and the counters whole,
/// the history and the events by their lengths (they only grow between
/// purges, which the tables count).
#[derive(Debug, Clone)]
pub struct Snapshot {
    records: BTreeMap<ScopeDigest, Current>,
    abandoned: BTreeMap<(ScopeDigest, String), i64>,
    fence: u64,
    rows: u64,
    history: usize,
    events: usize,
    purges: u64,
}

impl Tables {
    pub(super) fn snapshot(&self) -> Snapshot {
        Snapshot {
            records: self.records.clone(),
            abandoned: self.abandoned.clone(),
            fence: self.fence,
            rows: self.rows,
            history: self.history.len(),
            events: self.events.len(),
            purges: self.purges,
        }
    }

    /// Puts back the tables as `s` took them, and the fences up to `clock_us`
    /// as a database reopened then moves them; `false`, changing nothing,
    /// if a purge came since (what it removed cannot be put back).
    pub(super) fn restore(&mut self, s: Snapshot, clock_us: u64) -> bool {
        if s.purges != self.purges {
            return false;
        }
        self.records = s.records;
        self.abandoned = s.abandoned;
        self.fence = s.fence.max(clock_us);
        self.rows = s.rows;
        self.history.truncate(s.history);
        self.events.truncate(s.events);
        true
    }

    /// Counts an operation that changed a row: `durable` unless it was a
    /// completion its policy lets the database commit lazily.
    pub(super) fn commit(&mut self, durable: bool) {
        self.commits.0 += 1;
        self.commits.1 += u64::from(durable);
    }

    /// The next fencing token.
    pub(super) fn next_fence(&mut self) -> u64 {
        self.fence += 1;
        self.fence
    }

    /// What the rules and the effects need of the current record of `key`.
    pub(super) fn load(&self, key: &ScopeDigest) -> Option<LoadedRecord> {
        self.records.get(key).map(|c| {
            let r = &c.row;
            LoadedRecord {
                view: RecordView {
                    state: c.state,
                    fingerprint: r.fingerprint,
                    fence: r.fence,
                    lease_until: r.lease_until,
                    status: r.status,
                    body_stored: r.body_stored,
                    completed_at: r.completed_at,
                    expires_at: r.expires_at,
                    archived: r.archived_at.is_some(),
                    attempt: r.attempt.clone(),
                },
                ttl_ms: r.ttl_ms,
                headers_column: r.headers.clone(),
                // Nothing here is at rest: no response is sealed.
                response_key: None,
                release_on_unknown: r.release_on_unknown,
            }
        })
    }

    /// Records the transition `by` (with an operator's `note`) of the
    /// current record of `key`, read off the record as operators will see
    /// it. A key without a record records nothing, as the SQL backends'
    /// event, read off the record, finds nothing.
    pub(super) fn event(
        &mut self,
        key: &ScopeDigest,
        by: By<'_>,
        note: Option<&str>,
        now: i64,
        journal: &mut Journal,
    ) {
        let Some(current) = self.records.get(key) else {
            return;
        };
        let r = &current.row;
        let (transition, actor, detail) = by;
        let event = EventInfo {
            scope: r.scope.clone(),
            log_id: String::new(),
            generation: r.generation,
            at: now,
            transition,
            attempt: r.attempt.clone(),
            fence: r.fence,
            fingerprint: r.fingerprint.map(|f| f.to_hex()),
            status: r.status,
            actor: actor.clone(),
            detail: detail.map(str::to_string),
            duration_ms: now.saturating_sub(r.created_at),
            reason: note.map(str::to_string),
        };
        self.events.push(event.clone());
        journal.push(event);
    }

    /// Copies the current generation of `key` to the history as `ended`,
    /// without its body; the caller replaces or deletes the record.
    pub(super) fn keep_in_history(&mut self, key: &ScopeDigest, ended: Standing, now: i64) {
        if let Some(current) = self.records.get(key) {
            let mut row = current.row.clone();
            row.body = None;
            self.history.push(Ended {
                row,
                state: ended,
                ended_at: now,
            });
        }
    }

    /// Ends the current generation of `key` (state `last`): its event (with
    /// an operator's `note`), its move to the history, and the key is free.
    pub(super) fn end_generation(
        &mut self,
        key: &ScopeDigest,
        last: State,
        (by, note): (By<'_>, Option<&str>),
        now: i64,
        journal: &mut Journal,
    ) {
        self.event(key, by, note, now, journal);
        self.keep_in_history(key, record::ended_as(last, by.0), now);
        self.records.remove(key);
    }

    /// A fresh generation claimed by `req` under `fence`, in place of the
    /// key's record if it has one (which the caller moved to the history).
    /// Every column of a new generation is written here and only here.
    pub(super) fn start_generation(&mut self, req: &ClaimRequest, key: &ScopeDigest, fence: u64, now: i64) {
        let row = Generation {
            scope: req.scope.clone(),
            fingerprint: req.fingerprint,
            fence,
            lease_until: record::lease_until(now, req.lease_ms),
            ttl_ms: req.ttl_ms,
            release_on_unknown: req.on_unknown == OnUnknown::Release,
            status: None,
            headers: None,
            body: None,
            body_stored: false,
            created_at: now,
            completed_at: None,
            expires_at: None,
            archived_at: None,
            replay_count: 0,
            generation: fence,
            attempt: req.attempt.as_ref().map(|a| a.as_str().to_string()),
        };
        let rowid = match self.records.get(key) {
            Some(replaced) => replaced.rowid,
            None => {
                self.rows += 1;
                self.rows
            }
        };
        let current = Current {
            row,
            state: State::InProgress,
            rowid,
        };
        self.records.insert(*key, current);
    }

    /// Turns the record of `key` unknown until `expires_at`, if it still has
    /// the fence and state it was read with.
    pub(super) fn set_unknown(&mut self, key: &ScopeDigest, read_with: (u64, State), expires_at: i64) {
        if let Some(current) = self.records.get_mut(key) {
            if (current.row.fence, current.state) == read_with {
                current.state = State::Unknown;
                current.row.expires_at = Some(expires_at);
            }
        }
    }

    /// Counts a replay served from the record of `key`.
    pub(super) fn count_replay(&mut self, key: &ScopeDigest) {
        if let Some(current) = self.records.get_mut(key) {
            current.row.replay_count += 1;
        }
    }
}
