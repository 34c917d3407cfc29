//! Operator queries stay cheap with many subscriptions and deep backlogs: `status` is one
//! set-based statement, one subscription's status and a page of dead letters are
//! index-backed and bounded. CI runs a small size; the figures in BENCHMARKS.md come from
//! `PGBUS_SCALE_SUBSCRIPTIONS=10000 PGBUS_SCALE_DELIVERIES=1000000 PGBUS_SCALE_DEAD=100000
//! cargo test --release --test operator_scale -- --nocapture`.

mod common;

use std::time::{Duration, Instant};

use pgbus::admin::{self, DeadLetterFilter};

fn size(var: &str, default: i64) -> i64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn report(what: &str, started: Instant) -> Duration {
    let took = started.elapsed();
    println!("{what}: {:.1} ms", took.as_secs_f64() * 1000.0);
    took
}

/// `subs` subscriptions `sub1`, `sub2`... (patterns `svc1.*`, `svc2.*`..., an hour old)
/// and `events` events spread over them (one delivery each), in batches, created at
/// `created_at` (an SQL expression, `i` the event's number in its batch).
async fn seed(client: &tokio_postgres::Client, subs: i64, events: i64, created_at: &str) {
    client
        .execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, created_at)
             SELECT 'sub' || i, ARRAY['svc' || i || '.*'], now() - interval '1 hour'
             FROM generate_series(1, $1::int8) AS i",
            &[&subs],
        )
        .await
        .unwrap();
    let mut done = 0;
    while done < events {
        let n = (events - done).min(100_000);
        client
            .execute(
                &format!(
                    "INSERT INTO pgbus.events (event_name, created_at)
                     SELECT 'svc' || (1 + (($1::int8 + i) % $2::int8)) || '.x', {created_at}
                     FROM generate_series(1, $3::int8) AS i"
                ),
                &[&done, &subs, &n],
            )
            .await
            .unwrap();
        done += n;
    }
    // The deliveries, as the bus's next claim would make them.
    common::fan_out(client).await;
}

#[tokio::test]
async fn operator_queries_are_set_based_and_bounded() {
    let subs = size("PGBUS_SCALE_SUBSCRIPTIONS", 1_000);
    let deliveries = size("PGBUS_SCALE_DELIVERIES", 20_000);
    let dead = size("PGBUS_SCALE_DEAD", 5_000).min(deliveries);
    let db = common::test_db().await;
    let client = db.connect().await;
    let started = Instant::now();
    // Older than the last minute, spread over every subscription.
    seed(&client, subs, deliveries, "now() - interval '10 minutes'").await;
    client
        .execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, last_error = 'x'
             WHERE event_seq IN (SELECT seq FROM pgbus.events ORDER BY seq LIMIT $1)",
            &[&dead],
        )
        .await
        .unwrap();
    // A few events of the last minute, completed.
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name) SELECT 'svc1.y' FROM generate_series(1, 10)",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute(
            "DELETE FROM pgbus.deliveries WHERE event_seq IN
               (SELECT seq FROM pgbus.events WHERE event_name = 'svc1.y');
             ANALYZE pgbus.deliveries; ANALYZE pgbus.events; ANALYZE pgbus.subscriptions;
             ANALYZE pgbus.subscription_patterns;",
        )
        .await
        .unwrap();
    report(
        &format!("setup: {subs} subscriptions, {deliveries} deliveries, {dead} dead"),
        started,
    );

    let t = Instant::now();
    let status = admin::status(&client).await.unwrap();
    report("status (every subscription)", t);
    assert_eq!(status.subscriptions.len() as i64, subs);
    let total: i64 = status
        .subscriptions
        .iter()
        .map(|s| s.pending + s.dead)
        .sum();
    assert_eq!(total, deliveries);
    assert_eq!(
        status.subscriptions.iter().map(|s| s.dead).sum::<i64>(),
        dead
    );
    let first = status
        .subscriptions
        .iter()
        .find(|s| s.name == "sub1")
        .unwrap();
    assert_eq!(first.done_last_minute, 10);
    assert!(!first.done_estimated, "ten events: counted exactly");

    let t = Instant::now();
    let one = admin::subscription_status(&client, "sub1").await.unwrap();
    report("status of one subscription", t);
    assert_eq!(
        (
            one.pending,
            one.due,
            one.processing,
            one.dead,
            one.done_last_minute
        ),
        (
            first.pending,
            first.due,
            first.processing,
            first.dead,
            first.done_last_minute
        )
    );

    // Dead letters, a page at a time: every one listed once, in order.
    let t = Instant::now();
    let page = admin::dead_letters(&client, &DeadLetterFilter::all(), 100)
        .await
        .unwrap();
    report("dead list, first page of 100", t);
    let t = Instant::now();
    let cursor = page.last().map(admin::DeadLetter::cursor);
    let next = admin::dead_letters_after(&client, &DeadLetterFilter::all(), 100, cursor.as_ref())
        .await
        .unwrap();
    report("dead list, second page of 100", t);
    assert_eq!(page.len(), 100.min(dead as usize));
    if dead > 100 {
        assert!(next[0].event_seq > page[99].event_seq);
    }
    let t = Instant::now();
    let mut seen = 0;
    let mut last: Option<admin::DeadLetterCursor> = None;
    let filter = DeadLetterFilter::all().subscription("sub1");
    loop {
        let page = admin::dead_letters_after(&client, &filter, 50, last.as_ref())
            .await
            .unwrap();
        seen += page.len() as i64;
        match page.last() {
            Some(l) if page.len() == 50 => last = Some(l.cursor()),
            _ => break,
        }
    }
    report("dead list of one subscription, every page of 50", t);
    assert_eq!(
        seen,
        admin::count_dead_letters(&client, &filter).await.unwrap()
    );

    // The plans: the page reads its index in order and stops at the limit.
    let plan: String = client
        .query(
            "EXPLAIN SELECT d.event_seq FROM pgbus.deliveries AS d WHERE d.status = 'dead'
             AND (d.event_seq, d.subscription) > (0, '') ORDER BY d.event_seq, d.subscription
             LIMIT 100",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(plan.contains("deliveries_dead_seq_idx"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
}

