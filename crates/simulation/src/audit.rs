//! The contract's promises, checked on what happened: what the clients
//! got, what the upstream executed, what the store confirmed as it
//! answered, and the store's own history and events read back from it.
//! The checks restate the contract (`docs/contract.md` §4–§6) in their own
//! words instead of asking the core's rules: an oracle that shared them
//! would share their bugs.

use std::collections::{HashMap, HashSet};

use idemgate_core::config::{AfterExpiry, OnUnknown, DEFAULT_RELEASE_STATUSES};
use idemgate_core::record::{Standing, State, Transition};
use idemgate_store::backend::RecordInfo;

mod history;
mod loss;
mod modes;

pub use history::overwritten;
use history::{confirmations, events};

use crate::database::Limited;
use crate::scenario::Knobs;
use crate::world::{Exec, Got, World};

/// Every promise, on a world that ran: the first one broken.
pub fn audit(w: &World, k: &Knobs) -> Result<(), String> {
    let histories = w.histories();
    let generations: Vec<&RecordInfo> = histories.iter().flat_map(|(_, h)| &h.records).collect();
    modes::forwarded(w, k)?;
    modes::observed(w)?;
    if let Some(lost) = &w.lost {
        loss::only_allowed(lost)?;
    }
    executions(w, k, &generations)?;
    if let Some(at) = w.outgrown {
        return Err(format!(
            "a worker's queue outgrew its bound at {at} ms: {} calls",
            w.max_queued
        ));
    }
    left_unknown(w, &generations)?;
    if k.edge {
        stored(w, k, &generations)?;
    }
    never_reached(w, k, &generations)?;
    answers(w, k, &generations)?;
    for (key, h) in &histories {
        events(key, h)?;
    }
    confirmations(w, &histories)?;
    for l in &w.limited {
        rate_limited(l)?;
    }
    if let Some(what) = &w.unlooked {
        return Err(what.clone());
    }
    if let Some(what) = &w.overwritten {
        return Err(format!("the history was overwritten: {what}"));
    }
    if w.stuck {
        return Err("the store held calls that never finished".into());
    }
    if !w.quiet() {
        return Err("calls were left undelivered".into());
    }
    Ok(())
}

fn released(status: u16) -> bool {
    DEFAULT_RELEASE_STATUSES.contains(&status)
}

/// The generation an attempt claimed, if it claimed one.
fn generation_of<'a>(generations: &[&'a RecordInfo], attempt: &str) -> Option<&'a RecordInfo> {
    generations
        .iter()
        .copied()
        .find(|g| g.attempt.as_deref() == Some(attempt))
}

