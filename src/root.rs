//! The root context: parses the configuration and sets up what every request
//! on this worker's VM shares ([`Worker`]); hears the answers to callouts
//! whose request context is gone, and drives the store client's timer.
//!
//! When Envoy lets the configuration go (a listener or filter update brought
//! a new plugin configuration, or the filter was removed), it asks the root
//! whether it is done; deleting it would cancel its callouts. A root with
//! work that outlives its requests (detached requests whose client left,
//! letters the store has not confirmed) says no and keeps its timer and its
//! callouts until that work drains, then tells Envoy it is done.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::client::BUDGET_MS;
use idemgate_core::config::Config;
use idemgate_core::protocol::Attempt;
use idemgate_worker::{Filter, Host, Worker};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

use crate::filter::Request;
use crate::host::{self, Envoy};

#[derive(Default)]
pub struct Root {
    /// `None` until a valid configuration arrived.
    worker: Option<Rc<Worker<Envoy>>>,
    /// This worker's random prefix for attempt ids, and the last number.
    attempt_prefix: String,
    attempts: Cell<u64>,
    /// Set once Envoy let this configuration go while work was left: until
    /// when (ms since the epoch) the root may go on finishing it.
    drain_until: Option<i64>,
    /// Envoy was told the root is done.
    finished: bool,
}

/// The most a let-go root goes on: the letters' delivery budget. Nothing it
/// waits on lasts longer (a letter is given up after it, a detached upstream
/// call and a store call time out well within it), so the limit never cuts
/// real work short; it only bounds a root whose work would never end.
fn drain_limit_ms() -> i64 {
    i64::try_from(BUDGET_MS).unwrap_or(i64::MAX)
}

/// While draining, the timer wakes the root at least this often.
const DRAIN_TICK: Duration = Duration::from_secs(1);

impl Root {
    /// While draining: tells Envoy the root is done once nothing is left (or
    /// the limit passed); otherwise keeps the timer running.
    fn drain_step(&mut self) {
        let (Some(until), Some(worker)) = (self.drain_until, &self.worker) else {
            return;
        };
        if self.finished {
            return;
        }
        let drained = worker.drained();
        if !drained && Envoy.now_ms() < until {
            if worker.timer_off() {
                Envoy.set_tick_period(DRAIN_TICK);
            }
            return;
        }
        if drained {
            host::log(
                LogLevel::Info,
                "a replaced configuration finished its detached requests and letters",
            );
        } else {
            let (drivers, letters, calls) = worker.outstanding();
            host::log(
                LogLevel::Warn,
                &format!(
                    "a replaced configuration gave up after {}s with {drivers} requests, \
                     {letters} letters and {calls} store calls left; their leases will settle them",
                    drain_limit_ms() / 1000
                ),
            );
        }
        self.finished = true;
        Envoy.set_tick_period(Duration::ZERO);
        host::done();
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if let Some(worker) = &self.worker {
            worker.answer(token, num_headers, body_size);
        }
        self.drain_step();
    }

    /// Envoy lets this configuration go. Deleting the root would cancel its
    /// callouts: with work left it stays (`false`) until [`Root::drain_step`]
    /// finds it drained and calls `proxy_done`.
    fn on_done(&mut self) -> bool {
        let Some(worker) = &self.worker else {
            return true;
        };
        if worker.drained() {
            return true;
        }
        let (drivers, letters, calls) = worker.outstanding();
        host::log(
            LogLevel::Info,
            &format!(
                "configuration replaced: finishing {drivers} requests, {letters} letters and \
                 {calls} store calls first (at most {}s)",
                drain_limit_ms() / 1000
            ),
        );
        self.drain_until = Some(Envoy.now_ms().saturating_add(drain_limit_ms()));
        if worker.timer_off() {
            Envoy.set_tick_period(DRAIN_TICK);
        }
        false
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration().unwrap_or_default();
        // The VM's environment: what vm_config.environment_variables passes.
        match Config::parse_with_env(&bytes, &|name| std::env::var(name).ok()) {
            Ok(config) => {
                // Which module a worker runs, in its log: what a rollout is checked by.
                host::log(
                    LogLevel::Info,
                    &format!(
                        "idemgate {} configured: {} policies",
                        env!("CARGO_PKG_VERSION"),
                        config.policies().len()
                    ),
                );
                for warning in config.warnings() {
                    host::log(LogLevel::Warn, &warning);
                }
                let Some(prefix) = host::random_hex() else {
                    host::log(LogLevel::Error, "no random source for claim attempt ids");
                    return false;
                };
                self.attempt_prefix = prefix;
                self.worker = Some(Rc::new(Worker::new(Envoy, Rc::new(config))));
                true
            }
            Err(e) => {
                host::log(LogLevel::Error, &format!("{e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(worker) = &self.worker {
            worker.pump();
        }
        self.drain_step();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Envoy creates no request contexts for a rejected configuration; an
        // unconfigured filter passes everything rather than panic in the SDK.
        let n = self.attempts.get().wrapping_add(1);
        self.attempts.set(n);
        let attempt = Attempt::try_from(format!("{}-{n:x}", self.attempt_prefix)).ok();
        let filter = Filter::new(Envoy, context_id, self.worker.clone(), attempt);
        Some(Box::new(Request::new(filter)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
