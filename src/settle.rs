//! Settling: the acker writes what became of each delivery (done, failed, released), many
//! at a time in one statement, fenced by the lease, and answers whoever waits.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff::{self, WarnGate};
use crate::error::{Error, Result};
use crate::listen::Wake;
use crate::metrics::DeliveryOutcome;
use crate::slot::{Key, Slot};
use crate::sql;
use crate::stats::{self, Counters};

/// The most settlements written by one statement.
const SETTLE_BATCH: usize = 2000;

/// How many times a whole batch is tried when PostgreSQL refuses it for a reason that is
/// neither passing nor plainly a value's fault, before it is split.
const TRIES_BEFORE_SPLIT: u32 = 3;

/// How many times a batch is tried, once the bus is stopping, while the database stays
/// unreachable.
const TRIES_WHILE_STOPPING: u32 = 5;

/// What the acker is asked to write for one delivery.
#[derive(Debug)]
pub(crate) enum Action {
    Ack,
    Fail {
        error: String,
        delay: Duration,
        permanent: bool,
    },
    /// Back to pending without consuming the attempt (claimed, never started).
    Release,
}

impl Action {
    /// The action as it can be written: a failure's text made storable (NUL replaced,
    /// bounded length: [`crate::error::storable_text`]) and its delay clamped to
    /// [`crate::MAX_RETRY_DELAY`]. Every settlement passes through here on its way to the
    /// acker, so no text or delay the application (or a panic, or a command) produced can
    /// fail the batch it is written with.
    fn storable(self) -> Action {
        match self {
            Action::Fail {
                error,
                delay,
                permanent,
            } => Action::Fail {
                error: crate::error::storable_text(error),
                delay: crate::retry::clamp_delay(delay),
                permanent,
            },
            other => other,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Action::Ack => "ack",
            Action::Fail { .. } => "fail",
            Action::Release => "release",
        }
    }
}

/// How the acker answers.
#[derive(Debug)]
pub(crate) enum Outcome {
    Applied,
    /// The lease was no longer this worker's: nothing changed.
    Rejected,
    /// The settlement could not be written.
    Failed(Arc<Error>),
    /// Nobody can tell whether it was written: a try's connection was lost with the
    /// statement in flight (the error), and no later try could tell.
    Unknown(Arc<Error>),
}

/// One settlement on its way to the acker, with the delivery's slot: freed once the
/// settlement is written (or given up), so that until then the delivery counts as claimed.
#[derive(Debug)]
pub(crate) struct SettleMsg {
    slot: Slot,
    action: Action,
    reply: Option<oneshot::Sender<Outcome>>,
}

impl SettleMsg {
    fn key(&self) -> Key {
        (self.slot.sub().name.clone(), self.slot.seq())
    }

    fn answer(mut self, outcome: Outcome) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(outcome);
        }
    }
}

/// The way to the acker, and to completing a delivery in an application's transaction.
#[derive(Debug, Clone)]
pub(crate) struct Settler {
    tx: mpsc::UnboundedSender<SettleMsg>,
    worker: Arc<str>,
    stats: Arc<Counters>,
}

