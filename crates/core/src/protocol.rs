//! The filter ↔ store wire protocol (`/v1`).
//!
//! Every call is `POST` with a *frame* as body: one line of compact JSON
//! metadata, a `\n`, then raw bytes (a stored response body travels as bytes,
//! never as base64 inside JSON). Compact JSON never contains a raw newline, so
//! the first `\n` always ends the metadata. Every reply is a frame too: a
//! claim's carries a replayed body, the other calls' an empty one.
//!
//! Timestamps are milliseconds since the Unix epoch, taken by the store's clock.
//!
//! A *batch* (`/v1/batch`) carries several calls in one request: its frame's
//! metadata is a [`Batch`] listing each call's path and length, its bytes the
//! calls' own frames back to back. The reply's metadata is a [`BatchReply`]
//! listing each call's status and length, its bytes the calls' own replies
//! back to back, in the same order. Each call is decided on its own, exactly
//! as if it had been sent alone; a refusal of one is its own result, never
//! its neighbours'.
//!
//! **Versions.** The filter says in `Idemgate-Protocol` which versions it
//! speaks; the store answers in the highest one both speak and names it in
//! the same header. A peer that sends no header speaks version 1. Within a
//! version, a peer ignores fields it does not know, so a field whose absence
//! keeps the old meaning is added without a new version; a new outcome, a
//! new scope component or a field that must be understood needs one. A
//! scope stays strict: a component the store ignored would merge records.

use serde::{Deserialize, Serialize};

use crate::config::{AfterExpiry, OnUnknown};
use crate::fingerprint::Fingerprint;
use crate::limits;
use crate::scope::Scope;
use crate::trace::Trace;

mod borrowed;
pub use borrowed::{
    AbandonRequestRef, ClaimRequestRef, CompleteRequestRef, FenceRequestRef, FingerprintHex, ScopeRef,
};

pub const CLAIM_PATH: &str = "/v1/claim";
pub const COMPLETE_PATH: &str = "/v1/complete";
pub const RELEASE_PATH: &str = "/v1/release";
pub const MARK_UNKNOWN_PATH: &str = "/v1/mark-unknown";
pub const ABANDON_PATH: &str = "/v1/abandon";
pub const BATCH_PATH: &str = "/v1/batch";
/// The store's replay route for gRPC responses, named as a gRPC method so
/// that a route matching it exactly never meets a real one.
pub const REPLAY_PATH: &str = "/idemgate.v1.Store/Replay";
/// The request header Envoy's replay route requires. The filter sets it on
/// the replays it reroutes and removes it from every request a client sends,
/// so a client never reaches the store's replay route.
pub const REPLAY_MARKER: &str = "x-idemgate-replay";
pub const FRAME_CONTENT_TYPE: &str = "application/vnd.idemgate.frame";

/// The header in which a peer lists the protocol versions it speaks (a
/// request) or names the one it answers in (a reply).
pub const PROTOCOL_HEADER: &str = "idemgate-protocol";

/// The protocol versions this build speaks, oldest first.
pub const PROTOCOL_VERSIONS: &[u16] = &[1];

/// What this build offers in [`PROTOCOL_HEADER`]: every version it speaks.
pub const PROTOCOL_OFFER: &str = "1";

/// The highest version both this build (`supported`) and the peer speak,
/// from the peer's [`PROTOCOL_HEADER`] (`None`: the peer predates the
/// header and speaks version 1). `Err` names what each side speaks.
pub fn negotiate(offered: Option<&str>, supported: &[u16]) -> Result<u16, String> {
    let Some(offered) = offered else {
        return supported.contains(&1).then_some(1).ok_or_else(|| {
            format!(
                "the caller sent no {PROTOCOL_HEADER} (version 1); this store speaks {}",
                list(supported)
            )
        });
    };
    let mut theirs = Vec::new();
    for item in offered.split(',').map(str::trim) {
        match item.parse::<u16>() {
            Ok(v) if v > 0 => theirs.push(v),
            _ => {
                return Err(format!(
                    "{PROTOCOL_HEADER} must list versions as positive integers, got {offered:?}"
                ))
            }
        }
    }
    theirs
        .iter()
        .filter(|v| supported.contains(v))
        .max()
        .copied()
        .ok_or_else(|| {
            format!(
                "the caller speaks protocol {}; this store speaks {}",
                list(&theirs),
                list(supported)
            )
        })
}

fn list(versions: &[u16]) -> String {
    versions.iter().map(u16::to_string).collect::<Vec<_>>().join(", ")
}

