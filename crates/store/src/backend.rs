//! The storage trait every backend implements, and the types of its calls
//! and answers. It is the bottom of the backends' stack: it names no
//! backend (the `--database-url` picks SQLite or PostgreSQL in
//! [`crate::database_url`]; the simulation and the tests build the
//! in-memory one, [`crate::memory`], themselves). The
//! types it shares with the column mapping live below both
//! ([`crate::error`], [`crate::calls`], [`crate::records`]) and are
//! re-exported here; the clock reads the database's time through its own
//! [`DatabaseClock`], which every backend is.

use async_trait::async_trait;
use idemgate_core::protocol::{AbandonRequest, ClaimRequest, CompleteRequest, FenceReply, FenceRequest};
use idemgate_core::scope::{Namespace, Scope};
use serde::{Deserialize, Serialize};

pub use crate::calls::{Answer, Call, ClaimOutcome, Peeked};
use crate::clock::DatabaseClock;
pub use crate::error::{Outage, Result, StoreError};
use crate::log_ids::LogIds;
pub use crate::records::{label_records, Actor, EventInfo, KeyHistory, OpenRecords, RecordInfo};
use crate::scope_digest::ScopeDigest;

/// How long an abandon is remembered: a claim still on its way to the
/// database under that attempt (or a copy of one delivered twice) is
/// released by the sweeper when it lands. Claims past their caller's deadline are never committed,
/// so this only has to outlast a claim statement already running.
pub const ABANDONED_ATTEMPT_MEMORY_MS: i64 = 10 * 60 * 1000;

/// Find records by tenant and key; the other components narrow the search.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lookup {
    pub tenant: String,
    pub key: String,
    pub route: Option<String>,
    pub principal: Option<String>,
    pub namespace: Option<Namespace>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    Unknown,
    /// In progress and created more than this many milliseconds ago.
    Stuck {
        older_than_ms: u64,
    },
}

/// What an operator does with a record (the admin API's `action`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Store this response as if the upstream had produced it (an open
    /// record only). The old owner's fencing token is superseded.
    Complete {
        status: u16,
        #[serde(default)]
        headers: Vec<(String, String)>,
        #[serde(default)]
        body: String,
    },
    /// Delete the record so the key can be claimed again (an open record
    /// only).
    Release,
    /// End the current generation whatever its state (it moves to the
    /// history as `purged`, so the key is free). Not an `action` of the
    /// resolve endpoint: the admin API purges at its own path.
    #[serde(skip)]
    Purge,
}

/// An operator's decision about a record, and who made it: `by` is the
/// actor of the event it writes (see [`EventInfo::actor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    pub action: Action,
    pub by: Actor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepPolicy {
    pub batch: u32,
    pub audit_retention_ms: u64,
}

/// Rows touched by one sweep pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepReport {
    pub marked_unknown: u64,
    pub released: u64,
    /// Claims whose filter abandoned them before they landed.
    pub abandoned: u64,
    pub archived: u64,
    /// Generations (current or history) past the audit retention.
    pub purged: u64,
    /// Events past the audit retention.
    pub events_purged: u64,
    /// Due records that could not be read (a damaged row), left as they are.
    pub unreadable: u64,
    /// Phases whose batch failed and was rolled back, each logged with its
    /// error; the other phases' work is kept.
    pub failed_phases: u64,
}

