//! The crate's error type and the error a handler returns.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::error::SqlState;

/// The result type of pgbus operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in pgbus.
///
/// Match on the variant to react to a kind of failure (the enum is `#[non_exhaustive]`:
/// keep a catch-all arm), or ask: [`Error::code`] gives the SQLSTATE where PostgreSQL
/// refused a statement, [`Error::as_db_error`] its full report, [`Error::is_connection`]
/// and [`Error::is_transient`] whether a retry may help. `source()` leads to the
/// underlying error.
///
/// [`Error::Invalid`] is only ever bad input, refused before anything was done: a command
/// line can exit with its own code for it ("nothing was done").
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Input was refused before anything was written: an empty or over-long name, an
    /// invalid pattern, a payload with `\u0000`, a payload over the size limit, headers
    /// that are not a JSON object, a malformed connection string.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// What was invalid, e.g. `event name` or `payload`.
        what: &'static str,
        /// Why, in words.
        reason: String,
    },
    /// An event with this id was already published with different content.
    #[error("event {id} was already published with different content")]
    Conflict {
        /// The conflicting event id.
        id: String,
    },
    /// The `pgbus` schema is missing or older than this library: run `pgbus migrate`.
    #[error("the pgbus schema is missing or out of date in this database: run `pgbus migrate`")]
    SchemaMissing(#[source] tokio_postgres::Error),
    /// A migration recorded as applied differs from the one embedded in this binary.
    #[error("migration {version} was applied with different content than this binary carries")]
    MigrationDrift {
        /// The migration's version.
        version: i32,
    },
    /// [`migrate`](crate::migrate) refused the `pgbus` schema, before writing anything:
    /// the schema or objects in it were made by a role that is neither the migrating
    /// role, nor one it is granted, nor a superuser (or another role may create objects
    /// in it, or triggers on its tables). Their code would run with the migrating role's
    /// rights, so pgbus never adopts them. Each entry of `problems` names one, e.g.
    /// `table pgbus.schema_migrations is owned by mallory`.
    #[error(
        "refusing to migrate: the pgbus schema holds what role {role} did not create: {}; \
         drop the schema (DROP SCHEMA pgbus CASCADE) or make {role} the owner of each object \
         (ALTER ... OWNER TO {role}; drop foreign triggers, revoke foreign grants), then run \
         migrate again",
        .problems.join("; ")
    )]
    UnsafeSchema {
        /// The role `migrate` ran as.
        role: String,
        /// What was refused, one object or grant each.
        problems: Vec<String>,
    },
    /// The server is a PostgreSQL older than pgbus supports; [`migrate`](crate::migrate)
    /// refused it before changing anything. Both versions are `server_version_num`
    /// values, e.g. `120022` for 12.22; the minimum is a major version's first release.
    #[error(
        "PostgreSQL {} is not supported: pgbus needs PostgreSQL {} or newer",
        match *.version {
            v if v >= 100_000 => format!("{}.{}", v / 10_000, v % 10_000),
            v => format!("{}.{}.{}", v / 10_000, v / 100 % 100, v % 100),
        },
        .minimum / 10_000
    )]
    UnsupportedServer {
        /// The server's `server_version_num`.
        version: i32,
        /// The oldest version pgbus supports, as a `server_version_num`.
        minimum: i32,
    },
    /// PostgreSQL refused a statement, or the connection failed.
    #[error("database error: {}", describe(.0))]
    Database(#[source] tokio_postgres::Error),
    /// PostgreSQL refused a statement sent through sqlx, or sqlx could not run it (a
    /// failed connection, a closed or exhausted pool): [`pgbus::sqlx`](crate::sqlx) only.
    /// [`Error::code`], [`Error::is_connection`] and [`Error::is_transient`] answer as
    /// for [`Error::Database`]; a missing schema says so (run `pgbus migrate`), with its
    /// SQLSTATE (42P01, 3F000, 42883 or 42703).
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "sqlx", feature = "sqlx-0_8"))))]
    #[error("{0}")]
    Sqlx(#[source] SqlxVariantError),
    /// As [`Error::Sqlx`], for a statement sent through sqlx 0.8
    /// ([`pgbus::sqlx08`](crate::sqlx08)) when both the `sqlx` and the `sqlx-0_8` features
    /// are on (with `sqlx-0_8` alone, sqlx 0.8's failures are [`Error::Sqlx`]).
    #[cfg(all(feature = "sqlx", feature = "sqlx-0_8"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "sqlx", feature = "sqlx-0_8"))))]
    #[error("{0}")]
    Sqlx08(#[source] sqlx08::SqlxError),
    /// No connection could be taken from the bus's pool (none could be opened in time,
    /// or the pool is closed).
    #[error("connection pool error: {0}")]
    Pool(#[source] PoolError),
    /// No connection to the server could be opened: the host and port tried last, what
    /// pgbus was waiting for when it gave up ([`ConnectPhase`]), and why: the startup
    /// bound (`connect_timeout`, 10 s by default) ran out, or the network, the TLS
    /// handshake or the server failed it (the `source()`). With several hosts
    /// (`host=a,b`), each is tried in turn and `earlier` says how the others failed.
    /// [`Error::code`] gives the SQLSTATE when the server refused the login.
    #[error("{}", describe_connect(host, *port, *phase, *timed_out, source.as_deref(), earlier))]
    Connect {
        /// The host tried last, as the connection string names it (a name, an address,
        /// or a socket directory).
        host: String,
        /// Its port.
        port: u16,
        /// What pgbus was waiting for when the attempt ended.
        phase: ConnectPhase,
        /// The startup bound, when it ran out (the server did not answer in time).
        timed_out: Option<Duration>,
        /// Why the attempt failed, when it did not time out: the network's, the TLS
        /// library's or the server's error, or that the server does not speak
        /// PostgreSQL's protocol.
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
        /// How the hosts tried before this one failed, in order.
        earlier: Vec<String>,
    },
    /// A wait inside pgbus ran past its deadline.
    #[error("timed out while {0}")]
    Timeout(&'static str),
    /// A lock pgbus needs stayed held by other sessions for as long as the caller allowed
    /// (e.g. [`admin::configure_subscription_within`](crate::admin::configure_subscription_within)
    /// waiting for the configuration lock); nothing was changed. `sessions` names the
    /// sessions that held or awaited it when pgbus gave up, the longest-running
    /// transaction first.
    #[error("gave up waiting for {what} after {}: {}", human(*.waited), describe_holders(.sessions))]
    LockWait {
        /// The lock, in words, e.g. `the configuration lock`.
        what: &'static str,
        /// How long pgbus waited.
        waited: Duration,
        /// The sessions holding or awaiting it.
        sessions: Vec<LockHolder>,
    },
    /// The lease on a delivery was lost (it expired and the delivery was claimed again,
    /// or an operator changed it), so the settlement changed nothing.
    #[error("the lease on this delivery was lost; the settlement changed nothing")]
    LeaseLost,
    /// A settlement (ack, failure, release) could not be written; the delivery's lease
    /// will expire and it will be delivered again. The error that stopped it is its
    /// source (one error may answer every settlement of a batch, hence the `Arc`);
    /// [`Error::code`] gives its SQLSTATE.
    #[error("could not record the settlement: {0}")]
    Settle(#[source] Arc<Error>),
    /// The outcome of a settlement is unknown: its connection was lost with the
    /// statement (or its `COMMIT`) in flight, so it may have been written or not, and a
    /// later try could not tell (it found the lease gone, which the first try may have
    /// done itself, or it could not be written either). The delivery may come back or
    /// not; at-least-once delivery covers both. The connection error is its source.
    #[error(
        "the outcome of the settlement is unknown: the connection was lost while it was being \
         written ({0}); the delivery may or may not be delivered again"
    )]
    SettleUnknown(#[source] Arc<Error>),
    /// The bus has shut down.
    #[error("the bus has shut down")]
    Closed,
    /// PostgreSQL answered in a way pgbus does not expect of its own statements (a
    /// schema changed by hand, say); nothing this error names was done.
    #[error("unexpected answer from PostgreSQL: {0}")]
    Unexpected(&'static str),
    /// No subscription has this name.
    #[error("unknown subscription {name:?}")]
    UnknownSubscription {
        /// The name asked for.
        name: String,
    },
    /// PostgreSQL refused an action for want of privilege (SQLSTATE 42501): the connected
    /// role lacks the grant it needs, and nothing was done. The message names the grant
    /// and how the schema's owner gives it, e.g. `SELECT pgbus.grant_operator('ops')`.
    #[error(
        "{action} needs {}: {} ({})",
        grant.needed(),
        grant.fix(role.as_deref()),
        describe(source)
    )]
    NeedsGrant {
        /// What was refused, e.g. `purging dead letters`.
        action: &'static str,
        /// The grant that allows it.
        grant: Grant,
        /// The role that was refused (`current_user`), when it could be read.
        role: Option<String>,
        /// PostgreSQL's refusal.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The subscription has deliveries being processed, so it was not dropped (pass
    /// `force` to drop it anyway).
    #[error("subscription {name:?} has {processing} deliveries processing")]
    SubscriptionBusy {
        /// The subscription.
        name: String,
        /// How many of its deliveries are processing.
        processing: i64,
    },
}

/// The grants of pgbus's roles (docs/ARCHITECTURE.md, "Roles and privileges"), as
/// [`Error::NeedsGrant`] names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Grant {
    /// `pgbus.grant_publisher`: publishing.
    Publisher,
    /// `pgbus.grant_consumer`: what a running bus does.
    Consumer,
    /// `pgbus.grant_operator`: settings, dead letters (retry, purge), replay, a blocked
    /// key's head (skip, redrive).
    Operator,
    /// The schema's owner (the role that ran `pgbus migrate`) alone: dropping a
    /// subscription, `register_subscription`, `pgbus.settings`.
    Owner,
}

impl Grant {
    /// The grant's function, `None` for the owner's actions.
    pub fn function(self) -> Option<&'static str> {
        match self {
            Grant::Publisher => Some("pgbus.grant_publisher"),
            Grant::Consumer => Some("pgbus.grant_consumer"),
            Grant::Operator => Some("pgbus.grant_operator"),
            Grant::Owner => None,
        }
    }

    /// What is needed, in words.
    fn needed(self) -> &'static str {
        match self {
            Grant::Publisher => "the publisher grant",
            Grant::Consumer => "the consumer grant",
            Grant::Operator => "the operator grant",
            Grant::Owner => "the schema's owner",
        }
    }

    /// How to get it, for `role`.
    fn fix(self, role: Option<&str>) -> String {
        let role = role.unwrap_or("ROLE").replace('\'', "''");
        match self.function() {
            Some(f) => format!("as the schema's owner, run SELECT {f}('{role}')"),
            None => format!("run it as the role that ran `pgbus migrate` (not '{role}')"),
        }
    }
}

