//! What the exchange sees of a request's and a response's head, and how the
//! filter reads it from Envoy's header maps under a policy: the identity
//! and key lines, the fingerprint lines, the upstream call of detached
//! forwarding, a response's status and where it came from.

use super::step::UpstreamCall;
use crate::config::{Forwarding, Identity, Mode, Policy, Source};
use crate::headers::{self, content_length, only, status, values, Lines, KEY_HEADER};
use crate::origin::{self, Origin};
use crate::trace::Trace;

/// What the filter found in the request headers, read according to the policy.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    pub method: String,
    /// Path with query.
    pub path: String,
    /// Raw values of every `Idempotency-Key` field line.
    pub key_fields: Vec<Vec<u8>>,
    /// From the policy's tenant source; `None` when absent.
    pub tenant: Option<Vec<u8>>,
    pub principal: Option<Vec<u8>>,
    /// The policy's fingerprint headers that are present, in policy order.
    pub fingerprint_headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    /// The request has no body.
    pub end_of_stream: bool,
    /// Under detached forwarding, the request the filter sends itself once
    /// it owns the key; `None`: through Envoy's router.
    pub upstream: Option<UpstreamCall>,
    pub trace: Trace,
}

#[derive(Debug, Clone)]
pub struct ResponseHead {
    pub status: u16,
    pub origin: Origin,
    pub headers: Vec<(String, Vec<u8>)>,
    pub content_length: Option<u64>,
    pub end_of_stream: bool,
}

/// The filter's own upstream request under detached forwarding: the
/// request's headers as [`headers::forwarded`] leaves them, to the policy's
/// cluster or else the route's. `None` (the request goes through Envoy's
/// router instead) when there is no cluster to call (a route without one,
/// such as a direct response) or a header value is not UTF-8 (the host API
/// sends text only); and in observe mode, which never changes how traffic
/// flows.
pub fn upstream_call(policy: &Policy, route_cluster: Option<&str>, lines: &Lines) -> Option<UpstreamCall> {
    let Forwarding::Detached(detached) = policy.forwarding() else {
        return None;
    };
    if policy.mode() == Mode::Observe {
        return None;
    }
    let cluster = detached.cluster().or(route_cluster).filter(|c| !c.is_empty())?;
    Some(UpstreamCall {
        cluster: cluster.to_string(),
        headers: headers::forwarded(lines)?,
        timeout_ms: detached.upstream_timeout_ms(),
    })
}

/// Builds the exchange's view of a request covered by `policy`. `path` is the
/// request's `:path` as received; `claim(payload, claim)` reads a JWT claim
/// (see [`crate::jwt`]); `route_cluster` is the cluster Envoy routes the
/// request to, for detached forwarding.
pub fn request_head(
    policy: &Policy,
    method: &str,
    path: &str,
    lines: &Lines,
    claim: &mut dyn FnMut(&str, &str) -> Option<Vec<u8>>,
    route_cluster: Option<&str>,
    end_of_stream: bool,
) -> RequestHead {
    let mut identity = |source: &Source| match source {
        Source::Header(name) => only(lines, name).map(<[u8]>::to_vec),
        Source::Jwt { payload, claim: name } => claim(payload, name),
    };
    let (tenant, principal) = match &policy.identity() {
        Identity::Anonymous => (None, None),
        Identity::Sourced { tenant, principal } => {
            (identity(tenant), principal.as_ref().and_then(&mut identity))
        }
    };
    RequestHead {
        method: method.to_string(),
        path: policy.matcher().fingerprint_path(path),
        key_fields: values(lines, KEY_HEADER).map(<[u8]>::to_vec).collect(),
        tenant,
        principal,
        // Every line, so two requests that differ in a repeated header's
        // second line do not share a fingerprint.
        fingerprint_headers: policy
            .fingerprint()
            .headers
            .iter()
            .flat_map(|name| values(lines, name).map(move |v| (name.clone(), v.to_vec())))
            .collect(),
        content_length: content_length(lines),
        end_of_stream,
        upstream: upstream_call(policy, route_cluster, lines),
        trace: Trace::of_request(lines),
    }
}

