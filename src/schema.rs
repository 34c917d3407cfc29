//! The embedded migrations and [`migrate`].
//!
//! Migrations are the numbered files in `sql/`, compiled into the binary. Each is applied
//! in its own transaction under a transaction-scoped advisory lock and recorded, with a
//! checksum, in `pgbus.schema_migrations`; running `migrate` twice, or from two processes
//! at once, applies each migration exactly once.

use crate::error::{Error, Result};

/// One numbered migration from `sql/`.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Migration {
    /// The migration's number: migrations apply in ascending order.
    pub version: i32,
    /// A short name, from the file name.
    pub name: &'static str,
    /// The SQL it runs.
    pub sql: &'static str,
}

/// Every migration this version of pgbus carries, in order.
pub static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "init",
        sql: include_str!("../sql/0001_init.sql"),
    },
    Migration {
        version: 2,
        name: "fan_out_without_jit",
        sql: include_str!("../sql/0002_fan_out_without_jit.sql"),
    },
    Migration {
        version: 3,
        name: "roles",
        sql: include_str!("../sql/0003_roles.sql"),
    },
    Migration {
        version: 4,
        name: "ordered",
        sql: include_str!("../sql/0004_ordered.sql"),
    },
    Migration {
        version: 5,
        name: "least_privilege",
        sql: include_str!("../sql/0005_least_privilege.sql"),
    },
    Migration {
        version: 6,
        name: "scale",
        sql: include_str!("../sql/0006_scale.sql"),
    },
    Migration {
        version: 7,
        name: "visible_text",
        sql: include_str!("../sql/0007_visible_text.sql"),
    },
    Migration {
        version: 8,
        name: "ordered_replay",
        sql: include_str!("../sql/0008_ordered_replay.sql"),
    },
    Migration {
        version: 9,
        name: "ack_in",
        sql: include_str!("../sql/0009_ack_in.sql"),
    },
];

/// The oldest PostgreSQL pgbus supports, as a `server_version_num` (13.0): [`migrate`]
/// refuses an older server. The schema relies on `gen_random_uuid()` in core and on
/// `autovacuum_vacuum_insert_scale_factor`, both new in PostgreSQL 13.
pub const MIN_SERVER_VERSION: i32 = 130_000;

/// Checks a server's `server_version_num` (`SHOW server_version_num`, e.g. `150014` for
/// 15.14) against [`MIN_SERVER_VERSION`].
///
/// # Errors
///
/// [`Error::UnsupportedServer`] for an older server.
///
/// ```
/// use pgbus::schema::check_server_version;
///
/// assert!(check_server_version(180_006).is_ok());
/// assert!(check_server_version(120_022).is_err());
/// ```
pub fn check_server_version(server_version_num: i32) -> Result<()> {
    if server_version_num < MIN_SERVER_VERSION {
        return Err(Error::UnsupportedServer {
            version: server_version_num,
            minimum: MIN_SERVER_VERSION,
        });
    }
    Ok(())
}

/// The advisory lock key that serializes migrations (`hashtext('pgbus.migrate')`-like,
/// fixed so that every version of pgbus uses the same one).
const MIGRATE_LOCK_KEY: i64 = 0x7067_6275_735f_6d67; // "pgbus_mg"

const BOOTSTRAP: &str = "\
CREATE SCHEMA IF NOT EXISTS pgbus;
CREATE TABLE IF NOT EXISTS pgbus.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);";

/// Applies the migrations this database lacks and returns those it applied (empty when
/// the schema was already current).
///
/// Safe to run concurrently from several processes: each migration runs in its own
/// transaction under an advisory lock, and a migration already recorded is skipped.
///
/// # Errors
///
/// [`Error::UnsupportedServer`] for a server older than [`MIN_SERVER_VERSION`] and
/// [`Error::Invalid`] for a database whose encoding is `SQL_ASCII` (nothing is written in
/// either case),
/// [`Error::Database`] when a statement fails (the failing migration is rolled back), and
/// [`Error::MigrationDrift`] when a migration recorded as applied has different content
/// from the one this binary carries.
pub async fn migrate(client: &tokio_postgres::Client) -> Result<Vec<Migration>> {
    // Before anything is written: an older server would fail halfway through the
    // migrations, with an error that does not say why.
    let version: i32 = client
        .query_one(
            "SELECT current_setting('server_version_num')::int AS version",
            &[],
        )
        .await?
        .try_get("version")?;
    check_server_version(version)?;
    // SQL_ASCII stores text bytes unchecked: a row that is not valid UTF-8 could never
    // be sent to pgbus, and every claim of its subscription would fail.
    let encoding: String = client
        .query_one("SELECT pg_encoding_to_char(encoding) AS encoding FROM pg_database WHERE datname = current_database()", &[])
        .await?
        .try_get("encoding")?;
    if encoding == "SQL_ASCII" {
        return Err(Error::Invalid {
            what: "database encoding",
            reason: "pgbus needs a database with a real encoding (UTF8, or any other than \
                     SQL_ASCII): SQL_ASCII keeps text bytes unchecked"
                .into(),
        });
    }
    let mut applied = Vec::new();
    for migration in MIGRATIONS {
        client.batch_execute("BEGIN").await?;
        match apply_one(client, migration).await {
            Ok(did_apply) => {
                client.batch_execute("COMMIT").await?;
                if did_apply {
                    tracing::info!(
                        version = migration.version,
                        name = migration.name,
                        "applied migration"
                    );
                    applied.push(*migration);
                }
            }
            Err(e) => {
                // The connection may be gone; the original error is the one that matters.
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(e);
            }
        }
    }
    Ok(applied)
}

async fn apply_one(client: &tokio_postgres::Client, migration: &Migration) -> Result<bool> {
    client
        .execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_LOCK_KEY])
        .await?;
    client.batch_execute(BOOTSTRAP).await?;
    let recorded = client
        .query_opt(
            "SELECT checksum = md5($2::text) AS same FROM pgbus.schema_migrations WHERE version = $1",
            &[&migration.version, &migration.sql],
        )
        .await?;
    match recorded {
        Some(row) if row.try_get::<_, bool>("same")? => Ok(false),
        Some(_) => Err(Error::MigrationDrift {
            version: migration.version,
        }),
        None => {
            client.batch_execute(migration.sql).await?;
            client
                .execute(
                    "INSERT INTO pgbus.schema_migrations (version, name, checksum) \
                     VALUES ($1, $2, md5($3::text))",
                    &[&migration.version, &migration.name, &migration.sql],
                )
                .await?;
            Ok(true)
        }
    }
}

/// The newest migration applied to this database, or `None` when pgbus was never
/// migrated here.
///
/// # Errors
///
/// [`Error::Database`] when the query fails.
pub async fn schema_version(client: &tokio_postgres::Client) -> Result<Option<i32>> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('pgbus.schema_migrations') IS NOT NULL AS migrated",
            &[],
        )
        .await?
        .try_get("migrated")?;
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_one(
            "SELECT max(version) AS version FROM pgbus.schema_migrations",
            &[],
        )
        .await?;
    Ok(row.try_get("version")?)
}

/// The newest migration this binary carries.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}
