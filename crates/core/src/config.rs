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
use crate::key::KeyRules;

pub const DEFAULT_DOC_BASE: &str = "https://idemgate.dev/problems/";

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub store: StoreConfig,
    /// Problem `type` URIs are `doc_base` + the problem's slug.
    pub doc_base: String,
    /// Shared with every request's exchange without copying.
    pub policies: Vec<Rc<Policy>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub token: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub name: String,
    pub matcher: Matcher,
    pub require_key: bool,
    pub key_rules: KeyRules,
    pub identity: Identity,
    pub fingerprint: FingerprintSpec,
    pub ttl_ms: u64,
    pub lease_ms: u64,
    pub in_flight: InFlight,
    pub after_expiry: AfterExpiry,
    pub on_unknown: OnUnknown,
    pub failure_mode: FailureMode,
    pub release_statuses: Vec<u16>,
    pub max_request_body: usize,
    pub max_stored_body: usize,
    /// Lower-case names replayed in addition to [`BASE_REPLAY_HEADERS`].
    pub replay_headers: Vec<String>,
    pub mode: Mode,
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
        BASE_REPLAY_HEADERS.contains(&name.as_str()) || self.replay_headers.contains(&name)
    }

    /// Whether an upstream status means "refused before acting" (release the key).
    pub fn releases_on(&self, status: u16) -> bool {
        matches!(status, 408 | 425 | 429) || self.release_statuses.contains(&status)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// Upper-case methods; empty means the default `POST` and `PATCH`.
    pub methods: Vec<String>,
    pub host: Option<String>,
    pub path: PathMatch,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
    /// `/v1/accounts/{id}/charges`: each `{…}` matches one non-empty segment.
    Template(String),
}

impl Matcher {
    pub fn matches(&self, method: &str, host: &str, path: &str) -> bool {
        let method_ok = if self.methods.is_empty() {
            method == "POST" || method == "PATCH"
        } else {
            self.methods.iter().any(|m| m == method)
        };
        let host_ok = match &self.host {
            None => true,
            Some(h) => {
                let bare = host.rsplit_once(':').map_or(host, |(h, port)| {
                    if port.bytes().all(|b| b.is_ascii_digit()) { h } else { host }
                });
                h.eq_ignore_ascii_case(host) || h.eq_ignore_ascii_case(bare)
            }
        };
        let path = path.split(['?', '#']).next().unwrap_or(path);
        method_ok && host_ok && self.path.matches(path)
    }
}

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Template(t) => {
                let mut want = t.split('/');
                let mut got = path.split('/');
                loop {
                    match (want.next(), got.next()) {
                        (None, None) => return true,
                        (Some(w), Some(g)) if w.starts_with('{') && w.ends_with('}') => {
                            if g.is_empty() {
                                return false;
                            }
                        }
                        (Some(w), Some(g)) if w == g => {}
                        _ => return false,
                    }
                }
            }
        }
    }
}

