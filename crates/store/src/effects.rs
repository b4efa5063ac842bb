//! What a claim, the fence calls, abandon, the operators' changes and the
//! sweeper do to a record, decided once for every backend.
//!
//! Each operation's effect is decided from the record as loaded (and
//! locked, on PostgreSQL): an [`Effect`] is the reply and the [`Write`]s
//! that make it true, in order. A backend loads, asks here, and carries the
//! effect out with
//! the steps it has for each write (`carry_out` in `sqlite::operations`,
//! `postgres::operations` and `memory::operations`); no backend decides
//! anything of its own. A claim's effect is a [`ClaimEffect`]: its one step
//! no other operation takes is starting a generation. The rules themselves
//! are [`idemgate_core::record`]'s.
//!
//! One decision is also stated in SQL: PostgreSQL completes a record with a
//! single statement that reads nothing first (`postgres::operations::COMPLETE`,
//! built from [`crate::conditions`]); the story suite checks that it comes
//! to what [`complete`] decides, in every state a completion can meet. And
//! PostgreSQL inserts a new key with the statement that reads its record
//! (`postgres::rows::CLAIM`, and `CLAIM_NEW` for a batch's new keys): the
//! generation and `claimed` event [`claim`] decides when there is no record.

use std::borrow::Cow;

use idemgate_core::protocol::{ClaimReply, ClaimRequest, CompleteRequest, FenceReply};
use idemgate_core::record::{self, AbandonDecision, ClaimDecision, Standing, State, Transition};
use idemgate_core::scope::Scope;

use crate::backend::{Action, Actor, Resolution, SweepReport};
use crate::calls::ClaimOutcome;
use crate::row_mapping::LoadedRecord;

/// A transition, who caused it (an operator lives as long as the effect), and
/// an optional detail.
pub type By<'a> = (Transition, &'a Actor, Option<&'static str>);

/// A response to store in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response<'a> {
    pub status: u16,
    pub headers: &'a [(String, String)],
    /// The body to keep (`None`: not kept).
    pub body: Option<&'a [u8]>,
    pub body_stored: bool,
}

/// The fence a completed record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// The one it holds already (the completing owner's).
    Held(u64),
    /// A new one, taken when the write is carried out: an operator's
    /// completion supersedes the owner, whose late calls are then stale.
    New,
}

/// One change to the current record of the operation's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write<'a> {
    /// Records the transition `by` (with an operator's `note`).
    Event { by: By<'a>, note: Option<&'a str> },
    /// Ends the generation, whose state was `last`: the event `by` (with
    /// `note`), its move to the history as [`record::ended_as`], and the key
    /// is free.
    EndGeneration {
        last: State,
        by: By<'a>,
        note: Option<&'a str>,
    },
    /// Turns the record unknown until `expires_at`, if it still has the
    /// fence and state it was read with.
    SetUnknown {
        read_with: (u64, State),
        expires_at: i64,
    },
    /// Stores `response`: the record is completed under `fence`, until
    /// `expires_at`. `durable`: the commit must reach the disk before the
    /// caller hears of it (a lost completion would free the key).
    Complete {
        response: Response<'a>,
        fence: Fence,
        expires_at: i64,
        durable: bool,
    },
    /// Archives the record: its body is dropped, its metadata kept.
    Archive,
    /// Remembers that the filter abandoned or released `attempt` of
    /// `scope`, so the sweeper ends its claim if it lands later.
    RememberAbandon { scope: &'a Scope, attempt: Cow<'a, str> },
}

/// The reply to an operation and the writes that carry it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect<'a, R> {
    pub reply: R,
    pub writes: Vec<Write<'a>>,
}

impl<'a, R> Effect<'a, R> {
    fn only(reply: R) -> Effect<'a, R> {
        Effect {
            reply,
            writes: Vec::new(),
        }
    }

    fn of(reply: R, writes: Vec<Write<'a>>) -> Effect<'a, R> {
        Effect { reply, writes }
    }
}

