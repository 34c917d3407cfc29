//! The delivery engine against a real PostgreSQL: push delivery, per-subscription
//! independence, retries, leases, fencing, backpressure and shutdown.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Error, Event, HandlerError, RetryPolicy, RunningBus, SubscriptionOptions};
use serde_json::json;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(20);

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn wait_listening(bus: &RunningBus) {
    common::wait_for("the listener to connect", WAIT, || async {
        bus.is_listening()
    })
    .await;
}

async fn wait_empty(client: &tokio_postgres::Client) {
    common::wait_for("every event to be delivered and settled", WAIT, || async {
        count(client, common::WORK_LEFT).await == 0
    })
    .await;
}

/// A handler that sends every event it receives to a channel.
fn recorder() -> (
    impl Fn(Event) -> futures::future::Ready<Result<(), HandlerError>> + Send + Sync + 'static,
    mpsc::UnboundedReceiver<Event>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let f = move |e: Event| {
        let _ = tx.send(e);
        futures::future::ready(Ok(()))
    };
    (f, rx)
}

#[tokio::test]
async fn handler_and_stream_receive_committed_events_and_never_rolled_back_ones() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    let (record, mut seen) = recorder();
    let mut bus = Bus::builder(db.config())
        .handler_fn("projection", ["order.*"], record)
        .poll_interval(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("stream", ["order.*"]).unwrap();
    let running = bus.start().await.unwrap();
    wait_listening(&running).await;

    let tx = client.transaction().await.unwrap();
    pgbus::publish(
        &tx,
        &Event::new("order.cancelled", json!({})).id("rolled-back"),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let tx = client.transaction().await.unwrap();
    pgbus::publish(
        &tx,
        &Event::new("order.placed", json!({"n": 1})).id("committed"),
    )
    .await
    .unwrap();
    // Not before the commit: while it is open, a probe committed from another
    // connection reaches both subscriptions, and it comes first. The open transaction's
    // event is older (an earlier `available_at` and `seq`), so a claim that saw it would
    // have taken it before the probe.
    let other = db.connect().await;
    pgbus::publish(&other, &Event::new("order.probe", json!({})).id("probe"))
        .await
        .unwrap();
    let event = common::within("the probe", WAIT, seen.recv())
        .await
        .unwrap();
    assert_eq!(event.id, "probe", "the handler ran an uncommitted event");
    let delivery = common::within("the stream's probe", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(
        delivery.event().id,
        "probe",
        "the stream yielded an uncommitted event"
    );
    delivery.ack().await.unwrap();
    wait_empty(&other).await;
    assert!(
        seen.try_recv().is_err(),
        "the handler ran an uncommitted event"
    );
    tx.commit().await.unwrap();

    let event = common::within("the handler", WAIT, seen.recv())
        .await
        .unwrap();
    assert_eq!(event.id, "committed");
    assert_eq!(event.payload, json!({"n": 1}));
    assert!(event.seq.is_some() && event.created_at.is_some());
    let delivery = common::within("the stream", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(delivery.event().id, "committed");
    assert_eq!(delivery.subscription(), "stream");
    assert_eq!(delivery.attempt(), 1);
    delivery.ack().await.unwrap();

    // A later event arrives; the rolled-back one never does.
    pgbus::publish(&client, &Event::new("order.marker", json!({})).id("marker"))
        .await
        .unwrap();
    let event = common::within("the marker", WAIT, seen.recv())
        .await
        .unwrap();
    assert_eq!(event.id, "marker");
    let delivery = common::within("the stream marker", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(delivery.event().id, "marker");
    delivery.ack().await.unwrap();
    wait_empty(&client).await;
    let stats = running.stats();
    assert_eq!(stats.delivered, 6);
    assert_eq!(stats.wakeups_by_poll, 0, "{stats:?}");
    running.shutdown().await.unwrap();
    assert!(
        common::within("the stream to end", WAIT, stream.next())
            .await
            .is_none()
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.consumers").await,
        0
    );
}

#[tokio::test]
async fn each_subscription_succeeds_fails_and_dies_on_its_own() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let flaky_runs = Arc::new(AtomicI32::new(0));
    let steady_runs = Arc::new(AtomicI32::new(0));
    let other_runs = Arc::new(AtomicI32::new(0));
    let (f, s, o) = (flaky_runs.clone(), steady_runs.clone(), other_runs.clone());
    let running = Bus::builder(db.config())
        .retry(RetryPolicy::fixed(Duration::from_millis(20)))
        .handler_fn("flaky", ["order.placed"], move |_| {
            let n = f.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n <= 2 {
                    Err(HandlerError::new(format!("failure {n}")))
                } else {
                    Ok(())
                }
            }
        })
        .handler_fn("steady", ["order.*"], move |_| {
            s.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .handler_fn("other", ["*"], move |_| {
            o.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .handler_fn("doomed", ["order.placed"], |_| async {
            Err(HandlerError::permanent("cannot ever work"))
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();

    pgbus::publish(&client, &Event::new("order.placed", json!({})))
        .await
        .unwrap();
    common::wait_for("the flaky handler to succeed", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'dead'",
        )
        .await
            == 0
            && flaky_runs.load(Ordering::SeqCst) == 3
    })
    .await;
    assert_eq!(steady_runs.load(Ordering::SeqCst), 1);
    assert_eq!(other_runs.load(Ordering::SeqCst), 1);
    let failures: Vec<(String, i32, String)> = client
        .query(
            "SELECT subscription, attempt, error FROM pgbus.delivery_failures ORDER BY subscription, attempt",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        failures,
        vec![
            ("doomed".to_string(), 1, "cannot ever work".to_string()),
            ("flaky".to_string(), 1, "failure 1".to_string()),
            ("flaky".to_string(), 2, "failure 2".to_string()),
        ]
    );
    // The dead letter blocks nobody: later events flow to every subscription.
    pgbus::publish(&client, &Event::new("order.placed", json!({})))
        .await
        .unwrap();
    common::wait_for("the second event", WAIT, || async {
        steady_runs.load(Ordering::SeqCst) == 2 && other_runs.load(Ordering::SeqCst) == 2
    })
    .await;
    common::wait_for("two dead letters", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'doomed' AND status = 'dead'",
        )
        .await
            == 2
    })
    .await;
    // The counter moves when the bus reads the settlement's answer, just after the row
    // became dead in its commit: wait for it too.
    common::wait_for("two dead letters counted", WAIT, || async {
        running.stats().dead_lettered == 2
    })
    .await;
    assert_eq!(running.stats().dead_lettered, 2);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn two_buses_never_claim_each_others_subscriptions() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let (record, mut seen) = recorder();
    let first = Bus::builder(db.config())
        .handler_fn("first", ["*"], record)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let second = Bus::builder(db.config())
        .handler_fn("second", ["*"], move |_| {
            let g = g.clone();
            async move {
                // Holds its deliveries until the test opens the gate.
                let _p = g.acquire().await.unwrap();
                Ok(())
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let events: Vec<Event> = (0..50).map(|i| Event::new("x", json!(i))).collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    for _ in 0..50 {
        common::within("the first bus", WAIT, seen.recv())
            .await
            .unwrap();
    }
    common::wait_for("the second bus to claim", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'second' AND status = 'processing'",
        )
        .await
            > 0
    })
    .await;
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE subscription = 'second' AND locked_by = $1), \
                    count(*) FILTER (WHERE subscription = 'first') \
             FROM pgbus.deliveries",
            &[&first.worker_id()],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>(0),
        0,
        "the first bus claimed the second's work"
    );
    gate.add_permits(1000);
    wait_empty(&client).await;
    assert_eq!(first.stats().delivered, 50);
    assert_eq!(second.stats().delivered, 50);
    first.shutdown().await.unwrap();
    second.shutdown().await.unwrap();
}

#[tokio::test]
async fn events_committed_while_the_listener_reconnects_are_caught_up_without_polling() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (record, mut seen) = recorder();
    let running = Bus::builder(db.config())
        .handler_fn("h", ["*"], record)
        .poll_interval(Duration::from_secs(30))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_listening(&running).await;
    pgbus::publish(&client, &Event::new("before", json!({})))
        .await
        .unwrap();
    assert_eq!(
        common::within("the first event", WAIT, seen.recv())
            .await
            .unwrap()
            .name,
        "before"
    );

    // Keep the listener out while an event commits: its notification reaches no one.
    let db_name = db.name().to_string();
    let mut maintenance = db.config();
    maintenance.dbname("postgres");
    let (admin, connection) = maintenance.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{db_name}\" WITH ALLOW_CONNECTIONS false"
        ))
        .await
        .unwrap();
    client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'pgbus listener' AND datname = current_database()",
        )
        .await
        .unwrap();
    common::wait_for("the listener to notice", WAIT, || async {
        !running.is_listening()
    })
    .await;
    pgbus::publish(&client, &Event::new("during", json!({})))
        .await
        .unwrap();
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{db_name}\" WITH ALLOW_CONNECTIONS true"
        ))
        .await
        .unwrap();

    // Delivered by the catch-up after the reconnect, long before the 30 s poll.
    let event = common::within("the catch-up", Duration::from_secs(15), seen.recv())
        .await
        .unwrap();
    assert_eq!(event.name, "during");
    let stats = running.stats();
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(stats.wakeups_by_poll, 0, "{stats:?}");
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stale_workers_settlement_changes_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("s", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish_batch(
        &client,
        &[
            Event::new("a", json!({})).id("a"),
            Event::new("b", json!({})).id("b"),
        ],
    )
    .await
    .unwrap();
    let first = common::within("attempt 1", WAIT, stream.next())
        .await
        .unwrap();
    let second = common::within("attempt 1", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(first.attempt(), 1);

    // Both leases run out; the reaper returns them and they are claimed again.
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second'")
        .await
        .unwrap();
    let again_1 = common::within("attempt 2", WAIT, stream.next())
        .await
        .unwrap();
    let again_2 = common::within("attempt 2", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!((again_1.attempt(), again_2.attempt()), (2, 2));

    // The stale holders of attempt 1 can neither complete nor fail them.
    assert!(matches!(first.ack().await, Err(Error::LeaseLost)));
    assert!(matches!(
        second.fail(HandlerError::new("late")).await,
        Err(Error::LeaseLost)
    ));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing' AND attempts = 2"
        )
        .await,
        2
    );
    assert_eq!(running.stats().stale_rejected, 2);
    let history = count(
        &client,
        "SELECT count(*) FROM pgbus.delivery_failures WHERE error LIKE 'lease expired%'",
    )
    .await;
    assert_eq!(history, 2);
    again_1.ack().await.unwrap();
    again_2.ack().await.unwrap();
    wait_empty(&client).await;
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_poison_event_that_panics_every_time_is_dead_after_max_attempts() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let (record, mut seen) = recorder();
    let running = Bus::builder(db.config())
        .handler_fn_with(
            "poisoned",
            ["poison"],
            SubscriptionOptions::new()
                .retry(RetryPolicy::fixed(Duration::from_millis(10)).max_attempts(3)),
            |_| async { panic!("boom") },
        )
        .handler_fn("healthy", ["*"], record)
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("poison", json!({})))
        .await
        .unwrap();
    common::wait_for("the dead letter", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' AND attempts = 3",
        )
        .await
            == 1
    })
    .await;
    let errors: Vec<String> = client
        .query(
            "SELECT error FROM pgbus.delivery_failures WHERE subscription = 'poisoned' ORDER BY attempt",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(errors, vec!["handler panicked: boom"; 3]);
    // The bus survived its handler's panics.
    assert_eq!(
        common::within("the healthy handler", WAIT, seen.recv())
            .await
            .unwrap()
            .name,
        "poison"
    );
    pgbus::publish(&client, &Event::new("later", json!({})))
        .await
        .unwrap();
    assert_eq!(
        common::within("a later event", WAIT, seen.recv())
            .await
            .unwrap()
            .name,
        "later"
    );
    assert_eq!(running.stats().dead_lettered, 1);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_expired_lease_at_max_attempts_is_dead_lettered_by_the_reaper() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .retry(RetryPolicy::default().max_attempts(1))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("s", ["*"]).unwrap();
    let running = bus.start().await.unwrap();
    pgbus::publish(&client, &Event::new("crashy", json!({})))
        .await
        .unwrap();
    // Claimed, and then its worker "crashes" (the lease runs out).
    let held = common::within("the claim", WAIT, stream.next())
        .await
        .unwrap();
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second'")
        .await
        .unwrap();
    common::wait_for("the reaper", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        )
        .await
            == 1
    })
    .await;
    assert!(matches!(
        held.fail(HandlerError::new("late")).await,
        Err(Error::LeaseLost)
    ));
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn retry_after_and_permanent_errors_and_the_next_due_timer() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let attempts: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>> = Default::default();
    let a = attempts.clone();
    let permanent_runs = Arc::new(AtomicI32::new(0));
    let p = permanent_runs.clone();
    let running = Bus::builder(db.config())
        .poll_interval(Duration::from_secs(30))
        .handler_fn("later", ["retry"], move |_| {
            let mut v = a.lock().unwrap();
            v.push(tokio::time::Instant::now());
            let first = v.len() == 1;
            async move {
                if first {
                    Err(HandlerError::retry_after(
                        "not yet",
                        Duration::from_millis(300),
                    ))
                } else {
                    Ok(())
                }
            }
        })
        .handler_fn("never", ["permanent"], move |_| {
            p.fetch_add(1, Ordering::SeqCst);
            async { Err(HandlerError::permanent("bad payload")) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_listening(&running).await;
    pgbus::publish_batch(
        &client,
        &[
            Event::new("retry", json!({})),
            Event::new("permanent", json!({})),
        ],
    )
    .await
    .unwrap();
    common::wait_for("the retry", Duration::from_secs(10), || async {
        attempts.lock().unwrap().len() == 2
    })
    .await;
    let v = attempts.lock().unwrap().clone();
    let gap = v[1] - v[0];
    assert!(gap >= Duration::from_millis(250), "retried after {gap:?}");
    assert!(
        gap < Duration::from_secs(5),
        "retried after {gap:?}: waited for the poll?"
    );
    common::wait_for("the dead letter", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'never' AND status = 'dead' AND attempts = 1",
        )
        .await
            == 1
    })
    .await;
    assert_eq!(permanent_runs.load(Ordering::SeqCst), 1);
    wait_for_only_dead(&client).await;
    assert_eq!(running.stats().wakeups_by_poll, 0);
    running.shutdown().await.unwrap();
}

