//! Maintenance: the duties a running bus does on timers besides claiming. Every bus
//! extends the leases of what it holds and renews its row in `pgbus.consumers`; one
//! bus at a time, elected through that renewal (`pgbus.beat`), also returns expired
//! leases (of any bus), repairs ordering keys left without a head, sweeps the log past
//! its retention, and samples the backlog gauges. The others only claim.
//!
//! One file per duty: the heartbeat and the election (`consumer.rs`), reaping and
//! extending leases (`leases.rs`), ordering repair (`repair.rs`), the backlog gauges and
//! the horizon (`gauges.rs`) and the retention sweep (`sweep.rs`); this file is the
//! schedule that runs them.

mod consumer;
mod gauges;
mod leases;
mod repair;
mod sweep;

pub(crate) use consumer::{Consumer, beat_interval};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::backoff::WarnGate;
use crate::conn::Db;
use crate::error::Result;
use crate::listen::Wake;
use crate::shutdown::Shutdown;
use crate::slot::Slots;
use crate::stats::{self, Counters};

/// How often a bus with ordered subscriptions looks for keys left without a head.
pub(super) const REPAIR_INTERVAL: Duration = Duration::from_secs(300);
/// How often a bus runs the retention sweep (one batch, then more batches a poll
/// interval apart while batches come back full).
pub(super) const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);
/// The most expired leases, or headless keys, one statement handles.
pub(super) const ROWS_PER_DUTY: i32 = 1000;

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
}
