//! The exchange on gRPC calls (compiled only for tests).
#![cfg(test)]

use super::super::*;
use crate::grpc::{self, code};
use crate::protocol::{decode_frame, ClaimReply, ReplayRequest, REPLAY_PATH};
use crate::protocol::{CompleteRequest, COMPLETE_PATH};

const CONFIG: &str = r#"{
    "store": {"cluster": "store", "token": "t"},
    "policies": [
        {"name": "ledger", "match": {"path": {"exact": "/ledger.v1.Ledger/Transfer"}},
         "anonymous": true, "grpc": {"release_codes": [5]}, "replay_headers": ["x-ledger"]}
    ]}"#;

const METHOD: &str = "/ledger.v1.Ledger/Transfer";

fn fields(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn message(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn begin(key: Option<&str>) -> (Exchange, Step) {
    let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap());
    let policy = config.policy_for("POST", "h", METHOD).unwrap().clone();
    let head = RequestHead {
        method: "POST".into(),
        path: METHOD.into(),
        key_fields: key.map(|k| vec![k.as_bytes().to_vec()]).unwrap_or_default(),
        ..RequestHead::default()
    };
    let attempt = Attempt::try_from("attempt-1".to_string()).unwrap();
    let (mut ex, step) = Exchange::begin(config, policy, head, attempt);
    if step != Step::Pause {
        return (ex, step);
    }
    let step = ex.request_body(&message(b"\x08\x01"), true);
    (ex, step)
}

fn answered(ex: &mut Exchange, reply: ClaimReply, body: &[u8]) -> Step {
    ex.store_reply(Some((200, encode_frame(&reply, body))))
}

fn owned() -> Exchange {
    let (mut ex, _) = begin(Some("k1"));
    assert_eq!(
        answered(&mut ex, ClaimReply::Owned { fence: 7 }, b""),
        Step::Continue
    );
    ex
}

fn response(ex: &mut Exchange, headers: &[(&str, &str)], end_of_stream: bool) -> Step {
    ex.response_headers(ResponseHead {
        status: 200,
        origin: Origin::Upstream,
        headers: fields(headers),
        content_length: None,
        end_of_stream,
    })
}

/// The status of a trailers-only answer of the filter's own.
fn status_of(step: &Step) -> u8 {
    let Step::Respond(reply) = step else {
        panic!("expected an answer, got {step:?}")
    };
    let status = reply.headers.iter().find(|(n, _)| n == "grpc-status").unwrap();
    assert!(reply.body.is_empty());
    status.1.parse().unwrap()
}

fn settled_on(step: &Step) -> &'static str {
    let Step::Call(call) = step else {
        panic!("expected a store call, got {step:?}")
    };
    call.path
}

#[test]
fn the_filters_own_answers_are_grpc_statuses() {
    let (_, step) = begin(None);
    assert_eq!(status_of(&step), code::INVALID_ARGUMENT, "key missing");
    let (mut ex, _) = begin(Some("k1"));
    let step = answered(&mut ex, ClaimReply::InProgress { retry_after_ms: 700 }, b"");
    assert_eq!(status_of(&step), code::ABORTED);
    let (mut ex, _) = begin(Some("k1"));
    assert_eq!(
        status_of(&answered(&mut ex, ClaimReply::Mismatch, b"")),
        code::FAILED_PRECONDITION
    );
    let (mut ex, _) = begin(Some("k1"));
    assert_eq!(
        status_of(&answered(&mut ex, ClaimReply::Unknown, b"")),
        code::UNKNOWN
    );
    let (mut ex, _) = begin(Some("k1"));
    let Step::Deliver(_, then) = ex.store_reply(None) else {
        panic!("a claim without an answer is abandoned")
    };
    assert_eq!(status_of(&then), code::UNAVAILABLE);
}

