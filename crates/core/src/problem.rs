//! RFC 9457 problem details (semantics §7). STUB: signatures only.

use crate::Reply;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    KeyMissing,
    KeyInvalid,
    BodyTooLarge,
    KeyReused,
    KeyExpired,
    RequestInProgress,
    OutcomeUnknown,
    ResultUnavailable,
    StoreUnavailable,
    IdentityMissing,
    // The store's own API.
    Unauthorized,
    Forbidden,
    BadRequest,
    NotFound,
}

impl ProblemKind {
    pub fn slug(self) -> &'static str { todo!() }
    pub fn status(self) -> u16 { todo!() }
    pub fn title(self) -> &'static str { todo!() }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub kind: ProblemKind,
    pub detail: String,
    pub retry_after_s: Option<u64>,
    /// Milliseconds since the epoch; rendered as RFC 3339.
    pub completed_at: Option<i64>,
    pub original_status: Option<u16>,
}

impl Problem {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem { kind, detail: detail.into(), retry_after_s: None, completed_at: None, original_status: None }
    }
    pub fn retry_after(mut self, seconds: u64) -> Self { self.retry_after_s = Some(seconds.max(1)); self }
    pub fn completed_at(mut self, ms: Option<i64>) -> Self { self.completed_at = ms; self }
    pub fn original_status(mut self, status: u16) -> Self { self.original_status = Some(status); self }
    /// The full response: status, `application/problem+json`, `Cache-Control:
    /// no-store`, `Link: <type>; rel="describedby"`, `Retry-After` when set.
    pub fn render(&self, _doc_base: &str) -> Reply { todo!() }
}
