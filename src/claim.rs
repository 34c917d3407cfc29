//! Claiming: the claimer turns wake-ups into claims (`FOR UPDATE SKIP LOCKED`, leased to
//! this bus) and yields the claimed deliveries as a stream, within the free slots and the
//! byte budget.
//!
//! It claims back to back while claims come back full; otherwise it waits for a
//! notification, the next due retry, a freed slot its quota waits for, or the fallback
//! poll interval, whichever comes first. A bus that claims a batch marks itself awake (in
//! the claim statement), so publishers need not notify it; once its claims come back
//! empty it lingers briefly, then marks itself asleep and claims once more.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::Stream;
use tokio::time::Instant;
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};
use tracing::Instrument;

use crate::backoff::{self, WarnGate};
use crate::conn::Db;
use crate::decode;
use crate::delivery::Delivery;
use crate::error::Result;
use crate::listen::Wake;
use crate::metrics::{self, Wakeup};
use crate::settle::{Action, Settler};
use crate::shutdown::Shutdown;
use crate::slot::{Slots, Sub};
use crate::sql;
use crate::stats::{self, Counters};

/// A claim that returns at least this many deliveries marks the bus awake: it is
/// draining, will claim again by itself, and publishers need not notify it.
const AWAKE_THRESHOLD: i32 = 4;
/// How long an awake bus keeps polling after its claims come back empty...
const LINGER: Duration = Duration::from_millis(50);
/// ...and how often.
const COOLDOWN: Duration = Duration::from_millis(1);
/// After falling asleep, claim again after these delays: a publisher that read "awake"
/// just before the bus fell asleep sent no notification.
const RECHECKS: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(50),
    Duration::from_millis(250),
];
/// The longest wait [`due_in`] returns: the claimer waits at most its poll interval anyway.
const MAX_DUE: f64 = 86_400.0;
/// How often a claim goes without floors (and at start): it finds a delivery that a writer
/// slower than the floors' margin left below one (`sql::CLAIM_CALL`). Behind a long transaction
/// it walks every index entry left since that began, once in this interval.
const WHOLE_SCAN: Duration = Duration::from_secs(30);

/// The claimer's settings (see the setters of [`BusBuilder`](crate::BusBuilder)).
#[derive(Debug, Clone)]
pub(crate) struct Pacing {
    pub(crate) batch_size: usize,
    pub(crate) claim_bytes: usize,
    pub(crate) lease: Duration,
    pub(crate) poll_interval: Duration,
    /// The fallback poll's interval while the listener is connected.
    pub(crate) idle_poll_interval: Duration,
    pub(crate) poll_only: bool,
}

/// The claimer: what it claims with and for, and where it puts what it claimed.
#[derive(Debug)]
pub(crate) struct Claimer {
    pub(crate) db: Db,
    pub(crate) worker: Arc<str>,
    pub(crate) subs: HashMap<Arc<str>, Arc<Sub>>,
    pub(crate) slots: Arc<Slots>,
    pub(crate) settler: Settler,
    pub(crate) wake: Arc<Wake>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) shutdown: Arc<Shutdown>,
    pub(crate) pacing: Pacing,
    /// Whether the listener is connected and LISTENing.
    pub(crate) listening: Arc<std::sync::atomic::AtomicBool>,
}

/// What the next claim asks for.
struct Ask {
    /// Per subscription, how many it may take.
    quotas: Vec<(Arc<str>, usize)>,
    /// How many in all (the free slots, at most a batch).
    free: usize,
    /// Bytes of JSON left in the budget.
    budget: usize,
}

/// The result of one claim statement.
#[derive(Default)]
struct Claimed {
    deliveries: Vec<Delivery>,
    /// Per subscription: how many were claimed.
    per_sub: HashMap<Arc<str>, usize>,
    next_due: Option<Duration>,
    /// Whether the byte budget left due deliveries behind.
    cut: bool,
    /// The next claim's floors, in the order of the subscriptions asked for.
    floors: Vec<Option<DateTime<Utc>>>,
}

