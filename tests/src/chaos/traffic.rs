//! The chaos traffic: workers that send mixed scenarios through Envoy and
//! record every request and its answer.
//!
//! A share of the scenarios calls the gRPC method ([`GRPC`]) with a gRPC
//! client: HTTP/2 with prior knowledge, one length-prefixed message frame,
//! `content-type: application/grpc` and `te: trailers`, the identity and
//! `idempotency-key` as metadata. Its answer is recorded as an [`Answer`]
//! whose headers hold the response headers and then the trailers, and whose
//! body holds the message frames as they came.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::answers::problem_of;
use super::{
    now_ms, policy, route_of, seed, Rng, ScopeId, GRPC, LARGE_STORED_BODY, RELAYED_BODY, RENEW_TTL_MS,
    STORED_BODY,
};
use crate::Answer;

/// A knob of the client, not of the upstream (which ignores the header):
/// the client stops waiting after this many milliseconds.
pub const LEAVES_AFTER: &str = "x-chaos-client-leaves-after-ms";

/// The test upstream answers a body of this many bytes (not JSON; its
/// `Location` names the execution).
const BODY_SIZE: &str = "x-test-body-size";

/// At most this many scenarios with responses near 4 MiB at a time: two
/// cores, and every such response crosses Envoy, the store and the client.
const HUGE_AT_A_TIME: usize = 2;

/// One request a worker sent, and what came back.
#[derive(Debug)]
pub struct Sent {
    pub scope: ScopeId,
    pub path: &'static str,
    pub body: String,
    pub knobs: Vec<(&'static str, String)>,
    /// When it was sent (ms since the Unix epoch).
    pub at_ms: i64,
    /// `Err`: no HTTP answer at all (Envoy restarting, connection reset).
    pub outcome: Result<Answer, String>,
}

/// One in this many scenarios calls the gRPC method.
const GRPC_SHARE: u64 = 14;

/// The whole time a client gives a request (as the HTTP client's timeout).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// What the workers share.
pub struct Traffic {
    pub client: reqwest::Client,
    /// The gRPC client: HTTP/2 only, with prior knowledge.
    pub grpc: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
    /// Scenarios sent to the gRPC method.
    pub grpc_scenarios: AtomicUsize,
    pub base: String,
    /// A random tag inside every key, so logs can be searched for any of them.
    pub tag: String,
    pub sent: Mutex<Vec<Sent>>,
    /// Scenarios with responses near 4 MiB in flight.
    huge: AtomicUsize,
}

impl Traffic {
    pub fn new(base: String) -> Arc<Traffic> {
        let tag = format!("ck{:010x}", seed() & 0xff_ffff_ffff);
        Arc::new(Traffic {
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(4)
                .timeout(CLIENT_TIMEOUT)
                .build()
                .unwrap_or_else(|e| panic!("client: {e}")),
            grpc: hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
            grpc_scenarios: AtomicUsize::new(0),
            base,
            tag,
            sent: Mutex::new(Vec::new()),
            huge: AtomicUsize::new(0),
        })
    }

    /// The answers so far that were 503 `store-unavailable`.
    pub fn store_unavailable(&self) -> usize {
        (self.sent.lock().unwrap().iter())
            .filter_map(|s| s.outcome.as_ref().ok())
            .filter(|a| a.problem().as_deref() == Some("store-unavailable"))
            .count()
    }

