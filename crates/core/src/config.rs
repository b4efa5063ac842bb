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
use crate::headers::is_header_name;
use crate::key::KeyRules;
use crate::limits;

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
    /// `Bearer <token>`, built once rather than on every store call.
    pub authorization: String,
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// Upper-case methods; empty means the default `POST` and `PATCH`.
    pub methods: Vec<String>,
    pub host: Option<String>,
    /// Compared with the request's normalized path ([`crate::path::normalize`]);
    /// exact and template patterns are stored normalized.
    pub path: PathMatch,
    /// Compare paths ignoring ASCII case (patterns are stored lower-case).
    pub ignore_case: bool,
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
                    if port.bytes().all(|b| b.is_ascii_digit()) {
                        h
                    } else {
                        host
                    }
                });
                h.eq_ignore_ascii_case(host) || h.eq_ignore_ascii_case(bare)
            }
        };
        method_ok && host_ok && self.path.matches(&self.normal_path(path))
    }

    /// The request's path as this policy sees it: normalized, and lower-case
    /// if the policy ignores case.
    fn normal_path(&self, path: &str) -> String {
        let normal = crate::path::normalize(path);
        if self.ignore_case {
            normal.to_ascii_lowercase()
        } else {
            normal
        }
    }

    /// The path with query that is fingerprinted: every spelling of the same
    /// resource is the same request, so a retry in another spelling replays.
    pub fn fingerprint_path(&self, path: &str) -> String {
        format!("{}{}", self.normal_path(path), crate::path::query(path))
    }
}

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => path == p,
            // A normalized path has no trailing slash, so `/v1/payments/`
            // must also cover `/v1/payments` itself.
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_str()) || (p.len() > 1 && p.strip_suffix('/') == Some(path))
            }
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
    Sourced {
        tenant: Source,
        principal: Option<Source>,
    },
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
    Wait {
        max_ms: u64,
    },
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
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
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
    #[serde(default)]
    ignore_case: Option<bool>,
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
/// Below Envoy's default 1 MiB buffer limit, so the filter answers 413 itself with a problem.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 512 * 1024;
pub const DEFAULT_MAX_STORED_BODY: usize = 512 * 1024;
pub const DEFAULT_STORE_TIMEOUT_MS: u64 = 1_000;

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
            err(
                "(document)",
                format!("{e}; the configuration must be a JSON object with `store` and `policies`"),
            )
        })?;
        let store = raw.store.validate()?;
        let doc_base = raw.doc_base.unwrap_or_else(|| DEFAULT_DOC_BASE.to_string());
        if doc_base.is_empty() || doc_base.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err(
                "doc_base",
                "must be a non-empty URI without spaces, e.g. https://docs.example/problems/",
            ));
        }
        if raw.policies.is_empty() {
            return Err(err(
                "policies",
                "add at least one policy; without one the filter does nothing",
            ));
        }
        let mut policies = Vec::with_capacity(raw.policies.len());
        for (i, p) in raw.policies.into_iter().enumerate() {
            let policy = p.validate(&format!("policies[{i}]"))?;
            if policies.iter().any(|q: &Rc<Policy>| q.name == policy.name) {
                return Err(err(
                    format!("policies[{i}].name"),
                    format!(
                        "`{}` is used twice; policy names scope records and must be unique",
                        policy.name
                    ),
                ));
            }
            policies.push(Rc::new(policy));
        }
        Ok(Config {
            store,
            doc_base,
            policies,
        })
    }

    /// The first policy whose match covers the request.
    pub fn policy_for(&self, method: &str, host: &str, path: &str) -> Option<&Rc<Policy>> {
        self.policies
            .iter()
            .find(|p| p.matcher.matches(method, host, path))
    }
}

impl RawStore {
    fn validate(self) -> Result<StoreConfig, ConfigError> {
        if self.cluster.is_empty() {
            return Err(err(
                "store.cluster",
                "name the Envoy cluster that reaches the store",
            ));
        }
        let timeout_ms = self.timeout_ms.unwrap_or(DEFAULT_STORE_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err(err(
                "store.timeout_ms",
                "must be at least 1; 0 would mean no timeout at all",
            ));
        }
        if self.token.is_empty() || self.token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err(
                "store.token",
                "must be the store's API credential: non-empty visible ASCII",
            ));
        }
        let authority = self.authority.unwrap_or_else(|| "idempotency-store".to_string());
        if authority.is_empty() || authority.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err(
                "store.authority",
                "must be the store's host name, e.g. `idempotency-store`",
            ));
        }
        Ok(StoreConfig {
            authority,
            cluster: self.cluster,
            timeout_ms,
            authorization: format!("Bearer {}", self.token),
        })
    }
}

