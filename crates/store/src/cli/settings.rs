//! What the flags add up to, every rule between them checked before it is
//! used: the database every command opens ([`Global`]) and what `serve`
//! serves with ([`ServeSettings`]).

use std::path::Path;
use std::time::Duration;

use super::args::{Cli, Command, MeshArgs, OperatorArgs, PgPooler, ServeArgs, SweepArgs, Synchronous};
use super::CliError;
use crate::auth::{ApiCredential, Credential, OperatorSource, TokenFiles};
use crate::backend::SweepPolicy;
use crate::budget::Budgets;
use crate::console::ConsoleSettings;
use crate::database_url::BackendOptions;
use crate::log_ids::LogIds;
use crate::mesh::MeshIdentities;
use crate::postgres::{PgSession, PgTimeouts, Pooler};
use crate::sealing::Seal;
use crate::sweeper::SweepSettings;

#[cfg(test)]
mod tests;

/// What a command may do to the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// Apply pending migrations (`migrate`, `serve --migrate`).
    Migrate,
    /// Use it only if it is current: PostgreSQL refuses a schema that is
    /// behind, SQLite (embedded, owned by the store) is migrated.
    Verify,
    /// Use it only if it is current, on both backends (`serve
    /// --no-migrate`); SQLite is not checked, only left alone.
    Untouched,
    /// Read it, change nothing (`inspect`).
    ReadOnly,
}

impl Schema {
    pub fn of(command: &Command) -> Schema {
        match command {
            Command::Migrate => Schema::Migrate,
            Command::Serve(s) if s.migrate => Schema::Migrate,
            Command::Serve(s) if s.no_migrate => Schema::Untouched,
            Command::Inspect(_) => Schema::ReadOnly,
            _ => Schema::Verify,
        }
    }
}

/// What every command shares: where the database is, how to reach it, and
/// the admin credential (which names records in logs unless a log key does).
pub struct Global {
    pub database_url: String,
    pub options: BackendOptions,
    pub session: PgSession,
    pub schema: Schema,
    pub admin: Option<String>,
    /// Whether the log ids printed are those of the store's logs: a log key
    /// or the admin credential was given, not a random secret.
    pub log_ids_match_logs: bool,
}

impl TryFrom<&Cli> for Global {
    type Error = CliError;

    fn try_from(cli: &Cli) -> Result<Global, CliError> {
        let admin = optional_token(
            cli.admin_token.as_deref(),
            cli.admin_token_file.as_deref(),
            "admin token",
        )?;
        let log_ids = match (&cli.log_key_file, &admin) {
            (Some(path), _) => LogIds::from_file(path),
            (None, Some(admin)) => LogIds::from_admin_credential(admin),
            // `serve` refuses to start without an admin credential; the other
            // commands then print ids that match no log line.
            (None, None) => LogIds::random(),
        }
        .map_err(CliError::Invalid)?;
        let seal = match &cli.response_key_file {
            Some(path) => Seal::from_file(path).map_err(CliError::Invalid)?,
            None => Seal::off(),
        };
        let options = BackendOptions {
            sqlite_synchronous_full: Some(matches!(cli.sqlite_synchronous, Synchronous::Full)),
            pg_pool_size: Some(cli.pg_pool_size),
            log_ids: Some(log_ids),
            seal,
            pg_timeouts: pg_timeouts(cli),
        };
        let database_url = match &cli.database_url_file {
            Some(path) => read_token(None, Some(path), "database url")?,
            None => cli.database_url.clone(),
        };
        let schema = Schema::of(&cli.command);
        let session = PgSession {
            pooler: match cli.pg_pooler {
                PgPooler::Session => Pooler::Session,
                PgPooler::Transaction => Pooler::Transaction,
            },
            read_only: schema == Schema::ReadOnly,
        };
        Ok(Global {
            database_url,
            options,
            session,
            schema,
            log_ids_match_logs: cli.log_key_file.is_some() || admin.is_some(),
            admin,
        })
    }
}

/// The PostgreSQL timeouts, none of them zero (which would disable it).
pub fn pg_timeouts(cli: &Cli) -> PgTimeouts {
    let ms = |ms: u64| Duration::from_millis(ms.max(1));
    PgTimeouts {
        wait: ms(cli.pg_wait_timeout_ms),
        connect: ms(cli.pg_connect_timeout_ms),
        recycle: ms(cli.pg_recycle_timeout_ms),
        statement: ms(cli.pg_statement_timeout_ms),
    }
}

