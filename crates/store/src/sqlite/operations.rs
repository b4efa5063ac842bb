//! The fence calls, abandon and the operators' changes, each one job on the
//! writer: load, ask the rules, write.
//!
//! A completion is queued as a relaxed job (no fsync of its own): if its
//! commit is lost on power loss, the record is still in progress under the
//! owner's lease, turns unknown when the lease runs out, and is never run
//! again. Unless the claim's policy releases unknown outcomes
//! (`on_unknown: release`): then a lost completion would free the key for a
//! second execution, so such a completion asks for a durable commit.

use idemgate_core::protocol::{AbandonRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::record::{self, AbandonDecision, State, Transition};
use idemgate_core::scope::Scope;
use rusqlite::Connection;

use super::engine::Writer;
use super::generation::{
    end_generation, end_noted_generation, event, execute, fenced, noted_event, set_unknown, Journal,
};
use super::rows::load;
use crate::backend::{actor, Resolution, Result};
use crate::columns::{encode_headers, i64_from, ScopeDigest};
use crate::sealing::Seal;

pub(super) fn complete(
    w: &Writer<'_>,
    journal: &mut Journal,
    (req, seal): (&CompleteRequest, &Seal),
    body: Option<&[u8]>,
    now: i64,
) -> Result<FenceReply> {
    let conn: &Connection = w;
    let key = ScopeDigest::of(&req.scope);
    let Some(loaded) = fenced(conn, &key, req.fence)? else {
        return Ok(FenceReply::Stale);
    };
    if loaded.release_on_unknown {
        w.require_durable();
    }
    let sql = concat!(
        "UPDATE idempotency_records SET state = 'completed', response_status = ?2, response_headers = ?3, \
         response_body = ?4, body_stored = ?5, completed_at = ?6, expires_at = ?7, lease_until = ?6, \
         response_key = ?8 WHERE ",
        key_where!()
    );
    let expires_at = record::completion_expiry(now, loaded.ttl_ms);
    // Sealed under the fence the record holds (the completion's own).
    let sealed = seal.seal(&key, loaded.view.fence, encode_headers(&req.headers), body)?;
    let params: [&dyn rusqlite::ToSql; 7] = [
        &req.status,
        &sealed.headers,
        &sealed.body.as_deref(),
        &req.body_stored,
        &now,
        &expires_at,
        &sealed.key_id,
    ];
    execute(conn, sql, &key, &params)?;
    event(
        conn,
        &key,
        (Transition::Completed, actor::FILTER, None),
        now,
        journal,
    )?;
    Ok(FenceReply::Done)
}

pub(super) fn release(
    conn: &Connection,
    journal: &mut Journal,
    req: &FenceRequest,
    now: i64,
) -> Result<FenceReply> {
    let key = ScopeDigest::of(&req.scope);
    let Some(loaded) = fenced(conn, &key, req.fence)? else {
        return Ok(FenceReply::Stale);
    };
    let by = (Transition::Released, actor::FILTER, None);
    end_generation(conn, &key, loaded.view.state, by, now, journal)?;
    Ok(FenceReply::Done)
}

pub(super) fn abandon(
    conn: &Connection,
    journal: &mut Journal,
    req: &AbandonRequest,
    now: i64,
) -> Result<FenceReply> {
    let key = ScopeDigest::of(&req.scope);
    let attempt = req.attempt.as_str();
    let loaded = load(conn, &key)?;
    match (
        record::decide_abandon(loaded.as_ref().map(|l| &l.view), attempt),
        loaded,
    ) {
        (AbandonDecision::End, Some(l)) => {
            let by = (Transition::Abandoned, actor::FILTER, None);
            end_generation(conn, &key, l.view.state, by, now, journal)?;
            Ok(FenceReply::Done)
        }
        (AbandonDecision::Settled, _) => Ok(FenceReply::Stale),
        _ => {
            let sql =
                "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, principal, route, \
                       namespace, idem_key, attempt, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                       ON CONFLICT DO NOTHING";
            let [v, t, p, r, n, k] = req.scope.parts();
            execute(conn, sql, &key, &[&v, &t, &p, &r, &n, &k, &attempt, &now])?;
            Ok(FenceReply::Done)
        }
    }
}

pub(super) fn mark_unknown(
    conn: &Connection,
    journal: &mut Journal,
    req: &FenceRequest,
    now: i64,
) -> Result<FenceReply> {
    let key = ScopeDigest::of(&req.scope);
    let Some(loaded) = fenced(conn, &key, req.fence)? else {
        return Ok(FenceReply::Stale);
    };
    if loaded.view.state == State::Unknown {
        return Ok(FenceReply::Done);
    }
    set_unknown(conn, &key, record::unknown_expiry(now, loaded.ttl_ms))?;
    event(
        conn,
        &key,
        (Transition::MarkedUnknown, actor::FILTER, None),
        now,
        journal,
    )?;
    Ok(FenceReply::Done)
}

pub(super) fn resolve(
    w: &Writer<'_>,
    journal: &mut Journal,
    (scope, seal): (&Scope, &Seal),
    (how, reason): (Resolution, Option<&str>),
    now: i64,
) -> Result<bool> {
    let conn: &Connection = w;
    let key = ScopeDigest::of(scope);
    let Some(loaded) = load(conn, &key)? else {
        return Ok(false);
    };
    if !loaded.is_open() {
        return Ok(false);
    }
    match how {
        Resolution::Release => {
            let by = (Transition::Resolved, actor::OPERATOR, Some("release"));
            end_noted_generation(conn, &key, loaded.view.state, (by, reason), now, journal)?;
        }
        Resolution::Complete {
            status,
            headers,
            body,
        } => {
            // A new fence: the old owner's late completion must not
            // overwrite what the operator decided.
            let fence = w.next_fence()?;
            let sql = concat!(
                "UPDATE idempotency_records SET state = 'completed', fence = ?2, response_status = ?3, \
                 response_headers = ?4, response_body = ?5, body_stored = 1, completed_at = ?6, expires_at = ?7, \
                 lease_until = ?6, response_key = ?8 WHERE ",
                key_where!()
            );
            let expires_at = record::completion_expiry(now, loaded.ttl_ms);
            let sealed = seal.seal(&key, fence, encode_headers(&headers), Some(body.as_bytes()))?;
            let params: [&dyn rusqlite::ToSql; 7] = [
                &i64_from(fence),
                &status,
                &sealed.headers,
                &sealed.body.as_deref(),
                &now,
                &expires_at,
                &sealed.key_id,
            ];
            execute(conn, sql, &key, &params)?;
            let by = (Transition::Resolved, actor::OPERATOR, Some("complete"));
            noted_event(conn, &key, by, reason, now, journal)?;
        }
    }
    Ok(true)
}

pub(super) fn purge(conn: &Connection, journal: &mut Journal, scope: &Scope, now: i64) -> Result<bool> {
    let key = ScopeDigest::of(scope);
    let Some(loaded) = load(conn, &key)? else {
        return Ok(false);
    };
    let by = (Transition::Purged, actor::OPERATOR, None);
    end_generation(conn, &key, loaded.view.state, by, now, journal)?;
    Ok(true)
}
