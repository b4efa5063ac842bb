//! Which client request a store call serves. The store names it on every
//! event line it logs for the call, so an operator goes from an access-log
//! line (or a trace) to the record's history: the request's `x-request-id`
//! and the trace id of its W3C `traceparent`.
//!
//! It travels in a header of the callout, [`TRACE_HEADER`], one entry per
//! call in the order of the calls (one batch carries calls of many
//! requests), never in the frames: a store before it refuses frame fields
//! it does not know, and ignores headers. A value that breaks the rules
//! below is dropped, never refused: it only labels log lines, and a call is
//! never lost over a label.

use crate::headers::{only, Lines};

/// The header Envoy sets (or keeps) on every request.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// W3C Trace Context.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// The store call's header: `<request id> <trace id>` per call, `-` for
/// either when absent, entries separated by `,`.
pub const TRACE_HEADER: &str = "idemgate-trace";
/// The longest request id kept: Envoy's are UUIDs (36); room for others'.
pub const MAX_REQUEST_ID: usize = 128;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// 1-128 visible ASCII characters but `,`.
    pub request_id: Option<String>,
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: Option<String>,
}

impl Trace {
    /// No request to name (the store's own work: the sweeper, an operator).
    pub const NONE: Trace = Trace {
        request_id: None,
        trace_id: None,
    };

    /// The trace of the request with these header lines.
    pub fn of_request(lines: &Lines) -> Trace {
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

    /// The [`TRACE_HEADER`] value naming `traces`, one per call; `None`
    /// when none names anything.
    pub fn header(traces: &[Trace]) -> Option<String> {
        if traces.iter().all(Trace::is_empty) {
            return None;
        }
        let entry = |t: &Trace| {
            format!(
                "{} {}",
                t.request_id.as_deref().unwrap_or("-"),
                t.trace_id.as_deref().unwrap_or("-")
            )
        };
        Some(traces.iter().map(entry).collect::<Vec<_>>().join(","))
    }

    /// The traces of `calls` calls from their [`TRACE_HEADER`] value: each
    /// entry as its rules allow, and none at all when the count is not
    /// `calls` (no call is named after another's request).
    pub fn parse_header(value: Option<&[u8]>, calls: usize) -> Vec<Trace> {
        let entries: Vec<Trace> = value
            .map(|v| v.split(|&b| b == b',').map(Trace::parse_entry).collect())
            .unwrap_or_default();
        if entries.len() == calls {
            entries
        } else {
            vec![Trace::NONE; calls]
        }
    }

    fn parse_entry(entry: &[u8]) -> Trace {
        let mut parts = entry.trim_ascii().split(|&b| b == b' ');
        let (request_id, trace_id) = (parts.next(), parts.next());
        Trace {
            request_id: request_id
                .filter(|v| *v != b"-" && is_request_id(v))
                .and_then(text),
            trace_id: trace_id.filter(|v| is_trace_id(v)).and_then(text),
        }
    }
}

fn text(v: &[u8]) -> Option<String> {
    String::from_utf8(v.to_vec()).ok()
}

fn is_request_id(v: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&v.len()) && v.iter().all(|&b| b.is_ascii_graphic() && b != b',')
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
