//! Command line: `serve`, `migrate`, `inspect`, `resolve`, `purge`, `sweep`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idemgate_core::scope::Scope;

use crate::backend::{
    open_backend, Action, Backend, BackendOptions, Listing, Lookup, Resolution, StoreError, SweepPolicy,
};
use crate::budget::Budgets;
use crate::clock::Clock;
use crate::log_ids::LogIds;
use crate::postgres::{PgSession, PgTimeouts, Pooler, Postgres};
use crate::sealing::Seal;
use crate::service::Store;
use crate::sweeper::{SweepSettings, DEFAULT_AUDIT_RETENTION_MS};

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-store",
    version,
    about = "Companion store of the idemgate Envoy filter: claims, leases, fencing tokens, replay, audit"
)]
pub struct Cli {
    /// Where records live: sqlite://FILE (embedded, default) or
    /// postgres://USER[:PASSWORD]@HOST:PORT/DB (several replicas).
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_DATABASE_URL",
        default_value = "sqlite://idempotency.db"
    )]
    pub database_url: String,

    /// File holding the database URL (trailing newline ignored), used instead
    /// of --database-url: a PostgreSQL password then lives in a mounted file
    /// (e.g. a Kubernetes Secret), not in the environment or the command line.
    #[arg(long, global = true, env = "IDEMGATE_DATABASE_URL_FILE")]
    pub database_url_file: Option<PathBuf>,

    /// SQLite durability: `full` fsyncs every (group) commit; `normal` may lose
    /// the last commits on power loss (WAL mode keeps the file consistent).
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_SQLITE_SYNCHRONOUS",
        default_value = "full"
    )]
    pub sqlite_synchronous: Synchronous,

    /// PostgreSQL connection pool size.
    #[arg(long, global = true, env = "IDEMGATE_PG_POOL_SIZE", default_value_t = 16)]
    pub pg_pool_size: usize,

    /// Bearer credential of the /admin/v1 endpoints (`serve`); must differ
    /// from the API one. Without --log-key-file, log ids are derived from it.
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<String>,
    /// File holding the admin credential (trailing newline ignored).
    #[arg(long, global = true, env = "IDEMGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,

    /// File holding the secret (at least 16 bytes; trailing newline ignored)
    /// under which records are named in logs: an HMAC of the scope, so a log
    /// line says nothing about the key. Give every replica the same file.
    /// Default: a secret derived from the admin credential.
    #[arg(long, global = true, env = "IDEMGATE_LOG_KEY_FILE")]
    pub log_key_file: Option<PathBuf>,

    /// File of the AES-256-GCM keys that seal stored responses (headers and
    /// body) at rest: one key a line, `ID:BASE64` (32 bytes); the first seals,
    /// every one opens. Without it responses are stored in plaintext.
    #[arg(long, global = true, env = "IDEMGATE_RESPONSE_KEY_FILE")]
    pub response_key_file: Option<PathBuf>,

    /// PostgreSQL: how long a call waits for a pooled connection when all
    /// are in use, in milliseconds (then 503).
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_PG_WAIT_TIMEOUT_MS",
        default_value_t = 250
    )]
    pub pg_wait_timeout_ms: u64,

    /// PostgreSQL: how long opening a connection may take, in milliseconds.
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_PG_CONNECT_TIMEOUT_MS",
        default_value_t = 500
    )]
    pub pg_connect_timeout_ms: u64,

    /// PostgreSQL: how long checking a pooled connection before reuse may take, in milliseconds.
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_PG_RECYCLE_TIMEOUT_MS",
        default_value_t = 250
    )]
    pub pg_recycle_timeout_ms: u64,

    /// PostgreSQL `statement_timeout` for the store's connections, in
    /// milliseconds; keep it below the filter's store timeout (default 1000).
    /// Migrations run without it.
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_PG_STATEMENT_TIMEOUT_MS",
        default_value_t = 750
    )]
    pub pg_statement_timeout_ms: u64,

    /// PostgreSQL: what the store connects through. `session`: PostgreSQL
    /// itself, or a pooler in session mode. `transaction`: a pooler in
    /// transaction mode (PgBouncer's `pool_mode = transaction`), for which
    /// statements are not prepared by name and each transaction sets its
    /// own `statement_timeout`.
    #[arg(
        long,
        global = true,
        env = "IDEMGATE_PG_POOLER",
        value_enum,
        default_value = "session"
    )]
    pub pg_pooler: PgPooler,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PgPooler {
    Session,
    Transaction,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Synchronous {
    Full,
    Normal,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API until SIGTERM or Ctrl-C. On PostgreSQL the schema
    /// must be current (`migrate` first, or --migrate); SQLite is migrated.
    Serve(Serve),
    /// Apply pending schema migrations and exit: the only command that
    /// changes a PostgreSQL schema (run it as the schema's owner).
    Migrate,
    /// Print records as JSON: by tenant and key, or the unknown / stuck
    /// ones. Read-only: on PostgreSQL every transaction is READ ONLY.
    Inspect(Inspect),
    /// Resolve an in-progress or unknown record: complete it with a response, or release it.
    Resolve(Resolve),
    /// Delete one record whatever its state.
    Purge(Purge),
    /// Run the sweeper once (expire leases, archive, purge) and print what it did.
    Sweep(SweepArgs),
}

#[derive(Debug, Args)]
pub struct Serve {
    /// Address to listen on (`host:port`, or `unix:/path` for a Unix domain
    /// socket that an Envoy on the same host reaches through a `pipe`
    /// address). Listen only where the mesh can reach it.
    #[arg(long, env = "IDEMGATE_LISTEN", default_value = "127.0.0.1:8787")]
    pub listen: String,
    /// Serve the admin surface (/admin/v1, the console) on this address
    /// instead, and only the API on `--listen`: operators' network path
    /// apart from the mesh's.
    #[arg(long, env = "IDEMGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Bearer credential of the /v1 API (the filter's `store.token`).
    #[arg(
        long,
        env = "IDEMGATE_API_TOKEN",
        hide_env_values = true,
        conflicts_with = "api_token_file"
    )]
    pub api_token: Option<String>,
    /// File holding the API credential (trailing newline ignored).
    #[arg(long, env = "IDEMGATE_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// A second accepted API credential, while filters move to it: start
    /// every replica with the old one and this, roll the filters to this
    /// one, then make it the only one.
    #[arg(
        long,
        env = "IDEMGATE_API_TOKEN_NEXT",
        hide_env_values = true,
        conflicts_with = "api_token_next_file"
    )]
    pub api_token_next: Option<String>,
    /// File holding the second accepted API credential.
    #[arg(long, env = "IDEMGATE_API_TOKEN_NEXT_FILE")]
    pub api_token_next_file: Option<PathBuf>,
    /// Base URI of problem `type` links (the problem's slug is appended).
    #[arg(long, env = "IDEMGATE_DOC_BASE", default_value = idemgate_core::config::DEFAULT_DOC_BASE)]
    pub doc_base: String,
    /// Largest request body accepted (bytes); larger gets 413.
    #[arg(long, env = "IDEMGATE_MAX_BODY_BYTES", default_value_t = crate::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    #[command(flatten)]
    pub sweep: SweepArgs,
    /// Milliseconds between sweeper passes.
    #[arg(long, env = "IDEMGATE_SWEEP_INTERVAL_MS", default_value_t = 1000)]
    pub sweep_interval_ms: u64,
    /// Do not run the sweeper in this process (e.g. all but one replica).
    #[arg(long, env = "IDEMGATE_NO_SWEEPER")]
    pub no_sweeper: bool,
    /// Budget of new keys per tenant, per second, in this replica: claims
    /// that would take a key beyond it get 429 `key-rate-limited` (nothing
    /// is claimed). Replays, conflicts and completions are never limited.
    /// Each replica keeps its own budget. Default: no limit.
    #[arg(long, env = "IDEMGATE_TENANT_NEW_KEYS_PER_SEC")]
    pub tenant_new_keys_per_sec: Option<f64>,
    /// With --tenant-new-keys-per-sec: how many new keys a tenant may take
    /// at once (default: one second's worth, at least 1).
    #[arg(
        long,
        env = "IDEMGATE_TENANT_NEW_KEYS_BURST",
        requires = "tenant_new_keys_per_sec"
    )]
    pub tenant_new_keys_burst: Option<u32>,
    /// Apply pending schema migrations before serving. Without it a
    /// PostgreSQL store whose schema is behind refuses to start (run
    /// `migrate` as the schema's owner instead); SQLite is migrated unless
    /// --no-migrate.
    #[arg(long, env = "IDEMGATE_MIGRATE", conflicts_with = "no_migrate")]
    pub migrate: bool,
    /// Never change the schema, on either backend: what PostgreSQL does
    /// without --migrate, and for SQLite, a file `migrate` has prepared.
    #[arg(long, env = "IDEMGATE_NO_MIGRATE")]
    pub no_migrate: bool,
    /// Do not serve the operators' console (/admin/console).
    #[arg(long, env = "IDEMGATE_NO_CONSOLE")]
    pub no_console: bool,
    /// Mark the console's cookies Secure: set it when browsers reach the
    /// store over TLS (a terminating proxy or ingress in front of it).
    #[arg(long, env = "IDEMGATE_CONSOLE_SECURE_COOKIES")]
    pub console_secure_cookies: bool,
    #[command(flatten)]
    pub operators: OperatorArgs,
}

