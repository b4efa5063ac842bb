//! Mesh identity (contract §9): the store behind its own sidecar, an Envoy
//! whose listener requires client certificates and names the caller's SPIFFE
//! ID in `x-forwarded-client-cert` (`SANITIZE_SET`), reaching the store from
//! 127.0.0.6 as Istio's inbound passthrough does; two caller Envoys with the
//! filter, each with a certificate of its own identity from a throwaway CA.
//! Each claims and completes its own keys; the other's completion, an
//! identity the store does not name, a forged header sent straight to the
//! store and a caller with no credential are refused with problem documents,
//! and none of them writes anything.
//!
//! Istio stands emulated by plain Envoys: the sidecar's settings are the ones
//! `examples/istio/mesh-identity.yaml` gives the store's real sidecar.

// Test support: failing loudly is how a helper reports a broken run.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use e2e::{eventually, free_port, send, Answer, Proc, Upstream, ADMIN_TOKEN};
use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply, ClaimRequest, CompleteRequest};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};

const TRUST_DOMAIN: &str = "spiffe://mesh.test";
const PAYMENTS: &str = "spiffe://mesh.test/ns/shop/sa/payments";
const REFUNDS: &str = "spiffe://mesh.test/ns/shop/sa/refunds";
const STRANGER: &str = "spiffe://mesh.test/ns/shop/sa/stranger";
const STORE: &str = "spiffe://mesh.test/ns/idemgate/sa/store";

/// A throwaway CA and, for each name, `NAME.pem`/`NAME.key` in `dir`: a
/// certificate with that SPIFFE ID as its URI SAN (and `store` as a DNS
/// name for the store's sidecar).
fn certificates(dir: &Path, identities: &[(&str, &str)]) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "mesh test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    for (name, id) in identities {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["store".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::URI(id.to_string().try_into().unwrap()));
        params.distinguished_name.push(DnType::CommonName, *name);
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

const ROUTER: &str = r#"{name: envoy.filters.http.router, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}"#;

/// The store's sidecar: mTLS required on its listener, the caller's SPIFFE
/// ID set in x-forwarded-client-cert (any the client sent is dropped), and
/// the store reached from 127.0.0.6.
fn sidecar_bootstrap(dir: &Path, port: u16, admin: u16, store: u16) -> String {
    let d = dir.display();
    format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: inbound
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates: [{{certificate_chain: {{filename: {d}/store.pem}}, private_key: {{filename: {d}/store.key}}}}]
            validation_context: {{trusted_ca: {{filename: {d}/ca.pem}}}}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inbound
          forward_client_cert_details: SANITIZE_SET
          set_current_client_cert_details: {{uri: true}}
          route_config:
            virtual_hosts: [{{name: store, domains: ["*"], routes: [{{match: {{prefix: "/"}}, route: {{cluster: store}}}}]}}]
          http_filters: [{ROUTER}]
  clusters:
  - name: store
    type: STATIC
    connect_timeout: 1s
    upstream_bind_config: {{source_address: {{address: 127.0.0.6, port_value: 0}}}}
    load_assignment:
      cluster_name: store
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {store}}}}}}}}}]}}]
"#
    )
}

/// A cluster to the store's sidecar over mTLS as `name`'s identity.
fn store_cluster(cluster: &str, dir: &Path, name: &str, sidecar: u16) -> String {
    let d = dir.display();
    format!(
        r#"
  - name: {cluster}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: {cluster}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {sidecar}}}}}}}}}]}}]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: store
        common_tls_context:
          tls_certificates: [{{certificate_chain: {{filename: {d}/{name}.pem}}, private_key: {{filename: {d}/{name}.key}}}}]
          validation_context:
            trusted_ca: {{filename: {d}/ca.pem}}
            match_typed_subject_alt_names: [{{san_type: URI, matcher: {{exact: "{STORE}"}}}}]
"#
    )
}

struct Caller {
    listener: u16,
    egress: u16,
    admin: u16,
}

/// A caller's Envoy: the filter with both policies on its listener, the
/// store reached through the store's sidecar as `name`; its egress listener
/// sends the app's own calls to the store the same way (`/stranger/...` as
/// the stranger's identity).
fn caller_bootstrap(dir: &Path, name: &str, caller: &Caller, upstream: u16, sidecar: u16) -> String {
    let wasm = e2e::wasm_path();
    let config = r#"{"store": {"cluster": "idempotency_store", "authority": "store", "timeout_ms": 2000, "token": "unused-in-the-mesh"}, "policies": [{"name": "payments.create", "match": {"path": {"prefix": "/pay"}}, "tenant": {"header": "x-tenant-id"}}, {"name": "refunds.create", "match": {"path": {"prefix": "/refund"}}, "tenant": {"header": "x-tenant-id"}}]}"#;
    let (listener, egress, admin) = (caller.listener, caller.egress, caller.admin);
    format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listener}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts: [{{name: app, domains: ["*"], routes: [{{match: {{prefix: "/"}}, route: {{cluster: upstream, timeout: 15s}}}}]}}]
          http_filters:
          - name: idemgate
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: idemgate
                root_id: idemgate
                allow_on_headers_stop_iteration: true
                failure_policy: FAIL_RELOAD
                vm_config: {{vm_id: idemgate, runtime: envoy.wasm.runtime.v8, code: {{local: {{filename: {wasm}}}}}}}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'
          - {ROUTER}
  - name: egress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {egress}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: egress
          route_config:
            virtual_hosts:
            - name: store
              domains: ["*"]
              routes:
              - {{match: {{prefix: "/stranger/"}}, route: {{cluster: store_as_stranger, prefix_rewrite: "/"}}}}
              - {{match: {{prefix: "/"}}, route: {{cluster: idempotency_store}}}}
          http_filters: [{ROUTER}]
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}}}]}}]
{own}{stranger}"#,
        wasm = wasm.display(),
        own = store_cluster("idempotency_store", dir, name, sidecar),
        stranger = store_cluster("store_as_stranger", dir, "stranger", sidecar),
    )
}

