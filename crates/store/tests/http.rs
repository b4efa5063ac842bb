//! The axum app, in-process through `oneshot`: auth, bad input, the wire
//! shape of every endpoint, and the OpenAPI document against the routes.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply, FenceReply, FRAME_CONTENT_TYPE};
use idemgate_store::backend::Lookup;
use idemgate_store::{app, AppState, Clock, Settings, Store};
use tower::ServiceExt;

use crate::support::*;

struct Harness {
    state: AppState,
    _dir: tempfile::TempDir,
}

async fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(sqlite_backend(&dir).await, Clock::System);
    let settings = Settings {
        doc_base: "https://docs.example/problems/".into(),
        max_body_bytes: 4096,
        ..Settings::new(API, ADMIN)
    };
    let state = AppState::new(store, settings).with_console(behind_proxy());
    Harness { state, _dir: dir }
}

struct Resp {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(
            self.status.as_u16(),
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(self.headers["content-type"], "application/problem+json");
        assert_eq!(self.headers["cache-control"], "no-store");
        let link = self.headers["link"].to_str().unwrap();
        assert!(link.contains("rel=\"describedby\""), "{link}");
        let p = self.json();
        assert_eq!(p["type"], format!("https://docs.example/problems/{slug}"));
        assert_eq!(p["status"], status);
        assert!(p["title"].is_string() && p["detail"].is_string());
    }
}

impl Harness {
    async fn send(&self, method: &str, path: &str, token: Option<&str>, body: Vec<u8>) -> Resp {
        self.send_with(method, path, token, &[], body).await
    }

