//! Dispatching: each claimed delivery goes to its subscription, a handler task (under the
//! bus's and the subscription's concurrency limits, with its timeout, panics caught) or an
//! in-process stream.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::context::Context;
use crate::delivery::Delivery;
use crate::error::HandlerError;
use crate::handler::DynHandler;
use crate::settle::Action;
use crate::shutdown::Shutdown;
use crate::trace_context;

/// Where a subscription's deliveries go.
pub(crate) enum Target {
    Handler {
        handler: Arc<dyn DynHandler>,
        timeout: Option<Duration>,
        /// Limits concurrent runs of this subscription's handler, if set.
        limit: Option<Arc<Semaphore>>,
    },
    Stream(mpsc::UnboundedSender<Delivery>),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Handler { timeout, .. } => f
                .debug_struct("Handler")
                .field("timeout", timeout)
                .finish_non_exhaustive(),
            Target::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// The dispatcher: the subscriptions' targets by name, and the bus's concurrency limit.
#[derive(Debug)]
pub(crate) struct Dispatcher {
    pub(crate) targets: HashMap<Arc<str>, Target>,
    pub(crate) concurrency: usize,
    pub(crate) shutdown: Arc<Shutdown>,
}

impl Dispatcher {
    /// Routes every delivery of `claims` until it ends (the bus is stopping); then waits
    /// for running handlers until the handlers' deadline and aborts the rest (their
    /// deliveries count as failed attempts and return at once).
    pub(crate) async fn run(self, claims: impl Stream<Item = Delivery> + Send) {
        let run_limit = Arc::new(Semaphore::new(self.concurrency));
        let mut tasks = JoinSet::new();
        tokio::pin!(claims);
        while let Some(delivery) = claims.next().await {
            while tasks.try_join_next().is_some() {}
            match self.targets.get(delivery.subscription()) {
                // A dropped stream drops the delivery unstarted: it is released. So does a
                // stopping bus, whose streams are no longer read.
                Some(Target::Stream(tx)) if !self.shutdown.is_stopping() => {
                    let _ = tx.send(delivery);
                }
                Some(Target::Stream(_)) => {}
                Some(Target::Handler {
                    handler,
                    timeout,
                    limit,
                }) => {
                    let run = Run {
                        handler: handler.clone(),
                        timeout: *timeout,
                        limits: [Some(run_limit.clone()), limit.clone()],
                        shutdown: self.shutdown.clone(),
                    };
                    tasks.spawn(run.handle(delivery));
                }
                None => {} // cannot happen: the claimer claims for these names only
            }
        }
        let deadline = self.shutdown.handlers_deadline();
        while !tasks.is_empty() {
            match tokio::time::timeout_at(deadline, tasks.join_next()).await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => {
                    crate::warn_limited!(
                        running = tasks.len(),
                        "pgbus shutdown timeout: aborting handlers still running"
                    );
                    tasks.shutdown().await;
                    break;
                }
            }
        }
    }
}

/// One handler run.
struct Run {
    handler: Arc<dyn DynHandler>,
    timeout: Option<Duration>,
    /// The bus's limit, then the subscription's, if any.
    limits: [Option<Arc<Semaphore>>; 2],
    shutdown: Arc<Shutdown>,
}

impl Run {
    /// Waits for a place under the limits (a delivery never started is released when the
    /// bus stops first), runs the handler, and hands the outcome to the acker.
    async fn handle(self, mut delivery: Delivery) {
        let mut permits: Vec<OwnedSemaphorePermit> = Vec::with_capacity(2);
        for limit in self.limits.iter().flatten() {
            tokio::select! {
                p = limit.clone().acquire_owned() => permits.extend(p.ok()),
                // Never started: dropping it releases it.
                _ = self.shutdown.stopping() => return,
            }
        }
        delivery.mark_started();
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        let cx = delivery.context(deadline, self.shutdown.token().child_token());
        let action = invoke(
            &*self.handler,
            &delivery,
            cx.clone(),
            deadline,
            self.timeout,
        )
        .await;
        delivery.finish(action, cx.acked_in());
    }
}

/// Runs `handler` on `delivery` in its `pgbus.process` span, until `deadline` (the
/// handler's `timeout` from its start), catching a panic; says what to write.
pub(crate) async fn invoke(
    handler: &dyn DynHandler,
    delivery: &Delivery,
    cx: Context,
    deadline: Option<tokio::time::Instant>,
    timeout: Option<Duration>,
) -> Action {
    let event = delivery.event();
    // Named `process <subscription>`: subscriptions are few and known to the consumer,
    // event names are as many as the publishers make.
    let span = tracing::info_span!(
        "pgbus.process",
        otel.name = %format_args!("process {}", delivery.subscription()),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        messaging.system = "pgbus",
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = %event.name,
        messaging.destination.subscription.name = %delivery.subscription(),
        messaging.message.id = %event.id,
        messaging.message.conversation_id = event.correlation_id.as_deref(),
        pgbus.attempt = delivery.attempt(),
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
    delivery.fail_action(&error)
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
