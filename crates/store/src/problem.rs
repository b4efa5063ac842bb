//! Problem details (RFC 9457) as axum responses, rendered by the core crate.

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use idemgate_core::problem::{Problem, ProblemKind};

use crate::AppState;

pub fn problem(state: &AppState, kind: ProblemKind, detail: &str) -> Response {
    render(&Problem::new(kind, detail), &state.inner.doc_base)
}

pub fn render(p: &Problem, doc_base: &str) -> Response {
    let reply = p.render(doc_base);
    let mut resp = Response::new(Body::from(reply.body));
    *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in reply.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            resp.headers_mut().append(n, v);
        }
    }
    resp
}
