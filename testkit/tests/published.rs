//! The assertions on what was published: they pass on what a committed transaction
//! published, see an open transaction's own events, find nothing of a rolled-back one,
//! and fail, listing the log, on anything else.

use pgbus::Event;
use pgbus_testkit::{
    assert_not_published, assert_nothing_published, assert_published, assert_published_exactly,
    published,
};
use serde_json::json;
use tokio_postgres::Config;

/// The message of the panic that `check`, run on a connection of its own to `config`,
/// ends in.
async fn panic_message<F, Fut>(config: Config, check: F) -> String
where
    F: FnOnce(tokio_postgres::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let outcome = tokio::spawn(async move {
        let client = pgbus_testkit::connect(&config).await.unwrap();
        check(client).await;
    })
    .await;
    let payload = outcome.expect_err("the assertion passed").into_panic();
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[tokio::test]
async fn a_committed_transaction_is_seen_by_name_and_payload() {
    let db = pgbus_testkit::test_db().await;
    let mut client = db.connect().await;
    let tx = client.transaction().await.unwrap();
    let placed = Event::new("order.placed", json!({"order_id": 42, "lines": [1, 2]}));
    let paid = Event::new("order.paid", json!({"order_id": 42}));
    pgbus::publish(&tx, &placed).await.unwrap();
    pgbus::publish(&tx, &paid).await.unwrap();
    tx.commit().await.unwrap();

    // Key order and number spelling do not matter, as in jsonb.
    let found = assert_published(
        &client,
        "order.placed",
        &json!({"lines": [1, 2], "order_id": 42.0}),
    )
    .await;
    assert_eq!(found.id, placed.id);
    assert_eq!(found.payload, json!({"order_id": 42, "lines": [1, 2]}));
    let log = assert_published_exactly(
        &client,
        &[
            ("order.placed", json!({"order_id": 42, "lines": [1, 2]})),
            ("order.paid", json!({"order_id": 42})),
        ],
    )
    .await;
    assert_eq!(
        log.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
        [placed.id.as_str(), paid.id.as_str()]
    );
    assert!(log[0].seq < log[1].seq);
    assert_eq!(published(&client).await, log);
    assert_not_published(&client, "order.cancelled").await;
}

#[tokio::test]
async fn an_open_transaction_sees_its_own_events_and_a_rolled_back_one_published_nothing() {
    let db = pgbus_testkit::test_db().await;
    let mut client = db.connect().await;
    let tx = client.transaction().await.unwrap();
    pgbus::publish(&tx, &Event::new("order.placed", json!({"order_id": 7})))
        .await
        .unwrap();
    assert_published(&tx, "order.placed", &json!({"order_id": 7})).await;
    tx.rollback().await.unwrap();

    assert_not_published(&client, "order.placed").await;
    assert_nothing_published(&client).await;
    assert!(published(&client).await.is_empty());
}

#[tokio::test]
async fn a_failed_assertion_names_what_was_expected_and_lists_the_log() {
    let db = pgbus_testkit::test_db().await;
    let client = db.connect().await;
    let first = Event::new("order.placed", json!({"order_id": 1}));
    pgbus::publish(&client, &first).await.unwrap();

    let message = panic_message(db.config(), |client| async move {
        assert_published(&client, "order.placed", &json!({"order_id": 2})).await;
    })
    .await;
    assert!(
        message.contains(r#"expected one event order.placed with payload {"order_id":2}"#)
            && message.contains("found 0")
            && message.contains(&first.id),
        "{message}"
    );

    // The same name and payload twice (two ids) is not "one".
    pgbus::publish(&client, &Event::new("order.placed", json!({"order_id": 1})))
        .await
        .unwrap();
    let message = panic_message(db.config(), |client| async move {
        assert_published(&client, "order.placed", &json!({"order_id": 1})).await;
    })
    .await;
    assert!(
        message.contains("found 2") && message.contains("the log holds 2 event(s)"),
        "{message}"
    );

    let message = panic_message(db.config(), |client| async move {
        assert_published_exactly(&client, &[("order.placed", json!({"order_id": 1}))]).await;
    })
    .await;
    assert!(message.contains("expected 1 event(s)"), "{message}");

    let message = panic_message(db.config(), |client| async move {
        assert_not_published(&client, "order.placed").await;
    })
    .await;
    assert!(
        message.contains("expected no event order.placed"),
        "{message}"
    );

    let message = panic_message(db.config(), |client| async move {
        assert_nothing_published(&client).await;
    })
    .await;
    assert!(
        message.contains("expected nothing to be published"),
        "{message}"
    );
}
