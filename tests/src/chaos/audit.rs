//! The audit: the evidence of a run (what was sent, what the upstream
//! executed, the store's whole history) read once, then one function per
//! promise, each adding what it found to the [`Audit`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::answers::{check_answer, execution_number, grpc_status, is_grpc, problem_of};
use super::judge::{execution_scope, judge, released, Generation};
use super::recheck::records_replay_and_stay_unknown;
use super::report::{LeftDetached, HUGE_RESPONSE, LARGE_RESPONSE};
use super::traffic::LEAVES_AFTER;
use super::{policy, Audit, ScopeId, Sent, Traffic};
use crate::stack::Stack;
use crate::Execution;

/// How long the audit lets leases, abandons and the sweeper settle after no
/// record is in progress any more: two sweeper passes (1 s apart) and the
/// filter's retried abandons.
const SETTLE: Duration = Duration::from_millis(2_500);

/// What the audit reads, grouped by scope.
pub(super) struct Evidence<'a> {
    pub(super) sent: BTreeMap<ScopeId, Vec<&'a Sent>>,
    /// Each scope's executions, in arrival order.
    execs: BTreeMap<ScopeId, Vec<&'a Execution>>,
    by_n: HashMap<u64, &'a Execution>,
    /// Each scope's generations, in claim order (only scopes whose lookup
    /// the store answered).
    pub(super) histories: BTreeMap<ScopeId, Vec<Generation>>,
    /// Each scope's events, `(generation, "transition by actor (detail)")`,
    /// to say how a burnt key got where it is.
    events: BTreeMap<ScopeId, Vec<(u64, String)>>,
}

impl<'a> Evidence<'a> {
    fn execs_of(&self, scope: &ScopeId) -> &[&'a Execution] {
        self.execs.get(scope).map(Vec::as_slice).unwrap_or_default()
    }
}

/// What the store kept, from judging the scopes: the executions whose
/// outcome a completed generation holds, and the execution of each current
/// generation.
#[derive(Default)]
pub(super) struct Kept<'a> {
    stored: BTreeMap<ScopeId, Vec<&'a Execution>>,
    pub(super) current: BTreeMap<ScopeId, &'a Execution>,
}

/// The whole audit; `stack` must be up (all replicas and Envoy).
pub async fn audit(stack: &Stack, traffic: &Traffic) -> Audit {
    let mut audit = Audit::default();
    no_record_left_in_progress(stack, &mut audit).await;
    tokio::time::sleep(SETTLE).await;

    let log = stack.upstream.log();
    let sent = std::mem::take(&mut *traffic.sent.lock().unwrap_or_else(|e| e.into_inner()));
    audit.requests = sent.len();
    audit.executions = log.len();
    audit.grpc_scenarios = traffic.grpc_scenarios.load(std::sync::atomic::Ordering::Relaxed);
    let mut evidence = Evidence {
        sent: BTreeMap::new(),
        execs: BTreeMap::new(),
        by_n: log.iter().map(|e| (e.n, e)).collect(),
        histories: BTreeMap::new(),
        events: BTreeMap::new(),
    };
    for e in &log {
        evidence.execs.entry(execution_scope(e)).or_default().push(e);
    }
    for list in evidence.execs.values_mut() {
        list.sort_by_key(|e| e.n);
    }
    for s in &sent {
        evidence.sent.entry(s.scope.clone()).or_default().push(s);
    }
    count_traffic(&evidence, &mut audit);
    no_execution_nobody_sent(&evidence, &mut audit);
    read_histories(stack, &mut evidence, &mut audit).await;
    detached_clients_that_left(&evidence, &mut audit);

    let kept = records_agree_with_executions(&evidence, &mut audit);
    answers_keep_the_contract(&evidence, &kept, &mut audit);
    records_replay_and_stay_unknown(stack, traffic, &evidence, &kept, &mut audit).await;
    // What the re-checks sent is not part of the traffic.
    traffic.sent.lock().map(|mut s| s.clear()).ok();
    no_raw_key_in_logs(stack, &traffic.tag, &mut audit);
    no_crash(stack, &mut audit);
    audit
}

/// No process panicked or logged a critical line, and none exited on its
/// own (the faults restart what they kill).
fn no_crash(stack: &Stack, audit: &mut Audit) {
    let crashes: Vec<String> = stack
        .log_lines()
        .into_iter()
        .filter(|(_, line)| line.contains("panicked at") || line.contains("[critical]"))
        .map(|(file, line)| format!("{file}: {line}"))
        .collect();
    for c in crashes.iter().take(5) {
        audit.violations.push(format!("a crash in the logs: {c}"));
    }
    let procs = stack.envoy.iter().map(|p| ("Envoy", p)).chain(
        stack
            .stores
            .iter()
            .filter_map(|r| r.proc.as_ref())
            .map(|p| ("a store replica", p)),
    );
    for (name, proc) in procs {
        if !proc.alive() {
            audit.violations.push(format!("{name} exited on its own"));
        }
    }
}

