//! The idemgate Envoy filter: thin proxy-wasm glue over `idemgate_core`.
//!
//! [`root`] parses the plugin configuration and sets up what the worker's
//! requests share ([`worker`]): the [`metrics`], the store [`client`] (the
//! core's group-committing queue for their claims and settlements, and its
//! letters for calls that outlive a request), and every request's
//! [`driver`], which carries out the steps of its
//! [`idemgate_core::exchange::Exchange`] (and outlives the client of a
//! detached one). [`filter`] reads a request for its exchange;
//! [`host`] is the only module that talks to Envoy, and it handles every host
//! error instead of unwrapping it (an unwrap here would kill the VM for every
//! request on the worker).

// The map above links private modules: the docs are built with
// `--document-private-items` (`make lint`).
#![allow(rustdoc::private_intra_doc_links)]

mod client;
mod driver;
#[cfg(feature = "fault-injection")]
mod fault;
mod filter;
mod host;
mod metrics;
mod root;
mod worker;

proxy_wasm::main! {{
    // Also installs a panic hook that logs at Critical.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}
