//! Rows: reading them through [`ColumnReader`], binding a record's key, and
//! the statements built from the one list of record columns.

use std::sync::LazyLock;

use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::record::{State, Transition};
use rusqlite::types::{FromSql, ToSqlOutput, ValueRef};
use rusqlite::{Connection, Row, ToSql};

use super::errors::unavailable;
use super::stored;
use crate::backend::{Actor, EventInfo, RecordInfo, Result, StoreError};
use crate::row_mapping::{record_list, ColumnReader, LoadedRecord, ScopeDigest, EVENT_COLUMN_NAMES};
use crate::sealing::Seal;

/// The current record's key, `?1`; a statement's own parameters start at `?2`.
pub(super) const KEY_WHERE: &str = key_where!();

impl ToSql for ScopeDigest {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(ValueRef::Blob(self.as_bytes())))
    }
}

pub(super) trait Bind {
    /// The key parameter followed by `extra`.
    fn bind<'p>(&'p self, extra: &[&'p dyn ToSql]) -> Vec<&'p dyn ToSql>;
}

impl Bind for ScopeDigest {
    fn bind<'p>(&'p self, extra: &[&'p dyn ToSql]) -> Vec<&'p dyn ToSql> {
        let mut v: Vec<&dyn ToSql> = Vec::with_capacity(1 + extra.len());
        v.push(self);
        v.extend_from_slice(extra);
        v
    }
}

/// A row read by column name. With `select`, the statement's select list in
/// order, a name is found in that list instead of being asked of SQLite
/// column by column: the claim path reads every record that way.
pub(super) struct SqliteRow<'a, 'r> {
    row: &'a Row<'r>,
    select: Option<&'static [&'static str]>,
}

impl SqliteRow<'_, '_> {
    fn get<T: FromSql>(&self, name: &str) -> Result<T> {
        self.value(name)
            .and_then(|v| T::column_result(v).map_err(|e| StoreError::Corrupt(format!("column {name}: {e}"))))
    }

    fn value(&self, name: &str) -> Result<ValueRef<'_>> {
        let read = match self.select {
            None => self.row.get_ref(name),
            Some(select) => match select.iter().position(|c| *c == name) {
                Some(i) => self.row.get_ref(i),
                None => return Err(StoreError::Corrupt(format!("column {name}: not selected"))),
            },
        };
        read.map_err(|e| StoreError::Corrupt(format!("column {name}: {e}")))
    }
}

impl ColumnReader for SqliteRow<'_, '_> {
    fn text(&self, name: &str) -> Result<String> {
        self.get(name)
    }
    fn optional_text(&self, name: &str) -> Result<Option<String>> {
        self.get(name)
    }
    fn int(&self, name: &str) -> Result<i64> {
        self.get(name)
    }
    fn optional_int(&self, name: &str) -> Result<Option<i64>> {
        self.get(name)
    }
    fn flag(&self, name: &str) -> Result<bool> {
        self.get(name)
    }
    fn optional_bytes(&self, name: &str) -> Result<Option<Vec<u8>>> {
        self.get(name)
    }
    fn fingerprint(&self) -> Result<Option<Fingerprint>> {
        stored::fingerprint(self.value("fingerprint")?)
    }
    fn attempt(&self) -> Result<Option<String>> {
        stored::attempt_id(self.value("attempt")?)
    }
    fn transition(&self) -> Result<Transition> {
        stored::transition(self.value("transition")?)
    }
    fn actor(&self) -> Result<Actor> {
        stored::actor(self.value("actor")?)
    }
}

/// A record's columns for operators: the body's length, not the body.
pub(super) static INFO_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    record_list(|c| {
        (c == "response_body").then(|| {
            format!(
                "length(response_body) - CASE WHEN response_key IS NULL THEN 0 ELSE {} END AS body_len",
                crate::sealing::OVERHEAD
            )
        })
    })
});

/// A fresh generation's row: `?1` its key, `?2..?7` its scope's columns,
/// `?8..?14` the claim (see [`super::generation::insert_generation`]); the
/// value of every column of a new generation is written here and only here.
fn fresh_value(column: &str) -> Option<String> {
    Some(
        match column {
            "state" => return Some(crate::conditions::state(State::InProgress)),
            "fingerprint" => "?8",
            "fence" | "generation" => "?9",
            "lease_until" => "?10",
            "ttl_ms" => "?11",
            "release_on_unknown" => "?12",
            "created_at" => "?13",
            "attempt" => "?14",
            "body_stored" | "replay_count" => "0",
            "response_status" | "response_headers" | "response_body" | "response_key" | "completed_at"
            | "expires_at" | "archived_at" => "NULL",
            _ => return None,
        }
        .to_string(),
    )
}

fn insert_generation_sql(on_conflict: &str) -> String {
    let values = record_list(|c| {
        let key = crate::row_mapping::RECORD_COLUMNS[..6]
            .iter()
            .position(|k| *k == c);
        key.map(|i| format!("?{}", i + 2)).or_else(|| fresh_value(c))
    });
    format!(
        "INSERT INTO idempotency_records (scope_digest, {}) VALUES (?1, {values}) ON CONFLICT (scope_digest) \
         DO {on_conflict}",
        record_list(|_| None),
    )
}

