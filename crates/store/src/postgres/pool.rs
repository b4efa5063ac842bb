//! Connections: the pool, one-statement queries, and errors that carry the
//! server's own message. Nothing here knows what the statements do.
//!
//! Every wait is bounded ([`PgTimeouts`]), so a database that is down, slow
//! or unreachable turns into a prompt `Unavailable` (a 503 for the filter)
//! instead of requests piling up: waiting for a pooled connection, opening
//! one, checking one before reuse, and each statement (server side, through
//! `statement_timeout`). A statement the server never hears of (a network
//! that swallows packets) is not bounded by the server: the store's calls are
//! bounded on the client too ([`PgTimeouts::call`]), and a connection held
//! longer than that is closed instead of going back to the pool, so a
//! connection stuck behind a dead network is never handed out again.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{NoTls, Row};

use super::tls::Transport;

use super::rows::Param;
use crate::backend::{Result, StoreError};

pub(super) type Tx<'a> = deadpool_postgres::Transaction<'a>;

/// How long the store waits for PostgreSQL, at each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgTimeouts {
    /// For a pooled connection when all are in use.
    pub wait: Duration,
    /// To open a new connection (TCP, TLS, authentication).
    pub connect: Duration,
    /// To check a pooled connection before it is reused.
    pub recycle: Duration,
    /// Per statement, enforced by the server (`statement_timeout`). Below
    /// the filter's default store timeout (1 s), so a statement the filter
    /// has given up on does not go on holding locks and a connection.
    pub statement: Duration,
}

impl Default for PgTimeouts {
    fn default() -> PgTimeouts {
        PgTimeouts {
            wait: Duration::from_millis(250),
            connect: Duration::from_millis(500),
            recycle: Duration::from_millis(250),
            statement: Duration::from_millis(750),
        }
    }
}

impl PgTimeouts {
    /// The longest a call on the request path may take, client side: a
    /// connection waited for and opened, then statements that the server
    /// bounds. What exceeds it is the network's fault, not a statement's.
    pub fn call(&self) -> Duration {
        self.wait + self.connect + self.statement
    }
}

/// A pooled connection. One held longer than [`PgTimeouts::call`] is closed
/// rather than reused: it was stuck (a network that stopped answering, a
/// call given up on mid-statement) or did long work (a sweep, a migration),
/// and a fresh one costs little next to handing a stuck one to the next
/// request. Such a connection is noted as condemned when let go of, and the
/// pool's check before reuse throws it away.
pub(super) struct Client {
    object: deadpool_postgres::Object,
    taken: Instant,
    limit: Duration,
    condemned: Condemned,
}

/// Pooled connections not to be handed out again, by the address of their
/// statement cache (one per connection, alive as long as it is).
type Condemned = Arc<Mutex<HashSet<usize>>>;

fn identity(client: &deadpool_postgres::ClientWrapper) -> usize {
    Arc::as_ptr(&client.statement_cache) as usize
}

impl std::ops::Deref for Client {
    type Target = deadpool_postgres::Object;
    fn deref(&self) -> &deadpool_postgres::Object {
        &self.object
    }
}

impl std::ops::DerefMut for Client {
    fn deref_mut(&mut self) -> &mut deadpool_postgres::Object {
        &mut self.object
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if self.taken.elapsed() > self.limit {
            let mut condemned = self.condemned.lock().unwrap_or_else(|e| e.into_inner());
            condemned.insert(identity(&self.object));
        }
    }
}

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
    pub(super) timeouts: PgTimeouts,
    condemned: Condemned,
}

impl Connections {
    pub(super) fn open(url: &str, pool_size: usize, timeouts: PgTimeouts) -> Result<Connections> {
        let (mut config, transport) = super::tls::target(url)?;
        // Appended, so it wins over a `statement_timeout` in the URL's own
        // `options`: the store's bounds depend on it.
        let options = format!(
            "{} -c statement_timeout={}",
            config.get_options().unwrap_or_default(),
            timeouts.statement.as_millis()
        );
        config.options(options.trim_start());
        config.connect_timeout(timeouts.connect);
        // tokio-postgres bounds each host's TCP connect by it and tries a
        // multi-host URL's hosts in turn: a primary that is gone (its
        // packets dropped) takes that long before the next host is tried.
        let hosts = config.get_hosts().len().max(config.get_hostaddrs().len()).max(1);
        let timeouts = PgTimeouts {
            connect: timeouts
                .connect
                .saturating_mul(u32::try_from(hosts).unwrap_or(u32::MAX)),
            ..timeouts
        };
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match &transport {
            Transport::Plain => Manager::from_config(config, NoTls, manager_config),
            Transport::Tls(tls) => Manager::from_config(config, tls.clone(), manager_config),
        };
        let condemned = Condemned::default();
        let marked = Arc::clone(&condemned);
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeouts.wait))
            .create_timeout(Some(timeouts.connect))
            .recycle_timeout(Some(timeouts.recycle))
            .pre_recycle(Hook::sync_fn(move |client, _| {
                let mut marked = marked.lock().unwrap_or_else(|e| e.into_inner());
                if marked.remove(&identity(client)) {
                    Err(HookError::message("held past the call timeout"))
                } else {
                    Ok(())
                }
            }))
            .build()
            .map_err(|e| StoreError::Config(format!("postgres pool: {e}")))?;
        Ok(Connections {
            pool,
            transport,
            timeouts,
            condemned,
        })
    }

    pub(super) fn status(&self) -> deadpool_postgres::Status {
        self.pool.status()
    }

    pub(super) async fn client(&self) -> Result<Client> {
        let object = self.pool.get().await.map_err(unavailable)?;
        Ok(Client {
            object,
            taken: Instant::now(),
            limit: self.timeouts.call(),
            condemned: Arc::clone(&self.condemned),
        })
    }

    /// `work` (one call of the request path), given up on once it has taken
    /// longer than [`PgTimeouts::call`].
    pub(super) async fn bounded<T>(&self, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.within(self.timeouts.call(), work).await
    }

    /// `work`, given up on after `limit`.
    pub(super) async fn within<T>(
        &self,
        limit: Duration,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!(
                "postgres did not answer within {} ms",
                limit.as_millis()
            )))
        })
    }

    /// One statement on a pooled connection, prepared once per connection.
    pub(super) async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        self.bounded(async {
            let client = self.client().await?;
            let stmt = client.prepare_cached(sql).await.map_err(unavailable)?;
            client.query(&stmt, params).await.map_err(unavailable)
        })
        .await
    }
}
