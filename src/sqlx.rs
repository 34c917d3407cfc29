//! Publishing, migrating and completing deliveries through sqlx (the `sqlx` Cargo
//! feature).
//!
//! A service built on sqlx publishes its events in its own sqlx transaction, with the
//! business writes: [`publish`] and [`publish_batch`] take any sqlx PostgreSQL executor
//! (`&mut *tx` for a `sqlx::Transaction`, a `&mut PgConnection`, a `&PgPool`) and never
//! begin or commit. They are [`crate::publish`] and [`crate::publish_batch`] sent through
//! sqlx: the same statement, the same checks before anything is sent (a refused event is
//! the same [`Error::Invalid`] and leaves the transaction usable), the same idempotency
//! ([`Published::Duplicate`] for an identical event with the same id, [`Error::Conflict`]
//! for different content, writing nothing). [`migrate`] applies the same migrations as
//! [`crate::migrate`], under the same lock and checks. On the consuming side, [`ack_in`]
//! completes a handler's delivery inside the handler's own sqlx transaction
//! ([`Context::ack_in`] through sqlx), and [`ack_delivery_in`] a stream's
//! [`Delivery`] ([`Delivery::ack_in`]), so that a projection written with the service's
//! own pool and its completion commit together.
//!
//! ```toml
//! # A clone of pgbus by path until it is released; then: version = "0.1"
//! pgbus = { path = "../pgbus", features = ["sqlx"] }
//! ```
//!
//! ```no_run
//! use pgbus::Event;
//! use serde_json::json;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
//! pgbus::sqlx::migrate(&pool).await?; // once per database; also `pgbus migrate`
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE orders SET state = 'placed' WHERE id = $1")
//!     .bind(42_i64)
//!     .execute(&mut *tx)
//!     .await?;
//! let event = Event::new("order.placed", json!({"order_id": 42})).aggregate("order", "42");
//! pgbus::sqlx::publish(&mut *tx, &event).await?;
//! tx.commit().await?; // the event is delivered only if this commits
//! # Ok(())
//! # }
//! ```
//!
//! Each statement is sent unnamed (`persistent(false)`): sqlx prepares it and then binds
//! it, two round trips instead of one for a cached statement, and nothing is left on the
//! server connection beyond the transaction, so it works inside a transaction behind a
//! transaction-mode pooler. A failure of sqlx or PostgreSQL is [`Error::Sqlx`]:
//! [`Error::code`], [`Error::is_connection`] and [`Error::is_transient`] answer as they
//! do for tokio-postgres.
//!
//! sqlx 0.9 needs Rust 1.94 or newer.
//!
//! # sqlx 0.8
//!
//! A service on sqlx 0.8 enables the `sqlx-0_8` feature instead (a `sqlx` 0.9 build
//! would fail there with E0277, "multiple different versions of crate `sqlx_core`"):
//!
//! ```toml
//! pgbus = { path = "../pgbus", features = ["sqlx-0_8"] }
//! ```
//!
//! The same API, built from the same source against sqlx 0.8, is then
//! `pgbus::sqlx08`, and also `pgbus::sqlx` (so the code above is unchanged), and its
//! failures are [`Error::Sqlx`]. With both features on, `pgbus::sqlx` is sqlx 0.9's,
//! `pgbus::sqlx08` sqlx 0.8's, and the latter's failures are `Error::Sqlx08`.

#[cfg(doc)]
use crate::{Context, Delivery, Error, Published};
/// The sqlx crate this module is compiled against.
use ::sqlx as driver;

pub use crate::error::sqlx09::SqlxError;

// The same file is the other sqlx version's module too: on purpose, one source for both.
#[allow(clippy::duplicate_mod)]
#[path = "sqlx_api.rs"]
mod api;

pub use api::*;
