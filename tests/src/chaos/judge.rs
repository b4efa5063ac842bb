//! One scope judged: its executions against the generations of its record
//! in the store's history, under its route's policy.

use std::collections::BTreeMap;

use super::{route_of, Route, ScopeId};
use crate::Execution;

/// The upstream refused before acting: the store releases the claim. A gRPC
/// call is released by its status (contract §10: `RESOURCE_EXHAUSTED` and
/// the other codes meaning "refused before acting").
pub(super) fn released(e: &Execution) -> bool {
    let refused = match e.grpc_status {
        Some(code) => idemgate_core::grpc::DEFAULT_RELEASE_CODES.contains(&code),
        None => matches!(e.status, 408 | 425 | 429),
    };
    refused || e.control.as_deref() == Some("no-store")
}

/// How many bytes the store keeps of execution `e`'s response: its body;
/// for a gRPC call, its message frames and then one frame (flag `0x80`)
/// holding the status fields a replay sends back as `name: value\r\n`
/// lines (contract §10: every `grpc-*` field; the chaos policy lists no
/// other trailing metadata to replay).
pub(super) fn stored_len(e: &Execution) -> usize {
    if e.grpc_status.is_none() {
        return e.response.len();
    }
    let kept: usize = e
        .grpc_fields
        .iter()
        .filter(|(name, _)| name.starts_with("grpc-"))
        .map(|(name, value)| name.len() + 2 + value.len() + 2)
        .sum();
    e.response.len() + 5 + kept
}

pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn execution_scope(e: &Execution) -> ScopeId {
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
    /// Whether the record kept the response body (`None` while it has no
    /// outcome): a response longer than the route's `max_stored_body` is
    /// recorded without it.
    pub body_stored: Option<bool>,
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
            body_stored: r["body_stored"].as_bool(),
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
    let owner: Vec<Option<usize>> = execs
        .iter()
        .map(|e| gens.iter().rposition(|g| g.created_at <= e.at_ms))
        .collect();
    let by_gen: Vec<Vec<&Execution>> = (0..gens.len())
        .map(|g| {
            execs
                .iter()
                .zip(&owner)
                .filter(|(_, o)| **o == Some(g))
                .map(|(e, _)| *e)
                .collect()
        })
        .collect();
    let (double_executions, reruns) = double_executions(what, route, execs, gens, &owner, &by_gen);
    let mut violations = executions_outside_their_claim(what, execs, gens, &owner);
    violations.extend(records_against_executions(what, route, gens, &by_gen));
    ScopeVerdict {
        double_executions,
        violations,
        burnt: burnt_keys(what, gens, &by_gen),
        abandoned_executed: executions_of_abandoned_claims(what, execs, gens, &owner),
        reruns,
        owner,
    }
}

/// No execution without a claim before it, none after its generation ended
/// (other than by its lease running out).
fn executions_outside_their_claim(
    what: &str,
    execs: &[&Execution],
    gens: &[Generation],
    owner: &[Option<usize>],
) -> Vec<String> {
    let mut found = Vec::new();
    for (e, owner) in execs.iter().zip(owner) {
        let Some(g) = owner.map(|g| &gens[g]) else {
            found.push(format!(
                "{what}: execution {} ran but the store's history has no claim before it",
                e.n
            ));
            continue;
        };
        if g.state != "abandoned" && g.ended_at.is_some_and(|end| end < e.at_ms) && g.state != "lease_expired"
        {
            found.push(format!(
                "{what}: execution {} arrived {} ms after its generation {} ended {}",
                e.n,
                e.at_ms - g.ended_at.unwrap_or(0),
                g.generation,
                g.state
            ));
        }
    }
    found
}

/// The filter abandons only what it never forwarded: no execution may run
/// in a generation the store ended as abandoned.
fn executions_of_abandoned_claims(
    what: &str,
    execs: &[&Execution],
    gens: &[Generation],
    owner: &[Option<usize>],
) -> Vec<String> {
    execs
        .iter()
        .zip(owner)
        .filter_map(|(e, owner)| {
            let g = &gens[(*owner)?];
            (g.state == "abandoned").then(|| {
                format!(
                    "{what}: execution {} ran in generation {}, which the store ended as abandoned",
                    e.n, g.generation
                )
            })
        })
        .collect()
}

