//! What the driver's and the pool's errors mean to the store: an outage of
//! the database or a timeout, described by the server's own message.

use crate::backend::{Outage, StoreError};

pub(super) trait Described {
    fn describe(&self) -> String;
    /// Whether it is the server's or the pool's limit that ran out.
    fn outage(&self) -> Outage;
}

impl Described for tokio_postgres::Error {
    /// The server's own message, or the cause of a failed connection (a
    /// refused certificate, say); `Display` only says "db error" or "error
    /// performing TLS handshake".
    fn describe(&self) -> String {
        match (self.as_db_error(), std::error::Error::source(self)) {
            (Some(db), _) => format!("{} ({})", db.message(), db.code().code()),
            (None, Some(cause)) => format!("{self}: {cause}"),
            (None, None) => self.to_string(),
        }
    }

    fn outage(&self) -> Outage {
        // 57014: query_canceled, which statement_timeout raises.
        match self.code() {
            Some(code) if code.code() == "57014" => Outage::Timeout,
            _ => Outage::Database,
        }
    }
}

impl Described for deadpool_postgres::PoolError {
    fn describe(&self) -> String {
        match self {
            deadpool_postgres::PoolError::Backend(e) => e.describe(),
            other => other.to_string(),
        }
    }

    fn outage(&self) -> Outage {
        match self {
            deadpool_postgres::PoolError::Backend(e) => e.outage(),
            deadpool_postgres::PoolError::Timeout(_) => Outage::Timeout,
            _ => Outage::Database,
        }
    }
}

pub(super) fn unavailable(e: impl Described) -> StoreError {
    StoreError::unavailable(e.outage(), e.describe())
}
