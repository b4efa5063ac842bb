use std::time::Duration;

use clap::Parser;

use super::*;
use crate::cli::args::{Cli, Command, LogFormat, ServeArgs};

fn cli(args: &[&str]) -> Cli {
    let mut line = vec!["idempotency-store"];
    line.extend(args);
    Cli::try_parse_from(line).unwrap()
}

fn serve_args(args: &[&str]) -> ServeArgs {
    let mut line = vec!["serve", "--api-token", "api-token"];
    line.extend(args);
    match cli(&line).command {
        Command::Serve(s) => s,
        other => panic!("not serve: {other:?}"),
    }
}

fn serve(args: &[&str]) -> Result<ServeSettings, CliError> {
    ServeSettings::new(&serve_args(args), Some("admin-token".into()))
}

fn refusal(args: &[&str]) -> String {
    match serve(args) {
        Ok(_) => panic!("{args:?} accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_schema_follows_the_command_and_the_migrate_flags() {
    let of = |args: &[&str]| Schema::of(&cli(args).command);
    assert_eq!(of(&["migrate"]), Schema::Migrate);
    assert_eq!(of(&["serve"]), Schema::Verify);
    assert_eq!(of(&["serve", "--migrate"]), Schema::Migrate);
    assert_eq!(of(&["serve", "--no-migrate"]), Schema::Untouched);
    assert_eq!(of(&["inspect", "--unknown"]), Schema::ReadOnly);
    assert_eq!(of(&["sweep"]), Schema::Verify);
}

#[test]
fn only_inspect_opens_read_only_sessions() {
    let global = |args: &[&str]| Global::try_from(&cli(args)).unwrap();
    let inspect = global(&["inspect", "--unknown", "--pg-pooler", "transaction"]);
    assert!(inspect.session.read_only);
    assert_eq!(inspect.session.pooler, Pooler::Transaction);
    assert!(!global(&["sweep"]).session.read_only);
}

#[test]
fn log_ids_match_the_logs_only_with_a_log_key_or_the_admin_credential() {
    let global = |args: &[&str]| Global::try_from(&cli(args)).unwrap();
    assert!(!global(&["sweep"]).log_ids_match_logs);
    let with_admin = global(&["--admin-token", "admin-token", "sweep"]);
    assert!(with_admin.log_ids_match_logs);
    assert_eq!(with_admin.admin.as_deref(), Some("admin-token"));
}

#[test]
fn zero_timeouts_become_one_millisecond() {
    let t = pg_timeouts(&cli(&[
        "--pg-wait-timeout-ms",
        "0",
        "--pg-statement-timeout-ms",
        "0",
        "sweep",
    ]));
    assert_eq!(t.wait, Duration::from_millis(1));
    assert_eq!(t.statement, Duration::from_millis(1));
    assert_eq!(t.connect, Duration::from_millis(500));
}

#[test]
fn the_database_url_file_is_read_without_its_newline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("url");
    std::fs::write(&path, "sqlite://x.db\r\n").unwrap();
    let global = Global::try_from(&cli(&["--database-url-file", path.to_str().unwrap(), "sweep"])).unwrap();
    assert_eq!(global.database_url, "sqlite://x.db");
    let absent = dir.path().join("absent");
    let e = Global::try_from(&cli(&["--database-url-file", absent.to_str().unwrap(), "sweep"]))
        .err()
        .unwrap();
    assert!(matches!(
        e,
        CliError::Read {
            what: "database url",
            ..
        }
    ));
    assert!(
        e.to_string().starts_with("cannot read the database url file "),
        "{e}"
    );
    assert!(std::error::Error::source(&e).is_some());
}

#[test]
fn a_missing_or_empty_token_names_its_flags_and_variable() {
    let e = read_token(None, None, "api token").unwrap_err();
    assert_eq!(
        e.to_string(),
        "no api token: pass --api-token or --api-token-file, or set IDEMGATE_API_TOKEN"
    );
    assert_eq!(
        read_token(Some(""), None, "api token").unwrap_err().to_string(),
        "the api token is empty"
    );
    assert_eq!(optional_token(None, None, "api token next").unwrap(), None);
}

#[test]
fn serve_requires_the_admin_credential() {
    let e = ServeSettings::new(&serve_args(&[]), None).err().unwrap();
    assert_eq!(
        e.to_string(),
        "no admin token: pass --admin-token or --admin-token-file, or set IDEMGATE_ADMIN_TOKEN"
    );
}

#[test]
fn the_admin_credential_differs_from_every_api_one() {
    assert_eq!(
        distinct_tokens("same", "same", None).unwrap_err().to_string(),
        "the API and admin tokens must differ"
    );
    assert_eq!(
        distinct_tokens("api", "admin", Some("admin"))
            .unwrap_err()
            .to_string(),
        "the next API token must differ from the admin token"
    );
    assert!(distinct_tokens("api", "admin", Some("next")).is_ok());
    assert_eq!(
        refusal(&["--api-token-next", "admin-token"]),
        "the next API token must differ from the admin token"
    );
}

#[test]
fn the_next_api_token_is_accepted_alongside_the_current_one() {
    let s = serve(&["--api-token-next", "next-token"]).unwrap();
    assert!(s.http.api_token.matches(b"api-token"));
    assert!(s.http.api_token.matches(b"next-token"));
    assert!(!s.http.api_token.matches(b"admin-token"));
    assert!(s.http.admin_token.matches(b"admin-token"));
}

#[test]
fn the_new_key_burst_defaults_to_one_seconds_worth_and_at_least_one() {
    assert!(new_key_limit(None, None).unwrap().is_none());
    let limit = |rate, burst| new_key_limit(Some(rate), burst).unwrap().unwrap().burst;
    assert_eq!(limit(2.5, None), 3);
    assert_eq!(limit(0.1, None), 1);
    assert_eq!(limit(2.5, Some(7)), 7);
    let e = new_key_limit(Some(0.0), None).err().unwrap().to_string();
    assert!(e.starts_with("--tenant-new-keys-per-sec: "), "{e}");
    let e = new_key_limit(Some(1.0), Some(0)).err().unwrap().to_string();
    assert!(e.starts_with("--tenant-new-keys-per-sec: "), "{e}");
}

#[test]
fn the_sweeper_never_spins_and_never_batches_nothing() {
    let s = sweep_settings(&serve_args(&[
        "--sweep-interval-ms",
        "0",
        "--sweep-batch",
        "0",
        "--audit-retention-secs",
        "60",
        "--no-sweeper",
    ]));
    assert_eq!(s.interval, Duration::from_millis(10));
    assert_eq!(s.batch, 1);
    assert_eq!(s.audit_retention_ms, 60_000);
    assert!(!s.enabled);
    let huge = sweep_settings(&serve_args(&["--audit-retention-secs", &u64::MAX.to_string()]));
    assert_eq!(huge.audit_retention_ms, u64::MAX);
    assert!(huge.enabled);
}

#[test]
fn console_sessions_idle_at_least_a_minute() {
    let s = serve(&["--console-idle-minutes", "0", "--no-console"]).unwrap();
    assert_eq!(s.http.console.idle, Duration::from_secs(60));
    assert!(!s.http.console.enabled);
    assert_eq!(
        serve(&[]).unwrap().http.console.idle,
        Duration::from_secs(15 * 60)
    );
}

#[test]
fn operator_sources_are_checked() {
    assert_eq!(
        refusal(&["--operator-header", "bad header"]),
        "--operator-header: \"bad header\" is not a header name"
    );
    assert!(refusal(&["--operator-trusted-peers", "10.0.0.1,not-an-address"])
        .starts_with("--operator-trusted-peers: "));
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, "too short\n").unwrap();
    assert_eq!(
        refusal(&["--operator-proxy-secret-file", short.to_str().unwrap()]),
        "the operator proxy secret is shorter than 16 bytes"
    );
    let long = dir.path().join("long");
    std::fs::write(&long, "0123456789abcdef\n").unwrap();
    let s = serve(&[
        "--operator-proxy-secret-file",
        long.to_str().unwrap(),
        "--operator-trusted-peers",
        "10.0.0.0/8, ,",
    ])
    .unwrap();
    assert!(s.http.console.operators.secret.is_some());
    assert_eq!(s.http.console.operators.trusted_peers.len(), 1);
    assert!(s.http.console.operators.configured());
    assert!(!serve(&[]).unwrap().http.console.operators.configured());
}

