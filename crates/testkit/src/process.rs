//! A child process whose output goes to a log file: killed (SIGKILL) when
//! dropped, and its log printed when that happens while a test fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub struct Proc {
    name: &'static str,
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr into `log` (created afresh).
    pub fn spawn(name: &'static str, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap_or_else(|e| panic!("log file {log:?}: {e}"));
        let err = out.try_clone().unwrap_or_else(|e| panic!("log file: {e}"));
        let child = cmd
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Proc {
            name,
            child: Some(child),
            log,
        }
    }

    /// SIGKILL, no goodbye.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is still running (not exited, not a zombie).
    pub fn alive(&self) -> bool {
        let Some(pid) = self.pid() else { return false };
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit(')')
                    .next()
                    .map(|rest| !rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    }

    /// Resident memory in KiB (Linux `/proc`).
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("===== {} log =====\n{}", self.name, self.log());
        }
    }
}
