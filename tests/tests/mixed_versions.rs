//! Upgrades one piece at a time, through real Envoy: the previous release's
//! filter and store (built from history by scripts/previous-release.sh,
//! found through `IDEMGATE_PREVIOUS`) next to this build's, in both mixed
//! pairs, on the same database.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use e2e::stack::{Database, Options, Stack};
use e2e::{env_path, fresh_key, send, wasm_path};

/// The previous release's filter module and store binary.
fn previous() -> (PathBuf, PathBuf) {
    let dir = std::env::var("IDEMGATE_PREVIOUS").unwrap_or_else(|_| {
        panic!("IDEMGATE_PREVIOUS is not set: run scripts/previous-release.sh and point it at the directory it prints (make test does)")
    });
    let dir = PathBuf::from(dir);
    let (wasm, store) = (dir.join("idemgate.wasm"), dir.join("idempotency-store"));
    assert!(
        wasm.exists() && store.exists(),
        "{} lacks idemgate.wasm or idempotency-store",
        dir.display()
    );
    (wasm, store)
}

fn current_store() -> PathBuf {
    env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store")
}

/// What a client sees from one key: executed once with its first request,
/// replayed with the same body, refused with another; on a streaming and
/// on a detached route. Returns the keys, for later replays.
async fn exercise(stack: &Stack, label: &str) -> Vec<(&'static str, String, String)> {
    let mut made = Vec::new();
    for path in ["/pay", "/detached/pay"] {
        let key = fresh_key(label);
        let body = format!(r#"{{"amount": 100, "label": "{label}"}}"#);
        let first = send(stack.post(path, Some(&key), &body)).await;
        assert_eq!(first.status, 201, "{label} {path}: {first:?}");
        let replay = send(stack.post(path, Some(&key), &body)).await;
        assert_eq!(replay.status, 201, "{label} {path}: {replay:?}");
        assert_eq!(
            replay.header("idempotent-replayed"),
            Some("true"),
            "{label} {path}"
        );
        assert_eq!(replay.body, first.body, "{label} {path}");
        let other = send(stack.post(path, Some(&key), r#"{"amount": 999}"#)).await;
        assert_eq!(
            other.problem().as_deref(),
            Some("key-reused"),
            "{label} {path}: {other:?}"
        );
        assert_eq!(stack.upstream.executions(&key), 1, "{label} {path}");
        made.push((path, key, body));
    }
    // Many new keys at once: the filter batches its store calls.
    let keys: Vec<String> = (0..24).map(|i| fresh_key(&format!("{label}-burst{i}"))).collect();
    let burst: Vec<_> = keys
        .iter()
        .map(|k| tokio::spawn(send(stack.post("/pay", Some(k), "{}"))))
        .collect();
    for (k, answer) in keys.iter().zip(burst) {
        let a = answer.await.unwrap();
        assert_eq!(a.status, 201, "{label} burst {k}: {a:?}");
        assert_eq!(stack.upstream.executions(k), 1, "{label} burst {k}");
    }
    made
}

/// Keys made earlier replay, whoever made them.
async fn replays(stack: &Stack, label: &str, keys: &[(&'static str, String, String)]) {
    for (path, key, body) in keys {
        let again = send(stack.post(path, Some(key), body)).await;
        assert_eq!(again.status, 201, "{label} {path}: {again:?}");
        assert_eq!(
            again.header("idempotent-replayed"),
            Some("true"),
            "{label} {path}"
        );
        assert_eq!(stack.upstream.executions(key), 1, "{label} {path}");
    }
}

/// The reference bootstrap without the policies that use settings added
/// since the previous release (a `canary`), which that release's filter
/// would refuse: an operator upgrades the filters before using them.
fn without_newer_policies(config: String) -> String {
    let mut out = Vec::new();
    let mut lines = config.lines();
    while let Some(line) = lines.next() {
        if line.contains(r#"{"name": "canary""#) {
            lines.next(); // the policy's second line
            continue;
        }
        out.push(line);
    }
    let config = out.join("\n") + "\n";
    assert!(!config.contains(r#""canary":"#), "a policy with a canary is left");
    config
}

/// The documented order: the store first (the old filters keep working
/// against it, on the migrated database), then the filters; a filter rolled
/// back still replays what the new one recorded.
async fn upgrade_in_order(database: Database) {
    let (old_wasm, old_store) = previous();
    let mut options = Options::new("envoy/e2e.yaml", database, 1);
    options.edit = Some(Box::new(without_newer_policies));
    options.wasm = Some(old_wasm.clone());
    options.store_bin = Some(old_store);
    let mut stack = Stack::start(options).await;
    let mut keys = exercise(&stack, "old-old").await;

    stack.replace_stores(current_store()).await;
    replays(&stack, "old filter, new store", &keys).await;
    keys.extend(exercise(&stack, "old-new").await);

    stack.replace_filter(wasm_path()).await;
    replays(&stack, "new filter, new store", &keys).await;
    keys.extend(exercise(&stack, "new-new").await);

    stack.replace_filter(old_wasm).await;
    replays(&stack, "filter rolled back", &keys).await;
    exercise(&stack, "rolled-back").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_then_the_filters_upgrade_without_an_outage_on_sqlite() {
    upgrade_in_order(Database::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_then_the_filters_upgrade_without_an_outage_on_postgresql() {
    upgrade_in_order(Database::Postgres).await;
}

/// The other mixed pair: a sidecar upgraded before the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_filter_works_against_the_previous_store() {
    let (_, old_store) = previous();
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.store_bin = Some(old_store);
    let stack = Stack::start(options).await;
    let keys = exercise(&stack, "new-old").await;
    replays(&stack, "new filter, old store", &keys).await;
}

/// Whether Envoy loads `config` (`--mode init_only`, beside the running
/// stack: its ports freed to the kernel's choice), and what it logged.
fn envoy_loads(stack: &Stack, config: &str) -> (bool, String) {
    let config = config
        .replace(&format!("port_value: {}", stack.port), "port_value: 0")
        .replace(&format!("port_value: {}", stack.admin_port), "port_value: 0");
    let path = stack.dir.path().join("init-only.yaml");
    std::fs::write(&path, config).unwrap();
    let out = std::process::Command::new(e2e::envoy_bin())
        .args([
            "--mode",
            "init_only",
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "-c",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.success(), log)
}

/// A module rolled back across a setting it does not know (docs/rollout.md,
/// "Roll back"): the previous release's filter refuses a configuration with
/// a `canary`, so Envoy would not load the pair (at start it exits; a pushed
/// update is rejected and the newer module keeps running). The
/// configuration goes back first, then the module, without an outage, and
/// what the newer module recorded still replays.
#[tokio::test(flavor = "multi_thread")]
async fn a_module_rolled_back_across_a_new_setting_takes_its_configuration_back_first() {
    let (old_wasm, _) = previous();
    let mut stack = Stack::start(Options::new("envoy/e2e.yaml", Database::Sqlite, 1)).await;
    assert!(
        stack.config().contains(r#""canary":"#),
        "the bootstrap has no canary to roll back across"
    );
    let mut keys = exercise(&stack, "newer-setting").await;

    let (from, to) = (
        format!("filename: {}", wasm_path().display()),
        format!("filename: {}", old_wasm.display()),
    );
    let (loads, log) = envoy_loads(&stack, &stack.config());
    assert!(loads, "the running pair does not load beside itself: {log}");
    let (loads, log) = envoy_loads(&stack, &stack.config().replace(&from, &to));
    assert!(!loads, "the previous module took a configuration with a canary");
    assert!(log.contains("unknown field `canary`"), "{log}");

    stack.replace_config(without_newer_policies).await;
    replays(&stack, "configuration rolled back", &keys).await;
    keys.extend(exercise(&stack, "configuration-rolled-back").await);
    stack.replace_filter(old_wasm).await;
    replays(&stack, "module rolled back", &keys).await;
    exercise(&stack, "module-rolled-back").await;
}