impl Settler {
    pub(crate) fn channel(
        worker: Arc<str>,
        stats: Arc<Counters>,
    ) -> (Settler, mpsc::UnboundedReceiver<SettleMsg>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Settler { tx, worker, stats }, rx)
    }

    /// Completes the delivery `(subscription, seq)` claimed for `attempt` in the caller's
    /// transaction ([`sql::ACK_IN`]: the SETTLE statement's completion, fenced by the
    /// lease), as an unnamed statement. Counted as delivered when the statement ran.
    ///
    /// A stale lease is [`Error::LeaseLost`], and the statement's error has aborted the
    /// caller's transaction.
    pub(crate) async fn ack_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        subscription: &str,
        seq: i64,
        attempt: i32,
    ) -> Result<()> {
        let worker: &str = &self.worker;
        let params: [(&(dyn ToSql + Sync), Type); 4] = [
            (&subscription, Type::TEXT),
            (&seq, Type::INT8),
            (&attempt, Type::INT4),
            (&worker, Type::TEXT),
        ];
        let ran = tx.query_typed(sql::ACK_IN, &params).await;
        self.acked_in(
            subscription,
            seq,
            attempt,
            ran.map(drop).map_err(Error::from),
        )
    }

    /// The worker id this bus claims with: [`sql::ACK_IN`]'s fourth parameter.
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    pub(crate) fn worker(&self) -> &str {
        &self.worker
    }

    /// Counts and reports what the [`sql::ACK_IN`] statement for `(subscription, seq)`
    /// claimed for `attempt` came to, whichever driver ran it: a stale lease (SQLSTATE
    /// [`sql::LEASE_LOST`]) is [`Error::LeaseLost`].
    pub(crate) fn acked_in(
        &self,
        subscription: &str,
        seq: i64,
        attempt: i32,
        ran: Result<()>,
    ) -> Result<()> {
        match ran {
            Ok(()) => {
                self.stats
                    .settled(&Arc::from(subscription), DeliveryOutcome::Acked);
                Ok(())
            }
            Err(e) if e.code().is_some_and(|c| c.code() == sql::LEASE_LOST) => {
                self.stats
                    .settled(&Arc::from(subscription), DeliveryOutcome::Stale);
                tracing::info!(
                    messaging.destination.subscription.name = %subscription,
                    pgbus.event_seq = seq,
                    pgbus.attempt = attempt,
                    "pgbus rejected a completion in the application's transaction: the lease had been taken over"
                );
                Err(Error::LeaseLost)
            }
            Err(e) => Err(e),
        }
    }

    /// Queues a settlement. If the acker is gone, the slot is freed at once and the
    /// waiter's channel closes (its caller sees [`Error::Closed`]); the lease will expire.
    pub(crate) fn send(&self, slot: Slot, action: Action, reply: Option<oneshot::Sender<Outcome>>) {
        let action = action.storable();
        let _ = self.tx.send(SettleMsg {
            slot,
            action,
            reply,
        });
    }
}

/// The acker: what it writes with, counts and wakes.
#[derive(Debug)]
pub(crate) struct Acker {
    pub(crate) db: crate::conn::Db,
    pub(crate) worker: Arc<str>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) wake: Arc<Wake>,
    pub(crate) warn: WarnGate,
    /// Cancelled at the shutdown deadline: the statement in flight is cancelled and
    /// whatever is left is given up (the leases expire and the deliveries return).
    pub(crate) deadline: CancellationToken,
}