/// What a claim does to its key ([`record::decide_claim`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimEffect {
    /// Answer this; nothing changes.
    Answer(ClaimReply),
    /// Serve the stored response (status, headers, body) and count the
    /// replay in the record.
    Replay { status: u16, completed_at: i64 },
    /// Take the key: the generation there, if any, ends as `replaced` says
    /// (its event, then its move to the history without its body), a fresh
    /// one starts in progress under a new fence from the one sequence, `by`
    /// is recorded on it, and the claim is answered `Owned` with that fence.
    Take {
        replaced: Option<Replaced>,
        by: By<'static>,
    },
    /// Change the record without taking the key (an expired lease turns
    /// unknown): the effect's writes, then its answer.
    Change(Effect<'static, ClaimOutcome>),
}

/// How a claim ends the generation it replaces: `by`, the event recorded
/// on that generation while it is still the key's record, and `ended`, how
/// the history keeps it ([`record::ended_as`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replaced {
    pub ended: Standing,
    pub by: By<'static>,
}

impl ClaimEffect {
    /// Whether carrying it out writes anything but a replay's count: a claim
    /// past its caller's deadline must not, and a peek does not.
    pub fn writes(&self) -> bool {
        matches!(self, ClaimEffect::Take { .. } | ClaimEffect::Change(_))
    }
}

/// A claim of `req`'s key, whose current record is `loaded`.
pub fn claim(loaded: Option<&LoadedRecord>, req: &ClaimRequest, now: i64) -> ClaimEffect {
    match (record::decide_claim(loaded.map(|l| &l.view), req, now), loaded) {
        (ClaimDecision::Answer(reply), _) => ClaimEffect::Answer(reply),
        (ClaimDecision::Replay { status, completed_at }, _) => ClaimEffect::Replay { status, completed_at },
        // The generation it replaces ends with an event of its own before
        // it keeps its row in the history: a lease that ran out releases
        // it, as the sweeper would have; a finished one (unknown, or
        // expired) is reclaimed. The new one begins as every generation does.
        (ClaimDecision::Claim, Some(old)) => ClaimEffect::Take {
            replaced: Some(Replaced {
                ended: record::ended_as(old.view.state, Transition::Reclaimed),
                by: match old.view.state {
                    State::InProgress => (Transition::LeaseExpired, &Actor::Filter, Some("released")),
                    State::Completed | State::Unknown => (Transition::Reclaimed, &Actor::Filter, None),
                },
            }),
            by: (Transition::Claimed, &Actor::Filter, None),
        },
        (ClaimDecision::BecomeUnknown, Some(l)) => ClaimEffect::Change(Effect::of(
            ClaimOutcome {
                reply: ClaimReply::Unknown,
                body: Vec::new(),
                became_unknown: true,
            },
            vec![
                Write::SetUnknown {
                    read_with: (l.view.fence, l.view.state),
                    expires_at: record::unknown_expiry(now, l.ttl_ms),
                },
                Write::Event {
                    by: (Transition::LeaseExpired, &Actor::Filter, Some("unknown")),
                    note: None,
                },
            ],
        )),
        // No record: the key is free (`decide_claim` turns nothing unknown
        // that is not there).
        (ClaimDecision::Claim | ClaimDecision::BecomeUnknown, None) => ClaimEffect::Take {
            replaced: None,
            by: (Transition::Claimed, &Actor::Filter, None),
        },
    }
}

/// The record, if a fence call with `fence` may act on it
/// ([`LoadedRecord::may_fence`]).
fn fenced(loaded: Option<&LoadedRecord>, fence: u64) -> Option<&LoadedRecord> {
    loaded.filter(|l| l.may_fence(fence))
}

