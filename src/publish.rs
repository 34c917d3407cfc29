//! Publishing events inside the caller's transaction.
//!
//! [`publish`] and [`publish_batch`] join whatever transaction the given client is in and
//! never begin or commit one: the events become visible, and their deliveries claimable,
//! exactly when the caller's business transaction commits, and vanish with it when it
//! rolls back. Each call is one round trip: a single statement, sent as an unnamed
//! prepared statement with its parameter types, so it works behind transaction-mode
//! poolers too.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::event::{DEFAULT_MAX_PAYLOAD_BYTES, Encoded, Event};
use crate::sql::{PUBLISH_COLUMNS, PUBLISH_HEAD, PUBLISH_TAIL, PUBLISH_TYPES};

/// A connection or transaction that pgbus can publish through.
///
/// Implemented for `tokio_postgres::Client` and `Transaction`, and for
/// `deadpool_postgres`'s `Object` (a pooled client), `ClientWrapper` and `Transaction`.
/// Sealed: it cannot be implemented outside pgbus.
pub trait Executor: private::Sealed + Sync {
    /// The tokio-postgres client or transaction underneath.
    type Client: GenericClient + Sync;

    /// Returns the tokio-postgres client or transaction underneath.
    fn client(&self) -> &Self::Client;
}

mod private {
    pub trait Sealed {}
}

impl private::Sealed for tokio_postgres::Client {}
impl Executor for tokio_postgres::Client {
    type Client = Self;
    fn client(&self) -> &Self {
        self
    }
}

impl private::Sealed for tokio_postgres::Transaction<'_> {}
impl<'a> Executor for tokio_postgres::Transaction<'a> {
    type Client = Self;
    fn client(&self) -> &Self {
        self
    }
}

impl private::Sealed for deadpool_postgres::ClientWrapper {}
impl Executor for deadpool_postgres::ClientWrapper {
    type Client = tokio_postgres::Client;
    fn client(&self) -> &tokio_postgres::Client {
        self
    }
}

impl private::Sealed for deadpool_postgres::Object {}
impl Executor for deadpool_postgres::Object {
    type Client = tokio_postgres::Client;
    fn client(&self) -> &tokio_postgres::Client {
        self
    }
}

impl private::Sealed for deadpool_postgres::Transaction<'_> {}
impl<'a> Executor for deadpool_postgres::Transaction<'a> {
    type Client = tokio_postgres::Transaction<'a>;
    fn client(&self) -> &tokio_postgres::Transaction<'a> {
        self
    }
}

/// What [`publish`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Published {
    /// The event was written to the log, and its deliveries created.
    Inserted,
    /// An identical event with this id was already in the log: nothing was written.
    Duplicate,
}

/// Publishes with non-default limits. [`publish`] and [`publish_batch`] use
/// `Publisher::default()`.
#[derive(Debug, Clone, Copy)]
pub struct Publisher {
    max_payload_bytes: usize,
}

impl Default for Publisher {
    fn default() -> Self {
        Publisher {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

/// Parameter types of the batch statement: the same columns as arrays.
const BATCH_TYPES: [Type; 14] = [
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT4_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TIMESTAMPTZ_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TIMESTAMPTZ_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
];

fn one_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "{PUBLISH_HEAD}(VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)) AS {PUBLISH_COLUMNS}{PUBLISH_TAIL}"
        )
    })
}

fn batch_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "{PUBLISH_HEAD}unnest($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) AS {PUBLISH_COLUMNS}{PUBLISH_TAIL}"
        )
    })
}

impl Publisher {
    /// A publisher with the default limits.
    pub fn new() -> Self {
        Publisher::default()
    }

