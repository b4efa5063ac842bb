//! gRPC unary calls through the real Envoy (`envoy/grpc.yaml`) with the
//! real store, between a real gRPC server and a real gRPC client: Python's
//! `grpcio` from PyPI (`examples/ledger/ledger.py`, installed into the venv by
//! `scripts/setup.sh`). The client reads every answer as an application
//! would: status, message, metadata, and `google.rpc.Status` details.
//!
//! `IDEMGATE_PYTHON` names the interpreter (default `.tools/venv/bin/python`).

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, Proc};
use serde_json::Value;

/// gRPC status codes the tests expect.
const OK: u64 = 0;
const UNKNOWN: u64 = 2;
const INVALID_ARGUMENT: u64 = 3;
const NOT_FOUND: u64 = 5;
const ALREADY_EXISTS: u64 = 6;
const FAILED_PRECONDITION: u64 = 9;
const ABORTED: u64 = 10;
const UNAVAILABLE: u64 = 14;

struct Ledger {
    stack: Stack,
    _server: Proc,
}

impl Ledger {
    async fn start() -> Ledger {
        Ledger::serving(&[]).await
    }

    /// The ledger started with `ledger.py serve`'s options, e.g. `--compress gzip`.
    async fn serving(options: &[&str]) -> Ledger {
        let port = e2e::free_port();
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("ledger.log");
        let server = Proc::spawn(
            "ledger",
            Command::new(e2e::python())
                .arg(script())
                .args(["serve", &port.to_string()])
                .args(options),
            log.clone(),
        );
        e2e::eventually("the gRPC ledger listens", Duration::from_secs(20), || {
            let log = log.clone();
            async move { std::fs::read_to_string(&log).is_ok_and(|l| l.contains("listening")) }
        })
        .await;
        std::mem::forget(dir);
        let mut options = Options::new("envoy/grpc.yaml", Database::Sqlite, 1);
        options.upstream_port = Some(port);
        Ledger {
            stack: Stack::start(options).await,
            _server: server,
        }
    }

    /// Runs `ledger.py call` against Envoy; one JSON answer per call made.
    async fn call(&self, args: &[&str]) -> Vec<Value> {
        let target = format!("127.0.0.1:{}", self.stack.port);
        let mut command = tokio::process::Command::new(e2e::python());
        command
            .arg(script())
            .args(["call", &target])
            .args(args)
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .unwrap_or_else(|_| panic!("ledger.py call {args:?} ran for more than 60 s"))
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/setup.sh)", e2e::python().display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "ledger.py call {args:?} failed:\n{stdout}\n{stderr}"
        );
        stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    async fn one(&self, key: &str, body: &str) -> Value {
        self.call(&["--key", key, "--body", body]).await.remove(0)
    }

    /// How often the upstream ran `key`.
    async fn executions(&self, key: &str) -> u64 {
        self.call(&["--executions", key]).await[0]["executions"]
            .as_u64()
            .unwrap()
    }
}

fn script() -> PathBuf {
    e2e::repo_root().join("examples/ledger/ledger.py")
}

fn metadata<'a>(answer: &'a Value, part: &str, name: &str) -> Option<&'a str> {
    answer[part]
        .as_array()?
        .iter()
        .find(|pair| pair[0] == name)
        .and_then(|pair| pair[1].as_str())
}

