//! The store's history and events, audited (§6): every transition is an
//! event of its own generation by the actor that makes it, what the store
//! confirmed is in its history, and nothing is ever overwritten.

use std::collections::HashMap;

use idemgate_core::record::{ended_as, Standing, State, Transition};
use idemgate_store::backend::{Actor, EventInfo, KeyHistory, RecordInfo};

use crate::world::{Confirmed, World};

/// A generation's life as its events tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Open(State),
    Ended(Standing),
}

/// Every transition is an event of the generation it changed, by the actor
/// that makes it, in an order the lifecycle allows (§6); the generation's
/// row is what its events made it; and a generation that ended has an
/// event of its own that ended it.
pub(super) fn events(key: &str, h: &KeyHistory) -> Result<(), String> {
    let mut by_generation: HashMap<u64, Vec<&EventInfo>> = HashMap::new();
    for e in &h.events {
        by_generation.entry(e.generation).or_default().push(e);
    }
    for g in &h.records {
        let evs = by_generation.remove(&g.generation).unwrap_or_default();
        let told: Vec<String> = evs.iter().map(|e| told(e)).collect();
        let whose = || format!("{key}: generation {} ({})", g.generation, told.join(", "));
        let (life, archived) = replay(&evs).map_err(|e| format!("{}: {e}", whose()))?;
        match (g.ended_at, life) {
            (None, Life::Open(state)) if g.state == Standing::In(state) => {}
            (None, life) => {
                return Err(format!(
                    "{}: is current and {} but its events leave it {life:?}",
                    whose(),
                    g.state.as_str()
                ))
            }
            (Some(_), Life::Ended(how)) if how == g.state => {}
            (Some(at), Life::Open(state)) => {
                return Err(format!(
                    "{}: ended at {at} ({}) with no event of its own that ended it; its events leave it {}",
                    whose(),
                    g.state.as_str(),
                    state.as_str()
                ))
            }
            (Some(_), Life::Ended(how)) => {
                return Err(format!(
                    "{}: ended {} but its events say {}",
                    whose(),
                    g.state.as_str(),
                    how.as_str()
                ))
            }
        }
        if archived != g.archived_at.is_some() {
            return Err(format!(
                "{}: archived_at {:?}, but its events say archived: {archived}",
                whose(),
                g.archived_at
            ));
        }
    }
    if let Some((generation, _)) = by_generation.iter().next() {
        return Err(format!(
            "{key}: events of generation {generation}, which the store does not know"
        ));
    }
    Ok(())
}

fn told(e: &EventInfo) -> String {
    match &e.detail {
        Some(d) => format!("{} by {} ({d})", e.transition, e.actor),
        None => format!("{} by {}", e.transition, e.actor),
    }
}

/// A generation's events in order, as the lifecycle allows them: how they
/// leave it, and whether it was archived.
fn replay(evs: &[&EventInfo]) -> Result<(Life, bool), String> {
    let Some((first, rest)) = evs.split_first() else {
        return Err("has no events".into());
    };
    // Every generation begins with its claim.
    if first.transition != Transition::Claimed || first.actor != Actor::Filter {
        return Err(format!("begins with {}", told(first)));
    }
    let (mut life, mut archived) = (Life::Open(State::InProgress), false);
    for e in rest {
        let open = match life {
            Life::Open(s) => s,
            Life::Ended(how) => return Err(format!("{} after it ended {}", told(e), how.as_str())),
        };
        let (actors, next): (&[Actor], Option<Life>) = match (e.transition, e.detail.as_deref(), open) {
            (Transition::Completed, _, State::InProgress | State::Unknown) => {
                (&[Actor::Filter], Some(Life::Open(State::Completed)))
            }
            (Transition::MarkedUnknown, _, State::InProgress) => {
                (&[Actor::Filter], Some(Life::Open(State::Unknown)))
            }
            (Transition::LeaseExpired, Some("unknown"), State::InProgress) => {
                (&[Actor::Filter, Actor::Sweeper], Some(Life::Open(State::Unknown)))
            }
            (Transition::LeaseExpired, Some("released"), State::InProgress) => (
                &[Actor::Filter, Actor::Sweeper],
                Some(Life::Ended(Standing::EndedBy(Transition::LeaseExpired))),
            ),
            (Transition::Released, _, State::InProgress | State::Unknown) => (
                &[Actor::Filter],
                Some(Life::Ended(Standing::EndedBy(Transition::Released))),
            ),
            (Transition::Abandoned, _, State::InProgress | State::Unknown) => (
                &[Actor::Filter, Actor::Sweeper],
                Some(Life::Ended(Standing::EndedBy(Transition::Abandoned))),
            ),
            (Transition::Archived, _, State::Completed | State::Unknown) if !archived => {
                archived = true;
                (&[Actor::Sweeper], None)
            }
            // Replaced by a new generation's claim.
            (Transition::Reclaimed, _, state) => (
                &[Actor::Filter],
                Some(Life::Ended(ended_as(state, Transition::Reclaimed))),
            ),
            _ => return Err(format!("{} while {}", told(e), open.as_str())),
        };
        if !actors.contains(&e.actor) {
            return Err(format!("{} by an actor that does not make it", told(e)));
        }
        if let Some(next) = next {
            life = next;
        }
    }
    Ok((life, archived))
}

