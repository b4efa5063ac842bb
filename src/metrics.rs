//! The filter's counters as Envoy stats, labelled by outcome and policy.
//!
//! A proxy-wasm counter is a bare name, so each name carries its labels:
//! `idemgate.requests.outcome.<handling>.policy.<policy>` and
//! `idemgate.records.outcome.<settlement>.policy.<policy>`. The bootstrap's
//! `stats_config.stats_tags` (see `envoy/e2e.yaml`) cut the labels out of the
//! name, so that `/stats/prometheus` shows
//! `idemgate_requests{outcome="owned",policy="payments.create"}`. The policy
//! comes last because its name may hold dots.
//!
//! Every counter of every policy is defined with the configuration, so each
//! series exists (at 0) before its first request: rates and ratios over them
//! then return data from the start.

use idemgate_core::config::Config;
use idemgate_core::exchange::{Handling, Settlement};
use proxy_wasm::types::LogLevel;

use crate::host;

/// One policy's counter ids, in the order of `Handling::ALL` and
/// `Settlement::ALL` (`None` where Envoy refused one).
struct PolicyCounters {
    policy: String,
    handlings: Vec<Option<u32>>,
    settlements: Vec<Option<u32>>,
}

#[derive(Default)]
pub struct Metrics {
    policies: Vec<PolicyCounters>,
    config_errors: Option<u32>,
    store_queue_full: Option<u32>,
}

/// The stat name of one request counter.
pub fn request_stat(handling: Handling, policy: &str) -> String {
    format!("idemgate.requests.outcome.{}.policy.{policy}", handling.as_str())
}

/// The stat name of one record counter.
pub fn record_stat(settlement: Settlement, policy: &str) -> String {
    format!("idemgate.records.outcome.{}.policy.{policy}", settlement.as_str())
}

impl Metrics {
    pub fn define(config: &Config) -> Metrics {
        let policies = config
            .policies()
            .iter()
            .map(|p| PolicyCounters {
                policy: p.name().to_string(),
                handlings: Handling::ALL
                    .iter()
                    .map(|h| host::counter(&request_stat(*h, p.name())))
                    .collect(),
                settlements: Settlement::ALL
                    .iter()
                    .map(|s| host::counter(&record_stat(*s, p.name())))
                    .collect(),
            })
            .collect();
        Metrics {
            policies,
            config_errors: host::counter("idemgate.config_errors"),
            store_queue_full: host::counter("idemgate.store_queue_full"),
        }
    }

    fn of(&self, policy: &str) -> Option<&PolicyCounters> {
        self.policies.iter().find(|p| p.policy == policy)
    }

    pub fn count(&self, policy: &str, handling: Handling, settlement: Option<Settlement>) {
        let i = Handling::ALL.iter().position(|h| *h == handling);
        if let (Some(counters), Some(i)) = (self.of(policy), i) {
            host::increment(counters.handlings.get(i).copied().flatten());
        }
        if let Some(settlement) = settlement {
            self.count_settlement(policy, settlement);
        }
    }

    pub fn count_settlement(&self, policy: &str, settlement: Settlement) {
        let i = Settlement::ALL.iter().position(|s| *s == settlement);
        if let (Some(counters), Some(i)) = (self.of(policy), i) {
            host::increment(counters.settlements.get(i).copied().flatten());
        }
    }

    /// A store call found the worker's queue full and was failed closed
    /// (`503` with `Retry-After`): the store is slower than the traffic.
    pub fn store_queue_full(&self) {
        host::increment(self.store_queue_full);
    }

    /// The store refused a frame (4xx): filter and store disagree on a limit
    /// or the credential. Logged and counted apart from outages.
    pub fn config_error(&self, status: u16, detail: &str) {
        host::log(
            LogLevel::Error,
            &format!("the store refused a call with {status} ({detail}); check that the filter's configuration and the store agree on limits and the API token"),
        );
        host::increment(self.config_errors);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_name_carries_its_outcome_and_then_its_policy() {
        assert_eq!(
            request_stat(Handling::Owned, "payments.create"),
            "idemgate.requests.outcome.owned.policy.payments.create"
        );
        assert_eq!(
            record_stat(Settlement::Failed, "p"),
            "idemgate.records.outcome.settle_failed.policy.p"
        );
    }
}
