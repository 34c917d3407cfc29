//! What an application registers: a [`Handler`] per subscription (or a closure, perhaps
//! taking the [`Context`] or a typed payload), and the [`SubscriptionOptions`] of each.

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;

use crate::context::Context;
use crate::error::HandlerError;
use crate::event::Event;
use crate::retry::RetryPolicy;
use crate::subscription::DeadHeadPolicy;

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

    /// Handles one event, with its delivery's [`Context`] (attempt, deadline, shutdown
    /// signal, [`Context::ack_in`]). This is what the bus calls; by default it calls
    /// [`Handler::handle`]. A handler that needs the context overrides it (and its
    /// `handle` is then never called by the bus):
    ///
    /// ```
    /// use pgbus::{Context, Event, Handler, HandlerError};
    ///
    /// struct Audit;
    ///
    /// impl Handler for Audit {
    ///     fn name(&self) -> &str {
    ///         "audit"
    ///     }
    ///     fn patterns(&self) -> Vec<String> {
    ///         vec!["*".into()]
    ///     }
    ///     async fn handle(&self, event: &Event) -> Result<(), HandlerError> {
    ///         println!("{}", event.name);
    ///         Ok(())
    ///     }
    ///     async fn handle_with_context(
    ///         &self,
    ///         event: &Event,
    ///         cx: &Context,
    ///     ) -> Result<(), HandlerError> {
    ///         println!("{} (attempt {})", event.name, cx.attempt());
    ///         Ok(())
    ///     }
    /// }
    /// ```
    fn handle_with_context(
        &self,
        event: &Event,
        cx: &Context,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        let _ = cx;
        self.handle(event)
    }
}

/// The object-safe form of [`Handler`] that the bus stores.
pub(crate) trait DynHandler: Send + Sync {
    fn call<'a>(&'a self, event: &'a Event, cx: Context)
    -> BoxFuture<'a, Result<(), HandlerError>>;
}

impl<H: Handler> DynHandler for H {
    fn call<'a>(
        &'a self,
        event: &'a Event,
        cx: Context,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        async move { self.handle_with_context(event, &cx).await }.boxed()
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
    fn call<'a>(&'a self, event: &'a Event, _: Context) -> BoxFuture<'a, Result<(), HandlerError>> {
        (self.f)(event.clone()).boxed()
    }
}

/// A handler made of a closure that takes an argument made from the event (the event
/// itself, or its payload decoded) and the [`Context`] (see
/// [`BusBuilder::handler_with_context`](crate::BusBuilder::handler_with_context) and
/// [`BusBuilder::handler_typed`](crate::BusBuilder::handler_typed)).
pub(crate) struct ArgFnHandler<A, F> {
    f: F,
    /// Makes the argument; an error fails the attempt without calling `f`.
    arg: fn(&Event) -> Result<A, HandlerError>,
}

impl<F> ArgFnHandler<Event, F> {
    /// The closure gets the event.
    pub(crate) fn event(f: F) -> Self {
        ArgFnHandler {
            f,
            arg: |event| Ok(event.clone()),
        }
    }
}

impl<T: DeserializeOwned, F> ArgFnHandler<T, F> {
    /// The closure gets the payload decoded as `T`.
    pub(crate) fn typed(f: F) -> Self {
        ArgFnHandler {
            f,
            arg: decode::<T>,
        }
    }
}

impl<A, F, Fut> DynHandler for ArgFnHandler<A, F>
where
    F: Fn(A, Context) -> Fut + Send + Sync,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn call<'a>(
        &'a self,
        event: &'a Event,
        cx: Context,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        match (self.arg)(event) {
            Ok(arg) => (self.f)(arg, cx).boxed(),
            Err(e) => futures::future::ready(Err(e)).boxed(),
        }
    }
}

/// An event's payload as `T`; a payload that does not decode is a permanent failure:
/// retrying cannot change the payload.
fn decode<T: DeserializeOwned>(event: &Event) -> Result<T, HandlerError> {
    T::deserialize(&event.payload).map_err(|e| {
        HandlerError::permanent(format!(
            "the payload of {} does not decode as {}: {e}",
            event.name,
            std::any::type_name::<T>()
        ))
    })
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
