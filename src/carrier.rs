//! Carries out the steps of one request's exchange: held by the request's
//! HTTP context, or, once the client has left while the exchange must go on
//! (detached forwarding), by the root, which hears the answers to its calls.

use std::rc::Rc;

use idemgate_core::config::Config;
use idemgate_core::exchange::{Exchange, Settlement, Step, StoreCall, UpstreamAnswer};
use proxy_wasm::types::{Action, LogLevel};

use crate::host;
use crate::root::Shared;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// Who a call in flight went to.
#[derive(Clone, Copy)]
enum Callee {
    Store,
    Upstream,
}

/// A call in flight, and the direction held until it is answered.
#[derive(Clone, Copy)]
struct Waiting {
    token: u32,
    callee: Callee,
    direction: Direction,
}

pub struct Carrier {
    pub exchange: Exchange,
    config: Rc<Config>,
    shared: Rc<Shared>,
    /// A call was handed to the root's store client, which counts its
    /// settlement once the store confirms it.
    delivered: bool,
    /// Request body bytes Envoy holds for us (all of them, while we pause).
    pub request_seen: usize,
    waiting: Option<Waiting>,
    /// The client is still there: its stream can be resumed or answered.
    attached: bool,
}

impl Carrier {
    pub fn new(exchange: Exchange, config: Rc<Config>, shared: Rc<Shared>) -> Carrier {
        Carrier {
            exchange,
            config,
            shared,
            delivered: false,
            request_seen: 0,
            waiting: None,
            attached: true,
        }
    }

    /// Carries out a step inside a stream callback.
    pub fn act(&mut self, step: Step, direction: Direction) -> Action {
        match step {
            Step::Continue => Action::Continue,
            Step::Pause => Action::Pause,
            Step::Respond(reply) => {
                if self.attached {
                    host::send_reply(&reply);
                }
                Action::Pause
            }
            Step::Deliver(call, next) => {
                self.deliver(call);
                self.act(*next, direction)
            }
            Step::Call(call) => {
                let token = host::dispatch(self.config.store(), &call);
                self.wait(token, Callee::Store, direction)
            }
            Step::Forward(call) => {
                let body = host::request_body(0, self.request_seen);
                let token = host::dispatch_upstream(&call, &body);
                self.wait(token, Callee::Upstream, direction)
            }
        }
    }

    /// Holds the stream until the call's answer, or carries on at once with
    /// no answer when Envoy refused to send it.
    fn wait(&mut self, token: Option<u32>, callee: Callee, direction: Direction) -> Action {
        if let Some(token) = token {
            self.waiting = Some(Waiting {
                token,
                callee,
                direction,
            });
            return Action::Pause;
        }
        let next = match callee {
            Callee::Store => self.exchange.store_reply(None),
            Callee::Upstream => self.exchange.upstream_reply(UpstreamAnswer::Refused, Vec::new),
        };
        self.act(next, direction)
    }

    /// Hands a call to the root's store client, to be counted as the
    /// exchange's settlement once the store confirms it.
    fn deliver(&mut self, call: StoreCall) {
        let settles = self.exchange.settlement().unwrap_or(Settlement::Failed);
        self.shared.outbox.borrow_mut().post(call, settles);
        self.delivered = true;
    }

    /// The answer to the call in flight (`on_http_call_response`).
    pub fn answered(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some(waiting) = self.waiting.take_if(|w| w.token == token) else {
            return;
        };
        let step = match waiting.callee {
            Callee::Store => {
                let step = self
                    .exchange
                    .store_reply(host::store_answer(num_headers, body_size));
                if let Some((status, detail)) = self.exchange.take_store_refusal() {
                    self.shared.metrics.config_error(status, &detail);
                }
                step
            }
            Callee::Upstream => {
                let answer = match host::call_response_headers(num_headers) {
                    Some(headers) => UpstreamAnswer::Response { headers, body_size },
                    None => UpstreamAnswer::Lost,
                };
                self.exchange
                    .upstream_reply(answer, || host::call_response_body(body_size))
            }
        };
        // Outside a stream callback: resume the stream ourselves.
        match self.act(step, waiting.direction) {
            Action::Continue if self.attached && waiting.direction == Direction::Request => {
                host::resume_request()
            }
            Action::Continue if self.attached => host::resume_response(),
            _ => {}
        }
    }

    /// The call in flight, if any.
    pub fn pending(&self) -> Option<u32> {
        self.waiting.map(|w| w.token)
    }

    /// The client has left (`on_log`). Returns the token under which the
    /// root must hold this carrier when the exchange goes on without the
    /// client; otherwise settles what was left open and counts the request.
    pub fn client_left(&mut self) -> Option<u32> {
        self.attached = false;
        if self.exchange.outlives_client() {
            if let Some(token) = self.pending() {
                self.shared.metrics.count(self.exchange.handling(), None);
                return Some(token);
            }
        }
        // The store's answer to a call sent from here would find nobody:
        // the root sends it and counts the settlement once the store confirms.
        let orphan = self.exchange.finish();
        if self.exchange.settlement() == Some(Settlement::Failed) {
            let record = self.exchange.log_id().unwrap_or_default();
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
        let settlement = if self.delivered {
            None
        } else {
            self.exchange.settlement()
        };
        self.shared.metrics.count(self.exchange.handling(), settlement);
        None
    }

    /// The root cannot hold this exchange: it ends as if streaming (the
    /// record is marked unknown).
    pub fn give_up(&mut self) {
        if let Some(call) = self.exchange.finish() {
            self.deliver(call);
        }
        self.close();
    }

    /// A detached exchange the root held has no call left in flight: counts
    /// its settlement (unless the root's store client will).
    pub fn close(&self) {
        if let (false, Some(settlement)) = (self.delivered, self.exchange.settlement()) {
            self.shared.metrics.count_settlement(settlement);
        }
    }
}
