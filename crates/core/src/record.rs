//! Record lifecycle rules used by the store (contract §4–§6).
//!
//! A record is `in_progress` (leased to one owner, who holds a fencing token
//! and named its claim attempt), `completed` (a stored response), or `unknown`
//! (nobody knows whether the upstream acted). Completed and unknown records
//! expire at `expires_at`; the store's sweeper archives them then (body
//! dropped, metadata kept).
//!
//! History is append-only: each claim of a key starts a *generation*, named
//! by the fencing token it was claimed with. A generation that ends (released,
//! abandoned, replaced by a new claim, purged by an operator) moves to the
//! history, and every change is a [`Transition`] event. History and events are
//! purged only after the audit retention.
//!
//! Every backend loads the existing record, asks [`decide_claim`] what to do,
//! and carries the decision out, so SQLite and PostgreSQL cannot disagree. Time
//! is an argument (milliseconds since the Unix epoch); nothing here reads a
//! clock or touches a database.

use crate::config::{AfterExpiry, OnUnknown};
use crate::fingerprint::Fingerprint;
use crate::protocol::{ClaimReply, ClaimRequest};

/// The stored state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    InProgress,
    Completed,
    Unknown,
}

impl State {
    /// Every state: the values the `state` column's `CHECK` admits.
    pub const ALL: [State; 3] = [State::InProgress, State::Completed, State::Unknown];

    /// The spelling in the database's `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            State::InProgress => "in_progress",
            State::Completed => "completed",
            State::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        match s {
            "in_progress" => Some(State::InProgress),
            "completed" => Some(State::Completed),
            "unknown" => Some(State::Unknown),
            _ => None,
        }
    }
}

/// A change in a record's life: one event row and one log line each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transition {
    /// A generation began: its key claimed, for the first time or after
    /// the generation before it ended.
    Claimed,
    /// A finished generation (an unknown outcome under `on_unknown:
    /// release`, an expired key under `after_expiry: new`) ended because a
    /// new claim replaced it, and moved to the history. (One in progress
    /// that a new claim replaces ends with `LeaseExpired`.)
    Reclaimed,
    Completed,
    /// The upstream refused before acting; the key is free again.
    Released,
    /// The filter gave up on its claim before forwarding anything.
    Abandoned,
    MarkedUnknown,
    /// The owner's lease ran out: the record turned unknown or, with
    /// `on_unknown: release`, was released.
    LeaseExpired,
    /// An operator completed or released an open record.
    Resolved,
    Archived,
    Purged,
}

impl Transition {
    pub const ALL: [Transition; 10] = [
        Transition::Claimed,
        Transition::Reclaimed,
        Transition::Completed,
        Transition::Released,
        Transition::Abandoned,
        Transition::MarkedUnknown,
        Transition::LeaseExpired,
        Transition::Resolved,
        Transition::Archived,
        Transition::Purged,
    ];

    /// The spelling in the events table and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Transition::Claimed => "claimed",
            Transition::Reclaimed => "reclaimed",
            Transition::Completed => "completed",
            Transition::Released => "released",
            Transition::Abandoned => "abandoned",
            Transition::MarkedUnknown => "marked_unknown",
            Transition::LeaseExpired => "lease_expired",
            Transition::Resolved => "resolved",
            Transition::Archived => "archived",
            Transition::Purged => "purged",
        }
    }

    pub fn parse(s: &str) -> Option<Transition> {
        Transition::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// How a generation that left the current records ended (the history's
/// `state` column): a state it was in, or the transition that ended it.
pub fn ended_as(last: State, by: Transition) -> Standing {
    match (last, by) {
        (_, Transition::Released | Transition::Abandoned | Transition::Purged) => Standing::EndedBy(by),
        (_, Transition::Resolved) => Standing::EndedBy(Transition::Released),
        (State::InProgress, _) => Standing::EndedBy(Transition::LeaseExpired),
        (state, _) => Standing::In(state),
    }
}

/// What a generation's `state` column holds: the record's [`State`] while
/// the generation is current; once it ended, [`ended_as`]: the state it was
/// left in, or the transition that ended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Standing {
    In(State),
    EndedBy(Transition),
}

