//! The operator behind an admin or console request, named by a trusted
//! authenticating proxy ([`OperatorSource`]): a header such as oauth2-proxy's
//! `X-Forwarded-Email`, believed only from a configured peer or when the
//! request also carries the proxy's shared secret. That name ([`Operator`])
//! is the actor of every event the operator causes; the shared admin
//! credential names nobody.

use std::net::IpAddr;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName};
use idemgate_core::problem::ProblemKind;

use crate::backend::Actor;
use crate::credential::Credential;
use crate::peers::{peer_of, trusted, Network};
use crate::problem::Refusal;
use crate::AppState;

/// The longest operator identity accepted.
pub const MAX_OPERATOR_BYTES: usize = 256;

/// Where the identity of the operator behind an admin or console request
/// comes from: the header a trusted authenticating proxy sets, believed
/// only from one of `trusted_peers` (the connection's source address) or
/// when the request also carries the proxy's `secret` in `secret_header`.
/// With neither configured, no identity is believed: the console opens no
/// session and the admin API makes no change.
#[derive(Clone)]
pub struct OperatorSource {
    pub header: HeaderName,
    pub trusted_peers: Vec<Network>,
    pub secret_header: HeaderName,
    pub secret: Option<Credential>,
}

impl std::fmt::Debug for OperatorSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorSource")
            .field("header", &self.header)
            .field("trusted_peers", &self.trusted_peers)
            .field("secret_header", &self.secret_header)
            .field("secret", &self.secret.is_some())
            .finish()
    }
}

/// oauth2-proxy's header of the signed-in user's email.
pub const DEFAULT_OPERATOR_HEADER: &str = "x-forwarded-email";
/// The header the proxy's shared secret travels in.
pub const DEFAULT_PROXY_SECRET_HEADER: &str = "x-idemgate-proxy-secret";

impl Default for OperatorSource {
    fn default() -> OperatorSource {
        OperatorSource {
            header: HeaderName::from_static(DEFAULT_OPERATOR_HEADER),
            trusted_peers: Vec::new(),
            secret_header: HeaderName::from_static(DEFAULT_PROXY_SECRET_HEADER),
            secret: None,
        }
    }
}

impl OperatorSource {
    /// Whether any identity can be believed at all.
    pub fn configured(&self) -> bool {
        !self.trusted_peers.is_empty() || self.secret.is_some()
    }
}

/// An operator's identity, checked: the actor of the events the operator
/// causes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator(String);

impl Operator {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The identity a trusted proxy gave: at most [`MAX_OPERATOR_BYTES`],
    /// printable, no spaces, none of the names the store writes itself
    /// and not a command-line operator's.
    pub fn named(value: &str) -> Result<Operator, String> {
        let value = value.trim();
        if value.is_empty() {
            return Err("the operator identity is empty".into());
        }
        if value.len() > MAX_OPERATOR_BYTES {
            return Err(format!(
                "the operator identity is longer than {MAX_OPERATOR_BYTES} bytes"
            ));
        }
        if value.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err("the operator identity contains a space or a control character".into());
        }
        if Actor::RESERVED.iter().any(|a| a.as_str() == value) || value.starts_with(Actor::CLI_PREFIX) {
            return Err(format!("{value:?} is not an operator identity the store accepts"));
        }
        Ok(Operator(value.to_string()))
    }

    /// The name a command-line operator declares (`--actor`), written
    /// `cli:NAME`: nobody verified it, and the history says so.
    pub fn declared(name: &str) -> Result<Operator, String> {
        let named = Operator::named(name)?;
        Ok(Operator(format!("{}{}", Actor::CLI_PREFIX, named.0)))
    }

    /// The actor of the events the operator causes.
    pub fn actor(&self) -> Actor {
        Actor::Named(self.0.clone())
    }
}

/// What a request says about its operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identified {
    /// No identity header.
    Nobody,
    Operator(Operator),
    /// An identity header the store does not believe: not from a trusted
    /// peer, without (or with a wrong) proxy secret, or malformed.
    Refused(&'static str),
}

impl Identified {
    /// The operator, or the refusal of a change that needs one.
    pub fn operator(self) -> Result<Operator, Refusal> {
        match self {
            Identified::Operator(o) => Ok(o),
            Identified::Refused(why) => Err(Refusal::new(ProblemKind::Forbidden, why)),
            Identified::Nobody => Err(Refusal::new(
                ProblemKind::Forbidden,
                "a change needs an operator identity, set by the trusted authenticating proxy: \
                 the admin credential alone names nobody",
            )),
        }
    }
}

