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
    /// A key claimed for the first time or after its generation was released.
    Claimed,
    /// A new generation replaced a finished one (`after_expiry: new`,
    /// `on_unknown: release`); the old one moved to the history.
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
pub fn ended_as(last: State, by: Transition) -> &'static str {
    match (last, by) {
        (_, Transition::Released | Transition::Abandoned | Transition::Purged) => by.as_str(),
        (_, Transition::Resolved) => Transition::Released.as_str(),
        (State::InProgress, _) => Transition::LeaseExpired.as_str(),
        (state, _) => state.as_str(),
    }
}

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
    /// The record is open under that attempt: its generation ends, abandoned.
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

/// Whether a completion under the current fence may still resolve a record
/// that was archived: only an unknown one, whose lease ran out and which
/// expired before the completion got through. It is recorded for the audit
/// ("why was this charged twice?") without its body: archived is history,
/// and it never replays.
pub fn completes_archived(state: State) -> bool {
    state == State::Unknown
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::scope::{Namespace, Scope};

    fn fp(b: u8) -> Fingerprint {
        Fingerprint::try_from(format!("{b:02x}").repeat(32)).unwrap()
    }

    fn req(fingerprint: Option<Fingerprint>) -> ClaimRequest {
        ClaimRequest {
            scope: Scope::new(
                "t",
                "p",
                "r",
                Namespace::Client,
                Key::try_from("k".to_string()).unwrap(),
            )
            .unwrap(),
            fingerprint,
            lease_ms: 1_000,
            ttl_ms: 10_000,
            wait_ms: 0,
            after_expiry: AfterExpiry::Reject,
            on_unknown: OnUnknown::Conflict,
            attempt: None,
            deadline_ms: 0,
        }
    }

    fn rec(state: State) -> RecordView {
        RecordView {
            state,
            fingerprint: Some(fp(1)),
            fence: 7,
            lease_until: 2_000,
            status: Some(201),
            body_stored: true,
            completed_at: if state == State::Completed {
                Some(1_500)
            } else {
                None
            },
            expires_at: if state == State::InProgress {
                None
            } else {
                Some(11_500)
            },
            archived: false,
            attempt: Some("a".into()),
        }
    }

    #[test]
    fn no_record_means_a_fresh_claim() {
        assert_eq!(decide_claim(None, &req(Some(fp(1))), 0), ClaimDecision::Claim);
    }

    #[test]
    fn a_different_fingerprint_is_a_mismatch_in_every_state() {
        for state in [State::InProgress, State::Completed, State::Unknown] {
            for now in [0, 1_999, 2_000, 11_500, 99_999] {
                let d = decide_claim(Some(&rec(state)), &req(Some(fp(2))), now);
                assert_eq!(
                    d,
                    ClaimDecision::Answer(ClaimReply::Mismatch),
                    "{state:?} at {now}"
                );
            }
        }
    }

    #[test]
    fn a_missing_fingerprint_on_either_side_matches() {
        let mut r = rec(State::Completed);
        assert!(matches!(
            decide_claim(Some(&r), &req(None), 1_600),
            ClaimDecision::Replay { .. }
        ));
        r.fingerprint = None;
        assert!(matches!(
            decide_claim(Some(&r), &req(Some(fp(9))), 1_600),
            ClaimDecision::Replay { .. }
        ));
    }

    #[test]
    fn a_completed_record_replays_until_it_expires() {
        let r = rec(State::Completed);
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 11_499),
            ClaimDecision::Replay {
                status: 201,
                completed_at: 1_500
            }
        );
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 11_500),
            ClaimDecision::Answer(ClaimReply::Expired {
                completed_at: Some(1_500)
            })
        );
        let mut new = req(Some(fp(1)));
        new.after_expiry = AfterExpiry::New;
        assert_eq!(decide_claim(Some(&r), &new, 11_500), ClaimDecision::Claim);
        // An expired key is forgotten under `new`: another request is no mismatch.
        new.fingerprint = Some(fp(2));
        assert_eq!(decide_claim(Some(&r), &new, 11_500), ClaimDecision::Claim);
    }

    #[test]
    fn a_completed_record_without_its_body_is_result_unavailable() {
        let mut r = rec(State::Completed);
        r.body_stored = false;
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 1_600),
            ClaimDecision::Answer(ClaimReply::ResultUnavailable {
                original_status: 201,
                completed_at: 1_500
            })
        );
    }

    #[test]
    fn an_in_progress_record_answers_the_remaining_lease() {
        let r = rec(State::InProgress);
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 1_250),
            ClaimDecision::Answer(ClaimReply::InProgress { retry_after_ms: 750 })
        );
    }

    #[test]
    fn a_lease_that_ran_out_turns_unknown_or_is_claimed_afresh() {
        let r = rec(State::InProgress);
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 2_000),
            ClaimDecision::BecomeUnknown
        );
        let mut release = req(Some(fp(1)));
        release.on_unknown = OnUnknown::Release;
        assert_eq!(decide_claim(Some(&r), &release, 2_000), ClaimDecision::Claim);
    }

    #[test]
    fn an_unknown_record_conflicts_unless_the_policy_releases_it() {
        let r = rec(State::Unknown);
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 3_000),
            ClaimDecision::Answer(ClaimReply::Unknown)
        );
        let mut release = req(Some(fp(1)));
        release.on_unknown = OnUnknown::Release;
        assert_eq!(decide_claim(Some(&r), &release, 3_000), ClaimDecision::Claim);
        // Marked unknown early, the upstream may still act until the lease ends.
        assert_eq!(
            decide_claim(Some(&r), &release, 1_500),
            ClaimDecision::Answer(ClaimReply::InProgress { retry_after_ms: 500 })
        );
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 11_500),
            ClaimDecision::Answer(ClaimReply::Expired { completed_at: None })
        );
    }

    #[test]
    fn an_archived_record_never_replays_whatever_the_clock() {
        let mut r = rec(State::Completed);
        r.archived = true;
        assert_eq!(
            decide_claim(Some(&r), &req(Some(fp(1))), 1_600),
            ClaimDecision::Answer(ClaimReply::Expired {
                completed_at: Some(1_500)
            })
        );
        let mut new = req(Some(fp(1)));
        new.after_expiry = AfterExpiry::New;
        assert_eq!(decide_claim(Some(&r), &new, 1_600), ClaimDecision::Claim);
    }

    #[test]
    fn an_abandon_is_remembered_unless_its_attempt_holds_the_record() {
        use AbandonDecision::*;
        assert_eq!(decide_abandon(None, "a"), Remember);
        let open = rec(State::InProgress);
        assert_eq!(decide_abandon(Some(&open), "a"), End);
        assert_eq!(decide_abandon(Some(&open), "b"), Remember);
        assert_eq!(decide_abandon(Some(&rec(State::Unknown)), "a"), End);
        assert_eq!(decide_abandon(Some(&rec(State::Completed)), "a"), Settled);
        assert_eq!(decide_abandon(Some(&rec(State::Completed)), "b"), Remember);
        // Its lease ran out and it expired before the abandon arrived.
        let mut archived = rec(State::Unknown);
        archived.archived = true;
        assert_eq!(decide_abandon(Some(&archived), "a"), End);
    }

    #[test]
    fn only_the_current_fence_completes_an_open_record() {
        assert!(may_fence(State::InProgress, 7, 7));
        assert!(may_fence(State::Unknown, 7, 7));
        assert!(!may_fence(State::InProgress, 8, 7));
        assert!(!may_fence(State::Completed, 7, 7));
    }

    #[test]
    fn only_the_claiming_attempt_abandons_and_never_a_completion() {
        assert!(may_abandon(State::InProgress, Some("a"), "a"));
        assert!(may_abandon(State::Unknown, Some("a"), "a"));
        assert!(!may_abandon(State::InProgress, Some("a"), "b"));
        assert!(!may_abandon(State::InProgress, None, "a"));
        assert!(!may_abandon(State::Completed, Some("a"), "a"));
    }

    #[test]
    fn transitions_round_trip_and_name_how_a_generation_ended() {
        for t in Transition::ALL {
            assert_eq!(Transition::parse(t.as_str()), Some(t));
        }
        assert_eq!(ended_as(State::InProgress, Transition::Abandoned), "abandoned");
        assert_eq!(ended_as(State::Completed, Transition::Reclaimed), "completed");
        assert_eq!(ended_as(State::Unknown, Transition::Reclaimed), "unknown");
        assert_eq!(
            ended_as(State::InProgress, Transition::LeaseExpired),
            "lease_expired"
        );
        assert_eq!(
            ended_as(State::InProgress, Transition::Reclaimed),
            "lease_expired"
        );
        assert_eq!(ended_as(State::Unknown, Transition::Resolved), "released");
    }

    #[test]
    fn time_arithmetic_saturates() {
        assert_eq!(remaining_ms(5, 10), 0);
        assert_eq!(plus_ms(i64::MAX - 1, u64::MAX), i64::MAX);
        assert_eq!(completion_expiry(1_000, 500), 1_500);
        assert_eq!(unknown_expiry(1_000, 500), 1_500);
        assert_eq!(lease_until(1_000, 10), 1_010);
    }

    #[test]
    fn states_round_trip_through_their_column_spelling() {
        for s in [State::InProgress, State::Completed, State::Unknown] {
            assert_eq!(State::parse(s.as_str()), Some(s));
        }
        assert_eq!(State::parse("released"), None);
    }
}