impl Acker {
    /// Writes settlements in batches (one statement each) until `stop` is cancelled and
    /// everything queued has been written, or could not be. `stop` also shortens the
    /// retries of a failing batch (see [`Acker::write_part`]).
    pub(crate) async fn run(
        self,
        mut rx: mpsc::UnboundedReceiver<SettleMsg>,
        stop: CancellationToken,
    ) {
        loop {
            let first = tokio::select! {
                biased;
                m = rx.recv() => m,
                _ = stop.cancelled() => None,
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while batch.len() < SETTLE_BATCH {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            self.write_batch(batch, &stop).await;
        }
        // Stopping: write what is queued, then end.
        rx.close();
        let mut rest = Vec::new();
        while let Ok(m) = rx.try_recv() {
            rest.push(m);
        }
        while !rest.is_empty() {
            let chunk: Vec<SettleMsg> = rest.drain(..rest.len().min(SETTLE_BATCH)).collect();
            self.write_batch(chunk, &stop).await;
        }
    }

    /// Writes one batch of settlements: one statement, when it succeeds.
    ///
    /// A statement that fails for a reason that passes ([`Error::is_transient`]: the
    /// connection, the pool, a lock, a timeout, a deadlock, too many connections) is
    /// retried with backoff for as long as the bus runs, and a few times once it is
    /// stopping. One that PostgreSQL refuses because of a value in it (or for another
    /// reason, after a few tries) is split in halves, each written on its own and split
    /// again if it fails, until the settlement at fault stands alone: only that one is
    /// given up (its waiter gets the error, its lease expires and the delivery returns);
    /// every other is written.
    ///
    /// A try whose connection was lost with the statement in flight may have been
    /// written: from then on, a settlement a later try finds stale (its lease gone, maybe
    /// by that first try's own doing) or that is given up has an unknown outcome, and is
    /// reported and counted so ([`Outcome::Unknown`]), never as a lost lease.
    async fn write_batch(&self, batch: Vec<SettleMsg>, stop: &CancellationToken) {
        let mut parts = vec![(batch, TRIES_BEFORE_SPLIT, None)];
        while let Some((part, tries, mut lost)) = parts.pop() {
            match self.write_part(&part, tries, stop, &mut lost).await {
                Ok(settled) => self.applied(part, settled, lost),
                Err(e) if part.len() > 1 && !e.is_transient() => {
                    if tries == TRIES_BEFORE_SPLIT {
                        crate::warn_limited!(
                            error = %e,
                            n = part.len(),
                            "pgbus could not write a batch of settlements; writing it in parts to isolate the one at fault"
                        );
                    }
                    // A part of a split is tried once before it is split again: the batch
                    // it came from was already retried.
                    let mut left = part;
                    let right = left.split_off(left.len() / 2);
                    parts.push((right, 1, lost.clone()));
                    parts.push((left, 1, lost));
                }
                Err(e) => self.given_up(part, e, lost),
            }
        }
    }

    /// Runs the SETTLE statement for one batch (or part of one), retrying what passes.
    /// The first error of a try whose statement was in flight when its connection was
    /// lost goes to `lost`.
    async fn write_part(
        &self,
        part: &[SettleMsg],
        tries_allowed: u32,
        stop: &CancellationToken,
        lost: &mut Option<Arc<Error>>,
    ) -> Result<Settled, Arc<Error>> {
        let mut tries: u32 = 0;
        let mut tries_stopping: u32 = 0;
        loop {
            if self.deadline.is_cancelled() {
                return Err(Arc::new(Error::Timeout(
                    "writing settlements before the shutdown deadline",
                )));
            }
            let e = match self.settle(part).await {
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
                Err(Try { error, in_flight }) => {
                    let error = Arc::new(error);
                    if in_flight && lost.is_none() {
                        *lost = Some(error.clone());
                    }
                    error
                }
            };
            tries += 1;
            if e.is_transient() {
                tries_stopping += u32::from(stop.is_cancelled());
                if tries_stopping >= TRIES_WHILE_STOPPING {
                    return Err(e);
                }
            } else if e.is_data_fault() || tries >= tries_allowed {
                return Err(e);
            }
            if tries == 1 {
                crate::warn_limited!(gate = &self.warn; error = %e, n = part.len(), "pgbus could not write settlements; retrying");
            } else {
                tracing::debug!(error = %e, n = part.len(), tries, "pgbus could not write settlements again");
            }
            // Shutdown cuts the wait short: from then on, the tries are bounded.
            let delay = backoff::delay(tries, Duration::MAX);
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stop.cancelled(), if !stop.is_cancelled() => {}
                _ = self.deadline.cancelled() => {}
            }
        }
    }

    /// Counts and answers settlements the database confirmed (applied, or rejected as
    /// stale: unknown instead when an earlier try was `lost` in flight, as that try may
    /// be what took the lease); dropping each frees its slot.
    fn applied(&self, part: Vec<SettleMsg>, settled: Settled, lost: Option<Arc<Error>>) {
        let mut retry_scheduled = false;
        let mut unknown = Vec::new();
        for m in part {
            let key = m.key();
            let ok = !settled.rejected.contains(&(m.action.kind(), key.clone()));
            if !ok {
                if lost.is_some() {
                    unknown.push(m);
                    continue;
                }
                self.stats.settled(&key.0, DeliveryOutcome::Stale);
                log_stale(&m);
            } else if let Action::Fail { error, .. } = &m.action {
                if settled.dead.contains(&key) {
                    self.stats.settled(&key.0, DeliveryOutcome::Dead);
                    log_dead(&m, error);
                } else {
                    self.stats.settled(&key.0, DeliveryOutcome::Failed);
                    retry_scheduled = true;
                }
            } else {
                let how = match m.action {
                    Action::Ack => DeliveryOutcome::Acked,
                    _ => DeliveryOutcome::Released,
                };
                self.stats.settled(&key.0, how);
            }
            m.answer(if ok {
                Outcome::Applied
            } else {
                Outcome::Rejected
            });
        }
        if retry_scheduled || settled.promoted {
            // The claimer learns the next due retry from its next claim.
            self.wake.now();
        }
        if let Some(lost) = lost.filter(|_| !unknown.is_empty()) {
            self.unknown(unknown, &lost);
        }
    }

    /// Reports settlements whose outcome nobody can know: each counted as unknown, its
    /// waiter given [`Outcome::Unknown`] with the error of the try that was lost; one log
    /// line for them all.
    fn unknown(&self, part: Vec<SettleMsg>, lost: &Arc<Error>) {
        match part.as_slice() {
            [m] => crate::warn_limited!(
                messaging.destination.subscription.name = %m.slot.sub().name,
                pgbus.event_seq = m.slot.seq(),
                pgbus.attempt = m.slot.attempt(),
                kind = m.action.kind(),
                error = %lost,
                "pgbus cannot tell whether a settlement was written: its connection was lost \
                 with the statement in flight; the delivery may or may not come back"
            ),
            _ => crate::warn_limited!(
                n = part.len(),
                error = %lost,
                "pgbus cannot tell whether settlements were written: their connection was lost \
                 with the statement in flight; the deliveries may or may not come back"
            ),
        }
        for m in part {
            self.stats
                .settled(&m.slot.sub().name, DeliveryOutcome::Unknown);
            m.answer(Outcome::Unknown(lost.clone()));
        }
    }

    /// Gives up settlements that could not be written: nothing is counted as done, the
    /// waiters get the error, and the leases will expire and the deliveries return. If
    /// an earlier try was `lost` in flight, they may have been written all the same:
    /// each is reported unknown instead.
    fn given_up(&self, part: Vec<SettleMsg>, error: Arc<Error>, lost: Option<Arc<Error>>) {
        stats::add(&self.stats.settle_errors, 1);
        if let Some(lost) = lost {
            self.unknown(part, &lost);
            return;
        }
        match part.as_slice() {
            [m] => tracing::error!(
                messaging.destination.subscription.name = %m.slot.sub().name,
                pgbus.event_seq = m.slot.seq(),
                pgbus.attempt = m.slot.attempt(),
                kind = m.action.kind(),
                error = %error,
                "pgbus gave up writing a settlement; the lease will expire and the delivery return"
            ),
            _ => tracing::error!(
                error = %error,
                n = part.len(),
                "pgbus gave up writing settlements; the leases will expire and the deliveries return"
            ),
        }
        for m in part {
            m.answer(Outcome::Failed(error.clone()));
        }
    }

    /// Runs the SETTLE statement for a batch.
    async fn settle(&self, batch: &[SettleMsg]) -> Result<Settled, Try> {
        let columns = Columns::of(batch);
        let client = self.db.get().await.map_err(Try::not_sent)?;
        // A connection already closed sends nothing.
        let sent = !client.is_closed();
        let mut params = columns.params();
        let worker: &str = &self.worker;
        params.push(&worker);
        let run = self.db.query(&client, sql::SETTLE, &SETTLE_TYPES, &params);
        // `settle`, without a destination: a batch holds any subscriptions' settlements.
        let span = tracing::debug_span!(
            "pgbus.settle",
            otel.name = "settle",
            messaging.system = "pgbus",
            messaging.operation.type = "settle",
            messaging.operation.name = "settle",
            messaging.batch.message_count = batch.len() as i64,
        );
        let stopped = self.db.unless_stopped(&client, &self.deadline, run);
        match stopped.instrument(span).await {
            Some(Ok(rows)) => Settled::read(rows).map_err(Try::not_sent),
            // The statement, or its COMMIT, may have been carried out before the
            // connection went: an error that ends the connection leaves it unknown.
            Some(Err(error)) => Err(Try {
                in_flight: sent && error.is_connection(),
                error,
            }),
            // Cancelled in flight: it may still commit.
            None => Err(Try {
                error: Error::Timeout("writing settlements before the shutdown deadline"),
                in_flight: sent,
            }),
        }
    }
}

/// A try of the SETTLE statement that failed.
struct Try {
    error: Error,
    /// Whether the statement may have been carried out all the same: it was sent, and
    /// its connection was lost (or it was cancelled) before its answer came.
    in_flight: bool,
}

impl Try {
    fn not_sent(error: Error) -> Try {
        Try {
            error,
            in_flight: false,
        }
    }
}

fn log_stale(m: &SettleMsg) {
    tracing::info!(
        messaging.destination.subscription.name = %m.slot.sub().name,
        pgbus.event_seq = m.slot.seq(),
        pgbus.attempt = m.slot.attempt(),
        kind = m.action.kind(),
        "pgbus rejected a stale settlement: the lease had been taken over"
    );
}

fn log_dead(m: &SettleMsg, error: &str) {
    crate::warn_limited!(
        messaging.destination.subscription.name = %m.slot.sub().name,
        pgbus.event_seq = m.slot.seq(),
        pgbus.attempt = m.slot.attempt(),
        error = %error,
        "pgbus delivery dead-lettered"
    );
}

/// The parameter types of [`sql::SETTLE`]: acks, failures and releases as arrays, then
/// the worker id.
const SETTLE_TYPES: [Type; 13] = [
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
];

/// One kind of settlement as arrays: subscription, event seq, attempt.
#[derive(Default)]
struct Keys<'a> {
    subscription: Vec<&'a str>,
    seq: Vec<i64>,
    attempt: Vec<i32>,
}

