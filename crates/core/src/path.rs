//! Path normalization for policy matching and fingerprints (contract §4).
//!
//! Many frameworks execute `/v1/payments/`, `//v1/payments`, `/v1/./payments`
//! and `/v1/%70ayments` as `/v1/payments` (Express with its default
//! non-strict routing, for one). A policy must therefore cover every spelling
//! of its path, and a retry in another spelling must be the same request. The
//! normal form: unreserved percent-escapes decoded (RFC 3986 §6.2.2.2) and the
//! other escapes' hex upper-cased, runs of `/` merged, dot segments removed
//! (§5.2.4), no trailing `/` (except the root). `%2F` stays encoded: whether it
//! separates segments is the upstream's choice, which is why the bootstraps
//! reject it before it gets here (`path_with_escaped_slashes_action`).

/// The normal form of a path without its query (a `?…` or `#…` is cut off).
pub fn normalize(path: &str) -> String {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let mut out = String::with_capacity(decoded.len() + 1);
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// The query of a `:path`, with its `?`, or empty.
pub fn query(path: &str) -> &str {
    let path = path.split('#').next().unwrap_or_default();
    path.find('?').map_or("", |at| &path[at..])
}

fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(h, l)| h * 16 + l),
            _ => None,
        };
        match escape {
            Some(b) if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => {
                out.push(char::from(b));
                i += 3;
            }
            Some(b) => {
                out.push_str(&format!("%{b:02X}"));
                i += 3;
            }
            None if bytes[i] == b'%' => {
                out.push('%');
                i += 1;
            }
            None => {
                // Up to the next `%` as it is; `i` is always on a character
                // boundary (after ASCII or before a `%`), so this slices safely.
                let rest = path.get(i..).unwrap_or_default();
                let run = rest.find('%').unwrap_or(rest.len());
                out.push_str(&rest[..run]);
                i += run;
            }
        }
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    macro_rules! normal {
        ($name:ident, $raw:expr => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(normalize($raw), $want);
            }
        };
    }

    normal!(a_normal_path_is_unchanged, "/v1/payments" => "/v1/payments");
    normal!(a_trailing_slash_is_dropped, "/v1/payments/" => "/v1/payments");
    normal!(the_root_stays, "/" => "/");
    normal!(an_empty_path_is_the_root, "" => "/");
    normal!(double_slashes_are_merged, "//v1//payments" => "/v1/payments");
    normal!(a_dot_segment_is_removed, "/v1/./payments" => "/v1/payments");
    normal!(a_dot_dot_segment_removes_its_parent, "/v1/refunds/../payments" => "/v1/payments");
    normal!(dot_dot_never_climbs_above_the_root, "/../../v1/payments" => "/v1/payments");
    normal!(an_encoded_unreserved_letter_is_decoded, "/v1/%70ayments" => "/v1/payments");
    normal!(lower_case_hex_is_decoded_too, "/v1/%7epay" => "/v1/~pay");
    normal!(encoded_dots_are_dot_segments, "/v1/%2E%2e/v2/payments" => "/v2/payments");
    normal!(an_encoded_slash_stays_encoded_in_upper_case, "/v1/a%2fb" => "/v1/a%2Fb");
    normal!(a_reserved_escape_stays_encoded, "/v1/a%20b" => "/v1/a%20b");
    normal!(a_broken_escape_is_kept, "/v1/%zz/%4" => "/v1/%zz/%4");
    normal!(the_query_is_cut_off, "/v1/payments/?a=/b/../" => "/v1/payments");
    normal!(a_fragment_is_cut_off, "/v1/payments#x" => "/v1/payments");
    normal!(case_is_kept, "/V1/Payments" => "/V1/Payments");
    normal!(non_ascii_is_kept, "/v1/caf\u{e9}" => "/v1/caf\u{e9}");

    #[test]
    fn the_query_is_kept_apart() {
        assert_eq!(query("/a?b=1#f"), "?b=1");
        assert_eq!(query("/a"), "");
    }

    proptest! {
        #[test]
        fn normalizing_is_idempotent_and_never_panics(path in "[/a-zA-Z.%0-9~?#\u{e9}-]{0,40}") {
            let once = normalize(&path);
            prop_assert_eq!(normalize(&once), once.clone());
            prop_assert!(once.starts_with('/'));
        }
    }
}
