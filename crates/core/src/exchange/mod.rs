//! The filter's brain: one [`Exchange`] per request covered by a policy.
//!
//! Sans-IO: the filter feeds in what Envoy tells it (request head, body chunks,
//! store replies, the upstream's response, the end of the stream) and carries out
//! the [`Step`] it gets back. Every decision of contract §4 and §5 is made here
//! and tested with plain values.
//!
//! Once the exchange has answered on its own ([`Step::Respond`]) it ignores the
//! rest of the stream: Envoy runs our own local reply back through the response
//! callbacks, and that must never be completed as if the upstream had sent it.

use std::rc::Rc;

use crate::client::Letter;
use crate::config::{Config, InFlight, Mode, Policy, Settle};
use crate::fingerprint::Fingerprinter;
use crate::grpc;
use crate::handling::{Handling, Settlement};
use crate::headers::KEY_HEADER;
use crate::identity::client_scope;
use crate::key::parse_key;

use crate::problem::Problem;
use crate::protocol::{
    encode_frame, AbandonRequestRef, Attempt, ClaimRequestRef, FenceRequestRef, FingerprintHex, ScopeRef,
    ABANDON_PATH, CLAIM_PATH, MARK_UNKNOWN_PATH, RELEASE_PATH,
};
use crate::scope::Scope;
use crate::store_call::{decided, refusal, settled, StoreAnswer, StoreCall};
use crate::trace::Trace;
use crate::Reply;

mod capture;
mod claimed;
mod detached;
mod head;
mod step;

pub use crate::origin::Origin;
pub use head::{request_head, response_head, upstream_call, RequestHead, ResponseHead};
pub use step::{Left, Step, UpstreamAnswer, UpstreamCall};

enum Phase {
    /// Not ours to dedupe: everything flows untouched.
    Passing,
    /// We answered locally; our own reply must not be treated as the upstream's.
    Answered,
    ReadingBody {
        fingerprint: Fingerprinter,
        seen: usize,
    },
    Claiming,
    Forwarded {
        fence: u64,
    },
    /// The filter's own upstream request is in flight (detached forwarding).
    Detached {
        fence: u64,
    },
    Capturing {
        fence: u64,
        status: u16,
        headers: Vec<(String, String)>,
        /// The complete call's frame for a kept body, written as the body
        /// comes: its metadata line, then the body so far. Empty when the
        /// response's headers already decided that the body is not kept.
        frame: Vec<u8>,
        /// Where the body starts in `frame`.
        body_at: usize,
        /// The response's `Content-Length`, when it announced one.
        announced: Option<u64>,
        /// What its headers' `Idempotency-Control` said (a gRPC response is
        /// decided at its trailers).
        control: Option<crate::headers::Control>,
    },
    /// A complete / release / mark-unknown call is in flight.
    Settling {
        settles: Settlement,
    },
    Done,
}

pub struct Exchange {
    config: Rc<Config>,
    policy: Rc<Policy>,
    /// Names this request's claim, so it can be abandoned unseen.
    attempt: Attempt,
    /// Names the request on the store's log lines for its calls.
    trace: Trace,
    scope: Option<Scope>,
    phase: Phase,
    /// This request's mode: the policy's, or under a canary, what it picks.
    mode: Mode,
    handling: Handling,
    /// See [`Exchange::reason`].
    reason: Option<Handling>,
    settlement: Option<Settlement>,
    /// The valid key as an sf-string, echoed on every answer.
    echo: Option<String>,
    /// The store refused a frame with a final problem of its own
    /// ([`refusal`]): status and its detail.
    refusal: Option<(u16, String)>,
    /// Detached forwarding: the request to send once the key is ours.
    upstream: Option<UpstreamCall>,
    /// Detached forwarding: the answer for the client, sent once the store
    /// has settled the record.
    relay: Option<Reply>,
    /// The settling call in flight, handed to the worker's letters if the
    /// store itself does not decide it ([`decided`]): the outcome is
    /// known, so it is delivered rather than left to the lease.
    redeliver: Option<StoreCall>,
}

