//! What the database lost when the store restarted ([`Lost`]), and what
//! the contract lets that explain (§5): a lost completion turns its record
//! back to its claim (in progress, then unknown) even after a retry was
//! answered with its replay, and never lets the key run again under
//! `on_unknown: conflict`; a lost claim (a standby's lag, a backup's age)
//! lets the key run again as a first request, and the transitions lost
//! with it were never made. Each excuse names the attempt or generation a
//! lost commit held.

use idemgate_core::config::OnUnknown;
use idemgate_core::record::{Standing, State, Transition};
use idemgate_store::backend::{Actor, RecordInfo};

use crate::database::loss::{Loss, Lost};
use crate::world::{Confirmed, Exec, World};

/// The scope `attempt`'s request named (its [`crate::world::scope_label`]).
fn key_of(w: &World, attempt: &str) -> Option<String> {
    w.attempts
        .iter()
        .find(|(_, a)| a.as_str() == attempt)
        .and_then(|(o, _)| w.request_keys.get(o))
        .map(|s| w.scope_name(*s))
}

/// Every generation the loss took, as the store had it.
pub(super) fn generations(w: &World) -> Vec<&RecordInfo> {
    let Some(lost) = &w.lost else { return Vec::new() };
    lost.keys
        .iter()
        .flat_map(|(key, _, _)| lost.claims(key))
        .collect()
}

/// Whether `attempt`'s claim was lost.
pub(super) fn claim(w: &World, attempt: &str) -> bool {
    let Some(lost) = &w.lost else { return false };
    key_of(w, attempt).is_some_and(|key| lost.claim_of(&key, attempt))
}

/// Whether a transition of `attempt`'s generation after its claim (its
/// completion, release, abandon, or its lease's end) was lost.
pub(super) fn transition(w: &World, attempt: &str) -> bool {
    let Some(lost) = &w.lost else { return false };
    key_of(w, attempt).is_some_and(|key| lost.transition_of(&key, attempt))
}

/// Whether what `attempt` settled or claimed was lost: its claim, a
/// transition after it, or its abandon (a claim of it that lands later is
/// then owned by nobody).
pub(super) fn settled(w: &World, attempt: &str) -> bool {
    let abandon = || {
        w.lost
            .as_ref()
            .is_some_and(|lost| key_of(w, attempt).is_some_and(|key| lost.abandon_of(&key, attempt)))
    };
    claim(w, attempt) || transition(w, attempt) || abandon()
}

/// `again` ran under a claim the loss took, and `done`'s generation was
/// not completed when the loss came: with that claim went the takeover
/// that had made `done`'s completion stale, which then landed.
pub(super) fn completed_after(w: &World, done: &Exec, again: &Exec) -> bool {
    let Some(lost) = &w.lost else { return false };
    let completed_before = |key: String| {
        lost.keys.iter().any(|(k, before, _)| {
            *k == key
                && before.records.iter().any(|g| {
                    g.attempt.as_deref() == Some(done.attempt.as_str())
                        && g.state == Standing::In(State::Completed)
                })
        })
    };
    claim(w, &again.attempt) && key_of(w, &done.attempt).is_some_and(|key| !completed_before(key))
}

/// `again` ran as a first request after the loss because the claim under
/// which `before` ran was lost.
pub(super) fn first_again(w: &World, before: &Exec, again: &Exec) -> bool {
    w.lost.as_ref().is_some_and(|l| again.start >= l.at) && claim(w, &before.attempt)
}

/// The store's confirmation `i` (`c`) was given before the loss and what
/// it confirmed is what was lost: the generation it gave, or the
/// transition it made.
pub(super) fn confirmation(w: &World, i: usize, c: &Confirmed) -> bool {
    let Some(lost) = w.lost.as_ref().filter(|l| i < l.confirmed) else {
        return false;
    };
    let (key, fence, made) = match c {
        Confirmed::Owned { key, fence } => {
            return lost.claims(key).iter().any(|g| g.generation == *fence);
        }
        Confirmed::Completed { key, fence } => (key, fence, Transition::Completed),
        Confirmed::Released { key, fence } => (key, fence, Transition::Released),
    };
    lost.events(key)
        .iter()
        .any(|e| e.generation == *fence && e.transition == made)
}

/// Whether `key` had a generation claimed by a request of the other body
/// than `attempt`'s, which the loss took.
pub(super) fn other_body(w: &World, key: &str, attempt: &str) -> bool {
    let Some(lost) = &w.lost else { return false };
    lost.claims(key).iter().any(|g| {
        g.attempt
            .as_ref()
            .is_some_and(|a| w.other_body.get(a) != w.other_body.get(attempt))
    })
}

/// The loss took only what its kind may take: a crash or failover only
/// completions committed without waiting, under `on_unknown: conflict`;
/// and every loss only the last of each key's history, which it put back
/// as it was.
pub(super) fn only_allowed(lost: &Lost) -> Result<(), String> {
    for (key, before, after) in &lost.keys {
        if !before.events.starts_with(&after.events) {
            return Err(format!("{key}: the database's loss changed what it kept"));
        }
        if lost.loss != Loss::Unflushed {
            continue;
        }
        if let Some(g) = lost.claims(key).first() {
            return Err(format!(
                "{key}: a crash lost the claim of generation {}, which was durable",
                g.generation
            ));
        }
        for e in lost.events(key) {
            let lazy = e.transition == Transition::Completed
                && e.actor == Actor::Filter
                && before
                    .records
                    .iter()
                    .any(|g| g.generation == e.generation && g.on_unknown == OnUnknown::Conflict);
            if !lazy {
                return Err(format!(
                    "{key}: a crash lost {} of generation {}, which was durable",
                    e.transition, e.generation
                ));
            }
        }
    }
    Ok(())
}
