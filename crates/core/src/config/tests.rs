//! Unit tests of the parent module (compiled only for tests).
#![cfg(test)]

use super::*;
use crate::limits;
use proptest::prelude::*;
use serde_json::{json, Value};

const MINIMAL: &str = r#"{"store": {"cluster": "idempotency_store", "token": "secret"},
    "policies": [{"name": "payments.create", "match": {"path": {"prefix": "/v1/payments"}},
                  "tenant": {"header": "x-tenant-id"}}]}"#;

fn minimal() -> Value {
    serde_json::from_str(MINIMAL).unwrap()
}

/// Sets (or, with `null`, removes) members of an object.
fn merge(target: &mut Value, patch: Value) {
    let (Value::Object(target), Value::Object(patch)) = (target, patch) else {
        panic!("both must be objects");
    };
    for (name, value) in patch {
        if value.is_null() {
            target.remove(&name);
        } else {
            target.insert(name, value);
        }
    }
}

fn parse_with(root: Value, policy: Value) -> Result<Config, ConfigError> {
    let mut doc = minimal();
    merge(&mut doc, root);
    if let Some(first) = doc["policies"].get_mut(0) {
        merge(first, policy);
    }
    Config::parse(&serde_json::to_vec(&doc).unwrap())
}

fn policy_with(patch: Value) -> Policy {
    Policy::clone(&parse_with(json!({}), patch).unwrap().policies[0])
}

#[test]
fn the_minimal_config_parses_with_the_defaults() {
    let config = Config::parse(MINIMAL.as_bytes()).unwrap();
    assert_eq!(
        config.store,
        StoreConfig {
            cluster: "idempotency_store".into(),
            authority: "idempotency-store".into(),
            timeout_ms: DEFAULT_STORE_TIMEOUT_MS,
            authorization: "Bearer secret".into(),
        }
    );
    assert_eq!(config.doc_base, DEFAULT_DOC_BASE);
    let want = Policy {
        name: "payments.create".into(),
        matcher: Matcher {
            methods: vec![],
            host: None,
            path: PathMatch::Prefix("/v1/payments".into()),
            ignore_case: false,
        },
        require_key: true,
        key_rules: KeyRules::default(),
        identity: Identity::Sourced {
            tenant: Source::Header("x-tenant-id".into()),
            principal: None,
        },
        fingerprint: FingerprintSpec::default(),
        ttl_ms: DEFAULT_TTL_SECONDS * 1000,
        lease_ms: DEFAULT_LEASE_SECONDS * 1000,
        in_flight: InFlight::Conflict,
        after_expiry: AfterExpiry::Reject,
        on_unknown: OnUnknown::Conflict,
        failure_mode: FailureMode::Closed,
        release_statuses: vec![],
        max_request_body: DEFAULT_MAX_REQUEST_BODY,
        max_stored_body: DEFAULT_MAX_STORED_BODY,
        replay_headers: vec![],
        mode: Mode::Enforce,
        in_progress_retry_after_ms: 1_000,
        forwarding: Forwarding::Streaming,
        settle: Settle::BeforeResponse,
        grpc: None,
        canary: None,
    };
    assert_eq!(config.policies, vec![Rc::new(want)]);
}

#[test]
fn every_setting_can_be_given() {
    let p = policy_with(json!({
        "match": {"methods": ["post", "PUT"], "host": "api.example", "path": {"template": "/v1/{id}"}},
        "require_key": false, "strict_syntax": true, "key_min_length": 8, "key_max_length": 64,
        "tenant": {"jwt": {"payload": "jwt_payload", "claim": "org"}}, "principal": {"header": "X-User"},
        "fingerprint": {"mode": "json", "exclude": ["/ts"], "headers": ["X-Client"]},
        "ttl_seconds": 60, "lease_seconds": 5, "in_flight": "wait", "wait_max_ms": 250,
        "after_expiry": "new", "on_unknown": "release", "failure_mode": "open",
        "release_statuses": [503], "max_request_body": 10, "max_stored_body": 20,
        "replay_headers": ["X-Request-Cost"], "mode": "observe", "settle": "background"
    }));
    assert_eq!(p.matcher.methods, vec!["POST", "PUT"]);
    assert_eq!(
        p.key_rules,
        KeyRules {
            strict: true,
            min_len: 8,
            max_len: 64
        }
    );
    assert_eq!(
        p.identity,
        Identity::Sourced {
            tenant: Source::Jwt {
                payload: "jwt_payload".into(),
                claim: "org".into()
            },
            principal: Some(Source::Header("x-user".into())),
        }
    );
    assert_eq!(p.fingerprint.headers, vec!["x-client"]);
    assert_eq!((p.ttl_ms, p.lease_ms), (60_000, 5_000));
    assert_eq!(p.in_flight, InFlight::Wait { max_ms: 250 });
    assert_eq!(
        (p.after_expiry, p.on_unknown, p.failure_mode),
        (AfterExpiry::New, OnUnknown::Release, FailureMode::Open)
    );
    assert_eq!((p.max_request_body, p.max_stored_body), (10, 20));
    assert_eq!(p.replay_headers, vec!["x-request-cost"]);
    assert_eq!(p.mode, Mode::Observe);
    assert_eq!(p.settle, Settle::Background);
    assert!(!p.require_key);
}

