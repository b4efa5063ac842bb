//! How the backend opens a connection to its file: the WAL, the
//! synchronous level, the busy timeout and the statement cache, and the SQL
//! functions the migrations call.

use rusqlite::functions::FunctionFlags;
use rusqlite::types::{Value, ValueRef};
use rusqlite::Connection;

use super::errors::unavailable;
use crate::backend::Result;

/// How long a connection waits for a lock another process holds.
pub(super) const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// For migrations that rewrite existing rows:
/// `idemgate_scope_digest(version, tenant, principal, route, namespace,
/// key)`, a current record's key ([`idemgate_core::scope::digest_parts`]);
/// `idemgate_stored_attempt(id)`, `idemgate_stored_transition(name)` and
/// `idemgate_stored_actor(name)`, a value as its column holds it
/// ([`super::stored`]).
fn register_functions(conn: &Connection) -> rusqlite::Result<()> {
    type AsStored = fn(ValueRef<'_>) -> Value;
    let stored: [(&str, AsStored); 3] = [
        ("idemgate_stored_attempt", super::stored::stored_attempt),
        ("idemgate_stored_transition", super::stored::stored_transition),
        ("idemgate_stored_actor", super::stored::stored_actor),
    ];
    for (name, as_stored) in stored {
        conn.create_scalar_function(
            name,
            1,
            FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC,
            move |ctx| Ok(as_stored(ctx.get_raw(0))),
        )?;
    }
    conn.create_scalar_function(
        "idemgate_scope_digest",
        6,
        FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC,
        |ctx| {
            let part = |i: usize| {
                ctx.get_raw(i)
                    .as_str()
                    .map_err(|e| rusqlite::Error::UserFunctionError(e.into()))
            };
            let parts = [part(0)?, part(1)?, part(2)?, part(3)?, part(4)?, part(5)?];
            Ok(idemgate_core::scope::digest_parts(parts).to_vec())
        },
    )
}

pub(super) fn open_connection(path: &str, synchronous_full: bool) -> Result<Connection> {
    let conn = Connection::open(path).map_err(unavailable)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(unavailable)?;
    // Room for every statement the writer repeats (queries and transaction
    // control), so none is evicted and parsed again.
    conn.set_prepared_statement_cache_capacity(64);
    let sync = if synchronous_full { "FULL" } else { "NORMAL" };
    // Temporary storage in memory: above all the statement journal that a
    // savepoint keeps of the pages it changes (the sweeper's phases, a
    // batch's jobs), which in a file made a sweep of 10^6 records take 17%
    // longer, in memory 4% (bench/results/profile.md §20).
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous={sync}; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;"
    ))
    .map_err(unavailable)?;
    register_functions(&conn).map_err(unavailable)?;
    Ok(conn)
}