fn reason(answer: &Value) -> &str {
    assert_eq!(answer["error"]["domain"], "idemgate.dev", "{answer}");
    answer["error"]["reason"].as_str().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_call_runs_once_and_its_replay_reads_as_the_original() {
    let ledger = Ledger::start().await;
    let key = fresh_key("grpc-replay");
    let first = ledger.one(&key, "amount=100").await;
    assert_eq!(first["code"], OK, "{first}");
    assert_eq!(first["text"], "executed 1 for amount=100");
    let retry = ledger.one(&key, "amount=100").await;
    assert_eq!(retry["code"], OK, "{retry}");
    assert_eq!(
        retry["message"], first["message"],
        "the same message, byte for byte"
    );
    assert_eq!(retry["details"], first["details"]);
    assert_eq!(metadata(&retry, "initial", "idempotent-replayed"), Some("true"));
    assert_eq!(metadata(&retry, "initial", "x-ledger-entry"), Some("entry-1"));
    assert_eq!(
        metadata(&retry, "trailing", "x-ledger-trailer"),
        Some("trailer-1")
    );
    assert_eq!(metadata(&first, "initial", "x-unlisted"), Some("u"));
    assert_eq!(
        metadata(&retry, "initial", "x-unlisted"),
        None,
        "only listed metadata is replayed"
    );
    assert_eq!(ledger.executions(&key).await, 1);

    let other = ledger.one(&key, "amount=999").await;
    assert_eq!(other["code"], FAILED_PRECONDITION, "{other}");
    assert_eq!(reason(&other), "KEY_REUSED");
    assert_eq!(ledger.executions(&key).await, 1);

    let missing = ledger.call(&["--body", "amount=1"]).await.remove(0);
    assert_eq!(missing["code"], INVALID_ARGUMENT, "{missing}");
    assert_eq!(reason(&missing), "KEY_MISSING");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compressed_answer_replays_as_readably_as_it_first_came() {
    let ledger = Ledger::serving(&["--compress", "gzip"]).await;
    let key = fresh_key("grpc-gzip");
    // Long enough to compress: gRPC sends a message that gzip would not
    // shrink as it is, with the compressed flag off.
    let body = format!("amount=100;memo={}", "x".repeat(2000));
    let first = ledger.one(&key, &body).await;
    assert_eq!(first["code"], OK, "{first}");
    assert_eq!(first["text"], format!("executed 1 for {body}"));
    let retry = ledger.one(&key, &body).await;
    assert_eq!(retry["code"], OK, "{retry}");
    assert_eq!(retry["message"], first["message"], "the same message");
    assert_eq!(metadata(&retry, "initial", "idempotent-replayed"), Some("true"));
    assert_eq!(ledger.executions(&key).await, 1);
    // Stored as the server sent it: compressed, with its encoding.
    let record = ledger
        .stack
        .current_record("acme", "*", "ledger.transfer", &key)
        .await;
    assert!(
        record["headers"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!(["grpc-encoding", "gzip"])),
        "{record}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_duplicates_run_once_and_the_others_are_told_to_retry() {
    let ledger = Ledger::start().await;
    let key = fresh_key("grpc-concurrent");
    let answers = ledger
        .call(&["--key", &key, "--body", "sleep=1500", "--parallel", "4"])
        .await;
    let ok: Vec<_> = answers.iter().filter(|a| a["code"] == OK).collect();
    assert_eq!(ok.len(), 1, "{answers:?}");
    for other in answers.iter().filter(|a| a["code"] != OK) {
        assert_eq!(other["code"], ABORTED, "{other}");
        assert_eq!(reason(other), "REQUEST_IN_PROGRESS");
        assert!(other["error"]["retry_ms"].as_u64().unwrap() > 0, "{other}");
    }
    assert_eq!(ledger.executions(&key).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_while_the_server_acts_leaves_the_outcome_unknown() {
    let ledger = Ledger::start().await;
    let key = fresh_key("grpc-deadline");
    let first = ledger
        .call(&["--key", &key, "--body", "sleep=2500", "--timeout", "1"])
        .await
        .remove(0);
    assert_ne!(first["code"], OK, "{first}");
    // The handler finishes on its own; nobody can say the client saw it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let retry = ledger.one(&key, "sleep=2500").await;
    assert_eq!(retry["code"], UNKNOWN, "{retry}");
    assert_eq!(reason(&retry), "OUTCOME_UNKNOWN");
    assert_eq!(ledger.executions(&key).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn refused_before_acting_releases_and_acted_then_failed_replays() {
    let ledger = Ledger::start().await;
    for (refusal, code) in [("refuse=3", INVALID_ARGUMENT), ("refuse=5", NOT_FOUND)] {
        let key = fresh_key("grpc-released");
        let refused = ledger.one(&key, refusal).await;
        assert_eq!(refused["code"], code, "{refused}");
        let fixed = ledger.one(&key, "amount=100").await;
        assert_eq!(fixed["code"], OK, "{refusal} released the key: {fixed}");
        assert_eq!(ledger.executions(&key).await, 1);
    }
    // The server says in its trailers that it acted though its status
    // says otherwise: stored, and the control trailer never reaches the client.
    let key = fresh_key("grpc-control");
    let refused = ledger.one(&key, "code=3;control=store").await;
    assert_eq!(refused["code"], INVALID_ARGUMENT, "{refused}");
    assert_eq!(metadata(&refused, "trailing", "idempotency-control"), None);
    let retry = ledger.one(&key, "amount=100").await;
    assert_eq!(retry["code"], FAILED_PRECONDITION, "another request: {retry}");
    let retry = ledger.one(&key, "code=3;control=store").await;
    assert_eq!(retry["code"], INVALID_ARGUMENT, "{retry}");
    assert_eq!(ledger.executions(&key).await, 1);
    assert_eq!(metadata(&retry, "initial", "idempotent-replayed"), Some("true"));
    assert_eq!(metadata(&retry, "trailing", "idempotency-control"), None);

    let key = fresh_key("grpc-failed");
    let failed = ledger.one(&key, "code=6").await;
    assert_eq!(failed["code"], ALREADY_EXISTS, "{failed}");
    let retry = ledger.one(&key, "code=6").await;
    assert_eq!(retry["code"], ALREADY_EXISTS, "{retry}");
    assert_eq!(retry["details"], "acted, then failed: 1");
    assert_eq!(metadata(&retry, "initial", "idempotent-replayed"), Some("true"));
    assert_eq!(ledger.executions(&key).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_store_is_unavailable_and_nothing_runs() {
    let mut ledger = Ledger::start().await;
    ledger.stack.kill_store(0);
    let key = fresh_key("grpc-store-down");
    let answer = ledger.one(&key, "amount=100").await;
    assert_eq!(answer["code"], UNAVAILABLE, "{answer}");
    assert_eq!(reason(&answer), "STORE_UNAVAILABLE");
    assert_eq!(ledger.executions(&key).await, 0);
}
