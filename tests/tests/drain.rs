//! A pod stop with an Istio sidecar, through the real Envoy and the real
//! store, while a detached request (contract §5) takes 10 s upstream; and
//! what a worker holds in memory for detached requests in flight, the
//! sizing note of docs/rollout.md §1.
//!
//! What is emulated is the sidecar agent's side of a pod stop (pilot-agent,
//! `pkg/istio-agent`): Envoy runs with `--drain-strategy immediate` and a
//! drain time (`--drain-time-s`, here 5; Istio passes its `drainDuration`,
//! 45 s by default, which decides when drained listeners stop accepting,
//! not when Envoy is killed); on the pod's SIGTERM the agent
//! posts `/drain_listeners?inboundonly&graceful` to Envoy's admin, then
//!
//! - by default sleeps `terminationDrainDuration` (5 s unless the pod's
//!   `proxy.istio.io/config` says otherwise) and kills Envoy (SIGKILL, Go's
//!   `Process.Kill`);
//! - with `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true`, sleeps
//!   `MINIMUM_DRAIN_DURATION` (5 s), then reads `downstream_cx_active` every
//!   second and kills Envoy once no downstream connection is left.
//!
//! The kubelet's own SIGKILL at `terminationGracePeriodSeconds` comes after
//! that and is not emulated; neither are the application container and the
//! endpoints update. The listener is marked `traffic_direction: INBOUND`, as
//! Istio's inbound listener is, so the drain applies to it. The pod that
//! replaces the stopped one is a fresh Envoy on the same store.
//!
//! The rule the examples derive the pod settings from (examples/istio):
//! `terminationDrainDuration` = the largest detached `forwarding.timeout_ms`
//! plus `store.timeout_ms` plus a margin, rounded up to seconds
//! (`scripts/istio-workloads.py`, `sidecar_settings`), and
//! `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` false, since a detached request whose
//! client left holds no downstream connection.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, fresh_key, send, Answer};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const ROUTE: &str = "payments.sidecar";
/// The upstream's time to answer: longer than Istio's default drain, shorter
/// than the policy's detached timeout.
const UPSTREAM_MS: u64 = 10_000;
/// The policy's `forwarding.timeout_ms`, and the bootstrap's `store.timeout_ms`.
const DETACHED_TIMEOUT_MS: u64 = 12_000;
const STORE_TIMEOUT_MS: u64 = 1_000;
/// The policy's lease: its detached timeout plus one store call, as the
/// configuration requires.
const LEASE_SECONDS: u64 = 14;
/// The margin the examples add (examples/istio/README.md, "Stopping a pod"):
/// one more store call (the claim before the upstream call and the
/// completion after it each take up to `store.timeout_ms`) and 1 s.
const MARGIN_SECONDS: u64 = 2;
/// Istio's defaults: `terminationDrainDuration` and `MINIMUM_DRAIN_DURATION`.
const ISTIO_DEFAULT_DRAIN: Duration = Duration::from_secs(5);

/// A detached policy with a timeout longer than the upstream takes.
const POLICY: &str = r#"
                        {"name": "payments.sidecar", "match": {"path": {"prefix": "/sidecar"}},
                         "tenant": {"header": "x-tenant-id"}, "principal": {"header": "x-user-id"},
                         "lease_seconds": 14,
                         "forwarding": {"mode": "detached", "timeout_ms": 12000}},"#;

/// `terminationDrainDuration` by the examples' rule.
fn derived_drain() -> Duration {
    Duration::from_secs((DETACHED_TIMEOUT_MS + STORE_TIMEOUT_MS).div_ceil(1000) + MARGIN_SECONDS)
}

