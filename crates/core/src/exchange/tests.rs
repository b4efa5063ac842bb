//! Unit tests of the parent module (compiled only for tests).
#![cfg(test)]

use super::*;
use crate::config::ENVOY_DEFAULT_BUFFER_LIMIT;
use crate::limits;
use crate::problem::ProblemKind;
use crate::protocol::{
    decode_frame, encode_frame, AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceRequest,
    COMPLETE_PATH,
};

mod canary;
mod capture;
mod grpc;

const CONFIG: &str = r#"{
    "store": {"cluster": "store", "token": "t"},
    "policies": [
        {"name": "pay", "match": {"path": {"prefix": "/pay"}}, "tenant": {"header": "x-tenant"}},
        {"name": "watch", "match": {"path": {"prefix": "/watch"}}, "anonymous": true, "mode": "observe"},
        {"name": "open", "match": {"path": {"prefix": "/open"}}, "anonymous": true, "failure_mode": "open"},
        {"name": "small", "match": {"path": {"prefix": "/small"}}, "anonymous": true,
         "max_request_body": 4, "max_stored_body": 4, "in_flight": "wait", "wait_max_ms": 300},
        {"name": "background", "match": {"path": {"prefix": "/background"}}, "anonymous": true,
         "settle": "background"},
        {"name": "detached", "match": {"path": {"prefix": "/detached"}}, "anonymous": true,
         "max_stored_body": 8, "forwarding": {"mode": "detached", "max_response_body": 16}}
    ]}"#;

fn begin(path: &str, key: Option<&str>, body: Option<&str>) -> (Exchange, Step) {
    let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap());
    let policy = config.policy_for("POST", "h", path).unwrap().clone();
    let lines = [
        (":path".to_string(), path.as_bytes().to_vec()),
        ("transfer-encoding".to_string(), b"chunked".to_vec()),
        ("x-trace".to_string(), b"t1".to_vec()),
        ("x-request-id".to_string(), b"r-1".to_vec()),
    ];
    let head = RequestHead {
        method: "POST".into(),
        path: path.into(),
        key_fields: key.map(|k| vec![k.as_bytes().to_vec()]).unwrap_or_default(),
        tenant: Some(b"acme".to_vec()),
        end_of_stream: body.is_none(),
        upstream: upstream_call(&policy, Some("route"), &lines),
        trace: crate::trace::Trace::of_request(&lines),
        ..RequestHead::default()
    };
    let (mut ex, step) = Exchange::begin(config, policy, head, attempt());
    match body {
        Some(body) if step == Step::Pause => {
            let step = ex.request_body(body.as_bytes(), true);
            (ex, step)
        }
        _ => (ex, step),
    }
}

fn attempt() -> Attempt {
    Attempt::try_from("attempt-1".to_string()).unwrap()
}

/// The abandon call a step hands to the store client, and the step after it.
fn abandoning(step: Step) -> (AbandonRequest, Step) {
    let Step::Deliver(call, next) = step else {
        panic!("expected an abandon, got {step:?}")
    };
    assert_eq!(call.path, ABANDON_PATH);
    (decode_frame::<AbandonRequest>(&call.body).unwrap().0, *next)
}

fn claim_of(step: &Step) -> ClaimRequest {
    let Step::Call(call) = step else {
        panic!("expected a claim, got {step:?}")
    };
    assert_eq!(call.path, CLAIM_PATH);
    decode_frame::<ClaimRequest>(&call.body).unwrap().0
}

fn reply(reply: ClaimReply, body: &[u8]) -> StoreAnswer {
    Some((200, encode_frame(&reply, body)))
}

/// A refusal as the store answers it: a problem document of its own.
fn store_problem(kind: ProblemKind, detail: &str) -> StoreAnswer {
    let reply = Problem::new(kind, detail).render("https://store.example/problems/");
    Some((reply.status, reply.body))
}

fn problem_slug(step: &Step) -> (u16, String) {
    let Step::Respond(reply) = step else {
        panic!("expected a reply, got {step:?}")
    };
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    (
        reply.status,
        body["type"]
            .as_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .to_string(),
    )
}

fn upstream(status: u16, headers: &[(&str, &str)], end_of_stream: bool) -> ResponseHead {
    ResponseHead {
        status,
        origin: Origin::Upstream,
        headers: headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect(),
        content_length: None,
        end_of_stream,
    }
}

fn owned(path: &str) -> Exchange {
    let (mut ex, step) = begin(path, Some("k1"), Some("{}"));
    claim_of(&step);
    assert_eq!(
        ex.store_reply(reply(ClaimReply::Owned { fence: 7 }, b"")),
        Step::Continue
    );
    ex
}

fn called_path(step: &Step) -> &'static str {
    let Step::Call(call) = step else {
        panic!("expected a call, got {step:?}")
    };
    call.path
}

#[test]
fn a_request_without_a_required_key_is_answered_400_key_missing() {
    assert_eq!(
        problem_slug(&begin("/pay", None, None).1),
        (400, "key-missing".into())
    );
}

