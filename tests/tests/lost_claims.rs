//! A claim whose answer is lost must not burn the key (contract §5): a store
//! slowed past the filter's timeout, a client gone while its claim is in
//! flight, a store killed between its commit and its reply. On SQLite and on
//! PostgreSQL, through the real Envoy: the retry executes, exactly once.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::proxy::Proxy;
use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, free_port, fresh_key, poll, Answer};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;

async fn start(database: Database) -> Stack {
    Stack::start(Options::new("envoy/e2e.yaml", database, 1)).await
}

fn pay(stack: &Stack, key: &str) -> reqwest::RequestBuilder {
    stack
        .client
        .post(stack.url("/pay"))
        .header("content-type", "application/json")
        .header("x-tenant-id", "tenant-a")
        .header("x-user-id", "alice")
        .header("idempotency-key", key)
        .body(PAYMENT)
}

async fn send(req: reqwest::RequestBuilder) -> Answer {
    Answer::of(req.send().await.unwrap()).await
}

/// Retries until the request executes (a 201); `409 request-in-progress` is
/// the only other answer allowed meanwhile.
async fn retry_until_executed(stack: &Stack, key: &str, within: Duration) -> Answer {
    poll("the retry to execute", within, || async {
        let a = send(pay(stack, key)).await;
        match (a.status, a.problem().as_deref()) {
            (201, _) => Some(a),
            (409, Some("request-in-progress")) => None,
            _ => panic!("unexpected answer to the retry: {a:?}"),
        }
    })
    .await
}

/// Holds the store database's write lock for `held` from another connection,
/// as a stalled disk, a long checkpoint or a lock wait would; returns once it
/// is held.
async fn hold_write_lock(stack: &Stack, held: Duration) -> tokio::task::JoinHandle<()> {
    match stack.database_url.strip_prefix("sqlite://") {
        Some(path) => {
            let conn = rusqlite::Connection::open(path).unwrap();
            conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            tokio::task::spawn_blocking(move || {
                std::thread::sleep(held);
                conn.execute_batch("COMMIT").unwrap();
            })
        }
        None => {
            let (client, connection) = tokio_postgres::connect(&stack.database_url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            // Blocks every insert and update of records; reads, row locks
            // and the other tables stay usable.
            client
                .batch_execute("BEGIN; LOCK TABLE idempotency_records IN SHARE ROW EXCLUSIVE MODE")
                .await
                .unwrap();
            tokio::spawn(async move {
                tokio::time::sleep(held).await;
                client.batch_execute("COMMIT").await.unwrap();
            })
        }
    }
}

async fn a_store_slower_than_the_filter(database: Database) {
    let stack = start(database).await;
    let k = fresh_key("slow-store");
    // Past the filter's 1 s store timeout.
    let holder = hold_write_lock(&stack, Duration::from_millis(1_500)).await;
    let first = send(pay(&stack, &k)).await;
    assert_eq!(
        (first.status, first.problem().as_deref()),
        (503, Some("store-unavailable")),
        "{first:?}"
    );
    let gave_up = Instant::now();
    // The retry the problem invites executes as soon as the store is healthy.
    let retried = retry_until_executed(&stack, &k, Duration::from_secs(2)).await;
    assert!(gave_up.elapsed() < Duration::from_secs(2));
    assert!(retried.header("idempotent-replayed").is_none());
    holder.await.unwrap();
    let replay = send(pay(&stack, &k)).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(stack.upstream.executions(&k), 1);
}

async fn a_client_gone_while_its_claim_is_in_flight(database: Database) {
    let stack = start(database).await;
    let k = fresh_key("gone-during-claim");
    // The claim lands at 600 ms, well after the client left at 200 ms.
    let holder = hold_write_lock(&stack, Duration::from_millis(600)).await;
    let gone = pay(&stack, &k).timeout(Duration::from_millis(200)).send().await;
    assert!(gone.is_err(), "the client should have given up: {gone:?}");
    // Its immediate retry executes once the claim it left behind is abandoned.
    let retried = retry_until_executed(&stack, &k, Duration::from_secs(4)).await;
    assert!(retried.header("idempotent-replayed").is_none());
    holder.await.unwrap();
    assert_eq!(stack.upstream.executions(&k), 1);
    // On PostgreSQL both claims wait on the lock and either may land first;
    // if the retry's does, the abandoned one never lands at all.
    let t = stack
        .transitions("tenant-a", "alice", "payments.create", &k)
        .await;
    assert!(
        t == ["claimed", "abandoned", "claimed", "completed"] || t == ["claimed", "completed"],
        "{t:?}"
    );
}

async fn a_store_killed_between_commit_and_reply(database: Database) {
    let mut stack = start(database).await;
    // Envoy keeps the replica's port; the proxy there decides what comes back.
    let envoy_facing = stack.stores[0].port;
    stack.kill_store(0);
    stack.stores[0].port = free_port();
    stack.start_store(0);
    stack.wait_store(0).await;
    let proxy = Proxy::start(envoy_facing, stack.stores[0].port).await;
    let k = fresh_key("killed-after-commit");
    proxy.swallow_replies(true);
    let first = tokio::spawn(send(pay(&stack, &k)));
    // The claim is committed; its answer never reaches the filter, and the
    // store dies before anything else happens.
    eventually("the claim to be committed", Duration::from_secs(5), || async {
        matches!(stack.records("tenant-a", "alice", "payments.create", &k).await, Some(r) if !r.is_empty())
    })
    .await;
    stack.kill_store(0);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, first.problem().as_deref()),
        (503, Some("store-unavailable")),
        "{first:?}"
    );
    // While the store is down the filter keeps the abandon; after the restart
    // it is delivered and the retry executes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.swallow_replies(false);
    stack.start_store(0);
    stack.wait_store(0).await;
    let retried = retry_until_executed(&stack, &k, Duration::from_secs(10)).await;
    assert!(retried.header("idempotent-replayed").is_none());
    assert_eq!(stack.upstream.executions(&k), 1);
    assert_eq!(
        stack
            .transitions("tenant-a", "alice", "payments.create", &k)
            .await,
        ["claimed", "abandoned", "claimed", "completed"]
    );
}

macro_rules! on_both_backends {
    ($($story:ident),*) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $story() {
                super::$story(e2e::stack::Database::Sqlite).await;
            })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $story() {
                super::$story(e2e::stack::Database::Postgres).await;
            })*
        }
    };
}

on_both_backends!(
    a_store_slower_than_the_filter,
    a_client_gone_while_its_claim_is_in_flight,
    a_store_killed_between_commit_and_reply
);
