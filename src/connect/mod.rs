//! Where and how pgbus connects: libpq's connection strings, environment variables and
//! password file, TLS through rustls with libpq's `sslmode`s, and whether the address is a
//! transaction-mode pooler.
//!
//! A [`ConnectConfig`] is what [`Bus::builder`](crate::Bus::builder) and the command line
//! take. It reads a connection string the way `psql` does:
//!
//! - both forms: `postgres://app:secret@db.internal:5432/app?sslmode=verify-full` and
//!   `host=db.internal user=app dbname=app sslmode=verify-full`;
//! - what the string leaves out comes from the `PG*` variables (`PGHOST`, `PGPORT`,
//!   `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`,
//!   `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`, `PGTARGETSESSIONATTRS`, ...),
//!   and a password still missing from the password file (`passfile`, `PGPASSFILE`,
//!   else `~/.pgpass`, read for each host of a list; ignored when others may read it);
//! - a service (`service`, `PGSERVICE`) fills what the string leaves out from the
//!   service file, before the variables;
//! - every libpq setting is either honoured or refused with an error that names it (or
//!   the variable it came from); a malformed percent-escape in a URL is refused;
//! - `connect_timeout` bounds each host's whole startup (TCP, TLS, authentication, up
//!   to ReadyForQuery; [`DEFAULT_CONNECT_TIMEOUT`] without one, none for 0); a failure
//!   is [`Error::Connect`], naming the host, the port and the
//!   [`ConnectPhase`](crate::ConnectPhase) it was waiting in; with several hosts the next is tried, and
//!   `target_session_attrs` chooses among them;
//! - `sslmode` is `disable`, `allow`, `prefer` (the default), `require`, `verify-ca` or
//!   `verify-full`, with libpq's meaning: `prefer` and `require` encrypt without checking
//!   the server's certificate, except that `require` checks it like `verify-ca` when a
//!   root certificate is given; `verify-ca` checks that a trusted CA signed it (or that
//!   it is itself in the root file, as a self-signed server certificate is);
//!   `verify-full` also checks that it names the host connected to (its subjectAltName,
//!   or its Common Name when it has no DNS name or IP address there). `allow` is taken
//!   as `prefer` (it tries TLS first rather than second).
//! - `sslrootcert` is a PEM file of trusted CAs, or `system` for the operating system's
//!   store (which insists on `verify-full`, as libpq 16). Without it,
//!   `~/.postgresql/root.crt` when that exists, else the system's store (libpq would
//!   refuse to verify; managed services' CAs are usually in the store or published as a
//!   file to name here). `sslcert` and `sslkey` (else `~/.postgresql/postgresql.crt` and
//!   `.key`, when they exist) present a client certificate; a key file others may read
//!   is refused, as libpq refuses it.
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

use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Client};

mod passfile;
mod service;
mod startup;
mod tls;

pub use startup::{DEFAULT_CONNECT_TIMEOUT, ServerStream};

use startup::{Connector, Erased};
use tls::{Roots, rustls_connector, unverified_config};

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

impl SslMode {
    /// Reads a mode, an error naming `what` (the setting or its variable).
    fn parse(what: &'static str, s: &str) -> Result<Self> {
        s.parse().map_err(|e| match e {
            Error::Invalid { reason, .. } => Error::invalid(what, reason),
            e => e,
        })
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

/// The TLS settings read from a connection string and the environment.
#[derive(Debug, Clone)]
struct Ssl {
    mode: Option<SslMode>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    /// The home directory, for `~/.postgresql/postgresql.crt` and `.key`.
    home: Option<PathBuf>,
    /// `sslsni`: send the host name in the TLS handshake (default on).
    sni: bool,
    /// `sslcertmode=disable`: present no client certificate.
    no_client_cert: bool,
    /// `ssl_min_protocol_version=TLSv1.3`.
    tls13_only: bool,
    /// `ssl_max_protocol_version=TLSv1.2`.
    tls12_only: bool,
}

/// libpq's `target_session_attrs`: what the server connected to must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionAttrs {
    Any,
    ReadWrite,
    ReadOnly,
    Primary,
    Standby,
    PreferStandby,
}

impl SessionAttrs {
    fn parse(what: &'static str, value: &str) -> Result<Self> {
        Ok(match value {
            "any" => SessionAttrs::Any,
            "read-write" => SessionAttrs::ReadWrite,
            "read-only" => SessionAttrs::ReadOnly,
            "primary" => SessionAttrs::Primary,
            "standby" => SessionAttrs::Standby,
            "prefer-standby" => SessionAttrs::PreferStandby,
            other => {
                return Err(Error::invalid(
                    what,
                    format!(
                        "{other:?} is not one of any, read-write, read-only, primary, standby, \
                         prefer-standby"
                    ),
                ));
            }
        })
    }

