//! Request fingerprints (contract §3).
//!
//! A fingerprint is SHA-256 over an unambiguous encoding of the request: the
//! domain tag `idemgate-fp-v1`, method, policy name and path with query, each
//! length-prefixed; then the policy's configured headers in the policy's order,
//! each with how many times it appeared (so an absent header differs from an
//! empty one) and its length-prefixed values; then one tag byte and the body.
//! The body is last, so it needs no length and can be hashed as it streams.
//!
//! - `raw`: tag `R`, the bytes as received.
//! - `json`: the body is buffered (the caller bounds its size); if it is valid
//!   JSON (see [`crate::jcs::parse`]), the `exclude` pointers are dropped and it
//!   is hashed as tag `J` + its RFC 8785 form, otherwise as tag `R` + the raw
//!   bytes. The tags keep a raw body that happens to look canonical apart from
//!   a canonicalized one.
//! - `none`: no fingerprint at all.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::jcs;

const DOMAIN_TAG: &[u8] = b"idemgate-fp-v1";
const RAW_BODY: u8 = b'R';
const CANONICAL_JSON_BODY: u8 = b'J';

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Fingerprint([u8; 32]);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodyMode {
    #[default]
    Json,
    Raw,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FingerprintSpec {
    pub mode: BodyMode,
    /// JSON Pointers (RFC 6901) dropped before canonicalisation.
    pub exclude: Vec<String>,
    /// Lower-case request header names included in the fingerprint.
    pub headers: Vec<String>,
}

impl FingerprintSpec {
    /// Validates the policy's `fingerprint` settings. The error says which
    /// setting is wrong and how to fix it.
    pub fn from_parts(
        mode: Option<&str>,
        exclude: Vec<String>,
        headers: Vec<String>,
    ) -> Result<Self, String> {
        let mode = match mode {
            None | Some("json") => BodyMode::Json,
            Some("raw") => BodyMode::Raw,
            Some("none") => BodyMode::None,
            Some(other) => return Err(format!("mode `{other}` is not one of `json`, `raw`, `none`")),
        };
        if mode != BodyMode::Json && !exclude.is_empty() {
            return Err("`exclude` only applies with mode `json`".to_string());
        }
        if let Some(bad) = exclude.iter().find(|p| !is_json_pointer(p)) {
            return Err(format!(
                "exclude `{bad}` is not a JSON Pointer; write it like `/client_timestamp` (`~0` for `~`, `~1` for `/`)"
            ));
        }
        let mut names: Vec<String> = Vec::with_capacity(headers.len());
        for name in headers {
            let name = name.to_ascii_lowercase();
            if !crate::headers::is_header_name(&name) {
                return Err(format!(
                    "headers: `{name}` is not a header name such as `x-client-id`"
                ));
            }
            if names.contains(&name) {
                return Err(format!("headers: `{name}` is listed twice"));
            }
            names.push(name);
        }
        Ok(FingerprintSpec {
            mode,
            exclude,
            headers: names,
        })
    }
}

/// RFC 6901 syntax: empty (the whole document), or `/`-separated tokens in
/// which `~` is always followed by `0` or `1`.
fn is_json_pointer(p: &str) -> bool {
    if !(p.is_empty() || p.starts_with('/')) {
        return false;
    }
    let mut chars = p.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return false;
        }
    }
    true
}

/// An RFC 9110 field name (a token), already lower-cased.
impl Fingerprint {
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl TryFrom<String> for Fingerprint {
    type Error = String;

    /// Parses the 64 lower-case hex digits of [`Fingerprint::to_hex`].
    fn try_from(s: String) -> Result<Self, Self::Error> {
        let wrong = || "a fingerprint is 64 lower-case hex digits".to_string();
        if !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(wrong());
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(&s, &mut bytes).map_err(|_| wrong())?;
        Ok(Fingerprint(bytes))
    }
}

impl From<Fingerprint> for String {
    fn from(f: Fingerprint) -> String {
        f.to_hex()
    }
}

/// Hashes one request as its parts arrive.
#[derive(Clone)]
pub struct Fingerprinter {
    mode: BodyMode,
    exclude: Vec<String>,
    hasher: Sha256,
    /// The body so far, in `json` mode only.
    body: Vec<u8>,
}

impl std::fmt::Debug for Fingerprinter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fingerprinter")
            .field("mode", &self.mode)
            .field("buffered", &self.body.len())
            .finish_non_exhaustive()
    }
}

