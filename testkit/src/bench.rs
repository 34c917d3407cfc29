//! Databases and data for benchmarks: pgbus's criterion benches (`benches/`) and the
//! workloads of `pgbus bench`.
//!
//! A [`Server`] is `DATABASE_URL`'s server or a throwaway cluster with PostgreSQL's
//! durable defaults (fsync on, synchronous_commit on); each run of a workload takes a
//! database of its own from it ([`Server::fresh_database`]: `CREATE DATABASE` +
//! [`pgbus::migrate`]) and drops it after ([`BenchDb::drop_database`]), so runs never
//! see each other's rows.
//!
//! ```no_run
//! # async fn example() -> pgbus::Result<()> {
//! use pgbus_testkit::bench::{Server, seed_backlog};
//!
//! let server = Server::start(std::env::var("DATABASE_URL").ok().as_deref()).await?;
//! let db = server.fresh_database("drain").await?;
//! seed_backlog(&db.connect().await?, &["billing".into()], "order.placed", 10_000).await?;
//! // ... measure a bus draining it ...
//! db.drop_database().await?;
//! server.stop().await;
//! # Ok(())
//! # }
//! ```

use serde_json::{Value, json};
use tokio_postgres::Client;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::ToSql;

use pgbus::{ConnectConfig, Error, Event, Result};

use crate::embedded::{EmbeddedOptions, EmbeddedPostgres, ShutdownMode};
use crate::sql::PUBLISH_TYPES;

/// The PostgreSQL server the benchmarks run on: `DATABASE_URL`'s, or a throwaway durable
/// cluster of their own.
#[derive(Debug)]
pub struct Server {
    admin: ConnectConfig,
    embedded: Option<EmbeddedPostgres>,
}

/// An [`Error::Invalid`] about `what`.
fn invalid(what: &'static str, reason: impl ToString) -> Error {
    Error::Invalid {
        what,
        reason: reason.to_string(),
    }
}

/// Connects over `config`'s TLS settings.
async fn connect(config: &ConnectConfig) -> Result<Client> {
    config.connect().await
}

impl Server {
    /// Connects to `database_url`, or starts a throwaway cluster with PostgreSQL's
    /// durable defaults when it is `None` or blank (it is removed when this value is
    /// dropped).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a malformed URL or when the cluster cannot be started;
    /// [`Error::Database`] when the server cannot be reached.
    pub async fn start(database_url: Option<&str>) -> Result<Server> {
        let server = match database_url.filter(|u| !u.trim().is_empty()) {
            Some(url) => Server {
                admin: ConnectConfig::parse(url).map_err(|e| invalid("database url", e))?,
                embedded: None,
            },
            None => {
                let pg = EmbeddedPostgres::start(EmbeddedOptions::default().durable(true))
                    .await
                    .map_err(|e| invalid("embedded server", e))?;
                Server {
                    admin: pg.config("postgres").into(),
                    embedded: Some(pg),
                }
            }
        };
        connect(&server.admin).await?;
        Ok(server)
    }

    /// Creates a new, migrated database for one run of a workload; `label` goes into its
    /// name.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when it cannot be created or migrated.
    pub async fn fresh_database(&self, label: &str) -> Result<BenchDb> {
        let name = format!(
            "pgbus_bench_{label}_{}_{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let admin = connect(&self.admin).await?;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await?;
        let mut config = self.admin.clone();
        config.pg_config_mut().dbname(&name);
        let db = BenchDb {
            config,
            admin: self.admin.clone(),
            name,
        };
        pgbus::migrate(&db.connect().await?).await?;
        Ok(db)
    }

    /// The server settings that matter for the figures, as a JSON object, and whether
    /// the server is a throwaway cluster (`embedded`).
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when the server cannot be reached.
    pub async fn settings(&self) -> Result<Value> {
        let client = connect(&self.admin).await?;
        let mut settings = serde_json::Map::new();
        for name in [
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "shared_buffers",
            "wal_level",
            "max_connections",
            "commit_delay",
            "max_wal_size",
        ] {
            let row = client
                .query_one("SELECT current_setting($1)", &[&name])
                .await?;
            settings.insert(name.into(), Value::String(row.get(0)));
        }
        settings.insert("embedded".into(), Value::Bool(self.embedded.is_some()));
        Ok(Value::Object(settings))
    }

    /// Stops the throwaway cluster, if this server is one (a fast shutdown), and removes
    /// it. Dropping the value does the same, with an immediate shutdown.
    pub async fn stop(self) {
        if let Some(pg) = self.embedded {
            let _ = pg.stop(ShutdownMode::Fast).await;
        }
    }
}

/// A database made for one run of a workload; [`BenchDb::drop_database`] removes it.
#[derive(Debug)]
pub struct BenchDb {
    /// How to connect to it.
    pub config: ConnectConfig,
    admin: ConnectConfig,
    name: String,
}

impl BenchDb {
    /// A new connection to this database (its connection task runs on the runtime).
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when it cannot connect.
    pub async fn connect(&self) -> Result<Client> {
        connect(&self.config).await
    }

