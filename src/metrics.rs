//! Metrics through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! pgbus only records: the application installs an exporter (a recorder), e.g.
//! `metrics-exporter-prometheus`, and everything below reaches it. Without one, recording
//! costs next to nothing and goes nowhere. pgbus never installs a recorder.
//!
//! Names are Prometheus-style, with their unit; labels are only `subscription`,
//! `outcome`, `source` and `state`, each from a bounded set (never an event id or key).
//! The counters and histograms are recorded where the bus's [`Stats`](crate::Stats)
//! counters are counted; the gauges are sampled by each running bus from the database
//! every [`DEFAULT_GAUGE_INTERVAL`] ([`BusBuilder::gauge_interval`]), and by
//! [`admin::backlog`](crate::admin::backlog) for a process that samples them on its own
//! (`pgbus metrics`).
//!
//! [`BusBuilder::gauge_interval`]: crate::BusBuilder::gauge_interval
//!
//! ```no_run
//! // Once, at start, with the exporter of the application's choice:
//! // metrics_exporter_prometheus::PrometheusBuilder::new().install()?;
//! pgbus::metrics::describe(); // HELP texts and units for the exporter
//! ```

use std::sync::Arc;
use std::time::Duration;

use ::metrics::{SharedString, histogram};
use ::metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use tokio_postgres::Row;

use crate::error::Result;

/// Counter: events inserted by [`publish`](crate::publish()) and
/// [`publish_batch`](crate::publish_batch()) (duplicates of an id are not counted).
pub const PUBLISHED_EVENTS: &str = "pgbus_published_events_total";
/// Counter `{subscription, outcome}`: settlements written, by outcome: `acked`, `failed`
/// (a failed attempt that will be retried), `dead` (dead-lettered), `released` (given back
/// unstarted or on request), `stale` (rejected: the lease had been taken over), `unknown`
/// (the connection was lost with the settlement in flight, and no later try could tell
/// whether it was written: see [`Error::SettleUnknown`](crate::Error::SettleUnknown)).
pub const DELIVERIES: &str = "pgbus_deliveries_total";
/// Counter `{source}`: what woke the claimer: `notify` (a notification), `poll` (the
/// fallback poll timer), `catch-up` (the listener (re)connected), `linger` (a busy bus
/// polling briefly before it sleeps).
pub const WAKEUPS: &str = "pgbus_wakeups_total";
/// Counter: expired leases this bus's reaper returned to pending or dead-lettered.
pub const LEASES_EXPIRED: &str = "pgbus_leases_expired_total";
/// Histogram `{subscription, outcome}`: seconds from a handler's (or a stream consumer's)
/// start to its decision, by that decision: `acked`, `failed`, `released`.
pub const HANDLER_DURATION: &str = "pgbus_handler_duration_seconds";
/// Histogram `{subscription}`: seconds from a delivery becoming due to its handler's
/// start. A new event is due from its publishing transaction's time (`now()` there, its
/// start: the lag includes that transaction's own duration, as PostgreSQL keeps no commit
/// time by default), a delayed one from its delivery time, a retry from its retry time.
pub const DELIVERY_LAG: &str = "pgbus_delivery_lag_seconds";
/// Histogram: seconds one claim statement took.
pub const CLAIM_DURATION: &str = "pgbus_claim_duration_seconds";
/// Histogram: deliveries one claim statement returned.
pub const CLAIM_BATCH_SIZE: &str = "pgbus_claim_batch_size";
/// Gauge `{subscription, state}`: deliveries `due` (pending, due now), `scheduled`
/// (pending, due later), `processing` (leased) and `dead` (dead letters), each counted up
/// to [`GAUGE_COUNT_CAP`].
pub const BACKLOG: &str = "pgbus_backlog";
/// Gauge `{subscription}`: seconds since the oldest delivery a consumer could claim now
/// became due; 0 when none is due.
pub const OLDEST_DUE_AGE: &str = "pgbus_oldest_due_age_seconds";
/// Gauge `{subscription}`: ordering keys blocked by a dead head.
pub const BLOCKED_KEYS: &str = "pgbus_blocked_keys";
/// Gauge `{subscription}`: 1 while the subscription is paused
/// ([`pause_subscription`](crate::admin::pause_subscription)), 0 while it delivers.
pub const SUBSCRIPTION_PAUSED: &str = "pgbus_subscription_paused";

