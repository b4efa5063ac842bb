//! The reconciliation console in a real browser: a payment whose upstream
//! connection reset after it charged is `outcome-unknown` through the real
//! Envoy; an operator signs in to the store's console in headless Chromium,
//! finds the record in the unknown list, opens it, stores the response the
//! bank confirms with a reason, and the client's retry through Envoy replays
//! that response. The history keeps the reason; no URL the browser was on
//! and no log line of Envoy or the store holds the key. The screenshots are
//! the ones docs/operations.md shows (`IDEMGATE_SCREENSHOTS=docs` writes them
//! there).

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use e2e::browser::Browser;
use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, repo_root, send, ADMIN_TOKEN};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const STORED: &str = r#"{"id":"pay_4200","status":"succeeded"}"#;
const REASON: &str =
    "Bank ledger shows charge ch_4200 succeeded; storing the answer the client should have had";

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_reconciles_an_unknown_payment_in_the_console() {
    let started = Instant::now();
    let stack = Stack::start(Options::new("envoy/e2e.yaml", Database::Sqlite, 1)).await;
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
    let console = |path: &str| stack.store_url(0, path);
    let mut seen: Vec<String> = Vec::new();

    // Signing in: the console sends a browser without a session to its login form.
    browser.goto(&console("/admin/console/unknown")).await;
    browser.wait_for("#token").await;
    assert!(browser.url().await.ends_with("/admin/console/login"));
    seen.push(browser.url().await);
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("main form button[type=submit]").await;
    browser.wait_for("form#search").await;
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
    let resolved = browser.text("tr.event-resolved").await;
    assert!(
        resolved.contains("operator") && resolved.contains("complete") && resolved.contains(REASON),
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
        (&"operator".into(), &"complete".into(), &REASON.into())
    );

    // Signing out ends the session: the console asks for the credential again.
    browser.click("nav .logout button").await;
    browser.wait_for("#token").await;
    browser.goto(&console("/admin/console/unknown")).await;
    browser.wait_for("#token").await;
    assert!(browser.url().await.ends_with("/admin/console/login"));

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
