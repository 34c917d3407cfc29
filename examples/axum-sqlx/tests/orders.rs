//! The service's tests, on pgbus-testkit: a database of each test's own, what a request
//! published, and the subscription's handler run on one delivery.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use orders_service::OrderTotals;
use pgbus::Handled;
use pgbus_testkit::TestDb;
use serde_json::json;
use sqlx::PgPool;
use tower::ServiceExt;

/// A migrated database, the service's pool on it, and the `order-totals` subscription
/// registered, as the deployed service's bus registers it at its start.
async fn service() -> (TestDb, PgPool) {
    let db = pgbus_testkit::test_db().await;
    let pool = PgPool::connect(&db.url()).await.unwrap();
    orders_service::migrate(&pool).await.unwrap();
    let running = orders_service::bus(db.config(), pool.clone())
        .unwrap()
        .start()
        .await
        .unwrap();
    running.shutdown().await.unwrap();
    (db, pool)
}

async fn place(pool: &PgPool, order: serde_json::Value) -> StatusCode {
    let request = Request::post("/orders")
        .header("content-type", "application/json")
        .body(Body::from(order.to_string()))
        .unwrap();
    let response = orders_service::router(pool.clone())
        .oneshot(request)
        .await
        .unwrap();
    response.status()
}

#[tokio::test]
async fn placing_an_order_publishes_order_placed_in_its_transaction() {
    let (db, pool) = service().await;
    let order = json!({"order_id": 42, "total_cents": 1999});
    assert_eq!(place(&pool, order.clone()).await, StatusCode::CREATED);

    let client = db.connect().await;
    let event = pgbus_testkit::assert_published(&client, "order.placed", &order).await;
    assert_eq!(event.name, "order.placed");
}

#[tokio::test]
async fn a_refused_order_publishes_nothing() {
    let (db, pool) = service().await;
    let order = json!({"order_id": 7, "total_cents": 500});
    assert_eq!(place(&pool, order.clone()).await, StatusCode::CREATED);
    let again = json!({"order_id": 7, "total_cents": 999});
    assert_eq!(place(&pool, again.clone()).await, StatusCode::CONFLICT);

    let client = db.connect().await;
    pgbus_testkit::assert_published(&client, "order.placed", &order).await;
    let published = pgbus_testkit::published(&client).await;
    assert_eq!(
        published.len(),
        1,
        "the refused order published nothing: {published:?}"
    );
}

#[tokio::test]
async fn the_projection_commits_with_its_delivery_s_completion() {
    let (db, pool) = service().await;
    assert_eq!(
        place(&pool, json!({"order_id": 9, "total_cents": 1250})).await,
        StatusCode::CREATED
    );

    let worked = pgbus_testkit::work_one(db.config(), &OrderTotals::new(pool.clone()))
        .await
        .unwrap()
        .expect("a delivery of order.placed was due");
    assert_eq!(worked.event.name, "order.placed");
    assert_eq!(
        worked.handled,
        Handled::AckedIn,
        "completed in the handler's transaction"
    );
    let total: (i64,) = sqlx::query_as("SELECT total_cents FROM order_totals WHERE order_id = 9")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(total.0, 1250);
    let client = db.connect().await;
    pgbus_testkit::wait_settled(&client, "the order's delivery").await;
}

#[tokio::test]
async fn a_payload_that_is_not_an_order_is_dead_at_once() {
    let (db, pool) = service().await;
    let client = db.connect().await;
    pgbus::publish(
        &client,
        &pgbus::Event::new("order.placed", json!({"order_id": "nine"})),
    )
    .await
    .unwrap();

    let worked = pgbus_testkit::work_one(db.config(), &OrderTotals::new(pool))
        .await
        .unwrap()
        .expect("a delivery of order.placed was due");
    match worked.handled {
        Handled::Failed { permanent, .. } => assert!(permanent, "{:?}", worked.handled),
        other => panic!("expected a permanent failure, got {other:?}"),
    }
}
