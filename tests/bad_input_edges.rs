//! Bad input at the edges: NUL in text fields, and JSON nested deeper than readers can
//! decode, whether it comes through the library or past it through SQL.

mod common;

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event};
use serde_json::{Value, json};

#[tokio::test]
async fn nul_in_any_text_field_is_refused_as_invalid() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let base = || Event::new("a.b", json!({}));
    for (field, event) in [
        ("id", base().id("x\0y")),
        ("source", base().source("x\0y")),
        ("aggregate type", base().aggregate("x\0y", "1")),
        ("aggregate id", base().aggregate("order", "x\0y")),
        ("correlation id", base().correlation_id("x\0y")),
        ("causation id", base().causation_id("x\0y")),
    ] {
        let err = pgbus::publish(&client, &event).await.unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{field}: {err:?}");
    }
}

#[tokio::test]
async fn a_payload_too_deep_to_decode_is_refused_and_never_poisons_a_claim() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = Value::Array(vec![deep]);
    }
    let refused = pgbus::publish(&client, &Event::new("a.b", deep.clone()).id("deep")).await;
    assert!(matches!(refused, Err(Error::Invalid { .. })), "{refused:?}");
    // Even when it gets into the log another way (SQL), it must not hold back its
    // neighbours: the claim that meets it must still hand out the rest.
    client
        .execute(
            "INSERT INTO pgbus.events (id, event_name, payload) VALUES ('deep', 'a.b', $1::text::jsonb)",
            &[&deep.to_string()],
        )
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("a.b", json!(2)).id("fine"))
        .await
        .unwrap();
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("all", ["*"]).unwrap();
    client
        .execute(
            "INSERT INTO pgbus.deliveries (subscription, event_seq) \
             SELECT 'all', seq FROM pgbus.events",
            &[],
        )
        .await
        .unwrap();
    let running = bus.start().await.unwrap();
    let got = common::within("the fine event", Duration::from_secs(10), stream.next())
        .await
        .unwrap();
    assert_eq!(got.event().id, "fine");
    got.ack().await.unwrap();
    // The undecodable one is a dead letter that says why, after a single attempt.
    common::wait_for(
        "the undecodable delivery to be dead",
        Duration::from_secs(10),
        || async {
            client
                .query_one(
                    "SELECT count(*) FROM pgbus.deliveries \
                 WHERE status = 'dead' AND attempts = 1 \
                   AND last_error LIKE 'the event cannot be decoded%'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;
    running.shutdown().await.unwrap();
}
