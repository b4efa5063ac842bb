//! Fault injection for the tests of Envoy's `failure_policy`: a module built
//! with the `fault-injection` feature kills its own VM where a request asks
//! it to, as a bug in the filter would (`x-idemgate-fault: request` before
//! anything is claimed, `response` once the request owns its key and the
//! upstream has answered). The shipped module never contains this.

use idemgate_worker::Host;

use crate::host::Envoy;

const HEADER: &str = "x-idemgate-fault";

/// Whether the request asks for the VM to fail at `phase`.
pub fn asked(phase: &str) -> bool {
    Envoy.request_header(HEADER).as_deref() == Some(phase.as_bytes())
}

/// Traps, which fails the VM of this worker: Envoy's `failure_policy`
/// decides what happens next.
pub fn fail_vm() -> ! {
    std::process::abort()
}
