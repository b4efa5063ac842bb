//! The words of header field lines, decided here so the glue only copies
//! what Envoy has: what a header name is, which field lines count, when an
//! identity header is ambiguous, what `Idempotency-Control` says, and which
//! lines a request or response the filter sends itself leaves behind. The
//! crate's ground floor: it imports nothing of the crate, so every other
//! module may read lines with it (how a policy reads a request's head is
//! [`crate::exchange::request_head`]).

/// Header names are compared case-insensitively; these are written lower-case.
pub const KEY_HEADER: &str = "idempotency-key";
pub const CONTROL_HEADER: &str = "idempotency-control";

/// The longest header name the filter and the store take: a bound of the
/// contract like those of [`crate::limits`] (which lists it too), kept with
/// the rule it bounds.
pub const MAX_HEADER_NAME: usize = 256;

/// Whether `name` is a header name (an RFC 9110 token of at most
/// [`MAX_HEADER_NAME`] bytes): the one check for the policy's header
/// sources, fingerprint and replay headers, and the responses the store keeps.
pub fn is_header_name(name: &str) -> bool {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    (1..=MAX_HEADER_NAME).contains(&name.len()) && name.bytes().all(tchar)
}

/// Header field lines as Envoy hands them over: name, raw value.
pub type Lines = [(String, Vec<u8>)];

/// The values of every field line named `name`, in order.
pub fn values<'a>(lines: &'a Lines, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
    lines
        .iter()
        .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

/// The value of the only field line named `name`. Absent, or repeated (two
/// lines could name two identities), is `None`.
pub fn only<'a>(lines: &'a Lines, name: &str) -> Option<&'a [u8]> {
    let mut found = lines
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice());
    match (found.next(), found.next()) {
        (Some(value), None) => Some(value),
        _ => None,
    }
}