async fn sidecar() -> Stack {
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.envoy_args = ["--drain-time-s", "5", "--drain-strategy", "immediate"]
        .map(String::from)
        .to_vec();
    options.edit = Some(Box::new(|config| {
        assert!(
            config.contains(r#""timeout_ms": 1000, "token""#),
            "the store timeout changed"
        );
        config
            .replacen(
                "  - name: ingress\n",
                "  - name: ingress\n    traffic_direction: INBOUND\n",
                1,
            )
            .replacen(r#""policies": ["#, &format!(r#""policies": [{POLICY}"#), 1)
    }));
    Stack::start(options).await
}

fn pay(stack: &Stack, key: &str, delay_ms: u64) -> reqwest::RequestBuilder {
    stack
        .post("/sidecar/pay", Some(key), PAYMENT)
        .header("x-test-delay-ms", delay_ms.to_string())
}

fn problem(a: &Answer) -> (u16, Option<String>) {
    (a.status, a.problem())
}

async fn drain_inbound_listeners(stack: &Stack) {
    let r = stack
        .client
        .post(stack.admin_url("/drain_listeners?inboundonly&graceful"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "drain_listeners");
}

/// The downstream connections the agent counts: every listener's but the
/// admin's.
async fn downstream_connections(stack: &Stack) -> u64 {
    let text = stack.admin_text("/stats?filter=downstream_cx_active$").await;
    text.lines()
        .filter(|l| l.starts_with("listener.") && !l.starts_with("listener.admin."))
        .filter_map(|l| l.rsplit_once(": "))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// How the agent ends the sidecar.
enum Agent {
    /// Sleeps `terminationDrainDuration`, then kills Envoy.
    Sleep(Duration),
    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true`: sleeps `MINIMUM_DRAIN_DURATION`,
    /// then kills Envoy once no downstream connection is left.
    ExitOnZero(Duration),
}

/// The pod's stop, from the agent's SIGTERM to Envoy's SIGKILL; returns how
/// long Envoy lived after the drain began.
async fn stop_pod(stack: &mut Stack, agent: Agent) -> Duration {
    let began = Instant::now();
    drain_inbound_listeners(stack).await;
    match agent {
        Agent::Sleep(drain) => tokio::time::sleep(drain).await,
        Agent::ExitOnZero(minimum) => {
            tokio::time::sleep(minimum).await;
            while downstream_connections(stack).await > 0 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    assert!(
        stack.envoy.as_ref().is_some_and(|p| p.alive()),
        "Envoy exited before the agent killed it"
    );
    stack.kill_envoy();
    began.elapsed()
}

/// A new pod: a fresh Envoy on the same store.
async fn next_pod(stack: &mut Stack) {
    stack.start_envoy();
    stack.wait_envoy().await;
}

/// The request is cut with Envoy: its record stays in progress until its
/// lease runs out, then is unknown; it never runs again.
async fn assert_lost(stack: &Stack, key: &str, claimed_at: Instant) {
    let early = send(pay(stack, key, 0)).await;
    assert_eq!(
        problem(&early),
        (409, Some("request-in-progress".into())),
        "within the lease: {early:?}"
    );
    let lease_over = claimed_at + Duration::from_secs(LEASE_SECONDS) + Duration::from_millis(1_500);
    tokio::time::sleep(lease_over.saturating_duration_since(Instant::now())).await;
    let late = send(pay(stack, key, 0)).await;
    assert_eq!(
        problem(&late),
        (409, Some("outcome-unknown".into())),
        "after the lease: {late:?}"
    );
    assert_eq!(
        stack.transitions("tenant-a", "alice", ROUTE, key).await,
        ["claimed", "lease_expired"]
    );
    assert_eq!(stack.upstream.executions(key), 1, "executions of {key}");
}

/// Istio's defaults: the agent kills Envoy 5 s into a 10 s detached request
/// whose client is still waiting. The client sees the connection cut, the
/// upstream's answer is never recorded, and the key ends unknown.
#[tokio::test(flavor = "multi_thread")]
async fn istios_default_drain_cuts_a_10s_detached_request() {
    let mut stack = sidecar().await;
    let k = fresh_key("default-drain");
    let claimed_at = Instant::now();
    let waiting = tokio::spawn(
        pay(&stack, &k, UPSTREAM_MS)
            .timeout(Duration::from_secs(30))
            .send(),
    );
    eventually(
        "the upstream to get the request",
        Duration::from_secs(5),
        || async { stack.upstream.executions(&k) == 1 },
    )
    .await;
    let lived = stop_pod(&mut stack, Agent::Sleep(ISTIO_DEFAULT_DRAIN)).await;
    assert!(lived < Duration::from_millis(UPSTREAM_MS), "{lived:?}");
    let cut = waiting.await.unwrap();
    assert!(cut.is_err(), "the client got an answer: {cut:?}");
    next_pod(&mut stack).await;
    assert_lost(&stack, &k, claimed_at).await;
}

/// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS=true` ends the sidecar once downstream
/// connections are gone, and a detached request whose client left has none:
/// it is cut after `MINIMUM_DRAIN_DURATION`, however long the drain is.
#[tokio::test(flavor = "multi_thread")]
async fn exit_on_zero_active_connections_cuts_a_detached_request_whose_client_left() {
    let mut stack = sidecar().await;
    let k = fresh_key("exit-on-zero");
    let claimed_at = Instant::now();
    let gone = pay(&stack, &k, UPSTREAM_MS)
        .timeout(Duration::from_secs(1))
        .send()
        .await;
    assert!(gone.is_err(), "the client should have given up: {gone:?}");
    assert_eq!(stack.upstream.executions(&k), 1);
    let lived = stop_pod(&mut stack, Agent::ExitOnZero(ISTIO_DEFAULT_DRAIN)).await;
    assert!(lived < Duration::from_millis(UPSTREAM_MS - 1_000), "{lived:?}");
    next_pod(&mut stack).await;
    assert_lost(&stack, &k, claimed_at).await;
}

/// The examples' setting: `terminationDrainDuration` covers the policy's
/// detached timeout and one store call. The same 10 s request, its client
/// gone, completes while Envoy drains; the retry on the next pod replays it.
/// A client that waits gets its answer through the drain.
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_derived_from_the_policies_lets_a_10s_detached_request_complete() {
    let mut stack = sidecar().await;
    let (gone_key, waiting_key) = (fresh_key("derived-gone"), fresh_key("derived-waiting"));
    let waiting = tokio::spawn(
        pay(&stack, &waiting_key, UPSTREAM_MS)
            .timeout(Duration::from_secs(30))
            .send(),
    );
    let gone = pay(&stack, &gone_key, UPSTREAM_MS)
        .timeout(Duration::from_secs(1))
        .send()
        .await;
    assert!(gone.is_err(), "the client should have given up: {gone:?}");
    assert_eq!(stack.upstream.executions(&gone_key), 1);
    assert_eq!(derived_drain(), Duration::from_secs(15));
    let lived = stop_pod(&mut stack, Agent::Sleep(derived_drain())).await;
    assert!(lived >= Duration::from_millis(UPSTREAM_MS), "{lived:?}");
    let answered = Answer::of(waiting.await.unwrap().unwrap()).await;
    assert_eq!(answered.status, 201, "the waiting client: {answered:?}");
    next_pod(&mut stack).await;
    for key in [&gone_key, &waiting_key] {
        let retry = send(pay(&stack, key, 0)).await;
        assert_eq!(retry.status, 201, "{key}: {retry:?}");
        assert_eq!(
            retry.header("idempotent-replayed"),
            Some("true"),
            "{key}: {retry:?}"
        );
        assert_eq!(stack.upstream.executions(key), 1, "executions of {key}");
        assert_eq!(
            stack.transitions("tenant-a", "alice", ROUTE, key).await,
            ["claimed", "completed"]
        );
    }
    let first = answered.json()["execution"].clone();
    let again = send(pay(&stack, &waiting_key, 0)).await;
    assert_eq!(again.json()["execution"], first);
}

/// Envoy's memory (kB) from `/proc/<pid>/status`: `VmRSS` now, or `VmHWM`,
/// the peak since it started.
fn envoy_kb(stack: &Stack, field: &str) -> u64 {
    let pid = stack.envoy.as_ref().and_then(|p| p.pid()).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// In-flight detached requests in the sizing run, each answered after 5 s
/// with a response of its policy's `max_response_body` (the default, 1 MiB).
const IN_FLIGHT: usize = 200;
const MAX_RESPONSE_BODY: u64 = 1_048_576;
const SLOW_MS: u64 = 5_000;
const SIZING_POLICY: &str = r#"
                        {"name": "sizing", "match": {"path": {"prefix": "/sizing"}}, "anonymous": true,
                         "forwarding": {"mode": "detached", "timeout_ms": 8000, "max_response_body": 1048576}},"#;
/// The documented bound (docs/rollout.md §1): Envoy's RSS grows by at most
/// this many times `max_response_body` per detached request in flight, plus
/// a fixed allowance.
const BODIES_PER_REQUEST: u64 = 4;
const FIXED_ALLOWANCE_KB: u64 = 64 * 1024;

/// 200 detached requests in flight at once, each answered after 5 s with a
/// response of the policy's `max_response_body`, their clients waiting (and
/// reading) or gone: Envoy's peak RSS stays within the documented bound.
async fn detached_memory(clients_wait: bool) {
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(|config| {
        config.replacen(r#""policies": ["#, &format!(r#""policies": [{SIZING_POLICY}"#), 1)
    }));
    let stack = Stack::start(options).await;
    let large = |key: &str, delay_ms: u64| {
        let client_ms = if clients_wait { 30_000 } else { 3_000 };
        stack
            .post("/sizing/pay", Some(key), PAYMENT)
            .header("x-test-delay-ms", delay_ms.to_string())
            .header("x-test-body-size", MAX_RESPONSE_BODY.to_string())
            .timeout(Duration::from_millis(client_ms))
    };
    // Both workers' VMs have served a detached request before the baseline
    // (a loaded machine may answer a claim 503 on the way: try again).
    let mut warmed = 0;
    while warmed < 4 {
        let warm = send(large(&fresh_key("warm"), 0).timeout(Duration::from_secs(30))).await;
        if warm.status == 201 {
            warmed += 1;
        } else {
            assert_eq!(
                problem(&warm),
                (503, Some("store-unavailable".into())),
                "{warm:?}"
            );
        }
    }
    let before = envoy_kb(&stack, "VmRSS");
    let keys: Vec<String> = (0..IN_FLIGHT).map(|_| fresh_key("sizing")).collect();
    let started = Instant::now();
    let requests: Vec<_> = keys
        .iter()
        .map(|k| tokio::spawn(Answer::read(large(k, SLOW_MS))))
        .collect();
    // Until every response is recorded (the clients that left do not say).
    let mut sampled = 0;
    while requests.iter().any(|r| !r.is_finished())
        || started.elapsed() < Duration::from_millis(SLOW_MS + 2_000)
    {
        sampled = sampled.max(envoy_kb(&stack, "VmRSS"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // On a loaded machine a claim may outlast the store's timeout, or the
    // filter's own request its connect timeout to the upstream: that
    // request is answered 503 (before a leaving client's timeout, too),
    // never executed, and not counted below.
    for (key, r) in keys.iter().zip(requests) {
        let a = match r.await.unwrap() {
            Ok(a) => a,
            Err(e) => {
                assert!(!clients_wait, "{key}: {e}");
                continue;
            }
        };
        let unconnected = String::from_utf8_lossy(&a.body).contains("upstream connect error");
        match a.status {
            201 if clients_wait => assert_eq!(a.body.len() as u64, MAX_RESPONSE_BODY, "{key}"),
            503 if unconnected => assert_eq!(stack.upstream.executions(key), 0, "{key}"),
            _ => assert_eq!(
                problem(&a),
                (503, Some("store-unavailable".into())),
                "{key}: the client did not leave, or {a:?}"
            ),
        }
    }
    // The forwarded ones were in flight together: every upstream call
    // started before the first one answered.
    let log = stack.upstream.log();
    let at: Vec<i64> = log
        .iter()
        .filter(|e| keys.contains(&e.key))
        .map(|e| e.at_ms)
        .collect();
    let in_flight = at.len() as u64;
    assert!(
        in_flight >= IN_FLIGHT as u64 * 3 / 4,
        "only {in_flight} of {IN_FLIGHT} requests were forwarded"
    );
    let spread = at.iter().max().unwrap() - at.iter().min().unwrap();
    assert!(spread < SLOW_MS as i64, "upstream calls spread over {spread} ms");
    // Every response was settled (a detached response is held until then):
    // recorded, or, on a machine too loaded for the 8 s timeout, unknown.
    eventually("every record to settle", Duration::from_secs(30), || async {
        stack.in_progress().await.is_some_and(|l| l.is_empty())
    })
    .await;
    let peak = envoy_kb(&stack, "VmHWM");
    let after = envoy_kb(&stack, "VmRSS");
    let growth = peak.saturating_sub(before);
    let per_request = growth * 1024 / in_flight;
    eprintln!(
        "sizing ({}): {in_flight} detached requests of {MAX_RESPONSE_BODY} B in flight (upstream calls within {spread} ms): \
         Envoy RSS {before} kB before, peak {peak} kB (sampled {sampled} kB), {after} kB after; \
         growth {growth} kB, {per_request} B per request ({:.2} x max_response_body)",
        if clients_wait { "clients waiting" } else { "clients gone" },
        per_request as f64 / MAX_RESPONSE_BODY as f64
    );
    let bound = FIXED_ALLOWANCE_KB + in_flight * BODIES_PER_REQUEST * MAX_RESPONSE_BODY / 1024;
    assert!(
        growth <= bound,
        "Envoy RSS grew by {growth} kB with {in_flight} detached requests in flight; the documented bound is {bound} kB"
    );
    // Not vacuous: the responses were held (at least a quarter of a body
    // per request, over 50 MiB in all; responses that arrive a little apart
    // reuse the memory of those already recorded).
    assert!(
        growth * 1024 > in_flight * MAX_RESPONSE_BODY / 4,
        "Envoy RSS grew by {growth} kB only: were the responses held?"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn detached_memory_with_clients_waiting_stays_within_the_documented_bound() {
    detached_memory(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn detached_memory_with_clients_gone_stays_within_the_documented_bound() {
    detached_memory(false).await;
}
