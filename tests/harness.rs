//! Tests of the test harness itself: each test's database is its own, and the waiting
//! helpers fail instead of hanging.

mod common;

use std::time::Duration;

use common::{test_db, wait_for, within};
use futures::StreamExt as _;
use tokio_postgres::{AsyncMessage, NoTls};

const TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn each_test_database_is_its_own() {
    let (a, b) = tokio::join!(test_db(), test_db());
    assert_ne!(a.name(), b.name());
    let (ca, cb) = tokio::join!(a.connect(), b.connect());

    let name: String = ca
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, a.name());

    ca.batch_execute("CREATE TABLE only_in_a (id int); INSERT INTO only_in_a VALUES (1)")
        .await
        .unwrap();
    let seen_in_b: i64 = cb
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'only_in_a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        seen_in_b, 0,
        "a table made in one test database is seen in another"
    );
}

#[tokio::test]
async fn test_databases_are_migrated() {
    let db = test_db().await;
    let client = db.connect().await;
    let applied: i64 = client
        .query_one("SELECT count(*) FROM pgbus.schema_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, pgbus::schema::MIGRATIONS.len() as i64);
    assert!(
        pgbus::migrate(&client).await.unwrap().is_empty(),
        "the template was not fully migrated"
    );
}

#[tokio::test]
async fn url_connects_to_the_same_database() {
    let db = test_db().await;
    let config: tokio_postgres::Config = db.url().parse().unwrap();
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    let name: String = client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, db.name());
}

#[tokio::test]
async fn a_notification_stays_in_its_database() {
    let (a, b) = tokio::join!(test_db(), test_db());
    let mut notifications = Vec::new();
    let mut listeners = Vec::new();
    for db in [&a, &b] {
        let (client, mut connection) = db.config().connect(NoTls).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        tokio::spawn(async move {
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message {
                    let _ = tx.send(n.payload().to_owned());
                }
            }
        });
        client.batch_execute("LISTEN harness").await.unwrap();
        notifications.push(rx);
        listeners.push(client);
    }

    let publisher = b.connect().await;
    publisher
        .batch_execute("NOTIFY harness, 'for b'")
        .await
        .unwrap();
    let got = within("the notification in b", TIMEOUT, notifications[1].recv()).await;
    assert_eq!(got.as_deref(), Some("for b"));

    // Notifications are delivered in commit order: once a's own arrives, b's would have
    // arrived before it, had it crossed over.
    let publisher = a.connect().await;
    publisher
        .batch_execute("NOTIFY harness, 'for a'")
        .await
        .unwrap();
    let got = within("the notification in a", TIMEOUT, notifications[0].recv()).await;
    assert_eq!(
        got.as_deref(),
        Some("for a"),
        "a notification crossed databases"
    );
}

#[tokio::test]
async fn wait_for_returns_once_the_condition_holds() {
    let polls = std::sync::atomic::AtomicU32::new(0);
    wait_for("three polls", TIMEOUT, || async {
        polls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 2
    })
    .await;
    assert_eq!(polls.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[tokio::test]
#[should_panic(expected = "timed out after 50ms waiting for the impossible")]
async fn wait_for_panics_at_its_deadline() {
    wait_for("the impossible", Duration::from_millis(50), || async {
        false
    })
    .await;
}

#[tokio::test]
#[should_panic(expected = "timed out after 50ms waiting for a future that never ends")]
async fn within_panics_at_its_deadline() {
    within(
        "a future that never ends",
        Duration::from_millis(50),
        std::future::pending::<()>(),
    )
    .await;
}

#[tokio::test]
async fn a_private_cluster_survives_a_crash_and_restart() {
    let (cluster, config) = common::private_cluster().await;
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute("CREATE TABLE kept (id int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();

    cluster
        .restart(pgbus_testkit::embedded::ShutdownMode::Immediate)
        .await
        .unwrap();
    assert!(client.is_closed() || client.simple_query("SELECT 1").await.is_err());

    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(connection);
    let id: i32 = client
        .query_one("SELECT id FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(id, 7);

    let dir = cluster.dir().to_path_buf();
    drop(client);
    drop(cluster);
    assert!(
        !dir.exists(),
        "the private cluster's directory was left behind"
    );
}
