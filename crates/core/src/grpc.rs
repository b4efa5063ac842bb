//! gRPC unary calls: what a status code means for the record, how a
//! response's trailers are kept with its message frames, and the filter's
//! own answers as gRPC statuses.
//!
//! A stored gRPC response is its headers plus a body in gRPC-Web's form: the
//! message frames as they came, then one frame flagged `0x80` holding the
//! trailers as `name: value\r\n` lines. A replay takes the trailers back out
//! ([`split_trailers`]) and the store's replay route sends them as trailers.

use base64::Engine;

use crate::problem::{Problem, ProblemKind};
use crate::Reply;

/// The content type of every gRPC request and response (with an optional
/// `+proto`, `+json`... suffix).
pub const CONTENT_TYPE: &str = "application/grpc";

/// gRPC's status codes, as its `statuscodes.md` lists them.
pub mod code {
    pub const OK: u8 = 0;
    pub const CANCELLED: u8 = 1;
    pub const UNKNOWN: u8 = 2;
    pub const INVALID_ARGUMENT: u8 = 3;
    pub const DEADLINE_EXCEEDED: u8 = 4;
    pub const ALREADY_EXISTS: u8 = 6;
    pub const PERMISSION_DENIED: u8 = 7;
    pub const RESOURCE_EXHAUSTED: u8 = 8;
    pub const FAILED_PRECONDITION: u8 = 9;
    pub const ABORTED: u8 = 10;
    pub const OUT_OF_RANGE: u8 = 11;
    pub const UNIMPLEMENTED: u8 = 12;
    pub const INTERNAL: u8 = 13;
    pub const UNAVAILABLE: u8 = 14;
    pub const UNAUTHENTICATED: u8 = 16;
    /// The highest code gRPC defines (`UNAUTHENTICATED`).
    pub const MAX: u8 = 16;
}

/// Codes that release the key whatever the policy lists: by their
/// definitions the server refused the call by its own checks before acting
/// (the gRPC counterparts of §5's 400, 401, 403, 422 and 429), or has no
/// such method.
pub const DEFAULT_RELEASE_CODES: [u8; 7] = [
    code::INVALID_ARGUMENT,
    code::PERMISSION_DENIED,
    code::RESOURCE_EXHAUSTED,
    code::FAILED_PRECONDITION,
    code::OUT_OF_RANGE,
    code::UNIMPLEMENTED,
    code::UNAUTHENTICATED,
];

/// Codes meaning the call was cut off while the server may have been
/// acting: the outcome is unknown.
pub const UNKNOWN_CODES: [u8; 2] = [code::CANCELLED, code::DEADLINE_EXCEEDED];

/// The error domain of the filter's answers (`google.rpc.ErrorInfo.domain`).
pub const DOMAIN: &str = "idemgate.dev";

/// The header carrying a status's `google.rpc.Status`, base64.
pub const DETAILS_HEADER: &str = "grpc-status-details-bin";

/// Header or trailer fields as names and text values.
pub type Metadata = Vec<(String, String)>;

/// Whether a request with this `content-type` is a gRPC call.
pub fn is_grpc(content_type: &[u8]) -> bool {
    let Some(rest) = content_type.strip_prefix(CONTENT_TYPE.as_bytes()) else {
        return false;
    };
    matches!(rest.first(), None | Some(b'+') | Some(b';'))
}

/// The `grpc-status` among response header or trailer fields.
pub fn status(fields: &[(String, Vec<u8>)]) -> Option<u8> {
    let (_, value) = fields
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("grpc-status"))?;
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

/// Appends `trailers` to message frames as gRPC-Web's trailer frame.
pub fn append_trailers(body: &mut Vec<u8>, trailers: &[(String, String)]) {
    let block: String = trailers.iter().map(|(n, v)| format!("{n}: {v}\r\n")).collect();
    body.push(0x80);
    body.extend_from_slice(&(block.len() as u32).to_be_bytes());
    body.extend_from_slice(block.as_bytes());
}

/// A stored body's message frames and its trailers; `None` unless it is a
/// sequence of whole frames ending in exactly one trailer frame.
pub fn split_trailers(body: &[u8]) -> Option<(&[u8], Metadata)> {
    let mut at = 0;
    loop {
        let header = body.get(at..at + 5)?;
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let payload = body.get(at + 5..(at + 5).checked_add(len)?)?;
        if header[0] & 0x80 == 0 {
            at += 5 + len;
            continue;
        }
        if at + 5 + len != body.len() {
            return None;
        }
        let block = std::str::from_utf8(payload).ok()?;
        let trailers = block
            .split("\r\n")
            .filter(|line| !line.is_empty())
            .map(|line| {
                let (name, value) = line.split_once(':')?;
                Some((name.trim().to_ascii_lowercase(), value.trim().to_string()))
            })
            .collect::<Option<Vec<_>>>()?;
        return Some((&body[..at], trailers));
    }
}

