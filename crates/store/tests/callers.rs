//! Who may call the filter's API: the API token re-read from its file
//! without a restart, and mesh identities limited to the policies they own.

use std::time::Duration;

use idemgate_core::protocol::encode_frame;

use crate::support::*;

/// The real binary with its API token in a file: a rotation writes the
/// file (the next token first, then the next token alone) and the store
/// follows without a restart.
#[tokio::test]
async fn the_api_token_file_is_re_read_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (current, next) = (dir.path().join("api-token"), dir.path().join("api-token-next"));
    std::fs::write(&current, "first-token\n").unwrap();
    let port = free_port();
    let db = format!("sqlite://{}", dir.path().join("store.db").display());
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idempotency-store"));
    cmd.arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--database-url", &db, "--admin-token", ADMIN])
        .arg("--api-token-file")
        .arg(&current)
        .arg("--api-token-next-file")
        .arg(&next)
        .env("RUST_LOG", "info");
    let store = Proc::spawn("store", &mut cmd, dir.path().join("store.log"));
    let c = client();
    let url = format!("http://127.0.0.1:{port}/v1/claim");
    let claim_as = |token: &'static str, key: &str| {
        let (c, url) = (c.clone(), url.clone());
        let body = encode_frame(&claim(&scope(key), None), b"");
        async move { request(&c, "POST", &url, Some(token), body).await.status }
    };
    eventually("the store to listen", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    assert_eq!(claim_as("first-token", "r").await, 200);
    assert_eq!(claim_as("second-token", "r0").await, 401);
    // The next token joins the current one...
    std::fs::write(&next, "second-token\n").unwrap();
    eventually(
        "the next token to be accepted",
        Duration::from_secs(10),
        || async { claim_as("second-token", "r1").await == 200 },
    )
    .await;
    assert_eq!(claim_as("first-token", "r2").await, 200);
    // ...then replaces it.
    std::fs::write(&current, "second-token\n").unwrap();
    std::fs::write(&next, "").unwrap();
    eventually("the old token to be refused", Duration::from_secs(10), || async {
        claim_as("first-token", "r3").await == 401
    })
    .await;
    assert_eq!(claim_as("second-token", "r4").await, 200);
    // A file emptied by mistake keeps what was accepted.
    std::fs::write(&current, "").unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(claim_as("second-token", "r5").await, 200, "{}", store.log());
}

const PAYMENTS: &str = "spiffe://cluster.local/ns/shop/sa/payments";
const REFUNDS: &str = "spiffe://cluster.local/ns/shop/sa/refunds";

/// The store serving `mesh` on a real listener (the peer's address is what
/// the sidecar is recognised by), with the token [`API`] as well.
async fn serving(
    mesh_peers: &str,
    dir: &tempfile::TempDir,
) -> (idemgate_store::AppState, std::net::SocketAddr) {
    let store = idemgate_store::Store::new(sqlite_backend(dir).await, idemgate_store::Clock::System);
    let mesh = idemgate_store::mesh::MeshIdentities::from_yaml(
        &format!("identities:\n  {PAYMENTS}: [payments.create]\n  {REFUNDS}: [refunds.create]\n"),
        vec![mesh_peers.parse().unwrap()],
    )
    .unwrap();
    let state =
        idemgate_store::AppState::new(store, idemgate_store::Settings::new(API, ADMIN)).with_mesh(mesh);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(idemgate_store::run(
        listener,
        None,
        state.clone(),
        std::future::pending(),
    ));
    (state, addr)
}

/// What the store's sidecar sets for a caller with `identity`'s certificate.
fn xfcc(identity: &str) -> String {
    format!("By=spiffe://cluster.local/ns/idemgate/sa/store;Hash=0a1b;Subject=\"\";URI={identity}")
}

struct Reply {
    status: u16,
    body: bytes::Bytes,
}

