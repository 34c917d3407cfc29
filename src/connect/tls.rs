//! TLS with rustls: the connector each `sslmode` asks for, and certificate checks that
//! accept what libpq accepts.

use std::path::{Path, PathBuf};
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

    /// The trusted CAs, and the certificates of a root file as they are (a server's
    /// own self-signed certificate in it is trusted as is, as libpq trusts it).
    fn load(&self) -> Result<(RootCertStore, Vec<CertificateDer<'static>>)> {
        let mut store = RootCertStore::empty();
        let mut listed = Vec::new();
        match self {
            Roots::File(path) => {
                let bad = |reason: String| {
                    Error::invalid("sslrootcert", format!("{}: {reason}", path.display()))
                };
                let certs = CertificateDer::pem_file_iter(path)
                    .map_err(|e| bad(e.to_string()))?
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| bad(e.to_string()))?;
                listed.clone_from(&certs);
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
        Ok((store, listed))
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
    let versions: Vec<&'static rustls::SupportedProtocolVersion> = [
        (!ssl.tls13_only).then_some(&rustls::version::TLS12),
        (!ssl.tls12_only).then_some(&rustls::version::TLS13),
    ]
    .into_iter()
    .flatten()
    .collect();
    if versions.is_empty() {
        return Err(Error::invalid(
            "ssl_min_protocol_version",
            "is above ssl_max_protocol_version",
        ));
    }
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&versions)
        .map_err(|e| Error::invalid("TLS configuration", e.to_string()))?;
    let verify = match mode {
        SslMode::VerifyCa | SslMode::VerifyFull => true,
        SslMode::Require => roots.is_some(),
        _ => false,
    };
    let builder = if verify {
        let (store, listed) = roots.unwrap_or(Roots::System).load()?;
        let store = Arc::new(store);
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(store, provider)
            .build()
            .map_err(|e| Error::invalid("sslrootcert", e.to_string()))?;
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Verified {
                webpki,
                listed,
                check_name: mode == SslMode::VerifyFull,
            }))
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
    };
    let config = match client_files(ssl)? {
        Some((cert, key)) => {
            let bad = |what: &'static str, file: &Path, reason: String| {
                Error::invalid(what, format!("{}: {reason}", file.display()))
            };
            let certs = CertificateDer::pem_file_iter(&cert)
                .map_err(|e| bad("sslcert", &cert, e.to_string()))?
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad("sslcert", &cert, e.to_string()))?;
            check_key_file(&key)?;
            let key = PrivateKeyDer::from_pem_file(&key)
                .map_err(|e| bad("sslkey", &key, e.to_string()))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| Error::invalid("sslcert", e.to_string()))?
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = config;
    config.enable_sni = ssl.sni;
    Ok(Arc::new(Erased(
        tokio_postgres_rustls::MakeRustlsConnect::new(config),
    )))
}

/// The client certificate and key to present: `sslcert` and `sslkey`, else, as libpq,
/// `~/.postgresql/postgresql.crt` and `.key` when the certificate exists; none with
/// `sslcertmode=disable`.
fn client_files(ssl: &Ssl) -> Result<Option<(PathBuf, PathBuf)>> {
    if ssl.no_client_cert {
        return Ok(None);
    }
    let home = |name: &str| ssl.home.as_ref().map(|h| h.join(".postgresql").join(name));
    let cert = match &ssl.cert {
        Some(cert) => PathBuf::from(cert),
        None => match home("postgresql.crt").filter(|p| p.is_file()) {
            Some(cert) => cert,
            None if ssl.key.is_some() => {
                return Err(Error::invalid(
                    "sslkey",
                    "a client key without a certificate: name it with sslcert",
                ));
            }
            None => return Ok(None),
        },
    };
    let key = match (&ssl.key, home("postgresql.key")) {
        (Some(key), _) => PathBuf::from(key),
        (None, Some(key)) if key.is_file() => key,
        _ => {
            return Err(Error::invalid(
                "sslkey",
                format!(
                    "the client certificate {} has no key: name it with sslkey",
                    cert.display()
                ),
            ));
        }
    };
    Ok(Some((cert, key)))
}

