//! In memory: the backend of the deterministic simulation
//! (`crates/simulation`) and of tests, never storage. No `--database-url`
//! names it ([`crate::database_url`]), and nothing it holds outlives the
//! process.
//!
//! It decides nothing of its own: a claim is decided by
//! [`crate::effects::claim`], every other operation by its effect in
//! [`crate::effects`], and it only carries the effects out, on the same tables
//! as the SQL backends (`tables`): current records by their key, the
//! history of ended generations, the events, the abandoned attempts and the
//! fence sequence. Its sweeper, listings and lookups pick rows by the same
//! conditions ([`crate::conditions`]). The story suite runs on it as on
//! SQLite and PostgreSQL.
//!
//! It is deterministic: every `now` is the caller's; it reads no clock
//! but the runtime's monotonic one, against a claim's deadline (the
//! caller's instant, on that clock) when it has one, which a simulation
//! whose runtime's time is paused moves by hand; it draws nothing at
//! random, and starts no thread or task. The tables
//! are behind one std Mutex, not an async one, because nothing awaits while
//! it is held: every call completes the first time its future is polled.
//!
//! What only storage needs, it leaves out: sealing stored responses at rest
//! ([`crate::sealing`]: nothing here is at rest), durability (an effect's
//! `durable` asks nothing of memory; it is only counted, [`Memory::commits`]),
//! deferred replay counts (a replay is counted in the record at once), and
//! the sweeper's slices (a batch is one call that nothing can queue behind).
//!
//! A simulation that plays a database losing what it committed takes the
//! tables as they are ([`Memory::snapshot`]) and puts them back later
//! ([`Memory::restore`]): a restore from a backup, a failover to a standby
//! behind the primary, a crash that loses the commits not yet flushed.

mod operations;
mod reads;
mod sweep;
mod tables;

use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use async_trait::async_trait;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;

use crate::backend::{
    Answer, Backend, Call, ClaimOutcome, KeyHistory, Listing, Lookup, OpenRecords, Peeked, RecordInfo,
    Resolution, Result, SweepPolicy, SweepReport,
};
use crate::effects;
use crate::log_ids::LogIds;
use crate::row_mapping::ScopeDigest;
use operations::load_and_carry_out;
pub use tables::Snapshot;
use tables::{Journal, Tables};

/// The in-memory backend.
pub struct Memory {
    tables: Mutex<Tables>,
    log_ids: LogIds,
}

impl Memory {
    /// Empty tables; events are logged with records named by `log_ids`.
    pub fn new(log_ids: LogIds) -> Memory {
        Memory {
            tables: Mutex::default(),
            log_ids,
        }
    }

    /// Everything the backend holds now.
    pub fn snapshot(&self) -> Snapshot {
        self.tables
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .snapshot()
    }

    /// Puts back what the backend held at `snapshot`: everything since is
    /// gone, as from a database restored to that moment, and reopened at
    /// `clock_us` (µs): fences move up to that clock, as the SQL backends
    /// move theirs when they open, so none drawn since is drawn again. The
    /// count of commits goes on. `false`, changing nothing, if the sweeper
    /// purged rows since: what it removed is not in the snapshot.
    pub fn restore(&self, snapshot: Snapshot, clock_us: u64) -> bool {
        self.tables
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .restore(snapshot, clock_us)
    }

