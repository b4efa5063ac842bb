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
    if settings.http.mesh.configured() {
        tracing::info!(
            identities = settings.http.mesh.len(),
            token = settings.http.api_token.configured(),
            "mesh identities call the API, each on the policies it owns"
        );
    }
    let state = crate::AppState::new(store, settings.http);
    let admin = match &settings.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(cannot_listen(addr))?,
        ),
        None => None,
    };
    let mut api = Vec::new();
    for addr in &settings.listen {
        api.push(crate::Listener::bind(addr).await.map_err(cannot_listen(addr))?);
    }
    crate::run(crate::Listeners(api), admin, state, shutdown_signal())
        .await
        .map_err(CliError::Serve)
}

fn cannot_listen(addr: &str) -> impl FnOnce(std::io::Error) -> CliError + '_ {
    move |source| CliError::Listen {
        addr: addr.to_string(),
        source,
    }
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
