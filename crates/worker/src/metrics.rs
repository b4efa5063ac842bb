//! The filter's counters as Envoy stats, labelled by outcome and policy.
//!
//! A proxy-wasm counter is a bare name, so each name carries its labels:
//! `idemgate.requests_total.outcome.<handling>.policy.<policy>` (observe mode's
//! `would_conflict` and `would_reject` with `.reason.<answer>` before the
//! policy) and `idemgate.records_total.outcome.<settlement>.policy.<policy>`. The bootstrap's
//! `stats_config.stats_tags` (see `envoy/e2e.yaml`) cut the labels out of the
//! name, so that `/stats/prometheus` shows
//! `idemgate_requests_total{outcome="owned",policy="payments.create"}`. The policy
//! comes last because its name may hold dots.
//!
//! Every counter of every policy is defined with the configuration, so each
//! series exists (at 0) before its first request: rates and ratios over them
//! then return data from the start.
//!
//! Two info gauges say what runs: `idemgate.build_info.version.<version>`
//! (1) and `idemgate.policy_info.mode.<rollout>.policy.<policy>`, 1 for the
//! policy's rollout and 0 for the others. Each configuration sets them all,
//! so a push that flips a policy's mode flips its series at once; a policy
//! that no configuration of the VM names any more (a push removed or renamed
//! it) reads 0 in every mode once the last one that named it is let go.
//! When the VM lets its last configuration go, it is being replaced (a new
//! module or `vm_id`) or the filter removed: it zeroes nothing then, since
//! the gauges are Envoy's, shared by every VM, and the VM that replaces it
//! has set them for the policies it runs.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use idemgate_core::config::{Config, ROLLOUTS};
use idemgate_core::handling::{Handling, Settlement};

use crate::host::{Host, Level};

/// One policy's counter ids, in the order of `Handling::ALL`,
/// `Handling::REASONS` and `Settlement::ALL` (`None` where Envoy refused
/// one, and for the outcomes only counted by reason).
struct PolicyCounters {
    policy: String,
    handlings: Vec<Option<u32>>,
    reasons: Vec<Option<u32>>,
    settlements: Vec<Option<u32>>,
}

pub struct Metrics<H: Host> {
    host: H,
    policies: Vec<PolicyCounters>,
    config_errors: Option<u32>,
    store_queue_full: Option<u32>,
    store_call_us: Option<u32>,
}

/// The histogram of the worker's store callouts, from sending to the
/// answer (or its end), in microseconds: Envoy's own `upstream_rq_time`
/// counts whole milliseconds, and most callouts take less than one. Like
/// Envoy's histograms its name carries no unit (Prometheus's lint refuses
/// an abbreviated one, and a base one, seconds, would round to 0).
pub const STORE_CALL_STAT: &str = "idemgate.store_call_time";

/// The stat name of one request counter.
pub fn request_stat(handling: Handling, policy: &str) -> String {
    format!(
        "idemgate.requests_total.outcome.{}.policy.{policy}",
        handling.as_str()
    )
}

/// The stat name of observe mode's counter of the requests enforce mode
/// would have answered with `reason`.
pub fn reason_stat(reason: Handling, policy: &str) -> String {
    format!(
        "idemgate.requests_total.outcome.{}.reason.{}.policy.{policy}",
        reason.observed().as_str(),
        reason.as_str()
    )
}

/// Counted by reason only.
fn by_reason(handling: Handling) -> bool {
    Handling::REASONS.iter().any(|r| r.observed() == handling)
}

/// The stat name of a policy's info gauge for `rollout`.
pub fn policy_info_stat(rollout: &str, policy: &str) -> String {
    format!("idemgate.policy_info.mode.{rollout}.policy.{policy}")
}

thread_local! {
    /// How many live configurations of this VM name each policy.
    static NAMED: RefCell<HashMap<String, usize>> = RefCell::new(HashMap::new());
    /// How many configurations of this VM are live.
    static LIVE: Cell<usize> = const { Cell::new(0) };
}

/// Sets the info gauges for `config`, and counts its policies as named.
fn inform(host: &impl Host, config: &Config) {
    host.set_gauge(
        &format!("idemgate.build_info.version.{}", env!("CARGO_PKG_VERSION")),
        1,
    );
    NAMED.with_borrow_mut(|named| {
        for policy in config.policies() {
            for rollout in ROLLOUTS {
                let on = rollout == policy.rollout();
                host.set_gauge(&policy_info_stat(rollout, policy.name()), u64::from(on));
            }
            *named.entry(policy.name().to_string()).or_default() += 1;
        }
    });
    LIVE.set(LIVE.get() + 1);
}

