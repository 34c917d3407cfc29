//! Pausing a subscription (migration 28): its deliveries are still made but none is handed
//! out, while the bus's other subscriptions deliver; resuming delivers what waited, each
//! ordered key in order; what a consumer holds at the pause settles as usual; the claim
//! keeps a paused subscription's floor.

mod common;

use common::count;

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event, SubscriptionOptions};
use serde_json::json;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(20);

/// Four events in one transaction: keys `k` (p1, p2, p4) and `j` (p3).
async fn publish_four(client: &mut Client) {
    let tx = client.transaction().await.unwrap();
    for (id, key) in [("p1", "k"), ("p2", "k"), ("p3", "j"), ("p4", "k")] {
        pgbus::publish(
            &tx,
            &Event::new("p.x", json!({ "id": id }))
                .id(id)
                .ordering_key(key),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

/// Takes `n` deliveries from `stream`, acknowledging each before taking the next (an
/// ordered subscription hands out a key's next delivery only then), and returns their
/// event ids with their keys, in the order they came.
async fn take_acking(what: &str, stream: &mut pgbus::Subscription, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let delivery = common::within(what, WAIT, stream.next())
            .await
            .expect("the stream ended");
        ids.push(format!(
            "{}@{}",
            delivery.event().id,
            delivery.event().ordering_key.as_deref().unwrap_or("")
        ));
        delivery.ack().await.unwrap();
    }
    ids
}

/// A bus serves three subscriptions of the same events, two of them paused: the open
/// one delivers all four events, the paused ones none (not one attempt), while their
/// deliveries wait; the gauges and the listing say they are paused. Resumed, the
/// unordered one delivers all four and the ordered one delivers key `k` in order.
#[tokio::test]
async fn a_paused_subscription_hands_out_nothing_until_resumed() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut open = bus.subscribe("open", ["p.*"]).unwrap();
    let mut held = bus.subscribe("held", ["p.*"]).unwrap();
    let mut held_o = bus
        .subscribe_with("held_o", ["p.*"], SubscriptionOptions::new().ordered(true))
        .unwrap();
    let running = bus.start().await.unwrap();

    for name in ["held", "held_o"] {
        let paused = pgbus::admin::pause_subscription(&client, name)
            .await
            .unwrap();
        assert!(!paused.already, "{name} was not paused before");
    }
    publish_four(&mut client).await;

    // The open subscription's deliveries were made in the same fan-out as the paused
    // ones' and claimed by the same claim statements.
    let mut got = take_acking("the open subscription's deliveries", &mut open, 4).await;
    got.sort();
    assert_eq!(got, ["p1@k", "p2@k", "p3@j", "p4@k"]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries \
             WHERE subscription IN ('held', 'held_o') AND status = 'pending' AND attempts = 0"
        )
        .await,
        8,
        "every delivery of the paused subscriptions waits, never claimed"
    );
    assert!(
        futures::FutureExt::now_or_never(held.next()).is_none(),
        "a paused subscription handed out a delivery"
    );
    let listed = pgbus::admin::subscriptions(&client).await.unwrap();
    let paused: Vec<(&str, bool)> = listed
        .iter()
        .map(|s| (s.name.as_str(), s.paused_at.is_some()))
        .collect();
    assert_eq!(paused, [("held", true), ("held_o", true), ("open", false)]);
    let gauges = pgbus::admin::backlog(&client, None).await.unwrap();
    let gauge: Vec<(&str, bool, i64)> = gauges
        .iter()
        .map(|b| (b.subscription.as_str(), b.paused, b.due))
        .collect();
    assert_eq!(
        gauge,
        [("held", true, 4), ("held_o", true, 4), ("open", false, 0)]
    );
    let status = pgbus::admin::status(&client).await.unwrap();
    assert!(
        status
            .subscriptions
            .iter()
            .all(|s| s.paused_at.is_some() == (s.name != "open")),
        "{:?}",
        status.subscriptions
    );

    for name in ["held", "held_o"] {
        let resumed = pgbus::admin::resume_subscription(&client, name)
            .await
            .unwrap();
        assert!(resumed.paused_since.is_some(), "{name} was paused");
    }
    let mut got = take_acking("the resumed subscription's deliveries", &mut held, 4).await;
    got.sort();
    assert_eq!(got, ["p1@k", "p2@k", "p3@j", "p4@k"]);
    let ordered = take_acking("the resumed ordered deliveries", &mut held_o, 4).await;
    let k: Vec<&String> = ordered.iter().filter(|id| id.ends_with("@k")).collect();
    assert_eq!(
        k,
        ["p1@k", "p2@k", "p4@k"],
        "key k out of order: {ordered:?}"
    );
    common::wait_for("every delivery settled", WAIT, || async {
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await == 0
    })
    .await;
    running.shutdown().await.unwrap();
}

