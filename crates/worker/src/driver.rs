//! Carries out the steps of one request's exchange. Shared between the
//! request's HTTP context and the [`Worker`]'s registry: the answer to
//! any of its callouts reaches it through the registry, whichever context
//! Envoy handed the answer to, and after the client has left a detached
//! exchange lives on there until its last callout is answered.

use std::rc::Rc;

use crate::host::{self, Action, Host, Level};
use crate::worker::Worker;
use idemgate_core::client::{Letter, Owner};
use idemgate_core::exchange::{Exchange, Left, Step, UpstreamAnswer};
use idemgate_core::handling::{Handling, Settlement};
use idemgate_core::store_call::StoreAnswer;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// Who a call in flight went to, and the direction held until it answers.
#[derive(Clone, Copy)]
struct Waiting {
    upstream: bool,
    direction: Direction,
}

pub struct Driver<H: Host> {
    pub exchange: Exchange,
    /// The request's HTTP context.
    owner: Owner,
    worker: Rc<Worker<H>>,
    /// A call was handed to the worker's letters, which count its
    /// settlement once the store confirms it.
    delivered: bool,
    /// Request body bytes Envoy holds for us (all of them, while we pause).
    pub request_seen: usize,
    waiting: Option<Waiting>,
    /// The client is still there: its stream can be resumed or answered.
    attached: bool,
    /// What access logs were last told ([`Driver::note_outcome`]).
    noted: Option<(Handling, Option<Handling>)>,
    /// The exchange's attempt id, which names it on log lines.
    attempt: Rc<str>,
}

impl<H: Host> Driver<H> {
    pub fn new(exchange: Exchange, owner: Owner, worker: Rc<Worker<H>>) -> Driver<H> {
        Driver {
            attempt: Rc::from(exchange.attempt().as_str()),
            exchange,
            owner,
            worker,
            delivered: false,
            request_seen: 0,
            waiting: None,
            attached: true,
            noted: None,
        }
    }

    /// Carries out a step.
    pub fn act(&mut self, step: Step, direction: Direction) -> Action {
        let _about = host::about(&self.attempt);
        let action = self.carry_out(step, direction);
        self.note_outcome();
        action
    }

    /// Tells access logs how the request was handled so far, as filter
    /// state (`%FILTER_STATE(wasm.idemgate_outcome:PLAIN)%`, and
    /// `idemgate_reason`, `idemgate_policy`, `idemgate_attempt`), whenever
    /// that changes. Envoy takes no dynamic metadata from a Wasm filter.
    fn note_outcome(&mut self) {
        let now = (self.exchange.handling(), self.exchange.reason());
        if !self.attached || self.noted == Some(now) {
            return;
        }
        if self.noted.is_none() {
            self.worker
                .host
                .set_filter_state("idemgate_policy", self.exchange.policy_name());
            self.worker
                .host
                .set_filter_state("idemgate_attempt", self.exchange.attempt().as_str());
        }
        self.worker
            .host
            .set_filter_state("idemgate_outcome", now.0.as_str());
        if let Some(reason) = now.1 {
            self.worker
                .host
                .set_filter_state("idemgate_reason", reason.as_str());
        }
        self.noted = Some(now);
    }

    fn carry_out(&mut self, step: Step, direction: Direction) -> Action {
        match step {
            Step::Continue => Action::Continue,
            Step::Pause => Action::Pause,
            Step::Respond(reply) => {
                if self.attached {
                    self.worker.host.send_reply(&reply);
                }
                Action::Pause
            }
            Step::Reroute(call) => {
                if self.attached {
                    self.worker.host.reroute(&call, self.request_seen);
                }
                Action::Continue
            }
            Step::Deliver(call, next) => {
                self.post(self.exchange.letter(call));
                self.act(*next, direction)
            }
            Step::Call(call) => {
                if !self.worker.submit(self.owner, call) {
                    let next = self.exchange.store_reply(None);
                    return self.act(next, direction);
                }
                self.wait(false, direction)
            }
            Step::Forward(call) => {
                let body = self.worker.host.request_body(0, self.request_seen);
                let Some(token) = self.worker.host.dispatch_upstream(&call, &body) else {
                    let next = self.exchange.upstream_reply(UpstreamAnswer::Refused, Vec::new);
                    return self.act(next, direction);
                };
                self.worker.upstream_sent(token, self.owner);
                self.wait(true, direction)
            }
        }
    }

