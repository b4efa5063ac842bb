//! The statements SQLite and PostgreSQL run word for word, but for their
//! placeholders: each is written once, with SQLite's (`?1`), and
//! PostgreSQL's text is rendered from it with its own (`$1`). A statement
//! whose words differ between the two (a cast, a lock, a batch) stays in
//! its backend.
//!
//! The text is SQLite's and not PostgreSQL's because SQLite reads `$1` as
//! a named parameter, numbered by where it first appears, not by its
//! digits; PostgreSQL has no `?1` at all.

use std::sync::LazyLock;

use idemgate_core::record::State;

use crate::conditions;
use crate::row_mapping::record_list;

/// A statement's text in each dialect, rendered once.
pub struct SharedStatement {
    sqlite: LazyLock<String>,
    postgres: LazyLock<String>,
}

impl SharedStatement {
    /// The text with SQLite's placeholders, `?1`.
    pub fn sqlite(&self) -> &str {
        &self.sqlite
    }

    /// The text with PostgreSQL's placeholders, `$1`.
    pub fn postgres(&self) -> &str {
        &self.postgres
    }
}

/// A [`SharedStatement`] from its text in SQLite's placeholders.
macro_rules! shared {
    ($text:expr) => {
        SharedStatement {
            sqlite: LazyLock::new(|| $text),
            postgres: LazyLock::new(|| numbered_dollars(&$text)),
        }
    };
}

/// `sql` with each `?N` written `$N`. No shared statement has a `?` of its
/// own (in a literal or an operator): the tests check each text.
fn numbered_dollars(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        let numbered = c == '?' && chars.peek().is_some_and(char::is_ascii_digit);
        out.push(if numbered { '$' } else { c });
    }
    out
}

/// The current record, `?1`, completed: `?2` its fence, `?3` status, `?4`
/// headers, `?5` body, `?6` whether the body is stored, `?7` now (also
/// the lease's end), `?8` when it expires, `?9` the id of the key that
/// sealed the response.
pub static COMPLETE_RECORD: SharedStatement = shared!(format!(
    "UPDATE idempotency_records SET state = {}, fence = ?2, response_status = ?3, \
     response_headers = ?4, response_body = ?5, body_stored = ?6, completed_at = ?7, \
     expires_at = ?8, lease_until = ?7, response_key = ?9 WHERE scope_digest = ?1",
    conditions::state(State::Completed)
));

/// The current record, `?1`, archived at `?2`: its body dropped.
pub static ARCHIVE_RECORD: SharedStatement = shared!(String::from(
    "UPDATE idempotency_records SET archived_at = ?2, response_body = NULL WHERE scope_digest = ?1"
));

/// Moves the current generation of `?1` to the history: `?2` how it
/// ended, `?3` now. The body is not kept.
pub static TO_HISTORY: SharedStatement = shared!(format!(
    "INSERT INTO idempotency_history ({}, ended_at) SELECT {}, ?3 FROM idempotency_records \
     WHERE scope_digest = ?1",
    record_list(|_| None),
    record_list(|c| match c {
        "state" => Some("?2".into()),
        "response_body" => Some("NULL".into()),
        _ => None,
    })
));

/// The current record of `?1`, gone (its generation is in the history).
pub static DELETE_RECORD: SharedStatement = shared!(String::from(
    "DELETE FROM idempotency_records WHERE scope_digest = ?1"
));

/// Remembers that the filter abandoned attempt `?8` of the scope `?2..?7`
/// (key `?1`), at `?9`.
pub static REMEMBER_ABANDON: SharedStatement = shared!(String::from(
    "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, principal, \
     route, namespace, idem_key, attempt, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
     ON CONFLICT DO NOTHING"
));

/// Forgets the abandoned attempts remembered at `?1` or before.
pub static FORGET_ABANDONED: SharedStatement =
    shared!(String::from("DELETE FROM idempotency_abandoned WHERE at <= ?1"));

#[cfg(test)]
mod tests {
    use super::*;

