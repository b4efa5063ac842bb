//! The fixed set of the simulation: the same scenarios on every run, so a
//! red run is the change's doing (`make explore` draws new ones), and the
//! scenarios that found defects.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;

use idemgate_simulation::regressions;
use idemgate_simulation::run::{run, Tally};
use idemgate_simulation::scenario::Scenario;

/// The fixed set's stream of scenarios, and how many of it run.
const SEED: u64 = 0x1de9_a7e5;
const CASES: u64 = 1_000;

/// Written to stderr itself, so the harness shows it on success too.
fn report(tally: &Tally) {
    let _ = writeln!(std::io::stderr(), "{}", tally.summary());
}

#[test]
fn every_scenario_of_the_fixed_set_keeps_the_contract() {
    let mut tally = Tally::default();
    let mut broken = Vec::new();
    for case in 0..CASES {
        let s = Scenario::nth(SEED, case);
        let outcome = run(&s);
        tally.add(&outcome);
        if let Err(e) = outcome.verdict {
            broken.push(format!(
                "case {case} (to trace it: explore --seed {SEED} --case {case}): {e}\n    {s:?}"
            ));
        }
    }
    report(&tally);
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_scenarios_that_found_defects_stay_fixed() {
    let mut tally = Tally::default();
    let broken: Vec<String> = regressions::all()
        .into_iter()
        .filter_map(|(found, s)| {
            let outcome = run(&s);
            tally.add(&outcome);
            outcome
                .verdict
                .err()
                .map(|e| format!("{e}\n    (it found: {found})\n    {s:?}"))
        })
        .collect();
    report(&tally);
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}
