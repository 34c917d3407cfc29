//! What a handler is told about the delivery it handles: [`Context`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::event::Event;
use crate::settle::Settler;

/// The delivery a handler runs for: which event it carries (name, id, position in the
/// log, headers, correlation and causation ids), which attempt it is, until when it may
/// run, whether the bus is stopping, and a way to complete it inside the handler's own
/// transaction.
///
/// Handlers registered with
/// [`BusBuilder::handler_with_context`](crate::BusBuilder::handler_with_context) or
/// [`BusBuilder::handler_typed`](crate::BusBuilder::handler_typed) receive it by value;
/// a [`Handler`](crate::Handler) receives it in
/// [`Handler::handle_with_context`](crate::Handler::handle_with_context). Clones share
/// the delivery: an [`ack_in`](Context::ack_in) through any of them counts.
///
/// ```
/// use std::time::Duration;
///
/// use pgbus::{Context, Event, HandlerError};
///
/// async fn handle(event: Event, cx: Context) -> Result<(), HandlerError> {
///     if cx.attempt() > 3 {
///         eprintln!("{} is at attempt {}", event.id, cx.attempt());
///     }
///     // Wait for a slow dependency, but not past the attempt's timeout, and not while
///     // the bus is stopping.
///     let wait = cx.remaining().unwrap_or(Duration::from_secs(5)).min(Duration::from_secs(5));
///     tokio::select! {
///         _ = tokio::time::sleep(wait) => Ok(()),
///         _ = cx.cancelled() => Err(HandlerError::new("the bus is stopping; try again later")),
///     }
/// }
/// # let _ = handle;
/// ```
#[derive(Clone)]
pub struct Context {
    subscription: Arc<str>,
    event: Arc<Event>,
    seq: i64,
    attempt: i32,
    deadline: Option<Instant>,
    cancel: CancellationToken,
    settler: Settler,
    acked_in: Arc<AtomicBool>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("subscription", &self.subscription)
            .field("event_id", &self.event.id)
            .field("event_name", &self.event.name)
            .field("seq", &self.seq)
            .field("attempt", &self.attempt)
            .field("deadline", &self.deadline)
            .field("cancelled", &self.cancel.is_cancelled())
            .field("acked_in", &self.acked_in())
            .finish_non_exhaustive()
    }
}

/// What a [`Context`] is made of, known to the delivery it belongs to.
#[derive(Debug)]
pub(crate) struct Parts {
    pub(crate) subscription: Arc<str>,
    /// The delivery's event, shared with it.
    pub(crate) event: Arc<Event>,
    pub(crate) seq: i64,
    pub(crate) attempt: i32,
    pub(crate) settler: Settler,
}

impl Context {
    pub(crate) fn new(parts: Parts, deadline: Option<Instant>, cancel: CancellationToken) -> Self {
        Context {
            subscription: parts.subscription,
            event: parts.event,
            seq: parts.seq,
            attempt: parts.attempt,
            deadline,
            cancel,
            settler: parts.settler,
            acked_in: Arc::default(),
        }
    }

    /// The subscription's name.
    pub fn subscription(&self) -> &str {
        &self.subscription
    }

    /// The event's id (its idempotency key): the same on every attempt.
    pub fn event_id(&self) -> &str {
        &self.event.id
    }

    /// The event's name (`order.placed`), as it was published.
    pub fn event_name(&self) -> &str {
        &self.event.name
    }

    /// The event's headers, as published (a JSON object; `{}` when it had none). With the
    /// `opentelemetry` feature they hold the publisher's `traceparent` (and `tracestate`)
    /// when it published inside a trace.
    pub fn headers(&self) -> &serde_json::Value {
        &self.event.headers
    }

    /// One header's value, if the event has it.
    pub fn header(&self, name: &str) -> Option<&serde_json::Value> {
        self.event.headers.get(name)
    }

    /// The event's position in the log (`pgbus.events.seq`): with the subscription, the
    /// key of this delivery, the same on every attempt.
    pub fn seq(&self) -> i64 {
        self.seq
    }

    /// The event's correlation id, if it was published with one
    /// ([`Event::correlation_id`](crate::Event::correlation_id)).
    pub fn correlation_id(&self) -> Option<&str> {
        self.event.correlation_id.as_deref()
    }