#[test]
fn serve_keeps_its_addresses_and_http_limits() {
    let s = serve(&[
        "--listen",
        "unix:/tmp/store.sock",
        "--admin-listen",
        "127.0.0.1:9000",
        "--max-body-bytes",
        "1024",
        "--doc-base",
        "https://docs.example/p/",
    ])
    .unwrap();
    assert_eq!(s.listen, ["unix:/tmp/store.sock"]);
    assert_eq!(s.admin_listen.as_deref(), Some("127.0.0.1:9000"));
    assert_eq!(s.http.max_body_bytes, 1024);
    assert_eq!(s.http.doc_base, "https://docs.example/p/");
    assert!(s.new_keys.is_none());
}

#[test]
fn serve_listens_on_every_address_given() {
    let both = ["127.0.0.1:8787", "unix:/tmp/store.sock"];
    let repeated = serve(&["--listen", both[0], "--listen", both[1]]).unwrap();
    assert_eq!(repeated.listen, both);
    let listed = serve(&["--listen", "127.0.0.1:8787,unix:/tmp/store.sock"]).unwrap();
    assert_eq!(listed.listen, both);
    assert_eq!(serve(&[]).unwrap().listen, ["127.0.0.1:8787"]);
}

#[test]
fn the_request_size_limit_stays_within_what_the_database_stores() {
    let most = crate::MAX_BODY_BYTES.to_string();
    assert_eq!(
        serve(&["--max-body-bytes", &most]).unwrap().http.max_body_bytes,
        crate::MAX_BODY_BYTES
    );
    let over = (crate::MAX_BODY_BYTES + 1).to_string();
    assert!(refusal(&["--max-body-bytes", &over]).contains("--max-body-bytes: at most"));
}

