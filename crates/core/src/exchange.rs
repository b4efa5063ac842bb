//! The filter's brain: one [`Exchange`] per request covered by a policy.
//!
//! Sans-IO: the filter feeds in what Envoy tells it (request head, body chunks,
//! store replies, the upstream's response, the end of the stream) and carries out
//! the [`Step`] it gets back. Every decision of semantics §4 and §5 is made here
//! and tested with plain values.
//!
//! Once the exchange has answered on its own ([`Step::Respond`]) it ignores the
//! rest of the stream: Envoy runs our own local reply back through the response
//! callbacks, and that must never be completed as if the upstream had sent it.

use std::rc::Rc;

use crate::config::{Config, FailureMode, Identity, InFlight, Mode, Policy};
use crate::fingerprint::Fingerprinter;
use crate::headers::{self, Control, KEY_HEADER};
use crate::key::{parse_key, KeyError};
use crate::limits;
use crate::problem::{Problem, ProblemKind};
use crate::protocol::{
    decode_frame, encode_frame, AbandonRequest, Attempt, ClaimReply, ClaimRequest, CompleteRequest,
    FenceReply, FenceRequest, ABANDON_PATH, CLAIM_PATH, COMPLETE_PATH, MARK_UNKNOWN_PATH, RELEASE_PATH,
};
use crate::scope::{Namespace, Scope, EVERYONE};
use crate::Reply;

/// What the filter must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Let the stream go on (resume it if it was held).
    Continue,
    /// Hold the stream: more input is needed.
    Pause,
    /// Send this to the store and hold the stream until its reply arrives.
    Call(StoreCall),
    /// Answer the client locally; the exchange is over.
    Respond(Reply),
    /// Hand this call to the worker's store client, which sends it whether or
    /// not the request is still there and retries it until the store answers;
    /// then carry out the next step.
    Deliver(StoreCall, Box<Step>),
}

/// A `POST` to the store: the filter adds `:authority`, `authorization` and
/// `content-type` from the [`crate::config::StoreConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreCall {
    pub path: &'static str,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// What the filter found in the request headers, read according to the policy.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    /// Path with query.
    pub path: String,
    /// Raw values of every `Idempotency-Key` field line.
    pub key_fields: Vec<Vec<u8>>,
    /// From the policy's tenant source; `None` when absent.
    pub tenant: Option<Vec<u8>>,
    pub principal: Option<Vec<u8>>,
    /// The policy's fingerprint headers that are present, in policy order.
    pub fingerprint_headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    /// The request has no body.
    pub end_of_stream: bool,
}

pub use crate::origin::Origin;

#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub status: u16,
    pub origin: Origin,
    pub headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    pub end_of_stream: bool,
}

/// The store's answer to a call: status and body, or no answer at all (reset,
/// timeout, dispatch failure).
pub type StoreAnswer = Option<(u16, Vec<u8>)>;

/// How the request was classified, for metrics (`as_str` is the metric name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Owned,
    Replayed,
    Conflict,
    Mismatch,
    Missing,
    Invalid,
    TooLarge,
    IdentityMissing,
    Expired,
    Unknown,
    StoreError,
    FailOpen,
    WouldReplay,
    WouldConflict,
    WouldReject,
}

impl Outcome {
    pub const ALL: [Outcome; 16] = [
        Outcome::Passed,
        Outcome::Owned,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::Missing,
        Outcome::Invalid,
        Outcome::TooLarge,
        Outcome::IdentityMissing,
        Outcome::Expired,
        Outcome::Unknown,
        Outcome::StoreError,
        Outcome::FailOpen,
        Outcome::WouldReplay,
        Outcome::WouldConflict,
        Outcome::WouldReject,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::Owned => "owned",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Missing => "missing",
            Outcome::Invalid => "invalid",
            Outcome::TooLarge => "too_large",
            Outcome::IdentityMissing => "identity_missing",
            Outcome::Expired => "expired",
            Outcome::Unknown => "unknown",
            Outcome::StoreError => "store_error",
            Outcome::FailOpen => "fail_open",
            Outcome::WouldReplay => "would_replay",
            Outcome::WouldConflict => "would_conflict",
            Outcome::WouldReject => "would_reject",
        }
    }
}

/// What became of an owned request's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    Completed,
    Released,
    MarkedUnknown,
    /// The claim was given up before anything was forwarded (its answer
    /// never came, or the client left while it was in flight).
    Abandoned,
    /// The store refused (stale fence) or could not be reached; the lease will
    /// turn the record unknown.
    Failed,
}

impl Settlement {
    pub const ALL: [Settlement; 5] = [
        Settlement::Completed,
        Settlement::Released,
        Settlement::MarkedUnknown,
        Settlement::Abandoned,
        Settlement::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Settlement::Completed => "completed",
            Settlement::Released => "released",
            Settlement::MarkedUnknown => "marked_unknown",
            Settlement::Abandoned => "abandoned",
            Settlement::Failed => "settle_failed",
        }
    }
}

