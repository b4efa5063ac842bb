//! One request's HTTP context: reads what the exchange needs from Envoy and
//! carries out the steps it returns.

use std::rc::Rc;

use idemgate_core::claims::claim_in_metadata;
use idemgate_core::config::{Config, Forwarding};
use idemgate_core::exchange::{Exchange, Step};
use idemgate_core::headers::{self, CONTROL_HEADER, KEY_HEADER};
use idemgate_core::protocol::Attempt;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::carrier::{Carrier, Direction};
use crate::host;
use crate::root::Shared;

/// The filter whose dynamic metadata holds verified JWT payloads.
const JWT_AUTHN: &str = "envoy.filters.http.jwt_authn";

pub struct Filter {
    config: Option<Rc<Config>>,
    shared: Rc<Shared>,
    /// This request's claim attempt id, unique on the worker.
    attempt: Option<Attempt>,
    /// Set once a policy covers the request.
    carrier: Option<Carrier>,
    /// Response body bytes already handed to the exchange.
    response_seen: usize,
}

impl Filter {
    pub fn new(config: Option<Rc<Config>>, shared: Rc<Shared>, attempt: Option<Attempt>) -> Filter {
        Filter {
            config,
            shared,
            attempt,
            carrier: None,
            response_seen: 0,
        }
    }

    /// Feeds the exchange and carries out its step.
    fn drive(&mut self, direction: Direction, feed: impl FnOnce(&mut Exchange) -> Step) -> Action {
        let Some(carrier) = self.carrier.as_mut() else {
            return Action::Continue;
        };
        let step = feed(&mut carrier.exchange);
        carrier.act(step, direction)
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if let Some(carrier) = self.carrier.as_mut() {
            carrier.answered(token, num_headers, body_size);
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
        // Detached forwarding calls the route's cluster unless the policy names one.
        let route_cluster = match policy.forwarding() {
            Forwarding::Detached(_) => host::property(&["xds", "cluster_name"]),
            Forwarding::Streaming => None,
        };
        let route_cluster = route_cluster.map(|c| String::from_utf8_lossy(&c).into_owned());
        let head = headers::request_head(
            &policy,
            &method,
            &path,
            &lines,
            &mut jwt_claim,
            route_cluster.as_deref(),
            end_of_stream,
        );
        let (exchange, step) = Exchange::begin(config.clone(), policy, head, attempt);
        let carrier = self
            .carrier
            .insert(Carrier::new(exchange, config, self.shared.clone()));
        carrier.act(step, Direction::Request)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(carrier) = self.carrier.as_mut() else {
            return Action::Continue;
        };
        let seen = carrier.request_seen;
        let chunk = host::request_body(seen, body_size.saturating_sub(seen));
        carrier.request_seen = body_size;
        let step = carrier.exchange.request_body(&chunk, end_of_stream);
        carrier.act(step, Direction::Request)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.drive(Direction::Request, |ex| ex.request_body(&[], true))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(carrier) = self.carrier.as_ref() else {
            return Action::Continue;
        };
        let ex = &carrier.exchange;
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
        self.drive(Direction::Response, |ex| ex.response_headers(head))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.carrier.as_ref().is_some_and(|c| c.exchange.owns_response()) {
            return Action::Continue;
        }
        let chunk = host::response_body(self.response_seen, body_size.saturating_sub(self.response_seen));
        let action = self.drive(Direction::Response, |ex| ex.response_body(&chunk, end_of_stream));
        // Once data flows on, Envoy's buffer restarts from the next chunk.
        self.response_seen = if action == Action::Continue { 0 } else { body_size };
        action
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.drive(Direction::Response, |ex| ex.response_body(&[], true))
    }

    fn on_log(&mut self) {
        let Some(mut carrier) = self.carrier.take() else {
            return;
        };
        // This context is deleted right after on_log; an exchange that must
        // go on is handed to the root, which hears its call's answer.
        if let Some(token) = carrier.client_left() {
            self.shared.adopt(token, carrier);
        }
    }
}
