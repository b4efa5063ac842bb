//! Tenant isolation and hostile clients (contract §2, §7, §9), through the
//! real Envoy and the real store: another tenant's key, forged identity
//! headers and tokens, the store's credentials, and what logs and problem
//! bodies may never contain.
//!
//! Each test collects its failed checks before asserting, so it can write its
//! row of docs/reliability.md (under `IDEMGATE_REPORT`) either way.

// Test support: failing loudly is how a helper reports a broken run.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use e2e::report::Checks;
use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, send, Answer, Harness, ADMIN_TOKEN, API_TOKEN};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;

use e2e::fresh_key as key;

/// What a fresh answer looks like from outside: status, header names that
/// are not per-response, and the body's member names.
fn shape(a: &Answer) -> (u16, BTreeSet<String>, BTreeSet<String>) {
    let headers = a
        .headers
        .keys()
        .map(|k| k.as_str().to_string())
        .filter(|k| {
            !matches!(
                k.as_str(),
                "date" | "x-envoy-upstream-service-time" | "content-length"
            )
        })
        .collect();
    let members = a
        .json()
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    (a.status, headers, members)
}

fn execution(a: &Answer) -> Option<u64> {
    a.json()["execution"].as_u64()
}

#[tokio::test(flavor = "multi_thread")]
async fn another_tenant_using_a_key_in_flight_or_completed_executes_on_its_own_and_learns_nothing() {
    let h = Harness::start().await;
    let mut c = Checks::default();
    let k = key("shared");
    let slow = h
        .post_as("tenant-a", "alice", "/pay", Some(&k), PAYMENT)
        .header("x-test-delay-ms", "1500");
    let a = tokio::spawn(send(slow));
    eventually("A to reach the upstream", Duration::from_secs(10), || async {
        h.upstream.executions(&k) == 1
    })
    .await;
    // While A is in flight: B with the same body, C with another one.
    let b = send(h.post_as("tenant-b", "alice", "/pay", Some(&k), PAYMENT)).await;
    let other = r#"{"amount": 1, "currency": "EUR"}"#;
    let c_ans = send(h.post_as("tenant-c", "alice", "/pay", Some(&k), other)).await;
    let a = a.await.unwrap_or_else(|e| panic!("A failed: {e}"));
    // After A completed: D, and A's own retry.
    let d = send(h.post_as("tenant-d", "alice", "/pay", Some(&k), PAYMENT)).await;
    let a_again = send(h.post_as("tenant-a", "alice", "/pay", Some(&k), PAYMENT)).await;
    // A brand-new key, for comparison.
    let fresh = send(h.post_as("tenant-b", "alice", "/pay", Some(&key("fresh")), PAYMENT)).await;

    c.check(a.status == 201, format!("A: {a:?}"));
    for (name, x) in [
        ("B in flight", &b),
        ("C in flight, other body", &c_ans),
        ("D after completion", &d),
    ] {
        c.check(
            x.status == 201,
            format!("{name} did not execute on its own: {x:?}"),
        );
        c.check(
            x.header("idempotent-replayed").is_none(),
            format!("{name} got a replay"),
        );
        c.check(
            execution(x).is_some() && execution(x) != execution(&a),
            format!("{name} saw A's execution"),
        );
        c.check(x.body != a.body, format!("{name} got A's body"));
        c.check(
            x.header("location") != a.header("location"),
            format!("{name} got A's location"),
        );
        c.check(
            x.problem().is_none(),
            format!("{name} got a problem that reveals A's key: {x:?}"),
        );
        c.check(
            shape(x) == shape(&fresh),
            format!(
                "{name} looks unlike a fresh key: {:?} vs {:?}",
                shape(x),
                shape(&fresh)
            ),
        );
    }
    c.check(
        a_again.header("idempotent-replayed") == Some("true") && a_again.body == a.body,
        format!("A's own retry does not replay A: {a_again:?}"),
    );
    let tenants: BTreeSet<String> = h
        .upstream
        .log()
        .into_iter()
        .filter(|e| e.key == k)
        .map(|e| e.tenant)
        .collect();
    c.check(
        h.upstream.executions(&k) == 4,
        format!("{} executions of the shared key", h.upstream.executions(&k)),
    );
    c.check(tenants.len() == 4, format!("executed for tenants {tenants:?}"));
    c.finish(
        "security: another tenant's key",
        "1 key shared by 4 tenants, in flight and completed".into(),
        "same key with same and other body from other tenants".into(),
        "—".into(),
    );
}

