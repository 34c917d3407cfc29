//! The body of `pgbus::sqlx` (sqlx 0.9) and of `pgbus::sqlx08` (sqlx 0.8): one source,
//! compiled once against each version. `super::driver` is the sqlx crate of the version
//! (and `crate::error`'s `sqlx_error!` makes its `SqlxError`).

use super::driver;
use driver::postgres::{PgArguments, PgConnection};
use driver::query::Query;
use driver::{Acquire, Connection, PgExecutor, Postgres, Row as _, Transaction};
use tracing::Instrument;

use crate::context::Context;
use crate::delivery::Delivery;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::publish::{Published, Publisher, batch_published, batch_span, publish_span, published};
use crate::schema::{Migration, Session, SessionTx};
use crate::sql::{
    ACK_IN, CURRENT_ROLE, PUBLISH_BATCH, PUBLISH_EVENT, RECORD, RECORDED, SERVER, UNSAFE_OBJECTS,
};

/// Binds the 14 parameters of a [`Row`](crate::publish::Row) or a
/// [`Columns`](crate::publish::Columns), in the order of the publish statements.
macro_rules! bind_params {
    ($query:expr, $s:expr) => {
        $query
            .bind(&$s.id)
            .bind(&$s.name)
            .bind(&$s.version)
            .bind(&$s.source)
            .bind(&$s.aggregate_type)
            .bind(&$s.aggregate_id)
            .bind(&$s.correlation_id)
            .bind(&$s.causation_id)
            .bind(&$s.occurred_at)
            .bind(&$s.payload)
            .bind(&$s.headers)
            .bind(&$s.deliver_at)
            .bind(&$s.delay_ms)
            .bind(&$s.ordering_key)
    };
}

/// An unnamed statement (see the module's documentation).
fn statement<'q>(sql: &'static str) -> Query<'q, Postgres, PgArguments> {
    driver::query(sql).persistent(false)
}

/// Publishes one event through a sqlx executor, in its current transaction, if any.
///
/// [`crate::publish`] for sqlx: `executor` is `&mut *tx` (a `sqlx::Transaction`), a
/// `&mut PgConnection` or a `&PgPool` (then the statement is its own transaction).
/// Nothing is visible to consumers before COMMIT, and nothing is left after ROLLBACK.
///
/// # Errors
///
/// - [`Error::Invalid`] for bad input (name, id, headers, `\u0000`, size); nothing is
///   sent, and the transaction is still usable.
/// - [`Error::Conflict`] when the id is in the log with different content. Nothing was
///   written; the transaction is still usable and decides what follows.
/// - [`Error::Sqlx`] when PostgreSQL refuses the statement or the connection fails (a
///   database never migrated says so).
pub async fn publish<'c, E: PgExecutor<'c>>(executor: E, event: &Event) -> Result<Published> {
    publish_with(&Publisher::default(), executor, event).await
}

/// Publishes many events in one statement through a sqlx executor, and returns how many
/// were new: [`crate::publish_batch`] for sqlx.
///
/// Identical repeats of an id (in the batch or in the log) are skipped.
///
/// # Errors
///
/// As [`publish`]; with a [`Error::Conflict`] or [`Error::Invalid`] nothing of the batch
/// is written.
pub async fn publish_batch<'c, E: PgExecutor<'c>>(executor: E, events: &[Event]) -> Result<u64> {
    publish_batch_with(&Publisher::default(), executor, events).await
}

/// [`publish`] with a [`Publisher`]'s limits.
///
/// # Errors
///
/// As [`publish`].
pub async fn publish_with<'c, E: PgExecutor<'c>>(
    publisher: &Publisher,
    executor: E,
    event: &Event,
) -> Result<Published> {
    let span = publish_span(event);
    let row = publisher.row(event, &span)?;
    let query = bind_params!(statement(PUBLISH_EVENT), row);
    let (inserted, conflict) = send(query, executor, span).await?;
    published(inserted, conflict)
}

/// [`publish_batch`] with a [`Publisher`]'s limits.
///
/// # Errors
///
/// As [`publish_batch`].
pub async fn publish_batch_with<'c, E: PgExecutor<'c>>(
    publisher: &Publisher,
    executor: E,
    events: &[Event],
) -> Result<u64> {
    let span = batch_span(events);
    let Some(columns) = publisher.columns(events, &span)? else {
        return Ok(0);
    };
    let query = bind_params!(statement(PUBLISH_BATCH), columns);
    let (inserted, conflict) = send(query, executor, span).await?;
    batch_published(inserted, conflict)
}

