//! The operators' surface (`/admin/v1`, admin credential): look records up,
//! list unknown and stuck ones, resolve, purge, run the sweeper now.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::Json;
use idemgate_core::problem::ProblemKind;
use idemgate_core::scope::{Namespace, Scope};
use serde::{Deserialize, Serialize};

use crate::api::{read_body, validate_response};
use crate::backend::{KeyHistory, Listing, Lookup, RecordInfo, Resolution, SweepPolicy, SweepReport};
use crate::problem::Refusal;
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

fn bad_query(e: impl std::fmt::Display) -> Refusal {
    Refusal::bad_request(format!("bad query: {e}"))
}

pub async fn lookup(State(state): State<AppState>, body: Body) -> Result<Json<KeyHistory>, Refusal> {
    let q: LookupQuery = json_body(&state, body).await?;
    if q.tenant.is_empty() || q.key.is_empty() {
        return Err(Refusal::bad_request("tenant and key are required"));
    }
    let lookup = Lookup {
        tenant: q.tenant,
        key: q.key,
        route: q.route,
        principal: q.principal,
        namespace: q.namespace,
    };
    Ok(Json(state.store.backend.lookup(&lookup, limit(q.limit)).await?))
}

async fn listing(state: AppState, which: Listing, l: Option<u32>) -> Result<Json<Vec<RecordInfo>>, Refusal> {
    let now = state.store.clock.now();
    Ok(Json(state.store.backend.list(which, now, limit(l)).await?))
}

type ListQueryResult = Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>;

pub async fn unknown(
    State(state): State<AppState>,
    q: ListQueryResult,
) -> Result<Json<Vec<RecordInfo>>, Refusal> {
    let Query(q) = q.map_err(|e| bad_query(e.body_text()))?;
    listing(state, Listing::Unknown, q.limit).await
}

pub async fn stuck(
    State(state): State<AppState>,
    q: ListQueryResult,
) -> Result<Json<Vec<RecordInfo>>, Refusal> {
    let Query(q) = q.map_err(|e| bad_query(e.body_text()))?;
    let older_than_ms = q.older_than_ms.unwrap_or(DEFAULT_STUCK_AFTER_MS);
    listing(state, Listing::Stuck { older_than_ms }, q.limit).await
}

async fn json_body<T: serde::de::DeserializeOwned>(state: &AppState, body: Body) -> Result<T, Refusal> {
    let bytes = read_body(state, body).await?;
    serde_json::from_slice(&bytes).map_err(|e| Refusal::bad_request(format!("invalid JSON: {e}")))
}

pub async fn resolve(State(state): State<AppState>, body: Body) -> Result<Json<Changed>, Refusal> {
    let req: ResolveRequest = json_body(&state, body).await?;
    if let Resolution::Complete { status, headers, .. } = &req.resolution {
        validate_response(*status, headers).map_err(Refusal::bad_request)?;
    }
    let now = state.store.clock.now();
    if !state
        .store
        .backend
        .resolve(&req.scope, &req.resolution, now)
        .await?
    {
        return Err(Refusal::new(
            ProblemKind::NotFound,
            "no in-progress or unknown record with this scope",
        ));
    }
    let action = match req.resolution {
        Resolution::Complete { .. } => "complete",
        Resolution::Release => "release",
    };
    tracing::info!(record = %req.scope.log_id(), action, "resolved by an operator");
    state.store.notify_changed();
    Ok(Json(Changed { changed: true }))
}

pub async fn purge(State(state): State<AppState>, body: Body) -> Result<Json<Changed>, Refusal> {
    let req: PurgeRequest = json_body(&state, body).await?;
    if !state
        .store
        .backend
        .purge(&req.scope, state.store.clock.now())
        .await?
    {
        return Err(Refusal::new(ProblemKind::NotFound, "no record with this scope"));
    }
    tracing::info!(record = %req.scope.log_id(), "purged by an operator");
    state.store.notify_changed();
    Ok(Json(Changed { changed: true }))
}

/// Runs the sweeper until it has nothing left to do (bounded), now.
pub async fn sweep(State(state): State<AppState>) -> Result<Json<SweepReport>, Refusal> {
    let policy = SweepPolicy {
        batch: state.settings.sweep.batch,
        audit_retention_ms: state.settings.sweep.audit_retention_ms,
    };
    Ok(Json(crate::sweeper::sweep_all(&state.store, &policy).await?))
}