#[test]
fn a_malformed_key_is_answered_400_key_invalid() {
    assert_eq!(
        problem_slug(&begin("/pay", Some("a b"), None).1),
        (400, "key-invalid".into())
    );
}

#[test]
fn a_missing_tenant_is_answered_400_identity_missing() {
    let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap());
    let policy = config.policies()[0].clone();
    let head = RequestHead {
        key_fields: vec![b"k".to_vec()],
        end_of_stream: true,
        ..RequestHead::default()
    };
    let (_, step) = Exchange::begin(config, policy, head, attempt());
    assert_eq!(problem_slug(&step), (400, "identity-missing".into()));
}

#[test]
fn the_body_is_read_before_the_claim_and_fingerprinted() {
    let (_, a) = begin("/pay", Some("k"), Some(r#"{"a":1,"b":2}"#));
    let (_, b) = begin("/pay", Some("k"), Some(r#"{ "b":2, "a":1.0 }"#));
    let (_, c) = begin("/pay", Some("k"), Some(r#"{"a":1,"b":3}"#));
    assert_eq!(claim_of(&a).fingerprint, claim_of(&b).fingerprint);
    assert_ne!(claim_of(&a).fingerprint, claim_of(&c).fingerprint);
    assert_eq!(claim_of(&a).scope.tenant(), "acme");
}

#[test]
fn a_body_over_the_limit_is_answered_413() {
    assert_eq!(
        problem_slug(&begin("/small", Some("k"), Some("12345")).1),
        (413, "body-too-large".into())
    );
}

#[test]
fn a_wait_policy_asks_the_store_to_wait_and_extends_the_call_timeout() {
    let (_, step) = begin("/small", Some("k"), Some("{}"));
    assert_eq!(claim_of(&step).wait_ms, 300);
    let Step::Call(call) = step else { unreachable!() };
    assert_eq!(call.timeout_ms, 1300);
}

#[test]
fn store_verdicts_map_to_the_contract_answers() {
    let cases: [(ClaimReply, u16, &str); 5] = [
        (ClaimReply::Mismatch, 422, "key-reused"),
        (
            ClaimReply::InProgress { retry_after_ms: 1500 },
            409,
            "request-in-progress",
        ),
        (ClaimReply::Unknown, 409, "outcome-unknown"),
        (
            ClaimReply::Expired {
                completed_at: Some(0),
            },
            422,
            "key-expired",
        ),
        (
            ClaimReply::ResultUnavailable {
                original_status: 201,
                completed_at: 0,
            },
            409,
            "result-unavailable",
        ),
    ];
    for (verdict, status, slug) in cases {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let step = ex.store_reply(reply(verdict, b""));
        assert_eq!(problem_slug(&step), (status, slug.to_string()));
        // Our own reply coming back through the response path is ignored.
        assert_eq!(ex.response_headers(upstream(status, &[], true)), Step::Continue);
        assert_eq!(ex.finish(), None);
    }
}

#[test]
fn in_progress_hints_a_short_retry_and_unknown_none() {
    let busy = |remaining_ms: u64| {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let Step::Respond(reply) = ex.store_reply(reply(
            ClaimReply::InProgress {
                retry_after_ms: remaining_ms,
            },
            b"",
        )) else {
            panic!()
        };
        let get = |name: &str| {
            reply
                .headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        (
            get("retry-after"),
            get("retry-after-ms"),
            get("x-should-retry"),
            get("stripe-should-retry"),
        )
    };
    let yes = Some("true".to_string());
    // The policy's hint (1 s by default), not the whole remaining lease...
    assert_eq!(
        busy(59_000),
        (Some("1".into()), Some("1000".into()), yes.clone(), yes.clone())
    );
    // ...and never beyond it.
    assert_eq!(
        busy(300),
        (Some("1".into()), Some("300".into()), yes.clone(), yes)
    );
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    let Step::Respond(unknown) = ex.store_reply(reply(ClaimReply::Unknown, b"")) else {
        panic!()
    };
    assert!(!unknown.headers.iter().any(|(n, _)| n == "retry-after"));
    assert!(unknown
        .headers
        .contains(&("x-should-retry".into(), "false".into())));
    assert!(unknown
        .headers
        .contains(&("stripe-should-retry".into(), "false".into())));
}

#[test]
fn a_replay_sends_the_stored_response_with_only_allowlisted_headers() {
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    let stored = ClaimReply::Replay {
        status: 201,
        headers: vec![
            ("location".into(), "/p/1".into()),
            ("set-cookie".into(), "s=1".into()),
        ],
        completed_at: 1,
    };
    let Step::Respond(r) = ex.store_reply(reply(stored, b"{\"id\":1}")) else {
        panic!()
    };
    assert_eq!((r.status, r.body.as_slice()), (201, b"{\"id\":1}".as_slice()));
    assert_eq!(
        r.headers,
        vec![
            ("location".into(), "/p/1".into()),
            ("idempotent-replayed".into(), "true".into()),
            ("idempotency-key".into(), "\"k\"".into())
        ]
    );
    assert_eq!(ex.handling(), Handling::Replayed);
}

fn header<'a>(step: &'a Step, name: &str) -> Option<&'a str> {
    let Step::Respond(reply) = step else {
        panic!("expected a reply, got {step:?}")
    };
    reply
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn every_answer_to_a_valid_key_echoes_it_as_an_sf_string() {
    // Problems after the key was read.
    let (mut ex, _) = begin("/pay", Some("\"k-1\""), Some("{}"));
    assert_eq!(ex.key_echo(), Some("\"k-1\""));
    let step = ex.store_reply(reply(ClaimReply::Mismatch, b""));
    assert_eq!(header(&step, "idempotency-key"), Some("\"k-1\""));
    let (_, step) = begin("/small", Some("k-2"), Some("12345"));
    assert_eq!(header(&step, "idempotency-key"), Some("\"k-2\""));
    // Forwarded: the filter echoes it on the upstream's answer.
    assert_eq!(owned("/pay").key_echo(), Some("\"k1\""));
    // No valid key, nothing to echo.
    let (ex, step) = begin("/pay", Some("a b"), None);
    assert_eq!(header(&step, "idempotency-key"), None);
    assert_eq!(ex.key_echo(), None);
    let (ex, _) = begin("/pay", None, None);
    assert_eq!(ex.key_echo(), None);
}

#[test]
fn a_store_4xx_is_reported_once_as_a_refusal_and_still_fails_closed() {
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    let refused = store_problem(ProblemKind::BadRequest, "ttl_ms must be between 1 and 9");
    assert_eq!(
        problem_slug(&ex.store_reply(refused)),
        (503, "store-unavailable".into())
    );
    assert_eq!(
        ex.take_store_refusal(),
        Some((400, "ttl_ms must be between 1 and 9".to_string()))
    );
    assert_eq!(ex.take_store_refusal(), None);
    // An outage is not a refusal, nor is a stale fence.
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    ex.store_reply(Some((503, vec![])));
    assert_eq!(ex.take_store_refusal(), None);
    let mut ex = owned("/pay");
    ex.response_headers(upstream(200, &[], true));
    ex.store_reply(Some((409, b"{\"outcome\":\"stale\"}\n".to_vec())));
    assert_eq!(ex.take_store_refusal(), None);
}

#[test]
fn a_tenant_over_its_key_budget_gets_429_and_no_claim_is_abandoned() {
    let (mut ex, step) = begin("/pay", Some("k"), Some("{}"));
    assert_eq!(claim_of(&step).scope.tenant(), "acme");
    // The store's answer, as it renders it (alone or inside a batch).
    let limited = Problem::key_rate_limited(2_500).render("https://store.example/problems/");
    let step = ex.store_reply(Some((429, limited.body)));
    assert_eq!(problem_slug(&step), (429, "key-rate-limited".into()));
    assert_eq!(header(&step, "retry-after"), Some("3"));
    assert_eq!(header(&step, "retry-after-ms"), Some("2500"));
    assert_eq!(header(&step, "x-should-retry"), Some("true"));
    assert_eq!(header(&step, "idempotency-key"), Some("\"k\""));
    // Nothing was claimed: no abandon follows, and it is no deployment error.
    assert!(matches!(step, Step::Respond(_)), "{step:?}");
    assert_eq!(ex.handling(), Handling::RateLimited);
    assert_eq!(ex.take_store_refusal(), None);
    // Observe mode forwards instead.
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    let limited = Problem::key_rate_limited(1).render("https://store.example/problems/");
    assert_eq!(ex.store_reply(Some((429, limited.body))), Step::Continue);
    assert_eq!(
        (ex.handling(), ex.reason()),
        (Handling::WouldReject, Some(Handling::RateLimited))
    );
    // A 429 that is not the store's rate limit is an outage (fail closed).
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    let (_, step) = abandoning(ex.store_reply(Some((429, b"slow down".to_vec()))));
    assert_eq!(problem_slug(&step), (503, "store-unavailable".into()));
}

#[test]
fn errors_before_execution_release_unless_the_upstream_says_store() {
    for status in [400, 401, 403, 422] {
        let mut ex = owned("/pay");
        assert_eq!(
            called_path(&ex.response_headers(upstream(status, &[], true))),
            RELEASE_PATH
        );
    }
    let mut ex = owned("/pay");
    let step = ex.response_headers(upstream(401, &[("idempotency-control", "store")], true));
    assert_eq!(called_path(&step), COMPLETE_PATH);
    let Step::Call(call) = step else { unreachable!() };
    assert_eq!(decode_frame::<CompleteRequest>(&call.body).unwrap().0.status, 401);
}

#[test]
fn headers_the_store_would_refuse_complete_without_the_response() {
    let mut ex = owned("/pay");
    let long = "v".repeat(limits::MAX_HEADER_VALUE + 1);
    let step = ex.response_headers(upstream(201, &[("location", &long)], true));
    let Step::Deliver(call, _) = &step else {
        panic!("{step:?}")
    };
    let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!(
        (done.status, done.body_stored, done.headers.len(), body.len()),
        (201, false, 0, 0)
    );
}

#[test]
fn envoys_replies_that_never_reached_the_upstream_release_and_timeouts_mark_unknown() {
    for (details, path) in [
        ("direct_response", RELEASE_PATH),
        ("local_rate_limited", RELEASE_PATH),
        ("upstream_reset_before_response_started{overflow}", RELEASE_PATH),
        ("response_timeout", MARK_UNKNOWN_PATH),
    ] {
        let mut ex = owned("/pay");
        let head = response_head(vec![(":status".into(), b"200".to_vec())], details, true);
        assert_eq!(called_path(&ex.response_headers(head)), path, "{details}");
    }
}

#[test]
fn every_store_failure_shape_fails_closed_with_503() {
    let answers: [StoreAnswer; 3] = [
        None,
        Some((503, b"no healthy upstream".to_vec())),
        Some((200, b"garbage".to_vec())),
    ];
    for answer in answers {
        let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
        let (abandon, next) = abandoning(ex.store_reply(answer));
        assert_eq!(problem_slug(&next), (503, "store-unavailable".into()));
        assert_eq!(abandon.attempt, attempt());
        assert_eq!(abandon.scope.key().as_str(), "k");
        assert_eq!(ex.handling(), Handling::StoreError);
        assert_eq!(ex.settlement(), Some(Settlement::Abandoned));
    }
}

#[test]
fn a_claim_names_its_attempt_and_the_deadline_of_its_caller() {
    let (_, step) = begin("/pay", Some("k"), Some("{}"));
    let claim = claim_of(&step);
    assert_eq!(claim.attempt, Some(attempt()));
    let Step::Call(call) = &step else { unreachable!() };
    assert_eq!(call.traces.len(), 1);
    assert_eq!(call.traces[0].request_id.as_deref(), Some("r-1"));
    assert_eq!(claim.deadline_ms, call.timeout_ms);
    // A waiting claim's caller waits longer.
    let (_, step) = begin("/small", Some("k"), Some("{}"));
    assert_eq!(claim_of(&step).deadline_ms, 1_000 + 300);
}

#[test]
fn a_client_gone_while_the_claim_is_in_flight_abandons_it() {
    let (mut ex, _) = begin("/pay", Some("k"), Some("{}"));
    let call = ex.finish().unwrap();
    assert_eq!(call.path, ABANDON_PATH);
    let abandon = decode_frame::<AbandonRequest>(&call.body).unwrap().0;
    assert_eq!(abandon.attempt, attempt());
    // Its log lines name the request it served, as the claim's did.
    assert_eq!(call.traces[0].request_id.as_deref(), Some("r-1"));
    assert_eq!(ex.settlement(), Some(Settlement::Abandoned));
    assert_eq!(ex.finish(), None);
}

#[test]
fn fail_open_abandons_the_claim_and_forwards_without_dedupe() {
    let (mut ex, _) = begin("/open", Some("k"), Some("{}"));
    let (_, next) = abandoning(ex.store_reply(None));
    assert_eq!(next, Step::Continue);
    assert_eq!(ex.handling(), Handling::FailOpen);
    assert!(!ex.owns_response());
}

#[test]
fn observe_mode_never_answers_on_its_own_and_says_why() {
    let (ex, step) = begin("/watch", None, None);
    assert_eq!(step, Step::Continue);
    assert_eq!(
        (ex.handling(), ex.reason()),
        (Handling::WouldReject, Some(Handling::Missing))
    );
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    assert_eq!(ex.store_reply(reply(ClaimReply::Mismatch, b"")), Step::Continue);
    assert_eq!(
        (ex.handling(), ex.reason()),
        (Handling::WouldReject, Some(Handling::Mismatch))
    );
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    assert_eq!(ex.store_reply(reply(ClaimReply::Unknown, b"")), Step::Continue);
    assert_eq!(
        (ex.handling(), ex.reason()),
        (Handling::WouldConflict, Some(Handling::Unknown))
    );
    // A store that fails is a store error in observe mode too, whatever
    // `failure_mode` says: the request goes on.
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    let (_, step) = abandoning(ex.store_reply(None));
    assert_eq!(step, Step::Continue);
    assert_eq!((ex.handling(), ex.reason()), (Handling::StoreError, None));
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    let replay = ClaimReply::Replay {
        status: 200,
        headers: vec![],
        completed_at: 1,
    };
    assert_eq!(ex.store_reply(reply(replay, b"")), Step::Continue);
    assert_eq!(ex.handling(), Handling::WouldReplay);
    let (mut ex, _) = begin("/watch", Some("k"), Some("{}"));
    assert_eq!(
        ex.store_reply(reply(ClaimReply::InProgress { retry_after_ms: 5 }, b"")),
        Step::Continue
    );
    assert_eq!(ex.handling(), Handling::WouldConflict);
}

#[test]
fn an_owned_response_is_held_captured_and_completed() {
    let mut ex = owned("/pay");
    let head = upstream(
        201,
        &[
            ("content-type", "application/json"),
            ("set-cookie", "x"),
            ("Location", "/p/1"),
        ],
        false,
    );
    assert_eq!(ex.response_headers(head), Step::Pause);
    assert_eq!(ex.response_body(b"{\"id\"", false), Step::Pause);
    let step = ex.response_body(b":1}", true);
    let Step::Call(call) = &step else {
        panic!("{step:?}")
    };
    let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!(done.fence, 7);
    assert_eq!(done.status, 201);
    assert!(done.body_stored);
    assert_eq!(
        done.headers,
        vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/p/1".into())
        ]
    );
    assert_eq!(body, b"{\"id\":1}");
    assert_eq!(
        ex.store_reply(Some((200, b"{\"outcome\":\"done\"}\n".to_vec()))),
        Step::Continue
    );
    assert_eq!(ex.settlement(), Some(Settlement::Completed));
    assert_eq!(ex.finish(), None);
}

#[test]
fn a_response_too_large_to_keep_streams_and_completes_without_body() {
    let mut ex = owned("/small");
    assert_eq!(ex.response_headers(upstream(200, &[], false)), Step::Pause);
    assert_eq!(ex.response_body(b"abc", false), Step::Pause);
    // The chunk that outgrows the limit goes on at once; the outcome is
    // handed to the worker's store client, so nothing waits in Envoy's
    // buffer for the store.
    let step = ex.response_body(b"defg", false);
    let Step::Deliver(call, next) = &step else {
        panic!("{step:?}")
    };
    assert_eq!(**next, Step::Continue);
    let (done, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert!(!done.body_stored);
    assert!(body.is_empty());
    assert_eq!(ex.response_body(b"h", false), Step::Continue);
    assert_eq!(ex.response_body(b"i", true), Step::Continue);
    assert_eq!(ex.settlement(), Some(Settlement::Completed));
    assert_eq!(ex.finish(), None);
}

#[test]
fn a_response_announced_too_large_is_completed_at_its_headers() {
    let mut ex = owned("/small");
    let head = ResponseHead {
        content_length: Some(5),
        ..upstream(201, &[], false)
    };
    // Small enough for Envoy's buffer: held until the store has it, so no
    // retry overtakes the record.
    let step = ex.response_headers(head);
    let Step::Call(call) = &step else {
        panic!("{step:?}")
    };
    let (done, _) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!((done.status, done.body_stored), (201, false));
    // Larger than Envoy's buffer: it streams on while the outcome is delivered.
    let mut ex = owned("/small");
    let head = ResponseHead {
        content_length: Some(ENVOY_DEFAULT_BUFFER_LIMIT as u64 + 1),
        ..upstream(201, &[], false)
    };
    let step = ex.response_headers(head);
    let Step::Deliver(call, next) = &step else {
        panic!("{step:?}")
    };
    assert_eq!(**next, Step::Continue);
    assert!(!decode_frame::<CompleteRequest>(&call.body).unwrap().0.body_stored);
}

#[test]
fn refusals_and_upstream_control_release_or_mark_unknown() {
    let cases: [(ResponseHead, &str); 6] = [
        (upstream(429, &[], false), RELEASE_PATH),
        (upstream(408, &[], false), RELEASE_PATH),
        (
            upstream(200, &[("idempotency-control", "no-store")], false),
            RELEASE_PATH,
        ),
        (
            upstream(200, &[("Idempotency-Control", " Uncertain ")], false),
            MARK_UNKNOWN_PATH,
        ),
        (
            ResponseHead {
                origin: Origin::NeverReached,
                ..upstream(503, &[], false)
            },
            RELEASE_PATH,
        ),
        (
            ResponseHead {
                origin: Origin::LostAfterForwarding,
                ..upstream(504, &[], false)
            },
            MARK_UNKNOWN_PATH,
        ),
    ];
    for (head, path) in cases {
        let mut ex = owned("/pay");
        let step = ex.response_headers(head);
        assert_eq!(called_path(&step), path);
        assert_eq!(ex.response_body(b"late", true), Step::Pause);
        let Step::Call(call) = step else { unreachable!() };
        assert_eq!(decode_frame::<FenceRequest>(&call.body).unwrap().0.fence, 7);
    }
}

#[test]
fn a_stream_that_ends_before_the_response_came_back_marks_the_record_unknown() {
    let mut ex = owned("/pay");
    let call = ex.finish().unwrap();
    assert_eq!(call.path, MARK_UNKNOWN_PATH);
    let mut ex = owned("/pay");
    ex.response_headers(upstream(200, &[], false));
    assert!(ex.finish().is_some());
}

#[test]
fn a_refused_completion_is_reported_as_failed() {
    let mut ex = owned("/pay");
    ex.response_headers(upstream(200, &[], true));
    assert_eq!(
        ex.store_reply(Some((409, b"{\"outcome\":\"stale\"}\n".to_vec()))),
        Step::Continue
    );
    assert_eq!(ex.settlement(), Some(Settlement::Failed));
}

#[test]
fn a_refused_completion_is_also_a_refusal_to_report() {
    let mut ex = owned("/pay");
    ex.response_headers(upstream(201, &[], true));
    let refused = store_problem(ProblemKind::BadRequest, "status must be between 100 and 599");
    assert_eq!(ex.store_reply(refused), Step::Continue);
    assert_eq!(ex.settlement(), Some(Settlement::Failed));
    assert_eq!(
        ex.take_store_refusal(),
        Some((400, "status must be between 100 and 599".to_string()))
    );
}

/// A detached exchange that owns its key and has sent the upstream request.
fn forwarded() -> Exchange {
    let (mut ex, step) = begin("/detached", Some("k1"), Some("{}"));
    claim_of(&step);
    let Step::Forward(call) = ex.store_reply(reply(ClaimReply::Owned { fence: 7 }, b"")) else {
        panic!("expected the upstream request")
    };
    assert_eq!(call.cluster, "route");
    // Hop-by-hop headers stay behind; the rest goes as received.
    assert_eq!(
        call.headers,
        vec![
            (":path".to_string(), "/detached".to_string()),
            ("x-trace".to_string(), "t1".to_string()),
            ("x-request-id".to_string(), "r-1".to_string())
        ]
    );
    assert!(ex.outlives_client());
    ex
}

fn answer(status: &str, extra: &[(&str, &str)], body_size: usize) -> UpstreamAnswer {
    let mut headers = vec![(":status".to_string(), status.as_bytes().to_vec())];
    headers.extend(extra.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
    UpstreamAnswer::Response { headers, body_size }
}

const MARK: (&str, &str) = ("x-envoy-upstream-service-time", "3");
const DONE: &[u8] = b"{\"outcome\":\"done\"}\n";
const STALE: &[u8] = b"{\"outcome\":\"stale\"}\n";

#[test]
fn a_detached_answer_is_completed_then_relayed_whole() {
    let mut ex = forwarded();
    let step = ex.upstream_reply(
        answer(
            "201",
            &[
                MARK,
                ("set-cookie", "s=1"),
                ("content-length", "6"),
                ("content-type", "a/b"),
            ],
            6,
        ),
        || b"{\"a\":1}".to_vec(),
    );
    let Step::Call(call) = step else {
        panic!("{step:?}")
    };
    assert_eq!(call.path, COMPLETE_PATH);
    let (complete, body) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!(
        (complete.status, complete.body_stored, body),
        (201, true, &b"{\"a\":1}"[..])
    );
    // The record keeps what a replay carries; the client gets all but framing.
    assert_eq!(
        complete.headers,
        vec![("content-type".to_string(), "a/b".to_string())]
    );
    assert!(ex.outlives_client());
    let Step::Respond(relay) = ex.store_reply(Some((200, DONE.to_vec()))) else {
        panic!("expected the relay")
    };
    assert_eq!((relay.status, relay.body.as_slice()), (201, &b"{\"a\":1}"[..]));
    let names: Vec<&str> = relay.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["x-envoy-upstream-service-time", "set-cookie", "content-type"]
    );
    assert_eq!(ex.settlement(), Some(Settlement::Completed));
    assert!(!ex.outlives_client());
}

#[test]
fn a_detached_completion_the_store_did_not_take_goes_to_the_store_client() {
    for unanswered in [None, Some((503, vec![]))] {
        let mut ex = forwarded();
        let Step::Call(call) = ex.upstream_reply(answer("201", &[MARK], 2), || b"ok".to_vec()) else {
            panic!("expected the completion")
        };
        let Step::Deliver(again, next) = ex.store_reply(unanswered) else {
            panic!("expected the completion handed on")
        };
        assert_eq!(again, call);
        assert!(matches!(*next, Step::Respond(ref r) if r.status == 201));
        // Counted by the store client once the store confirms it.
        assert_eq!(ex.settlement(), Some(Settlement::Completed));
    }
    // A store that decided (stale fence, refused frame) is not asked again.
    for decided in [
        Some((409, b"{\"outcome\":\"stale\"}\n".to_vec())),
        store_problem(ProblemKind::BadRequest, "a header name is not a token"),
    ] {
        let mut ex = forwarded();
        ex.upstream_reply(answer("201", &[MARK], 2), || b"ok".to_vec());
        assert!(matches!(ex.store_reply(decided), Step::Respond(ref r) if r.status == 201));
        assert_eq!(ex.settlement(), Some(Settlement::Failed));
    }
}

#[test]
fn envoys_own_answers_to_a_detached_request_are_classified() {
    // No healthy host: never reached, released, relayed as Envoy wrote it.
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("503", &[], 19), || b"no healthy upstream".to_vec());
    assert_eq!(called_path(&step), RELEASE_PATH);
    assert!(matches!(ex.store_reply(Some((200, DONE.to_vec()))), Step::Respond(ref r) if r.status == 503));
    assert_eq!(ex.settlement(), Some(Settlement::Released));
    // A timeout: the upstream may have acted.
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("504", &[], 24), || b"upstream request timeout".to_vec());
    assert_eq!(called_path(&step), MARK_UNKNOWN_PATH);
    // The upstream's own 503 is its answer.
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("503", &[MARK], 19), || b"no healthy upstream".to_vec());
    assert_eq!(called_path(&step), COMPLETE_PATH);
    // Envoy refused to send it: released, answered like Envoy's router would.
    let mut ex = forwarded();
    let step = ex.upstream_reply(UpstreamAnswer::Refused, Vec::new);
    assert_eq!(called_path(&step), RELEASE_PATH);
    assert!(matches!(ex.store_reply(Some((200, DONE.to_vec()))), Step::Respond(ref r) if r.status == 503));
    // Reset after the response started: unknown, and the client is told so.
    let mut ex = forwarded();
    let step = ex.upstream_reply(UpstreamAnswer::Lost, Vec::new);
    assert_eq!(called_path(&step), MARK_UNKNOWN_PATH);
    assert_eq!(
        problem_slug(&ex.store_reply(Some((200, DONE.to_vec())))),
        (409, "outcome-unknown".into())
    );
}

#[test]
fn a_detached_answer_over_the_relay_limit_is_recorded_without_being_read() {
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("201", &[MARK], 17), || panic!("the body must not be read"));
    let Step::Call(call) = step else {
        panic!("{step:?}")
    };
    let (complete, _) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!((complete.status, complete.body_stored), (201, false));
    let step = ex.store_reply(Some((200, DONE.to_vec())));
    assert_eq!(problem_slug(&step), (409, "result-unavailable".into()));
    let Step::Respond(r) = step else { unreachable!() };
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["original_status"], 201);
}

#[test]
fn a_detached_answer_too_large_to_keep_still_reaches_the_client() {
    let mut ex = forwarded();
    let body = b"0123456789".to_vec();
    let step = ex.upstream_reply(answer("201", &[MARK], body.len()), || body.clone());
    let Step::Call(call) = step else {
        panic!("{step:?}")
    };
    let (complete, _) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert!(!complete.body_stored);
    assert!(matches!(ex.store_reply(Some((200, DONE.to_vec()))), Step::Respond(ref r) if r.body == body));
}

#[test]
fn a_settlement_the_store_did_not_decide_is_delivered_in_every_mode() {
    for path in ["/pay", "/background"] {
        let mut ex = owned(path);
        let call = match ex.response_headers(upstream(201, &[], true)) {
            Step::Call(call) => {
                assert!(ex.outlives_client(), "the completion outlives its client");
                for lost in [None, Some((503, Vec::new()))] {
                    let mut again = owned(path);
                    again.response_headers(upstream(201, &[], true));
                    let Step::Deliver(redelivered, next) = again.store_reply(lost) else {
                        panic!("{path}: not delivered")
                    };
                    assert_eq!((&redelivered, *next), (&call, Step::Continue));
                    assert_eq!(again.settlement(), Some(Settlement::Completed));
                }
                call
            }
            Step::Deliver(call, _) => call,
            step => panic!("{path}: {step:?}"),
        };
        assert_eq!(call.path, COMPLETE_PATH);
    }
    // A stale fence is the store's decision: nothing to deliver again.
    let mut ex = owned("/pay");
    ex.response_headers(upstream(201, &[], true));
    assert_eq!(ex.store_reply(Some((409, STALE.to_vec()))), Step::Continue);
    assert_eq!(ex.settlement(), Some(Settlement::Failed));
    // With the client gone mid-request, a detached exchange is marked unknown
    // only when nobody can take it over.
    let mut ex = forwarded();
    assert_eq!(ex.finish().map(|c| c.path), Some(MARK_UNKNOWN_PATH));
}

#[test]
fn a_settlement_answered_by_something_in_front_of_the_store_is_delivered_again() {
    let envoy = crate::problem::envoy_reply(413, "Payload Too Large", "request body too large");
    for answer in [
        Some((429, b"local_rate_limited".to_vec())),
        Some((408, Vec::new())),
        Some((413, envoy.body)),
    ] {
        let mut ex = owned("/pay");
        let Step::Call(call) = ex.response_headers(upstream(201, &[], true)) else {
            panic!("expected the completion")
        };
        let Step::Deliver(again, next) = ex.store_reply(answer.clone()) else {
            panic!("{answer:?}: not delivered again")
        };
        assert_eq!((again, *next), (call, Step::Continue));
        assert_eq!(ex.settlement(), Some(Settlement::Completed));
        assert_eq!(
            ex.take_store_refusal(),
            None,
            "{answer:?} is not the store's refusal"
        );
    }
}

#[test]
fn with_settle_background_the_response_goes_on_while_the_store_client_records_it() {
    let mut ex = owned("/background");
    let Step::Deliver(call, next) = ex.response_headers(upstream(201, &[], true)) else {
        panic!("expected the completion handed to the store client")
    };
    assert_eq!((call.path, *next), (COMPLETE_PATH, Step::Continue));
    assert_eq!(ex.settlement(), Some(Settlement::Completed));
    assert!(!ex.owns_response());
    // A release goes the same way.
    let mut ex = owned("/background");
    let Step::Deliver(call, _) = ex.response_headers(upstream(429, &[], true)) else {
        panic!("expected the release handed to the store client")
    };
    assert_eq!(call.path, RELEASE_PATH);
}

/// The relayed answer once the store confirmed the settling call.
fn relayed_after(ex: &mut Exchange, step: Step) -> (Step, Reply) {
    assert!(matches!(step, Step::Call(_)), "{step:?}");
    match ex.store_reply(Some((200, DONE.to_vec()))) {
        Step::Respond(reply) => (Step::Respond(reply.clone()), reply),
        step => panic!("{step:?}"),
    }
}

#[test]
fn envoys_own_replies_on_a_detached_route_are_problems_that_are_never_cached() {
    // Envoy refused to send the call: nothing ran, and the answer says no more.
    let mut ex = forwarded();
    let step = ex.upstream_reply(UpstreamAnswer::Refused, Vec::new);
    let (relayed, reply) = relayed_after(&mut ex, step);
    assert_eq!(reply.status, 503);
    assert_eq!(header(&relayed, "content-type"), Some("application/problem+json"));
    assert_eq!(header(&relayed, "cache-control"), Some("no-store"));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["type"], "about:blank");
    assert!(!String::from_utf8_lossy(&reply.body).contains("no healthy upstream"));
    // Envoy's own timeout: unknown, answered like a local reply of the router.
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("504", &[], 24), || b"upstream request timeout".to_vec());
    let (relayed, reply) = relayed_after(&mut ex, step);
    assert_eq!(reply.status, 504);
    assert_eq!(header(&relayed, "cache-control"), Some("no-store"));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(
        (body["type"].as_str(), body["title"].as_str()),
        (Some("about:blank"), Some("upstream request timeout"))
    );
    assert_eq!(header(&relayed, KEY_HEADER), Some("\"k1\""));
}

