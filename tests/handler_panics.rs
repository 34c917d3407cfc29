//! A handler's panic is a failed attempt recorded as `handler panicked: ...`, wherever in
//! the handler it happens.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pgbus::{Bus, Event, HandlerError, RetryPolicy};
use serde_json::json;

#[tokio::test]
async fn a_closure_that_panics_before_returning_its_future_is_a_recorded_panic() {
    // The planned panic prints nothing.
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&"before the future") {
            default(info);
        }
    }));
    let db = common::test_db().await;
    let client = db.connect().await;
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let running = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .retry(RetryPolicy::fixed(Duration::from_millis(10)))
        // Panics in the closure itself, not in the future it returns, on the first run.
        .handler_fn("eager", ["*"], move |_event: Event| {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("before the future");
            }
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("a.b", json!({})))
        .await
        .unwrap();
    common::wait_for("the retry to succeed", Duration::from_secs(20), || async {
        client
            .query_one("SELECT count(*) FROM pgbus.deliveries", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
            && runs.load(Ordering::SeqCst) == 2
    })
    .await;
    let errors: Vec<String> = client
        .query("SELECT error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(errors, ["handler panicked: before the future"]);
    running.shutdown().await.unwrap();
}
