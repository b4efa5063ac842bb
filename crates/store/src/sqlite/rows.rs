//! Rows: reading them through [`ColumnReader`], binding a record's key, and
//! the statements built from the one list of record columns.

use std::sync::LazyLock;

use rusqlite::types::FromSql;
use rusqlite::{Connection, Row, ToSql};

use super::engine::unavailable;
use crate::backend::{EventInfo, RecordInfo, Result, StoreError};
use crate::columns::{record_list, ColumnReader, KeyColumns, LoadedRecord, EVENT_COLUMN_NAMES};

/// The six key parameters, `?1`..`?6`; a statement's own start at `?7`.
pub(super) const KEY_WHERE: &str = key_where!();

pub(super) trait Bind {
    /// The six key parameters followed by `extra`.
    fn bind<'p>(&'p self, extra: &[&'p dyn ToSql]) -> Vec<&'p dyn ToSql>;
}

impl Bind for KeyColumns<'_> {
    fn bind<'p>(&'p self, extra: &[&'p dyn ToSql]) -> Vec<&'p dyn ToSql> {
        let mut v: Vec<&dyn ToSql> = Vec::with_capacity(6 + extra.len());
        v.extend(self.0.iter().map(|c| c as &dyn ToSql));
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
        let read = match self.select {
            None => self.row.get(name),
            Some(select) => match select.iter().position(|c| *c == name) {
                Some(i) => self.row.get(i),
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
}

/// A record's columns for operators: the body's length, not the body.
pub(super) static INFO_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    record_list(|c| (c == "response_body").then(|| "length(response_body) AS body_len".to_string()))
});

/// Moves the current generation of `?1..?6` to the history: `?7` how it
/// ended, `?8` now. The body is not kept.
pub(super) static TO_HISTORY: LazyLock<String> = LazyLock::new(|| {
    let kept = record_list(|c| match c {
        "state" => Some("?7".into()),
        "response_body" => Some("NULL".into()),
        _ => None,
    });
    format!(
        "INSERT INTO idempotency_history ({}, ended_at) SELECT {kept}, ?8 FROM idempotency_records WHERE {KEY_WHERE}",
        record_list(|_| None)
    )
});

/// A fresh generation's row, `?1..?6` its key, `?7..?13` the claim (see
/// [`super::generation::insert_generation`]); the value of every column of
/// a new generation is written here and only here.
fn fresh_value(column: &str) -> Option<&'static str> {
    Some(match column {
        "state" => "'in_progress'",
        "fingerprint" => "?7",
        "fence" | "generation" => "?8",
        "lease_until" => "?9",
        "ttl_ms" => "?10",
        "release_on_unknown" => "?11",
        "created_at" => "?12",
        "attempt" => "?13",
        "body_stored" | "replay_count" => "0",
        "response_status" | "response_headers" | "response_body" | "completed_at" | "expires_at"
        | "archived_at" => "NULL",
        _ => return None,
    })
}

fn insert_generation_sql(on_conflict: &str) -> String {
    let values = record_list(|c| {
        let key = crate::columns::RECORD_COLUMNS[..6].iter().position(|k| *k == c);
        key.map(|i| format!("?{}", i + 1))
            .or_else(|| fresh_value(c).map(String::from))
    });
    format!(
        "INSERT INTO idempotency_records ({}) VALUES ({values}) ON CONFLICT ({}) DO {on_conflict}",
        record_list(|_| None),
        crate::columns::KEY_COLUMNS
    )
}

/// Inserts a fresh generation unless the key has a record.
pub(super) static INSERT_GENERATION: LazyLock<String> = LazyLock::new(|| insert_generation_sql("NOTHING"));

/// Inserts a fresh generation, replacing the key's record (which the caller
/// moved to the history first): every column takes its fresh value.
pub(super) static REPLACE_GENERATION: LazyLock<String> = LazyLock::new(|| {
    let set = crate::columns::RECORD_COLUMNS
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
    "body_stored",
    "completed_at",
    "expires_at",
    "archived",
    "attempt",
    "response_body",
];

/// The current record of `?1..?6`: [`LOADED`].
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

pub(super) fn load(conn: &Connection, key: &KeyColumns<'_>) -> Result<Option<LoadedRecord>> {
    load_with(conn, key, |loaded, _| Ok(loaded))
}

/// Loads a row and hands it to `f` together with a reader of its stored body,
/// so a replay gets status, headers and body from one statement while other
/// decisions never copy the body.
pub(super) fn load_with<T>(
    conn: &Connection,
    key: &KeyColumns<'_>,
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
pub(super) fn query_infos(conn: &Connection, sql: &str, params: &[&dyn ToSql]) -> Result<Vec<RecordInfo>> {
    query_all(conn, sql, params, |row| RecordInfo::read(row))
}

/// Runs a statement that selects (or returns) [`crate::columns::EVENT_COLUMNS`].
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

/// The key columns of the rows `sql` picks.
pub(super) fn query_keys(conn: &Connection, sql: &str, params: &[&dyn ToSql]) -> Result<Vec<[String; 6]>> {
    query_all(conn, sql, params, |row| row.key_columns())
}
