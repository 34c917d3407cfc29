//! pgbus-testkit: what integration tests and benchmarks of code that uses
//! [`pgbus`] need — a throwaway PostgreSQL server, a fresh migrated database per
//! test, and patient assertions.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use pgbus::{Bus, Event};
//!
//! #[tokio::test]
//! async fn an_order_reaches_its_handler() {
//!     // A database of this test's own, cloned from a migrated template.
//!     let db = pgbus_testkit::test_db().await;
//!     let client = db.connect().await;
//!     let running = Bus::builder(db.config())
//!         .handler_fn("billing", ["order.*"], |_event: Event| async { Ok(()) })
//!         .build()
//!         .unwrap()
//!         .start()
//!         .await
//!         .unwrap();
//!     pgbus::publish(&client, &Event::new("order.placed", serde_json::json!({"id": 1})))
//!         .await
//!         .unwrap();
//!     // Every delivery acknowledged (deleted) within 30 seconds.
//!     pgbus_testkit::wait_settled(&client, "the order's delivery").await;
//!     running.shutdown().await.unwrap();
//! }
//! # fn main() {}
//! ```
//!
//! With `DATABASE_URL` set, [`test_db`] makes its databases on that server (its user
//! needs `CREATEDB`); without it, on one throwaway cluster shared by every test process
//! of the run ([`embedded`]: PostgreSQL's `initdb` and `pg_ctl` must be installed, or
//! named by `PG_BIN_DIR`).
//!
//! - [`test_db`], [`TestDb`], [`cluster`], [`private_cluster`]: databases and servers
//!   for tests; [`TestDb::url`] is a `postgres://` URL that sqlx and tokio-postgres both
//!   read.
//! - [`assert_published`], [`assert_published_exactly`], [`assert_not_published`],
//!   [`assert_nothing_published`], [`published`]: what the code under test published
//!   (committed, or in the transaction given), by name and payload.
//! - [`wait_for`], [`within`], [`count`], [`wait_count`], [`wait_settled`]: waiting, with a
//!   deadline, for what happens in the background.
//! - [`work_one`], [`work_one_with`]: run one subscription's handler on one delivery, as
//!   a running bus would, and read what it came to.
//! - [`embedded`]: the throwaway PostgreSQL server itself.
//!
//! With the `fixtures` feature, the servers and data of pgbus's own tests and
//! benchmarks, which a service's tests do not need:
//!
//! - [`tls`]: a PostgreSQL server that accepts TCP connections over TLS only, with its
//!   certificates; [`pgbouncer`]: PgBouncer in transaction mode, configured so that
//!   whatever a client leaves on a server connection is gone at the next transaction;
//!   [`nats`]: a NATS server with JetStream, on a free port with a store of its own;
//!   [`browser`]: a headless Chromium driven through chromedriver (WebDriver).
//! - [`bench`](mod@bench): databases and data for benchmarks (pgbus's criterion benches and `pgbus
//!   bench`).
//!
//! # Platforms
//!
//! The servers and databases ([`embedded`], [`bench`](mod@bench), [`test_db`] and its friends) are
//! Unix-only (Linux, macOS, the BSDs): the server listens on a Unix socket only, and runs
//! as the `postgres` user when the tests run as root. The waiting helpers and
//! [`connect`], [`url`], [`conninfo`] and the assertions on what was published work
//! everywhere.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
pub mod bench;
#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
pub mod browser;
#[cfg(unix)]
pub mod embedded;
#[cfg(unix)]
mod harness;
#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
pub mod nats;
#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
pub mod pgbouncer;
#[cfg(all(unix, feature = "fixtures"))]
mod process;
mod published;
mod schema_dump;
#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
pub mod tls;
mod wait;
mod work;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

#[cfg(unix)]
pub use harness::{TestDb, cluster, private_cluster, test_db};
pub use published::{
    PublishedEvent, assert_not_published, assert_nothing_published, assert_published,
    assert_published_exactly, published,
};
pub use schema_dump::{claim_statement, schema_sql};
pub use wait::{
    WAIT, WORK_LEFT, count, count_after_fan_out, fan_out, wait_count, wait_for, wait_settled,
    within,
};
pub use work::{WORK_WAIT, Worked, work_one, work_one_with};

/// pgbus's statements, for tests and benchmarks that run or explain them directly
/// (`pgbus_testkit::sql::CLAIM_CALL`). Not part of pgbus's API: no semver promise.
#[doc(hidden)]
pub use pgbus::__private::sql;

