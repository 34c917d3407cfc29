//! [`pgbus::sqlx`](crate::sqlx)'s API against sqlx 0.8 (the `sqlx-0_8` Cargo feature), for
//! services on sqlx 0.8: the same functions ([`publish`], [`publish_batch`],
//! [`publish_with`], [`publish_batch_with`], [`migrate`], [`ack_in`],
//! [`ack_delivery_in`]) with the same semantics, taking sqlx 0.8's executors and
//! connections. One source serves both versions.
//!
//! ```toml
//! # A clone of pgbus by path until it is released; then: version = "0.1"
//! pgbus = { path = "../pgbus", features = ["sqlx-0_8"] }
//! ```
//!
//! With `sqlx-0_8` alone, this module is also `pgbus::sqlx` and sqlx 0.8's failures are
//! [`Error::Sqlx`](crate::Error::Sqlx), so code written for either version reads the
//! same. With both features on, `pgbus::sqlx` is sqlx 0.9's and this module's failures
//! are `Error::Sqlx08`.

/// The sqlx crate this module is compiled against.
use ::sqlx08 as driver;

pub use crate::error::sqlx08::SqlxError;

// The same file is the other sqlx version's module too: on purpose, one source for both.
#[allow(clippy::duplicate_mod)]
#[path = "sqlx_api.rs"]
mod api;

pub use api::*;
