//! Operating the bus: subscriptions (pausing and resuming them too), status, dead letters,
//! replay, ordering and the retention sweep. The `pgbus` command line is a thin layer over these functions.
//!
//! Every function here is one statement (except [`sweep`], one statement per batch), so
//! each works on any [`Executor`](crate::Executor): given a client, the statement is its own transaction;
//! given a transaction, it joins it and commits or rolls back with it (the transactional
//! twin). Every value is sent as a parameter. The statements are documented in
//! `src/sql/`.
//!
//! Every statement is sent unnamed, with its parameter types (`query_typed`): one round
//! trip, and nothing is left on the server connection between statements, so these
//! functions work behind a pooler in transaction mode (PgBouncer), which hands each
//! transaction whichever server connection is free.
//!
//! ```no_run
//! # async fn example(client: &tokio_postgres::Client) -> Result<(), pgbus::Error> {
//! use pgbus::admin::{self, DeadLetterFilter};
//!
//! for sub in admin::status(client).await?.subscriptions {
//!     println!("{}: {} pending, {} dead", sub.name, sub.pending, sub.dead);
//! }
//! let retried = admin::retry_dead_letters(client, &DeadLetterFilter::all()).await?;
//! println!("{retried} dead letters back to pending");
//! # Ok(()) }
//! ```
//!
//! One file per operator concern: subscriptions (with the
//! settings shared with the runtime, from `crate::subscription`), status, dead letters,
//! replay, the dashboard's reads ("inspect") and [`ordering`]. The retention sweep lives
//! in `crate::retention`, which the runtime runs too. Nothing in the runtime imports this
//! module (`tests/module_graph.rs` keeps it so).

mod dead_letters;
mod inspect;
pub mod ordering;
mod replay;
mod status;
mod subscriptions;

pub use dead_letters::{
    DeadLetter, DeadLetterCursor, DeadLetterFilter, Purged, count_dead_letters,
    count_dead_letters_after, dead_letters, dead_letters_after, purge_dead_letters,
    retry_dead_letters,
};
pub use inspect::{
    EventDelivery, FailedAttempt, PendingDelivery, RecentlyDelivered, delivered_recently,
    event_deliveries, failure_history, find_events, pending_deliveries,
};
pub use replay::{Replayed, replay};
pub use status::{
    ClusterStatus, ConsumerInfo, RECENT_EVENTS_CAP, RECENT_PROBES_CAP, Status, SubscriptionStatus,
    backlog, cluster_status, consumers, fan_out_backlog, status, status_of, subscription_status,
    xmin_horizon,
};
pub use subscriptions::{
    Dropped, Paused, Resumed, SubscriptionInfo, drop_subscription, pause_subscription,
    register_subscription, require_subscription, resume_subscription, subscriptions,
};

pub use crate::retention::{DEFAULT_RETENTION, DEFAULT_SWEEP_BATCH, Swept, sweep, sweep_batch};
pub use crate::subscription::{
    DEFAULT_CONFIGURE_WAIT, DeadHeadPolicy, SubscriptionChange, SubscriptionSettings,
    configure_subscription, configure_subscription_within, subscription_settings,
    validate_subscription,
};