/// What a consumer holds when its subscription is paused is still its to settle: the
/// acknowledgement of a delivery claimed before the pause is applied.
#[tokio::test]
async fn a_delivery_held_at_the_pause_is_settled_as_usual() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("s", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish(&client, &Event::new("x", json!({})).id("x"))
        .await
        .unwrap();
    let delivery = common::within("the delivery", WAIT, stream.next())
        .await
        .unwrap();
    pgbus::admin::pause_subscription(&client, "s")
        .await
        .unwrap();
    delivery.ack().await.unwrap();
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0,
        "the acknowledgement after the pause was not applied"
    );
    running.shutdown().await.unwrap();
}

/// Pausing twice keeps the first pause's time; resuming what is not paused changes
/// nothing; an unknown name is refused and nothing is written.
#[tokio::test]
async fn pausing_and_resuming_again_change_nothing_and_unknown_names_are_refused() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["*"], 25)
        .await
        .unwrap();
    let first = pgbus::admin::pause_subscription(&client, "s")
        .await
        .unwrap();
    let again = pgbus::admin::pause_subscription(&client, "s")
        .await
        .unwrap();
    assert!(!first.already);
    assert!(again.already);
    assert_eq!(again.since, first.since);
    let resumed = pgbus::admin::resume_subscription(&client, "s")
        .await
        .unwrap();
    assert_eq!(resumed.paused_since, Some(first.since));
    let again = pgbus::admin::resume_subscription(&client, "s")
        .await
        .unwrap();
    assert_eq!(again.paused_since, None);

    for result in [
        pgbus::admin::pause_subscription(&client, "nope")
            .await
            .map(|_| ()),
        pgbus::admin::resume_subscription(&client, "nope")
            .await
            .map(|_| ()),
    ] {
        match result {
            Err(Error::UnknownSubscription { name }) => assert_eq!(name, "nope"),
            other => panic!("not UnknownSubscription: {other:?}"),
        }
    }
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.subscriptions WHERE paused_at IS NOT NULL OR name = 'nope'"
        )
        .await,
        0
    );
}

/// The claim gives a paused subscription back the floor it was given, never a later
/// one: a delivery made while it is paused has a `ready_at` below a floor of "five
/// seconds before this claim", and must still be found after the resume.
#[tokio::test]
async fn the_claim_keeps_a_paused_subscriptions_floor() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for name in ["paused", "open"] {
        pgbus::admin::register_subscription(&client, name, &["*"], 25)
            .await
            .unwrap();
    }
    pgbus::admin::pause_subscription(&client, "paused")
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("x", json!({})).id("x"))
        .await
        .unwrap();
    let floor = chrono::DateTime::parse_from_rfc3339("2020-01-01T00:00:00Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let rows = client
        .query(
            "SELECT subscription, floors FROM pgbus.claim('{paused,open}', '{10,10}', 20, \
             60000, 'w', 1, 1000000, ARRAY[$1, $1]::timestamptz[])",
            &[&floor],
        )
        .await
        .unwrap();
    let claimed: Vec<Option<String>> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(
        claimed,
        [Some("open".to_owned())],
        "only the open one claims"
    );
    let floors: Vec<Option<chrono::DateTime<chrono::Utc>>> = rows[0].get(1);
    assert_eq!(
        floors[0],
        Some(floor),
        "the paused subscription's floor moved"
    );
    assert!(
        floors[1].is_some_and(|f| f > floor),
        "the open one took everything it found: its floor moves on ({floors:?})"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries \
             WHERE subscription = 'paused' AND status = 'pending' AND attempts = 0"
        )
        .await,
        1
    );
}
