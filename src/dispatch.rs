//! Handlers, subscriptions and routing: each subscription is one handler (or one
//! in-process stream), with its own retry policy, concurrency limit and timeout.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Semaphore;

use crate::error::HandlerError;
use crate::event::Event;
use crate::ordering::DeadHeadPolicy;
use crate::retry::RetryPolicy;
use crate::subscribe::Delivery;

/// A subscription's handler: it names the subscription, says which events it wants, and
/// handles each of them.
///
/// A handler runs at least once per matching event and must tolerate running again for
/// the same event (at-least-once delivery): after a crash, a lost lease, or a failed
/// acknowledgement. Returning `Err` is a failed attempt; so is a panic and running past
/// the subscription's timeout.
///
/// ```
/// use pgbus::{Event, Handler, HandlerError};
///
/// struct SendReceipt;
///
/// impl Handler for SendReceipt {
///     fn name(&self) -> &str {
///         "send-receipt"
///     }
///     fn patterns(&self) -> Vec<String> {
///         vec!["order.placed".into()]
///     }
///     async fn handle(&self, event: &Event) -> Result<(), HandlerError> {
///         let _order_id = event.payload["order_id"].as_i64();
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The subscription's name: stable across deploys, since delivery state is kept
    /// under it.
    fn name(&self) -> &str;

    /// The event-name patterns the subscription matches: `*`, an exact name
    /// (`order.placed`), or a prefix (`order.*`).
    fn patterns(&self) -> Vec<String>;

    /// Handles one event.
    fn handle(&self, event: &Event) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// The object-safe form of [`Handler`] that the bus stores.
pub(crate) trait DynHandler: Send + Sync {
    fn call<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<(), HandlerError>>;
}

impl<H: Handler> DynHandler for H {
    fn call<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<(), HandlerError>> {
        self.handle(event).boxed()
    }
}

/// A handler made of a closure (see [`BusBuilder::handler_fn`](crate::BusBuilder::handler_fn)).
pub(crate) struct FnHandler<F> {
    pub(crate) f: F,
}

impl<F, Fut> DynHandler for FnHandler<F>
where
    F: Fn(Event) -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<(), HandlerError>> {
        (self.f)(event.clone()).boxed()
    }
}

/// Per-subscription settings; unset fields take the bus's defaults.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SubscriptionOptions {
    /// How failures are retried, and the maximum attempts (default: the bus's policy).
    pub retry: Option<RetryPolicy>,
    /// The most deliveries of this subscription handled at once (default: only the bus's
    /// limit applies). For a stream subscription: how many deliveries may be claimed and
    /// not yet settled (default: the bus's concurrency).
    pub concurrency: Option<usize>,
    /// How long one attempt may run before it counts as failed (default: the bus's
    /// handler timeout).
    pub timeout: Option<Duration>,
    /// Deliver each ordering key's events one at a time, in commit order. Unset (the
    /// default): a new subscription is unordered, an existing one keeps what is stored.
    /// Set and different from what is stored: the bus refuses to start unless
    /// [`BusBuilder::reconfigure`](crate::BusBuilder::reconfigure). See [`crate::ordering`].
    pub ordered: Option<bool>,
    /// For an ordered subscription, what a dead head does to its key. Unset (the
    /// default): [`DeadHeadPolicy::Block`] for a new subscription, the stored policy for
    /// an existing one.
    pub on_dead: Option<DeadHeadPolicy>,
}

impl SubscriptionOptions {
    /// Options with every field unset.
    pub fn new() -> Self {
        SubscriptionOptions::default()
    }

    /// Sets the retry policy.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// Sets the concurrency limit.
    pub fn concurrency(mut self, limit: usize) -> Self {
        self.concurrency = Some(limit.max(1));
        self
    }

    /// Sets the per-attempt timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Makes the subscription ordered: one delivery per ordering key at a time, in the
    /// order the events' transactions committed.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = Some(ordered);
        self
    }

    /// Sets what a dead head does to its key in an ordered subscription.
    pub fn on_dead(mut self, policy: DeadHeadPolicy) -> Self {
        self.on_dead = Some(policy);
        self
    }
}

/// Where a subscription's deliveries go.
pub(crate) enum Target {
    Handler(Arc<dyn DynHandler>),
    Stream(tokio::sync::mpsc::UnboundedSender<Delivery>),
}

/// A subscription as the running bus keeps it.
pub(crate) struct SubRuntime {
    pub(crate) name: Arc<str>,
    /// The settings this bus asks for (unset ones follow the stored subscription).
    pub(crate) asked: crate::admin::SubscriptionChange,
    pub(crate) retry: RetryPolicy,
    pub(crate) timeout: Option<Duration>,
    /// Claimed and not yet settled, for the claim quota.
    pub(crate) held: AtomicUsize,
    /// The most this subscription may hold at once, if limited.
    pub(crate) limit: Option<usize>,
    /// Limits concurrent handler runs of this subscription.
    pub(crate) run_limit: Option<Arc<Semaphore>>,
    pub(crate) target: Target,
}

impl std::fmt::Debug for SubRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubRuntime")
            .field("name", &self.name)
            .field("asked", &self.asked)
            .field("held", &self.held.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl SubRuntime {
    /// How many deliveries this subscription may claim now, out of `free`.
    pub(crate) fn quota(&self, free: usize) -> usize {
        match self.limit {
            Some(limit) => limit
                .saturating_sub(self.held.load(Ordering::Acquire))
                .min(free),
            None => free,
        }
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}