    /// A libpq `key=value` connection string for this database.
    pub fn conninfo(&self) -> String {
        crate::conninfo(self.config.pg_config())
    }

    /// Drops the database (disconnecting whoever is still connected).
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when the statement fails.
    pub async fn drop_database(self) -> Result<()> {
        let admin = connect(&self.admin).await?;
        admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .await?;
        Ok(())
    }
}

/// Registers subscriptions `subscriptions` for `event_name` and seeds `events` pending
/// events of that name with plain SQL (in chunks, so each statement stays small), turns
/// each chunk into deliveries (`pgbus.fan_out_committed()`), then
/// vacuums and analyzes the tables so the planner knows their size, and checkpoints
/// (where allowed) so the seeding's dirty pages are not written during the measurement.
///
/// # Errors
///
/// [`Error::Database`] when a statement fails.
pub async fn seed_backlog(
    client: &Client,
    subscriptions: &[String],
    event_name: &str,
    events: u64,
) -> Result<()> {
    seed_keyed_backlog(client, subscriptions, event_name, events, 0).await
}

/// [`seed_backlog`] for ordered subscriptions: with `keys` > 0 the subscriptions are
/// ordered and the events spread round-robin over that many ordering keys.
///
/// # Errors
///
/// As [`seed_backlog`].
pub async fn seed_keyed_backlog(
    client: &Client,
    subscriptions: &[String],
    event_name: &str,
    events: u64,
    keys: u64,
) -> Result<()> {
    for name in subscriptions {
        pgbus::admin::register_subscription(client, name, &[event_name], 25).await?;
        pgbus::ordering::set_ordering(client, name, keys > 0, pgbus::DeadHeadPolicy::Block).await?;
    }
    let keys = keys as i64;
    let chunk = 100_000u64;
    let mut from = 1u64;
    while from <= events {
        let to = (from + chunk - 1).min(events);
        client
            .execute(
                "INSERT INTO pgbus.events (event_name, payload, ordering_key) \
                 SELECT $1, jsonb_build_object('i', g, 'kind', 'bench'), \
                        CASE WHEN $4::int8 > 0 THEN 'k' || (g % $4::int8) END \
                 FROM generate_series($2::int8, $3::int8) AS g",
                &[&event_name, &(from as i64), &(to as i64), &keys],
            )
            .await?;
        // The chunk's deliveries, as the bus's next claim would make them.
        client
            .execute("SELECT pgbus.fan_out_committed()", &[])
            .await?;
        from = to + 1;
    }
    settle_tables(client).await
}

/// Vacuums and analyzes the pgbus tables, then checkpoints where allowed.
async fn settle_tables(client: &Client) -> Result<()> {
    client
        .batch_execute("VACUUM (ANALYZE) pgbus.deliveries")
        .await?;
    client
        .batch_execute("VACUUM (ANALYZE) pgbus.events")
        .await?;
    // CHECKPOINT needs superuser or pg_checkpoint; without it the figures are noisier.
    let _ = client.batch_execute("CHECKPOINT").await;
    Ok(())
}

/// `n` order events (`bench.batch`, aggregate `order`), numbered from `from`: what the
/// publishing benchmarks publish.
pub fn sample_events(n: usize, from: u64) -> Vec<Event> {
    (from..from + n as u64)
        .map(|k| {
            Event::new(
                "bench.batch",
                json!({"order_id": k, "amount": 4200, "currency": "EUR", "lines": 3}),
            )
            .aggregate("order", k.to_string())
        })
        .collect()
}

/// The COPY target of [`publish_by_copy`]: publishing's columns and parameter types, one
/// temporary table per connection.
const COPY_TABLE: &str = "CREATE TEMP TABLE pgbus_copy (\
    id text, event_name text, event_version int4, source text, aggregate_type text, \
    aggregate_id text, correlation_id text, causation_id text, occurred_at timestamptz, \
    payload text, headers text, deliver_at timestamptz, delay_ms int8, ordering_key text) \
    ON COMMIT DELETE ROWS";
const COPY_IN: &str = "COPY pgbus_copy FROM STDIN (FORMAT binary)";
/// Publishes what was copied: the table's columns as `pgbus.publish_batch`'s arrays (one
/// aggregate pass, so every array has the rows in the same order).
const COPY_PUBLISH: &str = "SELECT p.inserted, p.conflict \
    FROM (SELECT array_agg(id) AS a1, array_agg(event_name) AS a2, array_agg(event_version) AS a3, \
                 array_agg(source) AS a4, array_agg(aggregate_type) AS a5, \
                 array_agg(aggregate_id) AS a6, array_agg(correlation_id) AS a7, \
                 array_agg(causation_id) AS a8, array_agg(occurred_at) AS a9, \
                 array_agg(payload) AS a10, array_agg(headers) AS a11, \
                 array_agg(deliver_at) AS a12, array_agg(delay_ms) AS a13, \
                 array_agg(ordering_key) AS a14 FROM pgbus_copy) AS c, \
         pgbus.publish_batch(c.a1, c.a2, c.a3, c.a4, c.a5, c.a6, c.a7, c.a8, c.a9, c.a10, \
                             c.a11, c.a12, c.a13, c.a14) AS p";

/// Creates the COPY target of [`publish_by_copy`] on `client` (once per connection).
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn prepare_copy(client: &Client) -> Result<()> {
    client.batch_execute(COPY_TABLE).await?;
    Ok(())
}

/// Publishes `events` by binary COPY into the temporary table made by [`prepare_copy`]
/// and one call of `pgbus.publish_batch` (the statement of [`pgbus::publish_batch`]) with
/// the copied columns: the alternative to `publish_batch`'s arrays that the benchmarks compare it
/// with. Returns how many were inserted.
///
/// Each event is checked as `publish_batch` checks it before anything is sent.
///
/// # Errors
///
/// [`Error::Invalid`] for a bad event (nothing is inserted),
/// [`Error::Database`] when a statement fails.
pub async fn publish_by_copy(
    tx: &tokio_postgres::Transaction<'_>,
    events: &[Event],
) -> Result<i64> {
    let sink = tx.copy_in(COPY_IN).await?;
    let writer = BinaryCopyInWriter::new(sink, &PUBLISH_TYPES);
    tokio::pin!(writer);
    let encoded = events
        .iter()
        .map(pgbus::__private::encode)
        .collect::<Result<Vec<_>>>()?;
    for (e, (payload, headers, delay_ms)) in events.iter().zip(&encoded) {
        let row: [&(dyn ToSql + Sync); 14] = [
            &e.id,
            &e.name,
            &e.version,
            &e.source,
            &e.aggregate_type,
            &e.aggregate_id,
            &e.correlation_id,
            &e.causation_id,
            &e.occurred_at,
            payload,
            headers,
            &e.deliver_at,
            delay_ms,
            &e.ordering_key,
        ];
        writer.as_mut().write(&row).await?;
    }
    writer.finish().await?;
    let row = tx.query_one(COPY_PUBLISH, &[]).await?;
    Ok(row.try_get("inserted")?)
}