/// Every lease runs out after the run, so no record is left in progress
/// (30 s at most); then the sweeper passes and the filter's abandons land.
async fn no_record_left_in_progress(stack: &Stack, audit: &mut Audit) {
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
}

/// The traffic's shape: scopes, duplicates, changed bodies, shared keys.
fn count_traffic(evidence: &Evidence<'_>, audit: &mut Audit) {
    audit.scopes = evidence.sent.len();
    for list in evidence.sent.values() {
        audit.duplicates += list.len() - 1;
        audit.changed_bodies += list.iter().filter(|s| s.body != list[0].body).count();
    }
    let mut tenants_by_key: HashMap<&str, HashSet<&str>> = HashMap::new();
    for scope in evidence.sent.keys() {
        tenants_by_key
            .entry(&scope.key)
            .or_default()
            .insert(&scope.tenant);
    }
    audit.shared_keys = tenants_by_key.values().filter(|t| t.len() > 1).count();
    for (scope, list) in &evidence.sent {
        let route = audit.by_route.entry(scope.route).or_default();
        route.scopes += 1;
        route.requests += list.len();
    }
    for (scope, execs) in &evidence.execs {
        let route = audit.by_route.entry(scope.route).or_default();
        route.executions += execs.len();
        let large = execs
            .iter()
            .filter(|e| e.response.len() >= LARGE_RESPONSE)
            .count();
        route.large_responses += large;
        audit.large_responses += large;
        audit.huge_responses += execs.iter().filter(|e| e.response.len() >= HUGE_RESPONSE).count();
    }
}

/// How the keys of detached requests whose client stopped waiting ended
/// (counted, not judged: the other checks judge them like any key).
fn detached_clients_that_left(evidence: &Evidence<'_>, audit: &mut Audit) {
    for (scope, list) in &evidence.sent {
        if policy(scope.route).detached.is_none() {
            continue;
        }
        let left = list
            .iter()
            .filter(|s| s.outcome.is_err() && s.knobs.iter().any(|(k, _)| *k == LEAVES_AFTER))
            .count();
        if left == 0 {
            continue;
        }
        audit.left_detached += left;
        let current = evidence
            .histories
            .get(scope)
            .and_then(|gens| gens.iter().find(|g| g.current));
        let state = current.map_or("no record", |g| g.state.as_str());
        *audit.left_detached_ended.entry(state.to_string()).or_default() += left;
        // How one that did not complete got there, to tell a timeout, a
        // reset or an Envoy kill from a request given up with its client.
        if let Some(g) = current.filter(|g| g.state == "unknown") {
            let events: Vec<&str> = evidence
                .events
                .get(scope)
                .map(|l| {
                    l.iter()
                        .filter(|(n, _)| *n == g.generation)
                        .map(|(_, t)| t.as_str())
                        .collect()
                })
                .unwrap_or_default();
            let ran: Vec<&&Execution> = evidence
                .execs_of(scope)
                .iter()
                .filter(|e| e.at_ms >= g.created_at)
                .collect();
            let execs: Vec<String> = ran
                .iter()
                .map(|e| format!("execution {} at +{} ms", e.n, e.at_ms - g.created_at))
                .collect();
            let delay = list
                .iter()
                .flat_map(|s| &s.knobs)
                .filter(|(k, _)| *k == "x-test-delay-ms")
                .filter_map(|(_, v)| v.parse::<i64>().ok())
                .max()
                .unwrap_or(0);
            let knobs: Vec<String> = list
                .iter()
                .map(|s| format!("{:?} → {}", s.knobs, outcome_text(s)))
                .collect();
            audit.left_detached_not_completed.push(LeftDetached {
                what: format!(
                    "{} {} {}: generation {} {} (events: {}; {}; requests: {})",
                    scope.tenant,
                    scope.route,
                    scope.key,
                    g.generation,
                    g.state,
                    events.join(", "),
                    execs.join(", "),
                    knobs.join("; ")
                ),
                claimed_at: g.created_at,
                delay_ms: delay,
                arrived_after_ms: ran.first().map(|e| e.at_ms - g.created_at),
                upstream_reset: ran.iter().any(|e| e.reset || e.control.is_some()),
                lease_ran_out: events.iter().any(|t| t.starts_with("lease_expired")),
            });
        }
    }
}

/// The upstream executes only what a client sent.
fn no_execution_nobody_sent(evidence: &Evidence<'_>, audit: &mut Audit) {
    for scope in evidence.execs.keys() {
        if !evidence.sent.contains_key(scope) {
            audit
                .violations
                .push(format!("execution of {} {} nobody sent", scope.tenant, scope.key));
        }
    }
}

