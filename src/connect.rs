//! Where and how pgbus connects: libpq's connection strings, environment variables and
//! password file, TLS through rustls with libpq's `sslmode`s, and whether the address is a
//! transaction-mode pooler.
//!
//! A [`ConnectConfig`] is what [`Bus::builder`](crate::Bus::builder) and the command line
//! take. It reads a connection string the way `psql` does:
//!
//! - both forms: `postgres://app:secret@db.internal:5432/app?sslmode=verify-full` and
//!   `host=db.internal user=app dbname=app sslmode=verify-full`;
//! - what the string leaves out comes from `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`,
//!   `PGDATABASE`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`, `PGSSLMODE`, `PGSSLROOTCERT`,
//!   `PGSSLCERT` and `PGSSLKEY`, and a password still missing from the password file
//!   (`passfile`, `PGPASSFILE`, else `~/.pgpass`; ignored when others may read it);
//! - `sslmode` is `disable`, `allow`, `prefer` (the default), `require`, `verify-ca` or
//!   `verify-full`, with libpq's meaning: `prefer` and `require` encrypt without checking
//!   the server's certificate, except that `require` checks it like `verify-ca` when a
//!   root certificate is given; `verify-ca` checks that a trusted CA signed it;
//!   `verify-full` also checks that it names the host connected to. `allow` is taken as
//!   `prefer` (it tries TLS first rather than second).
//! - `sslrootcert` is a PEM file of trusted CAs, or `system` for the operating system's
//!   store. Without it, `~/.postgresql/root.crt` when that exists, else the system's
//!   store (libpq would refuse to verify; managed services' CAs are usually in the store
//!   or published as a file to name here). `sslcert` and `sslkey` present a client
//!   certificate.
//!
//! ```
//! use pgbus::{ConnectConfig, SslMode};
//!
//! let config: ConnectConfig =
//!     "postgres://app:secret@db.internal/app?sslmode=require".parse()?;
//! assert_eq!(config.ssl_mode(), SslMode::Require);
//!
//! // Behind PgBouncer in transaction mode: say so; the bus then keeps its settings and
//! // statements within each transaction, and needs a direct connection to LISTEN.
//! let pooled = "host=pgbouncer port=6432 user=app dbname=app sslmode=disable"
//!     .parse::<ConnectConfig>()?
//!     .pooler(true);
//! assert!(pooled.is_pooler());
//! # Ok::<(), pgbus::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
use tokio_postgres::config::Host;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, CancelToken, Client, Socket};

use crate::error::{Error, Result};

/// libpq's `sslmode`: whether the connection is encrypted, and what of the server's
/// certificate is checked.
/// The modes are ordered from the weakest to the strictest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// Taken as [`SslMode::Prefer`].
    Allow,
    /// TLS when the server offers it, plain otherwise; the certificate is not checked.
    Prefer,
    /// TLS or no connection; the certificate is checked as for [`SslMode::VerifyCa`] only
    /// when a root certificate is given.
    Require,
    /// TLS, and the server's certificate must be signed by a trusted CA.
    VerifyCa,
    /// As [`SslMode::VerifyCa`], and the certificate must name the host connected to.
    VerifyFull,
}

impl SslMode {
    /// The mode as `sslmode` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl FromStr for SslMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::invalid(
                    "sslmode",
                    format!(
                        "{other:?} is not one of disable, allow, prefer, require, verify-ca, \
                         verify-full"
                    ),
                ));
            }
        })
    }
}

/// The notifications and notices of a connection: reading them drives it.
pub type Messages =
    Pin<Box<dyn Stream<Item = std::result::Result<AsyncMessage, tokio_postgres::Error>> + Send>>;

