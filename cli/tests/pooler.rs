//! The operator commands through PgBouncer in transaction mode (the test kit's hostile
//! configuration: every server connection is reset after each transaction, and there are
//! several): each succeeds and does what it says, read back on a direct connection.

mod common;
mod proc;

use pgbus::Event;
use pgbus::admin::{self, SubscriptionChange};
use proc::{Output, count, pgbus, run, run_with};
use serde_json::json;
use tokio::process::Command;

/// `pgbus` with DATABASE_URL naming the test's database through the shared PgBouncer.
async fn pgbus_pooled(db: &common::TestDb) -> Command {
    let mut cmd = pgbus();
    cmd.env(
        "DATABASE_URL",
        common::pgbouncer::shared().await.url_for(db.name()),
    );
    cmd
}

/// How many deliveries (`d`) of events (`e`) meet `condition`.
async fn deliveries_where(client: &tokio_postgres::Client, condition: &str) -> i64 {
    count(
        client,
        &format!(
            "SELECT count(*) FROM pgbus.deliveries d JOIN pgbus.events e ON e.seq = d.event_seq \
             WHERE {condition}"
        ),
    )
    .await
}

async fn pooled(db: &common::TestDb, args: &[&str]) -> Output {
    run(pgbus_pooled(db).await, args).await.ok()
}

#[tokio::test]
async fn migrate_publish_and_status_work_through_the_pooler() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "audit", &["order.*"], 25)
        .await
        .unwrap();

    let out = pooled(&db, &["migrate"]).await;
    assert!(out.stdout.starts_with("schema is current"), "{out:?}");

    let out = pooled(
        &db,
        &[
            "publish",
            "order.placed",
            r#"{"order_id": 1}"#,
            "--id",
            "order-1",
            "--aggregate",
            "order:1",
        ],
    )
    .await;
    assert_eq!(out.stdout.trim(), "order-1");
    let out = run_with(
        pgbus_pooled(&db).await,
        &["publish", "order.imported", "-", "--lines"],
        Some("{\"order_id\": 2}\n{\"order_id\": 3}\n"),
    )
    .await
    .ok();
    assert_eq!(out.stdout.lines().count(), 2, "{out:?}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.events WHERE payload ? 'order_id'"
        )
        .await,
        3
    );
    // The deliveries a running bus would make (its next claim).
    assert_eq!(common::fan_out(&client).await, 3);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'audit'"
        )
        .await,
        3
    );

    let status = pooled(&db, &["status", "--json"]).await.json();
    let audit = &status["subscriptions"][0];
    assert_eq!(audit["name"], "audit", "{status}");
    assert_eq!(audit["pending"], 3, "{status}");
    let out = pooled(&db, &["status", "-s", "audit"]).await;
    assert!(out.stdout.contains("audit"), "{out:?}");
}

#[tokio::test]
async fn dead_letters_are_listed_retried_and_purged_through_the_pooler() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "s", &["p.*"], 3)
        .await
        .unwrap();
    proc::two_dead_letters(&client).await;

    let listed = pooled(&db, &["dead", "list", "--json"]).await.json();
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["e1", "e2"]);
    // A page, the count of the rest, and the page after it.
    let out = pooled(&db, &["dead", "list", "--limit", "1", "-s", "s"]).await;
    assert!(
        out.stdout.contains("e1") && !out.stdout.contains("e2"),
        "{out:?}"
    );
    let more = out
        .stdout
        .lines()
        .find(|l| l.starts_with("1 more: "))
        .unwrap_or_else(|| panic!("no 'more' line: {out:?}"));
    let after = more
        .split("--after ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    let out = pooled(&db, &["dead", "list", "--after", after]).await;
    assert!(
        out.stdout.contains("e2") && !out.stdout.contains("e1"),
        "{out:?}"
    );

    let out = pooled(&db, &["dead", "retry", "--event", "e1", "-s", "s"]).await;
    assert_eq!(out.stdout.trim(), "retried 1 dead letter", "{out:?}");
    assert_eq!(
        deliveries_where(
            &client,
            "e.id = 'e1' AND d.status = 'pending' AND d.attempts = 0"
        )
        .await,
        1
    );

    let purged = pooled(&db, &["dead", "purge", "--all", "--yes", "--json"])
        .await
        .json();
    assert_eq!(purged, json!({"purged": 1, "failures": 1}));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'"
        )
        .await,
        0
    );
    // e1's history stays: it was retried, not purged.
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        1
    );
}