#[test]
fn a_response_with_messages_is_stored_with_its_trailers() {
    let mut ex = owned();
    let headers = [
        ("content-type", "application/grpc"),
        ("x-ledger", "L1"),
        ("x-other", "o"),
    ];
    assert_eq!(response(&mut ex, &headers, false), Step::Pause);
    let body = message(b"\x0a\x02ok");
    assert_eq!(ex.response_body(&body, false), Step::Pause);
    let step = ex.response_trailers(&fields(&[
        ("grpc-status", "0"),
        ("grpc-message", ""),
        ("x-t", "t"),
    ]));
    let Step::Call(call) = &step else {
        panic!("expected the completion, got {step:?}")
    };
    assert_eq!(call.path, COMPLETE_PATH);
    let (request, stored) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert!(request.body_stored);
    assert_eq!(
        request.headers,
        vec![
            ("content-type".into(), "application/grpc".into()),
            ("x-ledger".into(), "L1".into())
        ]
    );
    let (messages, trailers) = grpc::split_trailers(stored).unwrap();
    assert_eq!(messages, body.as_slice());
    assert_eq!(
        trailers,
        vec![
            ("grpc-status".into(), "0".into()),
            ("grpc-message".into(), String::new())
        ],
        "unlisted trailing metadata is not kept"
    );
}

#[test]
fn compressed_messages_are_stored_and_replayed_with_their_encoding() {
    let mut ex = owned();
    let headers = [
        ("content-type", "application/grpc"),
        ("grpc-encoding", "gzip"),
        ("grpc-accept-encoding", "identity, gzip"),
    ];
    assert_eq!(response(&mut ex, &headers, false), Step::Pause);
    // A message with its compressed flag set; its bytes are never read.
    let mut body = message(b"\x1f\x8b\x08\x00");
    body[0] = 1;
    assert_eq!(ex.response_body(&body, false), Step::Pause);
    let step = ex.response_trailers(&fields(&[("grpc-status", "0")]));
    let Step::Call(call) = &step else {
        panic!("expected the completion, got {step:?}")
    };
    let (request, stored) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    let kept = vec![
        ("content-type".to_string(), "application/grpc".to_string()),
        ("grpc-encoding".to_string(), "gzip".to_string()),
    ];
    assert_eq!(request.headers, kept);

    let (mut ex, _) = begin(Some("k1"));
    let reply = ClaimReply::Replay {
        status: 200,
        headers: kept.clone(),
        completed_at: 1,
    };
    let Step::Reroute(call) = answered(&mut ex, reply, stored) else {
        panic!("expected a reroute")
    };
    let (request, messages) = decode_frame::<ReplayRequest>(&call.body).unwrap();
    assert_eq!(messages, body.as_slice());
    assert!(request.headers.starts_with(&kept), "{:?}", request.headers);
}

#[test]
fn a_trailers_only_error_the_server_acted_on_is_stored() {
    let mut ex = owned();
    let head = [
        ("content-type", "application/grpc"),
        ("grpc-status", "6"),
        ("x-ledger", "L"),
    ];
    let step = response(&mut ex, &head, true);
    assert_eq!(settled_on(&step), COMPLETE_PATH);
    let Step::Call(call) = &step else {
        panic!("expected the completion, got {step:?}")
    };
    let (request, stored) = decode_frame::<CompleteRequest>(&call.body).unwrap();
    assert_eq!(
        request.headers,
        vec![
            ("content-type".into(), "application/grpc".into()),
            ("x-ledger".into(), "L".into())
        ]
    );
    let (messages, trailers) = grpc::split_trailers(stored).unwrap();
    assert!(messages.is_empty());
    assert_eq!(
        trailers,
        vec![
            ("grpc-status".into(), "6".into()),
            ("x-ledger".into(), "L".into())
        ],
        "the status, and listed metadata; content-type stays a header"
    );
}

#[test]
fn refused_before_acting_releases_the_key() {
    for status in ["3", "16", "5"] {
        let mut ex = owned();
        let step = response(&mut ex, &[("grpc-status", status)], true);
        assert_eq!(
            settled_on(&step),
            RELEASE_PATH,
            "code {status} (5 is the policy's)"
        );
    }
    let mut ex = owned();
    assert_eq!(response(&mut ex, &[], false), Step::Pause);
    let step = ex.response_trailers(&fields(&[("grpc-status", "9")]));
    assert_eq!(settled_on(&step), RELEASE_PATH);
}

#[test]
fn a_deadline_cancellation_or_missing_status_is_unknown() {
    for status in ["1", "4"] {
        let mut ex = owned();
        response(&mut ex, &[], false);
        let step = ex.response_trailers(&fields(&[("grpc-status", status)]));
        assert_eq!(settled_on(&step), MARK_UNKNOWN_PATH, "code {status}");
    }
    let mut ex = owned();
    response(&mut ex, &[], false);
    assert_eq!(
        settled_on(&ex.response_body(&message(b""), true)),
        MARK_UNKNOWN_PATH
    );
}

