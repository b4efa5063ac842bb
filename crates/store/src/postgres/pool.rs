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
//!
//! Only a primary is used ([`primary_only`]): a new connection must find its
//! server taking writes (`target_session_attrs=read-write`), and a server
//! that refuses a write later (demoted behind a pooler that kept the
//! connection) has every connection opened before then dropped
//! ([`Demotion`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures_util::TryStreamExt;
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{NoTls, Row, Statement};

use super::tls::Transport;

use super::errors::{unavailable, Described};
use super::rows::{typed, Param};
use super::settings::{primary_only, PgSession, PgTimeouts, Pooler};
use crate::backend::{Outage, Result, StoreError};

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
    demotion: Demotion,
    setup: Setup,
}

/// Pooled connections not to be handed out again, by the address of their
/// statement cache (one per connection, alive as long as it is).
type Condemned = Arc<Mutex<HashSet<usize>>>;

fn identity(client: &deadpool_postgres::ClientWrapper) -> usize {
    Arc::as_ptr(&client.statement_cache) as usize
}

/// When a statement last found its server refusing writes. A server that
/// does so on a connection it accepted as writable has been demoted (a
/// failover behind a pooler, which keeps the store's connections open and
/// hands them the demoted server), or turned read-only: every connection
/// opened before then is dropped at its next checkout rather than failing
/// one write each, and the connections opened instead pass such a server
/// over ([`primary_only`]).
#[derive(Clone, Default)]
pub(super) struct Demotion(Arc<Mutex<Option<Instant>>>);

impl Demotion {
    /// `result`, noted if it says the server refuses writes.
    fn note<T>(&self, result: PgResult<T>) -> PgResult<T> {
        if let Err(e) = &result {
            // 25006: a write in a read-only transaction, which is every
            // transaction on a standby.
            if e.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION) {
                self.now();
            }
        }
        result
    }

    fn now(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// Whether a connection opened at `created` predates the last refusal.
    fn outlived(&self, created: Instant) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|refused| created <= refused)
    }
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

#[derive(Clone)]
pub(super) struct Connections {
    pool: Pool,
    pub(super) transport: Transport,
    pub(super) timeouts: PgTimeouts,
    pub(super) session: PgSession,
    condemned: Condemned,
    demotion: Demotion,
}

impl Connections {
    pub(super) fn open(
        url: &str,
        pool_size: usize,
        timeouts: PgTimeouts,
        session: PgSession,
    ) -> Result<Connections> {
        let (mut config, transport) = super::tls::target(url)?;
        let attrs = primary_only(url, session)?;
        config.target_session_attrs(attrs);
        // tokio-postgres checks `transaction_read_only` once connected, and
        // a read-only session's own default would make every server look
        // like a standby: such a session turns read-only after the check
        // instead (the `post_create` hook below).
        let read_only_after_check = session.read_only && attrs == TargetSessionAttrs::ReadWrite;
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
            if session.read_only && !read_only_after_check {
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
        let demotion = Demotion::default();
        let refused = demotion.clone();
        let mut builder = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeouts.wait))
            .create_timeout(Some(timeouts.connect))
            .recycle_timeout(Some(timeouts.recycle))
            .pre_recycle(Hook::sync_fn(move |client, metrics| {
                let mut marked = marked.lock().unwrap_or_else(|e| e.into_inner());
                let held_too_long = marked.remove(&identity(client));
                if refused.outlived(metrics.created) {
                    tracing::warn!(
                        "postgres: dropping a connection whose server refused a write \
                         (demoted to a standby, or read-only); a new one goes to a primary"
                    );
                    Err(HookError::message("its server refused a write"))
                } else if held_too_long {
                    Err(HookError::message("held past the call timeout"))
                } else {
                    Ok(())
                }
            }));
        // Fences never go back: a new connection may be the first to a
        // restored or promoted database (migration 0009; before it there is
        // no procedure, and nothing to move). A read-only session moves
        // nothing.
        let setup = match (read_only_after_check, session.read_only) {
            (true, _) => Some("SET default_transaction_read_only = on"),
            (false, false) => Some("CALL idempotency_fence_floor()"),
            (false, true) => None,
        };
        builder = builder.post_create(Hook::async_fn(move |client, _| {
            Box::pin(async move {
                let Some(sql) = setup else { return Ok(()) };
                match client.batch_execute(sql).await {
                    Err(e) if e.code() != Some(&SqlState::UNDEFINED_FUNCTION) => {
                        Err(HookError::message(format!("{sql}: {}", e.describe())))
                    }
                    _ => Ok(()),
                }
            })
        }));
        let pool = builder
            .build()
            .map_err(|e| StoreError::Config(format!("postgres pool: {e}")))?;
        Ok(Connections {
            pool,
            transport,
            timeouts,
            session,
            condemned,
            demotion,
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
            demotion: self.demotion.clone(),
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
        let demotion = self.demotion.clone();
        let tx = self
            .object
            .build_transaction()
            .read_only(setup.session.read_only)
            .start()
            .await;
        let tx = match tx {
            // 0A000 for `START TRANSACTION READ WRITE`: the server is in
            // recovery, a standby.
            Err(e) if !setup.session.read_only && e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED) => {
                demotion.now();
                return Err(unavailable(e));
            }
            other => other.map_err(unavailable)?,
        };
        if setup.session.pooler == Pooler::Transaction {
            demotion
                .note(tx.batch_execute(&setup.local_settings()).await)
                .map_err(unavailable)?;
        }
        Ok(Tx { tx, setup, demotion })
    }
}

