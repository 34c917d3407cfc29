//! The bus's state as an operator reads it: every subscription's backlog and the last
//! minute's work ([`status`]), the cheap backlog gauges ([`backlog`]), the live consumers,
//! and what holds the database back (notification queue, xmin horizon, fan-out backlog).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use crate::error::{Error, Result};
use crate::executor::{Executor, Param, one_row};
use crate::metrics::{FanOutBacklog, XminHorizon};
use crate::sql;

/// One subscription's state, from [`status`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct SubscriptionStatus {
    /// The subscription's name.
    pub name: String,
    /// Its patterns.
    pub patterns: Vec<String>,
    /// Its maximum attempts.
    pub max_attempts: i32,
    /// Deliveries waiting: due now, or retries scheduled later.
    pub pending: i64,
    /// Pending deliveries that are due now.
    pub due: i64,
    /// Deliveries claimed by a worker and not yet settled.
    pub processing: i64,
    /// Dead letters.
    pub dead: i64,
    /// Keys of an ordered subscription whose head is a dead letter (the key waits).
    pub blocked_keys: i64,
    /// How long the oldest due delivery has been due (the lag); `None` when none is due.
    pub oldest_due_age: Option<Duration>,
    /// Events published in the last minute that matched this subscription and whose
    /// delivery is finished (completed, or purged; an event not yet turned into deliveries
    /// is not). Completed deliveries are deleted, so this is read from the log: a retry or
    /// replay of an older event is not counted. Exact unless
    /// [`done_estimated`](Self::done_estimated).
    pub done_last_minute: i64,
    /// Whether [`done_last_minute`](Self::done_last_minute) is an estimate: the last
    /// minute held more than [`RECENT_EVENTS_CAP`] events, or more than
    /// [`RECENT_PROBES_CAP`] pairs of an event and a matching subscription, and the count
    /// was taken over an even sample of it and scaled up (shown as `~N`).
    pub done_estimated: bool,
    /// Live consumers (running buses) serving this subscription.
    pub consumers: i64,
    /// When it was paused ([`pause_subscription`](crate::admin::pause_subscription));
    /// `None` while it delivers.
    pub paused_at: Option<DateTime<Utc>>,
}

/// The bus's state, from [`status`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Status {
    /// Every subscription, by name.
    pub subscriptions: Vec<SubscriptionStatus>,
    /// How full PostgreSQL's notification queue is, from 0 to 1
    /// (`pg_notification_queue_usage()`); near 1, a listener has stopped reading.
    pub notification_queue_usage: f64,
    /// Backends of this database named `pgbus listener` in `pg_stat_activity`.
    pub listeners: i64,
    /// Live consumers (running buses) in `pgbus.consumers`.
    pub consumers: i64,
    /// Live consumers that are asleep (publishers notify them).
    pub sleeping_consumers: i64,
    /// What holds the database's xmin horizon back: the oldest transaction, and the
    /// replication slots (see [`xmin_horizon`]).
    pub horizon: XminHorizon,
    /// The events committed and not yet turned into deliveries (see
    /// [`fan_out_backlog`]): none of the subscriptions' counts include them yet.
    pub fan_out: FanOutBacklog,
}

/// The most events of the last minute [`status`] reads to count each subscription's
/// [`done_last_minute`](SubscriptionStatus::done_last_minute): a busier minute is
/// sampled evenly and the counts are estimated.
pub const RECENT_EVENTS_CAP: i64 = 2_000;

/// The most deliveries [`status`] probes (one per event and matching subscription) to
/// count [`done_last_minute`](SubscriptionStatus::done_last_minute), and
/// [`delivered_recently`](crate::admin::delivered_recently) per event it may read: beyond, the sample is thinned and the
/// counts are estimated.
pub const RECENT_PROBES_CAP: i64 = 10_000;

/// Reads the state of every subscription and of the notification machinery.
///
/// Counting the backlog reads every delivery (O(backlog)); it is meant for operators,
/// not for a hot path. The last minute's counts cost at most [`RECENT_EVENTS_CAP`]
/// events and [`RECENT_PROBES_CAP`] probes, whatever the traffic
/// ([`SubscriptionStatus::done_estimated`]).
///
/// # Errors
///
/// [`Error::SchemaMissing`] when the database was never migrated, [`Error::Database`]
/// when a statement fails.
pub async fn status<C: Executor + ?Sized>(client: &C) -> Result<Status> {
    status_of(client, None).await
}

