//! A claim, decided by [`effects::claim`] as on every backend: one statement
//! in the common path, which inserts a new key ([`CLAIM`] states in SQL
//! what the effect on an absent record is) or returns the record, whose
//! effect is answered or replayed from it; an effect that changes the record
//! is decided again from the record under its lock and carried out there.

use std::sync::LazyLock;
use std::time::Instant;

use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use idemgate_core::record::{self, Transition};
use tokio_postgres::Row;

use super::generation::{event, lock, to_history};
use super::operations::carry_out;
use super::pool::{Client, On, Stmt};
use super::rows::{bind_with_columns, Bind, Param, CLAIM, LOADED, REPLACE_GENERATION};
use super::Postgres;
use crate::backend::{Actor, ClaimOutcome, EventInfo, Outage, Peeked, Result, StoreError};
use crate::effects::{self, ClaimEffect};
use crate::row_mapping::{i64_from, ColumnReader, KeyColumns, LoadedRecord, ScopeDigest};

/// What a claim's [`CLAIM`] row says.
enum Read {
    Decided(ClaimOutcome),
    /// No row: a concurrent insert not visible yet. Look again.
    Again,
    /// An existing record the claim changes, under its lock.
    Changes,
}

/// How often a claim that keeps losing races looks again before giving up.
const MAX_ATTEMPTS: usize = 20;

/// A claim's own parameters, in the order [`CLAIM`] (after the key and the
/// scope's columns) and [`REPLACE_GENERATION`] (after the key) take them.
pub(super) struct Claimed<'r> {
    pub(super) fingerprint: Option<String>,
    pub(super) lease_until: i64,
    pub(super) ttl_ms: i64,
    pub(super) release: bool,
    now: i64,
    pub(super) attempt: Option<&'r str>,
}

impl<'r> Claimed<'r> {
    /// The claim's parameters, then `extra`.
    fn params<'p>(&'p self, extra: &[Param<'p>]) -> Vec<Param<'p>> {
        let mut params: Vec<Param<'p>> = vec![
            &self.fingerprint,
            &self.lease_until,
            &self.ttl_ms,
            &self.release,
            &self.now,
            &self.attempt,
        ];
        params.extend_from_slice(extra);
        params
    }

    pub(super) fn of(req: &'r ClaimRequest, now: i64) -> Claimed<'r> {
        Claimed {
            fingerprint: req.fingerprint.map(|f| f.to_hex()),
            lease_until: record::lease_until(now, req.lease_ms),
            ttl_ms: i64_from(req.ttl_ms),
            release: req.on_unknown == OnUnknown::Release,
            now,
            attempt: req.attempt.as_ref().map(|a| a.as_str()),
        }
    }
}

/// Whether the caller of a claim has stopped waiting.
pub(super) fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// The record as committed, read without a lock: what [`LoadedRecord::read`]
/// reads, and the body a replay serves.
static COMMITTED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {LOADED}, response_body FROM idempotency_records WHERE {}",
        key_where!()
    )
});

impl Postgres {
    /// [`crate::backend::Backend::peek`]: the record as committed, read
    /// without a lock, decided by the same rules.
    pub(super) async fn peek_record(&self, req: &ClaimRequest, now: i64) -> Result<Peeked> {
        let key = ScopeDigest::of(&req.scope);
        let rows = self.connections.query(&COMMITTED, &key.bind(&[])).await?;
        self.unwritten(req, &key, rows.first(), now)
    }

    /// What the claim's effect on `row` (the record as read, or none) does
    /// without writing ([`ClaimEffect::writes`]): an answer, or a replay
    /// served from the row and counted; or whether it would take the key or
    /// change the record.
    fn unwritten(
        &self,
        req: &ClaimRequest,
        key: &ScopeDigest,
        row: Option<&Row>,
        now: i64,
    ) -> Result<Peeked> {
        let Some(row) = row else {
            return Ok(Peeked::Takes);
        };
        let loaded = LoadedRecord::read(row)?;
        match effects::claim(Some(&loaded), req, now) {
            ClaimEffect::Answer(reply) => Ok(Peeked::Answered(ClaimOutcome::answer(reply))),
            ClaimEffect::Replay { status, completed_at } => {
                let body = row.optional_bytes("response_body")?.unwrap_or_default();
                self.replay(key, &loaded, (status, completed_at), body)
                    .map(Peeked::Answered)
            }
            ClaimEffect::Take { .. } => Ok(Peeked::Takes),
            ClaimEffect::Change(_) => Ok(Peeked::Changes),
        }
    }

