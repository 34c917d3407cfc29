//! Retrying dead letters and replaying events touch only the subscription they name:
//! another subscription that handled the same event never runs it again.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbus::admin::DeadLetterFilter;
use pgbus::{Bus, Event, HandlerError, RunningBus};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Handler runs per (subscription, event id).
type Runs = Arc<Mutex<HashMap<(String, String), usize>>>;

fn runs_of(runs: &Runs, sub: &str, id: &str) -> usize {
    runs.lock()
        .unwrap()
        .get(&(sub.to_string(), id.to_string()))
        .copied()
        .unwrap_or(0)
}

/// One bus with two subscriptions, "A" and "B", both matching every event. A's first run
/// of an event whose payload has `"a_dies": true` fails permanently (later runs succeed);
/// B fails permanently on every run of an event with `"b_dies": true`. Everything else
/// succeeds.
async fn two_subscriptions(db: &common::TestDb) -> (Runs, RunningBus) {
    let runs: Runs = Default::default();
    let mut builder = Bus::builder(db.config()).poll_interval(Duration::from_millis(500));
    for sub in ["A", "B"] {
        let r = runs.clone();
        builder = builder.handler_fn(sub, ["*"], move |e: Event| {
            let run = {
                let mut runs = r.lock().unwrap();
                let n = runs.entry((sub.to_string(), e.id.clone())).or_insert(0);
                *n += 1;
                *n
            };
            let dies = match sub {
                "A" => run == 1 && e.payload["a_dies"] == true,
                _ => e.payload["b_dies"] == true,
            };
            async move {
                if dies {
                    Err(HandlerError::permanent("dies"))
                } else {
                    Ok(())
                }
            }
        });
    }
    let running = builder.build().unwrap().start().await.unwrap();
    (runs, running)
}

/// Waits until every committed event has its deliveries and the only deliveries left
/// are the `dead` dead letters. (Without the first half, an event published after the
/// one that dies, and not yet turned into deliveries, looked settled: it had none.)
async fn wait_settled(client: &tokio_postgres::Client, dead: i64) {
    common::wait_for("every live delivery to be settled", WAIT, || async {
        count(
            client,
            "SELECT (SELECT count(*) FROM pgbus.deliveries WHERE status <> 'dead') \
                    + (SELECT events FROM pgbus.not_fanned_out(NULL))",
        )
        .await
            == 0
            && count(
                client,
                "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
            )
            .await
                == dead
    })
    .await;
}

async fn dead_letters_of(client: &tokio_postgres::Client, sub: &str) -> i64 {
    pgbus::admin::count_dead_letters(client, &DeadLetterFilter::all().subscription(sub))
        .await
        .unwrap()
}

#[tokio::test]
async fn retrying_one_subscriptions_dead_letters_never_reruns_another() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (runs, running) = two_subscriptions(&db).await;
    pgbus::publish(
        &client,
        &Event::new("x", json!({ "a_dies": true })).id("e1"),
    )
    .await
    .unwrap();
    wait_settled(&client, 1).await;
    assert_eq!(dead_letters_of(&client, "A").await, 1);
    assert_eq!(
        (runs_of(&runs, "A", "e1"), runs_of(&runs, "B", "e1")),
        (1, 1)
    );

    let retried =
        pgbus::admin::retry_dead_letters(&client, &DeadLetterFilter::all().subscription("A"))
            .await
            .unwrap();
    assert_eq!(retried, 1);
    common::wait_for("A's second run", WAIT, || async {
        runs_of(&runs, "A", "e1") == 2
    })
    .await;
    // Idle: anything the retry had created for B would still be a delivery until B ran.
    wait_settled(&client, 0).await;
    assert_eq!(runs_of(&runs, "A", "e1"), 2);
    assert_eq!(runs_of(&runs, "B", "e1"), 1, "B ran the event again");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn retrying_one_events_dead_letters_never_reruns_another_subscription() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (runs, running) = two_subscriptions(&db).await;
    // e1: dead for A only. e2: dead for B only, and stays so.
    pgbus::publish(
        &client,
        &Event::new("x", json!({ "a_dies": true })).id("e1"),
    )
    .await
    .unwrap();
    pgbus::publish(
        &client,
        &Event::new("x", json!({ "b_dies": true })).id("e2"),
    )
    .await
    .unwrap();
    wait_settled(&client, 2).await;
    assert_eq!(dead_letters_of(&client, "A").await, 1);
    assert_eq!(dead_letters_of(&client, "B").await, 1);

    // No subscription named: the event id alone picks the dead letters.
    let retried =
        pgbus::admin::retry_dead_letters(&client, &DeadLetterFilter::all().event_id("e1"))
            .await
            .unwrap();
    assert_eq!(retried, 1);
    common::wait_for("A's second run", WAIT, || async {
        runs_of(&runs, "A", "e1") == 2
    })
    .await;
    wait_settled(&client, 1).await;
    assert_eq!(runs_of(&runs, "A", "e1"), 2);
    assert_eq!(runs_of(&runs, "B", "e1"), 1, "B ran e1 again");
    assert_eq!(runs_of(&runs, "A", "e2"), 1, "A ran e2 again");
    assert_eq!(
        runs_of(&runs, "B", "e2"),
        1,
        "B's dead letter of e2 was retried"
    );
    assert_eq!(dead_letters_of(&client, "A").await, 0);
    assert_eq!(dead_letters_of(&client, "B").await, 1);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn replaying_into_one_subscription_never_reruns_another() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (runs, running) = two_subscriptions(&db).await;
    let since = chrono::Utc::now() - chrono::Duration::hours(1);
    // e1: A's first run dies, and its dead letter is purged. e2: both succeed.
    pgbus::publish(
        &client,
        &Event::new("x", json!({ "a_dies": true })).id("e1"),
    )
    .await
    .unwrap();
    pgbus::publish(&client, &Event::new("x", json!({})).id("e2"))
        .await
        .unwrap();
    wait_settled(&client, 1).await;
    let purged =
        pgbus::admin::purge_dead_letters(&client, &DeadLetterFilter::all().subscription("A"))
            .await
            .unwrap();
    assert_eq!(purged.dead_letters, 1);
    for id in ["e1", "e2"] {
        assert_eq!((runs_of(&runs, "A", id), runs_of(&runs, "B", id)), (1, 1));
    }

    let replayed = pgbus::admin::replay(&client, "A", since, None, None)
        .await
        .unwrap();
    assert_eq!((replayed.matched, replayed.created), (2, 2));
    common::wait_for("A's second runs", WAIT, || async {
        runs_of(&runs, "A", "e1") == 2 && runs_of(&runs, "A", "e2") == 2
    })
    .await;
    wait_settled(&client, 0).await;
    for id in ["e1", "e2"] {
        assert_eq!(runs_of(&runs, "A", id), 2, "A's runs of {id}");
        assert_eq!(runs_of(&runs, "B", id), 1, "B ran {id} again");
    }
    running.shutdown().await.unwrap();
}
