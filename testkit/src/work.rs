//! Running one subscription's handler on one delivery, inside a test: the delivery is
//! claimed, handled and settled as a running bus would, and the test reads the outcome.

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, BusBuilder, ConnectConfig, Event, Handled, Handler, SubscriptionOptions};

/// How long [`work_one`] waits for a due delivery: 10 s.
pub const WORK_WAIT: Duration = Duration::from_secs(10);

/// What [`work_one`] did: the delivery's event and attempt, and how the handler's run
/// settled it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Worked {
    /// The event handled.
    pub event: Event,
    /// The delivery's attempt (1 for the first).
    pub attempt: i32,
    /// What the run came to: acknowledged, acknowledged in the handler's transaction, or
    /// failed (retried or dead-lettered).
    pub handled: Handled,
}

/// Claims the oldest due delivery of `handler`'s subscription (joining it with the
/// handler's patterns if it does not exist yet), runs `handler` on it
/// ([`Delivery::handle_with`](pgbus::Delivery::handle_with)), writes the settlement and
/// stops. `Ok(None)` when nothing was due within [`WORK_WAIT`].
///
/// Nothing else changes: the bus it starts for the purpose claims one delivery at a
/// time, and one claimed after the first is given back without using its attempt.
///
/// ```no_run
/// # async fn f(handler: impl pgbus::Handler) {
/// use pgbus::Handled;
///
/// let db = pgbus_testkit::test_db().await;
/// // ... the code under test publishes an event ...
/// let worked = pgbus_testkit::work_one(db.config(), &handler).await.unwrap().unwrap();
/// assert_eq!(worked.event.name, "order.placed");
/// assert_eq!(worked.handled, Handled::Acked);
/// # }
/// ```
///
/// # Errors
///
/// The bus's, when it cannot start (the database, an invalid subscription), and the
/// settlement's ([`Delivery::ack`](pgbus::Delivery::ack)).
pub async fn work_one<H: Handler>(
    config: impl Into<ConnectConfig>,
    handler: &H,
) -> pgbus::Result<Option<Worked>> {
    work_one_with(
        Bus::builder(config),
        SubscriptionOptions::default(),
        handler,
        WORK_WAIT,
    )
    .await
}

/// As [`work_one`], with a bus built by `builder` (its retry policy gives the backoff of
/// a failed run), the subscription's `options`, and a wait of one's own.
///
/// # Errors
///
/// As [`work_one`].
pub async fn work_one_with<H: Handler>(
    builder: BusBuilder,
    options: SubscriptionOptions,
    handler: &H,
    wait: Duration,
) -> pgbus::Result<Option<Worked>> {
    let mut bus = builder.concurrency(1).batch_size(1).build()?;
    let mut stream = bus.subscribe_with(handler.name(), handler.patterns(), options)?;
    let running = bus.start().await?;
    let worked = match tokio::time::timeout(wait, stream.next()).await {
        Ok(Some(delivery)) => {
            let event = delivery.event().clone();
            let attempt = delivery.attempt();
            delivery.handle_with(handler).await.map(|handled| {
                Some(Worked {
                    event,
                    attempt,
                    handled,
                })
            })
        }
        Ok(None) | Err(_) => Ok(None),
    };
    drop(stream);
    running.shutdown().await?;
    worked
}