/// Inserts a fresh generation unless the key has a record.
pub(super) static INSERT_GENERATION: LazyLock<String> = LazyLock::new(|| insert_generation_sql("NOTHING"));

/// Inserts a fresh generation, replacing the key's record (which the caller
/// moved to the history first): every column takes its fresh value.
pub(super) static REPLACE_GENERATION: LazyLock<String> = LazyLock::new(|| {
    let set = crate::row_mapping::RECORD_COLUMNS
        .iter()
        .filter(|c| fresh_value(c).is_some())
        .map(|c| format!("{c} = excluded.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    insert_generation_sql(&format!("UPDATE SET {set}"))
});

/// What [`LOAD`] selects: what [`LoadedRecord`] reads, and the body.
const LOADED: &[&str] = &[
    "state",
    "fingerprint",
    "fence",
    "lease_until",
    "ttl_ms",
    "response_status",
    "response_headers",
    "response_key",
    "body_stored",
    "completed_at",
    "expires_at",
    "archived",
    "attempt",
    "release_on_unknown",
    "response_body",
];

/// The current record of `?1`: [`LOADED`].
static LOAD: LazyLock<String> = LazyLock::new(|| {
    let select: Vec<&str> = LOADED
        .iter()
        .map(|c| {
            if *c == "archived" {
                "archived_at IS NOT NULL AS archived"
            } else {
                c
            }
        })
        .collect();
    format!(
        "SELECT {} FROM idempotency_records WHERE {KEY_WHERE}",
        select.join(", ")
    )
});

pub(super) fn load(conn: &Connection, key: &ScopeDigest) -> Result<Option<LoadedRecord>> {
    load_with(conn, key, |loaded, _| Ok(loaded))
}

/// Loads a row and hands it to `f` together with a reader of its stored body,
/// so a replay gets status, headers and body from one statement while other
/// decisions never copy the body.
pub(super) fn load_with<T>(
    conn: &Connection,
    key: &ScopeDigest,
    f: impl FnOnce(Option<LoadedRecord>, &dyn Fn() -> Result<Vec<u8>>) -> Result<T>,
) -> Result<T> {
    let mut stmt = conn.prepare_cached(&LOAD).map_err(unavailable)?;
    let mut rows = stmt.query(key.bind(&[]).as_slice()).map_err(unavailable)?;
    let Some(row) = rows.next().map_err(unavailable)? else {
        return f(None, &|| Ok(Vec::new()));
    };
    let row = SqliteRow {
        row,
        select: Some(LOADED),
    };
    let loaded = LoadedRecord::read(&row)?;
    let body = || Ok(row.optional_bytes("response_body")?.unwrap_or_default());
    f(Some(loaded), &body)
}

/// Runs a statement that selects [`INFO_COLUMNS`] and `ended_at`.
pub(super) fn query_infos(
    conn: &Connection,
    sql: &str,
    params: &[&dyn ToSql],
    seal: &Seal,
) -> Result<Vec<RecordInfo>> {
    query_all(conn, sql, params, |row| RecordInfo::read(row, seal))
}

/// Runs a statement that selects (or returns) [`crate::row_mapping::EVENT_COLUMNS`].
/// Read by position: the writer records an event with every change.
pub(super) fn query_events(conn: &Connection, sql: &str, params: &[&dyn ToSql]) -> Result<Vec<EventInfo>> {
    query_selected(conn, sql, params, Some(EVENT_COLUMN_NAMES), |row| {
        EventInfo::read(row)
    })
}

/// Every row of `sql`, each read by `read`.
pub(super) fn query_all<T>(
    conn: &Connection,
    sql: &str,
    params: &[&dyn ToSql],
    read: impl Fn(&SqliteRow<'_, '_>) -> Result<T>,
) -> Result<Vec<T>> {
    query_selected(conn, sql, params, None, read)
}

/// [`query_all`] for a statement whose select list is `select`, if given.
fn query_selected<T>(
    conn: &Connection,
    sql: &str,
    params: &[&dyn ToSql],
    select: Option<&'static [&'static str]>,
    read: impl Fn(&SqliteRow<'_, '_>) -> Result<T>,
) -> Result<Vec<T>> {
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    let mut rows = stmt.query(params).map_err(unavailable)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(unavailable)? {
        out.push(read(&SqliteRow { row, select })?);
    }
    Ok(out)
}

/// Every row of `sql`, each as its values in select order.
pub(super) fn query_values(
    conn: &Connection,
    sql: &str,
    params: &[&dyn ToSql],
) -> Result<Vec<Vec<rusqlite::types::Value>>> {
    let mut stmt = conn.prepare_cached(sql).map_err(unavailable)?;
    let width = stmt.column_count();
    let mut rows = stmt.query(params).map_err(unavailable)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(unavailable)? {
        let values = (0..width)
            .map(|i| row.get(i))
            .collect::<rusqlite::Result<Vec<_>>>();
        out.push(values.map_err(unavailable)?);
    }
    Ok(out)
}

/// The keys of the rows `sql` picks (it selects `scope_digest`).
pub(super) fn query_keys(conn: &Connection, sql: &str, params: &[&dyn ToSql]) -> Result<Vec<ScopeDigest>> {
    query_all(conn, sql, params, |row| row.scope_digest())
}