    async fn send_with(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Resp {
        let mut req = Request::builder().method(method).uri(path);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let resp = app(self.state.clone())
            .oneshot(req.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
        Resp {
            status,
            headers,
            body,
        }
    }
}

fn claim_json(tenant: &str, key: &str) -> serde_json::Value {
    serde_json::json!({
        "scope": { "version": "v1", "tenant": tenant, "principal": "*", "route": "payments.create", "namespace": "u", "key": key },
        "fingerprint": null, "lease_ms": 5000, "ttl_ms": 60000, "after_expiry": "reject", "on_unknown": "conflict"
    })
}

fn frame(meta: &serde_json::Value, bytes: &[u8]) -> Vec<u8> {
    let mut v = serde_json::to_vec(meta).unwrap();
    v.push(b'\n');
    v.extend_from_slice(bytes);
    v
}

#[tokio::test]
async fn the_api_needs_its_own_bearer_credential() {
    let h = harness().await;
    let body = frame(&claim_json("acme", "k1"), b"");
    h.send("POST", "/v1/claim", None, body.clone())
        .await
        .assert_problem(401, "unauthorized");
    h.send("POST", "/v1/claim", Some("wrong"), body.clone())
        .await
        .assert_problem(401, "unauthorized");
    h.send("POST", "/v1/claim", Some(ADMIN), body.clone())
        .await
        .assert_problem(403, "forbidden");
    let r = h.send("POST", "/v1/claim", Some(API), body).await;
    assert_eq!(r.status, 200);
}

/// Mixed versions during an upgrade: a filter that sends no protocol header
/// speaks version 1; the store answers in the highest common version and
/// says which, ignores fields it does not know, and refuses a caller it
/// shares no version with before reading its call.
#[tokio::test]
async fn the_store_answers_in_the_highest_common_protocol_version() {
    let h = harness().await;
    for (i, offer) in [None, Some("1"), Some("1, 9")].into_iter().enumerate() {
        let mut claim = claim_json("acme", &format!("proto{i}"));
        claim["a_field_of_a_later_version"] = serde_json::json!({"x": 1});
        let headers: Vec<(&str, &str)> = offer.map(|o| ("idemgate-protocol", o)).into_iter().collect();
        let r = h
            .send_with("POST", "/v1/claim", Some(API), &headers, frame(&claim, b""))
            .await;
        assert_eq!(r.status, 200, "{offer:?}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.headers["idemgate-protocol"], "1", "{offer:?}");
        assert!(matches!(
            decode_frame::<ClaimReply>(&r.body).unwrap().0,
            ClaimReply::Owned { .. }
        ));
    }
    for (offer, says) in [
        ("9", "this store speaks 1"),
        ("2, 3", "this store speaks 1"),
        ("one", "positive integers"),
        ("", "positive integers"),
    ] {
        let body = frame(&claim_json("acme", "proto-refused"), b"");
        let r = h
            .send_with(
                "POST",
                "/v1/claim",
                Some(API),
                &[("idemgate-protocol", offer)],
                body,
            )
            .await;
        r.assert_problem(400, "bad-request");
        let detail = r.json()["detail"].as_str().unwrap().to_string();
        assert!(detail.contains(says), "{offer:?}: {detail}");
    }
    // Refused before the call was read: the key is still free.
    let r = h
        .send(
            "POST",
            "/v1/claim",
            Some(API),
            frame(&claim_json("acme", "proto-refused"), b""),
        )
        .await;
    assert!(matches!(
        decode_frame::<ClaimReply>(&r.body).unwrap().0,
        ClaimReply::Owned { .. }
    ));
}

/// A rotation without outage: while filters move from the old API token to
/// the next one, the store accepts both (and still neither the admin one
/// nor anything else).
#[tokio::test]
async fn during_a_rotation_the_api_accepts_the_old_and_the_next_token() {
    let mut h = harness().await;
    h.state = h.state.clone().with_next_api_token("next-api-token");
    for (i, token) in [API, "next-api-token"].into_iter().enumerate() {
        let body = frame(&claim_json("acme", &format!("rot{i}")), b"");
        let r = h.send("POST", "/v1/claim", Some(token), body).await;
        assert_eq!(r.status, 200, "{token}");
    }
    let body = frame(&claim_json("acme", "rot-x"), b"");
    h.send("POST", "/v1/claim", Some("next-api-tokeN"), body.clone())
        .await
        .assert_problem(401, "unauthorized");
    h.send("POST", "/v1/claim", Some(ADMIN), body)
        .await
        .assert_problem(403, "forbidden");
    // The admin surface does not take the next API token either.
    h.send(
        "POST",
        "/admin/v1/records/lookup",
        Some("next-api-token"),
        br#"{"tenant": "acme", "key": "rot0"}"#.to_vec(),
    )
    .await
    .assert_problem(403, "forbidden");
}

#[tokio::test]
async fn admin_endpoints_need_the_admin_credential() {
    let h = harness().await;
    let path = "/admin/v1/records/lookup";
    let body = br#"{"tenant": "acme", "key": "k1"}"#.to_vec();
    h.send("POST", path, None, body.clone())
        .await
        .assert_problem(401, "unauthorized");
    h.send("POST", path, Some("nope"), body.clone())
        .await
        .assert_problem(401, "unauthorized");
    h.send("POST", path, Some(API), body.clone())
        .await
        .assert_problem(403, "forbidden");
    let r = h.send("POST", path, Some(ADMIN), body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), serde_json::json!({"records": [], "events": []}));
}

#[tokio::test]
async fn the_lookup_never_takes_a_key_in_the_url() {
    let h = harness().await;
    let r = h
        .send("GET", "/admin/v1/records?tenant=acme&key=k1", Some(ADMIN), vec![])
        .await;
    assert!(r.status == 404 || r.status == 405, "status {}", r.status);
    let r = h
        .send(
            "GET",
            "/admin/v1/records/lookup?tenant=acme&key=k1",
            Some(ADMIN),
            vec![],
        )
        .await;
    assert_eq!(r.status, 405);
}

#[tokio::test]
async fn claim_complete_and_replay_over_http() {
    let h = harness().await;
    let r = h
        .send(
            "POST",
            "/v1/claim",
            Some(API),
            frame(&claim_json("acme", "k1"), b""),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], FRAME_CONTENT_TYPE);
    let (reply, bytes) = decode_frame::<ClaimReply>(&r.body).unwrap();
    let ClaimReply::Owned { fence } = reply else {
        panic!("{reply:?}")
    };
    assert!(bytes.is_empty());
    let s = scope_of(
        "acme",
        "*",
        "payments.create",
        idemgate_core::scope::Namespace::Client,
        "k1",
    );
    let done = h
        .send(
            "POST",
            "/v1/complete",
            Some(API),
            encode_frame(&complete(&s, fence, 201), b"\x00binary\nbody"),
        )
        .await;
    assert_eq!(done.status, 200);
    assert_eq!(
        decode_frame::<FenceReply>(&done.body).unwrap().0,
        FenceReply::Done
    );
    let stale = h
        .send(
            "POST",
            "/v1/complete",
            Some(API),
            encode_frame(&complete(&s, fence + 100, 201), b""),
        )
        .await;
    assert_eq!(stale.status, 409);
    assert_eq!(
        decode_frame::<FenceReply>(&stale.body).unwrap().0,
        FenceReply::Stale
    );
    let r = h
        .send(
            "POST",
            "/v1/claim",
            Some(API),
            frame(&claim_json("acme", "k1"), b""),
        )
        .await;
    let (reply, bytes) = decode_frame::<ClaimReply>(&r.body).unwrap();
    assert!(matches!(reply, ClaimReply::Replay { status: 201, .. }));
    assert_eq!(bytes, b"\x00binary\nbody");
    for path in ["/v1/release", "/v1/mark-unknown"] {
        let r = h
            .send(
                "POST",
                path,
                Some(API),
                encode_frame(&crate::support::fence(&s, fence), b""),
            )
            .await;
        assert_eq!(r.status, 409, "{path}: a completed record is not open");
    }
    let admin = h
        .send(
            "POST",
            "/admin/v1/records/lookup",
            Some(ADMIN),
            br#"{"tenant": "acme", "key": "k1", "route": "payments.create"}"#.to_vec(),
        )
        .await;
    assert_eq!(admin.json()["records"][0]["replay_count"], 1);
}

#[tokio::test]
async fn bad_input_is_a_400_and_never_reaches_the_database() {
    let h = harness().await;
    let good = claim_json("acme", "k-bad");
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("no metadata line", b"{}".to_vec()),
        ("not JSON", b"claim please\n".to_vec()),
        ("empty", Vec::new()),
        ("bytes after a claim", frame(&good, b"extra")),
    ];
    let mut mutate = |name: &'static str, f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = good.clone();
        f(&mut v);
        cases.push((name, frame(&v, b"")));
    };
    mutate("missing scope", &|v| {
        v.as_object_mut().unwrap().remove("scope");
    });
    mutate("missing lease", &|v| {
        v.as_object_mut().unwrap().remove("lease_ms");
    });
    mutate("unknown field in the scope", &|v| {
        v["scope"]["region"] = "eu".into()
    });
    mutate("control character in tenant", &|v| {
        v["scope"]["tenant"] = "ac\u{1}me".into()
    });
    mutate("empty tenant", &|v| v["scope"]["tenant"] = "".into());
    mutate("tenant too long", &|v| {
        v["scope"]["tenant"] = "t".repeat(256).into()
    });
    mutate("unsupported scope version", &|v| {
        v["scope"]["version"] = "v2".into()
    });
    mutate("bad namespace", &|v| v["scope"]["namespace"] = "x".into());
    mutate("key with a space", &|v| v["scope"]["key"] = "a b".into());
    mutate("empty key", &|v| v["scope"]["key"] = "".into());
    mutate("key too long", &|v| v["scope"]["key"] = "k".repeat(256).into());
    mutate("short fingerprint", &|v| v["fingerprint"] = "abcd".into());
    mutate("zero lease", &|v| v["lease_ms"] = 0.into());
    mutate("negative ttl", &|v| v["ttl_ms"] = (-1).into());
    mutate("wait too long", &|v| v["wait_ms"] = 3_600_000.into());
    mutate("bad policy enum", &|v| v["after_expiry"] = "maybe".into());
    for (name, body) in cases {
        let r = h.send("POST", "/v1/claim", Some(API), body).await;
        assert_eq!(r.status, 400, "{name}: {}", String::from_utf8_lossy(&r.body));
        r.assert_problem(400, "bad-request");
    }
    let s = scope_of(
        "acme",
        "*",
        "payments.create",
        idemgate_core::scope::Namespace::Client,
        "k-bad",
    );
    let mut bad_status = complete(&s, 1, 99);
    let r = h
        .send("POST", "/v1/complete", Some(API), encode_frame(&bad_status, b""))
        .await;
    r.assert_problem(400, "bad-request");
    bad_status.status = 200;
    bad_status.headers = vec![("bad header".into(), "v".into())];
    h.send("POST", "/v1/complete", Some(API), encode_frame(&bad_status, b""))
        .await
        .assert_problem(400, "bad-request");
    bad_status.headers = vec![("x-ok".into(), "line\r\nbreak".into())];
    h.send("POST", "/v1/complete", Some(API), encode_frame(&bad_status, b""))
        .await
        .assert_problem(400, "bad-request");
    let mut unstored = complete(&s, 1, 200);
    unstored.body_stored = false;
    h.send(
        "POST",
        "/v1/complete",
        Some(API),
        encode_frame(&unstored, b"bytes"),
    )
    .await
    .assert_problem(400, "bad-request");
    let alice = as_operator(ALICE);
    h.send_with(
        "POST",
        "/admin/v1/resolve",
        Some(ADMIN),
        &alice,
        b"{not json".to_vec(),
    )
    .await
    .assert_problem(400, "bad-request");
    h.send(
        "POST",
        "/admin/v1/records/lookup",
        Some(ADMIN),
        br#"{"tenant": "acme"}"#.to_vec(),
    )
    .await
    .assert_problem(400, "bad-request");

    let found = h
        .state
        .store
        .backend
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-bad".into(),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    assert!(found.records.is_empty(), "{found:?}");
}

