//! One request's HTTP context: reads what the exchange needs from Envoy and
//! carries out the steps it returns.

use std::rc::Rc;

use idemgate_core::config::{Config, Identity, Source};
use idemgate_core::exchange::{Exchange, Origin, RequestHead, ResponseHead, Settlement, Step};
use idemgate_core::protocol::Attempt;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, Bytes, LogLevel};

use crate::host;
use crate::outbox::Shared;
use crate::root::Metrics;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Request,
    Response,
}

pub struct Filter {
    config: Option<Rc<Config>>,
    metrics: Rc<Metrics>,
    outbox: Shared,
    /// This request's claim attempt id, unique on the worker.
    attempt: Option<Attempt>,
    exchange: Option<Exchange>,
    /// Body bytes already handed to the exchange (Envoy's buffer grows while we pause).
    request_seen: usize,
    response_seen: usize,
    /// The direction held while a store call is in flight.
    waiting: Option<Direction>,
}

impl Filter {
    pub fn new(
        config: Option<Rc<Config>>,
        metrics: Rc<Metrics>,
        outbox: Shared,
        attempt: Option<Attempt>,
    ) -> Filter {
        Filter {
            config,
            metrics,
            outbox,
            attempt,
            exchange: None,
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
                self.outbox.borrow_mut().post(call);
                self.act(*next, direction)
            }
            Step::Call(call) => match self.config.as_ref().and_then(|c| host::dispatch(&c.store, &call)) {
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

fn header<'a>(headers: &'a [(String, Bytes)], name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

fn content_length(headers: &[(String, Bytes)]) -> Option<u64> {
    std::str::from_utf8(header(headers, "content-length")?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// An identity header that appears twice is ambiguous and counts as absent.
fn identity_value(source: &Source, headers: &[(String, Bytes)]) -> Option<Vec<u8>> {
    match source {
        Source::Header(name) => {
            let mut values = headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name));
            match (values.next(), values.next()) {
                (Some((_, value)), None) => Some(value.clone()),
                _ => None,
            }
        }
        Source::Jwt { payload, claim } => host::property(&[
            "metadata",
            "filter_metadata",
            "envoy.filters.http.jwt_authn",
            payload,
            claim,
        ]),
    }
}

/// Tells Envoy's own replies (connect failure, reset, timeout) from the upstream's.
fn origin() -> Origin {
    let details = host::property(&["response", "code_details"]).unwrap_or_default();
    let details = String::from_utf8_lossy(&details);
    const NEVER_REACHED: [&str; 5] = [
        "connection_failure",
        "no_healthy_upstream",
        "cluster_not_found",
        "route_not_found",
        "maintenance_mode",
    ];
    if details.is_empty() || details == "via_upstream" {
        Origin::Upstream
    } else if NEVER_REACHED.iter().any(|d| details.contains(d)) {
        Origin::NeverReached
    } else {
        Origin::LostAfterForwarding
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let answer = host::store_answer(num_headers, body_size);
        if let Some(ex) = self.exchange.as_mut() {
            let step = ex.store_reply(answer);
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
        let headers = host::request_headers();
        let (tenant, principal) = match &policy.identity {
            Identity::Anonymous => (None, None),
            Identity::Sourced { tenant, principal } => (
                identity_value(tenant, &headers),
                principal.as_ref().and_then(|p| identity_value(p, &headers)),
            ),
        };
        let head = RequestHead {
            key_fields: headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case("idempotency-key"))
                .map(|(_, v)| v.clone())
                .collect(),
            fingerprint_headers: policy
                .fingerprint
                .headers
                .iter()
                .filter_map(|name| header(&headers, name).map(|v| (name.clone(), v.to_vec())))
                .collect(),
            content_length: content_length(&headers),
            method,
            path,
            tenant,
            principal,
            end_of_stream,
        };
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
        if !ex.owns_response() {
            return Action::Continue;
        }
        let headers = host::response_headers();
        host::remove_response_header("idempotency-control");
        let status = std::str::from_utf8(header(&headers, ":status").unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let head = ResponseHead {
            status,
            origin: origin(),
            content_length: content_length(&headers),
            headers: headers.into_iter().filter(|(n, _)| !n.starts_with(':')).collect(),
            end_of_stream,
        };
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
        if let Some(call) = ex.finish() {
            self.outbox.borrow_mut().post(call);
        }
        if ex.settlement() == Some(Settlement::Failed) {
            let record = ex.log_id().unwrap_or_default();
            host::log(
                LogLevel::Warn,
                &format!(
                    "record {record}: the store did not record the outcome; its lease will turn it unknown"
                ),
            );
        }
        self.metrics.count(ex.outcome(), ex.settlement());
    }
}
