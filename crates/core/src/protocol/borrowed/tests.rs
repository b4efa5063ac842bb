//! Each borrowed request writes the bytes its owned twin writes, and the
//! store reads them back as that twin. Every owned field is named below, so a
//! field added to an owned request fails to compile here until its twin has it.

use super::*;
use crate::config::{AfterExpiry, OnUnknown};
use crate::key::Key;
use crate::protocol::{
    decode_frame, encode_frame, AbandonRequest, Attempt, ClaimRequest, CompleteRequest, FenceRequest,
};
use crate::trace::Trace;
use serde::de::DeserializeOwned;

fn scopes() -> Vec<Scope> {
    let scope = |tenant: &str, principal: &str, route: &str, namespace, key: &str| {
        Scope::new(
            tenant,
            principal,
            route,
            namespace,
            Key::try_from(key.to_string()).unwrap(),
        )
        .unwrap()
    };
    vec![
        scope("acme", "u1", "payments.create", Namespace::Client, "k1"),
        // Everything JSON escapes, and more than ASCII.
        scope(
            "t\"q\\é",
            "*",
            "r/ü\u{2028}",
            Namespace::Server,
            "!#$%&'()*+,-./:;<=>?@[]^_`{|}~",
        ),
    ]
}

fn trace() -> Trace {
    Trace {
        request_id: Some("r-1".into()),
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
    }
}

/// Writes `owned` both ways; the store reads the borrowed bytes back as `owned`.
fn both_ways<T: Serialize + DeserializeOwned>(owned: &T, borrowed: &impl Serialize, bytes: &[u8]) -> T {
    let frame = encode_frame(borrowed, bytes);
    assert_eq!(
        String::from_utf8_lossy(&frame),
        String::from_utf8_lossy(&encode_frame(owned, bytes))
    );
    assert_eq!(frame, encode_frame(owned, bytes));
    let (read, rest) = decode_frame::<T>(&frame).unwrap();
    assert_eq!(rest, bytes);
    read
}

#[test]
fn a_borrowed_claim_writes_the_owned_claims_bytes() {
    let attempts = [None, Some(Attempt::try_from("3f9c-a_7".to_string()).unwrap())];
    let fingerprints = [None, Some(Fingerprint::from_bytes([0xa7; 32]))];
    for scope in scopes() {
        for attempt in &attempts {
            for fingerprint in fingerprints {
                let owned = ClaimRequest {
                    scope: scope.clone(),
                    fingerprint,
                    lease_ms: 30_000,
                    ttl_ms: 86_400_000,
                    wait_ms: 250,
                    after_expiry: AfterExpiry::Reject,
                    on_unknown: OnUnknown::Conflict,
                    attempt: attempt.clone(),
                    deadline_ms: 2_250,
                    trace: trace(),
                };
                let ClaimRequest {
                    scope,
                    fingerprint,
                    lease_ms,
                    ttl_ms,
                    wait_ms,
                    after_expiry,
                    on_unknown,
                    attempt,
                    deadline_ms,
                    trace: _,
                } = &owned;
                let borrowed = ClaimRequestRef {
                    scope: scope.into(),
                    fingerprint: fingerprint.map(FingerprintHex),
                    lease_ms: *lease_ms,
                    ttl_ms: *ttl_ms,
                    wait_ms: *wait_ms,
                    after_expiry: *after_expiry,
                    on_unknown: *on_unknown,
                    attempt: attempt.as_ref().map(Attempt::as_str),
                    deadline_ms: *deadline_ms,
                };
                let read = both_ways(&owned, &borrowed, b"");
                assert_eq!(
                    read,
                    ClaimRequest {
                        trace: Trace::NONE,
                        ..owned.clone()
                    }
                );
            }
        }
    }
}

#[test]
fn a_borrowed_completion_writes_the_owned_completions_bytes() {
    let header_sets: [Vec<(String, String)>; 2] = [
        vec![],
        vec![
            ("location".into(), "/v1/p/1".into()),
            ("x-note".into(), "a \"quoted\"\tvalue é".into()),
        ],
    ];
    for scope in scopes() {
        for headers in &header_sets {
            for (body_stored, body) in [(true, &b"{\"id\":1}\n\x00\xff"[..]), (true, b""), (false, b"")] {
                let owned = CompleteRequest {
                    scope: scope.clone(),
                    fence: 41,
                    status: 201,
                    headers: headers.clone(),
                    body_stored,
                    trace: trace(),
                };
                let CompleteRequest {
                    scope,
                    fence,
                    status,
                    headers,
                    body_stored,
                    trace: _,
                } = &owned;
                let borrowed = CompleteRequestRef {
                    scope: scope.into(),
                    fence: *fence,
                    status: *status,
                    headers,
                    body_stored: *body_stored,
                };
                let read = both_ways(&owned, &borrowed, body);
                assert_eq!(
                    read,
                    CompleteRequest {
                        trace: Trace::NONE,
                        ..owned.clone()
                    }
                );
            }
        }
    }
}

#[test]
fn borrowed_fence_and_abandon_calls_write_the_owned_calls_bytes() {
    for scope in scopes() {
        let owned = FenceRequest {
            scope: scope.clone(),
            fence: 9,
            trace: trace(),
        };
        let FenceRequest {
            scope: s,
            fence,
            trace: _,
        } = &owned;
        let borrowed = FenceRequestRef {
            scope: s.into(),
            fence: *fence,
        };
        let read = both_ways(&owned, &borrowed, b"");
        assert_eq!(
            read,
            FenceRequest {
                trace: Trace::NONE,
                ..owned.clone()
            }
        );

        let owned = AbandonRequest {
            scope,
            attempt: Attempt::try_from("3f9c-a_7".to_string()).unwrap(),
            trace: trace(),
        };
        let AbandonRequest {
            scope,
            attempt,
            trace: _,
        } = &owned;
        let borrowed = AbandonRequestRef {
            scope: scope.into(),
            attempt: attempt.as_str(),
        };
        let read = both_ways(&owned, &borrowed, b"");
        assert_eq!(
            read,
            AbandonRequest {
                trace: Trace::NONE,
                ..owned.clone()
            }
        );
    }
}
