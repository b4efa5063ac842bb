//! One request's HTTP context: reads what the exchange needs from the host
//! and carries out the steps it returns. Each method is one of Envoy's
//! request callbacks.

use std::cell::RefCell;
use std::rc::Rc;

use idemgate_core::client::Owner;
use idemgate_core::config::Forwarding;
use idemgate_core::exchange::{self, Exchange, Step};
use idemgate_core::headers::{self, CONTROL_HEADER, KEY_HEADER};
use idemgate_core::jwt::claim_in_metadata;
use idemgate_core::protocol::Attempt;

use crate::driver::{Direction, Driver};
use crate::host::{Action, Host};
use crate::worker::Worker;

/// The filter whose dynamic metadata holds verified JWT payloads.
const JWT_AUTHN: &str = "envoy.filters.http.jwt_authn";

pub struct Filter<H: Host> {
    host: H,
    /// This HTTP context's id.
    owner: Owner,
    /// `None` while the filter has no valid configuration.
    worker: Option<Rc<Worker<H>>>,
    /// This request's claim attempt id, unique on the worker.
    attempt: Option<Attempt>,
    /// Set once a policy covers the request.
    driver: Option<Rc<RefCell<Driver<H>>>>,
    /// Response body bytes already handed to the exchange.
    response_seen: usize,
}

impl<H: Host> Filter<H> {
    pub fn new(host: H, owner: Owner, worker: Option<Rc<Worker<H>>>, attempt: Option<Attempt>) -> Filter<H> {
        Filter {
            host,
            owner,
            worker,
            attempt,
            driver: None,
            response_seen: 0,
        }
    }

    /// Feeds the exchange and carries out its step.
    fn drive(&mut self, direction: Direction, feed: impl FnOnce(&mut Driver<H>) -> Step) -> Action {
        let Some(driver) = &self.driver else {
            return Action::Continue;
        };
        let action = {
            let mut driver = driver.borrow_mut();
            let step = feed(&mut driver);
            driver.act(step, direction)
        };
        if let Some(worker) = &self.worker {
            worker.pump();
        }
        action
    }

    /// Reads something of the exchange (`None` when the request is not covered).
    fn exchange<T>(&self, read: impl FnOnce(&Exchange) -> T) -> Option<T> {
        self.driver.as_ref().map(|c| read(&c.borrow().exchange))
    }

    /// The answer to a callout of this worker's, handed to this context.
    pub fn call_response(&self, token: u32, num_headers: usize, body_size: usize) {
        if let Some(worker) = &self.worker {
            worker.answer(token, num_headers, body_size);
        }
    }

    /// The stream is over (`on_log`, or `on_done` of a stream Envoy ends
    /// without logging it). This context is deleted right after; an
    /// exchange that must go on stays with the worker, which hears its
    /// callouts' answers.
    pub fn client_left(&mut self) {
        if let (Some(worker), Some(_)) = (&self.worker, self.driver.take()) {
            worker.client_left(self.owner);
        }
    }

    pub fn request_headers(&mut self, end_of_stream: bool) -> Action {
        let host = self.host.clone();
        // Before anything else, whether this filter is configured or not.
        host.remove_forged_replay_marker();
        let (Some(worker), Some(attempt)) = (self.worker.clone(), self.attempt.take()) else {
            return Action::Continue;
        };
        let config = worker.config.clone();
        // Three lookups decide whether the request is ours; only then is the
        // whole header map copied out of Envoy.
        let pseudo =
            |name| String::from_utf8_lossy(&host.request_header(name).unwrap_or_default()).into_owned();
        let (method, path) = (pseudo(":method"), pseudo(":path"));
        let Some(policy) = config.policy_for(&method, &pseudo(":authority"), &path).cloned() else {
            return Action::Continue;
        };
        let lines = host.request_headers();
        // No caller has Envoy retry a covered request behind the filter.
        for name in headers::router_steering(&lines) {
            host.remove_request_header(name);
        }
        // JWT claims are read from the whole dynamic metadata, the one
        // property Envoy hands over with its types; once per request.
        let mut metadata: Option<Option<Vec<u8>>> = None;
        let mut jwt_claim = |payload: &str, claim: &str| {
            let metadata = metadata.get_or_insert_with(|| host.property(&["metadata"]));
            claim_in_metadata(metadata.as_deref()?, JWT_AUTHN, payload, claim)
        };
        // Detached forwarding calls the route's cluster unless the policy names one.
        let route_cluster = match policy.forwarding() {
            Forwarding::Detached(_) => host.property(&["xds", "cluster_name"]),
            Forwarding::Streaming => None,
        };
        let route_cluster = route_cluster.map(|c| String::from_utf8_lossy(&c).into_owned());
        let head = exchange::request_head(
            &policy,
            &method,
            &path,
            &lines,
            &mut jwt_claim,
            route_cluster.as_deref(),
            end_of_stream,
        );
        let (exchange, step) = Exchange::begin(config, policy, head, attempt);
        let driver = Rc::new(RefCell::new(Driver::new(exchange, self.owner, worker.clone())));
        worker.register(self.owner, driver.clone());
        self.driver = Some(driver);
        self.drive(Direction::Request, |_| step)
    }

    pub fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let host = self.host.clone();
        self.drive(Direction::Request, |c| {
            let seen = c.request_seen;
            let chunk = host.request_body(seen, body_size.saturating_sub(seen));
            c.request_seen = body_size;
            c.exchange.request_body(&chunk, end_of_stream)
        })
    }

    pub fn request_trailers(&mut self) -> Action {
        self.drive(Direction::Request, |c| c.exchange.request_body(&[], true))
    }

    pub fn response_headers(&mut self, end_of_stream: bool) -> Action {
        let Some((owns, echo)) = self.exchange(|ex| (ex.owns_response(), ex.key_echo().map(str::to_string)))
        else {
            return Action::Continue;
        };
        let host = &self.host;
        let lines = if owns { host.response_headers() } else { Vec::new() };
        host.remove_response_header(CONTROL_HEADER);
        if let Some(key) = echo {
            host.set_response_header(KEY_HEADER, &key);
        }
        if !owns {
            return Action::Continue;
        }
        let details = host.property(&["response", "code_details"]).unwrap_or_default();
        let head = exchange::response_head(lines, &String::from_utf8_lossy(&details), end_of_stream);
        self.drive(Direction::Response, |c| c.exchange.response_headers(head))
    }

    pub fn response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.exchange(Exchange::owns_response) != Some(true) {
            return Action::Continue;
        }
        let chunk = self
            .host
            .response_body(self.response_seen, body_size.saturating_sub(self.response_seen));
        let action = self.drive(Direction::Response, |c| {
            c.exchange.response_body(&chunk, end_of_stream)
        });
        // Once data flows on, Envoy's buffer restarts from the next chunk.
        self.response_seen = if action == Action::Continue { 0 } else { body_size };
        action
    }

    pub fn response_trailers(&mut self) -> Action {
        let Some(owns) = self.exchange(Exchange::owns_response) else {
            return Action::Continue;
        };
        let host = &self.host;
        let trailers = if owns {
            host.response_trailers()
        } else {
            Vec::new()
        };
        // gRPC servers often say it in their trailing metadata.
        host.remove_response_trailer(CONTROL_HEADER);
        if !owns {
            return Action::Continue;
        }
        self.drive(Direction::Response, |c| c.exchange.response_trailers(&trailers))
    }
}
