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
mod tests;