#[test]
fn an_anonymous_policy_needs_no_identity() {
    let p = policy_with(json!({"tenant": null, "anonymous": true}));
    assert_eq!(p.identity, Identity::Anonymous);
}

#[test]
fn waiting_without_a_bound_uses_the_default() {
    assert_eq!(
        policy_with(json!({"in_flight": "wait"})).in_flight,
        InFlight::Wait {
            max_ms: DEFAULT_WAIT_MAX_MS
        }
    );
}

#[test]
fn detached_forwarding_defaults_to_the_routes_cluster_and_half_the_lease() {
    let p = policy_with(json!({"forwarding": {"mode": "detached"}}));
    let Forwarding::Detached(d) = &p.forwarding else {
        panic!("{:?}", p.forwarding)
    };
    assert_eq!(d.cluster(), None);
    assert_eq!(d.timeout_ms(), DEFAULT_DETACHED_TIMEOUT_MS.min(p.lease_ms / 2));
    assert_eq!(d.max_response_body(), DEFAULT_MAX_RESPONSE_BODY);
    let p = policy_with(json!({"lease_seconds": 10, "max_stored_body": 100,
        "forwarding": {"mode": "detached", "cluster": "payments", "timeout_ms": 9000, "max_response_body": 100}}));
    let Forwarding::Detached(d) = &p.forwarding else {
        panic!("{:?}", p.forwarding)
    };
    assert_eq!(
        (d.cluster(), d.timeout_ms(), d.max_response_body()),
        (Some("payments"), 9000, 100)
    );
    assert_eq!(
        policy_with(json!({"forwarding": {"mode": "streaming"}})).forwarding,
        Forwarding::Streaming
    );
}

/// The detached upstream call starts only after the claim's answer came back,
/// and its outcome must reach the store afterwards: the lease (counted from
/// the claim's commit) must cover `forwarding.timeout_ms` plus one store call
/// (`store.timeout_ms`).
#[test]
fn a_detached_timeout_leaves_the_lease_a_store_call_to_spare() {
    let detached = |store_timeout: u64, policy: Value| {
        parse_with(
            json!({"store": {"cluster": "c", "token": "t", "timeout_ms": store_timeout}}),
            policy,
        )
    };
    // Exactly the margin: accepted.
    let c = detached(
        1000,
        json!({"lease_seconds": 5, "forwarding": {"mode": "detached", "timeout_ms": 4000}}),
    )
    .unwrap();
    let Forwarding::Detached(d) = &c.policies[0].forwarding else {
        panic!("{:?}", c.policies[0].forwarding)
    };
    assert_eq!(d.timeout_ms(), 4000);
    // Under `on_unknown: conflict` a late outcome still completes its
    // record: the upstream call gets what is configured.
    assert_eq!(d.upstream_timeout_ms(), 4000);
    // Under `release` it gets the lease less three store calls (the claim's
    // answer, the outcome queued behind the worker's callout, the outcome
    // on its way): a configured timeout nearer the lease is cut.
    for (store_timeout, timeout, given) in [
        (1000, 4000, 2000),
        (200, 1800, 1800),
        (200, 4500, 4400),
        (1000, 1500, 2000),
        (2000, 3000, 3000),
    ] {
        let c = detached(
            store_timeout,
            json!({"lease_seconds": 5, "on_unknown": "release",
                   "forwarding": {"mode": "detached", "timeout_ms": timeout}}),
        )
        .unwrap();
        let Forwarding::Detached(d) = &c.policies[0].forwarding else {
            panic!("{:?}", c.policies[0].forwarding)
        };
        assert_eq!(
            d.upstream_timeout_ms(),
            given.min(timeout),
            "{store_timeout} {timeout}"
        );
    }
    // Shorter than the lease, but without a store call's margin: refused,
    // saying what to change.
    for (store_timeout, timeout) in [(1000, 4001), (1000, 4500), (1500, 4000)] {
        let e = detached(
            store_timeout,
            json!({"lease_seconds": 5, "forwarding": {"mode": "detached", "timeout_ms": timeout}}),
        )
        .unwrap_err();
        assert_eq!(e.field, "policies[0].forwarding.timeout_ms", "{e}");
        for names in [
            "store.timeout_ms",
            "lease_seconds",
            &(5000 - store_timeout).to_string(),
        ] {
            assert!(e.message.contains(names), "{e}");
        }
    }
    // A lease no longer than the store call leaves no room for any timeout,
    // the default included.
    let e = detached(
        1000,
        json!({"lease_seconds": 1, "forwarding": {"mode": "detached"}}),
    )
    .unwrap_err();
    assert_eq!(e.field, "policies[0].forwarding.timeout_ms", "{e}");
    assert!(e.message.contains("store.timeout_ms"), "{e}");
}

