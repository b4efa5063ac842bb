//! A throwaway Patroni cluster: one etcd, and PostgreSQL nodes that Patroni
//! bootstraps, replicates (synchronous mode) and fails over on its own,
//! each in a temp directory on free ports. Killed and deleted on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::Proc;

/// Seconds the leader's key lives in etcd without being renewed: how long
/// a dead leader goes unnoticed, at most.
pub const TTL_SECS: u64 = 10;

pub struct PatroniCluster {
    dir: tempfile::TempDir,
    pg_bin: PathBuf,
    /// (patroni, PostgreSQL port) per node.
    nodes: Vec<Node>,
    _etcd: Proc,
    etcd_port: u16,
}

struct Node {
    name: String,
    patroni: Proc,
    port: u16,
}

/// What is missing for a Patroni cluster, if anything (Debian: `patroni`,
/// `etcd-server`).
pub fn missing() -> Option<String> {
    let gone: Vec<&str> = ["patroni", "etcd"]
        .into_iter()
        .filter(|bin| {
            !Command::new(bin)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    (!gone.is_empty()).then(|| {
        format!(
            "{} not installed (apt-get install -y patroni etcd-server)",
            gone.join(" and ")
        )
    })
}

fn id(flag: &str, user: &str) -> u32 {
    let out = Command::new("id").args([flag, user]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

impl PatroniCluster {
    /// `n` nodes under one etcd, in synchronous mode, started and
    /// replicating: one leader, the others synchronous or streaming
    /// standbys. `Err` (why) when Patroni or etcd is missing.
    pub fn start(n: usize) -> Result<PatroniCluster, String> {
        if let Some(why) = missing() {
            return Err(why);
        }
        let pg_bin = crate::pg::bin_dir();
        let dir = tempfile::tempdir().unwrap();
        if crate::pg::is_root() {
            crate::pg::give_to_postgres(dir.path(), "the Patroni directory");
        }
        let (client, peer) = (crate::free_port(), crate::free_port());
        let mut etcd = Command::new("etcd");
        etcd.arg("--data-dir")
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")]);
        let etcd = Proc::spawn("etcd", &mut etcd, dir.path().join("etcd.log"));
        let c = PatroniCluster {
            dir,
            pg_bin,
            nodes: Vec::new(),
            _etcd: etcd,
            etcd_port: client,
        };
        Ok(c.grown(n.max(1)))
    }

    /// Adds nodes until there are `n`: the first bootstraps the cluster,
    /// the others clone the leader.
    fn grown(mut self, n: usize) -> PatroniCluster {
        while self.nodes.len() < n {
            self.add_node();
            if self.nodes.len() == 1 {
                self.wait("leader", |c| c.leader().is_some());
            }
        }
        if n > 1 {
            self.wait("synchronous standby", |c| {
                c.leader().is_some_and(|l| {
                    c.try_psql(
                        l,
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                    )
                    .as_deref()
                        == Some("1")
                })
            });
        }
        self
    }

    fn add_node(&mut self) {
        let name = format!("node{}", self.nodes.len());
        let home = self.dir.path().join(&name);
        std::fs::create_dir_all(&home).unwrap();
        let (rest, port) = (crate::free_port(), crate::free_port());
        let config = home.join("patroni.yml");
        let text = node_config(&name, &home, &self.pg_bin, self.etcd_port, rest, port);
        std::fs::write(&config, text).unwrap();
        let mut cmd = Command::new("patroni");
        cmd.arg(&config).current_dir(&home);
        if crate::pg::is_root() {
            // PostgreSQL refuses to run as root.
            crate::pg::give_to_postgres(&home, &name);
            use std::os::unix::process::CommandExt;
            cmd.uid(id("-u", "postgres")).gid(id("-g", "postgres"));
            cmd.env("HOME", &home);
        }
        let log = self.dir.path().join(format!("{name}.log"));
        let patroni = Proc::spawn("patroni", &mut cmd, log);
        self.nodes.push(Node { name, patroni, port });
    }

    fn wait(&self, what: &str, ready: impl Fn(&PatroniCluster) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while !ready(self) {
            assert!(
                Instant::now() < deadline,
                "Patroni: no {what} within 90 s:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The PostgreSQL ports of the nodes, in order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The node that takes writes now, if any.
    pub fn leader(&self) -> Option<usize> {
        (0..self.nodes.len())
            .find(|&i| self.try_psql(i, "SELECT pg_is_in_recovery()").as_deref() == Some("f"))
    }

    /// One query on node `i` as the superuser, `psql -At` output, trimmed.
    pub fn psql(&self, i: usize, sql: &str) -> String {
        self.try_psql(i, sql)
            .unwrap_or_else(|| panic!("psql on {} failed: {sql}", self.nodes[i].name))
    }

    fn try_psql(&self, i: usize, sql: &str) -> Option<String> {
        let out = Command::new(self.pg_bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &self.nodes[i].port.to_string()])
            .args(["-U", "idem", "-d", "postgres", "-At", "-c", sql])
            .env("PGCONNECT_TIMEOUT", "2")
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Kills node `i` as a machine that dies would: its Patroni and every
    /// PostgreSQL process at once (SIGKILL). The others notice when its
    /// leader key expires ([`TTL_SECS`]).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].patroni.kill();
        kill_postgres(&self.data_dir(i));
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[i].name).join("data")
    }

    /// Everything the nodes and etcd logged, for a failing test.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("== {} ==\n{}", n.name, tail(&n.patroni.log(), 40)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The running postmaster of `data`: its pid file's, if that process is
/// still a postgres serving `data` (a pid left behind may have been reused).
fn postmaster_of(data: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&cmdline);
    (cmdline.contains("postgres") && cmdline.contains(&*data.to_string_lossy())).then_some(pid)
}

/// SIGKILL to the postmaster of `data` and its children, if it runs.
fn kill_postgres(data: &Path) {
    if let Some(pid) = postmaster_of(data) {
        let mut pids = crate::pg::children_of(pid);
        pids.push(pid);
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        // One may have exited since it was listed.
        let _ = Command::new("kill")
            .arg("-9")
            .args(&pids)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn node_config(name: &str, home: &Path, pg_bin: &Path, etcd: u16, rest: u16, port: u16) -> String {
    format!(
        "scope: idemgate\n\
         name: {name}\n\
         restapi:\n  listen: 127.0.0.1:{rest}\n  connect_address: 127.0.0.1:{rest}\n\
         etcd3:\n  hosts: 127.0.0.1:{etcd}\n\
         bootstrap:\n\
         \x20 dcs:\n\
         \x20   ttl: {TTL_SECS}\n\
         \x20   loop_wait: 1\n\
         \x20   retry_timeout: 3\n\
         \x20   maximum_lag_on_failover: 104857600\n\
         \x20   synchronous_mode: true\n\
         \x20   postgresql:\n\
         \x20     use_pg_rewind: false\n\
         \x20     use_slots: true\n\
         \x20     parameters:\n\
         \x20       max_connections: 300\n\
         \x20       fsync: 'off'\n\
         \x20 initdb:\n\
         \x20 - encoding: UTF8\n\
         \x20 - auth: trust\n\
         \x20 pg_hba:\n\
         \x20 - host replication replicator 127.0.0.1/32 trust\n\
         \x20 - host all all 127.0.0.1/32 trust\n\
         \x20 - local all all trust\n\
         postgresql:\n\
         \x20 listen: 127.0.0.1:{port}\n\
         \x20 connect_address: 127.0.0.1:{port}\n\
         \x20 data_dir: {data}\n\
         \x20 bin_dir: {bin}\n\
         \x20 pgpass: {pgpass}\n\
         \x20 authentication:\n\
         \x20   superuser: {{username: idem, password: idem}}\n\
         \x20   replication: {{username: replicator, password: rep}}\n\
         \x20 parameters:\n\
         \x20   unix_socket_directories: {home}\n",
        data = home.join("data").display(),
        bin = pg_bin.display(),
        pgpass = home.join("pgpass").display(),
        home = home.display(),
    )
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.patroni.kill();
        }
        for i in 0..self.nodes.len() {
            kill_postgres(&self.data_dir(i));
        }
    }
}
