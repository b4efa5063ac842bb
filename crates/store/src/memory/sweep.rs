//! One sweeper pass: expired leases, abandoned attempts, archiving, and what
//! is past the audit retention. Each phase picks what the SQL backends'
//! statements pick (`sqlite::sweep`, `postgres::sweep`), with the same
//! conditions ([`crate::conditions`]) and the oldest due first; each picked
//! record's effect is decided ([`effects::sweep`]) and carried out. Nothing
//! here can fail halfway, so no phase is ever rolled back.

use std::collections::BTreeSet;

use super::operations::carry_out;
use super::reads::as_count;
use super::tables::{Current, Journal, Tables};
use crate::backend::{SweepPhase, SweepPolicy, SweepReport, ABANDONED_ATTEMPT_MEMORY_MS};
use crate::conditions;
use crate::effects::{self, Due};
use crate::row_mapping::{i64_from, ScopeDigest};

pub(super) fn sweep(t: &mut Tables, journal: &mut Journal, now: i64, policy: SweepPolicy) -> SweepReport {
    let mut report = SweepReport::default();
    for phase in SweepPhase::ALL {
        run_phase(t, journal, now, policy, phase, &mut report);
    }
    report
}

/// The keys of the records `due` picks, ordered by `order` (ties in the
/// order keys got their rows), at most `batch`.
fn pick<K: Ord>(
    t: &Tables,
    batch: u32,
    due: impl Fn(&ScopeDigest, &Current) -> bool,
    order: impl Fn(&Current) -> K,
) -> Vec<ScopeDigest> {
    let mut picked: Vec<(&ScopeDigest, &Current)> = t.records.iter().filter(|(k, c)| due(k, c)).collect();
    picked.sort_by_key(|(_, c)| (order(c), c.rowid));
    picked
        .into_iter()
        .take(as_count(batch))
        .map(|(k, _)| *k)
        .collect()
}

fn run_phase(
    t: &mut Tables,
    journal: &mut Journal,
    now: i64,
    SweepPolicy {
        batch,
        audit_retention_ms,
    }: SweepPolicy,
    phase: SweepPhase,
    report: &mut SweepReport,
) {
    let mut carry_out_all = |t: &mut Tables, keys: Vec<ScopeDigest>, due| {
        for key in keys {
            let effect = effects::sweep(t.load(&key).as_ref(), due, now);
            if let Some(swept) = carry_out(t, journal, &key, effect, now) {
                swept.count(report);
            }
        }
    };
    match phase {
        // Leases that ran out: released or turned unknown, as the claim's
        // policy said; the ones that ran out first, first.
        SweepPhase::Leases => {
            for release in [true, false] {
                let keys = pick(
                    t,
                    batch,
                    |_, c| {
                        conditions::leased(c.state)
                            && c.row.lease_until <= now
                            && c.row.release_on_unknown == release
                    },
                    |c| c.row.lease_until,
                );
                carry_out_all(t, keys, Due::LeaseRanOut);
            }
        }
        // Claims that landed after their filter had abandoned them, then
        // abandoned attempts whose claims can no longer land.
        SweepPhase::Abandoned => {
            let landed = |key: &ScopeDigest, c: &Current| {
                let abandoned_at = c
                    .row
                    .attempt
                    .as_ref()
                    .and_then(|a| t.abandoned.get(&(*key, a.clone())));
                conditions::abandonable(c.state, c.row.archived_at.is_some())
                    && abandoned_at.is_some_and(|at| *at <= now)
            };
            let keys = pick(t, batch, landed, |_| ());
            carry_out_all(t, keys, Due::LandedAbandoned);
            let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
            t.abandoned.retain(|_, at| *at > forget);
        }
        // Expired records: body dropped, metadata kept.
        SweepPhase::Archive => {
            let keys = pick(
                t,
                batch,
                |_, c| c.row.archived_at.is_none() && c.row.expires_at.is_some_and(|at| at <= now),
                |c| c.row.expires_at,
            );
            carry_out_all(t, keys, Due::Expired);
        }
        // Past the audit retention: archived generations, history, events.
        SweepPhase::Purge => {
            let cutoff = now.saturating_sub(i64_from(audit_retention_ms));
            purge(t, cutoff, batch, report);
        }
    }
}

/// Archived records and ended generations past `cutoff`, the oldest first
/// (at most `batch` of each), each with its events past it; then at most
/// `batch` other events past it, the oldest first. A purged generation's
/// later events stay, naming it as before.
fn purge(t: &mut Tables, cutoff: i64, batch: u32, report: &mut SweepReport) {
    let purged_before = (report.purged, report.events_purged);
    let archived = pick(
        t,
        batch,
        |_, c| c.row.archived_at.is_some_and(|at| at <= cutoff),
        |c| c.row.archived_at,
    );
    let mut gone = BTreeSet::new();
    for key in archived {
        if let Some(c) = t.records.remove(&key) {
            gone.insert(c.row.generation);
            report.purged += 1;
        }
    }
    let mut ended: Vec<(usize, i64)> = (t.history.iter().enumerate())
        .filter(|(_, e)| e.ended_at <= cutoff)
        .map(|(i, e)| (i, e.ended_at))
        .collect();
    ended.sort_by_key(|(i, at)| (*at, *i));
    let ended: BTreeSet<usize> = ended.into_iter().take(as_count(batch)).map(|(i, _)| i).collect();
    let mut i = 0;
    t.history.retain(|e| {
        let purged = ended.contains(&i);
        i += 1;
        if purged {
            gone.insert(e.row.generation);
        }
        !purged
    });
    report.purged += count(ended.len());
    let before = t.events.len();
    t.events
        .retain(|e| !(gone.contains(&e.generation) && e.at <= cutoff));
    let mut left = as_count(batch);
    t.events.retain(|e| {
        let purged = left > 0 && e.at <= cutoff;
        if purged {
            left -= 1;
        }
        !purged
    });
    report.events_purged += count(before - t.events.len());
    if (report.purged, report.events_purged) != purged_before {
        t.commit(true);
        t.purges += 1;
    }
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
