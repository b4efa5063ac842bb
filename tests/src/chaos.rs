//! The chaos run and its audit.
//!
//! Workers send mixed traffic through Envoy for a fixed time (unique keys,
//! retries, concurrent duplicates, changed bodies, slow, failing, resetting
//! and uncertain upstream calls, one key shared by two tenants) to four
//! routes: two with the default policy, one with `on_unknown: release` and a
//! 2 s lease, one with `after_expiry: new` and a 2 s TTL (retried after the
//! expiry). Meanwhile a fault loop SIGKILLs and restarts store replicas,
//! freezes one past the filter's store timeout (SIGSTOP, then SIGCONT),
//! restarts Envoy and resets every upstream connection. Every request and its
//! answer is recorded; the upstream logs every execution and when it arrived.
//!
//! The audit then compares three independent views — the upstream's
//! execution log, the store's whole history (every generation of every key,
//! admin lookup) and every answer a client got — and counts each broken
//! promise:
//!
//! - double executions: an execution runs in the generation claimed last
//!   before it arrived; a generation runs at most once, and a scope runs again
//!   only after each earlier execution was released (the upstream refused
//!   before acting) or, as its route's policy allows, after its generation
//!   ended unknown or with its lease run out (`on_unknown: release`) or had
//!   expired when the next one was claimed (`after_expiry: new`);
//! - burnt keys: a current generation left unknown or in progress, after the
//!   run settled, whose upstream never ran;
//! - executions of abandoned claims: the filter abandons only what it never
//!   forwarded;
//! - violations: an answer that is not what the contract allows (a replay of
//!   an execution the store did not keep or of another request body, a 422
//!   for the same body, `outcome-unknown` under `on_unknown: release`, a
//!   malformed or unexpected problem, a problem body with internals, a 2xx
//!   nobody executed); an execution with no claim before it, or after its
//!   generation was released; store records that disagree with the
//!   executions (completed with another status or body length, completed
//!   without an execution, released although the upstream acted, replaced
//!   before it expired, still in progress long after its lease); a completed
//!   record that does not replay byte-identical, an unknown one (where
//!   `on_unknown: conflict`) that does not answer 409 `outcome-unknown`, or
//!   any execution caused by those checks; a log line of any process that
//!   contains a raw key.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::stack::Stack;
use crate::{Answer, Execution};

/// `(tenant, principal, route, key)`: what a record is scoped to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ScopeId {
    pub tenant: String,
    pub user: String,
    pub route: &'static str,
    pub key: String,
}

/// A policy of `envoy/chaos.yaml`, as far as the audit judges by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub name: &'static str,
    /// The path the workers send to (the policy's prefix).
    pub path: &'static str,
    /// `on_unknown: release`: a key whose outcome is unknown, or whose lease
    /// ran out, may be claimed (and executed) again.
    pub release_on_unknown: bool,
    /// `after_expiry: new`: an expired key is a first request again.
    pub renew_after_expiry: bool,
}

/// Every covered route of `envoy/chaos.yaml`; the first is the default.
pub const ROUTES: [Route; 4] = [
    Route {
        name: "payments.create",
        path: "/pay",
        release_on_unknown: false,
        renew_after_expiry: false,
    },
    Route {
        name: "orders.wait",
        path: "/wait",
        release_on_unknown: false,
        renew_after_expiry: false,
    },
    Route {
        name: "payments.release",
        path: "/release",
        release_on_unknown: true,
        renew_after_expiry: false,
    },
    Route {
        name: "payments.renew",
        path: "/renew",
        release_on_unknown: false,
        renew_after_expiry: true,
    },
];

/// The TTL of `payments.renew` in `envoy/chaos.yaml`, in milliseconds.
const RENEW_TTL_MS: u64 = 2_000;

pub fn route_of(path: &str) -> &'static str {
    policy_of_path(path).name
}

fn policy_of_path(path: &str) -> Route {
    ROUTES
        .iter()
        .skip(1)
        .find(|r| path.starts_with(r.path))
        .copied()
        .unwrap_or(ROUTES[0])
}

/// The policy of a route name (the default one for a name not in the table).
pub fn policy(route: &str) -> Route {
    ROUTES
        .iter()
        .find(|r| r.name == route)
        .copied()
        .unwrap_or(ROUTES[0])
}