/// Where operators' identities come from (docs/operations.md#operator-identity).
#[derive(Debug, Args)]
pub struct OperatorArgs {
    /// Header naming the operator, set by the authenticating proxy in front
    /// of the console and admin API (oauth2-proxy: X-Forwarded-Email).
    #[arg(long, env = "IDEMGATE_OPERATOR_HEADER", default_value = crate::auth::DEFAULT_OPERATOR_HEADER)]
    pub operator_header: String,
    /// Peers (IP addresses or CIDR networks, comma-separated) whose operator
    /// header is believed: the proxy's own addresses, nothing else.
    #[arg(long, env = "IDEMGATE_OPERATOR_TRUSTED_PEERS", value_delimiter = ',')]
    pub operator_trusted_peers: Vec<String>,
    /// File holding a secret the proxy sends with every request (in
    /// --operator-proxy-secret-header); with it, the operator header is
    /// believed from any peer.
    #[arg(long, env = "IDEMGATE_OPERATOR_PROXY_SECRET_FILE")]
    pub operator_proxy_secret_file: Option<PathBuf>,
    /// Header the proxy's secret travels in.
    #[arg(long, env = "IDEMGATE_OPERATOR_PROXY_SECRET_HEADER", default_value = crate::auth::DEFAULT_PROXY_SECRET_HEADER)]
    pub operator_proxy_secret_header: String,
    /// Minutes without use after which a console session ends.
    #[arg(long, env = "IDEMGATE_CONSOLE_IDLE_MINUTES", default_value_t = 15)]
    pub console_idle_minutes: u64,
}

