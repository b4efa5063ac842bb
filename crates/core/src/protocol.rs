//! The filter ↔ store wire protocol (`/v1`).
//!
//! Every call is `POST` with a *frame* as body: one line of compact JSON
//! metadata, a `\n`, then raw bytes (a stored response body travels as bytes,
//! never as base64 inside JSON). Compact JSON never contains a raw newline, so
//! the first `\n` always ends the metadata. Replies to `claim` are frames too;
//! the other calls answer plain JSON.
//!
//! Timestamps are milliseconds since the Unix epoch, taken by the store's clock.

use serde::{Deserialize, Serialize};

use crate::config::{AfterExpiry, OnUnknown};
use crate::fingerprint::Fingerprint;
use crate::scope::Scope;

pub const CLAIM_PATH: &str = "/v1/claim";
pub const COMPLETE_PATH: &str = "/v1/complete";
pub const RELEASE_PATH: &str = "/v1/release";
pub const MARK_UNKNOWN_PATH: &str = "/v1/mark-unknown";
pub const FRAME_CONTENT_TYPE: &str = "application/vnd.idemgate.frame";

/// Ask to own a key. The store answers with a [`ClaimReply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
}

/// The store's verdict on a claim. Checked in this order: fingerprint
/// mismatch first (422 before 409), then state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteRequest {
    pub scope: Scope,
    pub fence: u64,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// `false` when the body was larger than `max_stored_body` and was
    /// streamed through instead of kept; the frame then carries no bytes.
    pub body_stored: bool,
}

/// Give the key back (the upstream refused before acting), or declare that
/// nobody knows what happened (`mark-unknown`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceRequest {
    pub scope: Scope,
    pub fence: u64,
}

/// Answer to complete, release and mark-unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
pub enum FenceReply {
    Done,
    /// The fencing token was superseded (or the record is gone): nothing changed.
    Stale,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    MissingSeparator,
    Json(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::MissingSeparator => f.write_str("frame has no metadata line"),
            FrameError::Json(e) => write!(f, "frame metadata is not valid: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Metadata line, `\n`, bytes.
pub fn encode_frame<T: Serialize>(meta: &T, bytes: &[u8]) -> Vec<u8> {
    // Serializing plain data structs to a Vec cannot fail; an empty object is a
    // safe fallback that the peer rejects as invalid metadata.
    let mut out = serde_json::to_vec(meta).unwrap_or_else(|_| b"{}".to_vec());
    out.reserve(bytes.len() + 1);
    out.push(b'\n');
    out.extend_from_slice(bytes);
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