/// One request a worker sent, and what came back.
#[derive(Debug)]
pub struct Sent {
    pub scope: ScopeId,
    pub path: &'static str,
    pub body: String,
    pub knobs: Vec<(&'static str, String)>,
    /// `Err`: no HTTP answer at all (Envoy restarting, connection reset).
    pub outcome: Result<Answer, String>,
}

/// Problem types the chaos traffic may legitimately meet.
const EXPECTED_PROBLEMS: [&str; 4] = [
    "key-reused",
    "request-in-progress",
    "outcome-unknown",
    "store-unavailable",
];

/// Markers of internals that must never appear in a problem body.
pub const INTERNALS: [&str; 13] = [
    "SELECT ",
    "INSERT ",
    "UPDATE ",
    "sqlite",
    "SQLite",
    "postgres",
    "/tmp/",
    "/home/",
    "/root/",
    ".rs:",
    "panicked",
    "backtrace",
    "stack backtrace",
];

/// Small deterministic generator: reproducible enough, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7)
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

/// What the fault loop did.
#[derive(Debug, Default, Clone)]
pub struct Faults {
    pub store_kills: u64,
    /// A replica frozen (SIGSTOP) past the filter's 1 s store timeout, then
    /// let run again (SIGCONT): a slow store rather than a dead one.
    pub store_stalls: u64,
    pub envoy_restarts: u64,
    pub upstream_resets: u64,
    /// Connections dropped by those resets.
    pub connections_reset: u64,
    /// Every fault with its start and end (ms since the Unix epoch), to tell
    /// which fault a finding of the audit follows.
    pub windows: Vec<(&'static str, i64, i64)>,
}

impl Faults {
    pub fn summary(&self) -> String {
        format!(
            "{} store SIGKILLs, {} store stalls (SIGSTOP {STALL_MS} ms), {} Envoy restarts, \
             {} upstream resets ({} connections)",
            self.store_kills,
            self.store_stalls,
            self.envoy_restarts,
            self.upstream_resets,
            self.connections_reset
        )
    }

    /// The fault that left a generation claimed at `at` unknown without its
    /// upstream running, as the contract says it must (§5): Envoy killed, or
    /// the upstream connections reset, while the request was in flight (at
    /// most the route's timeout after the claim). Neither the filter nor the
    /// store can tell then whether the upstream read the request.
    pub fn left_unknown_by_contract(&self, at: i64) -> Option<&'static str> {
        self.windows
            .iter()
            .find(|(name, from, _)| {
                matches!(*name, "Envoy SIGKILL" | "upstream reset")
                    && at <= *from
                    && *from - at <= ROUTE_TIMEOUT_MS
            })
            .map(|(name, _, _)| *name)
    }

    /// The fault nearest to `at` (ms since the Unix epoch), for a finding.
    pub fn near(&self, at: i64) -> String {
        let distance = |(_, from, to): &&(&'static str, i64, i64)| {
            if at < *from {
                from - at
            } else {
                (at - to).max(0)
            }
        };
        match self.windows.iter().min_by_key(distance) {
            Some(w @ (name, from, to)) => format!(
                "{} ms from a {name} ({} ms long, {} ms {})",
                distance(&w),
                to - from,
                (at - from).abs(),
                if at < *from {
                    "before it began"
                } else {
                    "after it began"
                }
            ),
            None => "no fault injected".into(),
        }
    }
}

/// The covered routes' timeout in envoy/chaos.yaml.
const ROUTE_TIMEOUT_MS: i64 = 10_000;

/// How long a stalled replica stays frozen: past the filter's 1 s store
/// timeout (envoy/chaos.yaml), so claims it committed are never answered in
/// time.
pub const STALL_MS: u64 = 1_500;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Injects faults in rotation until `deadline`, leaving everything running.
pub async fn inject_faults(stack: &mut Stack, deadline: Instant, every: Duration) -> Faults {
    let mut faults = Faults::default();
    let mut rng = Rng::new(seed());
    let replicas = stack.stores.len();
    let mut step = 0usize;
    while Instant::now() + every < deadline {
        tokio::time::sleep(every).await;
        // Alternate replicas; with one, always the same.
        let r = step % replicas;
        let from = now_ms();
        let name = match step % 5 {
            0 => {
                stack.kill_store(r);
                faults.store_kills += 1;
                tokio::time::sleep(Duration::from_millis(300 + rng.below(1_200))).await;
                stack.start_store(r);
                stack.wait_store(r).await;
                "store SIGKILL"
            }
            1 | 4 => {
                stack.signal_store(r, true);
                faults.store_stalls += 1;
                tokio::time::sleep(Duration::from_millis(STALL_MS)).await;
                stack.signal_store(r, false);
                "store stall"
            }
            2 => {
                faults.upstream_resets += 1;
                faults.connections_reset += stack.upstream.reset_connections() as u64;
                "upstream reset"
            }
            _ => {
                stack.kill_envoy();
                faults.envoy_restarts += 1;
                tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
                stack.start_envoy();
                stack.wait_envoy().await;
                "Envoy SIGKILL"
            }
        };
        faults.windows.push((name, from, now_ms()));
        step += 1;
    }
    faults
}

/// What the audit found.
#[derive(Debug, Default)]
pub struct Audit {
    pub requests: usize,
    pub answers: usize,
    pub transport_errors: usize,
    pub scopes: usize,
    pub executions: usize,
    pub replays_checked: usize,
    pub unknown_checked: usize,
    pub by_outcome: BTreeMap<String, usize>,
    /// Requests that repeated a key (same or changed body).
    pub duplicates: usize,
    /// Requests that reused a key with another body.
    pub changed_bodies: usize,
    /// Keys sent by more than one tenant.
    pub shared_keys: usize,
    /// Generations in the store's history of all scopes, and how the ended
    /// ones ended.
    pub generations: usize,
    pub ended: BTreeMap<String, usize>,
    /// Executions the policy allowed after an earlier one of the scope, by
    /// reason (released, unknown or lease run out, expired).
    pub reruns: BTreeMap<&'static str, usize>,
    pub double_executions: Vec<String>,
    pub violations: Vec<String>,
    /// Current generations left unknown or in progress, after the run
    /// settled, whose upstream never ran: keys burnt for their TTL.
    pub burnt_keys: Vec<String>,
    /// When each burnt key's generation was claimed (ms since the epoch).
    pub burnt_at: Vec<i64>,
    /// Burnt keys an Envoy kill or an upstream reset left unknown while their
    /// request was in flight: what the contract prescribes, so counted apart,
    /// not as violations (see [`Audit::excuse`]).
    pub unknown_by_contract: Vec<String>,
    /// Executions inside a generation the store ended as abandoned (the
    /// filter abandons only what it never forwarded).
    pub abandoned_executed: Vec<String>,
}

impl Audit {
    /// Moves the burnt keys that `cause` explains (a fault after which the
    /// contract leaves the record unknown) out of the violations.
    pub fn excuse(&mut self, cause: impl Fn(i64) -> Option<&'static str>) {
        let burnt = std::mem::take(&mut self.burnt_keys);
        let at = std::mem::take(&mut self.burnt_at);
        for (key, at) in burnt.into_iter().zip(at) {
            match cause(at) {
                Some(fault) => self
                    .unknown_by_contract
                    .push(format!("{key} (in flight at a {fault})")),
                None => {
                    self.burnt_keys.push(key);
                    self.burnt_at.push(at);
                }
            }
        }
    }