fn token(name: &str) -> String {
    let path = e2e::repo_root().join("examples/tokens").join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path:?}: {e}"))
        .trim()
        .to_string()
}

fn base64url(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ABC[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn identity_headers_and_forged_tokens_cannot_choose_a_tenant() {
    let mut opts = Options::new("envoy/demo.yaml", Database::Sqlite, 1);
    opts.api_token = "demo-api-token";
    let s = Stack::start(opts).await;
    let mut c = Checks::default();
    let (token_a, token_b) = (token("tenant-a.jwt"), token("tenant-b.jwt"));
    let post = |bearer: Option<&str>, k: &str| {
        let mut req = s
            .client
            .post(s.url("/v1/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", k)
            .body(PAYMENT);
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        req
    };
    let k = key("jwt");
    let b = send(post(Some(&token_b), &k)).await;
    c.check(b.status == 201, format!("tenant-b's own request: {b:?}"));
    // tenant-a's token, claiming to be tenant-b / bob by header.
    let forged = send(
        post(Some(&token_a), &k)
            .header("x-tenant-id", "tenant-b")
            .header("x-user-id", "bob"),
    )
    .await;
    c.check(
        forged.status == 201,
        format!("tenant-a with forged headers: {forged:?}"),
    );
    c.check(
        forged.header("idempotent-replayed").is_none() && forged.body != b.body,
        "identity headers chose tenant-b: got its replay",
    );
    let log = s.upstream.log();
    let tenants: Vec<&str> = log
        .iter()
        .filter(|e| e.key == k)
        .map(|e| e.tenant.as_str())
        .collect();
    c.check(
        tenants == ["tenant-b", "tenant-a"],
        format!("the upstream saw tenants {tenants:?}"),
    );
    let a_records = s
        .records("tenant-a", "alice", "payments.create", &k)
        .await
        .unwrap_or_default();
    let b_records = s
        .records("tenant-b", "bob", "payments.create", &k)
        .await
        .unwrap_or_default();
    c.check(
        a_records.len() == 1 && b_records.len() == 1,
        format!("records {a_records:?} {b_records:?}"),
    );
    // No token, a tampered token, an unsigned token: refused before anything runs.
    let before = s.upstream.total();
    let mut parts: Vec<String> = token_a.split('.').map(str::to_string).collect();
    let claims = br#"{"aud":"payments-demo","exp":4102444800,"iss":"https://demo.idemgate.invalid","sub":"bob","tenant":"tenant-b"}"#;
    parts[1] = base64url(claims);
    let tampered = parts.join(".");
    let unsigned = format!(
        "{}.{}.",
        base64url(br#"{"alg":"none","typ":"JWT"}"#),
        base64url(claims)
    );
    // Signed with the demo key but wrong in a claim, or signed with another
    // key under the demo key's id.
    let demo = payments::token::demo_key().unwrap();
    let claims = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut claims = serde_json::json!({
            "iss": payments::token::ISSUER, "aud": payments::token::AUDIENCE,
            "sub": "bob", "tenant": "tenant-b", "iat": 1_700_000_000u64, "exp": 4_102_444_800u64,
        });
        edit(&mut claims);
        claims
    };
    let signed = |edit: &dyn Fn(&mut serde_json::Value)| payments::token::sign(&demo, &claims(edit));
    let expired = signed(&|c| c["exp"] = 1_700_000_100u64.into());
    let no_expiry = signed(&|c| drop(c.as_object_mut().map(|o| o.remove("exp"))));
    let wrong_issuer = signed(&|c| c["iss"] = "https://evil.invalid".into());
    let wrong_audience = signed(&|c| c["aud"] = "another-api".into());
    let impostor_key = p256::ecdsa::SigningKey::from_bytes(&[7u8; 32].into()).unwrap();
    let same_kid_other_key = payments::token::sign(&impostor_key, &claims(&|_| {}));
    for (name, bearer) in [
        ("no token", None),
        ("tampered token", Some(tampered.as_str())),
        ("alg none", Some(unsigned.as_str())),
        ("expired token", Some(expired.as_str())),
        ("token without an expiry", Some(no_expiry.as_str())),
        ("wrong issuer", Some(wrong_issuer.as_str())),
        ("wrong audience", Some(wrong_audience.as_str())),
        (
            "another key under the demo key's id",
            Some(same_kid_other_key.as_str()),
        ),
    ] {
        // jwt_authn answers 401, or 403 for a token it verified but whose
        // audience this route does not accept.
        let a = send(post(bearer, &key("forged")).header("x-tenant-id", "tenant-b")).await;
        c.check(
            a.status == 401 || (a.status == 403 && name == "wrong audience"),
            format!("{name}: {} {:?}", a.status, a.body),
        );
    }
    // A valid token without the tenant claim names nobody: no identity, no execution.
    let no_tenant = signed(&|c| drop(c.as_object_mut().map(|o| o.remove("tenant"))));
    let a = send(post(Some(&no_tenant), &key("no-tenant")).header("x-tenant-id", "tenant-b")).await;
    c.check(
        a.status == 400 && a.problem().as_deref() == Some("identity-missing"),
        format!("a token without a tenant: {} {:?}", a.status, a.body),
    );
    c.check(
        s.upstream.total() == before,
        "a request without a valid token reached the upstream",
    );
    c.finish(
        "security: identity headers and tokens",
        "envoy/demo.yaml (jwt_authn)".into(),
        "forged x-tenant-id/x-user-id, no token, tampered, unsigned, expired, expiry-less, wrong-issuer, wrong-audience and impostor-key tokens, a token without a tenant".into(),
        "—".into(),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_refuses_missing_and_wrong_credentials_and_admin_refuses_the_api_one() {
    let h = Harness::start().await;
    let mut c = Checks::default();
    let store = |path: &str| format!("http://127.0.0.1:{}{path}", h.stores[0].port);
    let api = ["/v1/claim", "/v1/complete", "/v1/release", "/v1/mark-unknown"];
    let admin_get = ["/admin/v1/records/unknown", "/admin/v1/records/stuck"];
    let admin_post = [
        "/admin/v1/records/lookup",
        "/admin/v1/resolve",
        "/admin/v1/purge",
        "/admin/v1/sweep",
    ];
    let cases: Vec<(&str, String, Option<&str>, u16)> = api
        .iter()
        .flat_map(|p| {
            [
                ("POST", store(p), None, 401),
                ("POST", store(p), Some("wrong"), 401),
                ("POST", store(p), Some(""), 401),
                ("POST", store(p), Some(&API_TOKEN[..API_TOKEN.len() - 1]), 401),
                ("POST", store(p), Some(ADMIN_TOKEN), 403),
            ]
        })
        .chain(admin_get.iter().flat_map(|p| {
            [
                ("GET", store(p), None, 401),
                ("GET", store(p), Some("wrong"), 401),
                ("GET", store(p), Some(API_TOKEN), 403),
            ]
        }))
        .chain(admin_post.iter().flat_map(|p| {
            [
                ("POST", store(p), None, 401),
                ("POST", store(p), Some("wrong"), 401),
                ("POST", store(p), Some(API_TOKEN), 403),
            ]
        }))
        .collect();
    for (method, url, bearer, want) in &cases {
        let mut req = match *method {
            "GET" => h.client.get(url),
            _ => h.client.post(url).body("{}\n"),
        };
        if let Some(t) = bearer {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let a = send(req).await;
        let text = String::from_utf8_lossy(&a.body).to_string();
        c.check(
            a.status == *want,
            format!("{method} {url} with {bearer:?}: {} {text}", a.status),
        );
        c.check(
            a.header("content-type") == Some("application/problem+json"),
            format!("{method} {url}: not a problem: {text}"),
        );
        c.check(
            !text.contains(API_TOKEN) && !text.contains(ADMIN_TOKEN),
            format!("{method} {url}: a credential in the answer"),
        );
    }
    // A wrong scheme is no credential either.
    let basic = send(
        h.client
            .post(store("/v1/claim"))
            .header("authorization", format!("Basic {API_TOKEN}")),
    )
    .await;
    c.check(basic.status == 401, format!("Basic scheme: {}", basic.status));
    c.finish(
        "security: store credentials",
        format!(
            "{} requests to the store's API and admin endpoints",
            cases.len() + 1
        ),
        "no, empty, wrong, truncated and swapped bearer credentials".into(),
        "—".into(),
    );
}

/// Drives every problem the filter and the store can produce, on PostgreSQL
/// with debug logs, including a store and a database that die under it;
/// then no log line of any process may hold a raw key, and no problem body
/// may show internals.
#[tokio::test(flavor = "multi_thread")]
async fn no_log_line_holds_a_raw_key_and_no_problem_body_shows_internals() {
    let mut opts = Options::new("envoy/e2e.yaml", Database::Postgres, 1);
    opts.envoy_args = vec!["--component-log-level".into(), "wasm:debug".into()];
    // Everything at debug, the PostgreSQL driver included: the store itself
    // must keep that driver's statement parameters out of its log.
    opts.store_log = "debug";
    let mut s = Stack::start(opts).await;
    let mut c = Checks::default();
    // Every key carries this tag, so a log line holding any of them is found.
    let tag = format!("rk{:x}", e2e::chaos::seed() & 0xffff_ffff);
    let k = |label: &str| format!("{tag}-{}", key(label));
    let mut answers: Vec<(String, Answer)> = Vec::new();
    let (done, busy, unknown, big) = (k("done"), k("busy"), k("unknown"), k("big"));
    answers.push(("fresh".into(), send(s.post("/pay", Some(&done), PAYMENT)).await));
    answers.push(("replay".into(), send(s.post("/pay", Some(&done), PAYMENT)).await));
    answers.push(("key-reused".into(), send(s.post("/pay", Some(&done), "{}")).await));
    let slow = tokio::spawn(send(
        s.post("/pay", Some(&busy), PAYMENT)
            .header("x-test-delay-ms", "1000"),
    ));
    eventually(
        "the slow request to reach the upstream",
        Duration::from_secs(10),
        || async { s.upstream.log().iter().any(|e| e.key == busy) },
    )
    .await;
    answers.push((
        "in-progress".into(),
        send(s.post("/pay", Some(&busy), PAYMENT)).await,
    ));
    let _ = slow.await;
    send(
        s.post("/pay", Some(&unknown), PAYMENT)
            .header("x-test-control", "uncertain"),
    )
    .await;
    answers.push((
        "outcome-unknown".into(),
        send(s.post("/pay", Some(&unknown), PAYMENT)).await,
    ));
    send(
        s.post("/small", Some(&big), "{}")
            .header("x-test-body-size", "5000"),
    )
    .await;
    answers.push((
        "result-unavailable".into(),
        send(s.post("/small", Some(&big), "{}")).await,
    ));
    answers.push((
        "body-too-large".into(),
        send(s.post("/small", Some(&k("large")), &"x".repeat(100))).await,
    ));
    answers.push(("key-missing".into(), send(s.post("/pay", None, PAYMENT)).await));
    let hostile_keys = [
        format!("{tag} with spaces"),
        format!("\"{tag}-unterminated"),
        format!("{tag}-{}", "k".repeat(300)),
        format!("\"{tag}\\qx\""),
        format!("{tag}\u{e9}"),
    ];
    for bad in &hostile_keys {
        let value =
            reqwest::header::HeaderValue::from_bytes(bad.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        answers.push((
            "key-invalid".into(),
            send(s.post("/pay", None, PAYMENT).header("idempotency-key", value)).await,
        ));
    }
    let nobody = s
        .client
        .post(s.url("/pay"))
        .header("idempotency-key", k("nobody"))
        .body(PAYMENT);
    answers.push(("identity-missing".into(), send(nobody).await));
    // The store's own problems, straight at it.
    let store = s.store_url(0, "/v1/claim");
    for body in [
        "garbage".to_string(),
        format!("{{\"scope\": {{\"key\": \"{tag}\"}}}}\n"),
        format!(
            "{{\"scope\":{{\"version\":\"v1\",\"tenant\":\"a\\u0000b\",\"principal\":\"p\",\"route\":\"r\",\"namespace\":\"u\",\"key\":\"{tag}\"}},\"fingerprint\":null,\"lease_ms\":1,\"ttl_ms\":1,\"after_expiry\":\"reject\",\"on_unknown\":\"conflict\"}}\n"
        ),
    ] {
        let a = send(s.client.post(&store).bearer_auth(API_TOKEN).body(body)).await;
        answers.push(("store bad request".into(), a));
    }
    answers.push((
        "store 404".into(),
        send(s.client.get(s.store_url(0, "/etc/passwd")).bearer_auth(API_TOKEN)).await,
    ));
    // The database dies under the store, then the store dies.
    drop(s.pg.take());
    answers.push((
        "database down, via Envoy".into(),
        send(s.post("/pay", Some(&k("pgdown")), PAYMENT)).await,
    ));
    let claim = format!(
        "{{\"scope\":{{\"version\":\"v1\",\"tenant\":\"t\",\"principal\":\"p\",\"route\":\"r\",\"namespace\":\"u\",\"key\":\"{tag}\"}},\"fingerprint\":null,\"lease_ms\":1000,\"ttl_ms\":1000,\"after_expiry\":\"reject\",\"on_unknown\":\"conflict\"}}\n"
    );
    answers.push((
        "database down, at the store".into(),
        send(s.client.post(&store).bearer_auth(API_TOKEN).body(claim)).await,
    ));
    s.kill_store(0);
    answers.push((
        "store down".into(),
        send(s.post("/pay", Some(&k("down")), PAYMENT)).await,
    ));

    for (what, a) in &answers {
        let text = String::from_utf8_lossy(&a.body).to_string();
        if what != "fresh" && what != "replay" {
            c.check(
                a.problem().is_some(),
                format!("{what}: not a problem: {} {text}", a.status),
            );
        }
        if let Some(m) = e2e::internals::shown_in(&text) {
            c.check(
                false,
                format!("{what}: problem body shows internals ({m}): {text}"),
            );
        }
        c.check(
            !text.contains(&tag),
            format!("{what}: the answer repeats a raw key: {text}"),
        );
    }
    let expected = [
        "key-reused",
        "request-in-progress",
        "outcome-unknown",
        "result-unavailable",
        "body-too-large",
        "key-missing",
        "key-invalid",
        "identity-missing",
        "store-unavailable",
    ];
    let seen: BTreeSet<String> = answers.iter().filter_map(|(_, a)| a.problem()).collect();
    for slug in expected {
        c.check(
            seen.contains(slug),
            format!("never produced {slug}; saw {seen:?}"),
        );
    }
    let lines = s.log_lines();
    c.check(lines.len() > 20, format!("only {} log lines", lines.len()));
    for (file, line) in lines.iter().filter(|(_, l)| l.contains(&tag)).take(10) {
        c.check(false, format!("raw key in {file}: {line}"));
    }
    c.finish(
        "security: logs and problem bodies",
        format!(
            "{} requests, {} log lines (Envoy wasm and store at debug)",
            answers.len(),
            lines.len()
        ),
        "every problem type, hostile keys, malformed store frames, database and store killed".into(),
        "—".into(),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_numeric_jwt_claim_is_an_identity_by_its_json_text() {
    let mut opts = Options::new("envoy/demo.yaml", Database::Sqlite, 1);
    opts.api_token = "demo-api-token";
    let s = Stack::start(opts).await;
    let signer = payments::token::demo_key().unwrap();
    let mint = |tenant: serde_json::Value, sub: serde_json::Value| {
        payments::token::mint_claims(&signer, tenant, sub, 1_700_000_000, 4_102_444_800)
    };
    let post = |bearer: &str, k: &str| {
        s.client
            .post(s.url("/v1/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", k)
            .bearer_auth(bearer)
            .body(PAYMENT)
    };
    let k = key("numeric-claims");
    // jwt_authn itself insists on a string `sub`; the tenant may be a number.
    let numeric = mint(serde_json::json!(4242), serde_json::json!("alice"));
    let first = send(post(&numeric, &k)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send(post(&numeric, &k)).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{again:?}");
    // Another numeric tenant is another scope.
    let other = send(post(
        &mint(serde_json::json!(4243), serde_json::json!("alice")),
        &k,
    ))
    .await;
    assert_eq!(other.status, 201, "{other:?}");
    assert!(other.header("idempotent-replayed").is_none());
    let records = s
        .records("4242", "alice", "payments.create", &k)
        .await
        .unwrap_or_default();
    assert_eq!(
        records.len(),
        1,
        "the store's scope is the claims' JSON text: {records:?}"
    );
}

/// The store credential can stay out of the plugin configuration, which
/// Envoy's `/config_dump` shows to anyone with admin access: the filter reads
/// it from the Envoy process's environment (`store.token_env`).
#[tokio::test(flavor = "multi_thread")]
async fn the_store_credential_can_come_from_envoys_environment_instead_of_its_configuration() {
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.envoy_env = vec![("IDEMGATE_STORE_TOKEN", API_TOKEN)];
    options.edit = Some(Box::new(|yaml: String| {
        let token = format!("\"token\": \"{API_TOKEN}\"");
        assert!(
            yaml.contains(&token),
            "envoy/e2e.yaml names its token differently"
        );
        let runtime = "runtime: envoy.wasm.runtime.v8";
        yaml.replace(&token, "\"token_env\": \"IDEMGATE_STORE_TOKEN\"")
            .replace(
            runtime,
            &format!(
                "{runtime}\n                  environment_variables: {{host_env_keys: [IDEMGATE_STORE_TOKEN]}}"
            ),
        )
    }));
    let stack = Stack::start(options).await;
    let k = key("env-token");
    let first = send(stack.post("/pay", Some(&k), "{}")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let replay = send(stack.post("/pay", Some(&k), "{}")).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let dump = stack.admin_text("/config_dump").await;
    assert!(
        dump.contains("IDEMGATE_STORE_TOKEN"),
        "not the edited configuration"
    );
    assert!(
        !dump.contains(API_TOKEN),
        "the store credential shows in /config_dump"
    );
}

/// The store's gRPC replay method answers only the filter's own reroutes: a
/// client on the demo's virtual host, which serves browsers too, cannot have
/// it reflect a page or a cookie, with the route's marker header or without.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_cannot_make_the_replay_route_reflect_a_page_or_a_cookie() {
    let mut opts = Options::new("envoy/demo.yaml", Database::Sqlite, 1);
    opts.api_token = "demo-api-token";
    let s = Stack::start(opts).await;
    let block = r#"{"headers":[["content-type","text/html"],["set-cookie","session=stolen"]],"trailers":[]}"#;
    let page = format!("{block}\n<script>alert(document.domain)</script>");
    for marker in [None, Some("1")] {
        let mut req = s
            .client
            .post(s.url(idemgate_core::protocol::REPLAY_PATH))
            .bearer_auth(token("tenant-a.jwt"))
            .header("content-type", "text/plain")
            .body(page.clone());
        if let Some(value) = marker {
            req = req.header(idemgate_core::protocol::REPLAY_MARKER, value);
        }
        let a = send(req).await;
        let body = String::from_utf8_lossy(&a.body);
        assert!(
            a.header("set-cookie").is_none()
                && a.header("content-type") != Some("text/html")
                && !body.contains("<script>"),
            "marker {marker:?}: reflected: {a:?}"
        );
        // The demo's virtual host has no route for the path once the
        // marker is gone: Envoy's own problem, not the store's answer.
        assert_eq!(a.status, 404, "marker {marker:?}: {a:?}");
    }
}
