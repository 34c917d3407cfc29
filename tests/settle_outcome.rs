//! A settlement whose connection is lost with its statement in flight may have been
//! written or not. A later try that finds the lease gone cannot tell whether that first
//! try took it: the outcome is reported unknown (`Error::SettleUnknown`, counted in
//! `Stats::unknown_outcomes` and as outcome `unknown` of `pgbus_deliveries_total`), never
//! as a lost lease. A later try that writes it makes the outcome known again.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use pgbus::{Bus, Error, Event};
use serde_json::json;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(30);

/// The backends of the bus whose settle statement waits for a lock (in this test's
/// database: the cluster serves other tests at once).
async fn settling_backends(client: &Client) -> Vec<i32> {
    client
        .query(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'pgbus worker' AND wait_event_type = 'Lock'
               AND query LIKE '%pgbus.settle(%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The `pgbus_deliveries_total` counters the recorder saw, by outcome.
fn deliveries_by_outcome(
    snapshotter: &metrics_util::debugging::Snapshotter,
) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if key.key().name() != pgbus::metrics::DELIVERIES {
            continue;
        }
        let outcome = key
            .key()
            .labels()
            .find(|l| l.key() == "outcome")
            .map(|l| l.value().to_string())
            .unwrap_or_default();
        if let DebugValue::Counter(n) = value {
            *out.entry(outcome).or_default() += n;
        }
    }
    out
}

/// Acks the one delivery while its settle statement waits on a lock the test holds;
/// meanwhile, in the lock's transaction, `meanwhile` runs (with the delivery's event
/// seq), then the settling backend is terminated and the lock released. Returns the
/// ack's result and the bus's stats.
async fn ack_with_connection_killed_in_flight(
    meanwhile: Option<&str>,
) -> (pgbus::Result<()>, pgbus::Stats, HashMap<String, u64>) {
    let recorder: &'static DebuggingRecorder = Box::leak(Box::new(DebuggingRecorder::new()));
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(recorder);

    let db = common::test_db().await;
    let client = db.connect().await;
    let mut locker = db.connect().await;
    let mut bus = Bus::builder(db.config()).build().unwrap();
    let mut stream = bus.subscribe("outcome", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish(&client, &Event::new("t.settle", json!({})).id("in-flight"))
        .await
        .unwrap();
    let delivery = common::within("the delivery", WAIT, stream.next())
        .await
        .expect("the stream ended");

    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pgbus.deliveries IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let ack = tokio::spawn(delivery.ack());
    common::wait_for(
        "the settle statement to wait for the lock",
        WAIT,
        || async { !settling_backends(&client).await.is_empty() },
    )
    .await;
    let pids = settling_backends(&client).await;
    if let Some(sql) = meanwhile {
        tx.batch_execute(sql).await.unwrap();
    }
    for pid in &pids {
        let ended: bool = client
            .query_one("SELECT pg_terminate_backend($1)", &[pid])
            .await
            .unwrap()
            .get(0);
        assert!(ended, "backend {pid} was not terminated");
    }
    tx.commit().await.unwrap();

    let result = common::within("the ack", WAIT, ack).await.unwrap();
    let stats = running.stats();
    running.shutdown().await.unwrap();
    (result, stats, deliveries_by_outcome(&snapshotter))
}

#[tokio::test(flavor = "current_thread")]
async fn a_settlement_lost_in_flight_then_found_stale_is_unknown_not_a_lost_lease() {
    // What the first try would have done had it committed before its connection went
    // (an ack deletes the delivery): the retry then finds no lease to settle.
    let (result, stats, counted) = ack_with_connection_killed_in_flight(Some(
        "DELETE FROM pgbus.deliveries WHERE subscription = 'outcome'",
    ))
    .await;
    match result {
        Err(Error::SettleUnknown(source)) => {
            assert!(source.is_connection(), "{source:?}");
        }
        other => panic!("expected SettleUnknown, got {other:?}"),
    }
    assert_eq!(stats.unknown_outcomes, 1, "{stats:?}");
    assert_eq!(stats.stale_rejected, 0, "{stats:?}");
    assert_eq!(stats.delivered, 0, "{stats:?}");
    assert_eq!(counted.get("unknown"), Some(&1), "{counted:?}");
    assert_eq!(counted.get("stale"), None, "{counted:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_settlement_lost_in_flight_then_written_by_a_retry_is_known() {
    let (result, stats, counted) = ack_with_connection_killed_in_flight(None).await;
    result.unwrap();
    assert_eq!(stats.delivered, 1, "{stats:?}");
    assert_eq!(stats.unknown_outcomes, 0, "{stats:?}");
    assert_eq!(stats.stale_rejected, 0, "{stats:?}");
    assert_eq!(counted.get("acked"), Some(&1), "{counted:?}");
    assert_eq!(counted.get("unknown"), None, "{counted:?}");
}

#[tokio::test]
async fn a_settlement_refused_for_a_lost_lease_without_a_lost_connection_is_stale() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config()).build().unwrap();
    let mut stream = bus.subscribe("outcome", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish(&client, &Event::new("t.settle", json!({})).id("taken"))
        .await
        .unwrap();
    let delivery = common::within("the delivery", WAIT, stream.next())
        .await
        .expect("the stream ended");
    // Taken over: another worker holds the lease now.
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_by = 'someone else'")
        .await
        .unwrap();
    let result = common::within("the ack", WAIT, delivery.ack()).await;
    assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
    let stats = running.stats();
    assert_eq!((stats.stale_rejected, stats.unknown_outcomes), (1, 0));
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        1
    );
    running.shutdown().await.unwrap();
}
