//! gRPC on the wire, for a world whose policy covers a gRPC method: how
//! the upstream's answers are framed, and how what a client got reads as
//! the HTTP answer the audit judges (the contract's table of gRPC statuses
//! read backwards, and the problem's name from `ErrorInfo.reason`).

use base64::Engine;
use idemgate_core::grpc::{code, CONTENT_TYPE};
use idemgate_core::Reply;

/// The upstream's three answers and the status each is sent with: a
/// success, a refusal by the server's own checks (released, as `422` is a
/// release status), a failure kept as the outcome.
const ANSWERS: [(u16, u8); 3] = [
    (201, code::OK),
    (422, code::INVALID_ARGUMENT),
    (500, code::INTERNAL),
];

/// A response as Envoy hands it to the filter: headers, body, trailers.
pub type Response = (Fields, Vec<u8>, Fields);
type Fields = Vec<(String, Vec<u8>)>;

fn line(name: &str, value: &str) -> (String, Vec<u8>) {
    (name.to_string(), value.as_bytes().to_vec())
}

/// The upstream's answer `status` with `message`, compressed or not.
pub fn upstream_answer(status: u16, message: &[u8], compressed: bool) -> Response {
    let mut headers = vec![line(":status", "200"), line("content-type", CONTENT_TYPE)];
    if compressed {
        headers.push(line("grpc-encoding", "gzip"));
    }
    let code = code_of(status).to_string();
    (
        headers,
        frame(message, compressed),
        vec![line("grpc-status", &code)],
    )
}

/// Envoy's own answer to a gRPC call (the upstream never answered): a
/// status alone, in the headers.
pub fn envoy_answer() -> Response {
    let code = code::UNAVAILABLE.to_string();
    let headers = vec![
        line(":status", "200"),
        line("content-type", CONTENT_TYPE),
        line("grpc-status", &code),
    ];
    (headers, Vec::new(), Vec::new())
}

/// The status the upstream answers `status` with.
fn code_of(status: u16) -> u8 {
    ANSWERS
        .iter()
        .find(|(s, _)| *s == status)
        .map_or(code::UNKNOWN, |(_, c)| *c)
}

/// One length-prefixed message, flagged compressed or not (the world
/// never compresses it: only whether a client could read it is judged).
pub fn frame(message: &[u8], compressed: bool) -> Vec<u8> {
    let mut out = vec![u8::from(compressed)];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// The messages of whole frames, one after another; `None` unless a
/// client could read them: whole frames, and an encoding named for any
/// compressed one.
fn messages(mut body: &[u8], encoded: bool) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body[0] == 1 && !encoded {
            return None;
        }
        let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
        out.extend_from_slice(body.get(5..5 + len)?);
        body = &body[5 + len..];
    }
    Some(out)
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// A replay the store's route sent back, as the upstream answer it
/// repeats: the status its `grpc-status` trailer was sent for (0 if none
/// or another), its messages as the body (or a note that a client could
/// not read them), its headers kept.
pub fn replayed(headers: Vec<(String, String)>, body: &[u8], trailers: &[(String, String)]) -> Reply {
    let sent = field(trailers, "grpc-status").and_then(|c| c.parse::<u8>().ok());
    let status = ANSWERS
        .iter()
        .find(|(_, c)| Some(*c) == sent)
        .map_or(0, |(s, _)| *s);
    let encoded = field(&headers, "grpc-encoding").is_some();
    Reply {
        status,
        headers,
        body: messages(body, encoded).unwrap_or_else(|| b"(no message a client could read)".to_vec()),
    }
}

/// The filter's own gRPC answer as the problem it stands for: its HTTP
/// status by the code, and its name from the `ErrorInfo` in
/// `grpc-status-details-bin` (`KEY_REUSED` is `key-reused`).
pub fn problem(reply: &Reply) -> Reply {
    let code = field(&reply.headers, "grpc-status").and_then(|c| c.parse::<u8>().ok());
    let status = match code {
        Some(code::ABORTED | code::UNKNOWN | code::ALREADY_EXISTS) => 409,
        Some(code::FAILED_PRECONDITION) => 422,
        Some(code::RESOURCE_EXHAUSTED) => 429,
        Some(code::UNAVAILABLE) => 503,
        Some(code::INVALID_ARGUMENT) => 400,
        _ => return reply.clone(),
    };
    let details = field(&reply.headers, "grpc-status-details-bin")
        .and_then(|d| base64::engine::general_purpose::STANDARD_NO_PAD.decode(d).ok())
        .unwrap_or_default();
    let name = details
        .split(|b| !(b.is_ascii_uppercase() || *b == b'_'))
        .find(|run| run.len() > 4 && run.contains(&b'_'))
        .map(|run| {
            String::from_utf8_lossy(run)
                .to_ascii_lowercase()
                .replace('_', "-")
        })
        .unwrap_or_default();
    Reply {
        status,
        headers: vec![("content-type".into(), "application/problem+json".into())],
        body: format!(r#"{{"type":"{name}"}}"#).into_bytes(),
    }
}
