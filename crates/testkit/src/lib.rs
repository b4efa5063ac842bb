//! Test support shared by the store's tests, the end-to-end tests and the
//! fuzz oracle: free ports, throwaway PostgreSQL clusters and PgBouncers in
//! front of them, processes that keep their output for a failing test, the
//! store's command line, waiting for a condition, the internals that must
//! never reach a client, a small tmpfs for disk-full tests, and the rows
//! runs write into docs/reliability.md.

// Test support: failing loudly is how it reports a broken environment.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

pub mod internals;
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

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    // A port is free only until someone binds it, and the kernel may offer
    // the same one again before the process it was meant for has started:
    // never hand out one port twice in a test process.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no free port: {e}"));
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}