    /// Serves the stored response of `loaded` and counts the replay.
    fn replay(
        &self,
        key: &ScopeDigest,
        loaded: &LoadedRecord,
        (status, completed_at): (u16, i64),
        body: Vec<u8>,
    ) -> Result<ClaimOutcome> {
        self.count_replay(*key, loaded.view.fence);
        loaded.replay(&self.seal, key, (status, completed_at), body)
    }

    pub(super) async fn claim_record(
        &self,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<Instant>,
    ) -> Result<ClaimOutcome> {
        let key = ScopeDigest::of(&req.scope);
        let columns = KeyColumns::of(&req.scope);
        let claimed = Claimed::of(req, now);
        let mut client = self.connections.client().await?;
        let claim_stmt = client.prepare(&CLAIM).await?;
        for _ in 0..MAX_ATTEMPTS {
            // Nobody waits for this claim any more: it is answered from the
            // record as committed, and refused if its effect writes, since
            // committing it would only leave a record that its filter is
            // abandoning. [`CLAIM`] may insert, so it is not sent.
            if past(deadline) {
                let rows = client.query(&COMMITTED, &key.bind(&[])).await?;
                return self
                    .unwritten(req, &key, rows.first(), now)?
                    .answered()
                    .ok_or(StoreError::Late);
            }
            let params = bind_with_columns(&key, &columns, &claimed.params(&[]));
            let query = client.rows(&claim_stmt, &params);
            let rows = match deadline {
                None => query.await,
                Some(d) => match tokio::time::timeout_at(d.into(), query).await {
                    Ok(rows) => rows,
                    Err(_) => {
                        // Stuck past its caller's deadline (a lock wait, a slow
                        // commit): cancelled at the server so that it does not
                        // land later. One that lands anyway is abandoned.
                        let cancel = client.cancel_token();
                        let transport = self.connections.transport.clone();
                        let limit = self.connections.timeouts.connect;
                        tokio::spawn(async move {
                            match tokio::time::timeout(limit, transport.cancel(cancel)).await {
                                Ok(Ok(())) => {}
                                Ok(Err(e)) => tracing::warn!("postgres: could not cancel a late claim: {e}"),
                                Err(_) => {
                                    tracing::warn!("postgres: could not cancel a late claim: no answer")
                                }
                            }
                        });
                        return Err(StoreError::Late);
                    }
                },
            }?;
            match self.read_claim_row(req, &claimed, &key, rows.first(), now)? {
                Read::Decided(outcome) => return Ok(outcome),
                // Lost a race with a concurrent insert we cannot see yet: look again.
                Read::Again => continue,
                Read::Changes => {
                    if let Some(out) = self
                        .change_claimed(&mut client, req, &claimed, now, deadline)
                        .await?
                    {
                        return Ok(out);
                    }
                }
            }
            // The record went away between our read and our lock: decide again.
        }
        Err(StoreError::unavailable(
            Outage::Database,
            "claim kept racing with concurrent changes",
        ))
    }

    /// Logs the `claimed` event of a new record, committed with it.
    pub(super) fn log_claimed(&self, req: &ClaimRequest, claimed: &Claimed<'_>, fence: u64, now: i64) {
        EventInfo {
            log_id: String::new(),
            scope: req.scope.clone(),
            generation: fence,
            at: now,
            transition: Transition::Claimed,
            attempt: claimed.attempt.map(String::from),
            fence,
            fingerprint: claimed.fingerprint.clone(),
            status: None,
            actor: Actor::Filter,
            detail: None,
            duration_ms: 0,
            reason: None,
        }
        .log(&self.log_ids, &req.trace);
    }