fn envoy(dir: &Path, name: &'static str, config: String) -> Proc {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, config).unwrap();
    Proc::spawn(
        name,
        Command::new(e2e::envoy_bin()).arg("-c").arg(&path).args([
            "--concurrency",
            "1",
            "-l",
            "info",
            "--disable-hot-restart",
        ]),
        dir.join(format!("{name}.log")),
    )
}

/// The processes are dropped (and their logs printed on a failure) before
/// the directory that holds the logs.
struct Mesh {
    client: reqwest::Client,
    upstream: Upstream,
    store: u16,
    payments: Caller,
    refunds: Caller,
    procs: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl Mesh {
    async fn start() -> Mesh {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        certificates(
            d,
            &[
                ("store", STORE),
                ("payments", PAYMENTS),
                ("refunds", REFUNDS),
                ("stranger", STRANGER),
            ],
        );
        std::fs::write(
            d.join("identities.yaml"),
            format!("identities:\n  {PAYMENTS}: [payments.create]\n  {REFUNDS}: [refunds.create]\n"),
        )
        .unwrap();
        assert!(PAYMENTS.starts_with(TRUST_DOMAIN));
        let upstream = Upstream::start().await;
        let (store, sidecar, sidecar_admin) = (free_port(), free_port(), free_port());
        let caller = || Caller {
            listener: free_port(),
            egress: free_port(),
            admin: free_port(),
        };
        let (payments, refunds) = (caller(), caller());
        let bin = e2e::env_path("IDEMGATE_STORE_BIN", "target/debug/idempotency-store");
        let db = format!("sqlite://{}", d.join("store.db").display());
        let mut serve = Command::new(bin);
        serve
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{store}")])
            .args(["--database-url", &db, "--admin-token", ADMIN_TOKEN])
            .arg("--mesh-identities-file")
            .arg(d.join("identities.yaml"))
            .args(["--mesh-trusted-peers", "127.0.0.6"])
            .env("RUST_LOG", "info");
        let mut procs = vec![Proc::spawn("store", &mut serve, d.join("store.log"))];
        procs.push(envoy(
            d,
            "sidecar",
            sidecar_bootstrap(d, sidecar, sidecar_admin, store),
        ));
        let up = upstream.addr.port();
        procs.push(envoy(
            d,
            "payments",
            caller_bootstrap(d, "payments", &payments, up, sidecar),
        ));
        procs.push(envoy(
            d,
            "refunds",
            caller_bootstrap(d, "refunds", &refunds, up, sidecar),
        ));
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let mesh = Mesh {
            _dir: dir,
            client,
            upstream,
            store,
            payments,
            refunds,
            procs,
        };
        for port in [store, sidecar_admin, mesh.payments.admin, mesh.refunds.admin] {
            let path = if port == store { "/readyz" } else { "/ready" };
            let url = format!("http://127.0.0.1:{port}{path}");
            eventually(
                "the store and the Envoys to be ready",
                Duration::from_secs(60),
                || async { matches!(mesh.client.get(&url).send().await, Ok(r) if r.status() == 200) },
            )
            .await;
        }
        mesh
    }

    /// A request of tenant acme with `key` through `caller`'s Envoy.
    async fn pay(&self, caller: &Caller, path: &str, key: &str) -> Answer {
        send(
            self.client
                .post(format!("http://127.0.0.1:{}{path}", caller.listener))
                .header("idempotency-key", key)
                .header("x-tenant-id", "acme")
                .header("content-type", "application/json")
                .body(r#"{"amount": 4200}"#),
        )
        .await
    }

    /// A store call the app sends itself, through its sidecar (`egress`).
    async fn call(&self, caller: &Caller, path: &str, frame: Vec<u8>) -> Answer {
        send(
            self.client
                .post(format!("http://127.0.0.1:{}{path}", caller.egress))
                .body(frame),
        )
        .await
    }

    /// Every event the store holds for tenant acme's `key`.
    async fn events(&self, key: &str) -> usize {
        let query = serde_json::json!({"tenant": "acme", "key": key, "limit": 1000});
        let a = send(
            self.client
                .post(format!("http://127.0.0.1:{}/admin/v1/records/lookup", self.store))
                .bearer_auth(ADMIN_TOKEN)
                .header("content-type", "application/json")
                .body(query.to_string()),
        )
        .await;
        assert_eq!(a.status, 200, "{a:?}");
        a.json()["events"].as_array().map_or(0, Vec::len)
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for p in &self.procs {
            all.push_str(&p.log());
        }
        all
    }
}

fn claim(route: &str, key: &str) -> ClaimRequest {
    serde_json::from_value(serde_json::json!({
        "scope": {"version": "v1", "tenant": "acme", "principal": "*", "route": route, "namespace": "u", "key": key},
        "fingerprint": null, "lease_ms": 10000, "ttl_ms": 60000, "after_expiry": "reject", "on_unknown": "conflict"
    }))
    .unwrap()
}

fn completion(claimed: &ClaimRequest, fence: u64) -> Vec<u8> {
    let req: CompleteRequest = serde_json::from_value(serde_json::json!({
        "scope": claimed.scope, "fence": fence, "status": 201, "headers": [], "body_stored": true
    }))
    .unwrap();
    encode_frame(&req, b"{}")
}

fn forbidden(a: &Answer, what: &str) {
    assert_eq!(a.status, 403, "{what}: {a:?}");
    assert_eq!(a.problem().as_deref(), Some("forbidden"), "{what}: {a:?}");
}

#[tokio::test]
async fn each_identity_acts_on_its_own_policies_only() {
    let mesh = Mesh::start().await;
    let (payments, refunds) = (&mesh.payments, &mesh.refunds);
    // Each caller's filter claims, completes and replays its own keys.
    for (caller, path, key) in [(payments, "/pay", "pay-1"), (refunds, "/refund", "refund-1")] {
        let first = mesh.pay(caller, path, key).await;
        assert_eq!(first.status, 201, "{first:?}\n{}", mesh.logs());
        let again = mesh.pay(caller, path, key).await;
        assert_eq!(
            (again.status, &again.body),
            (201, &first.body),
            "{key}: {again:?}"
        );
        assert_eq!(mesh.upstream.executions(key), 1, "{key}");
        assert!(mesh.events(key).await >= 2, "{key}: claimed and completed");
    }
    // The payments caller's filter on a policy its identity does not own:
    // the store refuses the claim and the request never runs.
    let other = mesh.pay(payments, "/refund", "refund-by-payments").await;
    assert_ne!(other.status, 201, "{other:?}");
    println!(
        "the refused claim's client answer: {} {:?}",
        other.status,
        other.problem()
    );
    assert_eq!(mesh.upstream.executions("refund-by-payments"), 0);
    assert_eq!(mesh.events("refund-by-payments").await, 0);

    // The refunds identity completing the payments identity's claim.
    let claimed = claim("payments.create", "pay-2");
    let a = mesh
        .call(payments, "/v1/claim", encode_frame(&claimed, b""))
        .await;
    assert_eq!(a.status, 200, "{a:?}");
    let ClaimReply::Owned { fence } = decode_frame::<ClaimReply>(&a.body).unwrap().0 else {
        panic!("{a:?}");
    };
    let written = mesh.events("pay-2").await;
    let a = mesh
        .call(refunds, "/v1/complete", completion(&claimed, fence))
        .await;
    forbidden(&a, "the other identity's completion");
    assert!(a.json()["detail"].as_str().unwrap().contains(REFUNDS), "{a:?}");
    // An identity the store does not name, through the sidecar.
    let a = mesh
        .call(payments, "/stranger/v1/complete", completion(&claimed, fence))
        .await;
    forbidden(&a, "an unknown identity");
    // Straight to the store, not through its sidecar: a forged header...
    let forged = format!("By={STORE};Hash=00;URI={PAYMENTS}");
    let a = send(
        mesh.client
            .post(format!("http://127.0.0.1:{}/v1/complete", mesh.store))
            .header("x-forwarded-client-cert", forged)
            .body(completion(&claimed, fence)),
    )
    .await;
    forbidden(&a, "a forged x-forwarded-client-cert");
    assert!(a.json()["detail"].as_str().unwrap().contains("sidecar"), "{a:?}");
    // ...and no credential at all.
    let a = send(
        mesh.client
            .post(format!("http://127.0.0.1:{}/v1/complete", mesh.store))
            .body(completion(&claimed, fence)),
    )
    .await;
    assert_eq!(
        (a.status, a.problem().as_deref()),
        (401, Some("unauthorized")),
        "{a:?}"
    );
    assert_eq!(
        mesh.events("pay-2").await,
        written,
        "a refused call wrote an event"
    );
    // The owner still completes its claim.
    let a = mesh
        .call(payments, "/v1/complete", completion(&claimed, fence))
        .await;
    assert_eq!(a.status, 200, "{a:?}");
    assert!(mesh.events("pay-2").await > written);
}