/// A configuration is let go: a policy no live configuration names any
/// more reads 0 in every mode, unless it was the VM's last.
fn retire(host: &impl Host, policies: &[PolicyCounters]) {
    let live = LIVE.get().saturating_sub(1);
    LIVE.set(live);
    NAMED.with_borrow_mut(|named| {
        for p in policies {
            let Some(n) = named.get_mut(&p.policy) else {
                continue;
            };
            *n = n.saturating_sub(1);
            if *n == 0 {
                named.remove(&p.policy);
                if live > 0 {
                    for rollout in ROLLOUTS {
                        host.set_gauge(&policy_info_stat(rollout, &p.policy), 0);
                    }
                }
            }
        }
    });
}

/// The stat name of one record counter.
pub fn record_stat(settlement: Settlement, policy: &str) -> String {
    format!(
        "idemgate.records_total.outcome.{}.policy.{policy}",
        settlement.as_str()
    )
}

impl<H: Host> Drop for Metrics<H> {
    fn drop(&mut self) {
        retire(&self.host, &self.policies);
    }
}

impl<H: Host> Metrics<H> {
    pub fn define(host: H, config: &Config) -> Metrics<H> {
        inform(&host, config);
        let policies = config
            .policies()
            .iter()
            .map(|p| PolicyCounters {
                policy: p.name().to_string(),
                handlings: Handling::ALL
                    .iter()
                    .map(|h| match by_reason(*h) {
                        true => None,
                        false => host.counter(&request_stat(*h, p.name())),
                    })
                    .collect(),
                reasons: Handling::REASONS
                    .iter()
                    .map(|r| host.counter(&reason_stat(*r, p.name())))
                    .collect(),
                settlements: Settlement::ALL
                    .iter()
                    .map(|s| host.counter(&record_stat(*s, p.name())))
                    .collect(),
            })
            .collect();
        Metrics {
            policies,
            config_errors: host.counter("idemgate.config_errors_total"),
            store_queue_full: host.counter("idemgate.store_queue_full_total"),
            store_call_us: host.histogram(STORE_CALL_STAT),
            host,
        }
    }

    fn of(&self, policy: &str) -> Option<&PolicyCounters> {
        self.policies.iter().find(|p| p.policy == policy)
    }

    /// Counts a request as `handling` (observe mode's, with the `reason`
    /// enforce mode would have answered).
    pub fn count(
        &self,
        policy: &str,
        (handling, reason): (Handling, Option<Handling>),
        settlement: Option<Settlement>,
    ) {
        if let Some(counters) = self.of(policy) {
            let id = match reason {
                Some(reason) => Handling::REASONS
                    .iter()
                    .position(|r| *r == reason)
                    .and_then(|i| counters.reasons.get(i)),
                None => Handling::ALL
                    .iter()
                    .position(|h| *h == handling)
                    .and_then(|i| counters.handlings.get(i)),
            };
            self.host.increment(id.copied().flatten());
        }
        if let Some(settlement) = settlement {
            self.count_settlement(policy, settlement);
        }
    }

    pub fn count_settlement(&self, policy: &str, settlement: Settlement) {
        let i = Settlement::ALL.iter().position(|s| *s == settlement);
        if let (Some(counters), Some(i)) = (self.of(policy), i) {
            self.host
                .increment(counters.settlements.get(i).copied().flatten());
        }
    }

    /// A store callout took `us` microseconds.
    pub fn store_call(&self, us: u64) {
        self.host.record(self.store_call_us, us);
    }

    /// A store call found the worker's queue full and was failed closed
    /// (`503` with `Retry-After`): the store is slower than the traffic.
    pub fn store_queue_full(&self) {
        self.host.increment(self.store_queue_full);
    }

    /// The store refused a frame (4xx): filter and store disagree on a limit
    /// or the credential. Logged and counted apart from outages.
    pub fn config_error(&self, status: u16, detail: &str) {
        self.host.log(
            Level::Error,
            &format!("the store refused a call with {status} ({detail}); check that the filter's configuration and the store agree on limits and the API token"),
        );
        self.host.increment(self.config_errors);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_name_carries_its_outcome_and_then_its_policy() {
        assert_eq!(
            request_stat(Handling::Owned, "payments.create"),
            "idemgate.requests_total.outcome.owned.policy.payments.create"
        );
        assert_eq!(
            reason_stat(Handling::Mismatch, "payments.create"),
            "idemgate.requests_total.outcome.would_reject.reason.mismatch.policy.payments.create"
        );
        assert_eq!(
            record_stat(Settlement::Failed, "p"),
            "idemgate.records_total.outcome.settle_failed.policy.p"
        );
        assert_eq!(
            policy_info_stat("canary", "payments.create"),
            "idemgate.policy_info.mode.canary.policy.payments.create"
        );
    }
}
