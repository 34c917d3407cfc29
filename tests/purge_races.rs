//! `pgbus.purge_dead` against a head that dies while the purge runs, the race the heads
//! model (`models/src/heads.rs`) found in migration 5: the purge locked the keys of the
//! dead heads its first statement saw, but deleted, in a later statement and under no
//! key lock, a head that had died in between; a publisher holding that key's lock had
//! filed its delivery behind the dead head, the purge could not see it and promoted
//! nothing, and the key was left with a pending delivery and no head.

mod common;

use std::time::Duration;

use pgbus::{DeadHeadPolicy, Event, admin};
use serde_json::json;
use tokio_postgres::{Client, NoTls};

const WAIT: Duration = Duration::from_secs(60);

async fn connect(db: &common::TestDb) -> Client {
    let (client, conn) = db.config().connect(NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// Claims a key's head and settles it as a permanent failure through `pgbus.settle`, as
/// a bus does: under `DeadHeadPolicy::Block` it stays the head, dead.
async fn kill_head(client: &Client, key: &str) -> i64 {
    common::fan_out(client).await;
    let seq: i64 = client
        .query_one(
            "UPDATE pgbus.deliveries SET status = 'processing', attempts = attempts + 1,
                    locked_by = 'w', locked_until = now() + interval '1 minute'
             WHERE subscription = 'o' AND ordering_key = $1 AND is_head AND status = 'pending'
             RETURNING event_seq",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    client
        .execute(
            "SELECT * FROM pgbus.settle('{}', '{}', '{}', ARRAY['o'], ARRAY[$1::int8], ARRAY[1],
                ARRAY['boom'], ARRAY[0::int8], ARRAY[true], '{}', '{}', '{}', 'w')",
            &[&seq],
        )
        .await
        .unwrap();
    seq
}

async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

async fn publish(client: &Client, key: &str) {
    pgbus::publish(client, &Event::new("t.e", json!({})).ordering_key(key))
        .await
        .unwrap();
}

/// Key "a"'s head dies after the purge has read the dead heads (it is held up on key
/// "b"'s lock) and before it deletes; a batch files a new event of key "a" behind the
/// dead head and commits after the purge's delete. The key must end with that event as
/// its head. With migration 5's purge it ended with no head. (When publishers wrote the
/// deliveries, the publisher's transaction was the batch.)
#[tokio::test]
async fn a_head_that_dies_during_a_purge_keeps_its_key_whole() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "o", &["*"], 3)
        .await
        .unwrap();
    pgbus::ordering::set_ordering(&client, "o", true, DeadHeadPolicy::Block)
        .await
        .unwrap();
    publish(&client, "b").await;
    kill_head(&client, "b").await;
    publish(&client, "a").await;

    // Key "b"'s lock is held, so the purge stops after its first read, which saw only
    // "b"'s dead head.
    let mut holder = connect(&db).await;
    let holder_pid = backend_pid(&holder).await;
    let hold = holder.transaction().await.unwrap();
    hold.execute("SELECT pgbus.lock_keys(ARRAY['o'], ARRAY['b'])", &[])
        .await
        .unwrap();
    let purger = connect(&db).await;
    let purger_pid = backend_pid(&purger).await;
    let purge = tokio::spawn(async move {
        purger
            .query_one("SELECT purged FROM pgbus.purge_dead('o', NULL)", &[])
            .await
            .map(|row| row.get::<_, i64>(0))
    });
    let blocked_by = |pid: i32| {
        format!(
            "SELECT count(*) FROM unnest(pg_blocking_pids({purger_pid})) AS b(pid) WHERE b.pid = {pid}"
        )
    };
    let blocked_by_holder = blocked_by(holder_pid);
    common::wait_for("the purge to wait for key b's lock", WAIT, || async {
        common::count(&client, &blocked_by_holder).await == 1
    })
    .await;

    // Now key "a"'s head dies, and a batch files a new event of "a" behind it.
    let dead_a = kill_head(&client, "a").await;
    publish(&client, "a").await;
    let mut publisher = connect(&db).await;
    let blocked_by_publisher = blocked_by(backend_pid(&publisher).await);
    let tx = publisher.transaction().await.unwrap();
    tx.execute("SELECT pgbus.fan_out_committed()", &[])
        .await
        .unwrap();
    let follower: i64 = tx
        .query_one(
            "SELECT event_seq FROM pgbus.deliveries
             WHERE subscription = 'o' AND ordering_key = 'a' AND status = 'pending'",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    // The purge goes on: it either finishes or waits for the publisher's key lock.
    hold.commit().await.unwrap();
    common::wait_for("the purge to finish or wait for key a", WAIT, || async {
        purge.is_finished() || common::count(&client, &blocked_by_publisher).await == 1
    })
    .await;
    tx.commit().await.unwrap();
    let purged = common::within("the purge", WAIT, purge)
        .await
        .unwrap()
        .unwrap();
    assert!(purged >= 1, "the purge deleted nothing");

    let heads: Vec<i64> = client
        .query(
            "SELECT event_seq FROM pgbus.deliveries
             WHERE subscription = 'o' AND ordering_key = 'a' AND is_head",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let dead_a_left: i64 = common::count(
        &client,
        &format!("SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'o' AND event_seq = {dead_a}"),
    )
    .await;
    // The purge read the dead heads again after taking key b's lock, saw key a's, and
    // waited for the publisher's lock on it: it purged the dead head and promoted the
    // publisher's event.
    assert_eq!(dead_a_left, 0, "key a's dead head {dead_a} was not purged");
    assert_eq!(
        heads,
        vec![follower],
        "key a must have one head, the event published behind its dead head"
    );
    let orphans = common::count(
        &client,
        "SELECT count(*) FROM (SELECT 1 FROM pgbus.deliveries WHERE ordering_key IS NOT NULL
           GROUP BY subscription, ordering_key
           HAVING NOT bool_or(is_head) AND bool_or(status = 'pending')) AS o",
    )
    .await;
    assert_eq!(orphans, 0, "a key has pending deliveries and no head");
}
