//! The one-shot commands: `migrate`, `inspect`, `resolve`, `purge`, `sweep`.
//! Each prints its result as JSON on standard output.

use idemgate_core::scope::Scope;

use super::args::{Change, Inspect, Purge, Resolve, ScopeArgs, SweepArgs};
use super::settings::sweep_policy;
use super::CliError;
use crate::auth::Operator;
use crate::backend::{Action, Listing, Lookup, Resolution, SweepReport};
use crate::service::Store;

pub fn migrate(database_url: &str) -> Result<(), CliError> {
    tracing::info!(database = %crate::database_url::redact_url(database_url), "migrations applied");
    Ok(())
}

/// `log_ids_match_logs`: whether the ids printed are those the logs use.
pub async fn inspect(store: &Store, i: Inspect, log_ids_match_logs: bool) -> Result<(), CliError> {
    if !log_ids_match_logs {
        eprintln!(
            "idempotency-store: no --log-key-file or admin credential: the log_id values printed match no log line"
        );
    }
    if i.unknown {
        let listing = store.list(Listing::Unknown, i.limit).await?;
        return print_json(&listing);
    }
    if i.stuck {
        let stuck = Listing::Stuck {
            older_than_ms: i.older_than_ms,
        };
        let listing = store.list(stuck, i.limit).await?;
        return print_json(&listing);
    }
    // Every generation and event of the key.
    let lookup = Lookup {
        tenant: i.tenant.unwrap_or_default(),
        key: i.key.unwrap_or_default(),
        route: i.route,
        principal: i.principal,
        namespace: None,
    };
    let history = store.lookup(&lookup, i.limit).await?;
    print_json(&history)
}

pub async fn resolve(store: &Store, r: Resolve) -> Result<(), CliError> {
    let scope = scope(&r.scope)?;
    let (operator, reason) = checked(&r.change)?;
    let action = match r.status {
        Some(status) if !r.release => {
            let headers = (r.headers.iter())
                .map(|h| crate::admin::parse_header(h).map_err(|e| CliError::Invalid(format!("--{e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            idemgate_core::limits::response_fits(status, &headers).map_err(CliError::Invalid)?;
            Action::Complete {
                status,
                headers,
                body: r.body,
            }
        }
        _ => Action::Release,
    };
    change(
        store,
        &scope,
        action,
        &operator,
        reason,
        "in-progress or unknown record",
    )
    .await
}

pub async fn purge(store: &Store, p: Purge) -> Result<(), CliError> {
    let scope = scope(&p.scope)?;
    let (operator, reason) = checked(&p.change)?;
    change(store, &scope, Action::Purge, &operator, reason, "record").await
}

/// Sweeps until a pass finds nothing left to do.
pub async fn sweep(store: &Store, args: &SweepArgs) -> Result<(), CliError> {
    let policy = sweep_policy(args);
    let mut total = SweepReport::default();
    loop {
        let report = crate::sweeper::sweep_all(store, &policy).await?;
        total.add(report);
        if report.total() == 0 {
            break;
        }
    }
    print_json(&total)?;
    match total.failed_phases {
        0 => Ok(()),
        failed => Err(CliError::SweepIncomplete { failed }),
    }
}

/// Carries out an operator's change; `what` names the records it applies
/// to, for the refusal when there is none.
async fn change(
    store: &Store,
    scope: &Scope,
    action: Action,
    operator: &Operator,
    reason: &str,
    what: &'static str,
) -> Result<(), CliError> {
    let how = Resolution {
        action,
        by: operator.actor(),
    };
    let now = store.clock.now();
    let changed = store.backend.resolve(scope, &how, Some(reason), now).await?;
    if !changed {
        return Err(CliError::NoRecord { what });
    }
    print_json(&crate::admin::Changed { changed })
}

fn scope(args: &ScopeArgs) -> Result<Scope, CliError> {
    crate::admin::scope_of(
        &args.tenant,
        &args.principal,
        &args.route,
        &args.namespace,
        &args.key,
    )
    .map_err(CliError::Invalid)
}

/// The operator and the reason, or why the change is refused: nobody
/// changes a record without saying who and why.
fn checked(change: &Change) -> Result<(Operator, &str), CliError> {
    let actor = change.actor.as_deref().ok_or_else(|| {
        CliError::Invalid(
            "--actor is required: name yourself, the history records who made the change".into(),
        )
    })?;
    let operator = Operator::declared(actor).map_err(|e| CliError::flag("actor", e))?;
    let reason =
        crate::admin::required_reason(change.reason.as_deref()).map_err(|e| CliError::flag("reason", e))?;
    Ok((operator, reason))
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<(), CliError> {
    let s = serde_json::to_string_pretty(v).map_err(CliError::Output)?;
    println!("{s}");
    Ok(())
}
