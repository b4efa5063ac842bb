//! What the filter reads from Envoy for the exchange.

/// What the filter found in the request headers, read according to the policy.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    /// Path with query.
    pub path: String,
    /// Raw values of every `Idempotency-Key` field line.
    pub key_fields: Vec<Vec<u8>>,
    /// From the policy's tenant source; `None` when absent.
    pub tenant: Option<Vec<u8>>,
    pub principal: Option<Vec<u8>>,
    /// The policy's fingerprint headers that are present, in policy order.
    pub fingerprint_headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    /// The request has no body.
    pub end_of_stream: bool,
    /// Under detached forwarding, the request the filter sends itself once
    /// it owns the key; `None`: through Envoy's router.
    pub upstream: Option<super::UpstreamCall>,
    pub trace: crate::trace::Trace,
}

use crate::origin::Origin;

#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub status: u16,
    pub origin: Origin,
    pub headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    pub end_of_stream: bool,
}
