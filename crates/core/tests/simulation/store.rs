//! The store in memory: the core's record rules carried out on a map, with
//! the store's wire answers. What it decides is what both real backends
//! decide (`record::decide_claim`, `decide_abandon`, `may_fence`); what it
//! leaves out (durability, replicas) the faults of the world stand in for.

use std::collections::{HashMap, HashSet};

use idemgate_core::config::{OnUnknown, DEFAULT_DOC_BASE};
use idemgate_core::limits::MAX_FRAME;
use idemgate_core::problem::{Problem, ProblemKind};
use idemgate_core::protocol::{
    decode_frame, encode_batch_reply, encode_frame, split_batch, AbandonRequest, Batch, ClaimReply,
    ClaimRequest, CompleteRequest, FenceReply, FenceRequest, ABANDON_PATH, BATCH_PATH, CLAIM_PATH,
    COMPLETE_PATH, MARK_UNKNOWN_PATH, RELEASE_PATH,
};
use idemgate_core::record::{
    self, decide_abandon, decide_claim, AbandonDecision, ClaimDecision, RecordView, State,
};
use idemgate_core::scope::Scope;

pub struct Record {
    pub view: RecordView,
    pub on_unknown: OnUnknown,
    pub ttl_ms: u64,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// How a generation ended, or where it stands: for the audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Open(State),
    Released,
    Abandoned,
}

#[derive(Default)]
pub struct MemStore {
    pub records: HashMap<Scope, Record>,
    tombstones: HashSet<(Scope, String)>,
    next_fence: u64,
    /// Every generation by its fence: its scope, its attempt and how it ended.
    pub generations: HashMap<u64, (Scope, String, Ended)>,
}

/// What the store did with a claim.
pub enum Claimed {
    Answer(u16, Vec<u8>),
    /// In progress and the claim may wait: ask again when something changed.
    Wait,
}

/// A refusal as the store writes it: a problem document of its own.
fn refused(kind: ProblemKind, detail: &str) -> (u16, Vec<u8>) {
    let reply = Problem::new(kind, detail).render(DEFAULT_DOC_BASE);
    (reply.status, reply.body)
}

fn fence_answer(done: bool) -> (u16, Vec<u8>) {
    let reply = if done { FenceReply::Done } else { FenceReply::Stale };
    (if done { 200 } else { 409 }, encode_frame(&reply, &[]))
}

impl MemStore {
    /// One call, as `POST path` with `body`.
    pub fn call(&mut self, path: &str, body: &[u8], now: i64, waited_out: bool) -> Claimed {
        if body.len() > MAX_FRAME {
            let (status, body) = refused(ProblemKind::BodyTooLarge, "frame too large");
            return Claimed::Answer(status, body);
        }
        let answer = match path {
            BATCH_PATH => self.batch(body, now),
            CLAIM_PATH => return self.claim(body, now, waited_out),
            _ => self.fence_call(path, body, now),
        };
        Claimed::Answer(answer.0, answer.1)
    }

    fn batch(&mut self, body: &[u8], now: i64) -> (u16, Vec<u8>) {
        let Ok((meta, bytes)) = decode_frame::<Batch>(body) else {
            return refused(ProblemKind::BadRequest, "not a frame");
        };
        let Ok(parts) = split_batch(meta.calls.iter().map(|c| c.len), bytes) else {
            return refused(ProblemKind::BadRequest, "not a frame");
        };
        let results: Vec<(u16, Vec<u8>)> = meta
            .calls
            .iter()
            .zip(parts)
            .map(|(c, part)| match self.call(&c.path, part, now, true) {
                Claimed::Answer(s, b) => (s, b),
                Claimed::Wait => (500, Vec::new()),
            })
            .collect();
        (200, encode_batch_reply(&results))
    }

    fn claim(&mut self, body: &[u8], now: i64, waited_out: bool) -> Claimed {
        let Ok((req, _)) = decode_frame::<ClaimRequest>(body) else {
            let (status, body) = refused(ProblemKind::BadRequest, "not a claim frame");
            return Claimed::Answer(status, body);
        };
        let existing = self.records.get(&req.scope).map(|r| &r.view);
        let reply = match decide_claim(existing, &req, now) {
            ClaimDecision::Answer(ClaimReply::InProgress { .. }) if req.wait_ms > 0 && !waited_out => {
                return Claimed::Wait;
            }
            ClaimDecision::Answer(reply) => reply,
            ClaimDecision::Replay { status, completed_at } => {
                let Some(r) = self.records.get(&req.scope) else {
                    return Claimed::Answer(500, Vec::new());
                };
                let reply = ClaimReply::Replay {
                    status,
                    headers: r.headers.clone(),
                    completed_at,
                };
                return Claimed::Answer(200, encode_frame(&reply, &r.body));
            }
            ClaimDecision::BecomeUnknown => {
                self.set_unknown(&req.scope, now);
                ClaimReply::Unknown
            }
            ClaimDecision::Claim => {
                self.end(&req.scope, None);
                self.next_fence += 1;
                let fence = self.next_fence;
                let attempt = req
                    .attempt
                    .as_ref()
                    .map(|a| a.as_str().to_string())
                    .unwrap_or_default();
                self.generations.insert(
                    fence,
                    (req.scope.clone(), attempt.clone(), Ended::Open(State::InProgress)),
                );
                self.records.insert(
                    req.scope.clone(),
                    Record {
                        view: RecordView {
                            state: State::InProgress,
                            fingerprint: req.fingerprint,
                            fence,
                            lease_until: record::lease_until(now, req.lease_ms),
                            status: None,
                            body_stored: false,
                            completed_at: None,
                            expires_at: None,
                            archived: false,
                            attempt: Some(attempt),
                        },
                        on_unknown: req.on_unknown,
                        ttl_ms: req.ttl_ms,
                        headers: Vec::new(),
                        body: Vec::new(),
                    },
                );
                ClaimReply::Owned { fence }
            }
        };
        Claimed::Answer(200, encode_frame(&reply, &[]))
    }

