//! A subscription's settings are shared by every consumer of it: a starting consumer
//! follows the stored ones, refuses to start where it asks for different ones, and
//! changes them only when told to (`reconfigure`, or the operator's `subscriptions set`),
//! which converts the backlog in the same transaction. The command line's part is in
//! `cli/tests/subscription_settings.rs`.

mod common;
#[path = "shared/subscription_settings.rs"]
mod shared;

use std::time::Duration;

use common::count;
use pgbus::admin::{self, SubscriptionChange};
use pgbus::{Bus, DeadHeadPolicy, Error, Event, RetryPolicy, SubscriptionOptions};
use serde_json::json;
use shared::{ordered_ship, stored};

const WAIT: Duration = Duration::from_secs(30);

fn bus(db: &common::TestDb) -> pgbus::BusBuilder {
    Bus::builder(db.config()).poll_interval(Duration::from_millis(100))
}

#[tokio::test]
async fn a_consumer_that_sets_nothing_follows_the_stored_settings() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_ship(&client).await;
    let before = stored(&client).await;

    // No patterns, no ordering, no policy, retry delays without a maximum.
    let mut b = bus(&db)
        .retry(RetryPolicy::exponential(Duration::from_millis(10)))
        .build()
        .unwrap();
    let mut deliveries = b.subscribe("ship", Vec::<String>::new()).unwrap();
    let running = b.start().await.unwrap();
    assert_eq!(stored(&client).await, before);
    assert!(before.ordered && before.on_dead == DeadHeadPolicy::Skip);
    assert_eq!(before.max_attempts, 7);

    // It consumes as an ordered subscription: one head per key.
    for n in 0..3 {
        pgbus::publish(
            &client,
            &Event::new("order.placed", json!({ "n": n })).ordering_key("k"),
        )
        .await
        .unwrap();
    }
    common::fan_out(&client).await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE ordering_key = 'k' AND is_head"
        )
        .await,
        1
    );
    for n in 0..3 {
        use futures::StreamExt;
        let d = common::within("a delivery", WAIT, deliveries.next())
            .await
            .unwrap();
        assert_eq!(d.event().payload["n"], n);
        d.ack().await.unwrap();
    }
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_consumer_asking_for_other_settings_refuses_to_start_and_changes_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_ship(&client).await;
    let before = stored(&client).await;

    let cases: Vec<(SubscriptionOptions, Vec<&str>, &str)> = vec![
        (
            SubscriptionOptions::new().ordered(false),
            vec!["order.*"],
            "ordered false (stored: true)",
        ),
        (
            SubscriptionOptions::new().on_dead(DeadHeadPolicy::Block),
            vec!["order.*"],
            "on-dead block (stored: skip)",
        ),
        (
            SubscriptionOptions::new(),
            vec!["order.placed"],
            "patterns order.placed (stored: order.*)",
        ),
        (
            SubscriptionOptions::new().retry(RetryPolicy::default().max_attempts(3)),
            vec!["order.*"],
            "max attempts 3 (stored: 7)",
        ),
    ];
    for (options, patterns, difference) in cases {
        let mut b = bus(&db).build().unwrap();
        let _stream = b.subscribe_with("ship", patterns, options).unwrap();
        let err = b.start().await.unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
        assert!(message.contains(difference), "{message}");
        assert!(
            message.contains("pgbus subscriptions set ship"),
            "{message}"
        );
        assert_eq!(stored(&client).await, before, "{difference}");
    }
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.consumers").await,
        0
    );
}

#[tokio::test]
async fn reconfigure_changes_the_settings_for_everyone_and_converts_the_backlog() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_ship(&client).await;
    for n in 0..4 {
        pgbus::publish(
            &client,
            &Event::new("order.placed", json!({ "n": n })).ordering_key("k"),
        )
        .await
        .unwrap();
    }
    common::fan_out(&client).await;
    let heads = "SELECT count(*) FROM pgbus.deliveries WHERE is_head";
    assert_eq!(count(&client, heads).await, 1);

    let mut b = bus(&db).reconfigure(true).build().unwrap();
    let _stream = b
        .subscribe_with(
            "ship",
            ["order.*"],
            SubscriptionOptions::new().ordered(false),
        )
        .unwrap();
    let running = b.start().await.unwrap();
    let after = stored(&client).await;
    assert!(!after.ordered);
    assert_eq!(after.max_attempts, 7, "what it did not set is kept");
    // Every waiting delivery is claimable (or already claimed by the bus).
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head AND ordering_key IS NULL"
        )
        .await,
        4
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_new_subscription_needs_patterns() {
    let db = common::test_db().await;
    let mut b = bus(&db).build().unwrap();
    let _stream = b.subscribe("fresh", Vec::<String>::new()).unwrap();
    let err = b.start().await.unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    let client = db.connect().await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        0
    );
}

/// Turning ordering on gives each key exactly one head, its oldest waiting delivery;
/// dead letters stay aside; unkeyed events stay claimable.
#[tokio::test]
async fn turning_ordering_on_gives_each_key_one_head_in_event_order() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "ship", &["*"], 5)
        .await
        .unwrap();
    for (key, n) in [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1)] {
        pgbus::publish(
            &client,
            &Event::new("x", json!({ "n": n })).ordering_key(key),
        )
        .await
        .unwrap();
    }
    common::fan_out(&client).await;
    pgbus::publish(&client, &Event::new("x", json!({"unkeyed": true})))
        .await
        .unwrap();
    // The oldest of key b is a dead letter: it must not block b.
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead'
             WHERE event_seq = (SELECT min(seq) FROM pgbus.events WHERE ordering_key = 'b')",
        )
        .await
        .unwrap();
    let converted =
        admin::configure_subscription(&client, "ship", &SubscriptionChange::new().ordered(true))
            .await
            .unwrap();
    assert_eq!(converted, Some(5));
    let heads: Vec<(String, i64)> = client
        .query(
            "SELECT d.ordering_key, (e.payload->>'n')::int8 FROM pgbus.deliveries AS d
             JOIN pgbus.events AS e ON e.seq = d.event_seq
             WHERE d.is_head AND d.ordering_key IS NOT NULL ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(heads, [("a".to_string(), 0), ("b".to_string(), 1)]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE ordering_key IS NULL AND is_head"
        )
        .await,
        1
    );
}

/// A subscription dropped while its consumer runs is noticed (at the next consumer
/// heartbeat) and reported, instead of the consumer idling silently.
#[tokio::test]
async fn a_consumer_notices_that_its_subscription_was_dropped() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let running = bus(&db)
        .handler_fn("h", ["*"], |_| async { Ok(()) })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    assert!(running.dropped_subscriptions().is_empty());
    admin::drop_subscription(&client, "h", true).await.unwrap();
    common::wait_for("the drop to be noticed", WAIT, || async {
        running.dropped_subscriptions() == ["h"]
    })
    .await;
    running.shutdown().await.unwrap();
}
