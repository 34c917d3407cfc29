//! The tests of `tests/sqlx.rs` against sqlx 0.8 (`pgbus::sqlx08`, the `sqlx-0_8`
//! feature): the same body (`shared/sqlx_tests.rs`), through sqlx 0.8's executors.

mod common;
#[path = "shared/migrations.rs"]
mod migrations;
#[path = "shared/roles.rs"]
mod roles;

use ::sqlx08 as driver;
#[cfg(not(feature = "sqlx"))]
use pgbus::Error::Sqlx as SqlxFailure;
#[cfg(feature = "sqlx")]
use pgbus::Error::Sqlx08 as SqlxFailure;
use pgbus::sqlx08 as pgbus_sqlx;

include!("shared/sqlx_tests.rs");

/// With the `sqlx-0_8` feature alone, `pgbus::sqlx` is `pgbus::sqlx08`, so code written
/// for `pgbus::sqlx` builds against sqlx 0.8 unchanged.
#[cfg(not(feature = "sqlx"))]
#[test]
fn with_sqlx_0_8_alone_pgbus_sqlx_is_the_sqlx_0_8_module() {
    let error: Option<pgbus::sqlx::SqlxError> = None::<pgbus::sqlx08::SqlxError>;
    assert!(error.is_none());
}
