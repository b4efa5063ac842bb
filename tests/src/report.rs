//! Rows of the results table in docs/reliability.md, written after the run's
//! own checks with their verdict. A run writes its row only when
//! `IDEMGATE_REPORT` names the file (the Makefile's `test`, `chaos` and
//! `soak` targets set it), through scripts/reliability-row.sh, the same
//! script scripts/fuzz.sh uses.

pub struct Row<'a> {
    pub run: &'a str,
    pub load: String,
    pub faults: String,
    pub hostile: String,
    pub fuzz_execs: String,
    pub violations: String,
    /// Whether every assertion of the run held.
    pub passed: bool,
    /// `results`, or `oracles` for a run built to break a promise.
    pub table: &'static str,
}

pub fn write(row: &Row<'_>) {
    let Some(file) = std::env::var_os("IDEMGATE_REPORT") else {
        return;
    };
    let script = crate::repo_root().join("scripts/reliability-row.sh");
    let status = std::process::Command::new("bash")
        .arg(script)
        .arg(file)
        .args([
            row.run,
            &row.load,
            &row.faults,
            &row.hostile,
            &row.fuzz_execs,
            &row.violations,
            if row.passed { "passed" } else { "FAILED" },
            row.table,
        ])
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!("could not write the results row {:?}: {status:?}", row.run);
    }
}

/// Failed checks, collected so the run's row is written before the test fails.
#[derive(Default)]
pub struct Checks {
    tried: usize,
    failed: Vec<String>,
}

impl Checks {
    pub fn check(&mut self, ok: bool, what: impl Into<String>) {
        self.tried += 1;
        if !ok {
            self.failed.push(what.into());
        }
    }

    /// Writes the run's row of the results table with its verdict, then
    /// fails the test if a check failed.
    pub fn finish(self, run: &str, load: String, hostile: String, faults: String) {
        write(&Row {
            run,
            load,
            faults,
            hostile: format!("{hostile} ({} checks)", self.tried),
            fuzz_execs: "—".into(),
            violations: self.failed.len().to_string(),
            passed: self.failed.is_empty(),
            table: "results",
        });
        assert!(self.failed.is_empty(), "{run}:\n  {}", self.failed.join("\n  "));
    }
}