/// A session that holds, or waits for, a lock pgbus waited for (see [`Error::LockWait`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockHolder {
    /// The server process id (`pg_stat_activity.pid`; end it with
    /// `pg_terminate_backend(pid)`), or `None` for a prepared transaction.
    pub pid: Option<i32>,
    /// The role the session runs as.
    pub role: Option<String>,
    /// The session's `application_name`.
    pub application_name: Option<String>,
    /// How long its transaction has run, where the asking role may see it (its own
    /// sessions, or with `pg_read_all_stats`).
    pub transaction_age: Option<Duration>,
    /// Whether it is itself waiting for the lock (rather than holding it).
    pub waiting: bool,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid}")?,
            None => f.write_str("a prepared transaction")?,
        }
        let mut about = Vec::new();
        if let Some(role) = &self.role {
            about.push(format!("role {role:?}"));
        }
        if let Some(app) = self.application_name.as_deref().filter(|a| !a.is_empty()) {
            about.push(format!("application_name {app:?}"));
        }
        if let Some(age) = self.transaction_age {
            about.push(format!("in a transaction for {}", human(age)));
        }
        if self.waiting {
            about.push("waiting for it too".to_owned());
        }
        if !about.is_empty() {
            write!(f, " ({})", about.join(", "))?;
        }
        Ok(())
    }
}

