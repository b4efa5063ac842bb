//! The idemgate Envoy filter: proxy-wasm's entry points over
//! `idemgate_worker`, which does what a worker's filter does with
//! `idemgate_core`'s machines over any host.
//!
//! [`root`] parses the plugin configuration, sets up what the worker's
//! requests share ([`idemgate_worker::Worker`]), and drains it when Envoy
//! lets the configuration go; [`filter`] hands each request callback to the
//! request's [`idemgate_worker::Filter`]. [`host`] is the worker's host on
//! Envoy and the only module that talks to Envoy, and it handles every host
//! error instead of unwrapping it (an unwrap here would kill the VM for
//! every request on the worker).

// The map above links private modules: the docs are built with
// `--document-private-items` (`make lint`).
#![allow(rustdoc::private_intra_doc_links)]

#[cfg(feature = "fault-injection")]
mod fault;
mod filter;
mod host;
mod root;

proxy_wasm::main! {{
    // Also installs a panic hook that logs at Critical.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}