#[test]
fn the_default_detached_timeout_leaves_the_lease_a_store_call_to_spare() {
    for (lease_s, store_timeout, want) in [
        (60, 1000, 30_000),
        (2, 1500, 500),
        (3, 1000, 1500),
        (60, 45_000, 15_000),
    ] {
        let c = parse_with(
            json!({"store": {"cluster": "c", "token": "t", "timeout_ms": store_timeout}}),
            json!({"lease_seconds": lease_s, "forwarding": {"mode": "detached"}}),
        )
        .unwrap();
        let Forwarding::Detached(d) = &c.policies[0].forwarding else {
            panic!("{:?}", c.policies[0].forwarding)
        };
        assert_eq!(
            d.timeout_ms(),
            want,
            "lease {lease_s} s, store timeout {store_timeout} ms"
        );
    }
}

#[test]
fn the_store_token_may_come_from_the_environment() {
    let doc = |store: &str| {
        format!(
            r#"{{"store": {store}, "policies": [{{"name": "p", "match": {{"path": {{"prefix": "/"}}}}, "anonymous": true}}]}}"#
        )
    };
    let from_env = doc(r#"{"cluster": "s", "token_env": "STORE_TOKEN"}"#);
    let env = |name: &str| (name == "STORE_TOKEN").then(|| "s3cret".to_string());
    let config = Config::parse_with_env(from_env.as_bytes(), &env).unwrap();
    assert_eq!(config.store().authorization(), "Bearer s3cret");
    let unset = Config::parse(from_env.as_bytes()).unwrap_err();
    assert_eq!(unset.field, "store.token_env");
    assert!(unset.message.contains("STORE_TOKEN"), "{unset}");
    let blank = Config::parse_with_env(from_env.as_bytes(), &|_| Some(" ".into())).unwrap_err();
    assert_eq!(blank.field, "store.token_env");
    for both_or_none in [
        r#"{"cluster": "s", "token": "t", "token_env": "STORE_TOKEN"}"#,
        r#"{"cluster": "s"}"#,
    ] {
        let e = Config::parse_with_env(doc(both_or_none).as_bytes(), &env).unwrap_err();
        assert_eq!(e.field, "store.token", "{both_or_none}");
    }
}

macro_rules! rejects {
    ($name:ident, $root:tt, $policy:tt => $field:expr) => {
        #[test]
        fn $name() {
            let err = parse_with(json!($root), json!($policy)).unwrap_err();
            assert_eq!(err.field, $field, "{err}");
            assert!(!err.message.is_empty());
        }
    };
}

rejects!(an_unknown_settle_mode_is_rejected, {}, {"settle": "later"} => "(document)");
rejects!(an_unknown_forwarding_mode_is_rejected, {}, {"forwarding": {"mode": "async"}} => "policies[0].forwarding.mode");
rejects!(detached_settings_under_streaming_are_rejected, {}, {"forwarding": {"mode": "streaming", "timeout_ms": 5}} => "policies[0].forwarding.mode");
rejects!(an_empty_detached_cluster_is_rejected, {}, {"forwarding": {"mode": "detached", "cluster": ""}} => "policies[0].forwarding.cluster");
rejects!(a_detached_timeout_as_long_as_the_lease_is_rejected, {}, {"lease_seconds": 5, "forwarding": {"mode": "detached", "timeout_ms": 5000}} => "policies[0].forwarding.timeout_ms");
rejects!(a_zero_detached_timeout_is_rejected, {}, {"forwarding": {"mode": "detached", "timeout_ms": 0}} => "policies[0].forwarding.timeout_ms");
rejects!(a_relay_limit_below_the_stored_body_is_rejected, {}, {"max_stored_body": 10, "forwarding": {"mode": "detached", "max_response_body": 9}} => "policies[0].forwarding.max_response_body");
rejects!(an_unknown_top_level_field_is_rejected, {"extra": 1}, {} => "(document)");
rejects!(an_unknown_policy_field_is_rejected, {}, {"ttl": 1} => "(document)");
rejects!(a_missing_store_is_rejected, {"store": null}, {} => "(document)");
rejects!(an_empty_cluster_is_rejected, {"store": {"cluster": "", "token": "t"}}, {} => "store.cluster");
rejects!(an_empty_authority_is_rejected, {"store": {"cluster": "c", "token": "t", "authority": ""}}, {} => "store.authority");
rejects!(an_authority_with_a_space_is_rejected, {"store": {"cluster": "c", "token": "t", "authority": "a b"}}, {} => "store.authority");
rejects!(a_zero_store_timeout_is_rejected, {"store": {"cluster": "c", "token": "t", "timeout_ms": 0}}, {} => "store.timeout_ms");
rejects!(an_empty_token_is_rejected, {"store": {"cluster": "c", "token": ""}}, {} => "store.token");
rejects!(a_token_with_a_space_is_rejected, {"store": {"cluster": "c", "token": "a b"}}, {} => "store.token");
rejects!(an_empty_doc_base_is_rejected, {"doc_base": ""}, {} => "doc_base");
rejects!(a_doc_base_with_a_space_is_rejected, {"doc_base": "https://x/ y"}, {} => "doc_base");
rejects!(no_policies_are_rejected, {"policies": []}, {} => "policies");
rejects!(an_empty_policy_name_is_rejected, {}, {"name": ""} => "policies[0].name");
rejects!(a_policy_name_with_a_space_is_rejected, {}, {"name": "a b"} => "policies[0].name");
rejects!(a_policy_name_over_128_characters_is_rejected, {}, {"name": "n".repeat(129)} => "policies[0].name");
rejects!(an_empty_method_is_rejected, {}, {"match": {"methods": [""], "path": {"exact": "/"}}} => "policies[0].match.methods");
rejects!(a_method_with_digits_is_rejected, {}, {"match": {"methods": ["P0ST"], "path": {"exact": "/"}}} => "policies[0].match.methods");
rejects!(an_exact_path_without_a_slash_is_rejected, {}, {"match": {"path": {"exact": "v1"}}} => "policies[0].match.path");
rejects!(a_prefix_without_a_slash_is_rejected, {}, {"match": {"path": {"prefix": ""}}} => "policies[0].match.path");
rejects!(a_template_without_a_slash_is_rejected, {}, {"match": {"path": {"template": "{id}"}}} => "policies[0].match.path");
rejects!(two_path_kinds_are_rejected, {}, {"match": {"path": {"exact": "/a", "prefix": "/b"}}} => "(document)");
rejects!(a_key_max_length_of_0_is_rejected, {}, {"key_max_length": 0} => "policies[0].key_max_length");
rejects!(a_key_max_length_over_255_is_rejected, {}, {"key_max_length": 256} => "policies[0].key_max_length");
rejects!(a_key_min_length_of_0_is_rejected, {}, {"key_min_length": 0} => "policies[0].key_min_length");
rejects!(a_key_min_length_over_the_max_is_rejected, {}, {"key_min_length": 20, "key_max_length": 10} => "policies[0].key_min_length");
rejects!(anonymous_with_a_tenant_is_rejected, {}, {"anonymous": true} => "policies[0].anonymous");
rejects!(anonymous_with_a_principal_is_rejected, {}, {"tenant": null, "anonymous": true, "principal": {"header": "x-u"}} => "policies[0].anonymous");
rejects!(a_missing_tenant_is_rejected, {}, {"tenant": null} => "policies[0].tenant");
rejects!(a_missing_tenant_is_rejected_even_if_not_anonymous, {}, {"tenant": null, "anonymous": false} => "policies[0].tenant");
rejects!(a_bad_tenant_header_is_rejected, {}, {"tenant": {"header": "x tenant"}} => "policies[0].tenant.header");
rejects!(a_bad_principal_header_is_rejected, {}, {"principal": {"header": ""}} => "policies[0].principal.header");
rejects!(a_jwt_tenant_without_a_claim_is_rejected, {}, {"tenant": {"jwt": {"payload": "p", "claim": ""}}} => "policies[0].tenant.jwt");
rejects!(a_jwt_principal_without_a_payload_is_rejected, {}, {"principal": {"jwt": {"payload": "", "claim": "sub"}}} => "policies[0].principal.jwt");
rejects!(an_unknown_source_is_rejected, {}, {"tenant": {"cookie": "t"}} => "(document)");
rejects!(an_unknown_fingerprint_mode_is_rejected, {}, {"fingerprint": {"mode": "xml"}} => "policies[0].fingerprint");
rejects!(a_bad_exclude_pointer_is_rejected, {}, {"fingerprint": {"exclude": ["ts"]}} => "policies[0].fingerprint");
rejects!(exclude_with_raw_mode_is_rejected, {}, {"fingerprint": {"mode": "raw", "exclude": ["/ts"]}} => "policies[0].fingerprint");
rejects!(a_bad_fingerprint_header_is_rejected, {}, {"fingerprint": {"headers": ["a b"]}} => "policies[0].fingerprint");
rejects!(a_zero_ttl_is_rejected, {}, {"ttl_seconds": 0} => "policies[0].ttl_seconds");
rejects!(a_ttl_the_store_refuses_is_rejected, {}, {"ttl_seconds": limits::MAX_TTL_MS / 1000 + 1} => "policies[0].ttl_seconds");
rejects!(a_lease_the_store_refuses_is_rejected, {}, {"lease_seconds": limits::MAX_LEASE_MS / 1000 + 1} => "policies[0].lease_seconds");
rejects!(a_wait_the_store_refuses_is_rejected, {}, {"in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS + 1} => "policies[0].wait_max_ms");
rejects!(a_store_timeout_the_store_refuses_as_a_claims_deadline_is_rejected,
    {"store": {"cluster": "c", "token": "t", "timeout_ms": limits::MAX_DEADLINE_MS + 1}}, {} => "store.timeout_ms");
rejects!(a_wait_that_with_the_store_timeout_passes_the_stores_deadline_is_rejected,
    {"store": {"cluster": "c", "token": "t", "timeout_ms": limits::MAX_DEADLINE_MS - limits::MAX_WAIT_MS + 1}},
    {"in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS} => "policies[0].wait_max_ms");
rejects!(a_stored_body_the_store_refuses_is_rejected, {}, {"max_stored_body": limits::MAX_STORED_BODY + 1} => "policies[0].max_stored_body");
rejects!(more_replay_headers_than_the_store_keeps_are_rejected, {},
    {"replay_headers": (0..=limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len()).map(|i| format!("x-h{i}")).collect::<Vec<_>>()}
    => "policies[0].replay_headers");
rejects!(a_replay_header_name_the_store_refuses_is_rejected, {}, {"replay_headers": ["x".repeat(limits::MAX_HEADER_NAME + 1)]} => "policies[0].replay_headers");
rejects!(a_zero_lease_is_rejected, {}, {"lease_seconds": 0} => "policies[0].lease_seconds");
rejects!(a_wait_bound_without_waiting_is_rejected, {}, {"wait_max_ms": 10} => "policies[0].wait_max_ms");
rejects!(a_wait_bound_with_conflict_is_rejected, {}, {"in_flight": "conflict", "wait_max_ms": 10} => "policies[0].wait_max_ms");
rejects!(a_zero_wait_bound_is_rejected, {}, {"in_flight": "wait", "wait_max_ms": 0} => "policies[0].wait_max_ms");
rejects!(an_unknown_in_flight_is_rejected, {}, {"in_flight": "queue"} => "policies[0].in_flight");
rejects!(an_unknown_after_expiry_is_rejected, {}, {"after_expiry": "ignore"} => "(document)");
rejects!(an_in_progress_retry_hint_of_zero_is_rejected, {}, {"in_progress_retry_after_ms": 0} => "policies[0].in_progress_retry_after_ms");
rejects!(an_in_progress_retry_hint_over_a_minute_is_rejected, {}, {"in_progress_retry_after_ms": 60_001} => "policies[0].in_progress_retry_after_ms");
rejects!(a_release_status_over_599_is_rejected, {}, {"release_statuses": [600]} => "policies[0].release_statuses");
rejects!(a_release_status_under_100_is_rejected, {}, {"release_statuses": [99]} => "policies[0].release_statuses");
rejects!(a_zero_max_request_body_is_rejected, {}, {"max_request_body": 0} => "policies[0].max_request_body");
rejects!(a_bad_replay_header_is_rejected, {}, {"replay_headers": ["x:y"]} => "policies[0].replay_headers");
rejects!(a_negative_number_is_rejected, {}, {"ttl_seconds": -1} => "(document)");

#[test]
fn the_largest_settings_the_store_accepts_are_accepted() {
    let p = policy_with(json!({
        "ttl_seconds": limits::MAX_TTL_MS / 1000, "lease_seconds": limits::MAX_LEASE_MS / 1000,
        "in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS, "max_stored_body": limits::MAX_STORED_BODY,
        "replay_headers": (0..limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len()).map(|i| format!("x-h{i}")).collect::<Vec<_>>(),
    }));
    assert_eq!((p.ttl_ms, p.lease_ms), (limits::MAX_TTL_MS, limits::MAX_LEASE_MS));
}

#[test]
fn patterns_are_stored_normalized_and_folded_when_case_is_ignored() {
    let p = policy_with(json!({"match": {"path": {"exact": "/V1//Pay/"}, "ignore_case": true}}));
    assert_eq!(p.matcher.path, PathMatch::Exact("/v1/pay".into()));
    assert!(p.matcher.matches("POST", "h", "/v1/PAY"));
    assert_eq!(p.matcher.fingerprint_path("/V1/Pay/?A=1"), "/v1/pay?A=1");
    let p = policy_with(json!({"match": {"path": {"exact": "/v1/pay"}}}));
    assert!(!p.matcher.matches("POST", "h", "/V1/pay"));
    assert_eq!(p.matcher.fingerprint_path("//v1/./pay/?a=1"), "/v1/pay?a=1");
}

#[test]
fn invalid_json_is_rejected_as_a_document_error() {
    for bad in [&b""[..], b"{", b"[]", b"null", b"\xff"] {
        assert_eq!(Config::parse(bad).unwrap_err().field, "(document)");
    }
}

#[test]
fn a_repeated_policy_name_names_the_second_policy() {
    let mut doc = minimal();
    let first = doc["policies"][0].clone();
    doc["policies"].as_array_mut().unwrap().push(first);
    let err = Config::parse(&serde_json::to_vec(&doc).unwrap()).unwrap_err();
    assert_eq!(err.field, "policies[1].name");
}

#[test]
fn the_error_names_the_field_when_displayed() {
    let err = parse_with(json!({}), json!({"ttl_seconds": 0})).unwrap_err();
    assert!(err
        .to_string()
        .starts_with("invalid configuration at `policies[0].ttl_seconds`: "));
}

fn matcher(methods: &[&str], host: Option<&str>, path: PathMatch) -> Matcher {
    Matcher {
        methods: methods.iter().map(|m| m.to_string()).collect(),
        host: host.map(String::from),
        path,
        ignore_case: false,
    }
}

fn template(t: &str) -> PathMatch {
    PathMatch::Template(t.into())
}

fn prefix(p: &str) -> PathMatch {
    PathMatch::Prefix(p.into())
}

fn exact(p: &str) -> PathMatch {
    PathMatch::Exact(p.into())
}

macro_rules! route {
    ($name:ident, $matcher:expr, $method:expr, $host:expr, $path:expr => $want:expr) => {
        #[test]
        fn $name() {
            assert_eq!($matcher.matches($method, $host, $path), $want);
        }
    };
}

route!(post_is_covered_by_default, matcher(&[], None, prefix("/")), "POST", "h", "/x" => true);
route!(patch_is_covered_by_default, matcher(&[], None, prefix("/")), "PATCH", "h", "/x" => true);
route!(get_is_not_covered_by_default, matcher(&[], None, prefix("/")), "GET", "h", "/x" => false);
route!(put_is_not_covered_by_default, matcher(&[], None, prefix("/")), "PUT", "h", "/x" => false);
route!(listed_methods_replace_the_default, matcher(&["PUT"], None, prefix("/")), "PUT", "h", "/x" => true);
route!(listed_methods_exclude_post, matcher(&["PUT"], None, prefix("/")), "POST", "h", "/x" => false);
route!(an_exact_path_matches_itself, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay" => true);
route!(an_exact_path_ignores_the_query, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay?a=1" => true);
route!(an_exact_path_ignores_a_fragment, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay#x" => true);
route!(an_exact_path_covers_a_trailing_slash, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay/" => true);
route!(an_exact_path_covers_double_slashes, matcher(&[], None, exact("/v1/pay")), "POST", "h", "//v1//pay" => true);
route!(an_exact_path_covers_dot_segments, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/./x/../pay" => true);
route!(an_exact_path_covers_encoded_letters, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/%70ay" => true);
route!(an_exact_path_does_not_cover_an_encoded_slash, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1%2Fpay" => false);
route!(a_prefix_covers_double_slashes, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "//v1/pay/1" => true);
route!(a_prefix_with_a_trailing_slash_covers_the_bare_path, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/pay" => true);
route!(a_prefix_with_a_trailing_slash_covers_deeper_paths, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/pay/9" => true);
route!(a_prefix_with_a_trailing_slash_does_not_cover_a_sibling, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/payx" => false);
route!(an_ignore_case_path_covers_upper_case, Matcher { ignore_case: true, ..matcher(&[], None, exact("/v1/pay")) }, "POST", "h", "/V1/PAY/" => true);
route!(an_exact_path_is_case_sensitive, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/V1/pay" => false);
route!(a_prefix_matches_a_longer_path, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "/v1/payments/9" => true);
route!(a_prefix_does_not_match_a_shorter_path, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "/v1/pa" => false);
route!(a_template_matches_one_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c" => true);
route!(a_template_ignores_the_query, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c?x=/y" => true);
route!(a_template_rejects_an_empty_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a//c" => false);
route!(a_template_rejects_two_segments, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/4/2/c" => false);
route!(a_template_rejects_a_trailing_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c/d" => false);
route!(a_template_rejects_a_missing_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42" => false);
route!(a_template_covers_a_trailing_slash, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c/" => true);
route!(a_template_compares_literal_segments, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/b/42/c" => false);
route!(a_template_may_end_in_a_variable, matcher(&[], None, template("/v1/{a}/{b}")), "POST", "h", "/v1/x/y" => true);
route!(a_host_matches_without_a_port, matcher(&[], Some("api.example"), prefix("/")), "POST", "api.example", "/" => true);
route!(a_host_matches_ignoring_case, matcher(&[], Some("API.example"), prefix("/")), "POST", "api.EXAMPLE", "/" => true);
route!(a_host_matches_with_a_port, matcher(&[], Some("api.example"), prefix("/")), "POST", "api.example:8443", "/" => true);
route!(a_host_with_a_port_matches_exactly, matcher(&[], Some("api.example:8443"), prefix("/")), "POST", "api.example:8443", "/" => true);
route!(a_host_with_a_port_rejects_another_port, matcher(&[], Some("api.example:8443"), prefix("/")), "POST", "api.example:80", "/" => false);
route!(another_host_is_not_matched, matcher(&[], Some("api.example"), prefix("/")), "POST", "evil.example", "/" => false);
route!(a_host_suffix_is_not_matched, matcher(&[], Some("example"), prefix("/")), "POST", "api.example", "/" => false);
route!(an_ipv6_host_matches_with_a_port, matcher(&[], Some("[::1]"), prefix("/")), "POST", "[::1]:8080", "/" => true);
route!(an_ipv6_host_matches_without_a_port, matcher(&[], Some("[::1]"), prefix("/")), "POST", "[::1]", "/" => true);
route!(no_host_means_any_host, matcher(&[], None, prefix("/")), "POST", "anything:1", "/" => true);

#[test]
fn the_first_matching_policy_wins() {
    let mut doc = minimal();
    let mut second = doc["policies"][0].clone();
    merge(
        &mut second,
        json!({"name": "all", "match": {"path": {"prefix": "/"}}}),
    );
    doc["policies"].as_array_mut().unwrap().push(second);
    let config = Config::parse(&serde_json::to_vec(&doc).unwrap()).unwrap();
    let name = |path| config.policy_for("POST", "h", path).map(|p| p.name.as_str());
    assert_eq!(name("/v1/payments"), Some("payments.create"));
    assert_eq!(name("/v1/refunds"), Some("all"));
    assert_eq!(config.policy_for("GET", "h", "/v1/payments"), None);
}

macro_rules! replays {
    ($name:ident, $extra:tt, $header:expr => $want:expr) => {
        #[test]
        fn $name() {
            let p = policy_with(json!({"replay_headers": $extra}));
            assert_eq!(p.replays_header($header), $want);
        }
    };
}

replays!(content_type_is_replayed, [], "Content-Type" => true);
replays!(location_is_replayed, [], "location" => true);
replays!(an_unlisted_header_is_not_replayed, [], "x-cost" => false);
replays!(a_listed_extra_header_is_replayed, ["X-Cost"], "x-cost" => true);
replays!(set_cookie_is_never_replayed, ["set-cookie"], "Set-Cookie" => false);
replays!(content_length_is_never_replayed, ["content-length"], "content-length" => false);
replays!(envoy_headers_are_never_replayed, ["x-envoy-upstream-service-time"], "x-envoy-upstream-service-time" => false);
replays!(pseudo_headers_are_never_replayed, [], ":status" => false);
replays!(idempotency_control_is_never_replayed, ["idempotency-control"], "idempotency-control" => false);

#[test]
fn a_grpc_policy_replays_the_encoding_its_messages_were_compressed_with() {
    let grpc = policy_with(json!({"match": {"path": {"exact": "/ledger.v1.Ledger/Transfer"}}, "grpc": {}}));
    assert!(grpc.replays_header("grpc-encoding"));
    assert!(grpc.replays_header("Grpc-Encoding"));
    assert!(
        !grpc.replays_header("grpc-accept-encoding"),
        "only requests need it"
    );
    assert!(
        !policy_with(json!({})).replays_header("grpc-encoding"),
        "an HTTP answer has no gRPC messages"
    );
}

rejects!(more_replay_headers_than_the_store_keeps_beside_the_grpc_encoding_are_rejected, {},
    {"match": {"path": {"exact": "/ledger.v1.Ledger/Transfer"}}, "grpc": {},
     "replay_headers": (0..limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len()).map(|i| format!("x-h{i}")).collect::<Vec<_>>()}
    => "policies[0].replay_headers");

macro_rules! releases {
    ($name:ident, $statuses:tt, $status:expr => $want:expr) => {
        #[test]
        fn $name() {
            assert_eq!(policy_with(json!({"release_statuses": $statuses})).releases_on($status), $want);
        }
    };
}

releases!(a_408_releases_the_key, [], 408 => true);
releases!(a_425_releases_the_key, [], 425 => true);
releases!(a_429_releases_the_key, [], 429 => true);
releases!(a_500_keeps_the_key, [], 500 => false);
releases!(a_400_releases_the_key, [], 400 => true);
releases!(a_401_releases_the_key, [], 401 => true);
releases!(a_403_releases_the_key, [], 403 => true);
releases!(a_422_releases_the_key, [], 422 => true);
releases!(a_404_keeps_the_key, [], 404 => false);
releases!(a_409_keeps_the_key, [], 409 => false);
releases!(a_201_keeps_the_key, [], 201 => false);
releases!(a_listed_503_releases_the_key, [503], 503 => true);

/// The filter's claim says `wait_ms` = `wait_max_ms` (0 without waiting) and
/// `deadline_ms` = `store.timeout_ms` + `wait_ms`: a configuration is
/// accepted exactly when the store accepts both.
fn the_store_accepts_the_claims_of(store_timeout: u64, wait: Option<u64>) -> bool {
    let wait_ms = wait.unwrap_or(0);
    wait_ms <= limits::MAX_WAIT_MS && store_timeout + wait_ms <= limits::MAX_DEADLINE_MS
}

#[test]
fn the_longest_store_timeout_and_wait_the_store_accepts_are_accepted() {
    let store = |timeout_ms: u64| json!({"store": {"cluster": "c", "token": "t", "timeout_ms": timeout_ms}});
    let c = parse_with(store(limits::MAX_DEADLINE_MS), json!({})).unwrap();
    assert_eq!(c.store().timeout_ms(), limits::MAX_DEADLINE_MS);
    let c = parse_with(
        store(limits::MAX_DEADLINE_MS - limits::MAX_WAIT_MS),
        json!({"in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS}),
    )
    .unwrap();
    assert_eq!(
        c.policies[0].in_flight,
        InFlight::Wait {
            max_ms: limits::MAX_WAIT_MS
        }
    );
    // One more millisecond of either, and the error says what to change.
    let e = parse_with(
        store(limits::MAX_DEADLINE_MS - limits::MAX_WAIT_MS + 1),
        json!({"in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS}),
    )
    .unwrap_err();
    for names in [
        "store.timeout_ms",
        "wait_max_ms",
        &limits::MAX_DEADLINE_MS.to_string(),
    ] {
        assert!(e.message.contains(names), "{e}");
    }
    // The default wait counts too.
    let e = parse_with(store(limits::MAX_DEADLINE_MS), json!({"in_flight": "wait"})).unwrap_err();
    assert_eq!(e.field, "policies[0].wait_max_ms", "{e}");
}

proptest! {
    #[test]
    fn a_config_is_accepted_exactly_when_the_store_accepts_its_claims(
        store_timeout in 1u64..=200_000,
        wait in proptest::option::of(1u64..=70_000),
    ) {
        let mut policy = json!({});
        if let Some(w) = wait {
            policy = json!({"in_flight": "wait", "wait_max_ms": w});
        }
        let parsed = parse_with(json!({"store": {"cluster": "c", "token": "t", "timeout_ms": store_timeout}}), policy);
        prop_assert_eq!(parsed.is_ok(), the_store_accepts_the_claims_of(store_timeout, wait), "{:?}", parsed.err());
    }

    #[test]
    fn an_accepted_detached_timeout_always_fits_the_lease_with_a_store_call(
        lease_s in 1u64..=120,
        store_timeout in 1u64..=20_000,
        timeout in proptest::option::of(1u64..=130_000),
    ) {
        let mut forwarding = json!({"mode": "detached"});
        if let Some(t) = timeout {
            forwarding["timeout_ms"] = json!(t);
        }
        let parsed = parse_with(
            json!({"store": {"cluster": "c", "token": "t", "timeout_ms": store_timeout}}),
            json!({"lease_seconds": lease_s, "forwarding": forwarding}),
        );
        let fits = |t: u64| t >= 1 && t + store_timeout <= lease_s * 1000;
        match (parsed, timeout) {
            (Ok(c), _) => {
                let Forwarding::Detached(d) = &c.policies[0].forwarding else {
                    panic!("{:?}", c.policies[0].forwarding)
                };
                prop_assert!(fits(d.timeout_ms()), "{} ms", d.timeout_ms());
            }
            (Err(e), Some(t)) => prop_assert!(!fits(t), "{e}"),
            // The default is refused only when nothing fits.
            (Err(e), None) => prop_assert!(store_timeout >= lease_s * 1000, "{e}"),
        }
    }

    #[test]
    fn parse_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Config::parse(&bytes);
    }

    #[test]
    fn parse_never_panics_on_a_mangled_config(cut in 0..MINIMAL.len(), insert in "[{}\\[\\]\":,0-9a-z_ -]{0,12}") {
        let mut text = MINIMAL.as_bytes().to_vec();
        text.splice(cut..cut, insert.bytes());
        let _ = Config::parse(&text);
    }

    #[test]
    fn parse_never_panics_on_any_policy_values(
        ttl in any::<u64>(), lease in any::<u64>(), min in any::<usize>(), max in any::<usize>(),
        body in any::<usize>(), name in "\\PC{0,140}",
    ) {
        let _ = parse_with(json!({}), json!({
            "ttl_seconds": ttl, "lease_seconds": lease, "key_min_length": min, "key_max_length": max,
            "max_request_body": body, "name": name,
        }));
    }
}

#[test]
fn a_detached_timeout_the_lease_cuts_is_warned_about() {
    let quiet = parse_with(json!({}), json!({"forwarding": {"mode": "detached"}})).unwrap();
    assert!(quiet.warnings().is_empty(), "{:?}", quiet.warnings());
    // A 10 s lease, the default store timeout: 9,000 ms fits the lease less
    // one store call but not less three, and is cut under `release` only.
    let policy = json!({"lease_seconds": 10, "forwarding": {"mode": "detached", "timeout_ms": 9000}});
    let conflict = parse_with(json!({}), policy.clone()).unwrap();
    assert!(conflict.warnings().is_empty(), "{:?}", conflict.warnings());
    let mut policy = policy;
    policy["on_unknown"] = json!("release");
    let cut = parse_with(json!({}), policy).unwrap();
    let Forwarding::Detached(d) = &cut.policies[0].forwarding else {
        panic!("{:?}", cut.policies[0].forwarding)
    };
    assert!(d.upstream_timeout_ms() < 9000);
    let warnings = cut.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains(&format!("gets {} ms", d.upstream_timeout_ms())),
        "{warnings:?}"
    );
}

#[test]
fn bodies_above_envoys_default_buffer_are_warned_about_by_field() {
    let quiet = parse_with(json!({}), json!({"max_stored_body": ENVOY_DEFAULT_BUFFER_LIMIT})).unwrap();
    assert!(quiet.warnings().is_empty());
    let loud = parse_with(
        json!({}),
        json!({"max_stored_body": ENVOY_DEFAULT_BUFFER_LIMIT + 1, "max_request_body": 2 * ENVOY_DEFAULT_BUFFER_LIMIT}),
    )
    .unwrap();
    let warnings = loud.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings
        .iter()
        .any(|w| w.contains("max_stored_body") && w.contains("per_connection_buffer_limit_bytes")));
    assert!(warnings.iter().any(|w| w.contains("max_request_body")));
}
