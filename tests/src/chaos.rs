//! The chaos run and its audit.
//!
//! Workers send mixed traffic through Envoy for a fixed time (unique keys,
//! retries, concurrent duplicates, changed bodies, slow, failing, resetting
//! and uncertain upstream calls, one key shared by two tenants) while a fault
//! loop SIGKILLs and restarts store replicas, restarts Envoy and resets every
//! upstream connection. Every request and its answer is recorded; the
//! upstream logs every execution.
//!
//! The audit then compares three independent views — the upstream's
//! execution log, the store's records (admin API) and every answer a client
//! got — and counts each broken promise as a violation:
//!
//! - a scope executed again after an execution that was not released;
//! - an answer that is not what the contract allows (a replay of another
//!   execution or another request body, a 422 for the same body, a malformed
//!   or unexpected problem, a problem body with internals, a 2xx nobody
//!   executed);
//! - a store record that disagrees with the executions (completed with
//!   another status or body length, completed without an execution, absent
//!   although its key was executed, still in progress long after its lease);
//! - a completed record that does not replay byte-identical, or an unknown one
//!   that does not answer 409 `outcome-unknown`, or any execution caused by
//!   those checks;
//! - a log line of any process that contains a raw key.

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

pub fn route_of(path: &str) -> &'static str {
    if path.starts_with("/wait") {
        "orders.wait"
    } else {
        "payments.create"
    }
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
        let path: &'static str = if rng.below(5) == 0 { "/wait" } else { "/pay" };
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
            // Retries after the answer: must replay.
            30..=44 => {
                t.send(&scope, path, &body, &[]).await.ok();
                t.send(&scope, path, &body, &[]).await.ok();
                tokio::time::sleep(Duration::from_millis(100)).await;
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
    pub envoy_restarts: u64,
    pub upstream_resets: u64,
    /// Connections dropped by those resets.
    pub connections_reset: u64,
}

impl Faults {
    pub fn summary(&self) -> String {
        format!(
            "{} store SIGKILLs, {} Envoy restarts, {} upstream resets ({} connections)",
            self.store_kills, self.envoy_restarts, self.upstream_resets, self.connections_reset
        )
    }
}