/// The sessions of an [`Error::LockWait`], in words.
fn describe_holders(sessions: &[LockHolder]) -> String {
    if sessions.is_empty() {
        return "held by sessions that ended meanwhile; try again".to_owned();
    }
    let list: Vec<String> = sessions.iter().map(ToString::to_string).collect();
    format!(
        "held by {}; let its transaction end, or end the session with pg_terminate_backend(pid)",
        list.join("; ")
    )
}

/// A duration in words: `250ms`, `4.2s`, `3m12s`.
fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        format!("{}m{}s", d.as_secs() / 60, d.as_secs() % 60)
    }
}

impl Error {
    /// The SQLSTATE code, where PostgreSQL refused a statement.
    pub fn code(&self) -> Option<&SqlState> {
        match self {
            Error::Database(e) | Error::SchemaMissing(e) => e.code(),
            Error::NeedsGrant { source, .. } => source.code(),
            Error::Settle(e) | Error::SettleUnknown(e) => e.code(),
            Error::Connect { .. } => self.connect_db_error().and_then(|e| e.code()),
            #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
            Error::Sqlx(e) => e.code(),
            #[cfg(all(feature = "sqlx", feature = "sqlx-0_8"))]
            Error::Sqlx08(e) => e.code(),
            _ => None,
        }
    }

