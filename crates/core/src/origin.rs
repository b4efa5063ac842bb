//! Where a response came from (contract §5), told from Envoy's
//! `response.code_details`.
//!
//! The filter sits before the router and before any filter placed after it,
//! so it sees their local replies in its response callbacks as if they were
//! the upstream's. Each detail string Envoy 1.40 emits on those paths is
//! listed here and classified by one question: could the upstream have
//! received the request? Never reached → the key is released; reached (or
//! can't tell) → the outcome is unknown. A detail this table does not know is
//! treated as "can't tell": a forgotten string costs a manual resolution,
//! never a second execution.
//!
//! The strings were read from a running Envoy 1.40.0 (`%RESPONSE_CODE_DETAILS%`
//! in an access log) and from Envoy's `ResponseCodeDetailValues` and
//! `Http::Utility::resetReasonToString`.

/// Where a response came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Upstream,
    /// Envoy or a filter after this one answered without the upstream ever
    /// getting the request (connect failure, no healthy host, circuit breaker,
    /// direct response, rate limit, authorization, fault abort): nothing was
    /// executed.
    NeverReached,
    /// Envoy answered after forwarding (reset, timeout): the upstream may have acted.
    LostAfterForwarding,
}

/// Details of a response the upstream produced itself.
pub const VIA_UPSTREAM: &str = "via_upstream";

/// Local replies given before the request could reach the upstream: exact
/// detail strings.
const NEVER_REACHED: [&str; 21] = [
    // Router: no place to send the request to.
    "direct_response",
    "route_not_found",
    "route_configuration_not_found",
    "cluster_not_found",
    "maintenance_mode",
    "no_healthy_upstream",
    "drop_overload",
    "unconditional_drop_overload",
    // Filters after this one refusing the request.
    "local_rate_limited",
    "request_rate_limited",
    "rate_limiter_error",
    "ext_authz_denied",
    "ext_authz_error",
    "fault_filter_abort",
    "request_payload_too_large",
    "filter_removed_required_request_headers",
    "filter_added_invalid_request_data",
    "absolute_path_rejected",
    "path_normalization_failed",
    "overload",
    "admin_filter_response",
];

/// Local replies given before reaching the upstream whose details carry a
/// variable part (`rbac_access_denied_matched_policy[deny-all]`).
const NEVER_REACHED_PREFIXES: [&str; 3] = [
    "rbac_access_denied",
    // jwt_authn after this filter: `jwt_authn_access_denied{Jwt_is_missing}`.
    "jwt_authn_access_denied",
    "csrf_origin_mismatch",
];

/// `upstream_reset_before_response_started{<reason>|<transport detail>}`:
/// the reasons that mean no byte of the request reached an upstream process.
const RESET_BEFORE_SENDING: [&str; 8] = [
    "overflow",
    "local_connection_failure",
    "remote_connection_failure",
    "connection_failure",
    "connection_timeout",
    // HTTP/2 REFUSED_STREAM: the peer guarantees it did not process the stream.
    "remote_refused_stream_reset",
    "local_refused_stream_reset",
    "connect_error",
];

const EARLY_RESET: &str = "upstream_reset_before_response_started";

/// Classifies a response by its `response.code_details`.
///
/// An empty value is what the filter (src/http.rs) hands over when it could
/// not read the property, so it means "can't tell": the response may be a
/// local reply given after forwarding as much as the upstream's own answer,
/// and it is never stored as the upstream's ([`Origin::LostAfterForwarding`],
/// the record turns unknown). A response Envoy relays from the upstream
/// says so explicitly, with [`VIA_UPSTREAM`].
pub fn classify(details: &str) -> Origin {
    if details.is_empty() {
        return Origin::LostAfterForwarding;
    }
    if details == VIA_UPSTREAM {
        return Origin::Upstream;
    }
    if NEVER_REACHED.contains(&details) || NEVER_REACHED_PREFIXES.iter().any(|p| details.starts_with(p)) {
        return Origin::NeverReached;
    }
    if let Some(rest) = details.strip_prefix(EARLY_RESET) {
        let reason = rest
            .trim_start_matches('{')
            .split(['|', '}'])
            .next()
            .unwrap_or_default();
        if RESET_BEFORE_SENDING.contains(&reason) {
            return Origin::NeverReached;
        }
    }
    // Timeouts, resets after sending (`upstream_reset_before_response_started
    // {connection_termination}`, `{remote_reset}`, `{protocol_error}`), resets
    // after the response started, stream and idle timeouts, and every detail
    // not listed above.
    Origin::LostAfterForwarding
}

