//! The root context: configuration, metrics, and the store calls that must
//! outlive their request, shared by every request on this worker's VM.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::config::Config;
use idemgate_core::exchange::{refusal, settled, Outcome, Settlement, StoreCall};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::host;
use crate::http::Filter;

/// How often the root sends the calls requests left behind.
const TICK: Duration = Duration::from_millis(100);

/// Counter ids per outcome and settlement (`None` when Envoy refused one).
#[derive(Default)]
pub struct Metrics {
    outcomes: Vec<(Outcome, Option<u32>)>,
    settlements: Vec<(Settlement, Option<u32>)>,
    config_errors: Option<u32>,
}

impl Metrics {
    fn define() -> Metrics {
        Metrics {
            outcomes: Outcome::ALL
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

    pub fn count(&self, outcome: Outcome, settlement: Option<Settlement>) {
        if let Some((_, id)) = self.outcomes.iter().find(|(o, _)| *o == outcome) {
            host::increment(*id);
        }
        if let Some((_, id)) = self.settlements.iter().find(|(s, _)| Some(*s) == settlement) {
            host::increment(*id);
        }
    }

    fn count_settlement(&self, settlement: Settlement) {
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

/// What the root shares with every request context.
#[derive(Default)]
pub struct Shared {
    pub metrics: Metrics,
    /// Mark-unknown calls of requests that ended (`on_log`) before their
    /// outcome was recorded. Sent from the root so that the store's answer
    /// arrives while someone is still there to count it.
    pub orphans: RefCell<Vec<StoreCall>>,
}

#[derive(Default)]
pub struct Root {
    config: Option<Rc<Config>>,
    shared: Rc<Shared>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let answer = host::store_answer(num_headers, body_size);
        let metrics = &self.shared.metrics;
        if settled(&answer) {
            metrics.count_settlement(Settlement::MarkedUnknown);
        } else {
            if let Some((status, detail)) = refusal(&answer) {
                metrics.config_error(status, &detail);
            }
            host::log(
                LogLevel::Warn,
                "the store did not confirm an unknown outcome; its lease will turn the record unknown",
            );
            metrics.count_settlement(Settlement::Failed);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        match Config::parse(&bytes) {
            Ok(config) => {
                self.config = Some(Rc::new(config));
                self.shared = Rc::new(Shared {
                    metrics: Metrics::define(),
                    orphans: RefCell::default(),
                });
                host::set_tick_period(TICK);
                true
            }
            Err(e) => {
                host::log(LogLevel::Error, &format!("{e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(config) = self.config.clone() else {
            return;
        };
        let calls = std::mem::take(&mut *self.shared.orphans.borrow_mut());
        for call in calls {
            match host::dispatch(&config.store, &call) {
                Some(_) => {}
                None => {
                    host::log(
                        LogLevel::Warn,
                        "could not report an unknown outcome; its lease will expire it",
                    );
                    self.shared.metrics.count_settlement(Settlement::Failed);
                }
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy creates no request contexts for a rejected configuration; an
        // unconfigured filter passes everything rather than panic in the SDK.
        Some(Box::new(Filter::new(self.config.clone(), self.shared.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
