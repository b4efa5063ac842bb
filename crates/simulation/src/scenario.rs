//! What one case of the simulation is: a seed for the world's chances, a
//! policy (the knobs: each one of the contract's choices, and the store's
//! budget of new keys) and the faults. A scenario is drawn from one number,
//! each knob and fault from a stream of its own ([`crate::rng`]), or written
//! out whole (the regression cases, [`crate::regressions`]).

use idemgate_core::client::{Bound, BOUND};
use idemgate_core::config::{Config, Forwarding};
use idemgate_store::budget::Budgets;

use crate::database::loss::{Loss, HORIZON_MS};
use crate::rng::Rng;

mod faults;

pub use faults::Faults;

/// One case: the world's seed, the policy and the faults.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub seed: u64,
    pub knobs: Knobs,
    pub faults: Faults,
}

/// A policy the simulation runs, and how the store is configured.
#[derive(Debug, Clone, PartialEq)]
pub struct Knobs {
    pub detached: bool,
    pub background: bool,
    pub wait: bool,
    pub release_unknown: bool,
    /// Many requests at once with responses of 2.5 to 4 MiB, kept whole:
    /// completions that would not fit one batch together.
    pub large: bool,
    /// Records expire three seconds after completion, within the run.
    pub short_ttl: bool,
    /// Detached forwarding's timeout: mostly half the lease, sometimes all
    /// the lease leaves room for (its length less one store call).
    pub detached_timeout_ms: u64,
    /// Hundreds of new keys at once to a store that is slow but alive, with
    /// queues bounded at 32 calls: the queues must hold their bound.
    pub flood: bool,
    /// The store's budget of new keys (`serve --new-keys-per-second`,
    /// `--new-keys-burst`); `None`: no budget.
    pub new_keys: Option<Budget>,
    /// How often the store's sweeper passes while clients come and go: a
    /// seldom one leaves leases that ran out for claims to find.
    pub sweep_every_ms: i64,
    /// Every latency just inside its timeout, on a network that loses
    /// nothing: store calls answered within a few milliseconds of the
    /// store timeout, upstreams within a few of the longest the lease
    /// allows (detached forwarding's timeout at its most, as the filter
    /// gives it to the upstream call). The lease's margin beyond the
    /// upstream must carry the claim's answer, the completion and its
    /// queueing behind the worker's callout, so every answer the upstream
    /// gave is stored, under `on_unknown: release` too.
    pub edge: bool,
    /// A streaming route whose upstream outlives the lease (a route
    /// timeout longer than the contract asks for), under `on_unknown:
    /// conflict` only: the lease runs out and the record turns unknown
    /// while the upstream acts, a retry gets `409`, and the completion that
    /// carries the current fence still resolves it with the real response
    /// (§6). Under `on_unknown: release` a retry may run alongside it,
    /// which the contract leaves to the route's timeout: not drawn.
    /// Explored clean over 99,380 drawn scenarios (about one in fifty
    /// with it); drawn under `on_unknown: release` too, it ran a key twice
    /// at once within seconds, as the contract warns.
    pub outlives_lease: bool,
    /// `after_expiry: new`: a request whose key expired (with short TTLs,
    /// within the run) is a new request and runs; a key runs again only
    /// once the generation that ran it had expired. A completion the
    /// faults held up until its record expired may find it replaced.
    /// Explored clean over 113,586 drawn scenarios (three in ten with it).
    pub after_expiry_new: bool,
    /// Response bodies of up to 120 bytes against a `max_stored_body` of
    /// 64: a larger one reaches its client whole and is completed without
    /// its body, so a retry gets `409 result-unavailable`, never a replay
    /// of what was not stored.
    pub over_stored: bool,
    /// Request and response bodies reach the filter in up to three pieces,
    /// a few milliseconds apart, as Envoy hands them over (its buffer
    /// holding what the filter paused on, restarting once data flows on).
    pub chunks: bool,
    /// The policy observes (`mode: observe`): every request is forwarded
    /// and answered by the upstream, whatever the store says or whether
    /// it answers; what ran is still recorded and its events kept.
    pub observe: bool,
    /// `failure_mode: open`: a request the store could not decide is
    /// forwarded unprotected, and may run again; one the store told that
    /// the key is not its own never is.
    pub fail_open: bool,
    /// Requests come from two tenants (an `x-tenant` header) under the
    /// same key names: each tenant's keys are its own, never replayed to
    /// the other nor refused for the other's body.
    pub tenants: bool,
    /// With two tenants, a canary that enforces the first and observes the
    /// second (`canary: {"tenants": ["t0"]}`): each tenant's keys are
    /// audited by their side.
    pub canary: bool,
    /// A configuration push mid-run: each Envoy worker takes new requests
    /// on a new configuration while the old one finishes what it holds
    /// (its requests, detached calls and letters) and is let go. A drained
    /// configuration loses nothing: the audit excuses nothing for it.
    ///
    /// This knob and those above it since `over_stored` run on the filter's
    /// own worker: 198,821 drawn scenarios with all of them (and fences
    /// kept past a database's loss) explored clean in five minutes. Bodies
    /// in pieces find a request context that reads each piece from the
    /// start of Envoy's buffer (every piece is fingerprinted again: `422
    /// key-reused` for the same body).
    pub push: bool,
    /// A gRPC policy (`grpc: {}`, streaming, on one unary method): calls
    /// and responses in gRPC's framing, statuses in trailers, Envoy's own
    /// answers trailers-only, the filter's answers as gRPC statuses, and
    /// replays rerouted through Envoy's router to the store's replay route.
    /// 148,128 drawn scenarios with every knob (36,562 gRPC replays)
    /// explored clean in five minutes; a replay sent without its trailers,
    /// or without `grpc-encoding` for compressed messages, breaks 125 and
    /// 60 of the fixed set.
    pub grpc: bool,
}

