//! What a stack runs beside Envoy and the store when it is not a test's: the
//! demo's upstreams, the bench's Express handler. Each starts before Envoy
//! and is polled until it answers, as the store is; and every process the
//! stack starts leaves its command line behind, for an operator to read.

use std::process::Command;
use std::time::Duration;

use super::Stack;
use crate::{eventually, Proc};

/// A process of the stack's own, e.g. the demo's payments service.
pub struct Service {
    pub name: &'static str,
    /// The program and its arguments.
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub ready: Ready,
}

/// When a [`Service`] counts as started.
pub enum Ready {
    /// `GET url` answers 200.
    Http(String),
    /// It accepts connections on this port of 127.0.0.1 (a gRPC server).
    Listening(u16),
}

impl Stack {
    pub(super) async fn start_services(&mut self) {
        let services = std::mem::take(&mut self.options.services);
        for service in &services {
            let log = self.next_log(service.name);
            let (program, args) = service.command.split_first().unwrap_or_else(|| {
                panic!("{}: no command", service.name);
            });
            let mut cmd = Command::new(program);
            cmd.args(args).envs(service.env.iter().map(|(k, v)| (k, v)));
            self.commands.push((service.name, command_line(&cmd)));
            let proc = Proc::spawn(service.name, &mut cmd, log);
            let what = format!("{} to be ready", service.name);
            eventually(&what, Duration::from_secs(60), || async {
                assert!(
                    proc.alive(),
                    "{} exited during start-up:\n{}",
                    service.name,
                    proc.log()
                );
                match &service.ready {
                    Ready::Http(url) => self.answers_200(url).await,
                    Ready::Listening(port) => {
                        tokio::net::TcpStream::connect(crate::addr(*port)).await.is_ok()
                    }
                }
            })
            .await;
            self.services.push(proc);
        }
        self.options.services = services;
    }

    /// Every process asked to stop (SIGTERM: Envoy first, then the stores,
    /// then the services) and given `within` to exit before it is killed.
    pub async fn stop(mut self, within: Duration) {
        for proc in self.processes() {
            if proc.alive() {
                super::signal(proc, "-TERM");
            }
        }
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline && self.processes().any(Proc::alive) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill_envoy();
        for i in 0..self.stores.len() {
            self.kill_store(i);
        }
        self.services.clear();
    }

    /// Every process of the stack that is running or was started last.
    pub fn processes(&self) -> impl Iterator<Item = &Proc> {
        (self.envoy.iter())
            .chain(self.stores.iter().filter_map(|r| r.proc.as_ref()))
            .chain(self.services.iter())
    }
}

/// `cmd` as a shell would run it: its environment first, paths under the
/// working directory relative to it, each word quoted where it must be.
pub fn command_line(cmd: &Command) -> String {
    let cwd = std::env::current_dir().unwrap_or_default();
    let word = |w: &std::ffi::OsStr| {
        let w = w.to_string_lossy();
        let w = w
            .strip_prefix(&format!("{}/", cwd.display()))
            .unwrap_or(&w)
            .to_string();
        quote(&w)
    };
    let env = cmd.get_envs().filter_map(|(k, v)| {
        let v = v?;
        Some(format!("{}={}", k.to_string_lossy(), word(v)))
    });
    let words = std::iter::once(word(cmd.get_program())).chain(cmd.get_args().map(word));
    env.chain(words).collect::<Vec<_>>().join(" ")
}

fn quote(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:=@,+%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}
