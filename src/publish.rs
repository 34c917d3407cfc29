//! Publishing events inside the caller's transaction.
//!
//! [`publish`] and [`publish_batch`] join whatever transaction the given client is in and
//! never begin or commit one: the events become visible, and their deliveries claimable,
//! exactly when the caller's business transaction commits, and vanish with it when it
//! rolls back. Each call is one round trip: a call of the SQL function
//! `pgbus.publish_event` ([`PUBLISH_EVENT`], one event) or `pgbus.publish_batch`
//! ([`PUBLISH_BATCH`]), sent as an unnamed prepared statement with its parameter types,
//! so it works behind transaction-mode poolers too; the function's own statements are
//! planned once per connection (PL/pgSQL caches their plans), where the whole statement
//! sent unnamed was planned on every call.
//!
//! With the `sqlx` feature, `pgbus::sqlx` publishes through sqlx's executors with the
//! same checks, statements and answers: [`Publisher::row`] and [`Publisher::columns`]
//! make the parameters, [`published`] and [`batch_published`] read the answer; only the
//! sending differs.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::event::{DEFAULT_MAX_PAYLOAD_BYTES, Encoded, Event};
use crate::executor::Executor;
use crate::sql::{PUBLISH_BATCH, PUBLISH_EVENT, PUBLISH_TYPES};
use crate::trace_context::{Outgoing, TRACEPARENT, TRACESTATE};

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

/// The 14 parameters of a [`Row`] or [`Columns`], in the order of [`PUBLISH_BATCH`]'s
/// parameters, each with the type given in `$types`.
macro_rules! typed_params {
    ($s:expr, $types:expr) => {
        [
            (&$s.id as &(dyn ToSql + Sync), $types[0].clone()),
            (&$s.name, $types[1].clone()),
            (&$s.version, $types[2].clone()),
            (&$s.source, $types[3].clone()),
            (&$s.aggregate_type, $types[4].clone()),
            (&$s.aggregate_id, $types[5].clone()),
            (&$s.correlation_id, $types[6].clone()),
            (&$s.causation_id, $types[7].clone()),
            (&$s.occurred_at, $types[8].clone()),
            (&$s.payload, $types[9].clone()),
            (&$s.headers, $types[10].clone()),
            (&$s.deliver_at, $types[11].clone()),
            (&$s.delay_ms, $types[12].clone()),
            (&$s.ordering_key, $types[13].clone()),
        ]
    };
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
        let span = publish_span(event);
        let row = self.row(event, &span)?;
        let params = typed_params!(row, PUBLISH_TYPES);
        let (inserted, conflict) = send(client, PUBLISH_EVENT, &params, span).await?;
        published(inserted, conflict)
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
        let span = batch_span(events);
        let Some(columns) = self.columns(events, &span)? else {
            return Ok(0);
        };
        let params = typed_params!(columns, BATCH_TYPES);
        let (inserted, conflict) = send(client, PUBLISH_BATCH, &params, span).await?;
        batch_published(inserted, conflict)
    }

    /// One event checked and encoded as [`PUBLISH_EVENT`]'s parameters, with the trace
    /// context of `span` in its headers (see [`Outgoing`]). Every check runs here, before
    /// anything is sent.
    pub(crate) fn row<'a>(&self, event: &'a Event, span: &tracing::Span) -> Result<Row<'a>> {
        let mut enc = event.encode(self.max_payload_bytes)?;
        Outgoing::of(span).write(&event.headers, &mut enc.headers);
        Ok(Row {
            id: &event.id,
            name: &event.name,
            version: event.version,
            source: event.source.as_deref(),
            aggregate_type: event.aggregate_type.as_deref(),
            aggregate_id: event.aggregate_id.as_deref(),
            correlation_id: event.correlation_id.as_deref(),
            causation_id: event.causation_id.as_deref(),
            occurred_at: event.occurred_at,
            payload: enc.payload,
            headers: enc.headers,
            deliver_at: event.deliver_at,
            delay_ms: enc.delay_ms,
            ordering_key: event.ordering_key.as_deref(),
        })
    }

    /// A batch checked and encoded as the batch statement's arrays, identical repeats of
    /// an id dropped, each event with the trace context of `span` in its headers (see
    /// [`Outgoing`]); `None` for an empty batch (nothing to send). Every check runs here,
    /// before anything is sent.
    pub(crate) fn columns<'a>(
        &self,
        events: &'a [Event],
        span: &tracing::Span,
    ) -> Result<Option<Columns<'a>>> {
        if events.is_empty() {
            return Ok(None);
        }
        let outgoing = Outgoing::of(span);
        let mut columns = Columns::with_capacity(events.len());
        let mut seen = std::collections::HashMap::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            let mut enc = event.encode(self.max_payload_bytes)?;
            outgoing.write(&event.headers, &mut enc.headers);
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
        Ok(Some(columns))
    }
}

/// The tracing span of publishing one event, named after the OpenTelemetry messaging
/// conventions (`publish <event name>`; `create`: the event becomes visible at the
/// caller's COMMIT, which pgbus does not see). With the `opentelemetry` feature, its
/// context is the one written into the event's headers.
pub(crate) fn publish_span(event: &Event) -> tracing::Span {
    tracing::debug_span!(
        "pgbus.publish",
        otel.name = %format_args!("publish {}", event.name),
        otel.kind = "producer",
        messaging.system = "pgbus",
        messaging.operation.type = "create",
        messaging.operation.name = "publish",
        messaging.destination.name = %event.name,
        messaging.message.id = %event.id,
    )
}