/// [`status`] with only one subscription's row (`Some(name)`), computed for that one
/// alone; `None`: every subscription.
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when there is no subscription of that name; otherwise
/// as [`status`].
pub async fn status_of<C: Executor + ?Sized>(
    client: &C,
    subscription: Option<&str>,
) -> Result<Status> {
    let client = client.client();
    let subscriptions = subscription_statuses(client, subscription).await?;
    if let (Some(name), true) = (subscription, subscriptions.is_empty()) {
        return Err(Error::UnknownSubscription {
            name: name.to_string(),
        });
    }
    let cluster = read_cluster(client).await?;
    Ok(Status {
        subscriptions,
        notification_queue_usage: cluster.notification_queue_usage,
        listeners: cluster.listeners,
        consumers: cluster.consumers,
        sleeping_consumers: cluster.sleeping_consumers,
        horizon: cluster.horizon,
        fan_out: cluster.fan_out,
    })
}

/// Samples the backlog gauges of `subscriptions` (`None`: every registered
/// subscription), one [`Backlog`](crate::metrics::Backlog) per subscription, by name:
/// one index-backed statement whose counts stop at
/// [`GAUGE_COUNT_CAP`](crate::metrics::GAUGE_COUNT_CAP), so it stays cheap at any
/// backlog (unlike [`status`]). [`Backlog::record`](crate::metrics::Backlog::record)
/// sets the gauges; a running bus samples its own subscriptions by itself.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn backlog<C: Executor + ?Sized>(
    client: &C,
    subscriptions: Option<&[&str]>,
) -> Result<Vec<crate::metrics::Backlog>> {
    let cap = crate::metrics::GAUGE_COUNT_CAP;
    let params: [Param<'_>; 2] = [
        (&subscriptions, sql::BACKLOG_TYPES[0].clone()),
        (&cap, sql::BACKLOG_TYPES[1].clone()),
    ];
    let rows = client.client().query_typed(sql::BACKLOG, &params).await?;
    rows.iter().map(crate::metrics::Backlog::from_row).collect()
}

/// The state of one subscription (see [`status`]).
///
/// # Errors
///
/// [`Error::UnknownSubscription`] when there is none of this name; otherwise as
/// [`status`].
pub async fn subscription_status<C: Executor + ?Sized>(
    client: &C,
    name: &str,
) -> Result<SubscriptionStatus> {
    subscription_statuses(client.client(), Some(name))
        .await?
        .pop()
        .ok_or_else(|| Error::UnknownSubscription {
            name: name.to_string(),
        })
}

async fn subscription_statuses<C: GenericClient>(
    client: &C,
    name: Option<&str>,
) -> Result<Vec<SubscriptionStatus>> {
    let [t_name, t_events, t_probes] = sql::STATUS_SUBSCRIPTIONS_TYPES;
    let rows = client
        .query_typed(
            sql::STATUS_SUBSCRIPTIONS,
            &[
                (&name, t_name),
                (&RECENT_EVENTS_CAP, t_events),
                (&RECENT_PROBES_CAP, t_probes),
            ],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(SubscriptionStatus {
                name: row.try_get("name")?,
                patterns: row.try_get("patterns")?,
                max_attempts: row.try_get("max_attempts")?,
                pending: row.try_get("pending")?,
                due: row.try_get("due")?,
                processing: row.try_get("processing")?,
                dead: row.try_get("dead")?,
                blocked_keys: row.try_get("blocked_keys")?,
                // An infinite age (a row written with available_at = -infinity before
                // the schema refused it) reads as the longest duration there is.
                oldest_due_age: row
                    .try_get::<_, Option<f64>>("oldest_due_age")?
                    .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)),
                done_last_minute: row.try_get("done_last_minute")?,
                done_estimated: row.try_get("done_estimated")?,
                consumers: row.try_get("consumers")?,
                paused_at: row.try_get("paused_at")?,
            })
        })
        .collect()
}

/// A live consumer (a running bus), from [`consumers`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ConsumerInfo {
    /// The bus's worker id.
    pub id: String,
    /// Whether it is awake (claiming without being notified); asleep, publishers notify
    /// it.
    pub awake: bool,
    /// The subscriptions it serves.
    pub subscriptions: Vec<String>,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat: when it last renewed its row.
    pub last_heartbeat: DateTime<Utc>,
    /// When its row stops counting as live unless it beats again.
    pub expires_at: DateTime<Utc>,
    /// What the bus says of its process: `pid N on HOST`.
    pub info: Option<String>,
}

