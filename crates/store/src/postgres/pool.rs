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

use async_trait::async_trait;
use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures_util::TryStreamExt;
use tokio_postgres::types::Type;
use tokio_postgres::{NoTls, Row, Statement};

use super::tls::Transport;

use super::rows::Param;
use crate::backend::{Outage, Result, StoreError};

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

/// What stands between the store and PostgreSQL, which decides how
/// statements and session settings travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooler {
    /// PostgreSQL itself, or a pooler that gives each client a server
    /// session of its own (PgBouncer's `pool_mode = session`): the store's
    /// settings travel in the startup packet and statements are prepared
    /// once per connection.
    #[default]
    Session,
    /// A pooler that hands a server connection to a client for one
    /// transaction at a time (PgBouncer's `pool_mode = transaction`): no
    /// startup options, no named prepared statements, and every statement
    /// runs in a transaction that sets its own `statement_timeout` (`SET
    /// LOCAL`).
    Transaction,
}

/// How the store's sessions are set up, beyond their timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PgSession {
    pub pooler: Pooler,
    /// Every transaction read-only (`inspect`): the server refuses any
    /// write, whatever the role may do.
    pub read_only: bool,
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
    setup: Setup,
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

#[derive(Clone)]
pub(super) struct Connections {
    pool: Pool,
    pub(super) transport: Transport,
    pub(super) timeouts: PgTimeouts,
    pub(super) session: PgSession,
    condemned: Condemned,
}

impl Connections {
    pub(super) fn open(
        url: &str,
        pool_size: usize,
        timeouts: PgTimeouts,
        session: PgSession,
    ) -> Result<Connections> {
        let (mut config, transport) = super::tls::target(url)?;
        if session.pooler == Pooler::Session {
            // Appended, so it wins over a `statement_timeout` in the URL's own
            // `options`: the store's bounds depend on it. Behind a transaction
            // pooler each transaction sets them instead ([`Client::begin`]).
            // JIT off: the server compiles a statement when its plan's
            // estimated cost is high, and a sweeper's pick that expects few
            // rows is costed as a walk of its whole index range. Under load
            // the compiling alone took 300-480 ms: a pick that read three
            // pages ran into the statement timeout on every pass.
            let mut options = format!(
                "{} -c statement_timeout={} -c jit=off",
                config.get_options().unwrap_or_default(),
                timeouts.statement.as_millis()
            );
            if session.read_only {
                options.push_str(" -c default_transaction_read_only=on");
            }
            config.options(options.trim_start());
        }
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
            session,
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
            setup: Setup {
                session: self.session,
                statement: self.timeouts.statement,
            },
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
            Err(StoreError::unavailable(
                Outage::Timeout,
                format!("postgres did not answer within {} ms", limit.as_millis()),
            ))
        })
    }

    /// One statement on a pooled connection, its own transaction.
    pub(super) async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        self.bounded(async { self.client().await?.query(sql, params).await })
            .await
    }
}

/// How a session was set up: what each transaction sets itself behind a
/// transaction pooler.
#[derive(Debug, Clone, Copy)]
pub(super) struct Setup {
    session: PgSession,
    statement: Duration,
}

impl Setup {
    /// What opens a statement's own transaction behind a transaction
    /// pooler, with the session's settings made local to it.
    fn begin_sql(&self) -> String {
        format!(
            "BEGIN{}; {}",
            if self.session.read_only { " READ ONLY" } else { "" },
            self.local_settings()
        )
    }

    fn local_settings(&self) -> String {
        format!(
            "SET LOCAL statement_timeout = {}; SET LOCAL jit = off",
            self.statement.as_millis()
        )
    }
}

impl Client {
    /// A transaction on this connection. Behind a transaction pooler it
    /// sets the store's session settings itself (`SET LOCAL`): the session
    /// does not carry them.
    pub(super) async fn begin(&mut self) -> Result<Tx<'_>> {
        let setup = self.setup;
        let tx = self
            .object
            .build_transaction()
            .read_only(setup.session.read_only)
            .start()
            .await
            .map_err(unavailable)?;
        if setup.session.pooler == Pooler::Transaction {
            tx.batch_execute(&setup.local_settings())
                .await
                .map_err(unavailable)?;
        }
        Ok(Tx { tx, setup })
    }
}