#[test]
fn idempotency_control_in_the_trailers_decides() {
    let mut ex = owned();
    response(&mut ex, &[], false);
    let step = ex.response_trailers(&fields(&[("grpc-status", "3"), ("idempotency-control", "store")]));
    assert_eq!(settled_on(&step), COMPLETE_PATH);
    let mut ex = owned();
    response(&mut ex, &[("idempotency-control", "store")], false);
    let step = ex.response_trailers(&fields(&[("grpc-status", "3")]));
    assert_eq!(settled_on(&step), COMPLETE_PATH, "the headers said so");
    let mut ex = owned();
    response(&mut ex, &[("idempotency-control", "store")], false);
    let step = ex.response_trailers(&fields(&[
        ("grpc-status", "0"),
        ("idempotency-control", "uncertain"),
    ]));
    assert_eq!(
        settled_on(&step),
        MARK_UNKNOWN_PATH,
        "the safest of headers and trailers wins"
    );
}

#[test]
fn a_replay_goes_to_the_stores_replay_route() {
    let (mut ex, _) = begin(Some("k1"));
    let mut stored = message(b"\x0a\x02ok");
    grpc::append_trailers(&mut stored, &[("grpc-status".into(), "0".into())]);
    let headers = vec![("content-type".to_string(), "application/grpc".to_string())];
    let reply = ClaimReply::Replay {
        status: 200,
        headers: headers.clone(),
        completed_at: 1,
    };
    let step = answered(&mut ex, reply, &stored);
    let Step::Reroute(call) = &step else {
        panic!("expected a reroute, got {step:?}")
    };
    assert_eq!(call.path, REPLAY_PATH);
    let (request, messages) = decode_frame::<ReplayRequest>(&call.body).unwrap();
    assert_eq!(messages, message(b"\x0a\x02ok").as_slice());
    assert_eq!(request.trailers, vec![("grpc-status".into(), "0".into())]);
    assert!(request
        .headers
        .contains(&("idempotent-replayed".to_string(), "true".to_string())));
    assert_eq!(ex.handling(), Handling::Replayed);
    // Our own rerouted request's response is not the upstream's.
    assert!(!ex.owns_response());
}

#[test]
fn a_stored_body_that_is_not_grpc_is_not_replayed() {
    let (mut ex, _) = begin(Some("k1"));
    let reply = ClaimReply::Replay {
        status: 200,
        headers: Vec::new(),
        completed_at: 1,
    };
    let step = answered(&mut ex, reply, b"{}");
    assert_eq!(status_of(&step), code::ALREADY_EXISTS);
}

#[test]
fn grpc_policies_refuse_what_cannot_work() {
    let policy = |extra: &str| {
        format!(
            r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "g",
            "match": {{"path": {{"exact": "/g.S/M"}}}}, "anonymous": true, "grpc": {{}}{extra}}}]}}"#
        )
    };
    assert!(Config::parse(policy("").as_bytes()).is_ok());
    assert!(Config::parse(policy(r#", "fingerprint": {"headers": ["x-a"]}"#).as_bytes()).is_ok());
    for (extra, field) in [
        (r#", "fingerprint": {"mode": "json"}"#, "fingerprint.mode"),
        (r#", "release_statuses": [404]"#, "release_statuses"),
        (r#", "forwarding": {"mode": "detached"}"#, "forwarding"),
    ] {
        let e = Config::parse(policy(extra).as_bytes()).unwrap_err().to_string();
        assert!(e.contains(field), "{extra}: {e}");
    }
    let prefix = policy("").replace(r#"{"exact": "/g.S/M"}"#, r#"{"prefix": "/g.S/"}"#);
    let e = Config::parse(prefix.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("match.path") && e.contains("streaming"), "{e}");
    let codes = |list: &str| {
        policy("").replace(
            r#""grpc": {}"#,
            &format!(r#""grpc": {{"release_codes": {list}}}"#),
        )
    };
    for bad in ["[0]", "[17]"] {
        let e = Config::parse(codes(bad).as_bytes()).unwrap_err().to_string();
        assert!(e.contains("grpc.release_codes"), "{bad}: {e}");
    }
}