    pub async fn send(
        &self,
        scope: &ScopeId,
        path: &'static str,
        body: &str,
        knobs: &[(&'static str, String)],
    ) -> Result<Answer, String> {
        if policy(scope.route).grpc {
            let at_ms = now_ms();
            let outcome = self.call_grpc(scope, path, body, knobs).await;
            self.record(scope, path, body, knobs, at_ms, &outcome);
            return outcome;
        }
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .header("x-tenant-id", &scope.tenant)
            .header("x-user-id", &scope.user)
            .header("idempotency-key", &scope.key)
            .body(body.to_string());
        for (name, value) in knobs {
            req = req.header(*name, value);
            if *name == LEAVES_AFTER {
                if let Ok(ms) = value.parse() {
                    req = req.timeout(Duration::from_millis(ms));
                }
            }
        }
        let at_ms = now_ms();
        let outcome = match req.send().await {
            Ok(res) => {
                let status = res.status().as_u16();
                let headers = res.headers().clone();
                match res.bytes().await {
                    Ok(body) => Ok(Answer {
                        status,
                        headers,
                        body,
                    }),
                    Err(e) => Err(format!("body: {}", why(&e))),
                }
            }
            Err(e) => Err(why(&e)),
        };
        self.record(scope, path, body, knobs, at_ms, &outcome);
        outcome
    }

    /// Records a request and its answer.
    fn record(
        &self,
        scope: &ScopeId,
        path: &'static str,
        body: &str,
        knobs: &[(&'static str, String)],
        at_ms: i64,
        outcome: &Result<Answer, String>,
    ) {
        let copy = match outcome {
            Ok(a) => Ok(Answer {
                status: a.status,
                headers: a.headers.clone(),
                body: a.body.clone(),
            }),
            Err(e) => Err(e.clone()),
        };
        if let Ok(mut sent) = self.sent.lock() {
            sent.push(Sent {
                scope: scope.clone(),
                path,
                at_ms,
                body: body.to_string(),
                knobs: knobs.to_vec(),
                outcome: copy,
            });
        }
    }

    /// A gRPC unary call of `path` with `body` as its one message; the
    /// knobs go as request metadata.
    async fn call_grpc(
        &self,
        scope: &ScopeId,
        path: &'static str,
        body: &str,
        knobs: &[(&'static str, String)],
    ) -> Result<Answer, String> {
        let mut req = hyper::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-tenant-id", &scope.tenant)
            .header("x-user-id", &scope.user)
            .header("idempotency-key", &scope.key);
        for (name, value) in knobs {
            req = req.header(*name, value);
        }
        let req = req
            .body(Full::new(Bytes::from(grpc_frame(body.as_bytes()))))
            .map_err(|e| format!("request: {e}"))?;
        let call = async {
            let res = self.grpc.request(req).await.map_err(|e| legacy_why(&e))?;
            let status = res.status().as_u16();
            let (parts, incoming) = res.into_parts();
            let collected = incoming
                .collect()
                .await
                .map_err(|e| format!("body: {}", innermost(&e)))?;
            let mut headers = parts.headers;
            // The trailers after the headers: a gRPC status is read from
            // either (trailers-only answers carry it in the headers).
            if let Some(trailers) = collected.trailers() {
                for (name, value) in trailers {
                    headers.append(name, value.clone());
                }
            }
            Ok(Answer {
                status,
                headers,
                body: collected.to_bytes(),
            })
        };
        match tokio::time::timeout(CLIENT_TIMEOUT, call).await {
            Ok(outcome) => outcome,
            Err(_) => Err("timeout".into()),
        }
    }
}

/// One gRPC message frame: uncompressed, its length, the message.
pub fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut frame = vec![0];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    frame
}

/// Why a gRPC call got no answer: `connect` or the innermost cause.
fn legacy_why(e: &hyper_util::client::legacy::Error) -> String {
    if e.is_connect() {
        return "connect".into();
    }
    innermost(e)
}

fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

/// Why a request got no answer: `timeout`, `connect` or the innermost cause.
fn why(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        return "timeout".into();
    }
    if e.is_connect() {
        return "connect".into();
    }
    let mut cause: &dyn std::error::Error = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

const TENANTS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];

fn retryable(outcome: &Result<Answer, String>) -> bool {
    match outcome {
        Err(_) => true,
        Ok(a) => matches!(
            problem_of(a).as_deref(),
            Some("store-unavailable" | "request-in-progress")
        ),
    }
}

/// One worker: scenarios back to back until `deadline` (and at most `max`).
/// `kinds` < 100 leaves out the later scenarios (slow and failing calls).
pub async fn worker(
    traffic: Arc<Traffic>,
    id: u64,
    deadline: Instant,
    max: u64,
    pause: Duration,
    kinds: u64,
) {
    let mut rng = Rng::new(seed() ^ (id << 48) ^ id);
    for n in 0..max {
        if Instant::now() >= deadline {
            break;
        }
        let grpc = rng.below(GRPC_SHARE) == 0;
        let mut path: &'static str = match rng.below(14) {
            _ if grpc => GRPC.path,
            0 | 1 => "/wait",
            2 | 3 => "/release",
            4 | 5 => "/renew",
            6 | 7 => "/detached",
            8 | 9 => "/background",
            10 => "/large",
            _ => "/pay",
        };
        // One scenario in 25 (not in the soak): a response near or above
        // the route's max_stored_body; a third of them near 4 MiB, on /large.
        // (The gRPC method keeps the default 512 KiB and is not among them.)
        let large = kinds >= 100 && rng.below(25) == 0 && !grpc;
        let huge = large
            && (path == "/large" || rng.below(3) == 0)
            && traffic
                .huge
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < HUGE_AT_A_TIME).then_some(n + 1)
                })
                .is_ok();
        if large && huge {
            path = "/large";
        } else if large && path == "/large" {
            // Too many near 4 MiB already: 512 KiB on another route.
            path = "/pay";
        }
        let scope = ScopeId {
            tenant: TENANTS[rng.below(3) as usize].to_string(),
            user: format!("user-{}", rng.below(2)),
            route: route_of(path),
            key: format!("{}-{id}-{n}", traffic.tag),
        };
        let amount = 100 + rng.below(10_000);
        let body = format!(r#"{{"amount": {amount}, "currency": "EUR", "note": "w{id} n{n}"}}"#);
        let t = &traffic;
        let kind = rng.below(kinds.min(100));
        if grpc {
            t.grpc_scenarios.fetch_add(1, Ordering::Relaxed);
        }
        if large {
            large_response(t, &scope, path, &body, large_size(&mut rng, path)).await;
            if huge {
                t.huge.fetch_sub(1, Ordering::SeqCst);
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            continue;
        }
        match kind {
            // A unique key; retried like a careful client would.
            0..=29 => {
                for _ in 0..3 {
                    if !retryable(&t.send(&scope, path, &body, &[]).await) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            // Retries after the answer: must replay; on /renew, the last
            // retry comes after the key expired and runs again.
            30..=44 => {
                t.send(&scope, path, &body, &[]).await.ok();
                t.send(&scope, path, &body, &[]).await.ok();
                let pause = if path == "/renew" {
                    RENEW_TTL_MS + 200 + rng.below(1_500)
                } else {
                    100
                };
                tokio::time::sleep(Duration::from_millis(pause)).await;
                t.send(&scope, path, &body, &[]).await.ok();
            }
            // Concurrent duplicates.
            45..=59 => {
                let copies = 2 + rng.below(5);
                let mut all = Vec::new();
                for i in 0..copies {
                    let (t, scope, body) = (t.clone(), scope.clone(), body.clone());
                    let knobs = if i == 0 {
                        vec![("x-test-delay-ms", "300".to_string())]
                    } else {
                        vec![]
                    };
                    all.push(tokio::spawn(async move {
                        t.send(&scope, path, &body, &knobs).await.ok();
                    }));
                }
                for task in all {
                    let _ = task.await;
                }
            }
            // The same key with another body.
            60..=69 => {
                t.send(&scope, path, &body, &[]).await.ok();
                let changed = body.replace(
                    &format!("\"amount\": {amount}"),
                    &format!("\"amount\": {}", amount + 1),
                );
                t.send(&scope, path, &changed, &[]).await.ok();
            }
            // Detached: a slow call whose client stops waiting early; the
            // request goes on without it, and a retry after it finished
            // must replay it (or, if its upstream timed out, find it
            // unknown).
            70..=79 if path == "/detached" => {
                let delay = 500 + rng.below(3_500);
                let leaves = 100 + rng.below(300);
                let started = Instant::now();
                t.send(
                    &scope,
                    path,
                    &body,
                    &[
                        ("x-test-delay-ms", delay.to_string()),
                        (LEAVES_AFTER, leaves.to_string()),
                    ],
                )
                .await
                .ok();
                t.send(&scope, path, &body, &[]).await.ok();
                let done = Duration::from_millis(delay + 300);
                tokio::time::sleep(done.saturating_sub(started.elapsed())).await;
                for _ in 0..3 {
                    if !retryable(&t.send(&scope, path, &body, &[]).await) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            // Slow, sometimes slower than the lease, with a duplicate meanwhile.
            70..=79 => {
                let delay = 500 + rng.below(3_500);
                let (t2, scope2, body2) = (t.clone(), scope.clone(), body.clone());
                let first = tokio::spawn(async move {
                    t2.send(&scope2, path, &body2, &[("x-test-delay-ms", delay.to_string())])
                        .await
                        .ok();
                });
                tokio::time::sleep(Duration::from_millis(300)).await;
                t.send(&scope, path, &body, &[]).await.ok();
                let _ = first.await;
                t.send(&scope, path, &body, &[]).await.ok();
            }
            // Failing upstream calls, then a retry.
            _ => {
                let knob = match kind {
                    // Acted, then failed (stored), and refused before
                    // acting (released), in gRPC's terms.
                    80..=84 if grpc => ("x-test-grpc-status", "13".to_string()),
                    85..=89 if grpc => ("x-test-grpc-status", "8".to_string()),
                    80..=84 => ("x-test-status", "500".to_string()),
                    85..=89 => ("x-test-status", "429".to_string()),
                    90..=93 => ("x-test-reset", "1".to_string()),
                    94..=96 => ("x-test-control", "uncertain".to_string()),
                    _ => ("x-test-status", "201".to_string()),
                };
                if kind >= 97 {
                    // Two tenants, one key, at the same time.
                    let other = ScopeId {
                        tenant: TENANTS
                            [(TENANTS.iter().position(|x| *x == scope.tenant).unwrap_or(0) + 1) % 3]
                            .to_string(),
                        ..scope.clone()
                    };
                    let (t2, body2) = (t.clone(), body.clone());
                    let b = tokio::spawn(async move {
                        t2.send(&other, path, &body2, &[("x-test-delay-ms", "200".to_string())])
                            .await
                            .ok();
                    });
                    t.send(&scope, path, &body, &[("x-test-delay-ms", "200".to_string())])
                        .await
                        .ok();
                    let _ = b.await;
                } else {
                    t.send(&scope, path, &body, &[knob]).await.ok();
                    t.send(&scope, path, &body, &[]).await.ok();
                }
            }
        }
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

/// A response size near the route's limits: just below, at and just above
/// `max_stored_body`; on /detached also above `max_response_body` (not
/// relayed); on /large (4 MiB kept) also past Envoy's buffer (4.25 MiB in
/// envoy/chaos.yaml), which streams on while its record is written.
fn large_size(rng: &mut Rng, path: &str) -> usize {
    let (limit, beyond) = match path {
        "/large" => (LARGE_STORED_BODY, LARGE_STORED_BODY + 512 * 1024),
        "/detached" => (STORED_BODY, RELAYED_BODY + 1),
        _ => (STORED_BODY, STORED_BODY + 100 * 1024),
    };
    match rng.below(4) {
        0 => limit - 1 - rng.below(4_096) as usize,
        1 => limit,
        2 => limit + 1,
        _ => beyond,
    }
}

/// A large response (`size` bytes) and two retries: at once (under `settle:
/// background`, or past Envoy's buffer, it may still be recorded: 409
/// request-in-progress) and 200 ms later. A stored one replays; a longer one
/// answers 409 result-unavailable.
async fn large_response(t: &Traffic, scope: &ScopeId, path: &'static str, body: &str, size: usize) {
    let knobs = [(BODY_SIZE, size.to_string())];
    for _ in 0..3 {
        if !retryable(&t.send(scope, path, body, &knobs).await) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    t.send(scope, path, body, &knobs).await.ok();
    tokio::time::sleep(Duration::from_millis(200)).await;
    t.send(scope, path, body, &knobs).await.ok();
}

/// `count` workers sending every scenario at full speed until `deadline`.
pub fn at_full_speed(
    traffic: &Arc<Traffic>,
    count: u64,
    deadline: Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..count)
        .map(|id| {
            tokio::spawn(worker(
                traffic.clone(),
                id,
                deadline,
                100_000,
                Duration::ZERO,
                100,
            ))
        })
        .collect()
}