/// A TLS connector with its type erased, so that one [`ConnectConfig`] can carry rustls or
/// a caller's own connector.
trait Connector: Send + Sync {
    fn connect<'a>(
        &'a self,
        config: &'a tokio_postgres::Config,
    ) -> BoxFuture<'a, std::result::Result<(Client, Messages), tokio_postgres::Error>>;

    fn cancel(
        &self,
        token: CancelToken,
    ) -> BoxFuture<'static, std::result::Result<(), tokio_postgres::Error>>;
}

struct Erased<T>(T);

impl<T> Connector for Erased<T>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect<'a>(
        &'a self,
        config: &'a tokio_postgres::Config,
    ) -> BoxFuture<'a, std::result::Result<(Client, Messages), tokio_postgres::Error>> {
        let tls = self.0.clone();
        async move {
            let (client, mut connection) = config.connect(tls).await?;
            let messages: Messages =
                futures::stream::poll_fn(move |cx| connection.poll_message(cx)).boxed();
            Ok((client, messages))
        }
        .boxed()
    }

    fn cancel(
        &self,
        token: CancelToken,
    ) -> BoxFuture<'static, std::result::Result<(), tokio_postgres::Error>> {
        let tls = self.0.clone();
        async move { token.cancel_query(tls).await }.boxed()
    }
}

/// The TLS settings read from a connection string and the environment.
#[derive(Debug, Clone, Default)]
struct Ssl {
    mode: Option<SslMode>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

/// Where and how to connect (see the [module docs](self)): a `tokio_postgres::Config`,
/// the TLS connector its `sslmode` asks for, and whether it is a transaction-mode pooler.
#[derive(Clone)]
pub struct ConnectConfig {
    pg: tokio_postgres::Config,
    mode: SslMode,
    connector: Arc<dyn Connector>,
    pooler: bool,
}

impl std::fmt::Debug for ConnectConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tokio_postgres::Config's Debug hides the password.
        f.debug_struct("ConnectConfig")
            .field("config", &self.pg)
            .field("sslmode", &self.mode)
            .field("pooler", &self.pooler)
            .finish_non_exhaustive()
    }
}

impl ConnectConfig {
    /// Reads a connection string (URL or `key=value` form), filling what it leaves out
    /// from the `PG*` environment variables and the password file, as `psql` does.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a malformed string, an unknown `sslmode`, a root or client
    /// certificate that cannot be read, or no host or user in the string or the
    /// environment.
    pub fn parse(s: &str) -> Result<Self> {
        Self::parse_with_env(s, |name| std::env::var(name).ok())
    }

    /// [`ConnectConfig::parse`] of an empty string: everything from the environment.
    ///
    /// # Errors
    ///
    /// As [`ConnectConfig::parse`].
    pub fn from_env() -> Result<Self> {
        Self::parse("")
    }

