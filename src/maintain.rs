//! Maintenance: the duties a running bus does on timers besides claiming. Every bus
//! extends the leases of what it holds and renews its row in `pgbus.consumers`; one
//! bus at a time, elected through that renewal (`pgbus.beat`), also returns expired
//! leases (of any bus), repairs ordering keys left without a head, sweeps the log past
//! its retention, and samples the backlog gauges. The others only claim.

use std::sync::atomic::{AtomicBool, Ordering};
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

/// How often a bus with ordered subscriptions looks for keys left without a head.
const REPAIR_INTERVAL: Duration = Duration::from_secs(300);
/// How often a bus runs the retention sweep (one batch, then more batches a poll
/// interval apart while batches come back full).
const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);
/// The most expired leases, or headless keys, one statement handles.
const ROWS_PER_DUTY: i32 = 1000;

/// How often a bus renews its row and runs for leadership, given the leadership's
/// length and its own delivery lease. A leader renews three times per leadership, and
/// at least twice per delivery lease, so that it sees every lease before it runs out;
/// a follower beats every 1.25 leaderships: a leader that died without leaving is
/// replaced within a leadership and a follower's beat.
pub(crate) fn beat_interval(leads: bool, leadership: Duration, lease: Duration) -> Duration {
    if leads {
        (leadership / 3)
            .min(lease / 2)
            .max(Duration::from_millis(100))
    } else {
        leadership + leadership / 4
    }
}

/// How long a bus's row stays live without a beat: two of a follower's beats.
pub(crate) fn consumer_ttl(leadership: Duration) -> Duration {
    2 * beat_interval(false, leadership, leadership)
}

/// What one beat returned.
#[derive(Debug)]
pub(crate) struct Beat {
    /// The bus's subscriptions that no longer exist.
    pub(crate) missing: Vec<String>,
    /// Whether this bus leads the maintenance now.
    pub(crate) leads: bool,
    /// For a leader: how soon the earliest lease of any bus runs out.
    pub(crate) next_expiry: Option<Duration>,
    /// For a follower: how soon the current leadership runs out.
    pub(crate) leader_expiry: Option<Duration>,
}

/// The bus's row in `pgbus.consumers`.
#[derive(Debug, Clone)]
pub(crate) struct Consumer {
    pub(crate) db: Db,
    pub(crate) worker: Arc<str>,
    pub(crate) subscriptions: Vec<Arc<str>>,
    pub(crate) poll_only: bool,
    /// How long a leadership lasts without renewal.
    pub(crate) leadership: Duration,
}

impl Consumer {
    /// Registers or renews the row and, with `lead`, runs for (or renews) the
    /// maintenance leadership. When `stop` fires first, the statement is cancelled on the
    /// server (a beat can wait for a lock, holding the leader row) and the beat fails
    /// with [`Error::Closed`].
    pub(crate) async fn beat(&self, lead: bool, stop: &CancellationToken) -> Result<Beat> {
        let client = self.db.get().await?;
        let ttl_ms = consumer_ttl(self.leadership).as_millis() as i64;
        let lead_ms = lead.then(|| self.leadership.as_millis().max(1) as i64);
        let subs: Vec<&str> = self.subscriptions.iter().map(|s| &**s).collect();
        let info = format!(
            "pid {} on {}",
            std::process::id(),
            std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown host".into())
        );
        let worker: &str = &self.worker;
        let params: [&(dyn ToSql + Sync); 6] =
            [&worker, &ttl_ms, &subs, &info, &self.poll_only, &lead_ms];
        let query = self.db.query(
            &client,
            sql::CONSUMER_BEAT,
            &[
                Type::TEXT,
                Type::INT8,
                Type::TEXT_ARRAY,
                Type::TEXT,
                Type::BOOL,
                Type::INT8,
            ],
            &params,
        );
        let rows = self
            .db
            .unless_stopped(&client, stop, query)
            .await
            .ok_or(Error::Closed)??;
        let row = rows
            .first()
            .ok_or(Error::Unexpected("the consumer beat returned no row"))?;
        let next_expiry: Option<i64> = row.try_get("next_expiry_ms")?;
        let leader_expiry: Option<i64> = row.try_get("leader_expiry_ms")?;
        Ok(Beat {
            leader_expiry: leader_expiry.map(|ms| Duration::from_millis(ms.max(0) as u64)),
            missing: row.try_get("missing")?,
            leads: row.try_get("leads")?,
            next_expiry: next_expiry.map(|ms| Duration::from_millis(ms.max(0) as u64)),
        })
    }

