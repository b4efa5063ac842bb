//! Unit tests of the parent module (compiled only for tests).
#![cfg(test)]

use super::*;

fn spec(mode: &str, exclude: &[&str], headers: &[&str]) -> FingerprintSpec {
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    FingerprintSpec::from_parts(Some(mode), owned(exclude), owned(headers)).unwrap()
}

fn fp(spec: &FingerprintSpec, body: &str) -> Option<Fingerprint> {
    let mut f = Fingerprinter::new(spec, "POST", "payments.create", "/v1/payments?x=1", &[]);
    f.push(body.as_bytes());
    f.finish()
}

fn with_headers(spec: &FingerprintSpec, headers: &[(&str, &str)]) -> Option<Fingerprint> {
    let headers: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    Fingerprinter::new(spec, "POST", "p", "/", &headers).finish()
}

macro_rules! spec_case {
    ($name:ident, $mode:expr, $exclude:expr, $headers:expr, ok) => {
        #[test]
        fn $name() {
            let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            assert!(FingerprintSpec::from_parts($mode, owned(&$exclude), owned(&$headers)).is_ok());
        }
    };
    ($name:ident, $mode:expr, $exclude:expr, $headers:expr, err $needle:expr) => {
        #[test]
        fn $name() {
            let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            let err = FingerprintSpec::from_parts($mode, owned(&$exclude), owned(&$headers)).unwrap_err();
            assert!(err.contains($needle), "{err}");
        }
    };
}

spec_case!(no_mode_is_accepted, None, [], [], ok);
spec_case!(mode_json_is_accepted, Some("json"), ["/ts", ""], [], ok);
spec_case!(mode_raw_is_accepted, Some("raw"), [], ["x-a"], ok);
spec_case!(mode_none_is_accepted, Some("none"), [], [], ok);
spec_case!(an_unknown_mode_names_the_allowed_ones, Some("JSON"), [], [], err "`json`, `raw`, `none`");
spec_case!(exclude_with_raw_mode_is_rejected, Some("raw"), ["/ts"], [], err "only applies with mode `json`");
spec_case!(exclude_with_none_mode_is_rejected, Some("none"), ["/ts"], [], err "only applies with mode `json`");
spec_case!(an_exclude_without_a_leading_slash_is_rejected, None, ["ts"], [], err "not a JSON Pointer");
spec_case!(an_exclude_with_a_bad_escape_is_rejected, None, ["/a~2b"], [], err "not a JSON Pointer");
spec_case!(an_exclude_with_a_trailing_tilde_is_rejected, None, ["/a~"], [], err "not a JSON Pointer");
spec_case!(
    an_exclude_with_valid_escapes_is_accepted,
    None,
    ["/a~0b~1c/0"],
    [],
    ok
);
spec_case!(an_empty_header_name_is_rejected, None, [], [""], err "not a header name");
spec_case!(a_header_name_with_a_space_is_rejected, None, [], ["x a"], err "not a header name");
spec_case!(a_pseudo_header_is_rejected, None, [], [":authority"], err "not a header name");
spec_case!(a_header_listed_twice_is_rejected, None, [], ["x-a", "X-A"], err "listed twice");

#[test]
fn the_default_spec_is_json_without_headers() {
    assert_eq!(
        FingerprintSpec::from_parts(None, vec![], vec![]),
        Ok(FingerprintSpec::default())
    );
}

#[test]
fn header_names_are_lower_cased() {
    assert_eq!(spec("json", &[], &["X-Client-Id"]).headers, vec!["x-client-id"]);
}

macro_rules! hex_case {
    ($name:ident, $hex:expr => $ok:expr) => {
        #[test]
        fn $name() {
            assert_eq!(Fingerprint::try_from($hex.to_string()).is_ok(), $ok);
        }
    };
}

