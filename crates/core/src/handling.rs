//! How a request was handled and what became of its record: the words the
//! filter's metrics use.

/// How the request was classified, for metrics (`as_str` is the metric name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handling {
    Passed,
    Owned,
    Replayed,
    Conflict,
    Mismatch,
    Missing,
    Invalid,
    TooLarge,
    IdentityMissing,
    Expired,
    Unknown,
    StoreError,
    FailOpen,
    WouldReplay,
    WouldConflict,
    WouldReject,
    /// The store's budget of new keys for the tenant was spent; nothing was claimed.
    RateLimited,
}

impl Handling {
    pub const ALL: [Handling; 17] = [
        Handling::Passed,
        Handling::Owned,
        Handling::Replayed,
        Handling::Conflict,
        Handling::Mismatch,
        Handling::Missing,
        Handling::Invalid,
        Handling::TooLarge,
        Handling::IdentityMissing,
        Handling::Expired,
        Handling::Unknown,
        Handling::StoreError,
        Handling::FailOpen,
        Handling::WouldReplay,
        Handling::WouldConflict,
        Handling::WouldReject,
        Handling::RateLimited,
    ];

    /// Observe mode's reasons: each answer it would have given, under the
    /// outcome it counts instead ([`Handling::observed`]).
    pub const REASONS: [Handling; 9] = [
        Handling::Conflict,
        Handling::Unknown,
        Handling::Missing,
        Handling::Invalid,
        Handling::TooLarge,
        Handling::Mismatch,
        Handling::IdentityMissing,
        Handling::Expired,
        Handling::RateLimited,
    ];

    /// What observe mode counts for a request enforce mode would have
    /// answered with this problem: `would_conflict` or `would_reject`, this
    /// being its reason; a store error stays a store error (observe forwards
    /// then too, whatever `failure_mode` says).
    pub fn observed(self) -> Handling {
        match self {
            Handling::Conflict | Handling::Unknown => Handling::WouldConflict,
            Handling::StoreError => Handling::StoreError,
            _ => Handling::WouldReject,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Handling::Passed => "passed",
            Handling::Owned => "owned",
            Handling::Replayed => "replayed",
            Handling::Conflict => "conflict",
            Handling::Mismatch => "mismatch",
            Handling::Missing => "missing",
            Handling::Invalid => "invalid",
            Handling::TooLarge => "too_large",
            Handling::IdentityMissing => "identity_missing",
            Handling::Expired => "expired",
            Handling::Unknown => "unknown",
            Handling::StoreError => "store_error",
            Handling::FailOpen => "fail_open",
            Handling::WouldReplay => "would_replay",
            Handling::WouldConflict => "would_conflict",
            Handling::WouldReject => "would_reject",
            Handling::RateLimited => "rate_limited",
        }
    }
}

/// What became of an owned request's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    Completed,
    Released,
    MarkedUnknown,
    /// The claim was given up before anything was forwarded (its answer
    /// never came, or the client left while it was in flight).
    Abandoned,
    /// The store refused (stale fence) or could not be reached; the lease will
    /// turn the record unknown.
    Failed,
}

impl Settlement {
    pub const ALL: [Settlement; 5] = [
        Settlement::Completed,
        Settlement::Released,
        Settlement::MarkedUnknown,
        Settlement::Abandoned,
        Settlement::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Settlement::Completed => "completed",
            Settlement::Released => "released",
            Settlement::MarkedUnknown => "marked_unknown",
            Settlement::Abandoned => "abandoned",
            Settlement::Failed => "settle_failed",
        }
    }
}
