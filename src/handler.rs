//! What an application registers: a [`Handler`] per subscription (or a closure), and the
//! [`SubscriptionOptions`] of each.

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::error::HandlerError;
use crate::event::Event;
use crate::ordering::DeadHeadPolicy;
use crate::retry::RetryPolicy;

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