async fn wait_for_only_dead(client: &tokio_postgres::Client) {
    common::wait_for("only dead letters left", WAIT, || async {
        count(
            client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'dead'",
        )
        .await
            == 0
    })
    .await;
}

#[tokio::test]
async fn shutdown_with_handlers_in_flight_loses_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let started = Arc::new(AtomicUsize::new(0));
    let done: Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let (s, d) = (started.clone(), done.clone());
    let running = Bus::builder(db.config())
        .concurrency(4)
        .handler_fn("slow", ["*"], move |e| {
            s.fetch_add(1, Ordering::SeqCst);
            let d = d.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                d.lock().unwrap().push(e.id);
                Ok(())
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let events: Vec<Event> = (0..40).map(|i| Event::new("job", json!(i))).collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    common::wait_for("handlers to start", WAIT, || async {
        started.load(Ordering::SeqCst) >= 4
    })
    .await;
    common::within("shutdown", WAIT, running.shutdown())
        .await
        .unwrap();

    // Nothing is left claimed; what was claimed but not started got its attempt back.
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'pending'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE attempts <> 0"
        )
        .await,
        0
    );
    let finished = done.lock().unwrap().len();
    assert!(
        finished >= 4,
        "in-flight handlers were waited for: {finished}"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await as usize,
        40 - finished
    );

    // A new bus delivers the rest.
    let d = done.clone();
    let next = Bus::builder(db.config())
        .handler_fn("slow", ["*"], move |e| {
            d.lock().unwrap().push(e.id);
            async { Ok(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_empty(&client).await;
    next.shutdown().await.unwrap();
    let mut ids = done.lock().unwrap().clone();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 40);
}

/// Makes `public.in_flight_max` hold the most deliveries ever `processing` at once in
/// this database, in all (subscription `*`) and per subscription: a statement-level
/// trigger records the counts after every UPDATE of `pgbus.deliveries`, and every claim
/// is one, so no peak can fall between two samples.
async fn record_in_flight_peaks(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "CREATE TABLE public.in_flight_max (subscription text PRIMARY KEY, peak bigint NOT NULL);
             CREATE FUNCTION public.record_in_flight() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO public.in_flight_max AS m (subscription, peak)
                 SELECT coalesce(subscription, '*'), count(*) FROM pgbus.deliveries
                 WHERE status = 'processing' GROUP BY ROLLUP (subscription)
                 ON CONFLICT (subscription) DO UPDATE SET peak = greatest(m.peak, excluded.peak);
                 RETURN NULL;
             END $$;
             CREATE TRIGGER deliveries_in_flight AFTER UPDATE ON pgbus.deliveries
                 FOR EACH STATEMENT EXECUTE FUNCTION public.record_in_flight();",
        )
        .await
        .unwrap();
}

/// The most deliveries ever in flight at once: `*` for all of them, or a subscription's.
async fn in_flight_peak(client: &tokio_postgres::Client, subscription: &str) -> i64 {
    client
        .query_opt(
            "SELECT peak FROM public.in_flight_max WHERE subscription = $1",
            &[&subscription],
        )
        .await
        .unwrap()
        .map_or(0, |row| row.get(0))
}

const CONCURRENCY: usize = 4;
const BATCH: usize = 50;

/// A handler that counts its runs and the most running at once, and takes a millisecond
/// (slow enough that claims wait for free slots).
fn counting_handler(
    handled: Arc<AtomicUsize>,
    max_running: Arc<AtomicUsize>,
) -> impl Fn(Event) -> futures::future::BoxFuture<'static, Result<(), HandlerError>>
+ Send
+ Sync
+ 'static {
    let running_now = Arc::new(AtomicUsize::new(0));
    move |_| {
        let now = running_now.fetch_add(1, Ordering::SeqCst) + 1;
        max_running.fetch_max(now, Ordering::SeqCst);
        let (r, h) = (running_now.clone(), handled.clone());
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            r.fetch_sub(1, Ordering::SeqCst);
            h.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_handlers_in_flight_deliveries_never_exceed_concurrency_plus_one_batch() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "work", &["*"], 25)
        .await
        .unwrap();
    record_in_flight_peaks(&client).await;
    let events: Vec<Event> = (0..10_000).map(|i| Event::new("job", json!(i))).collect();
    pgbus::publish_batch(&client, &events).await.unwrap();

    let handled = Arc::new(AtomicUsize::new(0));
    let max_running = Arc::new(AtomicUsize::new(0));
    let bus = Bus::builder(db.config())
        .concurrency(CONCURRENCY)
        .batch_size(BATCH)
        .handler_fn(
            "work",
            ["*"],
            counting_handler(handled.clone(), max_running.clone()),
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for("1,000 deliveries handled", WAIT, || async {
        handled.load(Ordering::SeqCst) >= 1_000
    })
    .await;
    bus.shutdown().await.unwrap();
    let peak = in_flight_peak(&client, "*").await;
    println!("handler: at most {peak} deliveries in flight");
    // The first claim alone takes a full batch: the recording sees the prefetch.
    assert!(
        peak >= BATCH as i64,
        "the peak recorded ({peak}) is below one batch: the recording misses claims"
    );
    assert!(
        peak <= (CONCURRENCY + BATCH) as i64,
        "{peak} deliveries in flight at once, more than concurrency plus one batch"
    );
    assert!(max_running.load(Ordering::SeqCst) <= CONCURRENCY);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'"
        )
        .await,
        0
    );
}

