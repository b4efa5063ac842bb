//! What the filter logs when it loads a configuration it accepts.

use super::{Config, Forwarding, OnUnknown, ENVOY_DEFAULT_BUFFER_LIMIT};

impl Config {
    /// What the filter logs when it loads: what the configuration asks of
    /// Envoy that Envoy's defaults do not give (a policy holding more of a
    /// body than Envoy's default buffer limit works only on a listener whose
    /// `per_connection_buffer_limit_bytes` is raised to match, else Envoy
    /// answers 413 or 500 itself; the filter cannot read that limit), and a
    /// detached `timeout_ms` the filter does not give as written
    /// ([`super::Detached::upstream_timeout_ms`]).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in &self.policies {
            if let (Forwarding::Detached(d), OnUnknown::Release) = (&p.forwarding, p.on_unknown) {
                if d.upstream_timeout_ms() < d.timeout_ms() {
                    out.push(format!(
                        "policy {:?}: forwarding.timeout_ms is {} ms, but its upstream request gets {} ms (the lease less three store.timeout_ms), so that an answer given in time is stored before the lease runs out; lower timeout_ms to that or raise lease_seconds",
                        p.name(),
                        d.timeout_ms(),
                        d.upstream_timeout_ms()
                    ));
                } else if p.lease_ms <= self.store.timeout_ms().saturating_mul(3) {
                    out.push(format!(
                        "policy {:?}: the lease ({} ms) is no longer than three store.timeout_ms; an upstream answer given near forwarding.timeout_ms may reach the store after the lease and run again on a retry (on_unknown: release); raise lease_seconds or lower store.timeout_ms",
                        p.name(),
                        p.lease_ms
                    ));
                }
            }
            for (field, bytes) in [
                ("max_request_body", p.max_request_body()),
                ("max_stored_body", p.max_stored_body()),
            ] {
                if bytes > ENVOY_DEFAULT_BUFFER_LIMIT {
                    out.push(format!(
                        "policy {:?}: {field} is {bytes} bytes, above Envoy's default buffer limit ({ENVOY_DEFAULT_BUFFER_LIMIT}); \
                         set the listener's per_connection_buffer_limit_bytes to at least {bytes}, or bodies between the two get Envoy's own 413 or 500",
                        p.name()
                    ));
                }
            }
        }
        out
    }
}