/// A transaction on a pooled connection.
pub(super) struct Tx<'a> {
    tx: deadpool_postgres::Transaction<'a>,
    setup: Setup,
    demotion: Demotion,
}

impl Tx<'_> {
    pub(super) async fn commit(self) -> Result<()> {
        let demotion = self.demotion;
        demotion.note(self.tx.commit().await).map_err(unavailable)
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
                self.demotion
                    .note(<$cached>::prepare_cached(&self.$inner, sql).await)
            }
            async fn run_prepared(
                &self,
                stmt: &Statement,
                params: &[Param<'_>],
            ) -> PgResult<(Vec<Row>, u64)> {
                let ran = async {
                    drain(<$pg>::query_raw(&self.$inner, stmt, params.iter().copied()).await?).await
                };
                self.demotion.note(ran.await)
            }
            async fn run_typed(&self, sql: &str, params: &[(Param<'_>, Type)]) -> PgResult<(Vec<Row>, u64)> {
                let params = params.iter().map(|(p, t)| (*p, t.clone()));
                let ran = async { drain(<$pg>::query_typed_raw(&self.$inner, sql, params).await?).await };
                self.demotion.note(ran.await)
            }
            async fn batch(&self, sql: &str) -> PgResult<()> {
                self.demotion
                    .note(<$pg>::batch_execute(&self.$inner, sql).await)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::settings::names_session_attrs;

    const WRITES: PgSession = PgSession {
        pooler: Pooler::Session,
        read_only: false,
    };
    const READS: PgSession = PgSession {
        pooler: Pooler::Session,
        read_only: true,
    };

    #[test]
    fn a_url_that_names_no_session_gets_a_writable_one_in_either_form() {
        for url in [
            "postgres://idem@10.0.0.1,10.0.0.2/db",
            "postgres://idem@10.0.0.1,10.0.0.2/db?application_name=store",
            "host=10.0.0.1,10.0.0.2 dbname=db",
            "host = 10.0.0.1 password='target_session_attrs=any'",
        ] {
            assert_eq!(names_session_attrs(url).unwrap(), None, "{url}");
            for session in [WRITES, READS] {
                assert_eq!(
                    primary_only(url, session).unwrap(),
                    TargetSessionAttrs::ReadWrite,
                    "{url}"
                );
            }
        }
    }

    #[test]
    fn what_the_url_names_is_read_in_either_form() {
        for (url, attrs) in [
            (
                "postgres://h/db?target_session_attrs=any",
                TargetSessionAttrs::Any,
            ),
            (
                "postgres://h/db?sslmode=disable&target_session_attrs=read-only",
                TargetSessionAttrs::ReadOnly,
            ),
            (
                "postgresql://h/db?target_session_attrs=read-write",
                TargetSessionAttrs::ReadWrite,
            ),
            ("host=h target_session_attrs=any", TargetSessionAttrs::Any),
            (
                "host=h target_session_attrs = 'read-only'",
                TargetSessionAttrs::ReadOnly,
            ),
            (
                "host=h target_session_attrs=read-write",
                TargetSessionAttrs::ReadWrite,
            ),
        ] {
            assert_eq!(names_session_attrs(url).unwrap(), Some(attrs), "{url}");
            assert_eq!(primary_only(url, READS).unwrap(), attrs, "{url}");
        }
    }

    #[test]
    fn a_writing_session_may_not_be_asked_to_land_anywhere_but_on_a_primary() {
        for url in [
            "postgres://h/db?target_session_attrs=any",
            "postgres://h/db?target_session_attrs=read-only",
            "host=h target_session_attrs=any",
        ] {
            let Err(StoreError::Config(detail)) = primary_only(url, WRITES) else {
                panic!("{url} accepted for a writing session");
            };
            assert!(detail.contains("target_session_attrs"), "{detail}");
        }
        assert_eq!(
            primary_only("postgres://h/db?target_session_attrs=read-write", WRITES).unwrap(),
            TargetSessionAttrs::ReadWrite
        );
    }

    #[test]
    fn a_refusal_drops_only_the_connections_opened_before_it() {
        let demotion = Demotion::default();
        let before = Instant::now();
        assert!(!demotion.outlived(before));
        demotion.now();
        let after = Instant::now();
        assert!(demotion.outlived(before));
        assert!(!demotion.outlived(after + Duration::from_millis(1)));
    }
}
