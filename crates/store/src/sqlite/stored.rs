//! How SQLite stores a fingerprint and an attempt id: as bytes, not as the
//! text the API speaks. A fingerprint is its 32 bytes (64 hex digits as
//! text). An attempt id of the filter's shape, 32 lower-case hex digits, `-`
//! and a counter in lower-case hex without leading zeros, is its 16 bytes
//! followed by the counter's big-endian bytes (17–24 bytes for 34–49
//! characters); any other id (the API takes 1–64 of `[0-9A-Za-z_-]`) stays
//! text. The two forms never compare equal, and a text id is stored as
//! bytes only when the bytes give it back exactly, so equality in SQL
//! (`r.attempt = a.attempt`) is equality of ids.
//!
//! An event's transition is a small integer code ([`transition_code`]), and
//! so is an actor the store writes itself ([`actor_code`]); an operator's
//! name stays text, so no name can pass for one of the store's actors. The
//! two commonest of each (`claimed` and `completed`, `filter`) are 0 and 1,
//! which SQLite keeps in the row's header alone. PostgreSQL keeps text.

use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::record::Transition;
use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::ToSql;

use crate::backend::{Actor, Result, StoreError};

const PREFIX: usize = 16;

/// A fingerprint as the column holds it.
pub(super) struct StoredFingerprint(pub(super) Option<Fingerprint>);

impl ToSql for StoredFingerprint {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match &self.0 {
            Some(f) => ToSqlOutput::Borrowed(ValueRef::Blob(f.as_bytes())),
            None => ToSqlOutput::Owned(Value::Null),
        })
    }
}

/// An attempt id as the column holds it.
pub(super) struct StoredAttempt<'a>(pub(super) Option<&'a str>);

impl ToSql for StoredAttempt<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self.0 {
            None => ToSqlOutput::Owned(Value::Null),
            Some(id) => match attempt_bytes(id) {
                Some(bytes) => ToSqlOutput::Owned(Value::Blob(bytes)),
                None => ToSqlOutput::Borrowed(ValueRef::Text(id.as_bytes())),
            },
        })
    }
}

/// The bytes of an id of the filter's shape; `None` for any other id.
pub(super) fn attempt_bytes(id: &str) -> Option<Vec<u8>> {
    let (prefix, counter) = id.split_once('-')?;
    let lower_hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    // The counter as `{:x}` writes a u64, so the bytes give the id back exactly.
    let counter_written = counter == "0" || !counter.starts_with('0');
    if prefix.len() != 2 * PREFIX || !counter_written || !lower_hex(prefix) || !lower_hex(counter) {
        return None;
    }
    let n = u64::from_str_radix(counter, 16).ok()?;
    let mut bytes = hex::decode(prefix).ok()?;
    let be = n.to_be_bytes();
    let first = be.iter().position(|b| *b != 0).unwrap_or(be.len() - 1);
    bytes.extend_from_slice(&be[first..]);
    Some(bytes)
}

/// An attempt column's value as the current schema holds it: a text id of
/// the filter's shape turned into its bytes, any other value as it is.
pub(super) fn stored_attempt(value: ValueRef<'_>) -> Value {
    let bytes = match value {
        ValueRef::Text(t) => std::str::from_utf8(t).ok().and_then(attempt_bytes),
        _ => None,
    };
    bytes.map_or_else(|| value.into(), Value::Blob)
}

/// The id whose bytes these are ([`attempt_bytes`]).
fn attempt_text(bytes: &[u8]) -> Option<String> {
    if !(PREFIX + 1..=PREFIX + 8).contains(&bytes.len()) {
        return None;
    }
    let (prefix, counter) = bytes.split_at(PREFIX);
    let n = counter.iter().fold(0u64, |n, b| (n << 8) | u64::from(*b));
    Some(format!("{}-{n:x}", hex::encode(prefix)))
}

/// A transition as the events' `transition` column holds it. Codes are
/// stored: one is never reused or changed.
pub(super) fn transition_code(t: Transition) -> i64 {
    match t {
        Transition::Claimed => 0,
        Transition::Completed => 1,
        Transition::Reclaimed => 2,
        Transition::Released => 3,
        Transition::Abandoned => 4,
        Transition::MarkedUnknown => 5,
        Transition::LeaseExpired => 6,
        Transition::Resolved => 7,
        Transition::Archived => 8,
        Transition::Purged => 9,
    }
}