impl Reply {
    fn problem(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

async fn post(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
    use http_body_util::BodyExt;
    let mut req = hyper::Request::post(format!("http://{addr}{path}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply { status, body }
}

fn scope_in(route: &str, key: &str) -> idemgate_core::scope::Scope {
    scope_of(
        "acme",
        "alice",
        route,
        idemgate_core::scope::Namespace::Client,
        key,
    )
}

/// Every event the store holds for `key` of tenant acme.
async fn events(state: &idemgate_store::AppState, key: &str) -> usize {
    let q = idemgate_store::backend::Lookup {
        tenant: "acme".into(),
        key: key.into(),
        ..Default::default()
    };
    state.store.lookup(&q, 100).await.unwrap().events.len()
}

#[tokio::test]
async fn each_mesh_identity_acts_only_on_the_policies_it_owns() {
    let dir = tempfile::tempdir().unwrap();
    let (state, addr) = serving("127.0.0.1", &dir).await;
    let (payments, refunds) = (xfcc(PAYMENTS), xfcc(REFUNDS));
    let as_payments = [("x-forwarded-client-cert", payments.as_str())];
    let as_refunds = [("x-forwarded-client-cert", refunds.as_str())];
    let paid = scope_in("payments.create", "pay-1");
    let r = post(
        addr,
        "/v1/claim",
        &as_payments,
        encode_frame(&claim(&paid, None), b""),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let (reply, _) =
        idemgate_core::protocol::decode_frame::<idemgate_core::protocol::ClaimReply>(&r.body).unwrap();
    let idemgate_core::protocol::ClaimReply::Owned { fence: token } = reply else {
        panic!("{reply:?}");
    };
    let written = events(&state, "pay-1").await;
    // The other identity can neither settle nor claim the payments policy's keys...
    for (path, body) in [
        ("/v1/complete", encode_frame(&complete(&paid, token, 201), b"{}")),
        ("/v1/release", encode_frame(&fence(&paid, token), b"")),
        ("/v1/mark-unknown", encode_frame(&fence(&paid, token), b"")),
        (
            "/v1/claim",
            encode_frame(&claim(&scope_in("payments.create", "pay-2"), None), b""),
        ),
    ] {
        let r = post(addr, path, &as_refunds, body).await;
        assert_eq!(r.status, 403, "{path}: {:?}", r.body);
        assert_eq!(
            r.problem()["type"],
            "https://idemgate.dev/problems/forbidden",
            "{path}"
        );
        let detail = r.problem()["detail"].as_str().unwrap().to_string();
        assert!(
            detail.contains(REFUNDS) && detail.contains("payments.create"),
            "{detail}"
        );
    }
    // ...nor in a batch, where its own call still goes through.
    let own = encode_frame(&claim(&scope_in("refunds.create", "ref-1"), None), b"");
    let other = encode_frame(&complete(&paid, token, 201), b"{}");
    let batch = idemgate_core::protocol::encode_batch(&[
        (idemgate_core::protocol::COMPLETE_PATH, other.as_slice()),
        (idemgate_core::protocol::CLAIM_PATH, own.as_slice()),
    ]);
    let r = post(addr, "/v1/batch", &as_refunds, batch).await;
    assert_eq!(r.status, 200);
    let (reply, _) =
        idemgate_core::protocol::decode_frame::<idemgate_core::protocol::BatchReply>(&r.body).unwrap();
    let statuses: Vec<u16> = reply.results.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [403, 200]);
    assert_eq!(
        events(&state, "pay-1").await,
        written,
        "a refused call wrote an event"
    );
    assert_eq!(events(&state, "pay-2").await, 0);
    // The owner completes its own key; the token's holder acts on every policy.
    let r = post(
        addr,
        "/v1/complete",
        &as_payments,
        encode_frame(&complete(&paid, token, 201), b"{}"),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let bearer = format!("Bearer {API}");
    let r = post(
        addr,
        "/v1/claim",
        &[("authorization", bearer.as_str())],
        own.clone(),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[tokio::test]
async fn a_client_certificate_header_from_elsewhere_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // The sidecar is somewhere else: this test's client is not it.
    let (state, addr) = serving("10.0.0.0/8", &dir).await;
    let forged = xfcc(PAYMENTS);
    let bearer = format!("Bearer {API}");
    let body = || encode_frame(&claim(&scope_in("payments.create", "forged"), None), b"");
    for headers in [
        vec![("x-forwarded-client-cert", forged.as_str())],
        // A valid token does not make a forged identity acceptable.
        vec![
            ("x-forwarded-client-cert", forged.as_str()),
            ("authorization", bearer.as_str()),
        ],
    ] {
        let r = post(addr, "/v1/claim", &headers, body()).await;
        assert_eq!(r.status, 403, "{:?}", r.body);
        let detail = r.problem()["detail"].as_str().unwrap().to_string();
        assert!(detail.contains("sidecar"), "{detail}");
    }
    let r = post(addr, "/v1/claim", &[], body()).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.problem()["type"], "https://idemgate.dev/problems/unauthorized");
    assert_eq!(events(&state, "forged").await, 0);
    let r = post(addr, "/v1/claim", &[("authorization", bearer.as_str())], body()).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[tokio::test]
async fn an_identity_the_store_does_not_name_owns_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (state, addr) = serving("127.0.0.1", &dir).await;
    let stranger = xfcc("spiffe://cluster.local/ns/shop/sa/stranger");
    let r = post(
        addr,
        "/v1/claim",
        &[("x-forwarded-client-cert", stranger.as_str())],
        encode_frame(&claim(&scope_in("payments.create", "stranger"), None), b""),
    )
    .await;
    assert_eq!(r.status, 403, "{:?}", r.body);
    assert_eq!(events(&state, "stranger").await, 0);
}