/// A stream and a handler on one bus: the stream's unsettled deliveries never exceed its
/// own limit, and with the handler's they never exceed the bus's concurrency plus one
/// batch, however long the stream's consumer holds them.
#[tokio::test]
async fn a_streams_in_flight_deliveries_never_exceed_its_limit_nor_the_buss() {
    const STREAM_LIMIT: usize = 20;
    let db = common::test_db().await;
    let client = db.connect().await;
    for sub in ["work", "feed"] {
        pgbus::admin::register_subscription(&client, sub, &["*"], 25)
            .await
            .unwrap();
    }
    record_in_flight_peaks(&client).await;
    let events: Vec<Event> = (0..10_000).map(|i| Event::new("job", json!(i))).collect();
    pgbus::publish_batch(&client, &events).await.unwrap();

    let handled = Arc::new(AtomicUsize::new(0));
    let max_running = Arc::new(AtomicUsize::new(0));
    let mut bus = Bus::builder(db.config())
        .concurrency(CONCURRENCY)
        .batch_size(BATCH)
        .handler_fn(
            "work",
            ["*"],
            counting_handler(handled.clone(), max_running.clone()),
        )
        .build()
        .unwrap();
    let mut stream = bus
        .subscribe_with(
            "feed",
            ["*"],
            SubscriptionOptions::new().concurrency(STREAM_LIMIT),
        )
        .unwrap();
    let running = bus.start().await.unwrap();
    // The test holds deliveries unacknowledged until it has as many as the stream may
    // have (so the stream's limit is reached every round), then acknowledges them.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut held = Vec::new();
    let mut acked = 0;
    while acked < 1_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out with {acked} deliveries acknowledged"
        );
        let d = common::within("the next delivery", WAIT, stream.next())
            .await
            .expect("the stream ended");
        held.push(d);
        if held.len() == STREAM_LIMIT {
            let acks = held.drain(..).map(|d| d.ack());
            for result in common::within("the acks", WAIT, futures::future::join_all(acks)).await {
                result.unwrap();
            }
            acked += STREAM_LIMIT;
        }
    }
    common::wait_for("1,000 deliveries handled", WAIT, || async {
        handled.load(Ordering::SeqCst) >= 1_000
    })
    .await;
    running.shutdown().await.unwrap();
    let (all, feed) = (
        in_flight_peak(&client, "*").await,
        in_flight_peak(&client, "feed").await,
    );
    println!("stream and handler: at most {all} deliveries in flight, {feed} of the stream");
    // The test held the stream's full limit: the recording saw it.
    assert!(
        feed >= STREAM_LIMIT as i64,
        "the stream's peak recorded ({feed}) is below what the test held"
    );
    assert!(
        feed <= STREAM_LIMIT as i64,
        "{feed} of the stream's deliveries in flight at once, more than its limit"
    );
    assert!(
        all <= (CONCURRENCY + BATCH) as i64,
        "{all} deliveries in flight at once, more than concurrency plus one batch"
    );
    assert!(max_running.load(Ordering::SeqCst) <= CONCURRENCY);
}

