//! The key of a current record's row. Both the column mapping and the
//! sealing (whose ciphertexts are bound to their record) name records by
//! it, so it sits below both.

use idemgate_core::scope::Scope;

use crate::error::{Result, StoreError};

/// A current record's primary key (`scope_digest`): the SHA-256 of its
/// scope ([`Scope::digest`]). 32 bytes compare faster and index smaller than
/// the six scope columns, whose first five are the same for every key of a
/// tenant's route; the columns are still stored, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeDigest(pub [u8; 32]);

impl ScopeDigest {
    pub fn of(s: &Scope) -> ScopeDigest {
        ScopeDigest(s.digest())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<ScopeDigest> {
        <[u8; 32]>::try_from(bytes)
            .map(ScopeDigest)
            .map_err(|_| StoreError::Corrupt(format!("scope_digest of {} bytes", bytes.len())))
    }
}

/// Lowercase hex, as logs name a row: `WHERE scope_digest = x'…'` (SQLite)
/// or `'\x…'` (PostgreSQL) finds it.
impl std::fmt::Display for ScopeDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}
