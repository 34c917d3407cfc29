//! The retention sweep run by the bus, and its one-at-a-time lock.

mod common;

use std::time::Duration;

use pgbus::Bus;

const WAIT: Duration = Duration::from_secs(20);

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn the_bus_sweeps_events_past_its_retention() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, created_at) VALUES \
               ('old', 'a.b', now() - interval '2 days'), ('new', 'a.b', now())",
        )
        .await
        .unwrap();
    let running = Bus::builder(db.config())
        .handler_fn("h", ["x.*"], |_| async { Ok(()) })
        .retention(Some(Duration::from_secs(86_400)))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for("the old event to be swept", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.events WHERE id = 'old'",
        )
        .await
            == 0
    })
    .await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.events WHERE id = 'new'"
        )
        .await,
        1
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_bus_without_retention_never_sweeps() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, created_at) \
             VALUES ('old', 'a.b', now() - interval '30 days')",
        )
        .await
        .unwrap();
    let running = Bus::builder(db.config())
        .handler_fn("h", ["x.*"], |_| async { Ok(()) })
        .retention(None)
        .poll_interval(Duration::from_millis(50))
        .idle_poll_interval(Duration::from_millis(50))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    // The bus leads and ran its first duties (a reap, then the sweep would be next),
    // and several poll ticks pass.
    common::wait_for("the leader's first reap", WAIT, || async {
        running.stats().reaps >= 1
    })
    .await;
    let claims = running.stats().claims;
    common::wait_for("a few poll ticks", WAIT, || async {
        running.stats().claims >= claims + 3
    })
    .await;
    running.shutdown().await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 1);
}

#[tokio::test]
async fn only_one_sweep_runs_at_a_time() {
    let db = common::test_db().await;
    let mut holder = db.connect().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, created_at) \
             SELECT 'a.b', now() - interval '30 days' FROM generate_series(1, 5)",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    // Another sweep is in its transaction: this one deletes nothing and says so.
    let tx = holder.transaction().await.unwrap();
    let held = pgbus::admin::sweep_batch(&tx, Duration::from_secs(60), 2)
        .await
        .unwrap();
    assert_eq!((held.events, held.busy), (2, false));
    let busy = pgbus::admin::sweep(&client, Duration::from_secs(60), 2)
        .await
        .unwrap();
    assert!(busy.busy);
    assert_eq!(busy.events, 0);
    tx.commit().await.unwrap();
    let rest = pgbus::admin::sweep(&client, Duration::from_secs(60), 2)
        .await
        .unwrap();
    assert_eq!((rest.events, rest.batches, rest.busy), (3, 2, false));
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 0);
}

/// The sweep asks each subscription that has deliveries whether one still refers to an
/// event (there is no index on the event alone): one refused delivery of any
/// subscription keeps it, also of a subscription whose row is gone (no foreign keys),
/// pending, processing or dead alike; an event with none left is swept.
#[tokio::test]
async fn the_sweep_keeps_every_event_a_delivery_still_refers_to() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for sub in ["a", "b", "c"] {
        pgbus::admin::register_subscription(&client, sub, &["x.*"], 25)
            .await
            .unwrap();
    }
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, created_at) \
             SELECT id, 'x.y', now() - interval '2 days' \
             FROM unnest('{done,pending,processing,dead,orphan}'::text[]) AS id; \
             INSERT INTO pgbus.events (id, event_name) VALUES ('young', 'x.y');",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute(
            "-- Every event has a delivery for a, b and c; leave one of each kind.
             DELETE FROM pgbus.deliveries AS d USING pgbus.events AS e
             WHERE e.seq = d.event_seq
               AND (e.id = 'done' OR (e.id <> 'young' AND d.subscription <> 'b'));
             UPDATE pgbus.deliveries AS d SET status = 'processing', locked_by = 'w', \
                    locked_until = now() + interval '1 hour' \
             FROM pgbus.events AS e WHERE e.seq = d.event_seq AND e.id = 'processing'; \
             UPDATE pgbus.deliveries AS d SET status = 'dead' \
             FROM pgbus.events AS e WHERE e.seq = d.event_seq AND e.id = 'dead'; \
             -- b's row goes, its deliveries stay (as a drop racing a publish can leave them),
             -- except for 'orphan', whose only delivery becomes one of a subscription
             -- that never had a row.
             UPDATE pgbus.deliveries AS d SET subscription = 'gone' \
             FROM pgbus.events AS e WHERE e.seq = d.event_seq AND e.id = 'orphan'; \
             DELETE FROM pgbus.subscriptions WHERE name = 'b';",
        )
        .await
        .unwrap();
    let swept = pgbus::admin::sweep_batch(&client, Duration::from_secs(86_400), 100)
        .await
        .unwrap();
    assert_eq!(swept.events, 1, "{swept:?}");
    let left: Vec<String> = client
        .query("SELECT id FROM pgbus.events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["dead", "orphan", "pending", "processing", "young"]);
}

/// A sweep before any claim has cut a batch (a bus sweeps on its first maintenance
/// tick, which may come before its first claim) removes what committed before it and no
/// delivery needs, and keeps what a subscription still needs: it cuts a batch first
/// (`sql/0021_append_only_boundary.sql`). Before, such events were not yet passed and
/// stayed until the next sweep, an hour later, and the bus test above failed now and
/// then.
#[tokio::test]
async fn a_sweep_before_any_claim_removes_what_committed_before_it() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('s', '{needed.*}'); \
             INSERT INTO pgbus.events (id, event_name, created_at) VALUES \
               ('unneeded', 'a.b', now() - interval '2 days'), \
               ('needed', 'needed.x', now() - interval '2 days')",
        )
        .await
        .unwrap();
    let swept = pgbus::admin::sweep_batch(&client, Duration::from_secs(86_400), 100)
        .await
        .unwrap();
    assert_eq!(swept.events, 1, "{swept:?}");
    let left: Vec<String> = client
        .query("SELECT id FROM pgbus.events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["needed"]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 's'"
        )
        .await,
        1,
        "the batch the sweep cut made the needed event's delivery"
    );
}
