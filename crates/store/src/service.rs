//! The store as the HTTP layer sees it: a backend plus the clock, the wait
//! for in-flight records, and the metrics.
//!
//! Waits and callers' deadlines are measured on the runtime's monotonic
//! clock ([`tokio::time::Instant`], the system's own in a running store), so
//! that a simulation whose runtime's time is paused moves them with its
//! world instead of the wall.

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{
    label_records, limits, Answer, Backend, Call, ClaimOutcome, KeyHistory, Listing, Lookup, Peeked,
    RecordInfo, Result, StoreError,
};
use crate::budget::Budgets;
use crate::clock::Clock;
use crate::metrics::Metrics;

/// How often a waiting claim looks again even without a local notification:
/// another replica sharing the database may have finished the record.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

#[derive(Clone)]
pub struct Store {
    pub backend: Arc<dyn Backend>,
    pub clock: Clock,
    pub metrics: Arc<Metrics>,
    /// Woken whenever this process finishes, releases or marks a record.
    changed: Arc<Notify>,
    /// The budget of new keys per tenant; `None`: no limit.
    budgets: Option<Arc<Budgets>>,
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>, clock: Clock) -> Store {
        let mut metrics = Metrics::new();
        metrics.build(backend.name());
        metrics.writer_stages(backend.writer_stages());
        Store {
            backend,
            clock,
            metrics: Arc::new(metrics),
            changed: Arc::new(Notify::new()),
            budgets: None,
        }
    }

    /// The same store, limiting each tenant's new keys to `budgets`.
    pub fn with_budgets(mut self, budgets: Budgets) -> Store {
        self.budgets = Some(Arc::new(budgets));
        self
    }

    /// Charges a claim that may take a key to its tenant's budget: `Ok(true)`
    /// when charged, `Ok(false)` when there is no budget, `Err(wait)` when
    /// it is spent.
    fn charge(&self, req: &ClaimRequest) -> std::result::Result<bool, u64> {
        match &self.budgets {
            None => Ok(false),
            Some(b) => b.take(req.scope.tenant(), self.clock.now()).map(|()| true),
        }
    }

    /// Gives a charged claim's key back unless the claim took the key.
    fn settle_charge(&self, tenant: &str, took: bool) {
        if let (Some(b), false) = (&self.budgets, took) {
            b.give_back(tenant);
        }
    }

    /// A claim whose tenant's budget is spent: carried out as usual when it
    /// takes no key (a replay, a conflict, a mismatch, a lease that ran out
    /// turned unknown), refused otherwise.
    async fn over_budget(
        &self,
        req: &ClaimRequest,
        deadline: Option<std::time::Instant>,
        wait_ms: u64,
    ) -> Result<ClaimOutcome> {
        let now = self.clock.now();
        match self.backend.peek(req, now).await? {
            Peeked::Answered(outcome) => Ok(outcome),
            // The budget counts keys, and turning a lease that ran out
            // unknown takes none. The claim is decided again when it is
            // written: had its record been freed in between, it takes the
            // key, one beyond the budget, which is no more exact than that
            // anyway (each replica keeps its own).
            Peeked::Changes => self.backend.claim(req, now, deadline).await,
            Peeked::Takes => {
                self.metrics.rate_limited_claims.inc();
                Err(StoreError::RateLimited {
                    retry_after_ms: wait_ms,
                })
            }
        }
    }

    /// One claim at the backend, within the tenant's budget.
    async fn claim_once(
        &self,
        req: &ClaimRequest,
        deadline: Option<std::time::Instant>,
    ) -> Result<ClaimOutcome> {
        match self.charge(req) {
            Ok(charged) => {
                let outcome = self.backend.claim(req, self.clock.now(), deadline).await;
                if charged {
                    let took = matches!(&outcome, Ok(o) if matches!(o.reply, ClaimReply::Owned { .. }));
                    self.settle_charge(req.scope.tenant(), took);
                }
                outcome
            }
            Err(wait_ms) => self.over_budget(req, deadline, wait_ms).await,
        }
    }

    /// Decides the calls of one request (one call, or a `/v1/batch`), each on
    /// its own. A claim that may wait for another request (`wait_ms > 0`)
    /// runs its own waiting loop ([`Store::claim`]); the others are handed to
    /// the backend together, which carries them out in one go where it can.
    pub async fn decide(&self, calls: Vec<Call>) -> Vec<Result<Answer>> {
        let started = Instant::now();
        let mut answers: Vec<Option<Result<Answer>>> = (0..calls.len()).map(|_| None).collect();
        let mut waiting = Vec::new();
        let mut over_budget = Vec::new();
        let mut charged = Vec::new();
        let mut together = Vec::with_capacity(calls.len());
        for (i, call) in calls.into_iter().enumerate() {
            match call {
                Call::Claim { req, .. } if req.wait_ms > 0 => waiting.push((i, req)),
                Call::Claim { req, .. } => match self.charge(&req) {
                    Err(wait_ms) => over_budget.push((i, req, wait_ms)),
                    Ok(was_charged) => {
                        if was_charged {
                            charged.push((i, req.scope.tenant().to_string()));
                        }
                        let deadline = caller_deadline(&req, started);
                        together.push((i, Call::Claim { req, deadline }));
                    }
                },
                other => together.push((i, other)),
            }
        }
        let kinds: Vec<(usize, Kind)> = together.iter().map(|(i, c)| (*i, Kind::of(c))).collect();
        let calls: Vec<Call> = together.into_iter().map(|(_, c)| c).collect();
        let backend = async {
            if calls.is_empty() {
                Vec::new()
            } else {
                self.backend.decide(calls, self.clock.now()).await
            }
        };
        let waits = futures_util::future::join_all(
            waiting
                .iter()
                .map(|(_, req)| async move { self.claim(req).await.map(Answer::Claim) }),
        );
        let peeks = futures_util::future::join_all(over_budget.iter().map(|(_, req, wait_ms)| async move {
            let deadline = caller_deadline(req, started);
            self.over_budget(req, deadline, *wait_ms).await
        }));
        let (decided, waited, peeked) = tokio::join!(backend, waits, peeks);
        for ((i, kind), answer) in kinds.into_iter().zip(decided) {
            self.observe(kind, &answer, started);
            answers[i] = Some(answer);
        }
        for ((i, _, _), answer) in over_budget.into_iter().zip(peeked) {
            if let Ok(outcome) = &answer {
                self.metrics.observe_claim(outcome, started.elapsed());
            }
            answers[i] = Some(answer.map(Answer::Claim));
        }
        for (i, tenant) in charged {
            let took = matches!(
                &answers[i],
                Some(Ok(Answer::Claim(o))) if matches!(o.reply, ClaimReply::Owned { .. })
            );
            self.settle_charge(&tenant, took);
        }
        for ((i, _), answer) in waiting.into_iter().zip(waited) {
            answers[i] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::internal("a call went unanswered"))))
            .collect()
    }

    /// Claims, and if the record is in progress and the caller asked to wait,
    /// waits (bounded by `wait_ms`) for it to finish, then decides again.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome> {
        let started = Instant::now();
        let deadline = started + Duration::from_millis(req.wait_ms.min(limits::MAX_WAIT_MS));
        let outcome = loop {
            // Register for the wake-up before looking, so a completion that
            // lands between the look and the wait is not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let outcome = match self
                .claim_once(req, commit_deadline(req, started, Instant::now()))
                .await
            {
                Err(e @ StoreError::Late) => {
                    self.metrics.late_claims.inc();
                    return Err(e);
                }
                Err(e) => {
                    self.metrics.call_failed(Kind::Claim.name());
                    return Err(e);
                }
                Ok(outcome) => outcome,
            };
            let now = Instant::now();
            match outcome.reply {
                ClaimReply::InProgress { retry_after_ms } if now < deadline => {
                    let nap = POLL_INTERVAL
                        .min(deadline - now)
                        .min(Duration::from_millis(retry_after_ms.max(1)));
                    let _ = tokio::time::timeout(nap, notified).await;
                }
                _ => break outcome,
            }
        };
        self.metrics.observe_claim(&outcome, started.elapsed());
        Ok(outcome)
    }

    pub async fn complete(&self, req: &CompleteRequest, body: &[u8]) -> Result<FenceReply> {
        let reply = self.backend.complete(req, body, self.clock.now()).await;
        self.observe_fence(Kind::Complete, &reply);
        reply
    }

    pub async fn release(&self, req: &FenceRequest) -> Result<FenceReply> {
        let reply = self.backend.release(req, self.clock.now()).await;
        self.observe_fence(Kind::Release, &reply);
        reply
    }

    pub async fn abandon(&self, req: &AbandonRequest) -> Result<FenceReply> {
        let reply = self.backend.abandon(req, self.clock.now()).await;
        self.observe_fence(Kind::Abandon, &reply);
        reply
    }

    pub async fn mark_unknown(&self, req: &FenceRequest) -> Result<FenceReply> {
        let reply = self.backend.mark_unknown(req, self.clock.now()).await;
        self.observe_fence(Kind::MarkUnknown, &reply);
        reply
    }

    /// Every generation and event of a tenant's key, each named as the logs
    /// name it.
    pub async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        let mut history = self.backend.lookup(q, limit).await?;
        history.label(self.backend.log_ids());
        Ok(history)
    }

    /// Unknown or stuck records, each named as the logs name it.
    pub async fn list(&self, which: Listing, limit: u32) -> Result<Vec<RecordInfo>> {
        let mut records = self.backend.list(which, self.clock.now(), limit).await?;
        label_records(&mut records, self.backend.log_ids());
        Ok(records)
    }

    /// The record's name in the logs.
    pub fn log_id(&self, scope: &idemgate_core::scope::Scope) -> String {
        self.backend.log_ids().of(scope)
    }

    /// Wakes waiting claims after an admin resolution.
    pub fn notify_changed(&self) {
        self.changed.notify_waiters();
    }

    /// Metrics and wake-ups for a call the backend answered.
    fn observe(&self, kind: Kind, answer: &Result<Answer>, started: Instant) {
        match (kind, answer) {
            (Kind::Claim, Ok(Answer::Claim(outcome))) => {
                self.metrics.observe_claim(outcome, started.elapsed())
            }
            (Kind::Claim, Err(StoreError::Late)) => {
                self.metrics.late_claims.inc();
            }
            (_, Ok(Answer::Fence(reply))) => self.observe_fence(kind, &Ok(*reply)),
            (_, Err(_)) => self.metrics.call_failed(kind.name()),
            _ => {}
        }
    }

    fn observe_fence(&self, kind: Kind, reply: &Result<FenceReply>) {
        let Ok(reply) = reply else {
            self.metrics.call_failed(kind.name());
            return;
        };
        let done = *reply == FenceReply::Done;
        match kind {
            Kind::Abandon => {
                if done {
                    self.metrics.abandoned_claims.inc();
                    self.changed.notify_waiters();
                }
                return;
            }
            Kind::MarkUnknown if done => {
                self.metrics.unknown_records.inc();
            }
            _ => {}
        }
        if done {
            self.changed.notify_waiters();
        } else {
            self.metrics.stale_fences.inc();
        }
    }
}

