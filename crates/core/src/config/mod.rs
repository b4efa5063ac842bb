//! Plugin configuration: JSON from Envoy, parsed raw, then converted into a
//! validated [`Config`]. Unknown fields and bad values are errors that name the
//! field and say how to fix it. A minimal configuration is three lines:
//!
//! ```json
//! {"store": {"cluster": "idempotency_store", "token": "secret"},
//!  "policies": [{"name": "payments.create", "match": {"path": {"prefix": "/v1/payments"}},
//!                "tenant": {"header": "x-tenant-id"}}]}
//! ```

use std::rc::Rc;

use serde::{Deserialize, Serialize};

use crate::fingerprint::FingerprintSpec;
use crate::grpc;
use crate::handling::Settlement;
use crate::key::KeyRules;

mod matching;
mod raw;
mod sections;
mod warnings;

/// The JSON Schema (draft 2020-12) of the plugin configuration, generated
/// from the types it is read into; published as `docs/config.schema.json`.
#[cfg(feature = "schema")]
pub fn json_schema() -> serde_json::Value {
    raw::json_schema()
}

pub use matching::{Matcher, PathMatch};

pub const DEFAULT_DOC_BASE: &str = "https://idemgate.dev/problems/";

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    store: StoreConfig,
    /// Problem `type` URIs are `doc_base` + the problem's slug.
    doc_base: String,
    /// Shared with every request's exchange without copying.
    policies: Vec<Rc<Policy>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    cluster: String,
    authority: String,
    timeout_ms: u64,
    /// `Bearer <token>`, built once rather than on every store call.
    authorization: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    name: String,
    matcher: Matcher,
    require_key: bool,
    key_rules: KeyRules,
    identity: Identity,
    fingerprint: FingerprintSpec,
    ttl_ms: u64,
    lease_ms: u64,
    in_flight: InFlight,
    after_expiry: AfterExpiry,
    on_unknown: OnUnknown,
    failure_mode: FailureMode,
    release_statuses: Vec<u16>,
    max_request_body: usize,
    max_stored_body: usize,
    /// Lower-case names replayed in addition to [`BASE_REPLAY_HEADERS`].
    replay_headers: Vec<String>,
    mode: Mode,
    in_progress_retry_after_ms: u64,
    forwarding: Forwarding,
    settle: Settle,
    grpc: Option<GrpcPolicy>,
    canary: Option<Canary>,
}

/// Partial enforcement: the requests a policy in `enforce` mode enforces;
/// it observes the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Canary {
    /// Of every 10,000 keys, how many are enforced: picked by a hash of the
    /// whole scope, so a key's retries are always treated alike.
    basis_points: u16,
    /// Tenants enforced whatever their keys.
    tenants: Vec<String>,
}

impl Canary {
    fn enforces(&self, tenant: Option<&[u8]>, scope: Option<&crate::scope::Scope>) -> bool {
        let listed = tenant.is_some_and(|t| self.tenants.iter().any(|n| n.as_bytes() == t));
        if self.basis_points >= 10_000 || listed {
            return true;
        }
        let Some(scope) = scope else {
            return false;
        };
        use sha2::Digest;
        let digest = sha2::Sha256::new()
            .chain_update(CANARY_LABEL)
            .chain_update(scope.encode())
            .finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_be_bytes(first) % 10_000 < u64::from(self.basis_points)
    }
}

/// Keeps the canary's hash of a scope apart from every other hash of it.
const CANARY_LABEL: &[u8] = b"idemgate canary\0";

/// What a policy covering gRPC unary methods adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcPolicy {
    release_codes: Vec<u8>,
}

impl GrpcPolicy {
    /// What a response's `grpc-status` does to the record: `None` stores
    /// the response; otherwise the key is released or the outcome unknown.
    pub fn settles(&self, code: u8) -> Option<Settlement> {
        if grpc::UNKNOWN_CODES.contains(&code) {
            Some(Settlement::MarkedUnknown)
        } else if grpc::DEFAULT_RELEASE_CODES.contains(&code) || self.release_codes.contains(&code) {
            Some(Settlement::Released)
        } else {
            None
        }
    }
}

