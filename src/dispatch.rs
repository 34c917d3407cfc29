//! Dispatching: each claimed delivery goes to its subscription, a handler task (under the
//! bus's and the subscription's concurrency limits, with its timeout, panics caught) or an
//! in-process stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;

use crate::delivery::Delivery;
use crate::handler::DynHandler;
use crate::shutdown::Shutdown;

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
        let action = delivery
            .invoke(&*self.handler, cx.clone(), deadline, self.timeout)
            .await;
        delivery.finish(action, cx.acked_in());
    }
}