impl Exchange {
    /// Starts the exchange from the request headers; `attempt` must be unique
    /// to this request (the filter draws it at random).
    pub fn begin(
        config: Rc<Config>,
        policy: Rc<Policy>,
        head: RequestHead,
        attempt: Attempt,
    ) -> (Exchange, Step) {
        let mut ex = Exchange {
            config,
            policy,
            attempt,
            trace: head.trace.clone(),
            scope: None,
            phase: Phase::Passing,
            mode: Mode::Enforce,
            handling: Handling::Passed,
            reason: None,
            settlement: None,
            echo: None,
            refusal: None,
            upstream: None,
            relay: None,
            redeliver: None,
        };
        let step = ex.start(head);
        (ex, step)
    }

    /// The claim attempt id naming this request in logs: random, so it says
    /// nothing about the key, and the store keeps it in the record's history
    /// (an operator finds the record by it there).
    pub fn attempt(&self) -> &Attempt {
        &self.attempt
    }

    /// `call`, to be delivered by the worker's store client: it settles
    /// this exchange's record as [`Exchange::settlement`] says.
    pub fn letter(&self, call: StoreCall) -> Letter {
        Letter {
            call,
            settles: self.settlement().unwrap_or(Settlement::Failed),
            policy: self.policy_name().to_string(),
            attempt: self.attempt.clone(),
        }
    }

    pub fn handling(&self) -> Handling {
        self.handling
    }

    /// In observe mode, the answer enforce mode would have given instead of
    /// forwarding (the reason of a `would_conflict` or `would_reject`).
    pub fn reason(&self) -> Option<Handling> {
        self.reason
    }

    /// The name of the policy covering the request (a label of the metrics).
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    pub fn settlement(&self) -> Option<Settlement> {
        self.settlement
    }

    /// The `Idempotency-Key` value every answer to this request carries: the
    /// valid key as an sf-string, `None` when the request had no valid key.
    pub fn key_echo(&self) -> Option<&str> {
        self.echo.as_deref()
    }

    /// A store refusal seen since the last call: `(status, detail)`, for the
    /// filter to log and count as a configuration error.
    pub fn take_store_refusal(&mut self) -> Option<(u16, String)> {
        self.refusal.take()
    }

    /// Whether the exchange must go on when the client leaves: the filter's
    /// own upstream request, or the store call recording its outcome, is in
    /// flight, and that outcome must still reach the store.
    pub fn outlives_client(&self) -> bool {
        matches!(self.phase, Phase::Detached { .. } | Phase::Settling { .. })
    }

    /// Whether the response path should run at all (and strip `Idempotency-Control`).
    pub fn owns_response(&self) -> bool {
        matches!(
            self.phase,
            Phase::Forwarded { .. } | Phase::Capturing { .. } | Phase::Settling { .. }
        )
    }

    fn start(&mut self, head: RequestHead) -> Step {
        self.mode = self.policy.mode_for(head.tenant.as_deref(), None);
        let fields: Vec<&[u8]> = head.key_fields.iter().map(Vec::as_slice).collect();
        let key = match parse_key(&fields, self.policy.key_rules()) {
            Ok(Some(key)) => {
                self.echo = Some(key.to_sf_string());
                key
            }
            Ok(None) if self.policy.require_key() => {
                let problem = Problem::key_missing(&head.method, self.policy.name());
                return self.reject(Handling::Missing, problem);
            }
            Ok(None) => return Step::Continue,
            Err(e) => return self.reject(Handling::Invalid, Problem::key_invalid(e)),
        };
        let scope = client_scope(
            self.policy.identity(),
            self.policy.name(),
            head.tenant.as_deref(),
            head.principal.as_deref(),
            key,
        );
        match scope {
            Ok(scope) => {
                self.mode = self.policy.mode_for(head.tenant.as_deref(), Some(&scope));
                self.scope = Some(scope);
            }
            Err(e) => return self.reject(Handling::IdentityMissing, Problem::identity_missing(e)),
        }
        if head
            .content_length
            .is_some_and(|n| n > self.policy.max_request_body() as u64)
        {
            return self.too_large();
        }
        let fingerprint = Fingerprinter::new(
            self.policy.fingerprint(),
            &head.method,
            self.policy.name(),
            &head.path,
            &head.fingerprint_headers,
        );
        // Observing never changes how traffic flows.
        self.upstream = head.upstream.filter(|_| self.mode == Mode::Enforce);
        if head.end_of_stream {
            return self.claim(fingerprint);
        }
        self.phase = Phase::ReadingBody { fingerprint, seen: 0 };
        Step::Pause
    }

