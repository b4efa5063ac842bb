//! The fence calls, abandon and the operators' changes. Completion is one
//! statement; the others lock the record, ask the rules, and write.

use std::sync::LazyLock;

use idemgate_core::protocol::{AbandonRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::record::{self, AbandonDecision, State, Transition};
use idemgate_core::scope::Scope;
use tokio_postgres::Statement;

use super::generation::{end_generation, end_noted_generation, event, execute, noted_event, set_unknown};
use super::pool::{unavailable, Client};
use super::rows::{bind_with_columns, Bind, Param};
use super::Postgres;
use crate::backend::{actor, EventInfo, Resolution, Result};
use crate::columns::{encode_headers, i64_from, KeyColumns, LoadedRecord, ScopeDigest};
use crate::conditions;

/// Completes the record of `$1` if `$2` is its fence and it is open
/// (`{fenceable}`: [`record::may_fence`]), and records the event; no row
/// back means stale. `$3` status, `$4` headers, `$5` body, `$6` whether it
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
    conditions::expand(&format!(
        "WITH done AS (UPDATE idempotency_records SET state = 'completed', response_status = $3, \
           response_headers = $4, response_body = $5, body_stored = $6, completed_at = $7, expires_at = {expiry}, \
           lease_until = $7, response_key = $8 WHERE {key} AND fence = $2 AND {{fenceable}} \
           RETURNING scope_version, tenant, principal, route, namespace, idem_key, generation, attempt, fence, \
           fingerprint, response_status, created_at, \
           set_config('synchronous_commit', CASE WHEN release_on_unknown THEN 'on' ELSE 'off' END, true) \
             AS commit_mode) \
         INSERT INTO idempotency_events ({events}) SELECT scope_version, tenant, principal, route, namespace, idem_key, \
           generation, $7, 'completed', attempt, fence, fingerprint, response_status, 'filter', NULL, $7 - created_at, NULL \
           FROM done WHERE commit_mode IS NOT NULL RETURNING {events}",
        expiry = conditions::completion_expiry("$7"),
        key = key_where!(),
        events = crate::columns::EVENT_COLUMNS,
    ))
});

/// Whether a fence call with `fence` may act on `locked`: [`record::may_fence`].
fn fenced(locked: Option<LoadedRecord>, fence: u64) -> Option<LoadedRecord> {
    locked.filter(|l| l.may_fence(fence))
}

impl Postgres {
    pub(super) async fn complete_record(
        &self,
        req: &CompleteRequest,
        body: &[u8],
        now: i64,
    ) -> Result<FenceReply> {
        let client = self.connections.client().await?;
        let stmt = client.prepare_cached(&COMPLETE).await.map_err(unavailable)?;
        self.complete_on(&client, &stmt, req, body, now).await
    }

    /// [`COMPLETE`] on `client` (prepared there as `stmt`): one statement, so
    /// a batch sends it together with the other calls' statements.
    pub(super) async fn complete_on(
        &self,
        client: &Client,
        stmt: &Statement,
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
        let rows = client.query(stmt, &params).await.map_err(unavailable)?;
        let events = rows.iter().map(EventInfo::read).collect::<Result<Vec<_>>>()?;
        self.log_all(&events);
        Ok(if events.is_empty() {
            FenceReply::Stale
        } else {
            FenceReply::Done
        })
    }

    pub(super) async fn release_record(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let fence = req.fence;
        self.in_tx(&req.scope, move |tx, key, locked| {
            Box::pin(async move {
                let Some(loaded) = fenced(locked, fence) else {
                    return Ok((FenceReply::Stale, Vec::new()));
                };
                let by = (Transition::Released, actor::FILTER, None);
                Ok((
                    FenceReply::Done,
                    end_generation(tx, key, loaded.view.state, by, now).await?,
                ))
            })
        })
        .await
    }

    pub(super) async fn mark_record_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply> {
        let fence = req.fence;
        self.in_tx(&req.scope, move |tx, key, locked| {
            Box::pin(async move {
                let Some(loaded) = fenced(locked, fence) else {
                    return Ok((FenceReply::Stale, Vec::new()));
                };
                let view = &loaded.view;
                if view.state == State::Unknown {
                    return Ok((FenceReply::Done, Vec::new()));
                }
                let expires_at = record::unknown_expiry(now, loaded.ttl_ms);
                set_unknown(tx, key, (view.fence, view.state), expires_at).await?;
                let by = (Transition::MarkedUnknown, actor::FILTER, None);
                Ok((FenceReply::Done, event(tx, key, by, now).await?))
            })
        })
        .await
    }

