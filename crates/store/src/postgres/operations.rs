//! The fence calls, abandon and the operators' changes: each locks the
//! record, plans ([`crate::plan`]) and carries the plan out in one
//! transaction. The filter's completion is the exception: one statement,
//! [`COMPLETE`], which states [`plan::complete`] in SQL.

use std::sync::LazyLock;

use idemgate_core::protocol::{AbandonRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::record::{State, Transition};
use idemgate_core::scope::Scope;
use idemgate_core::trace::Trace;

use super::generation::{end_generation, event_of, execute, noted_event, set_unknown};
use super::pool::{unavailable, Client, On, Stmt, Tx};
use super::rows::{bind_with_columns, Bind, Param};
use super::Postgres;
use crate::backend::{Actor, EventInfo, Resolution, Result};
use crate::columns::{encode_headers, i64_from, u64_from, KeyColumns, LoadedRecord, ScopeDigest};
use crate::conditions;
use crate::plan::{self, Fence, Plan, Write};
use crate::sealing::Seal;

/// Completes the record of `$1` if `$2` is its fence and it is open
/// (`{fenceable}`: [`idemgate_core::record::may_fence`]) or unknown and
/// archived since ([`idemgate_core::record::completes_archived`]: then
/// without its body), and records the event; no row back means stale. This is [`plan::complete`] in one
/// statement, with no read before it, so a batch of completions is one
/// round trip; the story suite checks that both come to the same in every
/// state a completion meets (`a_completion_comes_to_what_its_plan_says`). `$3` status, `$4` headers, `$5` body, `$6` whether it
/// is stored, `$7` now, `$8` the id of the key that sealed headers and body
/// (NULL: plaintext).
///
/// The statement's own transaction commits with `synchronous_commit = off`
/// (no wait for the WAL flush) unless the claim's policy releases unknown
/// outcomes: losing a completion in a database crash leaves the record in
/// progress, so it turns unknown when its lease runs out and is never run
/// again; under `on_unknown: release` it would free the key for a second
/// execution, so that completion waits for the flush like every other write.
pub(super) static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    let done = conditions::expand(&format!(
        "done AS (UPDATE idempotency_records SET state = {completed}, response_status = $3, \
           response_headers = $4, response_body = CASE WHEN archived_at IS NULL THEN $5::bytea END, \
           body_stored = $6 AND archived_at IS NULL, completed_at = $7, expires_at = {expiry}, \
           lease_until = $7, response_key = $8 WHERE {key} AND fence = $2 \
           AND ({{fenceable}} OR {{unknown}} AND archived_at IS NOT NULL) \
           RETURNING {generation}, fence, response_status, created_at, \
           set_config('synchronous_commit', CASE WHEN release_on_unknown THEN 'on' ELSE 'off' END, true) \
             AS commit_mode), ",
        completed = conditions::state(State::Completed),
        expiry = conditions::completion_expiry("$7"),
        key = key_where!(),
        generation = crate::columns::GENERATION_OF_EVENT,
    ));
    let values = format!(
        "SELECT generation, $7, {completion}, fence, response_status, {filter}, NULL, $7 - created_at, NULL \
         FROM done WHERE commit_mode IS NOT NULL",
        completion = conditions::transition(Transition::Completed),
        filter = conditions::actor(&Actor::Filter),
    );
    event_of(&done, &values, "done g")
});