#[tokio::test]
async fn an_oversize_body_is_a_413_problem() {
    let h = harness().await;
    let big = frame(&claim_json("acme", "k1"), &vec![b'x'; 5000]);
    h.send("POST", "/v1/claim", Some(API), big.clone())
        .await
        .assert_problem(413, "body-too-large");
    h.send("POST", "/v1/complete", Some(API), big)
        .await
        .assert_problem(413, "body-too-large");
}

#[tokio::test]
async fn unknown_paths_are_404_problems() {
    let h = harness().await;
    h.send("GET", "/v2/claim", None, vec![])
        .await
        .assert_problem(404, "not-found");
}

#[tokio::test]
async fn health_readiness_and_metrics_are_served() {
    let h = harness().await;
    assert_eq!(h.send("GET", "/healthz", None, vec![]).await.status, 200);
    assert_eq!(h.send("GET", "/readyz", None, vec![]).await.status, 200);
    h.send(
        "POST",
        "/v1/claim",
        Some(API),
        frame(&claim_json("acme", "m1"), b""),
    )
    .await;
    h.send(
        "POST",
        "/v1/claim",
        Some(API),
        frame(&claim_json("acme", "m1"), b""),
    )
    .await;
    let m = h.send("GET", "/metrics", None, vec![]).await;
    let text = String::from_utf8(m.body).unwrap();
    for name in [
        "idemgate_store_claims_total{outcome=\"owned\"} 1",
        "idemgate_store_claims_total{outcome=\"in_progress\"} 1",
        "idemgate_store_conflicts_total 1",
        "idemgate_store_replays_total",
        "idemgate_store_mismatches_total",
        "idemgate_store_unknown_records_total",
        "idemgate_store_claim_duration_seconds_bucket",
        "idemgate_store_oldest_in_progress_age_seconds",
        "idemgate_store_unknown_records_open 0",
        "idemgate_store_oldest_unknown_age_seconds",
        "idemgate_store_write_commit_seconds_count",
        "idemgate_store_write_answered_seconds_count",
        "idemgate_store_sweeper_runs_total",
        "idemgate_store_sweeper_errors_total 0",
        "idemgate_store_sweeper_unreadable_records_total 0",
        "idemgate_store_sweeper_last_success_timestamp_seconds",
        "idemgate_store_build_info{version=\"0.1.0\",backend=\"sqlite\"} 1",
        "idemgate_store_call_errors_total{call=\"complete\"} 0",
        "idemgate_store_call_errors_total{call=\"release\"} 0",
        "idemgate_store_claims_total{outcome=\"mismatch\"} 0",
        "idemgate_store_pool_connections 4",
        "idemgate_store_pool_max_connections 4",
        "idemgate_store_pool_available_connections",
        "idemgate_store_pool_waiting 0",
        "idemgate_store_sqlite_writer_queue 0",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    assert!(!text.contains("m1"), "raw keys never appear in metrics");
}

/// A gauge's value in the metrics text.
fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"))
}

