//! JWT claims as identity (contract §2).
//!
//! `jwt_authn` writes the verified payload into dynamic metadata as a
//! `google.protobuf.Struct`. Envoy hands a property over without its type: a
//! string claim as its bytes, a number as the 8 bytes of a double, a boolean
//! as one byte, and a map (the payload itself) as untyped key/value pairs, so
//! neither a claim nor the payload says whether `12345678` is text or a
//! number. Only a protobuf message keeps its types, and the top-level
//! `metadata` property is one (`envoy.config.core.v3.Metadata`): the filter
//! reads it whole and this module finds the claim in it. A string claim is its
//! text; a number or boolean claim is its JSON text (`12345`, `true`); null,
//! objects and lists are no identity, and neither is a number whose JSON text
//! the double has lost (an integer from 2^53 on, or one with a fraction).
//!
//! The few protobuf fields needed are read by hand rather than with a
//! protobuf crate: the module runs in every Envoy worker, and its size is
//! memory (see the `wasm` profile).

/// The identity text of `claim` in the payload that the filter `filter`
/// (`envoy.filters.http.jwt_authn`) stored under `payload` in a serialized
/// `Metadata` message.
pub fn claim_in_metadata(metadata: &[u8], filter: &str, payload: &str, claim: &str) -> Option<Vec<u8>> {
    // Metadata { map<string, Struct> filter_metadata = 1; }
    let filter_struct = map_entry(metadata, 1, filter)?;
    // The payload is a Value whose struct_value (5) holds the claims.
    let payload_struct =
        Fields::new(struct_value(filter_struct, payload)?).find_map(|(field, wire)| match (field, wire) {
            (5, Wire::Bytes(s)) => Some(s),
            _ => None,
        })?;
    claim_text(payload_struct, claim)
}

/// The identity text of `claim` in a serialized `google.protobuf.Struct`.
fn claim_text(payload: &[u8], claim: &str) -> Option<Vec<u8>> {
    value_text(struct_value(payload, claim)?)
}

/// The serialized `Value` of field `name` of a `Struct` (`map<string, Value>
/// fields = 1`).
fn struct_value<'a>(s: &'a [u8], name: &str) -> Option<&'a [u8]> {
    map_entry(s, 1, name)
}

/// The value of `key` in the map field `field` of a message (entries `{key =
/// 1; value = 2}`); the last entry wins, as in protobuf's map semantics.
fn map_entry<'a>(message: &'a [u8], field: u64, key: &str) -> Option<&'a [u8]> {
    let mut found = None;
    for (f, wire) in Fields::new(message) {
        let (true, Wire::Bytes(entry)) = (f == field, wire) else {
            continue;
        };
        let mut k = None;
        let mut v = None;
        for (f, wire) in Fields::new(entry) {
            match (f, wire) {
                (1, Wire::Bytes(b)) => k = Some(b),
                (2, Wire::Bytes(b)) => v = Some(b),
                _ => {}
            }
        }
        if k == Some(key.as_bytes()) {
            found = Some(v.unwrap_or_default());
        }
    }
    found
}

/// `google.protobuf.Value`: null_value = 1, number_value = 2, string_value = 3,
/// bool_value = 4, struct_value = 5, list_value = 6 (a oneof: the last one set wins).
fn value_text(value: &[u8]) -> Option<Vec<u8>> {
    let mut text = None;
    for (field, wire) in Fields::new(value) {
        text = match (field, wire) {
            (2, Wire::Fixed64(bits)) => number_text(f64::from_bits(bits)),
            (3, Wire::Bytes(s)) => Some(s.to_vec()),
            (4, Wire::Varint(b)) => Some(if b != 0 {
                b"true".to_vec()
            } else {
                b"false".to_vec()
            }),
            _ => None,
        };
    }
    text
}

/// 2^53: from here on, neighbouring JSON integers become one double
/// (`9007199254740992` and `9007199254740993` both read as 2^53).
const EXACT_INTEGERS: f64 = 9_007_199_254_740_992.0;