impl Standing {
    pub fn as_str(self) -> &'static str {
        match self {
            Standing::In(state) => state.as_str(),
            Standing::EndedBy(t) => t.as_str(),
        }
    }

    /// A state's spelling, or that of a transition [`ended_as`] ends a
    /// generation with. States come first: [`ended_as`] writes a state that
    /// outlived its generation (`completed`) in the state's own spelling.
    pub fn parse(s: &str) -> Option<Standing> {
        if let Some(state) = State::parse(s) {
            return Some(Standing::In(state));
        }
        let by = Standing::EndedBy(Transition::parse(s)?);
        Standing::endings().any(|e| e == by).then_some(by)
    }

    /// The state, while it is one.
    pub fn state(self) -> Option<State> {
        match self {
            Standing::In(state) => Some(state),
            Standing::EndedBy(_) => None,
        }
    }

    /// Every value [`ended_as`] gives (with repeats).
    pub fn endings() -> impl Iterator<Item = Standing> {
        State::ALL
            .into_iter()
            .flat_map(|s| Transition::ALL.into_iter().map(move |t| ended_as(s, t)))
    }
}

/// The columns' spellings ([`State::as_str`], [`Transition::as_str`],
/// [`Standing::as_str`]) are also the enums' text in logs and JSON, written
/// and read here so that nothing spells them twice.
macro_rules! spelled {
    ($($t:ty: $what:literal),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                <$t>::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown {} {s:?}", $what)))
            }
        }
    )*};
}

spelled!(State: "state", Transition: "transition", Standing: "state");

/// What the claim rules need to know about an existing record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    pub state: State,
    pub fingerprint: Option<Fingerprint>,
    pub fence: u64,
    pub lease_until: i64,
    pub status: Option<u16>,
    pub body_stored: bool,
    pub completed_at: Option<i64>,
    pub expires_at: Option<i64>,
    /// Archived by the sweeper: history, whatever the clock of whoever reads it.
    pub archived: bool,
    /// The claim attempt that opened the generation.
    pub attempt: Option<String>,
}

/// What a backend must do with a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Insert a fresh `in_progress` record (replacing any existing one) with a
    /// new fencing token from the global sequence; answer `Owned`.
    Claim,
    /// Serve the stored response (status, headers, body) and count a replay.
    Replay { status: u16, completed_at: i64 },
    /// The owner's lease ran out: store the record as `unknown` with
    /// `expires_at` = [`unknown_expiry`], then answer `Unknown`.
    BecomeUnknown,
    /// Answer this without changing anything.
    Answer(ClaimReply),
}

/// Two fingerprints conflict only when both are present and differ: a policy
/// in fingerprint mode `none` cannot detect reuse (contract §3).
pub fn fingerprints_conflict(stored: Option<&Fingerprint>, offered: Option<&Fingerprint>) -> bool {
    matches!((stored, offered), (Some(a), Some(b)) if a != b)
}

/// Milliseconds from `now` until `until`, never negative.
pub fn remaining_ms(until: i64, now: i64) -> u64 {
    u64::try_from(until.saturating_sub(now)).unwrap_or(0)
}