/// Gauge: seconds since the oldest transaction of this database that holds the xmin
/// horizon back (a session with a snapshot or a transaction id, a prepared transaction)
/// started; 0 when none does. While it is held, VACUUM cannot remove the rows deleted or
/// updated since, and the claims and settlements walk past them: see
/// [`XminHorizon`].
pub const OLDEST_TRANSACTION_AGE: &str = "pgbus_oldest_transaction_age_seconds";
/// Gauge: the age, in transactions, of the oldest xmin a replication slot holds (0 when
/// none holds one): a slot whose standby or consumer is gone holds the horizon as a long
/// transaction does.
pub const SLOT_XMIN_AGE: &str = "pgbus_replication_slot_xmin_age";

/// Gauge: committed events the bus has not yet turned into deliveries (counted up to
/// [`GAUGE_COUNT_CAP`]): the backlog before the deliveries (docs/ARCHITECTURE.md, "The
/// log-first publish"). It stays near 0 while any bus claims; it grows when none runs.
pub const FAN_OUT_BACKLOG: &str = "pgbus_fan_out_backlog";
/// Gauge: seconds since the oldest of those events was written (0 when none waits).
pub const FAN_OUT_OLDEST_AGE: &str = "pgbus_fan_out_oldest_age_seconds";

/// The age past which a running bus warns of the oldest transaction holding the xmin
/// horizon back, by default
/// ([`BusBuilder::long_transaction_warning`](crate::BusBuilder::long_transaction_warning)),
/// and the dashboard shows a banner: 5 minutes.
pub const DEFAULT_LONG_TRANSACTION_WARNING: Duration = Duration::from_secs(300);

/// How often the leading bus samples the gauges by default: every 60 s (an idle bus's
/// largest cost after its beat; BENCHMARKS.md, "An idle bus").
pub const DEFAULT_GAUGE_INTERVAL: Duration = Duration::from_secs(60);

/// The most deliveries each gauge counts per subscription and state: a larger backlog
/// reads as this many. Counting further would cost every sample time in proportion to
/// the backlog; the age of the oldest due delivery, which says how far behind a
/// subscription is, is exact whatever the backlog. `pgbus status` counts exactly.
pub const GAUGE_COUNT_CAP: i64 = 100_000;

/// Describes every metric (its help text and unit) to the installed recorder, for
/// exporters that show them (Prometheus' `# HELP`). Call it once the recorder is
/// installed; recording works without it.
pub fn describe() {
    describe_counter!(
        PUBLISHED_EVENTS,
        Unit::Count,
        "Events inserted by publish calls (duplicates not counted)"
    );
    describe_counter!(
        DELIVERIES,
        Unit::Count,
        "Settlements written, by outcome: acked, failed, dead, released, stale, unknown"
    );
    describe_counter!(
        WAKEUPS,
        Unit::Count,
        "Claimer wake-ups by source: notify, poll, catch-up, linger"
    );
    describe_counter!(
        LEASES_EXPIRED,
        Unit::Count,
        "Expired leases returned to pending or dead-lettered by this bus"
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "Handler run time, by its outcome: acked, failed, released"
    );
    describe_histogram!(
        DELIVERY_LAG,
        Unit::Seconds,
        "Time from a delivery becoming due to its handler's start"
    );
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Time one claim statement took"
    );
    describe_histogram!(
        CLAIM_BATCH_SIZE,
        Unit::Count,
        "Deliveries returned by one claim statement"
    );
    describe_gauge!(
        BACKLOG,
        Unit::Count,
        "Deliveries by state: due, scheduled, processing, dead (counted up to 100000)"
    );
    describe_gauge!(
        OLDEST_DUE_AGE,
        Unit::Seconds,
        "Age of the oldest delivery that could be claimed now (0 when none)"
    );
    describe_gauge!(
        BLOCKED_KEYS,
        Unit::Count,
        "Ordering keys blocked by a dead head"
    );
    describe_gauge!(
        SUBSCRIPTION_PAUSED,
        "1 while the subscription is paused (its deliveries wait), 0 while it delivers"
    );
    describe_gauge!(
        FAN_OUT_BACKLOG,
        Unit::Count,
        "Committed events not yet turned into deliveries (counted up to 100000)"
    );
    describe_gauge!(
        FAN_OUT_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest committed event not yet turned into deliveries (0 when none)"
    );
    describe_gauge!(
        OLDEST_TRANSACTION_AGE,
        Unit::Seconds,
        "Age of the oldest transaction holding the xmin horizon back (0 when none)"
    );
    describe_gauge!(
        SLOT_XMIN_AGE,
        Unit::Count,
        "Age in transactions of the oldest xmin a replication slot holds (0 when none)"
    );
}

