//! The record rules where a statement must state them in SQL.
//!
//! Decisions about one record are made in Rust by [`idemgate_core::record`].
//! Some statements must still pick rows in the database: PostgreSQL's
//! completion (one statement, no read first), the guards that keep a change
//! off a record that changed since it was read, the replay counts, and the
//! sweeper's and the listings' selections. Their conditions are built here,
//! once, by asking the rules which states they accept, and both backends
//! write them through [`expand`]: neither spells a state list of its own, so
//! they cannot disagree with the rules or with each other. The story suite
//! covers each condition on both backends.
//!
//! Expiry times are always computed in Rust ([`record::completion_expiry`],
//! [`record::unknown_expiry`]) from the ttl stored at claim time, except in
//! PostgreSQL's single-statement completion, which writes
//! [`completion_expiry`]: `now + ttl_ms`. That equals the saturating Rust
//! sum for every stored record, because a claim's `ttl_ms` is validated
//! against [`idemgate_core::limits::MAX_TTL_MS`] before it is stored.

use std::sync::LazyLock;

use idemgate_core::record::{self, State};

/// Every state, in the order of [`position`].
const STATES: [State; 3] = [State::InProgress, State::Completed, State::Unknown];

/// Where a state sits in [`STATES`]: a state added to the core is a compile
/// error here until it is listed.
#[cfg_attr(not(test), allow(dead_code))]
const fn position(s: State) -> usize {
    match s {
        State::InProgress => 0,
        State::Completed => 1,
        State::Unknown => 2,
    }
}

/// `state = '...'` or `state IN (...)` for the states `accepted` admits, in
/// [`STATES`] order. One state is written with `=`: that is the form a
/// partial index on that state (`WHERE state = 'in_progress'`) is matched
/// against, and SQLite does not match `IN` with a single value to it.
fn states_where(accepted: impl Fn(State) -> bool) -> String {
    let states: Vec<String> = STATES
        .into_iter()
        .filter(|s| accepted(*s))
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    match states.as_slice() {
        [one] => format!("state = {one}"),
        many => format!("state IN ({})", many.join(", ")),
    }
}

/// The state and archive half of [`record::may_fence`] (the fence half is the
/// statement's own `fence = $n`): complete, release and mark-unknown act only
/// on such a record.
pub static FENCEABLE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} AND archived_at IS NULL",
        states_where(|s| record::may_fence(s, 1, 1))
    )
});

/// The state and archive half of [`record::may_abandon`] (the attempt half is
/// the statement's own join): the sweeper releases an abandoned claim that
/// landed late only while it is such a record.
pub static ABANDONABLE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} AND archived_at IS NULL",
        states_where(|s| record::may_abandon(s, Some("attempt"), "attempt"))
    )
});

/// A record whose stored response [`record::decide_claim`] may replay: only
/// such a record counts replays.
pub static REPLAYABLE: LazyLock<String> = LazyLock::new(|| states_where(|s| s == State::Completed));

/// A record with a lease that can run out (the sweeper's first phase and the
/// stuck listing).
pub static LEASED: LazyLock<String> = LazyLock::new(|| states_where(|s| s == State::InProgress));

/// An unknown record (the unknown listing).
pub static UNKNOWN: LazyLock<String> = LazyLock::new(|| states_where(|s| s == State::Unknown));

/// [`record::completion_expiry`] in SQL, for the statement that completes
/// without reading first; `now` is the statement's parameter for now.
pub fn completion_expiry(now: &str) -> String {
    format!("{now} + ttl_ms")
}

/// `template` with `{fenceable}`, `{abandonable}`, `{replayable}`, `{leased}`
/// and `{unknown}` replaced by their conditions.
/// What the monitoring samples ([`crate::backend::OpenRecords`]), for both
/// backends: columns `oldest_in_progress`, `unknown`, `oldest_unknown`.
pub static OPEN_RECORDS: LazyLock<String> = LazyLock::new(|| {
    expand(
        "SELECT min(created_at) FILTER (WHERE {leased}) AS oldest_in_progress, \
         count(*) FILTER (WHERE {unknown} AND archived_at IS NULL) AS unknown, \
         min(created_at) FILTER (WHERE {unknown} AND archived_at IS NULL) AS oldest_unknown \
         FROM idempotency_records WHERE {leased} OR {unknown}",
    )
});

pub fn expand(template: &str) -> String {
    template
        .replace("{fenceable}", &FENCEABLE)
        .replace("{abandonable}", &ABANDONABLE)
        .replace("{replayable}", &REPLAYABLE)
        .replace("{leased}", &LEASED)
        .replace("{unknown}", &UNKNOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conditions_spell_the_states_the_rules_accept() {
        assert_eq!(
            *FENCEABLE,
            "state IN ('in_progress', 'unknown') AND archived_at IS NULL"
        );
        assert_eq!(*ABANDONABLE, *FENCEABLE);
        assert_eq!(*REPLAYABLE, "state = 'completed'");
        assert_eq!(*LEASED, "state = 'in_progress'");
        assert_eq!(*UNKNOWN, "state = 'unknown'");
    }

    #[test]
    fn every_state_is_listed_once() {
        for s in STATES {
            assert_eq!(STATES[position(s)], s);
        }
    }

    #[test]
    fn expanding_leaves_no_placeholder_behind() {
        let sql = expand("WHERE {fenceable} OR {abandonable} OR {replayable} OR {leased} OR {unknown}");
        assert!(!sql.contains('{'), "{sql}");
    }
}
