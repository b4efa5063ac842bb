//! The end-to-end suites, one module per file, in one test binary:
//! `cargo test -p e2e --test main -- <module>::` runs one suite (a filter
//! matches any part of `module::test_name`).

/// Exactly-once under store kills, stalls, Envoy restarts and upstream resets, audited.
mod chaos;
/// The published JSON Schema of the filter's configuration is the generated one.
mod config_schema;
/// The reconciliation console in a real browser, signed in through the authenticating proxy.
mod console;
/// Detached forwarding: a client that stops waiting still has its result recorded.
mod detached;
/// A pod stop with a sidecar while a detached request runs; what a worker holds meanwhile.
mod drain;
/// One test per row of the contract's answer table and stored outcomes.
mod e2e;
/// PostgreSQL failover to a hot standby under traffic, through one multi-host URL.
mod failover;
/// The growth soak on millions of records (`make soak`).
mod growth;
/// gRPC unary calls between a real grpcio server and client.
mod grpc;
/// Requests caught by client resets, Envoy drains, stops and hot restarts.
mod lifecycle;
/// A claim whose answer is lost never burns the key.
mod lost_claims;
/// Callers named by their mTLS identity, each on its own policies, behind the store's sidecar.
mod mesh;
/// The previous release's filter or store beside this build's.
mod mixed_versions;
/// Automatic failover under Patroni and etcd (`make chaos`).
mod patroni;
/// The chaos traffic behind PgBouncer in transaction mode, PgBouncer restarted (`make chaos`).
mod pgbouncer;
/// The alert rules and dashboard against a real Prometheus scraping a running stack.
mod prometheus;
/// h2c clients with request trailers, and bodies with no length.
mod protocol_edges;
/// A configuration push while work is in flight.
mod reload;
/// The router-steering headers of internal callers never reach the upstream twice.
mod router_headers;
/// Real SDKs from PyPI retrying with their own keys against the demo.
mod sdks;
/// Tenant isolation, forged identities, the store's credentials, hostile clients.
mod security;
/// The store's disk fills up mid-traffic and recovers.
mod storage_faults;
/// The store on a Unix socket, reached through a `pipe` address.
mod unix_socket;

/// One chaos or failover run at a time: they share two cores, and their
/// timing matters.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
