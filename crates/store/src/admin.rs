//! The operators' surface (`/admin/v1`, admin credential): look records up,
//! list unknown and stuck ones, resolve, purge, run the sweeper now.
//!
//! Reads and the sweeper take the admin credential alone. A change to a
//! record (resolve, purge) also needs an operator the trusted
//! authenticating proxy names ([`crate::auth::Identified`]), who becomes
//! the actor of its event, and a reason: the shared credential names
//! nobody.
//!
//! The JSON handlers and the console ([`crate::console`]) make the same
//! calls: [`find`], [`list`] and [`resolve_record`].

use axum::body::Body;
use axum::extract::{Query, State};

use crate::auth::{Identified, Operator};
use axum::Json;
use idemgate_core::problem::ProblemKind;
use idemgate_core::scope::{Namespace, Scope};
use serde::{Deserialize, Serialize};

use crate::api::read_body;
use crate::backend::{Action, KeyHistory, Listing, Lookup, RecordInfo, Resolution, SweepReport};
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
    /// `complete` (with its response) or `release`.
    #[serde(flatten)]
    pub action: Action,
    /// Why: kept in the history with the `resolved` event. Required; a
    /// request without one is refused (400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The longest reason a resolution may carry.
pub const MAX_REASON_BYTES: usize = 1024;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PurgeRequest {
    pub scope: Scope,
    /// Why: kept in the history with the `purged` event. Required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
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

/// Every generation and event of a tenant's key (narrowed by the lookup's
/// other components), at most `l` generations.
pub async fn find(state: &AppState, lookup: &Lookup, l: Option<u32>) -> Result<KeyHistory, Refusal> {
    if lookup.tenant.is_empty() || lookup.key.is_empty() {
        return Err(Refusal::bad_request("tenant and key are required"));
    }
    Ok(state.store.lookup(lookup, limit(l)).await?)
}

/// Unknown or stuck records, oldest first, at most `l`.
pub async fn list(state: &AppState, which: Listing, l: Option<u32>) -> Result<Vec<RecordInfo>, Refusal> {
    Ok(state.store.list(which, limit(l)).await?)
}

pub async fn lookup(State(state): State<AppState>, body: Body) -> Result<Json<KeyHistory>, Refusal> {
    let q: LookupQuery = json_body(&state, body).await?;
    let lookup = Lookup {
        tenant: q.tenant,
        key: q.key,
        route: q.route,
        principal: q.principal,
        namespace: q.namespace,
    };
    Ok(Json(find(&state, &lookup, q.limit).await?))
}

async fn listing(state: AppState, which: Listing, l: Option<u32>) -> Result<Json<Vec<RecordInfo>>, Refusal> {
    Ok(Json(list(&state, which, l).await?))
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

/// A record's scope from its parts as an operator types them (`namespace`
/// `u` for client keys, `s` for server keys).
pub fn scope_of(
    tenant: &str,
    principal: &str,
    route: &str,
    namespace: &str,
    key: &str,
) -> Result<Scope, String> {
    let ns = match namespace {
        "u" => Namespace::Client,
        "s" => Namespace::Server,
        _ => return Err("the namespace must be u or s".into()),
    };
    let key = idemgate_core::key::Key::try_from(key.to_string()).map_err(|e| format!("key: {e}"))?;
    Scope::new(tenant, principal, route, ns, key).map_err(|e| format!("scope: {e}"))
}

/// A response header written `NAME:VALUE` (the CLI's `--header`, a line of
/// the console's headers field): the name lowercased, both trimmed.
pub fn parse_header(line: &str) -> Result<(String, String), String> {
    line.split_once(':')
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .ok_or_else(|| format!("header {line:?}: write NAME: VALUE"))
}

/// A reason fit to be kept: at most [`MAX_REASON_BYTES`], no control
/// characters but line breaks and tabs; `None` when blank.
pub fn validate_reason(reason: Option<&str>) -> Result<Option<&str>, String> {
    let Some(reason) = reason.map(str::trim).filter(|r| !r.is_empty()) else {
        return Ok(None);
    };
    if reason.len() > MAX_REASON_BYTES {
        return Err(format!("the reason is longer than {MAX_REASON_BYTES} bytes"));
    }
    if reason
        .chars()
        .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
    {
        return Err("the reason contains a control character".into());
    }
    Ok(Some(reason))
}

/// A reason a change must carry: [`validate_reason`]'s, and not blank.
pub fn required_reason(reason: Option<&str>) -> Result<&str, String> {
    validate_reason(reason)?
        .ok_or_else(|| "a reason is required: say why, it is kept in the record's history".to_string())
}

/// Carries out `operator`'s decision about a record, `reason` (required)
/// kept in its history and `operator` its event's actor: completes or
/// releases an open record (404 when there is none), or purges whatever is
/// current (404 when nothing is).
pub async fn resolve_record(
    state: &AppState,
    scope: &Scope,
    how: &Action,
    reason: Option<&str>,
    operator: &Operator,
) -> Result<(), Refusal> {
    if let Action::Complete { status, headers, .. } = how {
        idemgate_core::limits::response_fits(*status, headers).map_err(Refusal::bad_request)?;
    }
    let reason = required_reason(reason).map_err(Refusal::bad_request)?;
    let now = state.store.clock.now();
    let decision = Resolution {
        action: how.clone(),
        by: operator.actor(),
    };
    if !state
        .store
        .backend
        .resolve(scope, &decision, Some(reason), now)
        .await?
    {
        return Err(Refusal::new(
            ProblemKind::NotFound,
            match how {
                Action::Purge => "no record with this scope",
                Action::Complete { .. } | Action::Release => {
                    "no in-progress or unknown record with this scope"
                }
            },
        ));
    }
    // Never the reason: it is the operator's free text. The operator is in
    // the event's own log line.
    match how {
        Action::Purge => tracing::info!(record = %state.store.log_id(scope), "purged by an operator"),
        Action::Complete { .. } | Action::Release => {
            let action = if matches!(how, Action::Release) {
                "release"
            } else {
                "complete"
            };
            tracing::info!(record = %state.store.log_id(scope), action, "resolved by an operator")
        }
    }
    state.store.notify_changed();
    Ok(())
}

pub async fn resolve(
    State(state): State<AppState>,
    identified: Identified,
    body: Body,
) -> Result<Json<Changed>, Refusal> {
    let operator = identified.operator()?;
    let req: ResolveRequest = json_body(&state, body).await?;
    resolve_record(&state, &req.scope, &req.action, req.reason.as_deref(), &operator).await?;
    Ok(Json(Changed { changed: true }))
}

pub async fn purge(
    State(state): State<AppState>,
    identified: Identified,
    body: Body,
) -> Result<Json<Changed>, Refusal> {
    let operator = identified.operator()?;
    let req: PurgeRequest = json_body(&state, body).await?;
    resolve_record(
        &state,
        &req.scope,
        &Action::Purge,
        req.reason.as_deref(),
        &operator,
    )
    .await?;
    Ok(Json(Changed { changed: true }))
}

/// Runs the sweeper until it has nothing left to do (bounded), now.
pub async fn sweep(State(state): State<AppState>) -> Result<Json<SweepReport>, Refusal> {
    let policy = state.settings.sweep.policy();
    Ok(Json(crate::sweeper::sweep_all(&state.store, &policy).await?))
}