#[test]
fn a_refusal_too_large_to_relay_is_not_called_executed() {
    let mut ex = forwarded();
    let step = ex.upstream_reply(answer("422", &[MARK], 17), || panic!("the body must not be read"));
    assert_eq!(called_path(&step), RELEASE_PATH);
    let (_, reply) = relayed_after(&mut ex, step);
    assert_eq!(reply.status, 422);
    let text = String::from_utf8_lossy(&reply.body);
    assert!(!text.contains("was executed"), "{text}");
    assert!(text.contains("retry with the same key"), "{text}");
}

/// The configuration's limits and the store's are one: a policy at every
/// limit makes claims the store accepts, and one past any limit is refused
/// when the configuration is loaded.
#[test]
fn a_policy_at_every_limit_makes_claims_the_store_accepts() {
    let config = |lease: u64, ttl: u64, wait: u64| {
        let timeout = limits::MAX_DEADLINE_MS - limits::MAX_WAIT_MS;
        let json = format!(
            r#"{{"store": {{"cluster": "s", "token": "t", "timeout_ms": {timeout}}}, "policies": [{{"name": "max",
            "match": {{"path": {{"prefix": "/max"}}}}, "anonymous": true, "lease_seconds": {lease},
            "ttl_seconds": {ttl}, "in_flight": "wait", "wait_max_ms": {wait}}}]}}"#
        );
        Config::parse(json.as_bytes()).map(Rc::new)
    };
    let (lease, ttl, wait) = (
        limits::MAX_LEASE_MS / 1000,
        limits::MAX_TTL_MS / 1000,
        limits::MAX_WAIT_MS,
    );
    let at_limits = config(lease, ttl, wait).unwrap();
    let policy = at_limits.policy_for("POST", "h", "/max").unwrap().clone();
    let head = RequestHead {
        method: "POST".into(),
        path: "/max".into(),
        key_fields: vec![b"k".to_vec()],
        end_of_stream: true,
        ..RequestHead::default()
    };
    let (_, step) = Exchange::begin(at_limits, policy, head, attempt());
    let claim = claim_of(&step);
    assert_eq!(claim.check(), Ok(()));
    assert_eq!(
        (claim.lease_ms, claim.ttl_ms, claim.wait_ms, claim.deadline_ms),
        (
            limits::MAX_LEASE_MS,
            limits::MAX_TTL_MS,
            limits::MAX_WAIT_MS,
            limits::MAX_DEADLINE_MS
        )
    );
    for (lease, ttl, wait) in [
        (lease + 1, ttl, wait),
        (lease, ttl + 1, wait),
        (lease, ttl, wait + 1),
    ] {
        assert!(config(lease, ttl, wait).is_err(), "{lease} {ttl} {wait}");
    }
}
