//! RFC 8785 JSON Canonicalization Scheme (JCS).
//!
//! [`canonicalize`] writes a JSON value with no whitespace, object members
//! sorted by the UTF-16 code units of their names, strings escaped exactly as
//! ECMAScript's `JSON.stringify` does, and every number as ECMAScript's
//! `Number.prototype.toString` of its IEEE-754 double. Two documents that
//! differ only in member order, whitespace or number spelling (`4200` vs
//! `4200.0` vs `4.2e3`) therefore canonicalize to the same bytes.
//!
//! Integers are read as doubles like every other number, so integers beyond
//! 2^53 lose precision exactly as they would in a browser.
//!
//! [`parse`] is a small strict RFC 8259 parser rather than serde_json, for
//! two reasons: serde_json's default build rounds some decimal numbers to a
//! neighbouring double (about a third of 17-digit numbers, and the RFC's own
//! `333333333.33333329`), which would make equal documents canonicalize apart;
//! and it silently keeps the last of two members with the same name, which
//! I-JSON (and so RFC 8785) forbids. Here numbers are read with Rust's
//! correctly rounded `f64` parser, and a repeated member name, a lone
//! surrogate, a number out of the double range or nesting deeper than
//! [`MAX_DEPTH`] make the document invalid.

use serde_json::{Map, Number, Value};
use std::fmt::{self, Write};

/// How deeply arrays and objects may nest (serde_json's limit too).
pub const MAX_DEPTH: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JcsError {
    /// NaN or an infinity: JSON cannot express them.
    NonFiniteNumber,
    /// Not a JSON document (the message says why), or a document with a
    /// repeated member name.
    Invalid(String),
}

impl fmt::Display for JcsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JcsError::NonFiniteNumber => f.write_str("JSON numbers must be finite"),
            JcsError::Invalid(why) => write!(f, "not canonicalizable JSON: {why}"),
        }
    }
}

impl std::error::Error for JcsError {}

/// The RFC 8785 form of `value`.
pub fn canonicalize(value: &Value) -> Result<Vec<u8>, JcsError> {
    let mut out = String::new();
    write_value(&mut out, value)?;
    Ok(out.into_bytes())
}

fn write_value(out: &mut String, value: &Value) -> Result<(), JcsError> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let f = n.as_f64().ok_or(JcsError::NonFiniteNumber)?;
            out.push_str(&number_to_string(f)?);
        }
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item)?;
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            // UTF-16 order differs from Rust's UTF-8 order once names mix
            // characters above the BMP with U+E000..U+FFFF.
            sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, name);
                out.push(':');
                write_value(out, item)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// A string literal as ECMAScript's `JSON.stringify` writes it.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < ' ' => {
                // Writing to a String cannot fail.
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// ECMAScript `Number.prototype.toString` (ECMA-262 §6.1.6.1.20) of `f`.
pub fn number_to_string(f: f64) -> Result<String, JcsError> {
    if !f.is_finite() {
        return Err(JcsError::NonFiniteNumber);
    }
    if f == 0.0 {
        // Both zeros, as ECMAScript prints `-0` as `0`.
        return Ok("0".to_string());
    }
    let sign = if f < 0.0 { "-" } else { "" };
    // Rust's `{:e}` gives the shortest digits that read back as `f`, and of
    // those the closest to `f`: what ECMAScript asks for, except on exact
    // ties, which `even_on_tie` settles.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exponent: i64 = exponent.parse().unwrap_or(0);
    // ECMAScript's k (number of digits) and n (position of the decimal point).
    let k = i64::try_from(digits.len()).unwrap_or(i64::MAX);
    let n = exponent + 1;
    let digits = even_on_tie(f.abs(), digits, n - k);
    let body = if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat(usize::try_from(n - k).unwrap_or(0)))
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits
            .split_at_checked(usize::try_from(n).unwrap_or(0))
            .unwrap_or((&digits, ""));
        format!("{int}.{frac}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat(usize::try_from(-n).unwrap_or(0)))
    } else {
        let e = n - 1;
        let e_sign = if e < 0 { '-' } else { '+' };
        let (first, rest) = digits.split_at_checked(1).unwrap_or((&digits, ""));
        let rest = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        format!("{first}{rest}e{e_sign}{}", e.abs())
    };
    Ok(format!("{sign}{body}"))
}

/// `digits × 10^scale` is the shortest decimal that reads back as `x`. When
/// another decimal of the same length is exactly as close to `x`, ECMAScript
/// takes the one with the even last digit (ECMA-262 Number::toString, note 2;
/// RFC 8785's `1424953923781206.2`); Rust's formatter may take the odd one.
fn even_on_tie(x: f64, digits: String, scale: i64) -> String {
    let Ok(value) = digits.parse::<u128>() else {
        return digits;
    };
    if value % 2 == 0 {
        return digits;
    }
    for other in [value - 1, value + 1] {
        let other_digits = other.to_string();
        // A trailing zero or a carry would change the length: not a tie.
        if other % 10 == 0 || other_digits.len() != digits.len() {
            continue;
        }
        let midpoint = value.min(other) * 10 + 5;
        let reads_back = format!("{other_digits}e{scale}").parse::<f64>() == Ok(x);
        if reads_back && equals_decimal(x, midpoint, scale - 1) {
            return other_digits;
        }
    }
    digits
}

