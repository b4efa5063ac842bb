//! The database under the store: the in-memory backend
//! ([`idemgate_store::memory::Memory`]), which carries out the store's
//! effects, seen through a tap of the world's. The tap decides nothing: it
//! makes some calls slow (a database that takes longer than the filter
//! waits) and notes every claim the store looked at without writing and
//! found it would write ([`Backend::peek`], which the store asks only about
//! a claim over its tenant's budget), with the record the claim met: the
//! audit judges each `429` of the store by what its claim met. It also
//! keeps the tables as its last commits left them, for the loss a scenario
//! may have the database suffer when the store restarts ([`loss`]).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::FutureExt;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::Scope;
use idemgate_store::backend::{
    Answer, Backend, Call, ClaimOutcome, KeyHistory, Listing, Lookup, OpenRecords, Peeked, RecordInfo,
    Resolution, Result, SweepPolicy, SweepReport,
};
use idemgate_store::log_ids::LogIds;
use idemgate_store::memory::Memory;

use crate::rng::Rng;
use crate::world::{scope_label, scope_of_label};

pub mod loss;

use loss::{Kept, Loss, Lost};

/// A claim the store looked at while its tenant's budget was spent, and
/// found would write: what it met.
#[derive(Debug, Clone)]
pub struct Limited {
    pub req: ClaimRequest,
    /// The store's clock when it looked.
    pub now: i64,
    /// The key's current record then, if any.
    pub record: Option<RecordInfo>,
}

/// The in-memory database and the world's tap on it.
pub struct Database {
    memory: Memory,
    /// The chance that a call takes [`SLOW_MS`] and its stream.
    slow: (f64, Mutex<Rng>),
    looked: Mutex<Vec<Limited>>,
    kept: Mutex<Kept>,
}

/// How long a slow call takes: longer than a claim's caller waits (the
/// filter's store timeout), shorter than a lease.
pub const SLOW_MS: (i64, i64) = (150, 450);

