//! One storage trait, two implementations chosen by URL scheme
//! (`sqlite://…`, `postgres://…`), each with its own migrations.

use std::sync::Arc;

use async_trait::async_trait;
use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use idemgate_core::scope::{Namespace, Scope};
use idemgate_core::trace::Trace;
use serde::{Deserialize, Serialize};

use crate::log_ids::LogIds;
use crate::sealing::Seal;

#[derive(Debug, Clone)]
pub enum StoreError {
    /// The database could not be reached or refused the operation.
    Unavailable(String),
    /// A write failed in a way that may have ended the transaction it ran
    /// in (SQLite: disk full, I/O error, busy; see `sqlite::engine`): every
    /// write of that transaction is in doubt, not only this one. Only
    /// SQLite's writer sees it, and fails the whole batch; its callers get
    /// [`StoreError::Unavailable`].
    TransactionLost(String),
    /// A row that does not satisfy the schema's promises.
    Corrupt(String),
    /// A bad `--database-url` or similar.
    Config(String),
    /// The claim's caller stopped waiting before the claim could be
    /// committed; nothing was written.
    Late,
    /// The claim would take a new key, and its tenant's budget of new keys
    /// is spent for `retry_after_ms`; nothing was written.
    RateLimited { retry_after_ms: u64 },
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Unavailable(e) | StoreError::TransactionLost(e) => {
                write!(f, "database unavailable: {e}")
            }
            StoreError::Corrupt(e) => write!(f, "unexpected row in the database: {e}"),
            StoreError::Config(e) => write!(f, "{e}"),
            StoreError::Late => f.write_str("the caller's deadline passed before the claim was committed"),
            StoreError::RateLimited { retry_after_ms } => {
                write!(
                    f,
                    "the tenant's budget of new keys is spent for {retry_after_ms} ms"
                )
            }
        }
    }
}

impl std::error::Error for StoreError {}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A claim's verdict plus the stored body for a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    pub reply: ClaimReply,
    pub body: Vec<u8>,
    /// The claim found an expired lease and turned the record `unknown`.
    pub became_unknown: bool,
}

impl ClaimOutcome {
    pub fn answer(reply: ClaimReply) -> ClaimOutcome {
        ClaimOutcome {
            reply,
            body: Vec::new(),
            became_unknown: false,
        }
    }

    /// A completed record served again.
    pub fn replay(
        status: u16,
        headers: Option<Vec<(String, String)>>,
        completed_at: i64,
        body: Vec<u8>,
    ) -> ClaimOutcome {
        ClaimOutcome {
            reply: ClaimReply::Replay {
                status,
                headers: headers.unwrap_or_default(),
                completed_at,
            },
            body,
            became_unknown: false,
        }
    }
}

/// One call of the filter's API, validated, as a backend decides it.
#[derive(Debug, Clone)]
pub enum Call {
    /// `deadline`: the caller stops waiting then (see [`Backend::claim`]).
    Claim {
        req: ClaimRequest,
        deadline: Option<std::time::Instant>,
    },
    /// `body` is stored only when `req.body_stored`.
    Complete {
        req: CompleteRequest,
        body: bytes::Bytes,
    },
    Release(FenceRequest),
    MarkUnknown(FenceRequest),
    Abandon(AbandonRequest),
}

impl Call {
    /// The client request the call serves, named on its event lines.
    pub fn trace(&self) -> &Trace {
        match self {
            Call::Claim { req, .. } => &req.trace,
            Call::Complete { req, .. } => &req.trace,
            Call::Release(req) | Call::MarkUnknown(req) => &req.trace,
            Call::Abandon(req) => &req.trace,
        }
    }
}

/// A call's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Claim(ClaimOutcome),
    /// Complete, release, mark-unknown and abandon.
    Fence(FenceReply),
}

/// Everything stored about a record except its body, for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordInfo {
    pub scope: Scope,
    /// The keyed hash that names this record in logs
    /// ([`crate::log_ids::LogIds`]); filled in by [`KeyHistory::label`] or
    /// [`label_records`] before the record leaves the store.
    pub log_id: String,
    pub state: String,
    pub fingerprint: Option<String>,
    pub fence: u64,
    pub lease_until: i64,
    pub ttl_ms: u64,
    pub on_unknown: OnUnknown,
    pub status: Option<u16>,
    pub headers: Option<Vec<(String, String)>>,
    /// The id of the key that sealed the stored response (headers and
    /// body); `None`: stored in plaintext.
    #[serde(default)]
    pub response_key: Option<String>,
    pub body_stored: bool,
    /// Length of the stored body; `None` once archived (the body is dropped).
    pub body_len: Option<u64>,
    pub created_at: i64,
    pub completed_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub archived_at: Option<i64>,
    pub replay_count: u64,
    /// Names the generation: the fencing token it was claimed with.
    pub generation: u64,
    /// The claim attempt that opened the generation.
    pub attempt: Option<String>,
    /// `None` for the current generation; when it left for the history.
    pub ended_at: Option<i64>,
}

