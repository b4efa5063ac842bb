//! Real SDKs against the demo's configuration: `envoy/demo.yaml` (JWT
//! identity, detached money movements, streaming orders) in front of the
//! demo's upstream (`examples/payments`), the real store and Envoy. The SDKs
//! are the ones applications use, from PyPI (`scripts/setup.sh` installs them
//! into `.tools/venv`): Stripe's Python SDK and `increase`, a
//! Stainless-generated client. Each makes one call with a 1 s timeout against
//! a 2.5 s handler and retries on its own with an `Idempotency-Key` of its
//! own; the scripts under `tests/sdks/` make the call and report every
//! attempt.
//!
//! `IDEMGATE_PYTHON` names the interpreter (default `.tools/venv/bin/python`).

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use e2e::stack::{Database, Options, Stack};
use payments::{token, Counts, Ledger};
use serde_json::Value;

/// The store token of `envoy/demo.yaml`.
const DEMO_API_TOKEN: &str = "demo-api-token";
/// Longer than the handler: the first attempt of every call times out.
const HANDLER_MS: &str = "2500";
const SUBJECT: &str = "alice";

/// The demo's stack, with its upstream in this process so its books can be read.
struct Demo {
    stack: Stack,
    ledger: Ledger,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Demo {
    async fn start() -> Demo {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let ledger = Ledger::default();
        let server = tokio::spawn(payments::serve(listener, ledger.clone(), std::future::pending()));
        let mut options = Options::new("envoy/demo.yaml", Database::Sqlite, 1);
        options.api_token = DEMO_API_TOKEN;
        options.upstream_port = Some(port);
        Demo {
            stack: Stack::start(options).await,
            ledger,
            server,
        }
    }

    /// What the upstream executed for `tenant`.
    fn executed(&self, tenant: &str) -> Counts {
        self.ledger.executions().get(tenant).copied().unwrap_or_default()
    }

    /// A GET through Envoy as `tenant`: the upstream's own copy of an object.
    async fn get(&self, tenant: &str, path: &str) -> Value {
        let res = self
            .stack
            .client
            .get(self.stack.url(path))
            .bearer_auth(jwt(tenant))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "GET {path}");
        serde_json::from_slice(&res.bytes().await.unwrap()).unwrap()
    }

    /// The transitions of the key's generations, oldest first.
    async fn transitions(&self, tenant: &str, route: &str, key: &str) -> Vec<String> {
        let history = self.stack.history(tenant, SUBJECT, route, key).await.unwrap();
        history["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["transition"].as_str().unwrap().to_string())
            .collect()
    }

    /// Runs `tests/sdks/<script>` as `tenant`'s client against this stack.
    async fn sdk(&self, tenant: &str, script: &str, args: &[&str]) -> Call {
        let mut command = tokio::process::Command::new(e2e::python());
        command
            .arg(e2e::repo_root().join("tests/sdks").join(script))
            .args(args)
            .env("IDEMGATE_URL", self.stack.url(""))
            .env("IDEMGATE_TOKEN", jwt(tenant))
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .unwrap_or_else(|_| panic!("{script} ran for more than 60 s"))
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/setup.sh)", e2e::python().display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{script} failed ({}); is scripts/setup.sh's venv there?\n{stdout}\n{stderr}",
            out.status
        );
        let report = stdout.lines().last().unwrap_or_default();
        let report: Value = serde_json::from_str(report)
            .unwrap_or_else(|e| panic!("{script} printed no report ({e}):\n{stdout}\n{stderr}"));
        Call(report)
    }
}

/// A demo token for `tenant` (subject alice): what the SDKs send as their API key.
fn jwt(tenant: &str) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    token::mint(
        &token::demo_key().unwrap(),
        tenant,
        SUBJECT,
        now,
        token::FAR_FUTURE,
    )
}

/// What a script reported about its one call.
#[derive(Debug)]
struct Call(Value);

