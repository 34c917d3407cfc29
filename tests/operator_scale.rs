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

#[tokio::test]
async fn operator_queries_are_set_based_and_bounded() {
    let subs = size("PGBUS_SCALE_SUBSCRIPTIONS", 1_000);
    let deliveries = size("PGBUS_SCALE_DELIVERIES", 20_000);
    let dead = size("PGBUS_SCALE_DEAD", 5_000).min(deliveries);
    let db = common::test_db().await;
    let client = db.connect().await;
    let started = Instant::now();
    client
        .execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, created_at)
             SELECT 'sub' || i, ARRAY['svc' || i || '.*'], now() - interval '1 hour'
             FROM generate_series(1, $1::int8) AS i",
            &[&subs],
        )
        .await
        .unwrap();
    // Older than the last minute, spread over every subscription, in batches.
    let mut done = 0;
    while done < deliveries {
        let n = (deliveries - done).min(100_000);
        client
            .execute(
                "INSERT INTO pgbus.events (event_name, created_at)
                 SELECT 'svc' || (1 + (($1::int8 + i) % $2::int8)) || '.x',
                        now() - interval '10 minutes'
                 FROM generate_series(1, $3::int8) AS i",
                &[&done, &subs, &n],
            )
            .await
            .unwrap();
        done += n;
    }
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
            "INSERT INTO pgbus.events (event_name) SELECT 'svc1.y' FROM generate_series(1, 10);
             DELETE FROM pgbus.deliveries WHERE event_seq IN
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