/// Where the tenant and principal of a request come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// One namespace for everyone on the route: an explicit opt-in.
    Anonymous,
    Sourced { tenant: Source, principal: Option<Source> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// A request header set by a trusted earlier filter (lower-case name).
    Header(String),
    /// A claim that `jwt_authn` wrote with `payload_in_metadata: <payload>`.
    Jwt { payload: String, claim: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InFlight {
    Conflict,
    /// Let the store hold the claim up to this long for the result.
    Wait { max_ms: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AfterExpiry {
    #[default]
    Reject,
    New,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnUnknown {
    #[default]
    Conflict,
    Release,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    #[default]
    Closed,
    Open,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Observe,
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
    ConfigError { field: field.into(), message: message.into() }
}

// ---- raw form: exactly what the JSON may say ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    store: RawStore,
    #[serde(default)]
    doc_base: Option<String>,
    policies: Vec<RawPolicy>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    cluster: String,
    #[serde(default)]
    authority: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    token: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    host: Option<String>,
    path: PathMatch,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFingerprint {
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    exclude: Vec<String>,
    #[serde(default)]
    headers: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    name: String,
    #[serde(rename = "match")]
    matcher: RawMatch,
    #[serde(default)]
    require_key: Option<bool>,
    #[serde(default)]
    strict_syntax: Option<bool>,
    #[serde(default)]
    key_min_length: Option<usize>,
    #[serde(default)]
    key_max_length: Option<usize>,
    #[serde(default)]
    anonymous: Option<bool>,
    #[serde(default)]
    tenant: Option<Source>,
    #[serde(default)]
    principal: Option<Source>,
    #[serde(default)]
    fingerprint: Option<RawFingerprint>,
    #[serde(default)]
    ttl_seconds: Option<u64>,
    #[serde(default)]
    lease_seconds: Option<u64>,
    #[serde(default)]
    in_flight: Option<String>,
    #[serde(default)]
    wait_max_ms: Option<u64>,
    #[serde(default)]
    after_expiry: Option<AfterExpiry>,
    #[serde(default)]
    on_unknown: Option<OnUnknown>,
    #[serde(default)]
    failure_mode: Option<FailureMode>,
    #[serde(default)]
    release_statuses: Vec<u16>,
    #[serde(default)]
    max_request_body: Option<usize>,
    #[serde(default)]
    max_stored_body: Option<usize>,
    #[serde(default)]
    replay_headers: Vec<String>,
    #[serde(default)]
    mode: Option<Mode>,
}

pub const DEFAULT_TTL_SECONDS: u64 = 24 * 60 * 60;
pub const DEFAULT_LEASE_SECONDS: u64 = 60;
pub const DEFAULT_WAIT_MAX_MS: u64 = 5_000;
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
pub const DEFAULT_MAX_STORED_BODY: usize = 512 * 1024;
pub const DEFAULT_STORE_TIMEOUT_MS: u64 = 1_000;

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
            err("(document)", format!("{e}; the configuration must be a JSON object with `store` and `policies`"))
        })?;
        let store = raw.store.validate()?;
        let doc_base = raw.doc_base.unwrap_or_else(|| DEFAULT_DOC_BASE.to_string());
        if doc_base.is_empty() || doc_base.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err("doc_base", "must be a non-empty URI without spaces, e.g. https://docs.example/problems/"));
        }
        if raw.policies.is_empty() {
            return Err(err("policies", "add at least one policy; without one the filter does nothing"));
        }
        let mut policies = Vec::with_capacity(raw.policies.len());
        for (i, p) in raw.policies.into_iter().enumerate() {
            let policy = p.validate(&format!("policies[{i}]"))?;
            if policies.iter().any(|q: &Rc<Policy>| q.name == policy.name) {
                return Err(err(format!("policies[{i}].name"), format!("`{}` is used twice; policy names scope records and must be unique", policy.name)));
            }
            policies.push(Rc::new(policy));
        }
        Ok(Config { store, doc_base, policies })
    }

    /// The first policy whose match covers the request.
    pub fn policy_for(&self, method: &str, host: &str, path: &str) -> Option<&Rc<Policy>> {
        self.policies.iter().find(|p| p.matcher.matches(method, host, path))
    }
}

impl RawStore {
    fn validate(self) -> Result<StoreConfig, ConfigError> {
        if self.cluster.is_empty() {
            return Err(err("store.cluster", "name the Envoy cluster that reaches the store"));
        }
        let timeout_ms = self.timeout_ms.unwrap_or(DEFAULT_STORE_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err(err("store.timeout_ms", "must be at least 1; 0 would mean no timeout at all"));
        }
        if self.token.is_empty() || self.token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err("store.token", "must be the store's API credential: non-empty visible ASCII"));
        }
        Ok(StoreConfig {
            authority: self.authority.unwrap_or_else(|| "idempotency-store".to_string()),
            cluster: self.cluster,
            timeout_ms,
            token: self.token,
        })
    }
}

