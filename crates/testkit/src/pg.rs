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
    /// The server options it was started with, for a restart.
    opts: String,
}

/// The directory of the PostgreSQL server binaries (`PG_BIN`, else the
/// newest under /usr/lib/postgresql).
pub fn bin_dir() -> PathBuf {
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

/// Whether the tests run as root (PostgreSQL then runs as `postgres`).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Gives `path`, and all below it, to the `postgres` user: when the tests
/// run as root the servers run as `postgres` (PostgreSQL, Patroni and
/// PgBouncer refuse root), and must own their directories and files.
/// `what` names it in the failure.
pub fn give_to_postgres(path: &Path, what: &str) {
    let ok = Command::new("chown")
        .args(["-R", "postgres"])
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "cannot chown {what} to the postgres user");
}

impl PgCluster {
    pub fn start() -> PgCluster {
        PgCluster::start_with(&[])
    }

    /// A cluster with these server settings (`name`, `value`) on top of the
    /// test defaults.
    pub fn start_with(settings: &[(&str, &str)]) -> PgCluster {
        PgCluster::start_with_files(settings, &[])
    }

    /// A cluster with these server settings and files (`name`, contents)
    /// written beside its data directory, readable by the server alone
    /// (mode 0600, as it wants for a key); `$DIR` in a setting's value is
    /// that directory.
    pub fn start_with_files(settings: &[(&str, &str)], files: &[(&str, &[u8])]) -> PgCluster {
        let c = PgCluster::unstarted(settings, files);
        let data = c.data_dir();
        let out = c.run(
            "initdb",
            &["-D", path(&data), "-A", "trust", "-U", "idem", "--no-sync"],
        );
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        c.start_server();
        c
    }

    /// A hot standby of `primary` with these server settings: a base backup
    /// of it (`pg_basebackup -R`, so it starts in recovery and streams the
    /// primary's WAL), started and streaming. `cluster_name` in `settings`
    /// names it in the primary's `synchronous_standby_names`.
    pub fn standby_of(primary: &PgCluster, settings: &[(&str, &str)]) -> PgCluster {
        let c = PgCluster::unstarted(settings, &[]);
        let data = c.data_dir();
        let port = primary.port.to_string();
        // A fast checkpoint to start the backup from: the default spreads
        // its writes over most of `checkpoint_timeout`, and a primary that
        // has just been written to (a schema migrated) took 95 s.
        let out = c.run(
            "pg_basebackup",
            &[
                "-D",
                path(&data),
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "idem",
                "-R",
                "-X",
                "stream",
                "--checkpoint=fast",
                "--no-sync",
            ],
        );
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        c.start_server();
        let streaming = (0..500).any(|_| {
            let n = primary.query("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'");
            n != "0" || {
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        });
        assert!(streaming, "the standby never streamed from its primary");
        c
    }

    /// A cluster not yet created: its directory (owned by the server's
    /// user), port, options and files.
    fn unstarted(settings: &[(&str, &str)], files: &[(&str, &[u8])]) -> PgCluster {
        let bin = bin_dir();
        let as_root = is_root();
        let dir = tempfile::tempdir().unwrap();
        if as_root {
            give_to_postgres(dir.path(), "the cluster directory");
        }
        let port = crate::free_port();
        let mut opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300",
            dir.path().display()
        );
        for (name, contents) in files {
            let file = dir.path().join(name);
            std::fs::write(&file, contents).unwrap();
            std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
            if as_root {
                give_to_postgres(&file, name);
            }
        }
        for (name, value) in settings {
            let value = value.replace("$DIR", path(dir.path()));
            opts.push_str(&format!(" -c {name}={value}"));
        }
        PgCluster {
            dir,
            bin,
            port,
            as_root,
            next_db: AtomicU32::new(0),
            opts,
        }
    }

    fn start_server(&self) {
        let data = self.dir.path().join("data");
        let log = self.dir.path().join("log");
        // pg_ctl's children inherit its stdout, so capturing it would wait for
        // the server to exit: discard it and read the server log on failure.
        if !self.run_detached(
            "pg_ctl",
            &[
                "-D",
                path(&data),
                "-l",
                path(&log),
                "-o",
                &self.opts,
                "-w",
                "-t",
                "60",
                "start",
            ],
        ) {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("pg_ctl start failed:\n{log}");
        }
    }

    /// Kills every server process at once (SIGKILL: what shared memory held,
    /// such as WAL not yet written out or sent to a standby, is gone), then
    /// starts the server again on the same data, which recovers from the WAL
    /// on disk.
    pub fn crash_and_restart(&self) {
        let postmaster = self.postmaster();
        self.kill();
        // A new postmaster refuses the lock files of one whose PID still
        // exists, and a killed one lingers as a zombie until it is reaped.
        let reaped = (0..1000).any(|_| {
            !Path::new(&format!("/proc/{postmaster}")).exists() || {
                std::thread::sleep(Duration::from_millis(10));
                false
            }
        });
        assert!(reaped, "the killed postmaster was never reaped");
        self.start_server();
    }

