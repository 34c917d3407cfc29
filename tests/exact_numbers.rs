//! Payload numbers come back exactly as jsonb holds them, through every path: the Rust
//! API (publish, handler, stream), SQL's `pgbus.publish`, `pgbus publish`, and `pgbus
//! consume` (its JSON lines and a command's standard input). "Exactly" means: the
//! delivered JSON equals `payload::text` read from PostgreSQL, number for number, and the
//! stored value equals the published one (`$1::jsonb = payload`). The command line's
//! part is in `cli/tests/exact_numbers.rs`.

mod common;
#[path = "shared/exact_numbers.rs"]
mod shared;

use std::time::Duration;

use common::wait_settled;
use futures::StreamExt;
use pgbus::{Bus, Event, HandlerError};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestCaseError, TestRunner};
use serde_json::Value;
use shared::{PAYLOADS, assert_exact, stored_payload};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn rust_publish_to_handler_and_sql_publish_to_stream_keep_every_digit() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (tx, mut handled) = mpsc::unbounded_channel();
    let mut bus = Bus::builder(db.config())
        .handler_fn("h", ["n.*"], move |e: Event| {
            let _ = tx.send(e);
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap();
    let mut stream = bus.subscribe("st", ["n.*"]).unwrap();
    let running = bus.start().await.unwrap();

    for (i, text) in PAYLOADS.iter().enumerate() {
        let payload: Value = serde_json::from_str(text).unwrap();
        let rust = format!("rust-{i}");
        pgbus::publish(&client, &Event::new("n.rust", payload).id(&rust))
            .await
            .unwrap();
        let sql = format!("sql-{i}");
        client
            .execute(
                "SELECT pgbus.publish('n.sql', $1::text::jsonb, id => $2)",
                &[text, &sql],
            )
            .await
            .unwrap();
        for id in [&rust, &sql] {
            let (stored, equal) = stored_payload(&client, id, text).await;
            assert!(equal, "{id}: the stored payload is not {text}: {stored}");
        }
    }
    let mut seen = 0;
    while seen < 2 * PAYLOADS.len() {
        let event = common::within("the handler", WAIT, handled.recv())
            .await
            .unwrap();
        let published = PAYLOADS[event.id[event.id.find('-').unwrap() + 1..]
            .parse::<usize>()
            .unwrap()];
        let (stored, _) = stored_payload(&client, &event.id, published).await;
        assert_exact(&format!("handler, {}", event.id), &event.payload, &stored);
        let delivery = common::within("the stream", WAIT, stream.next())
            .await
            .unwrap();
        let (stored, _) = stored_payload(&client, &delivery.event().id, published).await;
        assert_exact(
            &format!("stream, {}", delivery.event().id),
            &delivery.event().payload,
            &stored,
        );
        delivery.ack().await.unwrap();
        seen += 1;
    }
    wait_settled(&client, "every delivery").await;
    running.shutdown().await.unwrap();

    // The examples of the issue, by their digits.
    let (stored, _) = stored_payload(&client, "rust-0", PAYLOADS[0]).await;
    assert_eq!(stored["big"].to_string(), "18446744073709551617");
    assert_eq!(stored["dec"].to_string(), "12345678.123456789012");
    assert!(
        stored["tiny"].to_string().ends_with("0001") && stored["tiny"].to_string().len() > 400,
        "{}",
        stored["tiny"]
    );
}

#[tokio::test]
async fn headers_keep_every_digit_too() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (tx, mut handled) = mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .handler_fn("h", ["n.*"], move |e: Event| {
            let _ = tx.send(e);
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let headers: Value = serde_json::from_str(PAYLOADS[0]).unwrap();
    pgbus::publish(
        &client,
        &Event::new("n.h", Value::Null).headers(headers.clone()),
    )
    .await
    .unwrap();
    let event = common::within("the handler", WAIT, handled.recv())
        .await
        .unwrap();
    let text: String = client
        .query_one("SELECT headers::text FROM pgbus.events", &[])
        .await
        .unwrap()
        .get(0);
    assert_exact(
        "headers",
        &event.headers,
        &serde_json::from_str(&text).unwrap(),
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_object_that_serde_json_would_read_as_a_number_is_refused_or_dead_lettered() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let token = "$serde_json::private::Number";
    let payload: Value = serde_json::json!({ token: "12" });
    let err = pgbus::publish(&client, &Event::new("n.x", payload))
        .await
        .unwrap_err();
    assert!(matches!(err, pgbus::Error::Invalid { .. }), "{err}");
    assert_eq!(
        common::count(&client, "SELECT count(*) FROM pgbus.events").await,
        0
    );
    // Written by SQL, it is dead-lettered with the reason, never delivered as 12.
    pgbus::admin::register_subscription(&client, "h", &["n.*"], 25)
        .await
        .unwrap();
    client
        .execute(
            "SELECT pgbus.publish('n.x', jsonb_build_object($1::text, '12'), id => 'token')",
            &[&token],
        )
        .await
        .unwrap();
    client
        .execute("SELECT pgbus.publish('n.x', '{}', id => 'fine')", &[])
        .await
        .unwrap();
    let (tx, mut handled) = mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .handler_fn("h", ["n.*"], move |e: Event| {
            let _ = tx.send(e.id);
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    assert_eq!(
        common::within("the handler", WAIT, handled.recv()).await,
        Some("fine".to_string())
    );
    common::wait_count(
        &client,
        "the dead letter",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' \
         AND last_error LIKE 'the event cannot be decoded: payload: %serde_json%'",
        1,
    )
    .await;
    running.shutdown().await.unwrap();
    assert!(handled.try_recv().is_err());
}

/// A number's JSON text: sign, 1 to 60 digits, maybe a fraction, maybe an exponent.
fn number() -> impl Strategy<Value = String> {
    (
        any::<bool>(),
        "[1-9][0-9]{0,59}|0",
        proptest::option::of("[0-9]{1,40}"),
        proptest::option::of(-400i32..400),
    )
        .prop_map(|(negative, int, frac, exp)| {
            let mut s = String::new();
            if negative {
                s.push('-');
            }
            s.push_str(&int);
            if let Some(frac) = frac {
                s.push('.');
                s.push_str(&frac);
            }
            if let Some(exp) = exp {
                s.push_str(&format!("e{exp}"));
            }
            s
        })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(128)
}

/// Random numbers published through the Rust API are stored exactly (`$1::jsonb =
/// payload`), and read back by the library as the same text PostgreSQL shows.
#[test]
fn random_numbers_round_trip_through_postgresql_exactly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_db, client) = rt.block_on(async {
        let db = common::test_db().await;
        let client = db.connect().await;
        (db, client)
    });
    let mut runner = TestRunner::new(RunnerConfig {
        cases: cases(),
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    runner
        .run(&proptest::collection::vec(number(), 1..8), |numbers| {
            let text = format!("{{\"n\": [{}]}}", numbers.join(", "));
            let payload: Value = serde_json::from_str(&text).unwrap();
            rt.block_on(async {
                let event = Event::new("n.p", payload);
                pgbus::publish(&client, &event).await.unwrap();
                let row = client
                    .query_one(
                        "SELECT payload::text, payload = $2::text::jsonb, payload
                         FROM pgbus.events WHERE id = $1",
                        &[&event.id, &text],
                    )
                    .await
                    .unwrap();
                let (stored, equal, read): (String, bool, Value) =
                    (row.get(0), row.get(1), row.get(2));
                prop_assert!(equal, "{text} was stored as {stored}");
                let stored: Value = serde_json::from_str(&stored).unwrap();
                prop_assert_eq!(&read, &stored);
                Ok::<(), TestCaseError>(())
            })
        })
        .unwrap();
}
