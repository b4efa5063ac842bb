//! The store's one error type. Every module that can fail returns it, so it
//! sits below all of them and imports nothing of the store.

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