fn header_name_ok(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn validate_source(source: Source, field: &str) -> Result<Source, ConfigError> {
    match source {
        Source::Header(h) => {
            let h = h.to_ascii_lowercase();
            if header_name_ok(&h) {
                Ok(Source::Header(h))
            } else {
                Err(err(format!("{field}.header"), "must be a header name such as `x-tenant-id`"))
            }
        }
        Source::Jwt { payload, claim } if payload.is_empty() || claim.is_empty() => Err(err(
            format!("{field}.jwt"),
            "needs `payload` (jwt_authn's payload_in_metadata) and `claim`",
        )),
        jwt => Ok(jwt),
    }
}

impl RawPolicy {
    fn validate(self, at: &str) -> Result<Policy, ConfigError> {
        let f = |name: &str| format!("{at}.{name}");
        if self.name.is_empty() || self.name.len() > 128 || self.name.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err(f("name"), "must be 1-128 visible ASCII characters, e.g. `payments.create`"));
        }
        let methods = self.matcher.methods.iter().map(|m| m.to_ascii_uppercase()).collect::<Vec<_>>();
        if methods.iter().any(|m| m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase())) {
            return Err(err(f("match.methods"), "list HTTP methods such as `POST`"));
        }
        match &self.matcher.path {
            PathMatch::Exact(p) | PathMatch::Prefix(p) | PathMatch::Template(p) if !p.starts_with('/') => {
                return Err(err(f("match.path"), "must start with `/`"));
            }
            _ => {}
        }
        let min = self.key_min_length.unwrap_or(1);
        let max = self.key_max_length.unwrap_or(255);
        if !(1..=255).contains(&max) {
            return Err(err(f("key_max_length"), "must be between 1 and 255"));
        }
        if min == 0 || min > max {
            return Err(err(f("key_min_length"), format!("must be between 1 and key_max_length ({max})")));
        }
        let identity = match (self.anonymous.unwrap_or(false), self.tenant, self.principal) {
            (true, None, None) => Identity::Anonymous,
            (true, _, _) => {
                return Err(err(f("anonymous"), "an anonymous policy cannot also name `tenant` or `principal`; remove one"));
            }
            (false, None, _) => {
                return Err(err(
                    f("tenant"),
                    "say where the tenant comes from ({\"header\": \"x-tenant-id\"} or {\"jwt\": {\"payload\": \"jwt_payload\", \"claim\": \"tenant\"}}), or set `anonymous: true` to share one namespace",
                ));
            }
            (false, Some(t), p) => Identity::Sourced {
                tenant: validate_source(t, &f("tenant"))?,
                principal: p.map(|p| validate_source(p, &f("principal"))).transpose()?,
            },
        };
        let fingerprint = match self.fingerprint {
            None => FingerprintSpec::default(),
            Some(raw) => FingerprintSpec::from_parts(raw.mode.as_deref(), raw.exclude, raw.headers)
                .map_err(|m| err(f("fingerprint"), m))?,
        };
        let ttl_s = self.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS);
        if ttl_s == 0 {
            return Err(err(f("ttl_seconds"), "must be at least 1 (the draft's default is 24 h: 86400)"));
        }
        let lease_s = self.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
        if lease_s == 0 {
            return Err(err(f("lease_seconds"), "must be at least 1 and longer than the upstream's timeout"));
        }
        let in_flight = match (self.in_flight.as_deref(), self.wait_max_ms) {
            (None | Some("conflict"), None) => InFlight::Conflict,
            (None | Some("conflict"), Some(_)) => {
                return Err(err(f("wait_max_ms"), "only applies with `in_flight: \"wait\"`"));
            }
            (Some("wait"), w) => match w.unwrap_or(DEFAULT_WAIT_MAX_MS) {
                0 => return Err(err(f("wait_max_ms"), "must be at least 1")),
                max_ms => InFlight::Wait { max_ms },
            },
            (Some(other), _) => {
                return Err(err(f("in_flight"), format!("`{other}` is not one of `conflict`, `wait`")));
            }
        };
        if let Some(s) = self.release_statuses.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(err(f("release_statuses"), format!("{s} is not an HTTP status")));
        }
        let max_request_body = self.max_request_body.unwrap_or(DEFAULT_MAX_REQUEST_BODY);
        if max_request_body == 0 {
            return Err(err(f("max_request_body"), "must be at least 1 byte"));
        }
        let replay_headers = self.replay_headers.iter().map(|h| h.to_ascii_lowercase()).collect::<Vec<_>>();
        if let Some(h) = replay_headers.iter().find(|h| !header_name_ok(h)) {
            return Err(err(f("replay_headers"), format!("`{h}` is not a header name")));
        }
        Ok(Policy {
            name: self.name,
            matcher: Matcher { methods, host: self.matcher.host, path: self.matcher.path },
            require_key: self.require_key.unwrap_or(true),
            key_rules: KeyRules { strict: self.strict_syntax.unwrap_or(false), min_len: min, max_len: max },
            identity,
            fingerprint,
            ttl_ms: ttl_s.saturating_mul(1000),
            lease_ms: lease_s.saturating_mul(1000),
            in_flight,
            after_expiry: self.after_expiry.unwrap_or_default(),
            on_unknown: self.on_unknown.unwrap_or_default(),
            failure_mode: self.failure_mode.unwrap_or_default(),
            release_statuses: self.release_statuses,
            max_request_body,
            max_stored_body: self.max_stored_body.unwrap_or(DEFAULT_MAX_STORED_BODY),
            replay_headers,
            mode: self.mode.unwrap_or_default(),
        })
    }
}
