//! What an Envoy worker's filter does with the core's machines, over any
//! [`Host`]: Envoy's host calls in the module (`src/host.rs`), the
//! simulated Envoy's in `crates/simulation`, so that both run this code.
//!
//! A [`Worker`] is what every request on one worker's VM shares: the
//! [`metrics`], the store client ([`client`]: the core's group-committing
//! queue for the requests' claims and settlements, and its letters for calls
//! that outlive a request), and every request's [`driver`], which carries
//! out the steps of its [`idemgate_core::exchange::Exchange`] (and outlives
//! the client of a detached one). A [`Filter`] is one request's context: it
//! reads the request for its exchange. Nothing here decides a rule of the
//! contract: the core does.

// The map above links private modules: the docs are built with
// `--document-private-items` (`make lint`).
#![allow(rustdoc::private_intra_doc_links)]

mod client;
mod driver;
mod filter;
pub mod host;
pub mod metrics;
mod worker;

pub use filter::Filter;
pub use host::{Action, Host, Level};
pub use worker::Worker;
