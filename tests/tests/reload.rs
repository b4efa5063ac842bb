//! A configuration push while work is in flight, through the real Envoy. The
//! listener, and the filter's configuration in it, come from a file Envoy
//! watches (`envoy/reload.yaml`: LDS over the filesystem); replacing it with
//! a changed policy makes Envoy build the filter chain anew and, once the old
//! chain has drained (`--drain-time-s`), let the old configuration's root
//! context go. What outlives its requests is that root's: a detached request
//! whose client left (the filter's own upstream callout), and a settlement
//! the store has not confirmed yet (a letter). Both must finish after the
//! push, not be cancelled with the root: the retry replays, the upstream ran
//! once, and no record is left in progress.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, fresh_key, send, Answer, Ports};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
/// Where `envoy/reload.yaml` reads its listener from.
const LDS_DIR: &str = "/etc/envoy/lds";
/// The old filter chain drains this long before Envoy lets it go.
const DRAIN_SECONDS: &str = "1";

/// Writes the listener of `envoy/reload.yaml` (ports and wasm path of this
/// stack, then changed by `edit`) into the watched directory, by an atomic
/// rename as a control plane's file sync does.
fn push(stack: &Stack, lds: &Path, edit: impl FnOnce(String) -> String) {
    let ports = Ports {
        listener: stack.port,
        admin: stack.admin_port,
        upstream: stack.upstream.addr.port(),
    };
    let listener = edit(e2e::bootstrap("envoy/_reload-listener.yaml", &ports));
    let next = lds.with_file_name("listeners.yaml.next");
    std::fs::write(&next, listener).unwrap();
    std::fs::rename(&next, lds.join("listeners.yaml")).unwrap();
}

