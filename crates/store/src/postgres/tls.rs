//! How the store reaches PostgreSQL: the URL's libpq-style `sslmode` and
//! `sslrootcert`, which tokio-postgres does not read itself, turned into a
//! connection config and a transport. Over TLS the server's certificate
//! chain and host name are always verified: a managed database is reached
//! across networks the store does not control.

use std::sync::Arc;

use percent_encoding::percent_decode_str;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::RootCertStore;
use tokio_postgres::{CancelToken, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::backend::{Result, StoreError};

/// Plain TCP, or TLS with the server verified against these roots.
#[derive(Clone)]
pub(super) enum Transport {
    Plain,
    Tls(MakeRustlsConnect),
}

impl Transport {
    /// Cancels a running query through the same transport as its session,
    /// since a server that requires TLS refuses a plain cancel request.
    pub(super) async fn cancel(&self, token: CancelToken) -> std::result::Result<(), tokio_postgres::Error> {
        match self {
            Transport::Plain => token.cancel_query(NoTls).await,
            Transport::Tls(tls) => token.cancel_query(tls.clone()).await,
        }
    }
}

/// The connection config and transport that `url` asks for.
pub(super) fn target(url: &str) -> Result<(tokio_postgres::Config, Transport)> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut mode = None;
    let mut root_cert = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = || percent_decode_str(value).decode_utf8_lossy().into_owned();
        match name {
            "sslmode" => mode = Some(decoded()),
            "sslrootcert" => root_cert = Some(decoded()),
            _ => rest.push(pair),
        }
    }
    let tls = match mode.as_deref() {
        None | Some("disable" | "prefer") => false,
        Some("require" | "verify-full") => true,
        Some(other) => {
            return Err(config_error(format!(
                "sslmode={other} is not supported: use disable, require or verify-full \
                 (over TLS the store always verifies the server's certificate and host name)"
            )))
        }
    };
    if tls {
        rest.push("sslmode=require");
    } else if root_cert.is_some() {
        return Err(config_error(
            "sslrootcert needs sslmode=require or verify-full".into(),
        ));
    }
    let url = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| config_error(format!("bad postgres URL: {e}")))?;
    let transport = if tls {
        Transport::Tls(MakeRustlsConnect::new(client_config(root_cert.as_deref())?))
    } else {
        Transport::Plain
    };
    Ok((config, transport))
}

/// Roots from `sslrootcert` (a PEM file; `system` as in libpq), else the
/// operating system's.
fn client_config(root_cert: Option<&str>) -> Result<rustls::ClientConfig> {
    let mut roots = RootCertStore::empty();
    match root_cert {
        Some(path) if path != "system" => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
                .map_err(|e| config_error(format!("sslrootcert {path}: {e}")))?;
            if certs.is_empty() {
                return Err(config_error(format!("sslrootcert {path}: no certificate in it")));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| config_error(format!("sslrootcert {path}: {e}")))?;
            }
        }
        _ => {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!("postgres: a system root certificate could not be read: {e}");
            }
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(config_error(
                    "sslmode asks for TLS but the system has no root certificates: give sslrootcert".into(),
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn config_error(detail: String) -> StoreError {
    StoreError::Config(detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_sslmode_the_connection_is_plain_and_other_options_stay() {
        let (config, transport) = target("postgres://idem@127.0.0.1:5432/db?application_name=store").unwrap();
        assert!(matches!(transport, Transport::Plain));
        assert_eq!(config.get_application_name(), Some("store"));
        assert_eq!(config.get_ssl_mode(), tokio_postgres::config::SslMode::Prefer);
    }

    #[test]
    fn a_multi_host_url_keeps_every_host_and_asks_for_a_writable_session() {
        use tokio_postgres::config::{Host, TargetSessionAttrs};
        let (config, _) =
            target("postgres://idem@10.0.0.1:5432,10.0.0.2:5433/db?target_session_attrs=read-write").unwrap();
        let hosts = [Host::Tcp("10.0.0.1".into()), Host::Tcp("10.0.0.2".into())];
        assert_eq!(config.get_hosts(), hosts);
        assert_eq!(config.get_ports(), [5432, 5433]);
        assert_eq!(config.get_target_session_attrs(), TargetSessionAttrs::ReadWrite);
        let (config, _) =
            target("host=10.0.0.1,10.0.0.2 port=5432,5433 dbname=db target_session_attrs=read-write")
                .unwrap();
        assert_eq!(config.get_hosts(), hosts);
        assert_eq!(config.get_target_session_attrs(), TargetSessionAttrs::ReadWrite);
    }

    #[test]
    fn libpq_modes_that_would_skip_verification_are_refused() {
        for mode in ["verify-ca", "allow", "bogus"] {
            let Err(StoreError::Config(detail)) = target(&format!("postgres://h/db?sslmode={mode}")) else {
                panic!("{mode} accepted");
            };
            assert!(detail.contains(mode), "{detail}");
        }
    }

    #[test]
    fn a_root_certificate_without_tls_is_refused() {
        assert!(target("postgres://h/db?sslrootcert=/tmp/ca.pem").is_err());
    }

    #[test]
    fn a_missing_or_empty_root_certificate_file_is_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        for path in [dir.path().join("absent.pem"), empty] {
            let url = format!(
                "postgres://h/db?sslmode=verify-full&sslrootcert={}",
                path.display()
            );
            assert!(matches!(target(&url), Err(StoreError::Config(_))), "{url}");
        }
    }
}