/// What can go wrong starting a fixture: a [`tls::TlsServer`] or a
/// [`pgbouncer::PgBouncer`].
#[cfg(all(unix, feature = "fixtures"))]
#[cfg_attr(docsrs, doc(cfg(feature = "fixtures")))]
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FixtureError {
    /// The PostgreSQL server could not be started.
    #[error(transparent)]
    Embedded(#[from] embedded::EmbeddedError),
    /// The TLS certificates could not be made.
    #[error("generating the TLS certificates: {0}")]
    Certificates(#[from] rcgen::Error),
    /// A statement of the fixture's setup failed.
    #[error("{action}: {}", describe(.source))]
    Database {
        /// What was being done.
        action: String,
        /// The error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// Migrating a database of the fixture failed.
    #[error("migrating: {0}")]
    Migrate(#[source] pgbus::Error),
    /// No PostgreSQL server binaries built with SSL were found.
    #[error(
        "the TLS test server needs PostgreSQL server binaries built with SSL, and those \
         found were built without it ({tried}); install Debian's (`apt-get install \
         postgresql`), which are"
    )]
    NoSslServer {
        /// The binaries' directories that were tried.
        tried: String,
    },
    /// No `pgbouncer` program was found.
    #[error(
        "pgbouncer was not found on PATH or at {}; install it (Debian and Ubuntu:          `apt-get install pgbouncer`; .ci/run does)",
        pgbouncer::DEBIAN_PGBOUNCER
    )]
    PgBouncerNotFound,
    /// The server the pooler would front cannot be described to it.
    #[error("PgBouncer cannot front this server: {0}")]
    PgBouncerTarget(String),
    /// PgBouncer ended before it accepted a connection.
    #[error("pgbouncer exited at start ({status}); its log:\n{log}")]
    PgBouncerExited {
        /// How it ended.
        status: std::process::ExitStatus,
        /// The end of its log.
        log: String,
    },
    /// PgBouncer did not let a client run a query within the time allowed.
    #[error("pgbouncer did not answer a query within {waited:?} ({last_error}); its log:\n{log}")]
    PgBouncerNotReady {
        /// How long the fixture waited.
        waited: std::time::Duration,
        /// The last connection's or query's error.
        last_error: String,
        /// The end of its log.
        log: String,
    },
    /// No `nats-server` program was found.
    #[error(
        "nats-server was not found on PATH or at {}; install it (Debian and Ubuntu: \
         `apt-get install nats-server`; .ci/run does)",
        nats::DEBIAN_NATS_SERVER
    )]
    NatsServerNotFound,
    /// nats-server ended before it greeted a client.
    #[error("nats-server exited at start ({status}); its log:\n{log}")]
    NatsServerExited {
        /// How it ended.
        status: std::process::ExitStatus,
        /// The end of its log.
        log: String,
    },
    /// nats-server did not greet a client (with JetStream on) within the time allowed.
    #[error("nats-server was not ready within {waited:?} ({last_error}); its log:\n{log}")]
    NatsServerNotReady {
        /// How long the fixture waited.
        waited: std::time::Duration,
        /// The last connection's error, or what the server sent.
        last_error: String,
        /// The end of its log.
        log: String,
    },
    /// No `chromium` or no `chromedriver` program was found.
    #[error(
        "{program} was not found on PATH or at {fallback}; install Chromium and its driver \
         (Debian: `apt-get install chromium chromium-driver`; .ci/run does)"
    )]
    BrowserNotFound {
        /// The program missing.
        program: &'static str,
        /// Where Debian installs it.
        fallback: &'static str,
    },
    /// chromedriver ended before it was ready.
    #[error("chromedriver exited at start ({status}); its log:\n{log}")]
    ChromedriverExited {
        /// How it ended.
        status: std::process::ExitStatus,
        /// The end of its log.
        log: String,
    },
    /// chromedriver did not report itself ready within the time allowed.
    #[error("chromedriver was not ready within {waited:?} ({last_error}); its log:\n{log}")]
    ChromedriverNotReady {
        /// How long the fixture waited.
        waited: std::time::Duration,
        /// The last request's error, or what it answered.
        last_error: String,
        /// The end of its log.
        log: String,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done.
        action: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The server's message for a database error (tokio-postgres's own says `db error`).
#[cfg(all(unix, feature = "fixtures"))]
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

/// A TCP port of `127.0.0.1` that was free a moment ago (the system's choice for a
/// listener bound to port 0). Another process may take it before the caller binds it: a
/// start that fails so tries another.
#[cfg(all(unix, feature = "fixtures"))]
pub(crate) fn free_port() -> Result<u16, FixtureError> {
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|source| FixtureError::Io {
            action: "finding a free port on 127.0.0.1".into(),
            source,
        })
}

