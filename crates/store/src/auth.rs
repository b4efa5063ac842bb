//! Bearer credentials, compared in constant time. The API and the admin
//! surface have different credentials; presenting the API one on an admin
//! endpoint is 403, anything else missing or wrong is 401.
//!
//! A credential is checked by hashing what was presented (SHA-256), once per
//! connection: the `Authorization` value that passed is kept with the
//! connection ([`Connection`]), and later requests on it that present the
//! very same bytes are compared with those instead of being hashed again.
//! Every request is still checked: a request on the same connection with
//! another value (a proxy may share one connection among clients) goes the
//! whole way again.
//!
//! The operator behind an admin request is named by a trusted
//! authenticating proxy ([`OperatorSource`]): a header such as oauth2-proxy's
//! `X-Forwarded-Email`, believed only from a configured peer or when the
//! request also carries the proxy's shared secret. That name
//! ([`Operator`]) is the actor of every event the operator causes; the
//! shared admin credential names nobody.

use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName};
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::IncomingStream;
use idemgate_core::problem::ProblemKind;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

use crate::backend::Actor;
use crate::problem::Refusal;
use crate::AppState;

/// A credential kept only as SHA-256 digests, so comparing takes the same
/// time whatever the length or content of what the client sent. It holds a
/// second accepted token while one is being rotated.
#[derive(Clone)]
pub struct Credential(Vec<[u8; 32]>);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(***)")
    }
}

impl Credential {
    pub fn new(token: &str) -> Credential {
        Credential(vec![Sha256::digest(token.as_bytes()).into()])
    }

    /// Also accepts `token` (the next one, during a rotation).
    pub fn and(mut self, token: &str) -> Credential {
        self.0.push(Sha256::digest(token.as_bytes()).into());
        self
    }

    /// Compares with every accepted token, always all of them.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        self.0
            .iter()
            .fold(subtle::Choice::from(0), |any, accepted| {
                any | accepted.ct_eq(&digest)
            })
            .into()
    }
}

/// Which credential a request presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presented {
    Api,
    Admin,
}

/// What a connection has shown so far: the first `Authorization` value that
/// matched a credential, and which one; and the peer's address (TCP only).
/// Created per accepted connection (`axum`'s connect info) and shared by its
/// requests.
#[derive(Clone, Default)]
pub struct Connection {
    shown: Arc<OnceLock<Shown>>,
    peer: Option<IpAddr>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connection(***)")
    }
}

struct Shown {
    header: Box<[u8]>,
    presented: Presented,
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for Connection {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Connection {
        Connection {
            shown: Arc::default(),
            peer: Some(stream.remote_addr().ip()),
        }
    }
}

#[cfg(unix)]
impl Connected<IncomingStream<'_, tokio::net::UnixListener>> for Connection {
    fn connect_info(_: IncomingStream<'_, tokio::net::UnixListener>) -> Connection {
        Connection::default()
    }
}

/// Whether `presented` is exactly `shown`, in time that depends only on the
/// presented length: every presented byte is compared, against the shown
/// byte at its position or a stand-in past its end.
fn same(shown: &[u8], presented: &[u8]) -> bool {
    let mut equal = Choice::from(u8::from(shown.len() == presented.len()));
    for (i, b) in presented.iter().enumerate() {
        equal &= b.ct_eq(shown.get(i).unwrap_or(&0));
    }
    equal.into()
}

fn bearer(value: &[u8]) -> Option<&[u8]> {
    let scheme = value.get(..7)?;
    if scheme.eq_ignore_ascii_case(b"bearer ") {
        Some(&value[7..])
    } else {
        None
    }
}