/// Ask to own a key. The store answers with a [`ClaimReply`].
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRequest {
    pub scope: Scope,
    /// `None` when the policy's fingerprint mode is `none`.
    pub fingerprint: Option<Fingerprint>,
    /// How long the owner may take before the record turns `unknown`.
    pub lease_ms: u64,
    /// How long a finished record is replayable before it is archived.
    pub ttl_ms: u64,
    /// If the record is in progress, wait up to this long for it to finish.
    #[serde(default)]
    pub wait_ms: u64,
    pub after_expiry: AfterExpiry,
    pub on_unknown: OnUnknown,
    /// Names this claim so the filter can abandon it without knowing whether
    /// the store committed it (its answer may be lost). Absent from filters
    /// older than the abandon call; such claims cannot be abandoned.
    #[serde(default)]
    pub attempt: Option<Attempt>,
    /// The caller stops waiting this many milliseconds after sending the
    /// claim; the store does not commit a claim it starts later than that.
    /// 0: no deadline.
    #[serde(default)]
    pub deadline_ms: u64,
    /// The client request the call serves, named on the store's log lines.
    /// Not in the frame (a store before it refuses fields it does not
    /// know): it travels in the call's [`TRACE_HEADER`](crate::trace::TRACE_HEADER)
    /// and the store sets it here.
    #[serde(skip)]
    pub trace: Trace,
}

impl ClaimRequest {
    /// The limits a claim's numbers keep: the store refuses a claim that
    /// breaks them, and a policy's configuration never produces one
    /// (`exchange`'s tests build claims at every limit and check them here).
    pub fn check(&self) -> Result<(), String> {
        if self.lease_ms == 0 || self.lease_ms > limits::MAX_LEASE_MS {
            return Err(format!("lease_ms must be between 1 and {}", limits::MAX_LEASE_MS));
        }
        if self.ttl_ms == 0 || self.ttl_ms > limits::MAX_TTL_MS {
            return Err(format!("ttl_ms must be between 1 and {}", limits::MAX_TTL_MS));
        }
        if self.wait_ms > limits::MAX_WAIT_MS {
            return Err(format!("wait_ms must be at most {}", limits::MAX_WAIT_MS));
        }
        if self.deadline_ms > limits::MAX_DEADLINE_MS {
            return Err(format!("deadline_ms must be at most {}", limits::MAX_DEADLINE_MS));
        }
        Ok(())
    }
}

/// A claim attempt's id: 1-64 characters `[0-9A-Za-z_-]`, generated by the
/// filter (random, so two filters never share one).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Attempt(String);

impl Attempt {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Attempt {
    type Error = String;
    fn try_from(s: String) -> Result<Attempt, String> {
        let ok = (1..=64).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if ok {
            Ok(Attempt(s))
        } else {
            Err("an attempt id is 1-64 characters of [0-9A-Za-z_-]".into())
        }
    }
}

impl From<Attempt> for String {
    fn from(a: Attempt) -> String {
        a.0
    }
}

/// The filter gave up on a claim before forwarding anything (its answer was
/// lost, the store timed out, the client left): release the record if it is
/// still open under this attempt.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonRequest {
    pub scope: Scope,
    pub attempt: Attempt,
    /// The client request the call serves, named on the store's log lines.
    /// Not in the frame (a store before it refuses fields it does not
    /// know): it travels in the call's [`TRACE_HEADER`](crate::trace::TRACE_HEADER)
    /// and the store sets it here.
    #[serde(skip)]
    pub trace: Trace,
}

/// The store's verdict on a claim. Checked in this order: fingerprint
/// mismatch first (422 before 409), then state.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ClaimReply {
    /// The caller owns the key and must complete, release or mark it unknown
    /// with this fencing token.
    Owned { fence: u64 },
    /// Finished before: replay this response; the frame's bytes are its body.
    Replay {
        status: u16,
        headers: Vec<(String, String)>,
        completed_at: i64,
    },
    /// Finished, but the body was too large to keep.
    ResultUnavailable { original_status: u16, completed_at: i64 },
    /// Someone else owns the key; their lease ends in `retry_after_ms`.
    InProgress { retry_after_ms: u64 },
    /// Same key, different request.
    Mismatch,
    /// Nobody knows whether the upstream acted.
    Unknown,
    /// The record was archived and the policy rejects expired keys.
    Expired { completed_at: Option<i64> },
}

/// Store the upstream's response; the frame's bytes are its body.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompleteRequest {
    pub scope: Scope,
    pub fence: u64,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// `false` when the body was larger than `max_stored_body` and was
    /// streamed through instead of kept; the frame then carries no bytes.
    pub body_stored: bool,
    /// The client request the call serves, named on the store's log lines.
    /// Not in the frame (a store before it refuses fields it does not
    /// know): it travels in the call's [`TRACE_HEADER`](crate::trace::TRACE_HEADER)
    /// and the store sets it here.
    #[serde(skip)]
    pub trace: Trace,
}

/// A stored gRPC response to send back as it came (the replay route): the
/// frame's bytes are its message frames.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayRequest {
    pub headers: Vec<(String, String)>,
    pub trailers: Vec<(String, String)>,
}

/// Give the key back (the upstream refused before acting), or declare that
/// nobody knows what happened (`mark-unknown`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceRequest {
    pub scope: Scope,
    pub fence: u64,
    /// The client request the call serves, named on the store's log lines.
    /// Not in the frame (a store before it refuses fields it does not
    /// know): it travels in the call's [`TRACE_HEADER`](crate::trace::TRACE_HEADER)
    /// and the store sets it here.
    #[serde(skip)]
    pub trace: Trace,
}