/// Carries out `plan` on the record of `key`, locked in `tx`: its reply and
/// the events it recorded.
pub(super) async fn carry_out<R>(
    tx: &Tx<'_>,
    (key, seal): (&ScopeDigest, &Seal),
    plan: Plan<'_, R>,
    now: i64,
) -> Result<(R, Vec<EventInfo>)> {
    let mut events = Vec::new();
    for write in plan.writes {
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
                static SQL: LazyLock<String> = LazyLock::new(|| {
                    format!(
                        "UPDATE idempotency_records SET state = {}, fence = $2, response_status = $3, \
                         response_headers = $4, response_body = $5, body_stored = $6, completed_at = $7, \
                         expires_at = $8, lease_until = $7, response_key = $9 WHERE {}",
                        conditions::state(State::Completed),
                        key_where!()
                    )
                });
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
                execute(tx, &SQL, key, &params).await?;
            }
            Write::Archive => {
                let sql = concat!(
                    "UPDATE idempotency_records SET archived_at = $2, response_body = NULL WHERE ",
                    key_where!()
                );
                execute(tx, sql, key, &[&now]).await?;
            }
            Write::RememberAbandon { scope, attempt } => {
                let sql = "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, principal, \
                           route, namespace, idem_key, attempt, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                           ON CONFLICT DO NOTHING";
                let columns = KeyColumns::of(scope);
                tx.execute(sql, &bind_with_columns(key, &columns, &[&attempt, &now]))
                    .await?;
            }
        }
    }
    Ok((plan.reply, events))
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
        self.complete_on(&client, &stmt, req, body, now).await
    }

    /// [`COMPLETE`] on `client` (prepared there as `stmt`): one statement, so
    /// a batch sends it together with the other calls' statements.
    pub(super) async fn complete_on(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        req: &CompleteRequest,
        body: &[u8],
        now: i64,
    ) -> Result<FenceReply> {
        let key = ScopeDigest::of(&req.scope);
        let fence = i64_from(req.fence);
        let status = i32::from(req.status);
        let body: Option<&[u8]> = if req.body_stored { Some(body) } else { None };
        // Sealed under the fence the statement requires of the record.
        let sealed = self
            .seal
            .seal(&key, req.fence, encode_headers(&req.headers), body)?;
        let body = sealed.body.as_deref();
        let params = key.bind(&[
            &fence,
            &status,
            &sealed.headers,
            &body,
            &req.body_stored,
            &now,
            &sealed.key_id,
        ]);
        let rows = client.rows(stmt, &params).await?;
        let events = rows.iter().map(EventInfo::read).collect::<Result<Vec<_>>>()?;
        self.log_all(&events, &req.trace);
        Ok(if events.is_empty() {
            FenceReply::Stale
        } else {
            FenceReply::Done
        })
    }

    /// Locks the record of `scope`, plans with `plan_for` (from `input`, the
    /// record and now) and carries the plan out, in one transaction.
    async fn planned<D, R>(
        &self,
        scope: (&Scope, &Trace),
        input: D,
        plan_for: for<'d> fn(&'d D, Option<&LoadedRecord>, i64) -> Plan<'d, R>,
        now: i64,
    ) -> Result<R>
    where
        D: Send + Sync + 'static,
        R: Send + 'static,
    {
        let seal = self.seal.clone();
        self.in_tx(scope, move |tx, key, locked| {
            Box::pin(async move {
                let plan = plan_for(&input, locked.as_ref(), now);
                carry_out(tx, (key, &seal), plan, now).await
            })
        })
        .await
    }

    pub(super) async fn release_record(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.planned(
            (&req.scope, &req.trace),
            req.fence,
            |fence, l, _| plan::release(l, *fence),
            now,
        )
        .await
    }

    pub(super) async fn mark_record_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        self.planned(
            (&req.scope, &req.trace),
            req.fence,
            |fence, l, now| plan::mark_unknown(l, *fence, now),
            now,
        )
        .await
    }

    pub(super) async fn abandon_record(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        self.planned(
            (&req.scope, &req.trace),
            req.clone(),
            |req, l, _| plan::abandon(l, &req.scope, req.attempt.as_str()),
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
        self.planned(
            (scope, &Trace::NONE),
            input,
            |(how, reason), l, now| plan::resolve(l, how, reason.as_deref(), now),
            now,
        )
        .await
    }

    pub(super) async fn purge_record(&self, scope: &Scope, now: i64) -> Result<bool> {
        self.planned((scope, &Trace::NONE), (), |_, l, _| plan::purge(l), now)
            .await
    }
}