/// Cookies: the filter never replays them (`config::NEVER_REPLAYED`), and
/// the replay route answers on the API's own origin.
const COOKIES: [&str; 2] = ["set-cookie", "set-cookie2"];

/// Why the store's replay route refuses to send a response back: it sends
/// only gRPC responses (a gRPC content type, whole message frames, no
/// cookies), so whoever reaches it cannot make it reflect a page, a script
/// or a cookie on the API's origin.
pub fn replay_refusal(headers: &[(String, String)], messages: &[u8]) -> Option<&'static str> {
    let content_type = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"));
    if !content_type.is_some_and(|(_, value)| is_grpc(value.as_bytes())) {
        return Some("a replay is a gRPC response: its content-type must be application/grpc");
    }
    if headers
        .iter()
        .any(|(name, _)| COOKIES.iter().any(|cookie| name.eq_ignore_ascii_case(cookie)))
    {
        return Some("a replay never sets cookies");
    }
    if !whole_messages(messages) {
        return Some("a replay's body is whole gRPC message frames");
    }
    None
}

/// Whether `body` is a sequence of whole length-prefixed messages (no
/// trailer frame: trailers travel as trailers).
fn whole_messages(mut body: &[u8]) -> bool {
    while !body.is_empty() {
        let Some(header) = body.get(..5) else {
            return false;
        };
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if header[0] & !1 != 0 {
            return false;
        }
        let Some(rest) = body.get(5..).and_then(|rest| rest.get(len..)) else {
            return false;
        };
        body = rest;
    }
    true
}

/// `grpc-message`'s percent-encoding: every byte outside printable ASCII,
/// and `%`, as `%XX`.
pub fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The status each of the filter's answers is given on a gRPC call.
pub fn code_of(kind: ProblemKind) -> u8 {
    match kind {
        ProblemKind::KeyMissing
        | ProblemKind::KeyInvalid
        | ProblemKind::IdentityMissing
        | ProblemKind::BadRequest => code::INVALID_ARGUMENT,
        ProblemKind::BodyTooLarge | ProblemKind::KeyRateLimited => code::RESOURCE_EXHAUSTED,
        ProblemKind::KeyReused | ProblemKind::KeyExpired => code::FAILED_PRECONDITION,
        ProblemKind::RequestInProgress => code::ABORTED,
        // Not retryable, and told apart from every other answer: only an
        // operator can say what happened.
        ProblemKind::OutcomeUnknown => code::UNKNOWN,
        // It happened; its result was too large to keep.
        ProblemKind::ResultUnavailable => code::ALREADY_EXISTS,
        ProblemKind::StoreUnavailable => code::UNAVAILABLE,
        ProblemKind::Unauthorized => code::UNAUTHENTICATED,
        ProblemKind::Forbidden => code::PERMISSION_DENIED,
        ProblemKind::NotFound => code::UNIMPLEMENTED,
    }
}

/// A problem as a trailers-only gRPC answer: `grpc-status`, `grpc-message`
/// (the detail), and a `google.rpc.Status` in `grpc-status-details-bin`
/// with an `ErrorInfo` (reason: the problem's name in capitals, domain
/// [`DOMAIN`]) and, when the client should come back, a `RetryInfo`; the
/// same wait is also in `retry-after-ms`.
pub fn answer(problem: &Problem) -> Reply {
    let code = code_of(problem.kind);
    let reason = problem.kind.slug().replace('-', "_").to_ascii_uppercase();
    let details = status_proto(code, &problem.detail, &reason, problem.retry_after_ms);
    let mut headers = vec![
        ("content-type".to_string(), CONTENT_TYPE.to_string()),
        ("grpc-status".to_string(), code.to_string()),
        ("grpc-message".to_string(), percent_encode(&problem.detail)),
        (
            DETAILS_HEADER.to_string(),
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(details),
        ),
    ];
    if let Some(ms) = problem.retry_after_ms {
        headers.push(("retry-after-ms".to_string(), ms.to_string()));
    }
    Reply {
        status: 200,
        headers,
        body: Vec::new(),
    }
}

/// `google.rpc.Status { code, message, details: [ErrorInfo, RetryInfo?] }`
/// in protobuf's wire form, written out here: three messages do not justify
/// a protobuf runtime in the module.
fn status_proto(code: u8, message: &str, reason: &str, retry_ms: Option<u64>) -> Vec<u8> {
    let mut info = Vec::new();
    field(&mut info, 1, reason.as_bytes());
    field(&mut info, 2, DOMAIN.as_bytes());
    let mut status = Vec::new();
    varint_field(&mut status, 1, u64::from(code));
    field(&mut status, 2, message.as_bytes());
    field(
        &mut status,
        3,
        &any("type.googleapis.com/google.rpc.ErrorInfo", &info),
    );
    if let Some(ms) = retry_ms {
        let mut duration = Vec::new();
        varint_field(&mut duration, 1, ms / 1000);
        varint_field(&mut duration, 2, (ms % 1000) * 1_000_000);
        let mut retry = Vec::new();
        field(&mut retry, 1, &duration);
        field(
            &mut status,
            3,
            &any("type.googleapis.com/google.rpc.RetryInfo", &retry),
        );
    }
    status
}

