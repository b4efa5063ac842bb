//! A throwaway PgBouncer in front of a [`PgCluster`]: a generated ini and
//! user list in a temp directory, listening on a free port, killed on drop.
//! Every database of the cluster is reachable through it under the same
//! name (`* =` in `[databases]`); server connections left idle for 5 s are
//! closed, so the databases of finished tests hold none of the cluster's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::pg::{is_root, PgCluster};
use crate::Proc;

/// How PgBouncer hands server connections to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// One server connection per client, for as long as it is connected.
    Session,
    /// A server connection per transaction: what most deployments run.
    Transaction,
}

pub struct PgBouncer {
    pub port: u16,
    proc: Proc,
    bin: PathBuf,
    ini: PathBuf,
    restarts: u32,
    // Dropped after the process: it holds the ini, the user list and the log.
    _dir: tempfile::TempDir,
}

/// The PgBouncer binary: `PGBOUNCER_BIN`, else `/usr/sbin/pgbouncer`, else
/// `pgbouncer` on the PATH. `None` when there is none (scripts/setup.sh
/// installs it).
pub fn binary() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("PGBOUNCER_BIN") {
        return Some(PathBuf::from(bin));
    }
    let standard = PathBuf::from("/usr/sbin/pgbouncer");
    if standard.exists() {
        return Some(standard);
    }
    let on_path = Command::new("pgbouncer").arg("--version").output();
    on_path
        .is_ok_and(|o| o.status.success())
        .then(|| PathBuf::from("pgbouncer"))
}

/// The store's fences move up to the clock on every server connection
/// PgBouncer makes, as docs/operations.md#pgbouncer says: the store's own
/// connections to PgBouncer outlive a failover behind it. A database not
/// migrated yet has no procedure, and nothing to move.
pub const FENCE_FLOOR: &str = "DO $$BEGIN CALL idempotency_fence_floor(); \
     EXCEPTION WHEN undefined_function THEN NULL; END$$";

impl PgBouncer {
    /// PgBouncer in `mode` in front of `cluster`, at most `pool_size` server
    /// connections per database and user, ready to accept connections.
    /// `ignore` lists startup parameters it lets through unapplied
    /// (`ignore_startup_parameters`). `None` when PgBouncer is not
    /// installed.
    pub fn start(cluster: &PgCluster, mode: PoolMode, pool_size: u32, ignore: &[&str]) -> Option<PgBouncer> {
        let bin = binary()?;
        let dir = tempfile::tempdir().unwrap();
        let port = crate::free_port();
        let mode = match mode {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        };
        let ini = dir.path().join("pgbouncer.ini");
        let users = dir.path().join("userlist.txt");
        let log = dir.path().join("pgbouncer.log");
        std::fs::write(&users, "\"idem\" \"\"\n").unwrap();
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 * = host=127.0.0.1 port={pg} connect_query='{FENCE_FLOOR}'\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = {mode}\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 2000\n\
                 max_db_connections = 0\n\
                 server_reset_query =\n\
                 server_idle_timeout = 5\n\
                 ignore_startup_parameters = {ignore}\n\
                 pidfile = {pidfile}\n",
                pg = cluster.port,
                users = users.display(),
                ignore = ["extra_float_digits"]
                    .iter()
                    .chain(ignore)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(","),
                pidfile = dir.path().join("pgbouncer.pid").display(),
            ),
        )
        .unwrap();
        if is_root() {
            // It refuses to run as root; the directory is the postgres user's.
            crate::pg::give_to_postgres(dir.path(), "the PgBouncer directory");
        }
        let proc = spawn(&bin, &ini, port, log);
        Some(PgBouncer {
            port,
            proc,
            bin,
            ini,
            restarts: 0,
            _dir: dir,
        })
    }

    /// Kills PgBouncer (SIGKILL: every client and server connection dropped
    /// at once) and starts it again on the same port.
    pub fn restart(&mut self) {
        self.proc.kill();
        self.restarts += 1;
        let log = self
            .ini
            .with_file_name(format!("pgbouncer-{}.log", self.restarts));
        self.proc = spawn(&self.bin, &self.ini, self.port, log);
    }

    /// The URL of database `db` through PgBouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://idem@127.0.0.1:{}/{db}", self.port)
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        self.proc.log()
    }
}

/// PgBouncer on `ini`, once it accepts connections on `port`.
fn spawn(bin: &Path, ini: &Path, port: u16, log: PathBuf) -> Proc {
    let mut cmd = Command::new(bin);
    if is_root() {
        cmd.args(["-u", "postgres"]);
    }
    cmd.arg(ini);
    let proc = Proc::spawn("pgbouncer", &mut cmd, log);
    let ready = (0..500).any(|_| {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() || {
            assert!(proc.alive(), "PgBouncer exited:\n{}", proc.log());
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(ready, "PgBouncer never listened:\n{}", proc.log());
    proc
}