/// Every generation of a key and every event, for operators.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyHistory {
    /// The current generation(s) first, then earlier ones, newest first.
    pub records: Vec<RecordInfo>,
    /// Oldest first.
    pub events: Vec<EventInfo>,
}

/// One transition of a record (see [`idemgate_core::record::Transition`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventInfo {
    pub scope: Scope,
    /// As [`RecordInfo::log_id`].
    pub log_id: String,
    pub generation: u64,
    pub at: i64,
    pub transition: String,
    pub attempt: Option<String>,
    pub fence: u64,
    pub fingerprint: Option<String>,
    pub status: Option<u16>,
    /// `filter` or `sweeper`; for an operator's change, the operator's
    /// identity as the trusted authenticating proxy gave it
    /// (`alice@example.com`), or `cli:NAME` for the name a command-line
    /// operator declared (`--actor`).
    pub actor: String,
    pub detail: Option<String>,
    /// Since the generation was claimed.
    pub duration_ms: i64,
    /// Why an operator made this transition (a resolution's reason); kept in
    /// the history only, never written to the log.
    #[serde(default)]
    pub reason: Option<String>,
}

impl KeyHistory {
    /// Names every record and event as the logs do.
    pub fn label(&mut self, ids: &LogIds) {
        label_records(&mut self.records, ids);
        for e in &mut self.events {
            e.log_id = ids.of(&e.scope);
        }
    }
}

/// Names every record as the logs do.
pub fn label_records(records: &mut [RecordInfo], ids: &LogIds) {
    for r in records {
        r.log_id = ids.of(&r.scope);
    }
}

impl EventInfo {
    /// The event's structured log line: what operators monitor. The record
    /// and the request fingerprint are named by their keyed hashes under
    /// `ids`, never by the bare digests (contract §9); `trace` names the
    /// client request of the call that caused it, as Envoy's access log and
    /// traces do.
    pub fn log(&self, ids: &LogIds, trace: &Trace) {
        let fingerprint = self
            .fingerprint
            .as_deref()
            .map_or_else(|| "-".to_string(), |f| ids.of_fingerprint(f));
        tracing::info!(
            target: "idemgate::events",
            event = %self.transition,
            tenant = %self.scope.tenant(),
            route = %self.scope.route(),
            record = %ids.of(&self.scope),
            generation = self.generation,
            fence = self.fence,
            fingerprint = %fingerprint,
            replayed = false,
            status = self.status.unwrap_or(0),
            duration_ms = self.duration_ms,
            actor = %self.actor,
            detail = self.detail.as_deref().unwrap_or("-"),
            attempt = self.attempt.as_deref().unwrap_or("-"),
            request_id = trace.request_id.as_deref().unwrap_or("-"),
            trace_id = trace.trace_id.as_deref().unwrap_or("-"),
        );
    }
}

/// Who caused a transition. An operator's changes name the operator
/// ([`Resolution::by`]); [`OPERATOR`](actor::OPERATOR) is only what
/// [`Backend::purge`] writes, which the store's own surfaces never call.
pub mod actor {
    pub const FILTER: &str = "filter";
    pub const SWEEPER: &str = "sweeper";
    pub const OPERATOR: &str = "operator";
    /// The names the store writes itself: no operator may take one.
    pub const RESERVED: &[&str] = &[FILTER, SWEEPER, OPERATOR];
    /// What a command-line operator's declared name is written after.
    pub const CLI_PREFIX: &str = "cli:";
}

/// How long an abandon that found no record is remembered: a claim still on
/// its way to the database under that attempt is released by the sweeper
/// when it lands. Claims past their caller's deadline are never committed,
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
    pub by: String,
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
}

