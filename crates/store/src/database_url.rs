//! The `--database-url`: the backend its scheme names (`sqlite://…`,
//! `postgres://…`), opened with the options the command line gathered, and
//! the URL as logs may show it. It sits above both backends so that the
//! [`Backend`] trait below them never names either.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Result, StoreError};
use crate::log_ids::LogIds;
use crate::sealing::Seal;

/// How to open a backend, beyond what its URL says.
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
