//! A claim: one statement in the common path, a locked re-decision when it
//! must change an existing record.

use std::time::Instant;

use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use idemgate_core::record::{self, ClaimDecision, Transition};
use tokio_postgres::Row;

use super::generation::{event, lock, set_unknown, to_history};
use super::pool::{Client, On, Stmt};
use super::rows::{bind_with_columns, Bind, Param, CLAIM, REPLACE_GENERATION};
use super::Postgres;
use crate::backend::{Actor, ClaimOutcome, EventInfo, Outage, Result, StoreError};
use crate::columns::{i64_from, ColumnReader, KeyColumns, LoadedRecord, ScopeDigest};

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

impl Postgres {
    /// [`crate::backend::Backend::peek`]: the record as committed, read
    /// without a lock, decided by the same rules.
    pub(super) async fn peek_record(&self, req: &ClaimRequest, now: i64) -> Result<Option<ClaimOutcome>> {
        const SQL: &str = concat!(
            "SELECT state, fingerprint, fence, lease_until, ttl_ms, response_status, response_headers, response_key, \
             response_body, body_stored, completed_at, expires_at, archived_at IS NOT NULL AS archived, attempt, \
             release_on_unknown FROM idempotency_records WHERE ",
            key_where!()
        );
        let key = ScopeDigest::of(&req.scope);
        let rows = self.connections.query(SQL, &key.bind(&[])).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let loaded = LoadedRecord::read(row)?;
        match record::decide_claim(Some(&loaded.view), req, now) {
            ClaimDecision::Answer(reply) => Ok(Some(ClaimOutcome::answer(reply))),
            ClaimDecision::Replay { status, completed_at } => {
                self.count_replay(key, loaded.view.fence);
                let body = row.optional_bytes("response_body")?.unwrap_or_default();
                Ok(Some(loaded.replay(
                    &self.seal,
                    &key,
                    (status, completed_at),
                    body,
                )?))
            }
            ClaimDecision::Claim | ClaimDecision::BecomeUnknown => Ok(None),
        }
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
            // Nobody waits for this claim any more: committing it would only
            // leave a record that its filter is abandoning.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(StoreError::Late);
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
        let loaded = LoadedRecord::read(row)?;
        Ok(match record::decide_claim(Some(&loaded.view), req, now) {
            ClaimDecision::Answer(reply) => Read::Decided(ClaimOutcome::answer(reply)),
            ClaimDecision::Replay { status, completed_at } => {
                // Served from the committed row this statement returned.
                self.count_replay(*key, loaded.view.fence);
                let body = row.optional_bytes("response_body")?.unwrap_or_default();
                Read::Decided(loaded.replay(&self.seal, key, (status, completed_at), body)?)
            }
            ClaimDecision::Claim | ClaimDecision::BecomeUnknown => Read::Changes,
        })
    }

    /// A batch's claim, sent on the batch's connection together with the
    /// other calls' statements: decided by its first [`CLAIM`] alone when
    /// that is enough (a new key, an answer, a replay), else `None` and it
    /// goes the whole way of [`Postgres::claim_record`] afterwards. A claim
    /// past its caller's deadline is not sent.
    pub(super) async fn claim_pipelined(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<Instant>,
    ) -> Option<Result<ClaimOutcome>> {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(Err(StoreError::Late));
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

    /// A claim that must change an existing record (a new generation, or a
    /// lease that ran out turning unknown), decided again under the record's
    /// lock so that nothing that happened since (a completion, another
    /// claim) is overwritten. `None` when the record is gone.
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
        let view = &loaded.view;
        let mut events = Vec::new();
        let outcome = match record::decide_claim(Some(view), req, now) {
            ClaimDecision::Answer(reply) => ClaimOutcome::answer(reply),
            ClaimDecision::Replay { status, completed_at } => {
                self.count_replay(key, view.fence);
                loaded.replay(&self.seal, &key, (status, completed_at), body)?
            }
            ClaimDecision::Claim => {
                to_history(
                    &tx,
                    &key,
                    record::ended_as(view.state, Transition::Reclaimed),
                    now,
                )
                .await?;
                let stmt = tx.prepare(&REPLACE_GENERATION).await?;
                let (old_fence, old_state) = (i64_from(view.fence), view.state.as_str());
                let mut params: Vec<Param<'_>> = vec![&key];
                params.extend(claimed.params(&[&old_fence, &old_state]));
                let row = tx.one(&stmt, &params).await?;
                let fence = row.unsigned("fence")?;
                events.extend(event(&tx, &key, (Transition::Reclaimed, &Actor::Filter, None), now).await?);
                ClaimOutcome::answer(ClaimReply::Owned { fence })
            }
            ClaimDecision::BecomeUnknown => {
                let expires_at = record::unknown_expiry(now, loaded.ttl_ms);
                set_unknown(&tx, &key, (view.fence, view.state), expires_at).await?;
                let by = (Transition::LeaseExpired, &Actor::Filter, Some("unknown"));
                events.extend(event(&tx, &key, by, now).await?);
                ClaimOutcome {
                    reply: ClaimReply::Unknown,
                    body: Vec::new(),
                    became_unknown: true,
                }
            }
        };
        if matches!(outcome.reply, ClaimReply::Owned { .. }) && deadline.is_some_and(|d| Instant::now() >= d)
        {
            return Err(StoreError::Late);
        }
        tx.commit().await?;
        self.log_all(&events, &req.trace);
        Ok(Some(outcome))
    }
}
