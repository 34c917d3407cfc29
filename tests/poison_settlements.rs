//! One bad settlement never costs the others: failure texts and retry delays are made
//! storable before they reach a batch, a settlement PostgreSQL still refuses is isolated
//! and given up alone, and a failure that passes (a lock, a statement timeout) is waited
//! out without dropping anything.

mod common;

use std::collections::HashMap;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::future::{BoxFuture, FutureExt};
use pgbus::{
    Bus, Delivery, Error, Event, HandlerError, MAX_ERROR_TEXT, MAX_RETRY_DELAY, RetryPolicy,
};
use serde_json::json;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(30);

/// What the test's `pgbus.delivery_failures` refuses (a CHECK constraint it adds): a
/// settlement that no cleaning of its text can save, for the acker to isolate.
const REFUSED: &str = "refused by the database";

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The state of the delivery of the event with this id: status, last error, and the
/// seconds until it is due.
async fn delivery_of(client: &Client, id: &str) -> Option<(String, Option<String>, f64)> {
    client
        .query_opt(
            "SELECT d.status, d.last_error,
                    extract(epoch FROM d.available_at - now())::float8
             FROM pgbus.deliveries AS d JOIN pgbus.events AS e ON e.seq = d.event_seq
             WHERE e.id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
}

async fn history_of(client: &Client, id: &str) -> Vec<String> {
    client
        .query(
            "SELECT f.error FROM pgbus.delivery_failures AS f
             JOIN pgbus.events AS e ON e.seq = f.event_seq WHERE e.id = $1 ORDER BY f.attempt",
            &[&id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Waits until a settle statement of the bus waits for a lock; returns when that
/// statement started.
async fn settle_waiting_on_lock(client: &Client) -> Vec<String> {
    client
        .query(
            "SELECT query_start::text FROM pg_stat_activity
             WHERE application_name = 'pgbus worker' AND wait_event_type = 'Lock'
               AND query LIKE '%pgbus.settle(%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn assert_about_a_year_ahead(what: &str, due_in_secs: f64) {
    let max = MAX_RETRY_DELAY.as_secs_f64();
    assert!(
        due_in_secs > max - 600.0 && due_in_secs <= max + 1.0,
        "{what}: due in {due_in_secs} s, expected about {max} s"
    );
}

#[tokio::test]
async fn a_poison_settlement_in_a_batch_loses_none_of_the_others() {
    const GOOD: usize = 300;
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut locker = db.connect().await;
    client
        .batch_execute(&format!(
            "ALTER TABLE pgbus.delivery_failures
               ADD CONSTRAINT test_refuses CHECK (error NOT LIKE '{REFUSED}%')"
        ))
        .await
        .unwrap();
    let mut bus = Bus::builder(db.config())
        .concurrency(GOOD + 20)
        .retry(RetryPolicy::fixed(Duration::from_secs(3600)))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("stream", ["*"]).unwrap();
    let running = bus.start().await.unwrap();

    let poison = [
        "blocker",
        "nul-reason",
        "nul-error",
        "retry-in-max",
        "retry-after-huge",
        "huge-reason",
        "refused",
    ];
    let mut events: Vec<Event> = (0..GOOD)
        .map(|i| Event::new("t.good", json!({ "i": i })).id(format!("good-{i}")))
        .collect();
    events.extend(
        poison
            .iter()
            .map(|id| Event::new("t.poison", json!({})).id(*id)),
    );
    pgbus::publish_batch(&client, &events).await.unwrap();

    let mut deliveries: HashMap<String, Delivery> = HashMap::new();
    while deliveries.len() < events.len() {
        let d = common::within("every delivery", WAIT, stream.next())
            .await
            .expect("the stream ended");
        deliveries.insert(d.event().id.clone(), d);
    }

    // Hold the acker on a first settlement until every other one is queued behind it,
    // so that they are all written as one batch.
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pgbus.deliveries IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut blocker = pin!(deliveries.remove("blocker").unwrap().ack());
    assert!(futures::poll!(blocker.as_mut()).is_pending());
    common::wait_for(
        "the first settlement to wait for the lock",
        WAIT,
        || async { !settle_waiting_on_lock(&client).await.is_empty() },
    )
    .await;

    let take =
        |deliveries: &mut HashMap<String, Delivery>, id: &str| deliveries.remove(id).unwrap();
    let mut settling: Vec<(String, BoxFuture<'static, pgbus::Result<()>>)> = vec![
        (
            "nul-reason".into(),
            take(&mut deliveries, "nul-reason")
                .dead_letter("bad\0byte in a reason")
                .boxed(),
        ),
        (
            "nul-error".into(),
            take(&mut deliveries, "nul-error")
                .fail(HandlerError::new("exit status 1: \0\0 on stderr"))
                .boxed(),
        ),
        (
            "retry-in-max".into(),
            take(&mut deliveries, "retry-in-max")
                .retry_in(Duration::MAX)
                .boxed(),
        ),
        (
            "retry-after-huge".into(),
            take(&mut deliveries, "retry-after-huge")
                .fail(HandlerError::retry_after(
                    "come back much later",
                    Duration::from_secs(10u64.pow(12)),
                ))
                .boxed(),
        ),
        (
            "huge-reason".into(),
            take(&mut deliveries, "huge-reason")
                .dead_letter(format!("{}\0", "r".repeat(1 << 20)))
                .boxed(),
        ),
        (
            "refused".into(),
            take(&mut deliveries, "refused")
                .dead_letter(format!("{REFUSED}: no text cleaning can save this"))
                .boxed(),
        ),
    ];
    // The poison ones in the middle of the good ones.
    let goods: Vec<_> = deliveries
        .drain()
        .map(|(id, d)| (id, d.ack().boxed()))
        .collect();
    let tail = settling.split_off(3);
    let mut all = settling;
    all.extend(goods);
    all.extend(tail);
    assert_eq!(all.len(), GOOD + 6);
    for (_, f) in &mut all {
        // Polled once: the settlement is queued for the acker.
        assert!(futures::poll!(f).is_pending());
    }
    tx.commit().await.unwrap();

    common::within("the first settlement", WAIT, blocker)
        .await
        .unwrap();
    let mut results = HashMap::new();
    for (id, f) in all {
        results.insert(id, common::within("a settlement", WAIT, f).await);
    }

    // Only the refused settlement failed, and its caller was told.
    for (id, result) in &results {
        if id == "refused" {
            assert!(
                matches!(result, Err(e @ Error::Settle(_))
                    if e.code() == Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION)
                        && e.to_string().contains("23514")),
                "{result:?}"
            );
        } else {
            assert!(result.is_ok(), "{id}: {result:?}");
        }
    }
    // Every good ack is saved: gone, with no history, never to come back.
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries AS d JOIN pgbus.events AS e
             ON e.seq = d.event_seq WHERE e.id LIKE 'good-%' OR e.id = 'blocker'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.delivery_failures AS f JOIN pgbus.events AS e
             ON e.seq = f.event_seq WHERE e.id LIKE 'good-%' OR e.id = 'blocker'"
        )
        .await,
        0
    );

    // The poison ones are stored, their texts made storable, their delays clamped.
    let (status, error, _) = delivery_of(&client, "nul-reason").await.unwrap();
    assert_eq!(status, "dead");
    assert_eq!(error.as_deref(), Some("bad\u{FFFD}byte in a reason"));
    assert_eq!(
        history_of(&client, "nul-reason").await,
        ["bad\u{FFFD}byte in a reason"]
    );

    let (status, error, due) = delivery_of(&client, "nul-error").await.unwrap();
    assert_eq!(status, "pending");
    assert_eq!(
        error.as_deref(),
        Some("exit status 1: \u{FFFD}\u{FFFD} on stderr")
    );
    assert!(due > 3000.0, "the policy's hour: {due}");

    let (status, error, due) = delivery_of(&client, "retry-in-max").await.unwrap();
    assert_eq!(status, "pending");
    assert!(error.unwrap().contains("clamped to"));
    assert_about_a_year_ahead("retry_in(Duration::MAX)", due);

    let (status, error, due) = delivery_of(&client, "retry-after-huge").await.unwrap();
    assert_eq!(status, "pending");
    assert_eq!(error.as_deref(), Some("come back much later"));
    assert_about_a_year_ahead("retry_after(10^12 s)", due);

    let (status, error, _) = delivery_of(&client, "huge-reason").await.unwrap();
    assert_eq!(status, "dead");
    let error = error.unwrap();
    assert!(error.len() <= MAX_ERROR_TEXT, "{}", error.len());
    assert!(error.starts_with("rrrr") && error.ends_with("(truncated)"));
    assert_eq!(history_of(&client, "huge-reason").await, [error]);

    // The refused one still holds its lease, with no history: it comes back when the
    // lease expires.
    let (status, _, _) = delivery_of(&client, "refused").await.unwrap();
    assert_eq!(status, "processing");
    assert!(history_of(&client, "refused").await.is_empty());

    let stats = running.stats();
    assert_eq!(stats.delivered, GOOD as u64 + 1, "{stats:?}");
    assert_eq!(stats.failed, 5, "{stats:?}");
    assert_eq!(stats.dead_lettered, 2, "{stats:?}");
    assert_eq!(stats.settle_errors, 1, "{stats:?}");
    assert_eq!(stats.stale_rejected, 0, "{stats:?}");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_handler_bus_stores_every_poison_text_and_runs_every_good_event_once() {
    const GOOD: usize = 200;
    // The planned panic prints nothing.
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planned = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.starts_with("planned"));
        if !planned {
            default(info);
        }
    }));
    let db = common::test_db().await;
    let client = db.connect().await;
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let counted = runs.clone();
    let running = Bus::builder(db.config())
        .concurrency(GOOD + 10)
        .batch_size(GOOD + 10)
        .retry(RetryPolicy::fixed(Duration::from_secs(3600)))
        .handler_fn("handler", ["*"], move |event: Event| {
            *counted.lock().unwrap().entry(event.id.clone()).or_default() += 1;
            async move {
                match event.id.as_str() {
                    "panic-nul" => panic!("{}", "planned panic with a \0 in it"),
                    "error-nul" => Err(HandlerError::new("a \0 in an error")),
                    "permanent-huge" => Err(HandlerError::permanent("p".repeat(1 << 20) + "\0")),
                    "retry-after-max" => Err(HandlerError::retry_after("later", Duration::MAX)),
                    _ => Ok(()),
                }
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let poison = [
        "panic-nul",
        "error-nul",
        "permanent-huge",
        "retry-after-max",
    ];
    let mut events: Vec<Event> = (0..GOOD)
        .map(|i| Event::new("t.good", json!({ "i": i })).id(format!("good-{i}")))
        .collect();
    for (n, id) in poison.iter().enumerate() {
        events.insert(n * GOOD / 4, Event::new("t.poison", json!({})).id(*id));
    }
    pgbus::publish_batch(&client, &events).await.unwrap();

    common::wait_for(
        "every settlement to be written and counted",
        WAIT,
        || async {
            let stats = running.stats();
            stats.delivered == GOOD as u64
                && stats.failed == 4
                && count(
                    &client,
                    "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'",
                )
                .await
                    == 0
                && count(&client, "SELECT count(*) FROM pgbus.deliveries").await == 4
        },
    )
    .await;
    let stats = running.stats();
    assert_eq!(stats.delivered, GOOD as u64, "{stats:?}");
    assert_eq!(stats.failed, 4, "{stats:?}");
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    assert_eq!(stats.settle_errors, 0, "{stats:?}");

    let (status, error, _) = delivery_of(&client, "panic-nul").await.unwrap();
    assert_eq!(status, "pending");
    assert_eq!(
        error.as_deref(),
        Some("handler panicked: planned panic with a \u{FFFD} in it")
    );
    let (_, error, _) = delivery_of(&client, "error-nul").await.unwrap();
    assert_eq!(error.as_deref(), Some("a \u{FFFD} in an error"));
    let (status, error, _) = delivery_of(&client, "permanent-huge").await.unwrap();
    assert_eq!(status, "dead");
    let error = error.unwrap();
    assert!(error.len() <= MAX_ERROR_TEXT && error.starts_with("ppp"));
    let (status, _, due) = delivery_of(&client, "retry-after-max").await.unwrap();
    assert_eq!(status, "pending");
    assert_about_a_year_ahead("retry_after(Duration::MAX)", due);

    running.shutdown().await.unwrap();
    // Shut down: nothing can run any more. Every event ran exactly once.
    let runs = runs.lock().unwrap();
    assert_eq!(runs.len(), GOOD + poison.len());
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
}

#[tokio::test]
async fn settlements_wait_out_a_lock_past_the_statement_timeout_and_none_is_dropped() {
    const N: usize = 50;
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut locker = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .concurrency(N + 10)
        .statement_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("stream", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    let events: Vec<Event> = (0..N)
        .map(|i| Event::new("t.ack", json!({ "i": i })))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    let mut deliveries = Vec::new();
    while deliveries.len() < N {
        deliveries.push(
            common::within("every delivery", WAIT, stream.next())
                .await
                .expect("the stream ended"),
        );
    }

    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pgbus.deliveries IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let acks = tokio::spawn(futures::future::join_all(
        deliveries.into_iter().map(|d| d.ack()),
    ));
    // Each try runs into the statement timeout (SQLSTATE 57014). Wait for more tries
    // than a settlement that is given up would get.
    let tries = Mutex::new(std::collections::HashSet::new());
    common::wait_for("the settlements to be tried 5 times", WAIT, || async {
        let waiting = settle_waiting_on_lock(&client).await;
        let mut tries = tries.lock().unwrap();
        tries.extend(waiting);
        tries.len() >= 5
    })
    .await;
    assert!(
        !acks.is_finished(),
        "an ack returned while the table was locked"
    );
    assert_eq!(running.stats().delivered, 0);
    tx.commit().await.unwrap();

    let results = common::within("the acks", WAIT, acks).await.unwrap();
    for result in results {
        result.unwrap();
    }
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        0
    );
    let stats = running.stats();
    assert_eq!(stats.delivered, N as u64, "{stats:?}");
    assert_eq!(stats.settle_errors, 0, "{stats:?}");
    running.shutdown().await.unwrap();
}
