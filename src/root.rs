//! The root context: configuration and metrics, shared by every request on
//! this worker's VM.

use std::rc::Rc;

use idemgate_core::config::Config;
use idemgate_core::exchange::{Outcome, Settlement};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::host;
use crate::http::Filter;

/// Counter ids per outcome and settlement (`None` when Envoy refused one).
#[derive(Default)]
pub struct Metrics {
    outcomes: Vec<(Outcome, Option<u32>)>,
    settlements: Vec<(Settlement, Option<u32>)>,
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
}

#[derive(Default)]
pub struct Root {
    config: Option<Rc<Config>>,
    metrics: Rc<Metrics>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        match Config::parse(&bytes) {
            Ok(config) => {
                self.config = Some(Rc::new(config));
                self.metrics = Rc::new(Metrics::define());
                true
            }
            Err(e) => {
                host::log(LogLevel::Error, &format!("{e}"));
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy creates no request contexts for a rejected configuration; an
        // unconfigured filter passes everything rather than panic in the SDK.
        Some(Box::new(Filter::new(self.config.clone(), self.metrics.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
