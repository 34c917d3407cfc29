//! The dashboard's reads (`pgbus ui`): what was delivered recently, a delivery's failure
//! history, a subscription's pending deliveries, finding events, and one event's
//! deliveries.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use tokio_postgres::types::Type;

use crate::error::{Error, Result};
use crate::executor::Executor;
use crate::sql;

/// What [`delivered_recently`] counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RecentlyDelivered {
    /// Events finished per subscription, by name; a subscription that finished none is
    /// absent.
    pub delivered: Vec<(String, i64)>,
    /// The window held more events than the most read (or more pairs of an event and a
    /// matching subscription than the probes allowed): the counts are estimated from an
    /// even sample of the window, its newest event included, scaled up (shown as `~N`).
    pub capped: bool,
}

/// How many events of the last `window` each subscription has finished (completed, or
/// purged), reading at most `max_events` events of the window and probing the
/// deliveries at most `max_events` times (once per event and matching subscription).
/// Divided by the window, it is the subscription's recent throughput (an estimate when
/// [`capped`](RecentlyDelivered::capped)). Read from the log, as
/// [`SubscriptionStatus::done_last_minute`](crate::admin::SubscriptionStatus::done_last_minute): its cost is bounded by `max_events`,
/// whatever the backlog, the publishing rate or how many subscriptions an event matches.
///
/// # Errors
///
/// [`Error::Invalid`] for a zero window or `max_events` below 1, [`Error::Database`]
/// when the statement fails.
pub async fn delivered_recently<C: Executor + ?Sized>(
    client: &C,
    window: Duration,
    max_events: i64,
) -> Result<RecentlyDelivered> {
    if window.is_zero() {
        return Err(Error::invalid("window", "must be positive"));
    }
    if max_events < 1 {
        return Err(Error::invalid("max events", "must be at least 1"));
    }
    let seconds = window.as_secs_f64();
    let rows = client
        .client()
        .query_typed(
            sql::DELIVERED_RECENTLY,
            &[
                (&seconds, Type::FLOAT8),
                (&max_events, Type::INT8),
                (&max_events, Type::INT8),
            ],
        )
        .await?;
    let mut out = RecentlyDelivered::default();
    for row in &rows {
        out.capped |= row.try_get::<_, bool>("estimated")?;
        if let Some(subscription) = row.try_get::<_, Option<String>>("subscription")? {
            out.delivered
                .push((subscription, row.try_get("delivered")?));
        }
    }
    Ok(out)
}

/// One failed attempt of a delivery, from [`failure_history`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct FailedAttempt {
    /// The event's position in the log.
    pub event_seq: i64,
    /// The attempt's number (counted since the delivery was last retried by an
    /// operator, who resets the attempts).
    pub attempt: i32,
    /// Its error.
    pub error: String,
    /// The worker that made it (`None` for a lease that expired).
    pub worker: Option<String>,
    /// When it failed.
    pub failed_at: DateTime<Utc>,
}

/// The failure history of `subscription`'s deliveries of the events `event_seqs`: every
/// failed attempt, by event and then oldest first, at most `limit` rows in all.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn failure_history<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    event_seqs: &[i64],
    limit: i64,
) -> Result<Vec<FailedAttempt>> {
    let rows = client
        .client()
        .query_typed(
            sql::FAILURE_HISTORY,
            &[
                (&subscription, Type::TEXT),
                (&event_seqs, Type::INT8_ARRAY),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(FailedAttempt {
                event_seq: row.try_get("event_seq")?,
                attempt: row.try_get("attempt")?,
                error: row.try_get("error")?,
                worker: row.try_get("worker")?,
                failed_at: row.try_get("failed_at")?,
            })
        })
        .collect()
}