/// The filter stores the upstream's response under its fence (`body`: the
/// body to keep, if `req.body_stored`).
pub fn complete<'a>(
    loaded: Option<&LoadedRecord>,
    req: &'a CompleteRequest,
    body: Option<&'a [u8]>,
    now: i64,
) -> Effect<'a, FenceReply> {
    let late = |l: &&LoadedRecord| {
        l.view.archived
            && record::completes_archived(l.view.state)
            && record::may_fence(l.view.state, l.view.fence, req.fence)
    };
    let Some(l) = fenced(loaded, req.fence).or(loaded.filter(late)) else {
        return Effect::only(FenceReply::Stale);
    };
    // An archived record keeps no body.
    let kept = !l.view.archived;
    let response = Response {
        status: req.status,
        headers: &req.headers,
        body: body.filter(|_| kept),
        body_stored: req.body_stored && kept,
    };
    Effect::of(
        FenceReply::Done,
        vec![
            Write::Complete {
                response,
                fence: Fence::Held(l.view.fence),
                expires_at: record::completion_expiry(now, l.ttl_ms),
                durable: l.release_on_unknown,
            },
            Write::Event {
                by: (Transition::Completed, &Actor::Filter, None),
                note: None,
            },
        ],
    )
}

/// The filter gives the key back: the upstream refused before acting.
pub fn release<'a>(loaded: Option<&LoadedRecord>, scope: &'a Scope, fence: u64) -> Effect<'a, FenceReply> {
    match fenced(loaded, fence) {
        None => Effect::only(FenceReply::Stale),
        Some(l) => {
            let mut writes = vec![Write::EndGeneration {
                last: l.view.state,
                by: (Transition::Released, &Actor::Filter, None),
                note: None,
            }];
            // Remembered as an abandon is: a copy of its claim (delivered
            // twice by something in front of the store) that lands after
            // the release would otherwise take the key for nobody.
            if let Some(attempt) = &l.view.attempt {
                writes.push(Write::RememberAbandon {
                    scope,
                    attempt: Cow::Owned(attempt.clone()),
                });
            }
            Effect::of(FenceReply::Done, writes)
        }
    }
}

/// The filter declares that nobody knows what the upstream did. An unknown
/// record stays as it is.
pub fn mark_unknown(loaded: Option<&LoadedRecord>, fence: u64, now: i64) -> Effect<'static, FenceReply> {
    match fenced(loaded, fence) {
        None => Effect::only(FenceReply::Stale),
        Some(l) if l.view.state == State::Unknown => Effect::only(FenceReply::Done),
        Some(l) => Effect::of(
            FenceReply::Done,
            vec![
                Write::SetUnknown {
                    read_with: (l.view.fence, l.view.state),
                    expires_at: record::unknown_expiry(now, l.ttl_ms),
                },
                Write::Event {
                    by: (Transition::MarkedUnknown, &Actor::Filter, None),
                    note: None,
                },
            ],
        ),
    }
}

/// The filter gave up on `attempt` of `scope` ([`record::decide_abandon`]).
pub fn abandon<'a>(
    loaded: Option<&LoadedRecord>,
    scope: &'a Scope,
    attempt: &'a str,
) -> Effect<'a, FenceReply> {
    match (record::decide_abandon(loaded.map(|l| &l.view), attempt), loaded) {
        // Remembered too: a copy of the claim that lands afterwards (one
        // delivered twice by something in front of the store) is ended by
        // the sweeper as any claim that lands after its abandon.
        (AbandonDecision::End, Some(l)) => Effect::of(
            FenceReply::Done,
            vec![
                Write::EndGeneration {
                    last: l.view.state,
                    by: (Transition::Abandoned, &Actor::Filter, None),
                    note: None,
                },
                Write::RememberAbandon {
                    scope,
                    attempt: attempt.into(),
                },
            ],
        ),
        (AbandonDecision::Settled, _) => Effect::only(FenceReply::Stale),
        // The claim may still be on its way: the sweeper ends it if it
        // lands under this attempt.
        _ => Effect::of(
            FenceReply::Done,
            vec![Write::RememberAbandon {
                scope,
                attempt: attempt.into(),
            }],
        ),
    }
}

