//! What each fuzz target checks, as plain functions so that the regression
//! test (`tests/regressions.rs`) can replay every saved input on stable Rust
//! without libFuzzer.
//!
//! Every function takes arbitrary bytes and panics only when the code under
//! test broke a promise: a parser panicked, accepted something the contract
//! forbids, or a round trip changed its answer.

use std::sync::OnceLock;

use idemgate_core::config::Config;
use idemgate_core::jcs;
use idemgate_core::key::{parse_key, KeyRules, MAX_KEY_LEN};
use idemgate_core::protocol::{decode_frame, ClaimReply, ClaimRequest};
use idemgate_testkit::INTERNALS;

/// `Idempotency-Key` parsing (contract §1). The first byte picks the rules
/// and how many field lines the rest is split into (at `\n`).
pub fn key(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let rules = KeyRules {
        strict: mode & 1 == 1,
        min_len: usize::from(mode >> 1 & 7),
        max_len: if mode & 0x10 == 0 { MAX_KEY_LEN } else { 1000 },
    };
    let fields: Vec<&[u8]> = if mode & 0x20 == 0 {
        vec![rest]
    } else {
        rest.split(|&b| b == b'\n').collect()
    };
    let parsed = parse_key(&fields, &rules);
    if fields.len() > 1 {
        assert!(parsed.is_err(), "two field lines must be refused");
    }
    if let Ok(Some(k)) = parsed {
        let s = k.as_str();
        assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN, "length {}", s.len());
        assert!(s.len() >= rules.min_len, "shorter than min_len");
        assert!(
            s.bytes()
                .all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\'),
            "a key holds a forbidden byte"
        );
        // The sf-string form spells the same key, even under strict rules.
        let sf = k.to_sf_string();
        let strict = KeyRules {
            strict: true,
            ..rules
        };
        assert_eq!(
            parse_key(&[sf.as_bytes()], &strict).ok().flatten().as_ref(),
            Some(&k)
        );
        // A valid key is also valid as a bare token when not strict.
        let bare = KeyRules {
            strict: false,
            ..rules
        };
        assert_eq!(
            parse_key(&[s.as_bytes()], &bare).ok().flatten().as_ref(),
            Some(&k)
        );
    }
}

/// RFC 8785 canonical JSON: never panics, and canonical output is a fixed
/// point (parsing and canonicalizing it again gives the same bytes).
pub fn jcs(data: &[u8]) {
    let Ok(value) = jcs::parse(data) else {
        return;
    };
    let Ok(canonical) = jcs::canonicalize(&value) else {
        return;
    };
    let again = jcs::parse(&canonical).unwrap_or_else(|e| {
        panic!(
            "canonical output does not parse: {e}: {:?}",
            String::from_utf8_lossy(&canonical)
        )
    });
    let twice =
        jcs::canonicalize(&again).unwrap_or_else(|e| panic!("canonical output does not canonicalize: {e}"));
    assert_eq!(canonical, twice, "canonicalization is not idempotent");
    assert!(
        std::str::from_utf8(&canonical).is_ok(),
        "canonical output is not UTF-8"
    );
}

/// The plugin configuration: never panics; an accepted one matches requests
/// without panicking either, and names every policy once.
pub fn config(data: &[u8]) {
    let Ok(config) = Config::parse(data) else {
        return;
    };
    assert!(!config.policies().is_empty());
    for (i, p) in config.policies().iter().enumerate() {
        assert!(
            config.policies()[..i].iter().all(|q| q.name() != p.name()),
            "policy name {:?} accepted twice",
            p.name()
        );
        assert!(p.key_rules().max_len <= MAX_KEY_LEN);
        assert!(p.ttl_ms() > 0 && p.lease_ms() > 0);
    }
    let text = String::from_utf8_lossy(data);
    for path in ["/", "/pay", "/v1/accounts/7/charges", "//", "/%2F", text.as_ref()] {
        for method in ["POST", "GET", "PATCH"] {
            let _ = config.policy_for(method, "example.com", path);
        }
    }
}

const API: &str = "fuzz-api-token";
const ADMIN: &str = "fuzz-admin-token";
const PROXY_SECRET: &str = "fuzz-proxy-secret-0123456789";

/// The endpoints a store request may go to; the first input byte picks one
/// (low three bits) and a credential (next two bits).
const ENDPOINTS: [(&str, &str, bool); 8] = [
    ("POST", "/v1/claim", false),
    ("POST", "/v1/complete", false),
    ("POST", "/v1/release", false),
    ("POST", "/v1/mark-unknown", false),
    ("POST", "/admin/v1/resolve", true),
    ("POST", "/admin/v1/purge", true),
    ("POST", "/admin/v1/records/lookup", true),
    ("GET", "/admin/v1/records/stuck", true),
];

struct StoreUnderTest {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
    _dir: tempfile::TempDir,
}