/// Sends a publish statement and reads its row: how many events were inserted, and the
/// first id whose content conflicted.
async fn send<'c, E: PgExecutor<'c>>(
    query: Query<'_, Postgres, PgArguments>,
    executor: E,
    span: tracing::Span,
) -> Result<(i64, Option<String>)> {
    let row = query.fetch_one(executor).instrument(span).await?;
    Ok((row.try_get("inserted")?, row.try_get("conflict")?))
}

/// Completes a handler's delivery inside the handler's own sqlx transaction:
/// [`Context::ack_in`] for sqlx. `tx` is `&mut tx` for a `sqlx::Transaction` (its
/// connection); its writes and the completion commit together, or neither does. The bus
/// then does not acknowledge the delivery again when the handler returns `Ok`.
///
/// The same statement and the same semantics as [`Context::ack_in`], sent unnamed: fenced
/// by the lease, for an ordered subscription it hands the key on once `tx` commits, and
/// `tx` must be `READ COMMITTED` (PostgreSQL's default). If `tx` rolls back after this,
/// return an error from the handler (returning a failed `commit`'s error with `?` does):
/// the bus retries the delivery after its backoff.
///
/// ```no_run
/// # #[cfg(not(feature = "sqlx"))] extern crate sqlx08 as sqlx; // sqlx 0.8 alone: its name
/// use pgbus::{Context, Event, HandlerError};
///
/// async fn project(pool: sqlx::PgPool, event: Event, cx: Context) -> Result<(), HandlerError> {
///     let mut tx = pool.begin().await?;
///     sqlx::query("INSERT INTO order_totals (order_id, total) VALUES ($1, $2)")
///         .bind(event.payload["order_id"].as_i64())
///         .bind(event.payload["total"].as_i64())
///         .execute(&mut *tx)
///         .await?;
///     pgbus::sqlx::ack_in(&mut tx, &cx).await?; // a lost lease fails here
///     tx.commit().await?;
///     Ok(())
/// }
/// # let _ = project;
/// ```
///
/// # Errors
///
/// [`Error::LeaseLost`] when the lease was lost (the delivery was reaped and perhaps
/// claimed again elsewhere): the statement's error has aborted `tx`, so its writes cannot
/// commit. [`Error::Sqlx`] otherwise (also aborting `tx`, when PostgreSQL refused the
/// statement).
pub async fn ack_in(tx: &mut PgConnection, cx: &Context) -> Result<()> {
    let (subscription, seq, attempt, worker) = cx.ack_in_args();
    let ran = run_ack_in(tx, subscription, seq, attempt, worker).await;
    cx.acked_in_by(ran)
}

/// Completes a stream's [`Delivery`] inside the application's own sqlx transaction:
/// [`Delivery::ack_in`] for sqlx, with its semantics. `tx` is `&mut tx` for a
/// `sqlx::Transaction`.
///
/// Once this returns `Ok`, the delivery no longer counts against the bus's capacity and
/// its lease is no longer extended. If `tx` then commits, the delivery is complete; if it
/// rolls back, the delivery stays leased until its lease runs out and is then delivered
/// again.
///
/// ```no_run
/// # #[cfg(not(feature = "sqlx"))] extern crate sqlx08 as sqlx; // sqlx 0.8 alone: its name
/// # async fn f(pool: sqlx::PgPool, d: pgbus::Delivery) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO audit (event_id) VALUES ($1)")
///     .bind(&d.event().id)
///     .execute(&mut *tx)
///     .await?;
/// pgbus::sqlx::ack_delivery_in(&mut tx, d).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::LeaseLost`] when the lease had been lost: nothing changed, and `tx` is
/// aborted. Another error ([`Error::Sqlx`]) fails the attempt as
/// [`Delivery::fail`] would, and the delivery is retried after its backoff.
pub async fn ack_delivery_in(tx: &mut PgConnection, delivery: Delivery) -> Result<()> {
    let (subscription, seq, attempt, worker) = delivery.ack_in_args();
    let ran = run_ack_in(tx, subscription, seq, attempt, worker).await;
    delivery.acked_in_by(ran)
}

