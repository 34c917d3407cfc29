//! `work_one`: one subscription's handler on one delivery, claimed, handled and settled
//! as a running bus would, the rest left as it was.

use std::time::Duration;

use pgbus::{Bus, Context, Event, Handled, Handler, HandlerError, SubscriptionOptions};
use pgbus_testkit::{TestDb, count, work_one, work_one_with};
use serde_json::json;
use tokio_postgres::Config;

/// What the test handlers do with an event: its payload's `do`.
struct Billing {
    /// For `ack_in`: the handler's own connection.
    config: Config,
}

impl Handler for Billing {
    fn name(&self) -> &str {
        "billing"
    }

    fn patterns(&self) -> Vec<String> {
        vec!["order.*".to_string()]
    }

    async fn handle(&self, _event: &Event) -> Result<(), HandlerError> {
        unreachable!("the bus calls handle_with_context")
    }

    async fn handle_with_context(&self, event: &Event, cx: &Context) -> Result<(), HandlerError> {
        match event.payload["do"].as_str().unwrap_or_default() {
            "fail" => Err(HandlerError::retry_after(
                "card declined",
                Duration::from_secs(3600),
            )),
            "give up" => Err(HandlerError::permanent("no such customer")),
            "panic" => panic!("billing blew up"),
            "write" => {
                let mut client = pgbus_testkit::connect(&self.config)
                    .await
                    .map_err(HandlerError::new)?;
                let tx = client.transaction().await.map_err(HandlerError::new)?;
                tx.execute("INSERT INTO invoices VALUES ($1)", &[&event.id])
                    .await
                    .map_err(HandlerError::new)?;
                cx.ack_in(&tx).await.map_err(HandlerError::new)?;
                tx.commit().await.map_err(HandlerError::new)?;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

async fn setup() -> (TestDb, tokio_postgres::Client, Billing) {
    let db = pgbus_testkit::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("CREATE TABLE invoices (event_id text PRIMARY KEY)")
        .await
        .unwrap();
    let billing = Billing {
        config: db.config(),
    };
    (db, client, billing)
}

async fn publish(client: &tokio_postgres::Client, id: &str, what: &str) {
    pgbus::publish(
        client,
        &Event::new("order.placed", json!({ "do": what })).id(id),
    )
    .await
    .unwrap();
}

/// The subscription's deliveries: event id, status, attempts, last error.
async fn deliveries(client: &tokio_postgres::Client) -> Vec<(String, String, i32, Option<String>)> {
    client
        .query(
            "SELECT e.id, d.status, d.attempts, d.last_error FROM pgbus.deliveries d \
             JOIN pgbus.events e ON e.seq = d.event_seq \
             WHERE d.subscription = 'billing' ORDER BY e.seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// `work_one`, waiting 300 ms for a due delivery.
async fn work_briefly(db: &TestDb, billing: &Billing) -> Option<pgbus_testkit::Worked> {
    work_one_with(
        Bus::builder(db.config()),
        SubscriptionOptions::default(),
        billing,
        Duration::from_millis(300),
    )
    .await
    .unwrap()
}

/// The subscription exists before anything is published, as a deployed consumer's would.
async fn join(db: &TestDb) {
    let mut bus = Bus::builder(db.config()).build().unwrap();
    bus.subscribe("billing", ["order.*"]).unwrap();
    bus.start().await.unwrap().shutdown().await.unwrap();
}

#[tokio::test]
async fn it_acknowledges_the_oldest_delivery_and_leaves_the_next_untouched() {
    let (db, client, billing) = setup().await;
    join(&db).await;
    publish(&client, "o-1", "ok").await;
    publish(&client, "o-2", "ok").await;
    let worked = work_one(db.config(), &billing).await.unwrap().unwrap();
    assert_eq!(worked.event.id, "o-1");
    assert_eq!(worked.attempt, 1);
    assert_eq!(worked.handled, Handled::Acked);
    assert_eq!(
        deliveries(&client).await,
        [("o-2".to_string(), "pending".to_string(), 0, None)],
        "the first is done; the second was never attempted"
    );
    let worked = work_one(db.config(), &billing).await.unwrap().unwrap();
    assert_eq!(worked.event.id, "o-2");
    assert!(deliveries(&client).await.is_empty());
}

#[tokio::test]
async fn a_failure_is_recorded_and_retried_after_its_delay() {
    let (db, client, billing) = setup().await;
    join(&db).await;
    publish(&client, "o-1", "fail").await;
    let worked = work_one(db.config(), &billing).await.unwrap().unwrap();
    match &worked.handled {
        Handled::Failed {
            error,
            delay,
            permanent,
        } => {
            assert_eq!(error, "card declined");
            assert_eq!(*delay, Duration::from_secs(3600));
            assert!(!permanent);
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert_eq!(
        deliveries(&client).await,
        [(
            "o-1".to_string(),
            "pending".to_string(),
            1,
            Some("card declined".to_string())
        )]
    );
    // Not due for an hour: nothing to work on now.
    let now = work_briefly(&db, &billing).await;
    assert!(now.is_none(), "{now:?}");
}

#[tokio::test]
async fn a_permanent_error_or_a_panic_is_a_failed_run() {
    let (db, client, billing) = setup().await;
    join(&db).await;
    publish(&client, "o-1", "give up").await;
    publish(&client, "o-2", "panic").await;
    let first = work_one(db.config(), &billing).await.unwrap().unwrap();
    assert!(
        matches!(&first.handled, Handled::Failed { permanent: true, error, .. } if error == "no such customer"),
        "{first:?}"
    );
    let second = work_one(db.config(), &billing).await.unwrap().unwrap();
    assert!(
        matches!(&second.handled, Handled::Failed { permanent: false, error, .. }
            if error == "handler panicked: billing blew up"),
        "{second:?}"
    );
    let rows = deliveries(&client).await;
    assert_eq!(rows[0].1, "dead", "{rows:?}");
    assert_eq!((rows[1].1.as_str(), rows[1].2), ("pending", 1), "{rows:?}");
}

#[tokio::test]
async fn a_handler_that_completes_in_its_own_transaction_commits_with_it() {
    let (db, client, billing) = setup().await;
    join(&db).await;
    publish(&client, "o-1", "write").await;
    let worked = work_one(db.config(), &billing).await.unwrap().unwrap();
    assert_eq!(worked.handled, Handled::AckedIn);
    assert_eq!(count(&client, "SELECT count(*) FROM invoices").await, 1);
    assert!(deliveries(&client).await.is_empty());
}

#[tokio::test]
async fn nothing_due_is_none_and_changes_nothing() {
    let (db, client, billing) = setup().await;
    // The subscription is joined by `work_one` itself.
    let none = work_briefly(&db, &billing).await;
    assert!(none.is_none());
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.subscriptions WHERE name = 'billing'"
        )
        .await,
        1
    );
    assert!(deliveries(&client).await.is_empty());
}
