//! The fence calls, abandon and the operators' changes: each locks the
//! record, decides its effect ([`crate::effects`]) and carries it out in one
//! transaction. The filter's completions are the exception: one statement,
//! [`COMPLETE`], which states [`effects::complete`] in SQL for any number of
//! them.

use std::sync::LazyLock;

use idemgate_core::protocol::{AbandonRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::record::{State, Transition};
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;

use super::errors::unavailable;
use super::generation::{end_generation, event_of, execute, noted_event, set_unknown};
use super::pool::{Client, On, Stmt, Tx};
use super::rows::{bind_with_columns, Param};
use super::Postgres;
use crate::backend::{Actor, EventInfo, Resolution, Result, StoreError};
use crate::conditions;
use crate::effects::{self, Effect, Fence, Write};
use crate::row_mapping::{encode_headers, i64_from, u64_from, KeyColumns, LoadedRecord, ScopeDigest};
use crate::sealing::Seal;
use crate::shared_statements::{ARCHIVE_RECORD, COMPLETE_RECORD, REMEMBER_ABANDON};

/// Completes each record of `$1[i]` whose fence is `$2[i]` if it is open
/// (`{fenceable}`: [`idemgate_core::record::may_fence`]) or unknown and
/// archived since ([`idemgate_core::record::completes_archived`]: then
/// without its body), and records its event; a completion with no row back
/// is stale. This is [`effects::complete`] in one statement, with no read
/// before it, for any number of completions of distinct keys: a batch's
/// completions are one transaction and one commit. The story suite checks
/// that it comes to what the effect says in every state a completion meets
/// (`a_completion_comes_to_what_its_effect_says`). Arrays, one element a
/// completion: `$1` key, `$2` fence, `$3` status, `$4` headers, `$5` body
/// (NULL: not stored), `$6` whether it is stored, `$8` the id of the key
/// that sealed headers and body (NULL: plaintext); `$7` now.
///
/// The transaction commits with `synchronous_commit = off` (no wait for the
/// WAL flush) unless the policy of one of its claims releases unknown
/// outcomes: losing a completion in a database crash leaves the record in
/// progress, so it turns unknown when its lease runs out and is never run
/// again; under `on_unknown: release` it would free the key for a second
/// execution, so a transaction that holds such a completion waits for the
/// flush like every other write.
///
/// Rows are updated in no set order: two such statements completing the
/// same keys at once (only a completion sent twice can) may deadlock, and
/// PostgreSQL then fails one of them, whose completions go one by one.
pub(super) static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    let done = conditions::expand(&format!(
        "c AS (SELECT * FROM unnest($1::bytea[], $2::bigint[], $3::integer[], $4::text[], $5::bytea[], \
           $6::boolean[], $8::text[]) AS c(c_key, c_fence, c_status, c_headers, c_body, c_stored, c_sealed_by) \
           WHERE {one_row_estimate}), \
         done AS (UPDATE idempotency_records SET state = {completed}, response_status = c_status, \
           response_headers = c_headers, response_body = CASE WHEN archived_at IS NULL THEN c_body END, \
           body_stored = c_stored AND archived_at IS NULL, completed_at = $7, expires_at = {expiry}, \
           lease_until = $7, response_key = c_sealed_by FROM c WHERE scope_digest = c_key AND fence = c_fence \
           AND ({{fenceable}} OR {{unknown}} AND archived_at IS NOT NULL) \
           RETURNING {generation}, fence, response_status, created_at, release_on_unknown), \
         mode AS (SELECT set_config('synchronous_commit', \
           CASE WHEN bool_or(release_on_unknown) THEN 'on' ELSE 'off' END, true) AS commit_mode FROM done), ",
        completed = conditions::state(State::Completed),
        expiry = conditions::completion_expiry("$7"),
        generation = crate::row_mapping::GENERATION_OF_EVENT,
        one_row_estimate = super::rows::one_row_estimate("c_fence", "c_status"),
    ));
    let values = format!(
        "SELECT generation, $7, {completion}, fence, response_status, {filter}, NULL, $7 - created_at, NULL \
         FROM done, mode WHERE commit_mode IS NOT NULL",
        completion = conditions::transition(Transition::Completed),
        filter = conditions::actor(&Actor::Filter),
    );
    event_of(&done, &values, "done g WHERE g.generation = ev.generation")
});

