//! Maintenance: the duties a running bus does on timers besides claiming. It returns
//! expired leases (of any bus), extends the leases of what it holds, renews its row in
//! `pgbus.consumers`, repairs ordering keys left without a head, sweeps the log past
//! its retention, and samples its subscriptions' backlog gauges.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::backoff::WarnGate;
use crate::conn::Db;
use crate::error::{Error, Result};
use crate::listen::Wake;
use crate::shutdown::Shutdown;
use crate::slot::Slots;
use crate::sql;
use crate::stats::{self, Counters};

/// How long a bus's row in `pgbus.consumers` stays live without a heartbeat.
const CONSUMER_TTL: Duration = crate::admin::CONSUMER_TTL;
/// How often the bus renews it.
const CONSUMER_HEARTBEAT: Duration = Duration::from_secs(10);
/// How often a bus with ordered subscriptions looks for keys left without a head.
const REPAIR_INTERVAL: Duration = Duration::from_secs(300);
/// How often a bus runs the retention sweep (one batch, then more batches on the
/// following poll ticks while batches come back full).
const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);
/// The most expired leases, or headless keys, one statement handles.
const ROWS_PER_DUTY: i32 = 1000;

/// The bus's row in `pgbus.consumers`.
#[derive(Debug, Clone)]
pub(crate) struct Consumer {
    pub(crate) db: Db,
    pub(crate) worker: Arc<str>,
    pub(crate) subscriptions: Vec<Arc<str>>,
    pub(crate) poll_only: bool,
}

impl Consumer {
    /// Registers or renews the row; returns the bus's subscriptions that no longer exist.
    pub(crate) async fn heartbeat(&self) -> Result<Vec<String>> {
        let client = self.db.get().await?;
        let ttl_ms = CONSUMER_TTL.as_millis() as i64;
        let subs: Vec<&str> = self.subscriptions.iter().map(|s| &**s).collect();
        let info = format!(
            "pid {} on {}",
            std::process::id(),
            std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown host".into())
        );
        let worker: &str = &self.worker;
        let rows = self
            .db
            .query(
                &client,
                sql::CONSUMER_HEARTBEAT,
                &[
                    Type::TEXT,
                    Type::INT8,
                    Type::TEXT_ARRAY,
                    Type::TEXT,
                    Type::BOOL,
                ],
                &[&worker, &ttl_ms, &subs, &info, &self.poll_only],
            )
            .await?;
        let row = rows
            .first()
            .ok_or(Error::Unexpected("the consumer heartbeat returned no row"))?;
        Ok(row.try_get("missing")?)
    }

    /// Removes the row (at shutdown).
    pub(crate) async fn remove(&self) -> Result<()> {
        let client = self.db.get().await?;
        let worker: &str = &self.worker;
        self.db
            .query(&client, sql::CONSUMER_REMOVE, &[Type::TEXT], &[&worker])
            .await?;
        Ok(())
    }
}

/// The maintenance task's settings.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    pub(crate) poll_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) retention: Option<Duration>,
    /// How often the backlog gauges are sampled; `None`: never.
    pub(crate) gauges: Option<Duration>,
    /// The age past which the oldest transaction holding the xmin horizon is a warning
    /// (sampled with the gauges); `None`: never.
    pub(crate) long_transaction: Option<Duration>,
}

/// The maintenance task.
#[derive(Debug)]
pub(crate) struct Maintainer {
    pub(crate) consumer: Consumer,
    pub(crate) slots: Arc<Slots>,
    pub(crate) wake: Arc<Wake>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) shutdown: Arc<Shutdown>,
    pub(crate) schedule: Schedule,
    /// This bus's subscriptions found dropped by the last heartbeat.
    pub(crate) dropped: Arc<Mutex<Vec<String>>>,
    pub(crate) lease_warn: WarnGate,
}

fn every(period: Duration) -> Interval {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    interval
}