/// One of the store's own actors as the events' `actor` column holds it;
/// `None` for an operator's name, which is kept as text.
pub(super) fn actor_code(actor: &Actor) -> Option<i64> {
    match actor {
        Actor::Filter => Some(0),
        Actor::Sweeper => Some(1),
        Actor::Operator => Some(2),
        Actor::Named(_) => None,
    }
}

/// A transition as the column holds it.
pub(super) struct StoredTransition(pub(super) Transition);

impl ToSql for StoredTransition {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Owned(Value::Integer(transition_code(self.0))))
    }
}

/// An actor as the column holds it.
pub(super) struct StoredActor<'a>(pub(super) &'a Actor);

impl ToSql for StoredActor<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match actor_code(self.0) {
            Some(code) => ToSqlOutput::Owned(Value::Integer(code)),
            None => ToSqlOutput::Borrowed(ValueRef::Text(self.0.as_str().as_bytes())),
        })
    }
}

/// A `transition` column's value as the current schema holds it: the text a
/// store before codes wrote turned into its code, any other value as it is
/// (and read as corrupt).
pub(super) fn stored_transition(value: ValueRef<'_>) -> Value {
    coded(value, |t| Transition::parse(t).map(transition_code))
}

/// An `actor` column's value as the current schema holds it: a reserved
/// name turned into its code, an operator's name and any other value as it is.
pub(super) fn stored_actor(value: ValueRef<'_>) -> Value {
    coded(value, |a| Actor::parse(a).as_ref().and_then(actor_code))
}

fn coded(value: ValueRef<'_>, code: impl Fn(&str) -> Option<i64>) -> Value {
    let code = match value {
        ValueRef::Text(t) => std::str::from_utf8(t).ok().and_then(code),
        _ => None,
    };
    code.map_or_else(|| value.into(), Value::Integer)
}

/// A `transition` column's value.
pub(super) fn transition(value: ValueRef<'_>) -> Result<Transition> {
    let code = value.as_i64().ok();
    (Transition::ALL.into_iter())
        .find(|t| Some(transition_code(*t)) == code)
        .ok_or_else(|| StoreError::Corrupt(format!("transition {value:?}")))
}

/// An `actor` column's value.
pub(super) fn actor(value: ValueRef<'_>) -> Result<Actor> {
    let actor = match value {
        ValueRef::Integer(code) => (Actor::RESERVED.into_iter()).find(|a| actor_code(a) == Some(code)),
        // A reserved name as text is not one the store writes.
        ValueRef::Text(t) => std::str::from_utf8(t)
            .ok()
            .and_then(Actor::parse)
            .filter(|a| actor_code(a).is_none()),
        _ => None,
    };
    actor.ok_or_else(|| StoreError::Corrupt(format!("actor {value:?}")))
}

/// A fingerprint column's value.
pub(super) fn fingerprint(value: ValueRef<'_>) -> Result<Option<Fingerprint>> {
    let bytes = match value {
        ValueRef::Null => return Ok(None),
        ValueRef::Blob(b) => <[u8; 32]>::try_from(b).ok(),
        _ => None,
    };
    bytes.map(|b| Some(Fingerprint::from_bytes(b))).ok_or_else(|| {
        StoreError::Corrupt(format!(
            "fingerprint: {:?} of {} bytes",
            value.data_type(),
            value.as_bytes().map_or(0, <[u8]>::len)
        ))
    })
}