    /// What the row [`CLAIM`] returned (if any) means for the claim.
    fn read_claim_row(
        &self,
        req: &ClaimRequest,
        claimed: &Claimed<'_>,
        key: &ScopeDigest,
        row: Option<&Row>,
        now: i64,
    ) -> Result<Read> {
        let Some(row) = row else {
            return Ok(Read::Again);
        };
        if row.flag("inserted")? {
            let fence = row.unsigned("fence")?;
            self.log_claimed(req, claimed, fence, now);
            return Ok(Read::Decided(ClaimOutcome::answer(ClaimReply::Owned { fence })));
        }
        // Answered or replayed from the committed row this statement returned.
        Ok(match self.unwritten(req, key, Some(row), now)?.answered() {
            Some(outcome) => Read::Decided(outcome),
            None => Read::Changes,
        })
    }

    /// A batch's claim, sent on the batch's connection together with the
    /// other calls' statements: decided by its first [`CLAIM`] alone when
    /// that is enough (a new key, an answer, a replay), else `None` and it
    /// goes the whole way of [`Postgres::claim_record`] afterwards. A claim
    /// past its caller's deadline is not sent: it goes that way at once.
    pub(super) async fn claim_pipelined(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<Instant>,
    ) -> Option<Result<ClaimOutcome>> {
        if past(deadline) {
            return None;
        }
        let key = ScopeDigest::of(&req.scope);
        let columns = KeyColumns::of(&req.scope);
        let claimed = Claimed::of(req, now);
        let params = bind_with_columns(&key, &columns, &claimed.params(&[]));
        let rows = match client.rows(stmt, &params).await {
            Ok(rows) => rows,
            Err(e) => return Some(Err(e)),
        };
        match self.read_claim_row(req, &claimed, &key, rows.first(), now) {
            Ok(Read::Decided(outcome)) => Some(Ok(outcome)),
            Ok(Read::Again | Read::Changes) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// A claim whose effect changes an existing record (a new generation, or
    /// a lease that ran out turning unknown), decided again from the record
    /// under its lock so that nothing that happened since (a completion,
    /// another claim) is overwritten, and carried out there. `None` when
    /// the record is gone.
    async fn change_claimed(
        &self,
        client: &mut Client,
        req: &ClaimRequest,
        claimed: &Claimed<'_>,
        now: i64,
        deadline: Option<Instant>,
    ) -> Result<Option<ClaimOutcome>> {
        let key = ScopeDigest::of(&req.scope);
        let tx = client.begin().await?;
        let Some((loaded, body)) = lock(&tx, &key).await? else {
            return Ok(None);
        };
        let effect = effects::claim(Some(&loaded), req, now);
        // The lock may have been waited for past the deadline: as at the
        // start, an effect that writes is refused then (the transaction rolls
        // back with nothing in it).
        if effect.writes() && past(deadline) {
            return Err(StoreError::Late);
        }
        let (outcome, events) = match effect {
            ClaimEffect::Answer(reply) => (ClaimOutcome::answer(reply), Vec::new()),
            ClaimEffect::Replay { status, completed_at } => (
                self.replay(&key, &loaded, (status, completed_at), body)?,
                Vec::new(),
            ),
            ClaimEffect::Take { replaced, by } => {
                let mut events = Vec::new();
                if let Some(replaced) = replaced {
                    events = event(&tx, &key, replaced.by, now).await?;
                    to_history(&tx, &key, replaced.ended, now).await?;
                }
                let stmt = tx.prepare(&REPLACE_GENERATION).await?;
                let (old_fence, old_state) = (i64_from(loaded.view.fence), loaded.view.state.as_str());
                let mut params: Vec<Param<'_>> = vec![&key];
                params.extend(claimed.params(&[&old_fence, &old_state]));
                let fence = tx.one(&stmt, &params).await?.unsigned("fence")?;
                events.extend(event(&tx, &key, by, now).await?);
                (ClaimOutcome::answer(ClaimReply::Owned { fence }), events)
            }
            ClaimEffect::Change(change) => carry_out(&tx, (&key, &self.seal), change, now).await?,
        };
        tx.commit().await?;
        self.log_all(&events, &req.trace);
        Ok(Some(outcome))
    }
}