    /// Operations that changed a row so far, and how many of them were
    /// durable: all but the completions their policy lets the database
    /// commit without waiting (`on_unknown: conflict`). A replay's count is
    /// no commit of its own (the SQL backends defer it).
    pub fn commits(&self) -> (u64, u64) {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner).commits
    }

    /// Runs `f` on the tables, then logs the events it recorded for the
    /// call that `trace` names.
    fn with<R>(&self, trace: &Trace, f: impl FnOnce(&mut Tables, &mut Journal) -> R) -> R {
        let mut journal = Journal::new();
        let out = {
            // A panic elsewhere leaves no operation half done (each is
            // carried out whole or not begun), so the tables stay usable.
            let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
            f(&mut tables, &mut journal)
        };
        journal.iter().for_each(|e| e.log(&self.log_ids, trace));
        out
    }

    fn claim_now(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        self.with(&req.trace, |t, journal| {
            operations::claim(t, journal, req, now, deadline)
        })
    }

    fn complete_now(&self, req: &CompleteRequest, body: &[u8], now: i64) -> FenceReply {
        let key = ScopeDigest::of(&req.scope);
        let body = req.body_stored.then_some(body);
        self.with(&req.trace, |t, journal| {
            load_and_carry_out(t, journal, &key, now, |l| effects::complete(l, req, body, now))
        })
    }

    fn release_now(&self, req: &FenceRequest, now: i64) -> FenceReply {
        let key = ScopeDigest::of(&req.scope);
        self.with(&req.trace, |t, journal| {
            load_and_carry_out(t, journal, &key, now, |l| {
                effects::release(l, &req.scope, req.fence)
            })
        })
    }

    fn mark_unknown_now(&self, req: &FenceRequest, now: i64) -> FenceReply {
        let key = ScopeDigest::of(&req.scope);
        self.with(&req.trace, |t, journal| {
            load_and_carry_out(t, journal, &key, now, |l| {
                effects::mark_unknown(l, req.fence, now)
            })
        })
    }

    fn abandon_now(&self, req: &AbandonRequest, now: i64) -> FenceReply {
        let key = ScopeDigest::of(&req.scope);
        self.with(&req.trace, |t, journal| {
            load_and_carry_out(t, journal, &key, now, |l| {
                effects::abandon(l, &req.scope, req.attempt.as_str())
            })
        })
    }

    /// One call of a batch, as if it came alone.
    fn decide_now(&self, call: Call, now: i64) -> Result<Answer> {
        Ok(match call {
            Call::Claim { req, deadline } => Answer::Claim(self.claim_now(&req, now, deadline)?),
            Call::Complete { req, body } => Answer::Fence(self.complete_now(&req, &body, now)),
            Call::Release(req) => Answer::Fence(self.release_now(&req, now)),
            Call::MarkUnknown(req) => Answer::Fence(self.mark_unknown_now(&req, now)),
            Call::Abandon(req) => Answer::Fence(self.abandon_now(&req, now)),
        })
    }
}

#[async_trait]
impl Backend for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn log_ids(&self) -> &LogIds {
        &self.log_ids
    }

    /// No schema: the tables are Rust values.
    async fn migrate(&self) -> Result<()> {
        Ok(())
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }

    async fn claim(&self, req: &ClaimRequest, now: i64, deadline: Option<Instant>) -> Result<ClaimOutcome> {
        self.claim_now(req, now, deadline)
    }

    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Peeked> {
        self.with(&req.trace, |t, _| operations::peek(t, req, now))
    }

    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply> {
        Ok(self.complete_now(req, body, now))
    }

    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        Ok(self.release_now(req, now))
    }

    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        Ok(self.mark_unknown_now(req, now))
    }

    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        Ok(self.abandon_now(req, now))
    }

    /// The calls one after the other, in their order: each on its own, and
    /// the same order on every run.
    async fn decide(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        calls.into_iter().map(|call| self.decide_now(call, now)).collect()
    }

    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory> {
        self.with(&Trace::NONE, |t, _| reads::lookup(t, q, limit))
    }

    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>> {
        self.with(&Trace::NONE, |t, _| reads::list(t, which, now, limit))
    }

    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool> {
        let key = ScopeDigest::of(scope);
        Ok(self.with(&Trace::NONE, |t, journal| {
            load_and_carry_out(t, journal, &key, now, |l| effects::resolve(l, how, reason, now))
        }))
    }

    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        Ok(self.with(&Trace::NONE, |t, journal| sweep::sweep(t, journal, now, *policy)))
    }

    async fn open_records(&self) -> Result<OpenRecords> {
        Ok(self.with(&Trace::NONE, |t, _| reads::open_records(t)))
    }
}

#[cfg(test)]
mod tests;
