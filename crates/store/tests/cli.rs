//! The operator's CLI against a real database file.

use std::process::Command;
use std::time::Duration;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply};

use crate::support::*;

fn cli(db: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .args(args)
        .args(["--database-url", db])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `s` claimed through a store serving `db` (lease 1 s), which then stops.
async fn claimed(db: &str, s: &idemgate_core::scope::Scope) {
    let p = StoreProcess::start(db).await;
    let r = request(
        &client(),
        "POST",
        &p.url("/v1/claim"),
        Some(API),
        encode_frame(&claim(s, Some(1)), b""),
    )
    .await;
    assert!(matches!(
        decode_frame::<ClaimReply>(&r.body).unwrap().0,
        ClaimReply::Owned { .. }
    ));
}

#[test]
fn help_documents_every_subcommand_and_flag() {
    let (ok, out, _) = cli("sqlite://unused.db", &["--help"]);
    assert!(ok);
    for word in [
        "serve",
        "migrate",
        "inspect",
        "resolve",
        "purge",
        "sweep",
        "--database-url",
        "--database-url-file",
        "IDEMGATE_DATABASE_URL_FILE",
        "--log-key-file",
        "IDEMGATE_LOG_KEY_FILE",
        "--response-key-file",
        "IDEMGATE_RESPONSE_KEY_FILE",
    ] {
        assert!(out.contains(word), "{word} missing from --help:\n{out}");
    }
    let (ok, out, _) = cli("sqlite://unused.db", &["serve", "--help"]);
    assert!(ok);
    for flag in [
        "--listen",
        "--admin-listen",
        "--api-token",
        "--api-token-file",
        "--api-token-next",
        "--api-token-next-file",
        "--admin-token",
        "--admin-token-file",
        "--sweep-batch",
        "--audit-retention-secs",
        "--no-console",
        "--console-secure-cookies",
        "--tenant-new-keys-per-sec",
        "--tenant-new-keys-burst",
        "IDEMGATE_API_TOKEN",
        "--operator-header",
        "--operator-trusted-peers",
        "--operator-proxy-secret-file",
        "--operator-proxy-secret-header",
        "--console-idle-minutes",
        "IDEMGATE_CONSOLE_IDLE_MINUTES",
    ] {
        assert!(out.contains(flag), "{flag} missing from serve --help:\n{out}");
    }
    for command in ["resolve", "purge"] {
        let (ok, out, _) = cli("sqlite://unused.db", &[command, "--help"]);
        assert!(ok);
        for flag in ["--actor", "--reason"] {
            assert!(out.contains(flag), "{flag} missing from {command} --help:\n{out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_inspect_resolve_sweep_and_purge_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let (ok, _, err) = cli(&db, &["migrate"]);
    assert!(ok, "{err}");
    let s = scope("k-cli");
    claimed(&db, &s).await;
    let (ok, out, err) = cli(&db, &["inspect", "--tenant", "acme", "--key", "k-cli"]);
    assert!(ok, "{err}");
    let history: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(history["records"][0]["state"], "in_progress");
    assert_eq!(history["events"][0]["transition"], "claimed");
    let (ok, out, _) = cli(&db, &["inspect", "--stuck", "--older-than-ms", "0"]);
    assert!(ok);
    assert!(out.contains("k-cli"));
    let scope_args = [
        "--tenant",
        "acme",
        "--principal",
        "alice",
        "--route",
        "payments.create",
        "--key",
        "k-cli",
    ];
    let mut args = vec!["resolve"];
    args.extend(scope_args);
    args.extend([
        "--status",
        "200",
        "--header",
        "content-type: text/plain",
        "--body",
        "fixed by hand",
    ]);
    // A change names who makes it and why, or is refused.
    let (ok, _, err) = cli(&db, &args);
    assert!(!ok && err.contains("--actor is required"), "{err}");
    let (ok, _, err) = cli(
        &db,
        &[&args[..], &["--actor", "operator", "--reason", "r"]].concat(),
    );
    assert!(!ok && err.contains("not an operator identity"), "{err}");
    args.extend(["--actor", "carol@example.com"]);
    let (ok, _, err) = cli(&db, &args);
    assert!(!ok && err.contains("--reason: a reason is required"), "{err}");
    let (ok, _, err) = cli(&db, &[&args[..], &["--reason", " "]].concat());
    assert!(!ok && err.contains("a reason is required"), "{err}");
    args.extend(["--reason", "the ledger shows charge ch_1"]);
    let (ok, _, err) = cli(&db, &args);
    assert!(ok, "{err}");
    let (ok, out, _) = cli(&db, &["inspect", "--tenant", "acme", "--key", "k-cli"]);
    assert!(ok);
    let history: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(history["records"][0]["state"], "completed");
    assert_eq!(history["records"][0]["body_len"], 13);
    assert_eq!(history["events"][1]["transition"], "resolved");
    // Declared, not verified: the history says so.
    assert_eq!(history["events"][1]["actor"], "cli:carol@example.com");
    assert_eq!(history["events"][1]["reason"], "the ledger shows charge ch_1");
    let (ok, _, err) = cli(&db, &args);
    assert!(!ok && err.contains("no in-progress or unknown record"), "{err}");
    let (ok, out, _) = cli(&db, &["sweep"]);
    assert!(ok);
    assert!(out.contains("archived"), "{out}");
    let mut purge = vec!["purge"];
    purge.extend(scope_args);
    purge.extend(["--actor", "carol@example.com"]);
    let (ok, _, err) = cli(&db, &purge);
    assert!(!ok && err.contains("a reason is required"), "{err}");
    purge.extend(["--reason", "test data"]);
    let (ok, _, err) = cli(&db, &purge);
    assert!(ok, "{err}");
    let (ok, out, _) = cli(&db, &["inspect", "--tenant", "acme", "--key", "k-cli"]);
    assert!(ok);
    // The key is free; its purged generation stays in the history.
    let history: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(history["records"][0]["state"], "purged");
    assert!(history["records"][0]["ended_at"].is_i64());
    let purged = &history["events"][2];
    assert_eq!(
        (&purged["transition"], &purged["actor"], &purged["reason"]),
        (
            &"purged".into(),
            &"cli:carol@example.com".into(),
            &"test data".into()
        )
    );
    let (ok, _, err) = cli("mysql://nope", &["migrate"]);
    assert!(!ok && err.contains("sqlite://"), "{err}");
}

/// A due record the sweeper cannot read is left as it is, and its log line
/// names the row by its key, which finds it for the operator who repairs
/// or purges it.
#[tokio::test]
async fn the_sweeper_names_a_record_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let db = format!("sqlite://{}", path.display());
    let s = scope("k-damaged");
    claimed(&db, &s).await;
    // A value no store writes, in a record whose lease (1 s) then runs out.
    let damage = "UPDATE idempotency_records SET fingerprint = 'abcdefghijklmnopqrstuvwxyz012345' \
                  WHERE idem_key = 'k-damaged'";
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute(damage, [])
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let (ok, out, err) = cli(&db, &["sweep"]);
    assert!(ok, "{err}");
    assert!(out.contains("\"unreadable\": 1"), "{out}");
    let digest = idemgate_store::scope_digest::ScopeDigest::of(&s).to_string();
    assert!(err.contains(&format!("scope_digest={digest}")), "{err}");
    let named: String = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row(
            &format!("SELECT idem_key FROM idempotency_records WHERE scope_digest = x'{digest}'"),
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(named, "k-damaged");
}

#[test]
fn the_database_url_can_come_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("from-file.db");
    let url_file = dir.path().join("database-url");
    std::fs::write(&url_file, format!("sqlite://{}\n", db.display())).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .arg("migrate")
        .env("IDEMGATE_DATABASE_URL_FILE", &url_file)
        .env("RUST_LOG", "warn")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(db.exists(), "the URL in the file was not used");
    assert!(
        !dir.path().join("idempotency.db").exists(),
        "the default URL was used instead of the file's"
    );
    let missing = Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .args(["migrate", "--database-url-file"])
        .arg(dir.path().join("absent"))
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("database url file"));
}

/// Every line of `stderr` as JSON, or the line that is not.
fn json_lines(stderr: &str) -> Vec<serde_json::Value> {
    (stderr.lines())
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_put_every_line_in_one_object_with_the_event_fields_on_top() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let port = free_port();
    let log = dir.path().join("stderr.log");
    let mut child = idemgate_testkit::store::serve(
        std::path::Path::new(env!("CARGO_BIN_EXE_idempotency-store")),
        port,
        &db,
        API,
        ADMIN,
        "info",
    )
    .args(["--log-format", "json"])
    .stdout(std::process::Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    let c = client();
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    eventually("the store to be ready", Duration::from_secs(30), || {
        let (c, ready) = (c.clone(), url("/readyz"));
        async move { matches!(c.get(ready.parse().unwrap()).await, Ok(r) if r.status() == 200) }
    })
    .await;
    let r = request(
        &c,
        "POST",
        &url("/v1/claim"),
        Some(API),
        encode_frame(&claim(&scope("k-json"), Some(1)), b""),
    )
    .await;
    assert!(matches!(
        decode_frame::<ClaimReply>(&r.body).unwrap().0,
        ClaimReply::Owned { .. }
    ));
    // A graceful stop, so the lines written on the way out are checked too.
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    let lines = json_lines(&std::fs::read_to_string(&log).unwrap());
    let claimed = (lines.iter())
        .find(|l| l["target"] == "idemgate::events" && l["event"] == "claimed")
        .unwrap_or_else(|| panic!("no claimed event in {lines:?}"));
    assert_eq!(claimed["level"], "INFO");
    assert_eq!(claimed["route"], "payments.create");
    assert!(
        claimed["record"].as_str().is_some_and(|r| r.len() == 12),
        "{claimed}"
    );
    assert!(claimed["generation"].is_u64(), "{claimed}");
    assert!(claimed["fence"].is_u64(), "{claimed}");
    assert_eq!(claimed["actor"], "filter");
    assert!(lines.iter().any(|l| l["message"] == "shutting down"), "{lines:?}");

    // A refusal to start is a JSON line too.
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .args(["serve", "--log-format", "json", "--listen", "127.0.0.1:0"])
        .args(["--database-url", &db, "--api-token", API, "--admin-token", API])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let lines = json_lines(&String::from_utf8_lossy(&out.stderr));
    let last = lines.last().unwrap();
    assert_eq!(last["level"], "ERROR");
    assert_eq!(last["message"], "the API and admin tokens must differ");
}
