//! The chaos traffic: workers that send mixed scenarios through Envoy and
//! record every request and its answer.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{now_ms, route_of, seed, Rng, ScopeId, RENEW_TTL_MS};
use crate::Answer;

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

/// What the workers share.
pub struct Traffic {
    pub client: reqwest::Client,
    pub base: String,
    /// A random tag inside every key, so logs can be searched for any of them.
    pub tag: String,
    pub sent: Mutex<Vec<Sent>>,
}

impl Traffic {
    pub fn new(base: String) -> Arc<Traffic> {
        let tag = format!("ck{:010x}", seed() & 0xff_ffff_ffff);
        Arc::new(Traffic {
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(4)
                .timeout(Duration::from_secs(15))
                .build()
                .unwrap_or_else(|e| panic!("client: {e}")),
            base,
            tag,
            sent: Mutex::new(Vec::new()),
        })
    }

    pub async fn send(
        &self,
        scope: &ScopeId,
        path: &'static str,
        body: &str,
        knobs: &[(&'static str, String)],
    ) -> Result<Answer, String> {
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
                    Err(e) => Err(format!("body: {e}")),
                }
            }
            Err(e) => Err(e.to_string()),
        };
        let copy = match &outcome {
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
        outcome
    }
}

const TENANTS: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];

fn retryable(outcome: &Result<Answer, String>) -> bool {
    match outcome {
        Err(_) => true,
        Ok(a) => matches!(
            a.problem().as_deref(),
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
        let path: &'static str = match rng.below(10) {
            0 | 1 => "/wait",
            2 | 3 => "/release",
            4 | 5 => "/renew",
            _ => "/pay",
        };
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
