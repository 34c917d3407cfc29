//! The embedded migrations and [`migrate`].
//!
//! Migrations are the numbered files in `sql/`, compiled into the binary. Each is applied
//! in its own transaction under a transaction-scoped advisory lock and recorded, with a
//! checksum, in `pgbus.schema_migrations`; running `migrate` twice, or from two processes
//! at once, applies each migration exactly once.
//!
//! The steps are `run`'s, over a `Session`: [`migrate`] runs them on a tokio-postgres
//! client, `pgbus::sqlx::migrate` (the `sqlx` feature) on a sqlx connection.

use std::future::Future;

use tokio_postgres::types::Type;

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
    Migration {
        version: 10,
        name: "backlog",
        sql: include_str!("../sql/0010_backlog.sql"),
    },
    Migration {
        version: 11,
        name: "publish_path",
        sql: include_str!("../sql/0011_publish_path.sql"),
    },
    Migration {
        version: 13,
        name: "owned_locks",
        sql: include_str!("../sql/0013_owned_locks.sql"),
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
pub(crate) const MIGRATE_LOCK_KEY: i64 = 0x7067_6275_735f_6d67; // "pgbus_mg"

/// What `migrate` asks of the server before it writes anything: `version`, its
/// `server_version_num`, and `encoding`, the database's. Sent outside a transaction.
pub(crate) const SERVER: &str = "SELECT current_setting('server_version_num')::int AS version, \
     (SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()) \
     AS encoding";

/// Takes the migration lock for the transaction. `$1 int8`: [`MIGRATE_LOCK_KEY`].
pub(crate) const LOCK: &str = "SELECT pg_advisory_xact_lock($1)";

/// Makes sure that the table that records migrations exists (simple query protocol).
pub(crate) const BOOTSTRAP: &str = "\
CREATE SCHEMA IF NOT EXISTS pgbus;
CREATE TABLE IF NOT EXISTS pgbus.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);";

/// Whether a migration is recorded, and with the same content: no row, or `same`.
/// `$1 int4` version, `$2 text` its SQL.
pub(crate) const RECORDED: &str = "SELECT checksum = md5($2::text) AS same \
     FROM pgbus.schema_migrations WHERE version = $1";

/// Records an applied migration. `$1 int4` version, `$2 text` name, `$3 text` its SQL.
pub(crate) const RECORD: &str = "INSERT INTO pgbus.schema_migrations (version, name, checksum) \
     VALUES ($1, $2, md5($3::text))";

/// A connection that `migrate` runs on: the tokio-postgres and the sqlx paths differ only
/// here, in how each statement is sent. Every statement sent outside the migrations'
/// transactions is an unnamed one, so that it works behind a transaction-mode pooler.
pub(crate) trait Session: Send {
    /// A transaction on this connection.
    type Tx<'t>: SessionTx
    where
        Self: 't;

    /// [`SERVER`]'s row: the server's version and the database's encoding.
    fn server(&mut self) -> impl Future<Output = Result<(i32, String)>> + Send;

    /// Begins a transaction.
    fn begin(&mut self) -> impl Future<Output = Result<Self::Tx<'_>>> + Send;
}

/// A transaction of a [`Session`], in which one migration is applied.
pub(crate) trait SessionTx: Send {
    /// Runs [`LOCK`] with [`MIGRATE_LOCK_KEY`].
    fn lock(&mut self) -> impl Future<Output = Result<()>> + Send;

    /// Runs statements without parameters with the simple query protocol.
    fn batch(&mut self, sql: &'static str) -> impl Future<Output = Result<()>> + Send;

    /// Runs [`RECORDED`] for `migration`: `None` when it is not recorded.
    fn recorded(
        &mut self,
        migration: &Migration,
    ) -> impl Future<Output = Result<Option<bool>>> + Send;

    /// Runs [`RECORD`] for `migration`.
    fn record(&mut self, migration: &Migration) -> impl Future<Output = Result<()>> + Send;

    /// Commits.
    fn commit(self) -> impl Future<Output = Result<()>> + Send;

    /// Rolls back.
    fn rollback(self) -> impl Future<Output = Result<()>> + Send;
}

/// Applies the migrations this database lacks and returns those it applied (empty when
/// the schema was already current).
///
/// Safe to run concurrently from several processes: each migration runs in its own
/// transaction under an advisory lock, and a migration already recorded is skipped.
///
/// Behind a transaction-mode pooler (PgBouncer), each statement outside the migrations'
/// transactions is an unnamed one: nothing relies on a server connection beyond a
/// transaction.
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
    run(&mut TokioSession(client)).await
}

