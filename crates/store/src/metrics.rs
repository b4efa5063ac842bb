//! Prometheus metrics at `/metrics`.

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

use crate::backend::{ClaimOutcome, SweepReport};
use crate::AppState;

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
    pub oldest_in_progress_seconds: Gauge<f64, AtomicU64>,
    pub sweeper_runs: Counter,
    pub sweeper_rows: Family<ActionLabel, Counter>,
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
        let claim_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let oldest = Gauge::<f64, AtomicU64>::default();
        let sweeper_runs = Counter::default();
        let sweeper_rows = Family::<ActionLabel, Counter>::default();
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
        registry.register("sweeper_runs", "Sweeper passes", sweeper_runs.clone());
        registry.register(
            "sweeper_rows",
            "Rows changed by the sweeper, by action",
            sweeper_rows.clone(),
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
            sweeper_runs,
            sweeper_rows,
        }
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

    pub fn observe_sweep(&self, report: &SweepReport) {
        self.sweeper_runs.inc();
        for (action, n) in [
            ("marked_unknown", report.marked_unknown),
            ("released", report.released),
            ("abandoned", report.abandoned),
            ("archived", report.archived),
            ("purged", report.purged),
            ("events_purged", report.events_purged),
        ] {
            self.sweeper_rows.get_or_create(&ActionLabel { action }).inc_by(n);
        }
        self.unknown_records.inc_by(report.marked_unknown);
        self.abandoned_claims.inc_by(report.abandoned);
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
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.store.metrics.render(),
    )
        .into_response()
}
