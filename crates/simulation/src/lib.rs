//! The filter's machines and the store's own service, simulated together:
//! many requests on Envoy's workers against the store's real HTTP app over
//! its in-memory database, through a network that loses, delays, repeats
//! and refuses (the store, or something in front of it), with clients that
//! leave at any moment, an upstream that is slow or cut off, a store that
//! restarts, a database that is slow, and a store clock that steps back;
//! on HTTP routes and on a gRPC method, whose replays go through Envoy's
//! router to the store's replay route.
//! Both ends are the real code, as in quinn-proto's `Pair`: the filter's
//! worker (`idemgate-worker`: its requests' contexts, drivers and store
//! client, with the exchanges of `idemgate-core`), and the store's routes,
//! service (waits, the budget of new keys, late claims), effects and
//! events of `idemgate-store`. Only Envoy's part is written again here: the
//! worker's host ([`world`]'s `envoy.rs`) and the request callbacks as
//! Envoy makes them.
//!
//! Deterministic: a scenario always runs the same way, and after each the
//! audit checks the contract's promises on what the clients got and on the
//! store's own history and events.
//!
//! # Layout
//!
//! - [`scenario`]: what a case is (seed, knobs, faults), drawn or written out.
//! - [`rng`]: seeded chance, one stream per knob, fault and source.
//! - [`world`]: Envoy and its workers, clients, network and upstream.
//! - [`far`]: the store's app, driven by the world's hand on paused time.
//! - [`database`]: the in-memory database, with the world's tap on it.
//! - [`audit`]: the promises, checked.
//! - [`run`]: one scenario, many, and the tally of a run.
//! - [`regressions`]: the scenarios that found defects, kept.
//!
//! `tests/fixed.rs` runs a fixed set (`make check`, `make test`);
//! `src/bin/explore.rs` runs new ones for as long as it is given (`make
//! explore`), or one with all that happens in it (`--case`, with
//! `SIMULATION_TRACE=1`).

// The simulation is a test harness: a broken invariant of the world's own
// is a bug of the harness, and a panic that names it is the report.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod audit;
pub mod database;
pub mod far;
pub mod regressions;
pub mod rng;
pub mod run;
pub mod scenario;
pub mod world;