/// Which credential `req` presents, if any: compared with what its
/// connection already showed, else hashed (and kept for the connection).
fn presented(state: &AppState, req: &Request) -> Option<Presented> {
    let header = req.headers().get(axum::http::header::AUTHORIZATION)?.as_bytes();
    let connection = req.extensions().get::<ConnectInfo<Connection>>().map(|c| &c.0);
    if let Some(shown) = connection.and_then(|c| c.shown.get()) {
        if same(&shown.header, header) {
            return Some(shown.presented);
        }
    }
    let token = bearer(header)?;
    let presented = if state.settings.api_token.matches(token) {
        Presented::Api
    } else if state.settings.admin_token.matches(token) {
        Presented::Admin
    } else {
        return None;
    };
    if let Some(connection) = connection {
        // The first value that matched stays; a later different one is
        // hashed each time.
        let _ = connection.shown.set(Shown {
            header: header.into(),
            presented,
        });
    }
    Some(presented)
}

pub async fn require_api(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, Refusal> {
    match presented(&state, &req) {
        Some(Presented::Api) => Ok(next.run(req).await),
        Some(Presented::Admin) => Err(Refusal::new(
            ProblemKind::Forbidden,
            "the admin credential is not valid for the /v1 API",
        )),
        None => Err(Refusal::new(
            ProblemKind::Unauthorized,
            "send Authorization: Bearer <API token>",
        )),
    }
}

/// The admin credential, and no operator identity the store does not
/// believe (whether or not the endpoint needs one).
pub async fn require_admin(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, Refusal> {
    match presented(&state, &req) {
        Some(Presented::Admin) => {
            let peer = peer_of(req.extensions());
            if let Identified::Refused(why) = identify(&state.settings.console.operators, req.headers(), peer)
            {
                return Err(Refusal::new(ProblemKind::Forbidden, why));
            }
            Ok(next.run(req).await)
        }
        Some(Presented::Api) => Err(Refusal::new(
            ProblemKind::Forbidden,
            "the API credential is not valid for admin endpoints",
        )),
        None => Err(Refusal::new(
            ProblemKind::Unauthorized,
            "send Authorization: Bearer <admin token>",
        )),
    }
}

/// The longest operator identity accepted.
pub const MAX_OPERATOR_BYTES: usize = 256;

/// An IPv4 or IPv6 network (`10.0.0.0/8`, `fd00::/8`), or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Network {
    type Err = String;

    fn from_str(s: &str) -> Result<Network, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or network (write 10.0.0.5 or 10.0.0.0/24)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Network { addr, prefix })
    }
}

impl Network {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> u128 {
            match ip {
                IpAddr::V4(v4) => u128::from(u32::from(v4)),
                IpAddr::V6(v6) => u128::from(v6),
            }
        };
        let ip = ip.to_canonical();
        if ip.is_ipv4() != self.addr.is_ipv4() {
            return false;
        }
        let width: u32 = if ip.is_ipv4() { 32 } else { 128 };
        let host_bits = width - u32::from(self.prefix);
        let mask = u128::MAX.checked_shl(host_bits).unwrap_or(0);
        bits(ip) & mask == bits(self.addr) & mask
    }
}

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

fn peer_of(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions.get::<ConnectInfo<Connection>>().and_then(|c| c.0.peer)
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
    let by_peer = peer.is_some_and(|ip| source.trusted_peers.iter().any(|n| n.contains(ip)));
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
    fn networks_contain_their_addresses_only() {
        let net: Network = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let one: Network = "127.0.0.1".parse().unwrap();
        assert!(one.contains("127.0.0.1".parse().unwrap()));
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "nope", "10.0.0.0/x", "::/129"] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
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

    #[test]
    fn only_the_very_same_bytes_are_the_same() {
        let shown = b"Bearer api-token";
        assert!(same(shown, b"Bearer api-token"));
        for other in [
            &b"Bearer api-tokeN"[..],
            b"Bearer api-toke",
            b"Bearer api-token ",
            b"Bearer api-token\0",
            b"",
            b"bearer api-token",
        ] {
            assert!(!same(shown, other), "{other:?}");
        }
    }
}
