use super::*;

#[test]
fn a_batch_carries_its_calls_frames_back_to_back() {
    let (a, b) = (
        encode_frame(&serde_json::json!({"x": 1}), b"\nraw"),
        encode_frame(&serde_json::json!({}), &[]),
    );
    let batch = encode_batch(&[(CLAIM_PATH, &a), (RELEASE_PATH, &b)]);
    let (meta, bytes) = decode_frame::<Batch>(&batch).unwrap();
    assert_eq!(
        meta.calls.iter().map(|c| c.path.as_str()).collect::<Vec<_>>(),
        [CLAIM_PATH, RELEASE_PATH]
    );
    assert_eq!(
        split_batch(meta.calls.iter().map(|c| c.len), bytes).unwrap(),
        [&a[..], &b[..]]
    );
    let reply = encode_batch_reply(&[(200, b"one".to_vec()), (503, vec![])]);
    let (meta, bytes) = decode_frame::<BatchReply>(&reply).unwrap();
    assert_eq!(
        meta.results.iter().map(|r| r.status).collect::<Vec<_>>(),
        [200, 503]
    );
    assert_eq!(
        split_batch(meta.results.iter().map(|r| r.len), bytes).unwrap(),
        [&b"one"[..], &b""[..]]
    );
}

#[test]
fn batch_lengths_must_add_up() {
    assert!(split_batch([4], b"abc").is_err());
    assert!(split_batch([2], b"abc").is_err());
    assert_eq!(split_batch([1, 2], b"abc").unwrap(), [&b"a"[..], &b"bc"[..]]);
}
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
        attempt: Some(Attempt::try_from("a-1_Z".to_string()).unwrap()),
        deadline_ms: 1_000,
        trace: Trace {
            request_id: Some("r-1".into()),
            trace_id: None,
        },
    };
    let text = serde_json::to_value(&claim).unwrap();
    assert_eq!(text["attempt"], "a-1_Z");
    // The trace travels in a header: a store before it refuses unknown fields.
    assert_eq!(text.get("trace"), None);
    assert_eq!(text["scope"], scope_json());
    assert_eq!(text["fingerprint"], serde_json::Value::Null);
    assert_eq!(
        serde_json::from_value::<ClaimRequest>(text).unwrap(),
        ClaimRequest {
            trace: Trace::NONE,
            ..claim
        }
    );
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
fn wait_ms_attempt_and_deadline_default_to_none() {
    let claim: ClaimRequest = serde_json::from_value(claim_json(json!({}))).unwrap();
    assert_eq!((claim.wait_ms, claim.deadline_ms, claim.attempt), (0, 0, None));
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
bad_claim!(a_claim_with_an_unknown_policy_value_is_rejected, {"after_expiry": "maybe"});
bad_claim!(a_claim_with_an_empty_attempt_is_rejected, {"attempt": ""});
bad_claim!(a_claim_with_a_long_attempt_is_rejected, {"attempt": "a".repeat(65)});
bad_claim!(a_claim_with_a_strange_attempt_is_rejected, {"attempt": "a b"});

#[test]
fn fence_requests_and_completions_round_trip() {
    let fence = FenceRequest {
        scope: scope(),
        fence: 3,
        trace: Trace::NONE,
    };
    let text = serde_json::to_string(&fence).unwrap();
    // A call with no trace says nothing of it: stores that predate it read it as before.
    assert!(!text.contains("trace"));
    assert_eq!(serde_json::from_str::<FenceRequest>(&text).unwrap(), fence);
    let complete = CompleteRequest {
        scope: scope(),
        fence: 3,
        status: 201,
        headers: vec![("location".into(), "/v1/p/1".into())],
        body_stored: true,
        trace: Trace::NONE,
    };
    let frame = encode_frame(&complete, b"{}");
    assert_eq!(
        decode_frame::<CompleteRequest>(&frame).unwrap(),
        (complete, &b"{}"[..])
    );
}

#[test]
fn fields_a_peer_does_not_know_are_ignored_but_outcomes_and_scopes_stay_strict() {
    let claim: ClaimRequest = serde_json::from_value(claim_json(json!({"priority": 1}))).unwrap();
    assert_eq!(claim.lease_ms, 1);
    assert_eq!(
        serde_json::from_str::<ClaimReply>(r#"{"outcome":"owned","fence":1,"x":1}"#).unwrap(),
        ClaimReply::Owned { fence: 1 }
    );
    assert!(serde_json::from_str::<ClaimReply>(r#"{"outcome":"deferred"}"#).is_err());
    let mut scope = scope_json();
    scope["region"] = json!("eu");
    assert!(serde_json::from_value::<ClaimRequest>(claim_json(json!({"scope": scope}))).is_err());
}

#[test]
fn the_highest_common_version_is_chosen_and_no_header_means_version_1() {
    assert_eq!(negotiate(None, PROTOCOL_VERSIONS), Ok(1));
    assert_eq!(negotiate(Some(PROTOCOL_OFFER), PROTOCOL_VERSIONS), Ok(1));
    assert_eq!(negotiate(Some("1, 2, 3"), &[1, 2]), Ok(2));
    assert_eq!(negotiate(Some("2,1"), &[1, 2, 3]), Ok(2));
    let err = negotiate(Some("3"), &[1, 2]).unwrap_err();
    assert!(err.contains("speaks protocol 3") && err.contains("1, 2"), "{err}");
    assert!(negotiate(None, &[2]).is_err());
    for bad in ["", "v1", "0", "1;q=1", "-1"] {
        assert!(negotiate(Some(bad), PROTOCOL_VERSIONS).is_err(), "{bad:?}");
    }
}

#[test]
fn the_offer_lists_every_version_spoken() {
    assert_eq!(PROTOCOL_OFFER, list(PROTOCOL_VERSIONS).replace(' ', ""));
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
