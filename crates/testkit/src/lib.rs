//! Test support shared by the store's tests and the end-to-end tests.

// Test support: failing loudly is how it reports a broken environment.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

pub mod pg;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}
