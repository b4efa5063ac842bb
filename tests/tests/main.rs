//! The end-to-end suites, one module per file, in one test binary:
//! `cargo test -p e2e --test main -- <module>::` runs one suite (a filter
//! matches any part of `module::test_name`).

mod chaos;
mod config_schema;
mod console;
mod detached;
mod drain;
mod e2e;
mod failover;
mod growth;
mod grpc;
mod lifecycle;
mod lost_claims;
mod mixed_versions;
mod patroni;
mod pgbouncer;
mod prometheus;
mod protocol_edges;
mod reload;
mod router_headers;
mod sdks;
mod security;
mod storage_faults;
mod unix_socket;

/// One chaos or failover run at a time: they share two cores, and their
/// timing matters.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
