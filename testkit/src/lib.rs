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
//!   for tests.
//! - [`wait_for`], [`within`], [`count`], [`wait_count`], [`wait_settled`]: waiting, with a
//!   deadline, for what happens in the background.
//! - [`embedded`]: the throwaway PostgreSQL server itself.
//! - [`bench`](mod@bench): databases and data for benchmarks (pgbus's criterion benches and `pgbus
//!   bench`).
//!
//! # Platforms
//!
//! The servers and databases ([`embedded`], [`bench`](mod@bench), [`test_db`] and its friends) are
//! Unix-only (Linux, macOS, the BSDs): the server listens on a Unix socket only, and runs
//! as the `postgres` user when the tests run as root. The waiting helpers and
//! [`connect`]/[`conninfo`] work everywhere.

#[cfg(unix)]
pub mod bench;
#[cfg(unix)]
pub mod embedded;
#[cfg(unix)]
mod harness;
mod wait;

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

#[cfg(unix)]
pub use harness::{TestDb, cluster, private_cluster, test_db};
pub use wait::{WAIT, count, wait_count, wait_for, wait_settled, within};

/// pgbus's statements, for tests and benchmarks that run or explain them directly
/// (`pgbus_testkit::sql::CLAIM`). Not part of pgbus's API: no semver promise.
#[doc(hidden)]
pub use pgbus::__private::sql;

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
