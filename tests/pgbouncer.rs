//! The bus through PgBouncer in transaction mode, configured by the test kit to be
//! hostile: several server connections, every one reset (`DISCARD ALL`) after each
//! transaction, startup `options` refused. A bus in pooler mode connects (no startup
//! options), claims, retries, settles, keeps key order and completes in the caller's
//! transaction through it, LISTENing on a direct connection.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, ConnectConfig, Event, HandlerError, SubscriptionOptions};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

async fn pooled(db: &common::TestDb) -> ConnectConfig {
    let bouncer = common::pgbouncer::shared().await;
    ConnectConfig::from(bouncer.config_for(db.name())).pooler(true)
}

#[tokio::test]
async fn handlers_retry_settle_and_keep_key_order_through_the_pooler() {
    let db = common::test_db().await;
    let seen: Arc<Mutex<HashMap<String, Vec<i64>>>> = Arc::default();
    let failed_once: Arc<Mutex<Vec<i64>>> = Arc::default();
    let (s, f) = (seen.clone(), failed_once.clone());
    let running = Bus::builder(pooled(&db).await)
        .listen_config(db.config())
        // The default poll interval: one CI run with an hour's stalled here (see
        // docs/ARCHITECTURE.md, "Connections"); `cli/tests/pooler.rs` proves delivery by
        // notification through the direct connection with an hour's poll interval.
        .poll_interval(Duration::from_secs(1))
        .retry(pgbus::RetryPolicy::exponential(Duration::from_millis(10)))
        .handler_fn_with(
            "ordered",
            ["order.*"],
            SubscriptionOptions::new().ordered(true),
            move |event: Event| {
                let (seen, failed_once) = (s.clone(), f.clone());
                async move {
                    let n = event.payload["n"].as_i64().unwrap();
                    // Every fifth event fails its first attempt: the key must wait.
                    if n % 5 == 0 {
                        let mut failed = failed_once.lock().unwrap();
                        if !failed.contains(&n) {
                            failed.push(n);
                            return Err(HandlerError::new("first attempt fails"));
                        }
                    }
                    let key = event.aggregate_id.clone().unwrap_or_default();
                    seen.lock().unwrap().entry(key).or_default().push(n);
                    Ok(())
                }
            },
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for(
        "the bus to listen on its direct connection",
        WAIT,
        || async { running.is_listening() },
    )
    .await;
    let client = db.connect().await;
    for n in 0..60_i64 {
        let key = (n % 4).to_string();
        pgbus::publish(
            &client,
            &Event::new("order.changed", json!({"n": n})).aggregate("order", key),
        )
        .await
        .unwrap();
    }
    let left = "SELECT count(*) FROM pgbus.deliveries";
    let done = tokio::time::timeout(WAIT, async {
        while common::count(&client, left).await > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    if done.is_err() {
        // What is left, for the failure's message: which keys wait, and on what.
        let rows = client
            .query(
                "SELECT event_seq, ordering_key, status, is_head, attempts, \
                        (available_at - now())::text AS due_in, (locked_until - now())::text AS lease_left, \
                        locked_by FROM pgbus.deliveries ORDER BY ordering_key, key_pos",
                &[],
            )
            .await
            .unwrap();
        let state: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "seq {} key {:?} {} head {} attempts {} due_in {:?} lease_left {:?} by {:?}",
                    r.get::<_, i64>(0),
                    r.get::<_, Option<String>>(1),
                    r.get::<_, String>(2),
                    r.get::<_, bool>(3),
                    r.get::<_, i32>(4),
                    r.get::<_, Option<String>>(5),
                    r.get::<_, Option<String>>(6),
                    r.get::<_, Option<String>>(7),
                )
            })
            .collect();
        panic!(
            "deliveries not completed within {WAIT:?} through the pooler; stats {:?}; left:\n{}",
            running.stats(),
            state.join("\n")
        );
    }
    let seen = seen.lock().unwrap().clone();
    for (key, ns) in &seen {
        let mut sorted = ns.clone();
        sorted.sort();
        assert_eq!(ns, &sorted, "key {key} out of order");
        assert_eq!(ns.len(), 15, "key {key}");
    }
    assert_eq!(seen.len(), 4);
    assert_eq!(failed_once.lock().unwrap().len(), 12);
    let failures = common::count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await;
    assert_eq!(failures, 12);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_acks_and_acks_in_the_callers_transaction_through_the_pooler() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("CREATE TABLE public.projection (id text PRIMARY KEY)")
        .await
        .unwrap();
    let mut bus = Bus::builder(pooled(&db).await)
        .listen_config(db.config())
        .build()
        .unwrap();
    let mut sub = bus.subscribe("stream", ["item.*"]).unwrap();
    let running = bus.start().await.unwrap();
    for id in ["a", "b"] {
        pgbus::publish(&client, &Event::new("item.added", json!({})).id(id))
            .await
            .unwrap();
    }
    // The application's own connection goes through the pooler too.
    let bouncer = common::pgbouncer::shared().await;
    let (mut app, connection) = bouncer
        .config_for(db.name())
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    for _ in 0..2 {
        let delivery = common::within("a delivery", WAIT, sub.next())
            .await
            .unwrap();
        let id = delivery.event().id.clone();
        if id == "a" {
            delivery.ack().await.unwrap();
        } else {
            let tx = app.transaction().await.unwrap();
            tx.execute("INSERT INTO public.projection VALUES ($1)", &[&id])
                .await
                .unwrap();
            delivery.ack_in(&tx).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
    common::wait_count(
        &client,
        "both deliveries to be completed",
        common::WORK_LEFT,
        0,
    )
    .await;
    assert_eq!(
        common::count(&client, "SELECT count(*) FROM public.projection").await,
        1
    );
    running.shutdown().await.unwrap();
}
