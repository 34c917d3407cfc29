//! Shutdown releases what a stream subscription has claimed and not handed out.

mod common;

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Event, SubscriptionOptions};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// `RunningBus::shutdown` promises to release claimed deliveries that have not started.
/// A stream's consumer acknowledges a round, which frees slots and starts a claim; the
/// bus is shut down while that claim is in flight. Whatever the claim took must be back
/// to pending when shutdown returns.
#[tokio::test]
async fn shutdown_during_a_streams_claim_leaves_nothing_processing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "feed", &["*"], 25)
        .await
        .unwrap();
    let events: Vec<Event> = (0..5_000).map(|i| Event::new("job", json!(i))).collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    for round in 0..20 {
        let mut bus = Bus::builder(db.config())
            .concurrency(4)
            .batch_size(50)
            .shutdown_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let mut stream = bus
            .subscribe_with("feed", ["*"], SubscriptionOptions::new().concurrency(20))
            .unwrap();
        let running = bus.start().await.unwrap();
        let mut held = Vec::new();
        for _ in 0..20 {
            held.push(
                common::within("the next delivery", WAIT, stream.next())
                    .await
                    .expect("the stream ended"),
            );
        }
        for d in held {
            d.ack().await.unwrap();
        }
        // The acks freed every slot: a claim starts now. Shut down meanwhile.
        running.shutdown().await.unwrap();
        drop(stream);
        let processing = count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'",
        )
        .await;
        assert_eq!(
            processing, 0,
            "round {round}: shutdown left {processing} claimed deliveries processing"
        );
    }
}
