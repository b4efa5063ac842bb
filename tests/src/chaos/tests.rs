//! The audit must be able to fail: each broken promise, fabricated.
use std::collections::{BTreeMap, HashMap};

use super::answers::check_answer;
use super::judge::{execution_scope, released, sha256_hex};
use super::report::LeftDetached;
use super::*;
use crate::{Answer, Execution};

fn scope(tenant: &str) -> ScopeId {
    ScopeId {
        tenant: tenant.into(),
        user: "u".into(),
        route: "payments.create",
        key: "k".into(),
    }
}

#[test]
fn only_a_kill_or_reset_while_the_request_was_in_flight_excuses_a_burnt_key() {
    let faults = Faults {
        windows: vec![("Envoy SIGKILL", 10_000, 10_500), ("store stall", 30_000, 31_500)],
        ..Faults::default()
    };
    let mut audit = Audit {
        burnt_keys: vec![
            "before the kill".into(),
            "reaching the store as Envoy died".into(),
            "after the kill".into(),
            "before a stall".into(),
            "long before".into(),
        ],
        burnt_at: vec![9_000, 10_001, 10_600, 29_000, -5_000],
        ..Audit::default()
    };
    audit.excuse(|at| faults.left_unknown_by_contract(at));
    assert_eq!(
        audit.unknown_by_contract,
        [
            "before the kill (in flight at a Envoy SIGKILL)",
            "reaching the store as Envoy died (in flight at a Envoy SIGKILL)"
        ]
    );
    assert_eq!(
        audit.burnt_keys,
        ["after the kill", "before a stall", "long before"]
    );
    assert_eq!(audit.total_violations(), 3);
}

fn exec(n: u64, tenant: &str, body: &str, status: u16) -> Execution {
    Execution {
        n,
        // Execution n arrives at n s (and generations are claimed at
        // whole seconds before it).
        at_ms: n as i64 * 1_000 + 10,
        key: "k".into(),
        tenant: tenant.into(),
        user: "u".into(),
        path: "/pay".into(),
        body_sha256: sha256_hex(body.as_bytes()),
        status,
        control: None,
        response: bytes::Bytes::from(format!("{{\"execution\":{n}}}")),
        reset: false,
        header_names: Vec::new(),
        grpc_status: None,
        grpc_fields: Vec::new(),
    }
}