/// Carries out `effect` on the record of `key`, locked in `tx`: its reply and
/// the events it recorded.
pub(super) async fn carry_out<R>(
    tx: &Tx<'_>,
    (key, seal): (&ScopeDigest, &Seal),
    effect: Effect<'_, R>,
    now: i64,
) -> Result<(R, Vec<EventInfo>)> {
    let mut events = Vec::new();
    for write in effect.writes {
        match write {
            Write::Event { by, note } => events.extend(noted_event(tx, key, by, note, now).await?),
            Write::EndGeneration { last, by, note } => {
                events.extend(end_generation(tx, key, last, (by, note), now).await?)
            }
            Write::SetUnknown {
                read_with,
                expires_at,
            } => set_unknown(tx, key, read_with, expires_at).await?,
            // Durable whatever `durable` says: only [`COMPLETE`] commits
            // without waiting for the WAL flush.
            Write::Complete {
                response,
                fence,
                expires_at,
                durable: _,
            } => {
                let fence = match fence {
                    Fence::Held(f) => f,
                    Fence::New => {
                        let stmt = tx
                            .prepare("SELECT nextval('idempotency_fence_seq') AS fence")
                            .await?;
                        let next = tx.one(&stmt, &[]).await?;
                        u64_from(next.try_get("fence").map_err(unavailable)?, "fence")?
                    }
                };
                // Sealed under the fence the record holds from now on.
                let sealed = seal.seal(key, fence, encode_headers(response.headers), response.body)?;
                let (fence, status, body) = (
                    i64_from(fence),
                    i32::from(response.status),
                    sealed.body.as_deref(),
                );
                let params: [Param<'_>; 8] = [
                    &fence,
                    &status,
                    &sealed.headers,
                    &body,
                    &response.body_stored,
                    &now,
                    &expires_at,
                    &sealed.key_id,
                ];
                execute(tx, COMPLETE_RECORD.postgres(), key, &params).await?;
            }
            Write::Archive => {
                execute(tx, ARCHIVE_RECORD.postgres(), key, &[&now]).await?;
            }
            Write::RememberAbandon { scope, attempt } => {
                let columns = KeyColumns::of(scope);
                let attempt: &str = &attempt;
                tx.execute(
                    REMEMBER_ABANDON.postgres(),
                    &bind_with_columns(key, &columns, &[&attempt, &now]),
                )
                .await?;
            }
        }
    }
    Ok((effect.reply, events))
}

impl Postgres {
    pub(super) async fn complete_record(
        &self,
        req: &CompleteRequest,
        body: &[u8],
        now: i64,
    ) -> Result<FenceReply> {
        let client = self.connections.client().await?;
        let stmt = client.prepare(&COMPLETE).await?;
        self.complete_one(&client, &stmt, req, body, now).await
    }

    /// [`COMPLETE`] of one completion on `client` (prepared there as `stmt`).
    pub(super) async fn complete_one(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        req: &CompleteRequest,
        body: &[u8],
        now: i64,
    ) -> Result<FenceReply> {
        let replies = self.complete_all(client, stmt, &[(req, body)], now).await?;
        replies
            .into_iter()
            .next()
            .ok_or_else(|| StoreError::Corrupt("a completion went unanswered".into()))
    }

