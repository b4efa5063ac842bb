//! Detached forwarding through the real Envoy (contract §5): the filter makes
//! the upstream request itself, so a client that stops waiting still has its
//! result recorded, and its retry replays it. Also what the upstream and the
//! client see, and how Envoy's own answers are told apart.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, retry_until_settled, Answer};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const ROUTE: &str = "payments.detached";

async fn start(database: Database) -> Stack {
    Stack::start(Options::new("envoy/e2e.yaml", database, 1)).await
}

fn pay(stack: &Stack, key: &str, delay_ms: u64) -> reqwest::RequestBuilder {
    stack
        .post("/detached/pay", Some(key), PAYMENT)
        .header("x-test-delay-ms", delay_ms.to_string())
}

async fn send(req: reqwest::RequestBuilder) -> Answer {
    Answer::of(req.send().await.unwrap()).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_client_gets_the_upstreams_answer_and_the_retry_replays_it() {
    let stack = start(Database::Sqlite).await;
    let k = fresh_key("detached");
    let first = send(pay(&stack, &k, 0).header("x-custom", "kept")).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.json()["execution"], 1);
    assert_eq!(first.header("idempotency-key"), Some(format!("\"{k}\"").as_str()));
    // Relayed as the upstream sent it, beyond what a replay keeps.
    assert_eq!(first.header("x-payment-id"), Some("pay_1"));
    assert_eq!(first.header("set-cookie"), Some("session=secret"));
    assert!(first.header("idempotent-replayed").is_none());
    // The upstream got the request as the client sent it.
    let seen = stack.upstream.log();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].path.as_str(), seen[0].tenant.as_str()),
        ("/detached/pay", "tenant-a")
    );
    assert_eq!(seen[0].body_sha256, {
        use sha2::{Digest, Sha256};
        Sha256::digest(PAYMENT)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    });
    let replay = send(pay(&stack, &k, 0)).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.executions(&k), 1);
    assert_eq!(
        stack.transitions("tenant-a", "alice", ROUTE, &k).await,
        ["claimed", "completed"]
    );
}

