//! `RunningBus::shutdown` ends within its timeout even when the database blocks every
//! statement the bus has in flight, and cancels those statements rather than leaving them
//! to run (and commit) after it returned; whatever it could not write comes back.

mod common;

use common::count;

use std::sync::Arc;
use std::time::Duration;

use pgbus::{Bus, Error, Event, HandlerError};
use serde_json::json;
use tokio::sync::{Notify, mpsc};

const WAIT: Duration = Duration::from_secs(20);
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
/// The bound the test holds shutdown to: its timeout, and a second or two to cancel what
/// is in flight. The statement timeout (30 s) is far above it.
const BOUND: Duration = Duration::from_secs(5);

/// Waits until some statement of the bus waits for a lock, and the statement text
/// matches `like`.
async fn wait_blocked(client: &tokio_postgres::Client, like: &str) {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbus worker'
         AND wait_event_type = 'Lock' AND query LIKE '{like}'"
    );
    common::wait_for(
        "a statement of the bus to wait for the lock",
        WAIT,
        || async { count(client, &sql).await > 0 },
    )
    .await;
}

/// No statement of the bus is running any more.
async fn wait_none_active(client: &tokio_postgres::Client) {
    common::wait_for("the bus's statements to be cancelled", WAIT, || async {
        count(
            client,
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = 'pgbus worker' AND state = 'active'",
        )
        .await
            == 0
    })
    .await;
}

#[tokio::test]
async fn an_ack_blocked_by_a_lock_does_not_hold_shutdown_past_its_timeout() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (started_tx, mut started) = mpsc::unbounded_channel::<String>();
    let release = Arc::new(Notify::new());
    let r = release.clone();
    let running = Bus::builder(db.config())
        .lease(Duration::from_secs(2))
        .shutdown_timeout(SHUTDOWN_TIMEOUT)
        .handler_fn("blocked", ["job"], move |e| {
            let (tx, r) = (started_tx.clone(), r.clone());
            async move {
                let _ = tx.send(e.id);
                r.notified().await;
                Ok::<(), HandlerError>(())
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let event = Event::new("job", json!({"n": 1}));
    pgbus::publish(&client, &event).await.unwrap();
    let id = common::within("the handler to start", WAIT, started.recv())
        .await
        .unwrap();
    assert_eq!(id, event.id);

    // Another session locks the deliveries: the ack cannot be written.
    let mut locker = db.connect().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE pgbus.deliveries IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    release.notify_one();
    wait_blocked(&client, "%pgbus.settle%").await;

    let result = common::within(
        "shutdown to end within its timeout",
        BOUND,
        running.shutdown(),
    )
    .await;
    assert!(
        matches!(result, Err(Error::Timeout(_))),
        "the ack was given up at the deadline: {result:?}"
    );
    // The blocked statements were cancelled, not left to run once the lock goes.
    wait_none_active(&client).await;
    lock.rollback().await.unwrap();
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'"
        )
        .await,
        1,
        "the ack was not written after shutdown returned"
    );

    // Nothing is lost: once the lease expires, the event is delivered again.
    let (tx, mut again) = mpsc::unbounded_channel::<String>();
    let next = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(200))
        .handler_fn("blocked", ["job"], move |e| {
            let _ = tx.send(e.id);
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let redelivered = common::within("the event to come back", WAIT, again.recv())
        .await
        .unwrap();
    assert_eq!(redelivered, event.id);
    next.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_sweep_and_a_claim_blocked_by_a_lock_are_cancelled_at_shutdown() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // The log is locked before the bus starts: its first sweep (on its first tick) and
    // its claims wait for the lock.
    let mut locker = db.connect().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE pgbus.events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let running = Bus::builder(db.config())
        .shutdown_timeout(SHUTDOWN_TIMEOUT)
        .handler_fn("any", ["*"], |_| async { Ok::<(), HandlerError>(()) })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_blocked(&client, "%pgbus.sweep%").await;
    wait_blocked(&client, "%pgbus.claim(%").await;

    let result = common::within(
        "shutdown to end within its timeout",
        BOUND,
        running.shutdown(),
    )
    .await;
    assert!(result.is_ok(), "nothing was left to settle: {result:?}");
    wait_none_active(&client).await;
    lock.rollback().await.unwrap();
}