    pub fn total_violations(&self) -> usize {
        self.double_executions.len()
            + self.violations.len()
            + self.burnt_keys.len()
            + self.abandoned_executed.len()
    }

    /// The hostile part of the traffic, for the results table.
    pub fn hostile(&self) -> String {
        format!(
            "{} duplicate requests, {} with a changed body, {} keys sent by two tenants",
            self.duplicates, self.changed_bodies, self.shared_keys
        )
    }

    /// The verdict column of the results table.
    pub fn verdict(&self) -> String {
        format!(
            "{} double executions, {} contract violations, {} burnt keys, {} executions of abandoned claims \
             ({} replays, {} unknown records re-checked; {} generations, re-run after {}; \
             {} left unknown by an Envoy kill or upstream reset in flight)",
            self.double_executions.len(),
            self.violations.len(),
            self.burnt_keys.len(),
            self.abandoned_executed.len(),
            self.replays_checked,
            self.unknown_checked,
            self.generations,
            self.reruns_text(),
            self.unknown_by_contract.len()
        )
    }

    fn reruns_text(&self) -> String {
        let n = |k: &str| self.reruns.get(k).copied().unwrap_or(0);
        format!(
            "release {}, unknown or lease run-out {}, expiry {}",
            n("released"),
            n("unknown"),
            n("expired")
        )
    }

    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} requests ({} answered, {} transport errors), {} scopes, {} executions, \
             {} replays and {} unknown records re-checked; outcomes {:?}; \
             {} generations, ended {:?}, re-run after {}; \
             {} double executions, {} contract violations, {} burnt keys, {} executions of abandoned claims",
            self.requests,
            self.answers,
            self.transport_errors,
            self.scopes,
            self.executions,
            self.replays_checked,
            self.unknown_checked,
            self.by_outcome,
            self.generations,
            self.ended,
            self.reruns_text(),
            self.double_executions.len(),
            self.violations.len(),
            self.burnt_keys.len(),
            self.abandoned_executed.len(),
        );
        for v in self
            .double_executions
            .iter()
            .chain(&self.abandoned_executed)
            .chain(&self.burnt_keys)
            .chain(&self.violations)
            .take(30)
        {
            s.push_str("\n  - ");
            s.push_str(v);
        }
        s
    }
}

fn released(e: &Execution) -> bool {
    matches!(e.status, 408 | 425 | 429) || e.control.as_deref() == Some("no-store")
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn execution_scope(e: &Execution) -> ScopeId {
    ScopeId {
        tenant: e.tenant.clone(),
        user: e.user.clone(),
        route: route_of(&e.path),
        key: e.key.clone(),
    }
}

/// One generation of a scope's record, from the store's history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    pub generation: u64,
    /// Current: `in_progress`, `completed` or `unknown`; ended: how it ended
    /// (`completed`, `unknown`, `released`, `abandoned`, `lease_expired`,
    /// `purged`).
    pub state: String,
    pub current: bool,
    /// When it was claimed.
    pub created_at: i64,
    pub ended_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub archived_at: Option<i64>,
    pub status: Option<u16>,
    pub body_len: Option<u64>,
}