/// The everyday retry: the client's timeout is shorter than the handler.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_gave_up_gets_its_result_on_retry() {
    let stack = start(Database::Sqlite).await;
    let k = fresh_key("gave-up");
    let gone = pay(&stack, &k, 1_500)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gone.is_err(), "the client should have given up: {gone:?}");
    let retried = retry_until_settled(|| pay(&stack, &k, 0), Duration::from_secs(5)).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    assert_eq!(retried.json()["execution"], 1);
    assert_eq!(stack.upstream.executions(&k), 1);
    assert_eq!(
        stack.transitions("tenant-a", "alice", ROUTE, &k).await,
        ["claimed", "completed"]
    );
    assert_eq!(stack.counter("records_completed").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_before_acting_releases_the_key() {
    let stack = start(Database::Sqlite).await;
    let k = fresh_key("refused");
    let first = send(pay(&stack, &k, 0).header("x-test-status", "400")).await;
    assert_eq!(first.status, 400, "{first:?}");
    let second = send(pay(&stack, &k, 0)).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(stack.upstream.executions(&k), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn envoys_own_answers_are_told_apart() {
    let stack = start(Database::Sqlite).await;
    // No upstream to reach: Envoy's 503 is relayed in the form of Envoy's own
    // local replies (an about:blank problem, never cached) and the key released.
    let k = fresh_key("unreachable");
    let unreachable = || {
        stack
            .client
            .post(stack.url("/unreachable/detached"))
            .header("idempotency-key", &k)
            .body("{}")
    };
    for _ in 0..2 {
        let a = send(unreachable()).await;
        assert_eq!(a.status, 503, "{a:?}");
        assert_eq!(a.problem().as_deref(), Some("about:blank"), "{a:?}");
        assert_eq!(a.header("cache-control"), Some("no-store"), "{a:?}");
    }
    // The upstream reset after the request was sent: it may have acted.
    let k = fresh_key("reset");
    let reset = send(pay(&stack, &k, 0).header("x-test-reset", "1")).await;
    assert!(reset.status >= 500, "{reset:?}");
    let retry = send(pay(&stack, &k, 0)).await;
    assert_eq!(
        (retry.status, retry.problem().as_deref()),
        (409, Some("outcome-unknown")),
        "{retry:?}"
    );
    // The filter's own timeout for the upstream: it may have acted too.
    let k = fresh_key("slow");
    let slow = || {
        stack
            .client
            .post(stack.url("/detached-timeout"))
            .header("idempotency-key", &k)
            .header("x-test-delay-ms", "2000")
            .body("{}")
    };
    let timed_out = send(slow()).await;
    assert_eq!(timed_out.status, 504, "{timed_out:?}");
    assert_eq!(
        timed_out.header("cache-control"),
        Some("no-store"),
        "{timed_out:?}"
    );
    let retry = send(slow()).await;
    assert_eq!(
        (retry.status, retry.problem().as_deref()),
        (409, Some("outcome-unknown")),
        "{retry:?}"
    );
    assert_eq!(stack.upstream.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_larger_than_the_route_relays_is_recorded_without_its_body() {
    let stack = start(Database::Sqlite).await;
    let k = fresh_key("large");
    let large = || pay(&stack, &k, 0).header("x-test-body-size", "700000");
    let first = send(large()).await;
    assert_eq!(
        (first.status, first.problem().as_deref()),
        (409, Some("result-unavailable")),
        "{first:?}"
    );
    assert_eq!(first.json()["original_status"], 201);
    let retry = send(large()).await;
    assert_eq!(
        (retry.status, retry.problem().as_deref()),
        (409, Some("result-unavailable")),
        "{retry:?}"
    );
    assert_eq!(stack.upstream.executions(&k), 1);
}

/// The store goes down while the upstream works; the outcome is known and
/// the worker's store client records it once the store is back.
async fn a_store_restarted_while_a_detached_request_is_in_flight(database: Database) {
    let mut stack = start(database).await;
    let k = fresh_key("store-restart");
    let waiting = tokio::spawn(send(pay(&stack, &k, 1_000)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    stack.kill_store(0);
    let first = waiting.await.unwrap();
    // The client still gets the upstream's answer.
    assert_eq!(first.status, 201, "{first:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stack.start_store(0);
    stack.wait_store(0).await;
    let retried = retry_until_settled(|| pay(&stack, &k, 0), Duration::from_secs(10)).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    assert_eq!(retried.body, first.body);
    assert_eq!(stack.upstream.executions(&k), 1);
}

/// Envoy dies with the upstream request; nothing can record its answer, and
/// nothing runs it again.
#[tokio::test(flavor = "multi_thread")]
async fn an_envoy_restarted_while_a_detached_request_is_in_flight() {
    let mut stack = start(Database::Sqlite).await;
    let k = fresh_key("envoy-restart");
    let lost = tokio::spawn(pay(&stack, &k, 1_000).send());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stack.kill_envoy();
    assert!(lost.await.unwrap().is_err());
    stack.start_envoy();
    stack.wait_envoy().await;
    // The lease (4 s) runs out: the outcome is unknown, never re-executed.
    let retried = retry_until_settled(|| pay(&stack, &k, 0), Duration::from_secs(10)).await;
    assert_eq!(
        (retried.status, retried.problem().as_deref()),
        (409, Some("outcome-unknown")),
        "{retried:?}"
    );
    assert_eq!(stack.upstream.executions(&k), 1);
}

mod sqlite {
    #[tokio::test(flavor = "multi_thread")]
    async fn a_store_restarted_while_a_detached_request_is_in_flight() {
        super::a_store_restarted_while_a_detached_request_is_in_flight(e2e::stack::Database::Sqlite).await;
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread")]
    async fn a_store_restarted_while_a_detached_request_is_in_flight() {
        super::a_store_restarted_while_a_detached_request_is_in_flight(e2e::stack::Database::Postgres).await;
    }
}
