//! One request's HTTP context: reads what the exchange needs from Envoy and
//! carries out the steps it returns.

use std::rc::Rc;

use idemgate_core::claims::claim_in_metadata;
use idemgate_core::config::Config;
use idemgate_core::exchange::{Exchange, Settlement, Step, StoreCall};
use idemgate_core::headers::{self, CONTROL_HEADER, KEY_HEADER};
use idemgate_core::protocol::Attempt;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

use crate::host;
use crate::root::Shared;

/// The filter whose dynamic metadata holds verified JWT payloads.
const JWT_AUTHN: &str = "envoy.filters.http.jwt_authn";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Request,
    Response,
}

pub struct Filter {
    config: Option<Rc<Config>>,
    shared: Rc<Shared>,
    /// This request's claim attempt id, unique on the worker.
    attempt: Option<Attempt>,
    exchange: Option<Exchange>,
    /// A call was handed to the root's store client, which counts its
    /// settlement once the store confirms it.
    delivered: bool,
    /// Body bytes already handed to the exchange (Envoy's buffer grows while we pause).
    request_seen: usize,
    response_seen: usize,
    /// The direction held while a store call is in flight.
    waiting: Option<Direction>,
}

impl Filter {
    pub fn new(config: Option<Rc<Config>>, shared: Rc<Shared>, attempt: Option<Attempt>) -> Filter {
        Filter {
            config,
            shared,
            attempt,
            exchange: None,
            delivered: false,
            request_seen: 0,
            response_seen: 0,
            waiting: None,
        }
    }

    /// Carries out a step inside a stream callback.
    fn act(&mut self, step: Step, direction: Direction) -> Action {
        match step {
            Step::Continue => Action::Continue,
            Step::Pause => Action::Pause,
            Step::Respond(reply) => {
                host::send_reply(&reply);
                Action::Pause
            }
            Step::Deliver(call, next) => {
                self.deliver(call);
                self.act(*next, direction)
            }
            Step::Call(call) => match self
                .config
                .as_ref()
                .and_then(|c| host::dispatch(c.store(), &call))
            {
                Some(_) => {
                    self.waiting = Some(direction);
                    Action::Pause
                }
                None => match self.exchange.as_mut() {
                    Some(ex) => {
                        let next = ex.store_reply(None);
                        self.act(next, direction)
                    }
                    None => Action::Continue,
                },
            },
        }
    }

    /// Hands a call to the root's store client, to be counted as the
    /// exchange's settlement once the store confirms it.
    fn deliver(&mut self, call: StoreCall) {
        let settles = self
            .exchange
            .as_ref()
            .and_then(Exchange::settlement)
            .unwrap_or(Settlement::Failed);
        self.shared.outbox.borrow_mut().post(call, settles);
        self.delivered = true;
    }

    /// Carries out a step outside a stream callback (after a store reply).
    fn resume(&mut self, step: Step) {
        let Some(direction) = self.waiting.take() else {
            return;
        };
        match self.act(step, direction) {
            Action::Continue if direction == Direction::Request => host::resume_request(),
            Action::Continue => host::resume_response(),
            _ => {}
        }
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let answer = host::store_answer(num_headers, body_size);
        if let Some(ex) = self.exchange.as_mut() {
            let step = ex.store_reply(answer);
            if let Some((status, detail)) = ex.take_store_refusal() {
                self.shared.metrics.config_error(status, &detail);
            }
            self.resume(step);
        }
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let (Some(config), Some(attempt)) = (self.config.clone(), self.attempt.take()) else {
            return Action::Continue;
        };
        // Three lookups decide whether the request is ours; only then is the
        // whole header map copied out of Envoy.
        let pseudo =
            |name| String::from_utf8_lossy(&host::request_header(name).unwrap_or_default()).into_owned();
        let (method, path) = (pseudo(":method"), pseudo(":path"));
        let Some(policy) = config.policy_for(&method, &pseudo(":authority"), &path).cloned() else {
            return Action::Continue;
        };
        let lines = host::request_headers();
        // JWT claims are read from the whole dynamic metadata, the one
        // property Envoy hands over with its types; once per request.
        let mut metadata: Option<Option<Vec<u8>>> = None;
        let mut jwt_claim = |payload: &str, claim: &str| {
            let metadata = metadata.get_or_insert_with(|| host::property(&["metadata"]));
            claim_in_metadata(metadata.as_deref()?, JWT_AUTHN, payload, claim)
        };
        let head = headers::request_head(&policy, &method, &path, &lines, &mut jwt_claim, end_of_stream);
        let (exchange, step) = Exchange::begin(config.clone(), policy, head, attempt);
        self.exchange = Some(exchange);
        self.act(step, Direction::Request)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(ex) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        let chunk = host::request_body(self.request_seen, body_size.saturating_sub(self.request_seen));
        self.request_seen = body_size;
        let step = ex.request_body(&chunk, end_of_stream);
        self.act(step, Direction::Request)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(ex) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        let step = ex.request_body(&[], true);
        self.act(step, Direction::Request)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(ex) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        let lines = if ex.owns_response() {
            host::response_headers()
        } else {
            Vec::new()
        };
        host::remove_response_header(CONTROL_HEADER);
        if let Some(key) = ex.key_echo() {
            host::set_response_header(KEY_HEADER, key);
        }
        if !ex.owns_response() {
            return Action::Continue;
        }
        let details = host::property(&["response", "code_details"]).unwrap_or_default();
        let head = headers::response_head(lines, &String::from_utf8_lossy(&details), end_of_stream);
        let step = ex.response_headers(head);
        self.act(step, Direction::Response)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(ex) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        if !ex.owns_response() {
            return Action::Continue;
        }
        let chunk = host::response_body(self.response_seen, body_size.saturating_sub(self.response_seen));
        let step = ex.response_body(&chunk, end_of_stream);
        let action = self.act(step, Direction::Response);
        // Once data flows on, Envoy's buffer restarts from the next chunk.
        self.response_seen = if action == Action::Continue { 0 } else { body_size };
        action
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(ex) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        let step = ex.response_body(&[], true);
        self.act(step, Direction::Response)
    }

    fn on_log(&mut self) {
        let Some(ex) = self.exchange.as_mut() else { return };
        // This context is deleted right after on_log, and the store's answer
        // to a call sent from here would find nobody: the root sends it and
        // counts the settlement once the store confirms.
        let orphan = ex.finish();
        let (handling, settlement) = (ex.handling(), ex.settlement());
        if settlement == Some(Settlement::Failed) {
            let record = ex.log_id().unwrap_or_default();
            host::log(
                LogLevel::Warn,
                &format!(
                    "record {record}: the store did not record the outcome; its lease will turn it unknown"
                ),
            );
        }
        if let Some(call) = orphan {
            self.deliver(call);
        }
        let settlement = if self.delivered { None } else { settlement };
        self.shared.metrics.count(handling, settlement);
    }
}