    /// Sets the largest payload accepted, in bytes of JSON text (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`], 1 MiB), checked before anything is sent. Above
    /// [`MAX_EVENT_BYTES`](crate::MAX_EVENT_BYTES) the schema refuses the event
    /// anyway (a database error, SQLSTATE 23514).
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Publishes one event in the client's current transaction. See [`publish`].
    ///
    /// # Errors
    ///
    /// As [`publish`].
    pub async fn publish<C: Executor + ?Sized>(
        &self,
        client: &C,
        event: &Event,
    ) -> Result<Published> {
        let enc = event.encode(self.max_payload_bytes)?;
        let span = tracing::debug_span!(
            "pgbus.publish",
            messaging.system = "postgresql",
            messaging.destination.name = %event.name,
            messaging.message.id = %event.id,
            messaging.batch.message_count = 1_i64,
        );
        let params: [(&(dyn ToSql + Sync), Type); 14] = [
            (&event.id, PUBLISH_TYPES[0].clone()),
            (&event.name, PUBLISH_TYPES[1].clone()),
            (&event.version, PUBLISH_TYPES[2].clone()),
            (&event.source, PUBLISH_TYPES[3].clone()),
            (&event.aggregate_type, PUBLISH_TYPES[4].clone()),
            (&event.aggregate_id, PUBLISH_TYPES[5].clone()),
            (&event.correlation_id, PUBLISH_TYPES[6].clone()),
            (&event.causation_id, PUBLISH_TYPES[7].clone()),
            (&event.occurred_at, PUBLISH_TYPES[8].clone()),
            (&enc.payload, PUBLISH_TYPES[9].clone()),
            (&enc.headers, PUBLISH_TYPES[10].clone()),
            (&event.deliver_at, PUBLISH_TYPES[11].clone()),
            (&enc.delay_ms, PUBLISH_TYPES[12].clone()),
            (&event.ordering_key, PUBLISH_TYPES[13].clone()),
        ];
        let rows = client
            .client()
            .query_typed(one_sql(), &params)
            .instrument(span)
            .await?;
        match outcome(&rows)? {
            (1, None) => Ok(Published::Inserted),
            (_, Some(id)) => Err(Error::Conflict { id }),
            _ => Ok(Published::Duplicate),
        }
    }

    /// Publishes many events in one statement in the client's current transaction. See
    /// [`publish_batch`].
    ///
    /// # Errors
    ///
    /// As [`publish_batch`].
    pub async fn publish_batch<C: Executor + ?Sized>(
        &self,
        client: &C,
        events: &[Event],
    ) -> Result<u64> {
        if events.is_empty() {
            return Ok(0);
        }
        let mut columns = Columns::with_capacity(events.len());
        let mut seen = std::collections::HashMap::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            let enc = event.encode(self.max_payload_bytes)?;
            // One statement cannot insert the same id twice: identical repeats are
            // dropped, different content under one id is a conflict.
            if let Some(&first) = seen.get(event.id.as_str()) {
                if same_content(&events[first], event) {
                    continue;
                }
                return Err(Error::Conflict {
                    id: event.id.clone(),
                });
            }
            seen.insert(event.id.as_str(), i);
            columns.push(event, enc);
        }
        let span = tracing::debug_span!(
            "pgbus.publish",
            messaging.system = "postgresql",
            messaging.batch.message_count = events.len() as i64,
        );
        let rows = client
            .client()
            .query_typed(batch_sql(), &columns.params())
            .instrument(span)
            .await?;
        match outcome(&rows)? {
            (_, Some(id)) => Err(Error::Conflict { id }),
            (inserted, None) => Ok(inserted as u64),
        }
    }
}

/// Reads the statement's one row: how many events were inserted, and the first id whose
/// content conflicted.
fn outcome(rows: &[tokio_postgres::Row]) -> Result<(i64, Option<String>)> {
    let row = rows
        .first()
        .ok_or(Error::Unexpected("the publish statement returned no row"))?;
    Ok((row.try_get("inserted")?, row.try_get("conflict")?))
}

/// A batch as the publish statement's arrays, one per column.
struct Columns<'a> {
    ids: Vec<&'a str>,
    names: Vec<&'a str>,
    versions: Vec<i32>,
    sources: Vec<Option<&'a str>>,
    agg_types: Vec<Option<&'a str>>,
    agg_ids: Vec<Option<&'a str>>,
    correlations: Vec<Option<&'a str>>,
    causations: Vec<Option<&'a str>>,
    occurred: Vec<Option<DateTime<Utc>>>,
    payloads: Vec<String>,
    headers: Vec<String>,
    deliver_at: Vec<Option<DateTime<Utc>>>,
    delays: Vec<Option<i64>>,
    keys: Vec<Option<&'a str>>,
}

