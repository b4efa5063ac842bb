//! Unit tests of the parent module (compiled only for tests).
#![cfg(test)]

use super::*;
use proptest::prelude::*;

fn canon(json: &str) -> String {
    String::from_utf8(canonicalize(&parse(json.as_bytes()).unwrap()).unwrap()).unwrap()
}

macro_rules! number {
    ($name:ident, $bits:expr => $want:expr) => {
        #[test]
        fn $name() {
            assert_eq!(number_to_string(f64::from_bits($bits)).unwrap(), $want);
        }
    };
}

// RFC 8785 Appendix B, every finite row.
number!(rfc_positive_zero, 0x0000000000000000 => "0");
number!(rfc_negative_zero, 0x8000000000000000 => "0");
number!(rfc_min_positive, 0x0000000000000001 => "5e-324");
number!(rfc_min_negative, 0x8000000000000001 => "-5e-324");
number!(rfc_max_positive, 0x7fefffffffffffff => "1.7976931348623157e+308");
number!(rfc_max_negative, 0xffefffffffffffff => "-1.7976931348623157e+308");
number!(rfc_max_safe_integer_plus_one, 0x4340000000000000 => "9007199254740992");
number!(rfc_min_safe_integer_minus_one, 0xc340000000000000 => "-9007199254740992");
number!(rfc_two_to_the_68, 0x4430000000000000 => "295147905179352830000");
number!(rfc_just_below_1e23, 0x44b52d02c7e14af5 => "9.999999999999997e+22");
number!(rfc_exactly_1e23, 0x44b52d02c7e14af6 => "1e+23");
number!(rfc_just_above_1e23, 0x44b52d02c7e14af7 => "1.0000000000000001e+23");
number!(rfc_two_below_1e21, 0x444b1ae4d6e2ef4e => "999999999999999700000");
number!(rfc_one_below_1e21, 0x444b1ae4d6e2ef4f => "999999999999999900000");
number!(rfc_exactly_1e21, 0x444b1ae4d6e2ef50 => "1e+21");
number!(rfc_just_below_1e_6, 0x3eb0c6f7a0b5ed8c => "9.999999999999997e-7");
number!(rfc_exactly_1e_6, 0x3eb0c6f7a0b5ed8d => "0.000001");
number!(rfc_a_third_minus_two_ulps, 0x41b3de4355555553 => "333333333.3333332");
number!(rfc_a_third_minus_one_ulp, 0x41b3de4355555554 => "333333333.33333325");
number!(rfc_a_third, 0x41b3de4355555555 => "333333333.3333333");
number!(rfc_a_third_plus_one_ulp, 0x41b3de4355555556 => "333333333.3333334");
number!(rfc_a_third_plus_two_ulps, 0x41b3de4355555557 => "333333333.33333343");
number!(rfc_a_small_negative_fraction, 0xbecbf647612f3696 => "-0.0000033333333333333333");
number!(rfc_a_tie_rounded_to_even, 0x43143ff3c1cb0959 => "1424953923781206.2");
// The ECMAScript boundaries between the three notations.
number!(exactly_1e_7_has_an_exponent, 0x3e7ad7f29abcaf48 => "1e-7");
number!(one_half_has_a_leading_zero, 0x3fe0000000000000 => "0.5");
number!(a_small_integer_has_no_fraction, 0x40b0680000000000 => "4200");
number!(a_negative_integer_keeps_its_sign, 0xc045000000000000 => "-42");

#[test]
fn non_finite_numbers_are_refused() {
    // The rows of Appendix B that must be refused.
    for bits in [0x7fffffffffffffff_u64, 0x7ff0000000000000, 0xfff0000000000000] {
        let f = f64::from_bits(bits);
        assert_eq!(number_to_string(f), Err(JcsError::NonFiniteNumber));
    }
}

macro_rules! doc {
    ($name:ident, $json:expr => $want:expr) => {
        #[test]
        fn $name() {
            assert_eq!(canon($json), $want);
        }
    };
}

