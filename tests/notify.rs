//! Cost-aware notify: one notification per publishing transaction, sent at COMMIT, and
//! none while every live consumer is awake.

mod common;

use std::time::Duration;

use futures::StreamExt;
use pgbus::Event;
use serde_json::json;
use tokio::sync::mpsc;

/// A connection listening on `pgbus` and on a sentinel channel. The sentinel orders
/// things: notifications are delivered in commit order, so once a sentinel sent after a
/// commit has arrived, any notification of that commit has arrived too.
struct Listener {
    rx: mpsc::UnboundedReceiver<String>,
    sender: tokio_postgres::Client,
    _client: tokio_postgres::Client,
}

impl Listener {
    async fn start(db: &common::TestDb) -> Listener {
        let (client, mut connection) = db.config().connect(tokio_postgres::NoTls).await.unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let tokio_postgres::AsyncMessage::Notification(n) = message {
                    let _ = tx.send(n.channel().to_string());
                }
            }
        });
        client
            .batch_execute("LISTEN pgbus; LISTEN sentinel")
            .await
            .unwrap();
        Listener {
            rx,
            sender: db.connect().await,
            _client: client,
        }
    }

    /// The `pgbus` notifications received up to now (waits for a sentinel).
    async fn drain(&mut self) -> usize {
        self.sender.batch_execute("NOTIFY sentinel").await.unwrap();
        let mut n = 0;
        loop {
            let channel = common::within(
                "the sentinel notification",
                Duration::from_secs(10),
                self.rx.recv(),
            )
            .await
            .expect("listener closed");
            match channel.as_str() {
                "sentinel" => return n,
                "pgbus" => n += 1,
                other => panic!("unexpected channel {other}"),
            }
        }
    }

    async fn next_is_pgbus(&mut self) {
        let channel = common::within(
            "a pgbus notification",
            Duration::from_secs(10),
            self.rx.recv(),
        )
        .await
        .expect("listener closed");
        assert_eq!(channel, "pgbus");
    }
}

async fn set_consumer(client: &tokio_postgres::Client, id: &str, awake: bool, ttl_secs: f64) {
    client
        .execute(
            "INSERT INTO pgbus.consumers (id, awake, expires_at) \
             VALUES ($1, $2, now() + make_interval(secs => $3)) \
             ON CONFLICT (id) DO UPDATE SET awake = EXCLUDED.awake, expires_at = EXCLUDED.expires_at",
            &[&id, &awake, &ttl_secs],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn one_notification_per_transaction_sent_at_commit() {
    let db = common::test_db().await;
    let mut listener = Listener::start(&db).await;
    let mut client = db.connect().await;

    // One event.
    pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 1);

    // A batch of 1,000 in one transaction, plus two more publishes: still one.
    let tx = client.transaction().await.unwrap();
    let events: Vec<Event> = (0..1000).map(|i| Event::new("a", json!(i))).collect();
    pgbus::publish_batch(&tx, &events).await.unwrap();
    pgbus::publish(&tx, &Event::new("b", json!({})))
        .await
        .unwrap();
    pgbus::publish(&tx, &Event::new("c", json!({})))
        .await
        .unwrap();
    // Nothing before COMMIT.
    assert_eq!(listener.drain().await, 0);
    tx.commit().await.unwrap();
    assert_eq!(listener.drain().await, 1);

    // A rolled-back transaction sends nothing.
    let tx = client.transaction().await.unwrap();
    pgbus::publish(&tx, &Event::new("a", json!({})))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(listener.drain().await, 0);

    // A transaction that rolls back the savepoint holding its only event sends nothing;
    // one that publishes again after the rollback sends one.
    let mut tx = client.transaction().await.unwrap();
    let sp = tx.savepoint("sp").await.unwrap();
    pgbus::publish(&sp, &Event::new("a", json!({})))
        .await
        .unwrap();
    sp.rollback().await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(listener.drain().await, 0);

    let mut tx = client.transaction().await.unwrap();
    let sp = tx.savepoint("sp").await.unwrap();
    pgbus::publish(&sp, &Event::new("a", json!({})))
        .await
        .unwrap();
    sp.rollback().await.unwrap();
    pgbus::publish(&tx, &Event::new("a", json!({})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(listener.drain().await, 1);
}

#[tokio::test]
async fn no_notification_while_every_live_consumer_is_awake() {
    let db = common::test_db().await;
    let mut listener = Listener::start(&db).await;
    let client = db.connect().await;

    set_consumer(&client, "c1", true, 60.0).await;
    set_consumer(&client, "c2", true, 60.0).await;
    pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 0, "all consumers awake");

    // One falls asleep: the next commit notifies.
    set_consumer(&client, "c2", false, 60.0).await;
    pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 1, "one consumer asleep");

    // Awake again, but c2's heartbeat is stale: c1 is the only live one, and awake.
    set_consumer(&client, "c2", true, -1.0).await;
    pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 0, "stale consumer ignored");

    // Every consumer stale: nobody is known to be awake, so notify.
    set_consumer(&client, "c1", true, -1.0).await;
    pgbus::publish(&client, &Event::new("a", json!({})))
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 1, "no live consumer");
}