/// A key's request reaches the upstream once (§5); under `on_unknown:
/// release` an unknown outcome may run again, never while it may still
/// run, and never once a generation of the key completed.
fn executions(w: &World, k: &Knobs, generations: &[&RecordInfo]) -> Result<(), String> {
    let mut by_key: HashMap<usize, Vec<&Exec>> = HashMap::new();
    for e in w.execs.iter().filter(|e| !modes::unprotected(w, k, &e.attempt)) {
        by_key.entry(e.key).or_default().push(e);
    }
    let mut keys: Vec<_> = by_key.into_iter().collect();
    keys.sort_by_key(|(k, _)| *k);
    // Under `after_expiry: new`, what ran again under a generation claimed
    // once the generation of what ran before had expired (§6); a
    // generation the database lost since was one of them all the same.
    let known: Vec<&RecordInfo> = generations.iter().copied().chain(loss::generations(w)).collect();
    let after_expiry = |before: &Exec, again: &Exec| {
        let (Some(g), Some(h)) = (
            generation_of(&known, &before.attempt),
            generation_of(&known, &again.attempt),
        ) else {
            return false;
        };
        // A generation with an expiry (completed or unknown) is replaced
        // only once expired, but for an unknown one under `on_unknown:
        // release`, which may run again anyway. (The store's clock may
        // have stepped back since: times are not compared.)
        k.after_expiry_new
            && h.generation > g.generation
            && (g.archived_at.is_some() || g.expires_at.is_some())
    };
    for (key, execs) in keys {
        if !k.release_unknown {
            let mut acting: Vec<&&Exec> = execs.iter().filter(|e| !released(e.status)).collect();
            acting.sort_by_key(|e| e.start);
            if let Some(pair) = acting
                .windows(2)
                .find(|p| !after_expiry(p[0], p[1]) && !loss::first_again(w, p[0], p[1]))
            {
                return Err(format!(
                    "key {key} executed {} times: {} at {} ms, then {} at {} ms",
                    acting.len(),
                    pair[0].attempt,
                    pair[0].start,
                    pair[1].attempt,
                    pair[1].start
                ));
            }
            continue;
        }
        // A detached upstream may answer after its `timeout_ms`, but acts
        // no longer than it: the contract's premise, the lease covering
        // that and one store call. One that acts on past it is left to the
        // timeout, as a streaming route's upstream that outlives the lease
        // is (`Knobs::outlives_lease`, not drawn under `release`); counted
        // whole, it ran a key twice at once (explore --seed
        // 1796688534767718903 --case 11496: acting to 1,896 ms of a 1,800
        // ms timeout after a claim answer 138 ms late).
        let acting = |e: &Exec| match k.detached {
            true => e.end.min(e.start + k.detached_timeout_ms as i64),
            false => e.end,
        };
        let mut spans: Vec<&&Exec> = execs.iter().collect();
        spans.sort_by_key(|e| (e.start, acting(e)));
        if let Some(p) = spans
            .windows(2)
            .find(|p| p[1].start < acting(p[0]) && !loss::first_again(w, p[0], p[1]))
        {
            let spans: Vec<(i64, i64)> = p.iter().map(|e| (e.start, e.end)).collect();
            return Err(format!("key {key} executed twice at once: {spans:?}"));
        }
        // Only an unknown outcome may run again: a completion stands. (An
        // execution that began before it completed ran alongside it.)
        for done in &execs {
            let Some(g) = generation_of(generations, &done.attempt) else {
                continue;
            };
            if g.state != Standing::In(State::Completed) {
                continue;
            }
            if let Some(again) = execs.iter().find(|e| {
                e.start > done.start && !after_expiry(done, e) && !loss::completed_after(w, done, e)
            }) {
                return Err(format!(
                    "key {key} completed ({} by {}, generation {}) and executed again by {} at {} ms",
                    g.status.unwrap_or(0),
                    done.attempt,
                    g.generation,
                    again.attempt,
                    again.start
                ));
            }
        }
    }
    Ok(())
}

/// A generation may be unknown for a while (its lease ran out before the
/// abandon arrived); it may be left unknown only if the upstream may have
/// run, if the store client gave up its abandon (its lease settled it) or
/// Envoy went away with it (§5: a claim on its way lands with nobody to
/// forward it),
/// or if a copy of its claim took the key after the store had decided its
/// request's claim without it, and the request read that answer (§5: a
/// store call delivered twice).
/// Whether an unknown generation expired: archived, or replaced under
/// `after_expiry: new`.
fn expired(g: &RecordInfo) -> bool {
    g.archived_at.is_some() || g.ended_at.is_some()
}

fn left_unknown(w: &World, generations: &[&RecordInfo]) -> Result<(), String> {
    // An Envoy reply its filter never read leaves it as unsure as a run.
    let ran: HashSet<&str> = w
        .execs
        .iter()
        .map(|e| e.attempt.as_str())
        .chain(w.reply_unread.iter().map(String::as_str))
        .collect();
    for g in generations {
        let attempt = g.attempt.as_deref().unwrap_or("");
        let copied = w.told_not_theirs.contains(attempt)
            && matches!((w.refused_at.get(attempt), w.owned_at.get(attempt)), (Some(r), Some(o)) if r <= o);
        // A release of a request Envoy answered itself, or an abandon of
        // one that was never forwarded, held up by the faults until the
        // unknown record expired (archived, or replaced under
        // `after_expiry: new`): the TTL ended the key.
        let expired_first =
            (w.never_reached.contains(attempt) || w.abandoned.contains(attempt)) && expired(g);
        if g.state == Standing::In(State::Unknown)
            && !ran.contains(attempt)
            && !w.gave_up.contains(attempt)
            && !w.envoy_lost.contains(attempt)
            && !copied
            && !expired_first
            && !loss::settled(w, attempt)
        {
            return Err(format!(
                "generation {} ({attempt}) left unknown although nothing ran",
                g.generation
            ));
        }
    }
    Ok(())
}

