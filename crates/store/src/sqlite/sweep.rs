//! One sweeper pass, one job on the writer: expired leases, abandoned
//! attempts, archiving, and what is past the audit retention, each phase
//! under its own savepoint. Each picked record's effect is
//! decided ([`effects::sweep`]) and carried out.

use std::sync::LazyLock;

use super::engine::Writer;
use super::generation::Journal;
use super::operations::carry_out;
use super::rows::{load, query_keys, query_values};
use crate::backend::{Result, SweepPhase, SweepPolicy, SweepReport, ABANDONED_ATTEMPT_MEMORY_MS};
use crate::conditions::expand;
use crate::effects::{self, Due};
use crate::row_mapping::{i64_from, GENERATION_OF_EVENT, PURGE_EVENTLESS_GENERATIONS};
use crate::sealing::Seal;
use crate::shared_statements::FORGET_ABANDONED;

/// Rows picked by a phase: `?1` now, `?2` the batch, `?3` the claim's
/// `on_unknown` (released or not). Each phase takes the oldest due first, in
/// the order of its partial index.
static LEASE_RAN_OUT: LazyLock<String> = LazyLock::new(|| {
    expand(
        "SELECT scope_digest FROM idempotency_records \
         WHERE {leased} AND lease_until <= ?1 AND release_on_unknown = ?3 ORDER BY lease_until LIMIT ?2",
    )
});
/// `state` and `archived_at` are the record's: the abandoned table has neither.
static LANDED_ABANDONED: LazyLock<String> = LazyLock::new(|| {
    expand(
        "SELECT r.scope_digest FROM idempotency_abandoned a JOIN idempotency_records r \
         ON r.scope_digest = a.scope_digest AND r.attempt = a.attempt \
         WHERE {abandonable} AND a.at <= ?1 LIMIT ?2",
    )
});
/// Archived records past the retention: `?1` the cutoff, `?2` the batch.
static PURGE_ARCHIVED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idempotency_records WHERE scope_digest IN (SELECT scope_digest FROM idempotency_records \
         WHERE archived_at IS NOT NULL AND archived_at <= ?1 ORDER BY archived_at LIMIT ?2) \
         RETURNING {GENERATION_OF_EVENT}"
    )
});
/// Ended generations past the retention, as [`PURGE_ARCHIVED`].
static PURGE_HISTORY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idempotency_history WHERE rowid IN (SELECT rowid FROM idempotency_history \
         WHERE ended_at <= ?1 ORDER BY ended_at LIMIT ?2) RETURNING {GENERATION_OF_EVENT}"
    )
});
const EXPIRED: &str = "SELECT scope_digest FROM idempotency_records \
                       WHERE archived_at IS NULL AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2";

/// Records a phase takes per writer job. At 10^6 records a job of 500
/// held the writer for 50–110 ms (its commit and the WAL's restart
/// included), and every request queued meanwhile waited for all of it;
/// slices of 100 cut the claims' p99.9 under a catching-up sweeper about
/// threefold and, with the store alone, sweep as fast (through Envoy, with
/// the cores shared, 60% slower at 10^6, as fast at 10^7); slices of 50
/// sweep a third slower still (`profile.md` §15).
pub(super) const SLICE: u32 = 100;

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Runs `sql`; how many rows it changed.
fn run(conn: &rusqlite::Connection, sql: &str, params: &[&dyn rusqlite::ToSql]) -> Result<u64> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.execute(params))
        .map(count)
        .map_err(super::errors::unavailable)
}

pub(super) fn sweep(
    w: &Writer<'_>,
    journal: &mut Journal,
    seal: &Seal,
    now: i64,
    policy: SweepPolicy,
) -> Result<SweepReport> {
    let conn: &rusqlite::Connection = w;
    let mut report = SweepReport::default();
    for phase in SweepPhase::ALL {
        let (kept, events) = (report, journal.len());
        control(conn, "SAVEPOINT sweep_phase")?;
        match run_phase(w, journal, seal, now, policy, phase, &mut report) {
            Ok(()) => control(conn, "RELEASE sweep_phase")?,
            Err(e) => {
                // A failure that ended the transaction, or a savepoint that
                // cannot be rolled back to, loses the whole batch.
                let rolled_back = control(conn, "ROLLBACK TO sweep_phase")
                    .and_then(|()| control(conn, "RELEASE sweep_phase"));
                if rolled_back.is_err() || conn.is_autocommit() {
                    return Err(e);
                }
                report = kept;
                journal.truncate(events);
                report.phase_failed(phase, &e);
            }
        }
    }
    Ok(report)
}