impl OperatorArgs {
    fn source(&self) -> Result<crate::auth::OperatorSource, String> {
        let header = |name: &str, flag: &str| {
            axum::http::HeaderName::try_from(name.trim())
                .map_err(|_| format!("--{flag}: {name:?} is not a header name"))
        };
        let trusted_peers = (self.operator_trusted_peers.iter())
            .filter(|p| !p.trim().is_empty())
            .map(|p| p.parse().map_err(|e| format!("--operator-trusted-peers: {e}")))
            .collect::<Result<Vec<_>, String>>()?;
        let secret = match &self.operator_proxy_secret_file {
            None => None,
            Some(path) => {
                let secret = read_token(&None, &Some(path.clone()), "operator proxy secret")?;
                if secret.len() < 16 {
                    return Err("the operator proxy secret is shorter than 16 bytes".into());
                }
                Some(crate::auth::Credential::new(&secret))
            }
        };
        Ok(crate::auth::OperatorSource {
            header: header(&self.operator_header, "operator-header")?,
            trusted_peers,
            secret_header: header(&self.operator_proxy_secret_header, "operator-proxy-secret-header")?,
            secret,
        })
    }
}

/// Who is changing a record from the command line, and why.
#[derive(Debug, Args)]
pub struct Change {
    /// Why (what the downstream lookup showed): kept in the record's
    /// history with the event. Required.
    #[arg(long)]
    pub reason: Option<String>,
    /// Your name (e.g. your email): the event's actor, recorded as
    /// `cli:NAME` because nobody verified it. Required.
    #[arg(long)]
    pub actor: Option<String>,
}

