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
