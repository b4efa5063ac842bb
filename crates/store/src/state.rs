//! What every request handler shares: the store, the service's settings
//! and the console's sessions.

use std::sync::Arc;

use crate::service::Store;
use crate::{auth, console, mesh, sealing, sweeper};

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
    /// The API's token, if any (re-read from its files when it came from them).
    pub api_token: auth::ApiCredential,
    pub admin_token: auth::Credential,
    /// The mesh identities that may call the API, and on which policies.
    pub mesh: mesh::MeshIdentities,
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
            api_token: auth::ApiCredential::new(api_token),
            admin_token: auth::Credential::new(admin_token),
            mesh: mesh::MeshIdentities::default(),
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

    /// The same state, the API called by the mesh identities of `mesh`.
    pub fn with_mesh(mut self, mesh: mesh::MeshIdentities) -> AppState {
        let mut settings = (*self.settings).clone();
        settings.mesh = mesh;
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
