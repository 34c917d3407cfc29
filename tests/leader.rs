//! Maintenance by one bus at a time: of the buses on one database, one leads (reaps,
//! repairs, sweeps, samples the gauges); a follower takes over when the leader leaves
//! (at once) or dies (within the bound); an idle bus runs almost no transactions.

mod common;

use std::time::Duration;

use futures::StreamExt;
use pgbus::{Bus, Event, RunningBus};
use serde_json::json;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(20);
/// The leadership the tests give their buses: a leader renews it every third; a
/// follower runs for it every 1.25 of it.
const LEADERSHIP: Duration = Duration::from_secs(1);

fn builder(db: &common::TestDb, leadership: Duration) -> pgbus::BusBuilder {
    Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .leader_lease(leadership)
}

async fn until_leads(what: &str, bus: &RunningBus, timeout: Duration) {
    common::wait_for(what, timeout, || async { bus.is_leader() }).await;
}

/// Two buses: exactly one leads, the two never lead at once, and only the leader reaps;
/// an expired lease (written by raw SQL) is returned by the leader and claimed again.
#[tokio::test]
async fn one_bus_of_two_leads_and_only_it_reaps() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut a = builder(&db, LEADERSHIP).build().unwrap();
    let mut a_stream = a.subscribe("s", ["*"]).unwrap();
    let a = a.start().await.unwrap();
    until_leads("the first bus to lead", &a, WAIT).await;
    let mut b = builder(&db, LEADERSHIP).build().unwrap();
    let mut b_stream = b.subscribe("s", ["*"]).unwrap();
    let b = b.start().await.unwrap();

    pgbus::publish(&client, &Event::new("x", json!({})).id("x"))
        .await
        .unwrap();
    let first = common::within("attempt 1", WAIT, async {
        tokio::select! {
            d = a_stream.next() => d.unwrap(),
            d = b_stream.next() => d.unwrap(),
        }
    })
    .await;
    assert_eq!(first.attempt(), 1);

    // Over three leaderships: one leader at every look, never two, and the follower
    // never reaps.
    let end = Instant::now() + 3 * LEADERSHIP;
    while Instant::now() < end {
        assert!(!(a.is_leader() && b.is_leader()), "two buses lead at once");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        a.is_leader() && !b.is_leader(),
        "the first leader kept its lead"
    );
    assert_eq!(b.stats().reaps, 0, "the follower reaped");
    assert_eq!(b.stats().elected, 0);
    assert_eq!(a.stats().elected, 1);

    // The lease runs out: the leader returns it, and it is claimed again.
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second'")
        .await
        .unwrap();
    let again = common::within("attempt 2", WAIT, async {
        tokio::select! {
            d = a_stream.next() => d.unwrap(),
            d = b_stream.next() => d.unwrap(),
        }
    })
    .await;
    assert_eq!(again.attempt(), 2);
    assert!(a.stats().reaped >= 1, "{:?}", a.stats());
    assert_eq!(b.stats().reaps, 0, "the follower reaped");
    again.ack().await.unwrap();
    drop(first);
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// A leader that dies (its tasks gone without leaving, as a SIGKILL leaves it) is
/// replaced within a leadership and a follower's beat (2.25 leaderships).
#[tokio::test]
async fn a_leader_that_dies_is_replaced_within_the_bound() {
    let db = common::test_db().await;
    let mut a = builder(&db, LEADERSHIP).build().unwrap();
    a.subscribe("s", ["*"]).unwrap();
    let a = a.start().await.unwrap();
    until_leads("the first bus to lead", &a, WAIT).await;
    let mut b = builder(&db, LEADERSHIP).build().unwrap();
    b.subscribe("s", ["*"]).unwrap();
    let b = b.start().await.unwrap();
    tokio::time::sleep(LEADERSHIP).await;
    assert!(!b.is_leader());

    let died = Instant::now();
    drop(a); // no shutdown: its row and its leadership stay until they run out
    let bound = LEADERSHIP * 9 / 4;
    until_leads(
        "the follower to take over",
        &b,
        bound + Duration::from_secs(2),
    )
    .await;
    let took = died.elapsed();
    println!("takeover after a dead leader: {took:?} (bound {bound:?})");
    assert!(b.stats().elected == 1);
    b.shutdown().await.unwrap();
}

/// A leader that shuts down hands over at once: its leave notifies, and the follower
/// runs for the lead without waiting for its next beat.
#[tokio::test]
async fn a_leader_that_shuts_down_hands_over_at_once() {
    let db = common::test_db().await;
    // A long leadership: the follower's own beat would come only after 75 s.
    let leadership = Duration::from_secs(60);
    let mut a = builder(&db, leadership).build().unwrap();
    a.subscribe("s", ["*"]).unwrap();
    let a = a.start().await.unwrap();
    until_leads("the first bus to lead", &a, WAIT).await;
    let mut b = builder(&db, leadership).build().unwrap();
    b.subscribe("s", ["*"]).unwrap();
    let b = b.start().await.unwrap();
    common::wait_for("the follower to listen", WAIT, || async {
        b.is_listening()
    })
    .await;
    assert!(!b.is_leader());

    let left = Instant::now();
    a.shutdown().await.unwrap();
    until_leads("the follower to take over", &b, Duration::from_secs(10)).await;
    println!("handover after a leader left: {:?}", left.elapsed());
    assert!(left.elapsed() < leadership);
    b.shutdown().await.unwrap();
}