/// Connects with `config` and spawns the connection's task on the current runtime.
///
/// The task ends quietly when the connection does (a dropped database, a restarted
/// server): the client reports that to whoever uses it.
///
/// # Errors
///
/// When the connection fails.
pub async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// A libpq `key=value` connection string for `config` (host, port, user, password,
/// dbname, options, application_name), e.g. to give a child process as `DATABASE_URL`.
/// sqlx reads URLs only: [`url`] gives one.
pub fn conninfo(config: &Config) -> String {
    fn quote(value: &str) -> String {
        format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
    }
    let mut parts = Vec::new();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            Host::Unix(path) => path.to_string_lossy().into_owned(),
        })
        .collect();
    if !hosts.is_empty() {
        parts.push(format!("host={}", quote(&hosts.join(","))));
    }
    let ports: Vec<String> = config.get_ports().iter().map(u16::to_string).collect();
    if !ports.is_empty() {
        parts.push(format!("port={}", ports.join(",")));
    }
    if let Some(user) = config.get_user() {
        parts.push(format!("user={}", quote(user)));
    }
    if let Some(password) = config.get_password() {
        parts.push(format!(
            "password={}",
            quote(&String::from_utf8_lossy(password))
        ));
    }
    if let Some(dbname) = config.get_dbname() {
        parts.push(format!("dbname={}", quote(dbname)));
    }
    if let Some(options) = config.get_options() {
        parts.push(format!("options={}", quote(options)));
    }
    if let Some(name) = config.get_application_name() {
        parts.push(format!("application_name={}", quote(name)));
    }
    parts.join(" ")
}

/// A `postgres://` URL for `config` (hosts, ports, user, password, dbname, options,
/// application_name), which sqlx, tokio-postgres and libpq all read: e.g.
/// `sqlx::PgPool::connect(&url(&config))`.
///
/// One TCP host goes in the authority, `postgres://user:password@host:5432/dbname`;
/// a Unix socket directory, an IPv6 address (sqlx would keep an authority's brackets)
/// or more than one host goes in the query,
/// `postgres:///dbname?host=%2Frun%2Fpostgresql&port=5432&user=postgres`. Every name
/// and value is percent-encoded. sqlx connects to one host only (the last `host`
/// parameter), tokio-postgres and libpq try them in turn.
pub fn url(config: &Config) -> String {
    let hosts = config.get_hosts();
    let ports = config.get_ports();
    let mut url = String::from("postgres://");
    let mut params: Vec<(&str, String)> = Vec::new();
    match hosts {
        [Host::Tcp(host)] if !host.contains(':') => {
            if let Some(user) = config.get_user() {
                url.push_str(&percent_encode(user.as_bytes()));
                if let Some(password) = config.get_password() {
                    url.push(':');
                    url.push_str(&percent_encode(password));
                }
                url.push('@');
            }
            url.push_str(&percent_encode(host.as_bytes()));
            if let Some(port) = ports.first() {
                url.push_str(&format!(":{port}"));
            }
        }
        _ => {
            for host in hosts {
                let host = match host {
                    Host::Tcp(name) => name.clone(),
                    #[cfg(unix)]
                    Host::Unix(path) => path.to_string_lossy().into_owned(),
                };
                params.push(("host", host));
            }
            if !ports.is_empty() {
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                params.push(("port", ports.join(",")));
            }
            if let Some(user) = config.get_user() {
                params.push(("user", user.to_owned()));
            }
            if let Some(password) = config.get_password() {
                params.push(("password", String::from_utf8_lossy(password).into_owned()));
            }
        }
    }
    url.push('/');
    if let Some(dbname) = config.get_dbname() {
        url.push_str(&percent_encode(dbname.as_bytes()));
    }
    if let Some(options) = config.get_options() {
        params.push(("options", options.to_owned()));
    }
    if let Some(name) = config.get_application_name() {
        params.push(("application_name", name.to_owned()));
    }
    for (i, (key, value)) in params.iter().enumerate() {
        url.push(if i == 0 { '?' } else { '&' });
        url.push_str(key);
        url.push('=');
        url.push_str(&percent_encode(value.as_bytes()));
    }
    url
}

/// `bytes` with every byte but the unreserved characters of RFC 3986 (letters, digits,
/// `-._~`) written as `%XX`.
fn percent_encode(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len());
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            text.push(char::from(byte));
        } else {
            text.push_str(&format!("%{byte:02X}"));
        }
    }
    text
}

/// An error's message and its sources', on one line (a TLS failure's reason is in a
/// source).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conninfo_quotes_values() {
        let config: Config = "host=/tmp/x port=5433 user=postgres dbname=a'b"
            .parse()
            .unwrap();
        assert_eq!(
            conninfo(&config),
            "host='/tmp/x' port=5433 user='postgres' dbname='a\\'b'"
        );
        let back: Config = conninfo(&config).parse().unwrap();
        assert_eq!(back.get_dbname(), Some("a'b"));
    }
}