/// Whether the positive finite `x` is exactly `odd × 10^exp10`, with `odd` odd.
fn equals_decimal(x: f64, odd: u128, exp10: i64) -> bool {
    let bits = x.to_bits();
    let biased = (bits >> 52) & 0x7ff;
    let fraction = bits & ((1 << 52) - 1);
    let (mut mantissa, mut exp2) = if biased == 0 {
        (fraction, -1074)
    } else {
        (fraction | 1 << 52, i64::try_from(biased).unwrap_or(0) - 1075)
    };
    if mantissa == 0 {
        return false;
    }
    let zeros = mantissa.trailing_zeros();
    mantissa >>= zeros;
    exp2 += i64::from(zeros);
    // odd × 5^e × 2^e == mantissa × 2^exp2 with both odd parts odd: the powers
    // of two must match, then the odd parts.
    if exp2 != exp10 {
        return false;
    }
    let five = |e: i64| u32::try_from(e).ok().and_then(|e| 5u128.checked_pow(e));
    if exp10 >= 0 {
        five(exp10).and_then(|p| odd.checked_mul(p)) == Some(u128::from(mantissa))
    } else {
        five(-exp10).and_then(|p| u128::from(mantissa).checked_mul(p)) == Some(odd)
    }
}

/// Parses one JSON document strictly (see the module docs).
pub fn parse(bytes: &[u8]) -> Result<Value, JcsError> {
    let text = std::str::from_utf8(bytes).map_err(|_| JcsError::Invalid("not UTF-8".into()))?;
    let mut parser = Parser { text, pos: 0 };
    parser.skip_whitespace();
    let value = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != text.len() {
        return Err(parser.error("text after the document"));
    }
    Ok(value)
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> JcsError {
        JcsError::Invalid(format!("{what} at byte {}", self.pos))
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Result<(), JcsError> {
        if self.peek() != Some(byte) {
            return Err(self.error(&format!("expected `{}`", char::from(byte))));
        }
        self.pos += 1;
        Ok(())
    }

    fn value(&mut self, depth: usize) -> Result<Value, JcsError> {
        match self.peek() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string().map(Value::String),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.error("unexpected character")),
            None => Err(self.error("unexpected end")),
        }
    }

    fn literal(&mut self, word: &str, value: Value) -> Result<Value, JcsError> {
        if !self
            .text
            .get(self.pos..)
            .is_some_and(|rest| rest.starts_with(word))
        {
            return Err(self.error("unknown literal"));
        }
        self.pos += word.len();
        Ok(value)
    }

    fn object(&mut self, depth: usize) -> Result<Value, JcsError> {
        if depth >= MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        self.eat(b'{')?;
        let mut members = Map::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_whitespace();
            let at = self.pos;
            let name = self.string()?;
            self.skip_whitespace();
            self.eat(b':')?;
            self.skip_whitespace();
            let value = self.value(depth + 1)?;
            if members.insert(name, value).is_some() {
                return Err(JcsError::Invalid(format!("repeated member name at byte {at}")));
            }
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Object(members));
                }
                _ => return Err(self.error("expected `,` or `}`")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, JcsError> {
        if depth >= MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        self.eat(b'[')?;
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_whitespace();
            items.push(self.value(depth + 1)?);
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("expected `,` or `]`")),
            }
        }
    }

    fn string(&mut self) -> Result<String, JcsError> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let start = self.pos;
            while matches!(self.peek(), Some(b) if b != b'"' && b != b'\\' && b >= 0x20) {
                self.pos += 1;
            }
            // The run stops at an ASCII byte or the end, so both ends are
            // character boundaries.
            out.push_str(self.text.get(start..self.pos).unwrap_or_default());
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    out.push(self.escape()?);
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    /// The character an escape (after its `\`) stands for.
    fn escape(&mut self) -> Result<char, JcsError> {
        let c = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                let unit = self.hex4()?;
                let code = match unit {
                    0xD800..=0xDBFF => {
                        if !self.text.get(self.pos..).is_some_and(|r| r.starts_with("\\u")) {
                            return Err(self.error("lone surrogate"));
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(self.error("lone surrogate"));
                        }
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    _ => unit,
                };
                // Only a lone low surrogate is left to refuse here.
                return char::from_u32(code).ok_or_else(|| self.error("lone surrogate"));
            }
            _ => return Err(self.error("unknown escape")),
        };
        self.pos += 1;
        Ok(c)
    }

    fn hex4(&mut self) -> Result<u32, JcsError> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| self.error("expected four hex digits"))?;
        let unit = u32::from_str_radix(digits, 16).map_err(|_| self.error("expected four hex digits"))?;
        self.pos += 4;
        Ok(unit)
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<Value, JcsError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let leading_zero = self.peek() == Some(b'0');
        match self.digits() {
            0 => return Err(self.error("expected a digit")),
            n if leading_zero && n > 1 => return Err(self.error("leading zero")),
            _ => {}
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.error("expected a digit"));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("expected a digit"));
            }
        }
        let f = self
            .text
            .get(start..self.pos)
            .and_then(|s| s.parse::<f64>().ok())
            .and_then(Number::from_f64)
            .ok_or_else(|| self.error("number out of the double range"))?;
        Ok(Value::Number(f))
    }
}

#[cfg(test)]
mod tests {
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
}