/// Read access only: a policy is built by [`Config::parse`], validated.
impl Policy {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn matcher(&self) -> &Matcher {
        &self.matcher
    }
    pub fn require_key(&self) -> bool {
        self.require_key
    }
    pub fn key_rules(&self) -> &KeyRules {
        &self.key_rules
    }
    pub fn identity(&self) -> &Identity {
        &self.identity
    }
    pub fn fingerprint(&self) -> &FingerprintSpec {
        &self.fingerprint
    }
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }
    pub fn in_flight(&self) -> InFlight {
        self.in_flight
    }
    pub fn after_expiry(&self) -> AfterExpiry {
        self.after_expiry
    }
    pub fn on_unknown(&self) -> OnUnknown {
        self.on_unknown
    }
    pub fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }
    /// `Some` when the policy covers gRPC unary methods.
    pub fn grpc(&self) -> Option<&GrpcPolicy> {
        self.grpc.as_ref()
    }
    pub fn release_statuses(&self) -> &[u16] {
        &self.release_statuses
    }
    pub fn max_request_body(&self) -> usize {
        self.max_request_body
    }
    pub fn max_stored_body(&self) -> usize {
        self.max_stored_body
    }
    pub fn replay_headers(&self) -> &[String] {
        &self.replay_headers
    }
    /// The configured mode; see [`Policy::mode_for`] for one request's.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The mode of one request: its tenant (as the identity source gave it)
    /// and its scope, once known. A policy with a canary enforces the
    /// tenants it lists and its share of keys, and observes the rest; a
    /// request without a usable key is enforced only for a listed tenant
    /// (or a share of 100%).
    pub fn mode_for(&self, tenant: Option<&[u8]>, scope: Option<&crate::scope::Scope>) -> Mode {
        match &self.canary {
            Some(canary) if self.mode == Mode::Enforce && !canary.enforces(tenant, scope) => Mode::Observe,
            _ => self.mode,
        }
    }
    /// How far the policy is rolled out: one of [`ROLLOUTS`], the `mode`
    /// of the `idemgate_policy_info` metric.
    pub fn rollout(&self) -> &'static str {
        match (self.mode, &self.canary) {
            (Mode::Observe, _) => "observe",
            (Mode::Enforce, Some(_)) => "canary",
            (Mode::Enforce, None) => "enforce",
        }
    }
    /// How soon a request that found its key in progress is told to come
    /// back (never later than the owner's lease ends).
    pub fn in_progress_retry_after_ms(&self) -> u64 {
        self.in_progress_retry_after_ms
    }
    pub fn forwarding(&self) -> &Forwarding {
        &self.forwarding
    }
    pub fn settle(&self) -> Settle {
        self.settle
    }
}

impl Config {
    pub fn store(&self) -> &StoreConfig {
        &self.store
    }
    /// Problem `type` URIs are `doc_base` + the problem's slug.
    pub fn doc_base(&self) -> &str {
        &self.doc_base
    }
    pub fn policies(&self) -> &[Rc<Policy>] {
        &self.policies
    }
}

impl StoreConfig {
    pub fn cluster(&self) -> &str {
        &self.cluster
    }
    pub fn authority(&self) -> &str {
        &self.authority
    }
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }
    /// `Bearer <token>`.
    pub fn authorization(&self) -> &str {
        &self.authorization
    }
}

/// Response headers that are stored and replayed for every policy.
pub const BASE_REPLAY_HEADERS: [&str; 8] = [
    "content-type",
    "content-language",
    "location",
    "etag",
    "last-modified",
    "cache-control",
    "link",
    "content-encoding",
];

/// Response headers a gRPC policy also stores and replays: what a client
/// needs to read the stored messages. A compressed message (its flag set)
/// means nothing without the encoding it was compressed with; the encodings
/// the server accepts (`grpc-accept-encoding`) only matter to a request.
pub const GRPC_REPLAY_HEADERS: [&str; 1] = ["grpc-encoding"];

/// Never stored or replayed, whatever a policy lists.
pub const NEVER_REPLAYED: [&str; 14] = [
    "set-cookie",
    "authorization",
    "content-length",
    "date",
    "server",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "idempotency-control",
];

impl Policy {
    /// Whether a response header is stored and replayed under this policy.
    pub fn replays_header(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        if NEVER_REPLAYED.contains(&name.as_str()) || name.starts_with("x-envoy-") || name.starts_with(':') {
            return false;
        }
        BASE_REPLAY_HEADERS.contains(&name.as_str())
            || (self.grpc.is_some() && GRPC_REPLAY_HEADERS.contains(&name.as_str()))
            || self.replay_headers.contains(&name)
    }

    /// Whether a gRPC response's trailer is replayed: the status and its
    /// details always, other trailing metadata if `replay_headers` lists it
    /// (the headers replayed by default, `content-type` among them, are
    /// headers, never trailers).
    pub fn replays_trailer(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        name.starts_with("grpc-") || (self.replay_headers.contains(&name) && self.replays_header(&name))
    }

    /// Whether an upstream status means "refused before acting" (release the
    /// key): errors before execution, which Stripe v1 never stores and the
    /// retry table tells clients to retry with the same key.
    pub fn releases_on(&self, status: u16) -> bool {
        DEFAULT_RELEASE_STATUSES.contains(&status) || self.release_statuses.contains(&status)
    }
}

/// Statuses that release the key whatever the policy lists: the request was
/// refused before it was acted on (bad request, credentials, rate limit...).
pub const DEFAULT_RELEASE_STATUSES: [u16; 7] = [400, 401, 403, 408, 422, 425, 429];