    /// A chunk of the request body (empty with `end_of_stream` for trailers).
    pub fn request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Step {
        let Phase::ReadingBody { fingerprint, seen } = &mut self.phase else {
            return Step::Continue;
        };
        *seen += chunk.len();
        if *seen > self.policy.max_request_body() {
            return self.too_large();
        }
        fingerprint.push(chunk);
        if !end_of_stream {
            return Step::Pause;
        }
        match std::mem::replace(&mut self.phase, Phase::Claiming) {
            Phase::ReadingBody { fingerprint, .. } => self.claim(fingerprint),
            _ => Step::Continue,
        }
    }

    fn claim(&mut self, fingerprint: Fingerprinter) -> Step {
        let Some(scope) = self.scope_ref() else {
            return Step::Continue;
        };
        let wait_ms = match self.policy.in_flight() {
            InFlight::Conflict => 0,
            InFlight::Wait { max_ms } => max_ms,
        };
        let request = ClaimRequestRef {
            scope,
            fingerprint: fingerprint.finish().map(FingerprintHex),
            lease_ms: self.policy.lease_ms(),
            ttl_ms: self.policy.ttl_ms(),
            wait_ms,
            after_expiry: self.policy.after_expiry(),
            on_unknown: self.policy.on_unknown(),
            attempt: Some(self.attempt.as_str()),
            // The store must not commit a claim after we stopped waiting for it.
            deadline_ms: self.timeout_ms(wait_ms),
        };
        let call = self.call(CLAIM_PATH, encode_frame(&request, &[]), wait_ms);
        self.phase = Phase::Claiming;
        Step::Call(call)
    }

