//! The HTTP surface: every route the service answers, which listener
//! serves which part of it, and serving them with the sweeper alongside.

use std::future::Future;

use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

use crate::listen::{Listener, Listeners};
use crate::state::AppState;
use crate::{admin, api, auth, console, grpc_replay, metrics, openapi, problem, sweeper};

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
            .route(idemgate_core::protocol::REPLAY_PATH, post(grpc_replay::serve))
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
    let tokens = (state.settings.api_token.reloads())
        .then(|| tokio::spawn(state.settings.api_token.clone().watch(stop_rx.clone())));
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
    for handle in sweeper.into_iter().chain(tokens) {
        let _ = handle.await;
    }
    result
}