    fn as_str(self) -> &'static str {
        match self {
            SessionAttrs::Any => "any",
            SessionAttrs::ReadWrite => "read-write",
            SessionAttrs::ReadOnly => "read-only",
            SessionAttrs::Primary => "primary",
            SessionAttrs::Standby => "standby",
            SessionAttrs::PreferStandby => "prefer-standby",
        }
    }
}

/// libpq's `connect_timeout`: whole seconds; 0 or less waits forever, and 1 is taken as
/// 2. `None` for "forever".
fn parse_timeout(what: &'static str, value: &str) -> Result<Option<Duration>> {
    let secs: i64 = value
        .trim()
        .parse()
        .map_err(|_| Error::invalid(what, format!("{value:?} is not a whole number of seconds")))?;
    Ok((secs > 0).then(|| Duration::from_secs(secs.max(2) as u64)))
}

/// Where and how to connect (see the [module docs](self)): a `tokio_postgres::Config`,
/// the TLS connector its `sslmode` asks for, and whether it is a transaction-mode pooler.
#[derive(Clone)]
pub struct ConnectConfig {
    pg: tokio_postgres::Config,
    mode: SslMode,
    connector: Arc<dyn Connector>,
    pooler: bool,
    /// `connect_timeout=0`: no startup bound.
    unbounded: bool,
    session: SessionAttrs,
    /// The password file, read at each connection for the host it connects to, when
    /// no password was given.
    passfile: Option<PathBuf>,
    /// The caller's connector is `NoTls`: `prefer` does not ask for TLS.
    no_tls: bool,
}