/// `status` and the dashboard's throughput stay bounded however much traffic the last
/// minute held: `PGBUS_SCALE_SUBSCRIPTIONS` subscriptions, `PGBUS_SCALE_RECENT` events of
/// the last minute spread over them (one delivery each), half of them completed. The
/// figures in BENCHMARKS.md ("`status` and recent traffic") come from
/// `PGBUS_SCALE_SUBSCRIPTIONS=10000 PGBUS_SCALE_RECENT=1000000 cargo test --test
/// operator_scale status_with_recent_traffic -- --nocapture`.
#[tokio::test]
async fn status_with_recent_traffic_is_bounded() {
    let subs = size("PGBUS_SCALE_SUBSCRIPTIONS", 100);
    let recent = size("PGBUS_SCALE_RECENT", 30_000);
    let db = common::test_db().await;
    let client = db.connect().await;
    let started = Instant::now();
    // Dated ahead, so that they are still of the last minute when the seeding (minutes at
    // 1,000,000) is over: `status` reads the window's lower bound only.
    seed(
        &client,
        subs,
        recent,
        "now() + interval '10 minutes' - (i % 20) * interval '1 second'",
    )
    .await;
    // About half of them completed (completed deliveries are deleted; which ones by a
    // hash, so that no even sample of the log lines up with them).
    client
        .batch_execute("DELETE FROM pgbus.deliveries WHERE hashint8(event_seq) % 2 = 0")
        .await
        .unwrap();
    for vacuum in [
        "VACUUM ANALYZE pgbus.deliveries",
        "VACUUM ANALYZE pgbus.events",
        "ANALYZE pgbus.subscriptions",
        "ANALYZE pgbus.subscription_patterns",
    ] {
        client.batch_execute(vacuum).await.unwrap();
    }
    report(
        &format!("setup: {subs} subscriptions, {recent} deliveries of the last minute"),
        started,
    );

    let window: i64 = client
        .query_one(
            "SELECT count(*) FROM pgbus.events WHERE created_at > now() - interval '1 minute'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(window, recent, "every seeded event is of the last minute");
    let mut status = None;
    for _ in 0..3 {
        let t = Instant::now();
        status = Some(admin::status(&client).await.unwrap());
        report("status (every subscription)", t);
    }
    let status = status.unwrap();
    if std::env::var_os("PGBUS_SCALE_EXPLAIN").is_some() {
        // Where the time goes: the backlog's count and the last minute's, apart.
        let plan = client
            .query(
                &format!(
                    "EXPLAIN (ANALYZE, BUFFERS) {}",
                    pgbus::__private::sql::STATUS_SUBSCRIPTIONS
                ),
                &[
                    &None::<String>,
                    &admin::RECENT_EVENTS_CAP,
                    &admin::RECENT_PROBES_CAP,
                ],
            )
            .await
            .unwrap();
        for row in plan {
            println!("{}", row.get::<_, String>(0));
        }
    }
    assert_eq!(status.subscriptions.len() as i64, subs);
    let pending: i64 = status.subscriptions.iter().map(|s| s.pending).sum();
    let finished = recent - pending;
    let t = Instant::now();
    let one = admin::subscription_status(&client, "sub1").await.unwrap();
    report("status of one subscription", t);
    let t = Instant::now();
    let throughput = admin::delivered_recently(&client, Duration::from_secs(60), 2_000)
        .await
        .unwrap();
    report("delivered_recently (60 s, 2,000 events)", t);
    let total: i64 = status
        .subscriptions
        .iter()
        .map(|s| s.done_last_minute)
        .sum();
    let seen = status
        .subscriptions
        .iter()
        .filter(|s| s.done_last_minute > 0)
        .count();
    println!(
        "done in the last minute: {total} in all (truly {finished}), by {seen} subscriptions; \
         sub1 {}; throughput sample {}",
        one.done_last_minute,
        throughput.delivered.iter().map(|(_, n)| n).sum::<i64>()
    );
    // Beyond the caps the counts are estimates, and say so; over every subscription the
    // even sample lands near the truth.
    if recent > admin::RECENT_EVENTS_CAP {
        assert!(status.subscriptions.iter().all(|s| s.done_estimated));
        assert!(one.done_estimated);
        assert!(throughput.capped);
        let off = (total - finished).abs() as f64 / finished as f64;
        assert!(off < 0.25, "estimated {total}, truly {finished}");
    }
}

/// When every event matches many subscriptions, the probes stay bounded too: 50
/// subscriptions matching each of 1,500 events of the last minute (75,000 pairs, under
/// the events' cap but over the probes'), and the counts say they are estimates.
#[tokio::test]
async fn status_bounds_the_probes_of_widely_matched_events() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, created_at)
             SELECT 'wide' || i, ARRAY['t.*'], now() - interval '1 hour'
             FROM generate_series(1, 50) AS i;
             INSERT INTO pgbus.events (event_name) SELECT 't.x' FROM generate_series(1, 1500);",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute(
            "DELETE FROM pgbus.deliveries WHERE hashint8(event_seq) % 2 = 0;
             ANALYZE pgbus.deliveries; ANALYZE pgbus.events;",
        )
        .await
        .unwrap();
    let truth: i64 = client
        .query_one(
            "SELECT count(*) FROM pgbus.events AS e
             WHERE NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                               WHERE d.subscription = 'wide1' AND d.event_seq = e.seq)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    const { assert!(1500 * 50 > admin::RECENT_PROBES_CAP && 1500 <= admin::RECENT_EVENTS_CAP) };
    let status = admin::status(&client).await.unwrap();
    for s in &status.subscriptions {
        assert!(s.done_estimated, "{s:?}");
        let off = (s.done_last_minute - truth).abs() as f64 / truth as f64;
        assert!(
            off < 0.3,
            "{}: estimated {}, truly {truth}",
            s.name,
            s.done_last_minute
        );
    }
    // One subscription alone: its 1,500 pairs are under the cap, counted exactly.
    let one = admin::subscription_status(&client, "wide1").await.unwrap();
    assert!(!one.done_estimated);
    assert_eq!(one.done_last_minute, truth);
}