impl Maintainer {
    /// Runs until `stop` is cancelled. Once the bus is stopping it only extends leases
    /// (handlers may still run) and renews its row: no reaping, repair or sweep starts,
    /// and one in flight is cancelled on the server.
    pub(crate) async fn run(self, stop: CancellationToken) {
        // The first sweep runs on the first tick; then hourly, or on the next tick while
        // batches come back full. One batch per tick keeps the other duties on time.
        let mut next_sweep = Instant::now();
        let mut reap = every(self.schedule.poll_interval);
        let mut extend = every(self.schedule.lease / 3);
        let mut heartbeat = every(CONSUMER_HEARTBEAT);
        let mut repair = every(REPAIR_INTERVAL);
        let mut gauges = every(self.schedule.gauges.unwrap_or(REPAIR_INTERVAL));
        extend.tick().await;
        heartbeat.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = reap.tick(), if !self.shutdown.is_stopping() => {
                    if self.reap().await && Instant::now() >= next_sweep {
                        next_sweep = self.sweep().await;
                    }
                }
                _ = extend.tick() => self.extend(&stop).await,
                _ = heartbeat.tick() => self.heartbeat(&stop).await,
                _ = repair.tick(), if !self.shutdown.is_stopping() => self.repair().await,
                _ = gauges.tick(), if self.schedule.gauges.is_some()
                    && !self.shutdown.is_stopping() => self.sample_gauges().await,
            }
        }
    }

    fn db(&self) -> &Db {
        &self.consumer.db
    }

    async fn client(&self) -> Result<Object> {
        self.consumer.db.get().await
    }

    /// Returns expired leases (of any bus) to pending or the dead letters; true when it
    /// ran (or the bus is stopping).
    async fn reap(&self) -> bool {
        let reaped = async {
            let client = self.client().await?;
            let work = async {
                let rows = self
                    .db()
                    .query(&client, sql::REAP, &[Type::INT4], &[&ROWS_PER_DUTY])
                    .await?;
                let row = rows
                    .first()
                    .ok_or(Error::Unexpected("the reaper returned no row"))?;
                Ok((
                    row.try_get::<_, i64>("returned")?,
                    row.try_get::<_, i64>("dead")?,
                ))
            };
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match reaped.await {
            Ok(Some((pending, dead))) => {
                if pending + dead > 0 {
                    self.stats.leases_expired((pending + dead) as u64);
                    tracing::info!(returned = pending, dead, "pgbus reaped expired leases");
                }
                if pending > 0 {
                    self.wake.now();
                }
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::debug!(error = %e, "pgbus reaper failed");
                false
            }
        }
    }

    /// Extends the leases of every delivery this bus still holds.
    async fn extend(&self, stop: &CancellationToken) {
        let held = self.slots.held();
        if held.is_empty() {
            return;
        }
        let extended = async {
            let client = self.client().await?;
            let subs: Vec<&str> = held.iter().map(|(s, _, _)| &**s).collect();
            let seqs: Vec<i64> = held.iter().map(|(_, q, _)| *q).collect();
            let attempts: Vec<i32> = held.iter().map(|(_, _, a)| *a).collect();
            let lease_ms = self.schedule.lease.as_millis() as i64;
            let worker: &str = &self.consumer.worker;
            let params: [&(dyn ToSql + Sync); 5] = [&subs, &seqs, &attempts, &lease_ms, &worker];
            let work = self.db().query(
                &client,
                sql::EXTEND,
                &[
                    Type::TEXT_ARRAY,
                    Type::INT8_ARRAY,
                    Type::INT4_ARRAY,
                    Type::INT8,
                    Type::TEXT,
                ],
                &params,
            );
            self.db()
                .unless_stopped(&client, stop, work)
                .await
                .transpose()
        };
        if let Err(e) = extended.await {
            crate::warn_limited!(gate = &self.lease_warn; error = %e, "pgbus could not extend leases");
        }
    }

    /// Renews the bus's row, and says when one of its subscriptions was dropped.
    async fn heartbeat(&self, stop: &CancellationToken) {
        let beat = tokio::select! {
            r = self.consumer.heartbeat() => r,
            _ = stop.cancelled() => return,
        };
        match beat {
            Ok(missing) => self.note_dropped(missing),
            Err(e) => tracing::debug!(error = %e, "pgbus consumer heartbeat failed"),
        }
    }

    /// Records which of this bus's subscriptions were dropped, and says so once per drop.
    fn note_dropped(&self, missing: Vec<String>) {
        let mut known = self.dropped.lock().unwrap_or_else(|p| p.into_inner());
        for name in missing.iter().filter(|n| !known.contains(n)) {
            tracing::error!(
                messaging.destination.subscription.name = %name,
                "pgbus subscription was dropped while this bus consumes it: it receives nothing \
                 until it is registered again (restart this consumer, or stop it)"
            );
        }
        for name in known.iter().filter(|n| !missing.contains(n)) {
            tracing::info!(
                messaging.destination.subscription.name = %name,
                "pgbus subscription is registered again"
            );
        }
        *known = missing;
    }

    /// Repairs keys of ordered subscriptions left without a head.
    async fn repair(&self) {
        let repaired = async {
            let client = self.client().await?;
            let work = self
                .db()
                .query(&client, sql::REPAIR, &[Type::INT4], &[&ROWS_PER_DUTY]);
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match repaired.await {
            Ok(Some(rows)) if !rows.is_empty() => {
                for row in &rows {
                    tracing::error!(
                        messaging.destination.subscription.name =
                            row.try_get::<_, &str>("subscription").unwrap_or_default(),
                        pgbus.ordering_key =
                            row.try_get::<_, &str>("ordering_key").unwrap_or_default(),
                        pgbus.event_seq = row.try_get::<_, i64>("event_seq").unwrap_or_default(),
                        "pgbus repaired an ordering key that had no head"
                    );
                }
                stats::add(&self.stats.repaired, rows.len() as u64);
                self.wake.now();
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "pgbus ordering repair failed"),
        }
    }

    /// Samples the backlog gauges of this bus's subscriptions ([`sql::BACKLOG`]) and sets
    /// them on the installed recorder.
    async fn sample_gauges(&self) {
        let sampled = async {
            let client = self.client().await?;
            let subs: Vec<&str> = self.consumer.subscriptions.iter().map(|s| &**s).collect();
            let cap = crate::metrics::GAUGE_COUNT_CAP;
            let params: [&(dyn ToSql + Sync); 2] = [&subs, &cap];
            let work = self
                .db()
                .query(&client, sql::BACKLOG, &sql::BACKLOG_TYPES, &params);
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match sampled.await {
            Ok(Some(rows)) => {
                for row in &rows {
                    match crate::metrics::Backlog::from_row(row) {
                        Ok(backlog) => backlog.record(),
                        Err(e) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
                    }
                }
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "pgbus could not sample the backlog gauges"),
        }
        self.sample_fan_out().await;
        self.sample_horizon().await;
    }

    /// Samples the events not yet turned into deliveries ([`sql::FAN_OUT_BACKLOG`]) and
    /// sets their gauges.
    async fn sample_fan_out(&self) {
        let sampled = async {
            let client = self.client().await?;
            let cap = crate::metrics::GAUGE_COUNT_CAP;
            let params: [&(dyn ToSql + Sync); 1] = [&cap];
            let work = self.db().query(
                &client,
                sql::FAN_OUT_BACKLOG,
                &sql::FAN_OUT_BACKLOG_TYPES,
                &params,
            );
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match sampled.await {
            Ok(Some(rows)) => match rows.first().map(crate::metrics::FanOutBacklog::from_row) {
                Some(Ok(backlog)) => backlog.record(),
                Some(Err(e)) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
                None => {}
            },
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "pgbus could not sample the fan-out gauges"),
        }
    }

    /// Samples what holds the xmin horizon back ([`sql::XMIN_HORIZON`]), sets its gauges,
    /// and warns (rate-limited) when the oldest transaction is older than the schedule's
    /// threshold.
    async fn sample_horizon(&self) {
        let sampled = async {
            let client = self.client().await?;
            let work = self.db().query(&client, sql::XMIN_HORIZON, &[], &[]);
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        let horizon = match sampled.await {
            Ok(Some(rows)) => match rows.first().map(crate::metrics::XminHorizon::from_row) {
                Some(Ok(horizon)) => horizon,
                Some(Err(e)) => return tracing::debug!(error = %e, "pgbus cannot read the horizon"),
                None => return,
            },
            Ok(None) => return,
            Err(e) => return tracing::debug!(error = %e, "pgbus could not sample the horizon"),
        };
        horizon.record();
        if let Some(threshold) = self.schedule.long_transaction
            && horizon.older_than(threshold)
        {
            crate::warn_limited!(
                age_seconds = horizon.oldest_transaction_age.unwrap_or_default().round() as i64,
                transaction = horizon.oldest_transaction.as_deref().unwrap_or(""),
                "pgbus sees a long transaction holding the xmin horizon back: VACUUM cannot \
                 remove settled deliveries until it ends, and claims slow down (end it, or \
                 see the README's \"A long transaction\")"
            );
        }
    }

    /// Runs one retention sweep batch; returns when the next one is due.
    async fn sweep(&self) -> Instant {
        let later = Instant::now() + SWEEP_INTERVAL;
        let Some(retention) = self.schedule.retention else {
            return later;
        };
        let batch = crate::admin::DEFAULT_SWEEP_BATCH;
        let swept = async {
            let client = self.client().await?;
            let work = self.db().with_settings(
                &client,
                crate::admin::sweep_batch(&**client, retention, batch),
            );
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        match swept.await {
            Ok(Some(swept)) => {
                if swept.events > 0 {
                    tracing::info!(
                        events = swept.events,
                        failures = swept.failures,
                        "pgbus swept events past retention"
                    );
                }
                if swept.events >= batch as u64 {
                    Instant::now()
                } else {
                    later
                }
            }
            Ok(None) => later,
            Err(e) => {
                crate::warn_limited!(error = %e, "pgbus retention sweep failed");
                later
            }
        }
    }
}