/// Builds the exchange's view of a response from its header lines and
/// Envoy's `response.code_details`.
pub fn response_head(lines: Vec<(String, Vec<u8>)>, code_details: &str, end_of_stream: bool) -> ResponseHead {
    ResponseHead {
        status: status(&lines),
        origin: origin::classify(code_details),
        content_length: content_length(&lines),
        headers: lines.into_iter().filter(|(n, _)| !n.starts_with(':')).collect(),
        end_of_stream,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn lines(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    const CONFIG: &str = r#"{"store": {"cluster": "s", "token": "t"}, "policies": [
        {"name": "pay", "match": {"path": {"prefix": "/pay"}}, "tenant": {"header": "x-tenant"},
         "principal": {"jwt": {"payload": "p", "claim": "sub"}},
         "fingerprint": {"headers": ["x-a"]}},
        {"name": "anon", "match": {"path": {"prefix": "/anon"}}, "anonymous": true}]}"#;

    #[test]
    fn a_detached_request_goes_to_the_policys_cluster_or_the_routes_or_through_the_router() {
        let policy = |forwarding: &str, mode: &str| {
            let json = format!(
                r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "p",
                "match": {{"path": {{"prefix": "/"}}}}, "anonymous": true, "mode": "{mode}",
                "forwarding": {forwarding}}}]}}"#
            );
            Config::parse(json.as_bytes()).unwrap().policies()[0].clone()
        };
        let l = lines(&[
            (":path", "/p"),
            ("Connection", "close"),
            ("content-length", "2"),
            ("x-a", "1"),
        ]);
        let detached = policy(r#"{"mode": "detached"}"#, "enforce");
        let call = upstream_call(&detached, Some("route"), &l).unwrap();
        assert_eq!(call.cluster, "route");
        assert_eq!(
            call.headers,
            vec![
                (":path".to_string(), "/p".to_string()),
                ("x-a".to_string(), "1".to_string())
            ]
        );
        let named = policy(r#"{"mode": "detached", "cluster": "named"}"#, "enforce");
        assert_eq!(upstream_call(&named, Some("route"), &l).unwrap().cluster, "named");
        // Through the router: no cluster to call, a header the host API cannot
        // send, observe mode, streaming mode.
        assert_eq!(upstream_call(&detached, None, &l), None);
        assert_eq!(upstream_call(&detached, Some(""), &l), None);
        let mut binary = l.clone();
        binary.push(("x-b".to_string(), vec![0xff]));
        assert_eq!(upstream_call(&detached, Some("route"), &binary), None);
        let observed = policy(r#"{"mode": "detached"}"#, "observe");
        assert_eq!(upstream_call(&observed, Some("route"), &l), None);
        let streaming = policy(r#"{"mode": "streaming"}"#, "enforce");
        assert_eq!(upstream_call(&streaming, Some("route"), &l), None);
    }

    #[test]
    fn the_detached_call_never_carries_the_routers_steering_headers() {
        let json = r#"{"store": {"cluster": "s", "token": "t"}, "policies": [{"name": "p",
            "match": {"path": {"prefix": "/"}}, "anonymous": true,
            "forwarding": {"mode": "detached"}}]}"#;
        let detached = Config::parse(json.as_bytes()).unwrap().policies()[0].clone();
        let mut l = lines(&[(":path", "/p"), ("x-a", "1")]);
        for (i, name) in headers::ROUTER_STEERING.iter().enumerate() {
            // Any case, repeated, with a value Envoy would act on.
            l.push((name.to_string(), b"5xx".to_vec()));
            l.push((name.to_ascii_uppercase(), b"3".to_vec()));
            l.push((format!("x-other-{i}"), b"kept".to_vec()));
        }
        // Look-alikes are not the router's.
        l.push(("x-envoy-retry-on-x".to_string(), b"kept".to_vec()));
        l.push(("x-envoy-retriable-status-codes".to_string(), b"500".to_vec()));
        let call = upstream_call(&detached, Some("route"), &l).unwrap();
        let names: Vec<&str> = call.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                ":path",
                "x-a",
                "x-other-0",
                "x-other-1",
                "x-other-2",
                "x-other-3",
                "x-other-4",
                "x-other-5",
                "x-envoy-retry-on-x",
                "x-envoy-retriable-status-codes"
            ]
        );
    }

    #[test]
    fn a_request_head_reads_identity_key_lines_and_every_fingerprint_line() {
        let config = Config::parse(CONFIG.as_bytes()).unwrap();
        let l = lines(&[
            ("x-tenant", "acme"),
            ("idempotency-key", "k"),
            ("x-a", "1"),
            ("X-A", "2"),
            ("content-length", "2"),
        ]);
        let mut asked = Vec::new();
        let mut claim = |payload: &str, name: &str| {
            asked.push(format!("{payload}/{name}"));
            Some(b"alice".to_vec())
        };
        let head = request_head(
            &config.policies()[0],
            "POST",
            "/pay//x/?q=1",
            &l,
            &mut claim,
            None,
            false,
        );
        assert_eq!(asked, vec!["p/sub"]);
        assert_eq!(head.tenant.as_deref(), Some(&b"acme"[..]));
        assert_eq!(head.principal.as_deref(), Some(&b"alice"[..]));
        assert_eq!(head.key_fields, vec![b"k".to_vec()]);
        assert_eq!(
            head.fingerprint_headers,
            vec![
                ("x-a".to_string(), b"1".to_vec()),
                ("x-a".to_string(), b"2".to_vec())
            ]
        );
        assert_eq!(head.path, "/pay/x?q=1");
        assert_eq!(head.content_length, Some(2));
    }

    #[test]
    fn an_anonymous_policy_reads_no_identity() {
        let config = Config::parse(CONFIG.as_bytes()).unwrap();
        let mut claim = |_: &str, _: &str| -> Option<Vec<u8>> { panic!("no claim is read") };
        let head = request_head(
            &config.policies()[1],
            "POST",
            "/anon",
            &lines(&[("x-tenant", "a")]),
            &mut claim,
            None,
            true,
        );
        assert_eq!((head.tenant, head.principal), (None, None));
        assert!(head.end_of_stream);
    }

    #[test]
    fn a_response_head_drops_pseudo_headers_and_classifies_its_origin() {
        let head = response_head(
            lines(&[(":status", "429"), ("content-length", "0"), ("x-ratelimit", "1")]),
            "local_rate_limited",
            true,
        );
        assert_eq!(head.status, 429);
        assert_eq!(head.origin, Origin::NeverReached);
        assert_eq!(head.content_length, Some(0));
        assert_eq!(
            head.headers,
            lines(&[("content-length", "0"), ("x-ratelimit", "1")])
        );
    }
}
