//! Partial enforcement: a canary's tenants and share of keys are enforced,
//! the rest observed (compiled only for tests).
#![cfg(test)]

use super::super::*;
use crate::protocol::ClaimReply;

fn config(canary: &str, extra: &str) -> Rc<Config> {
    let json = format!(
        r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "pay",
        "match": {{"path": {{"prefix": "/pay"}}}}, "tenant": {{"header": "x-tenant"}},
        "canary": {canary}{extra}}}]}}"#
    );
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

fn begin(config: &Rc<Config>, tenant: &str, key: Option<&str>) -> (Exchange, Step) {
    let policy = config.policy_for("POST", "h", "/pay").unwrap().clone();
    let head = RequestHead {
        method: "POST".into(),
        path: "/pay".into(),
        key_fields: key.map(|k| vec![k.as_bytes().to_vec()]).unwrap_or_default(),
        tenant: Some(tenant.as_bytes().to_vec()),
        end_of_stream: true,
        upstream: Some(UpstreamCall {
            cluster: "upstream".into(),
            headers: Vec::new(),
            timeout_ms: 1000,
        }),
        ..RequestHead::default()
    };
    let attempt = Attempt::try_from("attempt-1".to_string()).unwrap();
    Exchange::begin(config.clone(), policy, head, attempt)
}

/// What a request of `tenant` with `key` gets when the store says its key
/// was used by another request.
fn mismatched(config: &Rc<Config>, tenant: &str, key: &str) -> (Step, Handling) {
    let (mut ex, _) = begin(config, tenant, Some(key));
    let step = ex.store_reply(Some((200, encode_frame(&ClaimReply::Mismatch, b""))));
    (step, ex.handling())
}

fn enforced(config: &Rc<Config>, tenant: &str, key: &str) -> bool {
    match mismatched(config, tenant, key) {
        (Step::Respond(reply), Handling::Mismatch) => reply.status == 422,
        (Step::Continue, Handling::WouldReject) => false,
        other => panic!("neither enforced nor observed: {other:?}"),
    }
}

#[test]
fn listed_tenants_are_enforced_and_the_others_observed() {
    let config = config(r#"{"percent": 0, "tenants": ["acme"]}"#, "");
    assert!(enforced(&config, "acme", "k1"));
    assert!(!enforced(&config, "globex", "k1"));
    let (mut ex, step) = begin(&config, "globex", None);
    assert_eq!(
        step,
        Step::Continue,
        "a missing key is only counted for an unlisted tenant"
    );
    assert_eq!(ex.reason(), Some(Handling::Missing));
    let (_, step) = begin(&config, "acme", None);
    assert!(
        matches!(step, Step::Respond(ref r) if r.status == 400),
        "{step:?}"
    );
    ex.finish();
}

#[test]
fn a_share_of_keys_is_enforced_and_each_key_always_alike() {
    let all = config(r#"{"percent": 100}"#, "");
    assert!(enforced(&all, "globex", "k1"));
    let half = config(r#"{"percent": 50}"#, "");
    let picked: Vec<bool> = (0..1000)
        .map(|i| enforced(&half, "globex", &format!("k{i}")))
        .collect();
    let count = picked.iter().filter(|&&p| p).count();
    assert!(
        (400..=600).contains(&count),
        "{count} of 1000 keys enforced at 50%"
    );
    for (i, was) in picked.iter().enumerate().take(50) {
        assert_eq!(
            enforced(&half, "globex", &format!("k{i}")),
            *was,
            "key k{i} changed sides"
        );
    }
    // Another tenant's same key is another scope: picked on its own.
    let other: Vec<bool> = (0..1000)
        .map(|i| enforced(&half, "acme", &format!("k{i}")))
        .collect();
    assert_ne!(picked, other);
}

#[test]
fn an_observed_request_is_never_forwarded_by_the_filter_itself() {
    let config = config(
        r#"{"tenants": ["acme"]}"#,
        r#", "forwarding": {"mode": "detached"}"#,
    );
    for (tenant, forwards) in [("acme", true), ("globex", false)] {
        let (mut ex, _) = begin(&config, tenant, Some("k1"));
        let step = ex.store_reply(Some((200, encode_frame(&ClaimReply::Owned { fence: 1 }, b""))));
        assert_eq!(matches!(step, Step::Forward(_)), forwards, "{tenant}: {step:?}");
    }
}

#[test]
fn a_canary_is_refused_where_it_cannot_mean_anything() {
    let parse = |canary: &str, extra: &str| {
        let json = format!(
            r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "pay",
            "match": {{"path": {{"prefix": "/pay"}}}}, "anonymous": true, "canary": {canary}{extra}}}]}}"#
        );
        Config::parse(json.as_bytes())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(parse(r#"{"percent": 12.5}"#, "").is_ok());
    for (canary, extra, field) in [
        (r#"{"percent": 5}"#, r#", "mode": "observe""#, "canary"),
        (r#"{"percent": 101}"#, "", "canary.percent"),
        (r#"{"percent": -1}"#, "", "canary.percent"),
        (r#"{"percent": 0.001}"#, "", "canary.percent"),
        (r#"{"tenants": [""]}"#, "", "canary.tenants"),
        (r#"{"share": 5}"#, "", "share"),
    ] {
        let e = parse(canary, extra).unwrap_err();
        assert!(e.contains(field), "{canary}{extra}: {e}");
    }
}

#[test]
fn the_rollout_a_policy_reports_is_observe_canary_or_enforce() {
    let rollout = |policy: &str| {
        let json = format!(
            r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "pay",
            "match": {{"path": {{"prefix": "/pay"}}}}, "anonymous": true{policy}}}]}}"#
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        config.policies()[0].rollout()
    };
    assert_eq!(rollout(""), "enforce");
    assert_eq!(rollout(r#", "mode": "observe""#), "observe");
    assert_eq!(rollout(r#", "canary": {"percent": 5}"#), "canary");
    for r in ["enforce", "observe", "canary"] {
        assert!(crate::config::ROLLOUTS.contains(&r));
    }
}