impl Change {
    /// The operator and the reason, or why the change is refused.
    fn checked(&self) -> Result<(crate::auth::Operator, &str), String> {
        let actor = self
            .actor
            .as_deref()
            .ok_or("--actor is required: name yourself, the history records who made the change")?;
        let operator = crate::auth::Operator::declared(actor).map_err(|e| format!("--actor: {e}"))?;
        let reason =
            crate::admin::required_reason(self.reason.as_deref()).map_err(|e| format!("--reason: {e}"))?;
        Ok((operator, reason))
    }
}

#[derive(Debug, Args)]
pub struct Purge {
    #[command(flatten)]
    pub scope: ScopeArgs,
    #[command(flatten)]
    pub change: Change,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// Rows changed per sweeper transaction.
    #[arg(long, env = "IDEMGATE_SWEEP_BATCH", default_value_t = 500)]
    pub sweep_batch: u32,
    /// Seconds an archived record (metadata only) is kept before it is purged.
    #[arg(long, env = "IDEMGATE_AUDIT_RETENTION_SECS", default_value_t = DEFAULT_AUDIT_RETENTION_MS / 1000)]
    pub audit_retention_secs: u64,
}

#[derive(Debug, Args)]
pub struct Inspect {
    /// Tenant of the records to look up (archived ones included).
    #[arg(long, required_unless_present_any = ["unknown", "stuck"])]
    pub tenant: Option<String>,
    /// The Idempotency-Key, unquoted.
    #[arg(long, required_unless_present_any = ["unknown", "stuck"])]
    pub key: Option<String>,
    /// Only records of this route (policy name).
    #[arg(long)]
    pub route: Option<String>,
    /// Only records of this principal.
    #[arg(long)]
    pub principal: Option<String>,
    /// List records whose outcome is unknown.
    #[arg(long, conflicts_with_all = ["tenant", "key", "stuck"])]
    pub unknown: bool,
    /// List records in progress for longer than --older-than-ms.
    #[arg(long, conflicts_with_all = ["tenant", "key"])]
    pub stuck: bool,
    /// With --stuck: in progress for at least this many milliseconds.
    #[arg(long, default_value_t = crate::admin::DEFAULT_STUCK_AFTER_MS)]
    pub older_than_ms: u64,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
}

#[derive(Debug, Args)]
pub struct ScopeArgs {
    /// Tenant of the record.
    #[arg(long)]
    pub tenant: String,
    /// `*` when the policy has no principal.
    #[arg(long, default_value = "*")]
    pub principal: String,
    /// The policy name, e.g. payments.create.
    #[arg(long)]
    pub route: String,
    /// `u` (client keys) or `s` (server keys).
    #[arg(long, default_value = "u")]
    pub namespace: String,
    /// The Idempotency-Key, unquoted.
    #[arg(long)]
    pub key: String,
}

