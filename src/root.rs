//! The root context: configuration, metrics, and the store client for calls
//! that must outlive their request, shared by every request on this worker's VM.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use idemgate_core::config::Config;
use idemgate_core::exchange::{refusal, settled, Handling, Settlement};
use idemgate_core::protocol::Attempt;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::carrier::Carrier;
use crate::host;
use crate::http::Filter;
use crate::outbox::Outbox;

/// Counter ids per handling and settlement (`None` when Envoy refused one).
#[derive(Default)]
pub struct Metrics {
    handlings: Vec<(Handling, Option<u32>)>,
    settlements: Vec<(Settlement, Option<u32>)>,
    config_errors: Option<u32>,
}

impl Metrics {
    fn define() -> Metrics {
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

/// What the root shares with every request context.
#[derive(Default)]
pub struct Shared {
    pub metrics: Metrics,
    /// Calls that must outlive their request (abandoned claims, unknown
    /// outcomes): sent from the root, so that the store's answer arrives
    /// while someone is still there to count it, and sent again until the
    /// store has answered.
    pub outbox: RefCell<Outbox>,
    /// Detached exchanges whose client has left, by the call they wait on.
    orphans: RefCell<HashMap<u32, Carrier>>,
}

/// Detached exchanges held at most; beyond that a client that leaves gets
/// the streaming outcome (the record turns unknown).
const MAX_ORPHANS: usize = 4_096;

impl Shared {
    /// Takes over an exchange whose client has left; the answer to its call
    /// `token` comes to the root.
    pub fn adopt(&self, token: u32, mut carrier: Carrier) {
        let mut orphans = self.orphans.borrow_mut();
        if orphans.len() >= MAX_ORPHANS {
            drop(orphans);
            host::log(
                LogLevel::Warn,
                "too many detached requests without a client; this one's record will be unknown",
            );
            carrier.give_up();
            return;
        }
        orphans.insert(token, carrier);
    }

    /// The answer to a call an orphan waits on; `false` if none does.
    fn answer_orphan(&self, token: u32, num_headers: usize, body_size: usize) -> bool {
        let Some(mut carrier) = self.orphans.borrow_mut().remove(&token) else {
            return false;
        };
        carrier.answered(token, num_headers, body_size);
        match carrier.pending() {
            Some(next) => {
                self.orphans.borrow_mut().insert(next, carrier);
            }
            None => carrier.close(),
        }
        true
    }
}

#[derive(Default)]
pub struct Root {
    config: Option<Rc<Config>>,
    shared: Rc<Shared>,
    /// This worker's random prefix for attempt ids, and the last number.
    attempt_prefix: String,
    attempts: Cell<u64>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if self.shared.answer_orphan(token, num_headers, body_size) {
            return;
        }
        let answer = host::store_answer(num_headers, body_size);
        let Some((settles, answer)) = self.shared.outbox.borrow_mut().answered(token, answer) else {
            return;
        };
        let metrics = &self.shared.metrics;
        if settled(&answer) {
            metrics.count_settlement(settles);
        } else {
            if let Some((status, detail)) = refusal(&answer) {
                metrics.config_error(status, &detail);
            }
            host::log(
                LogLevel::Warn,
                &format!(
                    "the store did not confirm a record {}; its lease will settle it",
                    settles.as_str()
                ),
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
                let Some(prefix) = host::random_hex() else {
                    host::log(LogLevel::Error, "no random source for claim attempt ids");
                    return false;
                };
                self.attempt_prefix = prefix;
                self.config = Some(Rc::new(config));
                self.shared = Rc::new(Shared {
                    metrics: Metrics::define(),
                    outbox: RefCell::default(),
                    orphans: RefCell::default(),
                });
                true
            }
            Err(e) => {
                host::log(LogLevel::Error, &format!("{e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(config) = &self.config {
            let given_up = self.shared.outbox.borrow_mut().tick(config.store());
            for _ in 0..given_up {
                self.shared.metrics.count_settlement(Settlement::Failed);
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy creates no request contexts for a rejected configuration; an
        // unconfigured filter passes everything rather than panic in the SDK.
        let n = self.attempts.get().wrapping_add(1);
        self.attempts.set(n);
        let attempt = Attempt::try_from(format!("{}-{n:x}", self.attempt_prefix)).ok();
        Some(Box::new(Filter::new(
            self.config.clone(),
            self.shared.clone(),
            attempt,
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
