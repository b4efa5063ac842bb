//! Problem details (RFC 9457) as axum responses, rendered by the core crate.
//!
//! Handlers and middleware return `Result<_, Refusal>` and use `?`: a
//! [`Refusal`] is the problem to answer with, and a backend failure becomes
//! one (503 `store-unavailable`, the cause only in the log). Its response is
//! the problem rendered with the default documentation base, and carries the
//! problem along: [`render_refusals`], a layer over the whole router, renders
//! it again when the service is configured with another base (configuration
//! is not known where the refusal is made).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idemgate_core::config::DEFAULT_DOC_BASE;
use idemgate_core::problem::{Problem, ProblemKind};

use crate::backend::StoreError;
use crate::AppState;

/// Why a request is refused, as the problem to answer with.
#[derive(Debug, Clone)]
pub struct Refusal(Problem);

impl Refusal {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Refusal {
        Refusal(Problem::new(kind, detail))
    }

    pub fn bad_request(detail: impl Into<String>) -> Refusal {
        Refusal::new(ProblemKind::BadRequest, detail)
    }

    /// Status and problem document, for a call answered inside a batch.
    pub fn render(&self, doc_base: &str) -> (u16, Vec<u8>) {
        let reply = self.0.render(doc_base);
        (reply.status, reply.body)
    }

    /// The problem this refusal answers with.
    pub fn problem(&self) -> &Problem {
        &self.0
    }
}

impl From<StoreError> for Refusal {
    /// The database's trouble is logged, never shown to the client.
    fn from(e: StoreError) -> Refusal {
        if let StoreError::RateLimited { retry_after_ms } = e {
            return Refusal(Problem::key_rate_limited(retry_after_ms));
        }
        let outage = e.outage().map_or("-", crate::error::Outage::as_str);
        tracing::error!(error = %e, outage, "store operation failed");
        Refusal(
            Problem::new(
                ProblemKind::StoreUnavailable,
                "the store's database is unavailable",
            )
            .retry_after(1),
        )
    }
}

/// The problem a refusal's response was rendered from.
#[derive(Clone)]
struct Refused(Arc<Problem>);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut resp = render(&self.0, DEFAULT_DOC_BASE);
        resp.extensions_mut().insert(Refused(Arc::new(self.0)));
        resp
    }
}

/// Renders every refusal the router produced with the configured
/// documentation base, when it is not the default.
pub async fn render_refusals(State(state): State<AppState>, resp: Response) -> Response {
    match resp.extensions().get::<Refused>() {
        Some(Refused(p)) if state.settings.doc_base != DEFAULT_DOC_BASE => {
            render(p, &state.settings.doc_base)
        }
        _ => resp,
    }
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
