//! A throwaway PostgreSQL cluster: initdb into a temp directory, start on a
//! free port, stop and delete on drop. Missing binaries fail the test with a
//! message (set PG_BIN, or `apt-get install -y postgresql`); never a skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    as_root: bool,
}

fn find_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let version = e.file_name().to_str()?.parse().ok()?;
                    let bin = e.path().join("bin");
                    bin.join("initdb").exists().then_some((version, bin))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL server binaries not found: set PG_BIN to the directory holding initdb and pg_ctl, \
             or install them (apt-get install -y postgresql)"
        ),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl PgCluster {
    pub fn start() -> PgCluster {
        let bin = find_bin();
        let as_root = is_root();
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        if as_root {
            let chown = Command::new("chown").arg("postgres").arg(dir.path()).status();
            assert!(
                chown.map(|s| s.success()).unwrap_or(false),
                "cannot chown the cluster directory to the postgres user"
            );
        }
        let c = PgCluster {
            port: crate::free_port(),
            dir,
            bin,
            as_root,
        };
        let data = c.dir.path().join("data");
        let initdb = c
            .command("initdb")
            .args(["-D", path(&data), "-A", "trust", "-U", "idem", "--no-sync"])
            .output()
            .unwrap_or_else(|e| panic!("initdb: {e}"));
        assert!(
            initdb.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&initdb.stderr)
        );
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            c.port,
            c.dir.path().display()
        );
        let log = c.dir.path().join("log");
        // pg_ctl's children inherit its stdout: discard it rather than wait on it.
        let started = c
            .command("pg_ctl")
            .args([
                "-D",
                path(&data),
                "-l",
                path(&log),
                "-o",
                &opts,
                "-w",
                "-t",
                "60",
                "start",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(
            started,
            "pg_ctl start failed:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        c
    }

    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_root {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(exe);
            cmd
        } else {
            Command::new(exe)
        };
        cmd.current_dir(self.dir.path()).stdin(Stdio::null());
        cmd
    }

    pub fn url(&self) -> String {
        format!("postgres://idem@127.0.0.1:{}/postgres", self.port)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_else(|| panic!("non-UTF-8 path {p:?}"))
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = self
            .command("pg_ctl")
            .args(["-D", path(&data), "-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
