//! What the audit found, counted per broken promise, and its text for the
//! run's output and the results table.

use std::collections::BTreeMap;

use super::{Faults, DETACHED_LEASE_MS, DETACHED_TIMEOUT_MS, GRPC};

/// What the audit found.
#[derive(Debug, Default)]
pub struct Audit {
    pub requests: usize,
    pub answers: usize,
    pub transport_errors: usize,
    pub scopes: usize,
    pub executions: usize,
    pub replays_checked: usize,
    pub unknown_checked: usize,
    /// Completed records too long to keep their body, re-checked for `409
    /// result-unavailable`.
    pub unavailable_checked: usize,
    pub by_outcome: BTreeMap<String, usize>,
    /// Requests that repeated a key (same or changed body).
    pub duplicates: usize,
    /// Requests that reused a key with another body.
    pub changed_bodies: usize,
    /// Keys sent by more than one tenant.
    pub shared_keys: usize,
    /// Each route's traffic, by policy name.
    pub by_route: BTreeMap<&'static str, RouteTraffic>,
    /// Scenarios that called the gRPC method.
    pub grpc_scenarios: usize,
    /// Of the re-checked records, the gRPC method's: replays and unknown.
    pub grpc_replays_checked: usize,
    pub grpc_unknown_checked: usize,
    /// Executions whose response was at least [`LARGE_RESPONSE`] bytes, and
    /// those of them at least [`HUGE_RESPONSE`].
    pub large_responses: usize,
    pub huge_responses: usize,
    /// Requests to a detached route whose client stopped waiting before the
    /// answer, and how their keys' current records ended.
    pub left_detached: usize,
    pub left_detached_ended: BTreeMap<String, usize>,
    /// Those whose key ended unknown (see [`Audit::judge_left_detached`]).
    pub left_detached_not_completed: Vec<LeftDetached>,
    /// Generations in the store's history of all scopes, and how the ended
    /// ones ended.
    pub generations: usize,
    pub ended: BTreeMap<String, usize>,
    /// Executions the policy allowed after an earlier one of the scope, by
    /// reason (released, unknown or lease run out, expired).
    pub reruns: BTreeMap<&'static str, usize>,
    pub double_executions: Vec<String>,
    pub violations: Vec<String>,
    /// Current generations left unknown or in progress, after the run
    /// settled, whose upstream never ran: keys burnt for their TTL.
    pub burnt_keys: Vec<String>,
    /// When each burnt key's generation was claimed (ms since the epoch).
    pub burnt_at: Vec<i64>,
    /// Burnt keys an Envoy kill or an upstream reset left unknown while their
    /// request was in flight: what the contract prescribes, so counted apart,
    /// not as violations (see [`Audit::excuse`]).
    pub unknown_by_contract: Vec<String>,
    /// Executions inside a generation the store ended as abandoned (the
    /// filter abandons only what it never forwarded).
    pub abandoned_executed: Vec<String>,
    /// When each answer's request was sent, and whether it was a `503
    /// store-unavailable`.
    pub answered_at: Vec<(i64, bool)>,
}

/// A detached request whose client stopped waiting, and whose key ended
/// unknown rather than completed.
#[derive(Debug, Clone)]
pub struct LeftDetached {
    /// The key, its generation, events, executions and requests.
    pub what: String,
    /// When its generation was claimed (ms since the epoch).
    pub claimed_at: i64,
    /// The upstream's delay (`x-test-delay-ms`).
    pub delay_ms: i64,
    /// How long after the claim its upstream call arrived (`None`: never).
    pub arrived_after_ms: Option<i64>,
    /// The upstream reset it or answered `uncertain` on purpose.
    pub upstream_reset: bool,
    /// The sweeper ended its lease (rather than the filter marking it).
    pub lease_ran_out: bool,
}

/// One route's share of the traffic.
#[derive(Debug, Default)]
pub struct RouteTraffic {
    pub requests: usize,
    pub scopes: usize,
    pub executions: usize,
    /// Executions whose response was at least [`LARGE_RESPONSE`] bytes.
    pub large_responses: usize,
    /// Answers by outcome (a problem's type, `replayed`, a status, or `no
    /// answer`).
    pub outcomes: BTreeMap<String, usize>,
}

/// A response this long counts as large (near the 512 KiB `max_stored_body`
/// or above it).
pub const LARGE_RESPONSE: usize = 400 * 1024;
/// ... and this long as near the 4 MiB the store keeps at most.
pub const HUGE_RESPONSE: usize = 4_000_000;

/// The share of `503 store-unavailable` answers allowed outside the fault
/// windows: a healthy store answers in time.
pub const MAX_UNAVAILABLE_SHARE: f64 = 0.01;
/// How long after a fault window the store may still be catching up (the
/// filter's store timeout, a restart, a health check).
const RECOVERY_MS: i64 = 3_000;
/// How long before a fault window a request may have been sent and still
/// meet it: the filter's store timeout (1 s) plus the longest claim wait of
/// `envoy/chaos.yaml` (2 s).
const IN_FLIGHT_MS: i64 = 3_000;

