//! The configuration as written (serde), and its validation into the types
//! of [`super`]: every error names its field and says how to fix it.

use serde::Deserialize;

use super::sections::{RawCanary, RawForwarding, RawGrpc};
use super::*;
use crate::fingerprint::FingerprintSpec;
use crate::headers::is_header_name;
use crate::key::KeyRules;
use crate::limits;

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawConfig {
    store: RawStore,
    #[serde(default)]
    doc_base: Option<String>,
    policies: Vec<RawPolicy>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawStore {
    cluster: String,
    #[serde(default)]
    authority: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default)]
    token: Option<String>,
    /// The name of an environment variable of the Envoy process that holds
    /// the token (`vm_config.environment_variables.host_env_keys`), so the
    /// credential stays out of the configuration Envoy's admin shows.
    #[serde(default)]
    token_env: Option<String>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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

#[derive(Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["conflict", "wait", null])))]
    in_flight: Option<String>,
    #[serde(default)]
    wait_max_ms: Option<u64>,
    #[serde(default)]
    in_progress_retry_after_ms: Option<u64>,
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
    #[serde(default)]
    forwarding: Option<RawForwarding>,
    #[serde(default)]
    settle: Option<Settle>,
    #[serde(default)]
    grpc: Option<RawGrpc>,
    #[serde(default)]
    canary: Option<RawCanary>,
}

impl RawStore {
    fn validate(self, env: &dyn Fn(&str) -> Option<String>) -> Result<StoreConfig, ConfigError> {
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
        // Every claim tells the store how long its caller waits for the
        // answer (`deadline_ms`): this timeout, plus `wait_max_ms` when waiting.
        if timeout_ms > limits::MAX_DEADLINE_MS {
            return Err(err(
                "store.timeout_ms",
                format!(
                    "must be at most {}: every claim tells the store it waits this long for the answer, and the store refuses a claim whose caller waits longer",
                    limits::MAX_DEADLINE_MS
                ),
            ));
        }
        let (field, token) = match (self.token, self.token_env) {
            (Some(token), None) => ("store.token", token),
            (None, Some(var)) => {
                let token = env(&var).ok_or_else(|| {
                    err(
                        "store.token_env",
                        format!("the environment variable `{var}` is not set in Envoy's VM; list it in vm_config.environment_variables.host_env_keys and set it for the Envoy process"),
                    )
                })?;
                ("store.token_env", token)
            }
            _ => {
                return Err(err(
                    "store.token",
                    "give the store's API credential as exactly one of `token` or `token_env`",
                ));
            }
        };
        if token.is_empty() || token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(err(
                field,
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
            authorization: format!("Bearer {token}"),
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
    fn validate(self, at: &str, store: &StoreConfig) -> Result<Policy, ConfigError> {
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
        let grpc = self.grpc.map(|g| g.validate(at)).transpose()?;
        let mut raw_fingerprint = self.fingerprint.unwrap_or_default();
        if grpc.is_some() {
            if raw_fingerprint.mode.as_deref() == Some("json") {
                return Err(err(
                    f("fingerprint.mode"),
                    "a gRPC call's messages are protobuf, not JSON: use `raw` (the default for gRPC) or `none`",
                ));
            }
            raw_fingerprint.mode.get_or_insert_with(|| "raw".to_string());
        }
        let fingerprint = FingerprintSpec::from_parts(
            raw_fingerprint.mode.as_deref(),
            raw_fingerprint.exclude,
            raw_fingerprint.headers,
        )
        .map_err(|m| err(f("fingerprint"), m))?;
        if grpc.is_some() && !matches!(path, PathMatch::Exact(_)) {
            return Err(err(
                f("match.path"),
                "a gRPC policy names each unary method exactly ({\"exact\": \"/package.Service/Method\"}): a prefix or template would also cover the service's streaming methods, which cannot be replayed",
            ));
        }
        if grpc.is_some() && !self.release_statuses.is_empty() {
            return Err(err(
                f("release_statuses"),
                "a gRPC call is released by its status code: list codes in `grpc.release_codes`",
            ));
        }
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
                // The claim's deadline is the call's timeout: both together.
                w if w + store.timeout_ms > limits::MAX_DEADLINE_MS => {
                    return Err(err(
                        f("wait_max_ms"),
                        format!(
                            "`wait_max_ms` ({w}) plus `store.timeout_ms` ({}) is how long a claim's caller waits for the answer, and the store refuses a claim whose caller waits longer than {} ms; lower `wait_max_ms` to at most {} or lower `store.timeout_ms`",
                            store.timeout_ms,
                            limits::MAX_DEADLINE_MS,
                            limits::MAX_DEADLINE_MS - store.timeout_ms
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
        let in_progress_retry_after_ms = self
            .in_progress_retry_after_ms
            .unwrap_or(DEFAULT_IN_PROGRESS_RETRY_AFTER_MS);
        if !(1..=limits::MAX_WAIT_MS).contains(&in_progress_retry_after_ms) {
            return Err(err(
                f("in_progress_retry_after_ms"),
                format!("must be between 1 and {}", limits::MAX_WAIT_MS),
            ));
        }
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
        let kept_unlisted =
            BASE_REPLAY_HEADERS.len() + grpc.as_ref().map_or(0, |_| GRPC_REPLAY_HEADERS.len());
        if kept_unlisted + replay_headers.len() > limits::MAX_HEADERS {
            return Err(err(
                f("replay_headers"),
                format!(
                    "at most {} extra headers: the store keeps at most {} per response",
                    limits::MAX_HEADERS - kept_unlisted,
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
        let mode = self.mode.unwrap_or_default();
        let canary = self.canary.map(|c| c.validate(at, mode)).transpose()?;
        let lease_ms = lease_s.saturating_mul(1000);
        let forwarding = match self.forwarding {
            None => Forwarding::Streaming,
            Some(raw) => {
                let release_unknown = self.on_unknown.unwrap_or_default() == OnUnknown::Release;
                raw.validate(at, (lease_ms, release_unknown), store.timeout_ms, max_stored_body)?
            }
        };
        if grpc.is_some() && forwarding != Forwarding::Streaming {
            return Err(err(
                f("forwarding"),
                "gRPC calls are forwarded through Envoy's router (`streaming`): the filter cannot answer a gRPC client with messages itself",
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
            lease_ms,
            in_flight,
            after_expiry: self.after_expiry.unwrap_or_default(),
            on_unknown: self.on_unknown.unwrap_or_default(),
            failure_mode: self.failure_mode.unwrap_or_default(),
            release_statuses: self.release_statuses,
            max_request_body,
            max_stored_body,
            replay_headers,
            mode,
            in_progress_retry_after_ms,
            forwarding,
            settle: self.settle.unwrap_or_default(),
            grpc,
            canary,
        })
    }
}

/// The JSON Schema of what [`parse`] reads. It says what may be written;
/// the rules across fields (a lease shorter than the TTL, say) are
/// [`parse`]'s.
#[cfg(feature = "schema")]
pub(super) fn json_schema() -> serde_json::Value {
    let mut schema = schemars::schema_for!(RawConfig).to_value();
    if let Some(root) = schema.as_object_mut() {
        root.insert("title".into(), "idemgate plugin configuration".into());
    }
    schema
}

/// Parses and validates the plugin configuration; `env` reads Envoy's VM
/// environment.
pub(super) fn parse(bytes: &[u8], env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
        err(
            "(document)",
            format!("{e}; the configuration must be a JSON object with `store` and `policies`"),
        )
    })?;
    let store = raw.store.validate(env)?;
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
        let policy = p.validate(&format!("policies[{i}]"), &store)?;
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