impl Database {
    pub fn new(slow: f64, rng: Rng) -> Database {
        let ids = LogIds::new(b"the simulation's own log key, 32b").unwrap_or_else(|e| panic!("{e}"));
        let memory = Memory::new(ids);
        Database {
            kept: Mutex::new(Kept::new(&memory)),
            memory,
            slow: (slow, Mutex::new(rng)),
            looked: Mutex::default(),
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After a call: keeps the tables if it committed.
    fn noted<T>(&self, out: T) -> T {
        self.kept().note(&self.memory, None);
        out
    }

    /// After an abandon of `req`'s: keeps the tables, and the abandon, if it committed.
    fn abandoned<T>(&self, req: &AbandonRequest, out: T) -> T {
        let abandon = (
            scope_label(req.scope.tenant(), req.scope.key().as_str()),
            req.attempt.as_str().to_string(),
        );
        self.kept().note(&self.memory, Some(abandon));
        out
    }

    fn named(&self, req: &ClaimRequest) {
        self.kept()
            .keys
            .insert(scope_label(req.scope.tenant(), req.scope.key().as_str()));
    }

    /// The store restarts (at the world's `at`), and the database loses
    /// what `loss` takes, if anything: each key's history before and
    /// after. A scenario's one restart ends the keeping.
    pub fn lose(&self, loss: Option<Loss>, at: i64, confirmed: usize) -> Option<Lost> {
        let (back, abandons) = self.kept().back(loss)?;
        let keys: Vec<String> = self.kept().keys.iter().cloned().collect();
        let before: Vec<KeyHistory> = keys.iter().map(|k| self.labeled(k)).collect();
        // The sweeper purges only past the audit retention, days after a run.
        let clock_us = u64::try_from(at).unwrap_or(0) * 1000;
        assert!(
            self.memory.restore(back, clock_us),
            "the sweeper purged within a run"
        );
        let keys = keys
            .into_iter()
            .zip(before)
            .map(|(k, before)| {
                let after = self.labeled(&k);
                (k, before, after)
            })
            .collect();
        Some(Lost {
            loss: loss?,
            at,
            confirmed,
            keys,
            abandons,
        })
    }

    /// The last look the store took at `req` (its scope and attempt) over
    /// budget, if it found it would write.
    pub fn looked_at(&self, req: &ClaimRequest) -> Option<Limited> {
        let looked = self.looked.lock().unwrap_or_else(PoisonError::into_inner);
        looked
            .iter()
            .rev()
            .find(|l| l.req.scope == req.scope && l.req.attempt == req.attempt)
            .cloned()
    }

    /// Every generation and event of the scope a [`scope_label`] names.
    fn labeled(&self, label: &str) -> KeyHistory {
        let (tenant, key) = scope_of_label(label);
        self.history(tenant, key)
    }

    /// Every generation and event of `tenant`'s `key` (`*`: everyone's,
    /// an anonymous policy's).
    pub fn history(&self, tenant: &str, key: &str) -> KeyHistory {
        let q = Lookup {
            tenant: tenant.into(),
            key: key.into(),
            ..Lookup::default()
        };
        self.memory
            .lookup(&q, 100_000)
            .now_or_never()
            .and_then(Result::ok)
            .unwrap_or_default()
    }

    /// The database's time for one call: now, or (a slow one) a while.
    async fn lag(&self) {
        let (p, rng) = &self.slow;
        let ms = {
            let mut rng = rng.lock().unwrap_or_else(PoisonError::into_inner);
            rng.chance(*p).then(|| rng.range(SLOW_MS.0, SLOW_MS.1))
        };
        if let Some(ms) = ms {
            tokio::time::sleep(Duration::from_millis(ms.unsigned_abs())).await;
        }
    }

    fn current(&self, scope: &Scope) -> Option<RecordInfo> {
        let history = self.history(scope.tenant(), scope.key().as_str());
        history
            .records
            .into_iter()
            .find(|r| r.ended_at.is_none() && &r.scope == scope)
    }
}

/// The memory backend's, every call; the store's calls on a claim's path
/// (claims, settlements, batches) after the database's lag.
#[async_trait]
impl Backend for Database {
    fn name(&self) -> &'static str {
        self.memory.name()
    }
    fn log_ids(&self) -> &LogIds {
        self.memory.log_ids()
    }
    async fn migrate(&self) -> Result<()> {
        self.memory.migrate().await
    }
    async fn ping(&self) -> Result<()> {
        self.memory.ping().await
    }
    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        self.lag().await;
        self.named(req);
        self.noted(self.memory.claim(req, now, deadline).await)
    }
    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Peeked> {
        self.named(req);
        let peeked = self.memory.peek(req, now).await;
        if let Ok(Peeked::Takes | Peeked::Changes) = peeked {
            let record = self.current(&req.scope);
            self.looked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Limited {
                    req: req.clone(),
                    now,
                    record,
                });
        }
        peeked
    }
    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        self.lag().await;
        self.noted(self.memory.complete(req, body, now).await)
    }
    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.lag().await;
        self.noted(self.memory.release(req, now).await)
    }
    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.lag().await;
        self.noted(self.memory.mark_unknown(req, now).await)
    }
    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        self.lag().await;
        self.abandoned(req, self.memory.abandon(req, now).await)
    }
    async fn decide(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        self.lag().await;
        // One call at a time, as the backend decides them anyway: each
        // commit is kept on its own.
        let mut answers = Vec::with_capacity(calls.len());
        for call in calls {
            if let Call::Claim { req, .. } = &call {
                self.named(req);
            }
            let abandon = match &call {
                Call::Abandon(req) => Some(req.clone()),
                _ => None,
            };
            let answer = self.memory.decide(vec![call], now).await;
            answers.extend(match &abandon {
                Some(req) => self.abandoned(req, answer),
                None => self.noted(answer),
            });
        }
        answers
    }
    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        self.memory.lookup(q, limit).await
    }
    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        self.memory.list(which, now, limit).await
    }
    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool> {
        self.noted(self.memory.resolve(scope, how, reason, now).await)
    }
    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        self.noted(self.memory.sweep(now, policy).await)
    }
    async fn open_records(&self) -> Result<OpenRecords> {
        self.memory.open_records().await
    }
}

/// Shared by the store (as its backend) and the world (its tap).
pub type Shared = Arc<Database>;
