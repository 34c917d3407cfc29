//! Publishing and migrating through sqlx (`pgbus::sqlx`, the `sqlx` feature): in a sqlx
//! transaction that commits or rolls back, through each kind of executor, in batches,
//! with the same idempotency, validation and errors as the tokio-postgres path; and
//! completing deliveries in a sqlx transaction (`ack_in`, `ack_delivery_in`). The body is
//! `shared/sqlx_tests.rs`, run against sqlx 0.8 by `tests/sqlx08.rs`.

mod common;
#[path = "shared/migrations.rs"]
mod migrations;
#[path = "shared/roles.rs"]
mod roles;

use ::sqlx as driver;
use pgbus::Error::Sqlx as SqlxFailure;
use pgbus::sqlx as pgbus_sqlx;

include!("shared/sqlx_tests.rs");
