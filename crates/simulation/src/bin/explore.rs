//! `make explore`: new scenarios for as long as it is given, on every core,
//! until one breaks a promise (printed whole, to be kept in
//! `regressions.rs`) or the time is up; then the tally.
//!
//!     explore [--minutes N] [--seed S] [--threads T] [--all] [--lost]
//!     explore --seed S --case N
//!
//! `--all` goes on after a violation, and prints the first scenario of
//! each kind of violation (its message with the numbers left out).
//! `--lost` runs only the drawn scenarios whose database loses what it
//! committed (`Faults::database_lost`).
//! `--case` runs the one scenario `Scenario::nth(S, N)` printed, with
//! `SIMULATION_TRACE=1` everything that happens in it, then the audit's
//! verdict and every key's history as the store keeps it.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idemgate_simulation::audit::audit;
use idemgate_simulation::run::{run, Tally};
use idemgate_simulation::scenario::Scenario;
use idemgate_simulation::world::World;

struct Args {
    case: Option<u64>,
    all: bool,
    lost: bool,
    minutes: f64,
    seed: u64,
    threads: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        case: None,
        all: false,
        lost: false,
        minutes: 1.0,
        // A new stream each run unless one is asked for.
        seed: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--all" {
            a.all = true;
            continue;
        }
        if flag == "--lost" {
            a.lost = true;
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--minutes" => a.minutes = value.parse().map_err(|e| bad(&e))?,
            "--seed" => a.seed = value.parse().map_err(|e| bad(&e))?,
            "--threads" => a.threads = value.parse().map_err(|e| bad(&e))?,
            "--case" => a.case = Some(value.parse().map_err(|e| bad(&e))?),
            _ => return Err(format!("unknown flag {flag}; usage: explore [--minutes N] [--seed S] [--threads T] [--all] [--lost] | --seed S --case N")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("explore: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(case) = a.case {
        return one(Scenario::nth(a.seed, case));
    }
    let until = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    println!(
        "explore: seed {} on {} threads for {} min",
        a.seed, a.threads, a.minutes
    );
    let stop = AtomicBool::new(false);
    let total = Mutex::new(Tally::default());
    let found = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for t in 0..a.threads {
            let (stop, total, found) = (&stop, &total, &found);
            scope.spawn(move || {
                let mut tally = Tally::default();
                let mut case = t as u64;
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    let s = Scenario::nth(a.seed, case);
                    if a.lost && s.faults.database_lost.is_none() {
                        case += a.threads as u64;
                        continue;
                    }
                    let outcome = run(&s);
                    tally.add(&outcome);
                    if let Err(e) = outcome.verdict {
                        stop.store(!a.all, Ordering::Relaxed);
                        let kind: String = e.chars().filter(|c| !c.is_ascii_digit()).collect();
                        let mut found = found.lock().unwrap_or_else(|e| e.into_inner());
                        if found.iter().all(|(k, _)| *k != kind) {
                            println!(
                                "violation (explore --seed {} --case {case}): {e}\n    {s:?}",
                                a.seed
                            );
                            found.push((kind, e));
                        }
                    }
                    case += a.threads as u64;
                }
                total.lock().unwrap_or_else(|e| e.into_inner()).merge(&tally);
            });
        }
    });
    let found = found.into_inner().unwrap_or_else(|e| e.into_inner());
    let tally = total.into_inner().unwrap_or_else(|e| e.into_inner());
    println!("{}", tally.summary());
    let _ = std::io::stdout().flush();
    if found.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One scenario, its verdict and the store's histories.
fn one(s: Scenario) -> ExitCode {
    println!("{s:#?}");
    let shape = match s.shape() {
        Ok(shape) => shape,
        Err(refused) => {
            println!("{refused}");
            return ExitCode::FAILURE;
        }
    };
    let mut w = World::new(shape, s.seed);
    w.run();
    let verdict = audit(&w, &s.knobs);
    for (key, h) in w.histories() {
        println!("{key}:");
        for g in &h.records {
            println!(
                "  generation {} {} by {:?}, created {}, ended {:?}",
                g.generation,
                g.state.as_str(),
                g.attempt,
                g.created_at,
                g.ended_at
            );
        }
        for e in &h.events {
            let detail = e.detail.as_deref().unwrap_or("");
            println!(
                "  {} generation {} {} by {} {detail}",
                e.at, e.generation, e.transition, e.actor
            );
        }
    }
    println!("{verdict:?}");
    match verdict {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}