/// What the claimer decides its next wait from: the last claim, asked and got.
struct Round {
    claimed: usize,
    free: usize,
    cut: bool,
    next_due: Option<Duration>,
    /// Whether a subscription's own limit held back due work (a freed slot may let it
    /// claim more).
    limited: bool,
}

/// The claimer's state between claims.
struct State {
    /// Marked awake: publishers do not notify; the claimer polls while it lingers.
    awake: bool,
    last_work: Instant,
    /// The next re-check after falling asleep ([`RECHECKS`]).
    recheck: usize,
    mark_errors: u32,
    /// Claim errors in a row, and whether this outage's first was logged as a warning.
    errors: u32,
    warned: bool,
    warn: WarnGate,
    /// Whether the pending claim was woken by the poll timer.
    by_poll: bool,
    round: Option<Round>,
    /// Per subscription, where its next claim's scan starts (`sql::CLAIM_CALL`'s `$8`); none
    /// for a subscription not claimed yet.
    floors: HashMap<Arc<str>, DateTime<Utc>>,
    /// When the last claim without floors ran.
    whole_scan: Option<Instant>,
}

impl Claimer {
    /// The stream of claimed deliveries; it ends when the bus is stopping.
    pub(crate) fn into_stream(self) -> impl Stream<Item = Delivery> + Send {
        async_stream::stream! {
            let mut state = State {
                awake: self.pacing.poll_only,
                last_work: Instant::now() - LINGER,
                recheck: RECHECKS.len(),
                mark_errors: 0,
                errors: 0,
                warned: false,
                warn: WarnGate::default(),
                by_poll: false,
                round: None,
                floors: HashMap::new(),
                whole_scan: None,
            };
            while let Some(batch) = self.next(&mut state).await {
                for delivery in batch {
                    yield delivery;
                }
            }
        }
    }