impl std::fmt::Debug for ConnectConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tokio_postgres::Config's Debug hides the password.
        f.debug_struct("ConnectConfig")
            .field("config", &self.pg)
            .field("sslmode", &self.mode)
            .field("pooler", &self.pooler)
            .field("target_session_attrs", &self.session.as_str())
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
            let why =
                std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
            Error::invalid("connection string", why.replace('\n', " "))
        })?;
        let mut settings = Vec::new();
        for (key, value) in ours {
            let Some((key, _)) = KEYWORDS.iter().find(|(k, _)| *k == key) else {
                return Err(Error::invalid(
                    "connection string",
                    format!("unknown setting {key:?}"),
                ));
            };
            settings.push(Setting {
                key,
                value,
                what: key,
            });
        }
        apply_service(&mut pg, &mut settings, &env)?;
        for (key, var) in KEYWORDS {
            if let Some(var) = var
                && !settings.iter().any(|s| s.key == key)
                && let Some(value) = env(var).filter(|v| !v.is_empty())
            {
                settings.push(Setting {
                    key,
                    value,
                    what: var,
                });
            }
        }
        let mut ssl = Ssl {
            mode: None,
            root_cert: None,
            cert: None,
            key: None,
            home: env("HOME").map(PathBuf::from),
            sni: true,
            no_client_cert: false,
            tls13_only: false,
            tls12_only: false,
        };
        let mut passfile = None;
        let mut timeout = None;
        let mut session = None;
        let mut fallback_name = None;
        for Setting { key, value, what } in settings {
            let v = value.as_str();
            match key {
                "sslmode" => ssl.mode = Some(SslMode::parse(what, v)?),
                "sslrootcert" => ssl.root_cert = Some(value),
                "sslcert" => ssl.cert = Some(value),
                "sslkey" => ssl.key = Some(value),
                "passfile" => passfile = Some(value),
                "connect_timeout" => timeout = Some(parse_timeout(what, v)?),
                "target_session_attrs" => session = Some(SessionAttrs::parse(what, v)?),
                "fallback_application_name" => fallback_name = Some(value),
                "client_encoding" => {
                    if !matches!(v.to_ascii_uppercase().as_str(), "UTF8" | "UTF-8" | "AUTO") {
                        return Err(unsupported(what, v, "pgbus speaks UTF8 only"));
                    }
                }
                "keepalives_count" => {
                    let count = v.trim().parse().map_err(|_| {
                        Error::invalid(what, format!("{v:?} is not a whole number"))
                    })?;
                    pg.keepalives_retries(count);
                }
                "sslsni" => ssl.sni = parse_flag(what, v)?,
                // Compression is off in every TLS library today; libpq ignores it too.
                "sslcompression" => {
                    parse_flag(what, v)?;
                }
                // Used only for an encrypted key, which is refused when it is read.
                "sslpassword" => {}
                "sslcertmode" => match v {
                    "allow" => {}
                    "disable" => ssl.no_client_cert = true,
                    _ => {
                        return Err(unsupported(
                            what,
                            v,
                            "pgbus supports sslcertmode allow and disable",
                        ));
                    }
                },
                "ssl_min_protocol_version" => match v {
                    "TLSv1" | "TLSv1.1" | "TLSv1.2" => {}
                    "TLSv1.3" => ssl.tls13_only = true,
                    _ => return Err(unsupported(what, v, "not a TLS version (TLSv1.2, TLSv1.3)")),
                },
                "ssl_max_protocol_version" => match v {
                    "TLSv1.3" => {}
                    "TLSv1.2" => ssl.tls12_only = true,
                    "TLSv1" | "TLSv1.1" => {
                        return Err(unsupported(what, v, "pgbus speaks TLS 1.2 and 1.3 only"));
                    }
                    _ => return Err(unsupported(what, v, "not a TLS version (TLSv1.2, TLSv1.3)")),
                },
                "gssencmode" => match v {
                    "disable" | "prefer" => {}
                    _ => return Err(unsupported(what, v, "pgbus does not support GSSAPI")),
                },
                "replication" => {
                    if parse_flag(what, v).ok() != Some(false) {
                        return Err(unsupported(
                            what,
                            v,
                            "pgbus does not open replication connections",
                        ));
                    }
                }
                "min_protocol_version" | "max_protocol_version" => {
                    if v != "3.0" {
                        return Err(unsupported(what, v, "pgbus speaks protocol 3.0"));
                    }
                }
                "sslcrl" | "sslcrldir" => {
                    return Err(unsupported(
                        what,
                        v,
                        "pgbus does not check certificate revocation lists",
                    ));
                }
                "requirepeer" => {
                    return Err(unsupported(
                        what,
                        v,
                        "pgbus does not check a Unix socket's peer",
                    ));
                }
                "require_auth" => {
                    return Err(unsupported(
                        what,
                        v,
                        "pgbus does not restrict the authentication methods",
                    ));
                }
                "krbsrvname" | "gsslib" | "gssdelegation" => {
                    return Err(unsupported(what, v, "pgbus does not support GSSAPI"));
                }
                // Read before the others (apply_service).
                "service" | "servicefile" => {}
                _ => return Err(unsupported(what, v, "pgbus does not support OAuth")),
            }
        }
        if pg.get_application_name().is_none()
            && let Some(name) = fallback_name
        {
            pg.application_name(name);
        }
        fill_from_env(&mut pg, &env)?;
        if let Some(Some(bound)) = timeout {
            pg.connect_timeout(bound);
        }
        if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
            return Err(Error::invalid(
                "connection string",
                "no host: name one in the connection string or in PGHOST",
            ));
        }
        if pg.get_user().is_none() {
            return Err(Error::invalid(
                "connection string",
                "no user: name one in the connection string or in PGUSER",
            ));
        }
        let passfile = (pg.get_password().is_none())
            .then(|| passfile.or_else(|| env("HOME").map(|h| format!("{h}/.pgpass"))))
            .flatten()
            .map(PathBuf::from);
        let home_root = env("HOME")
            .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
            .filter(|p| p.is_file());
        // As libpq 16: the system's store trusts every public CA, so it is only of use
        // with the host name checked; it makes verify-full the default, and refuses less.
        let system_roots = ssl.root_cert.as_deref() == Some("system");
        let mode = match ssl.mode {
            None if system_roots => SslMode::VerifyFull,
            Some(mode) if system_roots && mode != SslMode::VerifyFull => {
                return Err(Error::invalid(
                    "sslmode",
                    format!(
                        "sslrootcert=system needs sslmode=verify-full, not {}",
                        mode.as_str()
                    ),
                ));
            }
            mode => mode.unwrap_or(SslMode::Prefer),
        };
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
            unbounded: timeout == Some(None),
            session: session.unwrap_or(SessionAttrs::Any),
            passfile,
            no_tls: false,
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
    /// (its `sslmode` still decides whether TLS is asked for). The connector wraps a
    /// [`ServerStream`], which every connector generic over its stream accepts; the
    /// startup bound and the phases of [`Error::Connect`] hold as with pgbus's own.
    pub fn with_tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<ServerStream> + Clone + Send + Sync + 'static,
        T::Stream: Send + 'static,
        T::TlsConnect: Send + 'static,
        <T::TlsConnect as TlsConnect<ServerStream>>::Future: Send + 'static,
        <T::TlsConnect as TlsConnect<ServerStream>>::Error: 'static,
    {
        self.no_tls =
            std::any::TypeId::of::<T>() == std::any::TypeId::of::<tokio_postgres::NoTls>();
        self.connector = Arc::new(Erased(tls));
        self
    }

    /// Sets the startup bound: how long each attempt to connect to a host may take as
    /// a whole (TCP, TLS, authentication, up to the server's first ReadyForQuery)
    /// before the next host is tried; `None` waits forever (as `connect_timeout=0`),
    /// whatever [`pg_config`](Self::pg_config) says. The connection string's
    /// `connect_timeout` (or `PGCONNECT_TIMEOUT`) sets it; without either it is
    /// [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, bound: Option<Duration>) -> Self {
        match bound {
            Some(bound) => {
                self.pg.connect_timeout(bound);
                self.unbounded = false;
            }
            None => self.unbounded = true,
        }
        self
    }

    /// The startup bound of each attempt (see [`ConnectConfig::connect_timeout`]).
    pub fn startup_timeout(&self) -> Option<Duration> {
        self.bound(&self.pg)
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
    /// [`Error::Connect`] when no host could be reached within the startup bound,
    /// refused the login, was not a PostgreSQL server, or its certificate failed the
    /// checks `sslmode` asks for; the error names the host, the port and what pgbus was
    /// waiting for.
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
        self.connect_raw(&self.pg).await
    }

    /// Connects with `config` (this one's, changed) through this TLS connector, within
    /// the startup bound; the caller drives the messages.
    pub(crate) async fn connect_raw(
        &self,
        config: &tokio_postgres::Config,
    ) -> Result<(Client, Messages)> {
        self.open(config).await
    }

    /// Sends a cancel request for `client`'s statement in flight, over this TLS
    /// connector.
    pub(crate) async fn cancel(&self, client: &Client) -> Result<()> {
        self.cancel_everywhere(client).await
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
        let session = match pg.get_target_session_attrs() {
            tokio_postgres::config::TargetSessionAttrs::ReadWrite => SessionAttrs::ReadWrite,
            _ => SessionAttrs::Any,
        };
        ConnectConfig {
            pg,
            mode,
            connector: Arc::new(Erased(tokio_postgres_rustls::MakeRustlsConnect::new(
                unverified_config(),
            ))),
            pooler: false,
            unbounded: false,
            session,
            passfile: None,
            no_tls: false,
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

/// The settings tokio_postgres reads as libpq does; pgbus reads every other itself.
const PASSED: [&str; 16] = [
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "host",
    "hostaddr",
    "port",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "channel_binding",
    "load_balance_hosts",
    "sslnegotiation",
];

/// libpq's settings that pgbus reads itself, each with its environment variable: the
/// variable applies when the string does not give the setting.
const KEYWORDS: [(&str, Option<&str>); 31] = [
    ("sslmode", Some("PGSSLMODE")),
    ("sslrootcert", Some("PGSSLROOTCERT")),
    ("sslcert", Some("PGSSLCERT")),
    ("sslkey", Some("PGSSLKEY")),
    ("passfile", Some("PGPASSFILE")),
    ("connect_timeout", Some("PGCONNECT_TIMEOUT")),
    ("target_session_attrs", Some("PGTARGETSESSIONATTRS")),
    ("fallback_application_name", None),
    ("client_encoding", Some("PGCLIENTENCODING")),
    ("keepalives_count", None),
    ("sslsni", Some("PGSSLSNI")),
    ("sslcompression", Some("PGSSLCOMPRESSION")),
    ("sslpassword", None),
    ("sslcertmode", Some("PGSSLCERTMODE")),
    ("ssl_min_protocol_version", Some("PGSSLMINPROTOCOLVERSION")),
    ("ssl_max_protocol_version", Some("PGSSLMAXPROTOCOLVERSION")),
    ("gssencmode", Some("PGGSSENCMODE")),
    ("replication", None),
    ("sslcrl", Some("PGSSLCRL")),
    ("sslcrldir", Some("PGSSLCRLDIR")),
    ("requirepeer", Some("PGREQUIREPEER")),
    ("require_auth", Some("PGREQUIREAUTH")),
    ("krbsrvname", Some("PGKRBSRVNAME")),
    ("gsslib", Some("PGGSSLIB")),
    ("gssdelegation", Some("PGGSSDELEGATION")),
    ("service", Some("PGSERVICE")),
    ("servicefile", Some("PGSERVICEFILE")),
    ("min_protocol_version", Some("PGMINPROTOCOLVERSION")),
    ("max_protocol_version", Some("PGMAXPROTOCOLVERSION")),
    ("oauth_issuer", None),
    ("oauth_client_id", None),
];

/// Refuses a `%` that is not followed by two hexadecimal digits (libpq refuses such a
/// URL; it would otherwise be taken as written).
fn check_percent_escapes(s: &str) -> Result<()> {
    let bytes = s.as_bytes();
    for (i, _) in s.match_indices('%') {
        let hex = bytes.get(i + 1..i + 3);
        if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
            let shown: String = s[i..].chars().take(3).collect();
            return Err(Error::invalid(
                "connection string",
                format!(
                    "malformed percent-escape {shown:?} at byte {i} of the URL: '%' must be \
                     followed by two hexadecimal digits (write '%' itself as %25)"
                ),
            ));
        }
    }
    Ok(())
}

/// A setting pgbus reads itself, with what an error about it names: the setting, or the
/// environment variable it came from.
struct Setting {
    key: &'static str,
    value: String,
    what: &'static str,
}

/// Adds the settings of the service that `service` (or `PGSERVICE`) names where the
/// string gave none: tokio_postgres' into `pg`, pgbus's into `settings`.
fn apply_service(
    pg: &mut tokio_postgres::Config,
    settings: &mut Vec<Setting>,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<()> {
    let given = |key: &str| settings.iter().find(|s| s.key == key);
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    let Some((name, what)) = given("service")
        .map(|s| (s.value.clone(), s.what))
        .or_else(|| var("PGSERVICE").map(|v| (v, "PGSERVICE")))
    else {
        return Ok(());
    };
    let file = given("servicefile")
        .map(|s| s.value.clone())
        .or_else(|| var("PGSERVICEFILE"))
        .map(PathBuf::from);
    let entries = service::lookup(
        &name,
        what,
        file,
        env("HOME").map(PathBuf::from),
        var("PGSYSCONFDIR").map(PathBuf::from),
    )?;
    let mut passed = String::new();
    for (key, value) in entries {
        if PASSED.contains(&key.as_str()) {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            passed.push_str(&format!("{key}='{quoted}' "));
        } else if let Some((key, _)) = KEYWORDS.iter().find(|(k, _)| *k == key) {
            if !settings.iter().any(|s| s.key == *key) {
                settings.push(Setting {
                    key,
                    value,
                    what: key,
                });
            }
        } else {
            return Err(Error::invalid(
                what,
                format!("service {name:?} has an unknown setting {key:?}"),
            ));
        }
    }
    let from: tokio_postgres::Config = passed.parse().map_err(|e: tokio_postgres::Error| {
        let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
        Error::invalid(what, format!("service {name:?}: {why}"))
    })?;
    fill_missing(pg, &from);
    Ok(())
}

/// Copies into `pg` what `from` sets and `pg` does not.
fn fill_missing(pg: &mut tokio_postgres::Config, from: &tokio_postgres::Config) {
    use tokio_postgres::config::Host;
    let defaults = tokio_postgres::Config::new();
    if let (None, Some(user)) = (pg.get_user(), from.get_user()) {
        pg.user(user);
    }
    if let (None, Some(password)) = (pg.get_password(), from.get_password()) {
        pg.password(password);
    }
    if let (None, Some(dbname)) = (pg.get_dbname(), from.get_dbname()) {
        pg.dbname(dbname);
    }
    if let (None, Some(options)) = (pg.get_options(), from.get_options()) {
        pg.options(options);
    }
    if let (None, Some(name)) = (pg.get_application_name(), from.get_application_name()) {
        pg.application_name(name);
    }
    if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
        for host in from.get_hosts() {
            match host {
                Host::Tcp(name) => pg.host(name),
                #[cfg(unix)]
                Host::Unix(dir) => pg.host_path(dir),
            };
        }
        for addr in from.get_hostaddrs() {
            pg.hostaddr(*addr);
        }
    }
    if pg.get_ports().is_empty() {
        for port in from.get_ports() {
            pg.port(*port);
        }
    }
    if let (None, Some(timeout)) = (pg.get_tcp_user_timeout(), from.get_tcp_user_timeout()) {
        pg.tcp_user_timeout(*timeout);
    }
    if pg.get_keepalives() == defaults.get_keepalives() {
        pg.keepalives(from.get_keepalives());
    }
    if pg.get_keepalives_idle() == defaults.get_keepalives_idle() {
        pg.keepalives_idle(from.get_keepalives_idle());
    }
    if let (None, Some(interval)) = (pg.get_keepalives_interval(), from.get_keepalives_interval()) {
        pg.keepalives_interval(interval);
    }
    if let (None, Some(retries)) = (pg.get_keepalives_retries(), from.get_keepalives_retries()) {
        pg.keepalives_retries(retries);
    }
    if pg.get_channel_binding() == defaults.get_channel_binding() {
        pg.channel_binding(from.get_channel_binding());
    }
    if pg.get_load_balance_hosts() == defaults.get_load_balance_hosts() {
        pg.load_balance_hosts(from.get_load_balance_hosts());
    }
    if pg.get_ssl_negotiation() == defaults.get_ssl_negotiation() {
        pg.ssl_negotiation(from.get_ssl_negotiation());
    }
}

/// "0"/"1" (and libpq's other spellings of a boolean).
fn parse_flag(what: &'static str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(Error::invalid(what, format!("{value:?} is not 0 or 1"))),
    }
}