fn validate_source(source: Source, field: &str) -> Result<Source, ConfigError> {
    match source {
        Source::Header(h) => {
            let h = h.to_ascii_lowercase();
            if is_header_name(&h) {
                Ok(Source::Header(h))
            } else {
                Err(err(
                    format!("{field}.header"),
                    "must be a header name such as `x-tenant-id`",
                ))
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
        if self.name.is_empty()
            || self.name.len() > 128
            || self.name.bytes().any(|b| !(0x21..=0x7e).contains(&b))
        {
            return Err(err(
                f("name"),
                "must be 1-128 visible ASCII characters, e.g. `payments.create`",
            ));
        }
        let methods = self
            .matcher
            .methods
            .iter()
            .map(|m| m.to_ascii_uppercase())
            .collect::<Vec<_>>();
        if methods
            .iter()
            .any(|m| m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()))
        {
            return Err(err(f("match.methods"), "list HTTP methods such as `POST`"));
        }
        let ignore_case = self.matcher.ignore_case.unwrap_or(false);
        let fold = |p: String| if ignore_case { p.to_ascii_lowercase() } else { p };
        let path = match self.matcher.path {
            PathMatch::Exact(p) | PathMatch::Prefix(p) | PathMatch::Template(p) if !p.starts_with('/') => {
                return Err(err(f("match.path"), "must start with `/`"));
            }
            // Requests are matched in normal form, so the pattern is stored in it too.
            PathMatch::Exact(p) => PathMatch::Exact(fold(crate::path::normalize(&p))),
            PathMatch::Template(p) => PathMatch::Template(fold(crate::path::normalize(&p))),
            PathMatch::Prefix(p) => PathMatch::Prefix(fold(p)),
        };
        let min = self.key_min_length.unwrap_or(1);
        let max = self.key_max_length.unwrap_or(255);
        if !(1..=255).contains(&max) {
            return Err(err(f("key_max_length"), "must be between 1 and 255"));
        }
        if min == 0 || min > max {
            return Err(err(
                f("key_min_length"),
                format!("must be between 1 and key_max_length ({max})"),
            ));
        }
        let identity = match (self.anonymous.unwrap_or(false), self.tenant, self.principal) {
            (true, None, None) => Identity::Anonymous,
            (true, _, _) => {
                return Err(err(
                    f("anonymous"),
                    "an anonymous policy cannot also name `tenant` or `principal`; remove one",
                ));
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
        if ttl_s == 0 || ttl_s > limits::MAX_TTL_MS / 1000 {
            return Err(err(
                f("ttl_seconds"),
                format!(
                    "must be between 1 and {} (366 days; the draft's default is 24 h: 86400)",
                    limits::MAX_TTL_MS / 1000
                ),
            ));
        }
        let lease_s = self.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
        if lease_s == 0 || lease_s > limits::MAX_LEASE_MS / 1000 {
            return Err(err(
                f("lease_seconds"),
                format!(
                    "must be between 1 and {} (24 h) and longer than the upstream's timeout",
                    limits::MAX_LEASE_MS / 1000
                ),
            ));
        }
        let in_flight = match (self.in_flight.as_deref(), self.wait_max_ms) {
            (None | Some("conflict"), None) => InFlight::Conflict,
            (None | Some("conflict"), Some(_)) => {
                return Err(err(f("wait_max_ms"), "only applies with `in_flight: \"wait\"`"));
            }
            (Some("wait"), w) => match w.unwrap_or(DEFAULT_WAIT_MAX_MS) {
                0 => return Err(err(f("wait_max_ms"), "must be at least 1")),
                w if w > limits::MAX_WAIT_MS => {
                    return Err(err(
                        f("wait_max_ms"),
                        format!(
                            "must be at most {} (the store holds a claim no longer)",
                            limits::MAX_WAIT_MS
                        ),
                    ));
                }
                max_ms => InFlight::Wait { max_ms },
            },
            (Some(other), _) => {
                return Err(err(
                    f("in_flight"),
                    format!("`{other}` is not one of `conflict`, `wait`"),
                ));
            }
        };
        if let Some(s) = self.release_statuses.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(err(f("release_statuses"), format!("{s} is not an HTTP status")));
        }
        let max_request_body = self.max_request_body.unwrap_or(DEFAULT_MAX_REQUEST_BODY);
        if max_request_body == 0 {
            return Err(err(f("max_request_body"), "must be at least 1 byte"));
        }
        let replay_headers = self
            .replay_headers
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect::<Vec<_>>();
        if let Some(h) = replay_headers.iter().find(|h| !is_header_name(h)) {
            return Err(err(f("replay_headers"), format!("`{h}` is not a header name")));
        }
        if BASE_REPLAY_HEADERS.len() + replay_headers.len() > limits::MAX_HEADERS {
            return Err(err(
                f("replay_headers"),
                format!(
                    "at most {} extra headers: the store keeps at most {} per response",
                    limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len(),
                    limits::MAX_HEADERS
                ),
            ));
        }
        let max_stored_body = self.max_stored_body.unwrap_or(DEFAULT_MAX_STORED_BODY);
        if max_stored_body > limits::MAX_STORED_BODY {
            return Err(err(
                f("max_stored_body"),
                format!(
                    "must be at most {} bytes (4 MiB), the largest response the store keeps; larger responses stream through unstored anyway",
                    limits::MAX_STORED_BODY
                ),
            ));
        }
        Ok(Policy {
            name: self.name,
            matcher: Matcher {
                methods,
                host: self.matcher.host,
                path,
                ignore_case,
            },
            require_key: self.require_key.unwrap_or(true),
            key_rules: KeyRules {
                strict: self.strict_syntax.unwrap_or(false),
                min_len: min,
                max_len: max,
            },
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
            max_stored_body,
            replay_headers,
            mode: self.mode.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    const MINIMAL: &str = r#"{"store": {"cluster": "idempotency_store", "token": "secret"},
        "policies": [{"name": "payments.create", "match": {"path": {"prefix": "/v1/payments"}},
                      "tenant": {"header": "x-tenant-id"}}]}"#;

    fn minimal() -> Value {
        serde_json::from_str(MINIMAL).unwrap()
    }

    /// Sets (or, with `null`, removes) members of an object.
    fn merge(target: &mut Value, patch: Value) {
        let (Value::Object(target), Value::Object(patch)) = (target, patch) else {
            panic!("both must be objects");
        };
        for (name, value) in patch {
            if value.is_null() {
                target.remove(&name);
            } else {
                target.insert(name, value);
            }
        }
    }

    fn parse_with(root: Value, policy: Value) -> Result<Config, ConfigError> {
        let mut doc = minimal();
        merge(&mut doc, root);
        if let Some(first) = doc["policies"].get_mut(0) {
            merge(first, policy);
        }
        Config::parse(&serde_json::to_vec(&doc).unwrap())
    }

    fn policy_with(patch: Value) -> Policy {
        Policy::clone(&parse_with(json!({}), patch).unwrap().policies[0])
    }

    #[test]
    fn the_minimal_config_parses_with_the_defaults() {
        let config = Config::parse(MINIMAL.as_bytes()).unwrap();
        assert_eq!(
            config.store,
            StoreConfig {
                cluster: "idempotency_store".into(),
                authority: "idempotency-store".into(),
                timeout_ms: DEFAULT_STORE_TIMEOUT_MS,
                authorization: "Bearer secret".into(),
            }
        );
        assert_eq!(config.doc_base, DEFAULT_DOC_BASE);
        let want = Policy {
            name: "payments.create".into(),
            matcher: Matcher {
                methods: vec![],
                host: None,
                path: PathMatch::Prefix("/v1/payments".into()),
                ignore_case: false,
            },
            require_key: true,
            key_rules: KeyRules::default(),
            identity: Identity::Sourced {
                tenant: Source::Header("x-tenant-id".into()),
                principal: None,
            },
            fingerprint: FingerprintSpec::default(),
            ttl_ms: DEFAULT_TTL_SECONDS * 1000,
            lease_ms: DEFAULT_LEASE_SECONDS * 1000,
            in_flight: InFlight::Conflict,
            after_expiry: AfterExpiry::Reject,
            on_unknown: OnUnknown::Conflict,
            failure_mode: FailureMode::Closed,
            release_statuses: vec![],
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            max_stored_body: DEFAULT_MAX_STORED_BODY,
            replay_headers: vec![],
            mode: Mode::Enforce,
        };
        assert_eq!(config.policies, vec![Rc::new(want)]);
    }

    #[test]
    fn every_setting_can_be_given() {
        let p = policy_with(json!({
            "match": {"methods": ["post", "PUT"], "host": "api.example", "path": {"template": "/v1/{id}"}},
            "require_key": false, "strict_syntax": true, "key_min_length": 8, "key_max_length": 64,
            "tenant": {"jwt": {"payload": "jwt_payload", "claim": "org"}}, "principal": {"header": "X-User"},
            "fingerprint": {"mode": "json", "exclude": ["/ts"], "headers": ["X-Client"]},
            "ttl_seconds": 60, "lease_seconds": 5, "in_flight": "wait", "wait_max_ms": 250,
            "after_expiry": "new", "on_unknown": "release", "failure_mode": "open",
            "release_statuses": [503], "max_request_body": 10, "max_stored_body": 20,
            "replay_headers": ["X-Request-Cost"], "mode": "observe"
        }));
        assert_eq!(p.matcher.methods, vec!["POST", "PUT"]);
        assert_eq!(
            p.key_rules,
            KeyRules {
                strict: true,
                min_len: 8,
                max_len: 64
            }
        );
        assert_eq!(
            p.identity,
            Identity::Sourced {
                tenant: Source::Jwt {
                    payload: "jwt_payload".into(),
                    claim: "org".into()
                },
                principal: Some(Source::Header("x-user".into())),
            }
        );
        assert_eq!(p.fingerprint.headers, vec!["x-client"]);
        assert_eq!((p.ttl_ms, p.lease_ms), (60_000, 5_000));
        assert_eq!(p.in_flight, InFlight::Wait { max_ms: 250 });
        assert_eq!(
            (p.after_expiry, p.on_unknown, p.failure_mode),
            (AfterExpiry::New, OnUnknown::Release, FailureMode::Open)
        );
        assert_eq!((p.max_request_body, p.max_stored_body), (10, 20));
        assert_eq!(p.replay_headers, vec!["x-request-cost"]);
        assert_eq!(p.mode, Mode::Observe);
        assert!(!p.require_key);
    }

    #[test]
    fn an_anonymous_policy_needs_no_identity() {
        let p = policy_with(json!({"tenant": null, "anonymous": true}));
        assert_eq!(p.identity, Identity::Anonymous);
    }

    #[test]
    fn waiting_without_a_bound_uses_the_default() {
        assert_eq!(
            policy_with(json!({"in_flight": "wait"})).in_flight,
            InFlight::Wait {
                max_ms: DEFAULT_WAIT_MAX_MS
            }
        );
    }

    macro_rules! rejects {
        ($name:ident, $root:tt, $policy:tt => $field:expr) => {
            #[test]
            fn $name() {
                let err = parse_with(json!($root), json!($policy)).unwrap_err();
                assert_eq!(err.field, $field, "{err}");
                assert!(!err.message.is_empty());
            }
        };
    }

    rejects!(an_unknown_top_level_field_is_rejected, {"extra": 1}, {} => "(document)");
    rejects!(an_unknown_policy_field_is_rejected, {}, {"ttl": 1} => "(document)");
    rejects!(a_missing_store_is_rejected, {"store": null}, {} => "(document)");
    rejects!(an_empty_cluster_is_rejected, {"store": {"cluster": "", "token": "t"}}, {} => "store.cluster");
    rejects!(an_empty_authority_is_rejected, {"store": {"cluster": "c", "token": "t", "authority": ""}}, {} => "store.authority");
    rejects!(an_authority_with_a_space_is_rejected, {"store": {"cluster": "c", "token": "t", "authority": "a b"}}, {} => "store.authority");
    rejects!(a_zero_store_timeout_is_rejected, {"store": {"cluster": "c", "token": "t", "timeout_ms": 0}}, {} => "store.timeout_ms");
    rejects!(an_empty_token_is_rejected, {"store": {"cluster": "c", "token": ""}}, {} => "store.token");
    rejects!(a_token_with_a_space_is_rejected, {"store": {"cluster": "c", "token": "a b"}}, {} => "store.token");
    rejects!(an_empty_doc_base_is_rejected, {"doc_base": ""}, {} => "doc_base");
    rejects!(a_doc_base_with_a_space_is_rejected, {"doc_base": "https://x/ y"}, {} => "doc_base");
    rejects!(no_policies_are_rejected, {"policies": []}, {} => "policies");
    rejects!(an_empty_policy_name_is_rejected, {}, {"name": ""} => "policies[0].name");
    rejects!(a_policy_name_with_a_space_is_rejected, {}, {"name": "a b"} => "policies[0].name");
    rejects!(a_policy_name_over_128_characters_is_rejected, {}, {"name": "n".repeat(129)} => "policies[0].name");
    rejects!(an_empty_method_is_rejected, {}, {"match": {"methods": [""], "path": {"exact": "/"}}} => "policies[0].match.methods");
    rejects!(a_method_with_digits_is_rejected, {}, {"match": {"methods": ["P0ST"], "path": {"exact": "/"}}} => "policies[0].match.methods");
    rejects!(an_exact_path_without_a_slash_is_rejected, {}, {"match": {"path": {"exact": "v1"}}} => "policies[0].match.path");
    rejects!(a_prefix_without_a_slash_is_rejected, {}, {"match": {"path": {"prefix": ""}}} => "policies[0].match.path");
    rejects!(a_template_without_a_slash_is_rejected, {}, {"match": {"path": {"template": "{id}"}}} => "policies[0].match.path");
    rejects!(two_path_kinds_are_rejected, {}, {"match": {"path": {"exact": "/a", "prefix": "/b"}}} => "(document)");
    rejects!(a_key_max_length_of_0_is_rejected, {}, {"key_max_length": 0} => "policies[0].key_max_length");
    rejects!(a_key_max_length_over_255_is_rejected, {}, {"key_max_length": 256} => "policies[0].key_max_length");
    rejects!(a_key_min_length_of_0_is_rejected, {}, {"key_min_length": 0} => "policies[0].key_min_length");
    rejects!(a_key_min_length_over_the_max_is_rejected, {}, {"key_min_length": 20, "key_max_length": 10} => "policies[0].key_min_length");
    rejects!(anonymous_with_a_tenant_is_rejected, {}, {"anonymous": true} => "policies[0].anonymous");
    rejects!(anonymous_with_a_principal_is_rejected, {}, {"tenant": null, "anonymous": true, "principal": {"header": "x-u"}} => "policies[0].anonymous");
    rejects!(a_missing_tenant_is_rejected, {}, {"tenant": null} => "policies[0].tenant");
    rejects!(a_missing_tenant_is_rejected_even_if_not_anonymous, {}, {"tenant": null, "anonymous": false} => "policies[0].tenant");
    rejects!(a_bad_tenant_header_is_rejected, {}, {"tenant": {"header": "x tenant"}} => "policies[0].tenant.header");
    rejects!(a_bad_principal_header_is_rejected, {}, {"principal": {"header": ""}} => "policies[0].principal.header");
    rejects!(a_jwt_tenant_without_a_claim_is_rejected, {}, {"tenant": {"jwt": {"payload": "p", "claim": ""}}} => "policies[0].tenant.jwt");
    rejects!(a_jwt_principal_without_a_payload_is_rejected, {}, {"principal": {"jwt": {"payload": "", "claim": "sub"}}} => "policies[0].principal.jwt");
    rejects!(an_unknown_source_is_rejected, {}, {"tenant": {"cookie": "t"}} => "(document)");
    rejects!(an_unknown_fingerprint_mode_is_rejected, {}, {"fingerprint": {"mode": "xml"}} => "policies[0].fingerprint");
    rejects!(a_bad_exclude_pointer_is_rejected, {}, {"fingerprint": {"exclude": ["ts"]}} => "policies[0].fingerprint");
    rejects!(exclude_with_raw_mode_is_rejected, {}, {"fingerprint": {"mode": "raw", "exclude": ["/ts"]}} => "policies[0].fingerprint");
    rejects!(a_bad_fingerprint_header_is_rejected, {}, {"fingerprint": {"headers": ["a b"]}} => "policies[0].fingerprint");
    rejects!(a_zero_ttl_is_rejected, {}, {"ttl_seconds": 0} => "policies[0].ttl_seconds");
    rejects!(a_ttl_the_store_refuses_is_rejected, {}, {"ttl_seconds": limits::MAX_TTL_MS / 1000 + 1} => "policies[0].ttl_seconds");
    rejects!(a_lease_the_store_refuses_is_rejected, {}, {"lease_seconds": limits::MAX_LEASE_MS / 1000 + 1} => "policies[0].lease_seconds");
    rejects!(a_wait_the_store_refuses_is_rejected, {}, {"in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS + 1} => "policies[0].wait_max_ms");
    rejects!(a_stored_body_the_store_refuses_is_rejected, {}, {"max_stored_body": limits::MAX_STORED_BODY + 1} => "policies[0].max_stored_body");
    rejects!(more_replay_headers_than_the_store_keeps_are_rejected, {},
        {"replay_headers": (0..=limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len()).map(|i| format!("x-h{i}")).collect::<Vec<_>>()}
        => "policies[0].replay_headers");
    rejects!(a_replay_header_name_the_store_refuses_is_rejected, {}, {"replay_headers": ["x".repeat(limits::MAX_HEADER_NAME + 1)]} => "policies[0].replay_headers");
    rejects!(a_zero_lease_is_rejected, {}, {"lease_seconds": 0} => "policies[0].lease_seconds");
    rejects!(a_wait_bound_without_waiting_is_rejected, {}, {"wait_max_ms": 10} => "policies[0].wait_max_ms");
    rejects!(a_wait_bound_with_conflict_is_rejected, {}, {"in_flight": "conflict", "wait_max_ms": 10} => "policies[0].wait_max_ms");
    rejects!(a_zero_wait_bound_is_rejected, {}, {"in_flight": "wait", "wait_max_ms": 0} => "policies[0].wait_max_ms");
    rejects!(an_unknown_in_flight_is_rejected, {}, {"in_flight": "queue"} => "policies[0].in_flight");
    rejects!(an_unknown_after_expiry_is_rejected, {}, {"after_expiry": "ignore"} => "(document)");
    rejects!(a_release_status_over_599_is_rejected, {}, {"release_statuses": [600]} => "policies[0].release_statuses");
    rejects!(a_release_status_under_100_is_rejected, {}, {"release_statuses": [99]} => "policies[0].release_statuses");
    rejects!(a_zero_max_request_body_is_rejected, {}, {"max_request_body": 0} => "policies[0].max_request_body");
    rejects!(a_bad_replay_header_is_rejected, {}, {"replay_headers": ["x:y"]} => "policies[0].replay_headers");
    rejects!(a_negative_number_is_rejected, {}, {"ttl_seconds": -1} => "(document)");

    #[test]
    fn the_largest_settings_the_store_accepts_are_accepted() {
        let p = policy_with(json!({
            "ttl_seconds": limits::MAX_TTL_MS / 1000, "lease_seconds": limits::MAX_LEASE_MS / 1000,
            "in_flight": "wait", "wait_max_ms": limits::MAX_WAIT_MS, "max_stored_body": limits::MAX_STORED_BODY,
            "replay_headers": (0..limits::MAX_HEADERS - BASE_REPLAY_HEADERS.len()).map(|i| format!("x-h{i}")).collect::<Vec<_>>(),
        }));
        assert_eq!((p.ttl_ms, p.lease_ms), (limits::MAX_TTL_MS, limits::MAX_LEASE_MS));
    }

    #[test]
    fn patterns_are_stored_normalized_and_folded_when_case_is_ignored() {
        let p = policy_with(json!({"match": {"path": {"exact": "/V1//Pay/"}, "ignore_case": true}}));
        assert_eq!(p.matcher.path, PathMatch::Exact("/v1/pay".into()));
        assert!(p.matcher.matches("POST", "h", "/v1/PAY"));
        assert_eq!(p.matcher.fingerprint_path("/V1/Pay/?A=1"), "/v1/pay?A=1");
        let p = policy_with(json!({"match": {"path": {"exact": "/v1/pay"}}}));
        assert!(!p.matcher.matches("POST", "h", "/V1/pay"));
        assert_eq!(p.matcher.fingerprint_path("//v1/./pay/?a=1"), "/v1/pay?a=1");
    }

    #[test]
    fn invalid_json_is_rejected_as_a_document_error() {
        for bad in [&b""[..], b"{", b"[]", b"null", b"\xff"] {
            assert_eq!(Config::parse(bad).unwrap_err().field, "(document)");
        }
    }

    #[test]
    fn a_repeated_policy_name_names_the_second_policy() {
        let mut doc = minimal();
        let first = doc["policies"][0].clone();
        doc["policies"].as_array_mut().unwrap().push(first);
        let err = Config::parse(&serde_json::to_vec(&doc).unwrap()).unwrap_err();
        assert_eq!(err.field, "policies[1].name");
    }

    #[test]
    fn the_error_names_the_field_when_displayed() {
        let err = parse_with(json!({}), json!({"ttl_seconds": 0})).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("invalid configuration at `policies[0].ttl_seconds`: "));
    }

    fn matcher(methods: &[&str], host: Option<&str>, path: PathMatch) -> Matcher {
        Matcher {
            methods: methods.iter().map(|m| m.to_string()).collect(),
            host: host.map(String::from),
            path,
            ignore_case: false,
        }
    }

    fn template(t: &str) -> PathMatch {
        PathMatch::Template(t.into())
    }

    fn prefix(p: &str) -> PathMatch {
        PathMatch::Prefix(p.into())
    }

    fn exact(p: &str) -> PathMatch {
        PathMatch::Exact(p.into())
    }

    macro_rules! route {
        ($name:ident, $matcher:expr, $method:expr, $host:expr, $path:expr => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!($matcher.matches($method, $host, $path), $want);
            }
        };
    }

    route!(post_is_covered_by_default, matcher(&[], None, prefix("/")), "POST", "h", "/x" => true);
    route!(patch_is_covered_by_default, matcher(&[], None, prefix("/")), "PATCH", "h", "/x" => true);
    route!(get_is_not_covered_by_default, matcher(&[], None, prefix("/")), "GET", "h", "/x" => false);
    route!(put_is_not_covered_by_default, matcher(&[], None, prefix("/")), "PUT", "h", "/x" => false);
    route!(listed_methods_replace_the_default, matcher(&["PUT"], None, prefix("/")), "PUT", "h", "/x" => true);
    route!(listed_methods_exclude_post, matcher(&["PUT"], None, prefix("/")), "POST", "h", "/x" => false);
    route!(an_exact_path_matches_itself, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay" => true);
    route!(an_exact_path_ignores_the_query, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay?a=1" => true);
    route!(an_exact_path_ignores_a_fragment, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay#x" => true);
    route!(an_exact_path_covers_a_trailing_slash, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/pay/" => true);
    route!(an_exact_path_covers_double_slashes, matcher(&[], None, exact("/v1/pay")), "POST", "h", "//v1//pay" => true);
    route!(an_exact_path_covers_dot_segments, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/./x/../pay" => true);
    route!(an_exact_path_covers_encoded_letters, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1/%70ay" => true);
    route!(an_exact_path_does_not_cover_an_encoded_slash, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/v1%2Fpay" => false);
    route!(a_prefix_covers_double_slashes, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "//v1/pay/1" => true);
    route!(a_prefix_with_a_trailing_slash_covers_the_bare_path, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/pay" => true);
    route!(a_prefix_with_a_trailing_slash_covers_deeper_paths, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/pay/9" => true);
    route!(a_prefix_with_a_trailing_slash_does_not_cover_a_sibling, matcher(&[], None, prefix("/v1/pay/")), "POST", "h", "/v1/payx" => false);
    route!(an_ignore_case_path_covers_upper_case, Matcher { ignore_case: true, ..matcher(&[], None, exact("/v1/pay")) }, "POST", "h", "/V1/PAY/" => true);
    route!(an_exact_path_is_case_sensitive, matcher(&[], None, exact("/v1/pay")), "POST", "h", "/V1/pay" => false);
    route!(a_prefix_matches_a_longer_path, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "/v1/payments/9" => true);
    route!(a_prefix_does_not_match_a_shorter_path, matcher(&[], None, prefix("/v1/pay")), "POST", "h", "/v1/pa" => false);
    route!(a_template_matches_one_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c" => true);
    route!(a_template_ignores_the_query, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c?x=/y" => true);
    route!(a_template_rejects_an_empty_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a//c" => false);
    route!(a_template_rejects_two_segments, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/4/2/c" => false);
    route!(a_template_rejects_a_trailing_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c/d" => false);
    route!(a_template_rejects_a_missing_segment, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42" => false);
    route!(a_template_covers_a_trailing_slash, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/a/42/c/" => true);
    route!(a_template_compares_literal_segments, matcher(&[], None, template("/v1/a/{id}/c")), "POST", "h", "/v1/b/42/c" => false);
    route!(a_template_may_end_in_a_variable, matcher(&[], None, template("/v1/{a}/{b}")), "POST", "h", "/v1/x/y" => true);
    route!(a_host_matches_without_a_port, matcher(&[], Some("api.example"), prefix("/")), "POST", "api.example", "/" => true);
    route!(a_host_matches_ignoring_case, matcher(&[], Some("API.example"), prefix("/")), "POST", "api.EXAMPLE", "/" => true);
    route!(a_host_matches_with_a_port, matcher(&[], Some("api.example"), prefix("/")), "POST", "api.example:8443", "/" => true);
    route!(a_host_with_a_port_matches_exactly, matcher(&[], Some("api.example:8443"), prefix("/")), "POST", "api.example:8443", "/" => true);
    route!(a_host_with_a_port_rejects_another_port, matcher(&[], Some("api.example:8443"), prefix("/")), "POST", "api.example:80", "/" => false);
    route!(another_host_is_not_matched, matcher(&[], Some("api.example"), prefix("/")), "POST", "evil.example", "/" => false);
    route!(a_host_suffix_is_not_matched, matcher(&[], Some("example"), prefix("/")), "POST", "api.example", "/" => false);
    route!(an_ipv6_host_matches_with_a_port, matcher(&[], Some("[::1]"), prefix("/")), "POST", "[::1]:8080", "/" => true);
    route!(an_ipv6_host_matches_without_a_port, matcher(&[], Some("[::1]"), prefix("/")), "POST", "[::1]", "/" => true);
    route!(no_host_means_any_host, matcher(&[], None, prefix("/")), "POST", "anything:1", "/" => true);

    #[test]
    fn the_first_matching_policy_wins() {
        let mut doc = minimal();
        let mut second = doc["policies"][0].clone();
        merge(
            &mut second,
            json!({"name": "all", "match": {"path": {"prefix": "/"}}}),
        );
        doc["policies"].as_array_mut().unwrap().push(second);
        let config = Config::parse(&serde_json::to_vec(&doc).unwrap()).unwrap();
        let name = |path| config.policy_for("POST", "h", path).map(|p| p.name.as_str());
        assert_eq!(name("/v1/payments"), Some("payments.create"));
        assert_eq!(name("/v1/refunds"), Some("all"));
        assert_eq!(config.policy_for("GET", "h", "/v1/payments"), None);
    }

    macro_rules! replays {
        ($name:ident, $extra:tt, $header:expr => $want:expr) => {
            #[test]
            fn $name() {
                let p = policy_with(json!({"replay_headers": $extra}));
                assert_eq!(p.replays_header($header), $want);
            }
        };
    }

    replays!(content_type_is_replayed, [], "Content-Type" => true);
    replays!(location_is_replayed, [], "location" => true);
    replays!(an_unlisted_header_is_not_replayed, [], "x-cost" => false);
    replays!(a_listed_extra_header_is_replayed, ["X-Cost"], "x-cost" => true);
    replays!(set_cookie_is_never_replayed, ["set-cookie"], "Set-Cookie" => false);
    replays!(content_length_is_never_replayed, ["content-length"], "content-length" => false);
    replays!(envoy_headers_are_never_replayed, ["x-envoy-upstream-service-time"], "x-envoy-upstream-service-time" => false);
    replays!(pseudo_headers_are_never_replayed, [], ":status" => false);
    replays!(idempotency_control_is_never_replayed, ["idempotency-control"], "idempotency-control" => false);

    macro_rules! releases {
        ($name:ident, $statuses:tt, $status:expr => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(policy_with(json!({"release_statuses": $statuses})).releases_on($status), $want);
            }
        };
    }

    releases!(a_408_releases_the_key, [], 408 => true);
    releases!(a_425_releases_the_key, [], 425 => true);
    releases!(a_429_releases_the_key, [], 429 => true);
    releases!(a_500_keeps_the_key, [], 500 => false);
    releases!(a_400_releases_the_key, [], 400 => true);
    releases!(a_401_releases_the_key, [], 401 => true);
    releases!(a_403_releases_the_key, [], 403 => true);
    releases!(a_422_releases_the_key, [], 422 => true);
    releases!(a_404_keeps_the_key, [], 404 => false);
    releases!(a_409_keeps_the_key, [], 409 => false);
    releases!(a_201_keeps_the_key, [], 201 => false);
    releases!(a_listed_503_releases_the_key, [503], 503 => true);

    proptest! {
        #[test]
        fn parse_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Config::parse(&bytes);
        }

        #[test]
        fn parse_never_panics_on_a_mangled_config(cut in 0..MINIMAL.len(), insert in "[{}\\[\\]\":,0-9a-z_ -]{0,12}") {
            let mut text = MINIMAL.as_bytes().to_vec();
            text.splice(cut..cut, insert.bytes());
            let _ = Config::parse(&text);
        }

        #[test]
        fn parse_never_panics_on_any_policy_values(
            ttl in any::<u64>(), lease in any::<u64>(), min in any::<usize>(), max in any::<usize>(),
            body in any::<usize>(), name in "\\PC{0,140}",
        ) {
            let _ = parse_with(json!({}), json!({
                "ttl_seconds": ttl, "lease_seconds": lease, "key_min_length": min, "key_max_length": max,
                "max_request_body": body, "name": name,
            }));
        }
    }
}
