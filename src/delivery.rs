//! In-process consumption: [`Delivery`] (one claimed event with its lease) and
//! [`Subscription`] (a stream of them), and one handler run on a delivery (its span, its
//! context, a panic caught), which the dispatcher and [`Delivery::handle_with`] share.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{self, Poll};
use std::time::Duration;

use tokio::time::Instant;

use futures::{FutureExt, Stream};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::context::Context;
use crate::error::{Error, HandlerError, Result};
use crate::event::Event;
use crate::handler::DynHandler;
use crate::settle::{Action, Outcome, Settler};
use crate::slot::{Slot, Sub};
use crate::trace_context;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Claimed,
    Started,
    Settled,
}

/// One event claimed for one subscription, leased to this bus until it is settled.
///
/// Settle it with [`ack`](Delivery::ack) (done), [`fail`](Delivery::fail) (retry with
/// backoff), [`retry_in`](Delivery::retry_in) (retry after a delay) or
/// [`dead_letter`](Delivery::dead_letter) (give up). Its lease is extended in the
/// background while you hold it.
///
/// A delivery dropped without being settled is not lost: if it was handed to the
/// application, the drop counts as a failed attempt and it is redelivered at once (within
/// the subscription's maximum attempts); if it was still buffered, it is released without
/// consuming an attempt.
pub struct Delivery {
    /// Shared with the [`Context`] of a handler run.
    event: Arc<Event>,
    attempt: i32,
    sub: Arc<Sub>,
    /// Until the settlement is sent: then the acker holds it until it is written.
    slot: Option<Slot>,
    settler: Settler,
    state: State,
    /// When it was claimed, and how long it had been due then (seconds, PostgreSQL's
    /// clock): the start of [`DELIVERY_LAG`](crate::metrics::DELIVERY_LAG).
    claimed: Instant,
    waited: Option<f64>,
    /// When it was handed to its handler or stream consumer.
    started: Option<Instant>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("subscription", &self.sub.name)
            .field("event_id", &self.event.id)
            .field("event_name", &self.event.name)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    pub(crate) fn new(event: Event, slot: Slot, settler: Settler) -> Self {
        Delivery {
            event: Arc::new(event),
            attempt: slot.attempt(),
            sub: slot.sub().clone(),
            slot: Some(slot),
            settler,
            state: State::Claimed,
            claimed: Instant::now(),
            waited: None,
            started: None,
        }
    }

    /// Notes how long the delivery had been due when it was claimed (the claim's
    /// `waited`), for the lag metric.
    pub(crate) fn waited(mut self, seconds: Option<f64>) -> Self {
        self.waited = seconds;
        self
    }

    /// The event.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// The subscription this delivery belongs to.
    pub fn subscription(&self) -> &str {
        &self.sub.name
    }

    /// Which attempt this is (1 for the first claim; every claim counts).
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    pub(crate) fn mark_started(&mut self) {
        if self.state == State::Claimed {
            self.state = State::Started;
            self.started = Some(Instant::now());
            if let Some(waited) = self.waited {
                let lag = waited + self.claimed.elapsed().as_secs_f64();
                crate::metrics::started(&self.sub.name, lag);
            }
        }
    }

    /// Records the run's duration, once, if it was started: `outcome` is what the
    /// handler (or the stream's consumer) decided.
    fn ran(&mut self, outcome: &'static str) {
        if let Some(started) = self.started.take() {
            crate::metrics::handled(&self.sub.name, outcome, started.elapsed());
        }
    }

    /// Marks the delivery done: it is removed for good.
    ///
    /// Returns once the completion is written (batched with others: one statement for
    /// many deliveries).
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease had expired and the delivery was claimed
    /// again (nothing changed; it will be delivered again), [`Error::Closed`] when the bus
    /// has stopped, [`Error::Settle`] when it could not be written,
    /// [`Error::SettleUnknown`] when nobody can tell whether it was (the connection was
    /// lost with it in flight: the delivery may or may not come back).
    pub async fn ack(mut self) -> Result<()> {
        self.settle(Action::Ack).await
    }

