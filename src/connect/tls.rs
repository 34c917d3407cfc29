//! TLS with rustls: the connector each `sslmode` asks for, and certificate checks that
//! accept what libpq accepts.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};

use super::startup::{Connector, Erased};
use super::{Ssl, SslMode};
use crate::error::{Error, Result};

/// Where trusted CAs come from.
pub(super) enum Roots {
    File(PathBuf),
    System,
}

impl Roots {
    pub(super) fn named(name: String) -> Roots {
        if name == "system" {
            Roots::System
        } else {
            Roots::File(PathBuf::from(name))
        }
    }

    fn load(&self) -> Result<RootCertStore> {
        let mut store = RootCertStore::empty();
        match self {
            Roots::File(path) => {
                let bad = |reason: String| {
                    Error::invalid("sslrootcert", format!("{}: {reason}", path.display()))
                };
                let certs = CertificateDer::pem_file_iter(path)
                    .map_err(|e| bad(e.to_string()))?
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| bad(e.to_string()))?;
                let (added, _) = store.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(bad("holds no certificate".into()));
                }
            }
            Roots::System => {
                let found = rustls_native_certs::load_native_certs();
                store.add_parsable_certificates(found.certs);
                if store.is_empty() {
                    store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                }
            }
        }
        Ok(store)
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls configuration that encrypts without checking the server's certificate
/// (`prefer`, `require` without a root certificate).
pub(super) fn unverified_config() -> ClientConfig {
    let provider = provider();
    ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
        .with_no_client_auth()
}

/// Builds the rustls connector `mode` asks for.
pub(super) fn rustls_connector(
    mode: SslMode,
    roots: Option<Roots>,
    ssl: &Ssl,
) -> Result<Arc<dyn Connector>> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid("TLS configuration", e.to_string()))?;
    let verify = match mode {
        SslMode::VerifyCa | SslMode::VerifyFull => true,
        SslMode::Require => roots.is_some(),
        _ => false,
    };
    let builder = if verify {
        let store = Arc::new(roots.unwrap_or(Roots::System).load()?);
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(store, provider)
            .build()
            .map_err(|e| Error::invalid("sslrootcert", e.to_string()))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Verified {
                webpki,
                check_name: mode == SslMode::VerifyFull,
            }))
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
    };
    let config = match (&ssl.cert, &ssl.key) {
        (Some(cert), Some(key)) => {
            let bad = |what: &'static str, file: &str, reason: String| {
                Error::invalid(what, format!("{file}: {reason}"))
            };
            let certs = CertificateDer::pem_file_iter(cert)
                .map_err(|e| bad("sslcert", cert, e.to_string()))?
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad("sslcert", cert, e.to_string()))?;
            let key =
                PrivateKeyDer::from_pem_file(key).map_err(|e| bad("sslkey", key, e.to_string()))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| Error::invalid("sslcert", e.to_string()))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(Error::invalid(
                "sslcert",
                "sslcert and sslkey must be given together",
            ));
        }
    };
    Ok(Arc::new(Erased(
        tokio_postgres_rustls::MakeRustlsConnect::new(config),
    )))
}

/// Accepts any certificate, still checking the handshake's signatures with it.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Checks the chain against the trusted CAs, and the host name only for `verify-full`.
#[derive(Debug)]
struct Verified {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Verified {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            // The chain is checked before the name: a name error means a trusted chain.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