impl Generation {
    /// One entry of the lookup's `records`; `None` if it is not one.
    pub fn from_json(r: &serde_json::Value) -> Option<Generation> {
        Some(Generation {
            generation: r["generation"].as_u64()?,
            state: r["state"].as_str()?.to_string(),
            current: r["ended_at"].is_null(),
            created_at: r["created_at"].as_i64()?,
            ended_at: r["ended_at"].as_i64(),
            expires_at: r["expires_at"].as_i64(),
            archived_at: r["archived_at"].as_i64(),
            status: r["status"].as_u64().and_then(|s| u16::try_from(s).ok()),
            body_len: r["body_len"].as_u64(),
        })
    }

    /// Expired (and so, under `after_expiry: new`, free) at `t`.
    fn expired_by(&self, t: i64) -> bool {
        self.expires_at.is_some_and(|e| e <= t) || self.archived_at.is_some_and(|a| a <= t)
    }
}

/// What the executions of one scope and the store's history of it say.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ScopeVerdict {
    pub double_executions: Vec<String>,
    pub violations: Vec<String>,
    /// With when the burnt generation was claimed, and its number.
    pub burnt: Vec<(String, i64, u64)>,
    pub abandoned_executed: Vec<String>,
    /// Executions allowed after an earlier one, by reason.
    pub reruns: BTreeMap<&'static str, usize>,
    /// For each execution (same order), the index in `gens` of the
    /// generation it ran in.
    pub owner: Vec<Option<usize>>,
}

/// Judges one scope: its executions (in arrival order) against its
/// generations (in claim order), under its route's policy.
///
/// An execution ran in the generation claimed last before it arrived (the
/// upstream logs arrival after the filter had its claim's answer, and a new
/// generation is claimed only after the earlier one ended). Then:
///
/// - one generation forwards once: a second execution in it is a double
///   execution;
/// - a scope executes again only after each earlier execution was released
///   (the upstream refused before acting), or, under `on_unknown: release`,
///   its generation ended unknown or with its lease run out, or, under
///   `after_expiry: new`, its generation had expired when the next was
///   claimed; anything else is a double execution;
/// - no execution without a claim before it, none in an abandoned
///   generation, none after its generation was released;
/// - an ended generation agrees with what ran: `released` only after a
///   release status or nothing, `completed` with its execution's status, and
///   replaced only once it had expired;
/// - the current generation: completed with its execution's status and body
///   length, and never unknown or in progress with no execution (a burnt key).
pub fn judge(what: &str, route: Route, execs: &[&Execution], gens: &[Generation]) -> ScopeVerdict {
    let mut v = ScopeVerdict {
        owner: execs
            .iter()
            .map(|e| gens.iter().rposition(|g| g.created_at <= e.at_ms))
            .collect(),
        ..ScopeVerdict::default()
    };
    let ran_in = |g: usize| -> Vec<&Execution> {
        execs
            .iter()
            .zip(&v.owner)
            .filter(|(_, o)| **o == Some(g))
            .map(|(e, _)| *e)
            .collect()
    };
    let mut by_gen: Vec<Vec<&Execution>> = Vec::new();
    for g in 0..gens.len() {
        by_gen.push(ran_in(g));
    }
    // Where each execution ran.
    for (e, owner) in execs.iter().zip(&v.owner) {
        let Some(g) = owner.map(|g| &gens[g]) else {
            v.violations.push(format!(
                "{what}: execution {} ran but the store's history has no claim before it",
                e.n
            ));
            continue;
        };
        if g.state == "abandoned" {
            v.abandoned_executed.push(format!(
                "{what}: execution {} ran in generation {}, which the store ended as abandoned",
                e.n, g.generation
            ));
        } else if g.ended_at.is_some_and(|end| end < e.at_ms) && g.state != "lease_expired" {
            v.violations.push(format!(
                "{what}: execution {} arrived {} ms after its generation {} ended {}",
                e.n,
                e.at_ms - g.ended_at.unwrap_or(0),
                g.generation,
                g.state
            ));
        }
    }
    // Exactly once, as the policy defines it.
    for (g, list) in by_gen.iter().enumerate() {
        if list.len() > 1 {
            v.double_executions.push(format!(
                "{what}: generation {} executed {} times (executions {:?})",
                gens[g].generation,
                list.len(),
                list.iter().map(|e| e.n).collect::<Vec<_>>()
            ));
        }
    }
    for (j, later) in execs.iter().enumerate() {
        let Some(gj) = v.owner[j] else { continue };
        // Each earlier execution of an earlier generation must have left the
        // key free; the reason the last one did is what allowed this one.
        let mut allowed = None;
        let mut refused = None;
        for (i, earlier) in execs.iter().enumerate().take(j) {
            let Some(gi) = v.owner[i].filter(|gi| *gi < gj) else {
                continue;
            };
            let ended = &gens[gi];
            if released(earlier) {
                allowed = Some("released");
            } else if route.release_on_unknown && matches!(ended.state.as_str(), "unknown" | "lease_expired")
            {
                allowed = Some("unknown");
            } else if route.renew_after_expiry && ended.expired_by(gens[gj].created_at) {
                allowed = Some("expired");
            } else if refused.is_none() {
                refused = Some((earlier, ended));
            }
        }
        match (refused, allowed) {
            (Some((earlier, ended)), _) => v.double_executions.push(format!(
                "{what}: execution {} ran again after execution {} (status {}) whose generation {} ended {}",
                later.n, earlier.n, earlier.status, ended.generation, ended.state
            )),
            (None, Some(reason)) => *v.reruns.entry(reason).or_default() += 1,
            (None, None) => {}
        }
    }
    // Ended generations against what ran in them.
    for (g, gen) in gens.iter().enumerate().filter(|(_, g)| !g.current) {
        let ran = &by_gen[g];
        match gen.state.as_str() {
            "released" => {
                if let Some(e) = ran.iter().find(|e| !released(e)) {
                    v.violations.push(format!(
                        "{what}: generation {} was released although execution {} answered {}",
                        gen.generation, e.n, e.status
                    ));
                }
            }
            "completed" => {
                if !gen.expired_by(gen.ended_at.unwrap_or(i64::MAX)) {
                    v.violations.push(format!(
                        "{what}: completed generation {} was replaced before it expired",
                        gen.generation
                    ));
                }
                match ran.first() {
                    None => v.violations.push(format!(
                        "{what}: generation {} completed without an execution",
                        gen.generation
                    )),
                    Some(e) if gen.status != Some(e.status) => v.violations.push(format!(
                        "{what}: generation {} completed with status {:?}, execution {} answered {}",
                        gen.generation, gen.status, e.n, e.status
                    )),
                    Some(_) => {}
                }
            }
            _ => {}
        }
    }
    // The current generation, after the run settled.
    let current: Vec<usize> = (0..gens.len()).filter(|&g| gens[g].current).collect();
    if current.len() > 1 {
        v.violations
            .push(format!("{what}: {} current records for one scope", current.len()));
    }
    for g in current {
        let (gen, ran) = (&gens[g], &by_gen[g]);
        match (gen.state.as_str(), ran.first()) {
            ("completed", Some(e)) => {
                let body_ok = gen.archived_at.is_some() || gen.body_len == Some(e.response.len() as u64);
                if gen.status != Some(e.status) || !body_ok {
                    v.violations.push(format!(
                        "{what}: record {:?} / {:?} bytes, execution {} answered {} / {} bytes",
                        gen.status,
                        gen.body_len,
                        e.n,
                        e.status,
                        e.response.len()
                    ));
                }
            }
            ("completed", None) => v
                .violations
                .push(format!("{what}: completed record without an execution")),
            ("unknown" | "in_progress", None) => v.burnt.push((
                format!(
                    "{what}: generation {} left {} but its upstream never ran",
                    gen.generation, gen.state
                ),
                gen.created_at,
                gen.generation,
            )),
            ("unknown", Some(_)) => {}
            (other, _) => v
                .violations
                .push(format!("{what}: record in state {other:?} after the run")),
        }
    }
    v
}

