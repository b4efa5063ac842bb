//! The record rules where a statement must state them in SQL.
//!
//! Decisions about one record are made in Rust by [`idemgate_core::record`].
//! Some statements must still pick rows in the database: PostgreSQL's
//! completion (one statement, no read first), the guards that keep a change
//! off a record that changed since it was read, the replay counts, and the
//! sweeper's and the listings' selections. Their conditions are built here,
//! once, by asking the rules which states they accept, and both backends
//! write them through [`expand`]: neither spells a state list of its own, so
//! they cannot disagree with the rules or with each other. Each condition is
//! first a predicate ([`fenceable`], [`leased`], ...) that its SQL is spelled
//! from, and which the in-memory backend asks as it is. The story suite
//! covers each condition on every backend. The states, transitions and
//! actors statements write as literals are spelled here too ([`state`],
//! [`transition`], [`actor`]), by the enums, so none spells its own.
//!
//! Expiry times are always computed in Rust ([`record::completion_expiry`],
//! [`record::unknown_expiry`]) from the ttl stored at claim time, except in
//! PostgreSQL's single-statement completion, which writes
//! [`completion_expiry`]: `now + ttl_ms`. That equals the saturating Rust
//! sum for every stored record, because a claim's `ttl_ms` is validated
//! against [`idemgate_core::limits::MAX_TTL_MS`] before it is stored.

use std::sync::LazyLock;

use idemgate_core::record::{self, State, Transition};

use crate::records::Actor;

/// A state as an SQL literal, spelled by [`State::as_str`]: no statement
/// spells a state of its own.
pub fn state(s: State) -> String {
    quoted(s.as_str())
}

/// A transition as an SQL literal ([`Transition::as_str`]).
pub fn transition(t: Transition) -> String {
    quoted(t.as_str())
}

/// One of the store's own actors as an SQL literal ([`Actor::as_str`]).
pub fn actor(a: &Actor) -> String {
    quoted(a.as_str())
}

/// The enums' spellings are lowercase words and underscores: a quote
/// around them makes a literal; a name with a quote in it (only an
/// operator's, which is always a parameter) is doubled all the same.
fn quoted(spelling: &str) -> String {
    format!("'{}'", spelling.replace('\'', "''"))
}

/// `state = '...'` or `state IN (...)` for the states `accepted` admits, in
/// [`State::ALL`] order. One state is written with `=`: that is the form a
/// partial index on that state (`WHERE state = 'in_progress'`) is matched
/// against, and SQLite does not match `IN` with a single value to it.
fn states_where(accepted: impl Fn(State) -> bool) -> String {
    let states: Vec<String> = State::ALL
        .into_iter()
        .filter(|s| accepted(*s))
        .map(state)
        .collect();
    match states.as_slice() {
        [one] => format!("state = {one}"),
        many => format!("state IN ({})", many.join(", ")),
    }
}

/// The state and archive half of [`record::may_fence`] (the fence half is the
/// statement's own `fence = $n`): complete, release and mark-unknown act only
/// on such a record.
pub fn fenceable(state: State, archived: bool) -> bool {
    !archived && record::may_fence(state, 1, 1)
}

/// The state and archive half of [`record::may_abandon`] (the attempt half is
/// the statement's own join): the sweeper releases an abandoned claim that
/// landed late only while it is such a record.
pub fn abandonable(state: State, archived: bool) -> bool {
    !archived && record::may_abandon(state, Some("attempt"), "attempt")
}

/// A record whose stored response [`record::decide_claim`] may replay: only
/// such a record counts replays.
pub fn replayable(state: State) -> bool {
    state == State::Completed
}

/// A record with a lease that can run out (the sweeper's first phase and the
/// stuck listing).
pub fn leased(state: State) -> bool {
    state == State::InProgress
}

/// An unknown record (the unknown listing and the monitoring).
pub fn unknown(state: State) -> bool {
    state == State::Unknown
}

/// [`fenceable`] in SQL.
pub static FENCEABLE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} AND archived_at IS NULL",
        states_where(|s| fenceable(s, false))
    )
});

/// [`abandonable`] in SQL.
pub static ABANDONABLE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} AND archived_at IS NULL",
        states_where(|s| abandonable(s, false))
    )
});

/// [`replayable`] in SQL.
pub static REPLAYABLE: LazyLock<String> = LazyLock::new(|| states_where(replayable));

/// [`leased`] in SQL.
pub static LEASED: LazyLock<String> = LazyLock::new(|| states_where(leased));

/// [`unknown`] in SQL.
pub static UNKNOWN: LazyLock<String> = LazyLock::new(|| states_where(unknown));

/// [`record::completion_expiry`] in SQL, for the statement that completes
/// without reading first; `now` is the statement's parameter for now.
pub fn completion_expiry(now: &str) -> String {
    format!("{now} + ttl_ms")
}

/// What the monitoring samples ([`crate::backend::OpenRecords`]), for both
/// backends: columns `oldest_in_progress`, `unknown`, `oldest_unknown`.
/// Each figure is its own subquery, which reads only its state's partial
/// index and rows: SQLite answers one query over `{leased} OR {unknown}`
/// by reading the whole table, every sweeper pass.
pub static OPEN_RECORDS: LazyLock<String> = LazyLock::new(|| {
    expand(
        "SELECT (SELECT min(created_at) FROM idempotency_records WHERE {leased}) AS oldest_in_progress, \
         (SELECT count(*) FROM idempotency_records WHERE {unknown} AND archived_at IS NULL) AS unknown, \
         (SELECT min(created_at) FROM idempotency_records WHERE {unknown} AND archived_at IS NULL) AS oldest_unknown",
    )
});

/// `template` with `{fenceable}`, `{abandonable}`, `{replayable}`, `{leased}`
/// and `{unknown}` replaced by their conditions.
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
    fn the_literals_are_the_enums_spellings() {
        assert_eq!(state(State::InProgress), "'in_progress'");
        assert_eq!(transition(Transition::LeaseExpired), "'lease_expired'");
        assert_eq!(actor(&Actor::Filter), "'filter'");
        assert_eq!(actor(&Actor::Named("o'brien".into())), "'o''brien'");
    }

    /// Every `'...'` literal in the store's statements that spells a
    /// state, a transition or one of the store's actors: none may, they are
    /// built from the enums. Comments and the unit tests (which state the
    /// expected SQL) are not statements.
    #[test]
    fn no_statement_spells_a_state_a_transition_or_an_actor() {
        let spellings: Vec<String> = (State::ALL.into_iter().map(state))
            .chain(Transition::ALL.into_iter().map(transition))
            .chain(Actor::RESERVED.iter().map(actor))
            .collect();
        let mut dirs = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        let mut found = Vec::new();
        let mut read = 0;
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for path in entries.flatten().map(|e| e.path()) {
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let rust = path.extension().is_some_and(|e| e == "rs");
                if !rust || path.file_name().is_some_and(|n| n == "tests.rs") {
                    continue;
                }
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                read += 1;
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                    for s in spellings.iter().filter(|s| line.contains(s.as_str())) {
                        found.push(format!("{}: {s} in {line}", path.display()));
                    }
                }
            }
        }
        assert!(read > 10, "the store's sources were not found");
        assert_eq!(found, Vec::<String>::new());
    }

    #[test]
    fn expanding_leaves_no_placeholder_behind() {
        let sql = expand("WHERE {fenceable} OR {abandonable} OR {replayable} OR {leased} OR {unknown}");
        assert!(!sql.contains('{'), "{sql}");
    }
}