/// Lists the live consumers (running buses), by id.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn consumers<C: Executor + ?Sized>(client: &C) -> Result<Vec<ConsumerInfo>> {
    let rows = client
        .client()
        .query_typed(sql::CONSUMERS_LIST, &[])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(ConsumerInfo {
                id: row.try_get("id")?,
                awake: row.try_get("awake")?,
                subscriptions: row.try_get("subscriptions")?,
                started_at: row.try_get("started_at")?,
                last_heartbeat: row.try_get("beat_at")?,
                expires_at: row.try_get("expires_at")?,
                info: row.try_get("info")?,
            })
        })
        .collect()
}

/// The notification machinery's state, from [`cluster_status`]: [`Status`] without the
/// subscriptions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ClusterStatus {
    /// How full PostgreSQL's notification queue is, from 0 to 1.
    pub notification_queue_usage: f64,
    /// Backends of this database named `pgbus listener` in `pg_stat_activity`.
    pub listeners: i64,
    /// Live consumers (running buses).
    pub consumers: i64,
    /// Live consumers that are asleep.
    pub sleeping_consumers: i64,
    /// What holds the database's xmin horizon back (see [`xmin_horizon`]).
    pub horizon: XminHorizon,
    /// The events not yet turned into deliveries (see [`fan_out_backlog`]).
    pub fan_out: FanOutBacklog,
}

/// Reads the notification machinery's state and the xmin horizon alone: two cheap
/// statements, unlike [`status`], which also counts every delivery.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn cluster_status<C: Executor + ?Sized>(client: &C) -> Result<ClusterStatus> {
    read_cluster(client.client()).await
}

async fn read_cluster<C: GenericClient>(client: &C) -> Result<ClusterStatus> {
    let row = one_row(client, sql::STATUS_CLUSTER, &[]).await?;
    let horizon = one_row(client, sql::XMIN_HORIZON, &[]).await?;
    let fan_out = read_fan_out_backlog(client).await?;
    Ok(ClusterStatus {
        notification_queue_usage: row.try_get("notification_queue_usage")?,
        listeners: row.try_get("listeners")?,
        consumers: row.try_get("consumers")?,
        sleeping_consumers: row.try_get("sleeping_consumers")?,
        horizon: XminHorizon::from_row(&horizon)?,
        fan_out,
    })
}

/// Counts the events committed and not yet turned into deliveries, up to
/// [`GAUGE_COUNT_CAP`](crate::metrics::GAUGE_COUNT_CAP), with the age of the oldest: the
/// first stage of the backlog (docs/ARCHITECTURE.md, "The log-first publish"). A
/// running bus turns them into deliveries at its next claim, so the count stays near 0
/// while one runs. [`FanOutBacklog::record`] sets its gauges.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn fan_out_backlog<C: Executor + ?Sized>(client: &C) -> Result<FanOutBacklog> {
    read_fan_out_backlog(client.client()).await
}

async fn read_fan_out_backlog<C: GenericClient>(client: &C) -> Result<FanOutBacklog> {
    let cap = crate::metrics::GAUGE_COUNT_CAP;
    let params: [Param<'_>; 1] = [(&cap, sql::FAN_OUT_BACKLOG_TYPES[0].clone())];
    FanOutBacklog::from_row(&one_row(client, sql::FAN_OUT_BACKLOG, &params).await?)
}

/// Reads what holds the database's xmin horizon back: the oldest transaction of this
/// database with a snapshot or a transaction id (a session idle in transaction, a long
/// query or report, a prepared transaction), and the oldest xmin of a replication slot.
/// While one is held, VACUUM cannot remove what settled deliveries leave behind, and
/// the claims and settlements slow down as they walk past it (docs/operations.md, "A
/// long transaction"). [`XminHorizon::record`] sets its gauges.
///
/// # Errors
///
/// [`Error::Database`] when the statement fails.
pub async fn xmin_horizon<C: Executor + ?Sized>(client: &C) -> Result<XminHorizon> {
    let row = one_row(client.client(), sql::XMIN_HORIZON, &[]).await?;
    XminHorizon::from_row(&row)
}
