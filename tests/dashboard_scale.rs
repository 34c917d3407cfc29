//! The dashboard's reads (`pgbus ui`) at a large backlog: how long each admin function
//! takes, and the plans of the ones that read the most, for BENCHMARKS.md ("Dashboard
//! queries"), and what each returns. By default a backlog of 5,000 in each of two
//! subscriptions; the figures in BENCHMARKS.md are at a million:
//!
//! ```text
//! PGBUS_DASHBOARD_BACKLOG=1000000 cargo test -p pgbus --test dashboard_scale -- --nocapture
//! ```

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use pgbus::admin::{self, DeadLetterFilter};

/// Runs `query` 5 times; prints and returns the median.
async fn time<F, Fut, T>(what: &str, mut query: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = pgbus::Result<T>>,
{
    let mut times = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        query().await.unwrap();
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "{what}: median {:?} of 5 (min {:?}, max {:?})",
        times[2], times[0], times[4]
    );
    times[2]
}

/// Prints the plan of `statement` with `params`, as EXPLAIN ANALYZE runs it.
async fn explain(
    client: &tokio_postgres::Client,
    what: &str,
    statement: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) {
    let plan = client
        .query(
            &format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {statement}"),
            params,
        )
        .await
        .unwrap();
    println!("\n== plan of {what}");
    for row in plan {
        println!("{}", row.get::<_, String>(0));
    }
    println!();
}