    /// Gives up the leadership, if this bus holds it (as its shutdown begins); cancelled
    /// on the server when `stop` fires first.
    pub(crate) async fn resign(&self, stop: &CancellationToken) -> Result<()> {
        let client = self.db.get().await?;
        let worker: &str = &self.worker;
        let params: [&(dyn ToSql + Sync); 1] = [&worker];
        let query = self
            .db
            .query(&client, sql::LEADER_RESIGN, &[Type::TEXT], &params);
        self.db
            .unless_stopped(&client, stop, query)
            .await
            .ok_or(Error::Closed)??;
        Ok(())
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
    /// Whether this bus leads the maintenance ([`RunningBus::is_leader`]).
    ///
    /// [`RunningBus::is_leader`]: crate::RunningBus::is_leader
    pub(crate) leads: Arc<AtomicBool>,
}

fn every(period: Duration) -> Interval {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    interval
}

/// The leader's duties that are due, by when.
struct Duties {
    /// The next reap: when the earliest lease runs out, and then every poll interval
    /// while any delivery is leased (the last beat saw one, or this bus holds one);
    /// `None`: nothing is leased.
    reap: Option<Instant>,
    /// Whether the last beat saw a leased delivery.
    leased: bool,
    sweep: Instant,
    repair: Instant,
    gauges: Option<Instant>,
}

impl Maintainer {
    /// Runs until `stop` is cancelled. Once the bus is stopping it only extends leases
    /// (handlers may still run) and renews its row: no reaping, repair or sweep starts,
    /// and one in flight is cancelled on the server.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut extend = every(self.schedule.lease / 3);
        extend.tick().await;
        // The bus beat once as it started; it runs for leadership at once.
        let mut next_beat = Instant::now();
        let mut lead_until: Option<Instant> = None;
        let mut duties: Option<Duties> = None;
        loop {
            let leading = lead_until.is_some_and(|until| Instant::now() < until);
            if !leading {
                lead_until = None;
                if duties.take().is_some() {
                    self.lost_lead();
                }
            }
            let active = leading && !self.shutdown.is_stopping();
            let due = duties.as_ref().map(|d| {
                [Some(d.sweep), Some(d.repair), d.reap, d.gauges]
                    .into_iter()
                    .flatten()
                    .min()
                    .unwrap_or(d.sweep)
            });
            // A leader also looks every poll interval (no statement unless a duty is due)
            // whether this bus has claimed since: its leases are then reaped when they
            // run out without waiting for the next beat.
            let look = active.then(|| Instant::now() + self.schedule.poll_interval);
            let until = due
                .filter(|_| active)
                .into_iter()
                .chain(look)
                .chain(lead_until)
                .fold(next_beat, Instant::min);
            tokio::select! {
                _ = stop.cancelled() => return,
                // Stopping: hand the leadership over now, not when it runs out (the duty
                // in flight was cancelled before this branch can run).
                _ = self.shutdown.stopping(), if leading => {
                    if let Err(e) = self.consumer.resign(&stop).await {
                        tracing::debug!(error = %e, "pgbus could not resign the maintenance leadership");
                    }
                    if stop.is_cancelled() {
                        return;
                    }
                    lead_until = None;
                }
                _ = extend.tick() => self.extend(&stop).await,
                _ = self.wake.leader_left(), if !leading => next_beat = Instant::now(),
                _ = tokio::time::sleep_until(until) => {
                    let now = Instant::now();
                    if now >= next_beat {
                        let sent = Instant::now();
                        let beat = self.consumer.beat(!self.shutdown.is_stopping(), &stop).await;
                        if stop.is_cancelled() {
                            return;
                        }
                        let mut leader_expiry = None;
                        match beat {
                            Ok(beat) => {
                                leader_expiry = beat.leader_expiry;
                                self.note_dropped(beat.missing);
                                if beat.leads {
                                    lead_until = Some(sent + self.consumer.leadership);
                                    let d = duties.get_or_insert_with(|| self.took_lead());
                                    d.leased = beat.next_expiry.is_some();
                                    if let Some(expiry) = beat.next_expiry {
                                        let at = Instant::now()
                                            + expiry.min(self.schedule.poll_interval);
                                        d.reap = Some(d.reap.map_or(at, |r| r.min(at)));
                                    }
                                } else {
                                    lead_until = None;
                                }
                            }
                            Err(e) => tracing::debug!(error = %e, "pgbus consumer beat failed"),
                        }
                        let leads = lead_until.is_some();
                        let mut wait =
                            beat_interval(leads, self.consumer.leadership, self.schedule.lease);
                        // A leadership shorter than this bus's own (another bus's shorter
                        // lease, or a leader that stopped renewing): run for it as it ends.
                        if let Some(left) = leader_expiry
                            && left < self.consumer.leadership / 2
                        {
                            wait = wait.min(left + Duration::from_millis(10));
                        }
                        next_beat = Instant::now() + wait;
                    } else if active && let Some(d) = duties.as_mut() {
                        self.run_due(d, now).await;
                    }
                }
            }
        }
    }

    /// This bus has just been elected: every duty is due at once.
    fn took_lead(&self) -> Duties {
        tracing::info!(worker = %self.consumer.worker, "pgbus bus leads the maintenance");
        self.leads.store(true, Ordering::Release);
        stats::add(&self.stats.elected, 1);
        let now = Instant::now();
        Duties {
            reap: Some(now),
            leased: false,
            sweep: now,
            repair: now,
            gauges: self.schedule.gauges.map(|_| now),
        }
    }

    /// This bus's leadership ran out or went to another.
    fn lost_lead(&self) {
        tracing::info!(worker = %self.consumer.worker, "pgbus bus no longer leads the maintenance");
        self.leads.store(false, Ordering::Release);
    }

