//! Claiming, settling, extending and reaping, and the claim stream that drives them.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::time::Instant;
use tokio_postgres::types::Type;
use tracing::Instrument;

use crate::bus::Shared;
use crate::decode::{self, col};
use crate::error::{Error, Result};
use crate::sql;
use crate::subscribe::{Action, Delivery, Outcome, SettleMsg};

/// A claim that returns at least this many deliveries marks the bus awake: it is
/// draining, will claim again by itself, and publishers need not notify it.
pub(crate) const AWAKE_THRESHOLD: i32 = 4;
/// How long an awake bus keeps polling after its claims come back empty...
pub(crate) const LINGER: Duration = Duration::from_millis(50);
/// ...and how often.
pub(crate) const COOLDOWN: Duration = Duration::from_millis(1);
/// After falling asleep, claim again after these delays: a publisher that read "awake"
/// just before the bus fell asleep sent no notification.
pub(crate) const RECHECKS: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(50),
    Duration::from_millis(250),
];

/// The result of one claim statement.
struct Claimed {
    deliveries: Vec<Delivery>,
    /// Per subscription: how many were claimed.
    per_sub: HashMap<Arc<str>, usize>,
    next_due: Option<Duration>,
    /// Whether the byte budget left due deliveries behind.
    cut: bool,
    /// Every delivery claimed (handed out or dead-lettered), with its attempt and the
    /// bytes of JSON it holds.
    sizes: Vec<(HeldKey, i32, usize)>,
}

type HeldKey = (Arc<str>, i64);

/// The bytes of JSON held by the deliveries this stream claimed and that are not settled
/// yet (still in `Shared::held` with the same attempt).
#[derive(Debug, Default)]
struct HeldBytes {
    by_key: HashMap<HeldKey, (i32, usize)>,
}

impl HeldBytes {
    /// Forgets settled deliveries; returns the bytes of the others.
    fn current(&mut self, shared: &Shared) -> usize {
        if self.by_key.is_empty() {
            return 0;
        }
        let held = shared.held.lock().expect("held lock");
        self.by_key
            .retain(|key, (attempt, _)| held.get(key) == Some(attempt));
        drop(held);
        self.by_key.values().map(|(_, bytes)| bytes).sum()
    }

    fn add(&mut self, sizes: Vec<(HeldKey, i32, usize)>) {
        for (key, attempt, bytes) in sizes {
            self.by_key.insert(key, (attempt, bytes));
        }
    }
}

/// The longest wait [`due_in`] returns: the claimer waits at most its poll interval anyway.
const MAX_DUE: f64 = 86_400.0;

/// The wait until the next due delivery, from the seconds PostgreSQL computed: any float
/// (NaN, infinite, negative, huge) gives a usable duration or none.
fn due_in(secs: f64) -> Option<Duration> {
    if secs.is_nan() {
        return None;
    }
    Some(Duration::from_secs_f64(secs.clamp(0.0, MAX_DUE)))
}