fn any(type_url: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    field(&mut out, 1, type_url.as_bytes());
    field(&mut out, 2, value);
    out
}

/// A length-delimited field (wire type 2).
fn field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
    varint(out, number << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A varint field (wire type 0); zero is left out, as proto3 does.
fn varint_field(out: &mut Vec<u8>, number: u64, value: u64) {
    if value != 0 {
        varint(out, number << 3);
        varint(out, value);
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn trailers_come_back_out_of_the_stored_body() {
        let mut body = [frame(b"one"), frame(b"")].concat();
        let messages = body.clone();
        let trailers = vec![
            ("grpc-status".to_string(), "0".to_string()),
            ("x-ledger-id".to_string(), "L-7".to_string()),
        ];
        append_trailers(&mut body, &trailers);
        assert_eq!(split_trailers(&body), Some((messages.as_slice(), trailers)));
    }

    #[test]
    fn a_body_that_is_not_whole_frames_ending_in_trailers_is_refused() {
        let mut body = frame(b"one");
        assert_eq!(split_trailers(&body), None, "no trailer frame");
        append_trailers(&mut body, &[("grpc-status".into(), "0".into())]);
        assert_eq!(split_trailers(&body[..body.len() - 1]), None, "cut short");
        let mut longer = body.clone();
        longer.extend_from_slice(&frame(b"after"));
        assert_eq!(split_trailers(&longer), None, "a frame after the trailers");
    }

    #[test]
    fn the_replay_route_sends_back_only_grpc_responses() {
        let grpc = |extra: &[(&str, &str)]| -> Vec<(String, String)> {
            [("content-type", "application/grpc"), ("x-ledger-entry", "E-1")]
                .iter()
                .chain(extra)
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        let messages = [frame(b"one"), frame(b""), vec![1, 0, 0, 0, 2, 0x1f, 0x8b]].concat();
        assert_eq!(replay_refusal(&grpc(&[]), &messages), None);
        assert_eq!(replay_refusal(&grpc(&[]), &[]), None, "no message at all");

        let page = vec![("content-type".to_string(), "text/html".to_string())];
        assert!(replay_refusal(&page, &messages).is_some(), "text/html");
        assert!(replay_refusal(&[], &messages).is_some(), "no content-type");
        for cookie in ["set-cookie", "Set-Cookie2"] {
            assert!(
                replay_refusal(&grpc(&[(cookie, "session=x")]), &messages).is_some(),
                "{cookie}"
            );
        }
        for body in [&b"<script>alert(1)</script>"[..], &messages[..messages.len() - 1]] {
            assert!(replay_refusal(&grpc(&[]), body).is_some(), "{body:?}");
        }
        let mut with_trailers = messages.clone();
        append_trailers(&mut with_trailers, &[("grpc-status".into(), "0".into())]);
        assert!(
            replay_refusal(&grpc(&[]), &with_trailers).is_some(),
            "a trailer frame"
        );
    }

    #[test]
    fn only_grpc_content_types_are_grpc() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=x",
        ] {
            assert!(is_grpc(yes.as_bytes()), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/json",
            "application/grpcx",
            "",
        ] {
            assert!(!is_grpc(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn the_status_is_read_from_its_field() {
        let fields = vec![("Grpc-Status".to_string(), b" 9".to_vec())];
        assert_eq!(status(&fields), Some(9));
        assert_eq!(status(&[("grpc-status".into(), b"x".to_vec())]), None);
        assert_eq!(status(&[]), None);
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("50% off: é\n"), "50%25 off: %C3%A9%0A");
    }

    #[test]
    fn every_answer_is_a_trailers_only_status_with_details() {
        let reply = answer(&Problem::request_in_progress(1500));
        let header = |name: &str| {
            reply
                .headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(reply.status, 200);
        assert!(reply.body.is_empty());
        assert_eq!(header("grpc-status").as_deref(), Some("10"));
        assert_eq!(header("retry-after-ms").as_deref(), Some("1500"));
        let details = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(header(DETAILS_HEADER).unwrap_or_default())
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&details);
        assert!(
            text.contains("REQUEST_IN_PROGRESS") && text.contains(DOMAIN),
            "{text}"
        );
        assert!(text.contains("google.rpc.RetryInfo"), "{text}");
        // code 10 as field 1, then the message as field 2
        assert_eq!(&details[..2], &[0x08, 10]);
    }

    #[test]
    fn outcome_unknown_has_a_status_of_its_own() {
        let unknown = code_of(ProblemKind::OutcomeUnknown);
        for kind in ProblemKind::ALL {
            if kind != ProblemKind::OutcomeUnknown {
                assert_ne!(code_of(kind), unknown, "{kind:?}");
            }
        }
        assert!(!DEFAULT_RELEASE_CODES.contains(&unknown) && !UNKNOWN_CODES.contains(&unknown));
    }
}
