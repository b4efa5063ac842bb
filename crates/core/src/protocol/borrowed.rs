//! The filter's requests as it writes them: the same metadata as
//! [`ClaimRequest`](super::ClaimRequest), [`CompleteRequest`](super::CompleteRequest),
//! [`FenceRequest`](super::FenceRequest) and [`AbandonRequest`](super::AbandonRequest),
//! serialized from what the exchange already holds instead of from copies of
//! it. Each writes byte for byte what its owned twin writes (field names, order
//! and forms), which the store, of any release, reads as the owned type; the
//! tests check both against each other.

use serde::{Serialize, Serializer};

use crate::config::{AfterExpiry, OnUnknown};
use crate::fingerprint::Fingerprint;
use crate::scope::{Namespace, Scope};

/// [`Scope`] as its fields serialize.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ScopeRef<'a> {
    version: &'a str,
    tenant: &'a str,
    principal: &'a str,
    route: &'a str,
    namespace: Namespace,
    key: &'a str,
}

impl<'a> From<&'a Scope> for ScopeRef<'a> {
    fn from(scope: &'a Scope) -> ScopeRef<'a> {
        ScopeRef {
            version: scope.version(),
            tenant: scope.tenant(),
            principal: scope.principal(),
            route: scope.route(),
            namespace: scope.namespace(),
            key: scope.key().as_str(),
        }
    }
}

/// A [`Fingerprint`] as its 64 lower-case hex digits, written from the stack
/// (the owned form goes through a `String`).
#[derive(Debug, Clone, Copy)]
pub struct FingerprintHex(pub Fingerprint);

impl Serialize for FingerprintHex {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut digits = [0u8; 64];
        hex::encode_to_slice(self.0.as_bytes(), &mut digits).map_err(serde::ser::Error::custom)?;
        let text = std::str::from_utf8(&digits).map_err(serde::ser::Error::custom)?;
        serializer.serialize_str(text)
    }
}

/// [`ClaimRequest`](super::ClaimRequest)'s metadata.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ClaimRequestRef<'a> {
    pub scope: ScopeRef<'a>,
    pub fingerprint: Option<FingerprintHex>,
    pub lease_ms: u64,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    pub after_expiry: AfterExpiry,
    pub on_unknown: OnUnknown,
    pub attempt: Option<&'a str>,
    pub deadline_ms: u64,
}

/// [`CompleteRequest`](super::CompleteRequest)'s metadata.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CompleteRequestRef<'a> {
    pub scope: ScopeRef<'a>,
    pub fence: u64,
    pub status: u16,
    pub headers: &'a [(String, String)],
    pub body_stored: bool,
}

/// [`FenceRequest`](super::FenceRequest)'s metadata.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct FenceRequestRef<'a> {
    pub scope: ScopeRef<'a>,
    pub fence: u64,
}

/// [`AbandonRequest`](super::AbandonRequest)'s metadata.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct AbandonRequestRef<'a> {
    pub scope: ScopeRef<'a>,
    pub attempt: &'a str,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
