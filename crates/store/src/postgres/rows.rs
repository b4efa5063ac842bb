//! Rows: reading them through [`ColumnReader`], binding a record's key, and
//! the statements built from the one list of record columns.

use std::sync::LazyLock;

use tokio_postgres::types::{FromSql, ToSql};
use tokio_postgres::Row;

use crate::backend::{Result, StoreError};
use crate::columns::{record_list, ColumnReader, KeyColumns, KEY_COLUMNS, RECORD_COLUMNS};

/// A statement parameter.
pub(super) type Param<'p> = &'p (dyn ToSql + Sync);

pub(super) trait Bind {
    /// The six key parameters, `$1..$6`, followed by `extra`.
    fn bind<'p>(&'p self, extra: &[Param<'p>]) -> Vec<Param<'p>>;
}

impl Bind for KeyColumns<'_> {
    fn bind<'p>(&'p self, extra: &[Param<'p>]) -> Vec<Param<'p>> {
        let mut v: Vec<Param<'p>> = Vec::with_capacity(6 + extra.len());
        v.extend(self.0.iter().map(|c| c as Param<'p>));
        v.extend_from_slice(extra);
        v
    }
}

fn get<'r, T: FromSql<'r>>(row: &'r Row, name: &str) -> Result<T> {
    row.try_get(name)
        .map_err(|e| StoreError::Corrupt(format!("column {name}: {e}")))
}

impl ColumnReader for Row {
    fn text(&self, name: &str) -> Result<String> {
        get(self, name)
    }
    fn optional_text(&self, name: &str) -> Result<Option<String>> {
        get(self, name)
    }
    /// BIGINT columns, and INTEGER ones (`response_status`, `octet_length`).
    fn int(&self, name: &str) -> Result<i64> {
        match self.try_get::<_, i64>(name) {
            Ok(v) => Ok(v),
            Err(_) => get::<i32>(self, name).map(i64::from),
        }
    }
    fn optional_int(&self, name: &str) -> Result<Option<i64>> {
        match self.try_get::<_, Option<i64>>(name) {
            Ok(v) => Ok(v),
            Err(_) => get::<Option<i32>>(self, name).map(|v| v.map(i64::from)),
        }
    }
    fn flag(&self, name: &str) -> Result<bool> {
        get(self, name)
    }
    fn optional_bytes(&self, name: &str) -> Result<Option<Vec<u8>>> {
        get(self, name)
    }
}

/// A record's columns for operators: the body's length, not the body.
pub(super) static INFO_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    record_list(|c| (c == "response_body").then(|| "octet_length(response_body) AS body_len".to_string()))
});

/// Moves the current generation of `$1..$6` to the history: `$7` how it
/// ended, `$8` now. The body is not kept.
pub(super) static TO_HISTORY: LazyLock<String> = LazyLock::new(|| {
    let kept = record_list(|c| match c {
        "state" => Some("$7".into()),
        "response_body" => Some("NULL".into()),
        _ => None,
    });
    format!(
        "INSERT INTO idempotency_history ({}, ended_at) SELECT {kept}, $8 FROM idempotency_records WHERE {}",
        record_list(|_| None),
        key_where!()
    )
});

/// The value every column of a fresh generation gets: `$7` fingerprint,
/// `$8` lease_until, `$9` ttl_ms, `$10` release_on_unknown, `$11` now, `$12`
/// attempt, and `fence` for both the fence and the generation.
fn fresh_value(column: &str, fence: &str) -> Option<String> {
    Some(
        match column {
            "state" => "'in_progress'",
            "fingerprint" => "$7",
            "fence" | "generation" => fence,
            "lease_until" => "$8",
            "ttl_ms" => "$9",
            "release_on_unknown" => "$10",
            "created_at" => "$11",
            "attempt" => "$12",
            "body_stored" => "false",
            "replay_count" => "0",
            "response_status" | "response_headers" | "response_body" | "completed_at" | "expires_at"
            | "archived_at" => "NULL",
            _ => return None,
        }
        .to_string(),
    )
}

/// Insert if absent; otherwise the existing row. One statement, one round
/// trip; the row returned reads as [`crate::columns::LoadedRecord`] plus
/// `inserted` and the body (only when a replay could serve it).
pub(super) static CLAIM: LazyLock<String> = LazyLock::new(|| {
    let values = record_list(|c| match RECORD_COLUMNS[..6].iter().position(|k| *k == c) {
        Some(i) => Some(format!("${}", i + 1)),
        None => fresh_value(c, "f.fence"),
    });
    crate::conditions::expand(&format!(
        "WITH f AS (SELECT nextval('idempotency_fence_seq') AS fence), ins AS ( \
           INSERT INTO idempotency_records ({columns}) SELECT {values} FROM f ON CONFLICT DO NOTHING RETURNING fence), \
         ev AS (INSERT INTO idempotency_events ({events}) \
           SELECT $1, $2, $3, $4, $5, $6, fence, $11, 'claimed', $12, fence, $7, NULL, 'filter', NULL, 0, NULL FROM ins) \
         SELECT true AS inserted, fence, NULL::text AS state, NULL::text AS fingerprint, NULL::bigint AS lease_until, \
           NULL::bigint AS ttl_ms, NULL::integer AS response_status, NULL::text AS response_headers, \
           NULL::bytea AS response_body, false AS body_stored, NULL::bigint AS completed_at, NULL::bigint AS expires_at, \
           false AS archived, NULL::text AS attempt FROM ins \
         UNION ALL \
         SELECT false, fence, state, fingerprint, lease_until, ttl_ms, response_status, response_headers, \
           CASE WHEN {{replayable}} AND body_stored THEN response_body END, body_stored, completed_at, expires_at, \
           archived_at IS NOT NULL, attempt \
         FROM idempotency_records WHERE {key} AND NOT EXISTS (SELECT 1 FROM ins)",
        columns = record_list(|_| None),
        events = crate::columns::EVENT_COLUMNS,
        key = key_where!(),
    ))
});

/// A new generation in place of the locked record of `$1..$6` (already
/// moved to the history), guarded by the fence `$13` and state `$14` it was
/// read with; returns the new fence.
pub(super) static REPLACE_GENERATION: LazyLock<String> = LazyLock::new(|| {
    let set = RECORD_COLUMNS
        .iter()
        .filter_map(|c| {
            let fence = if *c == "generation" {
                "currval('idempotency_fence_seq')"
            } else {
                "nextval('idempotency_fence_seq')"
            };
            fresh_value(c, fence).map(|v| format!("{c} = {v}"))
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "UPDATE idempotency_records SET {set} WHERE {} AND fence = $13 AND state = $14 RETURNING fence",
        key_where!()
    )
});

/// Rows picked for a sweeper phase by `condition` (`$1` now or the cutoff,
/// `$2` the batch), locked; rows another replica holds are skipped.
pub(super) fn pick(condition: &str) -> String {
    crate::conditions::expand(&format!(
        "SELECT {KEY_COLUMNS}, fence, ttl_ms FROM idempotency_records WHERE {condition} ORDER BY {KEY_COLUMNS} \
         LIMIT $2 FOR UPDATE SKIP LOCKED"
    ))
}