#[tokio::test]
async fn a_sweeper_pass_sets_the_time_of_the_last_success() {
    let h = harness().await;
    let metrics = || async {
        let m = h.send("GET", "/metrics", None, vec![]).await;
        String::from_utf8(m.body).unwrap()
    };
    let name = "idemgate_store_sweeper_last_success_timestamp_seconds";
    assert_eq!(gauge(&metrics().await, name), 0.0);
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let sweep = h.send("POST", "/admin/v1/sweep", Some(ADMIN), vec![]).await;
    assert_eq!(sweep.status, 200);
    let text = metrics().await;
    assert!(gauge(&text, name) >= before.floor(), "{text}");
    assert_eq!(gauge(&text, "idemgate_store_sweeper_errors_total"), 0.0);
}

#[tokio::test]
async fn the_openapi_document_describes_exactly_the_routes() {
    let h = harness().await;
    let r = h.send("GET", "/openapi.json", None, vec![]).await;
    assert_eq!(r.status, 200);
    let doc = r.json();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for method in ops.as_object().unwrap().keys() {
            documented.push((method.clone(), path.clone()));
        }
    }
    documented.sort();
    let mut routes: Vec<(String, String)> = idemgate_store::ROUTES
        .iter()
        .chain(idemgate_store::console::ROUTES)
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    routes.sort();
    assert_eq!(documented, routes);
    // Every documented route is really served (never the 404 fallback).
    for (method, path) in routes {
        let r = h.send(&method.to_uppercase(), &path, None, vec![]).await;
        assert_ne!(r.status, 404, "{method} {path}");
        assert_ne!(r.status, 405, "{method} {path}");
    }
}

/// The wire's schemas are the protocol types' own, and every reference in
/// the document resolves; a claim the store accepts has every field its
/// schema requires.
#[tokio::test]
async fn the_openapi_schemas_are_the_wire_types_and_every_reference_resolves() {
    let h = harness().await;
    let doc = h.send("GET", "/openapi.json", None, vec![]).await.json();
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(r) = m.get("$ref").and_then(|r| r.as_str()) {
                    out.push(r.to_string());
                }
                m.values().for_each(|v| refs(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(all.len() > 20, "{all:?}");
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("{r}"));
        assert!(schemas.contains_key(name), "{r} does not resolve");
    }
    let claim = claim_json("acme", "openapi");
    for field in schemas["ClaimRequest"]["required"].as_array().unwrap() {
        assert!(
            claim.get(field.as_str().unwrap()).is_some(),
            "{field} required but not sent"
        );
    }
    assert_eq!(
        schemas["Scope"]["properties"]["tenant"]["maxLength"], 255,
        "the scope's limits come with its type"
    );
    assert_eq!(schemas["ClaimReply"]["oneOf"].as_array().unwrap().len(), 7);
}