impl SweepReport {
    /// Every action of the sweeper, as its rows counter names it, with its
    /// count: the rows it changed.
    pub fn actions(&mut self) -> [(&'static str, &mut u64); 6] {
        [
            ("marked_unknown", &mut self.marked_unknown),
            ("released", &mut self.released),
            ("abandoned", &mut self.abandoned),
            ("archived", &mut self.archived),
            ("purged", &mut self.purged),
            ("events_purged", &mut self.events_purged),
        ]
    }
    fn counts(mut self) -> [u64; 6] {
        self.actions().map(|(_, n)| *n)
    }
    /// Rows changed.
    pub fn total(&self) -> u64 {
        self.counts().iter().sum()
    }
    pub fn add(&mut self, other: SweepReport) {
        for ((_, n), more) in self.actions().into_iter().zip(other.counts()) {
            *n += more;
        }
        self.unreadable += other.unreadable;
        self.failed_phases += other.failed_phases;
    }
    /// Whether some phase filled a whole batch (there may be more to do).
    pub fn full(&self, batch: u32) -> bool {
        self.counts().iter().any(|n| *n >= u64::from(batch))
    }
    /// A due record the sweeper cannot read is left as it is and counted,
    /// so that one damaged row never stops its phase; any other error does.
    /// `row`: its key, for the operator who repairs or purges it (`None`:
    /// the key itself is what cannot be read).
    pub fn leave_unreadable(&mut self, e: StoreError, row: Option<&ScopeDigest>) -> Result<()> {
        match e {
            StoreError::Corrupt(what) => {
                let scope_digest = row.map_or_else(|| "unreadable".to_string(), ToString::to_string);
                tracing::error!(%what, %scope_digest, "sweeper: a due record cannot be read and is left as it is");
                self.unreadable += 1;
                Ok(())
            }
            e => Err(e),
        }
    }
    /// A phase whose batch failed is rolled back alone (the caller's
    /// savepoint), so that a phase that always fails (a statement always
    /// past the timeout, say) never holds up the others: leases still run
    /// out and records still expire.
    pub fn phase_failed(&mut self, phase: SweepPhase, e: &StoreError) {
        tracing::warn!(phase = phase.name(), error = %e, "sweeper phase failed and was rolled back");
        self.failed_phases += 1;
    }
}

/// A sweeper pass's phases, in the order each batch runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepPhase {
    /// In-progress records whose lease ran out.
    Leases,
    /// Claims that landed after their filter had abandoned them, and
    /// abandoned attempts old enough to forget.
    Abandoned,
    /// Records past their expiry.
    Archive,
    /// What is past the audit retention.
    Purge,
}

impl SweepPhase {
    pub const ALL: [SweepPhase; 4] = [
        SweepPhase::Leases,
        SweepPhase::Abandoned,
        SweepPhase::Archive,
        SweepPhase::Purge,
    ];
    pub fn name(self) -> &'static str {
        match self {
            SweepPhase::Leases => "leases",
            SweepPhase::Abandoned => "abandoned",
            SweepPhase::Archive => "archive",
            SweepPhase::Purge => "purge",
        }
    }
}

/// A storage backend. `now` is always an argument (milliseconds since the
/// epoch) so the story tests drive time by hand.
#[async_trait]
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// How this backend names records in its event log lines.
    fn log_ids(&self) -> &LogIds;
    /// Applies pending migrations; safe to call concurrently from several
    /// processes and on every start.
    async fn migrate(&self) -> Result<()>;
    /// Succeeds when the database answers and the schema is in place.
    async fn ping(&self) -> Result<()>;
    /// The database server's clock (µs since the Unix epoch), when replicas
    /// share one; `None` when the store's own clock is the only one.
    async fn database_now_us(&self) -> Result<Option<i64>> {
        Ok(None)
    }
    /// `deadline`: the caller stops waiting then; a claim that would commit
    /// later fails with [`StoreError::Late`] instead.
    async fn claim(
        &self,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<std::time::Instant>,
    ) -> Result<ClaimOutcome>;
    /// What the claim would do, without writing anything: its answer, or
    /// whether it would take the key (a new record or generation) or only
    /// change the record (turn an expired lease unknown). A replay it
    /// answers is counted like any other.
    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Peeked>;
    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply>;
    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply>;
    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply>;
    /// Releases the record if it is still open under this attempt, and
    /// remembers the attempt so the sweeper releases a claim of it that
    /// lands later (`record::decide_abandon`).
    async fn abandon(&self, req: &AbandonRequest, now: i64) -> Result<FenceReply>;
    /// Decides several calls at once, each on its own: the answer of one
    /// never depends on whether another failed, and one call's failure never
    /// undoes another's changes. A backend may carry them out together (one
    /// SQLite transaction, one PostgreSQL connection); by default they run
    /// concurrently, each as if it came alone.
    async fn decide(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        let each = calls.into_iter().map(|call| async move {
            match call {
                Call::Claim { req, deadline } => self.claim(&req, now, deadline).await.map(Answer::Claim),
                Call::Complete { req, body } => self.complete(&req, &body, now).await.map(Answer::Fence),
                Call::Release(req) => self.release(&req, now).await.map(Answer::Fence),
                Call::MarkUnknown(req) => self.mark_unknown(&req, now).await.map(Answer::Fence),
                Call::Abandon(req) => self.abandon(&req, now).await.map(Answer::Fence),
            }
        });
        futures_util::future::join_all(each).await
    }
    /// Every generation and event of records with this tenant and key.
    async fn lookup(&self, q: &Lookup, limit: u32) -> Result<KeyHistory>;
    async fn list(&self, which: Listing, now: i64, limit: u32) -> Result<Vec<RecordInfo>>;
    /// Carries out an operator's decision ([`effects::resolve`](crate::effects::resolve)):
    /// `false` when there is no record it applies to (an open one to
    /// complete or release, any current one to purge). `reason`, the
    /// operator's why, and `how.by`, who decided, are kept in the event.
    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool>;
    /// One batch of each sweeper phase ([`SweepPhase`]), each rolled back
    /// alone when it fails ([`SweepReport::phase_failed`]); `Err` only when
    /// the batch as a whole could not be committed.
    async fn sweep(&self, now: i64, policy: &SweepPolicy) -> Result<SweepReport>;
    /// The records the monitoring watches (sampled by the sweeper).
    async fn open_records(&self) -> Result<OpenRecords>;
    /// The connections right now, for the metrics (cheap, no I/O).
    fn pool(&self) -> PoolStats {
        PoolStats::default()
    }
    /// Where this backend times the stages of its writes, if it does.
    fn writer_stages(&self) -> Option<WriterStages> {
        None
    }
}

