//! The background job: leases that ran out become unknown (or are released),
//! expired records are archived, archived records are purged after the audit
//! retention. It works in batches so no transaction holds the writer long, and
//! it is the only thing that scans; the request path never does.

use std::time::Duration;

use crate::backend::{Result, SweepPolicy, SweepReport};
use crate::service::Store;

#[derive(Debug, Clone)]
pub struct SweepSettings {
    pub enabled: bool,
    pub interval: Duration,
    pub batch: u32,
    pub audit_retention_ms: u64,
}

impl SweepSettings {
    /// What each of its passes does.
    pub fn policy(&self) -> SweepPolicy {
        SweepPolicy {
            batch: self.batch,
            audit_retention_ms: self.audit_retention_ms,
        }
    }
}

pub const DEFAULT_AUDIT_RETENTION_MS: u64 = 30 * 24 * 60 * 60 * 1000;

impl Default for SweepSettings {
    fn default() -> Self {
        SweepSettings {
            enabled: true,
            interval: Duration::from_secs(1),
            batch: 500,
            audit_retention_ms: DEFAULT_AUDIT_RETENTION_MS,
        }
    }
}

/// Batches until a pass changes fewer rows than a full batch (at most 100
/// batches, so one call stays bounded), updating the metrics: a pass that
/// fails, or one of whose phases failed, is counted; one that finishes
/// whole sets the time of the last success.
pub async fn sweep_all(store: &Store, policy: &SweepPolicy) -> Result<SweepReport> {
    let pass = sweep_pass(store, policy).await;
    match &pass {
        Ok(report) if report.failed_phases == 0 => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            store.metrics.sweeper_last_success.set(now);
        }
        _ => {
            store.metrics.sweeper_errors.inc();
        }
    }
    pass
}

async fn sweep_pass(store: &Store, policy: &SweepPolicy) -> Result<SweepReport> {
    let mut total = SweepReport::default();
    for _ in 0..100 {
        let report = store.backend.sweep(store.clock.now(), policy).await?;
        store.metrics.observe_sweep(&report);
        total.add(report);
        if !report.full(policy.batch) {
            break;
        }
    }
    if total.total() > 0 {
        store.notify_changed();
    }
    let open = store.backend.open_records().await?;
    store.metrics.observe_open(&open, store.clock.now());
    Ok(total)
}

pub async fn run(store: Store, settings: SweepSettings, mut stop: tokio::sync::watch::Receiver<bool>) {
    let policy = settings.policy();
    loop {
        match sweep_all(&store, &policy).await {
            Ok(report) if report.total() + report.unreadable + report.failed_phases > 0 => {
                tracing::info!(?report, "sweeper pass")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "sweeper pass failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.interval) => {}
            _ = stop.changed() => return,
        }
    }
}
