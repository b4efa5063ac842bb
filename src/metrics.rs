//! The filter's counters, by handling and by settlement, as Envoy stats.

use idemgate_core::exchange::{Handling, Settlement};
use proxy_wasm::types::LogLevel;

use crate::host;

/// Counter ids per handling and settlement (`None` when Envoy refused one).
#[derive(Default)]
pub struct Metrics {
    handlings: Vec<(Handling, Option<u32>)>,
    settlements: Vec<(Settlement, Option<u32>)>,
    config_errors: Option<u32>,
}

impl Metrics {
    pub fn define() -> Metrics {
        Metrics {
            handlings: Handling::ALL
                .iter()
                .map(|o| (*o, host::counter(&format!("idemgate.requests.{}", o.as_str()))))
                .collect(),
            settlements: Settlement::ALL
                .iter()
                .map(|s| (*s, host::counter(&format!("idemgate.records.{}", s.as_str()))))
                .collect(),
            config_errors: host::counter("idemgate.config_errors"),
        }
    }

    pub fn count(&self, handling: Handling, settlement: Option<Settlement>) {
        if let Some((_, id)) = self.handlings.iter().find(|(h, _)| *h == handling) {
            host::increment(*id);
        }
        if let Some(settlement) = settlement {
            self.count_settlement(settlement);
        }
    }

    pub fn count_settlement(&self, settlement: Settlement) {
        if let Some((_, id)) = self.settlements.iter().find(|(s, _)| *s == settlement) {
            host::increment(*id);
        }
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