/// An operator decides a record: completes or releases an open one
/// ([`LoadedRecord::is_open`]), or purges whatever is current; the event
/// names the operator (`how.by`) and keeps the `reason`. `false`: there was
/// no record the decision applies to.
pub fn resolve<'a>(
    loaded: Option<&LoadedRecord>,
    how: &'a Resolution,
    reason: Option<&'a str>,
    now: i64,
) -> Effect<'a, bool> {
    let by = &how.by;
    let Some(l) = loaded else {
        return Effect::only(false);
    };
    // Only a purge ends a record that is not open.
    if how.action != Action::Purge && !l.is_open() {
        return Effect::only(false);
    }
    let writes = match &how.action {
        Action::Purge => vec![Write::EndGeneration {
            last: l.view.state,
            by: (Transition::Purged, by, None),
            note: reason,
        }],
        Action::Release => vec![Write::EndGeneration {
            last: l.view.state,
            by: (Transition::Resolved, by, Some("release")),
            note: reason,
        }],
        Action::Complete {
            status,
            headers,
            body,
        } => vec![
            Write::Complete {
                response: Response {
                    status: *status,
                    headers,
                    body: Some(body.as_bytes()),
                    body_stored: true,
                },
                fence: Fence::New,
                expires_at: record::completion_expiry(now, l.ttl_ms),
                durable: l.release_on_unknown,
            },
            Write::Event {
                by: (Transition::Resolved, by, Some("complete")),
                note: reason,
            },
        ],
    };
    Effect::of(true, writes)
}

/// Why the sweeper picked a record. The picks are the rules stated in SQL
/// ([`crate::conditions`]); what becomes of a picked record is decided here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Its lease ran out while in progress.
    LeaseRanOut,
    /// Its claim landed under an attempt its filter had abandoned.
    LandedAbandoned,
    /// It is past its expiry.
    Expired,
}

/// What a sweeper phase did to a record, for its [`SweepReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swept {
    Released,
    MarkedUnknown,
    Abandoned,
    Archived,
}

impl Swept {
    pub fn count(self, report: &mut SweepReport) {
        let n = match self {
            Swept::Released => &mut report.released,
            Swept::MarkedUnknown => &mut report.marked_unknown,
            Swept::Abandoned => &mut report.abandoned,
            Swept::Archived => &mut report.archived,
        };
        *n += 1;
    }
}

/// What the sweeper does to a record it picked as `due`; a record that is
/// gone by then is left alone (`None`).
pub fn sweep(loaded: Option<&LoadedRecord>, due: Due, now: i64) -> Effect<'static, Option<Swept>> {
    let Some(l) = loaded else {
        return Effect::only(None);
    };
    let (swept, writes) = match due {
        // Released or turned unknown, as the claim's `on_unknown` said.
        Due::LeaseRanOut if l.release_on_unknown => (
            Swept::Released,
            vec![Write::EndGeneration {
                last: l.view.state,
                by: (Transition::LeaseExpired, &Actor::Sweeper, Some("released")),
                note: None,
            }],
        ),
        Due::LeaseRanOut => (
            Swept::MarkedUnknown,
            vec![
                Write::SetUnknown {
                    read_with: (l.view.fence, l.view.state),
                    expires_at: record::unknown_expiry(now, l.ttl_ms),
                },
                Write::Event {
                    by: (Transition::LeaseExpired, &Actor::Sweeper, Some("unknown")),
                    note: None,
                },
            ],
        ),
        Due::LandedAbandoned => (
            Swept::Abandoned,
            vec![Write::EndGeneration {
                last: l.view.state,
                by: (Transition::Abandoned, &Actor::Sweeper, None),
                note: None,
            }],
        ),
        Due::Expired => (
            Swept::Archived,
            vec![
                Write::Archive,
                Write::Event {
                    by: (Transition::Archived, &Actor::Sweeper, None),
                    note: None,
                },
            ],
        ),
    };
    Effect::of(Some(swept), writes)
}

#[cfg(test)]
mod tests;