fn control(conn: &rusqlite::Connection, sql: &str) -> Result<()> {
    conn.execute_batch(sql).map_err(super::errors::unavailable)
}

fn run_phase(
    w: &Writer<'_>,
    journal: &mut Journal,
    seal: &Seal,
    now: i64,
    SweepPolicy {
        batch,
        audit_retention_ms,
    }: SweepPolicy,
    phase: SweepPhase,
    report: &mut SweepReport,
) -> Result<()> {
    let conn: &rusqlite::Connection = w;
    let mut carry_out_all = |keys: Vec<_>, due| -> Result<()> {
        for key in keys {
            let loaded = match load(conn, &key) {
                Ok(loaded) => loaded,
                Err(e) => {
                    report.leave_unreadable(e, Some(&key))?;
                    continue;
                }
            };
            let effect = effects::sweep(loaded.as_ref(), due, now);
            if let Some(swept) = carry_out(w, journal, (&key, seal), effect, now)? {
                swept.count(report);
            }
        }
        Ok(())
    };
    match phase {
        // Leases that ran out: released or turned unknown, as the claim's policy said.
        SweepPhase::Leases => {
            for release in [true, false] {
                let keys = query_keys(conn, &LEASE_RAN_OUT, &[&now, &batch, &release])?;
                carry_out_all(keys, Due::LeaseRanOut)?;
            }
        }
        // Claims that landed after their filter had abandoned them.
        SweepPhase::Abandoned => {
            carry_out_all(
                query_keys(conn, &LANDED_ABANDONED, &[&now, &batch])?,
                Due::LandedAbandoned,
            )?;
            let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
            run(conn, FORGET_ABANDONED.sqlite(), &[&forget])?;
        }
        // Expired records: body dropped, metadata kept.
        SweepPhase::Archive => carry_out_all(query_keys(conn, EXPIRED, &[&now, &batch])?, Due::Expired)?,
        // Past the audit retention: archived generations, history, events.
        SweepPhase::Purge => {
            let cutoff = now.saturating_sub(i64_from(audit_retention_ms));
            for sql in [&*PURGE_ARCHIVED, &*PURGE_HISTORY] {
                let (generations, events) = purge_generations(conn, sql, cutoff, batch)?;
                report.purged += generations;
                report.events_purged += events;
            }
            report.events_purged += run(
                conn,
                "DELETE FROM idempotency_events WHERE id IN (SELECT id FROM idempotency_events WHERE at <= ?1 \
                 ORDER BY at LIMIT ?2)",
                &[&cutoff, &batch],
            )?;
            run(conn, PURGE_EVENTLESS_GENERATIONS, &[])?;
        }
    }
    Ok(())
}

/// Deletes the generations `sql` picks (`?1` the cutoff, `?2` the batch; it
/// returns [`GENERATION_OF_EVENT`]), each with its events past the
/// retention. A generation with later events is kept for them among the
/// purged generations. Returns how many generations and events went.
fn purge_generations(conn: &rusqlite::Connection, sql: &str, cutoff: i64, batch: u32) -> Result<(u64, u64)> {
    const EVENTS: &str = "DELETE FROM idempotency_events WHERE generation = ?1 AND at <= ?2";
    static KEEP: LazyLock<String> = LazyLock::new(|| {
        format!(
            "INSERT OR IGNORE INTO idempotency_purged_generations ({GENERATION_OF_EVENT}) \
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9 \
             WHERE EXISTS (SELECT 1 FROM idempotency_events WHERE generation = ?1)"
        )
    });
    let gone = query_values(conn, sql, &[&cutoff, &batch])?;
    let mut events = 0;
    for generation in &gone {
        if let Some((number, _)) = generation.split_first() {
            events += run(conn, EVENTS, &[number, &cutoff])?;
        }
        let all: Vec<&dyn rusqlite::ToSql> = generation.iter().map(|v| v as &dyn rusqlite::ToSql).collect();
        run(conn, &KEEP, &all)?;
    }
    Ok((count(gone.len()), events))
}