/// The store's whole history of every scope sent to (16 lookups at a time).
async fn read_histories(stack: &Stack, evidence: &mut Evidence<'_>, audit: &mut Audit) {
    let scopes: Vec<ScopeId> = evidence.sent.keys().cloned().collect();
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
            evidence.histories.insert(scope.clone(), gens);
            let list: Vec<(u64, String)> = h["events"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|e| e["scope"]["principal"] == scope.user.as_str())
                        .map(|e| (e["generation"].as_u64().unwrap_or(0), event_text(e)))
                        .collect()
                })
                .unwrap_or_default();
            evidence.events.insert(scope.clone(), list);
        }
    }
}

/// `"transition by actor (detail)"`.
fn event_text(e: &serde_json::Value) -> String {
    format!(
        "{} by {}{}",
        e["transition"].as_str().unwrap_or("?"),
        e["actor"].as_str().unwrap_or("?"),
        e["detail"]
            .as_str()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default()
    )
}

/// Each scope's history against its executions ([`judge`]): exactly once as
/// its policy defines it, no burnt key, no execution of an abandoned claim,
/// records that agree with what ran. Returns what the store kept.
fn records_agree_with_executions<'a>(evidence: &Evidence<'a>, audit: &mut Audit) -> Kept<'a> {
    let mut kept = Kept::default();
    for (scope, gens) in &evidence.histories {
        let what = format!("{} {} {}", scope.tenant, scope.route, scope.key);
        let scope_execs = evidence.execs_of(scope);
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
                kept.stored.entry(scope.clone()).or_default().push(e);
            }
            if g.current {
                kept.current.insert(scope.clone(), e);
            }
        }
        audit.double_executions.extend(v.double_executions);
        audit.violations.extend(v.violations);
        for (b, at, generation) in v.burnt {
            let how: Vec<&str> = evidence
                .events
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
    kept
}

/// A request's answer, in a few words.
fn outcome_text(s: &Sent) -> String {
    match &s.outcome {
        Err(e) => format!("no answer ({e})"),
        Ok(a) => problem_of(a).unwrap_or_else(|| a.status.to_string()),
    }
}

/// Every answer a client got is one the contract allows ([`check_answer`]);
/// counts the answers by outcome.
fn answers_keep_the_contract(evidence: &Evidence<'_>, kept: &Kept<'_>, audit: &mut Audit) {
    // How often each execution's answer reached a client unmarked.
    let mut fresh: BTreeMap<u64, usize> = BTreeMap::new();
    for (scope, list) in &evidence.sent {
        let stored_here: Vec<&Execution> = match (evidence.histories.get(scope), kept.stored.get(scope)) {
            (Some(_), Some(s)) => s.clone(),
            (Some(_), None) => Vec::new(),
            // Without the history: any execution that was not released.
            (None, _) => evidence
                .execs_of(scope)
                .iter()
                .filter(|e| !released(e))
                .copied()
                .collect(),
        };
        let bodies: Vec<&str> = list.iter().map(|s| s.body.as_str()).collect();
        for s in list {
            match &s.outcome {
                Err(e) => {
                    audit.transport_errors += 1;
                    *audit.by_outcome.entry("no answer".into()).or_default() += 1;
                    let route = audit.by_route.entry(scope.route).or_default();
                    *route.outcomes.entry(format!("no answer ({e})")).or_default() += 1;
                }
                Ok(a) => {
                    audit.answers += 1;
                    let problem = problem_of(a);
                    let unavailable = problem.as_deref() == Some("store-unavailable");
                    audit.answered_at.push((s.at_ms, unavailable));
                    if a.header("idempotent-replayed").is_none() && problem.is_none() {
                        if let Some(n) = execution_number(a) {
                            *fresh.entry(n).or_default() += 1;
                        }
                    }
                    let label = match (problem, a.header("idempotent-replayed")) {
                        (Some(p), _) => p,
                        (None, Some(_)) => "replayed".to_string(),
                        (None, None) if is_grpc(a) => match grpc_status(a) {
                            Some(code) => format!("grpc-status {code}"),
                            None => "grpc without status".to_string(),
                        },
                        (None, None) => a.status.to_string(),
                    };
                    *audit
                        .by_route
                        .entry(scope.route)
                        .or_default()
                        .outcomes
                        .entry(label.clone())
                        .or_default() += 1;
                    *audit.by_outcome.entry(label).or_default() += 1;
                    if let Some(v) = check_answer(s, a, &stored_here, &evidence.by_n, &bodies) {
                        audit.violations.push(v);
                    }
                }
            }
        }
    }
    // An execution answers one request; every other answer with it is a
    // replay and must say so.
    for (n, times) in fresh.iter().filter(|(_, t)| **t > 1) {
        audit.violations.push(format!(
            "execution {n} reached {times} clients without Idempotent-Replayed: a replay went unmarked"
        ));
    }
}

/// No log line of any process holds a raw key (every key carries `tag`).
fn no_raw_key_in_logs(stack: &Stack, tag: &str, audit: &mut Audit) {
    let leaks: Vec<String> = stack
        .log_lines()
        .into_iter()
        .filter(|(_, line)| line.contains(tag))
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