    /// The error PostgreSQL reported, with its message, detail and hint, if any.
    pub fn as_db_error(&self) -> Option<&tokio_postgres::error::DbError> {
        match self {
            Error::Database(e) | Error::SchemaMissing(e) => e.as_db_error(),
            Error::NeedsGrant { source, .. } => source.as_db_error(),
            Error::Settle(e) | Error::SettleUnknown(e) => e.as_db_error(),
            Error::Connect { .. } => self.connect_db_error().and_then(|e| e.as_db_error()),
            _ => None,
        }
    }

    /// The driver's error behind an [`Error::Connect`], when the server answered with one.
    fn connect_db_error(&self) -> Option<&tokio_postgres::Error> {
        match self {
            Error::Connect {
                source: Some(source),
                ..
            } => source.downcast_ref::<tokio_postgres::Error>(),
            _ => None,
        }
    }

    /// Whether this is a [`Error::Conflict`].
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Conflict { .. })
    }

    /// Whether the error came from a lost or unusable connection, or from a server that
    /// is shutting down or starting up (worth a retry).
    pub fn is_connection(&self) -> bool {
        match self {
            Error::Database(e) => {
                e.is_closed()
                    || e.code().is_none_or(|c| {
                        // 08: connection exception; 57P01-57P05: the server is shutting
                        // down, crashed, or not accepting connections yet (a restart).
                        c.code().starts_with("08") || c.code().starts_with("57P")
                    })
            }
            Error::Pool(_) => true,
            // The server could not be reached, or answered the login with a connection
            // exception or "starting up"; a refused login (28...) is not one.
            Error::Connect { .. } => self.code().is_none_or(|c| {
                c.code().starts_with("08")
                    || c.code().starts_with("57P")
                    || c.code().starts_with("53")
            }),
            Error::Settle(e) | Error::SettleUnknown(e) => e.is_connection(),
            #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
            Error::Sqlx(e) => e.is_connection(),
            #[cfg(all(feature = "sqlx", feature = "sqlx-0_8"))]
            Error::Sqlx08(e) => e.is_connection(),
            _ => false,
        }
    }

    /// Whether the same statement may well succeed if it is simply tried again later:
    /// the connection failed or the pool had none to give ([`Error::is_connection`]),
    /// or PostgreSQL refused it for a reason that lies with the server and passes, not
    /// with the data:
    ///
    /// - class 53, insufficient resources (`too_many_connections`, `out_of_memory`,
    ///   `disk_full`, ...);
    /// - `40001` serialization failure and `40P01` deadlock detected;
    /// - `55P03` lock not available;
    /// - `57014` query canceled: the statement ran past `statement_timeout` (a lock held
    ///   elsewhere, an overloaded server) or was cancelled by an operator. The bus's own
    ///   statements are small and quick, so a timeout says more about the server than
    ///   about the statement;
    /// - `25006` read-only transaction: connected to a standby, as during a failover.
    ///
    /// The bus retries these with backoff and never gives up on them while running
    /// (nor drops a settlement because of them).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Timeout(_) | Error::LockWait { .. } => true,
            Error::Settle(e) => e.is_transient(),
            // Not the same statement to try again: the delivery is no longer this
            // caller's to settle.
            Error::SettleUnknown(_) => false,
            _ if self.is_connection() => true,
            _ => self.code().is_some_and(|c| transient_code(c.code())),
        }
    }

    /// Whether PostgreSQL refused the statement because of a value in it (classes 22,
    /// data exception, 23, integrity constraint violation, and 54, program limit
    /// exceeded): retrying the same values cannot help, but the other rows of a batch
    /// may be fine on their own.
    pub(crate) fn is_data_fault(&self) -> bool {
        self.code()
            .is_some_and(|c| matches!(&c.code()[..2], "22" | "23" | "54"))
    }

    /// A copy of an [`Error::Connect`] (its source is shared), for the pool to hand the
    /// same failure to every caller that waited on it.
    pub(crate) fn copy_connect(&self) -> Option<Error> {
        match self {
            Error::Connect {
                host,
                port,
                phase,
                timed_out,
                source,
                earlier,
            } => Some(Error::Connect {
                host: host.clone(),
                port: *port,
                phase: *phase,
                timed_out: *timed_out,
                source: source.clone(),
                earlier: earlier.clone(),
            }),
            _ => None,
        }
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::Invalid {
            what,
            reason: reason.into(),
        }
    }
}