    /// Each shared statement, the text SQLite runs and the text PostgreSQL runs.
    fn every() -> [(&'static SharedStatement, &'static str, &'static str); 6] {
        [
            (
                &COMPLETE_RECORD,
                "UPDATE idempotency_records SET state = 'completed', fence = ?2, response_status = ?3, \
                 response_headers = ?4, response_body = ?5, body_stored = ?6, completed_at = ?7, \
                 expires_at = ?8, lease_until = ?7, response_key = ?9 WHERE scope_digest = ?1",
                "UPDATE idempotency_records SET state = 'completed', fence = $2, response_status = $3, \
                 response_headers = $4, response_body = $5, body_stored = $6, completed_at = $7, \
                 expires_at = $8, lease_until = $7, response_key = $9 WHERE scope_digest = $1",
            ),
            (
                &ARCHIVE_RECORD,
                "UPDATE idempotency_records SET archived_at = ?2, response_body = NULL WHERE scope_digest = ?1",
                "UPDATE idempotency_records SET archived_at = $2, response_body = NULL WHERE scope_digest = $1",
            ),
            (
                &TO_HISTORY,
                "INSERT INTO idempotency_history (scope_version, tenant, principal, route, namespace, \
                 idem_key, state, fingerprint, fence, lease_until, ttl_ms, release_on_unknown, \
                 response_status, response_headers, response_body, body_stored, created_at, completed_at, \
                 expires_at, archived_at, replay_count, generation, attempt, response_key, ended_at) \
                 SELECT scope_version, tenant, principal, route, namespace, idem_key, ?2, fingerprint, \
                 fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, NULL, \
                 body_stored, created_at, completed_at, expires_at, archived_at, replay_count, generation, \
                 attempt, response_key, ?3 FROM idempotency_records WHERE scope_digest = ?1",
                "INSERT INTO idempotency_history (scope_version, tenant, principal, route, namespace, \
                 idem_key, state, fingerprint, fence, lease_until, ttl_ms, release_on_unknown, \
                 response_status, response_headers, response_body, body_stored, created_at, completed_at, \
                 expires_at, archived_at, replay_count, generation, attempt, response_key, ended_at) \
                 SELECT scope_version, tenant, principal, route, namespace, idem_key, $2, fingerprint, \
                 fence, lease_until, ttl_ms, release_on_unknown, response_status, response_headers, NULL, \
                 body_stored, created_at, completed_at, expires_at, archived_at, replay_count, generation, \
                 attempt, response_key, $3 FROM idempotency_records WHERE scope_digest = $1",
            ),
            (
                &DELETE_RECORD,
                "DELETE FROM idempotency_records WHERE scope_digest = ?1",
                "DELETE FROM idempotency_records WHERE scope_digest = $1",
            ),
            (
                &REMEMBER_ABANDON,
                "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, principal, \
                 route, namespace, idem_key, attempt, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                 ON CONFLICT DO NOTHING",
                "INSERT INTO idempotency_abandoned (scope_digest, scope_version, tenant, principal, \
                 route, namespace, idem_key, attempt, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT DO NOTHING",
            ),
            (
                &FORGET_ABANDONED,
                "DELETE FROM idempotency_abandoned WHERE at <= ?1",
                "DELETE FROM idempotency_abandoned WHERE at <= $1",
            ),
        ]
    }

    #[test]
    fn each_backend_runs_the_text_of_its_own_placeholders() {
        for (statement, sqlite, postgres) in every() {
            assert_eq!(statement.sqlite(), sqlite);
            assert_eq!(statement.postgres(), postgres);
            assert!(!statement.sqlite().contains('$'), "{sqlite}");
            assert!(!statement.postgres().contains('?'), "{postgres}");
        }
    }

    #[test]
    fn only_a_question_mark_before_a_digit_is_a_placeholder() {
        assert_eq!(numbered_dollars("a = ?1 AND b = ?12"), "a = $1 AND b = $12");
        assert_eq!(numbered_dollars("? ?a ?"), "? ?a ?");
        assert_eq!(numbered_dollars("'é' = ?3"), "'é' = $3");
    }
}