    /// Runs the leader's duties that are due at `now`, one at a time.
    async fn run_due(&self, d: &mut Duties, now: Instant) {
        if d.reap.is_none() && self.slots.taken() > 0 {
            d.reap = Some(now);
        }
        if d.reap.is_some_and(|at| at <= now) {
            let found = self.reap().await;
            let again = d.leased || self.slots.taken() > 0 || found != Some(0);
            d.reap = again.then(|| Instant::now() + self.schedule.poll_interval);
        } else if d.sweep <= now {
            d.sweep = self
                .sweep()
                .await
                .max(Instant::now() + self.schedule.poll_interval);
        } else if d.repair <= now {
            self.repair().await;
            d.repair = Instant::now() + REPAIR_INTERVAL;
        } else if let (Some(at), Some(every)) = (d.gauges, self.schedule.gauges)
            && at <= now
        {
            self.sample_gauges().await;
            d.gauges = Some(Instant::now() + every);
        }
    }

    fn db(&self) -> &Db {
        &self.consumer.db
    }

    async fn client(&self) -> Result<Object> {
        self.consumer.db.get().await
    }

    /// Returns expired leases (of any bus) to pending or the dead letters; how many, or
    /// `None` when it failed (or the bus is stopping).
    async fn reap(&self) -> Option<i64> {
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
        stats::add(&self.stats.reaps, 1);
        match reaped.await {
            Ok(Some((pending, dead))) => {
                if pending + dead > 0 {
                    self.stats.leases_expired((pending + dead) as u64);
                    tracing::info!(returned = pending, dead, "pgbus reaped expired leases");
                }
                if pending > 0 {
                    self.wake.now();
                }
                Some(pending + dead)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(error = %e, "pgbus reaper failed");
                None
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

    /// Samples the backlog gauges of every live bus's subscriptions
    /// ([`sql::BACKLOG_LIVE`]), the events not yet turned into deliveries
    /// ([`sql::FAN_OUT_BACKLOG`]) and what holds the xmin horizon back
    /// ([`sql::XMIN_HORIZON`]), in one transaction, and sets them on the installed
    /// recorder; warns (rate-limited) when the oldest transaction is older than the
    /// schedule's threshold.
    async fn sample_gauges(&self) {
        let client = match self.client().await {
            Ok(client) => client,
            Err(e) => return tracing::debug!(error = %e, "pgbus could not sample the gauges"),
        };
        let subs: Vec<&str> = self.consumer.subscriptions.iter().map(|s| &**s).collect();
        let cap = crate::metrics::GAUGE_COUNT_CAP;
        let sampled = async {
            let work = self.db().in_one_transaction(&client, async {
                let backlog = self
                    .db()
                    .query(
                        &client,
                        sql::BACKLOG_LIVE,
                        &sql::BACKLOG_TYPES,
                        &[&subs, &cap],
                    )
                    .await?;
                let fan_out = self
                    .db()
                    .query(
                        &client,
                        sql::FAN_OUT_BACKLOG,
                        &sql::FAN_OUT_BACKLOG_TYPES,
                        &[&cap],
                    )
                    .await?;
                let horizon = self
                    .db()
                    .query(&client, sql::XMIN_HORIZON, &[], &[])
                    .await?;
                Ok((backlog, fan_out, horizon))
            });
            self.db()
                .unless_stopped(&client, self.shutdown.token(), work)
                .await
                .transpose()
        };
        let (backlog, fan_out, horizon) = match sampled.await {
            Ok(Some(rows)) => rows,
            Ok(None) => {
                // Cancelled inside its transaction: the connection is not given back.
                drop(deadpool_postgres::Object::take(client));
                return;
            }
            Err(e) => return tracing::debug!(error = %e, "pgbus could not sample the gauges"),
        };
        for row in &backlog {
            match crate::metrics::Backlog::from_row(row) {
                Ok(backlog) => backlog.record(),
                Err(e) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
            }
        }
        match fan_out.first().map(crate::metrics::FanOutBacklog::from_row) {
            Some(Ok(backlog)) => backlog.record(),
            Some(Err(e)) => tracing::debug!(error = %e, "pgbus cannot read a gauge sample"),
            None => {}
        }
        let horizon = match horizon.first().map(crate::metrics::XminHorizon::from_row) {
            Some(Ok(horizon)) => horizon,
            Some(Err(e)) => return tracing::debug!(error = %e, "pgbus cannot read the horizon"),
            None => return,
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
                 see docs/operations.md, \"A long transaction\")"
            );
        }
    }

    /// Runs one retention sweep batch; returns when the next one is due.
    async fn sweep(&self) -> Instant {
        let later = Instant::now() + SWEEP_INTERVAL;
        let Some(retention) = self.schedule.retention else {
            return later;
        };
        let batch = crate::retention::DEFAULT_SWEEP_BATCH;
        let swept = async {
            let client = self.client().await?;
            let work = self.db().with_settings(
                &client,
                crate::retention::sweep_batch(&**client, retention, batch),
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