/// The operator `headers` name, believed only as `source` says: from a
/// trusted `peer` or with the proxy's secret.
pub fn identify(source: &OperatorSource, headers: &HeaderMap, peer: Option<IpAddr>) -> Identified {
    let mut values = headers.get_all(&source.header).iter();
    let Some(value) = values.next() else {
        return Identified::Nobody;
    };
    let secret = headers.get(&source.secret_header).map(|v| v.as_bytes());
    let by_secret = match (&source.secret, secret) {
        (Some(expected), Some(presented)) => {
            if !expected.matches(presented) {
                tracing::warn!(
                    ?peer,
                    "an operator identity with a wrong proxy secret was refused"
                );
                return Identified::Refused("the authenticating proxy's secret does not match");
            }
            true
        }
        _ => false,
    };
    let by_peer = trusted(&source.trusted_peers, peer);
    if !(by_secret || by_peer) {
        tracing::warn!(?peer, "an operator identity from an untrusted peer was refused");
        return Identified::Refused(
            "the operator identity header is believed only from the trusted authenticating proxy",
        );
    }
    if values.next().is_some() {
        return Identified::Refused("more than one operator identity header");
    }
    let Ok(value) = value.to_str() else {
        return Identified::Refused("the operator identity is not printable ASCII");
    };
    match Operator::named(value) {
        Ok(o) => Identified::Operator(o),
        Err(_) => Identified::Refused("the operator identity is malformed or reserved"),
    }
}

impl FromRequestParts<AppState> for Identified {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Identified, Self::Rejection> {
        Ok(identify(
            &state.settings.console.operators,
            &parts.headers,
            peer_of(&parts.extensions),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn an_identity_is_believed_only_from_a_trusted_peer_or_with_the_secret() {
        let source = OperatorSource {
            trusted_peers: vec!["10.0.0.0/24".parse().unwrap()],
            secret: Some(Credential::new("proxy-secret")),
            ..OperatorSource::default()
        };
        let alice = Identified::Operator(Operator::named("alice@example.com").unwrap());
        let from = |ip: &str| Some(ip.parse().unwrap());
        let email = ("x-forwarded-email", "alice@example.com");
        assert_eq!(
            identify(&source, &headers(&[]), from("10.0.0.1")),
            Identified::Nobody
        );
        assert_eq!(identify(&source, &headers(&[email]), from("10.0.0.7")), alice);
        assert!(matches!(
            identify(&source, &headers(&[email]), from("10.0.1.7")),
            Identified::Refused(_)
        ));
        assert!(matches!(
            identify(&source, &headers(&[email]), None),
            Identified::Refused(_)
        ));
        let with = |secret| headers(&[email, ("x-idemgate-proxy-secret", secret)]);
        assert_eq!(identify(&source, &with("proxy-secret"), None), alice);
        assert!(matches!(
            identify(&source, &with("proxy-secreT"), None),
            Identified::Refused(_)
        ));
        // A wrong secret is refused even from a trusted peer.
        assert!(matches!(
            identify(&source, &with("wrong"), from("10.0.0.7")),
            Identified::Refused(_)
        ));
        // Nothing configured: nothing believed.
        let none = OperatorSource::default();
        assert!(!none.configured());
        assert!(matches!(
            identify(&none, &with("proxy-secret"), from("10.0.0.7")),
            Identified::Refused(_)
        ));
        // One identity, well formed, not one of the store's own names.
        let two = headers(&[email, ("x-forwarded-email", "bob@example.com")]);
        assert!(matches!(
            identify(&source, &two, from("10.0.0.7")),
            Identified::Refused(_)
        ));
        for bad in ["operator", "sweeper", "filter", "cli:bob", "a b", ""] {
            let h = headers(&[("x-forwarded-email", bad)]);
            assert!(
                matches!(identify(&source, &h, from("10.0.0.7")), Identified::Refused(_)),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_declared_name_says_it_was_declared() {
        assert_eq!(Operator::declared("bob").unwrap().as_str(), "cli:bob");
        assert!(Operator::declared("").is_err());
        assert!(Operator::declared("operator").is_err());
        assert!(Operator::named(&"a".repeat(MAX_OPERATOR_BYTES + 1)).is_err());
    }
}
