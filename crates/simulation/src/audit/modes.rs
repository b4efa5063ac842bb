//! What the filter forwards, by the policy's mode (§4, §8): in `enforce`
//! mode only what the store gave the key; with `failure_mode: open` also
//! what the store could not decide, unprotected; in `observe` mode (a
//! policy's, or a canary's other side) every request, answered by the
//! upstream only. A request the store told that the key is not its own is
//! never forwarded but where it is observed.

use crate::scenario::Knobs;
use crate::world::{Got, World};

/// Whether `attempt` ran unprotected, as the mode allows: forwarded without
/// the filter having read that the key was its own.
pub fn unprotected(w: &World, k: &Knobs, attempt: &str) -> bool {
    (w.observed.contains(attempt) || k.fail_open) && !w.told_theirs.contains(attempt)
}

/// Every execution was forwarded as the mode allows.
pub fn forwarded(w: &World, k: &Knobs) -> Result<(), String> {
    for e in w.execs.iter().filter(|e| !w.observed.contains(&e.attempt)) {
        if w.told_not_theirs.contains(&e.attempt) {
            return Err(format!(
                "{} was told the key is not its own, but it ran at {} ms",
                e.attempt, e.start
            ));
        }
        if !k.fail_open && !w.told_theirs.contains(&e.attempt) {
            return Err(format!(
                "{} ran at {} ms, but the store never gave it the key",
                e.attempt, e.start
            ));
        }
    }
    Ok(())
}

/// No client observed is answered by the filter.
pub fn observed(w: &World) -> Result<(), String> {
    let mut owners: Vec<_> = w.got.iter().collect();
    owners.sort_by_key(|(o, _)| **o);
    for (owner, got) in owners {
        let attempt = &w.attempts[owner];
        if !w.observed.contains(attempt) {
            continue;
        }
        if let Got::Reply(r) = got {
            // Under detached forwarding the filter relays the upstream's answer.
            let relayed = w
                .execs
                .iter()
                .any(|e| &e.attempt == attempt && e.status == r.status && e.body == r.body);
            if !relayed {
                return Err(format!(
                    "request {owner}, observed, was answered {} {} by the filter",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ));
            }
        }
    }
    Ok(())
}