/// Refuses, as libpq does, a client key file that others may read (more than 0600; 0640
/// when root owns it), and one that is encrypted (pgbus cannot use `sslpassword`).
fn check_key_file(key: &Path) -> Result<()> {
    let bad = |reason: String| Error::invalid("sslkey", format!("{}: {reason}", key.display()));
    let meta = std::fs::metadata(key).map_err(|e| bad(e.to_string()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let allowed = if meta.uid() == 0 { 0o640 } else { 0o600 };
        let mode = meta.permissions().mode() & 0o777;
        if mode & !allowed != 0 {
            return Err(bad(format!(
                "group or others may read it (mode {mode:04o}): chmod 0600, as libpq requires"
            )));
        }
    }
    let _ = meta;
    let text = std::fs::read_to_string(key).map_err(|e| bad(e.to_string()))?;
    if text.contains("ENCRYPTED") {
        return Err(bad(
            "the key is encrypted, and pgbus cannot decrypt it with sslpassword: store it \
             decrypted (openssl pkey -in key.enc -out key), readable by its owner only"
                .into(),
        ));
    }
    Ok(())
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

/// Checks the certificate as libpq does: signed by a trusted CA (webpki checks the
/// chain), or itself one of the root file's certificates (a self-signed server
/// certificate, as PostgreSQL's documentation makes one, is its own root: webpki
/// refuses it as a CA used as an end entity); then, for `verify-full` only, that it
/// names the host by libpq's rule ([`names_host`]).
#[derive(Debug)]
struct Verified {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    /// The root file's certificates as they are.
    listed: Vec<CertificateDer<'static>>,
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
        let mut name_error = None;
        if self
            .listed
            .iter()
            .any(|c| c.as_ref() == end_entity.as_ref())
        {
            // Trusted as it is: only its validity period remains to be checked.
            within_validity(end_entity, now)?;
        } else {
            match self
                .webpki
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
            {
                Ok(verified) => return Ok(verified),
                // The chain is checked before the name: a name error means a trusted
                // chain, and libpq's rule decides the name.
                Err(
                    e @ rustls::Error::InvalidCertificate(
                        CertificateError::NotValidForName
                        | CertificateError::NotValidForNameContext { .. },
                    ),
                ) => name_error = Some(e),
                // A self-signed certificate that is not in the root file is simply not
                // trusted; webpki says first that it is a CA (CaUsedAsEndEntity).
                Err(rustls::Error::InvalidCertificate(CertificateError::Other(_)))
                    if self_signed(end_entity) =>
                {
                    return Err(rustls::Error::InvalidCertificate(
                        CertificateError::UnknownIssuer,
                    ));
                }
                Err(e) => return Err(e),
            }
        }
        if !self.check_name {
            return Ok(ServerCertVerified::assertion());
        }
        let (named, presented) = names_host(end_entity, server_name)?;
        if named {
            return Ok(ServerCertVerified::assertion());
        }
        Err(name_error.unwrap_or_else(|| {
            rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                expected: server_name.to_owned(),
                presented,
            })
        }))
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

fn bad_encoding() -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
}

fn parse(der: &CertificateDer<'_>) -> std::result::Result<x509_cert::Certificate, rustls::Error> {
    use x509_cert::der::Decode;
    x509_cert::Certificate::from_der(der.as_ref()).map_err(|_| bad_encoding())
}

/// Whether the certificate names itself as its issuer.
fn self_signed(der: &CertificateDer<'_>) -> bool {
    parse(der).is_ok_and(|c| c.tbs_certificate.issuer == c.tbs_certificate.subject)
}

/// Checks that `now` lies in the certificate's validity period.
fn within_validity(
    der: &CertificateDer<'_>,
    now: UnixTime,
) -> std::result::Result<(), rustls::Error> {
    let cert = parse(der)?;
    let validity = &cert.tbs_certificate.validity;
    let now = now.as_secs();
    if now < validity.not_before.to_unix_duration().as_secs() {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::NotValidYet,
        ));
    }
    if now > validity.not_after.to_unix_duration().as_secs() {
        return Err(rustls::Error::InvalidCertificate(CertificateError::Expired));
    }
    Ok(())
}

