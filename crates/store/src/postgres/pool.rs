//! Connections: the pool, one-statement queries, and errors that carry the
//! server's own message. Nothing here knows what the statements do.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::{NoTls, Row};

use super::tls::Transport;

use super::rows::Param;
use crate::backend::{Result, StoreError};

pub(super) type Tx<'a> = deadpool_postgres::Transaction<'a>;
pub(super) type Client = deadpool_postgres::Object;

pub(super) trait Described {
    fn describe(&self) -> String;
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
}

impl Described for deadpool_postgres::PoolError {
    fn describe(&self) -> String {
        match self {
            deadpool_postgres::PoolError::Backend(e) => e.describe(),
            other => other.to_string(),
        }
    }
}

pub(super) fn unavailable(e: impl Described) -> StoreError {
    StoreError::Unavailable(e.describe())
}

#[derive(Clone)]
pub(super) struct Connections {
    pool: Pool,
    pub(super) transport: Transport,
}

impl Connections {
    pub(super) fn open(url: &str, pool_size: usize) -> Result<Connections> {
        let (config, transport) = super::tls::target(url)?;
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match &transport {
            Transport::Plain => Manager::from_config(config, NoTls, manager_config),
            Transport::Tls(tls) => Manager::from_config(config, tls.clone(), manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .build()
            .map_err(|e| StoreError::Config(format!("postgres pool: {e}")))?;
        Ok(Connections { pool, transport })
    }

    pub(super) fn status(&self) -> deadpool_postgres::Status {
        self.pool.status()
    }

    pub(super) async fn client(&self) -> Result<Client> {
        self.pool.get().await.map_err(unavailable)
    }

    /// One statement on a pooled connection, prepared once per connection.
    pub(super) async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(sql).await.map_err(unavailable)?;
        client.query(&stmt, params).await.map_err(unavailable)
    }
}
