//! Which client request a store call serves. The store names it on every
//! event line it logs for the call, so an operator goes from an access-log
//! line (or a trace) to the record's history: the request's `x-request-id`
//! and the trace id of its W3C `traceparent`.
//!
//! A store call carries this per call, not as headers of the callout: one
//! batch carries calls of many requests. A value that breaks the rules below
//! is dropped, never refused: it only labels log lines, and a call is never
//! lost over a label.

use serde::{Deserialize, Serialize};

use crate::headers::{only, Lines};

/// The header Envoy sets (or keeps) on every request.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// W3C Trace Context.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The longest request id kept: Envoy's are UUIDs (36); room for others'.
pub const MAX_REQUEST_ID: usize = 128;

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Labels")]
pub struct Trace {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// A trace as it arrives, before the rules drop what breaks them.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Deserialize)]
struct Labels {
    /// 1-128 visible ASCII characters; otherwise dropped.
    #[serde(default)]
    request_id: Option<String>,
    /// 32 lowercase hex digits, not all zero; otherwise dropped.
    #[serde(default)]
    trace_id: Option<String>,
}

impl From<Labels> for Trace {
    fn from(l: Labels) -> Trace {
        Trace {
            request_id: l.request_id.filter(|id| is_request_id(id.as_bytes())),
            trace_id: l.trace_id.filter(|id| is_trace_id(id.as_bytes())),
        }
    }
}

impl Trace {
    /// No request to name (the store's own work: the sweeper, an operator).
    pub const NONE: Trace = Trace {
        request_id: None,
        trace_id: None,
    };

    /// The trace of the request with these header lines.
    pub fn of_request(lines: &Lines) -> Trace {
        let text = |v: &[u8]| String::from_utf8(v.to_vec()).ok();
        Trace {
            request_id: only(lines, REQUEST_ID_HEADER)
                .filter(|v| is_request_id(v))
                .and_then(text),
            trace_id: only(lines, TRACEPARENT_HEADER)
                .and_then(traceparent_trace_id)
                .and_then(text),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.request_id.is_none() && self.trace_id.is_none()
    }
}

fn is_request_id(v: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&v.len()) && v.iter().all(|b| b.is_ascii_graphic())
}

fn is_trace_id(v: &[u8]) -> bool {
    v.len() == 32
        && v.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
        && v.iter().any(|&b| b != b'0')
}

/// `version-traceid-parentid-flags`; later versions keep the trace id in
/// the same place and may append fields, version `ff` is invalid.
fn traceparent_trace_id(v: &[u8]) -> Option<&[u8]> {
    let mut parts = v.split(|&b| b == b'-');
    let version = parts.next()?;
    let trace_id = parts.next()?;
    let valid = version.len() == 2 && version != b"ff" && parts.next().is_some_and(|p| p.len() == 16);
    (valid && is_trace_id(trace_id)).then_some(trace_id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
