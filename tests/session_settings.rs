//! The bus's own transactions run READ COMMITTED, with its `synchronous_commit` and
//! `statement_timeout`, whatever the database's defaults say, and without startup options
//! (which a transaction-mode pooler refuses): on a direct connection, where they are set
//! once per connection, and in pooler mode, where each transaction sets them locally.
//!
//! A statement trigger on `pgbus.deliveries` records the settings in force inside the
//! bus's own claim and settle transactions.

mod common;

use std::time::Duration;

use pgbus::{Bus, ConnectConfig, Event};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

/// Makes the database's defaults the opposite of what the bus needs, and records the
/// settings of every statement that changes `pgbus.deliveries`.
async fn hostile_defaults_and_a_recorder(db: &common::TestDb) {
    let client = db.connect().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.seen (isolation text, sync text, timeout text, app text);
             CREATE FUNCTION public.note() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               INSERT INTO public.seen VALUES (
                 current_setting('transaction_isolation'),
                 current_setting('synchronous_commit'),
                 current_setting('statement_timeout'),
                 current_setting('application_name'));
               RETURN NULL;
             END $$;
             CREATE TRIGGER note AFTER UPDATE OR DELETE ON pgbus.deliveries
               FOR EACH STATEMENT EXECUTE FUNCTION public.note();
             ALTER DATABASE {name} SET default_transaction_isolation = 'serializable';
             ALTER DATABASE {name} SET synchronous_commit = 'on';
             ALTER DATABASE {name} SET statement_timeout = '7min';",
            name = db.name()
        ))
        .await
        .unwrap();
}

/// Runs a bus on `config`, publishes one event and waits for its delivery to be
/// completed; returns the settings the recorder saw.
async fn settings_seen(
    db: &common::TestDb,
    config: ConnectConfig,
) -> Vec<(String, String, String, String)> {
    let mut bus = Bus::builder(config)
        .statement_timeout(Duration::from_secs(12))
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut sub = bus.subscribe("settings", ["s.*"]).unwrap();
    let running = bus.start().await.unwrap();
    let client = db.connect().await;
    pgbus::publish(&client, &Event::new("s.one", json!({})))
        .await
        .unwrap();
    let delivery = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut sub))
        .await
        .expect("the event is delivered")
        .expect("the stream is open");
    delivery.ack().await.unwrap();
    common::wait_count(
        &client,
        "the delivery to be completed",
        common::WORK_LEFT,
        0,
    )
    .await;
    running.shutdown().await.unwrap();
    client
        .query("SELECT isolation, sync, timeout, app FROM public.seen", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

fn assert_bus_settings(seen: &[(String, String, String, String)]) {
    // The claim (an UPDATE) and the completion (a DELETE), at least.
    assert!(seen.len() >= 2, "{seen:?}");
    for (isolation, sync, timeout, app) in seen {
        assert_eq!(isolation, "read committed", "{seen:?}");
        assert_eq!(sync, "off", "{seen:?}");
        assert_eq!(timeout, "12s", "{seen:?}");
        assert_eq!(app, "pgbus worker", "{seen:?}");
    }
}

#[tokio::test]
async fn a_direct_bus_sets_its_settings_without_startup_options() {
    let db = common::test_db().await;
    hostile_defaults_and_a_recorder(&db).await;
    let config = ConnectConfig::from(db.config());
    assert!(config.pg_config().get_options().is_none());
    let seen = settings_seen(&db, config).await;
    assert_bus_settings(&seen);
}

#[tokio::test]
async fn a_pooled_bus_sets_its_settings_in_each_transaction_and_polls() {
    let db = common::test_db().await;
    hostile_defaults_and_a_recorder(&db).await;
    let config = ConnectConfig::from(db.config()).pooler(true);
    let seen = settings_seen(&db, config).await;
    assert_bus_settings(&seen);
    // Nothing leaked into the sessions: an ordinary connection sees the database's
    // defaults.
    let client = db.connect().await;
    let row = client
        .query_one("SELECT current_setting('transaction_isolation') AS i", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>("i"), "serializable");
}

#[tokio::test]
async fn a_pooled_bus_without_a_listen_connection_polls_and_with_one_listens() {
    let db = common::test_db().await;
    let pooled = ConnectConfig::from(db.config()).pooler(true);
    let polling = Bus::builder(pooled.clone())
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let listening = Bus::builder(pooled)
        .listen_config(db.config())
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for(
        "the bus with a listen connection to listen",
        WAIT,
        || async { listening.is_listening() },
    )
    .await;
    assert!(!polling.is_listening());
    polling.shutdown().await.unwrap();
    listening.shutdown().await.unwrap();
}
