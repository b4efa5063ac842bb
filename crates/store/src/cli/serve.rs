//! `serve`: the HTTP API (and the admin surface) until SIGTERM or Ctrl-C.

use super::args::ServeArgs;
use super::settings::ServeSettings;
use super::CliError;
use crate::service::Store;

/// `admin`: the admin credential from the global flags; `sealing`: the id
/// of the key stored responses are sealed with, if any.
pub async fn serve(
    store: Store,
    args: &ServeArgs,
    admin: Option<String>,
    database_url: &str,
    sealing: Option<&str>,
) -> Result<(), CliError> {
    match sealing {
        Some(id) => tracing::info!(key = %id, "stored responses are sealed (AES-256-GCM)"),
        None => tracing::warn!(
            "stored responses are kept in plaintext: pass --response-key-file to seal them at rest"
        ),
    }
    let settings = ServeSettings::new(args, admin)?;
    let store = match settings.new_keys {
        None => store,
        Some(limit) => {
            let (rate, burst) = (limit.rate, limit.burst);
            tracing::info!(rate, burst, "new keys per tenant are limited (in this replica)");
            store.with_budgets(limit.budgets)
        }
    };
    tracing::info!(
        backend = store.backend.name(),
        database = %crate::database_url::redact_url(database_url),
        "database ready"
    );
    if !settings.http.console.operators.configured() {
        tracing::warn!(
            "no trusted authenticating proxy (--operator-trusted-peers, --operator-proxy-secret-file): \
             the console opens no session and the admin API changes no record"
        );
    }
    let state = crate::AppState::new(store, settings.http);
    let admin = match &settings.admin_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let listen = settings.listen;
    let cannot = |source| CliError::Listen {
        addr: listen.clone(),
        source,
    };
    let served = match listen.strip_prefix("unix:") {
        // Envoy on the same host reaches it through a `pipe` address: no
        // TCP stack between them.
        Some(path) => {
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(cannot)?;
            crate::run(listener, admin, state, shutdown_signal()).await
        }
        None => {
            let listener = tokio::net::TcpListener::bind(&listen).await.map_err(cannot)?;
            crate::run(listener, admin, state, shutdown_signal()).await
        }
    };
    served.map_err(CliError::Serve)
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, CliError> {
    (tokio::net::TcpListener::bind(addr).await).map_err(|source| CliError::Listen {
        addr: addr.to_string(),
        source,
    })
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}
