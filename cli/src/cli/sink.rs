//! What `pgbus forward` asks of a broker, broker-neutral: [`Sink`] publishes one event
//! and answers once the broker has stored it. The relay's core (`forward.rs`) and each
//! broker's sink (`jetstream.rs`) depend on this module, and not on each other's
//! internals.

use futures::future::BoxFuture;
use pgbus::Event;

/// Where forwarded events go. `publish` is answered when the broker has stored the event
/// (JetStream: its PubAck); only then is the delivery acknowledged in PostgreSQL.
///
/// A sink must drop a re-sent event (same [`Event::id`]) that it already stored: a
/// forwarder that stops between the broker's answer and the acknowledgement sends the
/// event again.
pub(crate) trait Sink: Send + Sync + 'static {
    /// Publishes `event`; resolves once the broker has stored it, or dropped it as a
    /// duplicate of one it has.
    fn publish<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<Stored, SinkError>>;

    /// Resolves, with the broker's reason, once the broker refuses the forwarder itself
    /// (a wrong or revoked credential): no event can go through until an operator
    /// mends the configuration, so the command stops with exit 1.
    fn refused(&self) -> BoxFuture<'static, String>;
}

/// What the broker did with a published event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    /// Stored now.
    New,
    /// Already stored (a re-send after a crash or a lost answer): dropped.
    Duplicate,
}

/// Why a sink did not take an event.
#[derive(Debug)]
pub(crate) enum SinkError {
    /// The broker cannot take it now (unreachable, restarting, no answer in time): the
    /// same event is tried again after a pause.
    Unavailable(String),
    /// The broker will never take this event (e.g. its name is no valid subject, it is
    /// too large, the broker's user may not publish it): the delivery becomes a dead
    /// letter with this reason.
    Rejected(String),
}