/// On a network that loses nothing, every answer the upstream gave that
/// the filter read is stored (§5), whatever the policy does with unknown
/// outcomes and whether or not its client stayed: the lease's margin
/// carries the claim's answer, the completion and its queueing.
fn stored(w: &World, k: &Knobs, generations: &[&RecordInfo]) -> Result<(), String> {
    for e in &w.execs {
        if released(e.status)
            || modes::unprotected(w, k, &e.attempt)
            || !w.read_upstream.contains(&e.attempt)
            || w.gave_up.contains(&e.attempt)
            || w.envoy_lost.contains(&e.attempt)
        {
            continue;
        }
        let g = generation_of(generations, &e.attempt);
        if g.map(|g| g.state) != Some(Standing::In(State::Completed)) {
            return Err(format!(
                "{}'s upstream answered {} after {} ms (from {} to {} ms), but its record ended {:?}",
                e.attempt,
                e.status,
                e.end - e.start,
                e.start,
                e.end,
                g.map(|g| g.state.as_str())
            ));
        }
    }
    Ok(())
}

/// A request Envoy answered itself before the upstream got it ran
/// nowhere, and its key is released, never left unknown (§5): unless its
/// filter never read that answer (to it the request was forwarded), or
/// its settlement was given up or lost with Envoy (its lease settles it).
/// Under `on_unknown: release` a release the faults held up past the
/// lease finds the key freed by the lease.
fn never_reached(w: &World, k: &Knobs, generations: &[&RecordInfo]) -> Result<(), String> {
    let mut attempts: Vec<&String> = w.never_reached.iter().collect();
    attempts.sort();
    for attempt in attempts {
        if w.execs.iter().any(|e| &e.attempt == attempt) {
            return Err(format!("{attempt} never reached the upstream, but it ran"));
        }
        if w.gave_up.contains(attempt)
            || w.envoy_lost.contains(attempt)
            || w.reply_unread.contains(attempt)
            || modes::unprotected(w, k, attempt)
            || loss::settled(w, attempt)
        {
            continue;
        }
        // Its own generation; a copy of its claim delivered twice may
        // have opened another (see [`left_unknown`]).
        let freed = generations.iter().any(|g| {
            g.attempt.as_deref() == Some(attempt.as_str())
                && match g.state {
                    Standing::EndedBy(Transition::Released | Transition::Abandoned) => true,
                    // Its release held up until the unknown record expired
                    // (archived, or replaced under `after_expiry: new`): the
                    // key's TTL ended it first.
                    Standing::In(State::Unknown) => expired(g),
                    Standing::EndedBy(Transition::LeaseExpired) => k.release_unknown,
                    _ => false,
                }
        });
        if !freed {
            return Err(format!(
                "{attempt} never reached the upstream, but its record ended {:?}",
                generation_of(generations, attempt).map(|g| g.state.as_str())
            ));
        }
    }
    Ok(())
}

