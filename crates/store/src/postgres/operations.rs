//! The fence calls, abandon and the operators' changes. Completion is one
//! statement; the others lock the record, ask the rules, and write.

use std::sync::LazyLock;

use idemgate_core::protocol::{AbandonRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::record::{self, State, Transition};
use idemgate_core::scope::Scope;

use super::generation::{end_generation, end_noted_generation, event, execute, noted_event, set_unknown};
use super::rows::Bind;
use super::{log_all, Postgres};
use crate::backend::{actor, EventInfo, Resolution, Result};
use crate::columns::{encode_headers, i64_from, KeyColumns, LoadedRecord};
use crate::conditions;

/// Completes the record of `$1..$6` if `$7` is its fence and it is open
/// (`{fenceable}`: [`record::may_fence`]), and records the event; no row
/// back means stale. `$8` status, `$9` headers, `$10` body, `$11` whether it
/// is stored, `$12` now.
static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    conditions::expand(&format!(
        "WITH done AS (UPDATE idempotency_records SET state = 'completed', response_status = $8, \
           response_headers = $9, response_body = $10, body_stored = $11, completed_at = $12, expires_at = {expiry}, \
           lease_until = $12 WHERE {key} AND fence = $7 AND {{fenceable}} \
           RETURNING scope_version, tenant, principal, route, namespace, idem_key, generation, attempt, fence, \
           fingerprint, response_status, created_at) \
         INSERT INTO idempotency_events ({events}) SELECT scope_version, tenant, principal, route, namespace, idem_key, \
           generation, $12, 'completed', attempt, fence, fingerprint, response_status, 'filter', NULL, $12 - created_at, NULL \
           FROM done RETURNING {events}",
        expiry = conditions::completion_expiry("$12"),
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
        let key = KeyColumns::of(&req.scope);
        let fence = i64_from(req.fence);
        let status = i32::from(req.status);
        let headers = encode_headers(&req.headers);
        let body: Option<&[u8]> = if req.body_stored { Some(body) } else { None };
        let params = key.bind(&[&fence, &status, &headers, &body, &req.body_stored, &now]);
        let rows = self.connections.query(&COMPLETE, &params).await?;
        let events = rows.iter().map(EventInfo::read).collect::<Result<Vec<_>>>()?;
        log_all(&events);
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
        self.in_tx(&req.scope, move |tx, key, locked| {
            Box::pin(async move {
                let attempt = attempt.as_str();
                match locked {
                    Some(l) if l.may_abandon(attempt) => {
                        let by = (Transition::Abandoned, actor::FILTER, None);
                        Ok((
                            FenceReply::Done,
                            end_generation(tx, key, l.view.state, by, now).await?,
                        ))
                    }
                    Some(_) => Ok((FenceReply::Stale, Vec::new())),
                    None => {
                        // The claim may still be on its way: the sweeper
                        // releases it if it lands under this attempt.
                        let sql =
                            "INSERT INTO idempotency_abandoned (scope_version, tenant, principal, route, \
                                   namespace, idem_key, attempt, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                                   ON CONFLICT DO NOTHING";
                        execute(tx, sql, key, &[&attempt, &now]).await?;
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
                        let sql = concat!(
                            "UPDATE idempotency_records SET state = 'completed', fence = nextval('idempotency_fence_seq'), \
                             response_status = $7, response_headers = $8, response_body = $9, body_stored = true, \
                             completed_at = $10, expires_at = $11, lease_until = $10 WHERE ",
                            key_where!()
                        );
                        let status = i32::from(status);
                        let headers = encode_headers(&headers);
                        let body = body.as_bytes();
                        let expires_at = record::completion_expiry(now, loaded.ttl_ms);
                        execute(tx, sql, key, &[&status, &headers, &body, &now, &expires_at]).await?;
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
