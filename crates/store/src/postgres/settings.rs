//! How the store talks to PostgreSQL: its timeouts, the pooler in front of
//! it, and the session each connection asks for.

use std::time::Duration;

use tokio_postgres::config::TargetSessionAttrs;

use crate::backend::{Result, StoreError};

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

/// The session every new connection must find: a writable one, on a
/// primary. A multi-host URL is tried host by host, and a host that is a
/// hot standby (or a primary turned read-only) is passed over for the next
/// one, as libpq's `target_session_attrs=read-write` does: a standby would
/// refuse every write, and answer lookups from a copy that lags. This
/// holds whatever the URL says when the session writes (`any` or
/// `read-only` there is refused, not obeyed); a read-only session
/// (`inspect`) reads the primary too, unless its URL names another
/// `target_session_attrs`, to read a standby knowingly.
pub(super) fn primary_only(url: &str, session: PgSession) -> Result<TargetSessionAttrs> {
    match names_session_attrs(url)? {
        Some(attrs) if session.read_only => Ok(attrs),
        None | Some(TargetSessionAttrs::ReadWrite) => Ok(TargetSessionAttrs::ReadWrite),
        Some(_) => Err(StoreError::Config(
            "the database URL asks for a session that may not take writes (target_session_attrs): \
             the store writes, and only to a primary; leave it out or say read-write"
                .into(),
        )),
    }
}

/// The `target_session_attrs` that `url` itself names, if any, in either
/// form of a database URL. tokio-postgres reads it, and its default (`any`)
/// is the same as saying `any`: the key-value form is parsed twice with a
/// different value put before the URL's own, which wins if there is one.
pub(super) fn names_session_attrs(url: &str) -> Result<Option<TargetSessionAttrs>> {
    const KEY: &str = "target_session_attrs";
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let query = url.split_once('?').map_or("", |(_, query)| query);
        let value = query
            .split('&')
            .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
            .rfind(|(name, _)| *name == KEY);
        return match value {
            None => Ok(None),
            Some((_, "any")) => Ok(Some(TargetSessionAttrs::Any)),
            Some((_, "read-write")) => Ok(Some(TargetSessionAttrs::ReadWrite)),
            Some((_, "read-only")) => Ok(Some(TargetSessionAttrs::ReadOnly)),
            Some((_, other)) => Err(StoreError::Config(format!(
                "{KEY}={other} is not supported: use read-write (or, for inspect, any or read-only)"
            ))),
        };
    }
    let parsed = |first: &str| {
        format!("{KEY}={first} {url}")
            .parse::<tokio_postgres::Config>()
            .map(|config| config.get_target_session_attrs())
            .map_err(|e| StoreError::Config(format!("bad postgres URL: {e}")))
    };
    let (a, b) = (parsed("read-only")?, parsed("read-write")?);
    Ok((a == b).then_some(a))
}
