//! The fault loop: store replicas killed and restarted or frozen, Envoy
//! restarted, upstream connections reset, each with its time window.

use std::time::{Duration, Instant};

use super::{now_ms, seed, Rng};
use crate::stack::Stack;

/// What the fault loop did.
#[derive(Debug, Default, Clone)]
pub struct Faults {
    pub store_kills: u64,
    /// A replica frozen (SIGSTOP) past the filter's 1 s store timeout, then
    /// let run again (SIGCONT): a slow store rather than a dead one.
    pub store_stalls: u64,
    pub envoy_restarts: u64,
    pub upstream_resets: u64,
    /// Connections dropped by those resets.
    pub connections_reset: u64,
    /// Every fault with its start and end (ms since the Unix epoch), to tell
    /// which fault a finding of the audit follows.
    pub windows: Vec<(&'static str, i64, i64)>,
}

impl Faults {
    pub fn summary(&self) -> String {
        format!(
            "{} store SIGKILLs, {} store stalls (SIGSTOP {STALL_MS} ms), {} Envoy restarts, \
             {} upstream resets ({} connections)",
            self.store_kills,
            self.store_stalls,
            self.envoy_restarts,
            self.upstream_resets,
            self.connections_reset
        )
    }

    /// The fault that left a generation claimed at `at` unknown without its
    /// upstream running, as the contract says it must (§5): Envoy killed, or
    /// the upstream connections reset, while the request was in flight (at
    /// most the route's timeout after the claim). Neither the filter nor the
    /// store can tell then whether the upstream read the request. A claim
    /// Envoy sent just before it died may reach the store after the signal:
    /// the store commits it up to the filter's store timeout later, while
    /// Envoy is still down.
    pub fn left_unknown_by_contract(&self, at: i64) -> Option<&'static str> {
        self.windows
            .iter()
            .find(|(name, from, to)| {
                let sent_before = match *name {
                    "Envoy SIGKILL" => at < *to && at <= from + STORE_TIMEOUT_MS,
                    "upstream reset" => at <= *from,
                    _ => false,
                };
                sent_before && *from - at <= ROUTE_TIMEOUT_MS
            })
            .map(|(name, _, _)| *name)
    }

    /// The fault nearest to `at` (ms since the Unix epoch), for a finding.
    pub fn near(&self, at: i64) -> String {
        let distance = |(_, from, to): &&(&'static str, i64, i64)| {
            if at < *from {
                from - at
            } else {
                (at - to).max(0)
            }
        };
        match self.windows.iter().min_by_key(distance) {
            Some(w @ (name, from, to)) => format!(
                "{} ms from a {name} ({} ms long, {} ms {})",
                distance(&w),
                to - from,
                (at - from).abs(),
                if at < *from {
                    "before it began"
                } else {
                    "after it began"
                }
            ),
            None => "no fault injected".into(),
        }
    }
}

/// The covered routes' timeout in envoy/chaos.yaml.
const ROUTE_TIMEOUT_MS: i64 = 10_000;

/// The filter's store timeout in envoy/chaos.yaml.
const STORE_TIMEOUT_MS: i64 = 1_000;

/// How long a stalled replica stays frozen: past the filter's 1 s store
/// timeout (envoy/chaos.yaml), so claims it committed are never answered in
/// time.
pub const STALL_MS: u64 = 1_500;

/// Injects faults in rotation until `deadline`, leaving everything running.
pub async fn inject_faults(stack: &mut Stack, deadline: Instant, every: Duration) -> Faults {
    let mut faults = Faults::default();
    let mut rng = Rng::new(seed());
    let replicas = stack.stores.len();
    let mut step = 0usize;
    while Instant::now() + every < deadline {
        tokio::time::sleep(every).await;
        // Alternate replicas; with one, always the same.
        let r = step % replicas;
        let from = now_ms();
        let name = match step % 5 {
            0 => {
                stack.kill_store(r);
                faults.store_kills += 1;
                tokio::time::sleep(Duration::from_millis(300 + rng.below(1_200))).await;
                stack.start_store(r);
                stack.wait_store(r).await;
                "store SIGKILL"
            }
            1 | 4 => {
                stack.signal_store(r, true);
                faults.store_stalls += 1;
                tokio::time::sleep(Duration::from_millis(STALL_MS)).await;
                stack.signal_store(r, false);
                "store stall"
            }
            2 => {
                faults.upstream_resets += 1;
                faults.connections_reset += stack.upstream.reset_connections() as u64;
                "upstream reset"
            }
            _ => {
                stack.kill_envoy();
                faults.envoy_restarts += 1;
                tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
                stack.start_envoy();
                stack.wait_envoy().await;
                "Envoy SIGKILL"
            }
        };
        faults.windows.push((name, from, now_ms()));
        step += 1;
    }
    faults
}
