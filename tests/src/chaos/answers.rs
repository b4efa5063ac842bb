//! One answer a client got, against the contract: an HTTP answer by §4–§7,
//! a gRPC one by §10 (its status from the trailers, or from the headers of a
//! trailers-only answer; the filter's own answers by the `ErrorInfo` reason
//! in `grpc-status-details-bin`).

use std::collections::HashMap;

use base64::Engine;

use super::judge::{execution_scope, sha256_hex, stored_len};
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
    if is_grpc(a) {
        return grpc_execution_number(a);
    }
    if a.body.first() == Some(&b'{') {
        if let Some(n) = a.json()["execution"].as_u64() {
            return Some(n);
        }
    }
    a.header("location")?.strip_prefix("/pay/")?.parse().ok()
}

/// A gRPC answer's execution: its message's `execution`, or, for a status
/// the upstream answered trailers-only, the `execution n` its
/// `grpc-message` ends with.
fn grpc_execution_number(a: &Answer) -> Option<u64> {
    let message = first_message(&a.body);
    if let Some(n) =
        message.and_then(|m| serde_json::from_slice::<serde_json::Value>(m).ok()?["execution"].as_u64())
    {
        return Some(n);
    }
    a.header("grpc-message")?
        .strip_prefix("acted, then failed: execution ")?
        .parse()
        .ok()
}

/// The payload of the first message frame of a gRPC body.
fn first_message(body: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    body.get(5..5 + len)
}

/// A gRPC answer (`content-type: application/grpc...`).
pub(super) fn is_grpc(a: &Answer) -> bool {
    a.header("content-type")
        .is_some_and(|t| idemgate_core::grpc::is_grpc(t.as_bytes()))
}

/// A gRPC answer's status.
pub(super) fn grpc_status(a: &Answer) -> Option<u8> {
    a.header("grpc-status")?.trim().parse().ok()
}

/// The problem an answer is: a problem document's type, or a gRPC status's
/// `ErrorInfo` reason in the contract's spelling (`REQUEST_IN_PROGRESS` is
/// `request-in-progress`), when its domain is the filter's.
pub fn problem_of(a: &Answer) -> Option<String> {
    if !is_grpc(a) {
        return a.problem();
    }
    let (reason, domain) = error_info(a)?;
    (domain == idemgate_core::grpc::DOMAIN).then(|| reason.to_ascii_lowercase().replace('_', "-"))
}

/// The `google.rpc.ErrorInfo` (reason, domain) among the details of the
/// `google.rpc.Status` in `grpc-status-details-bin`, read from protobuf's
/// wire form: `Status.details` is field 3 (`Any`: type URL 1, value 2),
/// `ErrorInfo.reason` field 1 and `.domain` field 2.
pub fn error_info(a: &Answer) -> Option<(String, String)> {
    let text = a.header(idemgate_core::grpc::DETAILS_HEADER)?;
    let status = base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(text.trim().trim_end_matches('='))
        .ok()?;
    proto_fields(&status)?
        .into_iter()
        .filter(|(number, _)| *number == 3)
        .find_map(|(_, any)| {
            let any = proto_fields(any)?;
            let type_url = any.iter().find(|(n, _)| *n == 1)?.1;
            if !type_url.ends_with(b"/google.rpc.ErrorInfo") {
                return None;
            }
            let info = proto_fields(any.iter().find(|(n, _)| *n == 2)?.1)?;
            let text = |number: u64| {
                info.iter()
                    .find(|(n, _)| *n == number)
                    .and_then(|(_, v)| String::from_utf8(v.to_vec()).ok())
                    .unwrap_or_default()
            };
            Some((text(1), text(2)))
        })
}

/// A protobuf message's length-delimited fields (number, bytes); the others
/// are skipped. `None` if it is not protobuf's wire form.
fn proto_fields(mut bytes: &[u8]) -> Option<Vec<(u64, &[u8])>> {
    fn varint(bytes: &mut &[u8]) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = bytes.split_first()?;
            *bytes = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut fields = Vec::new();
    while !bytes.is_empty() {
        let tag = varint(&mut bytes)?;
        match tag & 7 {
            0 => {
                varint(&mut bytes)?;
            }
            1 => bytes = bytes.get(8..)?,
            5 => bytes = bytes.get(4..)?,
            2 => {
                let len = usize::try_from(varint(&mut bytes)?).ok()?;
                fields.push((tag >> 3, bytes.get(..len)?));
                bytes = &bytes[len..];
            }
            _ => return None,
        }
    }
    Some(fields)
}