/// The header Envoy's router adds to every response it got from an upstream,
/// also on the filter's own calls; Envoy's own replies lack it.
pub const UPSTREAM_MARK: &str = "x-envoy-upstream-service-time";

/// Classifies an answer to the filter's own upstream request (detached
/// forwarding), which carries no `response.code_details`: a response marked
/// with [`UPSTREAM_MARK`] is the upstream's; Envoy's own replies say why in
/// their body ("no healthy upstream", "upstream connect error or
/// disconnect/reset before headers. reset reason: connection failure"),
/// which reads as the detail strings above once spaces become underscores.
pub fn of_callout(marked: bool, body: &[u8]) -> Origin {
    if marked {
        return Origin::Upstream;
    }
    let text = String::from_utf8_lossy(body)
        .trim()
        .to_ascii_lowercase()
        .replace(' ', "_");
    if NEVER_REACHED.contains(&text.as_str()) {
        return Origin::NeverReached;
    }
    let reason = text
        .split_once("reset_reason:_")
        .and_then(|(_, rest)| rest.split(',').next());
    if reason.is_some_and(|r| RESET_BEFORE_SENDING.contains(&r)) {
        return Origin::NeverReached;
    }
    Origin::LostAfterForwarding
}

#[cfg(test)]
mod tests {
    use super::*;

    macro_rules! origin {
        ($name:ident, $details:expr => $want:ident) => {
            #[test]
            fn $name() {
                assert_eq!(classify($details), Origin::$want);
            }
        };
    }

    origin!(a_relayed_response_is_the_upstreams, "via_upstream" => Upstream);

    macro_rules! callout {
        ($name:ident, $marked:expr, $body:expr => $want:ident) => {
            #[test]
            fn $name() {
                assert_eq!(of_callout($marked, $body.as_bytes()), Origin::$want);
            }
        };
    }