/// A number claim's JSON text, or `None` (no identity) when the double
/// cannot give that text back. Only integers of magnitude below 2^53 can:
/// each is exactly one double and back. From 2^53 on, several integers share
/// a double, so two tenants would share a scope. A number with a fraction is
/// refused too: many JSON texts give one double (`0.1` and
/// `0.10000000000000001`; `1.5` and `1.50`), so no text written from it is
/// surely the token's. A refused claim counts as absent, so the request is
/// answered `identity-missing` rather than scoped by a rounded number. (An
/// integer written with a fraction or exponent, `1.0` or `1e0`, cannot be told
/// from `1` either, and reads as `1`, the text JSON encoders give integers.)
fn number_text(n: f64) -> Option<Vec<u8>> {
    // NaN and the infinities fail both tests.
    if n.fract() == 0.0 && n.abs() < EXACT_INTEGERS {
        #[allow(clippy::cast_possible_truncation)]
        return Some(format!("{}", n as i64).into_bytes());
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32,
}

/// The top-level fields of a protobuf message; stops at the first malformed byte.
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Fields { rest: bytes }
    }

    fn varint(&mut self) -> Option<u64> {
        let mut out = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.rest.split_first()?;
            self.rest = rest;
            out |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(out);
            }
        }
        None
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.rest.len() {
            return None;
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(head)
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = (u64, Wire<'a>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let tag = self.varint()?;
        let wire = match tag & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => Wire::Fixed64(u64::from_le_bytes(self.take(8)?.try_into().ok()?)),
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                Wire::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Wire::Fixed32
            }
            _ => {
                self.rest = &[];
                return None;
            }
        };
        Some((tag >> 3, wire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn varint(mut n: u64, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn bytes_field(field: u64, bytes: &[u8], out: &mut Vec<u8>) {
        varint(field << 3 | 2, out);
        varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }

    enum V<'a> {
        Null,
        Num(f64),
        Str(&'a str),
        Bool(bool),
        List,
    }

    /// A serialized Struct, as Envoy hands it over.
    fn payload(claims: &[(&str, V)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, v) in claims {
            let mut value = Vec::new();
            match v {
                V::Null => value.extend_from_slice(&[1 << 3, 0]),
                V::Num(n) => {
                    value.push(2 << 3 | 1);
                    value.extend_from_slice(&n.to_bits().to_le_bytes());
                }
                V::Str(s) => bytes_field(3, s.as_bytes(), &mut value),
                V::Bool(b) => value.extend_from_slice(&[4 << 3, u8::from(*b)]),
                V::List => bytes_field(6, &[], &mut value),
            }
            let mut entry = Vec::new();
            bytes_field(1, name.as_bytes(), &mut entry);
            bytes_field(2, &value, &mut entry);
            bytes_field(1, &entry, &mut out);
        }
        out
    }

    fn text(claims: &[(&str, V)], claim: &str) -> Option<String> {
        claim_text(&payload(claims), claim).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_string_claim_is_its_text() {
        assert_eq!(
            text(&[("sub", V::Str("alice")), ("tenant", V::Str("acme"))], "tenant").as_deref(),
            Some("acme")
        );
    }

    #[test]
    fn an_integer_claim_is_its_json_text() {
        assert_eq!(
            text(&[("tenant", V::Num(12345.0))], "tenant").as_deref(),
            Some("12345")
        );
        assert_eq!(text(&[("tenant", V::Num(-7.0))], "tenant").as_deref(), Some("-7"));
        assert_eq!(text(&[("tenant", V::Num(0.0))], "tenant").as_deref(), Some("0"));
    }

    /// The double that a JSON number in a token becomes in the `Struct`.
    fn json_number(json: &str) -> f64 {
        json.parse().unwrap()
    }

    fn number_claim(json: &str) -> Option<String> {
        text(&[("tenant", V::Num(json_number(json)))], "tenant")
    }

    #[test]
    fn two_integers_from_2_pow_53_on_never_share_an_identity() {
        // 2^53 and 2^53 + 1 are two tenants but one double.
        let (a, b) = ("9007199254740992", "9007199254740993");
        assert_eq!(json_number(a).to_bits(), json_number(b).to_bits());
        let (a, b) = (number_claim(a), number_claim(b));
        assert!(a.is_none() || a != b, "two tenants share the identity {a:?}");
    }

    #[test]
    fn an_integer_from_2_pow_53_on_is_no_identity() {
        for json in [
            "9007199254740992",
            "9007199254740993",
            "-9007199254740992",
            "-9007199254740993",
            "18446744073709551616",
            "1e300",
        ] {
            assert_eq!(number_claim(json), None, "{json}");
        }
    }

    #[test]
    fn an_integer_below_2_pow_53_is_its_json_text() {
        for json in ["9007199254740991", "-9007199254740991", "4294967296"] {
            assert_eq!(number_claim(json).as_deref(), Some(json));
        }
    }

    #[test]
    fn a_fractional_claim_is_no_identity() {
        // "0.1" and "0.10000000000000001" are one double; "1.5" may have been "1.50".
        assert_eq!(
            json_number("0.1").to_bits(),
            json_number("0.10000000000000001").to_bits()
        );
        for json in ["1.5", "0.1", "-2.25", "0.10000000000000001", "1e-7"] {
            assert_eq!(number_claim(json), None, "{json}");
        }
    }

    #[test]
    fn a_large_claim_in_the_metadata_is_missing() {
        let m = metadata(
            "jwt_payload",
            &[("tenant", V::Num(json_number("9007199254740993")))],
        );
        assert_eq!(
            claim_in_metadata(&m, "envoy.filters.http.jwt_authn", "jwt_payload", "tenant"),
            None
        );
    }

    #[test]
    fn a_boolean_claim_is_true_or_false() {
        assert_eq!(
            text(&[("admin", V::Bool(true))], "admin").as_deref(),
            Some("true")
        );
        assert_eq!(
            text(&[("admin", V::Bool(false))], "admin").as_deref(),
            Some("false")
        );
    }

    #[test]
    fn null_lists_and_absent_claims_are_no_identity() {
        let claims = [("a", V::Null), ("b", V::List)];
        assert_eq!(text(&claims, "a"), None);
        assert_eq!(text(&claims, "b"), None);
        assert_eq!(text(&claims, "c"), None);
    }

    #[test]
    fn a_claim_is_found_by_its_exact_name() {
        assert_eq!(
            text(&[("tenants", V::Str("x")), ("tenant", V::Str("y"))], "tenant").as_deref(),
            Some("y")
        );
    }

    /// A serialized `Metadata` with `claims` as jwt_authn's payload `name`.
    fn metadata(name: &str, claims: &[(&str, V)]) -> Vec<u8> {
        let mut payload_value = Vec::new();
        bytes_field(5, &payload(claims), &mut payload_value);
        let mut entry = Vec::new();
        bytes_field(1, name.as_bytes(), &mut entry);
        bytes_field(2, &payload_value, &mut entry);
        let mut filter_struct = Vec::new();
        bytes_field(1, &entry, &mut filter_struct);
        let mut filter_entry = Vec::new();
        bytes_field(1, b"envoy.filters.http.jwt_authn", &mut filter_entry);
        bytes_field(2, &filter_struct, &mut filter_entry);
        let mut out = Vec::new();
        // Another filter's metadata first: the right one is picked by name.
        let mut other = Vec::new();
        bytes_field(1, b"envoy.lb", &mut other);
        bytes_field(2, &[], &mut other);
        bytes_field(1, &other, &mut out);
        bytes_field(1, &filter_entry, &mut out);
        out
    }

    #[test]
    fn a_claim_is_found_in_the_whole_dynamic_metadata_with_its_type() {
        let m = metadata(
            "jwt_payload",
            &[("tenant", V::Num(12345678.0)), ("sub", V::Str("12345678"))],
        );
        let find = |payload, claim| {
            claim_in_metadata(&m, "envoy.filters.http.jwt_authn", payload, claim)
                .map(|b| String::from_utf8(b).unwrap())
        };
        assert_eq!(find("jwt_payload", "tenant").as_deref(), Some("12345678"));
        assert_eq!(find("jwt_payload", "sub").as_deref(), Some("12345678"));
        assert_eq!(find("other_payload", "tenant"), None);
        assert_eq!(find("jwt_payload", "missing"), None);
        assert_eq!(claim_in_metadata(&m, "envoy.lb", "jwt_payload", "tenant"), None);
    }

    #[test]
    fn garbage_is_no_identity() {
        assert_eq!(claim_text(b"\xff\xff\xff", "tenant"), None);
        assert_eq!(claim_text(b"", "tenant"), None);
        assert_eq!(claim_text(b"alice", "tenant"), None);
    }

    proptest! {
        #[test]
        #[allow(clippy::cast_precision_loss)]
        fn a_number_claim_is_exact_or_none(
            n in prop_oneof![
                any::<f64>(),
                any::<i64>().prop_map(|i| i as f64),
                (-(1i64 << 54)..(1i64 << 54)).prop_map(|i| i as f64),
            ],
        ) {
            if let Some(t) = text(&[("tenant", V::Num(n))], "tenant") {
                let i: i64 = t.parse().unwrap();
                prop_assert!(i.unsigned_abs() < 1 << 53);
                prop_assert_eq!(i as f64, n);
            }
        }

        #[test]
        fn claim_text_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = claim_text(&bytes, "tenant");
        }
    }
}