    /// [`COMPLETE`] of `completions` (their keys distinct) on `client`
    /// (prepared there as `stmt`): one statement, so a batch sends it
    /// together with the other calls' statements. Their replies, in order.
    /// An error means nothing is known of any of them (the statement is one
    /// transaction: none was made, unless the error came after its commit).
    pub(super) async fn complete_all(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        completions: &[(&CompleteRequest, &[u8])],
        now: i64,
    ) -> Result<Vec<FenceReply>> {
        let reqs: Vec<&CompleteRequest> = completions.iter().map(|(req, _)| *req).collect();
        let keys: Vec<ScopeDigest> = reqs.iter().map(|req| ScopeDigest::of(&req.scope)).collect();
        // Each sealed under the fence the statement requires of its record.
        let sealed = completions
            .iter()
            .zip(&keys)
            .map(|((req, body), key)| {
                let body = req.body_stored.then_some(*body);
                self.seal.seal(key, req.fence, encode_headers(&req.headers), body)
            })
            .collect::<Result<Vec<_>>>()?;
        let digests: Vec<&[u8]> = keys.iter().map(ScopeDigest::as_bytes).collect();
        let fences: Vec<i64> = reqs.iter().map(|req| i64_from(req.fence)).collect();
        let statuses: Vec<i32> = reqs.iter().map(|req| i32::from(req.status)).collect();
        let headers: Vec<&str> = sealed.iter().map(|s| s.headers.as_str()).collect();
        let bodies: Vec<Option<&[u8]>> = sealed.iter().map(|s| s.body.as_deref()).collect();
        let stored: Vec<bool> = reqs.iter().map(|req| req.body_stored).collect();
        let sealed_by: Vec<Option<&str>> = sealed.iter().map(|s| s.key_id.as_deref()).collect();
        let params: [Param<'_>; 8] = [
            &digests, &fences, &statuses, &headers, &bodies, &stored, &now, &sealed_by,
        ];
        let rows = client.rows(stmt, &params).await?;
        // A completion whose event came back is done; the others are stale.
        let mut replies = vec![FenceReply::Stale; reqs.len()];
        for row in &rows {
            let event = EventInfo::read(row)?;
            let key = ScopeDigest::of(&event.scope);
            let i = keys.iter().position(|k| *k == key);
            let (Some(reply), Some(req)) = (i.and_then(|i| replies.get_mut(i)), i.and_then(|i| reqs.get(i)))
            else {
                return Err(StoreError::Corrupt(
                    "a completion returned a key it was not given".into(),
                ));
            };
            *reply = FenceReply::Done;
            self.log_all(std::slice::from_ref(&event), &req.trace);
        }
        Ok(replies)
    }

    /// Locks the record of `scope`, decides its effect with `effect_of` (from
    /// `input`, the record and now) and carries it out, in one transaction.
    async fn lock_and_carry_out<D, R>(
        &self,
        scope: (&Scope, &Trace),
        input: D,
        effect_of: for<'d> fn(&'d D, Option<&LoadedRecord>, i64) -> Effect<'d, R>,
        now: i64,
    ) -> Result<R>
    where
        D: Send + Sync + 'static,
        R: Send + 'static,
    {
        let seal = self.seal.clone();
        self.in_tx(scope, move |tx, key, locked| {
            Box::pin(async move {
                let effect = effect_of(&input, locked.as_ref(), now);
                carry_out(tx, (key, &seal), effect, now).await
            })
        })
        .await
    }

    pub(super) async fn release_record(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.lock_and_carry_out(
            (&req.scope, &req.trace),
            req.clone(),
            |req, l, _| effects::release(l, &req.scope, req.fence),
            now,
        )
        .await
    }

    pub(super) async fn mark_record_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.lock_and_carry_out(
            (&req.scope, &req.trace),
            req.fence,
            |fence, l, now| effects::mark_unknown(l, *fence, now),
            now,
        )
        .await
    }

    pub(super) async fn abandon_record(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        self.lock_and_carry_out(
            (&req.scope, &req.trace),
            req.clone(),
            |req, l, _| effects::abandon(l, &req.scope, req.attempt.as_str()),
            now,
        )
        .await
    }

    pub(super) async fn resolve_record(
        &self,
        scope: &Scope,
        how: &Resolution,
        reason: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        let input = (how.clone(), reason.map(str::to_string));
        self.lock_and_carry_out(
            (scope, &Trace::NONE),
            input,
            |(how, reason), l, now| effects::resolve(l, how, reason.as_deref(), now),
            now,
        )
        .await
    }
}
