//! Integration tests of the store: one binary (ripgrep style).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

/// Consistent backups while the store serves, and restores from them.
mod backup;
/// Who may call the API: token files re-read, mesh identities and their policies.
mod callers;
/// The operator's CLI against a real database file.
mod cli;
/// Replicas judge leases by the database's clock, whatever their own say.
mod clock;
/// Concurrent claims of one tuple: exactly one owner, on every backend.
mod concurrency;
/// The console in-process, as a browser behind the authenticating proxy uses it.
mod console;
/// The binary killed between claim and completion, restarted on the same database.
mod crash;
/// The database stops answering, refuses, drops connections or restarts.
mod faults;
/// The HTTP API in-process: auth, bad input, every endpoint's wire shape.
mod http;
/// The store's modules form layers: no cycle between them.
mod layers;
/// Records named in logs by a keyed hash, the same one the admin API shows.
mod log_ids;
/// The metrics an outage shows.
mod metrics;
/// Existing databases migrate in place.
mod migration;
/// The store behind PgBouncer in transaction mode.
mod pgbouncer;
/// PostgreSQL's query plans for the store's statements, whatever the planner estimates.
mod query_plans;
/// The budget of new keys per tenant, through the HTTP API.
mod rate_limit;
/// PostgreSQL roles as docs/operations.md sets them up.
mod roles;
/// Stored responses sealed at rest, read back from the database's own files.
mod sealing;
/// The story suite, written once and run against every backend.
mod stories;
/// What the other modules share: backends, clusters, requests.
mod support;
/// The sweeper's phases stand alone.
mod sweeper;
/// PostgreSQL over TLS, as managed databases require it.
mod tls;