/// A followed clock reads the database's time through any backend.
#[async_trait]
impl DatabaseClock for dyn Backend {
    async fn read_us(&self) -> Result<Option<i64>> {
        self.database_now_us().await
    }
}

/// How long writes spend in each stage of a group commit, in seconds: queued
/// before their transaction began, running in it, and committing it (the
/// sync to disk included). The histograms are shared handles: the backend
/// observes, the metrics render.
#[derive(Clone, Debug)]
pub struct WriterStages {
    /// Per write: from its submission to the start of its transaction.
    pub queued: prometheus_client::metrics::histogram::Histogram,
    /// Per transaction: its writes, up to the commit.
    pub transaction: prometheus_client::metrics::histogram::Histogram,
    /// Per transaction: the commit, durable as asked.
    pub commit: prometheus_client::metrics::histogram::Histogram,
    /// Per write: from its batch's commit to its caller holding the answer
    /// (a thread woken, unless the caller ran the batch itself).
    pub answered: prometheus_client::metrics::histogram::Histogram,
    /// Transactions committed; of those, the ones synced to disk before
    /// anyone was answered; and the WAL checkpoints that ran (each syncs the
    /// WAL and the database file when it copies anything).
    pub commits: prometheus_client::metrics::counter::Counter,
    pub durable_commits: prometheus_client::metrics::counter::Counter,
    pub checkpoints: prometheus_client::metrics::counter::Counter,
}

impl Default for WriterStages {
    fn default() -> WriterStages {
        use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
        // 25 µs to about 0.8 s.
        let h = || Histogram::new(exponential_buckets(0.000_025, 2.0, 16));
        WriterStages {
            queued: h(),
            transaction: h(),
            commit: h(),
            answered: h(),
            commits: Default::default(),
            durable_commits: Default::default(),
            checkpoints: Default::default(),
        }
    }
}

/// A backend's connections at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Connections open (SQLite: its readers; the writer is apart).
    pub size: u64,
    /// Most connections the pool opens.
    pub max_size: u64,
    /// Open and idle.
    pub available: u64,
    /// Calls waiting for a connection.
    pub waiting: u64,
    /// SQLite: jobs queued for the writer thread, not yet in a transaction.
    pub writer_queue: Option<u64>,
}

/// Refuses a database migrated by a newer store: this one would misread
/// its schema. A store is rolled back across a migration only together
/// with the database (docs/operations.md#upgrades).
pub fn known_schema(applied: Option<i64>, known: Option<i64>) -> Result<()> {
    match (applied, known) {
        (Some(applied), Some(known)) if applied > known => Err(StoreError::Config(format!(
            "the database's schema is at version {applied}, newer than this store's {known}: \
             a newer store migrated it; run that version, or restore the database from before the upgrade"
        ))),
        _ => Ok(()),
    }
}

/// Bounds the store enforces before anything reaches the database: the
/// same ones the filter's configuration is validated against.
pub use idemgate_core::limits;
