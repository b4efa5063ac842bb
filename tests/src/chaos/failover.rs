//! What the failover runs share (tests/failover.rs, a standby promoted by
//! hand; tests/patroni.rs, one Patroni promotes): their audit, once the
//! traffic is done, with when the stores claimed through the promoted
//! database again; and what the promoted database lost of the transitions
//! the stores logged as committed, weighed against the contract (§5: a
//! completion the store did not wait for may be lost with the database,
//! and the answers it served with it).

use std::collections::{BTreeMap, HashSet};

use super::{audit, policy, Audit, Traffic};
use crate::stack::Stack;

/// How [`committed_but_lost`] names completions the store commits without
/// waiting for the WAL (routes that keep unknown outcomes).
const UNWAITED: &str = "completed, not waited for";

/// The audit's finding for an answer (a replay, result-unavailable) of a
/// completion the store no longer has.
const REPLAY_OF_LOST: &str = ", but nothing was stored";

/// The query whose rows [`committed_but_lost`] reads from the promoted
/// database: every transition it holds, by its fence and fingerprint.
///
/// A fence is drawn once per claim (a sequence, which may hand a lost
/// claim's fence out again after an asynchronous failover), so it is named
/// together with the body's fingerprint, which an event row leaves to its
/// generation's row (the record, the history, or a purged generation).
const HELD_TRANSITIONS: &str = "SELECT e.transition || ' ' || e.fence || ' ' || coalesce(g.fingerprint, '-') \
     FROM idempotency_events e JOIN (SELECT generation, fingerprint FROM idempotency_records \
     UNION ALL SELECT generation, fingerprint FROM idempotency_history \
     UNION ALL SELECT generation, fingerprint FROM idempotency_purged_generations) g ON g.generation = e.generation";

/// A failover run's audit, and what the failover did to its traffic and
/// to what the stores committed.
pub struct Audited {
    pub report: Audit,
    /// What the promoted database lost: [`committed_but_lost`].
    pub lost: BTreeMap<String, usize>,
    /// When the first request claimed through the promoted database reached
    /// the upstream.
    pub first_owned: Option<i64>,
    /// The answers 503 `store-unavailable`.
    pub unavailable: usize,
}

/// The chaos audit of a failover run whose workers are done. The database
/// failed at `failed_at` and was promoted from `promoted_at` (never, if
/// `None`; ms since the epoch): no claim can be made in between, and a
/// claimed request reaches the upstream within milliseconds, so the first
/// execution from `promoted_at` on is the stores' recovery. Until it,
/// answers 503 `store-unavailable` are the failover's. `query` runs SQL on
/// the promoted database; `log_id`: [`committed_but_lost`].
pub async fn audit_failover(
    stack: &Stack,
    traffic: &Traffic,
    failed_at: i64,
    promoted_at: Option<i64>,
    query: impl FnOnce(&str) -> String,
    log_id: impl Fn(&str) -> String,
) -> Audited {
    let first_owned = promoted_at.and_then(|p| {
        (stack.upstream.log().iter())
            .map(|e| e.at_ms)
            .filter(|at| *at >= p)
            .min()
    });
    let unavailable = traffic.store_unavailable();
    stack.wait_envoy().await;
    let mut report = audit(stack, traffic).await;
    report.bound_unavailable(&[("failover", failed_at, first_owned.unwrap_or(i64::MAX))]);
    let lost = committed_but_lost(stack, &query(HELD_TRANSITIONS), log_id);
    Audited {
        report,
        lost,
        first_owned,
        unavailable,
    }
}

/// The transitions any store replica logged as committed (`idemgate::events`
/// lines) that the promoted database does not hold, counted by kind;
/// completions apart (`UNWAITED`) when their route keeps unknown outcomes:
/// the store commits those without waiting for the WAL, so for the standby.
/// `held` is the promoted database's answer to `HELD_TRANSITIONS`;
/// `log_id` names a fingerprint as the stores' log lines do (a keyed hash,
/// under a key the stores derive from the admin credential).
pub fn committed_but_lost(
    stack: &Stack,
    held: &str,
    log_id: impl Fn(&str) -> String,
) -> BTreeMap<String, usize> {
    let held: HashSet<String> = held
        .lines()
        .map(|line| match line.rsplit_once(' ') {
            Some((event, fp)) if fp != "-" => format!("{event} {}", log_id(fp)),
            _ => line.to_string(),
        })
        .collect();
    let mut lost = BTreeMap::new();
    for (_, line) in stack.log_lines() {
        if !line.contains("idemgate::events") {
            continue;
        }
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                .map_or("?", |v| v.trim_matches('"'))
        };
        let event = field("event");
        if held.contains(&format!("{event} {} {}", field("fence"), field("fingerprint"))) {
            continue;
        }
        let kind = match event {
            "completed" if !policy(field("route")).release_on_unknown => UNWAITED.to_string(),
            other => other.to_string(),
        };
        *lost.entry(kind).or_default() += 1;
    }
    lost
}

/// Whether an audit finding is the answer a retry got from a completion
/// the contract lets a failover lose: the finding says nothing was stored,
/// its route keeps unknown outcomes (so the store did not wait for its
/// completions), and the run lost such a completion.
pub fn answer_of_an_unwaited_loss(finding: &str, lost: &BTreeMap<String, usize>) -> bool {
    // Findings start with the scope: `TENANT ROUTE KEY ...`.
    let route = finding.split_whitespace().nth(1).unwrap_or_default();
    finding.contains(REPLAY_OF_LOST)
        && lost.get(UNWAITED).is_some_and(|n| *n > 0)
        && policy(route).name == route
        && !policy(route).release_on_unknown
}

/// Takes the answers of lost completions the contract allows
/// ([`answer_of_an_unwaited_loss`]) out of the report's violations, to be
/// counted apart: how many. On a route whose completions are waited for,
/// or in a run that lost none of those, such an answer stays a violation.
pub fn allow_answers_of_unwaited_losses(report: &mut Audit, lost: &BTreeMap<String, usize>) -> usize {
    let before = report.violations.len();
    report.violations.retain(|v| !answer_of_an_unwaited_loss(v, lost));
    before - report.violations.len()
}

/// What a failover to a synchronous standby must keep, as checks (whether
/// it held, what): every key usable, every acknowledged claim, and every
/// transition the store waited for.
pub fn kept_by_a_synchronous_standby(
    report: &Audit,
    lost: &BTreeMap<String, usize>,
) -> [(bool, &'static str); 3] {
    [
        (report.burnt_keys.is_empty(), "no burnt key"),
        (!lost.contains_key("claimed"), "no acknowledged claim lost"),
        (
            lost.keys().all(|what| what == UNWAITED),
            "no transition lost that the store waited for",
        ),
    ]
}

/// The run's row's words for what it lost and how many answers of a lost
/// completion it allowed.
pub fn lost_text(lost: &BTreeMap<String, usize>, allowed: usize) -> String {
    match (lost.is_empty(), allowed) {
        (true, 0) => "nothing committed lost".to_string(),
        (true, n) => format!("{n} answers of a lost completion (allowed)"),
        (false, 0) => format!("committed but lost: {lost:?}"),
        (false, n) => format!("committed but lost: {lost:?}, {n} answers of a lost completion (allowed)"),
    }
}
