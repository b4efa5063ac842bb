//! The record's identity (semantics §2). STUB: signatures only.

use serde::{Deserialize, Serialize};

use crate::key::Key;

pub const SCOPE_VERSION: &str = "v1";
/// Tenant and principal of an anonymous policy, or principal when none is configured.
pub const EVERYONE: &str = "*";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Namespace {
    /// Keys sent by clients.
    #[serde(rename = "u")]
    Client,
    /// Reserved for keys minted by servers calling the store directly.
    #[serde(rename = "s")]
    Server,
}

/// `(scope_version, tenant, principal, route, namespace, key)`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Scope {
    version: String,
    tenant: String,
    principal: String,
    route: String,
    namespace: Namespace,
    key: Key,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeError {
    Empty(&'static str),
    TooLong(&'static str),
    ControlCharacter(&'static str),
    UnsupportedVersion,
}

impl Scope {
    pub fn new(_tenant: &str, _principal: &str, _route: &str, _namespace: Namespace, _key: Key) -> Result<Scope, ScopeError> {
        todo!()
    }
    pub fn version(&self) -> &str { &self.version }
    pub fn tenant(&self) -> &str { &self.tenant }
    pub fn principal(&self) -> &str { &self.principal }
    pub fn route(&self) -> &str { &self.route }
    pub fn namespace(&self) -> Namespace { self.namespace }
    pub fn key(&self) -> &Key { &self.key }
    /// Unambiguous, length-prefixed encoding of the whole tuple.
    pub fn encode(&self) -> Vec<u8> { todo!() }
    pub fn digest(&self) -> [u8; 32] { todo!() }
    /// A short hash that identifies the record in logs without the raw key.
    pub fn log_id(&self) -> String { todo!() }
}
