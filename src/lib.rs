//! The idemgate Envoy filter: thin proxy-wasm glue over `idemgate_core`.
//!
//! [`root`] parses the plugin configuration and owns the metrics and the
//! [`outbox`], the store client for calls that outlive a request; [`http`]
//! reads a request for its [`idemgate_core::exchange::Exchange`], whose steps
//! [`carrier`] carries out (handed to the root when the client leaves a
//! detached exchange);
//! [`host`] is the only module that talks to Envoy, and it handles every host
//! error instead of unwrapping it (an unwrap here would kill the VM for every
//! request on the worker).

mod carrier;
mod host;
mod http;
mod outbox;
mod root;

proxy_wasm::main! {{
    // Also installs a panic hook that logs at Critical.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}