#[tokio::test]
async fn the_consumer_state_is_read_at_commit_not_at_insert() {
    let db = common::test_db().await;
    let mut listener = Listener::start(&db).await;
    let mut client = db.connect().await;
    let other = db.connect().await;

    set_consumer(&other, "c1", true, 60.0).await;
    let tx = client.transaction().await.unwrap();
    pgbus::publish(&tx, &Event::new("a", json!({})))
        .await
        .unwrap();
    // The consumer falls asleep after the insert, before the commit.
    set_consumer(&other, "c1", false, 60.0).await;
    tx.commit().await.unwrap();
    listener.next_is_pgbus().await;
    assert_eq!(listener.drain().await, 0);
}

#[tokio::test]
async fn raw_inserts_and_sql_publish_notify() {
    let db = common::test_db().await;
    let mut listener = Listener::start(&db).await;
    let other = db.connect().await;
    other
        .batch_execute("INSERT INTO pgbus.events (event_name, payload) VALUES ('x', '{}')")
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 1);
    other
        .batch_execute("SELECT pgbus.publish('x', '{}')")
        .await
        .unwrap();
    assert_eq!(listener.drain().await, 1);
}

/// A bus with a poll interval far longer than any test wait, and a handler reporting the
/// names it handles.
async fn bus_reporting(
    db: &common::TestDb,
) -> (pgbus::RunningBus, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let running = pgbus::Bus::builder(db.config())
        .poll_interval(Duration::from_secs(60))
        .handler_fn("h", ["*"], move |e: Event| {
            let _ = tx.send(e.name.clone());
            async { Ok::<(), pgbus::HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    (running, rx)
}

async fn expect(rx: &mut mpsc::UnboundedReceiver<String>, name: &str, within: Duration) {
    loop {
        let got = common::within(&format!("{name} to be handled"), within, rx.recv())
            .await
            .expect("the bus stopped");
        if got == name {
            return;
        }
    }
}

/// The wake-up race: a publisher reads "awake" and sends no notification, but its
/// commit becomes visible only after the bus fell asleep and finished its re-checks
/// (here a deferred trigger holds the commit 600 ms; synchronous replication does the
/// same). The bus's sleep mark waits for that commit, so the claim after the mark finds
/// the event, long before the 60 s poll.
#[tokio::test]
async fn a_commit_slower_than_every_recheck_is_found_without_the_poll() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE public.seen_awake (awake boolean);
             CREATE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.event_name = 'slow' THEN
                     INSERT INTO public.seen_awake SELECT bool_and(awake) FROM pgbus.consumers;
                     PERFORM pg_sleep(0.6);
                 END IF;
                 RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER zz_slow_commit AFTER INSERT ON pgbus.events
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                 EXECUTE FUNCTION public.slow_commit();",
        )
        .await
        .unwrap();
    let (running, mut handled) = bus_reporting(&db).await;
    let warm: Vec<Event> = (0..8).map(|_| Event::new("warm", json!({}))).collect();
    let mut caught_awake = false;
    for _ in 0..10 {
        // A burst makes the bus claim several at once: it marks itself awake and
        // lingers. Publish the slow event while it does.
        pgbus::publish_batch(&client, &warm).await.unwrap();
        for _ in 0..warm.len() {
            expect(&mut handled, "warm", Duration::from_secs(10)).await;
        }
        pgbus::publish(&client, &Event::new("slow", json!({})))
            .await
            .unwrap();
        expect(&mut handled, "slow", Duration::from_secs(20)).await;
        let seen: Option<bool> = client
            .query_one("SELECT awake FROM public.seen_awake", &[])
            .await
            .unwrap()
            .get(0);
        client
            .batch_execute("DELETE FROM public.seen_awake")
            .await
            .unwrap();
        if seen == Some(true) {
            caught_awake = true;
            break;
        }
    }
    assert!(
        caught_awake,
        "the slow commit never read the bus awake: the race was not exercised"
    );
    assert_eq!(running.stats().wakeups_by_poll, 0);
    running.shutdown().await.unwrap();
}

/// A bus whose sleep mark fails is still marked awake, so nobody notifies it: it keeps
/// polling on a short backoff instead of sleeping until the poll interval.
#[tokio::test]
async fn a_bus_that_cannot_mark_itself_asleep_keeps_finding_events() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE SEQUENCE public.mark_tries;
             CREATE OR REPLACE FUNCTION pgbus.mark_asleep(p_id text) RETURNS void
             LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM nextval('public.mark_tries'); -- not undone by the error
                 RAISE EXCEPTION 'no sleeping today';
             END $$;",
        )
        .await
        .unwrap();
    let (running, mut handled) = bus_reporting(&db).await;
    let warm: Vec<Event> = (0..8).map(|_| Event::new("warm", json!({}))).collect();
    pgbus::publish_batch(&client, &warm).await.unwrap();
    for _ in 0..warm.len() {
        expect(&mut handled, "warm", Duration::from_secs(10)).await;
    }
    // Let the linger pass and the mark fail a few times: the row still says awake.
    common::wait_for(
        "the sleep mark to fail three times",
        Duration::from_secs(30),
        || async {
            let tries: i64 = client
                .query_one(
                    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.mark_tries",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            tries >= 3
        },
    )
    .await;
    let awake: bool = client
        .query_one("SELECT awake FROM pgbus.consumers", &[])
        .await
        .unwrap()
        .get(0);
    assert!(awake);
    for n in 0..3 {
        let name = format!("late{n}");
        pgbus::publish(&client, &Event::new(name.clone(), json!({})))
            .await
            .unwrap();
        expect(&mut handled, &name, Duration::from_secs(10)).await;
    }
    assert_eq!(running.stats().wakeups_by_poll, 0);
    running.shutdown().await.unwrap();
}