    /// The event's causation id (the id of the event or command that caused it), if it was
    /// published with one ([`Event::causation_id`](crate::Event::causation_id)).
    pub fn causation_id(&self) -> Option<&str> {
        self.event.causation_id.as_deref()
    }

    /// Which attempt this is: 1 for the first, 2 for the first retry, and so on (every
    /// claim counts, including one whose lease expired).
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// When this attempt's time runs out: the subscription's handler timeout
    /// ([`SubscriptionOptions::timeout`](crate::SubscriptionOptions::timeout), else
    /// [`BusBuilder::handler_timeout`](crate::BusBuilder::handler_timeout)) from the
    /// moment the handler was called. Then the handler's future is dropped and the attempt
    /// counts as failed. `None` when there is no timeout (the default).
    ///
    /// The lease is not a deadline for the handler: the bus extends it while the handler
    /// runs.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The time left until [`deadline`](Context::deadline) (zero once it passed), or
    /// `None` when there is no timeout.
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Whether the bus has begun to shut down.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Completes when the bus begins to shut down. A handler may then stop early and
    /// return (an error retries the delivery later, on this or another bus); the bus
    /// waits for running handlers until its shutdown deadline in any case.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// A token cancelled when the bus begins to shut down, to hand to work the handler
    /// starts. Cancelling it (or a clone) affects nothing but the holders of this token.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.child_token()
    }

    /// Completes the delivery inside `tx`, the handler's own write transaction: its
    /// writes and the completion commit together, or neither does. The bus then does not
    /// acknowledge the delivery again when the handler returns `Ok`.
    ///
    /// Fenced like every acknowledgement: it applies only while this attempt still holds
    /// the delivery's lease. For an ordered subscription it hands the key to its next
    /// delivery, as an acknowledgement does, once `tx` commits. `tx` must be `READ
    /// COMMITTED` (PostgreSQL's default); see [`Delivery::ack_in`](crate::Delivery::ack_in)
    /// for the locks it holds until `tx` ends. A sqlx transaction completes it with
    /// `pgbus::sqlx::ack_in(&mut tx, &cx)` (the `sqlx` or `sqlx-0_8` feature).
    ///
    /// If `tx` rolls back after this, the delivery was not completed. Return an error from
    /// the handler then (returning the error of a failed `commit` with `?` does): the bus
    /// records the failed attempt and retries the delivery after its backoff, as for any
    /// error. If the handler returns `Ok` although `tx` rolled back, the delivery comes
    /// back when its lease expires.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) when the lease was lost (the delivery
    /// was reaped and perhaps claimed again elsewhere): the statement's error has aborted
    /// `tx`, so its writes cannot commit (a `COMMIT` rolls back). A database error
    /// otherwise (also aborting `tx`, when PostgreSQL refused the statement).
    pub async fn ack_in(&self, tx: &tokio_postgres::Transaction<'_>) -> Result<()> {
        self.settler
            .ack_in(tx, &self.subscription, self.seq, self.attempt)
            .await?;
        self.acked_in.store(true, Ordering::Release);
        Ok(())
    }

    /// What the `pgbus.ack_in` statement is sent with, by another driver (`pgbus::sqlx`):
    /// the subscription, the seq, the attempt and the worker id.
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    pub(crate) fn ack_in_args(&self) -> (&str, i64, i32, &str) {
        (
            &self.subscription,
            self.seq,
            self.attempt,
            self.settler.worker(),
        )
    }

    /// Records what the `pgbus.ack_in` statement sent by another driver came to, as
    /// [`ack_in`](Context::ack_in) does.
    #[cfg(any(feature = "sqlx", feature = "sqlx-0_8"))]
    pub(crate) fn acked_in_by(&self, ran: Result<()>) -> Result<()> {
        self.settler
            .acked_in(&self.subscription, self.seq, self.attempt, ran)?;
        self.acked_in.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether [`ack_in`](Context::ack_in) completed the delivery in a transaction.
    pub(crate) fn acked_in(&self) -> bool {
        self.acked_in.load(Ordering::Acquire)
    }
}