#[tokio::test]
async fn operators_resolve_and_purge_over_http() {
    let h = harness().await;
    h.send(
        "POST",
        "/v1/claim",
        Some(API),
        frame(&claim_json("acme", "op1"), b""),
    )
    .await;
    let scope = claim_json("acme", "op1")["scope"].clone();
    // Reads take the admin credential alone.
    let stuck = h
        .send(
            "GET",
            "/admin/v1/records/stuck?older_than_ms=0",
            Some(ADMIN),
            vec![],
        )
        .await;
    assert_eq!(stuck.json().as_array().unwrap().len(), 1);
    let alice = as_operator(ALICE);
    let as_alice = |body: &serde_json::Value| {
        let body = serde_json::to_vec(body).unwrap();
        h.send_with("POST", "/admin/v1/resolve", Some(ADMIN), &alice, body)
    };
    let long = serde_json::json!({ "scope": scope, "action": "release", "reason": "x".repeat(1025) });
    as_alice(&long).await.assert_problem(400, "bad-request");
    // A reason is required.
    for reason in [serde_json::Value::Null, "".into(), "  \n ".into()] {
        let body = serde_json::json!({ "scope": scope, "action": "release", "reason": reason });
        let r = as_alice(&body).await;
        r.assert_problem(400, "bad-request");
        assert!(r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("a reason is required"));
    }
    let body = serde_json::json!({ "scope": scope, "action": "complete", "status": 200, "headers": [["content-type", "text/plain"]], "body": "fixed", "reason": "the ledger shows it" });
    let bytes = serde_json::to_vec(&body).unwrap();
    // The admin credential alone names nobody: no change.
    let r = h
        .send("POST", "/admin/v1/resolve", Some(ADMIN), bytes.clone())
        .await;
    r.assert_problem(403, "forbidden");
    assert!(r.json()["detail"].as_str().unwrap().contains("operator identity"));
    // Nor does an identity without the proxy's secret (any peer may send
    // the header).
    let forged = [("x-forwarded-email", ALICE)];
    h.send_with("POST", "/admin/v1/resolve", Some(ADMIN), &forged, bytes.clone())
        .await
        .assert_problem(403, "forbidden");
    let wrong = [("x-forwarded-email", ALICE), ("x-idemgate-proxy-secret", "guess")];
    h.send_with("POST", "/admin/v1/resolve", Some(ADMIN), &wrong, bytes.clone())
        .await
        .assert_problem(403, "forbidden");
    // A forged identity is refused on reads too.
    let lookup = br#"{"tenant": "acme", "key": "op1"}"#.to_vec();
    h.send_with(
        "POST",
        "/admin/v1/records/lookup",
        Some(ADMIN),
        &forged,
        lookup.clone(),
    )
    .await
    .assert_problem(403, "forbidden");
    // The proxy's identity still needs the admin credential.
    let r = h
        .send_with("POST", "/admin/v1/resolve", None, &alice, bytes.clone())
        .await;
    assert_eq!(r.status, 401);
    let history = h
        .send("POST", "/admin/v1/records/lookup", Some(ADMIN), lookup.clone())
        .await
        .json();
    assert_eq!(history["events"].as_array().unwrap().len(), 1, "{history}");

    let r = as_alice(&body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let replay = h
        .send(
            "POST",
            "/v1/claim",
            Some(API),
            frame(&claim_json("acme", "op1"), b""),
        )
        .await;
    assert_eq!(decode_frame::<ClaimReply>(&replay.body).unwrap().1, b"fixed");
    let history = h
        .send("POST", "/admin/v1/records/lookup", Some(ADMIN), lookup.clone())
        .await
        .json();
    let resolved = &history["events"][1];
    assert_eq!(resolved["transition"], "resolved");
    assert_eq!(resolved["actor"], ALICE);
    assert_eq!(resolved["reason"], "the ledger shows it");
    as_alice(&body).await.assert_problem(404, "not-found");
    assert_eq!(
        h.send("GET", "/admin/v1/records/unknown", Some(ADMIN), vec![])
            .await
            .json(),
        serde_json::json!([])
    );
    let purge = |body: serde_json::Value, headers: &'static [(&'static str, &'static str)]| {
        let body = serde_json::to_vec(&body).unwrap();
        h.send_with("POST", "/admin/v1/purge", Some(ADMIN), headers, body)
    };
    const BOB: [(&str, &str); 2] = [
        ("x-forwarded-email", "bob@example.com"),
        ("x-idemgate-proxy-secret", PROXY_SECRET),
    ];
    purge(serde_json::json!({ "scope": scope }), &BOB)
        .await
        .assert_problem(400, "bad-request");
    let reasoned = serde_json::json!({ "scope": scope, "reason": "customer asked for erasure" });
    purge(reasoned.clone(), &[])
        .await
        .assert_problem(403, "forbidden");
    assert_eq!(purge(reasoned.clone(), &BOB).await.status, 200);
    purge(reasoned, &BOB).await.assert_problem(404, "not-found");
    let history = h
        .send("POST", "/admin/v1/records/lookup", Some(ADMIN), lookup)
        .await
        .json();
    let purged = &history["events"][2];
    assert_eq!(
        (&purged["transition"], &purged["actor"], &purged["reason"]),
        (
            &"purged".into(),
            &"bob@example.com".into(),
            &"customer asked for erasure".into()
        )
    );
    // The sweeper does nothing it would not do on its own: the admin
    // credential alone runs it.
    let sweep = h.send("POST", "/admin/v1/sweep", Some(ADMIN), vec![]).await;
    assert_eq!(sweep.status, 200);
    assert!(sweep.json()["archived"].is_number());
}

