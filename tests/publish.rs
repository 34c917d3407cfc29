//! Publishing: fan-out to matching subscriptions, transactions, idempotency, raw SQL
//! publishers, and bad input.

mod common;

use pgbus::{Error, Event, Published};
use serde_json::json;

async fn subscribe(client: &tokio_postgres::Client, name: &str, patterns: &[&str]) {
    pgbus::admin::register_subscription(client, name, patterns, 25)
        .await
        .unwrap();
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The deliveries once the bus has turned what committed into deliveries.
async fn deliveries(client: &tokio_postgres::Client) -> Vec<(String, String)> {
    common::fan_out(client).await;
    client
        .query(
            "SELECT d.subscription, e.event_name FROM pgbus.deliveries d \
             JOIN pgbus.events e ON e.seq = d.event_seq ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[tokio::test]
async fn committed_publish_creates_one_delivery_per_matching_subscription() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    subscribe(&client, "orders", &["order.*"]).await;
    subscribe(&client, "everything", &["*"]).await;
    subscribe(&client, "placed", &["order.placed", "order.*"]).await;
    subscribe(&client, "users", &["user.created"]).await;

    let tx = client.transaction().await.unwrap();
    let outcome = pgbus::publish(&tx, &Event::new("order.placed", json!({"id": 1})))
        .await
        .unwrap();
    assert_eq!(outcome, Published::Inserted);
    tx.commit().await.unwrap();

    assert_eq!(
        deliveries(&client).await,
        pairs(&[
            ("everything", "order.placed"),
            ("orders", "order.placed"),
            ("placed", "order.placed"),
        ])
    );
}

#[tokio::test]
async fn rolled_back_publish_leaves_nothing() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    subscribe(&client, "everything", &["*"]).await;

    let tx = client.transaction().await.unwrap();
    pgbus::publish(&tx, &Event::new("order.placed", json!({})))
        .await
        .unwrap();
    pgbus::publish_batch(&tx, &[Event::new("a", json!(1)), Event::new("b", json!(2))])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 0);
    assert_eq!(
        common::count_after_fan_out(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
}

#[tokio::test]
async fn published_fields_round_trip() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let at = chrono::DateTime::parse_from_rfc3339("2026-01-02T03:04:05.123456Z")
        .unwrap()
        .to_utc();
    let event = Event::new("order.placed", json!({"n": 1, "s": "quote ' \" ; $$ --"}))
        .id("evt-1")
        .version(3)
        .source("checkout")
        .aggregate("order", "42")
        .correlation_id("corr")
        .causation_id("cause")
        .occurred_at(at)
        .header("tenant", "acme");
    pgbus::publish(&client, &event).await.unwrap();
    let row = client
        .query_one(
            "SELECT id, event_name, event_version, source, aggregate_type, aggregate_id, \
             correlation_id, causation_id, occurred_at, payload, headers, \
             available_at <= now() FROM pgbus.events",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, &str>(0), "evt-1");
    assert_eq!(row.get::<_, &str>(1), "order.placed");
    assert_eq!(row.get::<_, i32>(2), 3);
    assert_eq!(row.get::<_, Option<&str>>(3), Some("checkout"));
    assert_eq!(row.get::<_, Option<&str>>(4), Some("order"));
    assert_eq!(row.get::<_, Option<&str>>(5), Some("42"));
    assert_eq!(row.get::<_, Option<&str>>(6), Some("corr"));
    assert_eq!(row.get::<_, Option<&str>>(7), Some("cause"));
    assert_eq!(row.get::<_, chrono::DateTime<chrono::Utc>>(8), at);
    assert_eq!(row.get::<_, serde_json::Value>(9), event.payload);
    assert_eq!(
        row.get::<_, serde_json::Value>(10),
        json!({"tenant": "acme"})
    );
    assert!(row.get::<_, bool>(11));
}

#[tokio::test]
async fn delayed_events_are_not_due_before_their_time() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", &["*"]).await;
    pgbus::publish_batch(
        &client,
        &[
            Event::new("later", json!({})).delay(std::time::Duration::from_secs(3600)),
            Event::new("at", json!({})).deliver_at(chrono::Utc::now() + chrono::Duration::hours(2)),
            Event::new("now", json!({})),
        ],
    )
    .await
    .unwrap();
    common::fan_out(&client).await;
    let due: Vec<String> = client
        .query(
            "SELECT e.event_name FROM pgbus.deliveries d JOIN pgbus.events e ON e.seq = d.event_seq \
             WHERE d.available_at <= now() ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(due, vec!["now".to_string()]);
    let later_ok: bool = client
        .query_one(
            "SELECT available_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes' \
             FROM pgbus.events WHERE event_name = 'later'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(later_ok);
}

#[tokio::test]
async fn publish_is_idempotent_by_id() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", &["*"]).await;
    let event = Event::new("order.placed", json!({"id": 1})).id("order-1-placed");
    assert_eq!(
        pgbus::publish(&client, &event).await.unwrap(),
        Published::Inserted
    );
    assert_eq!(
        pgbus::publish(&client, &event).await.unwrap(),
        Published::Duplicate
    );
    // Fields outside the content (correlation, occurred_at) may differ on a retry.
    let retried = event.clone().correlation_id("retry");
    assert_eq!(
        pgbus::publish(&client, &retried).await.unwrap(),
        Published::Duplicate
    );
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 1);
    assert_eq!(
        common::count_after_fan_out(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        1
    );
}

#[tokio::test]
async fn different_content_under_the_same_id_is_a_conflict_that_writes_nothing() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    subscribe(&client, "s", &["*"]).await;
    pgbus::publish(&client, &Event::new("a", json!({"v": 1})).id("dup"))
        .await
        .unwrap();

    let err = pgbus::publish(&client, &Event::new("a", json!({"v": 2})).id("dup"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Conflict { id } if id == "dup"),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "event dup was already published with different content"
    );

    // In a batch: nothing of the batch is written, and the transaction stays usable.
    let tx = client.transaction().await.unwrap();
    let err = pgbus::publish_batch(
        &tx,
        &[
            Event::new("b", json!({})).id("fresh-1"),
            Event::new("a", json!({"v": 3})).id("dup"),
            Event::new("b", json!({})).id("fresh-2"),
        ],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, Error::Conflict { id } if id == "dup"),
        "{err}"
    );
    pgbus::publish(&tx, &Event::new("c", json!({})).id("after"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let ids: Vec<String> = client
        .query("SELECT id FROM pgbus.events ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec!["dup".to_string(), "after".to_string()]);
    let payload: serde_json::Value = client
        .query_one("SELECT payload FROM pgbus.events WHERE id = 'dup'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(payload, json!({"v": 1}));
}

#[tokio::test]
async fn batch_skips_duplicates_and_rejects_conflicts_within_itself() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", &["*"]).await;
    pgbus::publish(&client, &Event::new("a", json!(1)).id("x"))
        .await
        .unwrap();
    let inserted = pgbus::publish_batch(
        &client,
        &[
            Event::new("a", json!(1)).id("x"),
            Event::new("a", json!(2)).id("y"),
            Event::new("a", json!(2)).id("y"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(inserted, 1);
    let err = pgbus::publish_batch(
        &client,
        &[
            Event::new("a", json!(5)).id("z"),
            Event::new("a", json!(6)).id("z"),
        ],
    )
    .await
    .unwrap_err();
    assert!(matches!(&err, Error::Conflict { id } if id == "z"), "{err}");
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 2);
}

#[tokio::test]
async fn a_batch_of_a_thousand_is_one_statement_and_fans_out() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "orders", &["order.*"]).await;
    subscribe(&client, "users", &["user.*"]).await;
    // Every INSERT statement on the log leaves a row here with the rows it inserted: a
    // statement-level trigger fires once per statement, whatever its row count.
    client
        .batch_execute(
            "CREATE TABLE public.event_inserts (n bigserial PRIMARY KEY, inserted bigint NOT NULL);
             CREATE FUNCTION public.count_event_insert() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO public.event_inserts (inserted) SELECT count(*) FROM new_rows;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER events_insert_statements AFTER INSERT ON pgbus.events
                 REFERENCING NEW TABLE AS new_rows
                 FOR EACH STATEMENT EXECUTE FUNCTION public.count_event_insert();",
        )
        .await
        .unwrap();
    let events: Vec<Event> = (0..1000)
        .map(|i| {
            let name = if i % 2 == 0 {
                "order.placed"
            } else {
                "user.created"
            };
            Event::new(name, json!({ "i": i }))
        })
        .collect();
    assert_eq!(pgbus::publish_batch(&client, &events).await.unwrap(), 1000);
    let statements: Vec<i64> = client
        .query("SELECT inserted FROM public.event_inserts ORDER BY n", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        statements,
        vec![1000],
        "the batch took one INSERT statement per entry of this list"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.events").await,
        1000
    );
    assert_eq!(
        common::count_after_fan_out(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'orders'"
        )
        .await,
        500
    );
    assert_eq!(
        common::count_after_fan_out(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'users'"
        )
        .await,
        500
    );
}

#[tokio::test]
async fn raw_sql_insert_and_sql_publish_function_create_deliveries() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", &["order.*"]).await;
    let other = db.connect().await;
    other
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload) VALUES ('order.placed', '{\"a\": 1}')",
        )
        .await
        .unwrap();
    let id: String = other
        .query_one(
            "SELECT pgbus.publish('order.paid', '{\"b\": 2}', aggregate_type => 'order', aggregate_id => '7')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    let same: String = other
        .query_one(
            "SELECT pgbus.publish('order.paid', '{\"b\": 2}', id => $1, aggregate_type => 'order', aggregate_id => '7')",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(same, id);
    let err = other
        .query_one(
            "SELECT pgbus.publish('order.paid', '{\"b\": 3}', id => $1)",
            &[&id],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
    assert_eq!(
        deliveries(&client).await,
        pairs(&[("s", "order.paid"), ("s", "order.placed")])
    );
    // Defaults filled in for a bare INSERT.
    let row = client
        .query_one(
            "SELECT id, event_version, headers, occurred_at IS NOT NULL FROM pgbus.events WHERE event_name = 'order.placed'",
            &[],
        )
        .await
        .unwrap();
    assert!(uuid::Uuid::parse_str(row.get::<_, &str>(0)).is_ok());
    assert_eq!(row.get::<_, i32>(1), 1);
    assert_eq!(row.get::<_, serde_json::Value>(2), json!({}));
    assert!(row.get::<_, bool>(3));
}

#[tokio::test]
async fn uuid_v7_ids_are_time_ordered() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // Ids made by the schema (raw SQL publishers), in generation order; a millisecond
    // passes every 250 ids, so they span many milliseconds.
    let sql_ids: Vec<uuid::Uuid> = client
        .query(
            "SELECT pgbus.uuid_v7()::text, CASE WHEN i % 250 = 0 THEN pg_sleep(0.001)::text END \
             FROM generate_series(1, 2500) AS i ORDER BY i",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| uuid::Uuid::parse_str(r.get::<_, &str>(0)).unwrap())
        .collect();
    // Ids made by `Event::new` (the Rust publishers), in generation order.
    let rust_ids: Vec<uuid::Uuid> = (0..2500)
        .map(|_| uuid::Uuid::parse_str(&Event::new("x", json!({})).id).unwrap())
        .collect();
    let millis = |u: &uuid::Uuid| {
        let (secs, nanos) = u.get_timestamp().unwrap().to_unix();
        secs * 1000 + u64::from(nanos) / 1_000_000
    };
    for (source, ids) in [("sql", &sql_ids), ("rust", &rust_ids)] {
        for id in ids {
            assert_eq!(id.get_version_num(), 7, "{source}: {id}");
        }
        // The embedded millisecond timestamps never go back...
        let ms: Vec<u64> = ids.iter().map(millis).collect();
        assert!(
            ms.windows(2).all(|w| w[0] <= w[1]),
            "{source}: a timestamp went back"
        );
        assert!(
            ms.last().unwrap() > ms.first().unwrap(),
            "{source}: the ids span no time"
        );
        // ...and an id made in a later millisecond sorts after every earlier one, as text
        // (the column's type) and as a uuid.
        for w in ids.windows(2) {
            if millis(&w[0]) < millis(&w[1]) {
                assert!(w[0] < w[1], "{source}: {} sorts after {}", w[0], w[1]);
                assert!(w[0].to_string() < w[1].to_string(), "{source}: as text");
            }
        }
    }
    // `Event::new` ids sort in generation order even within one millisecond (the uuid
    // crate keeps a counter); the schema's are ordered to the millisecond only.
    let mut sorted = rust_ids.clone();
    sorted.sort();
    assert_eq!(sorted, rust_ids, "rust ids do not sort in generation order");
    // Both clocks agree: the schema's ids and the crate's are within a minute.
    let (a, b) = (millis(&rust_ids[0]), millis(&sql_ids[0]));
    assert!(a.abs_diff(b) < 60_000, "{a} vs {b}");
}

/// Every refusal: a typed error, and nothing written.
#[tokio::test]
async fn bad_input_is_refused_with_a_typed_error_and_writes_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", &["*"]).await;

    let cases: Vec<(Event, &str, &str)> = vec![
        (Event::new("", json!({})), "event name", "must not be empty"),
        (
            Event::new("x".repeat(256), json!({})),
            "event name",
            "must be at most 255 bytes",
        ),
        (
            Event::new("has space", json!({})),
            "event name",
            "white space",
        ),
        (Event::new("star.*", json!({})), "event name", "'*'"),
        (
            Event::new("a", json!({"deep": [{"x": "nul\u{0}here"}]})),
            "payload",
            "contains \\u0000 at $.deep[0].x",
        ),
        (
            Event::new("a", json!({})).header("h", "a\u{0}"),
            "headers",
            "contains \\u0000 at $.h",
        ),
        (
            Event::new("a", json!({})).headers(json!("not an object")),
            "headers",
            "must be a JSON object, got a string",
        ),
        (
            Event::new("a", json!("x".repeat(1024 * 1024))),
            "payload",
            "exceeds the limit of 1048576 bytes",
        ),
        (
            Event::new("a", json!({})).id(""),
            "event id",
            "must be 1 to 255 bytes",
        ),
    ];
    for (event, what_expected, reason_part) in cases {
        let err = pgbus::publish(&client, &event).await.unwrap_err();
        match &err {
            Error::Invalid { what, reason } => {
                assert_eq!(*what, what_expected, "{err}");
                assert!(reason.contains(reason_part), "{err}");
            }
            other => panic!("expected Invalid for {what_expected}, got {other:?}"),
        }
        // The same event in a batch with a good one: the whole batch is refused.
        let err = pgbus::publish_batch(&client, &[Event::new("good", json!({})), event])
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{err}");
    }
    let small = pgbus::Publisher::new().max_payload_bytes(10);
    let err = small
        .publish(&client, &Event::new("a", json!("more than ten")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid {
                what: "payload",
                ..
            }
        ),
        "{err}"
    );

    for (name, patterns) in [
        ("", vec!["*"]),
        ("ok", vec![]),
        ("ok", vec!["order*"]),
        ("ok", vec!["*.placed"]),
        ("ok", vec![""]),
        ("bad name", vec!["*"]),
    ] {
        let err = pgbus::admin::register_subscription(&client, name, &patterns, 5)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Invalid { .. }),
            "{name} {patterns:?}: {err}"
        );
    }
    let err = pgbus::admin::register_subscription(&client, "ok", &["*"], 0)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err}");

    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 0);
    assert_eq!(
        common::count_after_fan_out(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        1
    );

    // The schema refuses the same things from raw SQL.
    for sql in [
        "INSERT INTO pgbus.events (event_name, payload) VALUES ('', '{}')",
        "INSERT INTO pgbus.events (event_name, payload) VALUES ('a b', '{}')",
        "INSERT INTO pgbus.events (event_name, payload, headers) VALUES ('a', '{}', '[]')",
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('x', '{order*}')",
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('x', '{}')",
    ] {
        let err = client.batch_execute(sql).await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION),
            "{sql}: {err}"
        );
    }
}

#[tokio::test]
async fn publish_works_through_a_pooled_connection_and_its_transaction() {
    let db = common::test_db().await;
    let pool = deadpool_postgres::Pool::builder(deadpool_postgres::Manager::new(
        db.config(),
        tokio_postgres::NoTls,
    ))
    .max_size(2)
    .build()
    .unwrap();
    let mut obj = pool.get().await.unwrap();
    subscribe(&obj, "s", &["*"]).await;
    pgbus::publish(&obj, &Event::new("a", json!(1)))
        .await
        .unwrap();
    let tx = obj.transaction().await.unwrap();
    pgbus::publish_batch(&tx, &[Event::new("b", json!(2))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        common::count_after_fan_out(&obj, "SELECT count(*) FROM pgbus.deliveries").await,
        2
    );
}

#[tokio::test]
async fn missing_schema_says_to_run_migrate() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let err = pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::SchemaMissing(_)), "{err:?}");
    assert!(err.to_string().contains("run `pgbus migrate`"), "{err}");
}