/// Whether a SQLSTATE names a failure that passes (see [`Error::is_transient`]).
pub(crate) fn transient_code(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57P")
        || matches!(code, "40001" | "40P01" | "55P03" | "57014" | "25006")
}

/// The most bytes of an error text the bus stores: 8 KiB.
///
/// Every failure text pgbus writes (a handler's error, a panic message, a timeout, a
/// dead-letter reason, the standard error of a `pgbus consume --exec` command) is made
/// storable first: a NUL character, which PostgreSQL's `text` cannot hold, becomes
/// U+FFFD (`\u{FFFD}`), and a longer text is cut at a character boundary and ends with
/// `… (truncated)`, the whole at most this many bytes.
pub const MAX_ERROR_TEXT: usize = 8 * 1024;

/// What a text cut by [`storable_text`] ends with.
const TRUNCATED: &str = "… (truncated)";

/// Makes a failure text storable (see [`MAX_ERROR_TEXT`]): NUL becomes U+FFFD, and a
/// text longer than the limit is cut on a character boundary and marked. Allocates only
/// when it changes something.
pub(crate) fn storable_text(mut text: String) -> String {
    // Cut first, so that a huge text is never copied whole.
    let mut cut = text.len() > MAX_ERROR_TEXT;
    if cut {
        text.truncate(char_floor(&text, MAX_ERROR_TEXT));
    }
    if text.contains('\0') {
        text = text.replace('\0', "\u{FFFD}");
        cut |= text.len() > MAX_ERROR_TEXT;
    }
    if cut {
        text.truncate(char_floor(&text, MAX_ERROR_TEXT - TRUNCATED.len()));
        text.push_str(TRUNCATED);
    }
    text
}

/// The largest character boundary of `s` at or below `at`.
fn char_floor(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// What a connection attempt was waiting for when it ended (see [`Error::Connect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectPhase {
    /// Looking up the host name.
    Resolving,
    /// Waiting for the TCP (or Unix socket) connection.
    Connecting,
    /// Waiting for the server's one-byte answer to the request for TLS.
    TlsRequest,
    /// Waiting for the TLS handshake.
    TlsHandshake,
    /// The startup message was sent: waiting for the server to authenticate the login.
    Authenticating,
    /// Logged in: waiting for the server's parameters and its first ReadyForQuery.
    Starting,
    /// Connected: checking that the server is what `target_session_attrs` asks for.
    CheckingSession,
}

impl ConnectPhase {
    /// The phase in words, as the error message says it ("waiting for the TLS
    /// handshake").
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectPhase::Resolving => "looking up the host name",
            ConnectPhase::Connecting => "waiting for the TCP connection",
            ConnectPhase::TlsRequest => "waiting for the answer to the TLS request",
            ConnectPhase::TlsHandshake => "waiting for the TLS handshake",
            ConnectPhase::Authenticating => "waiting for authentication",
            ConnectPhase::Starting => "waiting for the session to start",
            ConnectPhase::CheckingSession => "checking target_session_attrs",
        }
    }
}