/// Checks one answer against the contract; `None` when it is fine. `stored`:
/// the scope's executions whose outcome the store kept (a replay must be one
/// of them).
fn check_answer(
    s: &Sent,
    a: &Answer,
    stored: &[&Execution],
    by_n: &HashMap<u64, &Execution>,
    bodies_in_scope: &[&str],
) -> Option<String> {
    let what = format!(
        "{} {} {} {:?}",
        s.scope.tenant, s.scope.route, s.scope.key, s.knobs
    );
    let text = String::from_utf8_lossy(&a.body);
    let body_sha = sha256_hex(s.body.as_bytes());
    if a.header("idempotent-replayed") == Some("true") {
        // An execution that was stored, and its answer byte for byte.
        if stored.is_empty() {
            return Some(format!("{what}: a replay, but nothing was stored: {text}"));
        }
        let same_body: Vec<&&Execution> = stored.iter().filter(|e| e.body_sha256 == body_sha).collect();
        if same_body.is_empty() {
            return Some(format!("{what}: replayed the answer to another request body"));
        }
        if same_body
            .iter()
            .any(|e| a.body == e.response && a.status == e.status)
        {
            return None;
        }
        return Some(format!(
            "{what}: replay differs from execution {} ({} vs {}): {text}",
            same_body[0].n, a.status, same_body[0].status
        ));
    }
    if a.header("content-type") == Some("application/problem+json") {
        let p = a.json();
        let slug = a.problem().unwrap_or_default();
        if p["status"] != a.status || a.header("cache-control") != Some("no-store") {
            return Some(format!("{what}: malformed problem {} {text}", a.status));
        }
        if let Some(m) = INTERNALS.iter().find(|m| text.contains(*m)) {
            return Some(format!("{what}: problem body shows internals ({m}): {text}"));
        }
        // Envoy's own replies (an upstream reset or timeout), rendered as
        // problems by the bootstrap's local_reply_config.
        if p["type"] == "about:blank" && (502..=504).contains(&a.status) {
            return None;
        }
        if !EXPECTED_PROBLEMS.contains(&slug.as_str()) {
            return Some(format!("{what}: unexpected problem {slug}: {text}"));
        }
        let ok = match slug.as_str() {
            "key-reused" => a.status == 422 && bodies_in_scope.iter().any(|b| *b != s.body),
            "request-in-progress" => {
                a.status == 409 && a.header("retry-after").and_then(|v| v.parse::<u64>().ok()) >= Some(1)
            }
            // Under `on_unknown: release` an unknown key is claimed again.
            "outcome-unknown" => {
                a.status == 409
                    && a.header("retry-after").is_none()
                    && !policy(s.scope.route).release_on_unknown
            }
            _ => a.status == 503 && a.header("retry-after").is_some(),
        };
        return (!ok).then(|| format!("{what}: {slug} does not fit ({}): {text}", a.status));
    }
    // Anything else came from the upstream (with its execution number) or
    // from Envoy itself (5xx without one).
    let n = a.json()["execution"].as_u64();
    match n.and_then(|n| by_n.get(&n)) {
        Some(e) => {
            if execution_scope(e) != s.scope || e.body_sha256 != body_sha {
                Some(format!("{what}: got execution {} of another request", e.n))
            } else if a.status != e.status || a.body != e.response {
                Some(format!("{what}: answer differs from execution {}", e.n))
            } else {
                None
            }
        }
        None if n.is_some() => Some(format!("{what}: execution {n:?} is not in the upstream's log")),
        None if a.status >= 500 => None,
        None => Some(format!("{what}: {} without an execution: {text}", a.status)),
    }
}

