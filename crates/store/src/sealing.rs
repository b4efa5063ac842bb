//! Stored responses encrypted at rest: AES-256-GCM under keys from a file.
//!
//! A stored response (its headers and its body) is sealed when it is written
//! and opened when it is replayed or shown to an operator. Each record keeps
//! the id of the key that sealed it (`response_key`), so keys rotate without
//! rewriting the table: the key file's first key seals new responses, every
//! key in it opens old ones, and a key may leave the file once no record
//! names it any more (archiving drops bodies after `ttl_seconds`; the
//! headers of archived records stay sealed until they are purged).
//!
//! Every seal draws a fresh random 96-bit nonce. The associated data binds
//! the ciphertext to its place: the record's scope digest, the fence the
//! response was stored under (which names the completion: a later
//! generation or an operator's resolution has another), and which part it
//! is (headers or body). A ciphertext copied to another record, another
//! generation of the same key, or from the headers to the body column
//! does not open, and neither does a sealed body blanked by someone else.
//!
//! What it does not cover: the rest of the row. The status, the
//! `body_stored` flag and `response_key` itself are outside the sealed bytes
//! and the associated data, and a record without a key id is plaintext
//! (records stored before sealing was turned on are), so a writer with
//! access to the database can change a sealed response's status, or clear
//! `response_key` and write a response in clear, and it is served. Sealing
//! gives confidentiality at rest and the integrity of the sealed bytes bound
//! to their record and fence; it is not a signature of the record. Covering
//! the status and the flag needs them in the associated data, under a new
//! version label so that records sealed under `v1` still open.
//!
//! The key file: one key a line, `ID:BASE64`, where `ID` is 1–32 letters,
//! digits, `.`, `_` or `-` and `BASE64` is 32 random bytes in standard
//! base64; blank lines and lines starting with `#` are ignored. The first key
//! is the current one.
//!
//! Without a key file the store writes responses in plaintext (and says so
//! when it starts); responses sealed earlier then cannot be read.

use std::borrow::Cow;
use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;

use crate::error::{Result, StoreError};
use crate::scope_digest::ScopeDigest;

const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
/// What sealing adds to a body: the nonce in front, the tag behind.
pub const OVERHEAD: usize = NONCE_LEN + TAG_LEN;
/// The longest key id.
pub const MAX_KEY_ID_LEN: usize = 32;

/// Which part of a stored response a ciphertext holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Headers,
    Body,
}

impl Part {
    fn label(self) -> u8 {
        match self {
            Part::Headers => b'h',
            Part::Body => b'b',
        }
    }
}

struct Keys {
    /// The first key of the file: it seals.
    current: usize,
    keys: Vec<(String, Aes256Gcm)>,
}

/// The response keys, or none (responses stay plaintext). Cheap to clone.
#[derive(Clone, Default)]
pub struct Seal {
    keys: Option<Arc<Keys>>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.keys {
            None => f.write_str("Seal(off)"),
            Some(k) => write!(
                f,
                "Seal(current {:?}, {} keys)",
                k.keys[k.current].0,
                k.keys.len()
            ),
        }
    }
}

/// A response as the database holds it: the id of the key that sealed it
/// (`None`: plaintext), the headers column, and the body column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed<'a> {
    pub key_id: Option<String>,
    pub headers: String,
    pub body: Option<Cow<'a, [u8]>>,
}

