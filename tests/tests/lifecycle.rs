//! Requests caught by Envoy's own lifecycle, through the real Envoy and the
//! real store (contract §5, §6): a client that resets after its request was
//! forwarded, Envoy drained and stopped or stopped at once (SIGTERM) and hot
//! restarted while it owns requests and store calls are in flight, the
//! filter's VM failing under each `failure_policy`, and slow clients. In every
//! case nothing runs twice, no key stays in progress past its lease, and the
//! record ends as the contract says.
//!
//! Each test collects its failed checks before asserting, so it can write its
//! row of docs/reliability.md (under `IDEMGATE_REPORT`) either way.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use e2e::report::Checks;
use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, fresh_key, retry_until_settled, send, Answer};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const ROUTE: &str = "payments.lifecycle";
const LEASE: Duration = Duration::from_secs(5);
/// A streaming policy whose lease runs out within a test.
const POLICY: &str = r#"
                        {"name": "payments.lifecycle", "match": {"path": {"prefix": "/lifecycle"}},
                         "tenant": {"header": "x-tenant-id"}, "principal": {"header": "x-user-id"},
                         "lease_seconds": 5},"#;

fn options() -> Options {
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(|config| {
        config.replacen(r#""policies": ["#, &format!(r#""policies": [{POLICY}"#), 1)
    }));
    options
}

fn pay(stack: &Stack, key: &str, delay_ms: u64) -> reqwest::RequestBuilder {
    stack
        .post("/lifecycle/pay", Some(key), PAYMENT)
        .header("x-test-delay-ms", delay_ms.to_string())
}

fn detached(stack: &Stack, key: &str, delay_ms: u64) -> reqwest::RequestBuilder {
    stack
        .post("/detached/pay", Some(key), PAYMENT)
        .header("x-test-delay-ms", delay_ms.to_string())
}

fn problem(a: &Answer) -> (u16, Option<String>) {
    (a.status, a.problem())
}

fn replayed(a: &Answer) -> bool {
    a.status == 201 && a.header("idempotent-replayed") == Some("true")
}

/// Enough for a lease that started before `since` to run out and the
/// store's sweeper (every second) to notice.
async fn past_the_lease(since: Instant) {
    let until = since + LEASE + Duration::from_millis(1_500);
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
}

/// The record's state (`none` when there is no current one).
async fn state(stack: &Stack, route: &str, key: &str) -> String {
    let record = stack.current_record("tenant-a", "alice", route, key).await;
    record["state"].as_str().unwrap_or("none").to_string()
}

/// Whether the store holds any record in progress (each test has its own
/// store), by the admin listing and by each of `keys`.
async fn any_in_progress(stack: &Stack, keys: &[(&str, &str)]) -> bool {
    let mut any = stack.in_progress().await.is_none_or(|l| !l.is_empty());
    for (route, key) in keys {
        any |= state(stack, route, key).await == "in_progress";
    }
    any
}

async fn executed_once(c: &mut Checks, stack: &Stack, what: &str, key: &str) {
    let n = stack.upstream.executions(key);
    c.check(n == 1, format!("{what}: {n} executions"));
}