/// `content-length`, when present once and a number.
pub fn content_length(lines: &Lines) -> Option<u64> {
    std::str::from_utf8(only(lines, "content-length")?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What the upstream says about its response in `Idempotency-Control`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// It refused before acting: release the key.
    NoStore,
    /// It acted: store the response even if its status is in the release set.
    Store,
    /// It cannot tell whether it acted: mark the outcome unknown.
    Uncertain,
}

impl Control {
    /// What two statements come to: the safest wins.
    pub fn safest(a: Option<Control>, b: Option<Control>) -> Option<Control> {
        match (a, b) {
            (Some(Control::Uncertain), _) | (_, Some(Control::Uncertain)) => Some(Control::Uncertain),
            (Some(Control::Store), _) | (_, Some(Control::Store)) => Some(Control::Store),
            (None, None) => None,
            _ => Some(Control::NoStore),
        }
    }
}

/// Reads `Idempotency-Control` (any case, any number of lines, comma-separated
/// tokens; unknown tokens ignored). When the upstream says several things the
/// safest wins: `uncertain` over `store` over `no-store`, since releasing a key
/// that did act would let a retry run it twice.
pub fn control(lines: &Lines) -> Option<Control> {
    let mut said = None;
    for value in values(lines, CONTROL_HEADER) {
        for token in value.split(|b| *b == b',') {
            let heard = match token.trim_ascii().to_ascii_lowercase().as_slice() {
                b"no-store" => Control::NoStore,
                b"store" => Control::Store,
                b"uncertain" => Control::Uncertain,
                _ => continue,
            };
            said = Control::safest(said, Some(heard));
        }
    }
    said
}

/// A response's `:status`, 0 when unreadable.
pub fn status(lines: &Lines) -> u16 {
    values(lines, ":status")
        .next()
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and framing: a request or response
/// the filter sends on itself does not carry them; Envoy frames it anew.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "expect",
];

fn passes_on(name: &str) -> bool {
    !HOP_BY_HOP.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// The router's request headers that steer how Envoy forwards a request:
/// its retries, their conditions and count, its timeouts and hedging. Envoy
/// keeps them from callers it counts as internal (`internal_address_config`
/// of the connection manager) and acts on them, so a caller could have a
/// covered request retried behind the filter and executed twice. The filter
/// removes them from every request a policy covers, in observe mode too
/// (a retry there would run the request twice just the same), and its own
/// upstream call never carries them.
pub const ROUTER_STEERING: [&str; 6] = [
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
];

fn is_router_steering(name: &str) -> bool {
    ROUTER_STEERING.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// The [`ROUTER_STEERING`] headers `lines` carries, each name once: the ones
/// to remove from a covered request.
pub fn router_steering(lines: &Lines) -> impl Iterator<Item = &'static str> + '_ {
    ROUTER_STEERING
        .into_iter()
        .filter(|h| lines.iter().any(|(name, _)| name.eq_ignore_ascii_case(h)))
}

/// The headers of the request the filter sends on itself (detached
/// forwarding): every line but the hop-by-hop and [`ROUTER_STEERING`] ones.
/// `None` when a value is not UTF-8: the host API sends text only.
pub fn forwarded(lines: &Lines) -> Option<Vec<(String, String)>> {
    lines
        .iter()
        .filter(|(name, _)| passes_on(name) && !is_router_steering(name))
        .map(|(name, value)| Some((name.clone(), String::from_utf8(value.clone()).ok()?)))
        .collect()
}

/// The headers of a response the filter relays itself (detached
/// forwarding): all but pseudo-headers, hop-by-hop ones and values that are
/// not text.
pub fn relayed(lines: &Lines) -> Vec<(String, String)> {
    lines
        .iter()
        .filter(|(name, _)| !name.starts_with(':') && passes_on(name))
        .filter_map(|(name, value)| Some((name.clone(), String::from_utf8(value.clone()).ok()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_header_name_rule_for_every_configured_header() {
        for ok in ["x-tenant-id", "x.y", "x_y", "X-Client", "a"] {
            assert!(is_header_name(ok), "{ok}");
        }
        for bad in ["", "a b", "a:b", "a\u{1}", "ü"] {
            assert!(!is_header_name(bad), "{bad:?}");
        }
        assert!(!is_header_name(&"n".repeat(MAX_HEADER_NAME + 1)));
        // The same rule at each place that names a header.
        let policy = |field: &str| {
            format!(
                r#"{{"store": {{"cluster": "s", "token": "t"}}, "policies": [{{"name": "p",
                "match": {{"path": {{"prefix": "/"}}}}, "tenant": {{"header": "x-t"}}, {field}}}]}}"#
            )
        };
        for field in [
            r#""principal": {"header": "x.y"}"#,
            r#""fingerprint": {"headers": ["x.y"]}"#,
            r#""replay_headers": ["x.y"]"#,
        ] {
            assert!(
                crate::config::Config::parse(policy(field).as_bytes()).is_ok(),
                "{field}"
            );
        }
    }

    fn lines(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    macro_rules! control {
        ($name:ident, [$(($n:expr, $v:expr)),*] => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(control(&lines(&[$(($n, $v)),*])), $want);
            }
        };
    }

    control!(no_control_header_says_nothing, [] => None);
    control!(no_store_releases, [("idempotency-control", "no-store")] => Some(Control::NoStore));
    control!(store_forces_storing, [("idempotency-control", "store")] => Some(Control::Store));
    control!(uncertain_marks_unknown, [("idempotency-control", "uncertain")] => Some(Control::Uncertain));
    control!(control_is_case_insensitive_and_trimmed, [("Idempotency-Control", " Uncertain ")] => Some(Control::Uncertain));
    control!(an_unknown_token_is_ignored, [("idempotency-control", "maybe")] => None);
    control!(a_list_keeps_the_known_token, [("idempotency-control", "x-vendor, no-store")] => Some(Control::NoStore));
    control!(store_beats_no_store, [("idempotency-control", "no-store"), ("idempotency-control", "store")] => Some(Control::Store));
    control!(uncertain_beats_store, [("idempotency-control", "store, uncertain")] => Some(Control::Uncertain));
    control!(uncertain_beats_no_store_on_another_line, [("idempotency-control", "uncertain"), ("idempotency-control", "no-store")] => Some(Control::Uncertain));
    control!(other_headers_are_not_control, [("x-idempotency-control", "store")] => None);

    #[test]
    fn an_identity_header_counts_only_when_it_appears_once() {
        let one = lines(&[("X-Tenant", "acme")]);
        assert_eq!(only(&one, "x-tenant"), Some(&b"acme"[..]));
        let two = lines(&[("x-tenant", "acme"), ("x-tenant", "evil")]);
        assert_eq!(only(&two, "x-tenant"), None);
        assert_eq!(only(&lines(&[]), "x-tenant"), None);
    }

    #[test]
    fn every_key_line_is_collected_so_a_repeat_is_seen() {
        let l = lines(&[("Idempotency-Key", "a"), ("x", "y"), ("idempotency-key", "b")]);
        assert_eq!(
            values(&l, KEY_HEADER).collect::<Vec<_>>(),
            vec![&b"a"[..], &b"b"[..]]
        );
    }

    #[test]
    fn content_length_and_status_are_read_or_absent() {
        assert_eq!(content_length(&lines(&[("content-length", " 12 ")])), Some(12));
        assert_eq!(content_length(&lines(&[("content-length", "x")])), None);
        assert_eq!(content_length(&lines(&[])), None);
        assert_eq!(status(&lines(&[(":status", "201")])), 201);
        assert_eq!(status(&lines(&[(":status", "abc")])), 0);
    }

    #[test]
    fn a_covered_request_names_each_steering_header_it_carries_once() {
        let l = lines(&[
            ("X-Envoy-Max-Retries", "3"),
            ("x-a", "1"),
            ("x-envoy-retry-on", "5xx"),
            ("x-envoy-retry-on", "reset"),
        ]);
        assert_eq!(
            router_steering(&l).collect::<Vec<_>>(),
            ["x-envoy-retry-on", "x-envoy-max-retries"]
        );
        assert_eq!(router_steering(&lines(&[("x-a", "1")])).count(), 0);
        assert!(ROUTER_STEERING
            .iter()
            .all(|h| is_header_name(h) && *h == h.to_ascii_lowercase()));
    }

    #[test]
    fn a_relayed_response_keeps_all_but_framing() {
        let mut l = lines(&[
            (":status", "201"),
            ("Transfer-Encoding", "chunked"),
            ("set-cookie", "s"),
            ("x-a", "1"),
        ]);
        l.push(("x-b".to_string(), vec![0xff]));
        let want = vec![
            ("set-cookie".to_string(), "s".to_string()),
            ("x-a".to_string(), "1".to_string()),
        ];
        assert_eq!(relayed(&l), want);
    }
}
