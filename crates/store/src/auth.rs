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

use std::sync::{Arc, OnceLock};

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::IncomingStream;
use idemgate_core::problem::ProblemKind;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

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
/// matched a credential, and which one. Created per accepted connection
/// (`axum`'s connect info) and shared by its requests.
#[derive(Clone, Default)]
pub struct Connection(Arc<OnceLock<Shown>>);

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
    fn connect_info(_: IncomingStream<'_, tokio::net::TcpListener>) -> Connection {
        Connection::default()
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
    if let Some(shown) = connection.and_then(|c| c.0.get()) {
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
        let _ = connection.0.set(Shown {
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

pub async fn require_admin(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, Refusal> {
    match presented(&state, &req) {
        Some(Presented::Admin) => Ok(next.run(req).await),
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

#[cfg(test)]
mod tests {
    use super::*;

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