impl fmt::Display for ConnectPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// [`Error::Connect`]'s message: the host and port, the phase, and why.
fn describe_connect(
    host: &str,
    port: u16,
    phase: ConnectPhase,
    timed_out: Option<Duration>,
    source: Option<&(dyn std::error::Error + Send + Sync + 'static)>,
    earlier: &[String],
) -> String {
    let mut text = match (timed_out, source) {
        (Some(bound), _) => format!(
            "could not connect to {host}:{port}: no answer within {} {phase}",
            seconds(bound)
        ),
        (None, Some(source)) => {
            let mut why = match source.downcast_ref::<tokio_postgres::Error>() {
                Some(e) => describe(e),
                None => source.to_string(),
            };
            // The driver's message alone says only "error performing TLS handshake":
            // what went wrong is in its sources.
            let db = source
                .downcast_ref::<tokio_postgres::Error>()
                .is_some_and(|e| e.as_db_error().is_some());
            let mut cause = if db { None } else { source.source() };
            while let Some(e) = cause {
                let part = e.to_string();
                if !why.contains(&part) {
                    why.push_str(": ");
                    why.push_str(&part);
                }
                cause = e.source();
            }
            format!("could not connect to {host}:{port} ({phase}): {why}")
        }
        (None, None) => format!("could not connect to {host}:{port} ({phase})"),
    };
    if !earlier.is_empty() {
        text.push_str("; before it, ");
        text.push_str(&earlier.join("; "));
    }
    text.replace('\n', " ")
}

/// A duration as "3 s" or "1.5 s".
fn seconds(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// What PostgreSQL said, with its SQLSTATE (tokio-postgres alone displays "db error").
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// Whether PostgreSQL's error says that the pgbus schema is missing or out of date: an
/// undefined table, schema, function or column of pgbus.
pub(crate) fn schema_missing(code: Option<&SqlState>, message: Option<&str>) -> bool {
    matches!(
        code,
        Some(c) if *c == SqlState::UNDEFINED_TABLE
            || *c == SqlState::INVALID_SCHEMA_NAME
            || *c == SqlState::UNDEFINED_FUNCTION
            || *c == SqlState::UNDEFINED_COLUMN
    ) && message.is_some_and(|m| m.contains("pgbus"))
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        if schema_missing(e.code(), e.as_db_error().map(|db| db.message())) {
            Error::SchemaMissing(e)
        } else {
            Error::Database(e)
        }
    }
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            e => Error::Pool(PoolError(Box::new(e))),
        }
    }
}

/// Defines `SqlxError` and `From<sqlx::Error> for Error` for one sqlx version's crate
/// (`$driver`), whose failures are `Error::$variant`: one source for both versions.
#[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
macro_rules! sqlx_error {
    ($driver:ident, $variant:ident) => {
        use std::fmt;

        use ::$driver as driver;
        use tokio_postgres::error::SqlState;

        use super::{Error, schema_missing};

        /// Why a statement sent through sqlx failed ([`Error::Sqlx`]; `Error::Sqlx08` for
        /// `pgbus::sqlx08` when both sqlx features are on): sqlx's own error, which is its
        /// `source()`, and the SQLSTATE that [`Error::code`] gives.
        #[derive(Debug)]
        pub struct SqlxError {
            error: driver::Error,
            code: Option<SqlState>,
        }

        impl SqlxError {
            /// sqlx's error.
            pub fn get_ref(&self) -> &driver::Error {
                &self.error
            }

            /// sqlx's error, taken out.
            pub fn into_inner(self) -> driver::Error {
                self.error
            }

            /// The SQLSTATE, where PostgreSQL refused the statement.
            pub(crate) fn code(&self) -> Option<&SqlState> {
                self.code.as_ref()
            }

            /// Whether the pgbus schema is missing or out of date in the database.
            pub fn is_schema_missing(&self) -> bool {
                let message = match &self.error {
                    driver::Error::Database(db) => Some(db.message()),
                    _ => None,
                };
                schema_missing(self.code.as_ref(), message)
            }

            /// As [`Error::is_connection`] for tokio-postgres: sqlx could not reach the server
            /// (I/O, TLS, the protocol, a closed or exhausted pool), or PostgreSQL answered with
            /// a connection exception (08) or is shutting down or starting up (57P).
            pub(crate) fn is_connection(&self) -> bool {
                match &self.error {
                    driver::Error::Database(_) => self
                        .code
                        .as_ref()
                        .is_some_and(|c| c.code().starts_with("08") || c.code().starts_with("57P")),
                    driver::Error::Io(_)
                    | driver::Error::Tls(_)
                    | driver::Error::Protocol(_)
                    | driver::Error::PoolTimedOut
                    | driver::Error::PoolClosed
                    | driver::Error::WorkerCrashed
                    | driver::Error::BeginFailed => true,
                    _ => false,
                }
            }
        }

        impl fmt::Display for SqlxError {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if self.is_schema_missing() {
                    f.write_str(
                        "the pgbus schema is missing or out of date in this database: run `pgbus migrate`: ",
                    )?;
                } else {
                    f.write_str("database error: ")?;
                }
                match (&self.error, &self.code) {
                    (driver::Error::Database(db), Some(code)) => {
                        write!(f, "{} (SQLSTATE {})", db.message(), code.code())
                    }
                    (e, _) => fmt::Display::fmt(e, f),
                }
            }
        }

        impl std::error::Error for SqlxError {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.error)
            }
        }

        impl From<driver::Error> for Error {
            fn from(error: driver::Error) -> Self {
                let code = match &error {
                    driver::Error::Database(db) => db.code().map(|c| SqlState::from_code(&c)),
                    _ => None,
                };
                Error::$variant(SqlxError { error, code })
            }
        }
    };
}

