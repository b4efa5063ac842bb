//! The reconciliation console in a real browser: a payment whose upstream
//! connection reset after it charged is `outcome-unknown` through the real
//! Envoy; an operator, signed in by the authenticating proxy in front of the
//! store (a stub here, setting `X-Forwarded-Email: alice@example.com` and
//! the proxy's secret), opens a console session in headless Chromium,
//! finds the record in the unknown list, opens it, stores the response the
//! bank confirms with a reason, and the client's retry through Envoy replays
//! that response. The history keeps the reason and names alice as the
//! actor; the same header sent straight to the store (not from the proxy)
//! is refused; no URL the browser was on and no log line of Envoy or the
//! store holds the key. A second run shows a session ending after 15 idle
//! minutes, the store's clock moved by libfaketime. The screenshots are the
//! ones docs/operations.md shows (`IDEMGATE_SCREENSHOTS=docs` writes them
//! there).

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::browser::Browser;
use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, free_port, fresh_key, repo_root, send, Answer, Proc, ADMIN_TOKEN, API_TOKEN};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

const OPERATOR: &str = "alice@example.com";
const PROXY_SECRET: &str = "e2e-proxy-secret-5f1c0d7e9a";

/// What an authenticating proxy such as oauth2-proxy does once it has
/// signed the operator in: forwards every request to the store with the
/// operator's identity and the proxy's shared secret, replacing whatever
/// the client sent in those headers.
struct StubProxy {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl StubProxy {
    async fn start(store_port: u16) -> StubProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = service_fn(move |req| forward(req, store_port));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        StubProxy { port, task }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

impl Drop for StubProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(req: Request<Incoming>, store_port: u16) -> Result<Response<Incoming>, hyper::Error> {
    let (mut parts, body) = req.into_parts();
    parts
        .headers
        .insert("x-forwarded-email", OPERATOR.parse().unwrap());
    parts
        .headers
        .insert("x-idemgate-proxy-secret", PROXY_SECRET.parse().unwrap());
    let stream = TcpStream::connect(("127.0.0.1", store_port)).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    sender.send_request(Request::from_parts(parts, body)).await
}

/// The store's arguments behind the stub proxy: the operator header is
/// believed only with the proxy's secret (no peer is trusted, so the
/// test's own connections to the store are not).
fn behind_proxy(dir: &Path) -> Vec<String> {
    let secret = dir.join("proxy-secret");
    std::fs::write(&secret, format!("{PROXY_SECRET}\n")).unwrap();
    vec![
        "--operator-proxy-secret-file".into(),
        secret.display().to_string(),
    ]
}

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const STORED: &str = r#"{"id":"pay_4200","status":"succeeded"}"#;
const REASON: &str =
    "Bank ledger shows charge ch_4200 succeeded; storing the answer the client should have had";

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_reconciles_an_unknown_payment_in_the_console() {
    let started = Instant::now();
    let secrets = tempfile::tempdir().unwrap();
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.store_args = behind_proxy(secrets.path());
    let stack = Stack::start(options).await;
    let proxy = StubProxy::start(stack.stores[0].port).await;
    let key = fresh_key("pay-console");

    // The upstream charges, then its connection resets: nobody knows.
    let first = send(
        stack
            .post("/pay", Some(&key), PAYMENT)
            .header("x-test-reset", "1"),
    )
    .await;
    assert!(first.status >= 500, "{first:?}");
    let retry = send(stack.post("/pay", Some(&key), PAYMENT)).await;
    assert_eq!(
        (retry.status, retry.problem().as_deref()),
        (409, Some("outcome-unknown")),
        "{retry:?}"
    );
    assert_eq!(stack.upstream.executions(&key), 1);

    let browser = Browser::start(stack.dir.path(), 1280, 1270).await;
    let console = |path: &str| proxy.url(path);
    let mut seen: Vec<String> = Vec::new();

    // Signing in: the console sends a browser without a session to its
    // login form, which names the operator the proxy signed in; no shared
    // credential is typed.
    browser.goto(&console("/admin/console/unknown")).await;
    browser.wait_for("form#sign-in").await;
    assert!(browser.url().await.ends_with("/admin/console/login"));
    let sign_in = browser.text("form#sign-in").await;
    assert!(sign_in.contains("Sign in as alice@example.com"), "{sign_in}");
    seen.push(browser.url().await);
    browser.click("form#sign-in button[type=submit]").await;
    browser.wait_for("form#search").await;
    assert_eq!(browser.text("nav .operator").await, OPERATOR);
    seen.push(browser.url().await);
    seen.extend(browser.addresses().await);

    // The unknown list has the record, with its age; Open posts its scope.
    browser.click("nav a[href='/admin/console/unknown']").await;
    let row = format!("//table[contains(@class, 'records')]//tr[td[contains(., '{key}')]]");
    browser.wait_for(&row).await;
    seen.push(browser.url().await);
    seen.extend(browser.addresses().await);
    let age = browser.text(&format!("{row}/td[1]")).await;
    assert!(age.ends_with('s'), "age {age:?}");
    let listed = browser.text(&row).await;
    assert!(
        listed.contains("tenant-a") && listed.contains("payments.create"),
        "{listed}"
    );
    browser.click(&format!("{row}//button")).await;
    browser.wait_for("form#complete").await;
    seen.push(browser.url().await);
    seen.extend(browser.addresses().await);

    // Its history so far: one generation, unknown; claimed, then marked unknown.
    let record = browser.text("section.record").await;
    assert!(record.contains(&key), "{record}");
    let events = browser.text("table.events").await;
    assert!(
        events.contains("claimed") && events.contains("marked_unknown"),
        "{events}"
    );
    assert!(!events.contains("resolved"));

    // The operator looked the charge up at the bank: it happened.
    browser.type_into("#status", "201").await;
    browser
        .type_into(
            "#headers",
            "content-type: application/json\nx-payment-id: pay_4200",
        )
        .await;
    browser.type_into("#body", STORED).await;
    browser.type_into("#complete-reason", REASON).await;
    browser
        .script("window.scrollTo(0, 0); document.activeElement.blur();")
        .await;
    let filled = browser.screenshot().await;
    browser.click("#complete button[type=submit]").await;
    browser.wait_for(".notice.ok").await;
    seen.push(browser.url().await);
    seen.extend(browser.addresses().await);
    let banner = browser.text(".notice.ok").await;
    assert!(banner.contains("completed with status 201"), "{banner}");
    // The history names the operator the proxy signed in.
    let resolved = browser.text("tr.event-resolved").await;
    assert!(
        resolved.contains(OPERATOR) && resolved.contains("complete") && resolved.contains(REASON),
        "{resolved}"
    );
    let state = browser.text("section.record h2 .badge").await;
    assert_eq!(state, "completed");
    let done = browser.screenshot().await;

    // The client's retry through Envoy replays what the operator stored.
    let replay = send(stack.post("/pay", Some(&key), PAYMENT)).await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("x-payment-id"), Some("pay_4200"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(&replay.body[..], STORED.as_bytes());
    assert_eq!(stack.upstream.executions(&key), 1, "executed once, ever");

    // The store's history keeps the reason with the operator's event.
    let history = stack
        .history("tenant-a", "alice", "payments.create", &key)
        .await
        .unwrap();
    let transitions: Vec<&str> = history["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["transition"].as_str().unwrap())
        .collect();
    assert_eq!(transitions, ["claimed", "marked_unknown", "resolved"]);
    let event = &history["events"][2];
    assert_eq!(
        (&event["actor"], &event["detail"], &event["reason"]),
        (&OPERATOR.into(), &"complete".into(), &REASON.into())
    );

    // The same header sent straight to the store, not by the proxy (no
    // secret; the test's address is no trusted peer): refused, by the
    // console and by the admin API, even with the admin credential.
    let direct = |path: &str| stack.store_url(0, path);
    let forged = stack
        .client
        .get(direct("/admin/console/login"))
        .header("x-forwarded-email", OPERATOR)
        .send()
        .await
        .unwrap();
    assert_eq!(forged.status(), 403);
    let page = forged.text().await.unwrap();
    assert!(
        page.contains("believed only from the trusted authenticating proxy"),
        "{page}"
    );
    let t = fresh_key("pay-forged");
    let first = send(stack.post("/pay", Some(&t), PAYMENT).header("x-test-reset", "1")).await;
    assert!(first.status >= 500, "{first:?}");
    let scope = serde_json::json!({ "version": "v1", "tenant": "tenant-a", "principal": "alice", "route": "payments.create", "namespace": "u", "key": t });
    let resolve = serde_json::json!({ "scope": scope, "action": "release", "reason": "forged" });
    for headers in [
        vec![("x-forwarded-email", OPERATOR)],
        vec![
            ("x-forwarded-email", OPERATOR),
            ("x-idemgate-proxy-secret", "a-guess"),
        ],
        vec![],
    ] {
        let mut req = stack
            .client
            .post(direct("/admin/v1/resolve"))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/json")
            .body(resolve.to_string());
        for (name, value) in &headers {
            req = req.header(*name, *value);
        }
        let answer = Answer::of(req.send().await.unwrap()).await;
        assert_eq!(
            (answer.status, answer.problem().as_deref()),
            (403, Some("forbidden")),
            "{headers:?}: {answer:?}"
        );
    }
    let transitions = stack
        .transitions("tenant-a", "alice", "payments.create", &t)
        .await;
    assert_eq!(transitions, ["claimed", "marked_unknown"], "nothing changed");
    // A reason is required, from the proxy too.
    let unreasoned = serde_json::json!({ "scope": scope, "action": "release" });
    let answer = Answer::of(
        stack
            .client
            .post(proxy.url("/admin/v1/resolve"))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/json")
            .body(unreasoned.to_string())
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (answer.status, answer.problem().as_deref()),
        (400, Some("bad-request")),
        "{answer:?}"
    );

    // Signing out ends the session: the console offers the sign-in again.
    browser.click("nav .logout button").await;
    browser.wait_for("form#sign-in").await;
    browser.goto(&console("/admin/console/unknown")).await;
    browser.wait_for("form#sign-in").await;
    assert!(browser.url().await.ends_with("/admin/console/login"));
    // Straight to the store, the browser names no operator: no form.
    browser.goto(&direct("/admin/console/login")).await;
    let refused = browser.text("main").await;
    assert!(refused.contains("names no operator"), "{refused}");

    // No key in any address the browser was on or was offered, nor in any
    // line Envoy or the store logged.
    assert!(seen.len() > 10, "{seen:?}");
    for url in &seen {
        assert!(!url.contains(&key), "a key in a URL: {url}");
    }
    let lines = stack.log_lines();
    assert!(lines.iter().any(|(_, l)| l.contains("resolved by an operator")));
    for (file, line) in &lines {
        assert!(!line.contains(&key), "a key in {file}: {line}");
        assert!(!line.contains(REASON), "a reason in {file}: {line}");
    }

    // What docs/operations.md shows: written under target/ (a run must not
    // change the tree it reports on); `IDEMGATE_SCREENSHOTS=docs` refreshes
    // the committed ones.
    let dir = repo_root()
        .join(std::env::var("IDEMGATE_SCREENSHOTS").unwrap_or_else(|_| "target/screenshots".into()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, png) in [("console.png", &filled), ("console-resolved.png", &done)] {
        assert!(png.starts_with(b"\x89PNG"), "{name} is no PNG");
        std::fs::write(dir.join(name), png).unwrap();
    }
    eprintln!(
        "console reconciliation through Envoy and Chromium: {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Debian's libfaketime (package `faketime`).
fn libfaketime() -> PathBuf {
    let found = std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.exists());
    found.unwrap_or_else(|| panic!("libfaketime not found: apt-get install faketime (scripts/setup.sh does)"))
}

/// A console session ends after 15 minutes without use. The store runs
/// under libfaketime, its offset read from a file at every clock call, so
/// the test moves the store's clocks (the monotonic one the sessions are
/// timed by included) while it runs instead of waiting.
#[tokio::test(flavor = "multi_thread")]
async fn a_console_session_ends_after_15_idle_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let offset = dir.path().join("faketime");
    std::fs::write(&offset, "+0").unwrap();
    let port = free_port();
    let bin = e2e::env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store");
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let mut serve = idemgate_testkit::store::serve(&bin, port, &db, API_TOKEN, ADMIN_TOKEN, "info");
    serve
        .args(behind_proxy(dir.path()))
        .env("LD_PRELOAD", libfaketime())
        .env("FAKETIME_TIMESTAMP_FILE", &offset)
        .env("FAKETIME_NO_CACHE", "1");
    let store = Proc::spawn("store", &mut serve, dir.path().join("store.log"));
    let client = reqwest::Client::new();
    let ready = format!("http://127.0.0.1:{port}/readyz");
    eventually("the store to be ready", Duration::from_secs(30), || async {
        matches!(client.get(&ready).send().await, Ok(r) if r.status() == 200)
    })
    .await;
    let proxy = StubProxy::start(port).await;
    let browser = Browser::start(dir.path(), 1024, 700).await;
    let unknown = proxy.url("/admin/console/unknown");

    browser.goto(&unknown).await;
    browser.click("form#sign-in button[type=submit]").await;
    browser.wait_for("form#search").await;
    let date = || async {
        let r = client.get(&ready).send().await.unwrap();
        let date = r.headers()["date"].to_str().unwrap().to_string();
        let out = std::process::Command::new("date")
            .args(["-d", &date, "+%s"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<i64>()
            .unwrap()
    };
    let before = date().await;

    // 14 minutes on: the session is alive, and using it keeps it so.
    std::fs::write(&offset, "+14m").unwrap();
    let moved = date().await - before;
    assert!(
        (840..=850).contains(&moved),
        "the store's clock moved {moved} s, not 14 min"
    );
    browser.goto(&unknown).await;
    assert_eq!(browser.text("main h1").await, "Unknown outcomes");
    assert_eq!(browser.text("nav .operator").await, OPERATOR);

    // 16 more minutes without a request: the session has ended.
    std::fs::write(&offset, "+30m").unwrap();
    browser.goto(&unknown).await;
    browser.wait_for("form#sign-in").await;
    assert!(
        browser.url().await.ends_with("/admin/console/login?ended"),
        "{}",
        browser.url().await
    );
    let notice = browser.text(".notice.error").await;
    assert!(
        notice.contains("Your session ended after 15 minutes without activity"),
        "{notice}"
    );
    // The next page too: the session is gone, not only hidden.
    browser.goto(&unknown).await;
    browser.wait_for("form#sign-in").await;
    assert!(browser.url().await.ends_with("/admin/console/login"));
    assert!(
        store.log().contains("console: a session ended"),
        "{}",
        store.log()
    );

    // Signing in again opens a new session.
    browser.click("form#sign-in button[type=submit]").await;
    browser.wait_for("form#search").await;
    browser.goto(&unknown).await;
    assert_eq!(browser.text("main h1").await, "Unknown outcomes");
}