impl<'a> Keys<'a> {
    fn push(&mut self, m: &'a SettleMsg) {
        self.subscription.push(&m.slot.sub().name);
        self.seq.push(m.slot.seq());
        self.attempt.push(m.slot.attempt());
    }
}

/// A batch as the SETTLE statement's arrays.
#[derive(Default)]
struct Columns<'a> {
    ack: Keys<'a>,
    fail: Keys<'a>,
    fail_error: Vec<&'a str>,
    fail_delay_ms: Vec<i64>,
    fail_permanent: Vec<bool>,
    release: Keys<'a>,
}

impl<'a> Columns<'a> {
    fn of(batch: &'a [SettleMsg]) -> Columns<'a> {
        let mut c = Columns::default();
        for m in batch {
            match &m.action {
                Action::Ack => c.ack.push(m),
                Action::Release => c.release.push(m),
                Action::Fail {
                    error,
                    delay,
                    permanent,
                } => {
                    c.fail.push(m);
                    c.fail_error.push(error);
                    // Clamped already (Action::storable); kept in range here regardless.
                    c.fail_delay_ms
                        .push(crate::retry::clamp_delay(*delay).as_millis() as i64);
                    c.fail_permanent.push(*permanent);
                }
            }
        }
        c
    }

    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        vec![
            &self.ack.subscription,
            &self.ack.seq,
            &self.ack.attempt,
            &self.fail.subscription,
            &self.fail.seq,
            &self.fail.attempt,
            &self.fail_error,
            &self.fail_delay_ms,
            &self.fail_permanent,
            &self.release.subscription,
            &self.release.seq,
            &self.release.attempt,
        ]
    }
}