/// A secret given as a value or as a file (trailing newline ignored); a
/// value wins. Neither, or an empty one, is refused.
pub fn read_token(value: Option<&str>, file: Option<&Path>, what: &'static str) -> Result<String, CliError> {
    let token = match (value, file) {
        (Some(v), _) => v.to_string(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map_err(|source| CliError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })?
            .trim_end_matches(['\r', '\n'])
            .to_string(),
        (None, None) => return Err(CliError::Missing { what }),
    };
    if token.is_empty() {
        return Err(CliError::Empty { what });
    }
    Ok(token)
}

/// [`read_token`], where giving neither is fine.
pub fn optional_token(
    value: Option<&str>,
    file: Option<&Path>,
    what: &'static str,
) -> Result<Option<String>, CliError> {
    match (value, file) {
        (None, None) => Ok(None),
        _ => read_token(value, file, what).map(Some),
    }
}

/// What `serve` serves with.
pub struct ServeSettings {
    pub listen: Vec<String>,
    pub admin_listen: Option<String>,
    /// The HTTP surface: credentials (the next API one included), problem
    /// links, body limit, sweeper and console.
    pub http: crate::Settings,
    pub new_keys: Option<NewKeyLimit>,
}

/// The budget of new keys per tenant, and what it was made of (for the log).
pub struct NewKeyLimit {
    pub rate: f64,
    pub burst: u32,
    pub budgets: Budgets,
}

impl ServeSettings {
    /// `args` with the admin credential from the global flags, which
    /// `serve` requires.
    pub fn new(args: &ServeArgs, admin: Option<String>) -> Result<ServeSettings, CliError> {
        let admin = admin.ok_or(CliError::Missing { what: "admin token" })?;
        let mesh = mesh_identities(&args.mesh)?;
        let api_token = api_credential(args, &admin, mesh.configured())?;
        let new_keys = new_key_limit(args.tenant_new_keys_per_sec, args.tenant_new_keys_burst)?;
        Ok(ServeSettings {
            listen: args.listen.clone(),
            admin_listen: args.admin_listen.clone(),
            http: crate::Settings {
                api_token,
                admin_token: Credential::new(&admin),
                mesh,
                doc_base: args.doc_base.clone(),
                max_body_bytes: max_body_bytes(args.max_body_bytes)?,
                sweep: sweep_settings(args),
                console: console_settings(args)?,
            },
            new_keys,
        })
    }
}

/// The API's tokens: from files (re-read while serving) when the current
/// one is a file, else as given; none at all only when mesh identities
/// call the API.
fn api_credential(args: &ServeArgs, admin: &str, mesh: bool) -> Result<ApiCredential, CliError> {
    if let (None, Some(current)) = (&args.api_token, &args.api_token_file) {
        if args.api_token_next.is_some() {
            return Err(CliError::Invalid(
                "with --api-token-file, give the next token as a file too (--api-token-next-file)".into(),
            ));
        }
        let files = TokenFiles {
            current: current.clone(),
            next: args.api_token_next_file.clone(),
        };
        return ApiCredential::from_files(files, Credential::new(admin)).map_err(CliError::Invalid);
    }
    if args.api_token.is_none() && mesh {
        if args.api_token_next.is_some() || args.api_token_next_file.is_some() {
            return Err(CliError::Invalid("a next API token needs a current one".into()));
        }
        return Ok(ApiCredential::none());
    }
    let api = read_token(args.api_token.as_deref(), None, "api token")?;
    let next = optional_token(
        args.api_token_next.as_deref(),
        args.api_token_next_file.as_deref(),
        "api token next",
    )?;
    distinct_tokens(&api, admin, next.as_deref())?;
    let api_token = ApiCredential::new(&api);
    Ok(match &next {
        Some(next) => api_token.and(next),
        None => api_token,
    })
}

/// The mesh identities file and the sidecar it is believed from.
pub fn mesh_identities(args: &MeshArgs) -> Result<MeshIdentities, CliError> {
    let trusted_peers = (args.mesh_trusted_peers.iter())
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.parse().map_err(|e| CliError::flag("mesh-trusted-peers", e)))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(path) = &args.mesh_identities_file else {
        return Ok(MeshIdentities::default());
    };
    let yaml = std::fs::read_to_string(path).map_err(|source| CliError::Read {
        what: "mesh identities file",
        path: path.clone(),
        source,
    })?;
    let mesh = MeshIdentities::from_yaml(&yaml, trusted_peers)
        .map_err(|e| CliError::flag("mesh-identities-file", e))?;
    if mesh.is_empty() {
        return Err(CliError::flag("mesh-identities-file", "it names no identity"));
    }
    Ok(mesh)
}