enum State {
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
    Capturing {
        fence: u64,
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// A complete / release / mark-unknown call is in flight.
    Settling {
        as_: Settlement,
    },
    Done,
}

pub struct Exchange {
    config: Rc<Config>,
    policy: Rc<Policy>,
    /// Names this request's claim, so it can be abandoned unseen.
    attempt: Attempt,
    scope: Option<Scope>,
    state: State,
    outcome: Outcome,
    settlement: Option<Settlement>,
    /// The valid key as an sf-string, echoed on every answer.
    echo: Option<String>,
    /// The store refused a frame with a 4xx: status and its problem detail.
    refusal: Option<(u16, String)>,
}

/// Whether the store confirmed a complete, release or mark-unknown call.
pub fn settled(answer: &StoreAnswer) -> bool {
    matches!(answer, Some((200, body)) if serde_json::from_slice::<FenceReply>(body).ok() == Some(FenceReply::Done))
}

/// A 4xx from the store means it refused the frame itself (a limit, the
/// credential, the API version): a deployment error, not an outage. 409 is
/// the store's ordinary "stale fence" answer.
pub fn refusal(answer: &StoreAnswer) -> Option<(u16, String)> {
    match answer {
        Some((status @ 400..=499, body)) if *status != 409 => {
            let detail = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_string))
                .unwrap_or_default();
            Some((*status, detail))
        }
        _ => None,
    }
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
            scope: None,
            state: State::Passing,
            outcome: Outcome::Passed,
            settlement: None,
            echo: None,
            refusal: None,
        };
        let step = ex.start(head);
        (ex, step)
    }

    /// A short hash naming the record in logs (never the raw key).
    pub fn log_id(&self) -> Option<String> {
        self.scope.as_ref().map(Scope::log_id)
    }

    pub fn outcome(&self) -> Outcome {
        self.outcome
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

    /// Whether the response path should run at all (and strip `Idempotency-Control`).
    pub fn owns_response(&self) -> bool {
        matches!(
            self.state,
            State::Forwarded { .. } | State::Capturing { .. } | State::Settling { .. }
        )
    }

    fn start(&mut self, head: RequestHead) -> Step {
        let fields: Vec<&[u8]> = head.key_fields.iter().map(Vec::as_slice).collect();
        let key = match parse_key(&fields, &self.policy.key_rules) {
            Ok(Some(key)) => {
                self.echo = Some(key.to_sf_string());
                key
            }
            Ok(None) if self.policy.require_key => {
                return self.reject(Outcome::Missing, Problem::new(ProblemKind::KeyMissing, format!(
                    "{} {} requires an Idempotency-Key header, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\"",
                    head.method, self.policy.name
                )));
            }
            Ok(None) => return Step::Continue,
            Err(e) => return self.reject(Outcome::Invalid, key_problem(&e)),
        };
        let (tenant, principal) = match identity(&self.policy.identity, &head) {
            Ok(ids) => ids,
            Err(detail) => {
                return self.reject(
                    Outcome::IdentityMissing,
                    Problem::new(ProblemKind::IdentityMissing, detail),
                )
            }
        };
        let scope = match Scope::new(&tenant, &principal, &self.policy.name, Namespace::Client, key) {
            Ok(scope) => scope,
            Err(_) => {
                return self.reject(
                    Outcome::IdentityMissing,
                    Problem::new(ProblemKind::IdentityMissing, "the request's identity is not usable: it must be 1-255 characters without control characters"),
                );
            }
        };
        self.scope = Some(scope);
        if head
            .content_length
            .is_some_and(|n| n > self.policy.max_request_body as u64)
        {
            return self.too_large();
        }
        let fingerprint = Fingerprinter::new(
            &self.policy.fingerprint,
            &head.method,
            &self.policy.name,
            &head.path,
            &head.fingerprint_headers,
        );
        if head.end_of_stream {
            return self.claim(fingerprint);
        }
        self.state = State::ReadingBody { fingerprint, seen: 0 };
        Step::Pause
    }

    /// A chunk of the request body (empty with `end_of_stream` for trailers).
    pub fn request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Step {
        let State::ReadingBody { fingerprint, seen } = &mut self.state else {
            return Step::Continue;
        };
        *seen += chunk.len();
        if *seen > self.policy.max_request_body {
            return self.too_large();
        }
        fingerprint.push(chunk);
        if !end_of_stream {
            return Step::Pause;
        }
        match std::mem::replace(&mut self.state, State::Claiming) {
            State::ReadingBody { fingerprint, .. } => self.claim(fingerprint),
            _ => Step::Continue,
        }
    }

    fn claim(&mut self, fingerprint: Fingerprinter) -> Step {
        let Some(scope) = self.scope.clone() else {
            return Step::Continue;
        };
        let wait_ms = match self.policy.in_flight {
            InFlight::Conflict => 0,
            InFlight::Wait { max_ms } => max_ms,
        };
        let mut request = ClaimRequest {
            scope,
            fingerprint: fingerprint.finish(),
            lease_ms: self.policy.lease_ms,
            ttl_ms: self.policy.ttl_ms,
            wait_ms,
            after_expiry: self.policy.after_expiry,
            on_unknown: self.policy.on_unknown,
            attempt: Some(self.attempt.clone()),
            deadline_ms: 0,
        };
        // The store must not commit a claim after we stopped waiting for it.
        request.deadline_ms = self.call(CLAIM_PATH, Vec::new(), wait_ms).timeout_ms;
        self.state = State::Claiming;
        Step::Call(self.call(CLAIM_PATH, encode_frame(&request, &[]), wait_ms))
    }

    /// The store answered (or failed to answer) the call last returned.
    pub fn store_reply(&mut self, answer: StoreAnswer) -> Step {
        self.refusal = refusal(&answer);
        match std::mem::replace(&mut self.state, State::Done) {
            State::Claiming => self.claimed(answer),
            State::Settling { as_ } => {
                self.settlement = Some(if settled(&answer) { as_ } else { Settlement::Failed });
                Step::Continue
            }
            other => {
                self.state = other;
                Step::Continue
            }
        }
    }

    fn claimed(&mut self, answer: StoreAnswer) -> Step {
        // A store that refused the frame (4xx) wrote nothing; any other
        // failure may have lost the answer to a committed claim.
        let refused = self.refusal.is_some();
        let reply = match answer {
            Some((200, body)) => decode_frame::<ClaimReply>(&body)
                .map(|(meta, bytes)| (meta, bytes.to_vec()))
                .ok(),
            _ => None,
        };
        let Some((reply, body)) = reply else {
            // The store may have committed the claim and lost only its answer:
            // abandon it, so the retry the problem invites is a first request.
            let next = match self.policy.failure_mode {
                FailureMode::Open => self.pass(Outcome::FailOpen),
                FailureMode::Closed => self.reject(
                    Outcome::StoreError,
                    Problem::new(ProblemKind::StoreUnavailable, "the idempotency store could not be reached; the request was not forwarded, retry later with the same key").retry_after(1),
                ),
            };
            if refused {
                return next;
            }
            self.settlement = Some(Settlement::Abandoned);
            return match self.abandon_call() {
                Some(call) => Step::Deliver(call, Box::new(next)),
                None => next,
            };
        };
        match reply {
            ClaimReply::Owned { fence } => {
                self.outcome = Outcome::Owned;
                self.state = State::Forwarded { fence };
                Step::Continue
            }
            ClaimReply::Replay { status, headers, .. } => {
                if self.policy.mode == Mode::Observe {
                    return self.pass(Outcome::WouldReplay);
                }
                self.outcome = Outcome::Replayed;
                self.state = State::Answered;
                let mut headers: Vec<(String, String)> =
                    headers.into_iter().filter(|(name, _)| self.policy.replays_header(name)).collect();
                headers.push(("idempotent-replayed".into(), "true".into()));
                headers.extend(self.echo.clone().map(|key| (KEY_HEADER.into(), key)));
                Step::Respond(Reply { status, headers, body })
            }
            ClaimReply::ResultUnavailable { original_status, completed_at } => self.reject(
                Outcome::Conflict,
                Problem::new(ProblemKind::ResultUnavailable, "this key's request was completed, but its response was too large to keep for replay")
                    .original_status(original_status)
                    .completed_at(Some(completed_at)),
            ),
            ClaimReply::InProgress { retry_after_ms } => self.reject(
                Outcome::Conflict,
                Problem::new(ProblemKind::RequestInProgress, "a request with this key is still being processed; retry after the indicated time")
                    .retry_after(retry_after_ms.div_ceil(1000)),
            ),
            ClaimReply::Mismatch => self.reject(
                Outcome::Mismatch,
                Problem::new(ProblemKind::KeyReused, "this key was already used for a different request; use a new key for a new request"),
            ),
            ClaimReply::Unknown => self.reject(
                Outcome::Unknown,
                Problem::new(ProblemKind::OutcomeUnknown, "the outcome of the request first sent with this key is unknown; reconcile before retrying with a new key"),
            ),
            ClaimReply::Expired { completed_at } => self.reject(
                Outcome::Expired,
                Problem::new(ProblemKind::KeyExpired, "this key has expired; if the original request must be repeated, send it with a new key")
                    .completed_at(completed_at),
            ),
        }
    }

    /// The response headers. Only an owned request's response is captured.
    pub fn response_headers(&mut self, head: ResponseHead) -> Step {
        let State::Forwarded { fence } = self.state else {
            return Step::Continue;
        };
        match head.origin {
            Origin::NeverReached => return self.settle(fence, Settlement::Released),
            Origin::LostAfterForwarding => return self.settle(fence, Settlement::MarkedUnknown),
            Origin::Upstream => {}
        }
        let control = headers::control(&head.headers);
        match control {
            Some(Control::NoStore) => return self.settle(fence, Settlement::Released),
            Some(Control::Uncertain) => return self.settle(fence, Settlement::MarkedUnknown),
            Some(Control::Store) => {}
            None if self.policy.releases_on(head.status) => return self.settle(fence, Settlement::Released),
            None => {}
        }
        let headers: Vec<(String, String)> = head
            .headers
            .into_iter()
            .filter(|(name, _)| self.policy.replays_header(name))
            .filter_map(|(name, value)| {
                String::from_utf8(value)
                    .ok()
                    .map(|v| (name.to_ascii_lowercase(), v))
            })
            .collect();
        // Headers the store would refuse: keep the outcome, not the response
        // (a retry gets result-unavailable rather than a partial replay).
        let keepable =
            headers.len() <= limits::MAX_HEADERS && headers.iter().all(|(n, v)| limits::header_fits(n, v));
        self.state = State::Capturing {
            fence,
            status: head.status,
            headers: if keepable { headers } else { Vec::new() },
            body: Vec::new(),
        };
        if !keepable
            || head
                .content_length
                .is_some_and(|n| n > self.policy.max_stored_body as u64)
        {
            return self.complete(false);
        }
        if head.end_of_stream {
            return self.complete(true);
        }
        Step::Pause
    }

    /// A chunk of an owned response's body.
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Step {
        let kept = match &mut self.state {
            State::Capturing { body, .. } => body,
            // A call about this response is in flight: hold the rest until the
            // store has recorded it, so no client can retry before that.
            State::Settling { .. } => return Step::Pause,
            _ => return Step::Continue,
        };
        // Too large to keep: record the outcome without the body now, while
        // this chunk is held, and let the rest stream once that is done.
        if kept.len() + chunk.len() > self.policy.max_stored_body {
            return self.complete(false);
        }
        kept.extend_from_slice(chunk);
        if end_of_stream {
            self.complete(true)
        } else {
            Step::Pause
        }
    }

    fn complete(&mut self, body_stored: bool) -> Step {
        let State::Capturing {
            fence,
            status,
            headers,
            body,
        } = std::mem::replace(&mut self.state, State::Done)
        else {
            return Step::Continue;
        };
        let Some(scope) = self.scope.clone() else {
            return Step::Continue;
        };
        let request = CompleteRequest {
            scope,
            fence,
            status,
            headers,
            body_stored,
        };
        let kept: &[u8] = if body_stored { &body } else { &[] };
        self.state = State::Settling {
            as_: Settlement::Completed,
        };
        Step::Call(self.call(COMPLETE_PATH, encode_frame(&request, kept), 0))
    }

    fn settle(&mut self, fence: u64, as_: Settlement) -> Step {
        match self.settle_call(fence, as_) {
            Some(call) => {
                self.state = State::Settling { as_ };
                Step::Call(call)
            }
            None => Step::Continue,
        }
    }

    fn settle_call(&self, fence: u64, as_: Settlement) -> Option<StoreCall> {
        let path = match as_ {
            Settlement::Released => RELEASE_PATH,
            Settlement::MarkedUnknown => MARK_UNKNOWN_PATH,
            Settlement::Completed | Settlement::Abandoned | Settlement::Failed => return None,
        };
        let scope = self.scope.clone()?;
        Some(self.call(path, encode_frame(&FenceRequest { scope, fence }, &[]), 0))
    }

    /// The stream is over (Envoy's `on_log`). Returns the call, for the
    /// worker's store client, that settles what was left open: a claim still
    /// in flight is abandoned (nothing was forwarded); if the upstream had the
    /// request and its response never fully came back, nobody knows whether
    /// it acted, and the record is marked unknown.
    pub fn finish(&mut self) -> Option<StoreCall> {
        let (call, as_) = match self.state {
            State::Claiming => (self.abandon_call(), Settlement::Abandoned),
            State::Forwarded { fence } | State::Capturing { fence, .. } => (
                self.settle_call(fence, Settlement::MarkedUnknown),
                Settlement::MarkedUnknown,
            ),
            _ => return None,
        };
        self.state = State::Done;
        self.settlement = Some(as_);
        call
    }

    fn abandon_call(&self) -> Option<StoreCall> {
        let request = AbandonRequest {
            scope: self.scope.clone()?,
            attempt: self.attempt.clone(),
        };
        Some(self.call(ABANDON_PATH, encode_frame(&request, &[]), 0))
    }

    fn call(&self, path: &'static str, body: Vec<u8>, extra_ms: u64) -> StoreCall {
        StoreCall {
            path,
            body,
            timeout_ms: self.config.store.timeout_ms.saturating_add(extra_ms),
        }
    }

    /// Answer with a problem, or in observe mode note what would have happened
    /// and let the request through.
    fn reject(&mut self, outcome: Outcome, problem: Problem) -> Step {
        if self.policy.mode == Mode::Observe {
            let would = match outcome {
                Outcome::Conflict | Outcome::Unknown => Outcome::WouldConflict,
                Outcome::StoreError => Outcome::StoreError,
                _ => Outcome::WouldReject,
            };
            return self.pass(would);
        }
        self.outcome = outcome;
        self.state = State::Answered;
        let mut reply = problem.render(&self.config.doc_base);
        reply
            .headers
            .extend(self.echo.clone().map(|key| (KEY_HEADER.into(), key)));
        Step::Respond(reply)
    }

    fn pass(&mut self, outcome: Outcome) -> Step {
        self.outcome = outcome;
        self.state = State::Passing;
        Step::Continue
    }

    fn too_large(&mut self) -> Step {
        let max = self.policy.max_request_body;
        self.reject(
            Outcome::TooLarge,
            Problem::new(
                ProblemKind::BodyTooLarge,
                format!(
                    "the request body exceeds the {max}-byte limit for idempotent requests on this route"
                ),
            ),
        )
    }
}