    /// [`ConnectConfig::parse`] with the environment read through `env` (`HOME` too, for
    /// `~/.pgpass` and `~/.postgresql/root.crt`) instead of the process's.
    ///
    /// # Errors
    ///
    /// As [`ConnectConfig::parse`].
    pub fn parse_with_env(s: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let (rest, ours) = split_params(s)?;
        let mut pg: tokio_postgres::Config = rest.parse().map_err(|e: tokio_postgres::Error| {
            Error::invalid("connection string", e.to_string().replace('\n', " "))
        })?;
        let mut ssl = Ssl::default();
        let mut passfile = None;
        for (key, value) in ours {
            match key.as_str() {
                "sslmode" => ssl.mode = Some(value.parse()?),
                "sslrootcert" => ssl.root_cert = Some(value),
                "sslcert" => ssl.cert = Some(value),
                "sslkey" => ssl.key = Some(value),
                _ => passfile = Some(value),
            }
        }
        fill_from_env(&mut pg, &mut ssl, &env)?;
        if pg.get_hosts().is_empty() {
            return Err(Error::invalid(
                "connection string",
                "no host: name one in the connection string or in PGHOST",
            ));
        }
        let Some(user) = pg.get_user().map(str::to_string) else {
            return Err(Error::invalid(
                "connection string",
                "no user: name one in the connection string or in PGUSER",
            ));
        };
        if pg.get_password().is_none() {
            let file = passfile
                .or_else(|| env("PGPASSFILE"))
                .or_else(|| env("HOME").map(|h| format!("{h}/.pgpass")));
            if let Some(password) = file.and_then(|f| password_from_file(Path::new(&f), &pg, &user))
            {
                pg.password(password);
            }
        }
        let home_root = env("HOME")
            .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
            .filter(|p| p.is_file());
        let mode = ssl.mode.unwrap_or(SslMode::Prefer);
        let roots = ssl
            .root_cert
            .clone()
            .map(Roots::named)
            .or(home_root.map(Roots::File));
        let connector = rustls_connector(mode, roots, &ssl)?;
        pg.ssl_mode(match mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(ConnectConfig {
            pg,
            mode,
            connector,
            pooler: false,
        })
    }

    /// The `tokio_postgres` settings (host, user, timeouts, ...).
    pub fn pg_config(&self) -> &tokio_postgres::Config {
        &self.pg
    }

    /// Changes the `tokio_postgres` settings.
    pub fn pg_config_mut(&mut self) -> &mut tokio_postgres::Config {
        &mut self.pg
    }

    /// The `sslmode`.
    pub fn ssl_mode(&self) -> SslMode {
        self.mode
    }

    /// Connects through the caller's TLS connector instead of the one `sslmode` built
    /// (its `sslmode` still decides whether TLS is asked for).
    pub fn with_tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + 'static,
        T::TlsConnect: Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.connector = Arc::new(Erased(tls));
        self
    }

    /// Says whether this address is a transaction-mode pooler such as PgBouncer (default
    /// false). A bus on a pooler applies its settings inside each of its transactions,
    /// runs every statement unnamed, and LISTENs only through
    /// [`BusBuilder::listen_config`](crate::BusBuilder::listen_config) (without one, it
    /// polls, and says so).
    pub fn pooler(mut self, pooler: bool) -> Self {
        self.pooler = pooler;
        self
    }

    /// Whether this address is a transaction-mode pooler (see [`ConnectConfig::pooler`]).
    pub fn is_pooler(&self) -> bool {
        self.pooler
    }

    /// Opens one connection, driven by a task of its own until the client is dropped.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when the server cannot be reached, refuses the login, or its
    /// certificate fails the checks `sslmode` asks for.
    pub async fn connect(&self) -> Result<Client> {
        let (client, messages) = self.connect_raw(&self.pg).await?;
        tokio::spawn(drive(messages));
        Ok(client)
    }

    /// Opens one connection and hands over its messages (notifications, notices) to the
    /// caller, whose reading them drives the connection: for a LISTEN of one's own.
    ///
    /// # Errors
    ///
    /// As [`ConnectConfig::connect`].
    pub async fn connect_with_messages(&self) -> Result<(Client, Messages)> {
        Ok(self.connect_raw(&self.pg).await?)
    }

    /// Connects with `config` (this one's, changed) through this TLS connector; the
    /// caller drives the messages.
    pub(crate) async fn connect_raw(
        &self,
        config: &tokio_postgres::Config,
    ) -> std::result::Result<(Client, Messages), tokio_postgres::Error> {
        self.connector.connect(config).await
    }

    /// Sends a cancel request for `client`'s statement in flight, over this TLS
    /// connector.
    pub(crate) async fn cancel(
        &self,
        client: &Client,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        self.connector.cancel(client.cancel_token()).await
    }
}

impl FromStr for ConnectConfig {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        ConnectConfig::parse(s)
    }
}

