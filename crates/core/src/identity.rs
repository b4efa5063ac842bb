//! Who is asking (contract §2), decided in one place: the tenant and
//! principal a policy names, read as the request carries them, become the
//! scope of its key — or the one error that says why they cannot.
//!
//! A header that appears more than once has already been read as absent
//! ([`crate::headers`]): an ambiguous identity is no identity.

use crate::config::Identity;
use crate::key::Key;
use crate::scope::{Namespace, Scope, ScopeError, EVERYONE};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityError {
    /// The policy names a source and the request carries no value, an empty
    /// one, or several.
    Missing(&'static str),
    NotUtf8(&'static str),
    /// Too long, or a control character (rejected, never stripped).
    Unusable(ScopeError),
}

impl std::fmt::Display for IdentityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdentityError::Missing(what) => write!(
                f,
                "this route requires exactly one authenticated {what}, and the request carries none or several"
            ),
            IdentityError::NotUtf8(what) => write!(f, "the request's {what} is not valid UTF-8"),
            IdentityError::Unusable(e) => write!(f, "the request's identity is not usable: {e}"),
        }
    }
}

impl std::error::Error for IdentityError {}

/// The scope of a client's `key` on `route`, for the identity the request
/// carries (`tenant` and `principal` as read from the policy's sources).
pub fn client_scope(
    identity: &Identity,
    route: &str,
    tenant: Option<&[u8]>,
    principal: Option<&[u8]>,
    key: Key,
) -> Result<Scope, IdentityError> {
    let (tenant, principal) = match identity {
        Identity::Anonymous => (EVERYONE, EVERYONE),
        Identity::Sourced {
            principal: source, ..
        } => (
            text(tenant, "tenant")?,
            match source {
                Some(_) => text(principal, "principal")?,
                None => EVERYONE,
            },
        ),
    };
    Scope::new(tenant, principal, route, Namespace::Client, key).map_err(IdentityError::Unusable)
}

fn text<'a>(value: Option<&'a [u8]>, what: &'static str) -> Result<&'a str, IdentityError> {
    match value {
        None | Some([]) => Err(IdentityError::Missing(what)),
        Some(bytes) => std::str::from_utf8(bytes).map_err(|_| IdentityError::NotUtf8(what)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Source;

    fn key() -> Key {
        Key::try_from("k".to_string()).unwrap()
    }

    fn sourced(principal: bool) -> Identity {
        Identity::Sourced {
            tenant: Source::Header("x-tenant".into()),
            principal: principal.then(|| Source::Header("x-user".into())),
        }
    }

    #[test]
    fn an_anonymous_policy_shares_one_namespace() {
        let s = client_scope(&Identity::Anonymous, "r", Some(b"ignored"), None, key()).unwrap();
        assert_eq!((s.tenant(), s.principal()), (EVERYONE, EVERYONE));
    }

    #[test]
    fn a_sourced_identity_is_the_scope() {
        let s = client_scope(&sourced(true), "r", Some(b"acme"), Some(b"alice"), key()).unwrap();
        assert_eq!((s.tenant(), s.principal(), s.route()), ("acme", "alice", "r"));
        let s = client_scope(&sourced(false), "r", Some(b"acme"), Some(b"alice"), key()).unwrap();
        assert_eq!(
            s.principal(),
            EVERYONE,
            "no principal source: shared by the tenant"
        );
    }

    #[test]
    fn every_way_an_identity_fails_is_one_error() {
        let id = sourced(true);
        let err = |t: Option<&[u8]>, p: Option<&[u8]>| client_scope(&id, "r", t, p, key()).unwrap_err();
        assert_eq!(err(None, Some(b"a")), IdentityError::Missing("tenant"));
        assert_eq!(err(Some(b""), Some(b"a")), IdentityError::Missing("tenant"));
        assert_eq!(err(Some(b"t"), None), IdentityError::Missing("principal"));
        assert_eq!(err(Some(b"\xff"), Some(b"a")), IdentityError::NotUtf8("tenant"));
        assert_eq!(
            err(Some(b"a\x01b"), Some(b"a")),
            IdentityError::Unusable(ScopeError::ControlCharacter("tenant"))
        );
        let long = vec![b'a'; 256];
        assert_eq!(
            err(Some(b"t"), Some(&long)),
            IdentityError::Unusable(ScopeError::TooLong("principal"))
        );
        assert!(err(Some(b"a\x01b"), Some(b"a"))
            .to_string()
            .contains("control character"));
    }
}
