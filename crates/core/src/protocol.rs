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
    // One allocation: metadata lines are a few hundred bytes.
    let mut out = Vec::with_capacity(256 + bytes.len());
    if serde_json::to_writer(&mut out, meta).is_err() {
        out.clear();
        out.extend_from_slice(b"{}");
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::scope::Namespace;
    use serde_json::json;

    fn scope() -> Scope {
        Scope::new(
            "acme",
            "u1",
            "payments.create",
            Namespace::Client,
            Key::try_from("k1".to_string()).unwrap(),
        )
        .unwrap()
    }

    fn scope_json() -> serde_json::Value {
        json!({"version": "v1", "tenant": "acme", "principal": "u1", "route": "payments.create",
               "namespace": "u", "key": "k1"})
    }

    #[test]
    fn a_frame_round_trips_metadata_and_bytes() {
        let reply = ClaimReply::Replay {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            completed_at: 1_700_000_000_000,
        };
        let body = b"line one\nline two\n\0\xff";
        let frame = encode_frame(&reply, body);
        let (meta, bytes): (ClaimReply, &[u8]) = decode_frame(&frame).unwrap();
        assert_eq!((meta, bytes), (reply, &body[..]));
    }

    #[test]
    fn metadata_with_newlines_in_strings_stays_on_one_line() {
        let reply = ClaimReply::Replay {
            status: 200,
            headers: vec![("x".into(), "a\nb".into())],
            completed_at: 0,
        };
        let frame = encode_frame(&reply, b"");
        assert_eq!(frame.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(decode_frame::<ClaimReply>(&frame).unwrap().0, reply);
    }

    #[test]
    fn an_empty_body_leaves_the_frame_ending_in_a_newline() {
        let frame = encode_frame(&FenceReply::Done, b"");
        assert_eq!(frame, b"{\"outcome\":\"done\"}\n");
    }

    macro_rules! bad_frame {
        ($name:ident, $frame:expr => $want:pat) => {
            #[test]
            fn $name() {
                assert!(matches!(decode_frame::<FenceReply>($frame), Err($want)));
            }
        };
    }

    bad_frame!(a_frame_without_a_newline_is_rejected, b"{\"outcome\":\"done\"}" => FrameError::MissingSeparator);
    bad_frame!(an_empty_frame_is_rejected, b"" => FrameError::MissingSeparator);
    bad_frame!(a_frame_with_bad_json_is_rejected, b"{oops\nbody" => FrameError::Json(_));
    bad_frame!(a_frame_with_an_unknown_outcome_is_rejected, b"{\"outcome\":\"maybe\"}\n" => FrameError::Json(_));
    bad_frame!(a_frame_with_empty_metadata_is_rejected, b"\nbody" => FrameError::Json(_));

    macro_rules! wire {
        ($name:ident, $value:expr => $json:tt) => {
            #[test]
            fn $name() {
                let value = $value;
                let text = serde_json::to_value(&value).unwrap();
                assert_eq!(text, json!($json));
                assert_eq!(serde_json::from_value::<ClaimReply>(text).unwrap(), value);
            }
        };
    }

    wire!(owned_is_tagged_by_outcome, ClaimReply::Owned { fence: 7 } => {"outcome": "owned", "fence": 7});
    wire!(mismatch_has_only_its_outcome, ClaimReply::Mismatch => {"outcome": "mismatch"});
    wire!(unknown_has_only_its_outcome, ClaimReply::Unknown => {"outcome": "unknown"});
    wire!(in_progress_is_snake_case, ClaimReply::InProgress { retry_after_ms: 1500 } => {"outcome": "in_progress", "retry_after_ms": 1500});
    wire!(result_unavailable_carries_status_and_time, ClaimReply::ResultUnavailable { original_status: 201, completed_at: 5 } => {"outcome": "result_unavailable", "original_status": 201, "completed_at": 5});
    wire!(expired_may_lack_a_completion_time, ClaimReply::Expired { completed_at: None } => {"outcome": "expired", "completed_at": null});
    wire!(replay_headers_are_pairs, ClaimReply::Replay { status: 200, headers: vec![("etag".into(), "\"1\"".into())], completed_at: 9 } => {"outcome": "replay", "status": 200, "headers": [["etag", "\"1\""]], "completed_at": 9});

    #[test]
    fn a_claim_request_round_trips() {
        let claim = ClaimRequest {
            scope: scope(),
            fingerprint: None,
            lease_ms: 60_000,
            ttl_ms: 86_400_000,
            wait_ms: 0,
            after_expiry: AfterExpiry::Reject,
            on_unknown: OnUnknown::Conflict,
        };
        let text = serde_json::to_value(&claim).unwrap();
        assert_eq!(text["scope"], scope_json());
        assert_eq!(text["fingerprint"], serde_json::Value::Null);
        assert_eq!(serde_json::from_value::<ClaimRequest>(text).unwrap(), claim);
    }

    fn claim_json(patch: serde_json::Value) -> serde_json::Value {
        let mut claim = json!({"scope": scope_json(), "fingerprint": "ab".repeat(32), "lease_ms": 1,
                               "ttl_ms": 2, "after_expiry": "new", "on_unknown": "release"});
        for (k, v) in patch.as_object().unwrap() {
            claim[k] = v.clone();
        }
        claim
    }

    #[test]
    fn wait_ms_defaults_to_zero() {
        let claim: ClaimRequest = serde_json::from_value(claim_json(json!({}))).unwrap();
        assert_eq!(claim.wait_ms, 0);
        assert_eq!(claim.fingerprint.unwrap().to_hex(), "ab".repeat(32));
    }

    macro_rules! bad_claim {
        ($name:ident, $patch:tt) => {
            #[test]
            fn $name() {
                assert!(serde_json::from_value::<ClaimRequest>(claim_json(json!($patch))).is_err());
            }
        };
    }

    bad_claim!(a_claim_with_an_invalid_scope_is_rejected, {"scope": {"version": "v1", "tenant": "a\nb", "principal": "p", "route": "r", "namespace": "u", "key": "k"}});
    bad_claim!(a_claim_with_an_invalid_key_is_rejected, {"scope": {"version": "v1", "tenant": "t", "principal": "p", "route": "r", "namespace": "u", "key": ""}});
    bad_claim!(a_claim_with_an_upper_case_fingerprint_is_rejected, {"fingerprint": "AB".repeat(32)});
    bad_claim!(a_claim_with_a_short_fingerprint_is_rejected, {"fingerprint": "ab"});
    bad_claim!(a_claim_with_an_unknown_field_is_rejected, {"priority": 1});
    bad_claim!(a_claim_with_an_unknown_policy_value_is_rejected, {"after_expiry": "maybe"});

    #[test]
    fn fence_requests_and_completions_round_trip() {
        let fence = FenceRequest {
            scope: scope(),
            fence: 3,
        };
        let text = serde_json::to_string(&fence).unwrap();
        assert_eq!(serde_json::from_str::<FenceRequest>(&text).unwrap(), fence);
        let complete = CompleteRequest {
            scope: scope(),
            fence: 3,
            status: 201,
            headers: vec![("location".into(), "/v1/p/1".into())],
            body_stored: true,
        };
        let frame = encode_frame(&complete, b"{}");
        assert_eq!(
            decode_frame::<CompleteRequest>(&frame).unwrap(),
            (complete, &b"{}"[..])
        );
    }

    #[test]
    fn a_claim_reply_with_unknown_members_in_a_struct_variant_is_rejected() {
        // serde ignores `deny_unknown_fields` for unit variants of an
        // internally tagged enum, so `{"outcome":"mismatch","x":1}` is accepted.
        assert!(serde_json::from_str::<ClaimReply>(r#"{"outcome":"owned","fence":1,"x":1}"#).is_err());
    }

    #[test]
    fn fence_replies_are_tagged_by_outcome() {
        assert_eq!(
            serde_json::to_string(&FenceReply::Stale).unwrap(),
            r#"{"outcome":"stale"}"#
        );
        assert_eq!(
            serde_json::from_str::<FenceReply>(r#"{"outcome":"done"}"#).unwrap(),
            FenceReply::Done
        );
    }
}
