//! The idemgate store: claims, leases, fencing tokens, replay and audit for
//! the Envoy filter (contract §4–§7, §9).
//!
//! The filter calls `POST /v1/claim` before forwarding a request and
//! `/v1/complete`, `/v1/release` or `/v1/mark-unknown` afterwards, always with
//! the fencing token it got from the claim. Every decision about an existing
//! record is made by the pure rules in [`idemgate_core::record`]; a backend
//! only loads the record and carries the decision out atomically. Where a
//! statement must pick rows in SQL instead (PostgreSQL's one-statement
//! completion, guards, the sweeper), it writes the conditions [`conditions`]
//! builds from those same rules, and rows map to values through one
//! [`columns`] mapping, so the SQLite and PostgreSQL backends cannot disagree.
//! Expiry, archiving and purging are a batched background job ([`sweeper`]),
//! never a scan on the request path.
//!
//! Tests start the whole service in a few lines: bind a listener on port 0,
//! build an [`AppState`], and spawn [`run`].

/// An event's columns as operators and the log see it (its generation's
/// scope, attempt and fingerprint with its own), for `concat!`.
macro_rules! event_columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, generation, at, transition, attempt, fence, \
         fingerprint, status, actor, detail, duration_ms, reason"
    };
}

pub mod admin;
pub mod api;
pub mod auth;
pub mod backend;
pub mod budget;
pub mod calls;
pub mod cli;
pub mod clock;
pub mod columns;
pub mod conditions;
pub mod console;
pub mod database_url;
pub mod error;
pub mod listen;
pub mod log_ids;
/// The in-memory backend of the simulation and the tests; never storage.
pub mod memory;
pub mod metrics;
pub mod openapi;
pub mod plan;
pub mod postgres;
pub mod problem;
pub mod records;
mod replay;
mod replays;
pub mod scope_digest;
pub mod sealing;
pub mod service;
pub mod sqlite;
pub mod sweeper;

use std::future::Future;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

pub use backend::{Backend, StoreError};
pub use clock::Clock;
pub use database_url::open_backend;
pub use listen::{Listener, Listeners};
pub use service::Store;

/// Everything a request handler needs: the store, the service's settings
/// and the console's sessions.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub settings: Arc<Settings>,
    pub sessions: Arc<console::Sessions>,
}

/// How the HTTP surface is configured.
#[derive(Clone)]
pub struct Settings {
    pub api_token: auth::Credential,
    pub admin_token: auth::Credential,
    /// Where problem type URIs point.
    pub doc_base: String,
    /// Largest request body accepted on any endpoint.
    pub max_body_bytes: usize,
    pub sweep: sweeper::SweepSettings,
    pub console: console::ConsoleSettings,
}

impl Settings {
    /// The defaults (problem links, body limit, sweeper, console) with
    /// these credentials.
    pub fn new(api_token: &str, admin_token: &str) -> Settings {
        Settings {
            api_token: auth::Credential::new(api_token),
            admin_token: auth::Credential::new(admin_token),
            doc_base: idemgate_core::config::DEFAULT_DOC_BASE.to_string(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            sweep: sweeper::SweepSettings::default(),
            console: console::ConsoleSettings::default(),
        }
    }
}

impl AppState {
    pub fn new(store: Store, settings: Settings) -> AppState {
        AppState {
            store,
            settings: Arc::new(settings),
            sessions: Arc::default(),
        }
    }

    /// The same state, also accepting `token` on the API: the next
    /// credential while the filters move to it (a rotation without outage).
    pub fn with_next_api_token(mut self, token: &str) -> AppState {
        let mut settings = (*self.settings).clone();
        settings.api_token = settings.api_token.and(token);
        self.settings = Arc::new(settings);
        self
    }