    fn fence_call(&mut self, path: &str, body: &[u8], now: i64) -> (u16, Vec<u8>) {
        match path {
            COMPLETE_PATH => {
                let Ok((req, bytes)) = decode_frame::<CompleteRequest>(body) else {
                    return refused(ProblemKind::BadRequest, "not a frame");
                };
                let late = |r: &Record| {
                    r.view.archived
                        && record::completes_archived(r.view.state)
                        && record::may_fence(r.view.state, r.view.fence, req.fence)
                };
                let Some(r) = self.records.get_mut(&req.scope).filter(|r| {
                    !r.view.archived && record::may_fence(r.view.state, r.view.fence, req.fence) || late(r)
                }) else {
                    return fence_answer(false);
                };
                // An archived record keeps no body.
                let kept = !r.view.archived;
                r.view.state = State::Completed;
                r.view.status = Some(req.status);
                r.view.body_stored = req.body_stored && kept;
                r.view.completed_at = Some(now);
                r.view.expires_at = Some(record::completion_expiry(now, r.ttl_ms));
                r.headers = req.headers;
                r.body = if kept { bytes.to_vec() } else { Vec::new() };
                let fence = r.view.fence;
                self.mark(fence, Ended::Open(State::Completed));
                fence_answer(true)
            }
            RELEASE_PATH | MARK_UNKNOWN_PATH => {
                let Ok((req, _)) = decode_frame::<FenceRequest>(body) else {
                    return refused(ProblemKind::BadRequest, "not a frame");
                };
                if self.fenced(&req.scope, req.fence).is_none() {
                    return fence_answer(false);
                }
                if path == RELEASE_PATH {
                    self.end(&req.scope, Some(Ended::Released));
                } else {
                    self.set_unknown(&req.scope, now);
                }
                fence_answer(true)
            }
            ABANDON_PATH => {
                let Ok((req, _)) = decode_frame::<AbandonRequest>(body) else {
                    return refused(ProblemKind::BadRequest, "not a frame");
                };
                let attempt = req.attempt.as_str();
                match decide_abandon(self.records.get(&req.scope).map(|r| &r.view), attempt) {
                    AbandonDecision::End => {
                        self.end(&req.scope, Some(Ended::Abandoned));
                        fence_answer(true)
                    }
                    AbandonDecision::Settled => fence_answer(false),
                    AbandonDecision::Remember => {
                        self.tombstones.insert((req.scope, attempt.to_string()));
                        fence_answer(true)
                    }
                }
            }
            _ => refused(ProblemKind::NotFound, "not a call of /v1"),
        }
    }

    fn fenced(&mut self, scope: &Scope, fence: u64) -> Option<&mut Record> {
        self.records
            .get_mut(scope)
            .filter(|r| !r.view.archived && record::may_fence(r.view.state, r.view.fence, fence))
    }

    fn mark(&mut self, fence: u64, ended: Ended) {
        if let Some(g) = self.generations.get_mut(&fence) {
            g.2 = ended;
        }
    }

    fn set_unknown(&mut self, scope: &Scope, now: i64) {
        if let Some(r) = self.records.get_mut(scope) {
            r.view.state = State::Unknown;
            r.view.expires_at = Some(record::unknown_expiry(now, r.ttl_ms));
            let fence = r.view.fence;
            self.mark(fence, Ended::Open(State::Unknown));
        }
    }

    /// The current generation ends (`how`), or is replaced (`None`: it keeps
    /// the state it was in).
    fn end(&mut self, scope: &Scope, how: Option<Ended>) {
        if let Some(r) = self.records.remove(scope) {
            if let Some(how) = how {
                self.mark(r.view.fence, how);
            }
        }
    }

    /// One sweeper pass: leases that ran out, abandoned claims that landed,
    /// expiry (archiving drops the body).
    pub fn sweep(&mut self, now: i64) {
        let scopes: Vec<Scope> = self.records.keys().cloned().collect();
        for scope in scopes {
            let Some(r) = self.records.get(&scope) else {
                continue;
            };
            let v = &r.view;
            let landed_abandoned = v
                .attempt
                .as_ref()
                .is_some_and(|a| self.tombstones.contains(&(scope.clone(), a.clone())))
                && !v.archived
                && record::may_abandon(v.state, v.attempt.as_deref(), v.attempt.as_deref().unwrap_or(""));
            if landed_abandoned {
                self.end(&scope, Some(Ended::Abandoned));
            } else if v.state == State::InProgress && v.lease_until <= now {
                if r.on_unknown == OnUnknown::Release {
                    self.end(&scope, Some(Ended::Released));
                } else {
                    self.set_unknown(&scope, now);
                }
            } else if !v.archived && v.expires_at.is_some_and(|at| at <= now) {
                if let Some(r) = self.records.get_mut(&scope) {
                    r.view.archived = true;
                    r.body.clear();
                }
            }
        }
    }
}
