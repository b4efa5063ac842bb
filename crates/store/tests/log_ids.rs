//! Records are named in logs by a keyed hash (contract §9): the name in an
//! event's log line is the one the admin API shows, it is the same in every
//! replica given the same key file, and it is not a bare digest. The same
//! holds for the request fingerprint an event line carries.

use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply};
use sha2::{Digest, Sha256};

use crate::support::*;

/// Claims and completes `s` through the API.
async fn claim_and_complete(p: &StoreProcess, s: &idemgate_core::scope::Scope) {
    let c = client();
    let r = request(
        &c,
        "POST",
        &p.url("/v1/claim"),
        Some(API),
        encode_frame(&claim(s, Some(1)), b""),
    )
    .await;
    let ClaimReply::Owned { fence } = decode_frame::<ClaimReply>(&r.body).unwrap().0 else {
        panic!("not owned: {:?}", String::from_utf8_lossy(&r.body));
    };
    let r = request(
        &c,
        "POST",
        &p.url("/v1/complete"),
        Some(API),
        encode_frame(&complete(s, fence, 201), b"{}"),
    )
    .await;
    assert_eq!(r.status, 200);
}

/// The `record=` of every `idemgate::events` line of `log`.
fn logged_records(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("idemgate::events"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("record=")))
        .map(String::from)
        .collect()
}