/// libpq's host name rule for `verify-full`: the host matches one of the certificate's
/// subjectAltName entries (a DNS name, `*.` matching one label, compared without
/// regard to case; or an IP address); only when it has no DNS name or IP address
/// entry, its subject's Common Name.
/// Returns whether it does, and the names the certificate gives.
fn names_host(
    der: &CertificateDer<'_>,
    server_name: &ServerName<'_>,
) -> std::result::Result<(bool, Vec<String>), rustls::Error> {
    use x509_cert::der::Decode;
    use x509_cert::der::oid::db::{rfc4519, rfc5280};
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;

    let cert = parse(der)?;
    let (host, ip): (String, Option<std::net::IpAddr>) = match server_name {
        ServerName::DnsName(name) => (name.as_ref().to_string(), None),
        ServerName::IpAddress(ip) => {
            let ip = std::net::IpAddr::from(*ip);
            (ip.to_string(), Some(ip))
        }
        _ => return Ok((false, Vec::new())),
    };
    let mut presented = Vec::new();
    for ext in cert.tbs_certificate.extensions.iter().flatten() {
        if ext.extn_id != rfc5280::ID_CE_SUBJECT_ALT_NAME {
            continue;
        }
        let names =
            SubjectAltName::from_der(ext.extn_value.as_bytes()).map_err(|_| bad_encoding())?;
        for name in names.0 {
            match name {
                GeneralName::DnsName(dns) => {
                    presented.push(dns.as_str().to_string());
                    if name_matches(dns.as_str(), &host) {
                        return Ok((true, presented));
                    }
                }
                GeneralName::IpAddress(bytes) => {
                    let listed = match bytes.as_bytes() {
                        b4 if b4.len() == 4 => {
                            <[u8; 4]>::try_from(b4).ok().map(std::net::IpAddr::from)
                        }
                        b16 if b16.len() == 16 => {
                            <[u8; 16]>::try_from(b16).ok().map(std::net::IpAddr::from)
                        }
                        _ => None,
                    };
                    match listed {
                        Some(listed) if Some(listed) == ip => return Ok((true, presented)),
                        Some(listed) => presented.push(listed.to_string()),
                        None => presented.push("an unreadable IP address".to_string()),
                    }
                }
                _ => {}
            }
        }
    }
    if !presented.is_empty() {
        return Ok((false, presented));
    }
    for rdn in cert.tbs_certificate.subject.0.iter() {
        for atv in rdn.0.iter() {
            if atv.oid == rfc4519::CN
                && let Ok(cn) = std::str::from_utf8(atv.value.value())
            {
                if name_matches(cn, &host) {
                    return Ok((true, presented));
                }
                presented.push(cn.to_string());
            }
        }
    }
    Ok((false, presented))
}

/// Whether a certificate's name matches the host, as libpq compares them: equal without
/// regard to case, or `*.rest` matching one non-empty label followed by `.rest`.
fn name_matches(pattern: &str, host: &str) -> bool {
    if pattern.eq_ignore_ascii_case(host) {
        return true;
    }
    let Some(suffix) = pattern.strip_prefix('*') else {
        return false;
    };
    if !suffix.starts_with('.') || suffix.len() < 2 || host.len() <= suffix.len() {
        return false;
    }
    let (label, rest) = host.split_at(host.len() - suffix.len());
    rest.eq_ignore_ascii_case(suffix) && !label.contains('.')
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    #[test]
    fn names_match_as_libpq_matches_them() {
        assert!(name_matches("db.example.com", "DB.Example.com"));
        assert!(name_matches("*.example.com", "db.example.com"));
        assert!(!name_matches("*.example.com", "a.db.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(!name_matches("*.example.com", ".example.com"));
        assert!(!name_matches("db*.example.com", "db1.example.com"));
        assert!(!name_matches("other.example.com", "db.example.com"));
    }
}