fn store() -> &'static StoreUnderTest {
    static STORE: OnceLock<StoreUnderTest> = OnceLock::new();
    STORE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let url = format!("sqlite://{}", dir.path().join("fuzz.db").display());
        let app = runtime.block_on(async {
            let opts = idemgate_store::database_url::BackendOptions {
                sqlite_synchronous_full: Some(false),
                pg_pool_size: None,
                ..Default::default()
            };
            let backend = idemgate_store::open_backend(&url, &opts)
                .await
                .unwrap_or_else(|e| panic!("backend: {e}"));
            backend.migrate().await.unwrap_or_else(|e| panic!("migrate: {e}"));
            let store = idemgate_store::Store::new(backend, idemgate_store::Clock::System);
            // Operators named by a proxy with its secret, so the changes
            // (resolve, purge) are reached and their bodies parsed.
            let console = idemgate_store::console::ConsoleSettings {
                operators: idemgate_store::auth::OperatorSource {
                    secret: Some(idemgate_store::auth::Credential::new(PROXY_SECRET)),
                    ..Default::default()
                },
                ..Default::default()
            };
            idemgate_store::app(
                idemgate_store::AppState::new(store, idemgate_store::Settings::new(API, ADMIN))
                    .with_console(console),
            )
        });
        StoreUnderTest {
            runtime,
            app,
            _dir: dir,
        }
    })
}

/// One request to the store's HTTP surface (the real router on SQLite).
/// Whatever the bytes: no 5xx, credentials are checked before anything else,
/// every error is a problem+json without internals, and a claim that succeeds
/// answers a well-formed frame.
pub fn store_request(data: &[u8]) {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    let Some((&select, body)) = data.split_first() else {
        return;
    };
    let (method, path, admin) = ENDPOINTS[usize::from(select & 7)];
    // A claim that waits for an in-progress record really waits: keep
    // iterations fast by not asking to.
    if path == "/v1/claim" {
        if let Ok((req, _)) = decode_frame::<ClaimRequest>(body) {
            if req.wait_ms > 0 {
                return;
            }
        }
    }
    let credential = match select >> 3 & 3 {
        0 => Some(if admin { ADMIN } else { API }),
        1 => Some(if admin { API } else { ADMIN }),
        2 => Some("wrong"),
        _ => None,
    };
    let uri = if method == "GET" {
        format!("{path}?{}", percent_encode(body))
    } else {
        path.to_string()
    };
    let mut req = Request::builder().method(method).uri(&uri);
    if let Some(token) = credential {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    if admin {
        req = req
            .header("x-forwarded-email", "fuzz@example.com")
            .header("x-idemgate-proxy-secret", PROXY_SECRET);
    }
    let body = if method == "GET" {
        Vec::new()
    } else {
        body.to_vec()
    };
    let Ok(req) = req.body(Body::from(body)) else {
        return;
    };
    let s = store();
    let (status, content_type, bytes) = s.runtime.block_on(async {
        let resp = s.app.clone().oneshot(req).await.unwrap_or_else(|e| match e {});
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        (status, content_type, bytes)
    });
    let text = String::from_utf8_lossy(&bytes);
    assert!(status < 500, "{method} {path}: {status} {text}");
    match select >> 3 & 3 {
        0 => {}
        1 => assert_eq!(status, 403, "{method} {path} with the other credential"),
        _ => assert_eq!(status, 401, "{method} {path} without the credential"),
    }
    // A marker the client sent itself may be echoed back (e.g. the name of an
    // unknown field in a 400's detail); only one it did not send is a leak.
    // Only errors are checked: a 200 from an admin listing shows records
    // that earlier inputs stored, whatever they contain.
    // Markers are looked for in the decoded strings, not in the JSON text,
    // where an echoed control byte becomes `\u001b` and then `…backtrace`.
    let sent = String::from_utf8_lossy(data);
    let decoded = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(members)) => members
            .values()
            .filter_map(|v| v.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => text.to_string(),
    };
    for marker in INTERNALS.iter().filter(|_| status >= 400) {
        assert!(
            !shows(&decoded, marker) || sent.contains(marker),
            "{method} {path} answered internals ({marker}): {text}"
        );
    }
    if status >= 400 && status != 409 {
        assert_eq!(
            content_type, "application/problem+json",
            "{method} {path}: {status} {text}"
        );
        let problem: serde_json::Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("problem body is not JSON: {e}: {text}"));
        assert_eq!(problem["status"], status, "{text}");
        assert!(
            problem["type"].is_string() && problem["title"].is_string(),
            "{text}"
        );
    }
    if path == "/v1/claim" && status == 200 {
        decode_frame::<ClaimReply>(&bytes)
            .unwrap_or_else(|e| panic!("claim answered a bad frame: {e}: {text}"));
    }
}

/// Whether `text` shows `marker`; a source location (`.rs:`) only counts
/// with its line number, because an echoed `….rs` followed by the store's own
/// `: unknown field` is no location.
fn shows(text: &str, marker: &str) -> bool {
    if marker == ".rs:" {
        text.match_indices(marker)
            .any(|(i, m)| text[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
    } else {
        text.contains(marker)
    }
}

fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~&=".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