async fn claim(
    shared: &Arc<Shared>,
    quotas: &[(Arc<str>, usize)],
    total: usize,
    budget: usize,
) -> Result<Claimed> {
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(sql::CLAIM, &sql::CLAIM_TYPES)
        .await?;
    let names: Vec<&str> = quotas.iter().map(|(n, _)| &**n).collect();
    let limits: Vec<i32> = quotas.iter().map(|(_, q)| *q as i32).collect();
    let total = total as i32;
    let lease_ms = shared.opts.lease.as_millis() as i64;
    let budget = i64::try_from(budget).unwrap_or(i64::MAX);
    let threshold = if shared.opts.poll_only {
        i32::MAX
    } else {
        AWAKE_THRESHOLD
    };
    let rows = client
        .query(
            &stmt,
            &[
                &names,
                &limits,
                &total,
                &lease_ms,
                &shared.worker_id,
                &threshold,
                &budget,
            ],
        )
        .await?;
    drop(client);
    let mut next_due = None;
    let mut deliveries = Vec::with_capacity(rows.len());
    let mut per_sub: HashMap<Arc<str>, usize> = HashMap::new();
    let mut cut = false;
    let mut sizes = Vec::with_capacity(rows.len());
    for row in rows {
        // Every row of the claim is leased: from here on, nothing may fail the claim as
        // a whole, or the other rows would wait for their leases to run out.
        if let Ok(Some(secs)) = row.try_get::<_, Option<f64>>(col::NEXT_DUE) {
            next_due = due_in(secs);
        }
        cut |= row.try_get::<_, bool>(col::CUT).unwrap_or(false);
        let key = (
            row.try_get::<_, Option<&str>>(col::SUBSCRIPTION),
            row.try_get::<_, i64>(col::SEQ),
            row.try_get::<_, i32>(col::ATTEMPTS),
        );
        let (subscription, seq, attempt) = match key {
            (Ok(None), _, _) => continue, // nothing was claimed
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
                continue;
            }
        };
        let Some(sub) = shared.subs.get(subscription).cloned() else {
            continue; // not ours: cannot happen, the statement filters by our names
        };
        // An event this library cannot decode (written by SQL past the validation in
        // Event::encode) must not fail the whole claim: that delivery alone is
        // dead-lettered with the reason, and the rest of the batch is handed out.
        let decoded = decode::event(&row, seq);
        // The claimer is the only one that acquires, and asked for no more than were
        // free, so this cannot fail; were it to, the delivery simply holds no permit.
        let permit = shared.capacity.clone().try_acquire_owned().ok();
        sub.held.fetch_add(1, Ordering::AcqRel);
        shared
            .held
            .lock()
            .expect("held lock")
            .insert((sub.name.clone(), seq), attempt);
        *per_sub.entry(sub.name.clone()).or_default() += 1;
        let bytes = decoded.as_ref().map_or(0, |(_, bytes)| *bytes);
        sizes.push(((sub.name.clone(), seq), attempt, bytes));
        match decoded {
            Ok((event, _)) => {
                deliveries.push(Delivery::new(event, attempt, sub, shared.clone(), permit));
            }
            Err(e) => {
                let event = decode::placeholder(&row, seq);
                tracing::error!(
                    messaging.destination.subscription.name = %sub.name,
                    pgbus.event_seq = seq,
                    messaging.message.id = %event.id,
                    error = %e,
                    "pgbus cannot decode an event; dead-lettering its delivery"
                );
                Delivery::new(event, attempt, sub, shared.clone(), permit).settle_nowait(
                    Action::Fail {
                        error: format!("the event cannot be decoded: {e}"),
                        delay: Duration::ZERO,
                        permanent: true,
                    },
                );
            }
        }
    }
    Ok(Claimed {
        deliveries,
        per_sub,
        next_due,
        cut,
        sizes,
    })
}

/// The stream of deliveries claimed for this bus's subscriptions.
///
/// It claims while batches come back full, claims only as many deliveries as there are
/// free slots (backpressure: in-flight deliveries never exceed the concurrency plus one
/// batch) and as fit in what is left of the byte budget, and otherwise waits for a notification, the next due retry or the fallback
/// poll interval, whichever comes first. It ends when the bus shuts down.
pub struct ClaimStream {
    inner: Pin<Box<dyn Stream<Item = Delivery> + Send>>,
}

impl std::fmt::Debug for ClaimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimStream").finish_non_exhaustive()
    }
}

