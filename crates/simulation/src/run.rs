//! Running scenarios: one, and many with their tally (scenarios a minute,
//! steps a second) for the end of a run.

use std::time::{Duration, Instant};

use crate::audit::audit;
use crate::scenario::Scenario;
use crate::world::World;

/// What one scenario came to.
#[derive(Debug)]
pub struct Outcome {
    /// The audit's verdict: the first promise broken, or why the scenario
    /// could not run at all (a configuration refused).
    pub verdict: Result<(), String>,
    pub steps: u64,
    pub executions: usize,
    /// Calls a worker's full queue did not take.
    pub refused_by_full_queue: usize,
    /// Claims the store refused as late, and as over budget.
    pub late: u64,
    pub rate_limited: u64,
    /// gRPC replays the filter rerouted to the store's replay route.
    pub rerouted: usize,
}

/// Runs `s` and audits it.
pub fn run(s: &Scenario) -> Outcome {
    let shape = match s.shape() {
        Ok(shape) => shape,
        Err(refused) => {
            return Outcome {
                verdict: Err(refused),
                steps: 0,
                executions: 0,
                refused_by_full_queue: 0,
                late: 0,
                rate_limited: 0,
                rerouted: 0,
            }
        }
    };
    let mut w = World::new(shape, s.seed);
    w.run();
    let (late, rate_limited) = w.refused();
    Outcome {
        late,
        rate_limited,
        verdict: audit(&w, &s.knobs),
        steps: w.steps,
        executions: w.execs.len(),
        refused_by_full_queue: w.queue_full,
        rerouted: w.rerouted,
    }
}

/// Scenarios run so far, and how long they took.
#[derive(Debug)]
pub struct Tally {
    started: Instant,
    pub scenarios: u64,
    pub steps: u64,
    pub executions: u64,
    pub refused_by_full_queue: u64,
    pub late: u64,
    pub rate_limited: u64,
    pub rerouted: u64,
    pub violations: u64,
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            started: Instant::now(),
            scenarios: 0,
            steps: 0,
            executions: 0,
            refused_by_full_queue: 0,
            late: 0,
            rate_limited: 0,
            rerouted: 0,
            violations: 0,
        }
    }
}

impl Tally {
    pub fn add(&mut self, o: &Outcome) {
        self.scenarios += 1;
        self.steps += o.steps;
        self.executions += o.executions as u64;
        self.refused_by_full_queue += o.refused_by_full_queue as u64;
        self.late += o.late;
        self.rate_limited += o.rate_limited;
        self.rerouted += o.rerouted as u64;
        self.violations += u64::from(o.verdict.is_err());
    }

    /// Another tally's scenarios, as if run here.
    pub fn merge(&mut self, other: &Tally) {
        self.scenarios += other.scenarios;
        self.steps += other.steps;
        self.executions += other.executions;
        self.refused_by_full_queue += other.refused_by_full_queue;
        self.late += other.late;
        self.rate_limited += other.rate_limited;
        self.rerouted += other.rerouted;
        self.violations += other.violations;
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// One line: what ran, how fast, and what the audit found.
    pub fn summary(&self) -> String {
        let secs = self.elapsed().as_secs_f64().max(1e-9);
        format!(
            "simulation: {} scenarios in {secs:.1} s ({:.0} scenarios/min), {} steps ({:.0} steps/s), \
             {} executions, {} gRPC replays rerouted to the store, {} calls refused by a full queue, claims \
             the store refused: {} late, {} over budget; audited: {} violations",
            self.scenarios,
            self.scenarios as f64 * 60.0 / secs,
            self.steps,
            self.steps as f64 / secs,
            self.executions,
            self.rerouted,
            self.refused_by_full_queue,
            self.late,
            self.rate_limited,
            self.violations,
        )
    }
}