/// Answer to complete, release, mark-unknown and abandon.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum FenceReply {
    Done,
    /// The fencing token was superseded (or the record is gone): nothing changed.
    Stale,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    MissingSeparator,
    Json(String),
    Batch(&'static str),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::MissingSeparator => f.write_str("frame has no metadata line"),
            FrameError::Json(e) => write!(f, "frame metadata is not valid: {e}"),
            FrameError::Batch(e) => write!(f, "batch lengths do not match its bytes: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// The calls of a batch, in order.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    pub calls: Vec<BatchCall>,
}

/// One call of a batch: where it would have been sent alone, and the length
/// of its frame in the batch's bytes.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchCall {
    pub path: String,
    pub len: usize,
}

/// The answers of a batch, in the order of its calls.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchReply {
    pub results: Vec<BatchResult>,
}

/// One call's answer: the status it would have had alone, and the length of
/// its reply in the batch reply's bytes.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchResult {
    pub status: u16,
    pub len: usize,
}

/// The wire's types as OpenAPI 3.1 component schemas, referring to each
/// other as `#/components/schemas/<name>`: the store's API document takes
/// them from here, so it describes exactly what is read and written.
#[cfg(feature = "schema")]
pub fn component_schemas() -> serde_json::Map<String, serde_json::Value> {
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.definitions_path = "/components/schemas".into();
    let mut generator = settings.into_generator();
    generator.subschema_for::<ClaimRequest>();
    generator.subschema_for::<ClaimReply>();
    generator.subschema_for::<CompleteRequest>();
    generator.subschema_for::<FenceRequest>();
    generator.subschema_for::<FenceReply>();
    generator.subschema_for::<AbandonRequest>();
    generator.subschema_for::<ReplayRequest>();
    generator.subschema_for::<Batch>();
    generator.subschema_for::<BatchReply>();
    generator.subschema_for::<Scope>();
    generator.take_definitions(true)
}

/// The most calls one batch carries.
pub const MAX_BATCH: usize = 64;

/// A batch of `(path, frame)` calls.
pub fn encode_batch(calls: &[(&str, &[u8])]) -> Vec<u8> {
    let meta = Batch {
        calls: calls
            .iter()
            .map(|(path, frame)| BatchCall {
                path: path.to_string(),
                len: frame.len(),
            })
            .collect(),
    };
    let bytes: Vec<u8> = calls
        .iter()
        .flat_map(|(_, frame)| frame.iter().copied())
        .collect();
    encode_frame(&meta, &bytes)
}

/// A batch's reply from each call's `(status, reply)`.
pub fn encode_batch_reply(results: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let meta = BatchReply {
        results: results
            .iter()
            .map(|(status, reply)| BatchResult {
                status: *status,
                len: reply.len(),
            })
            .collect(),
    };
    let bytes: Vec<u8> = results
        .iter()
        .flat_map(|(_, reply)| reply.iter().copied())
        .collect();
    encode_frame(&meta, &bytes)
}

/// Cuts a batch's (or a batch reply's) bytes into its parts' frames; the
/// lengths must add up exactly.
pub fn split_batch(
    lens: impl IntoIterator<Item = usize>,
    mut bytes: &[u8],
) -> Result<Vec<&[u8]>, FrameError> {
    let mut out = Vec::new();
    for len in lens {
        if len > bytes.len() {
            return Err(FrameError::Batch("a part is longer than the bytes left"));
        }
        let (frame, rest) = bytes.split_at(len);
        out.push(frame);
        bytes = rest;
    }
    if !bytes.is_empty() {
        return Err(FrameError::Batch("bytes are left after the last part"));
    }
    Ok(out)
}

/// Metadata line, `\n`, bytes.
pub fn encode_frame<T: Serialize>(meta: &T, bytes: &[u8]) -> Vec<u8> {
    let mut out = start_frame(meta, bytes.len());
    out.extend_from_slice(bytes);
    out
}

/// Room for a metadata line: a claim's or a completion's takes a few hundred
/// bytes, so the frame is one allocation.
const METADATA_ROOM: usize = 512;

/// A frame's metadata line and `\n`, with room for `bytes` more: its bytes
/// are appended to it as they come.
pub fn start_frame<T: Serialize>(meta: &T, bytes: usize) -> Vec<u8> {
    // Serializing plain data structs to a Vec cannot fail; an empty object is a
    // safe fallback that the peer rejects as invalid metadata.
    let mut out = Vec::with_capacity(METADATA_ROOM + bytes);
    if serde_json::to_writer(&mut out, meta).is_err() {
        out.clear();
        out.extend_from_slice(b"{}");
    }
    out.push(b'\n');
    out
}

/// Splits a frame into its metadata and its bytes.
pub fn decode_frame<'a, T: Deserialize<'a>>(frame: &'a [u8]) -> Result<(T, &'a [u8]), FrameError> {
    let cut = frame
        .iter()
        .position(|&b| b == b'\n')
        .ok_or(FrameError::MissingSeparator)?;
    let meta = serde_json::from_slice(&frame[..cut]).map_err(|e| FrameError::Json(e.to_string()))?;
    Ok((meta, &frame[cut + 1..]))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