    /// The same state with the console configured as `console` says.
    pub fn with_console(mut self, console: console::ConsoleSettings) -> AppState {
        let mut settings = (*self.settings).clone();
        settings.console = console;
        self.settings = Arc::new(settings);
        self
    }
}

/// 8 MiB: a stored response is at most the largest `max_stored_body` the
/// filter accepts plus a metadata line.
pub const DEFAULT_MAX_BODY_BYTES: usize = idemgate_core::limits::MAX_FRAME;

/// The largest `--max-body-bytes`: a stored body, sealed, must fit the
/// database's bound on the column (64 MiB), or the store would accept a
/// completion it then fails to write.
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024 - sealing::OVERHEAD;

/// Every API route the service answers, as (method, path). The router and
/// the OpenAPI document are both checked against this list and
/// [`console::ROUTES`] in tests.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("post", idemgate_core::protocol::CLAIM_PATH),
    ("post", idemgate_core::protocol::COMPLETE_PATH),
    ("post", idemgate_core::protocol::RELEASE_PATH),
    ("post", idemgate_core::protocol::MARK_UNKNOWN_PATH),
    ("post", idemgate_core::protocol::ABANDON_PATH),
    ("post", idemgate_core::protocol::BATCH_PATH),
    ("post", idemgate_core::protocol::REPLAY_PATH),
    ("post", admin::LOOKUP_PATH),
    ("get", admin::UNKNOWN_PATH),
    ("get", admin::STUCK_PATH),
    ("post", admin::RESOLVE_PATH),
    ("post", admin::PURGE_PATH),
    ("post", admin::SWEEP_PATH),
];

/// The whole HTTP surface.
pub fn app(state: AppState) -> Router {
    surface(state, Surface::All)
}

/// Which part of the HTTP surface a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// Everything on one address.
    All,
    /// What the filters and the monitoring need: `/v1`, health, metrics,
    /// the OpenAPI document.
    Api,
    /// What operators need: `/admin/v1`, the console, health.
    Admin,
}

/// The routes of one [`Surface`].
pub fn surface(state: AppState, surface: Surface) -> Router {
    use idemgate_core::protocol::{
        ABANDON_PATH, BATCH_PATH, CLAIM_PATH, COMPLETE_PATH, MARK_UNKNOWN_PATH, RELEASE_PATH,
    };
    let v1 = Router::new()
        .route(CLAIM_PATH, post(api::single))
        .route(COMPLETE_PATH, post(api::single))
        .route(RELEASE_PATH, post(api::single))
        .route(MARK_UNKNOWN_PATH, post(api::single))
        .route(ABANDON_PATH, post(api::single))
        .route(BATCH_PATH, post(api::batch))
        .route_layer(axum::middleware::from_fn(api::speak_protocol))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api,
        ));
    let admin = Router::new()
        .route(admin::LOOKUP_PATH, post(admin::lookup))
        .route(admin::UNKNOWN_PATH, get(admin::unknown))
        .route(admin::STUCK_PATH, get(admin::stuck))
        .route(admin::RESOLVE_PATH, post(admin::resolve))
        .route(admin::PURGE_PATH, post(admin::purge))
        .route(admin::SWEEP_PATH, post(admin::sweep))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin,
        ));
    let mut routes = Router::new()
        .route("/healthz", get(api::healthz))
        .route("/readyz", get(api::readyz));
    if surface != Surface::Admin {
        routes = routes
            .route("/metrics", get(metrics::serve))
            .route("/openapi.json", get(openapi::serve))
            .route(idemgate_core::protocol::REPLAY_PATH, post(replay::serve))
            .merge(v1);
    }
    if surface != Surface::Api {
        routes = routes.merge(admin).merge(console::router(&state));
    }
    routes
        .fallback(api::not_found)
        .layer(axum::middleware::map_response_with_state(
            state.clone(),
            problem::render_refusals,
        ))
        // Bodies are read with our own limit so an oversize body gets a
        // problem+json 413 instead of axum's plain-text one.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// Serves `state` on each of `api` until `shutdown` resolves, with the
/// sweeper running alongside; in-flight requests finish before it returns.
/// With `admin`, the admin surface (`/admin/v1`, the console) is served
/// there and only the API on `api`.
pub async fn run(
    api: impl Into<Listeners> + Send,
    admin: Option<TcpListener>,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sweeper = if state.settings.sweep.enabled {
        Some(tokio::spawn(sweeper::run(
            state.store.clone(),
            state.settings.sweep.clone(),
            stop_rx.clone(),
        )))
    } else {
        None
    };
    let main = if admin.is_some() {
        Surface::Api
    } else {
        Surface::All
    };
    let api = api.into().0.into_iter().map(|l| (l, main));
    let admin = admin.map(|a| (Listener::Tcp(a), Surface::Admin));
    let servers: Vec<_> = api
        .chain(admin)
        .map(|(listener, surface)| listener.serve(state.clone(), surface, stop_rx.clone()))
        .collect();
    shutdown.await;
    let _ = stop_tx.send(true);
    let mut result = Ok(());
    for server in servers {
        result = result.and(server.await.unwrap_or_else(|e| Err(std::io::Error::other(e))));
    }
    if let Some(handle) = sweeper {
        let _ = handle.await;
    }
    result
}
