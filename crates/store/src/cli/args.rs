//! The command line's flags, subcommands and help: what an operator types.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::sweeper::DEFAULT_AUDIT_RETENTION_MS;

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-store",
    version,
    about = "Companion store of the idemgate Envoy filter: claims, leases, fencing tokens, replay, audit"
)]
pub struct Cli {
    /// Where records live: sqlite://FILE (embedded, default) or
    /// postgres://USER:PASSWORD@HOST:PORT/DB (several replicas; the password
    /// may be left out).
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
    Serve(ServeArgs),
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
pub struct ServeArgs {
    /// Address to listen on (`host:port`, or `unix:/path` for a Unix domain
    /// socket that an Envoy on the same host reaches through a `pipe`
    /// address). Repeat it, or separate addresses with commas, to serve the
    /// same on several: a socket for the Envoy beside the store and TCP
    /// for the monitoring. Listen only where the mesh can reach it.
    #[arg(
        long,
        env = "IDEMGATE_LISTEN",
        value_delimiter = ',',
        default_value = "127.0.0.1:8787"
    )]
    pub listen: Vec<String>,
    /// Serve the admin surface (/admin/v1, the console) on this address
    /// instead, and only the API on `--listen`: operators' network path
    /// apart from the mesh's.
    #[arg(long, env = "IDEMGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// Bearer credential of the /v1 API (the filter's `store.token`); not
    /// needed when only mesh identities call it (--mesh-identities-file).
    /// Given here it is fixed until a restart: --api-token-file is re-read.
    #[arg(
        long,
        env = "IDEMGATE_API_TOKEN",
        hide_env_values = true,
        conflicts_with = "api_token_file"
    )]
    pub api_token: Option<String>,
    /// File holding the API credential (trailing newline ignored), read
    /// again every second: a new token there is taken without a restart.
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
    /// File holding the second accepted API credential, read again every
    /// second like --api-token-file; absent or empty: no second one.
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
    /// How log lines are written on standard error: `text`, or `json` (one
    /// object a line, the event's fields at the top level) for a log
    /// pipeline. RUST_LOG still chooses which lines.
    #[arg(long, env = "IDEMGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub operators: OperatorArgs,
    #[command(flatten)]
    pub mesh: MeshArgs,
}

/// Which mesh identities call the API (docs/operations.md#mesh-identities).
#[derive(Debug, Args)]
pub struct MeshArgs {
    /// YAML file mapping each caller's SPIFFE ID to the policies it owns
    /// (`identities: {spiffe://cluster.local/ns/shop/sa/payments:
    /// [payments.create]}`), named by the store's sidecar in
    /// x-forwarded-client-cert. A call on another policy is refused (403).
    #[arg(long, env = "IDEMGATE_MESH_IDENTITIES_FILE", requires = "mesh_trusted_peers")]
    pub mesh_identities_file: Option<PathBuf>,
    /// Peers (IP addresses or CIDR networks, comma-separated) whose
    /// x-forwarded-client-cert is believed: the store's own sidecar only
    /// (127.0.0.6 in Istio). From any other peer the header is refused.
    #[arg(long, env = "IDEMGATE_MESH_TRUSTED_PEERS", value_delimiter = ',')]
    pub mesh_trusted_peers: Vec<String>,
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

/// How `serve` writes its log lines on standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line, the event's fields at the top level.
    Json,
}

impl Cli {
    /// How log lines are written: `serve --log-format`; the other commands
    /// log little and always as text.
    pub fn log_format(&self) -> LogFormat {
        match &self.command {
            Command::Serve(s) => s.log_format,
            _ => LogFormat::Text,
        }
    }
}