/// Exactly once, as the policy defines it: a generation forwards once, and
/// a scope runs again only after each earlier execution left the key free
/// (released, or as the policy allows: unknown or lease run out, expired).
/// Also counts the re-runs the policy allowed, by reason.
fn double_executions(
    what: &str,
    route: Route,
    execs: &[&Execution],
    gens: &[Generation],
    owner: &[Option<usize>],
    by_gen: &[Vec<&Execution>],
) -> (Vec<String>, BTreeMap<&'static str, usize>) {
    let mut found = Vec::new();
    let mut reruns = BTreeMap::new();
    for (g, list) in by_gen.iter().enumerate() {
        if list.len() > 1 {
            found.push(format!(
                "{what}: generation {} executed {} times (executions {:?})",
                gens[g].generation,
                list.len(),
                list.iter().map(|e| e.n).collect::<Vec<_>>()
            ));
        }
    }
    for (j, later) in execs.iter().enumerate() {
        let Some(gj) = owner[j] else { continue };
        // Each earlier execution of an earlier generation must have left the
        // key free; the reason the last one did is what allowed this one.
        let mut allowed = None;
        let mut refused = None;
        for (i, earlier) in execs.iter().enumerate().take(j) {
            let Some(gi) = owner[i].filter(|gi| *gi < gj) else {
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
            (Some((earlier, ended)), _) => found.push(format!(
                "{what}: execution {} ran again after execution {} (status {}) whose generation {} ended {}",
                later.n, earlier.n, earlier.status, ended.generation, ended.state
            )),
            (None, Some(reason)) => *reruns.entry(reason).or_default() += 1,
            (None, None) => {}
        }
    }
    (found, reruns)
}

/// The store's records agree with what ran in them: an ended generation is
/// `released` only after a release status or nothing, `completed` with its
/// execution's status and replaced only once expired; the one current
/// generation, after the run settled, is completed with its execution's
/// status and body length (or, for a response longer than the route's
/// `max_stored_body`, without its body), or unknown, or (see
/// [`burnt_keys`]) burnt.
fn records_against_executions(
    what: &str,
    route: Route,
    gens: &[Generation],
    by_gen: &[Vec<&Execution>],
) -> Vec<String> {
    let mut found = Vec::new();
    for (g, gen) in gens.iter().enumerate().filter(|(_, g)| !g.current) {
        let ran = &by_gen[g];
        match gen.state.as_str() {
            "released" => {
                if let Some(e) = ran.iter().find(|e| !released(e)) {
                    found.push(format!(
                        "{what}: generation {} was released although execution {} answered {}",
                        gen.generation, e.n, e.status
                    ));
                }
            }
            "completed" => {
                if !gen.expired_by(gen.ended_at.unwrap_or(i64::MAX)) {
                    found.push(format!(
                        "{what}: completed generation {} was replaced before it expired",
                        gen.generation
                    ));
                }
                match ran.first() {
                    None => found.push(format!(
                        "{what}: generation {} completed without an execution",
                        gen.generation
                    )),
                    Some(e) if gen.status != Some(e.status) => found.push(format!(
                        "{what}: generation {} completed with status {:?}, execution {} answered {}",
                        gen.generation, gen.status, e.n, e.status
                    )),
                    Some(_) => {}
                }
            }
            _ => {}
        }
    }
    let current: Vec<usize> = (0..gens.len()).filter(|&g| gens[g].current).collect();
    if current.len() > 1 {
        found.push(format!("{what}: {} current records for one scope", current.len()));
    }
    for g in current {
        let (gen, ran) = (&gens[g], &by_gen[g]);
        match (gen.state.as_str(), ran.first()) {
            ("completed", Some(e)) => {
                let len = stored_len(e);
                let body_ok = if route.too_large_to_store(len) {
                    gen.body_stored != Some(true) && gen.body_len.unwrap_or(0) == 0
                } else {
                    gen.archived_at.is_some()
                        || (gen.body_stored != Some(false) && gen.body_len == Some(len as u64))
                };
                if gen.status != Some(e.status) || !body_ok {
                    found.push(format!(
                        "{what}: record {:?} / {:?} bytes (body stored: {:?}), execution {} answered {} / {} bytes",
                        gen.status,
                        gen.body_len,
                        gen.body_stored,
                        e.n,
                        e.status,
                        len
                    ));
                }
            }
            ("completed", None) => found.push(format!("{what}: completed record without an execution")),
            // Burnt (see burnt_keys), or an honest unknown: its upstream ran.
            ("unknown" | "in_progress", None) | ("unknown", Some(_)) => {}
            (other, _) => found.push(format!("{what}: record in state {other:?} after the run")),
        }
    }
    found
}

/// A current generation left unknown or in progress, after the run settled,
/// whose upstream never ran: a key burnt for its TTL. With when it was
/// claimed and its number.
fn burnt_keys(what: &str, gens: &[Generation], by_gen: &[Vec<&Execution>]) -> Vec<(String, i64, u64)> {
    gens.iter()
        .zip(by_gen)
        .filter(|(gen, ran)| {
            gen.current && ran.is_empty() && matches!(gen.state.as_str(), "unknown" | "in_progress")
        })
        .map(|(gen, _)| {
            (
                format!(
                    "{what}: generation {} left {} but its upstream never ran",
                    gen.generation, gen.state
                ),
                gen.created_at,
                gen.generation,
            )
        })
        .collect()
}
