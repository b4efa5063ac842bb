//! One sweeper pass, one job on the writer: expired leases, abandoned
//! attempts, archiving, and what is past the audit retention.

use std::sync::LazyLock;

use idemgate_core::record::{self, State, Transition};
use rusqlite::Connection;

use super::generation::{end_generation, event, execute, set_unknown, Journal};
use super::rows::{load, query_keys};
use crate::backend::{actor, Result, SweepPolicy, SweepReport, ABANDONED_ATTEMPT_MEMORY_MS};
use crate::columns::{i64_from, ColumnReader};
use crate::conditions::expand;

/// Rows picked by a phase: `?1` now, `?2` the batch, `?3` the claim's
/// `on_unknown` (released or not). Each phase takes the oldest due first, in
/// the order of its partial index.
static LEASE_RAN_OUT: LazyLock<String> = LazyLock::new(|| {
    expand(
        "SELECT scope_digest, ttl_ms FROM idempotency_records \
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
const EXPIRED: &str = "SELECT scope_digest FROM idempotency_records \
                       WHERE archived_at IS NULL AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2";

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

pub(super) fn sweep(
    conn: &Connection,
    journal: &mut Journal,
    now: i64,
    policy: SweepPolicy,
) -> Result<SweepReport> {
    let SweepPolicy {
        batch,
        audit_retention_ms,
    } = policy;
    let mut report = SweepReport::default();
    // Leases that ran out: released or turned unknown, as the claim's policy said.
    let ran_out = |release: bool| {
        super::rows::query_all(conn, &LEASE_RAN_OUT, &[&now, &batch, &release], |row| {
            Ok((row.scope_digest()?, row.unsigned("ttl_ms")?))
        })
    };
    for (key, _) in ran_out(true)? {
        let by = (Transition::LeaseExpired, actor::SWEEPER, Some("released"));
        end_generation(conn, &key, State::InProgress, by, now, journal)?;
        report.released += 1;
    }
    for (key, ttl_ms) in ran_out(false)? {
        set_unknown(conn, &key, record::unknown_expiry(now, ttl_ms))?;
        let by = (Transition::LeaseExpired, actor::SWEEPER, Some("unknown"));
        event(conn, &key, by, now, journal)?;
        report.marked_unknown += 1;
    }
    // Claims that landed after their filter had abandoned them.
    for key in query_keys(conn, &LANDED_ABANDONED, &[&now, &batch])? {
        let Some(loaded) = load(conn, &key)? else { continue };
        let by = (Transition::Abandoned, actor::SWEEPER, None);
        end_generation(conn, &key, loaded.view.state, by, now, journal)?;
        report.abandoned += 1;
    }
    let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
    conn.prepare_cached("DELETE FROM idempotency_abandoned WHERE at <= ?1")
        .and_then(|mut stmt| stmt.execute([forget]))
        .map_err(super::engine::unavailable)?;
    // Expired records: body dropped, metadata kept.
    for key in query_keys(conn, EXPIRED, &[&now, &batch])? {
        let sql = concat!(
            "UPDATE idempotency_records SET archived_at = ?2, response_body = NULL WHERE ",
            key_where!()
        );
        execute(conn, sql, &key, &[&now])?;
        event(
            conn,
            &key,
            (Transition::Archived, actor::SWEEPER, None),
            now,
            journal,
        )?;
        report.archived += 1;
    }
    // Past the audit retention: archived generations, history, events.
    let cutoff = now.saturating_sub(i64_from(audit_retention_ms));
    let delete = |sql: &str| {
        conn.prepare_cached(sql)
            .and_then(|mut stmt| stmt.execute(rusqlite::params![cutoff, batch]))
            .map(count)
            .map_err(super::engine::unavailable)
    };
    report.purged = delete(
        "DELETE FROM idempotency_records WHERE scope_digest IN (SELECT scope_digest FROM idempotency_records \
         WHERE archived_at IS NOT NULL AND archived_at <= ?1 ORDER BY archived_at LIMIT ?2)",
    )? + delete(
        "DELETE FROM idempotency_history WHERE rowid IN (SELECT rowid FROM idempotency_history \
         WHERE ended_at <= ?1 LIMIT ?2)",
    )?;
    report.events_purged = delete(
        "DELETE FROM idempotency_events WHERE id IN (SELECT id FROM idempotency_events WHERE at <= ?1 LIMIT ?2)",
    )?;
    Ok(report)
}