    fn wait(&mut self, upstream: bool, direction: Direction) -> Action {
        self.waiting = Some(Waiting { upstream, direction });
        Action::Pause
    }

    /// Hands a letter to the worker's store client, which counts the
    /// exchange's settlement once the store confirms it.
    fn post(&mut self, letter: Letter) {
        self.worker.post(letter);
        self.delivered = true;
    }

    /// The store's answer to the call in flight.
    pub fn store_answered(&mut self, answer: StoreAnswer) {
        self.answered(false, |ex| ex.store_reply(answer));
        if let Some((status, detail)) = self.exchange.take_store_refusal() {
            self.worker.metrics.config_error(status, &detail);
        }
    }

    /// The answer to the detached upstream request in flight.
    pub fn upstream_answered(&mut self, num_headers: usize, body_size: usize) {
        let host = self.worker.host.clone();
        self.answered(true, |ex| {
            let answer = match host.call_response_headers(num_headers) {
                Some(headers) => UpstreamAnswer::Response { headers, body_size },
                None => UpstreamAnswer::Lost,
            };
            ex.upstream_reply(answer, || host.call_response_body(body_size))
        });
    }

    /// Feeds an answer to the exchange and carries out its step on this
    /// request's stream (the answer may have reached another context).
    fn answered(&mut self, upstream: bool, feed: impl FnOnce(&mut Exchange) -> Step) {
        let Some(waiting) = self.waiting.take_if(|w| w.upstream == upstream) else {
            return;
        };
        let _about = host::about(&self.attempt);
        if self.attached {
            self.worker.host.set_effective_context(self.owner);
        }
        let step = feed(&mut self.exchange);
        match self.act(step, waiting.direction) {
            Action::Continue if self.attached && waiting.direction == Direction::Request => {
                self.worker.host.resume_request()
            }
            Action::Continue if self.attached => self.worker.host.resume_response(),
            _ => {}
        }
    }

    pub fn pending(&self) -> bool {
        self.waiting.is_some()
    }

    pub fn attached(&self) -> bool {
        self.attached
    }

    /// The client has left (`on_log`). Returns whether the exchange goes on
    /// without it (a detached request or its completion is in flight);
    /// otherwise settles what was left open and counts the request.
    pub fn client_left(&mut self) -> bool {
        let _about = host::about(&self.attempt);
        self.attached = false;
        let ended = match self.exchange.client_left(self.pending()) {
            Left::GoesOn => {
                let ex = &self.exchange;
                self.worker
                    .metrics
                    .count(ex.policy_name(), (ex.handling(), ex.reason()), None);
                return true;
            }
            Left::Ended(letter) => letter,
        };
        if self.exchange.settlement() == Some(Settlement::Failed) {
            // Named by the attempt id (see `host::about`), not a hash of the
            // key: it is random, and the record's history carries it.
            self.worker.host.log(
                Level::Warn,
                "the store did not record the outcome; its lease will turn it unknown",
            );
        }
        // The store's answer to a call sent from here would find nobody:
        // the root sends it and counts the settlement once the store confirms.
        if let Some(letter) = ended {
            self.post(letter);
        }
        let settlement = if self.delivered {
            None
        } else {
            self.exchange.settlement()
        };
        let ex = &self.exchange;
        self.worker
            .metrics
            .count(ex.policy_name(), (ex.handling(), ex.reason()), settlement);
        false
    }

    /// An exchange whose client has left has no callout left in flight:
    /// counts its settlement (unless the root's store client will).
    pub fn close(&self) {
        if let (false, Some(settlement)) = (self.delivered, self.exchange.settlement()) {
            let policy = self.exchange.policy_name();
            self.worker.metrics.count_settlement(policy, settlement);
        }
    }
}