/// The tracing span of publishing a batch (`publish`, without a destination: a batch may
/// hold several event names). Its context is every event's of the batch.
pub(crate) fn batch_span(events: &[Event]) -> tracing::Span {
    tracing::debug_span!(
        "pgbus.publish",
        otel.name = "publish",
        otel.kind = "producer",
        messaging.system = "pgbus",
        messaging.operation.type = "create",
        messaging.operation.name = "publish",
        messaging.batch.message_count = events.len() as i64,
    )
}

/// Sends a publish statement and reads its one row: how many events were inserted, and
/// the first id whose content conflicted.
async fn send<C: Executor + ?Sized>(
    client: &C,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
    span: tracing::Span,
) -> Result<(i64, Option<String>)> {
    let rows = client
        .client()
        .query_typed(sql, params)
        .instrument(span)
        .await?;
    let row = rows
        .first()
        .ok_or(Error::Unexpected("the publish statement returned no row"))?;
    Ok((row.try_get("inserted")?, row.try_get("conflict")?))
}

/// What the statement's row (`inserted`, `conflict`) means for a single event.
pub(crate) fn published(inserted: i64, conflict: Option<String>) -> Result<Published> {
    match (inserted, conflict) {
        (_, Some(id)) => Err(Error::Conflict { id }),
        (1, None) => {
            crate::metrics::published(1);
            Ok(Published::Inserted)
        }
        _ => Ok(Published::Duplicate),
    }
}

/// What the batch statement's row (`inserted`, `conflict`) means: how many were new.
pub(crate) fn batch_published(inserted: i64, conflict: Option<String>) -> Result<u64> {
    match conflict {
        Some(id) => Err(Error::Conflict { id }),
        None => {
            crate::metrics::published(inserted as u64);
            Ok(inserted as u64)
        }
    }
}

/// One event as [`PUBLISH_EVENT`]'s parameters (the same field names as [`Columns`]).
pub(crate) struct Row<'a> {
    pub(crate) id: &'a str,
    pub(crate) name: &'a str,
    pub(crate) version: i32,
    pub(crate) source: Option<&'a str>,
    pub(crate) aggregate_type: Option<&'a str>,
    pub(crate) aggregate_id: Option<&'a str>,
    pub(crate) correlation_id: Option<&'a str>,
    pub(crate) causation_id: Option<&'a str>,
    pub(crate) occurred_at: Option<DateTime<Utc>>,
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) deliver_at: Option<DateTime<Utc>>,
    pub(crate) delay_ms: Option<i64>,
    pub(crate) ordering_key: Option<&'a str>,
}

/// Events as the publish statement's arrays, one per column, in the order of
/// [`PUBLISH_BATCH`]'s parameters.
pub(crate) struct Columns<'a> {
    pub(crate) id: Vec<&'a str>,
    pub(crate) name: Vec<&'a str>,
    pub(crate) version: Vec<i32>,
    pub(crate) source: Vec<Option<&'a str>>,
    pub(crate) aggregate_type: Vec<Option<&'a str>>,
    pub(crate) aggregate_id: Vec<Option<&'a str>>,
    pub(crate) correlation_id: Vec<Option<&'a str>>,
    pub(crate) causation_id: Vec<Option<&'a str>>,
    pub(crate) occurred_at: Vec<Option<DateTime<Utc>>>,
    pub(crate) payload: Vec<String>,
    pub(crate) headers: Vec<String>,
    pub(crate) deliver_at: Vec<Option<DateTime<Utc>>>,
    pub(crate) delay_ms: Vec<Option<i64>>,
    pub(crate) ordering_key: Vec<Option<&'a str>>,
}

impl<'a> Columns<'a> {
    fn with_capacity(n: usize) -> Self {
        Columns {
            id: Vec::with_capacity(n),
            name: Vec::with_capacity(n),
            version: Vec::with_capacity(n),
            source: Vec::with_capacity(n),
            aggregate_type: Vec::with_capacity(n),
            aggregate_id: Vec::with_capacity(n),
            correlation_id: Vec::with_capacity(n),
            causation_id: Vec::with_capacity(n),
            occurred_at: Vec::with_capacity(n),
            payload: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
            deliver_at: Vec::with_capacity(n),
            delay_ms: Vec::with_capacity(n),
            ordering_key: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, event: &'a Event, enc: Encoded) {
        self.id.push(&event.id);
        self.name.push(&event.name);
        self.version.push(event.version);
        self.source.push(event.source.as_deref());
        self.aggregate_type.push(event.aggregate_type.as_deref());
        self.aggregate_id.push(event.aggregate_id.as_deref());
        self.correlation_id.push(event.correlation_id.as_deref());
        self.causation_id.push(event.causation_id.as_deref());
        self.occurred_at.push(event.occurred_at);
        self.payload.push(enc.payload);
        self.headers.push(enc.headers);
        self.deliver_at.push(event.deliver_at);
        self.delay_ms.push(enc.delay_ms);
        self.ordering_key.push(event.ordering_key.as_deref());
    }
}

/// The content that idempotency compares (the same columns as the statement): the
/// headers without the trace context, which describes one attempt to publish.
fn same_content(a: &Event, b: &Event) -> bool {
    let content = |headers: &serde_json::Value| match headers.as_object() {
        Some(map) => {
            let mut map = map.clone();
            map.remove(TRACEPARENT);
            map.remove(TRACESTATE);
            serde_json::Value::Object(map)
        }
        None => headers.clone(),
    };
    a.name == b.name
        && a.version == b.version
        && a.aggregate_type == b.aggregate_type
        && a.aggregate_id == b.aggregate_id
        && a.payload == b.payload
        && (a.headers == b.headers || content(&a.headers) == content(&b.headers))
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
