//! The re-checks after a run: a retry of every settled record the audit
//! can ask about without changing it, answered as the contract says.

use std::time::Duration;

use super::answers::{grpc_status, is_grpc, problem_of, same_answer};
use super::audit::{Evidence, Kept};
use super::judge::{sha256_hex, stored_len};
use super::{now_ms, policy, Audit, ScopeId, Sent, Traffic};
use crate::stack::Stack;
use crate::{Answer, Execution};

/// A re-check is sent only to a record that stays unexpired this long, so it
/// can neither meet an expiry nor (under `after_expiry: new`) run again.
const RECHECK_MARGIN_MS: i64 = 5_000;

/// Every completed record replays byte-identical and every unknown one
/// answers 409 `outcome-unknown`, executing nothing — where a request can
/// check that without changing the record: not under `on_unknown: release`
/// for an unknown one (it would be claimed again), not near its expiry.
pub(super) async fn records_replay_and_stay_unknown(
    stack: &Stack,
    traffic: &Traffic,
    evidence: &Evidence<'_>,
    kept: &Kept<'_>,
    audit: &mut Audit,
) {
    let before = stack.upstream.log().len();
    for (scope, gens) in &evidence.histories {
        let Some(gen) = gens.iter().find(|g| g.current) else {
            continue;
        };
        if gen.archived_at.is_some() || gen.expires_at.is_none_or(|e| e <= now_ms() + RECHECK_MARGIN_MS) {
            continue;
        }
        let list = &evidence.sent[scope];
        let exec = kept.current.get(scope).copied();
        let route = policy(scope.route);
        let found = match (gen.state.as_str(), exec) {
            ("completed", Some(e)) => match list_body(list, &e.body_sha256) {
                None => Some("executed a body nobody sent".into()),
                Some(body) if route.too_large_to_store(stored_len(e)) => {
                    audit.unavailable_checked += 1;
                    stays_unavailable(traffic, scope, body, e).await
                }
                Some(body) => {
                    audit.replays_checked += 1;
                    audit.grpc_replays_checked += usize::from(route.grpc);
                    replays_byte_identical(traffic, scope, body, e).await
                }
            },
            ("unknown", exec) if !route.release_on_unknown => {
                audit.unknown_checked += 1;
                audit.grpc_unknown_checked += usize::from(route.grpc);
                stays_unknown(traffic, scope, list, exec).await
            }
            _ => None,
        };
        if let Some(v) = found {
            audit
                .violations
                .push(format!("{} {} {}: {v}", scope.tenant, scope.route, scope.key));
        }
    }
    let after = stack.upstream.log().len();
    if after != before {
        audit.double_executions.push(format!(
            "re-checking completed and unknown records executed {} requests",
            after - before
        ));
    }
}

/// A completed record's replay: its execution's answer, byte for byte.
async fn replays_byte_identical(
    traffic: &Traffic,
    scope: &ScopeId,
    body: &str,
    e: &Execution,
) -> Option<String> {
    match settled(traffic, scope, body).await {
        Ok(a) if a.header("idempotent-replayed") == Some("true") && same_answer(&a, e) => None,
        Ok(a) => Some(format!(
            "completed record does not replay byte-identical: {} ({} bytes{}, execution {} answered {} / {} bytes{}) {:?}",
            a.status,
            a.body.len(),
            grpc_status(&a).map(|c| format!(", grpc-status {c}")).unwrap_or_default(),
            e.n,
            e.status,
            e.response.len(),
            e.grpc_status.map(|c| format!(", grpc-status {c}")).unwrap_or_default(),
            String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
        )),
        Err(err) => Some(format!("replay failed: {err}")),
    }
}

/// A completed record whose response was too long to keep answers `409
/// result-unavailable` with its execution's status, and nothing else.
async fn stays_unavailable(traffic: &Traffic, scope: &ScopeId, body: &str, e: &Execution) -> Option<String> {
    match settled(traffic, scope, body).await {
        Ok(a)
            if problem_of(&a).as_deref() == Some("result-unavailable")
                && (is_grpc(&a) || a.json()["original_status"] == e.status) =>
        {
            None
        }
        Ok(a) => Some(format!(
            "completed record of execution {} ({} bytes, status {}) answered {} ({} bytes) {:?}",
            e.n,
            e.response.len(),
            e.status,
            a.status,
            a.body.len(),
            String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
        )),
        Err(err) => Some(format!("retry failed: {err}")),
    }
}

/// An unknown record (under `on_unknown: conflict`) answers 409
/// `outcome-unknown` to a retry.
async fn stays_unknown(
    traffic: &Traffic,
    scope: &ScopeId,
    list: &[&Sent],
    exec: Option<&Execution>,
) -> Option<String> {
    let body = exec
        .and_then(|e| list_body(list, &e.body_sha256))
        .unwrap_or(&list[0].body)
        .to_string();
    match settled(traffic, scope, &body).await {
        Ok(a) if problem_of(&a).as_deref() == Some("outcome-unknown") => None,
        Ok(a) => Some(format!(
            "unknown record answered {} {:?}",
            a.status,
            String::from_utf8_lossy(&a.body)
        )),
        Err(err) => Some(format!("retry failed: {err}")),
    }
}

/// A re-check's answer; a 503 `store-unavailable` says nothing about the
/// record (it is the contract's answer while the store does not answer in
/// time), so it is asked again, a few times.
async fn settled(traffic: &Traffic, scope: &ScopeId, body: &str) -> Result<Answer, String> {
    let mut last = Err("not sent".to_string());
    for _ in 0..5 {
        last = traffic.send(scope, path_of(scope), body, &[]).await;
        match &last {
            Ok(a) if problem_of(a).as_deref() == Some("store-unavailable") => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => break,
        }
    }
    last
}

fn path_of(scope: &ScopeId) -> &'static str {
    policy(scope.route).path
}

fn list_body<'a>(list: &[&'a Sent], sha: &str) -> Option<&'a str> {
    list.iter()
        .find(|s| sha256_hex(s.body.as_bytes()) == sha)
        .map(|s| s.body.as_str())
}
