//! The record's identity (contract §2).
//!
//! A record is never identified by the bare key but by the tuple
//! `(scope_version, tenant, principal, route, namespace, key)`. Tenant,
//! principal and route are 1–255 bytes of UTF-8 without control characters; a
//! component that breaks these rules is refused (fail closed), never stripped
//! or escaped. The same checks run when a tuple is deserialized, so an invalid
//! one never reaches the store's database. Whenever the tuple becomes one byte
//! string ([`Scope::encode`]) or a digest, every component is length-prefixed,
//! so two different tuples can never encode alike.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::key::Key;

pub const SCOPE_VERSION: &str = "v1";
/// Tenant and principal of an anonymous policy, or principal when none is configured.
pub const EVERYONE: &str = "*";
/// The longest tenant, principal or route, in bytes.
pub const MAX_COMPONENT_LEN: usize = 255;

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Namespace {
    /// Keys sent by clients.
    #[serde(rename = "u")]
    Client,
    /// Reserved for keys minted by servers calling the store directly.
    #[serde(rename = "s")]
    Server,
}

impl Namespace {
    /// The one-letter form used on the wire and in [`Scope::encode`].
    pub fn as_str(self) -> &'static str {
        match self {
            Namespace::Client => "u",
            Namespace::Server => "s",
        }
    }
}

/// `(scope_version, tenant, principal, route, namespace, key)`, validated.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawScope")]
pub struct Scope {
    version: String,
    tenant: String,
    principal: String,
    route: String,
    namespace: Namespace,
    key: Key,
}

/// What the wire may say, before [`Scope`]'s checks.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScope {
    version: String,
    #[cfg_attr(feature = "schema", schemars(length(max = 255)))]
    tenant: String,
    #[cfg_attr(feature = "schema", schemars(length(max = 255)))]
    principal: String,
    #[cfg_attr(feature = "schema", schemars(length(max = 255)))]
    route: String,
    namespace: Namespace,
    key: Key,
}

/// Which rule a component broke; the `&'static str` names the component
/// (`"tenant"`, `"principal"` or `"route"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeError {
    Empty(&'static str),
    TooLong(&'static str),
    ControlCharacter(&'static str),
    UnsupportedVersion,
}

impl std::fmt::Display for ScopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScopeError::Empty(what) => write!(f, "the {what} is empty"),
            ScopeError::TooLong(what) => {
                write!(f, "the {what} is longer than {MAX_COMPONENT_LEN} bytes")
            }
            ScopeError::ControlCharacter(what) => write!(f, "the {what} contains a control character"),
            ScopeError::UnsupportedVersion => write!(f, "the scope version is not `{SCOPE_VERSION}`"),
        }
    }
}

impl std::error::Error for ScopeError {}

fn check(what: &'static str, value: &str) -> Result<(), ScopeError> {
    if value.is_empty() {
        return Err(ScopeError::Empty(what));
    }
    if value.len() > MAX_COMPONENT_LEN {
        return Err(ScopeError::TooLong(what));
    }
    if value.chars().any(char::is_control) {
        return Err(ScopeError::ControlCharacter(what));
    }
    Ok(())
}

impl Scope {
    pub fn new(
        tenant: &str,
        principal: &str,
        route: &str,
        namespace: Namespace,
        key: Key,
    ) -> Result<Scope, ScopeError> {
        check("tenant", tenant)?;
        check("principal", principal)?;
        check("route", route)?;
        Ok(Scope {
            version: SCOPE_VERSION.to_string(),
            tenant: tenant.to_string(),
            principal: principal.to_string(),
            route: route.to_string(),
            namespace,
            key,
        })
    }
    pub fn version(&self) -> &str {
        &self.version
    }
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
    pub fn principal(&self) -> &str {
        &self.principal
    }
    pub fn route(&self) -> &str {
        &self.route
    }
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Unambiguous encoding of the whole tuple: for each component in order,
    /// its length as a big-endian `u32`, then its bytes.
    pub fn encode(&self) -> Vec<u8> {
        encode_parts(self.parts())
    }