#[test]
fn only_serve_chooses_the_log_format() {
    assert_eq!(
        cli(&["serve", "--log-format", "json"]).log_format(),
        LogFormat::Json
    );
    assert_eq!(cli(&["serve"]).log_format(), LogFormat::Text);
    assert_eq!(cli(&["sweep"]).log_format(), LogFormat::Text);
    assert!(Cli::try_parse_from(["idempotency-store", "serve", "--log-format", "xml"]).is_err());
}

fn serve_without_token(args: &[&str]) -> Result<ServeSettings, CliError> {
    let mut line = vec!["serve"];
    line.extend(args);
    match cli(&line).command {
        Command::Serve(s) => ServeSettings::new(&s, Some("admin-token".into())),
        other => panic!("not serve: {other:?}"),
    }
}

#[test]
fn mesh_identities_come_from_their_file_and_stand_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("identities.yaml");
    std::fs::write(
        &file,
        "identities:\n  spiffe://cluster.local/ns/shop/sa/payments: [payments.create]\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let s = serve_without_token(&[
        "--mesh-identities-file",
        file,
        "--mesh-trusted-peers",
        "127.0.0.6",
    ])
    .unwrap();
    assert!(s.http.mesh.configured());
    assert!(!s.http.api_token.configured());
    let s = serve(&[
        "--mesh-identities-file",
        file,
        "--mesh-trusted-peers",
        "127.0.0.6",
    ])
    .unwrap();
    assert!(s.http.mesh.configured() && s.http.api_token.matches(b"api-token"));
    // Neither a token nor mesh identities: nobody could call the API.
    assert!(serve_without_token(&[]).is_err());
    // Identities believed from nowhere: refused by clap (the peers are required).
    let mut line = vec!["idempotency-store", "serve", "--mesh-identities-file", file];
    assert!(Cli::try_parse_from(line.clone()).is_err());
    line.extend(["--mesh-trusted-peers", "not-an-address"]);
    let Command::Serve(args) = Cli::try_parse_from(line).unwrap().command else {
        panic!("not serve");
    };
    assert!(ServeSettings::new(&args, Some("admin-token".into())).is_err());
    std::fs::write(dir.path().join("empty.yaml"), "identities: {}\n").unwrap();
    let empty = dir.path().join("empty.yaml");
    assert!(serve(&[
        "--mesh-identities-file",
        empty.to_str().unwrap(),
        "--mesh-trusted-peers",
        "127.0.0.6"
    ])
    .is_err());
}

#[test]
fn token_files_are_re_read_and_the_next_one_may_be_absent() {
    let dir = tempfile::tempdir().unwrap();
    let current = dir.path().join("api");
    std::fs::write(&current, "api-token\n").unwrap();
    let next = dir.path().join("next");
    let args = [
        "--api-token-file",
        current.to_str().unwrap(),
        "--api-token-next-file",
        next.to_str().unwrap(),
    ];
    let s = serve_without_token(&args).unwrap();
    assert!(s.http.api_token.reloads() && s.http.api_token.matches(b"api-token"));
    std::fs::write(&current, "admin-token").unwrap();
    assert!(serve_without_token(&args).is_err());
}