impl<'a> Columns<'a> {
    fn with_capacity(n: usize) -> Self {
        Columns {
            ids: Vec::with_capacity(n),
            names: Vec::with_capacity(n),
            versions: Vec::with_capacity(n),
            sources: Vec::with_capacity(n),
            agg_types: Vec::with_capacity(n),
            agg_ids: Vec::with_capacity(n),
            correlations: Vec::with_capacity(n),
            causations: Vec::with_capacity(n),
            occurred: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            deliver_at: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, event: &'a Event, enc: Encoded) {
        self.ids.push(&event.id);
        self.names.push(&event.name);
        self.versions.push(event.version);
        self.sources.push(event.source.as_deref());
        self.agg_types.push(event.aggregate_type.as_deref());
        self.agg_ids.push(event.aggregate_id.as_deref());
        self.correlations.push(event.correlation_id.as_deref());
        self.causations.push(event.causation_id.as_deref());
        self.occurred.push(event.occurred_at);
        self.payloads.push(enc.payload);
        self.headers.push(enc.headers);
        self.deliver_at.push(event.deliver_at);
        self.delays.push(enc.delay_ms);
        self.keys.push(event.ordering_key.as_deref());
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 14] {
        [
            (&self.ids, BATCH_TYPES[0].clone()),
            (&self.names, BATCH_TYPES[1].clone()),
            (&self.versions, BATCH_TYPES[2].clone()),
            (&self.sources, BATCH_TYPES[3].clone()),
            (&self.agg_types, BATCH_TYPES[4].clone()),
            (&self.agg_ids, BATCH_TYPES[5].clone()),
            (&self.correlations, BATCH_TYPES[6].clone()),
            (&self.causations, BATCH_TYPES[7].clone()),
            (&self.occurred, BATCH_TYPES[8].clone()),
            (&self.payloads, BATCH_TYPES[9].clone()),
            (&self.headers, BATCH_TYPES[10].clone()),
            (&self.deliver_at, BATCH_TYPES[11].clone()),
            (&self.delays, BATCH_TYPES[12].clone()),
            (&self.keys, BATCH_TYPES[13].clone()),
        ]
    }
}

/// The content that idempotency compares (the same columns as the statement).
fn same_content(a: &Event, b: &Event) -> bool {
    a.name == b.name
        && a.version == b.version
        && a.aggregate_type == b.aggregate_type
        && a.aggregate_id == b.aggregate_id
        && a.payload == b.payload
        && a.headers == b.headers
}

/// Publishes one event in the client's current transaction (one round trip).
///
/// The event is written to `pgbus.events`; the fan-out trigger creates one delivery per
/// matching subscription, and the bus is notified when the transaction commits. Nothing
/// is visible to consumers before COMMIT, and nothing is left after ROLLBACK.
///
/// Publishing is idempotent by [`Event::id`]: an identical event already in the log
/// gives [`Published::Duplicate`] and writes nothing.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), pgbus::Error> {
/// use pgbus::Event;
/// use serde_json::json;
///
/// let tx = client.transaction().await?;
/// // ... the business writes ...
/// pgbus::publish(&tx, &Event::new("order.placed", json!({"order_id": 42}))).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// - [`Error::Invalid`] for bad input (name, id, headers, `\u0000`, size); nothing is sent.
/// - [`Error::Conflict`] when the id is in the log with different content. Nothing was
///   written; the caller's transaction is still usable and decides what follows.
/// - [`Error::SchemaMissing`] when the database was never migrated.
/// - [`Error::Database`] when PostgreSQL refuses the statement.
pub async fn publish<C: Executor + ?Sized>(client: &C, event: &Event) -> Result<Published> {
    Publisher::default().publish(client, event).await
}

/// Publishes many events in one statement (one round trip) in the client's current
/// transaction, and returns how many were new.
///
/// The events are sent as arrays and expanded with `unnest` on the server. Identical
/// repeats of an id (in the batch or in the log) are skipped.
///
/// # Errors
///
/// As [`publish`]; with a [`Error::Conflict`] or [`Error::Invalid`] nothing of the batch
/// is written.
pub async fn publish_batch<C: Executor + ?Sized>(client: &C, events: &[Event]) -> Result<u64> {
    Publisher::default().publish_batch(client, events).await
}
