//! The store's one error type. Every module that can fail returns it, so it
//! sits below all of them and imports nothing of the store.

use std::sync::Arc;

/// What went wrong underneath, kept whole for the log; shared, because one
/// failed batch fails each of its calls with it.
pub type Source = Arc<dyn std::error::Error + Send + Sync>;

/// What kept the database from doing what was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// The database failed or refused the statement, or its connection
    /// broke.
    Database,
    /// It did not answer within the store's limit (a statement, a
    /// connection from the pool).
    Timeout,
    /// The store's own machinery around it failed: its writer or
    /// checkpointer thread, a task, sealing, an answer that went missing.
    Internal,
}

impl Outage {
    pub fn as_str(self) -> &'static str {
        match self {
            Outage::Database => "database",
            Outage::Timeout => "timeout",
            Outage::Internal => "internal",
        }
    }
}

#[derive(Debug, Clone)]
pub enum StoreError {
    /// The database could not do what was asked; nothing was decided.
    Unavailable { outage: Outage, source: Source },
    /// A write failed in a way that may have ended the transaction it ran
    /// in (SQLite: disk full, I/O error, busy; see `sqlite::engine`): every
    /// write of that transaction is in doubt, not only this one. Only
    /// SQLite's writer sees it, and fails the whole batch; its callers get
    /// [`StoreError::Unavailable`].
    TransactionLost(Source),
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

impl StoreError {
    pub fn unavailable(
        outage: Outage,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> StoreError {
        StoreError::Unavailable {
            outage,
            source: Arc::from(source.into()),
        }
    }

    /// What kept the database from answering, when that is the error.
    pub fn outage(&self) -> Option<Outage> {
        match self {
            StoreError::Unavailable { outage, .. } => Some(*outage),
            StoreError::TransactionLost(_) => Some(Outage::Database),
            _ => None,
        }
    }

    /// The store failed itself, not the database.
    pub fn internal(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
        StoreError::unavailable(Outage::Internal, why)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Unavailable { source, .. } | StoreError::TransactionLost(source) => {
                write!(f, "database unavailable: {source}")
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

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Unavailable { source, .. } | StoreError::TransactionLost(source) => {
                Some(source.as_ref())
            }
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;