impl SweepReport {
    pub fn total(&self) -> u64 {
        self.marked_unknown
            + self.released
            + self.abandoned
            + self.archived
            + self.purged
            + self.events_purged
    }
    pub fn add(&mut self, other: SweepReport) {
        self.marked_unknown += other.marked_unknown;
        self.released += other.released;
        self.abandoned += other.abandoned;
        self.archived += other.archived;
        self.purged += other.purged;
        self.events_purged += other.events_purged;
    }
    /// Whether some phase filled a whole batch (there may be more to do).
    pub fn full(&self, batch: u32) -> bool {
        let full = u64::from(batch);
        [
            self.marked_unknown,
            self.released,
            self.abandoned,
            self.archived,
            self.purged,
            self.events_purged,
        ]
        .iter()
        .any(|n| *n >= full)
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
    /// What the claim would answer without writing anything: `None` when it
    /// would take the key (a new record or generation) or change the record
    /// (turn an expired lease unknown). A replay it answers is counted like
    /// any other.
    async fn peek(&self, req: &ClaimRequest, now: i64) -> Result<Option<ClaimOutcome>>;
    async fn complete(&self, req: &CompleteRequest, body: &[u8], now: i64) -> Result<FenceReply>;
    async fn release(&self, req: &FenceRequest, now: i64) -> Result<FenceReply>;
    async fn mark_unknown(&self, req: &FenceRequest, now: i64) -> Result<FenceReply>;
    /// Releases the record if it is still open under this attempt; if the
    /// attempt holds no record, remembers it so the sweeper releases a claim
    /// of it that lands later (`record::decide_abandon`).
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
    /// Carries out an operator's decision ([`plan::resolve`](crate::plan::resolve)):
    /// `false` when there is no record it applies to (an open one to
    /// complete or release, any current one to purge). `reason`, the
    /// operator's why, and `how.by`, who decided, are kept in the event.
    async fn resolve(&self, scope: &Scope, how: &Resolution, reason: Option<&str>, now: i64) -> Result<bool>;
    /// Ends the current generation whatever its state, as
    /// [`Action::Purge`] does but with neither a reason nor an operator's
    /// name (the actor is `operator`); `false` when there was none. The
    /// store's surfaces purge through [`Backend::resolve`].
    async fn purge(&self, scope: &Scope, now: i64) -> Result<bool>;
    /// One batch of each sweeper phase: expired leases, abandoned attempts,
    /// archiving, purging what is past the audit retention.
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
            commits: Default::default(),
            durable_commits: Default::default(),
            checkpoints: Default::default(),
        }
    }
}

/// The records that want watching, at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenRecords {
    /// Creation time of the oldest in-progress record.
    pub oldest_in_progress: Option<i64>,
    /// Unknown records not archived: each waits for an operator.
    pub unknown: u64,
    /// Creation time of the oldest of them.
    pub oldest_unknown: Option<i64>,
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

#[derive(Debug, Clone, Default)]
pub struct BackendOptions {
    /// SQLite: `PRAGMA synchronous=FULL` (the default) or `NORMAL`.
    pub sqlite_synchronous_full: Option<bool>,
    /// PostgreSQL: connections in the pool.
    pub pg_pool_size: Option<usize>,
    /// The secret of the log ids; `None`: a random one (ids match nothing
    /// outside this process).
    pub log_ids: Option<LogIds>,
    /// The keys stored responses are sealed with; off: plaintext.
    pub seal: Seal,
    /// PostgreSQL: how long to wait at each step (pool, connect, statement).
    pub pg_timeouts: crate::postgres::PgTimeouts,
}

/// Opens the backend named by the URL's scheme. Does not migrate.
pub async fn open_backend(url: &str, opts: &BackendOptions) -> Result<Arc<dyn Backend>> {
    let log_ids = match &opts.log_ids {
        Some(ids) => ids.clone(),
        None => LogIds::random().map_err(StoreError::Config)?,
    };
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let path = rest.strip_prefix("//").unwrap_or(rest);
        let path = path.split('?').next().unwrap_or("");
        if path.is_empty() {
            return Err(StoreError::Config(
                "the sqlite URL names no file; write sqlite://idempotency.db or sqlite:///var/lib/idemgate/store.db".into(),
            ));
        }
        let backend = crate::sqlite::Sqlite::open(
            path,
            opts.sqlite_synchronous_full.unwrap_or(true),
            log_ids,
            opts.seal.clone(),
        )?;
        Ok(Arc::new(backend))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let backend = crate::postgres::Postgres::connect(
            url,
            opts.pg_pool_size.unwrap_or(16),
            opts.pg_timeouts,
            log_ids,
            opts.seal.clone(),
        )?;
        Ok(Arc::new(backend))
    } else {
        Err(StoreError::Config(
            "unsupported --database-url: use sqlite://FILE or postgres://USER@HOST:PORT/DB".into(),
        ))
    }
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

/// The URL with any password replaced, for logs.
pub fn redact_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        if let Some((creds, host)) = rest.split_once('@') {
            let user = creds.split(':').next().unwrap_or("");
            return format!("{scheme}://{user}:***@{host}");
        }
    }
    url.to_string()
}

/// Bounds the store enforces before anything reaches the database: the
/// same ones the filter's configuration is validated against.
pub use idemgate_core::limits;
