//! One answer a client got, against the contract.

use std::collections::HashMap;

use super::judge::{execution_scope, sha256_hex};
use super::{policy, Sent};
use crate::{internals, Answer, Execution};

/// Problem types the chaos traffic may legitimately meet.
const EXPECTED_PROBLEMS: [&str; 5] = [
    "key-reused",
    "request-in-progress",
    "outcome-unknown",
    "store-unavailable",
    "result-unavailable",
];

/// The upstream execution an answer carries: its JSON body's `execution`,
/// or (for the test upstream's large bodies, which are not JSON) its
/// `Location: /pay/{n}`, which is replayed with the body.
pub(super) fn execution_number(a: &Answer) -> Option<u64> {
    if a.body.first() == Some(&b'{') {
        if let Some(n) = a.json()["execution"].as_u64() {
            return Some(n);
        }
    }
    a.header("location")?.strip_prefix("/pay/")?.parse().ok()
}

/// Checks one answer against the contract; `None` when it is fine. `stored`:
/// the scope's executions whose outcome the store kept (a replay must be one
/// of them).
pub(super) fn check_answer(
    s: &Sent,
    a: &Answer,
    stored: &[&Execution],
    by_n: &HashMap<u64, &Execution>,
    bodies_in_scope: &[&str],
) -> Option<String> {
    let what = format!(
        "{} {} {} {:?}",
        s.scope.tenant, s.scope.route, s.scope.key, s.knobs
    );
    let route = policy(s.scope.route);
    let text = if a.body.len() > 4_096 {
        format!("{} bytes", a.body.len()).into()
    } else {
        String::from_utf8_lossy(&a.body)
    };
    let body_sha = sha256_hex(s.body.as_bytes());
    if a.header("idempotent-replayed") == Some("true") {
        // An execution that was stored, and its answer byte for byte.
        if stored.is_empty() {
            return Some(format!("{what}: a replay, but nothing was stored: {text}"));
        }
        let same_body: Vec<&&Execution> = stored.iter().filter(|e| e.body_sha256 == body_sha).collect();
        if same_body.is_empty() {
            return Some(format!("{what}: replayed the answer to another request body"));
        }
        if same_body
            .iter()
            .any(|e| a.body == e.response && a.status == e.status)
        {
            return None;
        }
        return Some(format!(
            "{what}: replay differs from execution {} ({} vs {}): {text}",
            same_body[0].n, a.status, same_body[0].status
        ));
    }
    if a.header("content-type") == Some("application/problem+json") {
        let p = a.json();
        let slug = a.problem().unwrap_or_default();
        if p["status"] != a.status || a.header("cache-control") != Some("no-store") {
            return Some(format!("{what}: malformed problem {} {text}", a.status));
        }
        if let Some(m) = internals::shown_in(&text) {
            return Some(format!("{what}: problem body shows internals ({m}): {text}"));
        }
        // Envoy's own replies (an upstream reset or timeout), rendered as
        // problems by the bootstrap's local_reply_config.
        if p["type"] == "about:blank" && (502..=504).contains(&a.status) {
            return None;
        }
        if !EXPECTED_PROBLEMS.contains(&slug.as_str()) {
            return Some(format!("{what}: unexpected problem {slug}: {text}"));
        }
        // Like a replay: the answer of a completion the store no longer has
        // (one a database failover lost).
        if slug == "result-unavailable" && stored.is_empty() {
            return Some(format!(
                "{what}: result-unavailable, but nothing was stored: {text}"
            ));
        }
        let ok = match slug.as_str() {
            "key-reused" => a.status == 422 && bodies_in_scope.iter().any(|b| *b != s.body),
            "request-in-progress" => {
                a.status == 409 && a.header("retry-after").and_then(|v| v.parse::<u64>().ok()) >= Some(1)
            }
            // Under `on_unknown: release` an unknown key is claimed again.
            "outcome-unknown" => {
                a.status == 409 && a.header("retry-after").is_none() && !route.release_on_unknown
            }
            // Only for a stored execution of this body whose response was
            // too long to keep (or, detached, to relay), with its status.
            "result-unavailable" => {
                a.status == 409
                    && stored.iter().any(|e| {
                        e.body_sha256 == body_sha
                            && route.too_large_to_store(e.response.len())
                            && p["original_status"] == e.status
                    })
            }
            _ => a.status == 503 && a.header("retry-after").is_some(),
        };
        return (!ok).then(|| format!("{what}: {slug} does not fit ({}): {text}", a.status));
    }
    // Anything else came from the upstream (with its execution number) or
    // from Envoy itself (5xx without one).
    let n = execution_number(a);
    match n.and_then(|n| by_n.get(&n)) {
        Some(e) => {
            if execution_scope(e) != s.scope || e.body_sha256 != body_sha {
                Some(format!("{what}: got execution {} of another request", e.n))
            } else if a.status != e.status || a.body != e.response {
                Some(format!(
                    "{what}: answer differs from execution {} ({} / {} bytes vs {} / {} bytes)",
                    e.n,
                    a.status,
                    a.body.len(),
                    e.status,
                    e.response.len()
                ))
            } else if route.too_large_to_relay(e.response.len()) {
                Some(format!(
                    "{what}: relayed execution {}'s {} bytes, more than the route's max_response_body",
                    e.n,
                    e.response.len()
                ))
            } else {
                None
            }
        }
        None if n.is_some() => Some(format!("{what}: execution {n:?} is not in the upstream's log")),
        // Envoy's own 5xx are problem documents (the bootstrap's
        // local_reply_config); anything else is a broken answer.
        None if a.status >= 500 => Some(format!(
            "{what}: a {} that is not a problem document: {text}",
            a.status
        )),
        None => Some(format!("{what}: {} without an execution: {text}", a.status)),
    }
}