fn valid_id(id: &str) -> bool {
    (1..=MAX_KEY_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The associated data: what the ciphertext is bound to.
fn aad(part: Part, key: &ScopeDigest, fence: u64) -> Vec<u8> {
    let mut aad = Vec::with_capacity(24 + 32 + 8);
    aad.extend_from_slice(b"idemgate response v1");
    aad.push(part.label());
    aad.extend_from_slice(key.as_bytes());
    aad.extend_from_slice(&fence.to_be_bytes());
    aad
}

impl Seal {
    /// No keys: responses are stored as they are.
    pub fn off() -> Seal {
        Seal::default()
    }

    pub fn is_on(&self) -> bool {
        self.keys.is_some()
    }

    /// The id of the key new responses are sealed with.
    pub fn current_id(&self) -> Option<&str> {
        self.keys.as_ref().map(|k| k.keys[k.current].0.as_str())
    }

    /// Reads a key file (see the module's documentation).
    pub fn from_file(path: &std::path::Path) -> std::result::Result<Seal, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the response key file {}: {e}", path.display()))?;
        Seal::parse(&text).map_err(|e| format!("the response key file {}: {e}", path.display()))
    }

    /// Parses a key file's text. Errors name the line, never a key.
    pub fn parse(text: &str) -> std::result::Result<Seal, String> {
        let mut keys: Vec<(String, Aes256Gcm)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = n + 1;
            let Some((id, b64)) = line.split_once(':') else {
                return Err(format!("line {n} is not ID:BASE64"));
            };
            let id = id.trim();
            if !valid_id(id) {
                return Err(format!(
                    "line {n}: a key id is 1 to {MAX_KEY_ID_LEN} letters, digits, `.`, `_` or `-`"
                ));
            }
            if keys.iter().any(|(known, _)| known == id) {
                return Err(format!("line {n}: the key id {id:?} appears twice"));
            }
            let bytes = STANDARD
                .decode(b64.trim())
                .map_err(|_| format!("line {n}: the key of {id:?} is not standard base64"))?;
            if bytes.len() != 32 {
                return Err(format!(
                    "line {n}: the key of {id:?} has {} bytes; AES-256 needs 32 (`head -c 32 /dev/urandom | base64`)",
                    bytes.len()
                ));
            }
            let cipher = Aes256Gcm::new_from_slice(&bytes)
                .map_err(|_| format!("line {n}: the key of {id:?} is unusable"))?;
            keys.push((id.to_string(), cipher));
        }
        if keys.is_empty() {
            return Err("no key in it; write one key a line as ID:BASE64".into());
        }
        Ok(Seal {
            keys: Some(Arc::new(Keys { current: 0, keys })),
        })
    }

    /// The response of the record `key` stored under `fence`, as the
    /// database holds it: sealed with the current key, or as it is.
    pub fn seal<'a>(
        &self,
        key: &ScopeDigest,
        fence: u64,
        headers_json: String,
        body: Option<&'a [u8]>,
    ) -> Result<Sealed<'a>> {
        let Some(keys) = &self.keys else {
            return Ok(Sealed {
                key_id: None,
                headers: headers_json,
                body: body.map(Cow::Borrowed),
            });
        };
        let (id, cipher) = &keys.keys[keys.current];
        let headers = STANDARD.encode(seal_part(
            cipher,
            Part::Headers,
            key,
            fence,
            headers_json.as_bytes(),
        )?);
        let body = match body {
            Some(b) => Some(Cow::Owned(seal_part(cipher, Part::Body, key, fence, b)?)),
            None => None,
        };
        Ok(Sealed {
            key_id: Some(id.clone()),
            headers,
            body,
        })
    }

    fn cipher(&self, key_id: &str) -> Result<&Aes256Gcm> {
        let Some(keys) = &self.keys else {
            return Err(StoreError::Config(format!(
                "a stored response is sealed with key {key_id:?} but the store has no response key file; \
                 start it with --response-key-file holding that key"
            )));
        };
        keys.keys
            .iter()
            .find(|(id, _)| id == key_id)
            .map(|(_, c)| c)
            .ok_or_else(|| {
                StoreError::Config(format!(
                    "a stored response is sealed with key {key_id:?}, which the response key file no longer holds"
                ))
            })
    }

    /// The headers column as written by [`Seal::seal`], opened.
    pub fn open_headers(
        &self,
        key_id: Option<&str>,
        key: &ScopeDigest,
        fence: u64,
        column: Option<String>,
    ) -> Result<Option<String>> {
        let (Some(id), Some(text)) = (key_id, column.as_deref()) else {
            return Ok(column);
        };
        let sealed = STANDARD
            .decode(text)
            .map_err(|_| StoreError::Corrupt("sealed headers are not base64".into()))?;
        let plain = open_part(self.cipher(id)?, Part::Headers, key, fence, &sealed)?;
        String::from_utf8(plain)
            .map(Some)
            .map_err(|_| StoreError::Corrupt("opened headers are not UTF-8".into()))
    }

    /// The body column of a stored body (`body_stored`) as written by
    /// [`Seal::seal`], opened. Under a key, an empty column (or a NULL one,
    /// read as empty) is refused: a sealed body, even an empty one, has at
    /// least its nonce and tag, so the column was blanked by someone else.
    pub fn open_body(
        &self,
        key_id: Option<&str>,
        key: &ScopeDigest,
        fence: u64,
        column: Vec<u8>,
    ) -> Result<Vec<u8>> {
        match key_id {
            Some(id) => open_part(self.cipher(id)?, Part::Body, key, fence, &column),
            None => Ok(column),
        }
    }
}

