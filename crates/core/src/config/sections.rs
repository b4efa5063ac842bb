//! A policy's optional sections as written (`forwarding`, `grpc`,
//! `canary`), each validated on its own into the types of [`super`].

use serde::Deserialize;

use super::*;

/// Partial enforcement under `mode: enforce`: these requests are enforced,
/// the rest observed.
#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RawCanary {
    /// The share of keys enforced, in percent (0-100, two decimals).
    #[serde(default)]
    percent: f64,
    /// Tenants enforced whatever their keys.
    #[serde(default)]
    tenants: Vec<String>,
}

impl RawCanary {
    pub(super) fn validate(self, at: &str, mode: Mode) -> Result<Canary, ConfigError> {
        let f = |name: &str| format!("{at}.canary.{name}");
        if mode != Mode::Enforce {
            return Err(err(
                format!("{at}.canary"),
                "a canary picks what `enforce` mode enforces; an observing policy observes everything",
            ));
        }
        let basis_points = (self.percent * 100.0).round();
        if !(0.0..=10_000.0).contains(&basis_points) || (self.percent * 100.0 - basis_points).abs() > 1e-6 {
            return Err(err(
                f("percent"),
                "must be between 0 and 100, with at most two decimals",
            ));
        }
        if let Some(t) = self.tenants.iter().find(|t| t.is_empty() || t.len() > 255) {
            return Err(err(f("tenants"), format!("`{t}` is not a tenant (1-255 bytes)")));
        }
        Ok(Canary {
            basis_points: basis_points as u16,
            tenants: self.tenants,
        })
    }
}

/// Present on a policy covering gRPC unary methods.
#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RawGrpc {
    /// Status codes that also release the key, besides the default ones.
    #[serde(default)]
    release_codes: Vec<u8>,
}

impl RawGrpc {
    pub(super) fn validate(self, at: &str) -> Result<GrpcPolicy, ConfigError> {
        if let Some(c) = self
            .release_codes
            .iter()
            .find(|&&c| c == grpc::code::OK || c > grpc::code::MAX)
        {
            return Err(err(
                format!("{at}.grpc.release_codes"),
                format!("{c} is not a gRPC error code (1-16)"),
            ));
        }
        Ok(GrpcPolicy {
            release_codes: self.release_codes,
        })
    }
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(super) struct RawForwarding {
    #[cfg_attr(feature = "schema", schemars(extend("enum" = ["streaming", "detached"])))]
    mode: String,
    #[serde(default)]
    cluster: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default)]
    max_response_body: Option<usize>,
}

impl RawForwarding {
    /// `store_timeout_ms`: how long one call to the store may take
    /// (`store.timeout_ms`), the margin the lease keeps beyond the upstream
    /// call; see [`Detached::timeout_ms`]. `release_unknown`: the policy's
    /// `on_unknown` is `release` ([`Detached::upstream_timeout_ms`]).
    pub(super) fn validate(
        self,
        at: &str,
        (lease_ms, release_unknown): (u64, bool),
        store_timeout_ms: u64,
        max_stored_body: usize,
    ) -> Result<Forwarding, ConfigError> {
        let f = |name: &str| format!("{at}.forwarding.{name}");
        match self.mode.as_str() {
            "streaming" => {
                if self.cluster.is_some() || self.timeout_ms.is_some() || self.max_response_body.is_some() {
                    return Err(err(
                        f("mode"),
                        "`cluster`, `timeout_ms` and `max_response_body` only apply with `mode: \"detached\"`",
                    ));
                }
                return Ok(Forwarding::Streaming);
            }
            "detached" => {}
            other => {
                return Err(err(
                    f("mode"),
                    format!("`{other}` is not one of `streaming`, `detached`"),
                ));
            }
        }
        if self.cluster.as_deref() == Some("") {
            return Err(err(
                f("cluster"),
                "name an Envoy cluster, or leave it out to use the route's",
            ));
        }
        // The lease runs from the store's commit of the claim; the upstream
        // call starts once the claim's answer is back, and its outcome must
        // still reach the store before the lease ends. One store call
        // (`store.timeout_ms`) is the margin for both.
        let room_ms = lease_ms.saturating_sub(store_timeout_ms);
        if room_ms == 0 {
            return Err(err(
                f("timeout_ms"),
                format!("no upstream timeout fits: the lease ({lease_ms} ms) must last the upstream call plus `store.timeout_ms` ({store_timeout_ms} ms), the time the claim's answer and the outcome take to travel between the filter and the store; raise `lease_seconds` or lower `store.timeout_ms`"),
            ));
        }
        let timeout_ms = self
            .timeout_ms
            .unwrap_or(DEFAULT_DETACHED_TIMEOUT_MS.min(lease_ms / 2).min(room_ms));
        if timeout_ms == 0 || timeout_ms > room_ms {
            return Err(err(
                f("timeout_ms"),
                format!("must be between 1 and {room_ms}: the lease ({lease_ms} ms) must last the upstream call plus `store.timeout_ms` ({store_timeout_ms} ms), the time the claim's answer and the outcome take to travel between the filter and the store, so that no other request can claim the key while the upstream may still act; lower `timeout_ms`, raise `lease_seconds` or lower `store.timeout_ms`"),
            ));
        }
        let max_response_body = self
            .max_response_body
            .unwrap_or(DEFAULT_MAX_RESPONSE_BODY.max(max_stored_body));
        if max_response_body < max_stored_body {
            return Err(err(
                f("max_response_body"),
                format!("must be at least `max_stored_body` ({max_stored_body} bytes): a response the store would keep must also reach the client"),
            ));
        }
        let upstream_timeout_ms = match lease_ms.saturating_sub(store_timeout_ms.saturating_mul(3)) {
            room if release_unknown && room > 0 => timeout_ms.min(room),
            _ => timeout_ms,
        };
        Ok(Forwarding::Detached(Detached {
            cluster: self.cluster,
            timeout_ms,
            upstream_timeout_ms,
            max_response_body,
        }))
    }
}
