//! The exchange, the worker's store client and the store's rules, simulated
//! together: many requests on one Envoy worker against the store in memory,
//! over a network that loses, delays and refuses, with clients that leave at
//! any moment and an upstream that is slow or cut off. Deterministic: a seed
//! and a policy make a scenario, and a scenario always runs the same way.
//! After each scenario the audit checks the contract's promises.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod store;
mod world;

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use idemgate_core::record::State;
use store::Ended;
use world::{Faults, Got, Scenario, World};

/// splitmix64: a seeded stream of chances.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// In `lo..hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo).max(1) as u64) as i64
    }
    /// In `0.0..1.0`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A policy the simulation runs: each knob one of the contract's choices.
#[derive(Debug, Clone)]
struct Knobs {
    detached: bool,
    background: bool,
    wait: bool,
    release_unknown: bool,
    large: bool,
}

impl Knobs {
    fn config(&self) -> String {
        let forwarding = if self.detached {
            r#", "forwarding": {"mode": "detached", "timeout_ms": 1000}"#
        } else {
            ""
        };
        format!(
            r#"{{"store": {{"cluster": "store", "token": "t", "timeout_ms": 200}},
              "policies": [{{"name": "pay", "match": {{"path": {{"prefix": "/pay"}}}}, "anonymous": true,
                "lease_seconds": 2, "settle": "{settle}", {in_flight},
                "on_unknown": "{on_unknown}", "max_stored_body": {max_stored}{forwarding}}}]}}"#,
            settle = if self.background {
                "background"
            } else {
                "before_response"
            },
            in_flight = if self.wait {
                r#""in_flight": "wait", "wait_max_ms": 300"#
            } else {
                r#""in_flight": "conflict""#
            },
            on_unknown = if self.release_unknown {
                "release"
            } else {
                "conflict"
            },
            max_stored = if self.large { 4 * 1024 * 1024 } else { 64 },
        )
    }
}

fn knobs() -> impl Strategy<Value = Knobs> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(detached, background, wait, release_unknown, large)| Knobs {
            detached,
            background,
            wait,
            release_unknown,
            large,
        })
}

fn faults() -> impl Strategy<Value = Faults> {
    let p = || prop_oneof![Just(0.0), 0.0..0.3f64];
    (p(), p(), p(), p(), 0.0..0.6f64, p()).prop_map(
        |(lose_request, lose_answer, unavailable, slow_store, client_leaves, upstream_lost)| Faults {
            lose_request,
            lose_answer,
            unavailable,
            slow_store,
            client_leaves,
            upstream_lost,
        },
    )
}

/// The contract's promises, checked on what happened.
fn audit(w: &World, k: &Knobs) -> Result<(), String> {
    let released = |s: u16| idemgate_core::config::DEFAULT_RELEASE_STATUSES.contains(&s);
    let mut by_key: HashMap<usize, Vec<&world::Exec>> = HashMap::new();
    for e in &w.execs {
        by_key.entry(e.key).or_default().push(e);
    }
    for (key, execs) in &by_key {
        if k.release_unknown {
            // An unknown outcome may be run again, but never while it runs.
            let mut spans: Vec<(i64, i64)> = execs.iter().map(|e| (e.start, e.end)).collect();
            spans.sort();
            if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
                return Err(format!("key {key} executed twice at once: {w:?}"));
            }
        } else {
            let acting = execs.iter().filter(|e| !released(e.status)).count();
            if acting > 1 {
                return Err(format!("key {key} executed {acting} times"));
            }
        }
    }
    let ran: HashSet<&str> = w.execs.iter().map(|e| e.attempt.as_str()).collect();
    // A generation may be unknown for a while (its lease ran out before the
    // abandon arrived); it may be left unknown only if the upstream may have run.
    for (fence, (_, attempt, ended)) in &w.store.generations {
        if *ended == Ended::Open(State::Unknown) && !ran.contains(attempt.as_str()) {
            return Err(format!("generation {fence} ({attempt}) left unknown although nothing ran"));
        }
    }
    for (owner, got) in &w.got {
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
        match relayed.as_ref().unwrap_or(got) {
            Got::Reply(r) if r.headers.iter().any(|(n, _)| n == "idempotent-replayed") => {
                let stored = by_key
                    .get(&key)
                    .is_some_and(|es| es.iter().any(|e| e.status == r.status && e.body == r.body));
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
            Got::Reply(r) if ![409, 503].contains(&r.status) => {
                return Err(format!(
                    "request {owner} got {} {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                ));
            }
            Got::Upstream(status, true) if !k.release_unknown && !released(*status) => {
                // A known outcome reaches the store, in every mode.
                let gen = w.store.generations.values().find(|(_, a, _)| a == attempt);
                if !matches!(
                    gen,
                    Some((_, _, Ended::Open(State::Completed)))
                ) {
                    return Err(format!(
                        "request {owner} was answered {status} but its record ended {:?}",
                        gen.map(|g| g.2)
                    ));
                }
            }
            _ => {}
        }
    }
    if !w.quiet() {
        return Err("calls were left undelivered".into());
    }
    Ok(())
}

fn run(seed: u64, k: &Knobs, faults: Faults) -> (World, Result<(), String>) {
    let scenario = Scenario {
        config: k.config(),
        keys: 3,
        requests: 10,
        body_max: if k.large { 4 * 1024 * 1024 } else { 48 },
        faults,
    };
    let mut w = World::new(scenario, seed);
    w.run();
    let verdict = audit(&w, k);
    (w, verdict)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_scenario_keeps_the_contract(seed in any::<u64>(), k in knobs(), faults in faults()) {
        let (_, verdict) = run(seed, &k, faults);
        prop_assert!(verdict.is_ok(), "{}", verdict.unwrap_err());
    }
}