/// A transaction on a pooled connection.
pub(super) struct Tx<'a> {
    tx: deadpool_postgres::Transaction<'a>,
    setup: Setup,
}

impl Tx<'_> {
    pub(super) async fn commit(self) -> Result<()> {
        self.tx.commit().await.map_err(unavailable)
    }
}

impl<'a> std::ops::Deref for Tx<'a> {
    type Target = deadpool_postgres::Transaction<'a>;
    fn deref(&self) -> &deadpool_postgres::Transaction<'a> {
        &self.tx
    }
}

/// A statement ready to run on one connection: prepared there (named,
/// cached with the connection), or its text, sent unnamed with its
/// parameters' types each time. A transaction pooler hands each
/// transaction whichever server connection is free: a statement prepared
/// by name on one is unknown to the next, and its name may already be
/// taken there by another client's.
pub(super) enum Stmt<'s> {
    Prepared(Statement),
    Text(&'s str),
}

type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;

/// Where statements run: a pooled connection (each statement its own
/// transaction) or a transaction on one.
#[async_trait]
pub(super) trait On: Send + Sync {
    fn setup(&self) -> Setup;
    /// Whether each statement commits on its own here.
    fn autocommit(&self) -> bool;
    async fn prepare_named(&self, sql: &str) -> PgResult<Statement>;
    async fn run_prepared(&self, stmt: &Statement, params: &[Param<'_>]) -> PgResult<(Vec<Row>, u64)>;
    async fn run_typed(&self, sql: &str, params: &[(Param<'_>, Type)]) -> PgResult<(Vec<Row>, u64)>;
    async fn batch(&self, sql: &str) -> PgResult<()>;

    /// `sql` made ready to run here, as many times as wanted: prepared
    /// once (cached with the connection), or, behind a transaction pooler,
    /// kept as text and sent unnamed each time.
    async fn prepare<'s>(&self, sql: &'s str) -> Result<Stmt<'s>> {
        match self.setup().session.pooler {
            Pooler::Session => self
                .prepare_named(sql)
                .await
                .map(Stmt::Prepared)
                .map_err(unavailable),
            Pooler::Transaction => Ok(Stmt::Text(sql)),
        }
    }

    /// The rows `stmt` returns, and how many it changed. On a connection
    /// (not in a transaction) behind a transaction pooler, it runs in a
    /// transaction of its own that bounds it (`SET LOCAL
    /// statement_timeout`), sent together with it: one round trip, as
    /// without the pooler.
    async fn run(&self, stmt: &Stmt<'_>, params: &[Param<'_>]) -> Result<(Vec<Row>, u64)> {
        let sql = match stmt {
            Stmt::Prepared(stmt) => return self.run_prepared(stmt, params).await.map_err(unavailable),
            Stmt::Text(sql) => sql,
        };
        let typed = typed(params)?;
        if !self.autocommit() {
            return self.run_typed(sql, &typed).await.map_err(unavailable);
        }
        // Sent at once, in this order; the pooler takes the server
        // connection back after COMMIT. A failed statement leaves the
        // transaction aborted, and COMMIT then rolls it back.
        let begin = self.setup().begin_sql();
        let (begun, ran, committed) = futures_util::future::join3(
            self.batch(&begin),
            self.run_typed(sql, &typed),
            self.batch("COMMIT"),
        )
        .await;
        begun.map_err(unavailable)?;
        let ran = ran.map_err(unavailable)?;
        committed.map_err(unavailable)?;
        Ok(ran)
    }

    /// The rows `stmt` returns.
    async fn rows(&self, stmt: &Stmt<'_>, params: &[Param<'_>]) -> Result<Vec<Row>> {
        self.run(stmt, params).await.map(|(rows, _)| rows)
    }

    /// The one row `stmt` returns, if any.
    async fn opt(&self, stmt: &Stmt<'_>, params: &[Param<'_>]) -> Result<Option<Row>> {
        let mut rows = self.rows(stmt, params).await?;
        if rows.len() > 1 {
            return Err(StoreError::Corrupt(format!(
                "{} rows where at most one was expected",
                rows.len()
            )));
        }
        Ok(rows.pop())
    }

