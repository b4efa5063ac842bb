//! One test per row of the contract's answer table (contract §4) and stored
//! outcomes (§5), plus concurrency, hostile input and store failure, all
//! through the real Envoy with the real store behind it.

use std::time::Duration;

use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, poll, send, Answer, Harness};

use e2e::fresh_key as key;

fn assert_problem(answer: &Answer, status: u16, slug: &str) {
    assert_eq!(answer.status, status, "status of {answer:?}");
    assert_eq!(
        answer.problem().as_deref(),
        Some(slug),
        "problem type of {answer:?}"
    );
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    let link = answer.header("link").unwrap_or_default();
    assert!(
        link.contains(slug) && link.ends_with("rel=\"describedby\""),
        "link header {link:?}"
    );
    assert_eq!(answer.json()["status"], status);
    // The retry hints SDKs obey, on every problem.
    let retry = if matches!(
        slug,
        "request-in-progress" | "store-unavailable" | "key-rate-limited"
    ) {
        "true"
    } else {
        "false"
    };
    assert_eq!(answer.header("x-should-retry"), Some(retry), "{answer:?}");
    assert_eq!(answer.header("stripe-should-retry"), Some(retry), "{answer:?}");
}

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR", "client_time": "10:00"}"#;

#[tokio::test(flavor = "multi_thread")]
async fn each_worker_logs_the_modules_version_when_configured() {
    let h = Harness::start().await;
    let line = format!("idemgate {} configured:", env!("CARGO_PKG_VERSION"));
    assert!(h.envoy_log().contains(&line), "Envoy's log lacks {line:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_route_no_policy_covers_is_untouched() {
    let h = Harness::start().await;
    let k = key("free");
    for _ in 0..2 {
        let a = send(h.post("/free", Some(&k), PAYMENT)).await;
        assert_eq!(a.status, 201);
        assert!(a.header("idempotent-replayed").is_none());
    }
    assert_eq!(h.upstream.executions(&k), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_required_key_is_rejected_without_calling_the_upstream() {
    let h = Harness::start().await;
    let a = send(h.post("/pay", None, PAYMENT)).await;
    assert_problem(&a, 400, "key-missing");
    assert_eq!(h.upstream.total(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_optional_key_passes_without_dedupe() {
    let h = Harness::start().await;
    for _ in 0..2 {
        assert_eq!(send(h.post("/optional", None, PAYMENT)).await.status, 201);
    }
    assert_eq!(h.upstream.executions(""), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_and_repeated_keys_are_rejected() {
    let h = Harness::start().await;
    let long = "k".repeat(256);
    for bad in ["", "\"\"", "\"unterminated", "has space", &long] {
        let a = send(h.post("/pay", Some(bad), PAYMENT)).await;
        assert_problem(&a, 400, "key-invalid");
    }
    let twice = h
        .post("/pay", None, PAYMENT)
        .header("idempotency-key", "one")
        .header("idempotency-key", "two");
    assert_problem(&send(twice).await, 400, "key-invalid");
    let strict = send(h.post("/strict", Some("bare-token"), PAYMENT)).await;
    assert_problem(&strict, 400, "key-invalid");
    assert_eq!(h.upstream.total(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_completed_key_replays_the_stored_response_byte_for_byte() {
    let h = Harness::start().await;
    let k = key("pay");
    let first = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_eq!(first.status, 201);
    assert!(first.header("set-cookie").is_some());
    // Same key, same request in another JSON spelling and a changed excluded field.
    let respelled = r#"{ "currency":"EUR","amount":4200.0, "client_time": "10:05" }"#;
    let quoted = format!("\"{k}\"");
    let again = send(h.post("/pay", Some(&quoted), respelled)).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    for name in ["location", "content-type", "x-payment-id"] {
        assert_eq!(again.header(name), first.header(name), "{name}");
    }
    assert!(again.header("set-cookie").is_none());
    assert!(again.header("x-not-replayed").is_none());
    assert_eq!(h.upstream.executions(&k), 1);
    eventually("the replay to be counted", Duration::from_secs(10), || async {
        h.counter("requests_replayed").await == 1 && h.counter("records_completed").await == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reused_key_with_another_request_gets_422_in_every_state() {
    let h = Harness::start().await;
    let k = key("reuse");
    let slow = h
        .post("/pay", Some(&k), PAYMENT)
        .header("x-test-delay-ms", "1500");
    let first = tokio::spawn(send(slow));
    let executed = || async { h.upstream.executions(&k) == 1 };
    eventually(
        "the first request to reach the upstream",
        Duration::from_secs(10),
        executed,
    )
    .await;
    // In progress: 422 is checked before 409.
    let other = r#"{"amount": 1, "currency": "EUR"}"#;
    assert_problem(&send(h.post("/pay", Some(&k), other)).await, 422, "key-reused");
    assert_eq!(first.await.map(|a| a.status).ok(), Some(201));
    assert_problem(&send(h.post("/pay", Some(&k), other)).await, 422, "key-reused");
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_in_progress_gets_409_with_retry_after() {
    let h = Harness::start().await;
    let k = key("busy");
    let first = tokio::spawn(send(
        h.post("/pay", Some(&k), PAYMENT)
            .header("x-test-delay-ms", "1500"),
    ));
    eventually(
        "the first request to reach the upstream",
        Duration::from_secs(10),
        || async { h.upstream.executions(&k) == 1 },
    )
    .await;
    let busy = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_problem(&busy, 409, "request-in-progress");
    // A short hint, not the 60 s left of the lease.
    assert_eq!(busy.header("retry-after"), Some("1"));
    let retry_ms: u64 = busy
        .header("retry-after-ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((1..=1_000).contains(&retry_ms), "retry-after-ms {retry_ms}");
    assert_eq!(first.await.map(|a| a.status).ok(), Some(201));
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn under_wait_an_in_progress_key_gets_the_result_when_it_is_ready() {
    let h = Harness::start().await;
    let k = key("wait");
    let first = tokio::spawn(send(
        h.post("/wait", Some(&k), PAYMENT)
            .header("x-test-delay-ms", "800"),
    ));
    eventually(
        "the first request to reach the upstream",
        Duration::from_secs(10),
        || async { h.upstream.executions(&k) == 1 },
    )
    .await;
    let waited = send(h.post("/wait", Some(&k), PAYMENT)).await;
    let first = first.await.ok();
    assert_eq!(waited.status, 201);
    assert_eq!(waited.header("idempotent-replayed"), Some("true"));
    assert_eq!(Some(&waited.body), first.as_ref().map(|a| &a.body));
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_simultaneous_duplicates_execute_once() {
    let h = Harness::start().await;
    let k = key("herd");
    let mut all = Vec::new();
    for _ in 0..50 {
        all.push(tokio::spawn(send(
            h.post("/pay", Some(&k), PAYMENT).header("x-test-delay-ms", "500"),
        )));
    }
    let (mut created, mut conflicts) = (0, 0);
    for task in all {
        match task.await.ok() {
            Some(a) if a.status == 201 && a.header("idempotent-replayed").is_none() => created += 1,
            Some(a) if a.status == 201 => {}
            Some(a) => {
                assert_problem(&a, 409, "request-in-progress");
                conflicts += 1;
            }
            None => panic!("a request task failed"),
        }
    }
    assert_eq!(created, 1);
    assert!(conflicts >= 1);
    assert_eq!(h.upstream.executions(&k), 1);
}

/// Each worker sends the claims and completions that arrive while its
/// store callout is in flight as one batch when it returns.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_new_keys_share_store_callouts_and_each_executes_once() {
    let h = Harness::start().await;
    let callouts = || async {
        let stats = h
            .admin_text("/stats?filter=^cluster.idempotency_store.upstream_rq_total$")
            .await;
        stats
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no store request counter in {stats:?}"))
    };
    let before = callouts().await;
    let keys: Vec<String> = (0..120).map(|i| key(&format!("batch-{i}"))).collect();
    let mut all = Vec::new();
    for k in &keys {
        all.push(tokio::spawn(send(h.post("/pay", Some(k), PAYMENT))));
    }
    for task in all {
        let a = task.await.unwrap();
        assert_eq!(a.status, 201, "{a:?}");
        assert!(a.header("idempotent-replayed").is_none());
    }
    for k in &keys {
        assert_eq!(h.upstream.executions(k), 1);
        let replay = send(h.post("/pay", Some(k), PAYMENT)).await;
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    // 120 claims and 120 completions at once, then 120 replayed claims one
    // by one (each alone). Unbatched, that is 360 callouts.
    let made = callouts().await - before;
    assert!(
        made <= 120 + 120,
        "{made} store callouts for 360 calls: the concurrent 240 were not batched"
    );
}

/// `settle: background`: the answer does not wait for the store; the
/// worker's store client records the outcome right after, even when the
/// store stalls just then, and a retry replays it. (Waiting for the store,
/// the completion would time out during the stall and the record stay in
/// progress until its lease ran out.)
#[tokio::test(flavor = "multi_thread")]
async fn with_settle_background_the_outcome_is_recorded_after_the_answer() {
    let h = Harness::start().await;
    let k = key("background");
    let post = |delay: &str| {
        h.client
            .post(h.url("/background"))
            .header("idempotency-key", &k)
            .header("x-test-delay-ms", delay)
            .body(PAYMENT)
    };
    let first = tokio::spawn(send(post("600")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.signal_store(0, true);
    let first = first.await.unwrap();
    h.signal_store(0, false);
    assert_eq!(first.status, 201, "{first:?}");
    let replay = poll(
        "the completion to be recorded",
        Duration::from_secs(5),
        || async {
            let a = send(post("0")).await;
            match (a.status, a.problem().as_deref()) {
                (409, Some("request-in-progress")) => None,
                _ => Some(a),
            }
        },
    )
    .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_key_from_another_tenant_or_on_another_route_is_another_record() {
    let h = Harness::start().await;
    let k = key("shared");
    let a = send(h.post("/pay", Some(&k), PAYMENT)).await;
    let b = send(h.post_as("tenant-b", "alice", "/pay", Some(&k), PAYMENT)).await;
    let c = send(h.post_as("tenant-a", "bob", "/pay", Some(&k), PAYMENT)).await;
    let d = send(h.post("/refund", Some(&k), PAYMENT)).await;
    for other in [&b, &c, &d] {
        assert_eq!(other.status, 201);
        assert!(other.header("idempotent-replayed").is_none());
        assert_ne!(other.header("location"), a.header("location"));
    }
    assert_eq!(h.upstream.executions(&k), 4);
    let nobody = send(h.post_as("", "alice", "/pay", Some(&k), PAYMENT)).await;
    assert_problem(&nobody, 400, "identity-missing");
    let ambiguous = h
        .post("/pay", Some(&k), PAYMENT)
        .header("x-tenant-id", "tenant-b");
    assert_problem(&send(ambiguous).await, 400, "identity-missing");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_expired_key_is_rejected_or_renewed_as_the_policy_says() {
    let h = Harness::start().await;
    let (k1, k2) = (key("ttl"), key("renew"));
    assert_eq!(send(h.post("/ttl", Some(&k1), PAYMENT)).await.status, 201);
    assert_eq!(send(h.post("/renew", Some(&k2), PAYMENT)).await.status, 201);
    let expired = poll("the key to expire", Duration::from_secs(10), || async {
        let a = send(h.post("/ttl", Some(&k1), PAYMENT)).await;
        (a.status != 201).then_some(a)
    })
    .await;
    assert_problem(&expired, 422, "key-expired");
    assert!(expired.json()["completed_at"].is_string());
    eventually(
        "the renewable key to run again",
        Duration::from_secs(10),
        || async {
            send(h.post("/renew", Some(&k2), PAYMENT)).await;
            h.upstream.executions(&k2) == 2
        },
    )
    .await;
    assert_eq!(h.upstream.executions(&k1), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_the_upstream_produced_are_stored_and_replayed() {
    let h = Harness::start().await;
    for status in ["404", "500"] {
        let k = key(status);
        let first = send(h.post("/pay", Some(&k), PAYMENT).header("x-test-status", status)).await;
        let again = send(h.post("/pay", Some(&k), PAYMENT)).await;
        assert_eq!(again.status.to_string(), status);
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        assert_eq!(again.body, first.body);
        assert_eq!(h.upstream.executions(&k), 1);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_before_acting_release_the_key() {
    let h = Harness::start().await;
    let cases = [
        ("/pay", "x-test-status", "429"),
        ("/pay", "x-test-status", "408"),
        ("/pay", "x-test-status", "400"),
        ("/pay", "x-test-status", "401"),
        ("/pay", "x-test-status", "403"),
        ("/pay", "x-test-status", "422"),
        ("/pay", "x-test-control", "no-store"),
        ("/accounts/7/charges", "x-test-status", "503"),
    ];
    for (path, knob, value) in cases {
        let k = key("release");
        let first = send(h.post(path, Some(&k), PAYMENT).header(knob, value)).await;
        assert!(first.header("idempotency-control").is_none());
        let again = send(h.post(path, Some(&k), PAYMENT)).await;
        assert_eq!(again.status, 201, "{path} {knob}={value}");
        assert!(again.header("idempotent-replayed").is_none());
        assert_eq!(h.upstream.executions(&k), 2, "{path} {knob}={value}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_uncertain_upstream_makes_the_outcome_unknown() {
    let h = Harness::start().await;
    let k = key("uncertain");
    let first = send(
        h.post("/pay", Some(&k), PAYMENT)
            .header("x-test-control", "uncertain"),
    )
    .await;
    assert_eq!(first.status, 201);
    assert!(first.header("idempotency-control").is_none());
    let again = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_problem(&again, 409, "outcome-unknown");
    assert!(again.header("retry-after").is_none());
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_reset_or_timeout_after_forwarding_makes_the_outcome_unknown() {
    let h = Harness::start().await;
    let reset = key("reset");
    let first = send(h.post("/pay", Some(&reset), PAYMENT).header("x-test-reset", "1")).await;
    assert!(first.status >= 500, "{first:?}");
    let timeout = key("timeout");
    let slow = send(
        h.post("/timeout", Some(&timeout), PAYMENT)
            .header("x-test-delay-ms", "2500"),
    )
    .await;
    assert_eq!(slow.status, 504);
    for (path, k) in [("/pay", &reset), ("/timeout", &timeout)] {
        let again = send(h.post(path, Some(k), PAYMENT)).await;
        assert_problem(&again, 409, "outcome-unknown");
        assert_eq!(h.upstream.executions(k), 1);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_never_reached_releases_the_key() {
    let h = Harness::start().await;
    let k = key("unreachable");
    for _ in 0..2 {
        let a = send(h.post("/unreachable", Some(&k), PAYMENT)).await;
        assert_eq!(a.status, 503);
        // Envoy's own reply, rendered as a problem by local_reply_config; the
        // retry reached the router again instead of meeting a conflict.
        assert_eq!(a.problem().as_deref(), Some("about:blank"), "{a:?}");
    }
}

/// Envoy's own replies as the reference bootstraps render them: a problem
/// document for every HTTP request, whether or not it has a body or a
/// content-type, and a gRPC status for a gRPC call.
#[tokio::test(flavor = "multi_thread")]
async fn envoys_own_replies_are_problems_for_any_http_request_and_statuses_for_grpc_calls() {
    fn assert_envoys_problem(what: &str, a: &Answer, status: u16) {
        assert_eq!(a.status, status, "{what}: {a:?}");
        assert_eq!(a.problem().as_deref(), Some("about:blank"), "{what}: {a:?}");
        assert_eq!(a.header("cache-control"), Some("no-store"), "{what}: {a:?}");
        assert_eq!(a.json()["status"], status, "{what}: {a:?}");
    }
    let h = Harness::start().await;
    let bare = send(h.client.get(h.url("/unreachable"))).await;
    assert_envoys_problem("envoy/e2e.yaml, no healthy upstream", &bare, 503);

    // The demo's bootstrap leaves paths unrouted and tells gRPC calls apart.
    let mut options = Options::new("envoy/demo.yaml", Database::Sqlite, 1);
    options.api_token = "demo-api-token";
    let demo = Stack::start(options).await;
    let token = std::fs::read_to_string(e2e::repo_root().join("examples/tokens/tenant-a.jwt")).unwrap();
    let get = |path: &str| demo.client.get(demo.url(path)).bearer_auth(token.trim());
    let post = |path: &str| demo.client.post(demo.url(path)).bearer_auth(token.trim());
    let bare = send(get("/nowhere")).await;
    assert_envoys_problem("no route, no body, no content-type", &bare, 404);
    let json = send(
        post("/nowhere")
            .header("content-type", "application/json")
            .body("{}"),
    )
    .await;
    assert_envoys_problem("no route, a JSON body", &json, 404);
    for content_type in ["application/grpc", "application/grpc+proto"] {
        let grpc = send(
            post("/nowhere.v1.Service/Call")
                .header("content-type", content_type)
                .header("te", "trailers")
                .body(vec![0u8; 5]),
        )
        .await;
        assert_eq!(grpc.status, 200, "{content_type}: {grpc:?}");
        assert_eq!(grpc.header("content-type"), Some("application/grpc"), "{grpc:?}");
        assert_eq!(grpc.header("grpc-status"), Some("12"), "UNIMPLEMENTED: {grpc:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_acted_before_refusing_can_force_storing() {
    let h = Harness::start().await;
    let k = key("store-401");
    let first = send(
        h.post("/pay", Some(&k), PAYMENT)
            .header("x-test-status", "401")
            .header("x-test-control", "store"),
    )
    .await;
    assert_eq!(first.status, 401);
    assert!(first.header("idempotency-control").is_none());
    let again = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_eq!(again.status, 401);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn envoys_replies_that_never_reached_the_upstream_release_the_key() {
    let h = Harness::start().await;
    // Circuit breaker overflow and a direct response: answered by Envoy after
    // the claim, each retry is answered again rather than 409 outcome-unknown.
    for path in ["/overflow", "/direct"] {
        let k = key(path);
        for _ in 0..2 {
            let a = send(h.post(path, Some(&k), PAYMENT)).await;
            assert!(
                !matches!(
                    a.problem().as_deref(),
                    Some("outcome-unknown" | "request-in-progress")
                ),
                "{path}: {a:?}"
            );
            assert!(a.header("idempotent-replayed").is_none(), "{path}: {a:?}");
        }
        assert!(
            h.current_record("*", "*", path.trim_start_matches('/'), &k)
                .await
                .is_null(),
            "{path}"
        );
    }
    let overflow = send(h.post("/overflow", Some(&key("o")), PAYMENT)).await;
    assert_eq!(overflow.status, 503);
    let direct = send(h.post("/direct", Some(&key("d")), PAYMENT)).await;
    assert_eq!(
        (direct.status, direct.body.as_ref()),
        (200, &b"{\"maintenance\": true}"[..])
    );
    // A local rate limit placed after idemgate: its 429 releases the key.
    let mut limited = None;
    for i in 0..6 {
        let k = key(&format!("rl-{i}"));
        let a = send(h.post("/ratelimited", Some(&k), PAYMENT)).await;
        if a.status == 429 {
            limited = Some(k);
            break;
        }
    }
    let k = limited.unwrap_or_else(|| panic!("no request was rate limited"));
    let again = send(h.post("/ratelimited", Some(&k), PAYMENT)).await;
    assert_eq!(again.status, 429, "{again:?}");
    assert_ne!(again.problem().as_deref(), Some("outcome-unknown"));
    assert_eq!(h.upstream.executions(&k), 0);
    assert!(h.current_record("*", "*", "ratelimited", &k).await.is_null());
}

#[tokio::test(flavor = "multi_thread")]
async fn every_answer_to_a_valid_key_echoes_it() {
    let h = Harness::start().await;
    let k = key("echo");
    let sf = format!("\"{k}\"");
    let first = send(h.post("/pay", Some(&k), PAYMENT)).await;
    let replay = send(h.post("/pay", Some(&sf), PAYMENT)).await;
    let problem = send(h.post("/pay", Some(&k), "{}")).await;
    assert_problem(&problem, 422, "key-reused");
    for a in [&first, &replay, &problem] {
        assert_eq!(a.header("idempotency-key"), Some(sf.as_str()), "{a:?}");
    }
    for path in ["/observe", "/open", "/optional"] {
        let a = send(h.post(path, Some(&k), PAYMENT)).await;
        assert_eq!(a.header("idempotency-key"), Some(sf.as_str()), "{path}");
    }
    // No valid key: nothing to echo.
    let bad = send(h.post("/pay", Some("has space"), PAYMENT)).await;
    assert!(bad.header("idempotency-key").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_control_never_reaches_the_client_in_any_mode() {
    let h = Harness::start().await;
    for (path, k) in [
        ("/observe", Some(key("c-observe"))),
        ("/optional", None),
        ("/optional", Some(key("c-optional"))),
        ("/pay", Some(key("c-pay"))),
    ] {
        let a = send(
            h.post(path, k.as_deref(), PAYMENT)
                .header("x-test-control", "uncertain"),
        )
        .await;
        assert_eq!(a.status, 201, "{path}");
        assert!(a.header("idempotency-control").is_none(), "{path} {k:?}");
    }
    // Fail-open: the store is down, the request is forwarded.
    let mut h = h;
    h.kill_store(0);
    let a = send(
        h.post("/open", Some(&key("c-open")), PAYMENT)
            .header("x-test-control", "store"),
    )
    .await;
    assert_eq!(a.status, 201);
    assert!(a.header("idempotency-control").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_refuses_the_filters_frames_is_a_counted_configuration_error() {
    // The filter holds another token than the store: every call gets 401.
    let h =
        Harness::start_with(|c| c.replace("\"token\": \"e2e-api-token\"", "\"token\": \"not-the-token\""))
            .await;
    let k = key("refused");
    let a = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_problem(&a, 503, "store-unavailable");
    assert_eq!(h.upstream.executions(&k), 0);
    eventually(
        "the configuration error to be counted",
        Duration::from_secs(10),
        || async { h.counter("config_errors").await >= 1 },
    )
    .await;
    assert!(h.envoy_log().contains("the store refused a call with 401"));
}

/// The filter times its own store callouts in microseconds: Envoy's
/// `upstream_rq_time` of the store's cluster counts whole milliseconds.
#[tokio::test(flavor = "multi_thread")]
async fn the_filter_times_its_store_callouts_in_microseconds() {
    let h = Harness::start().await;
    let k = key("timed");
    let a = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_eq!(a.status, 201);
    // A claim and a completion; Envoy merges the workers' histograms when
    // its stats are flushed.
    let (count, sum) = poll(
        "the store callouts to be timed",
        Duration::from_secs(15),
        || async {
            let text = h.admin_text("/stats/prometheus").await;
            // `name{} value`: Envoy writes the empty label set.
            let value = |name: &str| {
                text.lines().find_map(|l| {
                    l.strip_prefix(name)?
                        .trim_start_matches("{}")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
            };
            let count = value("idemgate_store_call_time_count")?;
            let sum = value("idemgate_store_call_time_sum")?;
            (count >= 2.0).then_some((count, sum))
        },
    )
    .await;
    let mean = sum / count;
    // Microseconds: more than one, far less than the call's timeout.
    assert!(
        mean > 1.0 && mean < 1_000_000.0,
        "{count} callouts, mean {mean} µs"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_spelling_of_a_covered_path_executes_once_on_express() {
    let port = e2e::free_port();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let _app = e2e::express(port, dir.path());
    let h = Harness::start_with(move |c| c.replace("port_value: 8081", &format!("port_value: {port}"))).await;
    let executions = || async {
        let url = format!("http://127.0.0.1:{port}/executions");
        match h.client.get(url).send().await {
            Ok(r) => serde_json::from_slice(&r.bytes().await.unwrap_or_default()).unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        }
    };
    eventually("express to listen", Duration::from_secs(30), || async {
        executions().await.is_object()
    })
    .await;
    let k = key("express");
    let first = send(h.post("/v1/payments", Some(&k), PAYMENT)).await;
    assert_eq!(first.status, 201, "{first:?}");
    for spelling in [
        "/v1/payments/",
        "//v1/payments",
        "/v1/./payments",
        "/v1/%70ayments",
        "/V1/Payments",
    ] {
        let again = send(h.post(spelling, Some(&k), PAYMENT)).await;
        assert_eq!(again.status, 201, "{spelling}: {again:?}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{spelling}");
        assert_eq!(again.body, first.body, "{spelling}");
    }
    assert_eq!(executions().await[&k], 1);
    // An escaped slash is refused before anything runs.
    let escaped = send(h.post("/v1%2Fpayments", Some(&key("esc")), PAYMENT)).await;
    assert_eq!(escaped.status, 400);
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_the_limits_are_refused_or_streamed_without_storing() {
    let h = Harness::start().await;
    let big_request = format!("{{\"pad\": \"{}\"}}", "x".repeat(100));
    assert_problem(
        &send(h.post("/small", Some(&key("big")), &big_request)).await,
        413,
        "body-too-large",
    );
    let k = key("big-response");
    let first = send(
        h.post("/small", Some(&k), "{}")
            .header("x-test-body-size", "5000"),
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), 5000);
    let again = send(h.post("/small", Some(&k), "{}")).await;
    assert_problem(&again, 409, "result-unavailable");
    assert_eq!(again.json()["original_status"], 201);
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn observe_mode_forwards_everything_and_counts_what_it_would_do() {
    let h = Harness::start().await;
    let k = key("observe");
    for _ in 0..2 {
        let a = send(h.post("/observe", Some(&k), PAYMENT)).await;
        assert_eq!(a.status, 201);
        assert!(a.header("idempotent-replayed").is_none());
    }
    assert_eq!(send(h.post("/observe", None, PAYMENT)).await.status, 201);
    assert_eq!(h.upstream.executions(&k), 2);
    eventually("observe counters", Duration::from_secs(10), || async {
        h.counter("requests_would_replay").await >= 1 && h.counter("requests_would_reject").await >= 1
    })
    .await;
    // Each would-be refusal is counted under its reason.
    let text = h.admin_text("/stats/prometheus").await;
    let missing = text.lines().find(|l| {
        l.starts_with("idemgate_requests_total{")
            && [
                "outcome=\"would_reject\"",
                "reason=\"missing\"",
                "policy=\"observe\"",
            ]
            .iter()
            .all(|label| l.contains(label))
    });
    assert!(
        missing.is_some_and(|l| l.ends_with(" 1")),
        "no would_reject series with reason missing: {missing:?}"
    );
}

/// A canary (partial enforcement): the listed tenant is enforced, every
/// other tenant observed, on the same route.
#[tokio::test(flavor = "multi_thread")]
async fn a_canary_enforces_its_tenants_and_observes_the_rest() {
    let h = Harness::start().await;
    for (tenant, enforced) in [("canary-tenant", true), ("other-tenant", false)] {
        let k = key(&format!("canary-{tenant}"));
        let first = send(h.post_as(tenant, "u", "/canary", Some(&k), PAYMENT)).await;
        assert_eq!(first.status, 201, "{tenant}");
        let again = send(h.post_as(tenant, "u", "/canary", Some(&k), PAYMENT)).await;
        let other = send(h.post_as(tenant, "u", "/canary", Some(&k), r#"{"amount": 1}"#)).await;
        if enforced {
            assert_eq!(again.header("idempotent-replayed"), Some("true"), "{tenant}");
            assert_problem(&other, 422, "key-reused");
            assert_eq!(h.upstream.executions(&k), 1, "{tenant}");
        } else {
            assert!(again.header("idempotent-replayed").is_none(), "{tenant}");
            assert_eq!(other.status, 201, "{tenant}");
            assert_eq!(h.upstream.executions(&k), 3, "{tenant}");
        }
    }
    eventually(
        "the observed tenant's would-be answers are counted",
        Duration::from_secs(10),
        || async {
            let text = h.admin_text("/stats/prometheus").await;
            ["would_replay", "would_reject"].iter().all(|outcome| {
                text.lines().any(|l| {
                    l.starts_with("idemgate_requests_total{")
                        && l.contains(&format!("outcome=\"{outcome}\""))
                        && l.contains("policy=\"canary\"")
                })
            })
        },
    )
    .await;
}

/// The rollout checker passes an enforced route and names what an
/// observed one does not enforce.
#[tokio::test(flavor = "multi_thread")]
async fn the_rollout_checker_tells_an_enforced_route_from_an_observed_one() {
    let h = Harness::start().await;
    let check = |path: &str| {
        let out = std::process::Command::new("python3")
            .arg(e2e::repo_root().join("scripts/rollout-check.py"))
            .arg(h.url(path))
            .args(["-H", "x-tenant-id: rollout-test", "-H", "x-user-id: checker"])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, report) = check("/pay");
    assert!(ok, "{report}");
    for name in ["new-key", "replay", "key-reused", "concurrent", "key-missing"] {
        assert!(report.contains(&format!("PASS  {name}")), "{name}: {report}");
    }
    let (ok, report) = check("/observe");
    assert!(!ok, "{report}");
    assert!(
        report.contains("NOT enforced: replay, key-reused, concurrent, key-missing"),
        "{report}"
    );
}

/// Access logs read how the filter handled each request from its filter
/// state: outcome, observe mode's reason, policy and claim attempt.
#[tokio::test(flavor = "multi_thread")]
async fn access_logs_show_each_requests_outcome_reason_policy_and_attempt() {
    let h = Harness::start().await;
    let k = key("logged");
    let tagged = |tag: &str, path: &str, key: Option<&str>| {
        h.post(path, key, PAYMENT).header("x-test-tag", tag.to_string())
    };
    assert_eq!(send(tagged("first", "/pay", Some(&k))).await.status, 201);
    assert_eq!(send(tagged("again", "/pay", Some(&k))).await.status, 201);
    assert_eq!(send(tagged("watched", "/observe", None)).await.status, 201);
    let line = |tag: &str| {
        let tag = format!("access tag={tag} ");
        h.envoy_log()
            .lines()
            .find(|l| l.starts_with(&tag))
            .map(str::to_string)
    };
    // Envoy writes access logs to stdout every 10 s at most.
    eventually("three access log lines", Duration::from_secs(30), || async {
        ["first", "again", "watched"].iter().all(|t| line(t).is_some())
    })
    .await;
    let first = line("first").unwrap_or_default();
    assert!(
        first.contains("status=201 outcome=owned reason=- policy=payments.create attempt="),
        "{first}"
    );
    let attempt = first.rsplit("attempt=").next().unwrap_or_default().trim();
    assert!(attempt.len() >= 16 && attempt != "-", "{first}");
    let again = line("again").unwrap_or_default();
    assert!(
        again.contains("outcome=replayed reason=- policy=payments.create"),
        "{again}"
    );
    assert!(!again.contains(attempt), "a replay has its own attempt: {again}");
    let watched = line("watched").unwrap_or_default();
    assert!(
        watched.contains("outcome=would_reject reason=missing policy=observe"),
        "{watched}"
    );
}

/// From an access-log line to the store's history: the filter names each
/// request (its `x-request-id`, its `traceparent`'s trace id) on its store
/// calls, and the store's JSON event lines carry them with the attempt.
#[tokio::test(flavor = "multi_thread")]
async fn store_event_lines_carry_the_access_logs_request_id_attempt_and_trace_id() {
    let h = Harness::start_serving(|c| c, vec!["--log-format".into(), "json".into()]).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let k = key("traced");
    let traced = h
        .post("/pay", Some(&k), PAYMENT)
        .header("x-test-tag", "traced")
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"));
    assert_eq!(send(traced).await.status, 201);
    let access = || {
        h.envoy_log()
            .lines()
            .find(|l| l.starts_with("access tag=traced "))
            .map(str::to_string)
    };
    eventually("the access log line", Duration::from_secs(30), || async {
        access().is_some()
    })
    .await;
    let access = access().unwrap_or_default();
    let field = |name: &str| {
        access
            .split(' ')
            .find_map(|f| f.strip_prefix(&format!("{name}=")))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let (request_id, attempt) = (field("request_id"), field("attempt"));
    assert!(request_id.len() >= 16 && attempt.len() >= 16, "{access}");
    let events = || {
        let mut events = Vec::new();
        for (file, line) in h.log_lines() {
            if !file.contains("store") {
                continue;
            }
            let json: serde_json::Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            if json["target"] == "idemgate::events" && json["trace_id"] == trace_id {
                events.push(json);
            }
        }
        events
    };
    eventually(
        "the claimed and completed events",
        Duration::from_secs(10),
        || async { events().len() >= 2 },
    )
    .await;
    let events = events();
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(names, ["claimed", "completed"], "{events:?}");
    for e in &events {
        assert_eq!(e["request_id"], request_id.as_str(), "{e}");
        assert_eq!(e["attempt"], attempt.as_str(), "{e}");
    }
}

/// The emergency stop: a route whose `typed_per_filter_config` disables the
/// filter (Envoy's own `FilterConfig {disabled: true}`) passes every request
/// unprotected, without a store call, though a policy covers it.
#[tokio::test(flavor = "multi_thread")]
async fn a_route_that_switches_the_filter_off_passes_requests_without_a_store_call() {
    let h = Harness::start().await;
    // One request elsewhere first, so the store cluster's counter exists.
    assert_eq!(
        send(h.post("/pay", Some(&key("warm")), PAYMENT)).await.status,
        201
    );
    let calls = "cluster.idempotency_store.upstream_rq_total";
    let before = h.stat(calls).await;
    assert!(before > 0, "the store cluster's counter is not there");
    let k = key("stopped");
    for _ in 0..2 {
        let a = send(h.post("/stopped", Some(&k), PAYMENT)).await;
        assert_eq!(a.status, 201);
        assert!(a.header("idempotent-replayed").is_none());
    }
    assert_eq!(send(h.post("/stopped", None, PAYMENT)).await.status, 201);
    assert_eq!(
        h.upstream.executions(&k),
        2,
        "nothing deduplicates on a stopped route"
    );
    assert_eq!(h.stat(calls).await, before, "a stopped route called the store");
    assert_eq!(
        h.counter("requests").await,
        1,
        "only the warm-up request was counted"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_store_fails_closed_and_service_resumes_when_it_returns() {
    let mut h = Harness::start().await;
    h.kill_store(0);
    let k = key("dead");
    let a = send(h.post("/pay", Some(&k), PAYMENT)).await;
    assert_problem(&a, 503, "store-unavailable");
    assert!(a.header("retry-after").is_some());
    assert_eq!(h.upstream.executions(&k), 0);
    let open = key("open");
    assert_eq!(send(h.post("/open", Some(&open), PAYMENT)).await.status, 201);
    assert_eq!(h.upstream.executions(&open), 1);
    h.start_store(0);
    h.wait_store(0).await;
    assert_eq!(send(h.post("/pay", Some(&k), PAYMENT)).await.status, 201);
    assert_eq!(
        send(h.post("/pay", Some(&k), PAYMENT))
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(h.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_keys_get_400_and_every_worker_keeps_serving() {
    let h = Harness::start().await;
    let huge = "k".repeat(10 * 1024);
    let hostile: Vec<Vec<u8>> = vec![
        b"\xff\xfe\xfd".to_vec(),
        b"caf\xc3\xa9".to_vec(),
        huge.into_bytes(),
        b"\"a\\qb\"".to_vec(),
    ];
    for bytes in hostile {
        let value = reqwest::header::HeaderValue::from_bytes(&bytes).unwrap_or_else(|e| panic!("{e}"));
        let a = send(h.post("/pay", None, PAYMENT).header("idempotency-key", value)).await;
        assert_problem(&a, 400, "key-invalid");
    }
    // Control characters never reach the filter: Envoy's codec refuses them.
    let raw = e2e::raw_request(
        h.port,
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: a\x01b\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    // Fresh connections spread over both workers; every one must still work.
    for i in 0..20 {
        let k = key(&format!("alive-{i}"));
        assert_eq!(send(h.post("/pay", Some(&k), PAYMENT)).await.status, 201);
    }
    assert!(!h.envoy_log().contains("panicked"), "a VM panicked");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_after_forwarding_leaves_the_outcome_unknown() {
    let h = Harness::start().await;
    let k = key("gone");
    let slow = h
        .post("/pay", Some(&k), PAYMENT)
        .header("x-test-delay-ms", "3000");
    let pending = tokio::spawn(slow.send());
    eventually(
        "the request to reach the upstream",
        Duration::from_secs(10),
        || async { h.upstream.executions(&k) == 1 },
    )
    .await;
    pending.abort();
    // The lease is a minute long: only the filter's report from on_log can
    // turn the record unknown this quickly.
    let again = poll(
        "the record to become unknown",
        Duration::from_secs(10),
        || async {
            let a = send(h.post("/pay", Some(&k), PAYMENT)).await;
            (a.problem().as_deref() != Some("request-in-progress")).then_some(a)
        },
    )
    .await;
    assert_problem(&again, 409, "outcome-unknown");
    assert_eq!(h.upstream.executions(&k), 1);
    eventually(
        "the confirmed mark-unknown to be counted",
        Duration::from_secs(10),
        || async { h.counter("records_marked_unknown").await == 1 },
    )
    .await;
}

#[test]
fn the_wasm_module_is_under_one_megabyte() {
    let wasm = e2e::wasm_path();
    let size = std::fs::metadata(&wasm)
        .map(|m| m.len())
        .unwrap_or_else(|e| panic!("{wasm:?}: {e}"));
    assert!(size < 1024 * 1024, "{wasm:?} is {size} bytes");
}

#[test]
fn envoy_refuses_an_invalid_plugin_configuration_and_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let ports = e2e::Ports {
        listener: e2e::free_port(),
        admin: e2e::free_port(),
        upstream: 8080,
    };
    let config =
        e2e::bootstrap("envoy/e2e.yaml", &ports).replace("\"ttl_seconds\": 1}", "\"ttl_seconds\": 0}");
    // The policy broken above is "short-lived": the error names its index.
    let index = config
        .split("\"name\": \"short-lived\"")
        .next()
        .unwrap()
        .matches("{\"name\": ")
        .count();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, config).unwrap();
    let out = std::process::Command::new(e2e::envoy_bin())
        .arg("-c")
        .arg(&path)
        .args(["--disable-hot-restart", "-l", "warning"])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        log.contains(&format!(
            "invalid configuration at `policies[{index}].ttl_seconds`"
        )),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_over_the_stores_budget_of_new_keys_gets_429_and_its_key_works_after_the_wait() {
    // One new key a second per tenant, one at a time.
    let args = ["--tenant-new-keys-per-sec", "1", "--tenant-new-keys-burst", "1"];
    let h = Harness::start_serving(|c| c, args.iter().map(|a| a.to_string()).collect()).await;
    let (first, second) = (key("budget-1"), key("budget-2"));
    let a = send(h.post("/pay", Some(&first), PAYMENT)).await;
    assert_eq!(a.status, 201, "{a:?}");
    // A second new key at once: refused before anything is claimed.
    let limited = send(h.post("/pay", Some(&second), PAYMENT)).await;
    assert_problem(&limited, 429, "key-rate-limited");
    assert_eq!(limited.header("retry-after"), Some("1"), "{limited:?}");
    let wait_ms: u64 = limited
        .header("retry-after-ms")
        .unwrap_or_default()
        .parse()
        .unwrap();
    assert!((1..=1000).contains(&wait_ms), "{limited:?}");
    assert_eq!(
        limited.header("idempotency-key"),
        Some(format!("\"{second}\"").as_str())
    );
    assert_eq!(h.upstream.executions(&second), 0);
    // Over budget, a retry of the first still replays, and another tenant
    // has its own budget.
    let replay = send(h.post("/pay", Some(&first), PAYMENT)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let other = send(h.post_as("tenant-b", "bob", "/pay", Some(&second), PAYMENT)).await;
    assert_eq!(other.status, 201, "{other:?}");
    // After the wait the refused key is a first request: it was not burnt.
    tokio::time::sleep(Duration::from_millis(wait_ms + 50)).await;
    let a = send(h.post("/pay", Some(&second), PAYMENT)).await;
    assert_eq!(a.status, 201, "{a:?}");
    assert!(a.header("idempotent-replayed").is_none());
    assert_eq!(h.upstream.executions(&second), 2, "once per tenant");
    assert_eq!(h.counter("requests_rate_limited").await, 1);
}