/// The server's transactions in the test's database so far (pg_stat_database, as
/// flushed), read from another database so that the reads do not count.
async fn transactions(elsewhere: &tokio_postgres::Client, db: &common::TestDb) -> i64 {
    elsewhere
        .query_one(
            "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
             WHERE datname = $1",
            &[&db.name()],
        )
        .await
        .unwrap()
        .get(0)
}

/// An idle bus (listening, leading, nothing to deliver, its gauges sampled) runs almost no
/// transactions: over a quiet minute, only its schedule's, about ten. Those are the
/// leader's beat (every third of the 60 s leadership), the gauge sample (every minute) and
/// the listener's ping (an empty query every 10 s: an empty transaction, without an xid).
/// No claim and no reap run; a bus that claimed or reaped every second would run 120.
///
/// The server counts a backend's empty transactions in `pg_stat_database` only when that
/// backend next flushes statistics of another kind (for the listener, when it reads the
/// notification queue, which other databases' notifications make it do), so the
/// listener's pings since it connected may all land in the window at once: the bound
/// counts them from the start, plus three for the edges.
#[tokio::test]
async fn an_idle_bus_runs_almost_no_transactions() {
    let db = common::test_db().await;
    let mut other = db.config();
    other.dbname("postgres");
    let (client, connection) = other.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let mut bus = Bus::builder(db.config()).build().unwrap();
    bus.subscribe("s", ["*"]).unwrap();
    let bus = bus.start().await.unwrap();
    common::wait_for("the bus to lead and listen", WAIT, || async {
        bus.is_leader() && bus.is_listening()
    })
    .await;
    // Its first duties (the first reap, sweep, repair and gauges) run as it is elected;
    // a backend's counts reach the server's view within 10 s of its last transaction.
    let settle = Duration::from_secs(20);
    tokio::time::sleep(settle).await;
    let window = Duration::from_secs(60);
    let before = transactions(&client, &db).await;
    tokio::time::sleep(window).await;
    let after = transactions(&client, &db).await;
    let ran = after - before;
    let connections: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
             AND application_name LIKE 'pgbus%'",
            &[&db.name()],
        )
        .await
        .unwrap()
        .get(0);
    println!("an idle bus: {ran} transactions in {window:?}, {connections} connections");
    let pings = (settle + window).as_secs() / 10;
    let schedule = pings + window.as_secs() / 20 + window.as_secs() / 60;
    assert!(
        ran as u64 <= schedule + 3,
        "{ran} transactions in {window:?}, where the schedule runs {schedule}"
    );
    assert!(bus.is_leader());
    bus.shutdown().await.unwrap();
}

/// With a connected listener the fallback poll sleeps long, yet a delivery scheduled a
/// second ahead is handled about then: the bus claims at the next due time it knows of.
#[tokio::test]
async fn a_listening_bus_claims_a_scheduled_delivery_when_it_is_due() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .idle_poll_interval(Duration::from_secs(600))
        .build()
        .unwrap();
    let mut stream = bus.subscribe("s", ["*"]).unwrap();
    let bus = bus.start().await.unwrap();
    common::wait_for("the bus to listen", WAIT, || async { bus.is_listening() }).await;
    let due = chrono::Utc::now() + chrono::Duration::seconds(2);
    pgbus::publish(
        &client,
        &Event::new("later", json!({})).id("later").deliver_at(due),
    )
    .await
    .unwrap();
    let d = common::within(
        "the scheduled delivery",
        Duration::from_secs(10),
        stream.next(),
    )
    .await
    .unwrap();
    assert!(chrono::Utc::now() >= due - chrono::Duration::milliseconds(50));
    d.ack().await.unwrap();
    bus.shutdown().await.unwrap();
}

/// The consumers list shows each bus's own heartbeat, whatever its leader lease: with a
/// leadership of 1 s a bus's row lives 2.5 s from its last beat (two follower beats),
/// and the last beat moves on as the bus beats.
#[tokio::test]
async fn the_consumers_list_shows_a_bus_s_last_beat_at_any_leader_lease() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = builder(&db, LEADERSHIP).build().unwrap();
    bus.subscribe("s", ["*"]).unwrap();
    let bus = bus.start().await.unwrap();
    until_leads("the bus to lead", &bus, WAIT).await;
    let first = pgbus::admin::consumers(&client).await.unwrap();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].id, bus.worker_id());
    assert_eq!(
        first[0].expires_at - first[0].last_heartbeat,
        chrono::Duration::milliseconds(2500),
        "{first:?}"
    );
    common::wait_for("the bus to beat again", WAIT, || async {
        let now = pgbus::admin::consumers(&client).await.unwrap();
        now.len() == 1 && now[0].last_heartbeat > first[0].last_heartbeat
    })
    .await;
    bus.shutdown().await.unwrap();
}
