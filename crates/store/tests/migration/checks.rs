//! The migrations' CHECK constraints, against the limits the code enforces.
//!
//! Each CHECK in force (after every migration ran: a later one may drop a
//! table, rebuild it with new constraints, or add and drop constraints) is
//! read out of the migration files and compared with the limit the code
//! applies before a value reaches the database. A CHECK either states that
//! limit exactly, or is deliberately looser: a second line of defence that
//! refuses what no code path writes, with room so that the database never
//! refuses what the API accepted (ARCHITECTURE.md, "Deliberate exceptions").
//! A CHECK stricter than the code is a bug: the store would accept a call and
//! then fail to write it.

use std::collections::{BTreeMap, BTreeSet};

use idemgate_core::key::Key;
use idemgate_core::limits;
use idemgate_core::protocol::Attempt as AttemptId;
use idemgate_core::record::State;
use idemgate_core::scope::{Namespace, Scope, SCOPE_VERSION};
use idemgate_store::{admin, row_mapping, sealing};

use super::schema::{apply, bound, in_force, one_of, statements, Bound, Table};
use crate::support::*;

/// The lengths in `0..=upto` that `accepts` takes: a range, as the code's
/// validation draws it.
fn accepted_lengths(upto: usize, accepts: impl Fn(usize) -> bool) -> Bound {
    let ok: Vec<u64> = (0..=upto).filter(|n| accepts(*n)).map(|n| n as u64).collect();
    let (min, max) = (ok[0], ok[ok.len() - 1]);
    assert_eq!(ok.len() as u64, max - min + 1, "not one range");
    assert!(max < upto as u64, "no upper limit below {upto}");
    Bound::Length { min, max: Some(max) }
}