/// What each client got is an answer the contract gives it (§4, §5).
fn answers(w: &World, k: &Knobs, generations: &[&RecordInfo]) -> Result<(), String> {
    let ran: HashSet<&str> = w.execs.iter().map(|e| e.attempt.as_str()).collect();
    let mut owners: Vec<_> = w.got.iter().collect();
    owners.sort_by_key(|(o, _)| **o);
    for (owner, got) in owners {
        let attempt = &w.attempts[owner];
        let key = w.request_keys[owner];
        // Under detached forwarding the filter relays the upstream's answer itself.
        let relayed = match got {
            Got::Reply(r) => w
                .execs
                .iter()
                .find(|e| &e.attempt == attempt && e.status == r.status && e.body == r.body)
                .map(|e| Got::Upstream(e.status, true)),
            _ => None,
        };
        let problem = |r: &idemgate_core::Reply, kind: &str| {
            r.headers
                .iter()
                .any(|(n, v)| n == "content-type" && v.contains("problem"))
                && String::from_utf8_lossy(&r.body).contains(kind)
        };
        match relayed.as_ref().unwrap_or(got) {
            Got::Reply(r) if r.headers.iter().any(|(n, _)| n == "idempotent-replayed") => {
                // Only a request like the one that ran gets its response.
                let stored = w.execs.iter().any(|e| {
                    e.key == key
                        && e.status == r.status
                        && e.body == r.body
                        && w.other_body.get(&e.attempt) == w.other_body.get(attempt)
                });
                if !stored {
                    return Err(format!(
                        "request {owner} replayed {} {:?} that no execution answered",
                        r.status,
                        String::from_utf8_lossy(&r.body[..r.body.len().min(40)])
                    ));
                }
            }
            Got::Reply(r) if r.status == 503 && ran.contains(attempt.as_str()) => {
                return Err(format!("request {owner} got 503 although it executed"));
            }
            // The key has (had) a record of the other body: 422 key-reused.
            Got::Reply(r) if r.status == 422 && problem(r, "key-reused") => {
                let other = generations.iter().any(|g| {
                    w.request_keys.iter().any(|(o, k)| {
                        *k == key
                            && g.attempt.as_deref() == Some(w.attempts[o].as_str())
                            && w.other_body.get(&w.attempts[o]) != w.other_body.get(attempt)
                    })
                });
                if !other && !loss::other_body(w, &w.scope_name(key), attempt) {
                    return Err(format!(
                        "request {owner} got 422 key-reused, but its key had no record of another body"
                    ));
                }
            }
            // After expiry (after_expiry: reject): 422 key-expired.
            Got::Reply(r) if r.status == 422 && problem(r, "key-expired") => {}
            // The store's budget of new keys: each such refusal of the store
            // is judged where it was made ([`rate_limited`]).
            Got::Reply(r) if r.status == 429 && problem(r, "key-rate-limited") => {}
            Got::Reply(r) if ![409, 503].contains(&r.status) => {
                return Err(format!(
                    "request {owner} got {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ));
            }
            Got::Upstream(status, true)
                if !k.release_unknown
                    && !released(*status)
                    && !modes::unprotected(w, k, attempt)
                    && !w.gave_up.contains(attempt)
                    && !w.envoy_lost.contains(attempt)
                    && !loss::settled(w, attempt) =>
            {
                // A known outcome reaches the store, in every mode; under
                // `after_expiry: new` a completion the faults held up until
                // its record expired may find it replaced by a new request.
                let g = generation_of(generations, attempt);
                let replaced = k.after_expiry_new
                    && g.is_some_and(|g| {
                        g.ended_at.is_some()
                            && matches!(
                                g.state,
                                Standing::In(State::Unknown) | Standing::EndedBy(Transition::Reclaimed)
                            )
                    });
                if !replaced && g.map(|g| g.state) != Some(Standing::In(State::Completed)) {
                    return Err(format!(
                        "request {owner} was answered {status} but its record ended {:?}",
                        g.map(|g| g.state.as_str())
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A `429` only where the contract allows one (§4): the claim would take a
/// new key, a new record or a new generation. A replay, a `409` and a `422`
/// are never limited: a claim that meets a record it does not replace is
/// answered as it would be without a budget.
pub fn rate_limited(l: &Limited) -> Result<(), String> {
    let Some(r) = &l.record else {
        return Ok(());
    };
    let key = l.req.scope.key().as_str();
    let now = l.now;
    let refused = |answer: &str| {
        Err(format!(
            "a claim of {key} was refused 429 key-rate-limited at {now}, but it takes no key: its record, \
             generation {} ({}, lease until {}, expires {:?}, archived {}, on_unknown {:?}), answers it {answer}",
            r.generation,
            r.state.as_str(),
            r.lease_until,
            r.expires_at,
            r.archived_at.is_some(),
            r.on_unknown,
        ))
    };
    let expired = r.archived_at.is_some()
        || (matches!(r.state, Standing::In(State::Completed | State::Unknown))
            && r.expires_at.is_some_and(|at| now >= at));
    if expired {
        return match l.req.after_expiry {
            AfterExpiry::New => Ok(()),
            AfterExpiry::Reject => refused("422 key-expired"),
        };
    }
    let offered = l.req.fingerprint.map(|f| f.to_hex());
    if r.fingerprint.is_some() && offered.is_some() && r.fingerprint != offered {
        return refused("422 key-reused");
    }
    let release = l.req.on_unknown == OnUnknown::Release;
    match r.state {
        Standing::In(State::InProgress) if now < r.lease_until => refused("409 request-in-progress"),
        Standing::In(State::InProgress) if !release => {
            refused("409 outcome-unknown (its lease ran out: the claim turns it unknown)")
        }
        Standing::In(State::Completed) => refused("with a replay"),
        Standing::In(State::Unknown) if !release || now < r.lease_until => refused("409"),
        _ => Ok(()),
    }
}