impl From<tokio_postgres::Config> for ConnectConfig {
    /// Takes a `tokio_postgres::Config` as it is (no environment is read): its `sslmode`
    /// (disable, prefer or require) encrypts without checking the certificate, as libpq
    /// does without a root certificate.
    fn from(pg: tokio_postgres::Config) -> Self {
        let mode = match pg.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => SslMode::Disable,
            tokio_postgres::config::SslMode::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        ConnectConfig {
            pg,
            mode,
            connector: Arc::new(Erased(tokio_postgres_rustls::MakeRustlsConnect::new(
                unverified_config(),
            ))),
            pooler: false,
        }
    }
}

/// Drives a connection until it closes.
pub(crate) async fn drive(mut messages: Messages) {
    while let Some(m) = messages.next().await {
        if let Err(e) = m {
            tracing::debug!(error = %e, "pgbus connection closed");
            return;
        }
    }
}

/// The parameters pgbus reads itself (tokio_postgres refuses them, or their values).
const OURS: [&str; 5] = ["sslmode", "sslrootcert", "sslcert", "sslkey", "passfile"];

/// Splits a connection string into the part tokio_postgres parses and pgbus's own
/// parameters (decoded).
fn split_params(s: &str) -> Result<(String, Vec<(String, String)>)> {
    let bad = |reason: &str| Error::invalid("connection string", reason.to_string());
    let mut ours = Vec::new();
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        let Some((base, query)) = s.split_once('?') else {
            return Ok((s.to_string(), ours));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad("a URL parameter has no '='"))?;
            let key = percent_decode(k).ok_or_else(|| bad("bad %-escape in a URL parameter"))?;
            if OURS.contains(&key.as_str()) {
                let value =
                    percent_decode(v).ok_or_else(|| bad("bad %-escape in a URL parameter"))?;
                ours.push((key, value));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, ours));
    }
    let mut rest = String::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(bad(&format!("missing '=' after {key:?}")));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\'') => break,
                    Some('\\') => {
                        value.push(chars.next().ok_or_else(|| bad("unterminated quote"))?)
                    }
                    Some(c) => value.push(c),
                    None => return Err(bad("unterminated quoted value")),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next().ok_or_else(|| bad("a value ends in '\\'"))?);
                } else {
                    value.push(c);
                }
            }
        }
        if OURS.contains(&key.as_str()) {
            ours.push((key, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            rest.push_str(&format!("{key}='{quoted}' "));
        }
    }
    Ok((rest.trim_end().to_string(), ours))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Fills what the string left out from the `PG*` variables.
fn fill_from_env(
    pg: &mut tokio_postgres::Config,
    ssl: &mut Ssl,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    if pg.get_hosts().is_empty()
        && let Some(hosts) = var("PGHOST")
    {
        for host in hosts.split(',') {
            pg.host(host.trim());
        }
    }
    if pg.get_ports().is_empty()
        && let Some(ports) = var("PGPORT")
    {
        for port in ports.split(',') {
            let port = port
                .trim()
                .parse()
                .map_err(|_| Error::invalid("PGPORT", format!("{port:?} is not a port number")))?;
            pg.port(port);
        }
    }
    let missing = [
        ("PGUSER", pg.get_user().is_none()),
        ("PGPASSWORD", pg.get_password().is_none()),
        ("PGDATABASE", pg.get_dbname().is_none()),
        ("PGAPPNAME", pg.get_application_name().is_none()),
    ];
    for (name, _) in missing.into_iter().filter(|(_, missing)| *missing) {
        let Some(value) = var(name) else { continue };
        match name {
            "PGUSER" => pg.user(value),
            "PGPASSWORD" => pg.password(value),
            "PGDATABASE" => pg.dbname(value),
            _ => pg.application_name(value),
        };
    }
    if pg.get_connect_timeout().is_none()
        && let Some(timeout) = var("PGCONNECT_TIMEOUT")
    {
        let secs: u64 = timeout.trim().parse().map_err(|_| {
            Error::invalid(
                "PGCONNECT_TIMEOUT",
                format!("{timeout:?} is not a number of seconds"),
            )
        })?;
        // As libpq: 0 waits forever, and less than 2 s is taken as 2 s.
        if secs > 0 {
            pg.connect_timeout(Duration::from_secs(secs.max(2)));
        }
    }
    if ssl.mode.is_none()
        && let Some(mode) = var("PGSSLMODE")
    {
        ssl.mode = Some(mode.parse()?);
    }
    ssl.root_cert = ssl.root_cert.take().or_else(|| var("PGSSLROOTCERT"));
    ssl.cert = ssl.cert.take().or_else(|| var("PGSSLCERT"));
    ssl.key = ssl.key.take().or_else(|| var("PGSSLKEY"));
    Ok(())
}

/// The password of the first line of a password file that matches the first host, its
/// port, the database and the user; `None` when none does, or the file cannot be read, or
/// others may read it (as libpq, which warns and ignores such a file).
fn password_from_file(file: &Path, pg: &tokio_postgres::Config, user: &str) -> Option<String> {
    let meta = std::fs::metadata(file).ok()?;
    if !meta.is_file() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                file = %file.display(),
                "pgbus ignores the password file: group or others may read it (chmod 0600)"
            );
            return None;
        }
    }
    let text = std::fs::read_to_string(file).ok()?;
    let hosts: Vec<String> = match pg.get_hosts().first()? {
        Host::Tcp(h) => vec![h.clone()],
        #[cfg(unix)]
        Host::Unix(path) => vec![path.display().to_string(), "localhost".to_string()],
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let dbname = pg.get_dbname().unwrap_or(user);
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(pgpass_fields)
        .find(|f| {
            let ok = |field: &str, value: &str| field == "*" || field == value;
            hosts.iter().any(|h| ok(&f[0], h))
                && ok(&f[1], &port)
                && ok(&f[2], dbname)
                && ok(&f[3], user)
        })
        .map(|f| f[4].clone())
}