/// sqlx 0.9's [`SqlxError`](sqlx09::SqlxError) (`pgbus::sqlx::SqlxError`).
#[cfg(feature = "sqlx")]
pub(crate) mod sqlx09 {
    sqlx_error!(sqlx, Sqlx);
}

/// sqlx 0.8's [`SqlxError`](sqlx08::SqlxError) (`pgbus::sqlx08::SqlxError`).
#[cfg(feature = "sqlx-0_8")]
pub(crate) mod sqlx08 {
    #[cfg(feature = "sqlx")]
    sqlx_error!(sqlx08, Sqlx08);
    #[cfg(not(feature = "sqlx"))]
    sqlx_error!(sqlx08, Sqlx);
}

#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx")))]
use sqlx08::SqlxError as SqlxVariantError;
/// The error of [`Error::Sqlx`]: sqlx 0.9's, or sqlx 0.8's with the `sqlx-0_8` feature alone.
#[cfg(feature = "sqlx")]
use sqlx09::SqlxError as SqlxVariantError;

/// Why no connection could be taken from the bus's pool: its message, and the pool's
/// own error as `source()`. Opaque, so that the pool behind it can change.
#[derive(Debug)]
pub struct PoolError(Box<dyn std::error::Error + Send + Sync>);

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for PoolError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// What a handler returns when it could not handle an event.
///
/// Every error that converts into `Box<dyn std::error::Error + Send + Sync>` converts
/// into it, so `?` works in handlers on any `std::error::Error + Send + Sync` type, on
/// `Box<dyn Error + Send + Sync>` and on `anyhow::Error` (for that reason it does not
/// implement `std::error::Error` itself). The message recorded is the error's text and
/// its sources'. An error that is neither `Send` nor `Sync` (a `PoisonError` holding a
/// guard) converts with `.map_err(HandlerError::new)`.
///
/// ```
/// use anyhow::Context as _;
/// use pgbus::{Event, HandlerError};
///
/// #[derive(serde::Deserialize)]
/// struct Order {
///     id: i64,
/// }
///
/// fn check(order: &Order) -> anyhow::Result<()> {
///     anyhow::ensure!(order.id > 0, "order {} has no valid id", order.id);
///     Ok(())
/// }
///
/// fn reserve(order: &Order) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     Ok(())
/// }
///
/// async fn handle(event: Event) -> Result<(), HandlerError> {
///     let order: Order = serde_json::from_value(event.payload)?; // serde_json::Error
///     check(&order).context("checking the order")?; // anyhow::Error
///     reserve(&order)?; // Box<dyn Error + Send + Sync>
///     Err(HandlerError::retry_after("the warehouse is busy", std::time::Duration::from_secs(30)))
/// }
/// # let _ = handle;
/// ```
///
/// By default the attempt is retried after the subscription's backoff. A handler can ask
/// for a specific delay ([`HandlerError::retry_after`]) or give up at once
/// ([`HandlerError::permanent`]), which dead-letters the delivery.
///
/// Any message is accepted; the text recorded in the delivery's history is made storable
/// first (NUL replaced, at most [`MAX_ERROR_TEXT`] bytes).
#[derive(Debug)]
pub struct HandlerError {
    message: String,
    retry_after: Option<Duration>,
    permanent: bool,
}

impl HandlerError {
    /// A failed attempt, retried after the subscription's backoff.
    pub fn new(message: impl fmt::Display) -> Self {
        HandlerError {
            message: message.to_string(),
            retry_after: None,
            permanent: false,
        }
    }

    /// A failed attempt to retry after `delay` instead of the backoff (still counted
    /// against the subscription's maximum attempts). A delay longer than
    /// [`MAX_RETRY_DELAY`](crate::MAX_RETRY_DELAY) (365 days) is clamped to it.
    pub fn retry_after(message: impl fmt::Display, delay: Duration) -> Self {
        HandlerError {
            retry_after: Some(crate::retry::clamp_delay(delay)),
            ..HandlerError::new(message)
        }
    }

