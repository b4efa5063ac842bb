//! The store as the HTTP layer sees it: a backend plus the clock, the wait
//! for in-flight records, and the metrics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use tokio::sync::Notify;

use crate::backend::{limits, Backend, ClaimOutcome, Result};
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
}

impl Store {
    pub fn new(backend: Arc<dyn Backend>, clock: Clock) -> Store {
        Store {
            backend,
            clock,
            metrics: Arc::new(Metrics::new()),
            changed: Arc::new(Notify::new()),
        }
    }

    /// Claims, and if the record is in progress and the caller asked to wait,
    /// waits (bounded by `wait_ms`) for it to finish, then decides again.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome> {
        let started = Instant::now();
        // The caller's deadline, from when its claim reached us (a little
        // after it was sent, so the filter abandons what slips through).
        let caller_deadline = (req.deadline_ms > 0).then(|| started + Duration::from_millis(req.deadline_ms));
        let deadline = started + Duration::from_millis(req.wait_ms.min(limits::MAX_WAIT_MS));
        let outcome = loop {
            // Register for the wake-up before looking, so a completion that
            // lands between the look and the wait is not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let outcome = match self.backend.claim(req, self.clock.now(), caller_deadline).await {
                Err(e @ crate::backend::StoreError::Late) => {
                    self.metrics.late_claims.inc();
                    return Err(e);
                }
                other => other?,
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
        let reply = self.backend.complete(req, body, self.clock.now()).await?;
        self.finished(reply);
        Ok(reply)
    }

    pub async fn release(&self, req: &FenceRequest) -> Result<FenceReply> {
        let reply = self.backend.release(req, self.clock.now()).await?;
        self.finished(reply);
        Ok(reply)
    }

    pub async fn abandon(&self, req: &AbandonRequest) -> Result<FenceReply> {
        let reply = self.backend.abandon(req, self.clock.now()).await?;
        if reply == FenceReply::Done {
            self.metrics.abandoned_claims.inc();
            self.changed.notify_waiters();
        }
        Ok(reply)
    }

    pub async fn mark_unknown(&self, req: &FenceRequest) -> Result<FenceReply> {
        let reply = self.backend.mark_unknown(req, self.clock.now()).await?;
        if reply == FenceReply::Done {
            self.metrics.unknown_records.inc();
        }
        self.finished(reply);
        Ok(reply)
    }

    /// Wakes waiting claims after an admin resolution.
    pub fn notify_changed(&self) {
        self.changed.notify_waiters();
    }

    fn finished(&self, reply: FenceReply) {
        if reply == FenceReply::Done {
            self.changed.notify_waiters();
        } else {
            self.metrics.stale_fences.inc();
        }
    }
}