#[derive(Debug, Args)]
pub struct Resolve {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Complete the record with this status.
    #[arg(long, conflicts_with = "release", required_unless_present = "release")]
    pub status: Option<u16>,
    /// A response header as NAME:VALUE (repeatable).
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// The response body.
    #[arg(long, default_value = "")]
    pub body: String,
    /// Release the record instead, so the key can be claimed again.
    #[arg(long)]
    pub release: bool,
    #[command(flatten)]
    pub change: Change,
}

impl ScopeArgs {
    pub fn scope(&self) -> Result<Scope, String> {
        crate::admin::scope_of(
            &self.tenant,
            &self.principal,
            &self.route,
            &self.namespace,
            &self.key,
        )
    }
}

fn read_token(value: &Option<String>, file: &Option<PathBuf>, what: &str) -> Result<String, String> {
    let token = match (value, file) {
        (Some(v), _) => v.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the {what} file {}: {e}", path.display()))?
            .trim_end_matches(['\r', '\n'])
            .to_string(),
        (None, None) => {
            let flag = what.replace(' ', "-");
            return Err(format!(
                "no {what}: pass --{flag} or --{flag}-file, or set IDEMGATE_{}",
                what.replace(' ', "_").to_uppercase()
            ));
        }
    };
    if token.is_empty() {
        return Err(format!("the {what} is empty"));
    }
    Ok(token)
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), String> {
    let s = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    println!("{s}");
    Ok(())
}

/// What a command may do to the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Schema {
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

/// The backend at `url`, its schema checked (or migrated) as `schema` says.
/// On PostgreSQL only `migrate` (or `serve --migrate`) issues DDL, so the
/// other commands run under roles without DDL rights.
async fn open(
    url: &str,
    opts: BackendOptions,
    session: PgSession,
    schema: Schema,
) -> crate::backend::Result<std::sync::Arc<dyn Backend>> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let log_ids = match opts.log_ids {
            Some(ids) => ids,
            None => LogIds::random().map_err(StoreError::Config)?,
        };
        let pool_size = opts.pg_pool_size.unwrap_or(16);
        let pg = Postgres::connect_with(url, pool_size, opts.pg_timeouts, session, log_ids, opts.seal)?;
        match schema {
            Schema::Migrate => pg.migrate().await?,
            Schema::Verify | Schema::Untouched | Schema::ReadOnly => pg.require_current_schema().await?,
        }
        return Ok(std::sync::Arc::new(pg));
    }
    let backend = open_backend(url, &opts).await?;
    if matches!(schema, Schema::Migrate | Schema::Verify) {
        backend.migrate().await?;
    }
    Ok(backend)
}