    // Bodies as Envoy 1.40's router writes them for its own replies.
    callout!(a_marked_callout_answer_is_the_upstreams, true, "no healthy upstream" => Upstream);
    callout!(a_callout_with_no_healthy_host_never_reached, false, "no healthy upstream" => NeverReached);
    callout!(a_callout_refused_by_the_upstream_never_reached, false,
        "upstream connect error or disconnect/reset before headers. reset reason: connection failure, transport failure reason: delayed connect error: Connection refused" => NeverReached);
    callout!(a_callout_over_the_circuit_breaker_never_reached, false,
        "upstream connect error or disconnect/reset before headers. reset reason: overflow" => NeverReached);
    callout!(a_callout_reset_after_sending_may_have_run, false,
        "upstream connect error or disconnect/reset before headers. reset reason: connection termination" => LostAfterForwarding);
    callout!(a_callout_timeout_may_have_run, false, "upstream request timeout" => LostAfterForwarding);
    callout!(an_unmarked_unknown_answer_may_have_run, false, "" => LostAfterForwarding);
    // src/http.rs hands over "" when it cannot read the property.
    origin!(unreadable_details_cannot_tell, "" => LostAfterForwarding);
    // Never reached (each seen from Envoy 1.40.0 or listed in its sources).
    origin!(a_direct_response_never_reached, "direct_response" => NeverReached);
    origin!(no_route_never_reached, "route_not_found" => NeverReached);
    origin!(no_route_configuration_never_reached, "route_configuration_not_found" => NeverReached);
    origin!(no_cluster_never_reached, "cluster_not_found" => NeverReached);
    origin!(maintenance_mode_never_reached, "maintenance_mode" => NeverReached);
    origin!(no_healthy_upstream_never_reached, "no_healthy_upstream" => NeverReached);
    origin!(drop_overload_never_reached, "drop_overload" => NeverReached);
    origin!(unconditional_drop_overload_never_reached, "unconditional_drop_overload" => NeverReached);
    origin!(a_local_rate_limit_never_reached, "local_rate_limited" => NeverReached);
    origin!(a_global_rate_limit_never_reached, "request_rate_limited" => NeverReached);
    origin!(a_rate_limit_service_error_never_reached, "rate_limiter_error" => NeverReached);
    origin!(an_ext_authz_denial_never_reached, "ext_authz_denied" => NeverReached);
    origin!(an_ext_authz_error_never_reached, "ext_authz_error" => NeverReached);
    origin!(an_rbac_denial_never_reached, "rbac_access_denied_matched_policy[deny-all]" => NeverReached);
    origin!(an_rbac_denial_without_a_policy_never_reached, "rbac_access_denied_matched_policy[none]" => NeverReached);
    origin!(a_jwt_denial_never_reached, "jwt_authn_access_denied{Jwt_is_missing}" => NeverReached);
    origin!(a_csrf_denial_never_reached, "csrf_origin_mismatch" => NeverReached);
    origin!(a_fault_abort_never_reached, "fault_filter_abort" => NeverReached);
    origin!(a_buffer_limit_never_reached, "request_payload_too_large" => NeverReached);
    origin!(a_removed_header_never_reached, "filter_removed_required_request_headers" => NeverReached);
    origin!(invalid_request_data_never_reached, "filter_added_invalid_request_data" => NeverReached);
    origin!(an_absolute_path_never_reached, "absolute_path_rejected" => NeverReached);
    origin!(a_failed_normalization_never_reached, "path_normalization_failed" => NeverReached);
    origin!(the_overload_manager_never_reached, "overload" => NeverReached);
    origin!(an_admin_reply_never_reached, "admin_filter_response" => NeverReached);
    origin!(a_circuit_breaker_overflow_never_reached, "upstream_reset_before_response_started{overflow}" => NeverReached);
    origin!(a_refused_connection_never_reached,
        "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}" => NeverReached);
    origin!(a_local_connect_failure_never_reached, "upstream_reset_before_response_started{local_connection_failure}" => NeverReached);
    origin!(an_older_connect_failure_never_reached, "upstream_reset_before_response_started{connection_failure}" => NeverReached);
    origin!(a_connect_timeout_never_reached, "upstream_reset_before_response_started{connection_timeout}" => NeverReached);
    origin!(a_refused_stream_never_reached, "upstream_reset_before_response_started{remote_refused_stream_reset}" => NeverReached);
    origin!(a_locally_refused_stream_never_reached, "upstream_reset_before_response_started{local_refused_stream_reset}" => NeverReached);
    origin!(a_connect_error_never_reached, "upstream_reset_before_response_started{connect_error}" => NeverReached);
    // Reached, or can't tell.
    origin!(a_route_timeout_is_lost, "response_timeout" => LostAfterForwarding);
    origin!(an_older_route_timeout_is_lost, "upstream_response_timeout" => LostAfterForwarding);
    origin!(a_per_try_timeout_is_lost, "upstream_per_try_timeout" => LostAfterForwarding);
    origin!(a_per_try_idle_timeout_is_lost, "upstream_per_try_idle_timeout" => LostAfterForwarding);
    origin!(a_max_stream_duration_is_lost, "upstream_max_stream_duration_reached" => LostAfterForwarding);
    origin!(a_connection_termination_is_lost, "upstream_reset_before_response_started{connection_termination}" => LostAfterForwarding);
    origin!(a_remote_reset_is_lost, "upstream_reset_before_response_started{remote_reset}" => LostAfterForwarding);
    origin!(a_local_reset_is_lost, "upstream_reset_before_response_started{local_reset}" => LostAfterForwarding);
    origin!(a_protocol_error_is_lost, "upstream_reset_before_response_started{protocol_error}" => LostAfterForwarding);
    origin!(a_premature_half_close_is_lost,
        "upstream_reset_before_response_started{http1_premature_upstream_half_close}" => LostAfterForwarding);
    origin!(an_early_reset_without_reason_is_lost, "upstream_reset_before_response_started" => LostAfterForwarding);
    origin!(a_late_reset_is_lost, "upstream_reset_after_response_started{protocol_error}" => LostAfterForwarding);
    origin!(a_late_overflow_is_still_lost, "upstream_reset_after_response_started{overflow}" => LostAfterForwarding);
    origin!(a_retry_buffer_overflow_is_lost, "request_payload_exceeded_retry_buffer_limit" => LostAfterForwarding);
    origin!(a_request_timeout_is_lost, "request_overall_timeout" => LostAfterForwarding);
    origin!(a_stream_idle_timeout_is_lost, "stream_idle_timeout" => LostAfterForwarding);
    origin!(a_max_duration_timeout_is_lost, "max_duration_timeout" => LostAfterForwarding);
    origin!(a_client_disconnect_is_lost, "downstream_remote_disconnect" => LostAfterForwarding);
    origin!(a_response_buffer_limit_is_lost, "response_payload_too_large" => LostAfterForwarding);
    origin!(an_unlisted_detail_is_lost, "some_filter_said_no" => LostAfterForwarding);
    origin!(a_never_reached_name_inside_another_is_lost, "x_direct_response" => LostAfterForwarding);
}
