//! The chaos run and its audit, along their seams: [`traffic`] (the
//! workers and what they sent), [`faults`] (the fault loop), [`mod@audit`] (one
//! function per promise, over the evidence; the retries of settled records
//! are [`recheck`]'s), [`mod@judge`] (one scope's
//! executions against its store history), [`answers`] (one answer against
//! the contract) and [`report`] (what the audit found, as text); what the
//! database failover runs add to the audit is [`failover`]'s.
//!
//! Workers send mixed traffic through Envoy for a fixed time (unique keys,
//! retries, concurrent duplicates, changed bodies, slow, failing, resetting
//! and uncertain upstream calls, one key shared by two tenants, responses
//! near and above the route's `max_stored_body`) to eight routes: two with
//! the default policy, one with `on_unknown: release` and a 2 s lease, one
//! with `after_expiry: new` and a 2 s TTL (retried after the expiry), one
//! with detached forwarding (whose slow calls' clients stop waiting), one
//! with `settle: background`, one that keeps responses up to 4 MiB, and a
//! gRPC unary method called over HTTP/2 by a gRPC client (see [`ROUTES`]):
//! its answers are gRPC statuses, and its replays come from the store's
//! replay method, each judged in gRPC's terms by the same promises. Meanwhile a fault loop SIGKILLs and restarts store replicas,
//! freezes one past the filter's store timeout (SIGSTOP, then SIGCONT),
//! restarts Envoy and resets every upstream connection. Every request and its
//! answer is recorded; the upstream logs every execution and when it arrived.
//!
//! The audit then compares three independent views — the upstream's
//! execution log, the store's whole history (every generation of every key,
//! admin lookup) and every answer a client got — and counts each broken
//! promise:
//!
//! - double executions: an execution runs in the generation claimed last
//!   before it arrived; a generation runs at most once, and a scope runs again
//!   only after each earlier execution was released (the upstream refused
//!   before acting) or, as its route's policy allows, after its generation
//!   ended unknown or with its lease run out (`on_unknown: release`) or had
//!   expired when the next one was claimed (`after_expiry: new`);
//! - burnt keys: a current generation left unknown or in progress, after the
//!   run settled, whose upstream never ran;
//! - executions of abandoned claims: the filter abandons only what it never
//!   forwarded;
//! - violations: an answer that is not what the contract allows (a replay of
//!   an execution the store did not keep or of another request body, a 422
//!   for the same body, `outcome-unknown` under `on_unknown: release`,
//!   `result-unavailable` but for a kept response longer than the route
//!   keeps, a detached response relayed past `max_response_body`, a
//!   malformed or unexpected problem, a problem body with internals, a 2xx
//!   nobody executed); an execution with no claim before it, or after its
//!   generation was released; store records that disagree with the
//!   executions (completed with another status or body length, with a body
//!   too long to keep or without one it should keep, completed
//!   without an execution, released although the upstream acted, replaced
//!   before it expired, still in progress long after its lease); a completed
//!   record that does not replay byte-identical (or, kept without its body,
//!   answer 409 `result-unavailable`), an unknown one (where `on_unknown:
//!   conflict`) that does not answer 409 `outcome-unknown`, or any execution
//!   caused by those checks; a detached request whose client left that ended
//!   unknown with no fault to lose it ([`Audit::judge_left_detached`]); a log
//!   line of any process that contains a raw key.

pub mod answers;
pub mod audit;
pub mod failover;
pub mod faults;
pub mod judge;
pub mod recheck;
pub mod report;
#[cfg(test)]
mod tests;
pub mod traffic;

pub use audit::audit;
pub use faults::{inject_faults, Faults, STALL_MS};
pub use judge::{judge, Generation, ScopeVerdict};
pub use report::Audit;
pub use traffic::{at_full_speed, worker, Sent, Traffic};

/// `(tenant, principal, route, key)`: what a record is scoped to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ScopeId {
    pub tenant: String,
    pub user: String,
    pub route: &'static str,
    pub key: String,
}

