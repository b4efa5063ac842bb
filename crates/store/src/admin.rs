//! The operators' surface (`/admin/v1`, admin credential): look records up,
//! list unknown and stuck ones, resolve, purge, run the sweeper now.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idemgate_core::problem::ProblemKind;
use idemgate_core::scope::{Namespace, Scope};
use serde::{Deserialize, Serialize};

use crate::api::{read_body, unavailable, validate_response};
use crate::backend::{Listing, Lookup, Resolution, SweepPolicy};
use crate::problem::problem;
use crate::AppState;

/// A `POST` with a [`LookupQuery`] body: raw keys never travel in a URL, which
/// proxies and access logs keep.
pub const LOOKUP_PATH: &str = "/admin/v1/records/lookup";
pub const UNKNOWN_PATH: &str = "/admin/v1/records/unknown";
pub const STUCK_PATH: &str = "/admin/v1/records/stuck";
pub const RESOLVE_PATH: &str = "/admin/v1/resolve";
pub const PURGE_PATH: &str = "/admin/v1/purge";
pub const SWEEP_PATH: &str = "/admin/v1/sweep";

const DEFAULT_LIMIT: u32 = 100;
const MAX_LIMIT: u32 = 1000;
/// In progress for longer than this counts as stuck unless the caller says otherwise.
pub const DEFAULT_STUCK_AFTER_MS: u64 = 5 * 60 * 1000;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupQuery {
    pub tenant: String,
    pub key: String,
    pub route: Option<String>,
    pub principal: Option<String>,
    pub namespace: Option<Namespace>,
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    pub limit: Option<u32>,
    pub older_than_ms: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ResolveRequest {
    pub scope: Scope,
    #[serde(flatten)]
    pub resolution: Resolution,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeRequest {
    pub scope: Scope,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Changed {
    pub changed: bool,
}

fn limit(l: Option<u32>) -> u32 {
    l.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT)
}

fn bad_query(state: &AppState, e: impl std::fmt::Display) -> Response {
    problem(state, ProblemKind::BadRequest, &format!("bad query: {e}"))
}

pub async fn lookup(State(state): State<AppState>, body: Body) -> Response {
    let q: LookupQuery = match json_body(&state, body).await {
        Ok(q) => q,
        Err(r) => return r,
    };
    if q.tenant.is_empty() || q.key.is_empty() {
        return problem(&state, ProblemKind::BadRequest, "tenant and key are required");
    }
    let lookup = Lookup {
        tenant: q.tenant,
        key: q.key,
        route: q.route,
        principal: q.principal,
        namespace: q.namespace,
    };
    match state.inner.store.backend.lookup(&lookup, limit(q.limit)).await {
        Ok(records) => Json(records).into_response(),
        Err(e) => unavailable(&state, &e),
    }
}

async fn listing(state: AppState, which: Listing, l: Option<u32>) -> Response {
    let now = state.inner.store.clock.now();
    match state.inner.store.backend.list(which, now, limit(l)).await {
        Ok(records) => Json(records).into_response(),
        Err(e) => unavailable(&state, &e),
    }
}

pub async fn unknown(
    State(state): State<AppState>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    match q {
        Ok(Query(q)) => listing(state, Listing::Unknown, q.limit).await,
        Err(e) => bad_query(&state, e.body_text()),
    }
}

pub async fn stuck(
    State(state): State<AppState>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    match q {
        Ok(Query(q)) => {
            let older_than_ms = q.older_than_ms.unwrap_or(DEFAULT_STUCK_AFTER_MS);
            listing(state, Listing::Stuck { older_than_ms }, q.limit).await
        }
        Err(e) => bad_query(&state, e.body_text()),
    }
}

async fn json_body<T: serde::de::DeserializeOwned>(state: &AppState, body: Body) -> Result<T, Response> {
    let bytes = read_body(state, body).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| problem(state, ProblemKind::BadRequest, &format!("invalid JSON: {e}")))
}

pub async fn resolve(State(state): State<AppState>, body: Body) -> Response {
    let req: ResolveRequest = match json_body(&state, body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Resolution::Complete { status, headers, .. } = &req.resolution {
        if let Err(e) = validate_response(*status, headers) {
            return problem(&state, ProblemKind::BadRequest, &e);
        }
    }
    let now = state.inner.store.clock.now();
    match state
        .inner
        .store
        .backend
        .resolve(&req.scope, &req.resolution, now)
        .await
    {
        Ok(true) => {
            let action = match req.resolution {
                Resolution::Complete { .. } => "complete",
                Resolution::Release => "release",
            };
            tracing::info!(record = %req.scope.log_id(), action, "resolved by an operator");
            state.inner.store.notify_changed();
            Json(Changed { changed: true }).into_response()
        }
        Ok(false) => problem(
            &state,
            ProblemKind::NotFound,
            "no in-progress or unknown record with this scope",
        ),
        Err(e) => unavailable(&state, &e),
    }
}

pub async fn purge(State(state): State<AppState>, body: Body) -> Response {
    let req: PurgeRequest = match json_body(&state, body).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    match state
        .inner
        .store
        .backend
        .purge(&req.scope, state.inner.store.clock.now())
        .await
    {
        Ok(true) => {
            tracing::info!(record = %req.scope.log_id(), "purged by an operator");
            state.inner.store.notify_changed();
            Json(Changed { changed: true }).into_response()
        }
        Ok(false) => problem(&state, ProblemKind::NotFound, "no record with this scope"),
        Err(e) => unavailable(&state, &e),
    }
}

/// Runs the sweeper until it has nothing left to do (bounded), now.
pub async fn sweep(State(state): State<AppState>) -> Response {
    let policy = SweepPolicy {
        batch: state.inner.sweep.batch,
        audit_retention_ms: state.inner.sweep.audit_retention_ms,
    };
    match crate::sweeper::sweep_all(&state.inner.store, &policy).await {
        Ok(report) => (StatusCode::OK, Json(report)).into_response(),
        Err(e) => unavailable(&state, &e),
    }
}