/// From a trusted peer the proxy needs no secret; from any other peer its
/// header is refused.
#[tokio::test]
async fn an_identity_is_believed_from_a_trusted_peer_only() {
    use idemgate_store::console::ConsoleSettings;
    for (trusted, believed) in [("127.0.0.1", true), ("10.0.0.0/8", false)] {
        let h = harness().await;
        let console = ConsoleSettings {
            operators: idemgate_store::auth::OperatorSource {
                trusted_peers: vec![trusted.parse().unwrap()],
                ..Default::default()
            },
            ..ConsoleSettings::default()
        };
        let state = h.state.clone().with_console(console);
        state
            .store
            .claim(&serde_json::from_value(claim_json("acme", "peer")).unwrap())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(idemgate_store::run(listener, None, state, async move {
            let _ = stopped.await;
        }));
        let body = serde_json::json!({ "scope": claim_json("acme", "peer")["scope"], "action": "release", "reason": "never charged" });
        let req = hyper::Request::post(format!("http://{addr}/admin/v1/resolve"))
            .header("authorization", format!("Bearer {ADMIN}"))
            .header("x-forwarded-email", ALICE)
            .body(http_body_util::Full::new(bytes::Bytes::from(
                serde_json::to_vec(&body).unwrap(),
            )))
            .unwrap();
        let resp = client().request(req).await.unwrap();
        let status = resp.status().as_u16();
        assert_eq!(status, if believed { 200 } else { 403 }, "trusting {trusted}");
        shut_down(stop, server).await;
    }
}

/// Serves the harness's state on `api` (and `admin`) until the returned
/// sender is used; the handle ends when the server has shut down.
fn serve(
    h: &Harness,
    api: impl Into<idemgate_store::Listeners> + Send + 'static,
    admin: Option<tokio::net::TcpListener>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(idemgate_store::run(api, admin, h.state.clone(), async move {
        let _ = stopped.await;
    }));
    (stop, server)
}

async fn shut_down(
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
) {
    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// The credential is hashed once per connection, and still checked on
/// every request: a request on the same connection with another value (a
/// proxy may share one connection among clients) is judged on its own.
#[tokio::test]
async fn every_request_on_a_kept_alive_connection_is_checked() {
    use hyper_util::rt::TokioIo;
    let h = harness().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(idemgate_store::run(
        listener,
        None,
        h.state.clone(),
        std::future::pending(),
    ));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut send = async |path: &str, token: Option<&str>, body: Vec<u8>| {
        let mut req = hyper::Request::post(path).header("host", addr.to_string());
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        sender.ready().await.unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        resp.into_body().collect().await.unwrap();
        status
    };
    let claim = |key: &str| frame(&claim_json("acme", key), b"");
    assert_eq!(send("/v1/claim", Some(API), claim("c1")).await, 200);
    assert_eq!(send("/v1/claim", Some("wrong"), claim("c2")).await, 401);
    assert_eq!(send("/v1/claim", Some(ADMIN), claim("c3")).await, 403);
    assert_eq!(send("/v1/claim", None, claim("c4")).await, 401);
    assert_eq!(
        send(idemgate_store::admin::LOOKUP_PATH, Some(API), b"{}".to_vec()).await,
        403
    );
    assert_eq!(send("/v1/claim", Some(API), claim("c5")).await, 200);
    let lookup = serde_json::to_vec(&serde_json::json!({"tenant": "acme", "key": "c3"})).unwrap();
    assert_eq!(
        send(idemgate_store::admin::LOOKUP_PATH, Some(ADMIN), lookup).await,
        200
    );
    assert_eq!(send("/v1/claim", Some(ADMIN), claim("c6")).await, 403);
}

#[tokio::test]
async fn run_serves_on_a_listener_until_shutdown() {
    let h = harness().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, server) = serve(&h, listener, None);
    let r = request(&client(), "GET", &format!("http://{addr}/readyz"), None, vec![]).await;
    assert_eq!(r.status, 200);
    shut_down(stop, server).await;
}

