//! TLS for labd's TCP listener and for the clients that reach it (rustls,
//! aws-lc-rs): between the nodes of a cluster, and from `labrun` on another
//! machine.
//!
//! A node serves one certificate chain and its key; it checks the other
//! nodes' certificates against the lab's CA (`ca` in labd's `[tls]`). A
//! client with no CA of its own trusts the system's roots. Who may do what is
//! still decided by the cluster secret and the users' tokens: TLS keeps them,
//! and everything else on the wire, from being read or changed on the way.

use crate::error::SetupError;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
pub use tokio_rustls::rustls::{ClientConfig, ServerConfig};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))
}

/// Every certificate in a PEM file, at least one.
fn certificates(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(what, path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("the TLS {what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "the TLS {what} {} holds no certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(certs)
}

/// A server's configuration: its certificate chain (`cert`, PEM, its own
/// certificate first) and private key (`key`, PEM: PKCS#8, PKCS#1 or SEC1).
pub fn server(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, SetupError> {
    server_config(cert, key).map_err(SetupError::Tls)
}

fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain = certificates("certificate", cert)?;
    let pem = read("key", key)?;
    let key_der = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        format!(
            "the TLS key {} holds no private key labd can read ({e})",
            key.display()
        )
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            format!(
                "the TLS certificate {} and key {} do not go together: {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A client's configuration: trusts the certificates in `ca` (PEM), or the
/// system's roots without one.
pub fn client(ca: Option<&Path>) -> Result<Arc<ClientConfig>, SetupError> {
    client_config(ca).map_err(SetupError::Tls)
}

fn client_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            for c in certificates("CA", path)? {
                roots
                    .add(c)
                    .map_err(|e| format!("the TLS CA {}: {e}", path.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for c in found.certs {
                // A system store may hold certificates rustls cannot use;
                // the others still count.
                let _ = roots.add(c);
            }
            if roots.is_empty() {
                return Err(
                    "no CA to check labd's certificate against: the system has none; give the \
                     lab's CA file (LABRUN_CA, or labd_ca in the config file)"
                        .into(),
                );
            }
        }
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The system roots' client, made once per process.
pub(crate) fn system_client() -> Result<Arc<ClientConfig>, SetupError> {
    static SYSTEM: OnceLock<Result<Arc<ClientConfig>, SetupError>> = OnceLock::new();
    SYSTEM.get_or_init(|| client(None)).clone()
}

/// The name a certificate must carry for `hostport` (`gpu1:7420`,
/// `10.0.0.5:7420`, `[fd00::5]:7420`): the host, or its IP address.
pub(crate) fn server_name(hostport: &str) -> Result<ServerName<'static>, String> {
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} cannot be checked against a certificate: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_hosts_or_addresses() {
        assert!(matches!(
            server_name("gpu1:7420").unwrap(),
            ServerName::DnsName(_)
        ));
        assert!(matches!(
            server_name("10.0.0.5:7420").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name("[::1]:7420").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(server_name("bad host:1").is_err());
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = client(Some(&empty)).unwrap_err().to_string();
        assert!(
            e.contains("empty.pem") && e.contains("no certificate"),
            "{e}"
        );
        let missing = dir.path().join("missing.pem");
        let e = server(&missing, &missing).unwrap_err().to_string();
        assert!(e.contains("cannot read the TLS certificate"), "{e}");

        // A certificate with another certificate's key.
        let a = rcgen::generate_simple_self_signed(vec!["a".to_string()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["b".to_string()]).unwrap();
        let (cert, key) = (dir.path().join("a.pem"), dir.path().join("b.key"));
        std::fs::write(&cert, a.cert.pem()).unwrap();
        std::fs::write(&key, b.signing_key.serialize_pem()).unwrap();
        let e = server(&cert, &key).unwrap_err().to_string();
        assert!(e.contains("do not go together"), "{e}");
        std::fs::write(&key, a.signing_key.serialize_pem()).unwrap();
        server(&cert, &key).unwrap();
        std::fs::write(&key, "junk").unwrap();
        let e = server(&cert, &key).unwrap_err().to_string();
        assert!(e.contains("no private key"), "{e}");
    }
}