    pub(super) async fn abandon_record(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply> {
        let attempt = req.attempt.clone();
        let scope = req.scope.clone();
        self.in_tx(&req.scope, move |tx, key, locked| {
            Box::pin(async move {
                let attempt = attempt.as_str();
                match (
                    record::decide_abandon(locked.as_ref().map(|l| &l.view), attempt),
                    locked,
                ) {
                    (AbandonDecision::End, Some(l)) => {
                        let by = (Transition::Abandoned, actor::FILTER, None);
                        Ok((
                            FenceReply::Done,
                            end_generation(tx, key, l.view.state, by, now).await?,
                        ))
                    }
                    (AbandonDecision::Settled, _) => Ok((FenceReply::Stale, Vec::new())),
                    _ => {
                        // The claim may still be on its way: the sweeper
                        // releases it if it lands under this attempt.
                        let sql = "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, \
                                   principal, route, namespace, idem_key, attempt, at) \
                                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING";
                        let columns = KeyColumns::of(&scope);
                        let stmt = tx.prepare_cached(sql).await.map_err(unavailable)?;
                        tx.execute(&stmt, &bind_with_columns(key, &columns, &[&attempt, &now]))
                            .await
                            .map_err(unavailable)?;
                        Ok((FenceReply::Done, Vec::new()))
                    }
                }
            })
        })
        .await
    }

    pub(super) async fn resolve_record(
        &self,
        scope: &Scope,
        how: &Resolution,
        reason: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        let (how, reason) = (how.clone(), reason.map(str::to_string));
        let seal = self.seal.clone();
        self.in_tx(scope, move |tx, key, locked| {
            Box::pin(async move {
                let Some(loaded) = locked else {
                    return Ok((false, Vec::new()));
                };
                if !loaded.is_open() {
                    return Ok((false, Vec::new()));
                }
                match how {
                    Resolution::Release => {
                        let by = (Transition::Resolved, actor::OPERATOR, Some("release"));
                        let noted = (by, reason.as_deref());
                        Ok((true, end_noted_generation(tx, key, loaded.view.state, noted, now).await?))
                    }
                    Resolution::Complete { status, headers, body } => {
                        // A new fence: the old owner's late completion must not
                        // overwrite what the operator decided.
                        // Taken first: the response is sealed under it.
                        let next = tx
                            .query_one("SELECT nextval('idempotency_fence_seq') AS fence", &[])
                            .await
                            .map_err(unavailable)?;
                        let fence: i64 = next.try_get("fence").map_err(unavailable)?;
                        let sealed = seal.seal(
                            key,
                            crate::columns::u64_from(fence, "fence")?,
                            encode_headers(&headers),
                            Some(body.as_bytes()),
                        )?;
                        let sql = concat!(
                            "UPDATE idempotency_records SET state = 'completed', fence = $7, \
                             response_status = $2, response_headers = $3, response_body = $4, body_stored = true, \
                             completed_at = $5, expires_at = $6, lease_until = $5, response_key = $8 WHERE ",
                            key_where!()
                        );
                        let status = i32::from(status);
                        let body = sealed.body.as_deref();
                        let expires_at = record::completion_expiry(now, loaded.ttl_ms);
                        let params: [Param<'_>; 7] =
                            [&status, &sealed.headers, &body, &now, &expires_at, &fence, &sealed.key_id];
                        execute(tx, sql, key, &params).await?;
                        let by = (Transition::Resolved, actor::OPERATOR, Some("complete"));
                        Ok((true, noted_event(tx, key, by, reason.as_deref(), now).await?))
                    }
                }
            })
        })
        .await
    }

    pub(super) async fn purge_record(&self, scope: &Scope, now: i64) -> Result<bool> {
        self.in_tx(scope, move |tx, key, locked| {
            Box::pin(async move {
                let Some(loaded) = locked else {
                    return Ok((false, Vec::new()));
                };
                let by = (Transition::Purged, actor::OPERATOR, None);
                Ok((true, end_generation(tx, key, loaded.view.state, by, now).await?))
            })
        })
        .await
    }
}