/// What one SETTLE statement did.
struct Settled {
    /// The stale settlements, by kind.
    rejected: HashSet<(&'static str, Key)>,
    /// The deliveries it dead-lettered.
    dead: HashSet<Key>,
    /// Whether it promoted the next delivery of some key (ordered subscriptions).
    promoted: bool,
}

impl Settled {
    fn read(rows: Vec<tokio_postgres::Row>) -> Result<Settled> {
        let mut settled = Settled {
            rejected: HashSet::new(),
            dead: HashSet::new(),
            promoted: false,
        };
        for row in rows {
            let kind: &str = row.try_get("kind")?;
            let (Some(sub), Some(seq)) = (
                row.try_get::<_, Option<&str>>("subscription")?,
                row.try_get::<_, Option<i64>>("event_seq")?,
            ) else {
                continue; // "woke": sleeping buses were notified
            };
            let key: Key = (Arc::from(sub), seq);
            match kind {
                "dead" => {
                    settled.dead.insert(key);
                }
                "promoted" => settled.promoted = true,
                "ack" => {
                    settled.rejected.insert(("ack", key));
                }
                "fail" => {
                    settled.rejected.insert(("fail", key));
                }
                _ => {
                    settled.rejected.insert(("release", key));
                }
            }
        }
        Ok(settled)
    }
}
