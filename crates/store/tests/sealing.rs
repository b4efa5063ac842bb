//! Stored responses are sealed at rest (AES-256-GCM): written through the
//! HTTP API, then the database's own files are read byte by byte. Replays,
//! operators' resolutions, archiving and lookups still see the response;
//! keys rotate without rewriting rows.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply, CompleteRequest};
use idemgate_store::admin::ResolveRequest;
use idemgate_store::backend::{Action, Backend, SweepPolicy};
use idemgate_store::sealing::Seal;
use idemgate_store::{AppState, Clock, Settings, Store};

use crate::support::*;

/// What must never be found in the database's files when sealing is on.
const CANARY: &str = "ch_CANARY_9f3b2c71";
const HEADER: &str = "application/vnd.canary-7d1e+json";
/// The control's canary: written with sealing off, it must be found, which
/// shows the search can find what is there.
const CONTROL: &str = "ch_PLAIN_41c07e55";

fn body_of(canary: &str) -> Vec<u8> {
    format!(r#"{{"charge":"{canary}","amount":4200}}"#).into_bytes()
}

struct Api {
    state: AppState,
}

impl Api {
    fn new(backend: Arc<dyn Backend>) -> Api {
        Api {
            state: AppState::new(Store::new(backend, Clock::System), Settings::new(API, ADMIN))
                .with_console(behind_proxy()),
        }
    }

    async fn send(&self, path: &str, token: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let (status, _, body) =
            post_in_process_with(&self.state, path, token, body, &as_operator(ALICE)).await;
        (status, body)
    }

    async fn claim(&self, key: &str, ttl_ms: u64) -> (u16, Vec<u8>) {
        let mut c = claim(&scope(key), Some(1));
        c.ttl_ms = ttl_ms;
        self.send("/v1/claim", API, encode_frame(&c, b"")).await
    }

    async fn owned(&self, key: &str, ttl_ms: u64) -> u64 {
        let (status, body) = self.claim(key, ttl_ms).await;
        assert_eq!(status, 200);
        match decode_frame::<ClaimReply>(&body).unwrap().0 {
            ClaimReply::Owned { fence } => fence,
            other => panic!("expected Owned, got {other:?}"),
        }
    }

    /// Claims `key` and completes it with `body` and the canary header.
    async fn complete(&self, key: &str, body: &[u8], ttl_ms: u64) {
        self.complete_with(key, (HEADER, body), ttl_ms).await;
    }

    /// Claims `key` and completes it with this content type and body.
    async fn complete_with(&self, key: &str, (content_type, body): (&str, &[u8]), ttl_ms: u64) {
        let fence = self.owned(key, ttl_ms).await;
        let req = CompleteRequest {
            headers: vec![("content-type".into(), content_type.into())],
            ..complete(&scope(key), fence, 201)
        };
        let (status, reply) = self.send("/v1/complete", API, encode_frame(&req, body)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
    }

    /// The replay of `key`: status, headers and body.
    async fn replay(&self, key: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
        let (status, body) = self.claim(key, 10_000).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let (reply, rest) = decode_frame::<ClaimReply>(&body).unwrap();
        match reply {
            ClaimReply::Replay { status, headers, .. } => (status, headers, rest.to_vec()),
            other => panic!("expected a replay, got {other:?}"),
        }
    }

    /// The admin API's current record of `key`.
    async fn record(&self, key: &str) -> serde_json::Value {
        let q = format!(r#"{{"tenant": "acme", "key": "{key}"}}"#).into_bytes();
        let (status, body) = self.send("/admin/v1/records/lookup", ADMIN, q).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let history: serde_json::Value = serde_json::from_slice(&body).unwrap();
        history["records"][0].clone()
    }
}

/// Every file under `dir` that holds `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if std::fs::read(&path).is_ok_and(|bytes| bytes.windows(needle.len()).any(|w| w == needle))
            {
                found.push(path);
            }
        }
    }
    found
}