/// `now + ms` without overflow.
pub fn plus_ms(now: i64, ms: u64) -> i64 {
    now.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// The lease of a fresh claim.
pub fn lease_until(now: i64, lease_ms: u64) -> i64 {
    plus_ms(now, lease_ms)
}

/// A completed record is replayable for `ttl_ms` after completion.
pub fn completion_expiry(completed_at: i64, ttl_ms: u64) -> i64 {
    plus_ms(completed_at, ttl_ms)
}

/// An unknown record stays answerable (409 `outcome-unknown`) for `ttl_ms`
/// after it became unknown.
pub fn unknown_expiry(became_unknown_at: i64, ttl_ms: u64) -> i64 {
    plus_ms(became_unknown_at, ttl_ms)
}

/// The claim rules, in the contract's order: fingerprint mismatch first (in
/// every state, 422 before 409), then the state of the record.
pub fn decide_claim(existing: Option<&RecordView>, req: &ClaimRequest, now: i64) -> ClaimDecision {
    let Some(rec) = existing else {
        return ClaimDecision::Claim;
    };
    // An archived record has lost its body: it is expired even to a replica
    // whose clock has not reached its expiry yet.
    let expired = rec.archived
        || matches!(rec.state, State::Completed | State::Unknown)
            && rec.expires_at.is_some_and(|at| now >= at);
    // Under `after_expiry: new` an expired key is forgotten: whatever the
    // request, it is a first one.
    if expired && req.after_expiry == AfterExpiry::New {
        return ClaimDecision::Claim;
    }
    if fingerprints_conflict(rec.fingerprint.as_ref(), req.fingerprint.as_ref()) {
        return ClaimDecision::Answer(ClaimReply::Mismatch);
    }
    match rec.state {
        // A copy of the claim that took the key (delivered twice by
        // something in front of the store, or decided after its copy under
        // a slow database): the filter reads whichever answer comes first,
        // so each says the key is its attempt's.
        State::InProgress if now < rec.lease_until && holds(rec, req) => {
            ClaimDecision::Answer(ClaimReply::Owned { fence: rec.fence })
        }
        State::InProgress => {
            if now < rec.lease_until {
                ClaimDecision::Answer(ClaimReply::InProgress {
                    retry_after_ms: remaining_ms(rec.lease_until, now),
                })
            } else {
                match req.on_unknown {
                    OnUnknown::Release => ClaimDecision::Claim,
                    OnUnknown::Conflict => ClaimDecision::BecomeUnknown,
                }
            }
        }
        State::Completed | State::Unknown if expired => ClaimDecision::Answer(ClaimReply::Expired {
            completed_at: rec.completed_at,
        }),
        State::Completed => {
            // A completed record always has a status and a completion time; a
            // row without them is treated like a result we cannot replay.
            let completed_at = rec.completed_at.unwrap_or(0);
            match rec.status {
                Some(status) if rec.body_stored => ClaimDecision::Replay { status, completed_at },
                status => ClaimDecision::Answer(ClaimReply::ResultUnavailable {
                    original_status: status.unwrap_or(0),
                    completed_at,
                }),
            }
        }
        // Marked unknown before its lease ran out (the client left a
        // streaming request, the upstream was cut off): the upstream may
        // still be acting, so even a policy that runs unknown outcomes again
        // waits for the lease, which bounds every forwarded request.
        State::Unknown => match req.on_unknown {
            OnUnknown::Release if now < rec.lease_until => ClaimDecision::Answer(ClaimReply::InProgress {
                retry_after_ms: remaining_ms(rec.lease_until, now),
            }),
            OnUnknown::Release => ClaimDecision::Claim,
            OnUnknown::Conflict => ClaimDecision::Answer(ClaimReply::Unknown),
        },
    }
}

/// Whether `req` is a claim of the attempt that opened `rec`.
fn holds(rec: &RecordView, req: &ClaimRequest) -> bool {
    matches!((&rec.attempt, &req.attempt), (Some(held), Some(offered)) if held == offered.as_str())
}

/// Whether an abandon of `offered` may release the record: only the attempt
/// that claimed it, and only while nothing is known to have run (in progress,
/// or unknown because that attempt's lease ran out). Completed records are
/// never touched.
pub fn may_abandon(state: State, stored: Option<&str>, offered: &str) -> bool {
    matches!(state, State::InProgress | State::Unknown) && stored == Some(offered)
}

/// What an abandon of claim attempt `offered` does to the record it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbandonDecision {
    /// The record is open under that attempt: its generation ends,
    /// abandoned. The abandon is remembered too, as with `Remember`: a copy
    /// of that claim delivered twice may still land.
    End,
    /// No record of that attempt: its claim may still be on its way (queued
    /// in the filter, or waiting in the store for another attempt's outcome).
    /// The abandon is remembered, so a claim of that attempt that lands later
    /// is released, never left owned by nobody.
    Remember,
    /// That attempt's record, completed: its claim landed and its outcome
    /// is known; nothing changes.
    Settled,
}

/// The abandon rule; see [`AbandonDecision`].
pub fn decide_abandon(existing: Option<&RecordView>, offered: &str) -> AbandonDecision {
    match existing {
        // Archived or not: an unknown record its own attempt abandons never
        // ran (the filter abandons only what it did not forward), so the
        // retry the 503 invited is a first request, not `key-expired`.
        Some(rec) if rec.attempt.as_deref() == Some(offered) => {
            if may_abandon(rec.state, rec.attempt.as_deref(), offered) {
                AbandonDecision::End
            } else {
                AbandonDecision::Settled
            }
        }
        _ => AbandonDecision::Remember,
    }
}

/// Whether `complete`, `release` or `mark-unknown` may act: the record must be
/// in progress or unknown (a late completion resolves an unknown record) and
/// the caller must hold the current fencing token.
pub fn may_fence(state: State, current_fence: u64, offered_fence: u64) -> bool {
    matches!(state, State::InProgress | State::Unknown) && current_fence == offered_fence
}

/// Whether a record is open: its outcome is not settled (in progress, or
/// unknown) and the sweeper has not archived it. Only an open record takes a
/// fence call ([`may_fence`], which leaves the archive to its caller) or an
/// operator's resolution; an archived record is history, whatever its state,
/// and every reader (the store, the console) asks this one rule.
pub fn is_open(state: State, archived: bool) -> bool {
    !archived && matches!(state, State::InProgress | State::Unknown)
}

/// Whether a completion under the current fence may still resolve a record
/// that was archived: only an unknown one, whose lease ran out and which
/// expired before the completion got through. It is recorded for the audit
/// ("why was this charged twice?") without its body: archived is history,
/// and it never replays.
pub fn completes_archived(state: State) -> bool {
    state == State::Unknown
}

#[cfg(test)]
mod tests;