/// What holds the database's xmin horizon back, one row of the horizon statement
/// (`src/sql/`, `XMIN_HORIZON`). While a transaction holds it, VACUUM cannot remove
/// the rows deleted or updated since (settled deliveries among them): the indexes the
/// claims and settlements walk fill with dead entries and both slow down, tenfold and
/// more after minutes. Sampled with the gauges by a running bus (which warns past
/// [`BusBuilder::long_transaction_warning`](crate::BusBuilder::long_transaction_warning)),
/// and read by [`admin::status`](crate::admin::status).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct XminHorizon {
    /// Seconds since the oldest transaction of this database that holds the horizon (a
    /// session with a snapshot or a transaction id, or a prepared transaction) started;
    /// `None` when none does. Without `pg_read_all_stats` (or superuser), only the
    /// sessions of the connecting role are seen.
    pub oldest_transaction_age: Option<f64>,
    /// That transaction: `pid N (application, state)`, or `prepared transaction 'gid'`.
    pub oldest_transaction: Option<String>,
    /// The age, in transactions, of the oldest xmin a replication slot holds; `None` when
    /// none holds one.
    pub slot_xmin_age: Option<i64>,
}

impl XminHorizon {
    /// Reads the row of the horizon statement.
    pub(crate) fn from_row(row: &Row) -> Result<XminHorizon> {
        Ok(XminHorizon {
            oldest_transaction_age: row
                .try_get::<_, Option<f64>>("oldest_transaction_age")?
                .filter(|s| s.is_finite())
                .map(|s| s.max(0.0)),
            oldest_transaction: row.try_get("oldest_transaction")?,
            slot_xmin_age: row.try_get("slot_xmin_age")?,
        })
    }

    /// Sets the gauges [`OLDEST_TRANSACTION_AGE`] and [`SLOT_XMIN_AGE`] on the installed
    /// recorder.
    pub fn record(&self) {
        gauge!(OLDEST_TRANSACTION_AGE).set(self.oldest_transaction_age.unwrap_or(0.0));
        gauge!(SLOT_XMIN_AGE).set(self.slot_xmin_age.unwrap_or(0) as f64);
    }

    /// Whether the oldest transaction is older than `threshold`.
    pub fn older_than(&self, threshold: Duration) -> bool {
        self.oldest_transaction_age
            .is_some_and(|age| age > threshold.as_secs_f64())
    }
}

/// The events committed and not yet turned into deliveries: the first stage of the
/// backlog, before any subscription's (`pgbus.not_fanned_out`). Read by
/// [`admin::fan_out_backlog`](crate::admin::fan_out_backlog) and
/// [`admin::status`](crate::admin::status), and sampled with the gauges by a running bus.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct FanOutBacklog {
    /// The events, counted up to [`GAUGE_COUNT_CAP`].
    pub events: i64,
    /// Seconds since the oldest of them was written (among those counted); `None` when
    /// none waits.
    pub oldest_age: Option<f64>,
}

impl FanOutBacklog {
    /// Reads the row of `pgbus.not_fanned_out`.
    pub(crate) fn from_row(row: &Row) -> Result<FanOutBacklog> {
        Ok(FanOutBacklog {
            events: row.try_get("events")?,
            oldest_age: row
                .try_get::<_, Option<f64>>("oldest_age")?
                .filter(|s| s.is_finite())
                .map(|s| s.max(0.0)),
        })
    }

    /// Sets the gauges [`FAN_OUT_BACKLOG`] and [`FAN_OUT_OLDEST_AGE`] on the installed
    /// recorder.
    pub fn record(&self) {
        gauge!(FAN_OUT_BACKLOG).set(self.events as f64);
        gauge!(FAN_OUT_OLDEST_AGE).set(self.oldest_age.unwrap_or(0.0));
    }
}

/// One subscription's backlog, as the gauges report it: one row of the gauge statement
/// (`src/sql/`, `BACKLOG`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Backlog {
    /// The subscription.
    pub subscription: String,
    /// Pending deliveries due now (up to [`GAUGE_COUNT_CAP`]), those waiting behind their
    /// key's head included.
    pub due: i64,
    /// Pending deliveries due later: retries backing off, delayed events (up to the cap).
    pub scheduled: i64,
    /// Deliveries leased to a consumer (up to the cap).
    pub processing: i64,
    /// Dead letters (up to the cap).
    pub dead: i64,
    /// Seconds since the oldest delivery a consumer could claim now became due; `None`
    /// when none is due.
    pub oldest_due_age: Option<f64>,
    /// Keys of an ordered subscription whose head is a dead letter (up to the cap).
    pub blocked_keys: i64,
    /// Whether the subscription is paused: its consumers claim none of its deliveries.
    pub paused: bool,
}

