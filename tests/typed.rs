//! The handler API as a service author uses it: typed events and handlers, the handler's
//! context, `?` on any error, and completing a delivery in the application's own
//! transaction (`ack_in`), against a real PostgreSQL.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use pgbus::{
    Bus, BusBuilder, Context, Delivery, Error, Event, HandlerError, RetryPolicy, RunningBus,
    Subscription, SubscriptionOptions,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{Mutex, mpsc};
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: i64,
    total_cents: u64,
    lines: Vec<String>,
}

/// The delivery of the event `id`: status, attempts, last error.
async fn delivery_of(client: &Client, id: &str) -> Option<(String, i32, Option<String>)> {
    client
        .query_opt(
            "SELECT d.status, d.attempts, d.last_error FROM pgbus.deliveries AS d
             JOIN pgbus.events AS e ON e.seq = d.event_seq WHERE e.id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

async fn wait_dead(client: &Client, id: &str) -> (i32, String) {
    common::wait_for("the delivery to be dead", WAIT, || async {
        delivery_of(client, id)
            .await
            .is_some_and(|(status, _, _)| status == "dead")
    })
    .await;
    let (_, attempts, error) = delivery_of(client, id).await.unwrap();
    (attempts, error.unwrap())
}

async fn projection_rows(client: &Client) -> Vec<(String, i32)> {
    let sql = "SELECT event_id, attempt FROM projection ORDER BY event_id";
    let rows = client.query(sql, &[]).await.unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// Builds and starts a bus.
async fn start(builder: BusBuilder) -> RunningBus {
    builder.build().unwrap().start().await.unwrap()
}

/// The next message a handler sent.
async fn recv<T>(what: &str, rx: &mut mpsc::UnboundedReceiver<T>) -> T {
    common::within(what, WAIT, rx.recv()).await.unwrap()
}

/// The next delivery of a stream.
async fn next(what: &str, stream: &mut Subscription) -> Delivery {
    common::within(what, WAIT, stream.next()).await.unwrap()
}

async fn publish(client: &Client, event: Event) {
    pgbus::publish(client, &event).await.unwrap();
}

/// Every failed attempt's error, in no particular order.
async fn failures(client: &Client) -> Vec<String> {
    let rows = client
        .query("SELECT error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

async fn create_projection(client: &Client) {
    client
        .batch_execute("CREATE TABLE projection (event_id text PRIMARY KEY, attempt int NOT NULL)")
        .await
        .unwrap();
}

#[test]
fn event_json_serializes_the_payload_and_refuses_what_json_cannot_hold() {
    let order = OrderPlaced {
        order_id: 42,
        total_cents: 1999,
        lines: vec!["book".into()],
    };
    let event = Event::json("order.placed", &order).unwrap();
    assert_eq!(event.name, "order.placed");
    assert_eq!(
        event.payload,
        json!({"order_id": 42, "total_cents": 1999, "lines": ["book"]})
    );
    assert_eq!(event.version, 1);

    // JSON object keys are strings: a map keyed by pairs cannot be written.
    let by_pair: HashMap<(i32, i32), i32> = HashMap::from([((1, 2), 3)]);
    match Event::json("order.placed", &by_pair) {
        Err(Error::Invalid { what, reason }) => {
            assert_eq!(what, "payload");
            assert!(reason.contains("key must be a string"), "{reason}");
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[tokio::test]
async fn a_typed_handler_gets_decoded_structs_and_a_bad_payload_is_dead_after_one_attempt() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let running = start(
        Bus::builder(db.config())
            // Were the decoding failure retried, the retries would come at once.
            .retry(RetryPolicy::fixed(Duration::from_millis(10)).max_attempts(5))
            .handler_typed(
                "receipts",
                ["order.*"],
                move |order: OrderPlaced, cx: Context| {
                    let seen_tx = seen_tx.clone();
                    async move {
                        let _ = seen_tx.send((order, cx.event_id().to_string(), cx.attempt()));
                        Ok(())
                    }
                },
            ),
    )
    .await;

    let order = OrderPlaced {
        order_id: 7,
        total_cents: 18_446_744_073_709_551_615,
        lines: vec!["a".into(), "b".into()],
    };
    let good = Event::json("order.placed", &order).unwrap().id("good");
    let bad = Event::new("order.placed", json!({"order_id": "seven"})).id("bad");
    pgbus::publish_batch(&client, &[bad, good]).await.unwrap();

    let (got, id, attempt) = recv("the typed handler", &mut seen).await;
    assert_eq!((got, id.as_str(), attempt), (order, "good", 1));

    let (attempts, error) = wait_dead(&client, "bad").await;
    assert_eq!(attempts, 1, "a payload that cannot decode is not retried");
    assert!(
        error.starts_with("the payload of order.placed does not decode as ")
            && error.contains("OrderPlaced")
            && error.contains("invalid type: string \"seven\", expected i64"),
        "{error}"
    );
    let history: i64 = client
        .query_one("SELECT count(*) FROM pgbus.delivery_failures", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(history, 1);
    running.shutdown().await.unwrap();
    assert!(
        seen.try_recv().is_err(),
        "the bad payload reached the closure"
    );
}

#[tokio::test]
async fn question_mark_on_anyhow_and_boxed_errors_fails_the_attempt_with_their_message() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let running = start(
        Bus::builder(db.config())
            .retry(RetryPolicy::fixed(Duration::from_millis(10)).max_attempts(1))
            .handler_fn("anyhow", ["a"], |_event: Event| async {
                let loaded: anyhow::Result<()> = Err(anyhow::anyhow!("connection refused"));
                loaded.context("loading order 42")?;
                Ok(())
            })
            .handler_fn("boxed", ["b"], |_event: Event| async {
                let checked: Result<(), Box<dyn std::error::Error + Send + Sync>> =
                    Err("the total is negative".into());
                checked?;
                Ok(())
            })
            .handler_fn("std", ["c"], |event: Event| async move {
                let n: i64 = event.payload["n"].as_str().unwrap_or_default().parse()?;
                let _ = n;
                Ok(())
            }),
    )
    .await;
    pgbus::publish_batch(
        &client,
        &[
            Event::new("a", json!({})).id("a"),
            Event::new("b", json!({})).id("b"),
            Event::new("c", json!({"n": "x"})).id("c"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(
        wait_dead(&client, "a").await,
        (1, "loading order 42: connection refused".to_string())
    );
    assert_eq!(
        wait_dead(&client, "b").await,
        (1, "the total is negative".to_string())
    );
    assert_eq!(
        wait_dead(&client, "c").await,
        (1, "invalid digit found in string".to_string())
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_context_counts_attempts_and_names_the_delivery() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let running = start(Bus::builder(db.config()).handler_with_context_opts(
        "counted",
        ["*"],
        SubscriptionOptions::new().timeout(Duration::from_secs(600)),
        move |event: Event, cx: Context| {
            let seen_tx = seen_tx.clone();
            async move {
                let remaining = cx.remaining().unwrap();
                let _ = seen_tx.send((
                    cx.attempt(),
                    cx.subscription().to_string(),
                    cx.event_id() == event.id,
                    remaining > Duration::from_secs(500) && remaining <= Duration::from_secs(600),
                ));
                if cx.attempt() == 1 {
                    return Err(HandlerError::retry_after(
                        "not yet",
                        Duration::from_millis(10),
                    ));
                }
                Ok(())
            }
        },
    ))
    .await;
    publish(&client, Event::new("x", json!({}))).await;
    let first = recv("attempt 1", &mut seen).await;
    let second = recv("attempt 2", &mut seen).await;
    assert_eq!(first, (1, "counted".to_string(), true, true));
    assert_eq!(second, (2, "counted".to_string(), true, true));
    common::wait_settled(&client, "the retry's completion").await;
    running.shutdown().await.unwrap();
}

/// What a handler saw of its event through its [`Context`].
#[derive(Debug, PartialEq)]
struct Seen {
    name: String,
    subscription: String,
    seq: i64,
    attempt: i32,
    headers: serde_json::Value,
    trace: Option<serde_json::Value>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
}

#[tokio::test]
async fn a_typed_handlers_context_names_the_event_its_headers_seq_and_ids() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let running = start(Bus::builder(db.config()).handler_typed(
        "described",
        ["order.*"],
        move |_order: OrderPlaced, cx: Context| {
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.send(Seen {
                    name: cx.event_name().to_string(),
                    subscription: cx.subscription().to_string(),
                    seq: cx.seq(),
                    attempt: cx.attempt(),
                    headers: cx.headers().clone(),
                    trace: cx.header("trace").cloned(),
                    correlation_id: cx.correlation_id().map(str::to_string),
                    causation_id: cx.causation_id().map(str::to_string),
                });
                Ok(())
            }
        },
    ))
    .await;
    let order = OrderPlaced {
        order_id: 7,
        total_cents: 100,
        lines: vec![],
    };
    let described = Event::json("order.placed", &order)
        .unwrap()
        .id("described")
        .header("trace", "t-1")
        .correlation_id("checkout-9")
        .causation_id("cmd-3");
    publish(&client, described).await;
    let plain = Event::json("order.shipped", &order).unwrap().id("plain");
    publish(&client, plain).await;
    let seqs: HashMap<String, i64> = client
        .query("SELECT id, seq FROM pgbus.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut got = vec![
        recv("the first delivery", &mut seen).await,
        recv("the second delivery", &mut seen).await,
    ];
    got.sort_by_key(|s| s.seq);
    assert_eq!(
        got,
        [
            Seen {
                name: "order.placed".into(),
                subscription: "described".into(),
                seq: seqs["described"],
                attempt: 1,
                headers: json!({"trace": "t-1"}),
                trace: Some(json!("t-1")),
                correlation_id: Some("checkout-9".into()),
                causation_id: Some("cmd-3".into()),
            },
            Seen {
                name: "order.shipped".into(),
                subscription: "described".into(),
                seq: seqs["plain"],
                attempt: 1,
                headers: json!({}),
                trace: None,
                correlation_id: None,
                causation_id: None,
            },
        ]
    );
    common::wait_settled(&client, "both completions").await;
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_contexts_token_fires_when_shutdown_begins_and_the_handler_returns() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let (observed_tx, mut observed) = mpsc::unbounded_channel();
    let running = start(
        Bus::builder(db.config())
            // Far longer than the test waits: only the token can end the handler in time.
            .shutdown_timeout(Duration::from_secs(600))
            .handler_with_context("patient", ["*"], move |_event: Event, cx: Context| {
                let started_tx = started_tx.clone();
                let observed_tx = observed_tx.clone();
                async move {
                    let token = cx.cancellation_token();
                    let _ = started_tx.send(cx.is_cancelled());
                    tokio::select! {
                        _ = cx.cancelled() => {}
                        _ = tokio::time::sleep(Duration::from_secs(3600)) => {}
                    }
                    let _ = observed_tx.send((cx.is_cancelled(), token.is_cancelled()));
                    Ok(())
                }
            }),
    )
    .await;
    publish(&client, Event::new("x", json!({}))).await;
    let cancelled_at_start = recv("the handler to start", &mut started).await;
    assert!(!cancelled_at_start);
    assert!(observed.try_recv().is_err());
    common::within("shutdown", WAIT, running.shutdown())
        .await
        .unwrap();
    let seen = observed
        .try_recv()
        .expect("the handler saw no cancellation");
    assert_eq!(seen, (true, true));
    // It returned Ok, so its delivery was completed on the way out.
    assert_eq!(
        common::count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
}

/// A handler that writes its projection row and completes its delivery in one
/// transaction; on attempt 1 of an event whose payload says so, it rolls back instead
/// (after `ack_in`) and fails.
fn projector(
    conn: Arc<Mutex<Client>>,
    calls: mpsc::UnboundedSender<(String, i32)>,
) -> impl Fn(Event, Context) -> futures::future::BoxFuture<'static, Result<(), HandlerError>>
+ Send
+ Sync
+ 'static {
    move |event: Event, cx: Context| {
        let conn = conn.clone();
        let calls = calls.clone();
        Box::pin(async move {
            let _ = calls.send((event.id.clone(), cx.attempt()));
            let mut conn = conn.lock().await;
            let tx = conn.transaction().await?;
            tx.execute(
                "INSERT INTO projection (event_id, attempt) VALUES ($1, $2)",
                &[&event.id, &cx.attempt()],
            )
            .await?;
            cx.ack_in(&tx).await?;
            if event.payload["roll_back_first"] == json!(true) && cx.attempt() == 1 {
                tx.rollback().await?;
                return Err(HandlerError::new("rolled back on purpose"));
            }
            tx.commit().await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_handlers_ack_in_commits_with_its_projection_and_is_not_acked_again() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let (calls_tx, mut calls) = mpsc::unbounded_channel();
    let conn = Arc::new(Mutex::new(db.connect().await));
    let running = start(Bus::builder(db.config()).handler_with_context(
        "projection",
        ["order.*"],
        projector(conn, calls_tx),
    ))
    .await;
    publish(&client, Event::new("order.placed", json!({})).id("o1")).await;
    common::wait_settled(&client, "the completion in the handler's transaction").await;
    assert_eq!(projection_rows(&client).await, [("o1".to_string(), 1)]);
    let stats = running.stats();
    running.shutdown().await.unwrap();
    // One call, one completion (the bus wrote no second acknowledgement, which would
    // have been rejected as stale), no failure.
    assert_eq!(calls.try_recv().unwrap(), ("o1".to_string(), 1));
    assert!(
        calls.try_recv().is_err(),
        "the delivery was delivered again"
    );
    assert_eq!(
        (stats.delivered, stats.stale_rejected, stats.failed),
        (1, 0, 0)
    );
    assert_eq!(
        common::count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        0
    );
}

#[tokio::test]
async fn a_handlers_ack_in_rolled_back_leaves_no_row_and_the_delivery_comes_again() {
    let db = common::test_db().await;
    let client = db.connect().await;
    create_projection(&client).await;
    let (calls_tx, mut calls) = mpsc::unbounded_channel();
    let conn = Arc::new(Mutex::new(db.connect().await));
    let running = start(
        Bus::builder(db.config())
            .retry(RetryPolicy::fixed(Duration::from_millis(10)))
            // The retry must not wait for the lease: the handler's error brings it back.
            .lease(Duration::from_secs(600))
            .handler_with_context("projection", ["order.*"], projector(conn, calls_tx)),
    )
    .await;
    pgbus::publish(
        &client,
        &Event::new("order.placed", json!({"roll_back_first": true})).id("o1"),
    )
    .await
    .unwrap();
    assert_eq!(recv("attempt 1", &mut calls).await, ("o1".to_string(), 1));
    assert_eq!(recv("attempt 2", &mut calls).await, ("o1".to_string(), 2));
    common::wait_settled(&client, "attempt 2's completion").await;
    // Attempt 1's row rolled back with its completion; attempt 2's committed with its.
    assert_eq!(projection_rows(&client).await, [("o1".to_string(), 2)]);
    let errors = failures(&client).await;
    assert_eq!(errors, ["rolled back on purpose"]);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_streams_ack_in_commits_with_the_projection_or_after_a_rollback_comes_again() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    create_projection(&client).await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("projection", ["order.*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish_batch(
        &client,
        &[
            Event::new("order.placed", json!({})).id("kept"),
            Event::new("order.placed", json!({})).id("rolled-back"),
        ],
    )
    .await
    .unwrap();
    let mut held = HashMap::new();
    for _ in 0..2 {
        let d = next("a delivery", &mut stream).await;
        held.insert(d.event().id.clone(), d);
    }

    let d = held.remove("kept").unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO projection VALUES ('kept', $1)",
        &[&d.attempt()],
    )
    .await
    .unwrap();
    d.ack_in(&tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(delivery_of(&client, "kept").await, None);

    let d = held.remove("rolled-back").unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO projection VALUES ('rolled-back', 1)", &[])
        .await
        .unwrap();
    d.ack_in(&tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(projection_rows(&client).await, [("kept".to_string(), 1)]);
    // Still leased to this bus, no longer extended: it comes back once the lease ran out.
    let again = next("the redelivery", &mut stream).await;
    assert_eq!(
        (again.event().id.as_str(), again.attempt()),
        ("rolled-back", 2)
    );
    let errors = failures(&client).await;
    assert_eq!(errors.len(), 1);
    assert!(errors[0].starts_with("lease expired"), "{errors:?}");
    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO projection VALUES ('rolled-back', 2)", &[])
        .await
        .unwrap();
    again.ack_in(&tx).await.unwrap();
    tx.commit().await.unwrap();
    common::wait_settled(&client, "both completions").await;
    assert_eq!(
        projection_rows(&client).await,
        [("kept".to_string(), 1), ("rolled-back".to_string(), 2)]
    );
    assert_eq!(running.stats().delivered, 3);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn ack_in_on_a_lost_lease_fails_and_the_transaction_cannot_commit_its_writes() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    create_projection(&client).await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("projection", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    publish(&client, Event::new("x", json!({})).id("x")).await;
    let stale = next("attempt 1", &mut stream).await;
    assert_eq!(stale.attempt(), 1);

    // The lease runs out; the reaper returns the delivery and it is claimed again.
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second'")
        .await
        .unwrap();
    let current = next("attempt 2", &mut stream).await;
    assert_eq!(current.attempt(), 2);

    let tx = client.transaction().await.unwrap();
    tx.execute("INSERT INTO projection VALUES ('x', 1)", &[])
        .await
        .unwrap();
    let result = stale.ack_in(&tx).await;
    assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
    // The statement's error aborted the transaction: nothing it wrote can commit.
    let more = tx
        .execute("INSERT INTO projection VALUES ('y', 1)", &[])
        .await;
    assert_eq!(
        more.unwrap_err().code(),
        Some(&tokio_postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION)
    );
    let _ = tx.commit().await;
    assert!(projection_rows(&client).await.is_empty());
    // The current holder's lease is untouched.
    assert_eq!(
        delivery_of(&client, "x")
            .await
            .map(|(status, attempts, _)| (status, attempts)),
        Some(("processing".to_string(), 2))
    );
    current.ack().await.unwrap();
    common::wait_settled(&client, "the current holder's completion").await;
    assert_eq!(running.stats().stale_rejected, 1);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn ack_in_in_an_ordered_subscription_hands_the_key_to_its_next_event_at_commit() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    let mut bus = Bus::builder(db.config()).build().unwrap();
    let mut stream = bus
        .subscribe_with("ordered", ["*"], SubscriptionOptions::new().ordered(true))
        .unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish_batch(
        &client,
        &[
            Event::new("x", json!({})).id("first").ordering_key("k"),
            Event::new("x", json!({})).id("second").ordering_key("k"),
        ],
    )
    .await
    .unwrap();
    let first = next("the key's head", &mut stream).await;
    assert_eq!(first.event().id, "first");

    let is_head = |id: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT d.is_head FROM pgbus.deliveries AS d
                     JOIN pgbus.events AS e ON e.seq = d.event_seq WHERE e.id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(!is_head("second").await);
    let observer = db.connect().await;
    let tx = client.transaction().await.unwrap();
    first.ack_in(&tx).await.unwrap();
    // Not before the commit: the head is still the first event, for everyone else.
    assert_eq!(
        delivery_of(&observer, "first").await.map(|d| d.0),
        Some("processing".to_string())
    );
    tx.commit().await.unwrap();
    let second = next("the key's next event", &mut stream).await;
    assert_eq!(
        (second.event().id.as_str(), second.attempt()),
        ("second", 1)
    );
    assert_eq!(delivery_of(&observer, "first").await, None);
    second.ack().await.unwrap();
    common::wait_settled(&observer, "the second event").await;
    running.shutdown().await.unwrap();
}
