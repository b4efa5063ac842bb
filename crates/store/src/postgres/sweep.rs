//! One sweeper pass in one transaction: expired leases, abandoned attempts,
//! archiving, and what is past the audit retention, each phase under its
//! own savepoint. Rows are picked with
//! `FOR UPDATE SKIP LOCKED`, so replicas sweeping at once share the work;
//! each picked record's effect is decided ([`effects::sweep`]) and carried out.

use std::sync::LazyLock;

use futures_util::future::try_join_all;
use idemgate_core::trace::Trace;

use super::errors::unavailable;
use super::operations::carry_out;
use super::pool::{On, Tx};
use super::rows::{pick, Param};
use super::Postgres;
use crate::backend::{Result, SweepPhase, SweepPolicy, SweepReport, ABANDONED_ATTEMPT_MEMORY_MS};
use crate::effects::{self, Due};
use crate::records::EventInfo;
use crate::row_mapping::{
    i64_from, ColumnReader, LoadedRecord, GENERATION_OF_EVENT, PURGE_EVENTLESS_GENERATIONS,
};
use crate::shared_statements::FORGET_ABANDONED;

static RELEASED_ON_EXPIRY: LazyLock<String> = LazyLock::new(|| {
    pick(
        "{leased} AND lease_until <= $1 AND release_on_unknown",
        "lease_until",
    )
});
static UNKNOWN_ON_EXPIRY: LazyLock<String> = LazyLock::new(|| {
    pick(
        "{leased} AND lease_until <= $1 AND NOT release_on_unknown",
        "lease_until",
    )
});
/// Claims that landed under an attempt their filter had abandoned.
static LANDED_ABANDONED: LazyLock<String> = LazyLock::new(|| {
    pick(
        "{abandonable} AND EXISTS (SELECT 1 FROM idempotency_abandoned a \
         WHERE a.scope_digest = idempotency_records.scope_digest AND a.attempt = idempotency_records.attempt \
         AND a.at <= $1)",
        "scope_digest",
    )
});
static EXPIRED: LazyLock<String> =
    LazyLock::new(|| pick("archived_at IS NULL AND expires_at <= $1", "expires_at"));
// A purge takes its batch past the cutoff ($1) the oldest first, in the
// order of its column's index, as the picks do; the batch is taken whole
// (`ARRAY`) before its rows are deleted by key or position. Without the
// order the planner may take a batch from a sequential scan that expects
// the share of rows its statistics say are due to turn up early; and a
// batch joined to the table's rows may be joined by a scan of the whole
// table. When what is left lies at the table's end, either reads the whole
// table: past the statement timeout, on every pass.
static PURGE_ARCHIVED: LazyLock<String> = LazyLock::new(|| {
    purge_generations(
        "DELETE FROM idempotency_records WHERE scope_digest = ANY(ARRAY(SELECT scope_digest \
         FROM idempotency_records WHERE archived_at IS NOT NULL AND archived_at <= $1 ORDER BY archived_at \
         LIMIT $2 FOR UPDATE SKIP LOCKED))",
    )
});
static PURGE_HISTORY: LazyLock<String> = LazyLock::new(|| {
    purge_generations(
        "DELETE FROM idempotency_history WHERE ctid = ANY(ARRAY(SELECT ctid FROM idempotency_history \
         WHERE ended_at <= $1 ORDER BY ended_at LIMIT $2))",
    )
});
const PURGE_EVENTS: &str =
    "DELETE FROM idempotency_events WHERE id = ANY(ARRAY(SELECT id FROM idempotency_events \
     WHERE at <= $1 ORDER BY at LIMIT $2))";

/// The generations `delete` deletes (`$1` the cutoff, `$2` the batch), each
/// with its events past the retention; a generation with later events is
/// kept for them among the purged generations. Returns how many
/// generations and events went.
fn purge_generations(delete: &str) -> String {
    let generation = GENERATION_OF_EVENT;
    format!(
        "WITH gone AS ({delete} RETURNING {generation}), \
         ev AS (DELETE FROM idempotency_events e USING gone WHERE e.generation = gone.generation AND e.at <= $1 \
           RETURNING e.id), \
         kept AS (INSERT INTO idempotency_purged_generations ({generation}) SELECT {generation} FROM gone \
           WHERE EXISTS (SELECT 1 FROM idempotency_events e WHERE e.generation = gone.generation AND e.at > $1) \
           ON CONFLICT DO NOTHING) \
         SELECT (SELECT count(*) FROM gone) AS generations, (SELECT count(*) FROM ev) AS events"
    )
}