    /// Kills every server process at once (SIGKILL), as a machine that dies
    /// would; the server stays down.
    pub fn kill(&self) {
        let postmaster = self.postmaster();
        let mut pids = children_of(postmaster);
        pids.push(postmaster);
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        // A backend may have exited since it was listed: `kill` then fails
        // for it alone, and what matters is checked below.
        let _ = Command::new("kill")
            .arg("-9")
            .args(&pids)
            .stderr(Stdio::null())
            .status();
        // A zombie holds no socket, file or memory any more.
        let gone = |pid: &String| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
                stat.rsplit(')')
                    .next()
                    .is_some_and(|rest| rest.trim_start().starts_with('Z'))
            })
        };
        for _ in 0..500 {
            if pids.iter().all(gone) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(pids.iter().all(gone), "the server's processes outlived kill -9");
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the processes that send this
    /// server's WAL to its standbys: a standby falling behind, as over a
    /// congested link. Commits that wait for a synchronous standby wait
    /// meanwhile.
    pub fn freeze_replication(&self, frozen: bool) {
        let senders: Vec<String> = children_of(self.postmaster())
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains("walsender"))
            })
            .map(|pid| pid.to_string())
            .collect();
        assert!(
            !senders.is_empty(),
            "no WAL sender to freeze: is a standby streaming?"
        );
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill")
            .arg(signal)
            .args(&senders)
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {signal} {senders:?} failed");
    }

    /// Ends a standby's recovery: it takes writes from now on.
    pub fn promote(&self) {
        let data = self.data_dir();
        let out = self.run("pg_ctl", &["-D", path(&data), "-w", "-t", "60", "promote"]);
        assert!(
            out.status.success(),
            "pg_ctl promote failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stops the server cleanly (`pg_ctl stop -m fast`): sessions are
    /// ended, and a primary sends its standbys every WAL record up to its
    /// shutdown checkpoint before it exits, so a standby promoted after it
    /// holds all it committed.
    pub fn stop(&self) {
        let data = self.data_dir();
        let out = self.run(
            "pg_ctl",
            &["-D", path(&data), "-m", "fast", "-w", "-t", "60", "stop"],
        );
        assert!(
            out.status.success(),
            "pg_ctl stop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts this stopped cluster again as a hot standby of `primary`
    /// (`standby.signal`, `primary_conninfo`): a former primary demoted in
    /// a switchover, on the same port. It follows `primary`'s newer
    /// timeline, so `primary` must have been promoted after this one
    /// stopped cleanly ([`PgCluster::stop`]).
    pub fn follow(&self, primary: &PgCluster) {
        let data = self.data_dir();
        let signal = data.join("standby.signal");
        std::fs::write(&signal, "").unwrap();
        let auto = data.join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&auto).unwrap_or_default();
        conf.push_str(&format!(
            "primary_conninfo = 'host=127.0.0.1 port={} user=idem'\n",
            primary.port
        ));
        std::fs::write(&auto, conf).unwrap();
        if self.as_root {
            give_to_postgres(&signal, "standby.signal");
            give_to_postgres(&auto, "postgresql.auto.conf");
        }
        self.start_server();
        let streaming = (0..500).any(|_| {
            let n = primary.query("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'");
            n != "0" || {
                std::thread::sleep(Duration::from_millis(20));
                false
            }
        });
        assert!(streaming, "the demoted primary never streamed from the new one");
    }

    /// One query's result as `psql -At` prints it (fields `|`-separated,
    /// one row a line), trimmed.
    pub fn query(&self, sql: &str) -> String {
        self.query_in("postgres", sql)
    }

    /// The cluster's next transaction id: it moves when anything, anywhere
    /// in the cluster, writes (a row, a catalog entry, a sequence); reading
    /// it does not move it.
    pub fn next_xid(&self) -> String {
        self.query("SELECT pg_snapshot_xmax(pg_current_snapshot())")
    }

    /// [`PgCluster::query`] in database `db`, as the superuser `idem`.
    pub fn query_in(&self, db: &str, sql: &str) -> String {
        let port = self.port.to_string();
        let out = self.run(
            "psql",
            &[
                "-h",
                path(self.dir.path()),
                "-p",
                &port,
                "-U",
                "idem",
                "-d",
                db,
                "-At",
                "-c",
                sql,
            ],
        );
        assert!(
            out.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn postmaster(&self) -> u32 {
        let pidfile = self.data_dir().join("postmaster.pid");
        std::fs::read_to_string(&pidfile)
            .unwrap()
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .unwrap()
    }

    /// The server binary `tool` with `args`, as the server's user, in the
    /// cluster's directory, reading nothing.
    fn command(&self, tool: &str, args: &[&str]) -> Command {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_root {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(&exe);
            cmd
        } else {
            Command::new(&exe)
        };
        cmd.args(args).current_dir(self.dir.path()).stdin(Stdio::null());
        cmd
    }

    fn run(&self, tool: &str, args: &[&str]) -> std::process::Output {
        self.command(tool, args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.join(tool).display()))
    }

    fn run_detached(&self, tool: &str, args: &[&str]) -> bool {
        let mut cmd = self.command(tool, args);
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        cmd.status().map(|s| s.success()).unwrap_or(false)
    }

    /// The cluster's data directory: what it holds on disk.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn url(&self, db: &str) -> String {
        self.url_as("idem", db)
    }

    /// The URL of database `db` for role `user` (authentication is `trust`:
    /// the role's grants are what limit it).
    pub fn url_as(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
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

/// The processes whose parent is `parent` (Linux `/proc`).
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid ...`: the command may hold spaces and
            // parentheses, so the fields are counted after the last ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
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