/// A policy of `envoy/chaos.yaml`, as far as the audit judges by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub name: &'static str,
    /// The path the workers send to (the policy's prefix).
    pub path: &'static str,
    /// `on_unknown: release`: a key whose outcome is unknown, or whose lease
    /// ran out, may be claimed (and executed) again.
    pub release_on_unknown: bool,
    /// `after_expiry: new`: an expired key is a first request again.
    pub renew_after_expiry: bool,
    /// `max_stored_body`: a longer response is recorded without its body,
    /// and its retries get `409 result-unavailable`.
    pub max_stored_body: usize,
    /// `forwarding: {mode: detached}`: its `max_response_body`, the longest
    /// response relayed (a longer one answers even the first request with
    /// `409 result-unavailable`). The request outlives a client that left.
    pub detached: Option<usize>,
    /// `settle: background`: the response goes out before its record lands;
    /// a retry in between gets `409 request-in-progress`.
    pub background: bool,
    /// A `grpc` policy on one unary method (`path` is the method, matched
    /// exactly): called over HTTP/2 with gRPC framing, answered with gRPC
    /// statuses (contract §10).
    pub grpc: bool,
}

/// The default `max_stored_body` (512 KiB).
pub const STORED_BODY: usize = 524_288;
/// The default detached `max_response_body` (1 MiB).
pub const RELAYED_BODY: usize = 1_048_576;
/// `max_stored_body` of `exports.large`: the most the store keeps (4 MiB).
pub const LARGE_STORED_BODY: usize = 4_194_304;

const DEFAULT: Route = Route {
    name: "payments.create",
    path: "/pay",
    release_on_unknown: false,
    renew_after_expiry: false,
    max_stored_body: STORED_BODY,
    detached: None,
    background: false,
    grpc: false,
};

/// Every covered route of `envoy/chaos.yaml`; the first is the default.
pub const ROUTES: [Route; 8] = [
    DEFAULT,
    Route {
        name: "orders.wait",
        path: "/wait",
        ..DEFAULT
    },
    Route {
        name: "payments.release",
        path: "/release",
        release_on_unknown: true,
        ..DEFAULT
    },
    Route {
        name: "payments.renew",
        path: "/renew",
        renew_after_expiry: true,
        ..DEFAULT
    },
    Route {
        name: "payments.detached",
        path: "/detached",
        detached: Some(RELAYED_BODY),
        ..DEFAULT
    },
    Route {
        name: "orders.background",
        path: "/background",
        background: true,
        ..DEFAULT
    },
    Route {
        name: "exports.large",
        path: "/large",
        max_stored_body: LARGE_STORED_BODY,
        ..DEFAULT
    },
    GRPC,
];

/// The gRPC method of `envoy/chaos.yaml` (`ledger.transfer`).
pub const GRPC: Route = Route {
    name: "ledger.transfer",
    path: "/chaos.v1.Ledger/Transfer",
    grpc: true,
    ..DEFAULT
};

impl Route {
    /// A response of `len` bytes is recorded without its body: its retries
    /// get `409 result-unavailable`.
    pub fn too_large_to_store(&self, len: usize) -> bool {
        len > self.max_stored_body
    }

    /// A response of `len` bytes is not relayed even to its own request
    /// (detached forwarding only): it gets `409 result-unavailable` too.
    pub fn too_large_to_relay(&self, len: usize) -> bool {
        self.detached.is_some_and(|max| len > max)
    }
}

/// The lease and the forwarding timeout of `payments.detached` in
/// `envoy/chaos.yaml`, in milliseconds.
pub const DETACHED_LEASE_MS: i64 = 5_000;
pub const DETACHED_TIMEOUT_MS: i64 = 4_000;

/// The TTL of `payments.renew` in `envoy/chaos.yaml`, in milliseconds.
const RENEW_TTL_MS: u64 = 2_000;

pub fn route_of(path: &str) -> &'static str {
    policy_of_path(path).name
}

fn policy_of_path(path: &str) -> Route {
    ROUTES
        .iter()
        .skip(1)
        .find(|r| path.starts_with(r.path))
        .copied()
        .unwrap_or(ROUTES[0])
}

/// The policy of a route name (the default one for a name not in the table).
pub fn policy(route: &str) -> Route {
    ROUTES
        .iter()
        .find(|r| r.name == route)
        .copied()
        .unwrap_or(ROUTES[0])
}

/// Small deterministic generator: reproducible enough, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7)
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