/// How a CHECK stands to the code's limit.
#[derive(Debug)]
enum Agreement {
    /// The CHECK states the code's limit exactly.
    Same(Bound),
    /// Deliberately looser, for the reason given (listed in ARCHITECTURE.md's
    /// deliberate exceptions): it admits everything the code admits, and more.
    Looser(Bound, &'static str),
    /// Not a limit of the code but a property of every row the store writes
    /// (a flag, a positive fence, the one row of a table); the CHECK is
    /// pinned as it is.
    Invariant(Bound),
}

/// The largest headers column a completion the API accepts can write: the
/// most headers, each of the longest name and the longest value, that value
/// all quotes (each escaped to two bytes in the column's JSON), sealed (the
/// nonce and tag added, then base64).
fn largest_headers_column() -> u64 {
    // The API's largest header block in its longest JSON: every byte it
    // allows spent on values of `"`, each escaped to two.
    let mut headers: Vec<(String, String)> = Vec::new();
    let mut left = limits::MAX_STORED_HEADER_BYTES;
    while left > 1 {
        let name = format!("n{}", headers.len());
        let value = "\"".repeat(limits::MAX_HEADER_VALUE.min(left - name.len()));
        left -= name.len() + value.len();
        headers.push((name, value));
    }
    limits::response_fits(200, &headers).unwrap();
    let mut more = headers.clone();
    more.push(("n".into(), "v".into()));
    assert!(limits::response_fits(200, &more).is_err());
    let json = row_mapping::encode_headers(&headers);
    let seal = seal(KEY_A);
    let sealed = seal
        .seal(&row_mapping::ScopeDigest([0; 32]), 1, json.clone(), None)
        .unwrap();
    json.len().max(sealed.headers.len()) as u64
}

/// Every (table, column) a migration of `backend` bounds, and how its CHECK
/// must stand to the code's limit.
fn agreements(backend: &str) -> BTreeMap<(&'static str, &'static str), Agreement> {
    use Agreement::*;
    // Each of tenant, principal and route (0, 1, 2) at each length.
    let component = |which: usize| {
        accepted_lengths(1000, |n| {
            let mut parts = ["t", "p", "r"].map(String::from);
            parts[which] = "c".repeat(n);
            let key = Key::try_from("k".to_string()).unwrap();
            Scope::new(&parts[0], &parts[1], &parts[2], Namespace::Client, key).is_ok()
        })
    };
    let key = accepted_lengths(1000, |n| Key::try_from("k".repeat(n)).is_ok());
    let attempt = accepted_lengths(1000, |n| AttemptId::try_from("a".repeat(n)).is_ok());
    let reason = accepted_lengths(10_000, |n| {
        admin::validate_reason(Some(&"r".repeat(n))).is_ok_and(|r| r.is_some())
    });
    let statuses: Vec<i64> = (0..=u16::MAX)
        .filter(|s| limits::response_fits(*s, &[]).is_ok())
        .map(i64::from)
        .collect();
    let status = Bound::Value {
        min: statuses[0],
        max: statuses.last().copied(),
    };
    let ttl = {
        let with = |ttl_ms: u64| {
            let mut c = claim(&scope("k"), None);
            c.ttl_ms = ttl_ms;
            c.check().is_ok()
        };
        assert!(!with(0) && with(1) && with(limits::MAX_TTL_MS) && !with(limits::MAX_TTL_MS + 1));
        Bound::Value {
            min: 1,
            max: Some(i64::try_from(limits::MAX_TTL_MS).unwrap()),
        }
    };
    let digest = {
        let n = scope("k").digest().len() as u64;
        Bound::Length { min: n, max: Some(n) }
    };
    let namespaces = [Namespace::Client, Namespace::Server];
    for n in namespaces {
        // A namespace added to the enum is a compile error here until it is listed.
        match n {
            Namespace::Client | Namespace::Server => {}
        }
    }
    let flag = one_of(["0", "1"]);
    let r = "idempotency_records";
    BTreeMap::from([
        ((r, "scope_digest"), Same(digest.clone())),
        (
            (r, "scope_version"),
            Looser(
                Bound::Length {
                    min: SCOPE_VERSION.len() as u64,
                    max: Some(SCOPE_VERSION.len() as u64),
                },
                "room for a later scope version without a migration",
            ),
        ),
        ((r, "tenant"), Same(component(0))),
        ((r, "principal"), Same(component(1))),
        ((r, "route"), Same(component(2))),
        ((r, "idem_key"), Same(key)),
        (
            (r, "namespace"),
            Same(one_of(namespaces.map(Namespace::as_str))),
        ),
        ((r, "state"), Same(one_of(State::ALL.map(State::as_str)))),
        (
            (r, "fingerprint"),
            // SQLite keeps its bytes, PostgreSQL its hex.
            Same({
                let n = match backend {
                    "sqlite" => fp(1).as_bytes().len(),
                    _ => fp(1).to_hex().len(),
                } as u64;
                Bound::Length { min: n, max: Some(n) }
            }),
        ),
        ((r, "fence"), Invariant(Bound::Value { min: 1, max: None })),
        ((r, "ttl_ms"), Looser(ttl, "only a sign check: the ttl's upper limit is the API's")),
        ((r, "release_on_unknown"), Invariant(flag.clone())),
        ((r, "body_stored"), Invariant(flag.clone())),
        (
            (r, "response_status"),
            Looser(status, "any three-digit status; the API's 100-599 is the contract's"),
        ),
        (
            (r, "response_headers"),
            Looser(
                Bound::Length {
                    min: 0,
                    max: Some(largest_headers_column()),
                },
                "the largest header block the API accepts (limits::MAX_STORED_HEADER_BYTES), escaped to JSON and sealed, with room",
            ),
        ),
        (
            (r, "response_body"),
            // The largest request size limit serve takes (--max-body-bytes), sealed.
            Same(Bound::Length {
                min: 0,
                max: Some((idemgate_store::MAX_BODY_BYTES + sealing::OVERHEAD) as u64),
            }),
        ),
        ((r, "replay_count"), Invariant(Bound::Value { min: 0, max: None })),
        ((r, "attempt"), Same(attempt)),
        (
            (r, "response_key"),
            Same(Bound::Length {
                min: 1,
                max: Some(sealing::MAX_KEY_ID_LEN as u64),
            }),
        ),
        (
            ("idempotency_events", "reason"),
            Looser(reason, "room: the API's limit may grow without a migration"),
        ),
        (("idempotency_abandoned", "scope_digest"), Same(digest)),
        (("idempotency_fence", "id"), Invariant(Bound::Value { min: 1, max: Some(1) })),
    ])
}

#[test]
fn the_migrations_checks_agree_with_the_codes_limits() {
    let mut seen = BTreeSet::new();
    for backend in ["sqlite", "postgres"] {
        let agreements = agreements(backend);
        for (table, t) in in_force(backend) {
            for check in &t.checks {
                let at = format!("{backend}: {table}.{} CHECK ({})", check.column, check.expr);
                let found = bound(&check.column, &check.expr);
                let (key, agreement) = agreements
                    .iter()
                    .find(|((t, c), _)| *t == table && *c == check.column)
                    .unwrap_or_else(|| panic!("{at}: a CHECK this test does not know; add the code's limit"));
                seen.insert(*key);
                match agreement {
                    Agreement::Same(code) | Agreement::Invariant(code) => {
                        assert_eq!(&found, code, "{at}: the code's limit differs");
                    }
                    Agreement::Looser(code, why) => assert!(
                        found.contains(code) && found != *code,
                        "{at}: meant to be looser than the code's {code:?} ({why})"
                    ),
                }
            }
        }
    }
    let unused: Vec<_> = (agreements("sqlite").into_keys())
        .filter(|k| !seen.contains(k))
        .collect();
    assert!(unused.is_empty(), "no migration bounds {unused:?}");
}

/// The statements as this test reads them leave the tables SQLite holds
/// after a real migration: the same CHECKs on the same columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_read_from_the_migrations_are_the_ones_sqlite_holds() {
    let dir = tempfile::tempdir().unwrap();
    drop(sqlite_backend(&dir).await);
    let conn = rusqlite::Connection::open(dir.path().join("store.db")).unwrap();
    let mut schema = conn
        .prepare("SELECT sql FROM sqlite_master WHERE type = 'table' AND name LIKE 'idempotency_%'")
        .unwrap();
    let mut held = BTreeMap::new();
    for sql in schema.query_map([], |row| row.get::<_, String>(0)).unwrap() {
        for stmt in statements(&sql.unwrap()) {
            apply(&mut held, &stmt);
        }
    }
    let read = in_force("sqlite");
    let checks = |tables: &BTreeMap<String, Table>| -> BTreeMap<String, Vec<(String, String)>> {
        tables
            .iter()
            .map(|(name, t)| {
                let mut c: Vec<_> = t
                    .checks
                    .iter()
                    .map(|c| (c.column.clone(), c.expr.clone()))
                    .collect();
                c.sort();
                (name.clone(), c)
            })
            .collect()
    };
    assert_eq!(checks(&read), checks(&held));
}