impl Call {
    fn outcome(&self) -> &str {
        self.0["outcome"].as_str().unwrap_or_default()
    }
    fn status(&self) -> u64 {
        self.0["status"].as_u64().unwrap_or_default()
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.0["headers"][name].as_str()
    }
    fn body(&self) -> &Value {
        &self.0["body"]
    }
    /// (Idempotency-Key, status; `None`: timed out) of every request sent.
    fn attempts(&self) -> Vec<(String, Option<u64>)> {
        self.0["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["key"].as_str().unwrap_or_default().to_string(),
                    a["status"].as_u64(),
                )
            })
            .collect()
    }

    /// The key every attempt carried: one key, sent on each retry. The first
    /// attempt timed out; every later one but the last was told the request
    /// was in progress (or, after the timeout, that its outcome is unknown).
    fn one_key(&self) -> String {
        let attempts = self.attempts();
        assert!(attempts.len() >= 2, "the client never retried: {self:?}");
        let key = attempts[0].0.clone();
        assert!(!key.is_empty(), "the SDK sent no Idempotency-Key: {self:?}");
        assert!(
            attempts.iter().all(|(k, _)| *k == key),
            "the retries changed the key: {self:?}"
        );
        assert_eq!(attempts[0].1, None, "the first attempt should time out: {self:?}");
        for (_, status) in &attempts[1..attempts.len() - 1] {
            assert_eq!(*status, Some(409), "{self:?}");
        }
        key
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stainless_client_that_times_out_gets_the_original_payment_on_retry() {
    let demo = Demo::start().await;
    let tenant = "sdk-stainless";
    let call = demo
        .sdk(
            tenant,
            "stainless_payment.py",
            &[
                "/v1/payments",
                HANDLER_MS,
                r#"{"amount": 4200, "currency": "EUR"}"#,
            ],
        )
        .await;
    assert_eq!((call.outcome(), call.status()), ("answered", 201), "{call:?}");
    assert_eq!(call.header("idempotent-replayed"), Some("true"), "{call:?}");
    let key = call.one_key();
    assert!(key.starts_with("stainless-python-retry-"), "{call:?}");
    // The upstream's original answer, executed once.
    let id = call.body()["id"].as_str().unwrap();
    assert_eq!(call.body()["amount"], 4200);
    assert_eq!(
        call.header("location"),
        Some(format!("/v1/payments/{id}").as_str())
    );
    assert_eq!(
        *call.body(),
        demo.get(tenant, &format!("/v1/payments/{id}")).await
    );
    assert_eq!(demo.executed(tenant).payments, 1);
    assert_eq!(
        demo.transitions(tenant, "payments.create", &key).await,
        ["claimed", "completed"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stripes_sdk_that_times_out_gets_the_original_payment_intent_on_retry() {
    let demo = Demo::start().await;
    let tenant = "sdk-stripe";
    let call = demo
        .sdk(tenant, "stripe_payment_intent.py", &["4200", HANDLER_MS])
        .await;
    assert_eq!((call.outcome(), call.status()), ("answered", 200), "{call:?}");
    assert_eq!(call.header("idempotent-replayed"), Some("true"), "{call:?}");
    let key = call.one_key();
    // The SDK parsed the upstream's original object.
    let id = call.body()["id"].as_str().unwrap();
    assert!(id.starts_with("pi_"), "{call:?}");
    assert_eq!(
        call.0["object"],
        serde_json::json!({"id": id, "object": "payment_intent", "amount": 4200})
    );
    assert_eq!(
        *call.body(),
        demo.get(tenant, &format!("/v1/payment_intents/{id}")).await
    );
    assert_eq!(demo.executed(tenant).payments, 1);
    assert_eq!(
        demo.transitions(tenant, "payment_intents.create", &key).await,
        ["claimed", "completed"]
    );
}

/// The same Stainless call on a streaming route (orders): the client's
/// timeout ends the upstream request with it, nothing can record its answer,
/// and the retry learns that the outcome is unknown, which the SDK does not
/// retry (`x-should-retry: false`): it raises `ConflictError`.
#[tokio::test(flavor = "multi_thread")]
async fn on_a_streaming_route_the_same_stainless_call_ends_in_outcome_unknown() {
    let demo = Demo::start().await;
    let tenant = "sdk-streaming";
    let call = demo
        .sdk(
            tenant,
            "stainless_payment.py",
            &["/v1/orders", HANDLER_MS, r#"{"items": ["book"]}"#],
        )
        .await;
    assert_eq!(
        (call.outcome(), call.status()),
        ("ConflictError", 409),
        "{call:?}"
    );
    assert_eq!(
        call.body()["type"],
        "https://idemgate.dev/problems/outcome-unknown",
        "{call:?}"
    );
    assert_eq!(call.header("x-should-retry"), Some("false"), "{call:?}");
    let key = call.one_key();
    assert_eq!(call.attempts().last().unwrap().1, Some(409));
    assert_eq!(demo.executed(tenant).orders, 1);
    assert_eq!(
        demo.transitions(tenant, "orders.create", &key).await,
        ["claimed", "marked_unknown"]
    );
}
