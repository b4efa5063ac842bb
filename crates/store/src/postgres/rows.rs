//! Rows: reading them through [`ColumnReader`], binding a record's key, and
//! the statements built from the one list of record columns.

use std::sync::LazyLock;

use bytes::BytesMut;
use idemgate_core::record::{State, Transition};
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type};
use tokio_postgres::Row;

use crate::backend::{Actor, Result, StoreError};
use crate::row_mapping::{record_list, ColumnReader, KeyColumns, ScopeDigest, RECORD_COLUMNS};

/// A statement parameter.
pub(super) type Param<'p> = &'p (dyn ToSql + Sync);

/// What [`LoadedRecord::read`](crate::row_mapping::LoadedRecord) reads, for a
/// select list.
pub(super) const LOADED: &str =
    "state, fingerprint, fence, lease_until, ttl_ms, response_status, response_headers, \
     response_key, body_stored, completed_at, expires_at, archived_at IS NOT NULL AS archived, attempt, \
     release_on_unknown";

/// A record's key is a `bytea`.
impl ToSql for ScopeDigest {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> std::result::Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.as_bytes().to_sql(ty, out)
    }

    fn accepts(ty: &Type) -> bool {
        <&[u8] as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

pub(super) trait Bind {
    /// The key parameter, `$1`, followed by `extra`.
    fn bind<'p>(&'p self, extra: &[Param<'p>]) -> Vec<Param<'p>>;
}

impl Bind for ScopeDigest {
    fn bind<'p>(&'p self, extra: &[Param<'p>]) -> Vec<Param<'p>> {
        let mut v: Vec<Param<'p>> = Vec::with_capacity(1 + extra.len());
        v.push(self);
        v.extend_from_slice(extra);
        v
    }
}

/// The key, `$1`, then the scope's six columns, `$2..$7`, then `extra`: for
/// statements that create a row.
pub(super) fn bind_with_columns<'p>(
    key: &'p ScopeDigest,
    columns: &'p KeyColumns<'_>,
    extra: &[Param<'p>],
) -> Vec<Param<'p>> {
    let mut v: Vec<Param<'p>> = Vec::with_capacity(7 + extra.len());
    v.push(key);
    v.extend(columns.0.iter().map(|c| c as Param<'p>));
    v.extend_from_slice(extra);
    v
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
    record_list(|c| {
        (c == "response_body").then(|| {
            format!(
                "octet_length(response_body) - CASE WHEN response_key IS NULL THEN 0 ELSE {} END AS body_len",
                crate::sealing::OVERHEAD
            )
        })
    })
});

/// The value every column of a fresh generation gets: the claim's
/// parameters from `$first` on (fingerprint, lease_until, ttl_ms,
/// release_on_unknown, now, attempt: see `Claimed`), and `fence` for both
/// the fence and the generation.
fn fresh_value(column: &str, fence: &str, first: usize) -> Option<String> {
    let param = |i: usize| format!("${}", first + i);
    Some(match column {
        "fingerprint" => param(0),
        "fence" | "generation" => fence.to_string(),
        "lease_until" => param(1),
        "ttl_ms" => param(2),
        "release_on_unknown" => param(3),
        "created_at" => param(4),
        "attempt" => param(5),
        "state" => crate::conditions::state(State::InProgress),
        fixed => match fixed {
            "body_stored" => "false",
            "replay_count" => "0",
            "response_status" | "response_headers" | "response_body" | "response_key" | "completed_at"
            | "expires_at" | "archived_at" => "NULL",
            _ => return None,
        }
        .to_string(),
    })
}

/// Insert if absent; otherwise the existing row. One statement, one round
/// trip; the row returned reads as [`crate::row_mapping::LoadedRecord`] plus
/// `inserted` and the body (only when a replay could serve it). `$1` the
/// key, `$2..$7` the scope's columns, `$8..$13` the claim.
pub(super) static CLAIM: LazyLock<String> = LazyLock::new(|| {
    let values = record_list(|c| match RECORD_COLUMNS[..6].iter().position(|k| *k == c) {
        Some(i) => Some(format!("${}", i + 2)),
        None => fresh_value(c, "f.fence", 8),
    });
    crate::conditions::expand(&format!(
        "WITH f AS (SELECT nextval('idempotency_fence_seq') AS fence), ins AS ( \
           INSERT INTO idempotency_records (scope_digest, {columns}) SELECT $1, {values} FROM f \
           ON CONFLICT DO NOTHING RETURNING fence), \
         ev AS (INSERT INTO idempotency_events ({events}) \
           SELECT fence, $12, {claimed}, fence, NULL, {filter}, NULL, 0, NULL FROM ins) \
         SELECT true AS inserted, fence, NULL::text AS state, NULL::text AS fingerprint, NULL::bigint AS lease_until, \
           NULL::bigint AS ttl_ms, NULL::integer AS response_status, NULL::text AS response_headers, \
           NULL::text AS response_key, NULL::bytea AS response_body, false AS body_stored, NULL::bigint AS completed_at, NULL::bigint AS expires_at, \
           false AS archived, NULL::text AS attempt, false AS release_on_unknown FROM ins \
         UNION ALL \
         SELECT false, fence, state, fingerprint, lease_until, ttl_ms, response_status, response_headers, \
           response_key, CASE WHEN {{replayable}} AND body_stored THEN response_body END, body_stored, completed_at, expires_at, \
           archived_at IS NOT NULL, attempt, release_on_unknown \
         FROM idempotency_records WHERE {key} AND NOT EXISTS (SELECT 1 FROM ins)",
        columns = record_list(|_| None),
        events = crate::row_mapping::EVENT_OWN_COLUMNS,
        key = key_where!(),
        claimed = crate::conditions::transition(Transition::Claimed),
        filter = crate::conditions::actor(&Actor::Filter),
    ))
});

/// A condition, always true, that two columns of an array parameter's rows
/// are positive (fences, counts and statuses are), for a statement that
/// joins those rows to the records. The planner takes an array it cannot
/// see for ten rows, and a plan made once a connection (generic) for ten
/// rows looked dearer than one made for the two or three at hand, so every
/// run was planned again (0.15–0.4 ms of the server's CPU a run, measured
/// with `pg_stat_statements.plans`). Two conditions it cannot judge bring
/// its estimate to one row, and the statement is planned once a connection.
pub(super) fn one_row_estimate(a: &str, b: &str) -> String {
    format!("{a} > 0 AND {b} > 0")
}

/// [`CLAIM`] for many new keys at once: one statement, so one transaction
/// and one commit. Inserts each absent key as [`CLAIM`] does, with its
/// `claimed` event, and returns `scope_digest` and `fence` of the rows it
/// inserted; a key already present is left alone and returns nothing.
/// `$1` the keys (distinct), `$2..$7` the scope's columns, `$8..$11` and
/// `$13` the claims' fingerprint, lease_until, ttl_ms, release_on_unknown
/// and attempt, one array element per claim; `$12` now. Fences are drawn in
/// the order of the arrays (so they increase along the batch); rows are
/// inserted in key order, so two batches inserting the same keys at once
/// wait for each other in one order and never deadlock.
pub(super) static CLAIM_NEW: LazyLock<String> = LazyLock::new(|| {
    let values = record_list(|c| match c {
        "scope_version" | "tenant" | "principal" | "route" | "namespace" | "idem_key" | "fingerprint"
        | "lease_until" | "ttl_ms" | "release_on_unknown" | "attempt" => Some(format!("v.{c}")),
        "created_at" => Some("$12::bigint".into()),
        _ => fresh_value(c, "v.fence", 0),
    });
    format!(
        "WITH v AS MATERIALIZED (SELECT u.*, nextval('idempotency_fence_seq') AS fence FROM ( \
           SELECT * FROM unnest($1::bytea[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
             $7::text[], $8::text[], $9::bigint[], $10::bigint[], $11::boolean[], $13::text[]) WITH ORDINALITY \
             AS a(scope_digest, scope_version, tenant, principal, route, namespace, idem_key, fingerprint, \
               lease_until, ttl_ms, release_on_unknown, attempt, ord) \
           ORDER BY ord) u), \
         ins AS (INSERT INTO idempotency_records (scope_digest, {columns}) \
           SELECT v.scope_digest, {values} FROM v ORDER BY v.scope_digest \
           ON CONFLICT (scope_digest) DO NOTHING \
           RETURNING scope_digest, fence), \
         ev AS (INSERT INTO idempotency_events ({events}) \
           SELECT fence, $12::bigint, {claimed}, fence, NULL, {filter}, NULL, 0, NULL FROM ins ORDER BY fence) \
         SELECT scope_digest, fence FROM ins",
        columns = record_list(|_| None),
        events = crate::row_mapping::EVENT_OWN_COLUMNS,
        claimed = crate::conditions::transition(Transition::Claimed),
        filter = crate::conditions::actor(&Actor::Filter),
    )
});

