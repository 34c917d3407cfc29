//! A connection that flaps (a connection limit reached and freed over and over, backends
//! terminated) must not flood the log: each task warns at most once a minute, however
//! many times the connection comes and goes, and every event is still delivered.

mod common;
#[path = "shared/logs.rs"]
mod logs;

use std::time::Duration;

use pgbus::{Bus, Event};
use serde_json::json;
use tokio::sync::mpsc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_connection_warns_once_not_once_per_flap() {
    let logs = logs::LogBuffer::install("pgbus=info");
    let db = common::test_db().await;
    let client = db.connect().await;
    // ALTER DATABASE ... ALLOW_CONNECTIONS runs from another database.
    let mut other = db.config();
    other.dbname("postgres");
    let (cluster, connection) = other.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let (tx, mut handled) = mpsc::unbounded_channel();
    let running = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .handler_fn("h", ["*"], move |e: Event| {
            let _ = tx.send(e.id.clone());
            async { Ok(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let flaps = 8;
    for i in 0..flaps {
        let errors = running.stats().claim_errors;
        // The database refuses new connections and the bus's are closed: its claims
        // fail until connections are allowed again (this test's own stays open).
        cluster
            .batch_execute(&format!(
                "ALTER DATABASE {db} ALLOW_CONNECTIONS false;
                 SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = '{db}' AND application_name IN ('pgbus worker', 'pgbus listener')",
                db = db.name()
            ))
            .await
            .unwrap();
        common::wait_for("a claim to fail", Duration::from_secs(30), || async {
            running.wake();
            running.stats().claim_errors > errors
        })
        .await;
        cluster
            .batch_execute(&format!(
                "ALTER DATABASE {} ALLOW_CONNECTIONS true",
                db.name()
            ))
            .await
            .unwrap();
        let id = format!("flap-{i}");
        pgbus::publish(&client, &Event::new("x", json!({})).id(id.clone()))
            .await
            .unwrap();
        loop {
            let got = common::within(
                "the event after a flap",
                Duration::from_secs(30),
                handled.recv(),
            )
            .await
            .unwrap();
            if got == id {
                break;
            }
        }
    }
    running.shutdown().await.unwrap();
    let claim_warnings = logs.count("pgbus claim failed; retrying");
    let listener_warnings = logs.count("pgbus listener lost its connection; reconnecting");
    println!(
        "{flaps} flaps: {claim_warnings} claim warnings, {listener_warnings} listener warnings"
    );
    assert_eq!(claim_warnings, 1, "claim warnings");
    assert!(
        listener_warnings <= 1,
        "listener warnings: {listener_warnings}"
    );
    assert_eq!(logs.count("pgbus claims succeed again"), 1);
}
