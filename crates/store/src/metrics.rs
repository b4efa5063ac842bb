//! Prometheus metrics at `/metrics`, prefix `idemgate_store_`: counters end
//! in `_total`, times in `_seconds`. Every labelled series the alert rules
//! and the dashboard read (`examples/monitoring/`) exists from the start, at
//! 0, so their rates and ratios have data before the first event. Pool
//! gauges are read from the backend when scraped.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use idemgate_core::protocol::ClaimReply;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::backend::{ClaimOutcome, OpenRecords, PoolStats, SweepReport, WriterStages};
use crate::AppState;

/// Every outcome a claim is counted under.
const CLAIM_OUTCOMES: [&str; 7] = [
    "owned",
    "replay",
    "result_unavailable",
    "in_progress",
    "mismatch",
    "unknown",
    "expired",
];

/// Every call of the filter's API, as the error counters name it.
pub const CALLS: [&str; 5] = ["claim", "complete", "release", "mark_unknown", "abandon"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabel {
    pub call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
    pub backend: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub claims: Family<OutcomeLabel, Counter>,
    pub replays: Counter,
    pub conflicts: Counter,
    pub mismatches: Counter,
    pub unknown_records: Counter,
    pub stale_fences: Counter,
    pub late_claims: Counter,
    pub abandoned_claims: Counter,
    pub rate_limited_claims: Counter,
    pub claim_seconds: Histogram,
    oldest_in_progress_seconds: Gauge<f64, AtomicU64>,
    unknown_open: Gauge,
    oldest_unknown_seconds: Gauge<f64, AtomicU64>,
    pub sweeper_runs: Counter,
    pub sweeper_rows: Family<ActionLabel, Counter>,
    pub sweeper_errors: Counter,
    /// Due records the sweeper could not read and left as they are.
    sweeper_unreadable: Counter,
    /// Unix time of the last sweeper pass that finished.
    pub sweeper_last_success: Gauge<f64, AtomicU64>,
    /// Calls the backend failed (database unreachable or refusing), by call.
    pub call_errors: Family<CallLabel, Counter>,
    build_info: Family<BuildLabels, Gauge>,
    pool_connections: Gauge,
    pool_max_connections: Gauge,
    pool_available_connections: Gauge,
    pool_waiting: Gauge,
    writer_queue: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("idemgate_store");
        let claims = Family::<OutcomeLabel, Counter>::default();
        let replays = Counter::default();
        let conflicts = Counter::default();
        let mismatches = Counter::default();
        let unknown_records = Counter::default();
        let stale_fences = Counter::default();
        let late_claims = Counter::default();
        let abandoned_claims = Counter::default();
        let rate_limited_claims = Counter::default();
        // 62.5 µs (about a durable commit on a fast disk) to about 16 s.
        let claim_seconds = Histogram::new(exponential_buckets(0.000_062_5, 2.0, 19));
        let oldest = Gauge::<f64, AtomicU64>::default();
        let unknown_open = Gauge::default();
        let oldest_unknown = Gauge::<f64, AtomicU64>::default();
        let sweeper_runs = Counter::default();
        let sweeper_rows = Family::<ActionLabel, Counter>::default();
        let sweeper_errors = Counter::default();
        let sweeper_unreadable = Counter::default();
        let sweeper_last_success = Gauge::<f64, AtomicU64>::default();
        let call_errors = Family::<CallLabel, Counter>::default();
        let build_info = Family::<BuildLabels, Gauge>::default();
        let pool_connections = Gauge::default();
        let pool_max_connections = Gauge::default();
        let pool_available_connections = Gauge::default();
        let pool_waiting = Gauge::default();
        let writer_queue = Gauge::default();
        // Each series created at 0.
        for outcome in CLAIM_OUTCOMES {
            claims.get_or_create(&OutcomeLabel { outcome }).inc_by(0);
        }
        for call in CALLS {
            call_errors.get_or_create(&CallLabel { call }).inc_by(0);
        }
        for (action, _) in SweepReport::default().actions() {
            sweeper_rows.get_or_create(&ActionLabel { action }).inc_by(0);
        }
        registry.register(
            "build_info",
            "Always 1: the store's version and backend",
            build_info.clone(),
        );
        registry.register("claims", "Claims answered, by outcome", claims.clone());
        registry.register("replays", "Stored responses served again", replays.clone());
        registry.register(
            "conflicts",
            "Claims answered in_progress (409)",
            conflicts.clone(),
        );
        registry.register(
            "mismatches",
            "Claims with the same key but another fingerprint (422)",
            mismatches.clone(),
        );
        registry.register(
            "unknown_records",
            "Records that became unknown",
            unknown_records.clone(),
        );
        registry.register(
            "stale_fences",
            "Complete/release/mark-unknown calls refused for a superseded fence",
            stale_fences.clone(),
        );
        registry.register(
            "late_claims",
            "Claims not committed because their caller's deadline had passed",
            late_claims.clone(),
        );
        registry.register(
            "abandoned_claims",
            "Claims their filter gave up before forwarding, released",
            abandoned_claims.clone(),
        );
        registry.register(
            "rate_limited_claims",
            "Claims of new keys refused because their tenant's budget was spent (429)",
            rate_limited_claims.clone(),
        );
        registry.register(
            "claim_duration_seconds",
            "Time to answer a claim, waiting included",
            claim_seconds.clone(),
        );
        registry.register(
            "oldest_in_progress_age_seconds",
            "Age of the oldest in-progress record (sampled by the sweeper)",
            oldest.clone(),
        );
        registry.register(
            "unknown_records_open",
            "Unknown records not yet resolved or archived: each waits for an operator (sampled by the sweeper)",
            unknown_open.clone(),
        );
        registry.register(
            "oldest_unknown_age_seconds",
            "Age of the oldest unknown record not yet resolved or archived (sampled by the sweeper)",
            oldest_unknown.clone(),
        );
        registry.register("sweeper_runs", "Sweeper passes", sweeper_runs.clone());
        registry.register(
            "sweeper_rows",
            "Rows changed by the sweeper, by action",
            sweeper_rows.clone(),
        );
        registry.register(
            "sweeper_errors",
            "Sweeper passes that failed, or one of whose phases failed (the database could not be reached or refused)",
            sweeper_errors.clone(),
        );
        registry.register(
            "sweeper_unreadable_records",
            "Due records the sweeper could not read (a damaged row) and left as they are, each time it met one",
            sweeper_unreadable.clone(),
        );
        registry.register(
            "sweeper_last_success_timestamp_seconds",
            "Unix time of the last sweeper pass that finished (0: none yet)",
            sweeper_last_success.clone(),
        );
        registry.register(
            "call_errors",
            "Calls of the filter's API the database failed (unreachable, refusing), by call",
            call_errors.clone(),
        );
        registry.register(
            "pool_connections",
            "Database connections open (SQLite: reader connections; the writer is one more)",
            pool_connections.clone(),
        );
        registry.register(
            "pool_max_connections",
            "Most database connections the pool opens",
            pool_max_connections.clone(),
        );
        registry.register(
            "pool_available_connections",
            "Database connections open and idle",
            pool_available_connections.clone(),
        );
        registry.register(
            "pool_waiting",
            "Calls waiting for a database connection",
            pool_waiting.clone(),
        );
        registry.register(
            "sqlite_writer_queue",
            "Writes queued for SQLite's writer thread, not yet in a transaction (0 on PostgreSQL)",
            writer_queue.clone(),
        );
        Metrics {
            registry,
            claims,
            replays,
            conflicts,
            mismatches,
            unknown_records,
            stale_fences,
            late_claims,
            abandoned_claims,
            rate_limited_claims,
            claim_seconds,
            oldest_in_progress_seconds: oldest,
            unknown_open,
            oldest_unknown_seconds: oldest_unknown,
            sweeper_runs,
            sweeper_rows,
            sweeper_errors,
            sweeper_unreadable,
            sweeper_last_success,
            call_errors,
            build_info,
            pool_connections,
            pool_max_connections,
            pool_available_connections,
            pool_waiting,
            writer_queue,
        }
    }

    /// Sets `build_info{version, backend}` to 1.
    pub fn build(&self, backend: &'static str) {
        self.build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                backend,
            })
            .set(1);
    }

    /// Registers the backend's write stage timers and commit counters, if it
    /// keeps them.
    pub fn writer_stages(&mut self, stages: Option<WriterStages>) {
        let Some(stages) = stages else { return };
        for (name, help, h) in [
            (
                "write_queued_seconds",
                "Time a write waited before its transaction began",
                stages.queued,
            ),
            (
                "write_transaction_seconds",
                "Time a group commit's writes took, up to its commit",
                stages.transaction,
            ),
            (
                "write_commit_seconds",
                "Time a group commit's commit took, the sync to disk included",
                stages.commit,
            ),
            (
                "write_answered_seconds",
                "Time from a write's commit to its caller holding the answer",
                stages.answered,
            ),
        ] {
            self.registry.register(name, help, h);
        }
        for (name, help, c) in [
            ("write_commits", "Transactions the writer committed", stages.commits),
            (
                "write_durable_commits",
                "Of the writer's commits, the ones synced to disk before anyone was answered",
                stages.durable_commits,
            ),
            (
                "wal_checkpoints",
                "WAL checkpoints run, off the writer's commits (each syncs the WAL and the database file when it copies anything)",
                stages.checkpoints,
            ),
        ] {
            self.registry.register(name, help, c);
        }
    }

    /// A call of the filter's API the backend failed.
    pub fn call_failed(&self, call: &'static str) {
        self.call_errors.get_or_create(&CallLabel { call }).inc();
    }

    pub fn observe_pool(&self, pool: PoolStats) {
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.pool_connections.set(g(pool.size));
        self.pool_max_connections.set(g(pool.max_size));
        self.pool_available_connections.set(g(pool.available));
        self.pool_waiting.set(g(pool.waiting));
        self.writer_queue.set(g(pool.writer_queue.unwrap_or(0)));
    }

    pub fn observe_claim(&self, outcome: &ClaimOutcome, took: Duration) {
        let label = match outcome.reply {
            ClaimReply::Owned { .. } => "owned",
            ClaimReply::Replay { .. } => {
                self.replays.inc();
                "replay"
            }
            ClaimReply::ResultUnavailable { .. } => "result_unavailable",
            ClaimReply::InProgress { .. } => {
                self.conflicts.inc();
                "in_progress"
            }
            ClaimReply::Mismatch => {
                self.mismatches.inc();
                "mismatch"
            }
            ClaimReply::Unknown => "unknown",
            ClaimReply::Expired { .. } => "expired",
        };
        if outcome.became_unknown {
            self.unknown_records.inc();
        }
        self.claims.get_or_create(&OutcomeLabel { outcome: label }).inc();
        self.claim_seconds.observe(took.as_secs_f64());
    }

    /// What the sweeper sampled of the records at `now`.
    pub fn observe_open(&self, open: &OpenRecords, now: i64) {
        let age = |t: Option<i64>| t.map_or(0.0, |t| now.saturating_sub(t).max(0) as f64 / 1000.0);
        self.oldest_in_progress_seconds.set(age(open.oldest_in_progress));
        self.unknown_open
            .set(i64::try_from(open.unknown).unwrap_or(i64::MAX));
        self.oldest_unknown_seconds.set(age(open.oldest_unknown));
    }

    pub fn observe_sweep(&self, report: &SweepReport) {
        self.sweeper_runs.inc();
        let mut report = *report;
        for (action, n) in report.actions() {
            self.sweeper_rows
                .get_or_create(&ActionLabel { action })
                .inc_by(*n);
        }
        self.unknown_records.inc_by(report.marked_unknown);
        self.abandoned_claims.inc_by(report.abandoned);
        self.sweeper_unreadable.inc_by(report.unreadable);
    }

    /// What the sweeper has done since the store started: every batch that
    /// committed, also in a pass that failed later.
    pub fn swept(&self) -> SweepReport {
        let mut swept = SweepReport::default();
        for (action, n) in swept.actions() {
            *n = self.sweeper_rows.get_or_create(&ActionLabel { action }).get();
        }
        swept
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

pub async fn serve(State(state): State<AppState>) -> Response {
    let store = &state.store;
    store.metrics.observe_pool(store.backend.pool());
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.store.metrics.render(),
    )
        .into_response()
}