    /// Completes the delivery inside `tx`, the application's own write transaction, so
    /// that what it writes there (a projection, say) and the completion commit together or
    /// not at all.
    ///
    /// Fenced like [`ack`](Delivery::ack): the statement (the acker's completion, run in
    /// `tx` as an unnamed statement, so a transaction-mode pooler is fine) applies only
    /// while this delivery's lease is still this bus's. For an ordered subscription it
    /// hands the key to its next delivery, visible when `tx` commits.
    ///
    /// Once this returns `Ok`, the delivery no longer counts against the bus's capacity
    /// and its lease is no longer extended. Then:
    ///
    /// - `tx` commits: the delivery is complete.
    /// - `tx` rolls back (or its commit fails): the delivery was not completed. It stays
    ///   leased to this bus until its lease runs out (at most the bus's
    ///   [`lease`](crate::BusBuilder::lease) from the last extension); then the reaper
    ///   returns it, counting the attempt as failed (`lease expired`), and it is delivered
    ///   again. (A handler's [`Context::ack_in`](crate::Context::ack_in) does better: the
    ///   handler's error retries it at once.)
    ///
    /// `tx` must be `READ COMMITTED` (PostgreSQL's default). Until it ends, `tx` holds the
    /// delivery's row lock and, for an ordered subscription, its key's lock (publishing to
    /// that key waits) and the shared configuration lock (changing a subscription's
    /// settings waits): keep it short, and well within the lease. A sqlx transaction
    /// completes it with `pgbus::sqlx::ack_delivery_in(&mut tx, delivery)` (the `sqlx` or
    /// `sqlx-0_8` feature).
    ///
    /// ```no_run
    /// # async fn f(mut client: tokio_postgres::Client, d: pgbus::Delivery) -> Result<(), Box<dyn std::error::Error>> {
    /// let tx = client.transaction().await?;
    /// tx.execute(
    ///     "INSERT INTO order_totals (order_id, total) VALUES ($1, $2)",
    ///     &[&d.event().payload["order_id"].as_i64(), &d.event().payload["total"].as_i64()],
    /// )
    /// .await?;
    /// d.ack_in(&tx).await?; // a lost lease fails here, before the commit
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when the lease had been lost (the delivery was reaped, and
    /// perhaps claimed again): nothing changed, and the statement's error has aborted
    /// `tx`, so its writes cannot commit (a `COMMIT` rolls back). Another error (the
    /// connection, `tx` already aborted, not `READ COMMITTED`) fails the attempt as
    /// [`fail`](Delivery::fail) would, and the delivery is retried after its backoff.
    pub async fn ack_in(self, tx: &tokio_postgres::Transaction<'_>) -> Result<()> {
        let result = self
            .settler
            .ack_in(tx, &self.sub.name, self.seq(), self.attempt)
            .await;
        self.after_ack_in(result)
    }

    /// What the `pgbus.ack_in` statement is sent with, by another driver (`pgbus::sqlx`):
    /// the subscription, the seq, the attempt and the worker id.
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    pub(crate) fn ack_in_args(&self) -> (&str, i64, i32, &str) {
        (
            &self.sub.name,
            self.seq(),
            self.attempt,
            self.settler.worker(),
        )
    }

    /// Settles the delivery after the `pgbus.ack_in` statement sent by another driver, as
    /// [`ack_in`](Delivery::ack_in) does.
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    pub(crate) fn acked_in_by(self, ran: Result<()>) -> Result<()> {
        let (subscription, seq, attempt) = (self.sub.name.clone(), self.seq(), self.attempt);
        let result = self.settler.acked_in(&subscription, seq, attempt, ran);
        self.after_ack_in(result)
    }

    /// Settles the delivery once its `pgbus.ack_in` statement ran: done (by the
    /// application's transaction, or by whoever holds the lease now), or failed.
    fn after_ack_in(mut self, result: Result<()>) -> Result<()> {
        match result {
            Ok(()) | Err(Error::LeaseLost) => {
                // Settled: by `tx`, or by whoever holds the lease now. Dropping the slot
                // frees the capacity and stops the lease's extension.
                self.ran("acked");
                self.state = State::Settled;
                self.slot = None;
            }
            Err(ref e) => {
                let action = self.fail_action(&HandlerError::new(format!(
                    "acknowledging in the application's transaction failed: {e}"
                )));
                self.settle_nowait(action);
            }
        }
        result
    }

    /// The event's position in the log (the delivery's key with the subscription).
    fn seq(&self) -> i64 {
        self.slot
            .as_ref()
            .map_or_else(|| self.event.seq.unwrap_or_default(), Slot::seq)
    }

    /// The context of a handler run for this delivery.
    pub(crate) fn context(
        &self,
        deadline: Option<tokio::time::Instant>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Context {
        let parts = crate::context::Parts {
            subscription: self.sub.name.clone(),
            event: self.event.clone(),
            seq: self.seq(),
            attempt: self.attempt,
            settler: self.settler.clone(),
        };
        Context::new(parts, deadline, cancel)
    }

    /// Settles a handler's run: `action`, unless the handler completed the delivery in
    /// its own transaction ([`Context::ack_in`]) and returned `Ok`, in which case nothing
    /// is written (the slot is freed). After an error, `action` is written even so: if the
    /// handler's transaction rolled back, the lease is still this bus's and the delivery
    /// is retried; if it committed, the failure is rejected as stale.
    pub(crate) fn finish(mut self, action: Action, acked_in: bool) {
        if acked_in && matches!(action, Action::Ack) {
            self.ran("acked");
            self.state = State::Settled;
            self.slot = None;
        } else {
            self.settle_nowait(action);
        }
    }

    /// Records a failed attempt and retries after the subscription's backoff (or the
    /// delay the error asks for); dead-letters it when the error is permanent or the
    /// attempts are used up. The error's message is recorded made storable (NUL
    /// replaced, at most [`MAX_ERROR_TEXT`](crate::MAX_ERROR_TEXT) bytes).
    ///
    /// # Errors
    ///
    /// As [`Delivery::ack`].
    pub async fn fail(mut self, error: HandlerError) -> Result<()> {
        let action = self.fail_action(&error);
        self.settle(action).await
    }

    /// Gives the delivery back without using its attempt: it is pending again at once,
    /// for this or another consumer, with no failure recorded. For a consumer that
    /// cannot handle it through no fault of the event (its own output failed, it is
    /// stopping); an ordered subscription's head stays the head.
    ///
    /// # Errors
    ///
    /// As [`Delivery::ack`].
    pub async fn release(mut self) -> Result<()> {
        self.settle(Action::Release).await
    }

    /// Records a failed attempt and retries after `delay`. A delay longer than
    /// [`MAX_RETRY_DELAY`](crate::MAX_RETRY_DELAY) (365 days) is clamped to it.
    ///
    /// # Errors
    ///
    /// As [`Delivery::ack`].
    pub async fn retry_in(mut self, delay: Duration) -> Result<()> {
        let clamped = crate::retry::clamp_delay(delay);
        let error = if clamped == delay {
            format!("retry requested in {delay:?}")
        } else {
            format!("retry requested in {delay:?}, clamped to {clamped:?}")
        };
        self.settle(Action::Fail {
            error,
            delay: clamped,
            permanent: false,
        })
        .await
    }

    /// Gives up: the delivery becomes a dead letter with `reason` in its history (made
    /// storable: NUL replaced, at most [`MAX_ERROR_TEXT`](crate::MAX_ERROR_TEXT) bytes).
    ///
    /// # Errors
    ///
    /// As [`Delivery::ack`].
    pub async fn dead_letter(mut self, reason: impl std::fmt::Display) -> Result<()> {
        self.settle(Action::Fail {
            error: reason.to_string(),
            delay: Duration::ZERO,
            permanent: true,
        })
        .await
    }

    /// Runs `handler` on this delivery as a running bus runs a subscription's handler, and
    /// settles it by the outcome; returns once the settlement is written.
    ///
    /// The handler runs in its `pgbus.process` span, through
    /// [`Handler::handle_with_context`](crate::Handler::handle_with_context), with a
    /// [`Context`] whose [`ack_in`](Context::ack_in) completes the delivery in the
    /// handler's own transaction; a panic is caught. `Ok` acknowledges the delivery (or
    /// leaves it to the handler's `ack_in`); an error or a panic fails the attempt as
    /// [`fail`](Delivery::fail) does. No handler timeout applies, and the context's
    /// shutdown signal never fires: this is for a stream consumer that runs a handler of
    /// its own, and for tests of a handler (`pgbus_testkit::work_one`).
    ///
    /// ```no_run
    /// # async fn f(mut stream: pgbus::Subscription, handler: impl pgbus::Handler) -> pgbus::Result<()> {
    /// use futures::StreamExt;
    ///
    /// if let Some(delivery) = stream.next().await {
    ///     let handled = delivery.handle_with(&handler).await?;
    ///     println!("{handled:?}");
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Delivery::ack`], for the settlement.
    pub async fn handle_with<H: crate::Handler>(mut self, handler: &H) -> Result<Handled> {
        self.mark_started();
        let cx = self.context(None, tokio_util::sync::CancellationToken::new());
        let action = self.invoke(handler, cx.clone(), None, None).await;
        // A run says to acknowledge or to fail, never to release.
        let handled = match &action {
            Action::Fail {
                error,
                delay,
                permanent,
            } => Handled::Failed {
                error: error.clone(),
                delay: *delay,
                permanent: *permanent,
            },
            _ if cx.acked_in() => Handled::AckedIn,
            _ => Handled::Acked,
        };
        if handled == Handled::AckedIn {
            self.finish(action, true);
        } else {
            self.settle(action).await?;
        }
        Ok(handled)
    }

    /// Runs `handler` on this delivery in its `pgbus.process` span, until `deadline` (the
    /// handler's `timeout` from its start), catching a panic; says what to write. The bus's
    /// dispatcher and [`Delivery::handle_with`] both run handlers through here.
    pub(crate) async fn invoke(
        &self,
        handler: &dyn DynHandler,
        cx: Context,
        deadline: Option<tokio::time::Instant>,
        timeout: Option<Duration>,
    ) -> Action {
        let event = self.event();
        // Named `process <subscription>`: subscriptions are few and known to the consumer,
        // event names are as many as the publishers make.
        let span = tracing::info_span!(
            "pgbus.process",
            otel.name = %format_args!("process {}", self.subscription()),
            otel.kind = "consumer",
            otel.status_code = tracing::field::Empty,
            messaging.system = "pgbus",
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = %event.name,
            messaging.destination.subscription.name = %self.subscription(),
            messaging.message.id = %event.id,
            messaging.message.conversation_id = event.correlation_id.as_deref(),
            pgbus.attempt = self.attempt(),
            error.type = tracing::field::Empty,
        );
        // A child of the publisher's context, linked to it (`opentelemetry` feature).
        trace_context::follow(&span, event);
        // Called inside the future, so that a handler panicking before it returns its
        // future (a closure's synchronous part) is caught too.
        let run = AssertUnwindSafe(async { handler.call(event, cx).await }).catch_unwind();
        let outcome = match deadline {
            Some(t) => tokio::time::timeout_at(t, run)
                .instrument(span.clone())
                .await
                .ok(),
            None => Some(run.instrument(span.clone()).await),
        };
        let (error, kind) = match outcome {
            Some(Ok(Ok(()))) => return Action::Ack,
            Some(Ok(Err(e))) => {
                span.in_scope(|| tracing::debug!(error = %e, "pgbus handler failed"));
                (e, "handler_error")
            }
            Some(Err(panic)) => {
                let msg = format!("handler panicked: {}", panic_message(&*panic));
                span.in_scope(|| crate::warn_limited!(error = %msg, "pgbus handler panicked"));
                (HandlerError::new(msg), "panic")
            }
            None => (
                HandlerError::new(format!(
                    "handler timed out after {:?}",
                    timeout.unwrap_or_default()
                )),
                "timeout",
            ),
        };
        span.record("error.type", kind);
        span.record("otel.status_code", "error");
        self.fail_action(&error)
    }

    pub(crate) fn fail_action(&self, error: &HandlerError) -> Action {
        Action::Fail {
            error: error.message().to_string(),
            delay: error
                .delay()
                .unwrap_or_else(|| self.sub.retry.delay(self.attempt)),
            permanent: error.is_permanent(),
        }
    }

    async fn settle(&mut self, action: Action) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(action, Some(tx));
        match rx.await {
            Ok(Outcome::Applied) => Ok(()),
            Ok(Outcome::Rejected) => Err(Error::LeaseLost),
            Ok(Outcome::Failed(error)) => Err(Error::Settle(error)),
            Ok(Outcome::Unknown(error)) => Err(Error::SettleUnknown(error)),
            Err(_) => Err(Error::Closed),
        }
    }

    /// Hands the settlement to the acker without waiting for it to be written.
    pub(crate) fn settle_nowait(mut self, action: Action) {
        self.send(action, None);
    }

    fn send(&mut self, action: Action, reply: Option<oneshot::Sender<Outcome>>) {
        self.ran(match action {
            Action::Ack => "acked",
            Action::Fail { .. } => "failed",
            Action::Release => "released",
        });
        self.state = State::Settled;
        if let Some(slot) = self.slot.take() {
            self.settler.send(slot, action, reply);
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        match self.state {
            State::Settled => {}
            State::Claimed => self.send(Action::Release, None),
            State::Started => self.send(
                Action::Fail {
                    error: "delivery dropped without being settled".to_string(),
                    delay: Duration::ZERO,
                    permanent: false,
                },
                None,
            ),
        }
    }
}

/// What [`Delivery::handle_with`] did with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Handled {
    /// The handler returned `Ok`: the delivery is acknowledged.
    Acked,
    /// The handler completed the delivery in its own transaction
    /// ([`Context::ack_in`]) and returned `Ok`.
    AckedIn,
    /// The handler returned an error, or panicked: the attempt is recorded as failed with
    /// `error`. The delivery is retried after `delay`, or dead-lettered when the error is
    /// `permanent` or the subscription's attempts are used up.
    Failed {
        /// The error's text (a panic's reads `handler panicked: ...`).
        error: String,
        /// The retry delay: the error's own, or the subscription's backoff.
        delay: Duration,
        /// Whether the error asked for a dead letter at once.
        permanent: bool,
    },
}

/// A stream of the deliveries of one subscription, for in-process consumers.
///
/// Made by [`Bus::subscribe`](crate::Bus::subscribe); it yields deliveries once the bus
/// is started, and ends when the bus shuts down. At most the subscription's concurrency
/// (default: the bus's) are claimed and unsettled at once, so a slow consumer holds back
/// only its own subscription.
pub struct Subscription {
    pub(crate) name: Arc<str>,
    pub(crate) rx: Arc<Mutex<mpsc::UnboundedReceiver<Delivery>>>,
    pub(crate) stopped: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Subscription {
    /// The subscription's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Stream for Subscription {
    type Item = Delivery;

    fn poll_next(self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> Poll<Option<Delivery>> {
        let this = self.get_mut();
        let mut rx = match this.rx.lock() {
            Ok(rx) => rx,
            Err(poisoned) => poisoned.into_inner(),
        };
        if this.stopped.as_mut().poll(cx).is_ready() {
            // Buffered deliveries are released (dropped unstarted), not handed out.
            while rx.try_recv().is_ok() {}
            return Poll::Ready(None);
        }
        match rx.poll_recv(cx) {
            Poll::Ready(Some(mut d)) => {
                d.mark_started();
                Poll::Ready(Some(d))
            }
            other => other,
        }
    }
}

/// The text of a panic payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}