fn seal_part(cipher: &Aes256Gcm, part: Part, key: &ScopeDigest, fence: u64, plain: &[u8]) -> Result<Vec<u8>> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| StoreError::internal(format!("no random nonce: {e}")))?;
    let aad = aad(part, key, fence);
    let sealed = cipher
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: plain,
                aad: &aad,
            },
        )
        .map_err(|_| StoreError::internal("a response could not be sealed"))?;
    let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

fn open_part(
    cipher: &Aes256Gcm,
    part: Part,
    key: &ScopeDigest,
    fence: u64,
    sealed: &[u8],
) -> Result<Vec<u8>> {
    if sealed.len() < OVERHEAD {
        return Err(StoreError::Corrupt(
            "a sealed response is shorter than its nonce and tag".into(),
        ));
    }
    let (nonce, rest) = sealed.split_at(NONCE_LEN);
    let aad = aad(part, key, fence);
    cipher
        .decrypt(Nonce::from_slice(nonce), Payload { msg: rest, aad: &aad })
        .map_err(|_| {
            StoreError::Corrupt(
                "a sealed response does not open: altered, or moved from another record".into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const B: &str = "b:HxweHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";

    fn key(b: u8) -> ScopeDigest {
        ScopeDigest([b; 32])
    }

    #[test]
    fn a_sealed_response_opens_with_its_key_and_place() {
        let seal = Seal::parse(A).unwrap();
        let s = seal
            .seal(&key(1), 7, r#"[["a","b"]]"#.into(), Some(b"secret body"))
            .unwrap();
        assert_eq!(s.key_id.as_deref(), Some("a"));
        let body = s.body.clone().unwrap().into_owned();
        assert_eq!(body.len(), 11 + OVERHEAD);
        assert!(!body.windows(6).any(|w| w == b"secret"));
        assert!(!s.headers.contains("\"a\""));
        assert_eq!(
            seal.open_body(Some("a"), &key(1), 7, body.clone()).unwrap(),
            b"secret body"
        );
        assert_eq!(
            seal.open_headers(Some("a"), &key(1), 7, Some(s.headers.clone()))
                .unwrap()
                .as_deref(),
            Some(r#"[["a","b"]]"#)
        );
        // Another record, another fence, or the other column: no.
        assert!(seal.open_body(Some("a"), &key(2), 7, body.clone()).is_err());
        assert!(seal.open_body(Some("a"), &key(1), 8, body.clone()).is_err());
        let headers_bytes = STANDARD.decode(&s.headers).unwrap();
        assert!(seal.open_body(Some("a"), &key(1), 7, headers_bytes).is_err());
        // A flipped bit: no.
        let mut bad = body;
        bad[15] ^= 1;
        assert!(seal.open_body(Some("a"), &key(1), 7, bad).is_err());
        // A blanked column under a key: no, not an empty body.
        let err = seal.open_body(Some("a"), &key(1), 7, Vec::new()).unwrap_err();
        assert!(err.to_string().contains("shorter than its nonce"), "{err}");
    }

    #[test]
    fn an_empty_body_seals_to_its_nonce_and_tag_and_opens_empty() {
        let seal = Seal::parse(A).unwrap();
        let s = seal.seal(&key(1), 3, "[]".into(), Some(b"")).unwrap();
        let body = s.body.unwrap().into_owned();
        assert_eq!(body.len(), OVERHEAD);
        assert_eq!(seal.open_body(Some("a"), &key(1), 3, body).unwrap(), b"");
    }

    #[test]
    fn what_sealing_does_not_cover_the_key_column_and_what_lies_outside_the_bytes() {
        // The associated data names the record, the fence and the column,
        // not the status or the body-stored flag: those are the caller's
        // columns, unauthenticated. And without a key id the column is
        // plaintext, whatever the store's configuration: records stored
        // before sealing was turned on are served as they are, so a writer
        // who clears `response_key` and writes a body in clear is served too.
        let seal = Seal::parse(A).unwrap();
        assert_eq!(
            seal.open_body(None, &key(1), 7, b"forged".to_vec()).unwrap(),
            b"forged"
        );
        assert_eq!(
            seal.open_headers(None, &key(1), 7, Some("[]".into()))
                .unwrap()
                .as_deref(),
            Some("[]")
        );
    }

    #[test]
    fn two_seals_of_one_body_differ() {
        let seal = Seal::parse(A).unwrap();
        let x = seal.seal(&key(1), 1, "[]".into(), Some(b"same")).unwrap();
        let y = seal.seal(&key(1), 1, "[]".into(), Some(b"same")).unwrap();
        assert_ne!(x.body, y.body);
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let old = Seal::parse(A).unwrap();
        let sealed_by_a = old.seal(&key(1), 1, "[]".into(), Some(b"old")).unwrap();
        let rotated = Seal::parse(&format!("# b is current\n{B}\n\n{A}\n")).unwrap();
        assert_eq!(rotated.current_id(), Some("b"));
        let a_body = sealed_by_a.body.unwrap().into_owned();
        assert_eq!(
            rotated.open_body(Some("a"), &key(1), 1, a_body.clone()).unwrap(),
            b"old"
        );
        let sealed_by_b = rotated.seal(&key(1), 2, "[]".into(), Some(b"new")).unwrap();
        assert_eq!(sealed_by_b.key_id.as_deref(), Some("b"));
        // Without `a` the old record no longer opens, with a clear error.
        let b_only = Seal::parse(B).unwrap();
        let err = b_only.open_body(Some("a"), &key(1), 1, a_body).unwrap_err();
        assert!(err.to_string().contains("no longer holds"), "{err}");
    }

    #[test]
    fn without_keys_responses_stay_as_they_are() {
        let off = Seal::off();
        let s = off.seal(&key(1), 1, "[]".into(), Some(b"plain")).unwrap();
        assert_eq!(s.key_id, None);
        assert_eq!(s.body.as_deref(), Some(&b"plain"[..]));
        assert_eq!(
            off.open_body(None, &key(1), 1, b"plain".to_vec()).unwrap(),
            b"plain"
        );
        let err = off.open_body(Some("a"), &key(1), 1, vec![0; 40]).unwrap_err();
        assert!(err.to_string().contains("--response-key-file"), "{err}");
    }

    #[test]
    fn bad_key_files_are_refused_by_line_without_showing_a_key() {
        let cases = [
            ("", "no key"),
            ("# only a comment\n", "no key"),
            ("no-colon-here", "line 1 is not ID:BASE64"),
            ("bad id!:AAAA", "line 1: a key id"),
            ("a:not base64!", "not standard base64"),
            ("a:AAAA", "has 3 bytes"),
            (&format!("{A}\n{A}"), "appears twice"),
        ];
        for (text, want) in cases {
            let err = Seal::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(!err.contains("AAECAwQF"), "{err}");
        }
    }
}
