//! pgbus: a transactional outbox and event bus on PostgreSQL, delivered by push.
//!
//! An application publishes events inside its own business transaction; when that
//! transaction commits, a trigger's `pg_notify` wakes every listening bus, which claims
//! the new deliveries with `FOR UPDATE SKIP LOCKED` and hands them to the handlers
//! subscribed to them. Each subscription gets its own delivery of each matching event,
//! and succeeds, retries, dies and is replayed on its own.
//!
//! ```no_run
//! use pgbus::Event;
//! use serde_json::json;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let (mut client, connection) =
//!     tokio_postgres::connect("host=localhost user=postgres", tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//!
//! // Once per database (also: `pgbus migrate`).
//! pgbus::migrate(&client).await?;
//!
//! // Publish inside the business transaction: delivered only if it commits.
//! let tx = client.transaction().await?;
//! tx.execute("SELECT 1", &[]).await?; // ... the business writes ...
//! pgbus::publish(&tx, &Event::new("order.placed", json!({"order_id": 42}))
//!     .aggregate("order", "42")
//!     .correlation_id("req-7f3a"))
//!     .await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```

// docs.rs (`--cfg docsrs`, nightly rustdoc) marks the items of a Cargo feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The modules in the order an event meets them (a comment between two steps keeps
// rustfmt from sorting them into one list).

// Publishing, inside the caller's transaction (the fan-out and the notification are in
// sql/): the event, what it is published through, and the trace context it carries.
mod event;
// What statements run on: a client or a transaction.
mod executor;
mod publish;
pub mod trace_context;
// The same publishing through sqlx.
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub mod sqlx;
#[cfg(feature = "sqlx-0_8")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx-0_8")))]
pub mod sqlx08;
/// With the `sqlx-0_8` feature alone, `pgbus::sqlx` is [`sqlx08`]: the same API against
/// sqlx 0.8.
#[cfg(all(feature = "sqlx-0_8", not(feature = "sqlx")))]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx-0_8")))]
pub use sqlx08 as sqlx;

// The runtime. The bus wires the rooms and is the only module that knows them all.
mod bus;
// A starting bus joins its subscriptions.
mod subscription;
// Listen: a notification wakes the claimer.
mod listen;
// Claim: deliveries into slots, their rows decoded.
mod claim;
mod decode;
mod slot;
// Dispatch: each delivery to its handler or stream, with its context.
mod dispatch;
mod handler;
// The handler's view of a delivery.
mod context;
mod delivery;
// Settle: acknowledgements and retries in batches.
mod settle;
// Beside the path: maintenance by the elected bus, and the retention sweep it runs.
mod maintain;
mod retention;
// The runtime's shared leaves: connections, backoff, shutdown, counters.
mod backoff;
mod conn;
mod shutdown;
mod stats;

// Operating the bus: the operator API, the schema's migrations, the metrics.
pub mod admin;
pub use admin::ordering;
pub mod metrics;
pub mod schema;

// Connecting (connection strings, the environment, TLS), and the shared leaves.
pub mod connect;
mod error;
mod retry;
mod sql;

pub use bus::{
    Bus, BusBuilder, DEFAULT_BATCH_SIZE, DEFAULT_CLAIM_BYTES, DEFAULT_CONCURRENCY,
    DEFAULT_HANDLER_TIMEOUT, DEFAULT_IDLE_POLL_INTERVAL, DEFAULT_LEADER_LEASE, DEFAULT_LEASE,
    DEFAULT_POLL_INTERVAL, DEFAULT_POOL_SIZE, DEFAULT_RETENTION, DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_STATEMENT_TIMEOUT, DEFAULT_SYNCHRONOUS_COMMIT, RunningBus,
};
pub use connect::{ConnectConfig, DEFAULT_CONNECT_TIMEOUT, ServerStream, SslMode};
pub use context::Context;
pub use delivery::{Delivery, Handled, Subscription};
pub use error::{
    ConnectPhase, Error, Grant, HandlerError, LockHolder, MAX_ERROR_TEXT, PoolError, Result,
};
pub use event::{
    DEFAULT_MAX_PAYLOAD_BYTES, Event, MAX_DELAY, MAX_EVENT_BYTES, MAX_JSON_DEPTH, MAX_KEY_BYTES,
    MAX_NAME_BYTES, is_invisible, json_text_bytes, pattern_matches,
};
pub use executor::Executor;
pub use handler::{Handler, SubscriptionOptions};
pub use publish::{Published, Publisher, publish, publish_batch};
pub use retry::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_BASE, DEFAULT_RETRY_CAP, DEFAULT_RETRY_FACTOR,
    MAX_RETRY_DELAY, RetryPolicy,
};
pub use schema::migrate;
pub use stats::Stats;
pub use subscription::DeadHeadPolicy;

#[doc(hidden)]
pub mod __private {
    //! Not part of the API (no semver promise): pgbus's own test kit and benchmarks reach the bus's statements here.

    /// The bus's statements (`src/sql/`). A glob re-export: the private module itself
    /// cannot be re-exported.
    pub mod sql {
        pub use crate::sql::*;
    }

    pub use crate::backoff::{WARN_EVERY, WarnGate};
    pub use crate::conn::drop_closed;
    pub use tracing;

    /// An event checked as [`publish`](crate::publish) checks it, with its payload and
    /// headers as sent (JSON text) and its delay in milliseconds: for the test kit's COPY
    /// publisher, which must refuse what `publish_batch` refuses.
    ///
    /// # Errors
    ///
    /// As `publish`, for bad input.
    pub fn encode(event: &crate::Event) -> crate::Result<(String, String, Option<i64>)> {
        let encoded = event.encode(crate::DEFAULT_MAX_PAYLOAD_BYTES)?;
        Ok((encoded.payload, encoded.headers, encoded.delay_ms))
    }
}

/// The README's examples, compiled as doc tests. Only with the `sqlx` and
/// `opentelemetry` features (as `scripts/check` runs them, `--all-features`): the
/// README's sqlx and tracing examples need them.
#[doc = include_str!("../README.md")]
#[cfg(all(doctest, feature = "sqlx", feature = "opentelemetry"))]
pub struct ReadmeDoctests;

/// The examples of the guide to TLS and poolers, compiled as doc tests (as the README's).
#[doc = include_str!("../docs/connecting.md")]
#[cfg(all(doctest, feature = "sqlx", feature = "opentelemetry"))]
pub struct ConnectingDoctests;

/// The examples of the operations guide (metrics, tracing), compiled as doc tests.
#[doc = include_str!("../docs/operations.md")]
#[cfg(all(doctest, feature = "sqlx", feature = "opentelemetry"))]
pub struct OperationsDoctests;
