//! The `Idempotency-Key` header (contract §1).
//!
//! A request carries at most one `Idempotency-Key` field line. Its value is an
//! RFC 9651 sf-string (`"8e03…"`) or, unless the policy is strict, the same
//! characters as a bare token; both spell the same key. After unquoting, a key
//! is `min_len..=max_len` (at most 255) characters of visible ASCII
//! (0x21–0x7E) other than `"` and `\`. Everything else is a [`KeyError`],
//! never a panic, whatever bytes arrive. Error messages never repeat the key.

use serde::{Deserialize, Serialize};

/// The longest key any policy may accept.
pub const MAX_KEY_LEN: usize = 255;

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
        KeyRules {
            strict: false,
            min_len: 1,
            max_len: MAX_KEY_LEN,
        }
    }
}

/// A valid key: 1–255 visible ASCII characters (0x21–0x7E), no `"`, no `\`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    TooShort {
        min: usize,
    },
    TooLong {
        max: usize,
    },
    /// A character outside 0x21–0x7E, or `"` / `\` inside the key.
    BadCharacter,
}

impl Key {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an RFC 9651 sf-string, for responses that carry it.
    pub fn to_sf_string(&self) -> String {
        // A valid key holds neither `"` nor `\`, so nothing needs escaping.
        format!("\"{}\"", self.0)
    }

    /// Checks an unquoted key against `rules`.
    fn validate(s: String, rules: &KeyRules) -> Result<Key, KeyError> {
        if !s.chars().all(|c| matches!(c, '!'..='~') && c != '"' && c != '\\') {
            return Err(KeyError::BadCharacter);
        }
        let min = rules.min_len.max(1);
        let max = rules.max_len.min(MAX_KEY_LEN);
        // Only ASCII is left, so bytes are characters.
        if s.len() < min {
            return Err(KeyError::TooShort { min });
        }
        if s.len() > max {
            return Err(KeyError::TooLong { max });
        }
        Ok(Key(s))
    }
}

impl TryFrom<String> for Key {
    type Error = KeyError;

    /// Validates an already unquoted key with the default rules.
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Key::validate(s, &KeyRules::default())
    }
}

impl From<Key> for String {
    fn from(k: Key) -> String {
        k.0
    }
}

/// Parses the raw values of every `Idempotency-Key` field line of a request.
/// `Ok(None)`: no field at all.
pub fn parse_key(fields: &[&[u8]], rules: &KeyRules) -> Result<Option<Key>, KeyError> {
    let value = match fields {
        [] => return Ok(None),
        [one] => *one,
        _ => return Err(KeyError::Repeated),
    };
    let value = std::str::from_utf8(value).map_err(|_| KeyError::NotUtf8)?;
    let value = value.trim_matches([' ', '\t']);
    let unquoted = match value.strip_prefix('"') {
        Some(rest) => unquote(rest)?,
        None if rules.strict => return Err(KeyError::BadSyntax),
        None => value.to_string(),
    };
    Key::validate(unquoted, rules).map(Some)
}