    /// SHA-256 of [`Scope::encode`].
    pub fn digest(&self) -> [u8; 32] {
        digest_parts(self.parts())
    }

    /// The six components in encoding order: version, tenant, principal,
    /// route, namespace, key.
    pub fn parts(&self) -> [&str; 6] {
        [
            self.version.as_str(),
            self.tenant.as_str(),
            self.principal.as_str(),
            self.route.as_str(),
            self.namespace.as_str(),
            self.key.as_str(),
        ]
    }
}

/// [`Scope::encode`] of the six components as stored (see [`Scope::parts`]),
/// without validating them: a store computes the digest of rows it wrote
/// earlier with this.
pub fn encode_parts(parts: [&str; 6]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| 4 + p.len()).sum());
    for part in parts {
        // Every component is at most 255 bytes, so the length always fits.
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(part.as_bytes());
    }
    out
}

/// [`Scope::digest`] of the six components as stored.
pub fn digest_parts(parts: [&str; 6]) -> [u8; 32] {
    Sha256::digest(encode_parts(parts)).into()
}

impl TryFrom<RawScope> for Scope {
    type Error = ScopeError;

    fn try_from(raw: RawScope) -> Result<Self, Self::Error> {
        if raw.version != SCOPE_VERSION {
            return Err(ScopeError::UnsupportedVersion);
        }
        Scope::new(&raw.tenant, &raw.principal, &raw.route, raw.namespace, raw.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(k: &str) -> Key {
        Key::try_from(k.to_string()).unwrap()
    }

    fn scope(tenant: &str, principal: &str, route: &str) -> Result<Scope, ScopeError> {
        Scope::new(tenant, principal, route, Namespace::Client, key("k1"))
    }

    macro_rules! case {
        ($name:ident, $tenant:expr, $principal:expr, $route:expr => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(scope($tenant, $principal, $route).err(), $want);
            }
        };
    }

    case!(a_plain_tuple_is_accepted, "acme", "user-1", "payments.create" => None);
    case!(unicode_components_are_accepted, "äcme ☃", "用户", "route" => None);
    case!(components_of_255_bytes_are_accepted, &"t".repeat(255), &"p".repeat(255), &"r".repeat(255) => None);
    case!(an_empty_tenant_is_rejected, "", "p", "r" => Some(ScopeError::Empty("tenant")));
    case!(an_empty_principal_is_rejected, "t", "", "r" => Some(ScopeError::Empty("principal")));
    case!(an_empty_route_is_rejected, "t", "p", "" => Some(ScopeError::Empty("route")));
    case!(a_tenant_of_256_bytes_is_rejected, &"t".repeat(256), "p", "r" => Some(ScopeError::TooLong("tenant")));
    case!(a_multibyte_tenant_over_255_bytes_is_rejected, &"é".repeat(128), "p", "r" => Some(ScopeError::TooLong("tenant")));
    case!(a_principal_of_256_bytes_is_rejected, "t", &"p".repeat(256), "r" => Some(ScopeError::TooLong("principal")));
    case!(a_route_of_256_bytes_is_rejected, "t", "p", &"r".repeat(256) => Some(ScopeError::TooLong("route")));
    case!(a_nul_in_the_tenant_is_rejected, "a\0b", "p", "r" => Some(ScopeError::ControlCharacter("tenant")));
    case!(a_newline_in_the_principal_is_rejected, "t", "p\n", "r" => Some(ScopeError::ControlCharacter("principal")));
    case!(a_tab_in_the_route_is_rejected, "t", "p", "r\tx" => Some(ScopeError::ControlCharacter("route")));
    case!(del_is_rejected, "t\u{7f}", "p", "r" => Some(ScopeError::ControlCharacter("tenant")));
    case!(a_c1_control_is_rejected, "t\u{85}", "p", "r" => Some(ScopeError::ControlCharacter("tenant")));

    #[test]
    fn a_new_scope_has_the_current_version() {
        assert_eq!(scope("t", "p", "r").unwrap().version(), SCOPE_VERSION);
    }

    #[test]
    fn separator_joined_collisions_encode_differently() {
        let a = scope("a|b", "c", "r").unwrap();
        let b = scope("a", "b|c", "r").unwrap();
        assert_ne!(a.encode(), b.encode());
        assert_ne!(a.digest(), b.digest());
    }

    #[test]
    fn the_encoding_is_length_prefixed_in_tuple_order() {
        let s = Scope::new("t", "pp", "r", Namespace::Server, key("k")).unwrap();
        let want: &[u8] = b"\0\0\0\x02v1\0\0\0\x01t\0\0\0\x02pp\0\0\0\x01r\0\0\0\x01s\0\0\0\x01k";
        assert_eq!(s.encode(), want);
    }

    #[test]
    fn client_and_server_namespaces_never_collide() {
        let u = Scope::new("t", "p", "r", Namespace::Client, key("k")).unwrap();
        let s = Scope::new("t", "p", "r", Namespace::Server, key("k")).unwrap();
        assert_ne!(u.digest(), s.digest());
    }

    #[test]
    fn a_scope_serializes_as_a_plain_object_and_round_trips() {
        let s = scope("acme", "u1", "payments.create").unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(
            json,
            r#"{"version":"v1","tenant":"acme","principal":"u1","route":"payments.create","namespace":"u","key":"k1"}"#
        );
        assert_eq!(serde_json::from_str::<Scope>(&json).unwrap(), s);
    }

    macro_rules! bad_wire {
        ($name:ident => $json:expr) => {
            #[test]
            fn $name() {
                assert!(serde_json::from_str::<Scope>($json).is_err());
            }
        };
    }

    bad_wire!(deserializing_rejects_another_version => r#"{"version":"v2","tenant":"t","principal":"p","route":"r","namespace":"u","key":"k"}"#);
    bad_wire!(deserializing_rejects_a_control_character => r#"{"version":"v1","tenant":"t\u0000","principal":"p","route":"r","namespace":"u","key":"k"}"#);
    bad_wire!(deserializing_rejects_an_empty_principal => r#"{"version":"v1","tenant":"t","principal":"","route":"r","namespace":"u","key":"k"}"#);
    bad_wire!(deserializing_rejects_an_invalid_key => r#"{"version":"v1","tenant":"t","principal":"p","route":"r","namespace":"u","key":"a b"}"#);
    bad_wire!(deserializing_rejects_an_unknown_namespace => r#"{"version":"v1","tenant":"t","principal":"p","route":"r","namespace":"x","key":"k"}"#);
    bad_wire!(deserializing_rejects_unknown_fields => r#"{"version":"v1","tenant":"t","principal":"p","route":"r","namespace":"u","key":"k","extra":1}"#);
    bad_wire!(deserializing_rejects_a_missing_field => r#"{"version":"v1","tenant":"t","principal":"p","namespace":"u","key":"k"}"#);

    #[test]
    fn errors_name_the_component() {
        assert_eq!(
            ScopeError::ControlCharacter("tenant").to_string(),
            "the tenant contains a control character"
        );
        assert_eq!(
            ScopeError::TooLong("route").to_string(),
            "the route is longer than 255 bytes"
        );
    }

    fn component() -> impl Strategy<Value = String> {
        // Small alphabets make near-collisions (shifted boundaries) likely.
        "[ab|]{1,6}"
    }

    proptest! {
        #[test]
        fn different_tuples_never_encode_alike(
            a in (component(), component(), component(), any::<bool>(), "[ab|]{1,6}"),
            b in (component(), component(), component(), any::<bool>(), "[ab|]{1,6}"),
        ) {
            let make = |(t, p, r, server, k): &(String, String, String, bool, String)| {
                let ns = if *server { Namespace::Server } else { Namespace::Client };
                Scope::new(t, p, r, ns, key(k)).unwrap()
            };
            let (sa, sb) = (make(&a), make(&b));
            prop_assert_eq!(sa == sb, sa.encode() == sb.encode());
        }
    }
}
