//! Rows of the results table in docs/reliability.md, written after the run's
//! own checks with their verdict: `passed`, `FAILED`, or `skipped (why)` for
//! a run that could not happen here. A run writes its row only when
//! `IDEMGATE_REPORT` names the file (the Makefile's `report`, `chaos` and
//! `soak` targets set it; `make test` leaves the file alone), through
//! scripts/reliability-row.sh, the same script scripts/fuzz.sh uses.

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
    if let Some(file) = std::env::var_os("IDEMGATE_REPORT") {
        write_to(&file, row);
    }
}

fn write_to(file: &std::ffi::OsStr, row: &Row<'_>) {
    write_with_verdict(file, row, if row.passed { "passed" } else { "FAILED" });
}

/// `verdict` is `passed`, `FAILED`, or `skipped (why)` for a run that did
/// not happen.
fn write_with_verdict(file: &std::ffi::OsStr, row: &Row<'_>, verdict: &str) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reliability-row.sh");
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
            verdict,
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

/// The row of a run that has no counts to report: written when the run
/// ends, `passed` unless it ends in a failed assertion, or `skipped (why)`
/// through [`Verdict::skip`].
pub struct Verdict {
    file: Option<std::ffi::OsString>,
    run: String,
    load: String,
    faults: String,
}

/// Call first thing in a test: `let _verdict = verdict(run, load, faults);`.
pub fn verdict(run: &str, load: &str, faults: &str) -> Verdict {
    Verdict {
        file: std::env::var_os("IDEMGATE_REPORT"),
        run: run.into(),
        load: load.into(),
        faults: faults.into(),
    }
}

impl Verdict {
    /// For a run that cannot happen here (what it needs is missing): its row
    /// says `skipped (reason)`, never `passed`, and `skipped: reason` goes to
    /// the test's stderr past libtest's capture, so that it shows even though
    /// libtest, which knows no skipped tests, reports the test `ok`. Call it
    /// as the test's last word: `return verdict.skip("...")`.
    pub fn skip(mut self, reason: &str) {
        use std::io::Write;
        let reason = one_cell(reason);
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {reason} ({:?} did not run)",
            self.run
        );
        self.write_skipped(&reason);
    }

    /// Writes the skipped row, and no other when dropped.
    fn write_skipped(&mut self, reason: &str) {
        let Some(file) = self.file.take() else { return };
        write_with_verdict(
            &file,
            &self.row("— (did not run)", false),
            &format!("skipped ({})", one_cell(reason)),
        );
    }

    /// The run's row: no counts, `violations` in their place.
    fn row(&self, violations: &str, passed: bool) -> Row<'_> {
        Row {
            run: &self.run,
            load: self.load.clone(),
            faults: self.faults.clone(),
            hostile: "—".into(),
            fuzz_execs: "—".into(),
            violations: violations.into(),
            passed,
            table: "results",
        }
    }
}

/// `text` on one line, without cell separators: a cell of the table.
fn one_cell(text: &str) -> String {
    text.replace(['\n', '\r'], " ").replace('|', "/")
}

impl Drop for Verdict {
    fn drop(&mut self) {
        let Some(file) = &self.file else { return };
        let passed = !std::thread::panicking();
        let violations = if passed {
            "0"
        } else {
            "an assertion failed (see the test's log)"
        };
        write_to(file, &self.row(violations, passed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLES: &str = "<!-- results:begin -->\n| run |\n|---|\n<!-- results:end -->\n\
                          <!-- earlier:begin -->\n| run |\n|---|\n<!-- earlier:end -->\n";

    fn verdict_in(file: &std::path::Path, run: &str) -> Verdict {
        Verdict {
            file: Some(file.into()),
            run: run.into(),
            load: "load".into(),
            faults: "faults".into(),
        }
    }

    /// An empty results table in a file of its own (kept while the
    /// directory is).
    fn tables() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reliability.md");
        std::fs::write(&file, TABLES).unwrap();
        (dir, file)
    }

    #[test]
    fn a_run_that_fails_an_assertion_writes_a_failed_row() {
        let (_dir, file) = tables();
        drop(verdict_in(&file, "holds"));
        let failing = file.clone();
        let run = std::thread::spawn(move || {
            let _verdict = verdict_in(&failing, "breaks");
            panic!("the run's assertion");
        });
        assert!(run.join().is_err());
        let table = std::fs::read_to_string(&file).unwrap();
        let verdict_of = |run: &str| {
            let row = table
                .lines()
                .find(|l| l.starts_with(&format!("| {run} |")))
                .unwrap();
            row.split(" | ").nth(6).unwrap().to_string()
        };
        assert_eq!(verdict_of("holds"), "passed");
        assert_eq!(verdict_of("breaks"), "FAILED");
    }

    #[test]
    fn a_run_that_is_skipped_writes_a_skipped_row_with_its_reason_not_a_passed_one() {
        let (_dir, file) = tables();
        // The same run passed before on this commit: the skip replaces its row.
        drop(verdict_in(&file, "needs root"));
        let mut skipped = verdict_in(&file, "needs root");
        skipped.write_skipped("mounting a tmpfs needs root | or a\nuser namespace");
        drop(skipped);
        let table = std::fs::read_to_string(&file).unwrap();
        let rows: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("| needs root |"))
            .collect();
        assert_eq!(rows.len(), 1, "{table}");
        let cells: Vec<&str> = rows[0].split(" | ").collect();
        // run, load, faults, hostile, fuzz executions, violations, verdict, commit, date
        assert_eq!(cells.len(), 9, "{}", rows[0]);
        assert_eq!(cells[5], "— (did not run)");
        assert_eq!(
            cells[6],
            "skipped (mounting a tmpfs needs root / or a user namespace)"
        );
        assert!(!rows[0].contains("passed"), "{}", rows[0]);
    }
}