/// A request size limit whose bodies the database can store.
pub fn max_body_bytes(n: usize) -> Result<usize, CliError> {
    if n > crate::MAX_BODY_BYTES {
        return Err(CliError::flag(
            "max-body-bytes",
            format!(
                "at most {} (the database's bound on a stored body, less sealing)",
                crate::MAX_BODY_BYTES
            ),
        ));
    }
    Ok(n)
}

/// The admin credential must differ from every API one, so a filter's
/// token can never act as an operator's.
pub fn distinct_tokens(api: &str, admin: &str, next: Option<&str>) -> Result<(), CliError> {
    if api == admin {
        return Err(CliError::Invalid("the API and admin tokens must differ".into()));
    }
    if next == Some(admin) {
        return Err(CliError::Invalid(
            "the next API token must differ from the admin token".into(),
        ));
    }
    Ok(())
}

/// `--tenant-new-keys-per-sec` and its burst: one second's worth, at least
/// 1, unless given.
pub fn new_key_limit(rate: Option<f64>, burst: Option<u32>) -> Result<Option<NewKeyLimit>, CliError> {
    let Some(rate) = rate else { return Ok(None) };
    // The cast saturates: a huge or non-finite rate is refused by Budgets.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let burst = burst.unwrap_or_else(|| (rate.ceil() as u32).max(1));
    let budgets = Budgets::new(rate, burst).map_err(|e| CliError::flag("tenant-new-keys-per-sec", e))?;
    Ok(Some(NewKeyLimit { rate, burst, budgets }))
}

/// One sweeper pass's policy: at least one row a batch.
pub fn sweep_policy(args: &SweepArgs) -> SweepPolicy {
    SweepPolicy {
        batch: args.sweep_batch.max(1),
        audit_retention_ms: args.audit_retention_secs.saturating_mul(1000),
    }
}

/// The background sweeper: passes at least 10 ms apart, so a zero
/// interval cannot spin.
pub fn sweep_settings(args: &ServeArgs) -> SweepSettings {
    let policy = sweep_policy(&args.sweep);
    SweepSettings {
        enabled: !args.no_sweeper,
        interval: Duration::from_millis(args.sweep_interval_ms.max(10)),
        batch: policy.batch,
        audit_retention_ms: policy.audit_retention_ms,
    }
}

/// The console, and who names operators: sessions idle at least a minute.
pub fn console_settings(args: &ServeArgs) -> Result<ConsoleSettings, CliError> {
    Ok(ConsoleSettings {
        enabled: !args.no_console,
        secure_cookies: args.console_secure_cookies,
        operators: operator_source(&args.operators)?,
        idle: Duration::from_secs(args.operators.console_idle_minutes.max(1).saturating_mul(60)),
    })
}

/// Where operators' identities come from: header names that are header
/// names, peers that are addresses or networks, a secret of 16 bytes or more.
pub fn operator_source(args: &OperatorArgs) -> Result<OperatorSource, CliError> {
    let header = |name: &str, flag: &str| {
        axum::http::HeaderName::try_from(name.trim())
            .map_err(|_| CliError::flag(flag, format_args!("{name:?} is not a header name")))
    };
    let trusted_peers = (args.operator_trusted_peers.iter())
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.parse().map_err(|e| CliError::flag("operator-trusted-peers", e)))
        .collect::<Result<Vec<_>, _>>()?;
    let secret = match &args.operator_proxy_secret_file {
        None => None,
        Some(path) => Some(proxy_secret(path)?),
    };
    Ok(OperatorSource {
        header: header(&args.operator_header, "operator-header")?,
        trusted_peers,
        secret_header: header(&args.operator_proxy_secret_header, "operator-proxy-secret-header")?,
        secret,
    })
}

fn proxy_secret(path: &Path) -> Result<Credential, CliError> {
    let secret = read_token(None, Some(path), "operator proxy secret")?;
    if secret.len() < 16 {
        return Err(CliError::Invalid(
            "the operator proxy secret is shorter than 16 bytes".into(),
        ));
    }
    Ok(Credential::new(&secret))
}