/// An attempt column's value as the API's id.
pub(super) fn attempt_id(value: ValueRef<'_>) -> Result<Option<String>> {
    let corrupt = |what: String| StoreError::Corrupt(format!("attempt: {what}"));
    match value {
        ValueRef::Null => Ok(None),
        ValueRef::Text(t) => String::from_utf8(t.to_vec())
            .map(Some)
            .map_err(|e| corrupt(e.to_string())),
        ValueRef::Blob(b) => attempt_text(b)
            .map(Some)
            .ok_or_else(|| corrupt(format!("{} bytes", b.len()))),
        other => Err(corrupt(format!("{:?}", other.data_type()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFIX_HEX: &str = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e";

    #[test]
    fn an_id_of_the_filters_shape_is_stored_as_its_bytes_and_read_back() {
        for n in [0u64, 1, 0xff, 0x100, 0x12345, u64::MAX] {
            let id = format!("{PREFIX_HEX}-{n:x}");
            let bytes = attempt_bytes(&id).unwrap();
            assert!((17..=24).contains(&bytes.len()), "{id}: {}", bytes.len());
            assert!(bytes.len() < id.len());
            assert_eq!(
                attempt_id(ValueRef::Blob(&bytes)).unwrap().as_deref(),
                Some(id.as_str())
            );
        }
    }

    #[test]
    fn any_other_id_stays_text() {
        let upper = format!("{}-1", PREFIX_HEX.to_uppercase());
        let zero_led = format!("{PREFIX_HEX}-01");
        let short = format!("{}-1", &PREFIX_HEX[2..]);
        let too_big = format!("{PREFIX_HEX}-1{}", "0".repeat(16));
        let two_dashes = format!("{PREFIX_HEX}-1-2");
        for id in ["a1", "a-1", "", &upper, &zero_led, &short, &too_big, &two_dashes] {
            assert_eq!(attempt_bytes(id), None, "{id}");
        }
        assert_eq!(attempt_id(ValueRef::Text(b"a1")).unwrap().as_deref(), Some("a1"));
    }

    #[test]
    fn transitions_and_the_stores_actors_are_codes_and_operators_names_text() {
        let codes: std::collections::BTreeSet<i64> =
            Transition::ALL.into_iter().map(transition_code).collect();
        assert_eq!(codes.len(), Transition::ALL.len());
        for t in Transition::ALL {
            let code = stored(&StoredTransition(t));
            assert!(matches!(code, Value::Integer(_)), "{code:?}");
            assert_eq!(transition(ValueRef::from(&code)).unwrap(), t);
            assert_eq!(stored_transition(ValueRef::Text(t.as_str().as_bytes())), code);
        }
        let alice = Actor::Named("alice@example.com".into());
        // A name that spells a code is still a name.
        let one = Actor::Named("1".into());
        for a in Actor::RESERVED.iter().chain([&alice, &one]) {
            let value = stored(&StoredActor(a));
            assert_eq!(
                matches!(value, Value::Integer(_)),
                Actor::RESERVED.contains(a),
                "{value:?}"
            );
            assert_eq!(actor(ValueRef::from(&value)).unwrap(), *a);
            assert_eq!(stored_actor(ValueRef::Text(a.as_str().as_bytes())), value);
        }
    }

    #[test]
    fn an_event_column_the_store_never_writes_is_corrupt() {
        for value in [
            ValueRef::Integer(10),
            ValueRef::Integer(-1),
            ValueRef::Text(b"claimed"),
            ValueRef::Null,
        ] {
            assert!(transition(value).is_err(), "{value:?}");
        }
        for value in [
            ValueRef::Integer(3),
            ValueRef::Text(b"filter"),
            ValueRef::Text(b""),
            ValueRef::Null,
        ] {
            assert!(actor(value).is_err(), "{value:?}");
        }
        let other = stored_transition(ValueRef::Text(b"finished"));
        assert_eq!(other, Value::Text("finished".into()));
    }

    fn stored(value: &dyn ToSql) -> Value {
        match value.to_sql().unwrap() {
            ToSqlOutput::Owned(v) => v,
            ToSqlOutput::Borrowed(v) => v.into(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_fingerprint_is_its_32_bytes() {
        let f = Fingerprint::from_bytes([7; 32]);
        let stored = StoredFingerprint(Some(f));
        let out = stored.to_sql().unwrap();
        let ToSqlOutput::Borrowed(value) = out else {
            panic!("{out:?}")
        };
        assert_eq!(fingerprint(value).unwrap().map(|f| f.to_hex()), Some(f.to_hex()));
        assert!(fingerprint(ValueRef::Text(f.to_hex().as_bytes())).is_err());
        assert!(fingerprint(ValueRef::Blob(&[7; 31])).is_err());
    }
}