doc!(whitespace_is_removed, " { \"a\" : [ 1 , true , null ] } " => r#"{"a":[1,true,null]}"#);
doc!(members_are_sorted, r#"{"b":1,"a":2,"aa":3}"# => r#"{"a":2,"aa":3,"b":1}"#);
doc!(integers_and_decimals_agree, r#"[4200, 4200.0, 4.2e3, 42e2]"# => "[4200,4200,4200,4200]");
doc!(a_big_integer_is_read_as_a_double, "18446744073709551615" => "18446744073709552000");
doc!(a_huge_integer_literal_is_read_as_a_double, "1000000000000000000000000" => "1e+24");
doc!(negative_integers_are_doubles_too, "-42" => "-42");
doc!(named_escapes_are_used, r#""\b\f\n\r\t\"\\""# => r#""\b\f\n\r\t\"\\""#);
doc!(other_c0_controls_are_lowercase_unicode_escapes, r#""\u0000\u001F\u000b""# => r#""\u0000\u001f\u000b""#);
doc!(solidus_and_del_are_literal, r#""\/\u007f""# => "\"/\u{7f}\"");
doc!(non_ascii_is_literal, r#""\u20ac\u2028\ud83d\ude00""# => "\"€\u{2028}😀\"");
doc!(names_sort_by_utf16_code_units, "{\"\u{e000}\":1,\"\u{1f600}\":2,\"a\":3}" => "{\"a\":3,\"\u{1f600}\":2,\"\u{e000}\":1}");
doc!(nested_objects_are_sorted, r#"{"z":{"y":1,"x":[{"b":0,"a":0}]}}"# => r#"{"z":{"x":[{"a":0,"b":0}],"y":1}}"#);

// RFC 8785 §3.2.2.
#[test]
fn the_rfc_example_object_canonicalizes_as_published() {
    let input = r#"{
      "numbers": [333333333.33333329, 1E30, 4.50,
                  2e-3, 0.000000000000000000000000001],
      "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
      "literals": [null, true, false]
    }"#;
    let want = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
    assert_eq!(canon(input), want);
}

// RFC 8785 §3.2.3.
#[test]
fn the_rfc_sorting_example_is_ordered_by_utf16() {
    let input = r#"{
      "\u20ac": "Euro Sign",
      "\r": "Carriage Return",
      "\ufb33": "Hebrew Letter Dalet With Dagesh",
      "1": "One",
      "\ud83d\ude00": "Emoji: Grinning Face",
      "\u0080": "Control",
      "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let want = concat!(
        r#"{"\r":"Carriage Return","1":"One","#,
        "\"\u{80}\":\"Control\",",
        r#""ö":"Latin Small Letter O With Diaeresis","€":"Euro Sign","#,
        r#""😀":"Emoji: Grinning Face","#,
        "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
    );
    assert_eq!(canon(input), want);
}

#[test]
fn repeated_member_names_are_refused() {
    assert!(matches!(parse(br#"{"a":1,"a":2}"#), Err(JcsError::Invalid(_))));
    assert!(matches!(
        parse(br#"[{"x":{"a":1,"a":1}}]"#),
        Err(JcsError::Invalid(_))
    ));
    assert!(parse(br#"{"a":{"a":1},"b":{"a":1}}"#).is_ok());
}

#[test]
fn invalid_json_is_refused() {
    for bad in [
        "",
        " ",
        "{",
        "[1,]",
        "{\"a\":1} x",
        "{\"a\" 1}",
        "{a:1}",
        "NaN",
        "Infinity",
        "1e400",
        "-1e400",
        "01",
        "-",
        "1.",
        ".5",
        "+1",
        "1e",
        "1e+",
        "tru",
        "nul",
        "\"\\ud800\"",
        "\"\\udc00\"",
        "\"\\ud800\\u0041\"",
        "\"\\x\"",
        "\"\\u12\"",
        "\"\\u+123\"",
        "\"a\tb\"",
        "\"open",
        "\u{feff}{}",
    ] {
        assert!(parse(bad.as_bytes()).is_err(), "{bad}");
    }
}

#[test]
fn nesting_is_limited_to_128_levels() {
    let nest = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    assert!(parse(nest(128).as_bytes()).is_ok());
    assert!(parse(nest(129).as_bytes()).is_err());
    assert!(parse(nest(100_000).as_bytes()).is_err());
}

#[test]
fn non_utf8_input_is_refused() {
    assert!(parse(b"\"\xff\"").is_err());
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Writes `value` as JSON text with object members in reverse order.
fn reversed(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            format!("[{}]", items.iter().map(reversed).collect::<Vec<_>>().join(" , "))
        }
        Value::Object(members) => {
            let parts: Vec<String> = members
                .iter()
                .rev()
                .map(|(k, v)| format!("{}:\n{}", Value::String(k.clone()), reversed(v)))
                .collect();
            format!("{{ {} }}", parts.join(",\t"))
        }
        other => other.to_string(),
    }
}

proptest! {
    #[test]
    fn canonical_form_ignores_member_order_and_whitespace(value in json_value()) {
        let want = canonicalize(&value).unwrap();
        for text in [
            serde_json::to_string(&value).unwrap(),
            serde_json::to_string_pretty(&value).unwrap(),
            reversed(&value),
        ] {
            prop_assert_eq!(&canonicalize(&parse(text.as_bytes()).unwrap()).unwrap(), &want);
        }
    }

    #[test]
    fn canonical_form_is_a_fixed_point(value in json_value()) {
        let once = canonicalize(&value).unwrap();
        let twice = canonicalize(&parse(&once).unwrap()).unwrap();
        prop_assert_eq!(once, twice);
    }

    #[test]
    fn numbers_round_trip_through_their_string(f in any::<f64>().prop_filter("finite", |f| f.is_finite())) {
        let s = number_to_string(f).unwrap();
        // `-0` prints as `0`, and `-0.0 == 0.0`.
        prop_assert_eq!(s.parse::<f64>().unwrap(), f);
    }
}
