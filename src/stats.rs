//! The counters a running bus keeps, and the snapshot of them it reports. Each fact is
//! counted once, here: the methods of [`Counters`] also record it as a metric
//! ([`crate::metrics`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{self, DeliveryOutcome, Wakeup};

/// Counters of a running bus, read with [`RunningBus::stats`](crate::RunningBus::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Deliveries completed (acknowledged and written). A completion in the
    /// application's transaction (`ack_in`) counts when its statement ran, even if that
    /// transaction then rolled back.
    pub delivered: u64,
    /// Failed attempts written (each retried or dead-lettered).
    pub failed: u64,
    /// Deliveries that became dead letters here.
    pub dead_lettered: u64,
    /// Claimed deliveries released unstarted (at shutdown, or dropped while buffered).
    pub released: u64,
    /// Settlements rejected because the lease had been taken over (stale worker), `ack_in`
    /// included.
    pub stale_rejected: u64,
    /// Settlements whose outcome is unknown: the connection was lost with the statement
    /// (or its `COMMIT`) in flight, and no later try could tell whether it had been
    /// written ([`Error::SettleUnknown`](crate::Error::SettleUnknown)). Never counted as
    /// stale: a retry that finds the lease gone may have found the first try's work.
    pub unknown_outcomes: u64,
    /// Claim statements run.
    pub claims: u64,
    /// Wake-ups caused by a notification.
    pub wakeups_by_notification: u64,
    /// Wake-ups by the fallback poll timer.
    pub wakeups_by_poll: u64,
    /// Poll wake-ups whose claim found work that no notification had announced.
    pub polls_found_work: u64,
    /// Times the listener reconnected.
    pub reconnects: u64,
    /// Expired leases this bus returned to pending or dead-lettered.
    pub reaped: u64,
    /// Claim statements that failed.
    pub claim_errors: u64,
    /// Settlements given up: a batch that could not be written, or, once a refused batch
    /// is split, each single settlement PostgreSQL still refuses.
    pub settle_errors: u64,
    /// Ordering keys found without a head and repaired (should stay 0).
    pub repaired: u64,
    /// Times this bus was elected to lead the maintenance (reaping, repair, the sweep,
    /// the gauges); [`RunningBus::is_leader`](crate::RunningBus::is_leader) says whether
    /// it leads now.
    pub elected: u64,
    /// Reaper runs (each returns the expired leases of every bus); only a leader reaps.
    pub reaps: u64,
}

/// The live counters, shared by the bus's tasks.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) delivered: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) stale_rejected: AtomicU64,
    pub(crate) unknown_outcomes: AtomicU64,
    pub(crate) claims: AtomicU64,
    pub(crate) wakeups_by_notification: AtomicU64,
    pub(crate) wakeups_by_poll: AtomicU64,
    pub(crate) polls_found_work: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) reaped: AtomicU64,
    pub(crate) claim_errors: AtomicU64,
    pub(crate) settle_errors: AtomicU64,
    pub(crate) repaired: AtomicU64,
    pub(crate) elected: AtomicU64,
    pub(crate) reaps: AtomicU64,
}

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    /// Counts a settlement the database confirmed (or one whose outcome nobody can know),
    /// for `sub`.
    pub(crate) fn settled(&self, sub: &Arc<str>, how: DeliveryOutcome) {
        match how {
            DeliveryOutcome::Acked => add(&self.delivered, 1),
            DeliveryOutcome::Failed => add(&self.failed, 1),
            DeliveryOutcome::Dead => {
                add(&self.failed, 1);
                add(&self.dead_lettered, 1);
            }
            DeliveryOutcome::Released => add(&self.released, 1),
            DeliveryOutcome::Stale => add(&self.stale_rejected, 1),
            DeliveryOutcome::Unknown => add(&self.unknown_outcomes, 1),
        }
        metrics::settled(sub, how);
    }

    /// Counts a wake-up of the claimer.
    pub(crate) fn woke(&self, source: Wakeup) {
        match source {
            Wakeup::Notify => add(&self.wakeups_by_notification, 1),
            Wakeup::Poll => add(&self.wakeups_by_poll, 1),
            Wakeup::CatchUp | Wakeup::Linger => {}
        }
        metrics::woke(source);
    }

    /// Counts expired leases reaped.
    pub(crate) fn leases_expired(&self, n: u64) {
        add(&self.reaped, n);
        metrics::leases_expired(n);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            delivered: r(&self.delivered),
            failed: r(&self.failed),
            dead_lettered: r(&self.dead_lettered),
            released: r(&self.released),
            stale_rejected: r(&self.stale_rejected),
            unknown_outcomes: r(&self.unknown_outcomes),
            claims: r(&self.claims),
            wakeups_by_notification: r(&self.wakeups_by_notification),
            wakeups_by_poll: r(&self.wakeups_by_poll),
            polls_found_work: r(&self.polls_found_work),
            reconnects: r(&self.reconnects),
            reaped: r(&self.reaped),
            claim_errors: r(&self.claim_errors),
            settle_errors: r(&self.settle_errors),
            repaired: r(&self.repaired),
            elected: r(&self.elected),
            reaps: r(&self.reaps),
        }
    }
}