impl Audit {
    /// Moves the burnt keys that `cause` explains (a fault after which the
    /// contract leaves the record unknown) out of the violations.
    pub fn excuse(&mut self, cause: impl Fn(i64) -> Option<&'static str>) {
        let burnt = std::mem::take(&mut self.burnt_keys);
        let at = std::mem::take(&mut self.burnt_at);
        for (key, at) in burnt.into_iter().zip(at) {
            match cause(at) {
                Some(fault) => self
                    .unknown_by_contract
                    .push(format!("{key} (in flight at a {fault})")),
                None => {
                    self.burnt_keys.push(key);
                    self.burnt_at.push(at);
                }
            }
        }
    }

    /// A detached request whose client left is carried on until its
    /// upstream answers and recorded (contract §5): its key ends completed.
    /// It may end unknown only if its upstream never ran (a burnt key,
    /// judged apart), reset or answered `uncertain`, ran into the forwarding
    /// timeout (its arrival after the claim plus its delay reach the
    /// timeout, less 100 ms: the call starts after the claim), or a fault
    /// that loses the answer came while it was in flight: the upstream's
    /// connections reset or Envoy killed; or its lease ran out while the
    /// store was down or frozen, so the completion could not land in time.
    /// Any other is a violation; returns the excused ones, with why.
    pub fn judge_left_detached(&mut self, faults: &Faults) -> Vec<String> {
        let mut excused = Vec::new();
        for l in &self.left_detached_not_completed {
            let during = |names: &[&str]| {
                faults.windows.iter().find(|(name, from, to)| {
                    names.contains(name) && *to >= l.claimed_at && *from <= l.claimed_at + DETACHED_LEASE_MS
                })
            };
            let why = if l.arrived_after_ms.is_none() {
                Some("its upstream never ran".to_string())
            } else if l.upstream_reset {
                Some("its upstream reset on purpose".to_string())
            } else if l.arrived_after_ms.unwrap_or(0) + l.delay_ms + 100 >= DETACHED_TIMEOUT_MS {
                Some(format!(
                    "its upstream arrived {} ms after the claim and took {} ms, against the {DETACHED_TIMEOUT_MS} ms timeout",
                    l.arrived_after_ms.unwrap_or(0),
                    l.delay_ms
                ))
            } else if let Some((name, from, _)) = during(&["upstream reset", "Envoy SIGKILL"]) {
                Some(format!("a {name} {} ms after the claim", from - l.claimed_at))
            } else if let Some((name, from, _)) =
                during(&["store SIGKILL", "store stall"]).filter(|_| l.lease_ran_out)
            {
                Some(format!(
                    "a {name} {} ms after the claim, and the lease ran out",
                    from - l.claimed_at
                ))
            } else {
                None
            };
            let near: Vec<String> = faults
                .windows
                .iter()
                .filter(|(_, from, to)| {
                    *to >= l.claimed_at - 1_000 && *from <= l.claimed_at + DETACHED_LEASE_MS
                })
                .map(|(name, from, to)| format!("{name} at +{} ms for {} ms", from - l.claimed_at, to - from))
                .collect();
            match why {
                Some(why) => excused.push(format!("{} — {why} (faults: {})", l.what, near.join(", "))),
                None => self.violations.push(format!(
                    "{}: a detached request whose client left ended unknown with no fault to lose it (faults: {})",
                    l.what,
                    near.join(", ")
                )),
            }
        }
        excused
    }