impl Postgres {
    pub(super) async fn sweep_once(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        let mut client = self.connections.client().await?;
        let tx = client.begin().await?;
        let mut events = Vec::new();
        for phase in SweepPhase::ALL {
            let (kept, logged) = (report, events.len());
            savepoint(&tx, "SAVEPOINT sweep_phase").await?;
            match self
                .run_phase(&tx, now, policy, phase, &mut report, &mut events)
                .await
            {
                Ok(()) => savepoint(&tx, "RELEASE sweep_phase").await?,
                Err(e) => {
                    // The transaction goes on once back at the savepoint;
                    // if it cannot get there, the whole batch fails.
                    if savepoint(&tx, "ROLLBACK TO sweep_phase").await.is_err() {
                        return Err(e);
                    }
                    report = kept;
                    events.truncate(logged);
                    report.phase_failed(phase, &e);
                }
            }
        }
        tx.commit().await?;
        self.log_all(&events, &Trace::NONE);
        Ok(report)
    }

    async fn run_phase(
        &self,
        tx: &Tx<'_>,
        now: i64,
        policy: &SweepPolicy,
        phase: SweepPhase,
        report: &mut SweepReport,
        events: &mut Vec<EventInfo>,
    ) -> Result<()> {
        let batch = i64::from(policy.batch);
        let picks: &[(&LazyLock<String>, Due)] = match phase {
            // Leases that ran out: released or turned unknown, as the claim's policy said.
            SweepPhase::Leases => &[
                (&RELEASED_ON_EXPIRY, Due::LeaseRanOut),
                (&UNKNOWN_ON_EXPIRY, Due::LeaseRanOut),
            ],
            // Claims that landed after their filter had abandoned them.
            SweepPhase::Abandoned => &[(&LANDED_ABANDONED, Due::LandedAbandoned)],
            // Expired records: body dropped, metadata kept.
            SweepPhase::Archive => &[(&EXPIRED, Due::Expired)],
            SweepPhase::Purge => &[],
        };
        for &(sql, due) in picks {
            let picked = tx.query(sql.as_str(), &[&now, &batch]).await?;
            let mut due_records = Vec::with_capacity(picked.len());
            for row in &picked {
                match row.scope_digest().map(|key| (key, LoadedRecord::read(row))) {
                    Ok((key, Ok(loaded))) => due_records.push((key, loaded)),
                    Ok((key, Err(e))) => report.leave_unreadable(e, Some(&key))?,
                    Err(e) => report.leave_unreadable(e, None)?,
                }
            }
            // The picked records' effects are carried out together: their
            // statements are pipelined on the transaction's connection, so
            // a batch waits for the database's work, not for a round trip
            // per statement (which, on a busy server, is a wait for a core).
            let seal = &self.seal;
            let carried = due_records.iter().map(|(key, loaded)| async move {
                carry_out(tx, (key, seal), effects::sweep(Some(loaded), due, now), now).await
            });
            for (swept, written) in try_join_all(carried).await? {
                events.extend(written);
                if let Some(swept) = swept {
                    swept.count(report);
                }
            }
        }
        match phase {
            SweepPhase::Abandoned => {
                // Abandoned attempts whose claims can no longer land.
                let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
                tx.execute(FORGET_ABANDONED.postgres(), &[&forget]).await?;
            }
            SweepPhase::Purge => {
                // Past the audit retention: archived generations, history, events.
                let cutoff = now.saturating_sub(i64_from(policy.audit_retention_ms));
                let params: [Param<'_>; 2] = [&cutoff, &batch];
                for sql in [&PURGE_ARCHIVED, &PURGE_HISTORY] {
                    let stmt = tx.prepare(sql.as_str()).await?;
                    let row = tx.one(&stmt, &params).await?;
                    report.purged += row.unsigned("generations")?;
                    report.events_purged += row.unsigned("events")?;
                }
                report.events_purged += tx.execute(PURGE_EVENTS, &params).await?;
                tx.execute(PURGE_EVENTLESS_GENERATIONS, &[]).await?;
            }
            SweepPhase::Leases | SweepPhase::Archive => {}
        }
        Ok(())
    }
}

async fn savepoint(tx: &Tx<'_>, sql: &str) -> Result<()> {
    tx.batch(sql).await.map_err(unavailable)
}