/// The migrations, on any [`Session`]: what `migrate` does, whichever driver sends it.
pub(crate) async fn run<S: Session>(session: &mut S) -> Result<Vec<Migration>> {
    // Before anything is written: an older server would fail halfway through the
    // migrations, with an error that does not say why.
    let (version, encoding) = session.server().await?;
    check_server_version(version)?;
    // SQL_ASCII stores text bytes unchecked: a row that is not valid UTF-8 could never
    // be sent to pgbus, and every claim of its subscription would fail.
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
        let mut tx = session.begin().await?;
        match apply_one(&mut tx, migration).await {
            Ok(did_apply) => {
                tx.commit().await?;
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
                let _ = tx.rollback().await;
                return Err(e);
            }
        }
    }
    Ok(applied)
}

async fn apply_one<T: SessionTx>(tx: &mut T, migration: &Migration) -> Result<bool> {
    tx.lock().await?;
    tx.batch(BOOTSTRAP).await?;
    match tx.recorded(migration).await? {
        Some(true) => Ok(false),
        Some(false) => Err(Error::MigrationDrift {
            version: migration.version,
        }),
        None => {
            tx.batch(migration.sql).await?;
            tx.record(migration).await?;
            Ok(true)
        }
    }
}

/// A tokio-postgres client as a [`Session`]: its transactions are explicit `BEGIN` and
/// `COMMIT` (the client is shared, not borrowed mutably), its statements unnamed
/// (`query_typed`).
struct TokioSession<'c>(&'c tokio_postgres::Client);

impl Session for TokioSession<'_> {
    type Tx<'t>
        = TokioTx<'t>
    where
        Self: 't;

    async fn server(&mut self) -> Result<(i32, String)> {
        let row = self.0.query_typed_one(SERVER, &[]).await?;
        Ok((row.try_get("version")?, row.try_get("encoding")?))
    }

    async fn begin(&mut self) -> Result<TokioTx<'_>> {
        self.0.batch_execute("BEGIN").await?;
        Ok(TokioTx(self.0))
    }
}

struct TokioTx<'c>(&'c tokio_postgres::Client);

impl SessionTx for TokioTx<'_> {
    async fn lock(&mut self) -> Result<()> {
        self.0
            .execute_typed(LOCK, &[(&MIGRATE_LOCK_KEY, Type::INT8)])
            .await?;
        Ok(())
    }

    async fn batch(&mut self, sql: &'static str) -> Result<()> {
        Ok(self.0.batch_execute(sql).await?)
    }

    async fn recorded(&mut self, migration: &Migration) -> Result<Option<bool>> {
        let row = self
            .0
            .query_typed_opt(
                RECORDED,
                &[
                    (&migration.version, Type::INT4),
                    (&migration.sql, Type::TEXT),
                ],
            )
            .await?;
        Ok(row.map(|row| row.try_get("same")).transpose()?)
    }

    async fn record(&mut self, migration: &Migration) -> Result<()> {
        self.0
            .execute_typed(
                RECORD,
                &[
                    (&migration.version, Type::INT4),
                    (&migration.name, Type::TEXT),
                    (&migration.sql, Type::TEXT),
                ],
            )
            .await?;
        Ok(())
    }

    async fn commit(self) -> Result<()> {
        Ok(self.0.batch_execute("COMMIT").await?)
    }

    async fn rollback(self) -> Result<()> {
        Ok(self.0.batch_execute("ROLLBACK").await?)
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
        .query_typed_one(
            "SELECT to_regclass('pgbus.schema_migrations') IS NOT NULL AS migrated",
            &[],
        )
        .await?
        .try_get("migrated")?;
    if !exists {
        return Ok(None);
    }
    let row = client
        .query_typed_one(
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
