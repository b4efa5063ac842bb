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

/// A port nobody listens on right now, below the kernel's ephemeral range,
/// reserved for this process until it exits or [`release`]s it.
pub fn free_port() -> u16 {
    // A port is free only until someone binds it. One the kernel hands out
    // for port 0 comes from its ephemeral range, where it also picks the
    // local port of every outgoing connection (a client of the stack, a
    // browser): one of those could take the port before the process it was
    // meant for binds it. Ports below that range are only ever bound on
    // purpose, but by any process: two test binaries (or a test and a
    // script's stack) picking at once could both find a port free before
    // either's child binds it, and one Envoy's callouts would then reach the
    // other's store. So a port is handed out only with a reservation: a Unix
    // socket in the abstract namespace named after it, bound by this process
    // and held until it exits (the kernel drops it even on SIGKILL) or
    // releases the port. A
    // network namespace shares both its ports and that namespace, and a
    // second bind of one name fails, so no two processes ever hold one port,
    // including while a child is restarted on it.
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let ports = below_ephemeral();
    loop {
        let port = fastrand::u16(ports.clone());
        let Some(reservation) = reserve(port) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            held.push((port, reservation));
            return port;
        }
    }
}

/// The reservations [`free_port`] holds, each with its port.
static HELD: std::sync::Mutex<Vec<(u16, std::os::unix::net::UnixListener)>> =
    std::sync::Mutex::new(Vec::new());

/// Gives up the reservation of `port` (if this process holds it), once
/// nothing of this process will bind it again: a test binary that runs
/// hundreds of stacks would otherwise keep a descriptor for each port.
pub fn release(port: u16) {
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    held.retain(|(p, _)| *p != port);
}

/// The reservation of `port`, unless another process (or this one) holds it.
fn reserve(port: u16) -> Option<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("idemgate-port-{port}");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?;
    std::os::unix::net::UnixListener::bind_addr(&addr).ok()
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
