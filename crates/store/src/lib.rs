//! The idemgate store: claims, leases, fencing tokens, replay and audit for
//! the Envoy filter (contract §4–§7, §9).
//!
//! The filter calls `POST /v1/claim` before forwarding a request and
//! `/v1/complete`, `/v1/release` or `/v1/mark-unknown` afterwards, always with
//! the fencing token it got from the claim. Every decision about an existing
//! record is made by the pure rules in [`idemgate_core::record`]; a backend
//! only loads the record and carries the decision out atomically. Where a
//! statement must pick rows in SQL instead (PostgreSQL's one-statement
//! completion, guards, the sweeper), it writes the conditions [`conditions`]
//! builds from those same rules, and rows map to values through one
//! [`row_mapping`], so the SQLite and PostgreSQL backends cannot disagree.
//! Expiry, archiving and purging are a batched background job ([`sweeper`]),
//! never a scan on the request path.
//!
//! Tests start the whole service in a few lines: bind a listener on port 0,
//! build an [`AppState`], and spawn [`run`].

/// An event's columns as operators and the log see it (its generation's
/// scope, attempt and fingerprint with its own), for `concat!`.
macro_rules! event_columns {
    () => {
        "scope_version, tenant, principal, route, namespace, idem_key, generation, at, transition, attempt, fence, \
         fingerprint, status, actor, detail, duration_ms, reason"
    };
}

// The operators' surface (`/admin/v1`): lookups, listings, resolve, purge, sweep.
pub mod admin;
// The filter's API (`/v1`): frames in, frames or JSON out.
pub mod api;
// Who may call which surface: mesh identities, the API's and the admin surface's tokens.
pub mod auth;
// The storage trait every backend implements, and the types of its calls.
pub mod backend;
// The budget of new keys per tenant.
pub mod budget;
// One call of the filter's API, validated, as a backend decides it.
pub mod calls;
// Bearer tokens, compared in constant time; the API's re-read from their files.
pub mod credential;
// The command line: `serve`, `migrate`, `inspect`, `resolve`, `purge`, `sweep`.
pub mod cli;
// The store's clock: the database server's on PostgreSQL, a manual one in tests.
pub mod clock;
// The record rules where a statement must state them in SQL.
pub mod conditions;
// The reconciliation console on the admin surface.
pub mod console;
// The `--database-url`: which backend it opens.
pub mod database_url;
// What every operation does to a record, a claim included, decided once for every backend.
pub mod effects;
// The store's one error type.
pub mod error;
// The gRPC replay route: a stored gRPC response sent back as it came.
mod grpc_replay;
// The addresses the store serves on: TCP or a Unix socket.
pub mod listen;
// How records are named in logs: a keyed hash, never their raw key.
pub mod log_ids;
// The in-memory backend of the simulation and the tests; never storage.
pub mod memory;
// The filter's calls named by their mesh identity, each limited to the policies it owns.
pub mod mesh;
// Prometheus metrics at `/metrics`.
pub mod metrics;
// The OpenAPI document at `/openapi.json`.
pub mod openapi;
// The operator behind an admin request, named by a trusted authenticating proxy.
pub mod operators;
// The peer of a connection: its address, trusted networks, the credential it showed.
pub mod peers;
// PostgreSQL, for several store replicas sharing one database.
pub mod postgres;
// Problem details (RFC 9457) as the HTTP layer's responses.
pub mod problem;
// What the store shows of its records: a record, its events, a key's history.
pub mod records;
// Replay counts, applied off the request path.
mod replay_counts;
// The HTTP surface: every route, which listener serves which, and serving them.
pub mod router;
// The tables' columns and how their rows read into the store's values, once for every backend.
pub mod row_mapping;
// The key of a current record's row.
pub mod scope_digest;
// Stored responses encrypted at rest.
pub mod sealing;
// The statements SQLite and PostgreSQL run word for word, written once; placeholders per dialect.
pub mod shared_statements;
// The store as the HTTP layer sees it: a backend, the clock, waits, budgets, metrics.
pub mod service;
// SQLite, the embedded default.
pub mod sqlite;
// What every request handler shares: the store and the service's settings.
pub mod state;
// The background job: leases, abandoned claims, archiving, purging.
pub mod sweeper;

pub use backend::{Backend, StoreError};
pub use clock::Clock;
pub use database_url::open_backend;
pub use listen::{Listener, Listeners};
pub use router::{app, run, surface, Surface, ROUTES};
pub use service::Store;
pub use state::{AppState, Settings, DEFAULT_MAX_BODY_BYTES, MAX_BODY_BYTES};
