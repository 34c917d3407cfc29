//! The embedded migrations and [`migrate`].
//!
//! Migrations are the numbered files in `sql/`, compiled into the binary. Each is applied
//! in its own transaction, under a lock on `pgbus.schema_migrations` that only the
//! schema's owner can take, and recorded there with a checksum; running `migrate` twice,
//! or from two processes at once, applies each migration exactly once. `migrate` refuses
//! a schema that holds objects of another role ([`Error::UnsafeSchema`]).
//!
//! The steps are `run`'s, over a `Session`: [`migrate`] runs them on a tokio-postgres
//! client, `pgbus::sqlx::migrate` (the `sqlx` feature) on a sqlx connection.

use std::future::Future;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use crate::error::{Error, Result};
use crate::sql::{
    BOOTSTRAP, CURRENT_ROLE, LOCK, MIGRATED, PIN, RECORD, RECORDED, SCHEMA_VERSION, SERVER,
    UNSAFE_OBJECTS,
};

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
        version: 12,
        name: "pinned_paths",
        sql: include_str!("../sql/0012_pinned_paths.sql"),
    },
    Migration {
        version: 13,
        name: "owned_locks",
        sql: include_str!("../sql/0013_owned_locks.sql"),
    },
    Migration {
        version: 14,
        name: "input_bounds",
        sql: include_str!("../sql/0014_input_bounds.sql"),
    },
    Migration {
        version: 15,
        name: "model_fixes",
        sql: include_str!("../sql/0015_model_fixes.sql"),
    },
    Migration {
        version: 16,
        name: "size_limit_fast_path",
        sql: include_str!("../sql/0016_size_limit_fast_path.sql"),
    },
    Migration {
        version: 17,
        name: "operator_role",
        sql: include_str!("../sql/0017_operator_role.sql"),
    },
    Migration {
        version: 18,
        name: "log_first",
        sql: include_str!("../sql/0018_log_first.sql"),
    },
    Migration {
        version: 19,
        name: "bounded_status",
        sql: include_str!("../sql/0019_bounded_status.sql"),
    },
    Migration {
        version: 20,
        name: "ordered_creation_gate",
        sql: include_str!("../sql/0020_ordered_creation_gate.sql"),
    },
    Migration {
        version: 21,
        name: "append_only_boundary",
        sql: include_str!("../sql/0021_append_only_boundary.sql"),
    },
    Migration {
        version: 22,
        name: "order_trigger_on_demand",
        sql: include_str!("../sql/0022_order_trigger_on_demand.sql"),
    },
    Migration {
        version: 23,
        name: "elected_maintenance",
        sql: include_str!("../sql/0023_elected_maintenance.sql"),
    },
    Migration {
        version: 24,
        name: "claim_floor",
        sql: include_str!("../sql/0024_claim_floor.sql"),
    },
    Migration {
        version: 25,
        name: "consumer_beat_at",
        sql: include_str!("../sql/0025_consumer_beat_at.sql"),
    },
    Migration {
        version: 26,
        name: "settle_by_key",
        sql: include_str!("../sql/0026_settle_by_key.sql"),
    },
    Migration {
        version: 27,
        name: "one_due_index",
        sql: include_str!("../sql/0027_one_due_index.sql"),
    },
    Migration {
        version: 28,
        name: "pause",
        sql: include_str!("../sql/0028_pause.sql"),
    },
    Migration {
        version: 29,
        name: "seen_heads",
        sql: include_str!("../sql/0029_seen_heads.sql"),
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

/// The search_path every function of pgbus runs with (or is immune to; see migration
/// 12), and that `migrate`'s and the bus's own transactions run with: nothing a caller
/// or another role put on its path is ever found, pg_temp last.
pub(crate) const PINNED_SEARCH_PATH: &str = "pg_catalog, pgbus, pg_temp";

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
    /// Runs statements without parameters with the simple query protocol.
    fn batch(&mut self, sql: &'static str) -> impl Future<Output = Result<()>> + Send;

    /// Runs [`UNSAFE_OBJECTS`]: what in the schema the migrating role must not adopt.
    fn unsafe_objects(&mut self) -> impl Future<Output = Result<Vec<String>>> + Send;

    /// Runs [`CURRENT_ROLE`].
    fn current_role(&mut self) -> impl Future<Output = Result<String>> + Send;

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

/// How many times the bootstrap starts again after losing a race to create the schema
/// or its table to another `migrate` (each loss means the other one created it).
const BOOTSTRAP_ATTEMPTS: usize = 5;

/// Applies the migrations this database lacks and returns those it applied (empty when
/// the schema was already current).
///
/// Safe to run concurrently from several processes: each migration runs in its own
/// transaction under a lock on `pgbus.schema_migrations` that only the schema's owner
/// can take, and a migration already recorded is skipped.
///
/// `migrate` never adopts what another role made. Before it writes anything, and again
/// in each migration's transaction once it holds the lock, it checks the `pgbus` schema:
/// the schema and every object in it must be owned by the migrating role, a role it is
/// granted, or a superuser; no trigger on its tables may run a function of another
/// owner; no other role may have CREATE on it. Otherwise it refuses with
/// [`Error::UnsafeSchema`], which names each object: code in an object planted there
/// would run with the migrating role's rights. The schema and its bookkeeping table are
/// created only where they do not exist. Every migration runs with the search_path
/// `pg_catalog, pgbus, pg_temp`.
///
/// Behind a transaction-mode pooler (PgBouncer), each statement outside the migrations'
/// transactions is an unnamed one: nothing relies on a server connection beyond a
/// transaction.
///
/// It logs one INFO line (`applied migration`, with its version and name) per migration
/// it applies, and one DEBUG line (`pgbus schema is up to date`) when there was none to
/// apply. The server's notices (`... already exists, skipping`) are not sent during the
/// migrations' transactions, so the client's driver does not log them.
///
/// # Errors
///
/// [`Error::UnsupportedServer`] for a server older than [`MIN_SERVER_VERSION`] and
/// [`Error::Invalid`] for a database whose encoding is `SQL_ASCII` (nothing is written in
/// either case), [`Error::UnsafeSchema`] for a schema holding objects of another role
/// (nothing is written),
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
    bootstrap(session).await?;
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
    if applied.is_empty() {
        tracing::debug!(
            version = MIGRATIONS.last().map_or(0, |m| m.version),
            "pgbus schema is up to date"
        );
    }
    Ok(applied)
}

/// Checks the schema, creates what is missing of it and its bookkeeping table, takes the
/// lock and checks again, in one transaction; starts again when another `migrate`
/// created the schema or the table first.
async fn bootstrap<S: Session>(session: &mut S) -> Result<()> {
    let mut attempt = 1;
    loop {
        let mut tx = session.begin().await?;
        let result = async {
            tx.batch(PIN).await?;
            refuse_foreign_objects(&mut tx).await?;
            tx.batch(BOOTSTRAP).await?;
            tx.batch(LOCK).await?;
            refuse_foreign_objects(&mut tx).await
        }
        .await;
        match result {
            Ok(()) => return tx.commit().await,
            Err(e) => {
                let _ = tx.rollback().await;
                let lost_race = e.code().is_some_and(|c| {
                    [
                        SqlState::DUPLICATE_SCHEMA,
                        SqlState::DUPLICATE_TABLE,
                        SqlState::UNIQUE_VIOLATION,
                    ]
                    .contains(c)
                });
                if !lost_race || attempt >= BOOTSTRAP_ATTEMPTS {
                    return Err(e);
                }
                attempt += 1;
            }
        }
    }
}

/// [`Error::UnsafeSchema`] when the schema holds anything [`UNSAFE_OBJECTS`] reports.
async fn refuse_foreign_objects<T: SessionTx>(tx: &mut T) -> Result<()> {
    let problems = tx.unsafe_objects().await?;
    if problems.is_empty() {
        return Ok(());
    }
    Err(Error::UnsafeSchema {
        role: tx.current_role().await?,
        problems,
    })
}

async fn apply_one<T: SessionTx>(tx: &mut T, migration: &Migration) -> Result<bool> {
    tx.batch(PIN).await?;
    tx.batch(LOCK).await?;
    refuse_foreign_objects(tx).await?;
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
    async fn batch(&mut self, sql: &'static str) -> Result<()> {
        Ok(self.0.batch_execute(sql).await?)
    }

    async fn unsafe_objects(&mut self) -> Result<Vec<String>> {
        let rows = self.0.query_typed(UNSAFE_OBJECTS, &[]).await?;
        Ok(rows
            .iter()
            .map(|row| row.try_get("problem"))
            .collect::<std::result::Result<_, _>>()?)
    }

    async fn current_role(&mut self) -> Result<String> {
        let row = self.0.query_typed_one(CURRENT_ROLE, &[]).await?;
        Ok(row.try_get("role")?)
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
        .query_typed_one(MIGRATED, &[])
        .await?
        .try_get("migrated")?;
    if !exists {
        return Ok(None);
    }
    let row = client.query_typed_one(SCHEMA_VERSION, &[]).await?;
    Ok(row.try_get("version")?)
}

/// The newest migration this binary carries.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.version)
}