impl Backlog {
    /// Reads one row of the gauge statement.
    pub(crate) fn from_row(row: &Row) -> Result<Backlog> {
        Ok(Backlog {
            subscription: row.try_get("subscription")?,
            due: row.try_get("due")?,
            scheduled: row.try_get("scheduled")?,
            processing: row.try_get("processing")?,
            dead: row.try_get("dead")?,
            oldest_due_age: row
                .try_get::<_, Option<f64>>("oldest_due_age")?
                .filter(|s| s.is_finite()),
            blocked_keys: row.try_get("blocked_keys")?,
            paused: row.try_get("paused")?,
        })
    }

    /// Sets the gauges [`BACKLOG`], [`OLDEST_DUE_AGE`], [`BLOCKED_KEYS`] and
    /// [`SUBSCRIPTION_PAUSED`] of this subscription on the installed recorder.
    pub fn record(&self) {
        let sub = SharedString::from(self.subscription.clone());
        for (state, n) in [
            ("due", self.due),
            ("scheduled", self.scheduled),
            ("processing", self.processing),
            ("dead", self.dead),
        ] {
            gauge!(BACKLOG, "subscription" => sub.clone(), "state" => state).set(n as f64);
        }
        gauge!(OLDEST_DUE_AGE, "subscription" => sub.clone())
            .set(self.oldest_due_age.unwrap_or(0.0).max(0.0));
        gauge!(BLOCKED_KEYS, "subscription" => sub.clone()).set(self.blocked_keys as f64);
        gauge!(SUBSCRIPTION_PAUSED, "subscription" => sub).set(f64::from(u8::from(self.paused)));
    }
}

/// What became of a settlement, as [`DELIVERIES`] labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeliveryOutcome {
    Acked,
    Failed,
    Dead,
    Released,
    Stale,
    /// Written or not, nobody can tell (a connection lost in flight).
    Unknown,
}

impl DeliveryOutcome {
    fn label(self) -> &'static str {
        match self {
            DeliveryOutcome::Acked => "acked",
            DeliveryOutcome::Failed => "failed",
            DeliveryOutcome::Dead => "dead",
            DeliveryOutcome::Released => "released",
            DeliveryOutcome::Stale => "stale",
            DeliveryOutcome::Unknown => "unknown",
        }
    }
}

/// What woke the claimer, as [`WAKEUPS`] labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wakeup {
    Notify,
    Poll,
    CatchUp,
    Linger,
}

fn label(sub: &Arc<str>) -> SharedString {
    SharedString::from(sub.clone())
}

/// Counts a settlement the database confirmed.
pub(crate) fn settled(sub: &Arc<str>, how: DeliveryOutcome) {
    counter!(DELIVERIES, "subscription" => label(sub), "outcome" => how.label()).increment(1);
}

/// Counts a wake-up of the claimer.
pub(crate) fn woke(source: Wakeup) {
    let source = match source {
        Wakeup::Notify => "notify",
        Wakeup::Poll => "poll",
        Wakeup::CatchUp => "catch-up",
        Wakeup::Linger => "linger",
    };
    counter!(WAKEUPS, "source" => source).increment(1);
}

/// Counts expired leases reaped.
pub(crate) fn leases_expired(n: u64) {
    counter!(LEASES_EXPIRED).increment(n);
}

/// Counts events inserted by a publish statement.
pub(crate) fn published(n: u64) {
    if n > 0 {
        counter!(PUBLISHED_EVENTS).increment(n);
    }
}

/// Records one claim statement: how long it took and how many it returned.
pub(crate) fn claimed(took: Duration, n: usize) {
    histogram!(CLAIM_DURATION).record(took.as_secs_f64());
    histogram!(CLAIM_BATCH_SIZE).record(n as f64);
}

/// Records a handler's start: the delivery had been due for `lag` seconds.
pub(crate) fn started(sub: &Arc<str>, lag: f64) {
    if lag.is_finite() {
        histogram!(DELIVERY_LAG, "subscription" => label(sub)).record(lag.max(0.0));
    }
}

/// Records a handler's run (or a stream consumer's, from hand-out to settlement).
pub(crate) fn handled(sub: &Arc<str>, outcome: &'static str, took: Duration) {
    histogram!(HANDLER_DURATION, "subscription" => label(sub), "outcome" => outcome)
        .record(took.as_secs_f64());
}