impl Stream for ClaimStream {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl ClaimStream {
    pub(crate) fn new(shared: Arc<Shared>) -> ClaimStream {
        let inner = async_stream::stream! {
            let opts = shared.opts.clone();
            let mut awake = shared.opts.poll_only;
            let mut last_work = Instant::now() - LINGER;
            let mut recheck = RECHECKS.len();
            let mut mark_errors: u32 = 0;
            // Whether this outage's first claim error was logged as a warning.
            let mut warned = false;
            let mut errors: u32 = 0;
            let mut by_poll = false;
            let mut held_bytes = HeldBytes::default();
            let subs: Vec<_> = shared.subs.values().cloned().collect();
            loop {
                if shared.stopping.is_cancelled() {
                    break;
                }
                let free = shared.capacity.available_permits().min(opts.batch_size);
                let quotas: Vec<(Arc<str>, usize)> = subs
                    .iter()
                    .map(|s| (s.name.clone(), s.quota(free)))
                    .filter(|(_, q)| *q > 0)
                    .collect();
                let holding = held_bytes.current(&shared);
                let budget = opts.claim_bytes.saturating_sub(holding);
                if free == 0 || quotas.is_empty() || (holding > 0 && budget == 0) {
                    // Every slot, or the byte budget, is taken: wait for a settlement.
                    tokio::select! {
                        _ = shared.stopping.cancelled() => break,
                        _ = shared.capacity_changed.notified() => continue,
                    }
                }
                let span = tracing::debug_span!(
                    "pgbus.claim",
                    messaging.system = "postgresql",
                    messaging.operation = "receive",
                    messaging.batch.message_count = tracing::field::Empty,
                    pgbus.requested = free,
                );
                let claimed = claim(&shared, &quotas, free, budget)
                    .instrument(span.clone())
                    .await;
                let claimed = match claimed {
                    Ok(c) => {
                        if errors > 0 && warned {
                            tracing::info!(after_errors = errors, "pgbus claims succeed again");
                        } else if errors > 0 {
                            tracing::debug!(after_errors = errors, "pgbus claims succeed again");
                        }
                        errors = 0;
                        c
                    }
                    Err(e) => {
                        if errors == 0 {
                            warned = shared.claim_warn.allow();
                        }
                        if errors == 0 && warned {
                            tracing::warn!(error = %e, "pgbus claim failed; retrying with backoff");
                        } else {
                            tracing::debug!(error = %e, errors, "pgbus claim failed again");
                        }
                        errors += 1;
                        shared.stats.claim_errors.fetch_add(1, Ordering::Relaxed);
                        let delay = crate::listen::backoff_delay(errors).min(opts.poll_interval);
                        tokio::select! {
                            _ = shared.stopping.cancelled() => break,
                            _ = tokio::time::sleep(delay) => continue,
                        }
                    }
                };
                let n = claimed.deliveries.len();
                held_bytes.add(claimed.sizes);
                span.record("messaging.batch.message_count", n);
                shared.stats.claims.fetch_add(1, Ordering::Relaxed);
                if n > 0 {
                    last_work = Instant::now();
                    if by_poll {
                        shared.stats.polls_found_work.fetch_add(1, Ordering::Relaxed);
                    }
                    if n as i32 >= AWAKE_THRESHOLD {
                        awake = true;
                    }
                }
                by_poll = false;
                // Did a subscription's own limit hold back due work?
                let limited = quotas.iter().any(|(name, q)| {
                    *q < free && claimed.per_sub.get(name).copied().unwrap_or(0) >= *q
                });
                for d in claimed.deliveries {
                    yield d;
                }
                if n >= free || claimed.cut {
                    continue; // a full batch, or cut by the byte budget: there may be more
                }
                let now = Instant::now();
                let mut wait = opts.poll_interval;
                if let Some(due) = claimed.next_due {
                    wait = wait.min(due);
                }
                if awake && !opts.poll_only {
                    if now.duration_since(last_work) < LINGER {
                        wait = wait.min(COOLDOWN);
                    } else {
                        // Fall asleep, then claim once more. The mark waits for every
                        // publisher that read "awake" to commit (`pgbus.mark_asleep`), so
                        // that claim finds their events; publishers after it notify.
                        match sleep_mark(&shared).await {
                            Ok(()) => {
                                awake = false;
                                mark_errors = 0;
                                recheck = 0;
                                continue;
                            }
                            Err(e) => {
                                // Still marked awake, so nobody notifies: keep polling,
                                // on a backoff no longer than the re-checks', and try
                                // the mark again.
                                mark_errors += 1;
                                tracing::debug!(error = %e, "pgbus could not mark itself asleep");
                                wait = wait.min(
                                    crate::listen::backoff_delay(mark_errors)
                                        .min(RECHECKS[RECHECKS.len() - 1]),
                                );
                            }
                        }
                    }
                } else if recheck < RECHECKS.len() {
                    wait = wait.min(RECHECKS[recheck]);
                    recheck += 1;
                }
                tokio::select! {
                    _ = shared.stopping.cancelled() => break,
                    _ = shared.wake.notified() => {
                        if shared.notified.swap(false, Ordering::AcqRel) {
                            shared.stats.wakeups_by_notification.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    _ = tokio::time::sleep(wait) => {
                        if wait == opts.poll_interval {
                            shared.stats.wakeups_by_poll.fetch_add(1, Ordering::Relaxed);
                            by_poll = true;
                        }
                    }
                    _ = shared.capacity_changed.notified(), if limited => {}
                }
            }
        };
        ClaimStream {
            inner: Box::pin(inner),
        }
    }
}

async fn sleep_mark(shared: &Shared) -> Result<()> {
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(sql::CONSUMER_SLEEP, &[Type::TEXT])
        .await?;
    client.execute(&stmt, &[&shared.worker_id]).await?;
    Ok(())
}

/// The most settlements written by one statement.
const SETTLE_BATCH: usize = 2000;

/// How many times a whole batch is tried when PostgreSQL refuses it for a reason that is
/// neither passing nor plainly a value's fault, before it is split.
const TRIES_BEFORE_SPLIT: u32 = 3;

/// How many times a batch is tried, once the bus is stopping, while the database stays
/// unreachable.
const TRIES_WHILE_STOPPING: u32 = 5;

/// The acker: writes settlements in batches (one statement each), answers the waiting
/// callers, and keeps the stats. Runs until `stop` is cancelled and everything queued
/// has been written (or could not be).
pub(crate) async fn run_acker(
    shared: Arc<Shared>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<SettleMsg>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let first = tokio::select! {
            biased;
            m = rx.recv() => m,
            _ = stop.cancelled() => None,
        };
        let mut batch = match first {
            Some(m) => vec![m],
            None => {
                // Stopping: write what is queued, then end.
                let mut rest = Vec::new();
                while let Ok(m) = rx.try_recv() {
                    rest.push(m);
                }
                while !rest.is_empty() {
                    let chunk: Vec<SettleMsg> =
                        rest.drain(..rest.len().min(SETTLE_BATCH)).collect();
                    write_batch(&shared, chunk, &stop).await;
                }
                return;
            }
        };
        while batch.len() < SETTLE_BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        write_batch(&shared, batch, &stop).await;
    }
}

/// Writes one batch of settlements: one statement, when it succeeds.
///
/// A statement that fails for a reason that passes ([`Error::is_transient`]: the
/// connection, the pool, a lock, a timeout, a deadlock, too many connections) is retried
/// with backoff for as long as the bus runs, and a few times once it is stopping. One
/// that PostgreSQL refuses because of a value in it (or for another reason, after a few
/// tries) is split in halves, each written on its own and split again if it fails, until
/// the settlement at fault stands alone: only that one is given up (its waiter gets the
/// error, its lease expires and the delivery returns); every other is written.
async fn write_batch(
    shared: &Arc<Shared>,
    batch: Vec<SettleMsg>,
    stop: &tokio_util::sync::CancellationToken,
) {
    let mut parts = vec![(batch, TRIES_BEFORE_SPLIT)];
    while let Some((part, tries)) = parts.pop() {
        match write_part(shared, &part, tries, stop).await {
            Ok(settled) => applied(shared, part, settled),
            Err(e) if part.len() > 1 && !e.is_transient() => {
                if tries == TRIES_BEFORE_SPLIT {
                    tracing::warn!(
                        error = %e,
                        n = part.len(),
                        "pgbus could not write a batch of settlements; writing it in parts to isolate the one at fault"
                    );
                }
                // A part of a split is tried once before it is split again: the batch it
                // came from was already retried.
                let mut left = part;
                let right = left.split_off(left.len() / 2);
                parts.push((right, 1));
                parts.push((left, 1));
            }
            Err(e) => given_up(shared, part, &e),
        }
    }
}

/// Runs the SETTLE statement for one batch (or part of one), retrying what passes.
async fn write_part(
    shared: &Shared,
    part: &[SettleMsg],
    tries_allowed: u32,
    stop: &tokio_util::sync::CancellationToken,
) -> Result<Settled> {
    let mut tries: u32 = 0;
    let mut tries_stopping: u32 = 0;
    loop {
        let e = match settle(shared, part).await {
            Ok(settled) => {
                if tries > 0 {
                    tracing::info!(
                        after_errors = tries,
                        n = part.len(),
                        "pgbus wrote the settlements"
                    );
                }
                return Ok(settled);
            }
            Err(e) => e,
        };
        tries += 1;
        if e.is_transient() {
            if stop.is_cancelled() {
                tries_stopping += 1;
                if tries_stopping >= TRIES_WHILE_STOPPING {
                    return Err(e);
                }
            }
        } else if e.is_data_fault() || tries >= tries_allowed {
            return Err(e);
        }
        if tries == 1 && shared.settle_warn.allow() {
            tracing::warn!(error = %e, n = part.len(), "pgbus could not write settlements; retrying");
        } else {
            tracing::debug!(error = %e, n = part.len(), tries, "pgbus could not write settlements again");
        }
        let delay = crate::listen::backoff_delay(tries);
        if stop.is_cancelled() {
            tokio::time::sleep(delay).await;
        } else {
            // Shutdown cuts the wait short: from then on, the tries are bounded.
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
}

/// The deliveries of these settlements are no longer held here: their leases are no
/// longer extended.
fn unhold(shared: &Shared, part: &[SettleMsg]) {
    let mut held = shared.held.lock().expect("held lock");
    for m in part {
        let key = (m.subscription.clone(), m.seq);
        if held.get(&key) == Some(&m.attempt) {
            held.remove(&key);
        }
    }
}

/// Counts and answers settlements the database confirmed (applied, or rejected as stale).
fn applied(shared: &Shared, part: Vec<SettleMsg>, settled: Settled) {
    unhold(shared, &part);
    let Settled {
        rejected,
        dead,
        promoted,
    } = settled;
    let mut retry_scheduled = false;
    for mut m in part {
        let key = (m.subscription.clone(), m.seq);
        let kind = action_kind(&m.action);
        let ok = !rejected.contains(&(kind, key.clone()));
        if ok {
            match &m.action {
                Action::Ack => {
                    shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
                }
                Action::Fail { error, .. } => {
                    shared.stats.failed.fetch_add(1, Ordering::Relaxed);
                    if dead.contains(&key) {
                        shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            messaging.destination.subscription.name = %m.subscription,
                            pgbus.event_seq = m.seq,
                            pgbus.attempt = m.attempt,
                            error = %error,
                            "pgbus delivery dead-lettered"
                        );
                    } else {
                        retry_scheduled = true;
                    }
                }
                Action::Release => {
                    shared.stats.released.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else {
            shared.stats.stale_rejected.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                messaging.destination.subscription.name = %m.subscription,
                pgbus.event_seq = m.seq,
                pgbus.attempt = m.attempt,
                kind,
                "pgbus rejected a stale settlement: the lease had been taken over"
            );
        }
        if let Some(reply) = m.reply.take() {
            let _ = reply.send(if ok {
                Outcome::Applied
            } else {
                Outcome::Rejected
            });
        }
        m.release_slot(shared);
    }
    if retry_scheduled || promoted {
        // The claimer learns the next due retry from its next claim.
        shared.wake.notify_one();
    }
}

/// Gives up settlements that could not be written: nothing is counted as done, the
/// waiters get the error, and the leases will expire and the deliveries return.
fn given_up(shared: &Shared, part: Vec<SettleMsg>, error: &Error) {
    unhold(shared, &part);
    shared.stats.settle_errors.fetch_add(1, Ordering::Relaxed);
    match part.as_slice() {
        [m] => tracing::error!(
            messaging.destination.subscription.name = %m.subscription,
            pgbus.event_seq = m.seq,
            pgbus.attempt = m.attempt,
            kind = action_kind(&m.action),
            error = %error,
            "pgbus gave up writing a settlement; the lease will expire and the delivery return"
        ),
        _ => tracing::error!(
            error = %error,
            n = part.len(),
            "pgbus gave up writing settlements; the leases will expire and the deliveries return"
        ),
    }
    let reason = error.to_string();
    for mut m in part {
        if let Some(reply) = m.reply.take() {
            let _ = reply.send(Outcome::Failed(reason.clone()));
        }
        m.release_slot(shared);
    }
}

fn action_kind(a: &Action) -> &'static str {
    match a {
        Action::Ack => "ack",
        Action::Fail { .. } => "fail",
        Action::Release => "release",
    }
}

type Key = (Arc<str>, i64);

/// What one SETTLE statement did.
struct Settled {
    /// The stale settlements, by kind.
    rejected: HashSet<(&'static str, Key)>,
    /// The deliveries it dead-lettered.
    dead: HashSet<Key>,
    /// Whether it promoted the next delivery of some key (ordered subscriptions).
    promoted: bool,
}

/// Runs the SETTLE statement for a batch.
async fn settle(shared: &Shared, batch: &[SettleMsg]) -> Result<Settled> {
    let mut ack = (Vec::new(), Vec::new(), Vec::new());
    let mut fail = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut rel = (Vec::new(), Vec::new(), Vec::new());
    for m in batch {
        match &m.action {
            Action::Ack => {
                ack.0.push(&*m.subscription);
                ack.1.push(m.seq);
                ack.2.push(m.attempt);
            }
            Action::Fail {
                error,
                delay,
                permanent,
            } => {
                fail.0.push(&*m.subscription);
                fail.1.push(m.seq);
                fail.2.push(m.attempt);
                fail.3.push(error.as_str());
                // Clamped already (Action::storable); kept in range here regardless.
                fail.4
                    .push(crate::retry::clamp_delay(*delay).as_millis() as i64);
                fail.5.push(*permanent);
            }
            Action::Release => {
                rel.0.push(&*m.subscription);
                rel.1.push(m.seq);
                rel.2.push(m.attempt);
            }
        }
    }
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(
            sql::SETTLE,
            &[
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::INT4_ARRAY,
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::INT4_ARRAY,
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::BOOL_ARRAY,
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::INT4_ARRAY,
                Type::TEXT,
            ],
        )
        .await?;
    let rows = client
        .query(
            &stmt,
            &[
                &ack.0,
                &ack.1,
                &ack.2,
                &fail.0,
                &fail.1,
                &fail.2,
                &fail.3,
                &fail.4,
                &fail.5,
                &rel.0,
                &rel.1,
                &rel.2,
                &shared.worker_id,
            ],
        )
        .await?;
    let mut rejected = HashSet::new();
    let mut dead = HashSet::new();
    let mut promoted = false;
    for row in rows {
        let kind: &str = row.try_get(0)?;
        let (Some(sub), Some(seq)) = (
            row.try_get::<_, Option<&str>>(1)?,
            row.try_get::<_, Option<i64>>(2)?,
        ) else {
            continue; // "woke": sleeping buses were notified
        };
        let key: Key = (Arc::from(sub), seq);
        match kind {
            "dead" => {
                dead.insert(key);
            }
            "promoted" => promoted = true,
            "ack" => {
                rejected.insert(("ack", key));
            }
            "fail" => {
                rejected.insert(("fail", key));
            }
            _ => {
                rejected.insert(("release", key));
            }
        }
    }
    Ok(Settled {
        rejected,
        dead,
        promoted,
    })
}

/// Extends the leases of every delivery this bus still holds; returns how many.
pub(crate) async fn extend_leases(shared: &Shared) -> Result<u64> {
    let held: Vec<(Arc<str>, i64, i32)> = shared
        .held
        .lock()
        .expect("held lock")
        .iter()
        .map(|((s, q), a)| (s.clone(), *q, *a))
        .collect();
    if held.is_empty() {
        return Ok(0);
    }
    let subs: Vec<&str> = held.iter().map(|(s, _, _)| &**s).collect();
    let seqs: Vec<i64> = held.iter().map(|(_, q, _)| *q).collect();
    let attempts: Vec<i32> = held.iter().map(|(_, _, a)| *a).collect();
    let lease_ms = shared.opts.lease.as_millis() as i64;
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(
            sql::EXTEND,
            &[
                Type::TEXT_ARRAY,
                Type::INT8_ARRAY,
                Type::INT4_ARRAY,
                Type::INT8,
                Type::TEXT,
            ],
        )
        .await?;
    let n = client
        .execute(
            &stmt,
            &[&subs, &seqs, &attempts, &lease_ms, &shared.worker_id],
        )
        .await?;
    Ok(n)
}

/// Reaps expired leases (of any bus); returns (back to pending, dead-lettered).
pub(crate) async fn reap(shared: &Shared) -> Result<(i64, i64)> {
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(sql::REAP, &[Type::INT4])
        .await?;
    let row = client.query_one(&stmt, &[&1000_i32]).await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

/// Repairs keys of ordered subscriptions left without a head; returns how many.
pub(crate) async fn repair_orphans(shared: &Shared) -> Result<usize> {
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(sql::REPAIR, &[Type::INT4])
        .await?;
    let rows = client.query(&stmt, &[&1000_i32]).await?;
    for row in &rows {
        let sub: &str = row.try_get(0)?;
        let key: &str = row.try_get(1)?;
        let seq: i64 = row.try_get(2)?;
        tracing::error!(
            messaging.destination.subscription.name = sub,
            pgbus.ordering_key = key,
            pgbus.event_seq = seq,
            "pgbus repaired an ordering key that had no head"
        );
    }
    Ok(rows.len())
}

/// Registers or renews this bus's row in `pgbus.consumers`; returns the bus's
/// subscriptions that no longer exist.
pub(crate) async fn consumer_heartbeat(shared: &Shared) -> Result<Vec<String>> {
    let client = shared.pool.get().await?;
    let stmt = client
        .prepare_typed_cached(
            sql::CONSUMER_HEARTBEAT,
            &[
                Type::TEXT,
                Type::INT8,
                Type::TEXT_ARRAY,
                Type::TEXT,
                Type::BOOL,
            ],
        )
        .await?;
    let ttl_ms = crate::bus::CONSUMER_TTL.as_millis() as i64;
    let subs: Vec<&str> = shared.subs.keys().map(|s| &**s).collect();
    let info = format!(
        "pid {} on {}",
        std::process::id(),
        std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown host".into())
    );
    let row = client
        .query_one(
            &stmt,
            &[
                &shared.worker_id,
                &ttl_ms,
                &subs,
                &info,
                &shared.opts.poll_only,
            ],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// Removes this bus's row from `pgbus.consumers`.
pub(crate) async fn consumer_remove(shared: &Shared) -> Result<()> {
    let client = shared.pool.get().await?;
    client
        .execute(sql::CONSUMER_REMOVE, &[&shared.worker_id])
        .await?;
    Ok(())
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