hex_case!(sixty_four_lower_hex_digits_are_a_fingerprint, "0123456789abcdef".repeat(4) => true);
hex_case!(upper_case_hex_is_rejected, "0123456789ABCDEF".repeat(4) => false);
hex_case!(sixty_three_digits_are_rejected, "a".repeat(63) => false);
hex_case!(sixty_five_digits_are_rejected, "a".repeat(65) => false);
hex_case!(non_hex_is_rejected, "g".repeat(64) => false);
hex_case!(an_empty_string_is_rejected, "" => false);

#[test]
fn a_fingerprint_round_trips_through_json() {
    let f = fp(&spec("raw", &[], &[]), "x").unwrap();
    let json = serde_json::to_string(&f).unwrap();
    assert_eq!(json, format!("\"{}\"", f.to_hex()));
    assert_eq!(serde_json::from_str::<Fingerprint>(&json).unwrap(), f);
}

macro_rules! same {
    ($name:ident, $spec:expr, $a:expr, $b:expr => $equal:expr) => {
        #[test]
        fn $name() {
            let s = $spec;
            assert_eq!(fp(&s, $a) == fp(&s, $b), $equal);
        }
    };
}

same!(json_ignores_member_order, spec("json", &[], &[]), r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"# => true);
same!(json_ignores_whitespace, spec("json", &[], &[]), r#"{"a":[1,2]}"#, "{ \"a\" :\n [ 1 , 2 ] }" => true);
same!(json_ignores_number_spelling, spec("json", &[], &[]), r#"{"amount":4200}"#, r#"{"amount":4200.0}"# => true);
same!(json_ignores_escapes_that_spell_the_same_text, spec("json", &[], &[]), r#"{"a":"é"}"#, r#"{"a":"\u00e9"}"# => true);
same!(json_sees_a_changed_value, spec("json", &[], &[]), r#"{"amount":4200}"#, r#"{"amount":4201}"# => false);
same!(json_sees_array_order, spec("json", &[], &[]), "[1,2]", "[2,1]" => false);
same!(json_hashes_invalid_json_raw, spec("json", &[], &[]), "{oops", "{oops " => false);
same!(json_hashes_the_same_invalid_json_alike, spec("json", &[], &[]), "{oops", "{oops" => true);
same!(json_treats_repeated_names_as_invalid, spec("json", &[], &[]), r#"{"a":1,"a":2}"#, r#"{"a":2}"# => false);
same!(exclude_drops_a_volatile_member, spec("json", &["/ts"], &[]), r#"{"a":1,"ts":"x"}"#, r#"{"ts":"y","a":1}"# => true);
same!(exclude_treats_a_missing_member_as_dropped, spec("json", &["/ts"], &[]), r#"{"a":1,"ts":"x"}"#, r#"{"a":1}"# => true);
same!(exclude_keeps_everything_else, spec("json", &["/ts"], &[]), r#"{"a":1,"ts":"x"}"#, r#"{"a":2,"ts":"x"}"# => false);
same!(exclude_reaches_into_nested_objects, spec("json", &["/meta/nonce"], &[]), r#"{"meta":{"nonce":1,"k":0}}"#, r#"{"meta":{"nonce":2,"k":0}}"# => true);
same!(exclude_unescapes_slash_and_tilde, spec("json", &["/a~1b/c~0d"], &[]), r#"{"a/b":{"c~d":1}}"#, r#"{"a/b":{"c~d":2}}"# => true);
same!(exclude_addresses_array_elements, spec("json", &["/items/0/nonce"], &[]), r#"{"items":[{"nonce":1,"q":2}]}"#, r#"{"items":[{"nonce":9,"q":2}]}"# => true);
same!(exclude_blanks_an_array_element_in_place, spec("json", &["/0", "/2"], &[]), "[1,2,3]", "[9,2,8]" => true);
same!(exclude_ignores_a_pointer_through_a_scalar, spec("json", &["/a/b"], &[]), r#"{"a":1}"#, r#"{"a":1}"# => true);
same!(exclude_ignores_a_leading_zero_index, spec("json", &["/01"], &[]), "[1,2]", "[1,3]" => false);
same!(exclude_of_the_root_ignores_the_body, spec("json", &[""], &[]), r#"{"a":1}"#, "[2]" => true);
same!(exclude_without_a_match_changes_nothing, spec("json", &["/zzz"], &[]), r#"{"a":1}"#, r#"{"a":1}"# => true);
same!(raw_sees_whitespace, spec("raw", &[], &[]), r#"{"a":1}"#, r#"{"a": 1}"# => false);
same!(raw_sees_member_order, spec("raw", &[], &[]), r#"{"a":1,"b":2}"#, r#"{"b":2,"a":1}"# => false);
same!(raw_hashes_equal_bytes_alike, spec("raw", &[], &[]), "abc", "abc" => true);

#[test]
fn mode_none_has_no_fingerprint() {
    assert_eq!(fp(&spec("none", &[], &[]), "anything"), None);
}

#[test]
fn a_canonical_body_and_the_same_raw_bytes_hash_apart() {
    let body = r#"{"a":1}"#;
    assert_ne!(
        fp(&spec("json", &[], &[]), body),
        fp(&spec("raw", &[], &[]), body)
    );
}

#[test]
fn invalid_json_in_json_mode_hashes_like_raw_mode() {
    assert_eq!(
        fp(&spec("json", &[], &[]), "{oops"),
        fp(&spec("raw", &[], &[]), "{oops")
    );
}

#[test]
fn chunk_boundaries_do_not_matter() {
    for s in [spec("raw", &[], &[]), spec("json", &[], &[])] {
        let mut f = Fingerprinter::new(&s, "POST", "p", "/", &[]);
        for chunk in [&b"{\"a\""[..], b":", b"1}"] {
            f.push(chunk);
        }
        let mut whole = Fingerprinter::new(&s, "POST", "p", "/", &[]);
        whole.push(b"{\"a\":1}");
        assert_eq!(f.finish(), whole.finish());
    }
}

#[test]
fn method_policy_and_path_each_count() {
    let s = spec("raw", &[], &[]);
    let base = Fingerprinter::new(&s, "POST", "p", "/a", &[]).finish();
    assert_ne!(base, Fingerprinter::new(&s, "PATCH", "p", "/a", &[]).finish());
    assert_ne!(base, Fingerprinter::new(&s, "POST", "q", "/a", &[]).finish());
    assert_ne!(base, Fingerprinter::new(&s, "POST", "p", "/a?x=1", &[]).finish());
}

#[test]
fn fields_cannot_shift_into_each_other() {
    let s = spec("raw", &[], &[]);
    assert_ne!(
        Fingerprinter::new(&s, "POST", "ab", "/c", &[]).finish(),
        Fingerprinter::new(&s, "POST", "a", "b/c", &[]).finish()
    );
}

#[test]
fn an_absent_header_differs_from_an_empty_one() {
    let s = spec("json", &[], &["x-a"]);
    assert_ne!(with_headers(&s, &[]), with_headers(&s, &[("x-a", "")]));
}

#[test]
fn configured_headers_count_and_others_do_not() {
    let s = spec("json", &[], &["x-a"]);
    assert_ne!(
        with_headers(&s, &[("x-a", "1")]),
        with_headers(&s, &[("x-a", "2")])
    );
    assert_eq!(
        with_headers(&s, &[("x-a", "1")]),
        with_headers(&s, &[("x-a", "1"), ("x-b", "2")])
    );
    assert_eq!(
        with_headers(&s, &[("X-A", "1")]),
        with_headers(&s, &[("x-a", "1")])
    );
}

#[test]
fn header_values_cannot_shift_between_headers() {
    let s = spec("json", &[], &["x-a", "x-b"]);
    assert_ne!(
        with_headers(&s, &[("x-a", "12"), ("x-b", "")]),
        with_headers(&s, &[("x-a", "1"), ("x-b", "2")])
    );
}

#[test]
fn a_repeated_header_differs_from_a_single_one() {
    let s = spec("json", &[], &["x-a"]);
    assert_ne!(
        with_headers(&s, &[("x-a", "1"), ("x-a", "1")]),
        with_headers(&s, &[("x-a", "1")])
    );
}
