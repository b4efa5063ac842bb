//! Request fingerprints (semantics §3). STUB: signatures only.

use serde::{Deserialize, Serialize};

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
    pub fn from_parts(_mode: Option<&str>, _exclude: Vec<String>, _headers: Vec<String>) -> Result<Self, String> {
        todo!()
    }
}

impl Fingerprint {
    pub fn to_hex(&self) -> String { hex::encode(self.0) }
}

impl TryFrom<String> for Fingerprint {
    type Error = String;
    fn try_from(_s: String) -> Result<Self, Self::Error> { todo!() }
}

impl From<Fingerprint> for String {
    fn from(f: Fingerprint) -> String { f.to_hex() }
}

/// Hashes one request as its parts arrive.
pub struct Fingerprinter {}

impl Fingerprinter {
    /// `headers`: the spec's headers as found on the request (absent ones omitted).
    pub fn new(_spec: &FingerprintSpec, _method: &str, _policy: &str, _path_and_query: &str, _headers: &[(String, Vec<u8>)]) -> Self { todo!() }
    pub fn push(&mut self, _chunk: &[u8]) { todo!() }
    /// `None` in mode `none`.
    pub fn finish(self) -> Option<Fingerprint> { todo!() }
}