/// The `log_id` the admin API gives the record of tenant `acme` and `key`.
async fn admin_log_id(p: &StoreProcess, key: &str) -> String {
    let body = format!(r#"{{"tenant": "acme", "key": "{key}"}}"#).into_bytes();
    let r = request(
        &client(),
        "POST",
        &p.url("/admin/v1/records/lookup"),
        Some(ADMIN),
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let history: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let id = history["records"][0]["log_id"].as_str().unwrap().to_string();
    assert_eq!(history["events"][0]["log_id"], id.as_str());
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_a_log_key_file_name_a_low_entropy_key_alike_and_never_by_its_digest() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let key_file = dir.path().join("log.key");
    std::fs::write(&key_file, "bG9nLWtleS1zaGFyZWQtYnktcmVwbGljYXM=\n").unwrap();
    let other_file = dir.path().join("other.key");
    std::fs::write(&other_file, "YW5vdGhlci1zZWNyZXQtZm9yLWxvZy1pZHM=\n").unwrap();
    let with_key = |path: std::path::PathBuf| {
        move |cmd: &mut std::process::Command| {
            cmd.arg("--log-key-file").arg(path);
        }
    };
    // A low-entropy key: an order number.
    let s = scope("1042");

    let first = StoreProcess::start_with(&db, "info", with_key(key_file.clone())).await;
    claim_and_complete(&first, &s).await;
    let logged = logged_records(&first.log());
    assert_eq!(logged.len(), 2, "claimed and completed:\n{}", first.log());
    assert_eq!(logged[0], logged[1]);
    let id = logged[0].clone();
    assert_eq!(id.len(), 12);
    // The admin API names the record as the log line does, so an operator
    // who has the line's tenant and the key finds it.
    assert_eq!(admin_log_id(&first, "1042").await, id);
    // Not the truncated SHA-256 of the scope, nor of the key.
    let bare: String = Sha256::digest(s.encode())
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_ne!(id, bare);
    let of_key: String = Sha256::digest(b"1042")
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_ne!(id, of_key);
    drop(first);

    // Another process (a restart, or another replica) with the same key file.
    let second = StoreProcess::start_with(&db, "info", with_key(key_file.clone())).await;
    assert_eq!(admin_log_id(&second, "1042").await, id);
    drop(second);

    // Another secret, another name.
    let third = StoreProcess::start_with(&db, "info", with_key(other_file)).await;
    assert_ne!(admin_log_id(&third, "1042").await, id);
    drop(third);

    // Without a key file the name derives from the admin credential, which
    // replicas share: stable across restarts, and still not a bare digest.
    let a = StoreProcess::start_with(&db, "info", |_| {}).await;
    let derived = admin_log_id(&a, "1042").await;
    drop(a);
    let b = StoreProcess::start_with(&db, "info", |_| {}).await;
    assert_eq!(admin_log_id(&b, "1042").await, derived);
    assert_ne!(derived, bare);
    assert_ne!(derived, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_log_key_file_stops_the_store_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("short.key");
    std::fs::write(&key_file, "too-short\n").unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let err = serve_refused(&db, &["--log-key-file".as_ref(), key_file.as_os_str()]);
    assert!(err.contains("log key") && err.contains("at least 16"), "{err}");
}

/// The `fingerprint=` of every `idemgate::events` line of `log`.
fn logged_fingerprints(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("idemgate::events"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("fingerprint=")))
        .map(|w| w.trim_matches('"').to_string())
        .collect()
}

/// Claims `s` with `fingerprint` and completes it through the API.
async fn claim_and_complete_with(
    p: &StoreProcess,
    s: &idemgate_core::scope::Scope,
    fingerprint: Fingerprint,
) {
    let c = client();
    let req = idemgate_core::protocol::ClaimRequest {
        fingerprint: Some(fingerprint),
        ..claim(s, None)
    };
    let r = request(
        &c,
        "POST",
        &p.url("/v1/claim"),
        Some(API),
        encode_frame(&req, b""),
    )
    .await;
    let ClaimReply::Owned { fence } = decode_frame::<ClaimReply>(&r.body).unwrap().0 else {
        panic!("not owned: {:?}", String::from_utf8_lossy(&r.body));
    };
    let r = request(
        &c,
        "POST",
        &p.url("/v1/complete"),
        Some(API),
        encode_frame(&complete(s, fence, 201), b"{}"),
    )
    .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_line_names_the_fingerprint_by_a_keyed_hash_never_by_the_bare_digest() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let key_file = dir.path().join("log.key");
    std::fs::write(&key_file, "bG9nLWtleS1zaGFyZWQtYnktcmVwbGljYXM=\n").unwrap();
    let other_file = dir.path().join("other.key");
    std::fs::write(&other_file, "YW5vdGhlci1zZWNyZXQtZm9yLWxvZy1pZHM=\n").unwrap();
    let with_key = |path: std::path::PathBuf| {
        move |cmd: &mut std::process::Command| {
            cmd.arg("--log-key-file").arg(path);
        }
    };
    // A low-entropy body: whoever reads the logs could hash every amount
    // until one matches a bare fingerprint.
    let digest: [u8; 32] = Sha256::digest(br#"{"amount":4200}"#).into();
    let fingerprint = Fingerprint::from_bytes(digest);
    let bare = fingerprint.to_hex();

    let first = StoreProcess::start_with(&db, "info", with_key(key_file.clone())).await;
    claim_and_complete_with(&first, &scope("order-1"), fingerprint).await;
    let log = first.log();
    assert!(!log.contains(&bare), "the bare fingerprint in the log:\n{log}");
    assert!(
        !log.contains(&bare[..12]),
        "a prefix of the bare fingerprint in the log:\n{log}"
    );
    let logged = logged_fingerprints(&log);
    assert!(!logged.is_empty(), "no fingerprint in the event lines:\n{log}");
    let named = logged[0].clone();
    assert!(logged.iter().all(|f| *f == named), "{logged:?}");
    assert_eq!(named.len(), 12, "{named}");
    assert!(named.bytes().all(|b| b.is_ascii_hexdigit()), "{named}");
    // Never the record's name: the two hashes are kept apart.
    let records = logged_records(&log);
    assert!(!records.is_empty());
    assert!(records.iter().all(|r| *r != named), "{records:?} {named}");
    // The admin API, which is not a log, still shows the stored fingerprint.
    let body = br#"{"tenant": "acme", "key": "order-1"}"#.to_vec();
    let r = request(
        &client(),
        "POST",
        &first.url("/admin/v1/records/lookup"),
        Some(ADMIN),
        body,
    )
    .await;
    assert_eq!(r.status, 200);
    let history: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(history["records"][0]["fingerprint"], bare.as_str());
    drop(first);

    // Another replica with the same key file names the same request alike,
    // on another record: lines about one request body correlate.
    let second = StoreProcess::start_with(&db, "info", with_key(key_file)).await;
    claim_and_complete_with(&second, &scope("order-2"), fingerprint).await;
    let again = logged_fingerprints(&second.log());
    assert!(!again.is_empty());
    assert!(again.iter().all(|f| *f == named), "{again:?} {named}");
    drop(second);

    // Another secret, another name.
    let third = StoreProcess::start_with(&db, "info", with_key(other_file)).await;
    claim_and_complete_with(&third, &scope("order-3"), fingerprint).await;
    let other = logged_fingerprints(&third.log());
    assert!(!other.is_empty());
    assert!(other.iter().all(|f| *f != named && *f != bare), "{other:?}");
}