#[tokio::test]
async fn the_dashboard_queries_at_a_large_backlog() {
    let backlog: u64 = std::env::var("PGBUS_DASHBOARD_BACKLOG")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5_000)
        .max(1_000);
    let db = common::test_db().await;
    let client = db.connect().await;
    let subs = ["bench".to_string(), "bench_ordered".to_string()];
    pgbus_testkit::bench::seed_backlog(&client, &subs[..1], "bench.x", backlog)
        .await
        .unwrap();
    pgbus_testkit::bench::seed_keyed_backlog(&client, &subs[1..], "bench.y", backlog, 1000)
        .await
        .unwrap();
    for n in 0..2 {
        let event =
            pgbus::Event::new("bench.x", serde_json::json!({ "n": n })).correlation_id("corr-1");
        pgbus::publish(&client, &event).await.unwrap();
    }
    // 100 dead letters with 3 failed attempts each, 10 blocked keys, two events of one
    // correlation id, two live consumers.
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 3, last_error = 'boom'
               WHERE subscription = 'bench' AND event_seq <= 100;
             INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
               SELECT 'bench', s, a, 'boom', 'w1' FROM generate_series(1, 100) AS s,
                      generate_series(1, 3) AS a;
             UPDATE pgbus.deliveries SET status = 'dead', attempts = 25, last_error = 'boom'
               WHERE subscription = 'bench_ordered' AND is_head
                 AND ordering_key IN ('k1','k2','k3','k4','k5','k6','k7','k8','k9','k10');
             INSERT INTO pgbus.consumers (id, awake, expires_at, subscriptions, info)
               VALUES ('w1', true, now() + interval '1 hour', '{bench}', 'pid 1 on bench'),
                      ('w2', false, now() + interval '1 hour', '{bench_ordered}', 'pid 2 on bench');",
        )
        .await
        .unwrap();
    for table in ["deliveries", "events", "delivery_failures"] {
        client
            .batch_execute(&format!("VACUUM (ANALYZE) pgbus.{table}"))
            .await
            .unwrap();
    }
    let server: String = client
        .query_one("SELECT version()", &[])
        .await
        .unwrap()
        .get(0);
    println!("{server}; {backlog} pending deliveries in each of {subs:?}\n");
    let c = &client;
    // An event of "bench" in the middle of its backlog (past the 100 dead letters).
    let seq = (backlog / 2) as i64;
    let some_id: String = client
        .query_one("SELECT id FROM pgbus.events WHERE seq = $1", &[&seq])
        .await
        .unwrap()
        .get(0);

    // The overview's sample: what the sampler runs every interval.
    time("overview: backlog (all subscriptions, capped)", || {
        admin::backlog(c, None)
    })
    .await;
    time("overview: delivered_recently (10 s window)", || {
        admin::delivered_recently(c, Duration::from_secs(10), 10_000)
    })
    .await;
    time(
        "overview: delivered_recently (1 h window: every seeded event in it)",
        || admin::delivered_recently(c, Duration::from_secs(3600), 10_000),
    )
    .await;
    time("overview: cluster_status", || admin::cluster_status(c)).await;
    time("overview and consumers page: consumers", || {
        admin::consumers(c)
    })
    .await;
    // A subscription's page.
    time("subscription: subscription_settings", || {
        admin::subscription_settings(c, "bench")
    })
    .await;
    time("subscription: backlog (one, capped)", || {
        admin::backlog(c, Some(&["bench_ordered"]))
    })
    .await;
    let filter = DeadLetterFilter::all().subscription("bench");
    time("subscription: dead_letters (50)", || {
        admin::dead_letters(c, &filter, 50)
    })
    .await;
    let second = admin::dead_letters(c, &filter, 50).await.unwrap()[49].cursor();
    time(
        "subscription: dead_letters_after (the second page of 50)",
        || admin::dead_letters_after(c, &filter, 50, Some(&second)),
    )
    .await;
    time(
        "subscription: pending_deliveries (the first page of 51)",
        || admin::pending_deliveries(c, "bench", None, 51),
    )
    .await;
    // bench_ordered's events come after bench's in the log: its first page is in the
    // middle of the log.
    time(
        "subscription: pending_deliveries (a page of 51 from the middle of the log)",
        || admin::pending_deliveries(c, "bench_ordered", None, 51),
    )
    .await;
    let ordered = DeadLetterFilter::all().subscription("bench_ordered");
    time(
        "subscription: dead_letters (50, from the middle of the log)",
        || admin::dead_letters(c, &ordered, 50),
    )
    .await;
    let seqs: Vec<i64> = (1..=50).collect();
    time("subscription: failure_history (50 dead letters)", || {
        admin::failure_history(c, "bench", &seqs, 2000)
    })
    .await;
    time("subscription: blocked_keys (ordered, 10 blocked)", || {
        pgbus::ordering::blocked_keys(c, Some("bench_ordered"))
    })
    .await;
    // An event's page.
    time("event: find_events by id", || {
        admin::find_events(c, &some_id, 20)
    })
    .await;
    time("event: find_events by correlation id", || {
        admin::find_events(c, "corr-1", 20)
    })
    .await;
    time("event: event_deliveries", || {
        admin::event_deliveries(c, seq)
    })
    .await;
    let one = [seq];
    time("event: failure_history (one delivery)", || {
        admin::failure_history(c, "bench", &one, 2000)
    })
    .await;

    // What the reads return, at any size of backlog.
    assert_eq!(admin::consumers(c).await.unwrap().len(), 2);
    assert_eq!(admin::dead_letters(c, &filter, 50).await.unwrap().len(), 50);
    let first = admin::pending_deliveries(c, "bench", None, 51)
        .await
        .unwrap();
    assert_eq!(first.len(), 51, "a full page of the backlog");
    assert!(
        first.windows(2).all(|w| w[0].event_seq < w[1].event_seq),
        "in event order"
    );
    let next = admin::pending_deliveries(c, "bench", Some(first[50].event_seq), 51)
        .await
        .unwrap();
    assert!(
        next[0].event_seq > first[50].event_seq,
        "the next page follows"
    );
    let history = admin::failure_history(c, "bench", &seqs, 2000)
        .await
        .unwrap();
    assert_eq!(
        history.len(),
        150,
        "3 failed attempts of each of 50 dead letters"
    );
    let blocked = pgbus::ordering::blocked_keys(c, Some("bench_ordered"))
        .await
        .unwrap();
    assert_eq!(blocked.len(), 10);
    assert_eq!(admin::find_events(c, "corr-1", 20).await.unwrap().len(), 2);
    let found = admin::find_events(c, &some_id, 20).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].id, some_id);
    let standing: Vec<(String, String)> = admin::event_deliveries(c, seq)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.subscription, d.status))
        .collect();
    assert_eq!(standing, [("bench".to_string(), "pending".to_string())]);

    explain(
        c,
        "EVENT_BY_ID",
        pgbus_testkit::sql::EVENT_BY_ID,
        &[&some_id],
    )
    .await;
    let sql = pgbus_testkit::sql::EVENTS_BY_CORRELATION;
    explain(c, "EVENTS_BY_CORRELATION", sql, &[&"corr-1", &20i64]).await;
    explain(
        c,
        "DELIVERED_RECENTLY (10 s)",
        pgbus_testkit::sql::DELIVERED_RECENTLY,
        &[&10.0f64, &10_000i64, &10_000i64],
    )
    .await;
    explain(
        c,
        "DELIVERED_RECENTLY (1 h)",
        pgbus_testkit::sql::DELIVERED_RECENTLY,
        &[&3600.0f64, &10_000i64, &10_000i64],
    )
    .await;
    explain(
        c,
        "BLOCKED_KEYS",
        pgbus_testkit::sql::BLOCKED_KEYS,
        &[&Some("bench_ordered")],
    )
    .await;
    explain(
        c,
        "EVENT_DELIVERIES",
        pgbus_testkit::sql::EVENT_DELIVERIES,
        &[&seq],
    )
    .await;
}