/// With `--admin-listen`, operators' surface is on its own address and the
/// mesh-facing one serves only the API.
#[tokio::test]
async fn the_admin_surface_can_listen_on_its_own_address() {
    let h = harness().await;
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (api_addr, admin_addr) = (api.local_addr().unwrap(), admin.local_addr().unwrap());
    let (stop, server) = serve(&h, api, Some(admin));
    let c = client();
    let lookup = br#"{"tenant": "acme", "key": "k1"}"#.to_vec();
    let claim = frame(&claim_json("acme", "split"), b"");
    let at = |addr: std::net::SocketAddr, path: &str| format!("http://{addr}{path}");
    let r = request(&c, "POST", &at(api_addr, "/v1/claim"), Some(API), claim.clone()).await;
    assert_eq!(r.status, 200);
    let r = request(
        &c,
        "POST",
        &at(api_addr, "/admin/v1/records/lookup"),
        Some(ADMIN),
        lookup.clone(),
    )
    .await;
    assert_eq!(r.status, 404, "the admin surface is not on the API's address");
    let r = request(&c, "GET", &at(api_addr, "/admin/console"), None, vec![]).await;
    assert_eq!(r.status, 404);
    let r = request(
        &c,
        "POST",
        &at(admin_addr, "/admin/v1/records/lookup"),
        Some(ADMIN),
        lookup,
    )
    .await;
    assert_eq!(r.status, 200);
    let r = request(&c, "POST", &at(admin_addr, "/v1/claim"), Some(API), claim).await;
    assert_eq!(r.status, 404, "the API is not on the admin address");
    for addr in [api_addr, admin_addr] {
        assert_eq!(
            request(&c, "GET", &at(addr, "/readyz"), None, vec![])
                .await
                .status,
            200
        );
    }
    shut_down(stop, server).await;
}

/// `--listen` given twice: the same API on a Unix socket (for an Envoy on
/// the same host, through a `pipe` address) and on TCP, one store behind both.
#[tokio::test]
async fn the_api_is_served_on_every_address_it_listens_on() {
    use hyper_util::rt::TokioIo;
    use idemgate_store::{Listener, Listeners};
    let h = harness().await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("store.sock");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let unix = Listener::bind(&format!("unix:{}", socket.display()))
        .await
        .unwrap();
    let (stop, server) = serve(&h, Listeners(vec![Listener::Tcp(tcp), unix]), None);

    let stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let claim = hyper::Request::post("/v1/claim")
        .header("host", "store")
        .header("authorization", format!("Bearer {API}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(frame(
            &claim_json("acme", "over-the-socket"),
            b"",
        ))))
        .unwrap();
    let resp = sender.send_request(claim).await.unwrap();
    assert_eq!(resp.status(), 200, "a claim over the Unix socket");

    let lookup = br#"{"tenant": "acme", "key": "over-the-socket"}"#.to_vec();
    let url = format!("http://{addr}/admin/v1/records/lookup");
    let r = request(&client(), "POST", &url, Some(ADMIN), lookup).await;
    assert_eq!(r.status, 200);
    let found: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let found = found["records"].as_array().map_or(0, Vec::len);
    assert_eq!(found, 1, "the record claimed over the socket, looked up over TCP");
    drop(sender);
    shut_down(stop, server).await;
    assert!(!socket.exists(), "a store that stops removes its socket file");
}

/// A store that stops leaves alone a socket file that is no longer its own:
/// the path of a store started meanwhile (which found the old socket no
/// longer accepting and bound the path again).
#[tokio::test]
async fn a_store_that_stops_leaves_the_socket_of_the_store_after_it() {
    use idemgate_store::{Listener, Listeners};
    let h = harness().await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("store.sock");
    let old = Listener::bind(&format!("unix:{}", socket.display()))
        .await
        .unwrap();
    let (stop, server) = serve(&h, Listeners(vec![old]), None);
    std::fs::remove_file(&socket).unwrap();
    let newer = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    shut_down(stop, server).await;
    std::os::unix::net::UnixStream::connect(&socket).unwrap();
    assert!(
        newer.accept().is_ok(),
        "the newer store's socket still reaches it"
    );
}

/// A Unix address replaces only a socket file nothing listens on (what a
/// killed store leaves): never a file that is not a socket, and never the
/// socket of a store still serving on it.
#[tokio::test]
async fn a_unix_address_replaces_only_a_dead_socket() {
    use idemgate_store::Listener;
    let dir = tempfile::tempdir().unwrap();
    let addr = |name: &str| format!("unix:{}", dir.path().join(name).display());

    let file = dir.path().join("store.db");
    std::fs::write(&file, b"records").unwrap();
    let err = Listener::bind(&addr("store.db")).await.err().unwrap();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"records",
        "and it is left as it was"
    );

    let live = std::os::unix::net::UnixListener::bind(dir.path().join("live.sock")).unwrap();
    let err = Listener::bind(&addr("live.sock")).await.err().unwrap();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    std::os::unix::net::UnixStream::connect(dir.path().join("live.sock")).unwrap();
    assert!(
        live.accept().is_ok(),
        "the live socket still reaches its listener"
    );

    drop(std::os::unix::net::UnixListener::bind(dir.path().join("dead.sock")).unwrap());
    assert!(
        dir.path().join("dead.sock").exists(),
        "a dead socket's file stays behind"
    );
    Listener::bind(&addr("dead.sock")).await.unwrap();
}

