//! orders-service: an axum + sqlx service that adds reliable events with pgbus.
//!
//! - `POST /orders` writes the order and publishes `order.placed` in the same sqlx
//!   transaction ([`pgbus::sqlx::publish`]): a refused order publishes nothing.
//! - [`OrderTotals`] is the subscription `order-totals`: it projects each placed order
//!   into `order_totals` and completes its delivery in the same sqlx transaction
//!   ([`pgbus::sqlx::ack_in`]), so the projection and the completion commit together.
//!
//! The same sources build against sqlx 0.9 (this crate, pgbus's `sqlx` feature) and sqlx
//! 0.8 (`sqlx-0.8/`, pgbus's `sqlx-0_8` feature).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use pgbus::{Bus, Context, Event, Handler, HandlerError};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// What a failure of this service's setup carries.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service's own tables.
const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS order_totals (order_id bigint PRIMARY KEY, total_cents bigint NOT NULL)",
];

/// Applies pgbus's migrations and the service's schema.
///
/// # Errors
///
/// When the database refuses either.
pub async fn migrate(pool: &PgPool) -> Result<(), BoxError> {
    pgbus::sqlx::migrate(pool).await?;
    for statement in SCHEMA {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// An order, as `POST /orders` takes it and `order.placed` carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    /// The order's id.
    pub order_id: i64,
    /// Its total, in cents.
    pub total_cents: i64,
}

/// The HTTP API: `POST /orders`.
pub fn router(pool: PgPool) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .with_state(pool)
}

/// `201 Created` with the order written and `order.placed` published, both or neither;
/// `409 Conflict` for an order id that exists (nothing written, nothing published).
async fn place_order(
    State(pool): State<PgPool>,
    Json(order): Json<Order>,
) -> Result<StatusCode, (StatusCode, String)> {
    let mut tx = pool.begin().await.map_err(internal)?;
    let inserted = sqlx::query(
        "INSERT INTO orders (id, total_cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
    )
    .bind(order.order_id)
    .bind(order.total_cents)
    .execute(&mut *tx)
    .await
    .map_err(internal)?
    .rows_affected();
    if inserted == 0 {
        // Dropping `tx` rolls it back.
        return Err((
            StatusCode::CONFLICT,
            format!("order {} exists", order.order_id),
        ));
    }
    let event = Event::json("order.placed", &order)
        .map_err(internal)?
        .aggregate("order", order.order_id.to_string());
    pgbus::sqlx::publish(&mut *tx, &event)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok(StatusCode::CREATED)
}

fn internal(error: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

/// The `order-totals` subscription: each placed order's total, projected in the
/// handler's own sqlx transaction together with the delivery's completion.
#[derive(Debug, Clone)]
pub struct OrderTotals {
    pool: PgPool,
}

impl OrderTotals {
    /// The projection, writing through `pool`.
    pub fn new(pool: PgPool) -> Self {
        OrderTotals { pool }
    }
}

impl Handler for OrderTotals {
    fn name(&self) -> &str {
        "order-totals"
    }

    fn patterns(&self) -> Vec<String> {
        vec!["order.placed".to_string()]
    }

    async fn handle(&self, _event: &Event) -> Result<(), HandlerError> {
        unreachable!("the bus calls handle_with_context")
    }

    async fn handle_with_context(&self, event: &Event, cx: &Context) -> Result<(), HandlerError> {
        // A payload that does not decode never will: dead at once, with the reason.
        let order: Order = event.payload_as().map_err(HandlerError::permanent)?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO order_totals (order_id, total_cents) VALUES ($1, $2)
             ON CONFLICT (order_id) DO NOTHING",
        )
        .bind(order.order_id)
        .bind(order.total_cents)
        .execute(&mut *tx)
        .await?;
        // Fenced: a lost lease fails here, and `tx` can no longer commit.
        pgbus::sqlx::ack_in(&mut tx, cx).await?;
        tx.commit().await?;
        Ok(())
    }
}

/// The service's bus: its subscriptions, on connections of its own to `config`.
///
/// # Errors
///
/// As [`pgbus::BusBuilder::build`].
pub fn bus(config: impl Into<pgbus::ConnectConfig>, pool: PgPool) -> pgbus::Result<Bus> {
    Bus::builder(config).handler(OrderTotals::new(pool)).build()
}