    /// A healthy store answers in time: outside the fault `windows` (name,
    /// from, to; ms since the epoch), at most [`MAX_UNAVAILABLE_SHARE`] of the
    /// answers may be `503 store-unavailable`.
    pub fn bound_unavailable(&mut self, windows: &[(&'static str, i64, i64)]) {
        let outside: Vec<bool> = self
            .answered_at
            .iter()
            .filter(|(at, _)| {
                !windows
                    .iter()
                    .any(|(_, from, to)| *at >= from - IN_FLIGHT_MS && *at <= to + RECOVERY_MS)
            })
            .map(|(_, unavailable)| *unavailable)
            .collect();
        let unavailable = outside.iter().filter(|u| **u).count();
        if outside.is_empty() || unavailable as f64 <= outside.len() as f64 * MAX_UNAVAILABLE_SHARE {
            return;
        }
        // How far each one was from the nearest fault, to tell a slow
        // recovery from trouble with no fault near.
        let after: Vec<String> = self
            .answered_at
            .iter()
            .filter(|(_, u)| *u)
            .filter_map(|(at, _)| {
                let (name, _, to) = windows
                    .iter()
                    .filter(|(_, from, _)| from <= at)
                    .max_by_key(|(_, from, _)| *from)?;
                (at - to > RECOVERY_MS).then(|| format!("{} ms after a {name}", at - to))
            })
            .collect();
        self.violations.push(format!(
            "{unavailable} of {} answers outside fault windows were 503 store-unavailable (at most {:.0} % allowed): {after:?}",
            outside.len(),
            MAX_UNAVAILABLE_SHARE * 100.0
        ));
    }

    pub fn total_violations(&self) -> usize {
        self.double_executions.len()
            + self.violations.len()
            + self.burnt_keys.len()
            + self.abandoned_executed.len()
    }

    /// The hostile part of the traffic, for the results table.
    pub fn hostile(&self) -> String {
        let mut s = format!(
            "{} duplicate requests, {} with a changed body, {} keys sent by two tenants",
            self.duplicates, self.changed_bodies, self.shared_keys
        );
        if self.large_responses > 0 || self.left_detached > 0 {
            s.push_str(&format!(
                ", {} responses of 400 KiB–4.5 MiB ({} of them ≥ 4 MB), {} clients that left a detached request",
                self.large_responses, self.huge_responses, self.left_detached
            ));
        }
        if self.grpc_scenarios > 0 {
            let t = self.by_route.get(GRPC.name);
            s.push_str(&format!(
                ", {} gRPC scenarios ({} calls, {} executions)",
                self.grpc_scenarios,
                t.map_or(0, |t| t.requests),
                t.map_or(0, |t| t.executions)
            ));
        }
        s
    }

    /// The gRPC method's share: scenarios, calls, keys, executions and
    /// answers by outcome (`replayed`, a problem, `grpc-status n`).
    pub fn grpc(&self) -> String {
        let t = self.by_route.get(GRPC.name);
        format!(
            "gRPC {} ({}): {} scenarios, {} calls, {} scopes, {} executions, {} replays and {} unknown records re-checked; answers {:?}",
            GRPC.name,
            GRPC.path,
            self.grpc_scenarios,
            t.map_or(0, |t| t.requests),
            t.map_or(0, |t| t.scopes),
            t.map_or(0, |t| t.executions),
            self.grpc_replays_checked,
            self.grpc_unknown_checked,
            t.map(|t| &t.outcomes).cloned().unwrap_or_default()
        )
    }

    /// One line per route: its requests, scopes, executions, large
    /// responses and answers by outcome.
    pub fn routes(&self) -> Vec<String> {
        self.by_route
            .iter()
            .map(|(name, t)| {
                format!(
                    "{name}: {} requests, {} scopes, {} executions ({} large responses); answers {:?}",
                    t.requests, t.scopes, t.executions, t.large_responses, t.outcomes
                )
            })
            .collect()
    }

    /// The verdict column of the results table.
    pub fn verdict(&self) -> String {
        format!(
            "{} double executions, {} contract violations, {} burnt keys, {} executions of abandoned claims \
             ({} replays, {} unknown and {} result-unavailable records re-checked; {} generations, re-run after {}; \
             {} left unknown by an Envoy kill or upstream reset in flight)",
            self.double_executions.len(),
            self.violations.len(),
            self.burnt_keys.len(),
            self.abandoned_executed.len(),
            self.replays_checked,
            self.unknown_checked,
            self.unavailable_checked,
            self.generations,
            self.reruns_text(),
            self.unknown_by_contract.len()
        )
    }

    fn reruns_text(&self) -> String {
        let n = |k: &str| self.reruns.get(k).copied().unwrap_or(0);
        format!(
            "release {}, unknown or lease run-out {}, expiry {}",
            n("released"),
            n("unknown"),
            n("expired")
        )
    }

    /// The load a run's row names: `traffic` long, `workers` clients, through
    /// `setup`, and what they sent and the upstream executed in the
    /// `elapsed` seconds the traffic really took.
    pub fn load(&self, traffic: std::time::Duration, workers: u64, setup: &str, elapsed: f64) -> String {
        format!(
            "{} s, {workers} clients, {setup}: {} requests ({:.0}/s), {} upstream executions",
            traffic.as_secs(),
            self.requests,
            self.requests as f64 / elapsed,
            self.executions
        )
    }

    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} requests ({} answered, {} transport errors), {} scopes, {} executions, \
             {} replays, {} unknown and {} result-unavailable records re-checked; outcomes {:?}; \
             {} generations, ended {:?}, re-run after {}; \
             {} double executions, {} contract violations, {} burnt keys, {} executions of abandoned claims",
            self.requests,
            self.answers,
            self.transport_errors,
            self.scopes,
            self.executions,
            self.replays_checked,
            self.unknown_checked,
            self.unavailable_checked,
            self.by_outcome,
            self.generations,
            self.ended,
            self.reruns_text(),
            self.double_executions.len(),
            self.violations.len(),
            self.burnt_keys.len(),
            self.abandoned_executed.len(),
        );
        for v in self
            .double_executions
            .iter()
            .chain(&self.abandoned_executed)
            .chain(&self.burnt_keys)
            .chain(&self.violations)
            .take(30)
        {
            s.push_str("\n  - ");
            s.push_str(v);
        }
        s
    }
}