    /// The one row `stmt` returns.
    async fn one(&self, stmt: &Stmt<'_>, params: &[Param<'_>]) -> Result<Row> {
        self.opt(stmt, params)
            .await?
            .ok_or_else(|| StoreError::Corrupt("no row where one was expected".into()))
    }

    /// The rows `sql` returns.
    async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>> {
        let stmt = self.prepare(sql).await?;
        self.rows(&stmt, params).await
    }

    /// How many rows `sql` changed.
    async fn execute(&self, sql: &str, params: &[Param<'_>]) -> Result<u64> {
        let stmt = self.prepare(sql).await?;
        self.run(&stmt, params).await.map(|(_, changed)| changed)
    }
}

/// Every row of `stream`, and how many the statement changed.
async fn drain(stream: tokio_postgres::RowStream) -> PgResult<(Vec<Row>, u64)> {
    let mut stream = std::pin::pin!(stream);
    let mut rows = Vec::new();
    while let Some(row) = stream.try_next().await? {
        rows.push(row);
    }
    let changed = stream.rows_affected().unwrap_or(0);
    Ok((rows, changed))
}

macro_rules! on {
    ($ty:ty, $autocommit:expr, $inner:ident, $cached:ty, $pg:ty) => {
        #[async_trait]
        impl On for $ty {
            fn setup(&self) -> Setup {
                self.setup
            }
            fn autocommit(&self) -> bool {
                $autocommit
            }
            async fn prepare_named(&self, sql: &str) -> PgResult<Statement> {
                <$cached>::prepare_cached(&self.$inner, sql).await
            }
            async fn run_prepared(
                &self,
                stmt: &Statement,
                params: &[Param<'_>],
            ) -> PgResult<(Vec<Row>, u64)> {
                drain(<$pg>::query_raw(&self.$inner, stmt, params.iter().copied()).await?).await
            }
            async fn run_typed(&self, sql: &str, params: &[(Param<'_>, Type)]) -> PgResult<(Vec<Row>, u64)> {
                let params = params.iter().map(|(p, t)| (*p, t.clone()));
                drain(<$pg>::query_typed_raw(&self.$inner, sql, params).await?).await
            }
            async fn batch(&self, sql: &str) -> PgResult<()> {
                <$pg>::batch_execute(&self.$inner, sql).await
            }
        }
    };
}

on!(
    Client,
    true,
    object,
    deadpool_postgres::ClientWrapper,
    tokio_postgres::Client
);
on!(
    Tx<'_>,
    false,
    tx,
    deadpool_postgres::Transaction<'_>,
    tokio_postgres::Transaction<'_>
);

/// The types a statement's parameters are sent as when it is not
/// prepared: the first of these each value can be written as (a Rust
/// `i64` as `int8`, `&str` as `text`, `Vec<&[u8]>` as `bytea[]`, ...).
const CANDIDATES: &[Type] = &[
    Type::INT8,
    Type::INT4,
    Type::INT2,
    Type::BOOL,
    Type::TEXT,
    Type::BYTEA,
    Type::FLOAT8,
    Type::JSONB,
    Type::INT8_ARRAY,
    Type::INT4_ARRAY,
    Type::BOOL_ARRAY,
    Type::TEXT_ARRAY,
    Type::BYTEA_ARRAY,
];

/// `params`, each with the type it is sent as (see [`CANDIDATES`]).
fn typed<'p>(params: &[Param<'p>]) -> Result<Vec<(Param<'p>, Type)>> {
    let mut scratch = bytes::BytesMut::new();
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            CANDIDATES
                .iter()
                .find(|ty| {
                    scratch.clear();
                    p.to_sql_checked(ty, &mut scratch).is_ok()
                })
                .map(|ty| (*p, ty.clone()))
                .ok_or_else(|| StoreError::Corrupt(format!("parameter ${} has no type to send it as", i + 1)))
        })
        .collect()
}
