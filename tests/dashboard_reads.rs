//! The admin reads the dashboard (`pgbus ui`) is built on: where an event's deliveries
//! stand, the recent throughput, failure histories, the event search and the live
//! consumers, against a real PostgreSQL.

mod common;

use std::time::Duration;

use pgbus::Event;
use pgbus::admin;
use serde_json::json;

#[tokio::test]
async fn the_dashboards_reads_say_where_each_delivery_stands() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "all", &["t.*"], 25)
        .await
        .unwrap();
    admin::register_subscription(&client, "ones", &["t.one"], 25)
        .await
        .unwrap();
    let one = Event::new("t.one", json!({ "n": 1 })).correlation_id("req-7");
    let two = Event::new("t.two", json!({ "n": 2 })).correlation_id("req-7");
    // Two transactions: two creation times, t.two the newer.
    pgbus::publish(&client, &one).await.unwrap();
    pgbus::publish(&client, &two).await.unwrap();
    // A subscription registered later never had these events.
    admin::register_subscription(&client, "late", &["t.*"], 25)
        .await
        .unwrap();
    let seq = |id: &str| {
        let client = &client;
        let id = id.to_string();
        async move {
            client
                .query_one("SELECT seq FROM pgbus.events WHERE id = $1", &[&id])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    common::fan_out(&client).await;
    let (one_seq, two_seq) = (seq(&one.id).await, seq(&two.id).await);
    // "all" completed the first event; "ones" failed it twice, for good.
    client
        .execute(
            "DELETE FROM pgbus.deliveries WHERE subscription = 'all' AND event_seq = $1",
            &[&one_seq],
        )
        .await
        .unwrap();
    client
        .execute(
            "WITH d AS (UPDATE pgbus.deliveries SET status = 'dead', attempts = 2, \
                          last_error = 'second' \
                        WHERE subscription = 'ones' RETURNING event_seq) \
             INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker, failed_at) \
             SELECT 'ones', d.event_seq, a, CASE a WHEN 1 THEN 'first' ELSE 'second' END, 'w-1', \
                    now() - (3 - a) * interval '1 second' \
             FROM d, generate_series(1, 2) AS a",
            &[],
        )
        .await
        .unwrap();

    let standing = admin::event_deliveries(&client, one_seq).await.unwrap();
    let summary: Vec<(&str, &str)> = standing
        .iter()
        .map(|d| (d.subscription.as_str(), d.status.as_str()))
        .collect();
    assert_eq!(summary, [("all", "done"), ("ones", "dead")]);
    assert_eq!(standing[1].last_error.as_deref(), Some("second"));
    assert_eq!(standing[1].attempts, Some(2));
    assert_eq!(standing[0].attempts, None);
    let standing = admin::event_deliveries(&client, two_seq).await.unwrap();
    let summary: Vec<(&str, &str)> = standing
        .iter()
        .map(|d| (d.subscription.as_str(), d.status.as_str()))
        .collect();
    assert_eq!(summary, [("all", "pending")], "ones does not match t.two");

    let history = admin::failure_history(&client, "ones", &[one_seq], 100)
        .await
        .unwrap();
    let errors: Vec<(i32, &str)> = history
        .iter()
        .map(|f| (f.attempt, f.error.as_str()))
        .collect();
    assert_eq!(errors, [(1, "first"), (2, "second")]);
    assert_eq!(history[0].worker.as_deref(), Some("w-1"));
    assert_eq!(
        admin::failure_history(&client, "ones", &[one_seq], 1)
            .await
            .unwrap()
            .len(),
        1,
        "the limit holds"
    );

    let recent = admin::delivered_recently(&client, Duration::from_secs(60), 100)
        .await
        .unwrap();
    assert_eq!(recent.delivered, [("all".to_string(), 1)]);
    assert!(!recent.capped);
    // Reading only the newest event (t.two, still pending): nothing finished among it,
    // and the answer says it read only part of the window.
    let recent = admin::delivered_recently(&client, Duration::from_secs(60), 1)
        .await
        .unwrap();
    assert!(recent.delivered.is_empty(), "{recent:?}");
    assert!(recent.capped);
    assert!(
        admin::delivered_recently(&client, Duration::ZERO, 10)
            .await
            .is_err()
    );

    let by_id = admin::find_events(&client, &two.id, 10).await.unwrap();
    assert_eq!(by_id.len(), 1);
    assert_eq!(by_id[0].name, "t.two");
    assert_eq!(by_id[0].payload, json!({ "n": 2 }));
    assert_eq!(by_id[0].seq, Some(two_seq));
    let by_correlation = admin::find_events(&client, "req-7", 10).await.unwrap();
    let ids: Vec<&str> = by_correlation.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [one.id.as_str(), two.id.as_str()], "oldest first");
    assert!(
        admin::find_events(&client, "nothing", 10)
            .await
            .unwrap()
            .is_empty()
    );

    client
        .batch_execute(
            "INSERT INTO pgbus.consumers (id, awake, expires_at, subscriptions, info) VALUES \
             ('w-live', false, now() + interval '25 seconds', '{all}', 'pid 1 on here'), \
             ('w-gone', true, now() - interval '1 second', '{all}', 'pid 2 on there')",
        )
        .await
        .unwrap();
    let consumers = admin::consumers(&client).await.unwrap();
    assert_eq!(consumers.len(), 1, "only live consumers: {consumers:?}");
    let live = &consumers[0];
    assert_eq!(live.id, "w-live");
    assert!(!live.awake);
    assert_eq!(live.subscriptions, ["all"]);
    assert_eq!(live.info.as_deref(), Some("pid 1 on here"));
    assert_eq!(
        live.expires_at - live.last_heartbeat,
        chrono::Duration::seconds(25),
        "the last heartbeat is the time of the write that set the expiry, whatever its TTL"
    );
    let cluster = admin::cluster_status(&client).await.unwrap();
    assert_eq!((cluster.consumers, cluster.sleeping_consumers), (1, 1));
}
