//! One sweeper pass in one transaction: expired leases, abandoned attempts,
//! archiving, and what is past the audit retention. Rows are picked with
//! `FOR UPDATE SKIP LOCKED`, so replicas sweeping at once share the work.

use std::sync::LazyLock;

use idemgate_core::record::{self, State, Transition};
use tokio_postgres::Row;

use super::generation::{end_generation, event, execute, lock, set_unknown};
use super::pool::unavailable;
use super::rows::{pick, Param};
use super::Postgres;
use crate::backend::{actor, Result, SweepPolicy, SweepReport, ABANDONED_ATTEMPT_MEMORY_MS};
use crate::columns::{i64_from, ColumnReader, ScopeDigest};

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
const PURGE_ARCHIVED: &str = "DELETE FROM idempotency_records WHERE scope_digest IN (SELECT scope_digest \
     FROM idempotency_records WHERE archived_at IS NOT NULL AND archived_at <= $1 ORDER BY archived_at LIMIT $2 \
     FOR UPDATE SKIP LOCKED)";

/// A picked row: its key, and the fence and ttl it was locked with.
struct Picked {
    key: ScopeDigest,
    fence: u64,
    ttl_ms: u64,
}

fn picked(rows: Vec<Row>) -> Result<Vec<Picked>> {
    rows.iter()
        .map(|row| {
            Ok(Picked {
                key: row.scope_digest()?,
                fence: row.unsigned("fence")?,
                ttl_ms: row.unsigned("ttl_ms")?,
            })
        })
        .collect()
}

impl Postgres {
    pub(super) async fn sweep_once(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport> {
        let batch = i64::from(policy.batch);
        let mut report = SweepReport::default();
        let mut client = self.connections.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let mut events = Vec::new();
        let select = |sql: &'static LazyLock<String>| {
            let tx = &tx;
            async move {
                picked(
                    tx.query(sql.as_str(), &[&now, &batch])
                        .await
                        .map_err(unavailable)?,
                )
            }
        };
        // Leases that ran out: released or turned unknown, as the claim's policy said.
        for row in select(&RELEASED_ON_EXPIRY).await? {
            let key = row.key;
            let by = (Transition::LeaseExpired, actor::SWEEPER, Some("released"));
            events.extend(end_generation(&tx, &key, State::InProgress, by, now).await?);
            report.released += 1;
        }
        for row in select(&UNKNOWN_ON_EXPIRY).await? {
            let key = row.key;
            let expires_at = record::unknown_expiry(now, row.ttl_ms);
            set_unknown(&tx, &key, (row.fence, State::InProgress), expires_at).await?;
            let by = (Transition::LeaseExpired, actor::SWEEPER, Some("unknown"));
            events.extend(event(&tx, &key, by, now).await?);
            report.marked_unknown += 1;
        }
        // Claims that landed after their filter had abandoned them.
        for row in select(&LANDED_ABANDONED).await? {
            let key = row.key;
            let Some((loaded, _)) = lock(&tx, &key).await? else {
                continue;
            };
            let by = (Transition::Abandoned, actor::SWEEPER, None);
            events.extend(end_generation(&tx, &key, loaded.view.state, by, now).await?);
            report.abandoned += 1;
        }
        let forget = now.saturating_sub(ABANDONED_ATTEMPT_MEMORY_MS);
        tx.execute("DELETE FROM idempotency_abandoned WHERE at <= $1", &[&forget])
            .await
            .map_err(unavailable)?;
        // Expired records: body dropped, metadata kept.
        for row in select(&EXPIRED).await? {
            let key = row.key;
            let sql = concat!(
                "UPDATE idempotency_records SET archived_at = $2, response_body = NULL WHERE ",
                key_where!()
            );
            execute(&tx, sql, &key, &[&now]).await?;
            events.extend(event(&tx, &key, (Transition::Archived, actor::SWEEPER, None), now).await?);
            report.archived += 1;
        }
        // Past the audit retention: archived generations, history, events.
        let cutoff = now.saturating_sub(i64_from(policy.audit_retention_ms));
        let params: [Param<'_>; 2] = [&cutoff, &batch];
        let delete = |sql: &'static str| {
            let (tx, params) = (&tx, &params);
            async move { tx.execute(sql, params).await.map_err(unavailable) }
        };
        report.purged = delete(PURGE_ARCHIVED).await?
            + delete(
                "DELETE FROM idempotency_history WHERE ctid IN (SELECT ctid FROM idempotency_history \
                 WHERE ended_at <= $1 LIMIT $2)",
            )
            .await?;
        report.events_purged = delete(
            "DELETE FROM idempotency_events WHERE id IN (SELECT id FROM idempotency_events WHERE at <= $1 LIMIT $2)",
        )
        .await?;
        tx.commit().await.map_err(unavailable)?;
        self.log_all(&events);
        Ok(report)
    }
}