/// The content of an sf-string whose opening `"` is already consumed.
fn unquote(rest: &str) -> Result<String, KeyError> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' if chars.as_str().is_empty() => return Ok(out),
            '"' => return Err(KeyError::BadSyntax),
            // `\"` and `\\` are legal sf-string syntax; the characters they
            // stand for are then refused as key characters.
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => out.push(escaped),
                _ => return Err(KeyError::BadSyntax),
            },
            other => out.push(other),
        }
    }
    // No closing quote.
    Err(KeyError::BadSyntax)
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::Repeated => f.write_str("send the Idempotency-Key header once; this request has more than one"),
            KeyError::NotUtf8 | KeyError::BadCharacter => f.write_str(
                "the Idempotency-Key may contain only visible ASCII characters (0x21-0x7E) other than '\"' and '\\'",
            ),
            KeyError::BadSyntax => f.write_str(
                "the Idempotency-Key must be a structured-field string, e.g. \"8e03978e-40d5-43e8-bc93-6894a57f9324\"",
            ),
            KeyError::TooShort { min: 1 } => f.write_str("the Idempotency-Key must not be empty"),
            KeyError::TooShort { min } => write!(f, "the Idempotency-Key must be at least {min} characters"),
            KeyError::TooLong { max } => write!(f, "the Idempotency-Key must be at most {max} characters"),
        }
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LOOSE: KeyRules = KeyRules {
        strict: false,
        min_len: 1,
        max_len: 255,
    };
    const STRICT: KeyRules = KeyRules {
        strict: true,
        min_len: 1,
        max_len: 255,
    };
    const SHORT: KeyRules = KeyRules {
        strict: false,
        min_len: 8,
        max_len: 16,
    };

    fn one(value: &[u8], rules: &KeyRules) -> Result<Option<String>, KeyError> {
        parse_key(&[value], rules).map(|k| k.map(String::from))
    }

    macro_rules! case {
        ($name:ident, $value:expr, $rules:expr, ok $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(one($value, &$rules), Ok(Some($want.to_string())));
            }
        };
        ($name:ident, $value:expr, $rules:expr, err $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(one($value, &$rules), Err($want));
            }
        };
    }

    case!(a_quoted_key_is_unquoted, b"\"8e03-abc\"", LOOSE, ok "8e03-abc");
    case!(a_bare_key_is_accepted_when_not_strict, b"8e03-abc", LOOSE, ok "8e03-abc");
    case!(a_bare_key_is_refused_when_strict, b"8e03-abc", STRICT, err KeyError::BadSyntax);
    case!(a_quoted_key_is_accepted_when_strict, b"\"8e03-abc\"", STRICT, ok "8e03-abc");
    case!(surrounding_spaces_and_tabs_are_trimmed, b" \t\"abc\" \t", STRICT, ok "abc");
    case!(surrounding_spaces_around_a_bare_key_are_trimmed, b"  abc ", LOOSE, ok "abc");
    case!(a_single_character_key_is_accepted, b"x", LOOSE, ok "x");
    case!(every_visible_character_but_quote_and_backslash_is_accepted, b"!#$%&'()*+,-./09:;<=>?@AZ[]^_`az{|}~", LOOSE, ok "!#$%&'()*+,-./09:;<=>?@AZ[]^_`az{|}~");
    case!(a_key_of_255_characters_is_accepted, "k".repeat(255).as_bytes(), LOOSE, ok "k".repeat(255));
    case!(a_key_of_256_characters_is_rejected, "k".repeat(256).as_bytes(), LOOSE, err KeyError::TooLong { max: 255 });
    case!(a_quoted_key_of_255_characters_is_accepted, format!("\"{}\"", "q".repeat(255)).as_bytes(), STRICT, ok "q".repeat(255));
    case!(a_quoted_key_of_256_characters_is_rejected, format!("\"{}\"", "q".repeat(256)).as_bytes(), STRICT, err KeyError::TooLong { max: 255 });
    case!(a_key_shorter_than_the_policy_minimum_is_rejected, b"abcdefg", SHORT, err KeyError::TooShort { min: 8 });
    case!(a_key_at_the_policy_minimum_is_accepted, b"abcdefgh", SHORT, ok "abcdefgh");
    case!(a_key_longer_than_the_policy_maximum_is_rejected, b"\"abcdefghijklmnopq\"", SHORT, err KeyError::TooLong { max: 16 });
    case!(an_empty_value_is_too_short, b"", LOOSE, err KeyError::TooShort { min: 1 });
    case!(a_blank_value_is_too_short, b" \t ", LOOSE, err KeyError::TooShort { min: 1 });
    case!(an_empty_sf_string_is_too_short, b"\"\"", STRICT, err KeyError::TooShort { min: 1 });
    case!(a_space_inside_a_quoted_key_is_a_bad_character, b"\"a b\"", LOOSE, err KeyError::BadCharacter);
    case!(a_space_inside_a_bare_key_is_a_bad_character, b"a b", LOOSE, err KeyError::BadCharacter);
    case!(a_tab_inside_a_key_is_a_bad_character, b"a\tb", LOOSE, err KeyError::BadCharacter);
    case!(a_control_character_is_a_bad_character, b"ab\x01c", LOOSE, err KeyError::BadCharacter);
    case!(a_nul_byte_is_a_bad_character, b"\"ab\x00c\"", LOOSE, err KeyError::BadCharacter);
    case!(del_is_a_bad_character, b"abc\x7f", LOOSE, err KeyError::BadCharacter);
    case!(non_ascii_utf8_is_a_bad_character, "clé".as_bytes(), LOOSE, err KeyError::BadCharacter);
    case!(non_utf8_bytes_are_rejected, b"abc\xff\xfe", LOOSE, err KeyError::NotUtf8);
    case!(non_utf8_bytes_inside_quotes_are_rejected, b"\"abc\xc3\"", STRICT, err KeyError::NotUtf8);
    case!(an_escaped_quote_is_a_bad_character, b"\"a\\\"b\"", LOOSE, err KeyError::BadCharacter);
    case!(an_escaped_backslash_is_a_bad_character, b"\"a\\\\b\"", LOOSE, err KeyError::BadCharacter);
    case!(any_other_escape_is_bad_syntax, b"\"a\\nb\"", LOOSE, err KeyError::BadSyntax);
    case!(a_trailing_backslash_is_bad_syntax, b"\"ab\\", LOOSE, err KeyError::BadSyntax);
    case!(an_unterminated_sf_string_is_bad_syntax, b"\"abc", LOOSE, err KeyError::BadSyntax);
    case!(a_lone_quote_is_bad_syntax, b"\"", LOOSE, err KeyError::BadSyntax);
    case!(text_after_the_closing_quote_is_bad_syntax, b"\"abc\"def", LOOSE, err KeyError::BadSyntax);
    case!(two_sf_strings_are_bad_syntax, b"\"abc\", \"def\"", LOOSE, err KeyError::BadSyntax);
    case!(a_quote_inside_a_bare_key_is_a_bad_character, b"ab\"c", LOOSE, err KeyError::BadCharacter);
    case!(a_backslash_inside_a_bare_key_is_a_bad_character, b"ab\\c", LOOSE, err KeyError::BadCharacter);

    #[test]
    fn no_field_means_no_key() {
        assert_eq!(parse_key(&[], &LOOSE), Ok(None));
    }

    #[test]
    fn two_field_lines_are_rejected_even_if_equal() {
        assert_eq!(parse_key(&[b"\"a\"", b"\"a\""], &LOOSE), Err(KeyError::Repeated));
    }

    #[test]
    fn a_quoted_and_a_bare_key_spell_the_same_key() {
        assert_eq!(one(b"\"abc\"", &LOOSE), one(b"abc", &LOOSE));
    }

    #[test]
    fn a_key_is_written_back_as_an_sf_string() {
        let key = Key::try_from("8e03-abc".to_string()).unwrap();
        assert_eq!(key.to_sf_string(), "\"8e03-abc\"");
    }

    #[test]
    fn rules_cannot_raise_the_maximum_above_255() {
        let wide = KeyRules {
            max_len: 1000,
            ..LOOSE
        };
        assert_eq!(
            one("k".repeat(256).as_bytes(), &wide),
            Err(KeyError::TooLong { max: 255 })
        );
    }

    #[test]
    fn deserializing_validates_the_key() {
        assert!(serde_json::from_str::<Key>("\"abc\"").is_ok());
        assert!(serde_json::from_str::<Key>("\"a b\"").is_err());
        assert!(serde_json::from_str::<Key>("\"\"").is_err());
        assert_eq!(serde_json::to_string(&Key("abc".into())).unwrap(), "\"abc\"");
    }

    #[test]
    fn messages_name_the_limit_and_never_the_key() {
        assert_eq!(
            KeyError::TooLong { max: 255 }.to_string(),
            "the Idempotency-Key must be at most 255 characters"
        );
        assert_eq!(
            KeyError::TooShort { min: 1 }.to_string(),
            "the Idempotency-Key must not be empty"
        );
        assert!(KeyError::TooShort { min: 8 }.to_string().contains("at least 8"));
    }

    proptest! {
        #[test]
        fn parse_key_never_panics(fields in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..4), strict: bool) {
            let refs: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
            let rules = KeyRules { strict, ..LOOSE };
            if let Ok(Some(key)) = parse_key(&refs, &rules) {
                prop_assert!((1..=255).contains(&key.as_str().len()));
            }
        }

        #[test]
        fn every_valid_key_round_trips_through_its_sf_string(key in "[!#-\\[\\]-~]{1,255}") {
            let parsed = parse_key(&[Key(key.clone()).to_sf_string().as_bytes()], &STRICT);
            prop_assert_eq!(parsed, Ok(Some(Key(key))));
        }
    }
}