/// `grpc-message` decoded (it is percent-encoded).
fn grpc_message(a: &Answer) -> Option<String> {
    let raw = a.header("grpc-message")?.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = raw.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (raw[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// An answer is execution `e`'s, byte for byte: its status and body; for a
/// gRPC call, `200`, its message frames, and its `grpc-status` and
/// `grpc-message`.
pub(super) fn same_answer(a: &Answer, e: &Execution) -> bool {
    let same_status = match e.grpc_status {
        None => true,
        Some(code) => {
            let sent = |name: &str| {
                e.grpc_fields
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_str())
            };
            grpc_status(a) == Some(code) && a.header("grpc-message") == sent("grpc-message")
        }
    };
    same_status && a.status == e.status && a.body == e.response
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
    if route.grpc {
        return check_grpc_answer(s, a, stored, by_n, bodies_in_scope, &what);
    }
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

/// A gRPC answer against contract §10, as [`check_answer`] judges an HTTP
/// one: a replay (`idempotent-replayed: true`) is a stored execution of this
/// message, its frames and status byte for byte; the filter's own answers
/// carry an `ErrorInfo` of its domain with the status §10 gives the problem
/// and fit as they would over HTTP; Envoy's own answers (an upstream reset or
/// timeout) are `UNAVAILABLE` with the bootstrap's problem document as their
/// message; anything else is the upstream's answer to this very call.
fn check_grpc_answer(
    s: &Sent,
    a: &Answer,
    stored: &[&Execution],
    by_n: &HashMap<u64, &Execution>,
    bodies_in_scope: &[&str],
    what: &str,
) -> Option<String> {
    use idemgate_core::grpc::code;
    let route = policy(s.scope.route);
    let status = grpc_status(a);
    let message = grpc_message(a).unwrap_or_default();
    let text = format!(
        "HTTP {} grpc-status {status:?} grpc-message {message:?} {} bytes of messages",
        a.status,
        a.body.len()
    );
    if a.status != 200 || !is_grpc(a) || status.is_none() {
        return Some(format!("{what}: not a gRPC answer: {text}"));
    }
    let body_sha = sha256_hex(s.body.as_bytes());
    if a.header("idempotent-replayed") == Some("true") {
        if stored.is_empty() {
            return Some(format!("{what}: a replay, but nothing was stored: {text}"));
        }
        let same_body: Vec<&&Execution> = stored.iter().filter(|e| e.body_sha256 == body_sha).collect();
        if same_body.is_empty() {
            return Some(format!("{what}: replayed the answer to another request message"));
        }
        if same_body.iter().any(|e| same_answer(a, e)) {
            return None;
        }
        return Some(format!(
            "{what}: replay differs from execution {} (grpc-status {:?}, {} bytes): {text}",
            same_body[0].n,
            same_body[0].grpc_status,
            same_body[0].response.len()
        ));
    }
    if let Some(m) = internals::shown_in(&message) {
        return Some(format!("{what}: grpc-message shows internals ({m}): {text}"));
    }
    if let Some((reason, domain)) = error_info(a) {
        let slug = reason.to_ascii_lowercase().replace('_', "-");
        if domain != idemgate_core::grpc::DOMAIN || !EXPECTED_PROBLEMS.contains(&slug.as_str()) {
            return Some(format!("{what}: unexpected error {reason} ({domain}): {text}"));
        }
        if slug == "result-unavailable" && stored.is_empty() {
            return Some(format!(
                "{what}: result-unavailable, but nothing was stored: {text}"
            ));
        }
        let retry_ms = a.header("retry-after-ms").and_then(|v| v.parse::<u64>().ok());
        let ok = match slug.as_str() {
            "key-reused" => {
                status == Some(code::FAILED_PRECONDITION) && bodies_in_scope.iter().any(|b| *b != s.body)
            }
            "request-in-progress" => status == Some(code::ABORTED) && retry_ms >= Some(1),
            // Under `on_unknown: release` an unknown key is claimed again.
            "outcome-unknown" => {
                status == Some(code::UNKNOWN) && retry_ms.is_none() && !route.release_on_unknown
            }
            "result-unavailable" => {
                status == Some(code::ALREADY_EXISTS)
                    && stored
                        .iter()
                        .any(|e| e.body_sha256 == body_sha && route.too_large_to_store(stored_len(e)))
            }
            _ => status == Some(code::UNAVAILABLE) && retry_ms.is_some(),
        };
        return (!ok).then(|| format!("{what}: {slug} does not fit: {text}"));
    }
    let n = execution_number(a);
    match n.and_then(|n| by_n.get(&n)) {
        Some(e) => {
            if execution_scope(e) != s.scope || e.body_sha256 != body_sha {
                Some(format!("{what}: got execution {} of another request", e.n))
            } else if !same_answer(a, e) {
                Some(format!(
                    "{what}: answer differs from execution {} (grpc-status {:?}, {} bytes): {text}",
                    e.n,
                    e.grpc_status,
                    e.response.len()
                ))
            } else {
                None
            }
        }
        None if n.is_some() => Some(format!("{what}: execution {n:?} is not in the upstream's log")),
        // Envoy's own answer: the bootstrap's local_reply_config problem as
        // the message of an UNAVAILABLE status (502 to 504).
        None if status == Some(code::UNAVAILABLE) => {
            let p: serde_json::Value = serde_json::from_str(&message).unwrap_or_default();
            let envoys = p["type"] == "about:blank"
                && p["status"].as_u64().is_some_and(|s| (502..=504).contains(&s))
                && a.header("cache-control") == Some("no-store");
            (!envoys).then(|| format!("{what}: UNAVAILABLE that is neither the filter's nor Envoy's: {text}"))
        }
        None => Some(format!("{what}: a status without an execution: {text}")),
    }
}
