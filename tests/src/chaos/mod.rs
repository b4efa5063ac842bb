//! The chaos run and its audit, along their seams: [`traffic`] (the
//! workers and what they sent), [`faults`] (the fault loop), [`audit`] (one
//! function per promise, over the evidence), [`judge`] (one scope's
//! executions against its store history), [`answers`] (one answer against
//! the contract) and [`report`] (what the audit found, as text).
//!
//! Workers send mixed traffic through Envoy for a fixed time (unique keys,
//! retries, concurrent duplicates, changed bodies, slow, failing, resetting
//! and uncertain upstream calls, one key shared by two tenants) to four
//! routes: two with the default policy, one with `on_unknown: release` and a
//! 2 s lease, one with `after_expiry: new` and a 2 s TTL (retried after the
//! expiry). Meanwhile a fault loop SIGKILLs and restarts store replicas,
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
//!   for the same body, `outcome-unknown` under `on_unknown: release`, a
//!   malformed or unexpected problem, a problem body with internals, a 2xx
//!   nobody executed); an execution with no claim before it, or after its
//!   generation was released; store records that disagree with the
//!   executions (completed with another status or body length, completed
//!   without an execution, released although the upstream acted, replaced
//!   before it expired, still in progress long after its lease); a completed
//!   record that does not replay byte-identical, an unknown one (where
//!   `on_unknown: conflict`) that does not answer 409 `outcome-unknown`, or
//!   any execution caused by those checks; a log line of any process that
//!   contains a raw key.

pub mod answers;
pub mod audit;
pub mod faults;
pub mod judge;
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
}

/// Every covered route of `envoy/chaos.yaml`; the first is the default.
pub const ROUTES: [Route; 4] = [
    Route {
        name: "payments.create",
        path: "/pay",
        release_on_unknown: false,
        renew_after_expiry: false,
    },
    Route {
        name: "orders.wait",
        path: "/wait",
        release_on_unknown: false,
        renew_after_expiry: false,
    },
    Route {
        name: "payments.release",
        path: "/release",
        release_on_unknown: true,
        renew_after_expiry: false,
    },
    Route {
        name: "payments.renew",
        path: "/renew",
        release_on_unknown: false,
        renew_after_expiry: true,
    },
];

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
