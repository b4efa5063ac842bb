//! PostgreSQL over TLS, as managed databases require it: a cluster that
//! refuses plaintext, with a certificate from a throwaway CA.

use std::process::Command;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply};
use idemgate_testkit::pg::PgCluster;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::support::*;

/// Plaintext is refused by the server itself, so a store that connects at
/// all has connected over TLS.
const HBA: &[u8] =
    b"local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n";

struct Pki {
    dir: tempfile::TempDir,
    cluster: PgCluster,
}

impl Pki {
    /// A cluster whose certificate names `localhost` alone, signed by a CA
    /// written to `ca.pem`; `other-ca.pem` is a CA that signed nothing.
    fn start() -> Pki {
        let new_ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let cert = params.self_signed(&key).unwrap();
            (cert, Issuer::new(params, key))
        };
        let (ca, issuer) = new_ca("idemgate test CA");
        let (other, _) = new_ca("another CA");
        let server_key = KeyPair::generate().unwrap();
        let mut server = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        server.distinguished_name.push(DnType::CommonName, "localhost");
        let server = server.signed_by(&server_key, &issuer).unwrap();

        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("other-ca.pem"), other.pem()).unwrap();
        let cluster = PgCluster::start_with_files(
            &[
                ("ssl", "on"),
                ("ssl_cert_file", "$DIR/server.pem"),
                ("ssl_key_file", "$DIR/server.key"),
                ("hba_file", "$DIR/hba.conf"),
            ],
            &[
                ("server.pem", server.pem().as_bytes()),
                ("server.key", server_key.serialize_pem().as_bytes()),
                ("hba.conf", HBA),
            ],
        );
        Pki { dir, cluster }
    }

    fn url(&self, host: &str, query: &str) -> String {
        format!("postgres://idem@{host}:{}/postgres{query}", self.cluster.port)
    }

    fn ca(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

fn migrate(url: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotency-store"))
        .args(["migrate", "--database-url", url])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_reaches_postgresql_over_verified_tls_only() {
    let pki = Pki::start();
    let ca = pki.ca("ca.pem");

    // The server refuses plaintext: the URL must ask for TLS.
    let (ok, err) = migrate(&pki.url("localhost", ""));
    assert!(!ok, "connected without TLS to a server that refuses it");
    assert!(err.contains("no encryption") || err.contains("pg_hba"), "{err}");

    // A CA that did not sign the server's certificate.
    let other = pki.ca("other-ca.pem");
    let (ok, err) = migrate(&pki.url("localhost", &format!("?sslmode=verify-full&sslrootcert={other}")));
    assert!(!ok, "accepted a certificate from an unknown CA");
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    // The right CA, but a host name the certificate does not name, even at
    // `require`, which libpq would not verify.
    let (ok, err) = migrate(&pki.url("127.0.0.1", &format!("?sslmode=require&sslrootcert={ca}")));
    assert!(!ok, "accepted a certificate for another host name");
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    // Verified: the store migrates, serves, and a claim lands.
    let url = pki.url("localhost", &format!("?sslmode=verify-full&sslrootcert={ca}"));
    let (ok, err) = migrate(&url);
    assert!(ok, "{err}");
    let store = StoreProcess::start(&url).await;
    let s = scope("k-over-tls");
    let r = request(
        &client(),
        "POST",
        &store.url("/v1/claim"),
        Some(API),
        encode_frame(&claim(&s, Some(1)), b""),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(matches!(
        decode_frame::<ClaimReply>(&r.body).unwrap().0,
        ClaimReply::Owned { .. }
    ));
}