/// How long the audit lets leases, abandons and the sweeper settle after no
/// record is in progress any more: two sweeper passes (1 s apart) and the
/// filter's retried abandons.
const SETTLE: Duration = Duration::from_millis(2_500);

/// A re-check is sent only to a record that stays unexpired this long, so it
/// can neither meet an expiry nor (under `after_expiry: new`) run again.
const RECHECK_MARGIN_MS: i64 = 5_000;

/// The whole audit; `stack` must be up (all replicas and Envoy).
pub async fn audit(stack: &Stack, traffic: &Traffic) -> Audit {
    let mut audit = Audit::default();
    // Let every lease run out, so no record is left in progress; then let
    // the sweeper pass and the filter's abandons land.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stuck = Vec::new();
    while Instant::now() < deadline {
        match stack.in_progress().await {
            Some(v) if v.is_empty() => {
                stuck.clear();
                break;
            }
            Some(v) => stuck = v,
            None => {}
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for r in &stuck {
        audit.violations.push(format!(
            "record still in progress 30 s after the run: {}",
            r["log_id"]
        ));
    }
    tokio::time::sleep(SETTLE).await;

    let log = stack.upstream.log();
    let sent = std::mem::take(&mut *traffic.sent.lock().unwrap_or_else(|e| e.into_inner()));
    audit.requests = sent.len();
    audit.executions = log.len();
    let by_n: HashMap<u64, &Execution> = log.iter().map(|e| (e.n, e)).collect();
    let mut execs: BTreeMap<ScopeId, Vec<&Execution>> = BTreeMap::new();
    for e in &log {
        execs.entry(execution_scope(e)).or_default().push(e);
    }
    for list in execs.values_mut() {
        list.sort_by_key(|e| e.n);
    }
    let mut sent_by_scope: BTreeMap<ScopeId, Vec<&Sent>> = BTreeMap::new();
    for s in &sent {
        sent_by_scope.entry(s.scope.clone()).or_default().push(s);
    }
    audit.scopes = sent_by_scope.len();
    for list in sent_by_scope.values() {
        audit.duplicates += list.len() - 1;
        audit.changed_bodies += list.iter().filter(|s| s.body != list[0].body).count();
    }
    let mut tenants_by_key: HashMap<&str, std::collections::HashSet<&str>> = HashMap::new();
    for scope in sent_by_scope.keys() {
        tenants_by_key
            .entry(&scope.key)
            .or_default()
            .insert(&scope.tenant);
    }
    audit.shared_keys = tenants_by_key.values().filter(|t| t.len() > 1).count();
    for scope in execs.keys() {
        if !sent_by_scope.contains_key(scope) {
            audit
                .violations
                .push(format!("execution of {} {} nobody sent", scope.tenant, scope.key));
        }
    }

    // 1. The store's whole history of every scope, against the executions:
    // exactly once as each policy defines it, no burnt key, no execution of
    // an abandoned claim, records that agree with what ran.
    let none: Vec<&Execution> = Vec::new();
    let scopes: Vec<ScopeId> = sent_by_scope.keys().cloned().collect();
    let mut histories: BTreeMap<ScopeId, Vec<Generation>> = BTreeMap::new();
    // Each scope's events, `(generation, "transition by actor (detail)")`,
    // to say how a burnt key got where it is.
    let mut events: BTreeMap<ScopeId, Vec<(u64, String)>> = BTreeMap::new();
    for chunk in scopes.chunks(16) {
        let lookups: Vec<_> = chunk
            .iter()
            .map(|scope| async move {
                let h = stack
                    .history(&scope.tenant, &scope.user, scope.route, &scope.key)
                    .await;
                (scope, h)
            })
            .collect();
        for (scope, h) in futures_join_all(lookups).await {
            let what = format!("{} {} {}", scope.tenant, scope.route, scope.key);
            let Some(h) = h else {
                audit
                    .violations
                    .push(format!("{what}: the store did not answer the lookup"));
                continue;
            };
            let records = h["records"].as_array().cloned().unwrap_or_default();
            let mut gens = Vec::new();
            for r in &records {
                if r["scope"]["namespace"] != "u" || r["scope"]["principal"] != scope.user.as_str() {
                    continue;
                }
                match Generation::from_json(r) {
                    Some(g) => gens.push(g),
                    None => audit
                        .violations
                        .push(format!("{what}: a generation the audit cannot read: {r}")),
                }
            }
            gens.sort_by_key(|g| (g.created_at, g.generation));
            histories.insert(scope.clone(), gens);
            let list: Vec<(u64, String)> = h["events"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|e| e["scope"]["principal"] == scope.user.as_str())
                        .map(|e| {
                            (
                                e["generation"].as_u64().unwrap_or(0),
                                format!(
                                    "{} by {}{}",
                                    e["transition"].as_str().unwrap_or("?"),
                                    e["actor"].as_str().unwrap_or("?"),
                                    e["detail"]
                                        .as_str()
                                        .map(|d| format!(" ({d})"))
                                        .unwrap_or_default()
                                ),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            events.insert(scope.clone(), list);
        }
    }
    let mut stored: BTreeMap<ScopeId, Vec<&Execution>> = BTreeMap::new();
    let mut current_exec: BTreeMap<ScopeId, &Execution> = BTreeMap::new();
    for (scope, gens) in &histories {
        let what = format!("{} {} {}", scope.tenant, scope.route, scope.key);
        let scope_execs = execs.get(scope).unwrap_or(&none);
        let v = judge(&what, policy(scope.route), scope_execs, gens);
        audit.generations += gens.len();
        for g in gens.iter().filter(|g| !g.current) {
            *audit.ended.entry(g.state.clone()).or_default() += 1;
        }
        for (r, n) in &v.reruns {
            *audit.reruns.entry(r).or_default() += n;
        }
        for (e, owner) in scope_execs.iter().zip(&v.owner) {
            let Some(g) = owner.map(|g| &gens[g]) else {
                continue;
            };
            if g.state == "completed" {
                stored.entry(scope.clone()).or_default().push(e);
            }
            if g.current {
                current_exec.insert(scope.clone(), e);
            }
        }
        audit.double_executions.extend(v.double_executions);
        audit.violations.extend(v.violations);
        for (b, at, generation) in v.burnt {
            let how: Vec<&str> = events
                .get(scope)
                .map(|l| {
                    l.iter()
                        .filter(|(g, _)| *g == generation)
                        .map(|(_, t)| t.as_str())
                        .collect()
                })
                .unwrap_or_default();
            audit.burnt_keys.push(format!("{b} (events: {})", how.join(", ")));
            audit.burnt_at.push(at);
        }
        audit.abandoned_executed.extend(v.abandoned_executed);
    }

    // 2. Every answer.
    for (scope, list) in &sent_by_scope {
        let stored_here: Vec<&Execution> = match (histories.get(scope), stored.get(scope)) {
            (Some(_), Some(s)) => s.clone(),
            (Some(_), None) => Vec::new(),
            // Without the history: any execution that was not released.
            (None, _) => execs
                .get(scope)
                .unwrap_or(&none)
                .iter()
                .filter(|e| !released(e))
                .copied()
                .collect(),
        };
        let bodies: Vec<&str> = list.iter().map(|s| s.body.as_str()).collect();
        for s in list {
            match &s.outcome {
                Err(_) => {
                    audit.transport_errors += 1;
                    *audit.by_outcome.entry("no answer".into()).or_default() += 1;
                }
                Ok(a) => {
                    audit.answers += 1;
                    let label = match (a.problem(), a.header("idempotent-replayed")) {
                        (Some(p), _) => p,
                        (None, Some(_)) => "replayed".to_string(),
                        (None, None) => a.status.to_string(),
                    };
                    *audit.by_outcome.entry(label).or_default() += 1;
                    if let Some(v) = check_answer(s, a, &stored_here, &by_n, &bodies) {
                        audit.violations.push(v);
                    }
                }
            }
        }
    }

    // 3. Every completed record must replay byte-identical and every unknown
    // one answer 409, executing nothing — where a request can check that
    // without changing the record: not under `on_unknown: release` for an
    // unknown one (it would be claimed again), not near its expiry.
    let before = stack.upstream.log().len();
    for (scope, gens) in &histories {
        let what = format!("{} {} {}", scope.tenant, scope.route, scope.key);
        let Some(gen) = gens.iter().find(|g| g.current) else {
            continue;
        };
        if gen.archived_at.is_some() || gen.expires_at.is_none_or(|e| e <= now_ms() + RECHECK_MARGIN_MS) {
            continue;
        }
        let list = &sent_by_scope[scope];
        let exec = current_exec.get(scope);
        match (gen.state.as_str(), exec) {
            ("completed", Some(e)) => {
                let Some(body) = list_body(list, &e.body_sha256) else {
                    audit
                        .violations
                        .push(format!("{what}: executed a body nobody sent"));
                    continue;
                };
                audit.replays_checked += 1;
                match settled(traffic, scope, body).await {
                    Ok(a)
                        if a.header("idempotent-replayed") == Some("true")
                            && a.status == e.status
                            && a.body == e.response => {}
                    Ok(a) => audit.violations.push(format!(
                        "{what}: completed record does not replay byte-identical: {} {:?}",
                        a.status,
                        String::from_utf8_lossy(&a.body)
                    )),
                    Err(err) => audit.violations.push(format!("{what}: replay failed: {err}")),
                }
            }
            ("unknown", exec) if !policy(scope.route).release_on_unknown => {
                audit.unknown_checked += 1;
                let body = exec
                    .and_then(|e| list_body(list, &e.body_sha256))
                    .unwrap_or(&list[0].body)
                    .to_string();
                match settled(traffic, scope, &body).await {
                    Ok(a) if a.problem().as_deref() == Some("outcome-unknown") => {}
                    Ok(a) => audit.violations.push(format!(
                        "{what}: unknown record answered {} {:?}",
                        a.status,
                        String::from_utf8_lossy(&a.body)
                    )),
                    Err(err) => audit.violations.push(format!("{what}: retry failed: {err}")),
                }
            }
            _ => {}
        }
    }
    let after = stack.upstream.log().len();
    if after != before {
        audit.double_executions.push(format!(
            "re-checking completed and unknown records executed {} requests",
            after - before
        ));
    }
    // What the re-checks sent is not part of the traffic.
    traffic.sent.lock().map(|mut s| s.clear()).ok();

    // 4. No raw key in any log line.
    let leaks: Vec<String> = stack
        .log_lines()
        .into_iter()
        .filter(|(_, line)| line.contains(&traffic.tag))
        .map(|(file, line)| format!("{file}: {line}"))
        .collect();
    for l in leaks.iter().take(5) {
        audit.violations.push(format!("raw key in a log line: {l}"));
    }
    if leaks.len() > 5 {
        audit.violations.push(format!(
            "... and {} more log lines with raw keys",
            leaks.len() - 5
        ));
    }
    audit
}

/// A re-check's answer; a 503 `store-unavailable` says nothing about the
/// record (it is the contract's answer while the store does not answer in
/// time), so it is asked again, a few times.
async fn settled(traffic: &Traffic, scope: &ScopeId, body: &str) -> Result<Answer, String> {
    let mut last = Err("not sent".to_string());
    for _ in 0..5 {
        last = traffic.send(scope, path_of(scope), body, &[]).await;
        match &last {
            Ok(a) if a.problem().as_deref() == Some("store-unavailable") => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => break,
        }
    }
    last
}

fn path_of(scope: &ScopeId) -> &'static str {
    policy(scope.route).path
}

fn list_body<'a>(list: &[&'a Sent], sha: &str) -> Option<&'a str> {
    list.iter()
        .find(|s| sha256_hex(s.body.as_bytes()) == sha)
        .map(|s| s.body.as_str())
}

/// Awaits every future concurrently (on this task), in order.
async fn futures_join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    //! The audit must be able to fail: each broken promise, fabricated.
    use super::*;

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
                "after the kill".into(),
                "before a stall".into(),
                "long before".into(),
            ],
            burnt_at: vec![9_000, 10_600, 29_000, -5_000],
            ..Audit::default()
        };
        audit.excuse(|at| faults.left_unknown_by_contract(at));
        assert_eq!(
            audit.unknown_by_contract,
            ["before the kill (in flight at a Envoy SIGKILL)"]
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
            assert!(
                yaml.contains(&format!("{{\"prefix\": \"{}\"}}", r.path)),
                "{}",
                r.path
            );
            assert_eq!(route_of(r.path), r.name);
            assert_eq!(policy(r.name), r);
        }
        assert!(yaml.contains(r#""lease_seconds": 2, "on_unknown": "release"}"#));
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
}