/// When the caller of a claim stops waiting, counted from when its claim
/// reached us (a little after it was sent, so the filter abandons what
/// slips through).
fn caller_deadline(req: &ClaimRequest, started: Instant) -> Option<std::time::Instant> {
    (req.deadline_ms > 0).then(|| (started + Duration::from_millis(req.deadline_ms)).into_std())
}

/// The latest a claim looked at `look` may commit, for a caller whose claim
/// reached us at `started`: when the caller stops waiting, and no later
/// than its store timeout (`deadline_ms` less `wait_ms`) after the look.
/// The lease counts from the look's clock, and the filter keeps only its
/// store timeout of the lease for the claim's answer to reach it: a waiting
/// claim the database commits later than that would leave the upstream less
/// than its timeout, and a retry could take the key while it still runs.
fn commit_deadline(req: &ClaimRequest, started: Instant, look: Instant) -> Option<std::time::Instant> {
    let answered_within = Duration::from_millis(req.deadline_ms.saturating_sub(req.wait_ms));
    caller_deadline(req, started).map(|d| d.min((look + answered_within).into_std()))
}

/// Which call an answer belongs to, for its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Claim,
    Complete,
    Release,
    MarkUnknown,
    Abandon,
}

impl Kind {
    /// Its name in the metrics ([`crate::metrics::CALLS`]).
    fn name(self) -> &'static str {
        match self {
            Kind::Claim => "claim",
            Kind::Complete => "complete",
            Kind::Release => "release",
            Kind::MarkUnknown => "mark_unknown",
            Kind::Abandon => "abandon",
        }
    }

    fn of(call: &Call) -> Kind {
        match call {
            Call::Claim { .. } => Kind::Claim,
            Call::Complete { .. } => Kind::Complete,
            Call::Release(_) => Kind::Release,
            Call::MarkUnknown(_) => Kind::MarkUnknown,
            Call::Abandon(_) => Kind::Abandon,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiting_claim_commits_within_the_callers_store_timeout_of_each_look() {
        let mut req: ClaimRequest = serde_json::from_str(
            r#"{"scope": {"version": "v1", "tenant": "t", "principal": "p", "route": "r",
                "namespace": "u", "key": "k"}, "lease_ms": 2000, "ttl_ms": 1000, "wait_ms": 300,
                "deadline_ms": 500, "after_expiry": "reject", "on_unknown": "conflict"}"#,
        )
        .unwrap();
        let started = Instant::now();
        let ms = |n| (started + Duration::from_millis(n)).into_std();
        // The first look: within the store timeout (200 ms) of it.
        assert_eq!(commit_deadline(&req, started, started), Some(ms(200)));
        // A look late in the wait: the caller's own deadline comes first.
        let late = started + Duration::from_millis(400);
        assert_eq!(commit_deadline(&req, started, late), Some(ms(500)));
        // A claim that does not wait: the caller's deadline, as before.
        req.wait_ms = 0;
        assert_eq!(commit_deadline(&req, started, started), Some(ms(500)));
        req.deadline_ms = 0;
        assert_eq!(commit_deadline(&req, started, started), None);
    }
}
