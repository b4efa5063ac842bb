//! Command line: `serve`, `migrate`, `inspect`, `resolve`, `purge`, `sweep`.
//!
//! [`args`] is what the operator types, [`settings`] what it adds up to
//! (every rule between flags, checked before use), `serve` and `commands`
//! what runs.

pub mod args;
mod commands;
mod error;
mod serve;
pub mod settings;

use std::sync::Arc;

pub use args::{Cli, Command, LogFormat};
pub use error::CliError;
pub use serve::shutdown_signal;

use crate::backend::{Backend, StoreError};
use crate::clock::Clock;
use crate::database_url::{open_backend, BackendOptions};
use crate::log_ids::LogIds;
use crate::postgres::{PgSession, Postgres};
use crate::service::Store;
use settings::{Global, Schema};

/// Runs a parsed command line.
pub async fn execute(cli: Cli) -> Result<(), CliError> {
    let global = Global::try_from(&cli)?;
    let sealing = global.options.seal.current_id().map(str::to_string);
    let backend = open(
        &global.database_url,
        global.options,
        global.session,
        global.schema,
    )
    .await?;
    let clock = Clock::follow(&backend).await?;
    let store = Store::new(backend, clock);
    match cli.command {
        Command::Migrate => commands::migrate(&global.database_url),
        Command::Serve(args) => {
            serve::serve(
                store,
                &args,
                global.admin,
                &global.database_url,
                sealing.as_deref(),
            )
            .await
        }
        Command::Inspect(i) => commands::inspect(&store, i, global.log_ids_match_logs).await,
        Command::Resolve(r) => commands::resolve(&store, r).await,
        Command::Purge(p) => commands::purge(&store, p).await,
        Command::Sweep(a) => commands::sweep(&store, &a).await,
    }
}

/// The backend at `url`, its schema checked (or migrated) as `schema` says.
/// On PostgreSQL only `migrate` (or `serve --migrate`) issues DDL, so the
/// other commands run under roles without DDL rights.
async fn open(
    url: &str,
    opts: BackendOptions,
    session: PgSession,
    schema: Schema,
) -> crate::backend::Result<Arc<dyn Backend>> {
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
        return Ok(Arc::new(pg));
    }
    let backend = open_backend(url, &opts).await?;
    if matches!(schema, Schema::Migrate | Schema::Verify) {
        backend.migrate().await?;
    }
    Ok(backend)
}