/// The event whose id is `id`; when there is none, the events whose correlation id is
/// `id`, oldest first, at most `limit`. An event whose columns cannot be read back (see
/// the claim's decoding) comes back with its name and id, and a payload saying why.
///
/// The search by id is a probe of the log's unique index; the one by correlation id
/// reads the whole log (it has no index on that column).
///
/// # Errors
///
/// [`Error::Database`] when a statement fails.
pub async fn find_events<C: Executor + ?Sized>(
    client: &C,
    id: &str,
    limit: i64,
) -> Result<Vec<crate::Event>> {
    let client = client.client();
    let mut rows = client
        .query_typed(sql::EVENT_BY_ID, &[(&id, Type::TEXT)])
        .await?;
    if rows.is_empty() {
        rows = client
            .query_typed(
                sql::EVENTS_BY_CORRELATION,
                &[(&id, Type::TEXT), (&limit, Type::INT8)],
            )
            .await?;
    }
    rows.iter()
        .map(|row| {
            let seq: i64 = row.try_get("seq")?;
            Ok(match crate::decode::event(row, seq) {
                Ok((event, _)) => event,
                Err(e) => {
                    let mut event = crate::decode::placeholder(row, seq);
                    event.payload = serde_json::Value::String(format!("undecodable: {e}"));
                    event
                }
            })
        })
        .collect()
}

/// Where an event's delivery stands in one subscription, from [`event_deliveries`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EventDelivery {
    /// The subscription.
    pub subscription: String,
    /// `pending`, `processing`, `dead`, or `done` (completed, or purged: no delivery is
    /// left of an event the subscription matches).
    pub status: String,
    /// Attempts made (`None` when done).
    pub attempts: Option<i32>,
    /// When a pending delivery is (or was) due.
    pub available_at: Option<DateTime<Utc>>,
    /// The worker holding a processing delivery.
    pub locked_by: Option<String>,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// The ordering key, in an ordered subscription.
    pub ordering_key: Option<String>,
    /// Whether it is its key's head (every delivery of an unordered subscription is).
    pub is_head: Option<bool>,
}

/// Where the delivery of the event at `event_seq` stands in every subscription that has
/// a delivery of it or matches it, by subscription name.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn event_deliveries<C: Executor + ?Sized>(
    client: &C,
    event_seq: i64,
) -> Result<Vec<EventDelivery>> {
    let rows = client
        .client()
        .query_typed(sql::EVENT_DELIVERIES, &[(&event_seq, Type::INT8)])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(EventDelivery {
                subscription: row.try_get("subscription")?,
                status: row.try_get("status")?,
                attempts: row.try_get("attempts")?,
                available_at: row.try_get("available_at")?,
                locked_by: row.try_get("locked_by")?,
                last_error: row.try_get("last_error")?,
                ordering_key: row.try_get("ordering_key")?,
                is_head: row.try_get("is_head")?,
            })
        })
        .collect()
}

/// A pending delivery, from [`pending_deliveries`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PendingDelivery {
    /// The event's position in the log (the listing's order and its cursor).
    pub event_seq: i64,
    /// The event's id (`None` if the event is no longer in the log).
    pub event_id: Option<String>,
    /// The event's name (`None` if the event is no longer in the log).
    pub event_name: Option<String>,
    /// Attempts made so far.
    pub attempts: i32,
    /// When it is (or was) due.
    pub available_at: DateTime<Utc>,
    /// Its ordering key, in an ordered subscription.
    pub ordering_key: Option<String>,
    /// `due` (claimable now), `scheduled` (due later) or `waiting` (behind its key's
    /// head).
    pub state: String,
}

/// `subscription`'s pending deliveries in event order, after the event seq `after`
/// (`None`: from the first), at most `limit`: a page of them, whose last one's
/// `event_seq` is the next page's `after`. Each page costs its rows (and the deliveries
/// in other states it steps over), whatever the backlog.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn pending_deliveries<C: Executor + ?Sized>(
    client: &C,
    subscription: &str,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<PendingDelivery>> {
    let rows = client
        .client()
        .query_typed(
            sql::PENDING_LIST,
            &[
                (&subscription, Type::TEXT),
                (&after, Type::INT8),
                (&limit, Type::INT8),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(PendingDelivery {
                event_seq: row.try_get("event_seq")?,
                event_id: row.try_get("event_id")?,
                event_name: row.try_get("event_name")?,
                attempts: row.try_get("attempts")?,
                available_at: row.try_get("available_at")?,
                ordering_key: row.try_get("ordering_key")?,
                state: row.try_get("state")?,
            })
        })
        .collect()
}