/// The whole story on one database (`url`); `flush` makes the database put
/// what it holds in memory on disk before `files` is searched.
async fn sealed_at_rest<F, Fut>(url: &str, control_url: &str, files: &Path, flush: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // Key `a` seals.
    let a = Api::new(backend_at(url, seal(KEY_A)).await);
    a.complete("k-a", &body_of(CANARY), 10_000).await;
    let (status, headers, body) = a.replay("k-a").await;
    assert_eq!((status, body), (201, body_of(CANARY)));
    assert_eq!(headers, vec![("content-type".to_string(), HEADER.to_string())]);
    let rec = a.record("k-a").await;
    assert_eq!(rec["response_key"], "a");
    assert_eq!(rec["headers"][0][1], HEADER, "operators see the headers opened");
    assert_eq!(
        rec["body_len"],
        body_of(CANARY).len(),
        "the body's length, not the ciphertext's"
    );

    // An operator completes an open record: sealed too, and replayed.
    let fence = a.owned("k-op", 10_000).await;
    assert!(fence > 0);
    let resolve = ResolveRequest {
        scope: scope("k-op"),
        action: Action::Complete {
            status: 200,
            headers: vec![("content-type".into(), HEADER.into())],
            body: format!("resolved {CANARY}"),
        },
        reason: Some("the ledger shows it".into()),
    };
    let (status, reply) = a
        .send("/admin/v1/resolve", ADMIN, serde_json::to_vec(&resolve).unwrap())
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
    let (status, _, body) = a.replay("k-op").await;
    assert_eq!((status, body), (200, format!("resolved {CANARY}").into_bytes()));
    assert_eq!(a.record("k-op").await["response_key"], "a");

    // Archived: the body goes, the sealed headers stay readable to operators.
    a.complete("k-arch", &body_of(CANARY), 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let policy = SweepPolicy {
        batch: 100,
        audit_retention_ms: 3_600_000,
    };
    let now = a.state.store.clock.now();
    let swept = a.state.store.backend.sweep(now, &policy).await.unwrap();
    assert!(swept.archived >= 1, "{swept:?}");
    let rec = a.record("k-arch").await;
    assert!(rec["archived_at"].is_i64(), "{rec}");
    assert_eq!(rec["body_len"], serde_json::Value::Null);
    assert_eq!(rec["headers"][0][1], HEADER);

    // Rotation: `b` becomes current, `a` stays for reading.
    let rotated = Api::new(backend_at(url, seal(&format!("{KEY_B}\n{KEY_A}\n"))).await);
    let (status, _, body) = rotated.replay("k-a").await;
    assert_eq!(
        (status, body),
        (201, body_of(CANARY)),
        "a record sealed by a still opens"
    );
    rotated.complete("k-b", &body_of(CANARY), 10_000).await;
    assert_eq!(rotated.record("k-b").await["response_key"], "b");
    assert_eq!(
        rotated.record("k-a").await["response_key"],
        "a",
        "old rows are not rewritten"
    );
    let (_, _, body) = rotated.replay("k-b").await;
    assert_eq!(body, body_of(CANARY));

    // Without `a`, its records do not replay: a 503 that names nothing
    // internal, never a wrong or empty body; operators still see them.
    let b_only = Api::new(backend_at(url, seal(KEY_B)).await);
    let (status, body) = b_only.claim("k-a", 10_000).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert!(!String::from_utf8_lossy(&body).contains(CANARY));
    let rec = b_only.record("k-a").await;
    assert_eq!(rec["state"], "completed");
    assert_eq!(rec["headers"], serde_json::Value::Null);
    let (_, _, body) = b_only.replay("k-b").await;
    assert_eq!(body, body_of(CANARY));

    // The control: the same writes without sealing, in another database.
    let plain = Api::new(backend_at(control_url, Seal::off()).await);
    plain
        .complete_with("k-plain", ("application/json", &body_of(CONTROL)), 10_000)
        .await;
    assert_eq!(
        plain.record("k-plain").await["response_key"],
        serde_json::Value::Null
    );

    flush().await;
    let found = files_holding(files, CANARY.as_bytes());
    assert!(found.is_empty(), "the body in plaintext in {found:?}");
    let found = files_holding(files, HEADER.as_bytes());
    assert!(found.is_empty(), "a header in plaintext in {found:?}");
    assert!(
        !files_holding(files, CONTROL.as_bytes()).is_empty(),
        "the search found not even the unsealed control body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_files_hold_no_plaintext_response_and_keys_rotate() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    let control = format!("sqlite://{}", dir.path().join("control.db").display());
    // The database file and its WAL, as they are: nothing is checkpointed.
    sealed_at_rest(&url, &control, dir.path(), || async {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_data_directory_holds_no_plaintext_response_and_keys_rotate() {
    // A cluster of its own: its data directory holds only this test.
    let cluster = pg::PgCluster::start();
    let url = cluster.fresh_database().await;
    let control = cluster.fresh_database().await;
    let admin = cluster.url("postgres");
    // A checkpoint writes every table page out; the WAL is searched too.
    let flush = || {
        let admin = admin.clone();
        async move {
            let (client, conn) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
                .await
                .unwrap();
            let task = tokio::spawn(conn);
            client.batch_execute("CHECKPOINT").await.unwrap();
            drop(client);
            let _ = task.await;
        }
    };
    sealed_at_rest(&url, &control, &cluster.data_dir(), flush).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_says_whether_it_seals_and_refuses_a_bad_key_file() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let keys = dir.path().join("response-keys");
    std::fs::write(&keys, format!("# rotated in December\n{KEY_B}\n{KEY_A}\n")).unwrap();
    let sealed = StoreProcess::start_with(&db, "info", |cmd| {
        cmd.arg("--response-key-file").arg(&keys);
    })
    .await;
    assert!(
        sealed.log().contains("stored responses are sealed"),
        "{}",
        sealed.log()
    );
    assert!(sealed.log().contains("key=b"), "{}", sealed.log());
    drop(sealed);
    let plain = StoreProcess::start_with(&db, "info", |_| {}).await;
    assert!(plain.log().contains("kept in plaintext"), "{}", plain.log());
    drop(plain);

    let bad = dir.path().join("bad-keys");
    std::fs::write(
        &bad,
        "a:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\nb:c2hvcnQ=\n",
    )
    .unwrap();
    let err = serve_refused(&db, &["--response-key-file".as_ref(), bad.as_os_str()]);
    assert!(err.contains("line 2") && err.contains("32"), "{err}");
    assert!(!err.contains("c2hvcnQ"), "a key in the error: {err}");
}

/// Sets `assignments` on the current record of `key` in the SQLite file
/// `path`, as a writer with access to the database would.
fn tamper(path: &Path, key: &str, assignments: &str) {
    let conn = rusqlite::Connection::open(path).unwrap();
    let sql = format!("UPDATE idempotency_records SET {assignments} WHERE idem_key = ?1");
    assert_eq!(conn.execute(&sql, [key]).unwrap(), 1, "{sql}");
}

/// What sealing protects against a writer with access to the database, and
/// what it does not (operations.md, "What sealing protects"). The sealed
/// bytes are bound to their record, fence and column, and a sealed body that
/// was blanked is refused; but the status, the `body_stored` flag and the
/// `response_key` column are not authenticated, so a writer can still change
/// the status of a sealed response, or downgrade a record to plaintext and
/// have the store serve what they wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealing_binds_the_sealed_bytes_but_not_the_status_or_the_sealed_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let url = format!("sqlite://{}", path.display());
    let a = Api::new(backend_at(&url, seal(KEY_A)).await);
    for key in ["k-blank", "k-null", "k-moved", "k-status", "k-flag", "k-plain"] {
        a.complete(key, &body_of(CANARY), 10_000).await;
        assert_eq!(a.replay(key).await.2, body_of(CANARY));
    }

    // A sealed body blanked, or cleared, while the record still names its
    // key: refused (503), never replayed as an empty body.
    tamper(&path, "k-blank", "response_body = x''");
    tamper(&path, "k-null", "response_body = NULL");
    for key in ["k-blank", "k-null"] {
        let (status, body) = a.claim(key, 10_000).await;
        assert_eq!(status, 503, "{key}: {}", String::from_utf8_lossy(&body));
    }
    // Another record's ciphertext: does not open.
    tamper(
        &path,
        "k-moved",
        "response_body = (SELECT response_body FROM idempotency_records WHERE idem_key = 'k-status')",
    );
    let (status, _) = a.claim("k-moved", 10_000).await;
    assert_eq!(status, 503);

    // Not covered: the status is outside the sealed bytes, so a changed
    // status is served with the genuine body; cleared headers, as none.
    tamper(
        &path,
        "k-status",
        "response_status = 200, response_headers = NULL",
    );
    let (status, headers, body) = a.replay("k-status").await;
    assert_eq!((status, headers, body), (200, vec![], body_of(CANARY)));
    // Nor is the `body_stored` flag: cleared, the record answers as a
    // result too large to keep.
    tamper(&path, "k-flag", "body_stored = 0");
    let (status, reply) = a.claim("k-flag", 10_000).await;
    assert_eq!(status, 200);
    let reply = decode_frame::<ClaimReply>(&reply).unwrap().0;
    assert!(
        matches!(
            reply,
            ClaimReply::ResultUnavailable {
                original_status: 201,
                ..
            }
        ),
        "{reply:?}"
    );

    // Not covered: a record downgraded to plaintext (no `response_key`, a
    // body and headers in clear) is served as written, since records stored
    // before sealing was turned on are plaintext too.
    tamper(
        &path,
        "k-plain",
        "response_key = NULL, response_headers = '[]', response_body = CAST('forged' AS BLOB)",
    );
    let (status, headers, body) = a.replay("k-plain").await;
    assert_eq!((status, headers, body), (201, vec![], b"forged".to_vec()));
}