/// Runs a parsed command line; errors are messages for the operator.
pub async fn execute(cli: Cli) -> Result<(), String> {
    let admin = match (&cli.admin_token, &cli.admin_token_file) {
        (None, None) => None,
        _ => Some(read_token(
            &cli.admin_token,
            &cli.admin_token_file,
            "admin token",
        )?),
    };
    let log_ids = match (&cli.log_key_file, &admin) {
        (Some(path), _) => LogIds::from_file(path)?,
        (None, Some(admin)) => LogIds::from_admin_credential(admin)?,
        // `serve` refuses to start without an admin credential; the other
        // commands then print ids that match no log line.
        (None, None) => LogIds::random()?,
    };
    let opts = BackendOptions {
        sqlite_synchronous_full: Some(matches!(cli.sqlite_synchronous, Synchronous::Full)),
        pg_pool_size: Some(cli.pg_pool_size),
        log_ids: Some(log_ids),
        seal: match &cli.response_key_file {
            Some(path) => Seal::from_file(path)?,
            None => Seal::off(),
        },
        pg_timeouts: PgTimeouts {
            wait: Duration::from_millis(cli.pg_wait_timeout_ms.max(1)),
            connect: Duration::from_millis(cli.pg_connect_timeout_ms.max(1)),
            recycle: Duration::from_millis(cli.pg_recycle_timeout_ms.max(1)),
            statement: Duration::from_millis(cli.pg_statement_timeout_ms.max(1)),
        },
    };
    let sealing = opts.seal.current_id().map(str::to_string);
    let database_url = match &cli.database_url_file {
        Some(path) => read_token(&None, &Some(path.clone()), "database url")?,
        None => cli.database_url.clone(),
    };
    let schema = match &cli.command {
        Command::Migrate => Schema::Migrate,
        Command::Serve(s) if s.migrate => Schema::Migrate,
        Command::Serve(s) if s.no_migrate => Schema::Untouched,
        Command::Inspect(_) => Schema::ReadOnly,
        _ => Schema::Verify,
    };
    let session = PgSession {
        pooler: match cli.pg_pooler {
            PgPooler::Session => Pooler::Session,
            PgPooler::Transaction => Pooler::Transaction,
        },
        read_only: schema == Schema::ReadOnly,
    };
    let backend = open(&database_url, opts, session, schema)
        .await
        .map_err(|e| e.to_string())?;
    let clock = Clock::follow(&backend).await.map_err(|e| e.to_string())?;
    let store = Store::new(backend, clock);
    let now = store.clock.now();
    match cli.command {
        Command::Migrate => {
            tracing::info!(database = %crate::backend::redact_url(&database_url), "migrations applied");
            Ok(())
        }
        Command::Serve(s) => {
            match &sealing {
                Some(id) => tracing::info!(key = %id, "stored responses are sealed (AES-256-GCM)"),
                None => tracing::warn!(
                    "stored responses are kept in plaintext: pass --response-key-file to seal them at rest"
                ),
            }
            serve(store, s, admin, &database_url).await
        }
        Command::Inspect(i) => {
            if cli.log_key_file.is_none() && admin.is_none() {
                eprintln!(
                    "idempotency-store: no --log-key-file or admin credential: the log_id values printed match no log line"
                );
            }
            let listing = if i.unknown {
                store.list(Listing::Unknown, i.limit).await
            } else if i.stuck {
                store
                    .list(
                        Listing::Stuck {
                            older_than_ms: i.older_than_ms,
                        },
                        i.limit,
                    )
                    .await
            } else {
                // Every generation and event of the key.
                let lookup = Lookup {
                    tenant: i.tenant.unwrap_or_default(),
                    key: i.key.unwrap_or_default(),
                    route: i.route,
                    principal: i.principal,
                    namespace: None,
                };
                let history = store.lookup(&lookup, i.limit).await.map_err(|e| e.to_string())?;
                return print_json(&history);
            }
            .map_err(|e| e.to_string())?;
            print_json(&listing)
        }
        Command::Resolve(r) => {
            let scope = r.scope.scope()?;
            let (operator, reason) = r.change.checked()?;
            let how = match r.status {
                Some(status) if !r.release => {
                    let headers = r
                        .headers
                        .iter()
                        .map(|h| crate::admin::parse_header(h).map_err(|e| format!("--{e}")))
                        .collect::<Result<Vec<_>, _>>()?;
                    crate::api::validate_response(status, &headers)?;
                    Action::Complete {
                        status,
                        headers,
                        body: r.body,
                    }
                }
                _ => Action::Release,
            };
            let how = Resolution {
                action: how,
                by: operator.as_str().to_string(),
            };
            let changed = store
                .backend
                .resolve(&scope, &how, Some(reason), now)
                .await
                .map_err(|e| e.to_string())?;
            if !changed {
                return Err("no in-progress or unknown record with this scope".into());
            }
            print_json(&crate::admin::Changed { changed })
        }
        Command::Purge(p) => {
            let scope = p.scope.scope()?;
            let (operator, reason) = p.change.checked()?;
            let how = Resolution {
                action: Action::Purge,
                by: operator.as_str().to_string(),
            };
            let changed = store
                .backend
                .resolve(&scope, &how, Some(reason), now)
                .await
                .map_err(|e| e.to_string())?;
            if !changed {
                return Err("no record with this scope".into());
            }
            print_json(&crate::admin::Changed { changed })
        }
        Command::Sweep(a) => {
            let policy = SweepPolicy {
                batch: a.sweep_batch.max(1),
                audit_retention_ms: a.audit_retention_secs.saturating_mul(1000),
            };
            let mut total = crate::backend::SweepReport::default();
            loop {
                let report = crate::sweeper::sweep_all(&store, &policy)
                    .await
                    .map_err(|e| e.to_string())?;
                total.add(report);
                if report.total() == 0 {
                    break;
                }
            }
            print_json(&total)
        }
    }
}