/// A new generation in place of the locked record of `$1` (already moved to
/// the history), guarded by the fence `$8` and state `$9` it was read with;
/// `$2..$7` the claim. Returns the new fence.
pub(super) static REPLACE_GENERATION: LazyLock<String> = LazyLock::new(|| {
    let set = RECORD_COLUMNS
        .iter()
        .filter_map(|c| {
            let fence = if *c == "generation" {
                "currval('idempotency_fence_seq')"
            } else {
                "nextval('idempotency_fence_seq')"
            };
            fresh_value(c, fence, 2).map(|v| format!("{c} = {v}"))
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "UPDATE idempotency_records SET {set} WHERE {} AND fence = $8 AND state = $9 RETURNING fence",
        key_where!()
    )
});

/// Rows picked for a sweeper phase by `condition` (`$1` now or the cutoff,
/// `$2` the batch), locked, each its key and what
/// [`crate::row_mapping::LoadedRecord`] reads; rows another replica holds are
/// skipped. Taken in the order of `by`, the column the phase's partial index is sorted on: the
/// scan stops after `$2` entries of that index, oldest due first. (In key
/// order a pick had to sort every due row, or walk the key past the rows
/// already swept: it grew with the table and the sweeper fell behind.)
pub(super) fn pick(condition: &str, by: &str) -> String {
    crate::conditions::expand(&format!(
        "SELECT scope_digest, {} FROM idempotency_records WHERE {condition} ORDER BY {by} \
         LIMIT $2 FOR UPDATE SKIP LOCKED",
        LOADED
    ))
}

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
pub(super) fn typed<'p>(params: &[Param<'p>]) -> Result<Vec<(Param<'p>, Type)>> {
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