    /// Waits as the last round says, then claims until a claim returns deliveries; `None`
    /// once the bus is stopping.
    async fn next(&self, state: &mut State) -> Option<Vec<Delivery>> {
        loop {
            if let Some(round) = state.round.take()
                && !self.pause(state, round).await
            {
                return None;
            }
            if self.shutdown.is_stopping() {
                return None;
            }
            let Some(ask) = self.ask() else {
                // Every slot, or the byte budget, is taken: wait for a settlement.
                tokio::select! {
                    _ = self.shutdown.stopping() => return None,
                    _ = self.slots.freed() => continue,
                }
            };
            let started = Instant::now();
            let whole = state.whole_scan.is_none_or(|at| at.elapsed() >= WHOLE_SCAN);
            let floors: Vec<Option<DateTime<Utc>>> = ask
                .quotas
                .iter()
                .map(|(name, _)| {
                    if whole {
                        None
                    } else {
                        state.floors.get(name).copied()
                    }
                })
                .collect();
            let claimed = match self.claim(&ask, &floors).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    let delay = self.claim_failed(state, &e);
                    tokio::select! {
                        _ = self.shutdown.stopping() => return None,
                        _ = tokio::time::sleep(delay) => continue,
                    }
                }
            };
            if whole {
                state.whole_scan = Some(started);
            }
            for ((name, _), floor) in ask.quotas.iter().zip(&claimed.floors) {
                match floor {
                    Some(floor) => state.floors.insert(name.clone(), *floor),
                    None => state.floors.remove(name),
                };
            }
            let round = self.record(state, &ask, &claimed, started.elapsed());
            state.round = Some(round);
            if !claimed.deliveries.is_empty() {
                return Some(claimed.deliveries);
            }
        }
    }

    /// What the next claim may take, or `None` when every slot (or the byte budget) is
    /// taken.
    fn ask(&self) -> Option<Ask> {
        let free = self.slots.free().min(self.pacing.batch_size);
        let quotas: Vec<(Arc<str>, usize)> = self
            .subs
            .values()
            .map(|s| (s.name.clone(), s.quota(free)))
            .filter(|(_, q)| *q > 0)
            .collect();
        let holding = self.slots.bytes();
        let budget = self.pacing.claim_bytes.saturating_sub(holding);
        if free == 0 || quotas.is_empty() || (holding > 0 && budget == 0) {
            return None;
        }
        Some(Ask {
            quotas,
            free,
            budget,
        })
    }

    /// Counts a claim that succeeded and says what it means for the next wait.
    fn record(&self, state: &mut State, ask: &Ask, claimed: &Claimed, took: Duration) -> Round {
        if state.errors > 0 {
            if state.warned {
                tracing::info!(after_errors = state.errors, "pgbus claims succeed again");
            } else {
                tracing::debug!(after_errors = state.errors, "pgbus claims succeed again");
            }
            state.errors = 0;
        }
        let n = claimed.deliveries.len();
        stats::add(&self.stats.claims, 1);
        metrics::claimed(took, n);
        if n > 0 {
            state.last_work = Instant::now();
            if state.by_poll {
                stats::add(&self.stats.polls_found_work, 1);
            }
            state.awake |= n as i32 >= AWAKE_THRESHOLD;
        }
        state.by_poll = false;
        let limited = ask.quotas.iter().any(|(name, q)| {
            *q < ask.free && claimed.per_sub.get(name).copied().unwrap_or(0) >= *q
        });
        Round {
            claimed: n,
            free: ask.free,
            cut: claimed.cut,
            next_due: claimed.next_due,
            limited,
        }
    }

    /// Logs a failed claim (a warning at the start of an outage) and returns how long to
    /// wait before the next.
    fn claim_failed(&self, state: &mut State, e: &crate::Error) -> Duration {
        if state.errors == 0 {
            state.warned = state.warn.allow();
        }
        if state.errors == 0 && state.warned {
            tracing::warn!(error = %e, "pgbus claim failed; retrying with backoff");
        } else {
            tracing::debug!(error = %e, errors = state.errors, "pgbus claim failed again");
        }
        state.errors += 1;
        stats::add(&self.stats.claim_errors, 1);
        backoff::delay(state.errors, self.pacing.poll_interval)
    }

    /// Waits before the next claim, as the last round says: not at all after a full
    /// claim; briefly while lingering awake; otherwise until a wake-up, the next due
    /// delivery, a re-check or the poll. Falls asleep after lingering. False when the bus
    /// is stopping.
    async fn pause(&self, state: &mut State, round: Round) -> bool {
        if round.claimed >= round.free || round.cut {
            return true; // a full batch, or cut by the byte budget: there may be more
        }
        // A connected listener hears every commit that makes work: the poll is then only
        // a safety net, and the next due delivery bounds the wait.
        let poll = if self.listening.load(std::sync::atomic::Ordering::Acquire) {
            self.pacing
                .idle_poll_interval
                .max(self.pacing.poll_interval)
        } else {
            self.pacing.poll_interval
        };
        let mut wait = round.next_due.map_or(poll, |due| due.min(poll));
        let mut lingering = false;
        if state.awake && !self.pacing.poll_only {
            if state.last_work.elapsed() < LINGER {
                wait = wait.min(COOLDOWN);
                lingering = true;
            } else {
                match self.fall_asleep(state).await {
                    None => return true, // asleep: claim once more at once
                    Some(retry) => wait = wait.min(retry),
                }
            }
        } else if state.recheck < RECHECKS.len() {
            wait = wait.min(RECHECKS[state.recheck]);
            state.recheck += 1;
        }
        tokio::select! {
            _ = self.shutdown.stopping() => false,
            by_notification = self.wake.woken() => {
                if by_notification {
                    self.stats.woke(Wakeup::Notify);
                }
                true
            }
            _ = tokio::time::sleep(wait) => {
                if wait == poll {
                    self.stats.woke(Wakeup::Poll);
                    state.by_poll = true;
                } else if lingering {
                    self.stats.woke(Wakeup::Linger);
                }
                true
            }
            _ = self.slots.freed(), if round.limited => true,
        }
    }

    /// Marks the bus asleep, so that publishers notify it again. The mark waits for
    /// every publisher that read "awake" to commit (`pgbus.mark_asleep`), so the claim
    /// after it finds their events. A mark that fails leaves the row saying "awake" and
    /// nobody notifies: returns how soon to poll, on a backoff no longer than the
    /// re-checks', before trying the mark again.
    async fn fall_asleep(&self, state: &mut State) -> Option<Duration> {
        match self.mark_asleep().await {
            Ok(()) => {
                state.awake = false;
                state.mark_errors = 0;
                state.recheck = 0;
                None
            }
            Err(e) => {
                state.mark_errors += 1;
                tracing::debug!(error = %e, "pgbus could not mark itself asleep");
                Some(backoff::delay(
                    state.mark_errors,
                    RECHECKS[RECHECKS.len() - 1],
                ))
            }
        }
    }

    /// Runs `pgbus.mark_asleep`; a bus that begins to stop meanwhile cancels it (its row
    /// is removed at the end of the stop anyway).
    async fn mark_asleep(&self) -> Result<()> {
        let client = self.db.get().await?;
        let worker: &str = &self.worker;
        let work = async {
            self.db
                .query(&client, sql::CONSUMER_SLEEP, &[Type::TEXT], &[&worker])
                .await?;
            Ok(())
        };
        self.db
            .unless_stopped(&client, self.shutdown.token(), work)
            .await
            .unwrap_or(Ok(()))
    }

    /// Runs one claim statement and takes its rows.
    async fn claim(&self, ask: &Ask, floors: &[Option<DateTime<Utc>>]) -> Result<Claimed> {
        // `claim`, without a destination: one claim serves every subscription of the bus.
        let span = tracing::debug_span!(
            "pgbus.claim",
            otel.name = "claim",
            otel.kind = "consumer",
            messaging.system = "pgbus",
            messaging.operation.type = "receive",
            messaging.operation.name = "claim",
            messaging.batch.message_count = tracing::field::Empty,
            pgbus.requested = ask.free as i64,
        );
        let rows = self
            .claim_rows(ask, floors)
            .instrument(span.clone())
            .await?;
        let claimed = self.take(rows);
        // As an i64: the OpenTelemetry layer records a u64 as text.
        span.record(
            "messaging.batch.message_count",
            claimed.deliveries.len() as i64,
        );
        Ok(claimed)
    }

    async fn claim_rows(&self, ask: &Ask, floors: &[Option<DateTime<Utc>>]) -> Result<Vec<Row>> {
        let client = self.db.get().await?;
        let names: Vec<&str> = ask.quotas.iter().map(|(n, _)| &**n).collect();
        let limits: Vec<i32> = ask.quotas.iter().map(|(_, q)| *q as i32).collect();
        let total = ask.free as i32;
        let lease_ms = self.pacing.lease.as_millis() as i64;
        let budget = i64::try_from(ask.budget).unwrap_or(i64::MAX);
        let threshold = if self.pacing.poll_only {
            i32::MAX
        } else {
            AWAKE_THRESHOLD
        };
        let worker: &str = &self.worker;
        let params: [&(dyn ToSql + Sync); 8] = [
            &names, &limits, &total, &lease_ms, &worker, &threshold, &budget, &floors,
        ];
        let work = self
            .db
            .query(&client, sql::CLAIM_CALL, &sql::CLAIM_TYPES, &params);
        // Cancelled only once the stop is overdue: a claim that completes while the bus
        // stops hands its deliveries over to be released.
        let rows = self
            .db
            .unless_stopped(&client, self.shutdown.overdue(), work)
            .await;
        rows.unwrap_or(Ok(Vec::new()))
    }

    /// Takes the claimed rows: a slot and a delivery each. Every row of the claim is
    /// leased: from here on, nothing may fail the claim as a whole, or the other rows would
    /// wait for their leases to run out.
    fn take(&self, rows: Vec<Row>) -> Claimed {
        let mut claimed = Claimed::default();
        for row in rows {
            if let Ok(Some(secs)) = row.try_get::<_, Option<f64>>("secs") {
                claimed.next_due = due_in(secs);
            }
            claimed.cut |= row.try_get::<_, bool>("cut").unwrap_or(false);
            if claimed.floors.is_empty() {
                claimed.floors = row.try_get("floors").unwrap_or_default();
            }
            if let Some((sub, delivery)) = self.take_row(&row) {
                *claimed.per_sub.entry(sub).or_default() += 1;
                claimed.deliveries.extend(delivery);
            }
        }
        claimed
    }

    /// One claimed row as a delivery. An event this library cannot decode (written by
    /// SQL past the validation in `Event::encode`) must not fail the whole claim: that
    /// delivery alone is dead-lettered with the reason, and none is returned for it.
    fn take_row(&self, row: &Row) -> Option<(Arc<str>, Option<Delivery>)> {
        let (sub, seq, attempt) = match (
            row.try_get::<_, Option<&str>>("subscription"),
            row.try_get::<_, i64>("seq"),
            row.try_get::<_, i32>("attempts"),
        ) {
            (Ok(None), _, _) => return None, // nothing was claimed
            (Ok(Some(sub)), Ok(seq), Ok(attempt)) => (sub, seq, attempt),
            (sub, seq, attempt) => {
                // Cannot happen (NOT NULL columns, and names this bus sent); the lease
                // runs out and the reaper returns the delivery.
                tracing::error!(
                    ?sub,
                    ?seq,
                    ?attempt,
                    "pgbus cannot read a claimed delivery's key"
                );
                return None;
            }
        };
        // Not ours cannot happen: the statement filters by our names.
        let sub = self.subs.get(sub)?;
        match decode::event(row, seq) {
            Ok((event, bytes)) => {
                let slot = self.slots.take(sub, seq, attempt, bytes);
                let delivery = Delivery::new(event, slot, self.settler.clone())
                    .waited(row.try_get("waited").ok().flatten());
                Some((sub.name.clone(), Some(delivery)))
            }
            Err(e) => {
                let event = decode::placeholder(row, seq);
                tracing::error!(
                    messaging.destination.subscription.name = %sub.name,
                    pgbus.event_seq = seq,
                    messaging.message.id = %event.id,
                    error = %e,
                    "pgbus cannot decode an event; dead-lettering its delivery"
                );
                let slot = self.slots.take(sub, seq, attempt, 0);
                Delivery::new(event, slot, self.settler.clone()).settle_nowait(Action::Fail {
                    error: format!("the event cannot be decoded: {e}"),
                    delay: Duration::ZERO,
                    permanent: true,
                });
                Some((sub.name.clone(), None))
            }
        }
    }
}

/// The wait until the next due delivery, from the seconds PostgreSQL computed: any float
/// (NaN, infinite, negative, huge) gives a usable duration or none.
fn due_in(secs: f64) -> Option<Duration> {
    if secs.is_nan() {
        return None;
    }
    Some(Duration::from_secs_f64(secs.clamp(0.0, MAX_DUE)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_float_gives_a_usable_wait() {
        assert_eq!(due_in(f64::NAN), None);
        assert_eq!(due_in(-1.0), Some(Duration::ZERO));
        assert_eq!(due_in(-0.0), Some(Duration::ZERO));
        assert_eq!(due_in(f64::NEG_INFINITY), Some(Duration::ZERO));
        assert_eq!(due_in(1.5), Some(Duration::from_millis(1500)));
        assert_eq!(due_in(f64::INFINITY), Some(Duration::from_secs(86_400)));
        assert_eq!(due_in(f64::MAX), Some(Duration::from_secs(86_400)));
        assert_eq!(due_in(1e300), Some(Duration::from_secs(86_400)));
    }
}