/// What the store confirmed in its answers is in its history: a claim it
/// gave is a generation that began with it, a completion or release it
/// did is an event of that generation.
pub(super) fn confirmations(w: &World, histories: &[(String, KeyHistory)]) -> Result<(), String> {
    let of = |key: &str| histories.iter().find(|(k, _)| k == key).map(|(_, h)| h);
    for (i, c) in w.confirmed.iter().enumerate() {
        if super::loss::confirmation(w, i, c) {
            continue;
        }
        let (key, fence, wanted) = match c {
            Confirmed::Owned { key, fence } => (key, fence, None),
            Confirmed::Completed { key, fence } => (key, fence, Some(Transition::Completed)),
            Confirmed::Released { key, fence } => (key, fence, Some(Transition::Released)),
        };
        let Some(h) = of(key) else {
            return Err(format!("the store answered {c:?} for a scope no request named"));
        };
        if !h.records.iter().any(|g| g.generation == *fence) {
            return Err(format!(
                "{key}: the store answered {c:?}, but it keeps no generation {fence}"
            ));
        }
        if let Some(t) = wanted {
            if !h
                .events
                .iter()
                .any(|e| e.generation == *fence && e.transition == t)
            {
                return Err(format!(
                    "{key}: the store answered {c:?}, but generation {fence} has no {t} event"
                ));
            }
        }
    }
    Ok(())
}

/// What changed in a key's history between two readings, if anything
/// changed that is not an addition: nothing is overwritten (§6). Every
/// generation stays, what it was claimed with stays, an ended generation
/// stays as it ended, a completion stays, and events only grow at the end.
pub fn overwritten(before: &KeyHistory, after: &KeyHistory) -> Option<String> {
    for old in &before.records {
        let Some(new) = after.records.iter().find(|g| g.generation == old.generation) else {
            return Some(format!("generation {} is gone", old.generation));
        };
        let claimed = |g: &RecordInfo| {
            (
                g.scope.clone(),
                g.attempt.clone(),
                g.fingerprint.clone(),
                g.created_at,
            )
        };
        if claimed(old) != claimed(new) {
            return Some(format!(
                "generation {} was claimed by something else",
                old.generation
            ));
        }
        if old.ended_at.is_some() && old != new {
            return Some(format!(
                "generation {} changed after it ended: {old:?} became {new:?}",
                old.generation
            ));
        }
        if old.completed_at.is_some() && (old.status, old.completed_at) != (new.status, new.completed_at) {
            return Some(format!(
                "the completion of generation {} changed: {:?} at {:?} became {:?} at {:?}",
                old.generation, old.status, old.completed_at, new.status, new.completed_at
            ));
        }
    }
    if !after.events.starts_with(&before.events) {
        return Some("an event was changed or removed".into());
    }
    None
}