fn answer(status: u16, headers: &[(&'static str, &str)], body: &str) -> Answer {
    let mut map = reqwest::header::HeaderMap::new();
    for (name, value) in headers {
        map.insert(*name, value.parse().unwrap());
    }
    Answer {
        status,
        headers: map,
        body: bytes::Bytes::from(body.to_string()),
    }
}

fn sent(tenant: &str, body: &str) -> Sent {
    Sent {
        scope: scope(tenant),
        path: "/pay",
        body: body.into(),
        knobs: vec![],
        at_ms: 0,
        outcome: Err(String::new()),
    }
}

fn verdict(s: &Sent, a: &Answer, execs: &[Execution], bodies: &[&str]) -> Option<String> {
    let refs: Vec<&Execution> = execs
        .iter()
        .filter(|e| execution_scope(e) == s.scope && !released(e))
        .collect();
    let by_n: HashMap<u64, &Execution> = execs.iter().map(|e| (e.n, e)).collect();
    check_answer(s, a, &refs, &by_n, bodies)
}

const REPLAYED: (&str, &str) = ("idempotent-replayed", "true");

#[test]
fn a_faithful_replay_and_a_fresh_answer_pass() {
    let e = [exec(1, "a", "A", 201)];
    let s = sent("a", "A");
    assert_eq!(
        verdict(&s, &answer(201, &[REPLAYED], "{\"execution\":1}"), &e, &["A"]),
        None
    );
    assert_eq!(
        verdict(&s, &answer(201, &[], "{\"execution\":1}"), &e, &["A"]),
        None
    );
}

#[test]
fn a_replay_with_other_bytes_or_for_another_body_is_a_violation() {
    let e = [exec(1, "a", "A", 201)];
    assert!(verdict(
        &sent("a", "A"),
        &answer(201, &[REPLAYED], "{\"execution\":2}"),
        &e,
        &["A"]
    )
    .is_some());
    assert!(verdict(
        &sent("a", "B"),
        &answer(201, &[REPLAYED], "{\"execution\":1}"),
        &e,
        &["A", "B"]
    )
    .is_some());
}

#[test]
fn another_tenants_execution_is_a_violation() {
    let e = [exec(1, "a", "A", 201)];
    assert!(verdict(
        &sent("b", "A"),
        &answer(201, &[], "{\"execution\":1}"),
        &e,
        &["A"]
    )
    .is_some());
}

#[test]
fn a_422_for_the_same_body_is_a_violation() {
    let problem = r#"{"type":"https://x/key-reused","title":"t","status":422,"detail":"d"}"#;
    let headers = [
        ("content-type", "application/problem+json"),
        ("cache-control", "no-store"),
    ];
    let a = answer(422, &headers, problem);
    assert!(verdict(&sent("a", "A"), &a, &[], &["A"]).is_some());
    assert_eq!(verdict(&sent("a", "B"), &a, &[], &["A", "B"]), None);
}

/// A generation claimed at `at` s; `end`: how and when (s) it ended, or
/// `None` for the current one, in `state`.
fn generation(n: u64, at: i64, state: &str, end: Option<i64>, status: Option<u16>) -> Generation {
    Generation {
        generation: n,
        state: state.into(),
        current: end.is_none(),
        created_at: at * 1_000,
        ended_at: end.map(|e| e * 1_000),
        // A 24 h TTL unless a test says otherwise.
        expires_at: status.map(|_| at * 1_000 + 86_400_000),
        archived_at: None,
        status,
        body_len: status.map(|_| 15),
        body_stored: status.map(|_| true),
    }
}

fn run(route: Route, execs: &[Execution], gens: &[Generation]) -> ScopeVerdict {
    let refs: Vec<&Execution> = execs.iter().collect();
    judge("a k", route, &refs, gens)
}

const CONFLICT: Route = ROUTES[0];
const RELEASE: Route = ROUTES[2];
const RENEW: Route = ROUTES[3];

#[test]
fn the_routes_match_the_bootstrap() {
    let yaml = std::fs::read_to_string(crate::repo_root().join("envoy/chaos.yaml")).unwrap();
    for r in ROUTES {
        assert!(yaml.contains(&format!("\"name\": \"{}\"", r.name)), "{}", r.name);
        let matched = if r.grpc { "exact" } else { "prefix" };
        assert!(
            yaml.contains(&format!("{{\"{matched}\": \"{}\"}}", r.path)),
            "{}",
            r.path
        );
        assert_eq!(route_of(r.path), r.name);
        assert_eq!(policy(r.name), r);
    }
    assert!(yaml.contains(r#""lease_seconds": 2, "on_unknown": "release"}"#));
    // The gRPC method: its policy, its route to the upstream over HTTP/2, and
    // the replay route (before the catch-all) to the store over HTTP/2.
    assert!(yaml.contains(r#""lease_seconds": 3, "grpc": {}}"#));
    let method = yaml.find(&format!("match: {{path: \"{}\"}}", GRPC.path)).unwrap();
    let replay = yaml
        .find("match: {path: \"/idemgate.v1.Store/Replay\", headers: [{name: x-idemgate-replay, present_match: true}]}")
        .unwrap();
    let catch_all = yaml.find("match: {prefix: \"/\"}").unwrap();
    assert!(method < catch_all && replay < catch_all);
    assert!(yaml.contains("codec_type: AUTO"));
    assert!(yaml.contains(&format!(
        r#""lease_seconds": {}, "forwarding": {{"mode": "detached", "timeout_ms": {DETACHED_TIMEOUT_MS}}}}}"#,
        DETACHED_LEASE_MS / 1_000
    )));
    assert!(yaml.contains(r#""lease_seconds": 3, "settle": "background"}"#));
    assert!(yaml.contains(&format!(r#""max_stored_body": {LARGE_STORED_BODY}}}"#)));
    assert!(yaml.contains(&format!(
        r#""ttl_seconds": {}, "after_expiry": "new"}}"#,
        RENEW_TTL_MS / 1_000
    )));
}

#[test]
fn running_again_after_a_stored_execution_is_a_double_execution() {
    let (one, two, refused) = (
        exec(1, "a", "A", 201),
        exec(2, "a", "A", 201),
        exec(2, "a", "A", 429),
    );
    // Twice in one generation, whatever the policy.
    for route in ROUTES {
        let v = run(
            route,
            &[one.clone(), two.clone()],
            &[generation(1, 1, "completed", None, Some(201))],
        );
        assert_eq!(v.double_executions.len(), 1, "{route:?}");
    }
    // Again in a new generation after a stored one: the store replaced a
    // live completion, and the scope ran twice.
    let gens = [
        generation(1, 1, "completed", Some(2), Some(201)),
        generation(2, 2, "completed", None, Some(201)),
    ];
    for route in ROUTES {
        let v = run(route, &[one.clone(), two.clone()], &gens);
        assert_eq!(v.double_executions.len(), 1, "{route:?}");
        assert_eq!(v.violations.len(), 1, "{route:?}: {v:?}");
    }
    // After a release: fine, and counted as a re-run.
    let gens = [
        generation(1, 0, "released", Some(1), None),
        generation(2, 1, "completed", None, Some(201)),
    ];
    let first = exec(0, "a", "A", 429);
    let v = run(CONFLICT, &[first, one.clone()], &gens);
    assert_eq!(
        v,
        ScopeVerdict {
            reruns: BTreeMap::from([("released", 1)]),
            owner: vec![Some(0), Some(1)],
            ..ScopeVerdict::default()
        }
    );
    // A stored execution, then a refused one in a new generation.
    let gens = [
        generation(1, 1, "released", Some(2), None),
        generation(2, 2, "completed", None, Some(429)),
    ];
    let v = run(CONFLICT, &[one.clone(), refused], &gens);
    assert_eq!(v.double_executions.len(), 1);
    // ... and the store released a generation whose upstream acted.
    assert_eq!(v.violations.len(), 1, "{v:?}");
}

#[test]
fn a_rerun_after_an_unknown_outcome_is_allowed_only_under_on_unknown_release() {
    let mut reset = exec(1, "a", "A", 201);
    reset.reset = true;
    reset.response = bytes::Bytes::new();
    let again = exec(2, "a", "A", 201);
    for ended in ["unknown", "lease_expired"] {
        let gens = [
            generation(1, 1, ended, Some(2), None),
            generation(2, 2, "completed", None, Some(201)),
        ];
        let v = run(RELEASE, &[reset.clone(), again.clone()], &gens);
        assert!(v.double_executions.is_empty() && v.violations.is_empty(), "{v:?}");
        assert_eq!(v.reruns, BTreeMap::from([("unknown", 1)]));
        for route in [CONFLICT, RENEW] {
            let v = run(route, &[reset.clone(), again.clone()], &gens);
            assert_eq!(v.double_executions.len(), 1, "{route:?} {ended}");
        }
    }
    // Under release, a generation that completed still may not run again.
    let gens = [
        generation(1, 1, "completed", Some(2), Some(201)),
        generation(2, 2, "completed", None, Some(201)),
    ];
    let v = run(RELEASE, &[exec(1, "a", "A", 201), again], &gens);
    assert_eq!(v.double_executions.len(), 1);
}

#[test]
fn a_rerun_after_expiry_is_allowed_only_under_after_expiry_new_and_only_once_expired() {
    let (one, two) = (exec(1, "a", "A", 201), exec(5, "a", "A", 201));
    let mut expired = generation(1, 1, "completed", Some(5), Some(201));
    expired.expires_at = Some(3_000);
    expired.archived_at = Some(3_500);
    let gens = [expired.clone(), generation(2, 5, "completed", None, Some(201))];
    let v = run(RENEW, &[one.clone(), two.clone()], &gens);
    assert!(v.double_executions.is_empty() && v.violations.is_empty(), "{v:?}");
    assert_eq!(v.reruns, BTreeMap::from([("expired", 1)]));
    for route in [CONFLICT, RELEASE] {
        assert_eq!(
            run(route, &[one.clone(), two.clone()], &gens)
                .double_executions
                .len(),
            1
        );
    }
    // Not yet expired when the next generation was claimed.
    let mut live = expired;
    live.expires_at = Some(6_000);
    live.archived_at = None;
    let v = run(
        RENEW,
        &[one, two],
        &[live, generation(2, 5, "completed", None, Some(201))],
    );
    assert_eq!(v.double_executions.len(), 1);
    assert_eq!(v.violations.len(), 1, "{v:?}");
}

#[test]
fn a_key_left_unknown_or_in_progress_with_no_execution_is_burnt() {
    for route in ROUTES {
        for state in ["unknown", "in_progress"] {
            let v = run(route, &[], &[generation(1, 1, state, None, None)]);
            assert_eq!(v.burnt.len(), 1, "{route:?} {state}");
            assert_eq!(v.burnt[0].1, 1_000);
        }
        // Its upstream ran (and reset): an honest unknown.
        let mut reset = exec(1, "a", "A", 201);
        reset.reset = true;
        let v = run(route, &[reset], &[generation(1, 1, "unknown", None, None)]);
        assert_eq!(
            v,
            ScopeVerdict {
                owner: vec![Some(0)],
                ..ScopeVerdict::default()
            }
        );
        // An earlier generation ran, the current one did not.
        let gens = [
            generation(1, 0, "released", Some(1), None),
            generation(2, 2, "unknown", None, None),
        ];
        let v = run(route, &[exec(0, "a", "A", 429)], &gens);
        assert_eq!(v.burnt.len(), 1, "{route:?}");
    }
}

#[test]
fn an_execution_of_an_abandoned_claim_or_with_no_claim_is_caught() {
    let gens = [
        generation(1, 1, "abandoned", Some(3), None),
        generation(2, 3, "completed", None, Some(201)),
    ];
    let v = run(CONFLICT, &[exec(1, "a", "A", 201), exec(3, "a", "A", 201)], &gens);
    assert_eq!(v.abandoned_executed.len(), 1, "{v:?}");
    // Nothing claimed before it ran.
    let v = run(
        CONFLICT,
        &[exec(1, "a", "A", 201)],
        &[generation(1, 2, "completed", None, Some(201))],
    );
    assert_eq!(v.owner, vec![None]);
    assert_eq!(v.violations.len(), 2, "{v:?}");
    // After its generation was released.
    let gens = [generation(1, 1, "released", Some(1), None)];
    let mut late = exec(1, "a", "A", 429);
    late.at_ms = 1_500;
    let v = run(CONFLICT, &[late], &gens);
    assert_eq!(v.violations.len(), 1, "{v:?}");
}

#[test]
fn envoys_own_502_to_504_problem_passes_and_others_do_not() {
    let reply = |status: u16| {
        answer(
            status,
            &[
                ("content-type", "application/problem+json"),
                ("cache-control", "no-store"),
            ],
            &format!(
                r#"{{"type":"about:blank","title":"upstream connect error","status":{status},"detail":"d"}}"#
            ),
        )
    };
    assert_eq!(verdict(&sent("a", "A"), &reply(503), &[], &["A"]), None);
    assert!(verdict(&sent("a", "A"), &reply(404), &[], &["A"]).is_some());
    assert!(verdict(&sent("a", "A"), &reply(500), &[], &["A"]).is_some());
}

#[test]
fn outcome_unknown_under_on_unknown_release_is_a_violation() {
    let problem = r#"{"type":"https://x/outcome-unknown","title":"t","status":409,"detail":"d"}"#;
    let headers = [
        ("content-type", "application/problem+json"),
        ("cache-control", "no-store"),
    ];
    let a = answer(409, &headers, problem);
    let mut s = sent("a", "A");
    assert_eq!(verdict(&s, &a, &[], &["A"]), None);
    s.scope.route = "payments.release";
    assert!(verdict(&s, &a, &[], &["A"]).is_some());
}

#[test]
fn a_5xx_that_is_not_a_problem_document_is_a_violation() {
    let plain = answer(503, &[("content-type", "text/plain")], "upstream connect error");
    assert!(verdict(&sent("a", "A"), &plain, &[], &["A"]).is_some());
}

#[test]
fn store_unavailable_outside_fault_windows_is_bounded() {
    // 1 of 100 answers outside the window: allowed; inside it: not counted.
    let mut audit = Audit {
        answered_at: (0..100).map(|i| (i * 10, i == 5)).collect(),
        ..Audit::default()
    };
    audit.answered_at.extend((0..50).map(|i| (20_000 + i, true)));
    audit.bound_unavailable(&[("store stall", 20_000, 21_500)]);
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    audit.answered_at.push((5_000, true));
    audit.bound_unavailable(&[("store stall", 20_000, 21_500)]);
    assert_eq!(audit.violations.len(), 1, "{:?}", audit.violations);
}

/// An execution of `route` whose response is `len` bytes of the test
/// upstream's large body (named by its `Location`).
fn large_exec(n: u64, route: Route, len: usize) -> Execution {
    Execution {
        path: route.path.into(),
        response: bytes::Bytes::from(vec![b'x'; len]),
        ..exec(n, "a", "A", 201)
    }
}

fn sent_to(route: Route) -> Sent {
    let mut s = sent("a", "A");
    s.scope.route = route.name;
    s.path = route.path;
    s
}

fn result_unavailable(original_status: u16) -> Answer {
    answer(
        409,
        &[
            ("content-type", "application/problem+json"),
            ("cache-control", "no-store"),
        ],
        &format!(
            r#"{{"type":"https://x/result-unavailable","title":"t","status":409,"detail":"d","original_status":{original_status}}}"#
        ),
    )
}

#[test]
fn result_unavailable_only_for_a_stored_response_longer_than_the_route_keeps() {
    let detached = ROUTES[4];
    let large = ROUTES[6];
    // Above 512 KiB on a default route: result-unavailable, with its status.
    let e = [large_exec(1, CONFLICT, STORED_BODY + 1)];
    assert_eq!(
        verdict(&sent("a", "A"), &result_unavailable(201), &e, &["A"]),
        None
    );
    assert!(verdict(&sent("a", "A"), &result_unavailable(200), &e, &["A"]).is_some());
    // At the limit it is kept, and must replay.
    let e = [large_exec(1, CONFLICT, STORED_BODY)];
    assert!(verdict(&sent("a", "A"), &result_unavailable(201), &e, &["A"]).is_some());
    // exports.large keeps 4 MiB: 600 KiB is no reason.
    let e = [large_exec(1, large, 600 * 1024)];
    assert!(verdict(&sent_to(large), &result_unavailable(201), &e, &["A"]).is_some());
    let e = [large_exec(1, large, LARGE_STORED_BODY + 1)];
    assert_eq!(
        verdict(&sent_to(large), &result_unavailable(201), &e, &["A"]),
        None
    );
    // Nothing executed: no result to be unavailable.
    assert!(verdict(&sent_to(detached), &result_unavailable(201), &[], &["A"]).is_some());
}

#[test]
fn a_large_answer_is_its_execution_by_location_and_detached_relays_at_most_its_limit() {
    let detached = ROUTES[4];
    let fresh = |e: &Execution| Answer {
        status: 201,
        headers: answer(201, &[("location", &format!("/pay/{}", e.n))], "").headers,
        body: e.response.clone(),
    };
    let e = [large_exec(1, CONFLICT, STORED_BODY + 1)];
    assert_eq!(verdict(&sent("a", "A"), &fresh(&e[0]), &e, &["A"]), None);
    // Another execution's bytes under this one's Location.
    let mut other = fresh(&e[0]);
    other.body = bytes::Bytes::from(vec![b'x'; 10]);
    assert!(verdict(&sent("a", "A"), &other, &e, &["A"]).is_some());
    // Detached relays up to 1 MiB; a longer response is never relayed.
    let e = [large_exec(1, detached, RELAYED_BODY)];
    assert_eq!(verdict(&sent_to(detached), &fresh(&e[0]), &e, &["A"]), None);
    let e = [large_exec(1, detached, RELAYED_BODY + 1)];
    assert!(verdict(&sent_to(detached), &fresh(&e[0]), &e, &["A"]).is_some());
    assert_eq!(
        verdict(&sent_to(detached), &result_unavailable(201), &e, &["A"]),
        None
    );
}

#[test]
fn a_record_keeps_its_body_exactly_when_the_route_allows() {
    let record = |stored: bool, len: Option<u64>| Generation {
        body_stored: Some(stored),
        body_len: len,
        ..generation(1, 0, "completed", None, Some(201))
    };
    let small = large_exec(1, CONFLICT, STORED_BODY);
    let big = large_exec(1, CONFLICT, STORED_BODY + 1);
    let kept = Some(STORED_BODY as u64);
    assert!(run(CONFLICT, std::slice::from_ref(&small), &[record(true, kept)])
        .violations
        .is_empty());
    assert_eq!(
        run(CONFLICT, &[small], &[record(false, None)]).violations.len(),
        1
    );
    assert!(run(CONFLICT, std::slice::from_ref(&big), &[record(false, None)])
        .violations
        .is_empty());
    let v = run(CONFLICT, &[big], &[record(true, Some(STORED_BODY as u64 + 1))]);
    assert_eq!(v.violations.len(), 1, "{v:?}");
}

#[test]
fn a_detached_request_whose_client_left_must_complete_unless_a_fault_lost_it() {
    let left = |arrived: Option<i64>, delay: i64, lease_ran_out: bool| LeftDetached {
        what: "k".into(),
        claimed_at: 10_000,
        delay_ms: delay,
        arrived_after_ms: arrived,
        upstream_reset: false,
        lease_ran_out,
    };
    let faults = |windows: Vec<(&'static str, i64, i64)>| Faults {
        windows,
        ..Faults::default()
    };
    let judged = |l: LeftDetached, f: &Faults| {
        let mut audit = Audit {
            left_detached_not_completed: vec![l],
            ..Audit::default()
        };
        let excused = audit.judge_left_detached(f);
        (excused.len(), audit.violations.len())
    };
    let none = faults(vec![]);
    // No fault, a short upstream: the filter gave the request up.
    assert_eq!(judged(left(Some(5), 1_000, false), &none), (0, 1));
    // Its upstream ran into the timeout.
    assert_eq!(judged(left(Some(5), 3_950, false), &none), (1, 0));
    // An upstream reset or an Envoy kill while it was in flight.
    for name in ["upstream reset", "Envoy SIGKILL"] {
        let f = faults(vec![(name, 11_000, 11_300)]);
        assert_eq!(judged(left(Some(5), 1_000, false), &f), (1, 0), "{name}");
    }
    // A store fault excuses only a lease that ran out, and only nearby.
    let stall = faults(vec![("store stall", 12_000, 13_500)]);
    assert_eq!(judged(left(Some(5), 1_000, true), &stall), (1, 0));
    assert_eq!(judged(left(Some(5), 1_000, false), &stall), (0, 1));
    let later = faults(vec![("upstream reset", 30_000, 30_000)]);
    assert_eq!(judged(left(Some(5), 1_000, false), &later), (0, 1));
}

/// The filter's own answer to a gRPC call, as `idemgate_core::grpc::answer`
/// writes it (trailers-only: everything in the headers).
fn grpc_problem(problem: &idemgate_core::problem::Problem) -> Answer {
    let reply = idemgate_core::grpc::answer(problem);
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in &reply.headers {
        let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).unwrap();
        headers.append(name, value.parse().unwrap());
    }
    Answer {
        status: reply.status,
        headers,
        body: bytes::Bytes::from(reply.body),
    }
}

/// A gRPC execution of the upstream: one message and `grpc-status: 0` in
/// the trailers, or, for another status, trailers-only.
fn grpc_exec(n: u64, body: &str, code: u8) -> Execution {
    let (response, fields) = if code == 0 {
        let message = format!("{{\"execution\":{n}}}");
        (
            traffic::grpc_frame(message.as_bytes()),
            vec![("grpc-status".to_string(), "0".to_string())],
        )
    } else {
        let fields = vec![
            ("content-type".to_string(), "application/grpc".to_string()),
            ("grpc-status".to_string(), code.to_string()),
            (
                "grpc-message".to_string(),
                format!("acted, then failed: execution {n}"),
            ),
        ];
        (Vec::new(), fields)
    };
    Execution {
        path: GRPC.path.into(),
        status: 200,
        response: bytes::Bytes::from(response),
        grpc_status: Some(code),
        grpc_fields: fields,
        ..exec(n, "a", body, 200)
    }
}

/// The answer a gRPC client reads for `e`: headers, then its trailers.
fn grpc_answer_of(e: &Execution, extra: &[(&'static str, &str)]) -> Answer {
    let mut a = answer(200, extra, "");
    if e.grpc_fields.iter().all(|(n, _)| n != "content-type") {
        a.headers
            .insert("content-type", "application/grpc".parse().unwrap());
    }
    for (name, value) in &e.grpc_fields {
        let name = reqwest::header::HeaderName::from_bytes(name.as_bytes()).unwrap();
        a.headers.append(name, value.parse().unwrap());
    }
    a.body = e.response.clone();
    a
}

fn sent_grpc(body: &str) -> Sent {
    sent_to(GRPC).with_body(body)
}

impl Sent {
    fn with_body(mut self, body: &str) -> Sent {
        self.body = body.into();
        self
    }
}

#[test]
fn a_grpc_answer_is_read_by_its_status_and_error_info() {
    use idemgate_core::problem::Problem;
    // The filter's answers: the reason of the ErrorInfo, in the contract's
    // spelling, and its status per §10.
    let busy = grpc_problem(&Problem::request_in_progress(1500));
    assert_eq!(
        answers::error_info(&busy),
        Some(("REQUEST_IN_PROGRESS".to_string(), "idemgate.dev".to_string()))
    );
    assert_eq!(answers::problem_of(&busy).as_deref(), Some("request-in-progress"));
    assert_eq!(answers::grpc_status(&busy), Some(10));
    let s = sent_grpc("A");
    assert_eq!(verdict(&s, &busy, &[], &["A"]), None);
    for (problem, fits) in [
        (Problem::outcome_unknown(), true),
        (Problem::store_unavailable().retry_after_ms(500), true),
        // The same message under the key: not another request.
        (Problem::key_reused(), false),
        // Nothing was stored, so nothing is unavailable.
        (Problem::result_unavailable(200, 0), false),
        // Never an answer to a well-formed chaos call.
        (Problem::key_missing("POST", GRPC.path), false),
    ] {
        let a = grpc_problem(&problem);
        assert_eq!(
            verdict(&s, &a, &[], &["A"]).is_none(),
            fits,
            "{:?}",
            answers::problem_of(&a)
        );
    }
    assert_eq!(
        verdict(
            &sent_grpc("B"),
            &grpc_problem(&Problem::key_reused()),
            &[],
            &["A", "B"]
        ),
        None
    );
    // An unknown outcome under on_unknown: release is a violation, as over HTTP.
    let mut release = sent_grpc("A");
    release.scope.route = ROUTES[2].name;
    let mut unknown = grpc_problem(&Problem::outcome_unknown());
    assert!(verdict(&release, &unknown, &[], &["A"]).is_some());
    // The right reason under another status is a violation too.
    unknown.headers.insert("grpc-status", "9".parse().unwrap());
    assert!(verdict(&s, &unknown, &[], &["A"]).is_some());
    // An HTTP problem is still read as one.
    let http = answer(
        409,
        &[("content-type", "application/problem+json")],
        r#"{"type":"https://x/outcome-unknown"}"#,
    );
    assert_eq!(answers::problem_of(&http).as_deref(), Some("outcome-unknown"));
}

#[test]
fn a_grpc_replay_must_equal_its_execution_in_messages_and_status() {
    let ok = grpc_exec(1, "A", 0);
    let s = sent_grpc("A");
    let e = [ok.clone()];
    // The fresh answer, and its replay.
    assert_eq!(verdict(&s, &grpc_answer_of(&ok, &[]), &e, &["A"]), None);
    assert_eq!(verdict(&s, &grpc_answer_of(&ok, &[REPLAYED]), &e, &["A"]), None);
    // Other message bytes, or another status, under the same execution.
    let mut other = grpc_answer_of(&ok, &[REPLAYED]);
    other.body = bytes::Bytes::from(traffic::grpc_frame(b"{\"execution\":1} "));
    assert!(verdict(&s, &other, &e, &["A"]).is_some());
    let mut status = grpc_answer_of(&ok, &[REPLAYED]);
    status.headers.insert("grpc-status", "13".parse().unwrap());
    assert!(verdict(&s, &status, &e, &["A"]).is_some());
    // A replay for another message.
    assert!(verdict(
        &sent_grpc("B"),
        &grpc_answer_of(&ok, &[REPLAYED]),
        &e,
        &["A", "B"]
    )
    .is_some());
    // A trailers-only status after acting, by its grpc-message; and its
    // replay, whose status comes in the trailers.
    let failed = grpc_exec(2, "A", 13);
    let e = [failed.clone()];
    let fresh = grpc_answer_of(&failed, &[]);
    assert_eq!(answers::execution_number(&fresh), Some(2));
    assert_eq!(verdict(&s, &fresh, &e, &["A"]), None);
    assert_eq!(
        verdict(&s, &grpc_answer_of(&failed, &[REPLAYED]), &e, &["A"]),
        None
    );
    let mut lost = grpc_answer_of(&failed, &[]);
    lost.headers.remove("grpc-message");
    assert!(verdict(&s, &lost, &e, &["A"]).is_some());
    // RESOURCE_EXHAUSTED is refused before acting: released, never replayed.
    let refused = grpc_exec(3, "A", 8);
    assert!(released(&refused) && !released(&failed) && !released(&ok));
    assert!(verdict(&s, &grpc_answer_of(&refused, &[REPLAYED]), &[refused], &["A"]).is_some());
    // Envoy's own UNAVAILABLE carries its problem document; a bare one, or
    // a reply that is not gRPC at all, is a violation.
    let envoys = answer(
        200,
        &[
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("cache-control", "no-store"),
            (
                "grpc-message",
                "{\"type\":\"about:blank\",\"title\":\"upstream connect error\",\"status\":503,\"detail\":\"upstream_reset_before_response_started%7Breset%7D\"}",
            ),
        ],
        "",
    );
    assert_eq!(verdict(&s, &envoys, &[], &["A"]), None);
    let bare = answer(
        200,
        &[("content-type", "application/grpc"), ("grpc-status", "14")],
        "",
    );
    assert!(verdict(&s, &bare, &[], &["A"]).is_some());
    let http = answer(503, &[("content-type", "text/plain")], "no healthy upstream");
    assert!(verdict(&s, &http, &[], &["A"]).is_some());
}

#[test]
fn a_grpc_record_keeps_the_messages_and_a_trailer_frame() {
    for e in [grpc_exec(1, "A", 0), grpc_exec(2, "A", 13)] {
        let mut stored = e.response.to_vec();
        let trailers: Vec<_> = e
            .grpc_fields
            .iter()
            .filter(|(n, _)| n.starts_with("grpc-"))
            .cloned()
            .collect();
        idemgate_core::grpc::append_trailers(&mut stored, &trailers);
        assert_eq!(judge::stored_len(&e), stored.len(), "{e:?}");
        let record = Generation {
            status: Some(200),
            body_len: Some(stored.len() as u64),
            ..generation(1, 0, "completed", None, Some(200))
        };
        let v = run(GRPC, std::slice::from_ref(&e), std::slice::from_ref(&record));
        assert!(v.violations.is_empty(), "{v:?}");
        // Without the trailer frame, the record is not the response.
        let short = Generation {
            body_len: Some(e.response.len() as u64),
            ..record
        };
        assert_eq!(run(GRPC, &[e], &[short]).violations.len(), 1);
    }
}
