//! A kept body is written straight into the complete call's frame, behind
//! its metadata: the frame is byte for byte the one the owned completion
//! writes, however the body arrives (compiled only for tests).
#![cfg(test)]

use super::*;
use crate::scope::Scope;
use crate::trace::Trace;

/// An exchange that owns its key on `path`, and the scope of its record.
fn owned_at(path: &str) -> (Exchange, Scope) {
    let (mut ex, step) = begin(path, Some("k1"), Some("{}"));
    let scope = claim_of(&step).scope;
    assert_eq!(
        ex.store_reply(reply(ClaimReply::Owned { fence: 7 }, b"")),
        Step::Continue
    );
    (ex, scope)
}

fn completion(step: &Step) -> &[u8] {
    match step {
        Step::Call(call) | Step::Deliver(call, _) => {
            assert_eq!(call.path, COMPLETE_PATH);
            &call.body
        }
        other => panic!("expected a completion, got {other:?}"),
    }
}

/// The frame of the owned completion: with `body`, or `None` for one not kept.
fn owned_completion(scope: Scope, status: u16, headers: &[(&str, &str)], body: Option<&[u8]>) -> Vec<u8> {
    let request = CompleteRequest {
        scope,
        fence: 7,
        status,
        headers: headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        body_stored: body.is_some(),
        trace: Trace::NONE,
    };
    encode_frame(&request, body.unwrap_or_default())
}

/// Feeds `body` cut at `cuts`; every chunk but the last is held.
fn feed(ex: &mut Exchange, body: &[u8], cuts: &[usize]) -> Step {
    let mut from = 0;
    for &to in cuts {
        assert_eq!(ex.response_body(&body[from..to], false), Step::Pause);
        from = to;
    }
    ex.response_body(&body[from..], true)
}

#[test]
fn a_kept_body_is_the_frame_the_owned_completion_writes_however_it_arrives() {
    let body = br#"{"id":"p_1","amount":1000,"note":"\u00e9\n"}"#;
    let every_byte: Vec<usize> = (1..body.len()).collect();
    let cuts: [&[usize]; 4] = [&[], &[1], &[5, 17], &every_byte];
    let headers = [("content-type", "application/json"), ("location", "/p/1")];
    // Announced exactly, not at all, or short of the body that came.
    for announced in [Some(body.len() as u64), None, Some(3)] {
        for cuts in cuts {
            let (mut ex, scope) = owned_at("/pay");
            let head = ResponseHead {
                content_length: announced,
                ..upstream(201, &[headers[0], ("set-cookie", "x"), headers[1]], false)
            };
            assert_eq!(ex.response_headers(head), Step::Pause);
            let step = feed(&mut ex, body, cuts);
            assert_eq!(
                completion(&step),
                owned_completion(scope, 201, &headers, Some(body)),
                "announced {announced:?}, cut at {cuts:?}"
            );
        }
    }
    // No body at all: complete at the headers.
    let (mut ex, scope) = owned_at("/pay");
    let step = ex.response_headers(upstream(204, &[], true));
    assert_eq!(completion(&step), owned_completion(scope, 204, &[], Some(b"")));
}

#[test]
fn a_body_at_the_cap_is_kept_and_one_past_it_is_not() {
    // `/small` keeps at most 4 bytes.
    let (mut ex, scope) = owned_at("/small");
    assert_eq!(ex.response_headers(upstream(200, &[], false)), Step::Pause);
    let step = feed(&mut ex, b"abcd", &[2]);
    assert_eq!(
        completion(&step),
        owned_completion(scope, 200, &[], Some(b"abcd"))
    );

    let (mut ex, scope) = owned_at("/small");
    assert_eq!(ex.response_headers(upstream(200, &[], false)), Step::Pause);
    assert_eq!(ex.response_body(b"ab", false), Step::Pause);
    let step = ex.response_body(b"cde", false);
    assert_eq!(completion(&step), owned_completion(scope, 200, &[], None));
}