fn key_problem(e: &KeyError) -> Problem {
    Problem::new(ProblemKind::KeyInvalid, e.to_string())
}

/// `(tenant, principal)` for the scope, or the problem's detail.
fn identity(identity: &Identity, head: &RequestHead) -> Result<(String, String), String> {
    let Identity::Sourced { principal, .. } = identity else {
        return Ok((EVERYONE.into(), EVERYONE.into()));
    };
    let read = |value: &Option<Vec<u8>>, what: &str| -> Result<String, String> {
        match value.as_deref() {
            None | Some([]) => {
                Err(format!("this route requires exactly one authenticated {what}, and the request carries none or several"))
            }
            Some(bytes) => String::from_utf8(bytes.to_vec()).map_err(|_| format!("the request's {what} is not valid UTF-8")),
        }
    };
    let tenant = read(&head.tenant, "tenant")?;
    let principal = match principal {
        Some(_) => read(&head.principal, "principal")?,
        None => EVERYONE.into(),
    };
    Ok((tenant, principal))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_frame, encode_frame};

    const CONFIG: &str = r#"{
        "store": {"cluster": "store", "token": "t"},
        "policies": [
            {"name": "pay", "match": {"path": {"prefix": "/pay"}}, "tenant": {"header": "x-tenant"}},
            {"name": "watch", "match": {"path": {"prefix": "/watch"}}, "anonymous": true, "mode": "observe"},
            {"name": "open", "match": {"path": {"prefix": "/open"}}, "anonymous": true, "failure_mode": "open"},
            {"name": "small", "match": {"path": {"prefix": "/small"}}, "anonymous": true,
             "max_request_body": 4, "max_stored_body": 4, "in_flight": "wait", "wait_max_ms": 300}
        ]}"#;

    fn begin(path: &str, key: Option<&str>, body: Option<&str>) -> (Exchange, Step) {
        let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap());
        let policy = config.policy_for("POST", "h", path).unwrap().clone();
        let head = RequestHead {
            method: "POST".into(),
            path: path.into(),
            key_fields: key.map(|k| vec![k.as_bytes().to_vec()]).unwrap_or_default(),
            tenant: Some(b"acme".to_vec()),
            end_of_stream: body.is_none(),
            ..RequestHead::default()
        };
        let (mut ex, step) = Exchange::begin(config, policy, head, attempt());
        match body {
            Some(body) if step == Step::Pause => {
                let step = ex.request_body(body.as_bytes(), true);
                (ex, step)
            }
            _ => (ex, step),
        }
    }

    fn attempt() -> Attempt {
        Attempt::try_from("attempt-1".to_string()).unwrap()
    }

    /// The abandon call a step hands to the store client, and the step after it.
    fn abandoning(step: Step) -> (AbandonRequest, Step) {
        let Step::Deliver(call, next) = step else {
            panic!("expected an abandon, got {step:?}")
        };
        assert_eq!(call.path, ABANDON_PATH);
        (decode_frame::<AbandonRequest>(&call.body).unwrap().0, *next)
    }

    fn claim_of(step: &Step) -> ClaimRequest {
        let Step::Call(call) = step else {
            panic!("expected a claim, got {step:?}")
        };
        assert_eq!(call.path, CLAIM_PATH);
        decode_frame::<ClaimRequest>(&call.body).unwrap().0
    }

    fn reply(reply: ClaimReply, body: &[u8]) -> StoreAnswer {
        Some((200, encode_frame(&reply, body)))
    }

    fn problem_slug(step: &Step) -> (u16, String) {
        let Step::Respond(reply) = step else {
            panic!("expected a reply, got {step:?}")
        };
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        (
            reply.status,
            body["type"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string(),
        )
    }

    fn upstream(status: u16, headers: &[(&str, &str)], end_of_stream: bool) -> ResponseHead {
        ResponseHead {
            status,
            origin: Origin::Upstream,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
            content_length: None,
            end_of_stream,
        }
    }

    fn owned(path: &str) -> Exchange {
        let (mut ex, step) = begin(path, Some("k1"), Some("{}"));
        claim_of(&step);
        assert_eq!(
            ex.store_reply(reply(ClaimReply::Owned { fence: 7 }, b"")),
            Step::Continue
        );
        ex
    }

    fn called_path(step: &Step) -> &'static str {
        let Step::Call(call) = step else {
            panic!("expected a call, got {step:?}")
        };
        call.path
    }

    #[test]
    fn a_request_without_a_required_key_is_answered_400_key_missing() {
        assert_eq!(
            problem_slug(&begin("/pay", None, None).1),
            (400, "key-missing".into())
        );
    }

    #[test]
    fn a_malformed_key_is_answered_400_key_invalid() {
        assert_eq!(
            problem_slug(&begin("/pay", Some("a b"), None).1),
            (400, "key-invalid".into())
        );
    }

    #[test]
    fn a_missing_tenant_is_answered_400_identity_missing() {
        let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap());
        let policy = config.policies[0].clone();
        let head = RequestHead {
            key_fields: vec![b"k".to_vec()],
            end_of_stream: true,
            ..RequestHead::default()
        };
        let (_, step) = Exchange::begin(config, policy, head, attempt());
        assert_eq!(problem_slug(&step), (400, "identity-missing".into()));
    }

    #[test]
    fn the_body_is_read_before_the_claim_and_fingerprinted() {
        let (_, a) = begin("/pay", Some("k"), Some(r#"{"a":1,"b":2}"#));
        let (_, b) = begin("/pay", Some("k"), Some(r#"{ "b":2, "a":1.0 }"#));
        let (_, c) = begin("/pay", Some("k"), Some(r#"{"a":1,"b":3}"#));
        assert_eq!(claim_of(&a).fingerprint, claim_of(&b).fingerprint);
        assert_ne!(claim_of(&a).fingerprint, claim_of(&c).fingerprint);
        assert_eq!(claim_of(&a).scope.tenant(), "acme");
    }

    #[test]
    fn a_body_over_the_limit_is_answered_413() {
        assert_eq!(
            problem_slug(&begin("/small", Some("k"), Some("12345")).1),
            (413, "body-too-large".into())
        );
    }

    #[test]
    fn a_wait_policy_asks_the_store_to_wait_and_extends_the_call_timeout() {
        let (_, step) = begin("/small", Some("k"), Some("{}"));
        assert_eq!(claim_of(&step).wait_ms, 300);
        let Step::Call(call) = step else { unreachable!() };
        assert_eq!(call.timeout_ms, 1300);
    }

    #[test]
    fn store_verdicts_map_to_the_contract_answers() {
        let cases: [(ClaimReply, u16, &str); 5] = [
            (ClaimReply::Mismatch, 422, "key-reused"),
            (
                ClaimReply::InProgress { retry_after_ms: 1500 },
                409,
                "request-in-progress",
            ),
            (ClaimReply::Unknown, 409, "outcome-unknown"),
            (
                ClaimReply::Expired {
                    completed_at: Some(0),
                },
                422,
                "key-expired",
            ),
            (
                ClaimReply::ResultUnavailable {
                    original_status: 201,
                    completed_at: 0,
                },
                409,
                "result-unavailable",
            ),
        ];
        for (verdict, status, slug) in cases {
            let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
            let step = ex.store_reply(reply(verdict, b""));
            assert_eq!(problem_slug(&step), (status, slug.to_string()));
            // Our own reply coming back through the response path is ignored.
            assert_eq!(ex.response_headers(upstream(status, &[], true)), Step::Continue);
            assert_eq!(ex.finish(), None);
        }
    }

    #[test]
    fn in_progress_carries_retry_after_rounded_up_and_unknown_carries_none() {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let Step::Respond(busy) = ex.store_reply(reply(ClaimReply::InProgress { retry_after_ms: 1001 }, b""))
        else {
            panic!()
        };
        assert!(busy.headers.contains(&("retry-after".into(), "2".into())));
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let Step::Respond(unknown) = ex.store_reply(reply(ClaimReply::Unknown, b"")) else {
            panic!()
        };
        assert!(!unknown.headers.iter().any(|(n, _)| n == "retry-after"));
    }

    #[test]
    fn a_replay_sends_the_stored_response_with_only_allowlisted_headers() {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let stored = ClaimReply::Replay {
            status: 201,
            headers: vec![
                ("location".into(), "/p/1".into()),
                ("set-cookie".into(), "s=1".into()),
            ],
            completed_at: 1,
        };
        let Step::Respond(r) = ex.store_reply(reply(stored, b"{\"id\":1}")) else {
            panic!()
        };
        assert_eq!((r.status, r.body.as_slice()), (201, b"{\"id\":1}".as_slice()));
        assert_eq!(
            r.headers,
            vec![
                ("location".into(), "/p/1".into()),
                ("idempotent-replayed".into(), "true".into()),
                ("idempotency-key".into(), "\"k\"".into())
            ]
        );
        assert_eq!(ex.outcome(), Outcome::Replayed);
    }

    fn header<'a>(step: &'a Step, name: &str) -> Option<&'a str> {
        let Step::Respond(reply) = step else {
            panic!("expected a reply, got {step:?}")
        };
        reply
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn every_answer_to_a_valid_key_echoes_it_as_an_sf_string() {
        // Problems after the key was read.
        let (mut ex, _) = begin("/pay", Some("\"k-1\""), Some("{}"));
        assert_eq!(ex.key_echo(), Some("\"k-1\""));
        let step = ex.store_reply(reply(ClaimReply::Mismatch, b""));
        assert_eq!(header(&step, "idempotency-key"), Some("\"k-1\""));
        let (_, step) = begin("/small", Some("k-2"), Some("12345"));
        assert_eq!(header(&step, "idempotency-key"), Some("\"k-2\""));
        // Forwarded: the filter echoes it on the upstream's answer.
        assert_eq!(owned("/pay").key_echo(), Some("\"k1\""));
        // No valid key, nothing to echo.
        let (ex, step) = begin("/pay", Some("a b"), None);
        assert_eq!(header(&step, "idempotency-key"), None);
        assert_eq!(ex.key_echo(), None);
        let (ex, _) = begin("/pay", None, None);
        assert_eq!(ex.key_echo(), None);
    }

    #[test]
    fn a_store_4xx_is_reported_once_as_a_refusal_and_still_fails_closed() {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let refused = Some((400, br#"{"detail":"ttl_ms must be between 1 and 9"}"#.to_vec()));
        assert_eq!(
            problem_slug(&ex.store_reply(refused)),
            (503, "store-unavailable".into())
        );
        assert_eq!(
            ex.take_store_refusal(),
            Some((400, "ttl_ms must be between 1 and 9".to_string()))
        );
        assert_eq!(ex.take_store_refusal(), None);
        // An outage is not a refusal, nor is a stale fence.
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        ex.store_reply(Some((503, vec![])));
        assert_eq!(ex.take_store_refusal(), None);
        let mut ex = owned("/pay");
        ex.response_headers(upstream(200, &[], true));
        ex.store_reply(Some((409, br#"{"outcome":"stale"}"#.to_vec())));
        assert_eq!(ex.take_store_refusal(), None);
    }

    #[test]
    fn errors_before_execution_release_unless_the_upstream_says_store() {
        for status in [400, 401, 403, 422] {
            let mut ex = owned("/pay");
            assert_eq!(
                called_path(&ex.response_headers(upstream(status, &[], true))),
                RELEASE_PATH
            );
        }
        let mut ex = owned("/pay");
        let step = ex.response_headers(upstream(401, &[("idempotency-control", "store")], true));
        assert_eq!(called_path(&step), COMPLETE_PATH);
        let Step::Call(call) = step else { unreachable!() };
        assert_eq!(decode_frame::<CompleteRequest>(&call.body).unwrap().0.status, 401);
    }

    #[test]
    fn headers_the_store_would_refuse_complete_without_the_response() {
        let mut ex = owned("/pay");
        let long = "v".repeat(limits::MAX_HEADER_VALUE + 1);
        let step = ex.response_headers(upstream(201, &[("location", &long)], true));
        let Step::Call(call) = &step else {
            panic!("{step:?}")
        };
        let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
        assert_eq!(
            (done.status, done.body_stored, done.headers.len(), body.len()),
            (201, false, 0, 0)
        );
    }

    #[test]
    fn envoys_replies_that_never_reached_the_upstream_release_and_timeouts_mark_unknown() {
        for (details, path) in [
            ("direct_response", RELEASE_PATH),
            ("local_rate_limited", RELEASE_PATH),
            ("upstream_reset_before_response_started{overflow}", RELEASE_PATH),
            ("response_timeout", MARK_UNKNOWN_PATH),
        ] {
            let mut ex = owned("/pay");
            let head =
                crate::headers::response_head(vec![(":status".into(), b"200".to_vec())], details, true);
            assert_eq!(called_path(&ex.response_headers(head)), path, "{details}");
        }
    }

    #[test]
    fn every_store_failure_shape_fails_closed_with_503() {
        let answers: [StoreAnswer; 3] = [
            None,
            Some((503, b"no healthy upstream".to_vec())),
            Some((200, b"garbage".to_vec())),
        ];
        for answer in answers {
            let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
            let (abandon, next) = abandoning(ex.store_reply(answer));
            assert_eq!(problem_slug(&next), (503, "store-unavailable".into()));
            assert_eq!(abandon.attempt, attempt());
            assert_eq!(abandon.scope.key().as_str(), "k");
            assert_eq!(ex.outcome(), Outcome::StoreError);
            assert_eq!(ex.settlement(), Some(Settlement::Abandoned));
        }
    }

    #[test]
    fn a_claim_names_its_attempt_and_the_deadline_of_its_caller() {
        let (_, step) = begin("/pay", Some("k"), Some("{}"));
        let claim = claim_of(&step);
        assert_eq!(claim.attempt, Some(attempt()));
        let Step::Call(call) = &step else { unreachable!() };
        assert_eq!(claim.deadline_ms, call.timeout_ms);
        // A waiting claim's caller waits longer.
        let (_, step) = begin("/small", Some("k"), Some("{}"));
        assert_eq!(claim_of(&step).deadline_ms, 1_000 + 300);
    }

    #[test]
    fn a_client_gone_while_the_claim_is_in_flight_abandons_it() {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let call = ex.finish().unwrap();
        assert_eq!(call.path, ABANDON_PATH);
        let abandon = decode_frame::<AbandonRequest>(&call.body).unwrap().0;
        assert_eq!(abandon.attempt, attempt());
        assert_eq!(ex.settlement(), Some(Settlement::Abandoned));
        assert_eq!(ex.finish(), None);
    }

    #[test]
    fn fail_open_abandons_the_claim_and_forwards_without_dedupe() {
        let (mut ex, _) = begin("/open", Some("k"), Some("{}"));
        let (_, next) = abandoning(ex.store_reply(None));
        assert_eq!(next, Step::Continue);
        assert_eq!(ex.outcome(), Outcome::FailOpen);
        assert!(!ex.owns_response());
    }

    #[test]
    fn observe_mode_never_answers_on_its_own() {
        let (_, step) = begin("/watch", None, None);
        assert_eq!(step, Step::Continue);
        let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
        let replay = ClaimReply::Replay {
            status: 200,
            headers: vec![],
            completed_at: 1,
        };
        assert_eq!(ex.store_reply(reply(replay, b"")), Step::Continue);
        assert_eq!(ex.outcome(), Outcome::WouldReplay);
        let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
        assert_eq!(
            ex.store_reply(reply(ClaimReply::InProgress { retry_after_ms: 5 }, b"")),
            Step::Continue
        );
        assert_eq!(ex.outcome(), Outcome::WouldConflict);
    }

    #[test]
    fn an_owned_response_is_held_captured_and_completed() {
        let mut ex = owned("/pay");
        let head = upstream(
            201,
            &[
                ("content-type", "application/json"),
                ("set-cookie", "x"),
                ("Location", "/p/1"),
            ],
            false,
        );
        assert_eq!(ex.response_headers(head), Step::Pause);
        assert_eq!(ex.response_body(b"{\"id\"", false), Step::Pause);
        let step = ex.response_body(b":1}", true);
        let Step::Call(call) = &step else {
            panic!("{step:?}")
        };
        let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
        assert_eq!(done.fence, 7);
        assert_eq!(done.status, 201);
        assert!(done.body_stored);
        assert_eq!(
            done.headers,
            vec![
                ("content-type".into(), "application/json".into()),
                ("location".into(), "/p/1".into())
            ]
        );
        assert_eq!(body, b"{\"id\":1}");
        assert_eq!(
            ex.store_reply(Some((200, br#"{"outcome":"done"}"#.to_vec()))),
            Step::Continue
        );
        assert_eq!(ex.settlement(), Some(Settlement::Completed));
        assert_eq!(ex.finish(), None);
    }

    #[test]
    fn a_response_too_large_to_keep_streams_and_completes_without_body() {
        let mut ex = owned("/small");
        assert_eq!(ex.response_headers(upstream(200, &[], false)), Step::Pause);
        assert_eq!(ex.response_body(b"abc", false), Step::Pause);
        // The chunk that outgrows the limit is held while the outcome is recorded.
        let step = ex.response_body(b"defg", false);
        let Step::Call(call) = &step else {
            panic!("{step:?}")
        };
        let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
        assert!(!done.body_stored);
        assert!(body.is_empty());
        assert_eq!(ex.response_body(b"h", false), Step::Pause);
        assert_eq!(
            ex.store_reply(Some((200, br#"{"outcome":"done"}"#.to_vec()))),
            Step::Continue
        );
        assert_eq!(ex.response_body(b"i", true), Step::Continue);
        assert_eq!(ex.settlement(), Some(Settlement::Completed));
    }

    #[test]
    fn a_response_announced_too_large_is_completed_at_its_headers() {
        let mut ex = owned("/small");
        let head = ResponseHead {
            content_length: Some(5),
            ..upstream(201, &[], false)
        };
        let step = ex.response_headers(head);
        let Step::Call(call) = &step else {
            panic!("{step:?}")
        };
        let (done, _) = decode_frame::<CompleteRequest>(&call.body).unwrap();
        assert_eq!((done.status, done.body_stored), (201, false));
    }

    #[test]
    fn refusals_and_upstream_control_release_or_mark_unknown() {
        let cases: [(ResponseHead, &str); 6] = [
            (upstream(429, &[], false), RELEASE_PATH),
            (upstream(408, &[], false), RELEASE_PATH),
            (
                upstream(200, &[("idempotency-control", "no-store")], false),
                RELEASE_PATH,
            ),
            (
                upstream(200, &[("Idempotency-Control", " Uncertain ")], false),
                MARK_UNKNOWN_PATH,
            ),
            (
                ResponseHead {
                    origin: Origin::NeverReached,
                    ..upstream(503, &[], false)
                },
                RELEASE_PATH,
            ),
            (
                ResponseHead {
                    origin: Origin::LostAfterForwarding,
                    ..upstream(504, &[], false)
                },
                MARK_UNKNOWN_PATH,
            ),
        ];
        for (head, path) in cases {
            let mut ex = owned("/pay");
            let step = ex.response_headers(head);
            assert_eq!(called_path(&step), path);
            assert_eq!(ex.response_body(b"late", true), Step::Pause);
            let Step::Call(call) = step else { unreachable!() };
            assert_eq!(decode_frame::<FenceRequest>(&call.body).unwrap().0.fence, 7);
        }
    }

    #[test]
    fn a_stream_that_ends_before_the_response_came_back_marks_the_record_unknown() {
        let mut ex = owned("/pay");
        let call = ex.finish().unwrap();
        assert_eq!(call.path, MARK_UNKNOWN_PATH);
        let mut ex = owned("/pay");
        ex.response_headers(upstream(200, &[], false));
        assert!(ex.finish().is_some());
    }

    #[test]
    fn a_refused_completion_is_reported_as_failed() {
        let mut ex = owned("/pay");
        ex.response_headers(upstream(200, &[], true));
        assert_eq!(
            ex.store_reply(Some((409, br#"{"outcome":"stale"}"#.to_vec()))),
            Step::Continue
        );
        assert_eq!(ex.settlement(), Some(Settlement::Failed));
    }
}