/// Feeds `bytes` preceded by their length, so adjacent fields cannot shift
/// into each other.
fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update(u64::try_from(bytes.len()).unwrap_or(u64::MAX).to_be_bytes());
    hasher.update(bytes);
}

impl Fingerprinter {
    /// `headers`: the spec's headers as found on the request (absent ones
    /// omitted; a header that appears on several lines, once per line).
    pub fn new(
        spec: &FingerprintSpec,
        method: &str,
        policy: &str,
        path_and_query: &str,
        headers: &[(String, Vec<u8>)],
    ) -> Self {
        let mut hasher = Sha256::new();
        field(&mut hasher, DOMAIN_TAG);
        field(&mut hasher, method.as_bytes());
        field(&mut hasher, policy.as_bytes());
        field(&mut hasher, path_and_query.as_bytes());
        hasher.update(
            u64::try_from(spec.headers.len())
                .unwrap_or(u64::MAX)
                .to_be_bytes(),
        );
        for name in &spec.headers {
            let values: Vec<&[u8]> = headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_slice())
                .collect();
            field(&mut hasher, name.as_bytes());
            hasher.update(u64::try_from(values.len()).unwrap_or(u64::MAX).to_be_bytes());
            for value in values {
                field(&mut hasher, value);
            }
        }
        if spec.mode == BodyMode::Raw {
            hasher.update([RAW_BODY]);
        }
        Fingerprinter {
            mode: spec.mode,
            exclude: spec.exclude.clone(),
            hasher,
            body: Vec::new(),
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        match self.mode {
            BodyMode::Raw => self.hasher.update(chunk),
            BodyMode::Json => self.body.extend_from_slice(chunk),
            BodyMode::None => {}
        }
    }

    /// `None` in mode `none`.
    pub fn finish(self) -> Option<Fingerprint> {
        let mut hasher = self.hasher;
        match self.mode {
            BodyMode::None => return None,
            BodyMode::Raw => {}
            BodyMode::Json => {
                let canonical = jcs::parse(&self.body).and_then(|mut value| {
                    for pointer in &self.exclude {
                        remove_pointer(&mut value, pointer);
                    }
                    jcs::canonicalize(&value)
                });
                match canonical {
                    Ok(canonical) => {
                        hasher.update([CANONICAL_JSON_BODY]);
                        hasher.update(canonical);
                    }
                    Err(_) => {
                        hasher.update([RAW_BODY]);
                        hasher.update(&self.body);
                    }
                }
            }
        }
        Some(Fingerprint(hasher.finalize().into()))
    }
}

/// Drops what `pointer` addresses. An object member is removed; an array
/// element becomes `null`, so the elements after it keep their indices for the
/// next pointer. The empty pointer (the whole document) leaves `null`. A
/// pointer to nothing changes nothing.
fn remove_pointer(root: &mut serde_json::Value, pointer: &str) {
    use serde_json::Value;

    let Some(path) = pointer.strip_prefix('/') else {
        *root = Value::Null;
        return;
    };
    let tokens: Vec<String> = path
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let Some((last, parents)) = tokens.split_last() else {
        return;
    };
    let mut node = root;
    for token in parents {
        let next = match node {
            Value::Object(members) => members.get_mut(token),
            Value::Array(items) => array_index(token).and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(next) => node = next,
            None => return,
        }
    }
    match node {
        Value::Object(members) => {
            members.remove(last);
        }
        Value::Array(items) => {
            if let Some(item) = array_index(last).and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

/// An RFC 6901 array index: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.is_empty()
        || (token.len() > 1 && token.starts_with('0'))
        || !token.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    token.parse().ok()
}

#[cfg(test)]
mod tests;