    /// The scope as the frames write it, borrowed.
    fn scope_ref(&self) -> Option<ScopeRef<'_>> {
        self.scope.as_ref().map(ScopeRef::from)
    }

    /// The store answered (or failed to answer) the call last returned.
    pub fn store_reply(&mut self, answer: StoreAnswer) -> Step {
        self.refusal = refusal(&answer);
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Claiming => self.claimed(answer),
            Phase::Settling { settles } => {
                let relay = self.relay.take().map_or(Step::Continue, Step::Respond);
                let confirmed = settled(&answer);
                self.settlement = Some(if confirmed { settles } else { Settlement::Failed });
                match self.redeliver.take() {
                    // The outcome is known: the worker's store client sends
                    // it until the store has it, rather than the lease
                    // turning it unknown.
                    Some(call) if !decided(&answer) => {
                        self.settlement = Some(settles);
                        Step::Deliver(call, Box::new(relay))
                    }
                    _ => relay,
                }
            }
            other => {
                self.phase = other;
                Step::Continue
            }
        }
    }

    fn settle(&mut self, fence: u64, settles: Settlement) -> Step {
        match self.settle_call(fence, settles) {
            Some(call) => self.settling(call, settles),
            None => Step::Continue,
        }
    }

    /// Sends the call that settles the record: the response waits for the
    /// store's answer, or with `settle: background` goes on at once while
    /// the worker's store client delivers the call.
    fn settling(&mut self, call: StoreCall, settles: Settlement) -> Step {
        if self.policy.settle() == Settle::Background {
            self.settlement = Some(settles);
            self.phase = Phase::Done;
            return Step::Deliver(call, Box::new(Step::Continue));
        }
        self.phase = Phase::Settling { settles };
        self.redeliver = Some(call.clone());
        Step::Call(call)
    }

    fn settle_call(&self, fence: u64, settles: Settlement) -> Option<StoreCall> {
        let path = match settles {
            Settlement::Released => RELEASE_PATH,
            Settlement::MarkedUnknown => MARK_UNKNOWN_PATH,
            Settlement::Completed | Settlement::Abandoned | Settlement::Failed => return None,
        };
        let request = FenceRequestRef {
            scope: self.scope_ref()?,
            fence,
        };
        Some(self.call(path, encode_frame(&request, &[]), 0))
    }

    /// The client has left (Envoy's `on_log`), while a callout of this
    /// exchange is in flight (`waiting`) or not. The exchange goes on if its
    /// outcome must still reach the store ([`Exchange::outlives_client`]);
    /// otherwise it ends, with the letter settling what it left open.
    pub fn client_left(&mut self, waiting: bool) -> Left {
        if waiting && self.outlives_client() {
            return Left::GoesOn;
        }
        Left::Ended(self.finish().map(|call| self.letter(call)))
    }

    /// The stream is over (Envoy's `on_log`). Returns the call, for the
    /// worker's store client, that settles what was left open: a claim still
    /// in flight is abandoned (nothing was forwarded); if the upstream had the
    /// request and its response never fully came back, nobody knows whether
    /// it acted, and the record is marked unknown.
    pub fn finish(&mut self) -> Option<StoreCall> {
        let (call, settles) = match self.phase {
            Phase::Claiming => (self.abandon_call(), Settlement::Abandoned),
            Phase::Forwarded { fence } | Phase::Detached { fence } | Phase::Capturing { fence, .. } => (
                self.settle_call(fence, Settlement::MarkedUnknown),
                Settlement::MarkedUnknown,
            ),
            _ => return None,
        };
        self.phase = Phase::Done;
        self.settlement = Some(settles);
        call
    }

    fn abandon_call(&self) -> Option<StoreCall> {
        let request = AbandonRequestRef {
            scope: self.scope_ref()?,
            attempt: self.attempt.as_str(),
        };
        Some(self.call(ABANDON_PATH, encode_frame(&request, &[]), 0))
    }

    fn call(&self, path: &'static str, body: Vec<u8>, extra_ms: u64) -> StoreCall {
        StoreCall {
            path,
            body,
            traces: vec![self.trace.clone()],
            timeout_ms: self.timeout_ms(extra_ms),
            may_wait: extra_ms > 0,
        }
    }

    /// How long the filter waits for a store call that may itself wait `extra_ms`.
    fn timeout_ms(&self, extra_ms: u64) -> u64 {
        self.config.store().timeout_ms().saturating_add(extra_ms)
    }

    /// Answer with a problem, or in observe mode note what would have happened
    /// and let the request through.
    fn reject(&mut self, handling: Handling, problem: Problem) -> Step {
        if self.mode == Mode::Observe {
            let would = handling.observed();
            if would != handling {
                self.reason = Some(handling);
            }
            return self.pass(would);
        }
        self.handling = handling;
        self.phase = Phase::Answered;
        Step::Respond(self.problem(problem))
    }

    /// A problem as this request's answer (a gRPC status on a gRPC call),
    /// with the key echoed.
    fn problem(&self, problem: Problem) -> Reply {
        self.with_key(match self.policy.grpc() {
            Some(_) => grpc::answer(&problem),
            None => problem.render(self.config.doc_base()),
        })
    }

    /// `reply` with the key echoed.
    fn with_key(&self, mut reply: Reply) -> Reply {
        reply
            .headers
            .extend(self.echo.clone().map(|key| (KEY_HEADER.into(), key)));
        reply
    }

    /// What the settling call in flight (or handed to the store client) settles.
    fn settling_as(&self) -> Option<Settlement> {
        match self.phase {
            Phase::Settling { settles } => Some(settles),
            _ => self.settlement,
        }
    }

    fn pass(&mut self, handling: Handling) -> Step {
        self.handling = handling;
        self.phase = Phase::Passing;
        Step::Continue
    }

    fn too_large(&mut self) -> Step {
        self.reject(
            Handling::TooLarge,
            Problem::body_too_large(self.policy.max_request_body()),
        )
    }
}

#[cfg(test)]
mod tests;