async fn transitions_are(c: &mut Checks, stack: &Stack, what: &str, route: &str, key: &str, want: &[&str]) {
    let got = stack.transitions("tenant-a", "alice", route, key).await;
    c.check(
        got == want,
        format!("{what}: transitions {got:?}, expected {want:?}"),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_resets_after_forwarding_never_gets_its_request_run_twice() {
    let stack = Stack::start(options()).await;
    let mut c = Checks::default();

    // Streaming: the client resets while the upstream works. Nobody will
    // see the response, so the filter marks the outcome unknown at once.
    let k = fresh_key("reset");
    let started = Instant::now();
    let gone = pay(&stack, &k, 1_500)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    c.check(gone.is_err(), format!("the client did not give up: {gone:?}"));
    let retry = retry_until_settled(|| pay(&stack, &k, 0), Duration::from_secs(3)).await;
    c.check(
        problem(&retry) == (409, Some("outcome-unknown".into())),
        format!("retry after a reset: {retry:?}"),
    );
    c.check(
        retry.header("x-should-retry") == Some("false"),
        "outcome-unknown must tell SDKs not to retry",
    );
    c.check(started.elapsed() < LEASE, "the retry waited for the lease");
    transitions_are(&mut c, &stack, "reset", ROUTE, &k, &["claimed", "marked_unknown"]).await;
    tokio::time::sleep(Duration::from_millis(1_500).saturating_sub(started.elapsed())).await;
    executed_once(&mut c, &stack, "reset", &k).await;

    // The response arrived and its completion is in flight (the store is
    // frozen) when the client resets: the completion still lands.
    let k2 = fresh_key("reset-settling");
    let waiting = tokio::spawn(pay(&stack, &k2, 400).timeout(Duration::from_millis(700)).send());
    tokio::time::sleep(Duration::from_millis(250)).await;
    stack.signal_store(0, true);
    tokio::time::sleep(Duration::from_millis(650)).await;
    stack.signal_store(0, false);
    let gone = waiting.await.unwrap();
    c.check(gone.is_err(), format!("the client did not give up: {gone:?}"));
    let retry = retry_until_settled(|| pay(&stack, &k2, 0), Duration::from_secs(3)).await;
    c.check(
        replayed(&retry),
        format!("retry after a reset while settling: {retry:?}"),
    );
    c.check(retry.json()["execution"].as_u64().is_some(), format!("{retry:?}"));
    transitions_are(&mut c, &stack, "settling", ROUTE, &k2, &["claimed", "completed"]).await;
    executed_once(&mut c, &stack, "settling", &k2).await;

    // Detached (tests/tests/detached.rs covers a client that gave up): one
    // that resets while the store is frozen, so the completion queues in the
    // worker's store client.
    let k3 = fresh_key("reset-detached");
    let waiting = tokio::spawn(
        detached(&stack, &k3, 400)
            .timeout(Duration::from_millis(200))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    stack.signal_store(0, true);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stack.signal_store(0, false);
    c.check(
        waiting.await.unwrap().is_err(),
        "the detached client did not give up",
    );
    let retry = retry_until_settled(|| detached(&stack, &k3, 0), Duration::from_secs(5)).await;
    c.check(replayed(&retry), format!("detached retry: {retry:?}"));
    executed_once(&mut c, &stack, "detached", &k3).await;

    let keys = [
        (ROUTE, k.as_str()),
        (ROUTE, k2.as_str()),
        ("payments.detached", k3.as_str()),
    ];
    c.check(
        !any_in_progress(&stack, &keys).await,
        "a record stayed in progress",
    );
    c.finish(
        "lifecycle: client reset after forwarding",
        "3 keys: streaming, streaming while settling, detached".into(),
        "client resets after forwarding, with the store frozen while settling".into(),
        "store frozen 0.65 s and 1.5 s (SIGSTOP)".into(),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_drained_envoy_finishes_what_it_owns_before_it_stops() {
    let mut stack = Stack::start(options()).await;
    let mut c = Checks::default();
    let (a, b, d) = (fresh_key("drain-a"), fresh_key("drain-b"), fresh_key("drain-d"));
    let first_a = tokio::spawn(pay(&stack, &a, 1_500).send());
    let first_b = tokio::spawn(pay(&stack, &b, 1_500).send());
    // A detached request whose client left: the worker holds it.
    let gone = tokio::spawn(
        detached(&stack, &d, 1_500)
            .timeout(Duration::from_millis(300))
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(400)).await;

    // What a preStop hook does: fail the health check, drain, wait for the
    // requests and for the worker's own calls (upstream and store), then
    // SIGTERM.
    for path in ["/healthcheck/fail", "/drain_listeners?graceful"] {
        let r = stack.client.post(stack.admin_url(path)).send().await;
        c.check(matches!(&r, Ok(r) if r.status() == 200), format!("{path}: {r:?}"));
    }
    for (what, first) in [("a", first_a), ("b", first_b)] {
        let answer = Answer::of(first.await.unwrap().unwrap()).await;
        c.check(answer.status == 201, format!("{what} while draining: {answer:?}"));
    }
    c.check(
        gone.await.unwrap().is_err(),
        "the detached client did not give up",
    );
    let idle = [
        "http.ingress.downstream_rq_active",
        "cluster.upstream.upstream_rq_active",
        "cluster.idempotency_store.upstream_rq_active",
    ];
    eventually("envoy to be idle", Duration::from_secs(10), || async {
        let mut active = 0;
        for name in idle {
            active += stack.stat(name).await;
        }
        active == 0
    })
    .await;
    stack.terminate_envoy().await;
    stack.start_envoy();
    stack.wait_envoy().await;

    for (what, key, route) in [("a", &a, ROUTE), ("b", &b, ROUTE), ("d", &d, "payments.detached")] {
        let again = if route == ROUTE {
            send(pay(&stack, key, 0)).await
        } else {
            send(detached(&stack, key, 0)).await
        };
        c.check(replayed(&again), format!("{what} on the fresh Envoy: {again:?}"));
        executed_once(&mut c, &stack, what, key).await;
        transitions_are(&mut c, &stack, what, route, key, &["claimed", "completed"]).await;
    }
    c.finish(
        "lifecycle: Envoy drained, then SIGTERM",
        "2 streaming + 1 detached request in flight".into(),
        "client of the detached request gone".into(),
        "/healthcheck/fail, /drain_listeners?graceful, SIGTERM once idle; retries on a fresh Envoy".into(),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_stopped_at_once_leaves_owned_requests_unknown_and_runs_nothing_twice() {
    let mut stack = Stack::start(options()).await;
    let mut c = Checks::default();
    let (owned, claiming) = (fresh_key("sigterm-owned"), fresh_key("sigterm-claiming"));
    let claimed_at = Instant::now();
    let first_owned = tokio::spawn(pay(&stack, &owned, 2_000).send());
    eventually(
        "the upstream to get the request",
        Duration::from_secs(5),
        || async { stack.upstream.executions(&owned) == 1 },
    )
    .await;
    // A claim in flight: the store has it in its socket, unread.
    stack.signal_store(0, true);
    let first_claiming = tokio::spawn(pay(&stack, &claiming, 0).send());
    tokio::time::sleep(Duration::from_millis(200)).await;
    stack.terminate_envoy().await;
    stack.signal_store(0, false);
    c.check(
        first_owned.await.unwrap().is_err(),
        "the owned request was answered",
    );
    c.check(
        first_claiming.await.unwrap().is_err(),
        "the claiming request was answered",
    );
    stack.start_envoy();
    stack.wait_envoy().await;

    // Until the lease runs out the key is in progress; then unknown.
    let early = send(pay(&stack, &owned, 0)).await;
    c.check(
        problem(&early) == (409, Some("request-in-progress".into())),
        format!("owned, within its lease: {early:?}"),
    );
    past_the_lease(claimed_at).await;
    let late = send(pay(&stack, &owned, 0)).await;
    c.check(
        problem(&late) == (409, Some("outcome-unknown".into())),
        format!("owned, after its lease: {late:?}"),
    );
    transitions_are(
        &mut c,
        &stack,
        "owned",
        ROUTE,
        &owned,
        &["claimed", "lease_expired"],
    )
    .await;
    executed_once(&mut c, &stack, "owned", &owned).await;

    // The claim that was in flight never reached the upstream. Either the
    // store never committed it (Envoy's connection was gone before the store
    // read it) and the retry is a first request, or it did, and with nobody
    // left to forward or abandon it, its lease ran out: unknown.
    let n = stack.upstream.executions(&claiming);
    c.check(n == 0, format!("the claim in flight executed {n} times"));
    let landed = stack.transitions("tenant-a", "alice", ROUTE, &claiming).await;
    let again = send(pay(&stack, &claiming, 0)).await;
    if landed.is_empty() {
        c.check(
            again.status == 201 && !replayed(&again),
            format!("the claim in flight never landed; its retry: {again:?}"),
        );
        executed_once(&mut c, &stack, "the claim in flight", &claiming).await;
    } else {
        c.check(
            landed == ["claimed", "lease_expired"],
            format!("the claim in flight landed: {landed:?}"),
        );
        c.check(
            problem(&again) == (409, Some("outcome-unknown".into())),
            format!("the claim in flight, after its lease: {again:?}"),
        );
        let n = stack.upstream.executions(&claiming);
        c.check(n == 0, format!("the claim in flight executed {n} times"));
    }
    eprintln!(
        "the claim in flight at SIGTERM: {landed:?}, its retry {}",
        again.status
    );
    let keys = [(ROUTE, owned.as_str()), (ROUTE, claiming.as_str())];
    c.check(
        !any_in_progress(&stack, &keys).await,
        "a record stayed in progress past its lease",
    );
    c.finish(
        "lifecycle: Envoy stopped at once (SIGTERM)",
        "1 request forwarded, 1 claim in flight".into(),
        "—".into(),
        "SIGTERM with no drain (Envoy exits at once), store frozen with a claim unread".into(),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_restart_lets_the_old_epoch_finish_or_leave_its_requests_unknown() {
    let mut options = options();
    options.hot_restart = true;
    // The old epoch exits 2 s after the new one started: well after the
    // quick request (1 s), well before the slow one (4.5 s, within its lease).
    options.envoy_args = ["--drain-time-s", "1", "--parent-shutdown-time-s", "2"]
        .map(String::from)
        .to_vec();
    let mut stack = Stack::start(options).await;
    let mut c = Checks::default();
    let (quick, slow, later) = (
        fresh_key("hot-quick"),
        fresh_key("hot-slow"),
        fresh_key("hot-later"),
    );
    let claimed_at = Instant::now();
    let first_quick = tokio::spawn(pay(&stack, &quick, 1_000).send());
    let first_slow = tokio::spawn(pay(&stack, &slow, 4_500).send());
    eventually(
        "the upstream to get both requests",
        Duration::from_secs(5),
        || async { stack.upstream.total() == 2 },
    )
    .await;
    let parent = stack.hot_restart().await;
    // The new epoch serves while the old one drains.
    let fresh = send(pay(&stack, &later, 0)).await;
    c.check(
        fresh.status == 201,
        format!("a new request during the restart: {fresh:?}"),
    );
    let quick_answer = first_quick.await.unwrap();
    c.check(
        matches!(&quick_answer, Ok(r) if r.status() == 201),
        format!("the quick request in the old epoch: {quick_answer:?}"),
    );
    let slow_answer = first_slow.await.unwrap();
    c.check(
        slow_answer.is_err(),
        format!("the slow request outlived the old epoch: {slow_answer:?}"),
    );
    if let Some(parent) = parent {
        eventually("the old epoch to exit", Duration::from_secs(10), || async {
            !parent.alive()
        })
        .await;
    }

    let again = send(pay(&stack, &quick, 0)).await;
    c.check(replayed(&again), format!("quick, on the new epoch: {again:?}"));
    transitions_are(&mut c, &stack, "quick", ROUTE, &quick, &["claimed", "completed"]).await;
    past_the_lease(claimed_at).await;
    let again = send(pay(&stack, &slow, 0)).await;
    c.check(
        problem(&again) == (409, Some("outcome-unknown".into())),
        format!("slow, on the new epoch after its lease: {again:?}"),
    );
    // The old epoch either marks its cut-off request unknown as it drains or
    // leaves that to the lease; the contract allows both, never a completion.
    let got = stack.transitions("tenant-a", "alice", ROUTE, &slow).await;
    c.check(
        got == ["claimed", "lease_expired"] || got == ["claimed", "marked_unknown"],
        format!("slow: transitions {got:?}, expected claimed then lease_expired or marked_unknown"),
    );
    for (what, key) in [("quick", &quick), ("slow", &slow), ("later", &later)] {
        executed_once(&mut c, &stack, what, key).await;
    }
    let keys = [
        (ROUTE, quick.as_str()),
        (ROUTE, slow.as_str()),
        (ROUTE, later.as_str()),
    ];
    c.check(
        !any_in_progress(&stack, &keys).await,
        "a record stayed in progress past its lease",
    );
    c.finish(
        "lifecycle: Envoy hot restart",
        "2 requests in flight in epoch 0, 1 new in epoch 1".into(),
        "—".into(),
        "--restart-epoch 1 (drain 1 s, parent shutdown 2 s) with a 1 s and a 4.5 s request".into(),
    );
}

/// One HTTP/2 connection to Envoy: every request on it meets the same
/// worker, so the same VM.
struct H2 {
    sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    port: u16,
}

impl H2 {
    async fn connect(port: u16) -> H2 {
        let io = TokioIo::new(TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        H2 { sender, port }
    }

    /// A connection to a worker whose VM works (under FAIL_CLOSED the other
    /// worker's may have failed for good).
    async fn to_a_live_vm(port: u16) -> H2 {
        e2e::poll("a connection to a live VM", Duration::from_secs(10), || async {
            let h2 = H2::connect(port).await;
            let probe = h2.pay(&fresh_key("vm-probe"), 0, None).await;
            probe.is_some_and(|(s, _)| s == 201).then_some(h2)
        })
        .await
    }

    /// The answer's status and body, `None` when the stream was reset.
    async fn pay(&self, key: &str, delay_ms: u64, fault: Option<&str>) -> Option<(u16, Bytes)> {
        let mut req = hyper::Request::post(format!("http://127.0.0.1:{}/lifecycle/pay", self.port))
            .header("content-type", "application/json")
            .header("x-tenant-id", "tenant-a")
            .header("x-user-id", "alice")
            .header("idempotency-key", key)
            .header("x-test-delay-ms", delay_ms.to_string());
        if let Some(phase) = fault {
            req = req.header("x-idemgate-fault", phase);
        }
        let req = req
            .body(Full::new(Bytes::from_static(PAYMENT.as_bytes())))
            .unwrap();
        let res = self.sender.clone().send_request(req).await.ok()?;
        let status = res.status().as_u16();
        let body = res.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    }
}

/// The stack on the filter built with its fault injection, under Envoy's
/// `failure_policy` `policy`.
async fn faulty_stack(policy: &'static str) -> Stack {
    let mut options = options();
    options.wasm = Some(e2e::env_path(
        "IDEMGATE_FAULTY_WASM",
        "target/idemgate-faulty.wasm",
    ));
    let edit = options.edit.take().unwrap();
    options.edit = Some(Box::new(move |config| {
        edit(config).replace(
            "failure_policy: FAIL_RELOAD",
            &format!("failure_policy: {policy}"),
        )
    }));
    Stack::start(options).await
}

/// The filter's VM failing (a trap, as a bug would cause) before a claim and
/// after one, with another owned request in flight on the same VM.
async fn a_failing_vm(policy: &'static str) {
    let stack = faulty_stack(policy).await;
    let mut c = Checks::default();
    let h2 = H2::connect(stack.port).await;
    let reloads = policy == "FAIL_RELOAD";

    // Before the claim: nothing is claimed, nothing runs.
    let k1 = fresh_key("vm-request");
    let first = h2.pay(&k1, 0, Some("request")).await;
    c.check(
        first.as_ref().is_none_or(|(s, _)| *s == 503),
        format!("a VM failing before the claim: {first:?}"),
    );
    c.check(stack.upstream.executions(&k1) == 0, "executed with a failed VM");
    c.check(
        state(&stack, ROUTE, &k1).await == "none",
        "claimed by a failed VM",
    );
    if reloads {
        // A new VM takes over after Envoy's backoff; the key, never claimed,
        // runs once.
        eventually("the VM to be reloaded", Duration::from_secs(10), || async {
            let probe = h2.pay(&fresh_key("vm-probe"), 0, None).await;
            probe.is_some_and(|(s, _)| s == 201)
        })
        .await;
        let recovered = h2.pay(&k1, 0, None).await;
        c.check(
            recovered.as_ref().is_some_and(|(s, _)| *s == 201),
            format!("the key after the VM was reloaded: {recovered:?}"),
        );
        executed_once(&mut c, &stack, "the key after the reload", &k1).await;
    } else {
        // Every later request on that worker gets Envoy's 503.
        let next = h2.pay(&k1, 0, None).await;
        c.check(
            next.as_ref().is_none_or(|(s, _)| *s == 503),
            format!("a request after the VM failed: {next:?}"),
        );
        let n = stack.upstream.executions(&k1);
        c.check(n == 0, format!("ran {n} times after the VM failed"));
    }

    // After the claim: one request is forwarded and slow, another's response
    // kills the VM. Both keys end unknown when their leases run out.
    let h2 = H2::to_a_live_vm(stack.port).await;
    let (slow, killer) = (fresh_key("vm-slow"), fresh_key("vm-killer"));
    let claimed_at = Instant::now();
    let slow_first = {
        let h2 = H2 {
            sender: h2.sender.clone(),
            port: h2.port,
        };
        let slow = slow.clone();
        tokio::spawn(async move { h2.pay(&slow, 1_500, None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = h2.pay(&killer, 0, Some("response")).await;
    let slow_first = slow_first.await.unwrap();
    // Envoy answers both itself: the VM that owned them is gone.
    for (what, first) in [("the slow request", &slow_first), ("the killer", &killed)] {
        c.check(
            first.as_ref().is_none_or(|(s, _)| *s == 503),
            format!("{what} when the VM failed: {first:?}"),
        );
    }
    past_the_lease(claimed_at).await;
    for (what, key) in [("the slow request", &slow), ("the killer", &killer)] {
        let again = send(pay(&stack, key, 0)).await;
        // Under FAIL_CLOSED a retry may meet the worker whose VM is gone.
        let closed = !reloads && again.status == 503 && again.body.is_empty();
        c.check(
            problem(&again) == (409, Some("outcome-unknown".into())) || closed,
            format!("{what} after its lease: {again:?}"),
        );
        transitions_are(&mut c, &stack, what, ROUTE, key, &["claimed", "lease_expired"]).await;
        executed_once(&mut c, &stack, what, key).await;
    }
    c.finish(
        &format!("lifecycle: wasm VM failure, {policy}"),
        "1 key failing before its claim, 2 owned keys on the failing VM".into(),
        "—".into(),
        format!("VM trap (fault-injection build) before the claim and in the response phase, failure_policy {policy}"),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vm_failure_under_fail_reload() {
    a_failing_vm("FAIL_RELOAD").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vm_failure_under_fail_closed() {
    a_failing_vm("FAIL_CLOSED").await;
}

/// Why docs/operations.md rules FAIL_OPEN out: once the VM failed, Envoy
/// skips the filter, so a covered request runs with no claim and its retry
/// runs again.
#[tokio::test(flavor = "multi_thread")]
async fn under_fail_open_a_failed_vm_lets_a_retry_run_twice() {
    let stack = faulty_stack("FAIL_OPEN").await;
    let mut c = Checks::default();
    let h2 = H2::connect(stack.port).await;
    let k = fresh_key("vm-open");
    let failing = h2.pay(&k, 0, Some("request")).await;
    c.check(
        failing.as_ref().is_none_or(|(s, _)| *s == 503),
        format!("the request that failed the VM: {failing:?}"),
    );
    // From then on the worker skips the filter: the same request twice.
    for attempt in 1..=2 {
        let answer = h2.pay(&k, 0, None).await;
        c.check(
            answer.as_ref().is_some_and(|(s, _)| *s == 201),
            format!("attempt {attempt} on the failed VM: {answer:?}"),
        );
    }
    c.check(state(&stack, ROUTE, &k).await == "none", "a claim by a failed VM");
    let n = stack.upstream.executions(&k);
    c.check(n == 2, format!("{n} executions, expected the unprotected 2"));
    c.finish(
        "lifecycle: wasm VM failure, FAIL_OPEN (ruled out in operations.md)",
        "1 key and its retry on the failed VM".into(),
        "—".into(),
        "VM trap before the claim; Envoy skips the filter from then on: a request and its retry both run"
            .into(),
    );
}

/// A request to the lifecycle policy written by hand: its head (with
/// `extra` header lines) and the two halves of its body.
fn raw_request(key: &str, extra: &str) -> (String, &'static str, &'static str) {
    let head = format!(
        "POST /lifecycle/pay HTTP/1.1\r\nhost: envoy\r\ncontent-type: application/json\r\n\
         x-tenant-id: tenant-a\r\nx-user-id: alice\r\nidempotency-key: {key}\r\n{extra}\
         content-length: {}\r\n\r\n",
        PAYMENT.len()
    );
    let (first, second) = PAYMENT.split_at(PAYMENT.len() / 2);
    (head, first, second)
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_clients_claim_nothing_before_their_body_and_settle_without_reading() {
    let stack = Stack::start(options()).await;
    let mut c = Checks::default();
    let connect = || TcpStream::connect(("127.0.0.1", stack.port));

    // A body sent slowly: nothing is claimed until it is complete.
    let slow = fresh_key("slow-body");
    let (head, first, second) = raw_request(&slow, "");
    let mut conn = connect().await.unwrap();
    conn.write_all(format!("{head}{first}").as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    c.check(
        state(&stack, ROUTE, &slow).await == "none",
        "claimed before the body was complete",
    );
    conn.write_all(second.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 64];
    let n = conn.read(&mut answer).await.unwrap_or(0);
    let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
    c.check(
        answer.starts_with("HTTP/1.1 201"),
        format!("the slow body's answer: {answer:?}"),
    );
    c.check(
        replayed(&send(pay(&stack, &slow, 0)).await),
        "the slow body's retry did not replay",
    );
    executed_once(&mut c, &stack, "slow body", &slow).await;

    // A client that gives up halfway through its body burns nothing.
    let quit = fresh_key("quit-body");
    let (head, first, _) = raw_request(&quit, "");
    let mut conn = connect().await.unwrap();
    conn.write_all(format!("{head}{first}").as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let history = stack.history("tenant-a", "alice", ROUTE, &quit).await;
    let events = history
        .as_ref()
        .and_then(|h| h["events"].as_array())
        .map_or(0, Vec::len);
    c.check(events == 0, format!("a body given up left history: {history:?}"));
    let whole = send(pay(&stack, &quit, 0)).await;
    c.check(
        whole.status == 201 && !replayed(&whole),
        format!("the whole request after one given up: {whole:?}"),
    );
    executed_once(&mut c, &stack, "given-up body", &quit).await;

    // Clients that never read their response: its record completes anyway,
    // whether the response is kept (400 kB) or too large to keep (3 MB).
    let mut unread = Vec::new();
    for size in [400_000, 3_000_000] {
        let key = fresh_key("unread");
        let (head, first, second) = raw_request(&key, &format!("x-test-body-size: {size}\r\n"));
        let mut conn = connect().await.unwrap();
        conn.write_all(format!("{head}{first}{second}").as_bytes())
            .await
            .unwrap();
        unread.push((size, key, conn));
    }
    for (size, key, _) in &unread {
        let done = e2e::poll("the record to complete", Duration::from_secs(10), || async {
            let s = state(&stack, ROUTE, key).await;
            (s != "in_progress" && s != "none").then_some(s)
        })
        .await;
        c.check(done == "completed", format!("{size} bytes unread: {done}"));
        let again = send(pay(&stack, key, 0).header("x-test-body-size", size.to_string())).await;
        let ok = if *size < 512 * 1024 {
            replayed(&again) && again.body.len() == *size
        } else {
            problem(&again) == (409, Some("result-unavailable".into()))
        };
        c.check(
            ok,
            format!("the retry of {size} bytes unread: {:?}", problem(&again)),
        );
        executed_once(&mut c, &stack, "unread", key).await;
    }
    drop(unread);
    c.finish(
        "lifecycle: slow clients",
        "1 body over 1.2 s, 1 given up mid-body, 2 responses never read (400 kB, 3 MB)".into(),
        "slow and vanishing clients".into(),
        "—".into(),
    );
}
