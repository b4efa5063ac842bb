//! The `Idempotency-Key` header (semantics §1). STUB: signatures only.

use serde::{Deserialize, Serialize};

/// Per-policy key syntax rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRules {
    /// Accept only the RFC 9651 sf-string form (`"…"`), not a bare token.
    pub strict: bool,
    pub min_len: usize,
    /// At most 255.
    pub max_len: usize,
}

impl Default for KeyRules {
    fn default() -> Self {
        KeyRules { strict: false, min_len: 1, max_len: 255 }
    }
}

/// A valid key: 1–255 visible ASCII characters (0x21–0x7E), no `"`, no `\`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Key(String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// More than one `Idempotency-Key` field line.
    Repeated,
    NotUtf8,
    /// Not an sf-string (or, unless strict, a bare token).
    BadSyntax,
    TooShort { min: usize },
    TooLong { max: usize },
    /// A character outside 0x21–0x7E, or `"` / `\` inside the key.
    BadCharacter,
}

impl Key {
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// The key as an RFC 9651 sf-string, for responses that carry it.
    pub fn to_sf_string(&self) -> String {
        todo!()
    }
}

impl TryFrom<String> for Key {
    type Error = KeyError;
    fn try_from(_s: String) -> Result<Self, Self::Error> {
        todo!()
    }
}

impl From<Key> for String {
    fn from(k: Key) -> String {
        k.0
    }
}

/// Parses the raw values of every `Idempotency-Key` field line of a request.
/// `Ok(None)`: no field at all.
pub fn parse_key(_fields: &[&[u8]], _rules: &KeyRules) -> Result<Option<Key>, KeyError> {
    todo!()
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