    /// A failure that retrying cannot fix: the delivery goes to the dead letters now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        HandlerError {
            permanent: true,
            ..HandlerError::new(message)
        }
    }

    /// The error message recorded in the delivery's history.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The delay the handler asked for, if any (at most
    /// [`MAX_RETRY_DELAY`](crate::MAX_RETRY_DELAY)).
    pub fn delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether the handler gave up on this event.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Any error that converts into a `Box<dyn Error + Send + Sync>`: every
/// `std::error::Error + Send + Sync` type, `Box<dyn Error + Send + Sync>` itself,
/// `anyhow::Error`, `String` and `&str`. The message is the error's text followed by the
/// texts of its sources (`loading order 42: connection refused`), each left out when the
/// text before already contains it.
impl<'a, E> From<E> for HandlerError
where
    E: Into<Box<dyn std::error::Error + Send + Sync + 'a>>,
{
    fn from(e: E) -> Self {
        let e = e.into();
        let mut message = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            let text = s.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = s.source();
        }
        HandlerError::new(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storable_text_is_unchanged_when_it_can_be_stored() {
        for text in [
            "",
            "connection refused",
            "ünïcödé ✓",
            &"x".repeat(MAX_ERROR_TEXT),
        ] {
            assert_eq!(storable_text(text.to_string()), text);
        }
    }

    #[test]
    fn nul_becomes_the_replacement_character() {
        assert_eq!(storable_text("a\0b\0".into()), "a\u{FFFD}b\u{FFFD}");
        assert_eq!(storable_text("\0".into()), "\u{FFFD}");
    }

    #[test]
    fn a_long_text_is_cut_on_a_char_boundary_and_marked() {
        let long = "é".repeat(MAX_ERROR_TEXT); // two bytes each
        let stored = storable_text(long);
        assert!(stored.len() <= MAX_ERROR_TEXT, "{}", stored.len());
        assert!(stored.ends_with(TRUNCATED));
        assert!(stored.trim_end_matches(TRUNCATED).chars().all(|c| c == 'é'));

        let mb = format!("{}{}", "r".repeat(1 << 20), "\0");
        let stored = storable_text(mb);
        assert!(stored.len() <= MAX_ERROR_TEXT && stored.ends_with(TRUNCATED));
        assert!(stored.starts_with("rrrr"));

        // Every cut point near the limit, with multi-byte characters of every width.
        for pad in 0..4 {
            let text = format!(
                "{}{}",
                "a".repeat(MAX_ERROR_TEXT - 16 + pad),
                "ß€😀".repeat(8)
            );
            let stored = storable_text(text);
            assert!(stored.len() <= MAX_ERROR_TEXT);
            assert!(stored.ends_with(TRUNCATED));
        }
    }

    #[test]
    fn replacing_nul_may_push_a_text_over_the_limit() {
        // A NUL is one byte, U+FFFD three.
        let text = "\0".repeat(MAX_ERROR_TEXT);
        let stored = storable_text(text);
        assert!(stored.len() <= MAX_ERROR_TEXT);
        assert!(!stored.contains('\0'));
        assert!(stored.ends_with(TRUNCATED));
        // Exactly at the limit after replacement: kept whole.
        let text = format!("{}\0", "a".repeat(MAX_ERROR_TEXT - 3));
        let stored = storable_text(text);
        assert_eq!(stored.len(), MAX_ERROR_TEXT);
        assert!(stored.ends_with('\u{FFFD}'));
    }

    #[test]
    fn transient_codes() {
        for code in [
            "08006", "08001", "53000", "53100", "53200", "53300", "53400", "57P01", "57P03",
            "40001", "40P01", "55P03", "57014", "25006",
        ] {
            assert!(transient_code(code), "{code}");
        }
        for code in [
            "22021", "22008", "22015", "23505", "23514", "54000", "42501", "42883", "XX000",
            "40002", "55000",
        ] {
            assert!(!transient_code(code), "{code}");
        }
    }

    #[test]
    fn a_retry_after_is_clamped() {
        let e = HandlerError::retry_after("later", Duration::MAX);
        assert_eq!(e.delay(), Some(crate::MAX_RETRY_DELAY));
        let e = HandlerError::retry_after("later", Duration::from_secs(10u64.pow(12)));
        assert_eq!(e.delay(), Some(crate::MAX_RETRY_DELAY));
        let e = HandlerError::retry_after("soon", Duration::from_millis(5));
        assert_eq!(e.delay(), Some(Duration::from_millis(5)));
    }
}