#[tokio::test]
async fn blocked_keys_are_listed_redriven_and_skipped_through_the_pooler() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "o", &["order.*"], 1)
        .await
        .unwrap();
    admin::configure_subscription(&client, "o", &SubscriptionChange::new().ordered(true))
        .await
        .unwrap();
    for n in 1..=3 {
        pgbus::publish(
            &client,
            &Event::new("order.step", json!({"n": n}))
                .id(format!("step-{n}"))
                .aggregate("order", "1"),
        )
        .await
        .unwrap();
    }
    common::fan_out(&client).await;
    let kill_head = "UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, \
                     last_error = 'carrier down' WHERE is_head AND status = 'pending'";
    client.batch_execute(kill_head).await.unwrap();

    let keys = pooled(&db, &["keys", "list", "--json"]).await.json();
    assert_eq!(keys[0]["subscription"], "o", "{keys}");
    assert_eq!(keys[0]["key"], "order:1", "{keys}");
    assert_eq!(keys[0]["waiting"], 2, "{keys}");

    pooled(&db, &["keys", "redrive", "o", "order:1"]).await;
    assert_eq!(
        deliveries_where(
            &client,
            "d.is_head AND d.status = 'pending' AND d.attempts = 0 AND e.id = 'step-1'"
        )
        .await,
        1
    );

    client.batch_execute(kill_head).await.unwrap();
    pooled(&db, &["keys", "skip", "o", "order:1"]).await;
    // The dead head is set aside and the next event of the key leads.
    assert_eq!(
        deliveries_where(
            &client,
            "d.is_head AND d.status = 'pending' AND e.id = 'step-2'"
        )
        .await,
        1
    );
    let out = pooled(&db, &["keys", "list"]).await;
    assert_eq!(out.stdout.trim(), "no blocked keys", "{out:?}");
}

#[tokio::test]
async fn replay_subscriptions_and_sweep_work_through_the_pooler() {
    let db = common::test_db().await;
    let client = db.connect().await;
    admin::register_subscription(&client, "r", &["a.*"], 25)
        .await
        .unwrap();
    // Their deliveries, made as the bus's next claim would, then gone: what a replay is for.
    proc::with_deliveries(
        &client,
        "INSERT INTO pgbus.events (id, event_name, created_at) VALUES \
           ('fresh', 'a.one', now()), ('old', 'a.two', now() - interval '3 days');",
        "DELETE FROM pgbus.deliveries",
    )
    .await;

    // `--since 1h` reads the database's clock first: a statement of its own.
    let out = pooled(&db, &["replay", "-s", "r", "--since", "1h", "--json"]).await;
    assert_eq!(out.json()["created"], 1, "{out:?}");
    assert_eq!(deliveries_where(&client, "e.id = 'fresh'").await, 1);

    let out = pooled(&db, &["sweep", "--retention", "1d"]).await;
    assert!(out.stdout.starts_with("swept 1 event"), "{out:?}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.events WHERE id = 'old'"
        )
        .await,
        0
    );
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 1);

    let listed = pooled(&db, &["subscriptions", "list", "--json"])
        .await
        .json();
    assert_eq!(listed[0]["name"], "r", "{listed}");
    pooled(
        &db,
        &[
            "subscriptions",
            "set",
            "r",
            "--max-attempts",
            "7",
            "--ordered",
        ],
    )
    .await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.subscriptions WHERE name = 'r' AND max_attempts = 7 \
             AND ordered"
        )
        .await,
        1
    );
    let out = pooled(&db, &["subscriptions", "drop", "r"]).await;
    assert!(
        out.stdout.starts_with("dropped subscription \"r\""),
        "{out:?}"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
}

/// Publishes `n` events named `order.placed` with ids `<prefix>-<i>` through the pooler.
async fn publish_through_the_pooler(db: &common::TestDb, prefix: &str, n: usize) {
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        pooled(db, &["publish", "order.placed", "{}", "--id", &id]).await;
    }
}

/// The ids of the next `n` deliveries of `consumer`, sorted.
async fn next_ids(consumer: &mut proc::Consumer, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(consumer.next().await["id"].as_str().unwrap().to_string());
    }
    ids.sort();
    ids
}

#[tokio::test]
async fn consume_runs_through_the_pooler_and_listens_on_a_direct_connection() {
    let db = common::test_db().await;
    let pooled_url = common::pgbouncer::shared().await.url_for(db.name());
    let direct_url = db.conninfo();
    let mut consumer = proc::Consumer::start(
        &db,
        &[
            "--database-url",
            &pooled_url,
            "--pooler",
            "--listen-url",
            &direct_url,
            "--poll-interval",
            "1h",
            "-s",
            "audit",
            "-p",
            "order.*",
        ],
    )
    .await;
    // With a poll interval of an hour, only notifications can bring these promptly.
    publish_through_the_pooler(&db, "listened", 3).await;
    assert_eq!(
        next_ids(&mut consumer, 3).await,
        vec!["listened-0", "listened-1", "listened-2"]
    );
    let client = db.connect().await;
    common::wait_count(
        &client,
        "the deliveries to be acknowledged through the pooler",
        common::WORK_LEFT,
        0,
    )
    .await;
    assert!(!consumer.stderr().contains("falls back to polling"));
    assert_eq!(consumer.terminate().await, 0);
}

#[tokio::test]
async fn consume_through_the_pooler_without_a_listen_url_polls_and_says_so() {
    let db = common::test_db().await;
    let pooled_url = common::pgbouncer::shared().await.url_for(db.name());
    let mut consumer = proc::Consumer::start(
        &db,
        &[
            "--database-url",
            &pooled_url,
            "--pooler",
            "--poll-interval",
            "200ms",
            "-s",
            "audit",
            "-p",
            "order.*",
        ],
    )
    .await;
    assert!(
        consumer.stderr().contains("falls back to polling"),
        "{}",
        consumer.stderr()
    );
    publish_through_the_pooler(&db, "polled", 2).await;
    assert_eq!(
        next_ids(&mut consumer, 2).await,
        vec!["polled-0", "polled-1"]
    );
    assert_eq!(consumer.terminate().await, 0);
}