async fn serve(store: Store, s: Serve, admin: Option<String>, url: &str) -> Result<(), String> {
    let api = read_token(&s.api_token, &s.api_token_file, "api token")?;
    let admin = match admin {
        Some(admin) => admin,
        None => read_token(&None, &None, "admin token")?,
    };
    if api == admin {
        return Err("the API and admin tokens must differ".into());
    }
    let next = match (&s.api_token_next, &s.api_token_next_file) {
        (None, None) => None,
        _ => Some(read_token(
            &s.api_token_next,
            &s.api_token_next_file,
            "api token next",
        )?),
    };
    if next.as_ref() == Some(&admin) {
        return Err("the next API token must differ from the admin token".into());
    }
    let store = match s.tenant_new_keys_per_sec {
        None => store,
        Some(rate) => {
            // One second's worth, at least 1 (the cast saturates).
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let burst = s
                .tenant_new_keys_burst
                .unwrap_or_else(|| (rate.ceil() as u32).max(1));
            let budgets = Budgets::new(rate, burst).map_err(|e| format!("--tenant-new-keys-per-sec: {e}"))?;
            tracing::info!(rate, burst, "new keys per tenant are limited (in this replica)");
            store.with_budgets(budgets)
        }
    };
    let sweep = SweepSettings {
        enabled: !s.no_sweeper,
        interval: Duration::from_millis(s.sweep_interval_ms.max(10)),
        batch: s.sweep.sweep_batch.max(1),
        audit_retention_ms: s.sweep.audit_retention_secs.saturating_mul(1000),
    };
    let cannot = |e: std::io::Error| format!("cannot listen on {}: {e}", s.listen);
    tracing::info!(backend = store.backend.name(), database = %crate::backend::redact_url(url), "database ready");
    let operators = s.operators.source()?;
    if !operators.configured() {
        tracing::warn!(
            "no trusted authenticating proxy (--operator-trusted-peers, --operator-proxy-secret-file): \
             the console opens no session and the admin API changes no record"
        );
    }
    let idle = Duration::from_secs(s.operators.console_idle_minutes.max(1).saturating_mul(60));
    let console = crate::console::ConsoleSettings {
        enabled: !s.no_console,
        secure_cookies: s.console_secure_cookies,
        operators,
        idle,
    };
    let mut state =
        crate::AppState::with(store, &api, &admin, s.doc_base, s.max_body_bytes, sweep).with_console(console);
    if let Some(next) = &next {
        state = state.with_next_api_token(next);
    }
    let admin = match &s.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?,
        ),
        None => None,
    };
    let served = match s.listen.strip_prefix("unix:") {
        // Envoy on the same host reaches it through a `pipe` address: no
        // TCP stack between them.
        Some(path) => {
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(cannot)?;
            crate::run(listener, admin, state, shutdown_signal()).await
        }
        None => {
            let listener = tokio::net::TcpListener::bind(&s.listen).await.map_err(cannot)?;
            crate::run(listener, admin, state, shutdown_signal()).await
        }
    };
    served.map_err(|e| e.to_string())
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