/// Injects faults in rotation until `deadline`, leaving everything running.
pub async fn inject_faults(stack: &mut Stack, deadline: Instant, every: Duration) -> Faults {
    let mut faults = Faults::default();
    let mut rng = Rng::new(seed());
    let replicas = stack.stores.len();
    let mut step = 0usize;
    while Instant::now() + every < deadline {
        tokio::time::sleep(every).await;
        match step % 4 {
            0 | 2 => {
                // Alternate replicas; with one, always the same.
                let r = (step / 2) % replicas;
                stack.kill_store(r);
                faults.store_kills += 1;
                tokio::time::sleep(Duration::from_millis(300 + rng.below(1_200))).await;
                stack.start_store(r);
                stack.wait_store(r).await;
            }
            1 => {
                faults.upstream_resets += 1;
                faults.connections_reset += stack.upstream.reset_connections() as u64;
            }
            _ => {
                stack.kill_envoy();
                faults.envoy_restarts += 1;
                tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
                stack.start_envoy();
                stack.wait_envoy().await;
            }
        }
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
    pub double_executions: Vec<String>,
    pub violations: Vec<String>,
}

impl Audit {
    pub fn total_violations(&self) -> usize {
        self.double_executions.len() + self.violations.len()
    }

    /// The hostile part of the traffic, for the results table.
    pub fn hostile(&self) -> String {
        format!(
            "{} duplicate requests, {} with a changed body, {} keys sent by two tenants",
            self.duplicates, self.changed_bodies, self.shared_keys
        )
    }

    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} requests ({} answered, {} transport errors), {} scopes, {} executions, \
             {} replays and {} unknown records re-checked; outcomes {:?}; \
             {} double executions, {} contract violations",
            self.requests,
            self.answers,
            self.transport_errors,
            self.scopes,
            self.executions,
            self.replays_checked,
            self.unknown_checked,
            self.by_outcome,
            self.double_executions.len(),
            self.violations.len()
        );
        for v in self.double_executions.iter().chain(&self.violations).take(30) {
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

/// Checks one answer against the contract; `None` when it is fine.
fn check_answer(
    s: &Sent,
    a: &Answer,
    execs: &[&Execution],
    by_n: &HashMap<u64, &Execution>,
    bodies_in_scope: &[&str],
) -> Option<String> {
    let what = format!("{} {} {:?}", s.scope.tenant, s.scope.key, s.knobs);
    let text = String::from_utf8_lossy(&a.body);
    let body_sha = sha256_hex(s.body.as_bytes());
    if a.header("idempotent-replayed") == Some("true") {
        // The one execution that was stored, and its answer byte for byte.
        let Some(stored) = execs.iter().find(|e| !released(e)) else {
            return Some(format!("{what}: a replay, but nothing was executed: {text}"));
        };
        if stored.body_sha256 != body_sha {
            return Some(format!("{what}: replayed the answer to another request body"));
        }
        if a.body != stored.response || a.status != stored.status {
            return Some(format!(
                "{what}: replay differs from execution {} ({} vs {}): {text}",
                stored.n, a.status, stored.status
            ));
        }
        return None;
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
            "outcome-unknown" => a.status == 409 && a.header("retry-after").is_none(),
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

/// The whole audit; `stack` must be up (all replicas and Envoy).
pub async fn audit(stack: &Stack, traffic: &Traffic) -> Audit {
    let mut audit = Audit::default();
    // Let every lease run out, so no record is left in progress.
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

    // 1. Exactly once: nothing runs after an execution that was not released.
    audit.double_executions = double_executions(&execs);
    for scope in execs.keys() {
        if !sent_by_scope.contains_key(scope) {
            audit
                .violations
                .push(format!("execution of {} {} nobody sent", scope.tenant, scope.key));
        }
    }

    // 2. Every answer.
    let none: Vec<&Execution> = Vec::new();
    for (scope, list) in &sent_by_scope {
        let scope_execs = execs.get(scope).unwrap_or(&none);
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
                    if let Some(v) = check_answer(s, a, scope_execs, &by_n, &bodies) {
                        audit.violations.push(v);
                    }
                }
            }
        }
    }

    // 3. The store's records against the executions; then every completed
    // record must replay byte-identical and every unknown one answer 409.
    let before = stack.upstream.log().len();
    let scopes: Vec<ScopeId> = sent_by_scope.keys().cloned().collect();
    for chunk in scopes.chunks(16) {
        let mut lookups = Vec::new();
        for scope in chunk {
            lookups.push(async move {
                let records = stack
                    .records(&scope.tenant, &scope.user, scope.route, &scope.key)
                    .await;
                (scope, records)
            });
        }
        for (scope, records) in futures_join_all(lookups).await {
            let what = format!("{} {} {}", scope.tenant, scope.route, scope.key);
            let Some(records) = records else {
                audit
                    .violations
                    .push(format!("{what}: the store did not answer the lookup"));
                continue;
            };
            let mine: Vec<&serde_json::Value> = records
                .iter()
                .filter(|r| r["scope"]["namespace"] == "u" && r["scope"]["principal"] == scope.user.as_str())
                .collect();
            let scope_execs = execs.get(scope).unwrap_or(&none);
            let stored = scope_execs.iter().find(|e| !released(e));
            match (mine.as_slice(), stored) {
                ([], None) => {}
                ([], Some(e)) => audit.violations.push(format!(
                    "{what}: executed (execution {}) but the store has no record",
                    e.n
                )),
                ([r], stored) => {
                    let state = r["state"].as_str().unwrap_or("");
                    match (state, stored) {
                        ("completed", Some(e)) => {
                            let body_ok = r["body_len"].as_u64() == Some(e.response.len() as u64);
                            if r["status"].as_u64() != Some(u64::from(e.status)) || !body_ok {
                                audit.violations.push(format!(
                                    "{what}: record {} / {} bytes, execution {} answered {} / {} bytes",
                                    r["status"],
                                    r["body_len"],
                                    e.n,
                                    e.status,
                                    e.response.len()
                                ));
                            }
                            let body = list_body(&sent_by_scope[scope], &e.body_sha256);
                            match body {
                                Some(body) => {
                                    audit.replays_checked += 1;
                                    let a = settled(traffic, scope, body).await;
                                    match a {
                                        Ok(a) if a.header("idempotent-replayed") == Some("true")
                                            && a.status == e.status
                                            && a.body == e.response => {}
                                        Ok(a) => audit.violations.push(format!(
                                            "{what}: completed record does not replay byte-identical: {} {:?}",
                                            a.status,
                                            String::from_utf8_lossy(&a.body)
                                        )),
                                        Err(err) => {
                                            audit.violations.push(format!("{what}: replay failed: {err}"))
                                        }
                                    }
                                }
                                None => audit
                                    .violations
                                    .push(format!("{what}: executed a body nobody sent")),
                            }
                        }
                        ("completed", None) => audit
                            .violations
                            .push(format!("{what}: completed record without an execution")),
                        ("unknown", _) => {
                            audit.unknown_checked += 1;
                            let body = sent_by_scope[scope][0].body.clone();
                            let body = stored
                                .and_then(|e| list_body(&sent_by_scope[scope], &e.body_sha256))
                                .map(str::to_string)
                                .unwrap_or(body);
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
                        (other, _) => audit
                            .violations
                            .push(format!("{what}: record in state {other:?} after the run")),
                    }
                }
                (many, _) => audit
                    .violations
                    .push(format!("{what}: {} records for one scope", many.len())),
            }
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

/// Scopes that ran again after an execution that was not released.
fn double_executions(execs: &BTreeMap<ScopeId, Vec<&Execution>>) -> Vec<String> {
    let mut found = Vec::new();
    for (scope, list) in execs {
        if let Some(first) = list.iter().position(|e| !released(e)) {
            if list.len() > first + 1 {
                found.push(format!(
                    "{} {} {} executed {} times (executions {:?})",
                    scope.tenant,
                    scope.route,
                    scope.key,
                    list.len(),
                    list.iter().map(|e| e.n).collect::<Vec<_>>()
                ));
            }
        }
    }
    found
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
    if scope.route == "orders.wait" {
        "/wait"
    } else {
        "/pay"
    }
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

    fn exec(n: u64, tenant: &str, body: &str, status: u16) -> Execution {
        Execution {
            n,
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
        let refs: Vec<&Execution> = execs.iter().filter(|e| execution_scope(e) == s.scope).collect();
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

    #[test]
    fn running_again_after_a_stored_execution_is_a_double_execution() {
        let (one, two, released) = (
            exec(1, "a", "A", 201),
            exec(2, "a", "A", 201),
            exec(3, "a", "A", 429),
        );
        fn map(list: Vec<&Execution>) -> BTreeMap<ScopeId, Vec<&Execution>> {
            BTreeMap::from([(scope("a"), list)])
        }
        assert_eq!(double_executions(&map(vec![&one, &two])).len(), 1);
        assert!(double_executions(&map(vec![&released, &one])).is_empty());
        assert_eq!(double_executions(&map(vec![&one, &released])).len(), 1);
    }
}
