//! What SQLite's errors mean to the store: which of them may have ended
//! the transaction, so that the writer fails its whole batch, and which
//! are an outage of the database. Every file of the backend reads its
//! errors through here.

use crate::backend::{Outage, StoreError};

/// A statement's error as the store's: [`StoreError::TransactionLost`] when
/// it may have ended the transaction ([`ends_transaction`]), which the
/// writer then fails whole.
pub(crate) fn unavailable(e: rusqlite::Error) -> StoreError {
    match ends_transaction(&e) {
        true => StoreError::TransactionLost(std::sync::Arc::new(e)),
        false => StoreError::unavailable(Outage::Database, e),
    }
}

/// Errors after which SQLite may have rolled back the transaction on its
/// own (<https://sqlite.org/lang_transaction.html>, "Response To Errors
/// Within A Transaction"): disk full, I/O error, out of memory, busy; and
/// those that say the file cannot be written at all. After one of them a
/// savepoint cannot be trusted to keep the batch's other jobs: if the
/// transaction is gone, statements after it run in autocommit mode, each
/// committed on its own.
fn ends_transaction(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode::*;
    matches!(
        e.sqlite_error_code(),
        Some(
            DiskFull
                | SystemIoFailure
                | OutOfMemory
                | DatabaseBusy
                | DatabaseLocked
                | ReadOnly
                | DatabaseCorrupt
                | NotADatabase
                | CannotOpen
                | FileLockingProtocolFailed
        )
    )
}
