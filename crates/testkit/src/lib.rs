//! Test support shared by the store's tests, the end-to-end tests, the fuzz
//! oracle and the core's layering test: free ports, throwaway PostgreSQL
//! clusters and PgBouncers in front of them, processes that keep their
//! output for a failing test, the store's command line, waiting for a
//! condition, the internals that must never reach a client, a small tmpfs
//! for disk-full tests, the rows runs write into docs/reliability.md, and a
//! crate's module graph for the tests that keep its modules in layers.

// Test support: failing loudly is how it reports a broken environment.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

pub mod internals;
pub mod layers;
pub mod patroni;
pub mod pg;
pub mod pgbouncer;
pub mod process;
pub mod report;
pub mod store;
pub mod tmpfs;
pub mod wait;

pub use internals::INTERNALS;
pub use process::Proc;
pub use wait::{eventually, poll};

/// A port nobody listens on right now, below the kernel's ephemeral range.
pub fn free_port() -> u16 {
    // A port is free only until someone binds it. One the kernel hands out
    // for port 0 comes from its ephemeral range, where it also picks the
    // local port of every outgoing connection (a client of the stack, a
    // browser): one of those could take the port before the process it was
    // meant for binds it. Ports below that range are only ever bound on
    // purpose. Never hand out one port twice in a test process.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let ports = below_ephemeral();
    loop {
        let port = fastrand::u16(ports.clone());
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            return port;
        }
    }
}

/// The 16,384 ports (or as many as there are above 1023) just below the
/// kernel's ephemeral range (`ip_local_port_range`, 32768–60999 by default).
fn below_ephemeral() -> std::ops::Range<u16> {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = start.saturating_sub(16384).max(1024);
    assert!(
        start > low,
        "no ports below the ephemeral range starting at {start}"
    );
    low..start
}