/// A budget of new keys per tenant: a rate and a burst.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub per_second: f64,
    pub burst: u32,
}

impl Budget {
    pub fn budgets(self) -> Result<Budgets, String> {
        Budgets::new(self.per_second, self.burst)
    }
}

impl Scenario {
    /// The case `case` of the stream of scenarios seeded `seed`.
    pub fn nth(seed: u64, case: u64) -> Scenario {
        Scenario::draw(Rng::stream(seed, "cases").draw() ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The scenario drawn from `id`: every knob and fault from its own stream.
    pub fn draw(id: u64) -> Scenario {
        let s = |name: &str| Rng::stream(id, name);
        // Off, or up to 30 %.
        let p = |mut r: Rng| if r.chance(0.5) { r.unit() * 0.3 } else { 0.0 };
        let edge = s("edge").chance(0.05);
        let knobs = Knobs {
            detached: s("detached").chance(0.5),
            background: s("background").chance(0.5),
            wait: s("wait").chance(0.5),
            release_unknown: s("release_unknown").chance(0.5),
            large: s("large").chance(0.03),
            short_ttl: s("short_ttl").chance(0.3),
            detached_timeout_ms: if edge || s("detached_timeout").chance(0.1) {
                LEASE_MS - STORE_TIMEOUT_MS
            } else {
                1_000
            },
            flood: s("flood").chance(0.02),
            new_keys: {
                let mut r = s("new_keys");
                r.chance(0.3).then(|| Budget {
                    per_second: r.pick(&[0.5, 1.0, 2.0, 5.0]),
                    burst: r.pick(&[1, 2, 4]),
                })
            },
            sweep_every_ms: s("sweep_every").pick(&[500, 500, 1_000, 5_000]),
            edge,
            outlives_lease: false,
            after_expiry_new: s("after_expiry_new").chance(0.3),
            over_stored: s("over_stored").chance(0.1),
            chunks: s("chunks").chance(0.3),
            observe: s("observe").chance(0.05),
            fail_open: s("fail_open").chance(0.1),
            tenants: s("tenants").chance(0.3),
            push: s("push").chance(0.2),
            canary: s("canary").chance(0.3),
            grpc: s("grpc").chance(0.2),
        };
        let knobs = Knobs {
            // A gRPC call is forwarded through Envoy's router.
            detached: knobs.detached && !knobs.grpc,
            ..knobs
        };
        let knobs = Knobs {
            outlives_lease: !knobs.detached
                && !knobs.release_unknown
                && !edge
                && !knobs.flood
                && !knobs.large
                && s("outlives_lease").chance(0.1),
            ..knobs
        };
        let store_restarts = s("store_restarts").chance(0.2);
        let faults = Faults {
            lose_request: p(s("lose_request")),
            lose_answer: p(s("lose_answer")),
            unavailable: p(s("unavailable")),
            slow_store: p(s("slow_store")),
            client_leaves: s("client_leaves").unit() * 0.6,
            upstream_lost: p(s("upstream_lost")),
            clock_steps_back_ms: {
                let mut r = s("clock_steps_back");
                if r.chance(0.5) {
                    r.range(1_000, 5_000)
                } else {
                    0
                }
            },
            store_restarts,
            database_lost: {
                let mut r = s("database_lost");
                (store_restarts && r.chance(0.3)).then(|| match r.range(0, 3) {
                    0 => Loss::Unflushed,
                    1 => Loss::Standby(r.range(20, 1_000)),
                    _ => Loss::Backup(r.range(1_000, HORIZON_MS)),
                })
            },
            envoy_restarts: s("envoy_restarts").chance(0.2),
            never_reached: p(s("never_reached")),
            mismatch: p(s("mismatch")),
            replica_skew_ms: {
                let mut r = s("replica_skew");
                r.chance(0.3).then(|| r.range(-5, 6))
            },
            in_front: p(s("in_front")),
            duplicate: p(s("duplicate")),
            duplicate_claims: p(s("duplicate_claims")),
            slow_database: p(s("slow_database")),
        };
        // At the edge nothing is lost or late: only clients leave.
        let faults = match edge {
            true => Faults {
                client_leaves: faults.client_leaves,
                ..Faults::default()
            },
            false => faults,
        };
        Scenario {
            seed: s("world").draw(),
            knobs,
            faults,
        }
    }
}

/// The unary method a gRPC policy covers.
pub const GRPC_METHOD: &str = "/pay.v1.Payments/Charge";

/// The policy's lease: every request, store call and upstream call of a
/// scenario fits in a few of them.
pub const LEASE_MS: u64 = 2_000;
/// The filter's store timeout.
pub const STORE_TIMEOUT_MS: u64 = 200;

impl Knobs {
    /// A canary is drawn with two tenants, in enforce mode.
    fn canary(&self) -> bool {
        self.canary && self.tenants && !self.observe
    }

    /// The filter's configuration.
    pub fn config(&self) -> String {
        let forwarding: &str = if self.detached {
            &format!(
                r#", "forwarding": {{"mode": "detached", "timeout_ms": {}}}"#,
                self.detached_timeout_ms
            )
        } else {
            ""
        };
        format!(
            r#"{{"store": {{"cluster": "store", "token": "t", "timeout_ms": {STORE_TIMEOUT_MS}}},
              "policies": [{{"name": "pay", "match": {{"path": {path}}}, {tenant},
                "lease_seconds": {lease}, "ttl_seconds": {ttl}, "settle": "{settle}", {in_flight},
                "on_unknown": "{on_unknown}", "after_expiry": "{after_expiry}", "max_stored_body": {max_stored},
                "mode": "{mode}", "failure_mode": "{failure_mode}"{canary}{forwarding}{grpc}}}]}}"#,
            path = match self.grpc {
                true => format!(r#"{{"exact": "{GRPC_METHOD}"}}"#),
                false => r#"{"prefix": "/pay"}"#.to_string(),
            },
            grpc = if self.grpc { r#", "grpc": {}"# } else { "" },
            lease = LEASE_MS / 1_000,
            settle = if self.background {
                "background"
            } else {
                "before_response"
            },
            in_flight = if self.wait {
                r#""in_flight": "wait", "wait_max_ms": 300"#
            } else {
                r#""in_flight": "conflict""#
            },
            on_unknown = if self.release_unknown {
                "release"
            } else {
                "conflict"
            },
            // A gRPC response is stored with its frames' prefixes and a
            // frame of trailers: room for them.
            max_stored = match (self.large, self.grpc) {
                (true, _) => 4 * 1024 * 1024,
                (false, true) => 96,
                (false, false) => 64,
            },
            after_expiry = if self.after_expiry_new { "new" } else { "reject" },
            ttl = if self.short_ttl { 3 } else { 86_400 },
            mode = if self.observe { "observe" } else { "enforce" },
            failure_mode = if self.fail_open { "open" } else { "closed" },
            canary = if self.canary() {
                r#", "canary": {"tenants": ["t0"]}"#
            } else {
                ""
            },
            tenant = if self.tenants {
                r#""tenant": {"header": "x-tenant"}"#
            } else {
                r#""anonymous": true"#
            },
        )
    }
}

impl Default for Knobs {
    /// Streaming, settled before the response, `in_flight: conflict`,
    /// `on_unknown: conflict`, small bodies, day-long records, no budget.
    fn default() -> Knobs {
        Knobs {
            detached: false,
            background: false,
            wait: false,
            release_unknown: false,
            large: false,
            short_ttl: false,
            detached_timeout_ms: 1_000,
            flood: false,
            new_keys: None,
            sweep_every_ms: 500,
            edge: false,
            outlives_lease: false,
            after_expiry_new: false,
            over_stored: false,
            chunks: false,
            observe: false,
            fail_open: false,
            tenants: false,
            push: false,
            canary: false,
            grpc: false,
        }
    }
}

/// The world a scenario builds: the filter's configuration parsed, and how
/// many clients ask what of whom.
#[derive(Debug, Clone)]
pub struct Shape {
    pub config: Config,
    pub keys: usize,
    pub requests: usize,
    /// Requests begin within this many milliseconds.
    pub begin_within: i64,
    /// The upstream takes this long, in milliseconds.
    pub latency: (i64, i64),
    /// Response bodies at least this many bytes...
    pub body_min: usize,
    /// ...and at most this many.
    pub body_max: usize,
    /// The store's answers take this long to come back, in milliseconds.
    pub answer_ms: (i64, i64),
    /// What each worker's queues keep at most.
    pub bound: Bound,
    /// The store's budget of new keys.
    pub budgets: Option<Budget>,
    /// How often the sweeper passes while clients come and go.
    pub sweep_every_ms: i64,
    /// Bodies reach the filter in pieces.
    pub chunks: bool,
    /// How many tenants the requests come from...
    pub tenants: usize,
    /// ...and how many of them, the first, are enforced: the rest are
    /// observed.
    pub enforced: usize,
    /// A configuration is pushed once.
    pub push: bool,
    /// The policy covers a gRPC method.
    pub grpc: bool,
    pub faults: Faults,
}

impl Scenario {
    /// The world this scenario builds, or why its configuration is refused:
    /// a scenario the filter or the store would not start with is an error
    /// of the scenario, never a case that passes.
    pub fn shape(&self) -> Result<Shape, String> {
        let k = &self.knobs;
        let config =
            Config::parse(k.config().as_bytes()).map_err(|e| format!("the policy was refused: {e}"))?;
        if let Some(b) = k.new_keys {
            b.budgets()
                .map_err(|e| format!("the store's budget was refused: {e}"))?;
        }
        let (keys, requests, begin_within, latency, body, answer_ms, bound) = if k.flood {
            let bound = Bound {
                calls: 32,
                bytes: 64 * 1024,
            };
            (400, 400, 200, (5, 50), (1, 48), (100, 170), bound)
        } else if k.edge {
            // An upstream just inside the timeout it is given (a streaming
            // route's kept below the lease as detached forwarding's is:
            // the lease less three store calls), and store calls whose way
            // there (up to 20 ms) and back just fit the store timeout.
            let room = match config.policies()[0].forwarding() {
                Forwarding::Detached(d) => d.upstream_timeout_ms(),
                Forwarding::Streaming => LEASE_MS - 3 * STORE_TIMEOUT_MS,
            } as i64;
            let back = STORE_TIMEOUT_MS as i64 - 40;
            (3, 10, 3_000, (room - 60, room), (1, 48), (back, back + 20), BOUND)
        } else if k.large {
            // Completions that land together: three of them exceed a frame.
            let body = (5 * 512 * 1024, 4 * 1024 * 1024);
            (12, 12, 50, (100, 130), body, (0, 20), BOUND)
        } else {
            // With short TTLs, some retries come after the key expired.
            let begin_within = if k.short_ttl { 9_000 } else { 3_000 };
            // A detached upstream may take as long as the filter lets it
            // (a route's timeout within the lease bounds a streaming one).
            let latency = match (k.detached, k.outlives_lease) {
                (true, _) => (5, 1_500.max(k.detached_timeout_ms as i64 + 100)),
                (false, true) => (LEASE_MS as i64 - 500, 2 * LEASE_MS as i64),
                (false, false) => (5, 1_500),
            };
            // A store that is a little slow when the upstream may take all the lease.
            let answer_ms = if k.detached_timeout_ms > 1_000 {
                (0, 150)
            } else {
                (0, 20)
            };
            (3, 10, begin_within, latency, (1, 48), answer_ms, BOUND)
        };
        let body = match k.over_stored && !k.large {
            true => (body.0, 120),
            false => body,
        };
        Ok(Shape {
            config,
            keys,
            requests,
            begin_within,
            latency,
            body_min: body.0,
            body_max: body.1,
            answer_ms,
            bound,
            budgets: k.new_keys,
            sweep_every_ms: k.sweep_every_ms,
            chunks: k.chunks,
            tenants: if k.tenants { 2 } else { 1 },
            enforced: match (k.observe, k.canary()) {
                (true, _) => 0,
                (false, true) => 1,
                (false, false) => 2,
            },
            push: k.push,
            grpc: k.grpc,
            faults: self.faults.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_drawn_scenario_is_one_the_filter_and_the_store_start_with() {
        for case in 0..2_000 {
            let s = Scenario::nth(1, case);
            assert!(s.shape().is_ok(), "{s:?}: {:?}", s.shape().err());
        }
    }

    #[test]
    fn a_refused_policy_is_an_error_of_the_scenario() {
        let s = Scenario {
            seed: 1,
            knobs: Knobs {
                detached: true,
                detached_timeout_ms: LEASE_MS - 10,
                ..Knobs::default()
            },
            faults: Faults::default(),
        };
        let refused = s.shape().err().unwrap_or_default();
        assert!(refused.contains("the policy was refused"), "{refused}");
        let s = Scenario {
            knobs: Knobs {
                new_keys: Some(Budget {
                    per_second: 0.0,
                    burst: 1,
                }),
                ..Knobs::default()
            },
            ..s
        };
        assert!(s.shape().is_err());
    }

    /// A case drawn once stays drawn so: a knob or a fault added later
    /// draws from a stream of its own and adds a field here, and every
    /// other value stays as it is.
    #[test]
    fn a_case_draws_what_it_always_drew() {
        let drawn = Scenario {
            seed: 7696398082572802790,
            knobs: Knobs {
                detached: true,
                chunks: true,
                tenants: true,
                push: true,
                ..Knobs::default()
            },
            faults: Faults {
                lose_answer: 0.1500114600706088,
                slow_store: 0.195181935044251,
                client_leaves: 0.3184857004380788,
                clock_steps_back_ms: 4384,
                never_reached: 0.19959556267684908,
                mismatch: 0.08509116152893799,
                in_front: 0.23948477475636193,
                duplicate: 0.05118299372644297,
                ..Faults::default()
            },
        };
        assert_eq!(Scenario::nth(1, 0), drawn);
    }
}
