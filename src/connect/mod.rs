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

use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Client};

mod passfile;
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
#[derive(Debug, Clone, Default)]
struct Ssl {
    mode: Option<SslMode>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
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
            Error::invalid("connection string", e.to_string().replace('\n', " "))
        })?;
        let mut ssl = Ssl::default();
        let mut passfile = None;
        let mut timeout = None;
        let mut session = None;
        for (key, value) in ours {
            match key.as_str() {
                "sslmode" => ssl.mode = Some(value.parse()?),
                "sslrootcert" => ssl.root_cert = Some(value),
                "sslcert" => ssl.cert = Some(value),
                "sslkey" => ssl.key = Some(value),
                "connect_timeout" => timeout = Some(parse_timeout("connect_timeout", &value)?),
                "target_session_attrs" => {
                    session = Some(SessionAttrs::parse("target_session_attrs", &value)?);
                }
                _ => passfile = Some(value),
            }
        }
        fill_from_env(&mut pg, &mut ssl, &env)?;
        if timeout.is_none()
            && let Some(value) = env("PGCONNECT_TIMEOUT").filter(|v| !v.is_empty())
        {
            timeout = Some(parse_timeout("PGCONNECT_TIMEOUT", &value)?);
        }
        if let Some(Some(bound)) = timeout {
            pg.connect_timeout(bound);
        }
        if session.is_none()
            && let Some(value) = env("PGTARGETSESSIONATTRS").filter(|v| !v.is_empty())
        {
            session = Some(SessionAttrs::parse("PGTARGETSESSIONATTRS", &value)?);
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
            .then(|| {
                passfile
                    .or_else(|| env("PGPASSFILE").filter(|v| !v.is_empty()))
                    .or_else(|| env("HOME").map(|h| format!("{h}/.pgpass")))
            })
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

/// The parameters pgbus reads itself (tokio_postgres refuses them, or their values).
const OURS: [&str; 7] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "passfile",
    "connect_timeout",
    "target_session_attrs",
];

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
