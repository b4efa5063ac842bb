//! A throwaway PostgreSQL cluster per test: initdb into a temp directory, start
//! on a free port, stop and delete on drop. Missing binaries fail the test
//! with a message; they are never a reason to skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    as_root: bool,
    next_db: AtomicU32,
}

fn find_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BIN") {
        let p = PathBuf::from(dir);
        assert!(p.join("initdb").exists(), "PG_BIN={} has no initdb", p.display());
        return p;
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .filter(|p| p.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    match found.pop() {
        Some(p) => p,
        None => panic!(
            "PostgreSQL server binaries not found: set PG_BIN to the directory holding initdb and pg_ctl, \
             or install them (apt-get install -y postgresql). The PostgreSQL tests never skip."
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
        let dir = tempfile::tempdir().unwrap();
        if as_root {
            let ok = Command::new("chown")
                .arg("postgres")
                .arg(dir.path())
                .status()
                .unwrap()
                .success();
            assert!(ok, "cannot chown the cluster directory to the postgres user");
        }
        let data = dir.path().join("data");
        let port = crate::free_port();
        let c = PgCluster {
            dir,
            bin,
            port,
            as_root,
            next_db: AtomicU32::new(0),
        };
        let out = c.run(
            "initdb",
            &["-D", path(&data), "-A", "trust", "-U", "idem", "--no-sync"],
        );
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300",
            c.dir.path().display()
        );
        let log = c.dir.path().join("log");
        // pg_ctl's children inherit its stdout, so capturing it would wait for
        // the server to exit: discard it and read the server log on failure.
        if !c.run_detached(
            "pg_ctl",
            &[
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
            ],
        ) {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("pg_ctl start failed:\n{log}");
        }
        c
    }

    fn run(&self, tool: &str, args: &[&str]) -> std::process::Output {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_root {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&exe);
            cmd
        } else {
            Command::new(&exe)
        };
        cmd.args(args).current_dir(self.dir.path()).stdin(Stdio::null());
        cmd.output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()))
    }

    fn run_detached(&self, tool: &str, args: &[&str]) -> bool {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_root {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&exe);
            cmd
        } else {
            Command::new(&exe)
        };
        cmd.args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd.status().map(|s| s.success()).unwrap_or(false)
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://idem@127.0.0.1:{}/{db}", self.port)
    }

    /// A new, empty database in this cluster.
    pub async fn fresh_database(&self) -> String {
        let n = self.next_db.fetch_add(1, Ordering::SeqCst);
        let name = format!("store_{n}");
        let (client, conn) = tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
            .await
            .unwrap();
        let task = tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        drop(client);
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        self.url(&name)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = self.run_detached("pg_ctl", &["-D", path(&data), "-m", "immediate", "-w", "stop"]);
    }
}
