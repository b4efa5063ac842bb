//! Bearer credentials, compared in constant time. The API and the admin
//! surface have different credentials; presenting the API one on an admin
//! endpoint is 403, anything else missing or wrong is 401.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use idemgate_core::problem::ProblemKind;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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

fn bearer(req: &Request) -> Option<&[u8]> {
    let value = req.headers().get(axum::http::header::AUTHORIZATION)?.as_bytes();
    let scheme = value.get(..7)?;
    if scheme.eq_ignore_ascii_case(b"bearer ") {
        Some(&value[7..])
    } else {
        None
    }
}

pub async fn require_api(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, Refusal> {
    match bearer(&req) {
        Some(t) if state.settings.api_token.matches(t) => Ok(next.run(req).await),
        Some(t) if state.settings.admin_token.matches(t) => Err(Refusal::new(
            ProblemKind::Forbidden,
            "the admin credential is not valid for the /v1 API",
        )),
        _ => Err(Refusal::new(
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
    match bearer(&req) {
        Some(t) if state.settings.admin_token.matches(t) => Ok(next.run(req).await),
        Some(t) if state.settings.api_token.matches(t) => Err(Refusal::new(
            ProblemKind::Forbidden,
            "the API credential is not valid for admin endpoints",
        )),
        _ => Err(Refusal::new(
            ProblemKind::Unauthorized,
            "send Authorization: Bearer <admin token>",
        )),
    }
}