/// A setting pgbus does not support, refused with why.
fn unsupported(what: &'static str, value: &str, why: &str) -> Error {
    Error::invalid(what, format!("{value:?}: {why}"))
}

/// Splits a connection string into the part tokio_postgres parses and pgbus's own
/// parameters (decoded).
fn split_params(s: &str) -> Result<(String, Vec<(String, String)>)> {
    let bad = |reason: &str| Error::invalid("connection string", reason.to_string());
    let mut ours = Vec::new();
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        check_percent_escapes(s)?;
        let Some((base, query)) = s.split_once('?') else {
            return Ok((s.to_string(), ours));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| bad("a URL parameter has no '='"))?;
            let key = percent_decode(k).ok_or_else(|| bad("bad %-escape in a URL parameter"))?;
            if !PASSED.contains(&key.as_str()) {
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
        if !PASSED.contains(&key.as_str()) {
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
    if pg.get_hostaddrs().is_empty()
        && let Some(addrs) = var("PGHOSTADDR")
    {
        for addr in addrs.split(',') {
            let addr = addr.trim().parse().map_err(|_| {
                Error::invalid("PGHOSTADDR", format!("{addr:?} is not an IP address"))
            })?;
            pg.hostaddr(addr);
        }
    }
    if pg.get_options().is_none()
        && let Some(options) = var("PGOPTIONS")
    {
        pg.options(options);
    }
    // The rest of tokio_postgres' settings from their variables, as the string would
    // give them.
    for (var_name, key) in [
        ("PGSSLNEGOTIATION", "sslnegotiation"),
        ("PGCHANNELBINDING", "channel_binding"),
        ("PGLOADBALANCEHOSTS", "load_balance_hosts"),
    ] {
        let Some(value) = var(var_name) else { continue };
        let one: tokio_postgres::Config = format!("{key}='{}'", value.replace(['\\', '\''], ""))
            .parse()
            .map_err(|_| Error::invalid(var_name, format!("{value:?} is not a value of {key}")))?;
        match key {
            "sslnegotiation" => pg.ssl_negotiation(one.get_ssl_negotiation()),
            "channel_binding" => pg.channel_binding(one.get_channel_binding()),
            _ => pg.load_balance_hosts(one.get_load_balance_hosts()),
        };
    }
    Ok(())
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
        assert_eq!(
            pg.get_hosts(),
            &[tokio_postgres::config::Host::Tcp("h".into())]
        );
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
            ("host=h user=u sslcert=/a.pem", "sslkey"),
            ("host=h user=u sslcrl=/crl.pem", "sslcrl"),
            ("host=h user=u sslcrldir=/crls", "sslcrldir"),
            ("host=h user=u sslsni=maybe", "sslsni"),
            (
                "host=h user=u target_session_attrs=master",
                "target_session_attrs",
            ),
            ("host=h user=u connect_timeout=soon", "connect_timeout"),
            ("host=h user=u gssencmode=require", "gssencmode"),
            ("host=h user=u service=mine", "service"),
            ("host=h user=u client_encoding=LATIN1", "client_encoding"),
            (
                "host=h user=u ssl_max_protocol_version=TLSv1.1",
                "ssl_max_protocol_version",
            ),
            ("host=h user=u port=many", "connection string"),
            ("postgres://%%%", "connection string"),
            ("postgres://u:p%ZZ@h/d", "connection string"),
            ("postgres://u@h/d?sslcrl=%2Fcrl.pem", "sslcrl"),
            ("postgres://u@h/d?replication=database", "replication"),
        ];
        for (s, what) in cases {
            match ConnectConfig::parse_with_env(s, &env) {
                Err(Error::Invalid { what: w, .. }) => assert_eq!(w, what, "{s}"),
                other => panic!("{s}: {other:?}"),
            }
        }
        // A bad value from the environment names the variable.
        for (var, value) in [
            ("PGSSLMODE", "on"),
            ("PGCONNECT_TIMEOUT", "later"),
            ("PGTARGETSESSIONATTRS", "primary-ish"),
            ("PGSSLCRL", "/crl.pem"),
            ("PGSERVICE", "mine"),
            ("PGHOSTADDR", "not-an-ip"),
            ("PGCHANNELBINDING", "always"),
        ] {
            let bad_env = env_of(&[("PGHOST", "h"), ("PGUSER", "u"), (var, value)]);
            match ConnectConfig::parse_with_env("", &bad_env) {
                Err(Error::Invalid { what, .. }) => assert_eq!(what, var),
                other => panic!("{var}={value}: {other:?}"),
            }
        }
        // The string's own setting wins over the variable.
        let env = env_of(&[("PGSSLMODE", "on"), ("PGTARGETSESSIONATTRS", "bogus")]);
        let c = ConnectConfig::parse_with_env(
            "host=h user=u sslmode=disable target_session_attrs=primary",
            &env,
        )
        .unwrap();
        assert_eq!(c.ssl_mode(), SslMode::Disable);
        // Every setting libpq names that pgbus supports is accepted.
        let c = ConnectConfig::parse_with_env(
            "host=h user=u sslsni=0 sslcompression=0 sslcertmode=disable keepalives_count=3 \
             ssl_min_protocol_version=TLSv1.2 ssl_max_protocol_version=TLSv1.3 \
             gssencmode=prefer fallback_application_name=fb client_encoding=UTF8 \
             target_session_attrs=prefer-standby sslpassword=unused replication=false",
            env_of(&[]),
        )
        .unwrap();
        assert_eq!(c.pg_config().get_application_name(), Some("fb"));
        assert_eq!(c.pg_config().get_keepalives_retries(), Some(3));
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
        let password = |s: &str| {
            let c = ConnectConfig::parse_with_env(s, &env).unwrap();
            let pg = c.pg_config();
            startup::targets(pg)
                .unwrap()
                .iter()
                .map(|t| {
                    c.passfile_password(pg, t)
                        .or_else(|| pg.get_password().map(|p| String::from_utf8_lossy(p).into()))
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(password("host=h user=u dbname=db"), [Some("pa:ss".into())]);
        assert_eq!(password("host=x user=y"), [Some("fallback".into())]);
        assert_eq!(
            password("host=h user=u password=given"),
            [Some("given".into())]
        );
        // Each host of a list is looked up on its own, as libpq does.
        assert_eq!(
            password("host=other,h user=u dbname=db"),
            [Some("wrong".into()), Some("pa:ss".into())]
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            assert_eq!(
                password("host=h user=u dbname=db"),
                [None],
                "a readable file is ignored"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
