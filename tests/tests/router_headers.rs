//! The router's request headers (`x-envoy-retry-on`, `x-envoy-max-retries`,
//! the upstream timeouts, hedging) from a caller Envoy trusts: on
//! `envoy/internal.yaml` loopback callers are internal, so Envoy keeps those
//! headers and its router would retry on them. A covered request still
//! reaches the upstream once, in streaming, detached and observe mode, and
//! the headers never reach the upstream.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, send};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;

/// What a caller sends to have Envoy retry (and re-time) a request.
const STEERING: [(&str, &str); 6] = [
    ("x-envoy-retry-on", "5xx,reset"),
    ("x-envoy-retry-grpc-on", "unavailable"),
    ("x-envoy-max-retries", "3"),
    ("x-envoy-upstream-rq-timeout-ms", "10000"),
    ("x-envoy-upstream-rq-per-try-timeout-ms", "5000"),
    ("x-envoy-hedge-on-per-try-timeout", "true"),
];

/// A covered POST on `path` with the steering headers, to an upstream that
/// answers 500 (which `x-envoy-retry-on: 5xx` retries): it must have run
/// once, and without those headers.
async fn runs_once(stack: &Stack, path: &str) {
    let key = fresh_key("steered");
    let mut req = stack
        .post(path, Some(&key), PAYMENT)
        .header("x-test-status", "500");
    for (name, value) in STEERING {
        req = req.header(name, value);
    }
    let answer = send(req).await;
    let seen = stack.upstream.log();
    let runs: Vec<_> = seen.iter().filter(|e| e.key == key).collect();
    assert_eq!(
        runs.len(),
        1,
        "{path}: executed {} times; answered {answer:?}",
        runs.len()
    );
    assert_eq!(answer.status, 500, "{path}: {answer:?}");
    let arrived: Vec<&str> = runs[0]
        .header_names
        .iter()
        .map(String::as_str)
        .filter(|n| STEERING.iter().any(|(s, _)| s == n))
        .collect();
    assert!(arrived.is_empty(), "{path}: the upstream got {arrived:?}");
}

async fn start() -> Stack {
    Stack::start(Options::new("envoy/internal.yaml", Database::Sqlite, 1)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_request_with_retry_headers_runs_once() {
    let stack = start().await;
    runs_once(&stack, "/pay").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_detached_request_with_retry_headers_runs_once() {
    let stack = start().await;
    runs_once(&stack, "/detached/pay").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_observed_request_with_retry_headers_runs_once() {
    let stack = start().await;
    runs_once(&stack, "/observe/pay").await;
}

/// The same headers on a route no policy covers are left to Envoy: the
/// bootstrap does honour them (so the tests above test something).
#[tokio::test(flavor = "multi_thread")]
async fn an_uncovered_request_is_retried_as_the_caller_asked() {
    let stack = start().await;
    let key = fresh_key("uncovered");
    let mut req = stack
        .post("/other", Some(&key), PAYMENT)
        .header("x-test-status", "500");
    for (name, value) in STEERING {
        req = req.header(name, value);
    }
    let answer = send(req).await;
    assert_eq!(answer.status, 500, "{answer:?}");
    assert_eq!(stack.upstream.executions(&key), 4, "one try and 3 retries");
}
