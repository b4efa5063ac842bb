//! Who may call which surface. The filter's API (`/v1`) is called by a mesh
//! identity its own sidecar names ([`crate::mesh`]), limited to the policies
//! it owns, or with the API's bearer token (every policy); the admin
//! surface takes a different token, and an operator's changes name the
//! operator ([`crate::operators`]). Presenting the API token on an admin
//! endpoint, or the admin one on the API, is 403; anything else missing or
//! wrong is 401.
//!
//! A credential is checked by hashing what was presented (SHA-256), once per
//! connection: the `Authorization` value that passed is kept with the
//! connection ([`Connection`]), and later requests on it that present the
//! very same bytes are compared with those instead of being hashed again,
//! until the API's tokens are re-read. Every request is still checked: a
//! request on the same connection with another value (a proxy may share
//! one connection among clients) goes the whole way again.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use idemgate_core::problem::ProblemKind;
use subtle::{Choice, ConstantTimeEq};

pub use crate::credential::{ApiCredential, Credential, TokenFiles};
use crate::mesh::{Caller, Named};
pub use crate::operators::{
    identify, Identified, Operator, OperatorSource, DEFAULT_OPERATOR_HEADER, DEFAULT_PROXY_SECRET_HEADER,
    MAX_OPERATOR_BYTES,
};
use crate::peers::{peer_of, Presented, Shown};
pub use crate::peers::{Connection, Network};
use crate::problem::Refusal;
use crate::AppState;

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
/// connection already showed under the same API tokens, else hashed (and
/// kept for the connection).
fn presented(state: &AppState, req: &Request) -> Option<Presented> {
    let header = req.headers().get(axum::http::header::AUTHORIZATION)?.as_bytes();
    let connection = req
        .extensions()
        .get::<axum::extract::ConnectInfo<Connection>>()
        .map(|c| &c.0);
    let generation = state.settings.api_token.generation();
    if let Some(shown) = connection.and_then(|c| c.shown.get()) {
        if shown.generation == generation && same(&shown.header, header) {
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
        // The first value that matched stays; a later different one, or
        // any after the tokens were re-read, is hashed each time.
        let _ = connection.shown.set(Shown {
            header: header.into(),
            presented,
            generation,
        });
    }
    Some(presented)
}

/// The caller of a `/v1` call: the mesh identity the store's sidecar names,
/// else the API token's holder. The call's policies are checked against it
/// where each call is read ([`Caller::may_act_on`]).
pub async fn require_api(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, Refusal> {
    let peer = peer_of(req.extensions());
    let caller = match crate::mesh::identify(&state.settings.mesh, req.headers(), peer) {
        Named::Caller(caller) => caller,
        Named::Refused(why) => return Err(Refusal::new(ProblemKind::Forbidden, why)),
        Named::Absent => match presented(&state, &req) {
            Some(Presented::Api) => Caller::Token,
            Some(Presented::Admin) => {
                return Err(Refusal::new(
                    ProblemKind::Forbidden,
                    "the admin credential is not valid for the /v1 API",
                ))
            }
            None if state.settings.mesh.configured() => {
                return Err(Refusal::new(
                    ProblemKind::Unauthorized,
                    "call through the mesh (the store's sidecar names the caller), or send \
                     Authorization: Bearer <API token>",
                ))
            }
            None => {
                return Err(Refusal::new(
                    ProblemKind::Unauthorized,
                    "send Authorization: Bearer <API token>",
                ))
            }
        },
    };
    req.extensions_mut().insert(caller);
    Ok(next.run(req).await)
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