async fn stat(stack: &Stack, name: &str) -> u64 {
    let text = stack.admin_text(&format!("/stats?filter=^{name}$")).await;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Retries until the answer is no longer `409 request-in-progress`, or
/// `within` passed: then the last answer, for the report.
async fn settle(req: impl Fn() -> reqwest::RequestBuilder, within: Duration) -> Answer {
    let until = std::time::Instant::now() + within;
    loop {
        let a = send(req()).await;
        let in_progress = a.status == 409 && a.problem().as_deref() == Some("request-in-progress");
        if !in_progress || std::time::Instant::now() > until {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pay(stack: &Stack, path: &str, key: &str, delay_ms: u64) -> reqwest::RequestBuilder {
    stack
        .post(path, Some(key), PAYMENT)
        .header("x-test-delay-ms", delay_ms.to_string())
}

/// The stack of `envoy/reload.yaml`, its listener directory (no listener
/// until the stack's ports are known: [`push`] writes it) and the directory
/// to keep alive meanwhile.
async fn start() -> (Stack, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let lds: PathBuf = dir.path().join("lds");
    std::fs::create_dir(&lds).unwrap();
    std::fs::write(lds.join("listeners.yaml"), "resources: []\n").unwrap();
    let mut options = Options::new("envoy/reload.yaml", Database::Sqlite, 1);
    let lds_path = lds.display().to_string();
    options.edit = Some(Box::new(move |config| config.replace(LDS_DIR, &lds_path)));
    options.envoy_args = vec!["--drain-time-s".into(), DRAIN_SECONDS.into()];
    (Stack::start(options).await, lds, dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_configuration_push_finishes_what_outlives_the_requests() {
    let (stack, lds, _dir) = start().await;
    push(&stack, &lds, |l| l);
    eventually("the listener to serve", Duration::from_secs(20), || async {
        stack.client.get(stack.url("/")).send().await.is_ok()
    })
    .await;

    // A detached request whose client gives up while the upstream works.
    let detached = fresh_key("reload-detached");
    let gone = pay(&stack, "/detached/pay", &detached, 6_000)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gone.is_err(), "the client should have given up: {gone:?}");
    eventually(
        "the detached request upstream",
        Duration::from_secs(5),
        || async { stack.upstream.executions(&detached) == 1 },
    )
    .await;

    // A completion settled in the background while the store is frozen:
    // it waits as a letter.
    let background = fresh_key("reload-background");
    let answered = tokio::spawn(send(pay(&stack, "/background/pay", &background, 1_500)));
    eventually(
        "the background request upstream",
        Duration::from_secs(5),
        || async { stack.upstream.executions(&background) == 1 },
    )
    .await;
    stack.signal_store(0, true);
    let answered = answered.await.unwrap();
    assert_eq!(answered.status, 201, "{answered:?}");

    // The push: one policy's harmless field changes, so the plugin
    // configuration (and its root context) is a new one.
    push(&stack, &lds, |l| l.replace("65536", "65537"));
    eventually("the listener update", Duration::from_secs(10), || async {
        stat(&stack, "listener_manager.listener_modified").await == 1
    })
    .await;
    // The old chain drains, and Envoy lets the old configuration go, while
    // the store is still frozen and the upstream still working.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stack.signal_store(0, false);

    let mut failed = Vec::new();
    for (label, path, key, route) in [
        ("detached", "/detached/pay", &detached, "payments.detached"),
        (
            "background",
            "/background/pay",
            &background,
            "payments.background",
        ),
    ] {
        let retried = settle(|| pay(&stack, path, key, 0), Duration::from_secs(15)).await;
        if retried.status != 201 || retried.header("idempotent-replayed") != Some("true") {
            failed.push(format!("{label}: the retry was not a replay: {retried:?}"));
        }
        if stack.upstream.executions(key) != 1 {
            failed.push(format!(
                "{label}: the upstream ran {} times",
                stack.upstream.executions(key)
            ));
        }
        let transitions = stack.transitions("tenant-a", "alice", route, key).await;
        if transitions != ["claimed", "completed"] {
            failed.push(format!("{label}: the record went {transitions:?}"));
        }
    }
    let log = stack.envoy_log();
    for line in log
        .lines()
        .filter(|l| l.contains("replaced configuration") || l.contains("configuration replaced"))
    {
        eprintln!("{line}");
    }
    for line in [
        "configuration replaced: finishing",
        "a replaced configuration finished its detached requests and letters",
    ] {
        if !log.contains(line) {
            failed.push(format!("Envoy's log lacks {line:?}"));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// The stat of `policy`'s info gauge for `mode`.
fn info(mode: &str, policy: &str) -> String {
    format!("wasmcustom.idemgate.policy_info.mode.{mode}.policy.{policy}")
}

/// A policy that a push renames reads 0 in every mode once the
/// configuration that named it is let go, and its new name reads 1 in its
/// mode: a dashboard shows no policy that nothing enforces or observes.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_that_renames_a_policy_zeroes_the_old_names_info_gauge() {
    let (stack, lds, _dir) = start().await;
    push(&stack, &lds, |l| l);
    eventually("the policy's gauge", Duration::from_secs(20), || async {
        stat(&stack, &info("enforce", "payments.create")).await == 1
    })
    .await;
    push(&stack, &lds, |l| {
        l.replace(r#""name": "payments.create""#, r#""name": "payments.renamed""#)
    });
    eventually("the old name's gauges at 0", Duration::from_secs(30), || async {
        stat(&stack, &info("enforce", "payments.renamed")).await == 1
            && stat(&stack, &info("enforce", "payments.create")).await == 0
            && stat(&stack, &info("observe", "payments.create")).await == 0
    })
    .await;
}

/// The info gauges follow a push: a policy switched to observe mode shows
/// as observed (and no longer enforced) once Envoy has built the new chain.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_that_flips_a_policys_mode_flips_its_info_gauge() {
    let (stack, lds, _dir) = start().await;
    let info = |mode: &str| info(mode, "payments.create");
    push(&stack, &lds, |l| l);
    eventually("the enforced policy's gauge", Duration::from_secs(20), || async {
        stat(&stack, &info("enforce")).await == 1 && stat(&stack, &info("observe")).await == 0
    })
    .await;
    let version = format!(
        "wasmcustom.idemgate.build_info.version.{}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(stat(&stack, &version).await, 1);
    push(&stack, &lds, |l| {
        l.replace(
            r#""max_request_body": 65536"#,
            r#""max_request_body": 65536, "mode": "observe""#,
        )
    });
    eventually("the observed policy's gauge", Duration::from_secs(20), || async {
        stat(&stack, &info("enforce")).await == 0 && stat(&stack, &info("observe")).await == 1
    })
    .await;
}

/// A push that brings a new VM (a new module, or here a new `vm_id`) keeps
/// the same policy's gauge at 1 once the old VM's configuration is let go:
/// the old VM retiring its names does not zero what the new one set.
#[tokio::test(flavor = "multi_thread")]
async fn a_push_that_brings_a_new_vm_keeps_the_policys_info_gauge() {
    let (stack, lds, _dir) = start().await;
    let enforced = info("enforce", "payments.create");
    push(&stack, &lds, |l| l);
    eventually("the policy's gauge", Duration::from_secs(20), || async {
        stat(&stack, &enforced).await == 1
    })
    .await;
    let (created, active) = (
        "wasm.envoy.wasm.runtime.v8.created",
        "wasm.envoy.wasm.runtime.v8.active",
    );
    let (vms_created, vms_active) = (stat(&stack, created).await, stat(&stack, active).await);
    push(&stack, &lds, |l| {
        l.replace("vm_id: idemgate", "vm_id: idemgate-next")
    });
    // The new VMs start with the new chain; the old ones go once it drained.
    eventually("the old VMs let go", Duration::from_secs(30), || async {
        stat(&stack, created).await > vms_created && stat(&stack, active).await == vms_active
    })
    .await;
    assert_eq!(stat(&stack, &enforced).await, 1);
}
