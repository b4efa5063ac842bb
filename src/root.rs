//! The root context: parses the configuration and sets up what every request
//! on this worker's VM shares ([`Shared`]); hears the answers to callouts
//! whose request context is gone, and drives the store client's timer.

use std::cell::Cell;
use std::rc::Rc;

use idemgate_core::config::Config;
use idemgate_core::protocol::Attempt;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::host;
use crate::http::Filter;
use crate::shared::Shared;

#[derive(Default)]
pub struct Root {
    /// `None` until a valid configuration arrived.
    shared: Option<Rc<Shared>>,
    /// This worker's random prefix for attempt ids, and the last number.
    attempt_prefix: String,
    attempts: Cell<u64>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if let Some(shared) = &self.shared {
            shared.answer(token, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        // The VM's environment: what vm_config.environment_variables passes.
        match Config::parse_with_env(&bytes, &|name| std::env::var(name).ok()) {
            Ok(config) => {
                for warning in config.warnings() {
                    host::log(LogLevel::Warn, &warning);
                }
                let Some(prefix) = host::random_hex() else {
                    host::log(LogLevel::Error, "no random source for claim attempt ids");
                    return false;
                };
                self.attempt_prefix = prefix;
                self.shared = Some(Rc::new(Shared::new(Rc::new(config))));
                true
            }
            Err(e) => {
                host::log(LogLevel::Error, &format!("{e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            shared.pump();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy creates no request contexts for a rejected configuration; an
        // unconfigured filter passes everything rather than panic in the SDK.
        let n = self.attempts.get().wrapping_add(1);
        self.attempts.set(n);
        let attempt = Attempt::try_from(format!("{}-{n:x}", self.attempt_prefix)).ok();
        Some(Box::new(Filter::new(context_id, self.shared.clone(), attempt)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