/// The race of cost-aware notify: publishers stop notifying while the bus is awake;
/// an event that commits just as it falls asleep must not wait for the poll.
#[tokio::test]
async fn no_event_waits_for_the_poll_at_busy_to_idle_transitions() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let seen: Arc<std::sync::Mutex<HashMap<String, tokio::time::Instant>>> = Default::default();
    let s = seen.clone();
    let running = Bus::builder(db.config())
        .poll_interval(Duration::from_secs(30))
        .handler_fn("h", ["*"], move |e| {
            s.lock().unwrap().insert(e.id, tokio::time::Instant::now());
            async { Ok(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_listening(&running).await;
    let mut trailing = Vec::new();
    for round in 0..6u64 {
        // A burst large enough to wake the bus up (it stops being notified)...
        let burst: Vec<Event> = (0..200).map(|i| Event::new("burst", json!(i))).collect();
        for chunk in burst.chunks(5) {
            pgbus::publish_batch(&client, chunk).await.unwrap();
        }
        // ...then single events around the moment it falls asleep (~50 ms later).
        for offset_ms in [0u64, 20, 45, 50, 55, 60, 80] {
            // A deliberate gap (the scenario), not a wait for a condition.
            tokio::time::sleep(Duration::from_millis(offset_ms.saturating_sub(round))).await;
            let id = format!("trail-{round}-{offset_ms}");
            pgbus::publish(&client, &Event::new("trail", json!({})).id(&id))
                .await
                .unwrap();
            trailing.push((id, tokio::time::Instant::now()));
        }
        wait_empty(&client).await;
    }
    let seen = seen.lock().unwrap().clone();
    let mut worst = Duration::ZERO;
    for (id, committed) in &trailing {
        let handled = seen.get(id).unwrap_or_else(|| panic!("{id} not handled"));
        worst = worst.max(handled.saturating_duration_since(*committed));
    }
    assert!(
        worst < Duration::from_secs(2),
        "worst trailing latency {worst:?}"
    );
    assert_eq!(running.stats().wakeups_by_poll, 0);
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn every_bus_statement_prepares_against_the_schema() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for (name, sql) in pgbus_testkit::sql::ALL {
        client
            .prepare(sql)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Rows are read by column name, so every result column needs a name of its own: an
/// unnamed expression (`?column?`) or two columns of one name would be read wrongly or
/// not at all.
#[tokio::test]
async fn every_bus_statement_names_its_columns_once_each() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for (name, sql) in pgbus_testkit::sql::ALL {
        let statement = client
            .prepare(sql)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut seen = std::collections::HashSet::new();
        for column in statement.columns() {
            assert_ne!(column.name(), "?column?", "{name}: a column has no name");
            assert!(
                seen.insert(column.name()),
                "{name}: two columns are named {:?}",
                column.name()
            );
        }
    }
}

#[tokio::test]
async fn the_claim_uses_its_index_whatever_the_backlog() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "big", &["big.*"], 25)
        .await
        .unwrap();
    pgbus::admin::register_subscription(&client, "small", &["small.*"], 25)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload) \
             SELECT 'big.x', jsonb_build_object('i', i) FROM generate_series(1, 200000) i; \
             INSERT INTO pgbus.events (event_name, payload) \
             SELECT 'small.x', '{}' FROM generate_series(1, 10);",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute("ANALYZE pgbus.deliveries; ANALYZE pgbus.events;")
        .await
        .unwrap();
    let claim = pgbus_testkit::claim_statement(&client).await.unwrap();
    for sub in ["big", "small"] {
        let names = vec![sub];
        let quotas = vec![100_i32];
        let rows = client
            .query(
                &format!("EXPLAIN (FORMAT JSON) {claim}"),
                &[
                    &names,
                    &quotas,
                    &100_i64,
                    &60_000_f64,
                    &"w",
                    &4_i64,
                    &i64::MAX,
                    &Vec::<Option<chrono::DateTime<chrono::Utc>>>::new(),
                ],
            )
            .await
            .unwrap();
        let plan: serde_json::Value = rows[0].get(0);
        let mut nodes = Vec::new();
        plan_nodes(&plan, &mut nodes);
        assert!(
            nodes
                .iter()
                .any(|(_, _, index)| index == "deliveries_ready_idx"),
            "{sub}: the claim does not use its index: {nodes:?}"
        );
        assert!(
            !nodes
                .iter()
                .any(|(kind, rel, _)| kind == "Seq Scan" && rel == "deliveries"),
            "{sub}: the claim scans every delivery: {nodes:?}"
        );
    }

    // The bus runs the statement with a generic plan (pgbus.claim): one plan for any
    // values, which must not reach a backlog either. "small"'s deliveries come after
    // 200,000 of "big"'s in every index but the claim's.
    client
        .batch_execute(&format!(
            "PREPARE claim(text[], int4[], int4, int8, text, int4, int8, timestamptz[]) AS {claim}; \
             SET plan_cache_mode = force_generic_plan"
        ))
        .await
        .unwrap();
    for sub in ["big", "small"] {
        let messages = client
            .simple_query(&format!(
                "EXPLAIN (FORMAT JSON) EXECUTE claim('{{{sub}}}', '{{100}}', 100, 60000, 'w', 4, {}, NULL)",
                i64::MAX
            ))
            .await
            .unwrap();
        let text = messages
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
            .expect("an EXPLAIN row");
        let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut nodes = Vec::new();
        plan_nodes(&plan, &mut nodes);
        let on_deliveries: Vec<_> = nodes
            .iter()
            .filter(|(kind, rel, _)| rel == "deliveries" && kind.ends_with("Scan"))
            .collect();
        assert!(
            on_deliveries
                .iter()
                .all(|(kind, _, index)| kind == "Tid Scan" || index == "deliveries_ready_idx"),
            "{sub}: the generic plan reaches deliveries other than by the claim index and \
             the leased rows' ctids: {nodes:?}"
        );
        assert!(
            on_deliveries.iter().any(|(kind, _, _)| kind == "Tid Scan"),
            "{sub}: the lease is not written by ctid: {nodes:?}"
        );
    }
}

/// `pgbus.claim` turns what committed into deliveries (docs/ARCHITECTURE.md, "The
/// log-first publish"), then runs `pgbus.claim_due`, whose body is one claim query
/// with a generic plan.
#[tokio::test]
async fn the_claim_function_runs_the_claim_statement() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let function = |signature: &'static str| {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT prosrc, coalesce(proconfig, '{}') FROM pg_proc \
                     WHERE oid = $1::text::regprocedure",
                    &[&signature],
                )
                .await
                .unwrap();
            (row.get::<_, String>(0), row.get::<_, Vec<String>>(1))
        }
    };
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let (wrapper, _) =
        function("pgbus.claim(text[], int4[], int4, int8, text, int4, int8, timestamptz[])").await;
    let wrapper = squash(&wrapper);
    let cut = wrapper.find("PERFORM pgbus.fan_out_committed();");
    let run =
        wrapper.find("RETURN QUERY SELECT * FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7, $8);");
    assert!(
        matches!((cut, run), (Some(c), Some(r)) if c < r),
        "pgbus.claim does not cut a batch and then claim:\n{wrapper}"
    );
    let (body, config) =
        function("pgbus.claim_due(text[], int4[], int4, int8, text, int4, int8, timestamptz[])")
            .await;
    // The tests and benchmarks that run or explain the claim by hand read it from
    // here (pgbus_testkit::claim_statement): the function must be that one query.
    let claim = pgbus_testkit::claim_statement(&client).await.unwrap();
    assert_eq!(
        squash(&body).matches("RETURN QUERY").count(),
        1,
        "pgbus.claim_due is not one query:\n{body}"
    );
    assert!(
        claim.starts_with("WITH subs AS") && claim.contains("FOR UPDATE SKIP LOCKED"),
        "pgbus.claim_due's query is not the claim:\n{claim}"
    );
    assert!(
        config
            .iter()
            .any(|c| c == "plan_cache_mode=force_generic_plan"),
        "pgbus.claim_due does not run with a generic plan: {config:?}"
    );
}

/// (node type, relation, index) of every node of an EXPLAIN (FORMAT JSON) plan.
fn plan_nodes(v: &serde_json::Value, out: &mut Vec<(String, String, String)>) {
    match v {
        serde_json::Value::Object(map) => {
            if let Some(kind) = map.get("Node Type").and_then(|k| k.as_str()) {
                let field = |k: &str| {
                    map.get(k)
                        .and_then(|x| x.as_str())
                        .unwrap_or_default()
                        .to_string()
                };
                out.push((
                    kind.to_string(),
                    field("Relation Name"),
                    field("Index Name"),
                ));
            }
            map.values().for_each(|x| plan_nodes(x, out));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|x| plan_nodes(x, out)),
        _ => {}
    }
}