/// Sends the `pgbus.ack_in` statement ([`ACK_IN`]) in `tx`.
async fn run_ack_in(
    tx: &mut PgConnection,
    subscription: &str,
    seq: i64,
    attempt: i32,
    worker: &str,
) -> Result<()> {
    statement(ACK_IN)
        .bind(subscription)
        .bind(seq)
        .bind(attempt)
        .bind(worker)
        .execute(tx)
        .await
        .map_err(Error::from)?;
    Ok(())
}

/// Applies the migrations this database lacks and returns those it applied (empty when
/// the schema was already current): [`crate::migrate`] through sqlx.
///
/// `conn` is anything sqlx can take a connection from: a `&PgPool` (one connection is
/// held for the whole run) or a `&mut PgConnection`. The same migrations, each in its
/// own transaction under the same lock, after the same refusal of a schema holding
/// another role's objects ([`Error::UnsafeSchema`]), recorded with the same checksums, so
/// either function finds the other's work done; safe to run concurrently from several
/// connections and processes. It logs what it applied, as [`crate::migrate`] does, and
/// not the server's notices, which sqlx would log at INFO.
///
/// ```no_run
/// # #[cfg(not(feature = "sqlx"))] extern crate sqlx08 as sqlx; // sqlx 0.8 alone: its name
/// # async fn example(pool: sqlx::PgPool) -> Result<(), pgbus::Error> {
/// let applied = pgbus::sqlx::migrate(&pool).await?;
/// println!("{} migrations applied", applied.len());
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::UnsupportedServer`] for a server older than
/// [`MIN_SERVER_VERSION`](crate::schema::MIN_SERVER_VERSION) and [`Error::Invalid`] for
/// a database whose encoding is `SQL_ASCII` (nothing is written in either case),
/// [`Error::UnsafeSchema`] for a schema holding objects of
/// another role (nothing is written), [`Error::Sqlx`] when a statement fails (the failing migration is rolled back), and
/// [`Error::MigrationDrift`] when a migration recorded as applied has different content
/// from the one this binary carries.
pub async fn migrate<'a, A: Acquire<'a, Database = Postgres>>(conn: A) -> Result<Vec<Migration>> {
    let mut conn = conn.acquire().await?;
    crate::schema::run(&mut SqlxSession(&mut conn)).await
}

/// A sqlx connection as a migration [`Session`]: its transactions are sqlx's (rolled back
/// if dropped), its statements unnamed.
struct SqlxSession<'c>(&'c mut PgConnection);

impl Session for SqlxSession<'_> {
    type Tx<'t>
        = Transaction<'t, Postgres>
    where
        Self: 't;

    async fn server(&mut self) -> Result<(i32, String)> {
        let row = statement(SERVER).fetch_one(&mut *self.0).await?;
        Ok((row.try_get("version")?, row.try_get("encoding")?))
    }

    async fn begin(&mut self) -> Result<Transaction<'_, Postgres>> {
        Ok(Connection::begin(&mut *self.0).await?)
    }
}

impl SessionTx for Transaction<'_, Postgres> {
    async fn batch(&mut self, sql: &'static str) -> Result<()> {
        // Through the executor (a boxed future): sqlx 0.8's `RawSql::execute` is an
        // `async fn` whose future the compiler cannot prove `Send` here.
        driver::Executor::execute(&mut **self, driver::raw_sql(sql)).await?;
        Ok(())
    }

    async fn unsafe_objects(&mut self) -> Result<Vec<String>> {
        let rows = statement(UNSAFE_OBJECTS).fetch_all(&mut **self).await?;
        Ok(rows
            .iter()
            .map(|row| row.try_get("problem"))
            .collect::<std::result::Result<_, _>>()?)
    }

    async fn current_role(&mut self) -> Result<String> {
        let row = statement(CURRENT_ROLE).fetch_one(&mut **self).await?;
        Ok(row.try_get("role")?)
    }

    async fn recorded(&mut self, migration: &Migration) -> Result<Option<bool>> {
        let row = statement(RECORDED)
            .bind(migration.version)
            .bind(migration.sql)
            .fetch_optional(&mut **self)
            .await?;
        Ok(row.map(|row| row.try_get("same")).transpose()?)
    }

    async fn record(&mut self, migration: &Migration) -> Result<()> {
        statement(RECORD)
            .bind(migration.version)
            .bind(migration.name)
            .bind(migration.sql)
            .execute(&mut **self)
            .await?;
        Ok(())
    }

    async fn commit(self) -> Result<()> {
        Ok(Transaction::commit(self).await?)
    }

    async fn rollback(self) -> Result<()> {
        Ok(Transaction::rollback(self).await?)
    }
}