#[tokio::test]
async fn a_batch_decides_each_call_on_its_own() {
    use idemgate_core::protocol::{encode_batch, split_batch, BatchReply};
    let h = harness().await;
    let k1 = frame(&claim_json("acme", "b1"), b"");
    let k2 = frame(&claim_json("acme", "b2"), b"");
    let bad = frame(&serde_json::json!({"scope": "nonsense"}), b"");
    let batch = encode_batch(&[
        ("/v1/claim", &k1),
        ("/v1/claim", &bad),
        ("/v1/nowhere", &k2),
        ("/v1/claim", &k2),
        ("/v1/claim", &k1),
    ]);
    let r = h.send("POST", "/v1/batch", Some(API), batch).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let (meta, bytes) = decode_frame::<BatchReply>(&r.body).unwrap();
    let replies = split_batch(meta.results.iter().map(|r| r.len), bytes).unwrap();
    let statuses: Vec<u16> = meta.results.iter().map(|r| r.status).collect();
    // A refused call answers with its own problem; its neighbours go on.
    assert_eq!(statuses, [200, 400, 404, 200, 200]);
    let problem: serde_json::Value = serde_json::from_slice(replies[1]).unwrap();
    assert_eq!(problem["type"], "https://docs.example/problems/bad-request");
    let claim = |i: usize| decode_frame::<ClaimReply>(replies[i]).unwrap().0;
    assert!(matches!(claim(3), ClaimReply::Owned { .. }));
    // The same key twice in one batch: exactly one owns it.
    let owned = [claim(0), claim(4)]
        .iter()
        .filter(|c| matches!(c, ClaimReply::Owned { .. }))
        .count();
    assert_eq!(owned, 1, "{:?} {:?}", claim(0), claim(4));
    // A batch whose lengths do not add up is refused whole.
    let mut broken = encode_batch(&[("/v1/claim", &k1)]);
    broken.push(b'x');
    h.send("POST", "/v1/batch", Some(API), broken)
        .await
        .assert_problem(400, "bad-request");
    h.send("POST", "/v1/batch", Some(API), encode_batch(&[]))
        .await
        .assert_problem(400, "bad-request");
    // The API credential guards it like every other call.
    let r = h
        .send("POST", "/v1/batch", None, encode_batch(&[("/v1/claim", &k1)]))
        .await;
    assert_eq!(r.status, 401);
}

/// The gRPC replay route sends back what it was sent only when that is a
/// gRPC response: never a page, a script or a cookie on the API's origin.
#[tokio::test]
async fn the_replay_route_reflects_nothing_but_grpc_responses() {
    use idemgate_core::protocol::{ReplayRequest, REPLAY_PATH};
    let h = harness().await;
    let replay = |headers: &[(&str, &str)], messages: &[u8]| {
        let request = ReplayRequest {
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            trailers: vec![("grpc-status".into(), "0".into())],
        };
        encode_frame(&request, messages)
    };
    let message = [&[0, 0, 0, 0, 2][..], b"ok"].concat();

    let r = h
        .send(
            "POST",
            REPLAY_PATH,
            None,
            replay(
                &[("content-type", "application/grpc"), ("x-ledger-entry", "E-1")],
                &message,
            ),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/grpc");
    assert_eq!(r.headers["x-ledger-entry"], "E-1");
    assert_eq!(r.body, message);

    let script = b"<script>document.cookie</script>";
    for (why, headers, body) in [
        ("a page", &[("content-type", "text/html")][..], &script[..]),
        (
            "a cookie",
            &[
                ("content-type", "application/grpc"),
                ("set-cookie", "session=stolen"),
            ][..],
            &message[..],
        ),
        (
            "bytes that are not gRPC messages",
            &[("content-type", "application/grpc")][..],
            &script[..],
        ),
    ] {
        let r = h.send("POST", REPLAY_PATH, None, replay(headers, body)).await;
        assert_eq!(r.status, 200, "{why}");
        assert_eq!(r.headers["content-type"], "application/grpc", "{why}");
        assert_eq!(r.headers["grpc-status"], "13", "{why}");
        assert!(!r.headers.contains_key("set-cookie"), "{why}");
        assert!(r.body.is_empty(), "{why}: {}", String::from_utf8_lossy(&r.body));
    }
}