/// A password file line's five fields, `\:` and `\\` unescaped.
fn pgpass_fields(line: &str) -> Option<[String; 5]> {
    let mut fields: Vec<String> = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut()?.push(chars.next().unwrap_or('\\')),
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut()?.push(c),
        }
    }
    fields.try_into().ok()
}

/// Where trusted CAs come from.
enum Roots {
    File(PathBuf),
    System,
}

impl Roots {
    fn named(name: String) -> Roots {
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
fn unverified_config() -> ClientConfig {
    let provider = provider();
    ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
        .with_no_client_auth()
}

/// Builds the rustls connector `mode` asks for.
fn rustls_connector(mode: SslMode, roots: Option<Roots>, ssl: &Ssl) -> Result<Arc<dyn Connector>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn our_parameters_are_taken_out_of_both_forms() {
        let (rest, ours) = split_params(
            "postgres://u@h/db?sslmode=verify-full&application_name=a&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@h/db?application_name=a");
        assert_eq!(
            ours,
            vec![
                ("sslmode".to_string(), "verify-full".to_string()),
                ("sslrootcert".to_string(), "/tmp/ca.pem".to_string())
            ]
        );
    }

    #[test]
    fn key_value_values_keep_their_quotes_and_escapes() {
        let (rest, ours) =
            split_params(r"host=h user = u sslmode=require password='it\'s a \\ secret' dbname=db")
                .unwrap();
        assert_eq!(ours, vec![("sslmode".to_string(), "require".to_string())]);
        let pg: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(pg.get_password(), Some(&br"it's a \ secret"[..]));
        assert_eq!(pg.get_dbname(), Some("db"));
        assert_eq!(pg.get_user(), Some("u"));
    }

    #[test]
    fn the_environment_fills_what_the_string_leaves_out() {
        let env = env_of(&[
            ("PGHOST", "a,b"),
            ("PGPORT", "6432,6433"),
            ("PGUSER", "envuser"),
            ("PGPASSWORD", "envpass"),
            ("PGDATABASE", "envdb"),
            ("PGAPPNAME", "envapp"),
            ("PGCONNECT_TIMEOUT", "1"),
            ("PGSSLMODE", "disable"),
        ]);
        let c = ConnectConfig::parse_with_env("", &env).unwrap();
        let pg = c.pg_config();
        assert_eq!(pg.get_hosts().len(), 2);
        assert_eq!(pg.get_ports(), &[6432, 6433]);
        assert_eq!(pg.get_user(), Some("envuser"));
        assert_eq!(pg.get_password(), Some(&b"envpass"[..]));
        assert_eq!(pg.get_dbname(), Some("envdb"));
        assert_eq!(pg.get_application_name(), Some("envapp"));
        assert_eq!(pg.get_connect_timeout(), Some(&Duration::from_secs(2)));
        assert_eq!(c.ssl_mode(), SslMode::Disable);

        let c = ConnectConfig::parse_with_env(
            "postgres://u:p@h:5433/d?sslmode=require&application_name=mine",
            &env,
        )
        .unwrap();
        let pg = c.pg_config();
        assert_eq!(pg.get_hosts(), &[Host::Tcp("h".into())]);
        assert_eq!(pg.get_ports(), &[5433]);
        assert_eq!(pg.get_user(), Some("u"));
        assert_eq!(pg.get_password(), Some(&b"p"[..]));
        assert_eq!(pg.get_dbname(), Some("d"));
        assert_eq!(pg.get_application_name(), Some("mine"));
        assert_eq!(c.ssl_mode(), SslMode::Require);
    }

    #[test]
    fn bad_settings_are_refused_with_what_was_wrong() {
        let env = env_of(&[]);
        let cases = [
            ("host=h user=u sslmode=verify", "sslmode"),
            (
                "host=h user=u sslmode=verify-full sslrootcert=/nonexistent/ca.pem",
                "sslrootcert",
            ),
            ("user=u", "connection string"),
            ("host=h", "connection string"),
            ("host=h user=u nonsense=1", "connection string"),
            ("host=h user=u password='open", "connection string"),
            ("host=h user=u sslcert=/a.pem", "sslcert"),
        ];
        for (s, what) in cases {
            match ConnectConfig::parse_with_env(s, &env) {
                Err(Error::Invalid { what: w, .. }) => assert_eq!(w, what, "{s}"),
                other => panic!("{s}: {other:?}"),
            }
        }
        let bad_env = env_of(&[("PGHOST", "h"), ("PGUSER", "u"), ("PGSSLMODE", "on")]);
        assert!(matches!(
            ConnectConfig::parse_with_env("", &bad_env),
            Err(Error::Invalid {
                what: "sslmode",
                ..
            })
        ));
    }

    #[test]
    fn password_file_lines_match_host_port_database_and_user() {
        let dir = std::env::temp_dir().join(format!("pgbus-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pgpass");
        std::fs::write(
            &file,
            "# comment\nother:5432:*:u:wrong\nh:5432:db:u:pa\\:ss\n*:*:*:*:fallback\n",
        )
        .unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let path = file.display().to_string();
        let env = env_of(&[("PGPASSFILE", &path)]);
        let c = ConnectConfig::parse_with_env("host=h user=u dbname=db", &env).unwrap();
        assert_eq!(c.pg_config().get_password(), Some(&b"pa:ss"[..]));
        let c = ConnectConfig::parse_with_env("host=x user=y", &env).unwrap();
        assert_eq!(c.pg_config().get_password(), Some(&b"fallback"[..]));
        let c = ConnectConfig::parse_with_env("host=h user=u password=given", &env).unwrap();
        assert_eq!(c.pg_config().get_password(), Some(&b"given"[..]));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let c = ConnectConfig::parse_with_env("host=h user=u dbname=db", &env).unwrap();
            assert_eq!(
                c.pg_config().get_password(),
                None,
                "a readable file is ignored"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