/// Where the tenant and principal of a request come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// One namespace for everyone on the route: an explicit opt-in.
    Anonymous,
    Sourced {
        tenant: Source,
        principal: Option<Source>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// A request header set by a trusted earlier filter (lower-case name).
    Header(String),
    /// A claim that `jwt_authn` wrote with `payload_in_metadata: <payload>`.
    Jwt { payload: String, claim: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum InFlight {
    Conflict,
    /// Let the store hold the claim up to this long for the result.
    Wait {
        max_ms: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum AfterExpiry {
    #[default]
    Reject,
    New,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnUnknown {
    #[default]
    Conflict,
    Release,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    #[default]
    Closed,
    Open,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Observe,
}

/// What [`Policy::rollout`] says: observed, enforced for a canary (and
/// observed for the rest), or enforced.
pub const ROLLOUTS: [&str; 3] = ["observe", "canary", "enforce"];

/// When the client gets the response of a request that owned its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Settle {
    /// Once the store has recorded the outcome: a retry after the answer
    /// always replays it.
    #[default]
    BeforeResponse,
    /// At once; the outcome is recorded right after, and a retry inside
    /// that window sees `request-in-progress` (or waits).
    Background,
}

/// How an owned request reaches the upstream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Forwarding {
    /// Through Envoy's router, streaming both ways: the request dies with a
    /// client that leaves, and its record is then unknown.
    #[default]
    Streaming,
    /// As the filter's own request to the upstream cluster, which outlives
    /// the client: its response is recorded whether or not anyone waits.
    Detached(Detached),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detached {
    /// The cluster to call; `None`: the route's.
    cluster: Option<String>,
    timeout_ms: u64,
    /// What the upstream call is given: `timeout_ms`, at most the lease
    /// less three store calls ([`Detached::upstream_timeout_ms`]).
    upstream_timeout_ms: u64,
    max_response_body: usize,
}

impl Detached {
    pub fn cluster(&self) -> Option<&str> {
        self.cluster.as_deref()
    }
    /// How long the upstream has to answer. It ends at least one store call
    /// (`store.timeout_ms`) before the lease does: the lease runs from the
    /// store's commit of the claim, the upstream call starts only once the
    /// claim's answer is back, and the outcome must still reach the store
    /// while the lease holds, so no other request can claim the key (or find
    /// it unknown) while the upstream may still act.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }
    /// What the filter's own upstream request is given: `timeout_ms`, under
    /// `on_unknown: release` cut to the lease less three store calls
    /// (`store.timeout_ms` each) when it would end later. The lease runs
    /// from the store's commit of the claim, and three legs may each take up
    /// to a store call: the claim's answer on its way back, the outcome
    /// waiting behind the worker's callout in flight, and the outcome on its
    /// way to the store. Cut so, an answer the upstream gives in time is
    /// stored before the lease ends, and no retry runs it again. Under
    /// `on_unknown: conflict` an outcome that arrives after the lease still
    /// completes the record it turned unknown, which no retry may claim, so
    /// nothing is cut. A lease of three store calls or less leaves
    /// `timeout_ms` as it is ([`Config::warnings`]).
    pub fn upstream_timeout_ms(&self) -> u64 {
        self.upstream_timeout_ms
    }
    /// The largest response body relayed; never below `max_stored_body`.
    pub fn max_response_body(&self) -> usize {
        self.max_response_body
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where the problem is, e.g. `policies[0].ttl_seconds`.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid configuration at `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

pub const DEFAULT_TTL_SECONDS: u64 = 24 * 60 * 60;
pub const DEFAULT_LEASE_SECONDS: u64 = 60;
pub const DEFAULT_WAIT_MAX_MS: u64 = 5_000;
/// A short hint: most requests finish within a second, and an SDK that obeys
/// `Retry-After` would otherwise wait for the whole lease.
pub const DEFAULT_IN_PROGRESS_RETRY_AFTER_MS: u64 = 1_000;
/// Below Envoy's default 1 MiB buffer limit, so the filter answers 413 itself with a problem.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 512 * 1024;
pub const DEFAULT_MAX_STORED_BODY: usize = 512 * 1024;
pub const DEFAULT_STORE_TIMEOUT_MS: u64 = 1_000;
pub const DEFAULT_DETACHED_TIMEOUT_MS: u64 = 30_000;
/// Envoy's default buffer limit (a listener's `per_connection_buffer_limit_bytes`).
pub const ENVOY_DEFAULT_BUFFER_LIMIT: usize = 1024 * 1024;
pub const DEFAULT_MAX_RESPONSE_BODY: usize = ENVOY_DEFAULT_BUFFER_LIMIT;

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        raw::parse(bytes, &|_| None)
    }

    /// Parses and validates the plugin configuration; `env` reads the
    /// environment of Envoy's VM (for `store.token_env`).
    pub fn parse_with_env(bytes: &[u8], env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        raw::parse(bytes, env)
    }

    /// The first policy whose match covers the request.
    pub fn policy_for(&self, method: &str, host: &str, path: &str) -> Option<&Rc<Policy>> {
        self.policies
            .iter()
            .find(|p| p.matcher.matches(method, host, path))
    }
}

#[cfg(test)]
mod tests;
