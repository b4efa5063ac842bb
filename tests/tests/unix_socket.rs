//! The store on a Unix domain socket, reached by Envoy through a `pipe`
//! address: the same contract with no TCP between the two on one host.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, fresh_key, send, Proc, ADMIN_TOKEN, API_TOKEN};

#[tokio::test(flavor = "multi_thread")]
async fn envoy_reaches_a_store_listening_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("store.sock");
    let bin = std::env::var("IDEMGATE_STORE_BIN").unwrap_or_else(|_| "target/debug/idempotency-store".into());
    let store = Proc::spawn(
        "uds-store",
        std::process::Command::new(bin)
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .args([
                "--database-url",
                &format!("sqlite://{}", dir.path().join("uds.db").display()),
            ])
            .args(["--api-token", API_TOKEN, "--admin-token", ADMIN_TOKEN]),
        dir.path().join("uds-store.log"),
    );
    eventually("the store's socket", Duration::from_secs(20), || async {
        socket.exists()
    })
    .await;
    let pipe = format!(
        "{{endpoint: {{address: {{pipe: {{path: {}}}}}}}}}",
        socket.display()
    );
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(move |config: String| {
        // Envoy's store cluster points at the socket only.
        let start = config.find("cluster_name: idempotency_store").unwrap();
        let (head, tail) = config.split_at(start);
        let tail = tail.replacen(
            &tail[tail.find("{endpoint:").unwrap()..tail.find("}}}}").unwrap() + 4],
            &pipe,
            1,
        );
        format!("{head}{tail}")
    }));
    let stack = Stack::start(options).await;
    let k = fresh_key("uds");
    let first = send(stack.post("/pay", Some(&k), "{}")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let replay = send(stack.post("/pay", Some(&k), "{}")).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.executions(&k), 1);
    // The record is in the socket's store, not in the stack's TCP replica.
    let db = rusqlite::Connection::open(dir.path().join("uds.db")).unwrap();
    let completed: i64 = db
        .query_row(
            "SELECT count(*) FROM idempotency_records WHERE state = 'completed'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(completed, 1);
    assert_eq!(
        stack.records("tenant-a", "alice", "payments.create", &k).await,
        Some(vec![])
    );
    drop(store);
}
