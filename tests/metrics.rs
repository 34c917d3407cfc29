//! Metrics against a real PostgreSQL: the counters and histograms of a real run, and the
//! backlog gauges of a seeded backlog, read from `metrics-util`'s debugging recorder.
//!
//! Each test installs its own recorder for its thread (`set_default_local_recorder`);
//! `#[tokio::test]` runs the bus's tasks on that one thread, so every metric the bus
//! records reaches that recorder, and tests running at once do not mix.

mod common;
#[path = "shared/logs.rs"]
mod logs;

use std::collections::HashMap;
use std::time::Duration;

use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use pgbus::metrics::{self as m, Backlog};
use pgbus::{Bus, Event, HandlerError, RetryPolicy, SubscriptionOptions};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// What the recorder saw so far. A snapshot drains the recorder (counters and gauges
/// reset, histograms emptied), so the readings are accumulated here.
struct Seen {
    snapshotter: Snapshotter,
    counters: HashMap<String, u64>,
    /// The last non-zero value of each gauge.
    gauges: HashMap<String, f64>,
    histograms: HashMap<String, Vec<f64>>,
}

/// `name{label=value,...}`, labels sorted.
fn key(k: &CompositeKey) -> String {
    let mut labels: Vec<String> = k
        .key()
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", k.key().name(), labels.join(","))
}

impl Seen {
    fn new(snapshotter: Snapshotter) -> Seen {
        Seen {
            snapshotter,
            counters: HashMap::new(),
            gauges: HashMap::new(),
            histograms: HashMap::new(),
        }
    }

    fn read(&mut self) {
        for (k, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let name = key(&k);
            match value {
                DebugValue::Counter(n) => *self.counters.entry(name).or_default() += n,
                DebugValue::Gauge(v) if v.0 != 0.0 => {
                    self.gauges.insert(name, v.0);
                }
                DebugValue::Gauge(_) => {}
                DebugValue::Histogram(values) => self
                    .histograms
                    .entry(name)
                    .or_default()
                    .extend(values.into_iter().map(|v| v.0)),
            }
        }
    }

    fn counter(&mut self, name: &str) -> u64 {
        self.read();
        self.counters.get(name).copied().unwrap_or(0)
    }

    fn histogram(&mut self, name: &str) -> Vec<f64> {
        self.read();
        self.histograms.get(name).cloned().unwrap_or_default()
    }

    fn gauge(&mut self, name: &str) -> f64 {
        self.read();
        self.gauges.get(name).copied().unwrap_or(0.0)
    }
}

/// A debugging recorder installed for this thread (until the guard drops), and what it
/// sees.
fn recording() -> (Seen, metrics::LocalRecorderGuard<'static>) {
    // Leaked: the guard borrows it for the rest of the test.
    let recorder: &'static DebuggingRecorder = Box::leak(Box::new(DebuggingRecorder::new()));
    let seen = Seen::new(recorder.snapshotter());
    (seen, metrics::set_default_local_recorder(recorder))
}

async fn wait_counter(seen: &mut Seen, name: &str, expected: u64) {
    let seen = std::sync::Mutex::new(seen);
    common::wait_for(&format!("{name} to reach {expected}"), WAIT, || {
        let n = seen.lock().unwrap().counter(name);
        assert!(n <= expected, "{name} went past {expected}: {n}");
        async move { n == expected }
    })
    .await;
}

#[tokio::test]
async fn a_real_run_counts_publishes_acks_retries_dead_letters_and_lease_expiries() {
    let (mut seen, _local) = recording();
    let db = common::test_db().await;
    let client = db.connect().await;
    // A delivery of a subscription no bus consumes, leased to a worker that is gone: the
    // running bus's reaper returns it.
    pgbus::admin::register_subscription(&client, "orphan", &["orphan.*"], 25)
        .await
        .unwrap();
    pgbus::publish(&client, &Event::new("orphan.left", json!({})))
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'processing', attempts = 1, \
             locked_by = 'gone', locked_until = now() - interval '1 second'",
        )
        .await
        .unwrap();

    let retry = RetryPolicy::fixed(Duration::from_millis(20)).max_attempts(3);
    let running = Bus::builder(db.config())
        .handler_fn("ok", ["m.ok"], |_e: Event| async { Ok(()) })
        .handler_fn_with(
            "bad",
            ["m.bad"],
            SubscriptionOptions::new().retry(retry),
            |_e: Event| async { Err(HandlerError::new("no")) },
        )
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();

    let oks: Vec<Event> = (0..5)
        .map(|i| Event::new("m.ok", json!({ "i": i })))
        .collect();
    assert_eq!(pgbus::publish_batch(&client, &oks).await.unwrap(), 5);
    pgbus::publish(&client, &Event::new("m.bad", json!({})).id("bad-1"))
        .await
        .unwrap();
    // The same id again is a duplicate: not counted.
    pgbus::publish(&client, &Event::new("m.bad", json!({})).id("bad-1"))
        .await
        .unwrap();

    wait_counter(
        &mut seen,
        "pgbus_deliveries_total{outcome=acked,subscription=ok}",
        5,
    )
    .await;
    wait_counter(
        &mut seen,
        "pgbus_deliveries_total{outcome=dead,subscription=bad}",
        1,
    )
    .await;
    wait_counter(&mut seen, "pgbus_leases_expired_total{}", 1).await;
    assert_eq!(
        seen.counter("pgbus_deliveries_total{outcome=failed,subscription=bad}"),
        2,
        "two failed attempts retried before the third died"
    );
    assert_eq!(seen.counter("pgbus_published_events_total{}"), 7);
    for outcome in ["released", "stale"] {
        for sub in ["ok", "bad"] {
            assert_eq!(
                seen.counter(&format!(
                    "pgbus_deliveries_total{{outcome={outcome},subscription={sub}}}"
                )),
                0
            );
        }
    }
    // The counters and the bus's Stats count the same facts.
    let stats = running.stats();
    assert_eq!(
        (
            stats.delivered,
            stats.failed,
            stats.dead_lettered,
            stats.reaped
        ),
        (5, 3, 1, 1)
    );
    assert_eq!(
        seen.counter("pgbus_wakeups_total{source=catch-up}"),
        1,
        "one catch-up after the listener connected"
    );
    assert_eq!(
        seen.counter("pgbus_wakeups_total{source=notify}"),
        stats.wakeups_by_notification
    );
    assert_eq!(
        seen.counter("pgbus_wakeups_total{source=poll}"),
        stats.wakeups_by_poll
    );

    let ran = seen.histogram("pgbus_handler_duration_seconds{outcome=acked,subscription=ok}");
    assert_eq!(ran.len(), 5, "{ran:?}");
    let failed = seen.histogram("pgbus_handler_duration_seconds{outcome=failed,subscription=bad}");
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert!(ran.iter().chain(&failed).all(|s| (0.0..5.0).contains(s)));
    let lag = seen.histogram("pgbus_delivery_lag_seconds{subscription=ok}");
    assert_eq!(lag.len(), 5, "{lag:?}");
    assert!(
        lag.iter().all(|s| (0.0..WAIT.as_secs_f64()).contains(s)),
        "{lag:?}"
    );
    let batches = seen.histogram("pgbus_claim_batch_size{}");
    let claims = seen.histogram("pgbus_claim_duration_seconds{}");
    assert_eq!(batches.len(), claims.len());
    assert_eq!(
        batches.len() as u64,
        running.stats().claims,
        "one record per claim"
    );
    assert_eq!(
        batches.iter().sum::<f64>(),
        8.0,
        "5 acked and 3 attempts claimed"
    );
    running.shutdown().await.unwrap();
}

/// Seeds, through SQL, every state the gauges count:
///
/// - `g_plain`: 3 due (the oldest due 100 s ago), 2 scheduled in an hour, 1 processing,
///   1 dead;
/// - `g_ordered` (ordered): key `k1` with a dead head and 2 deliveries behind it (due but
///   blocked), key `k2` with its head processing (another worker's live lease) and 1
///   behind it, and one unkeyed event scheduled in an hour.
async fn seed_every_state(client: &tokio_postgres::Client) {
    pgbus::admin::register_subscription(client, "g_plain", &["g.plain"], 25)
        .await
        .unwrap();
    pgbus::admin::register_subscription(client, "g_ordered", &["g.ordered"], 25)
        .await
        .unwrap();
    pgbus::ordering::set_ordering(client, "g_ordered", true, pgbus::DeadHeadPolicy::Block)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload) SELECT 'g.plain', '{}' FROM \
             generate_series(1, 5); INSERT INTO pgbus.events (event_name, payload, \
             available_at) SELECT 'g.plain', '{}', now() + interval '1 hour' FROM \
             generate_series(1, 2); INSERT INTO pgbus.events (event_name, payload, \
             ordering_key) SELECT 'g.ordered', '{}', k FROM \
             unnest(ARRAY['k1','k1','k1','k2','k2']) AS k; INSERT INTO pgbus.events \
             (event_name, payload, available_at) VALUES ('g.ordered', '{}', now() + interval \
             '1 hour')",
        )
        .await
        .unwrap();
    // The deliveries the bus makes of them, then their states.
    common::fan_out(client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET available_at = now() - interval '100 seconds' WHERE \
             subscription = 'g_plain' AND event_seq = (SELECT min(event_seq) FROM \
             pgbus.deliveries WHERE subscription = 'g_plain'); UPDATE pgbus.deliveries SET \
             status = 'processing', attempts = 1, locked_by = 'other', locked_until = now() + \
             interval '1 hour' WHERE subscription = 'g_plain' AND event_seq = (SELECT \
             max(event_seq) FROM pgbus.deliveries WHERE subscription = 'g_plain' AND \
             available_at <= now()); UPDATE pgbus.deliveries SET status = 'dead', attempts = \
             25 WHERE subscription = 'g_plain' AND event_seq = (SELECT max(event_seq) FROM \
             pgbus.deliveries WHERE subscription = 'g_plain' AND status = 'pending' AND \
             available_at <= now()); UPDATE pgbus.deliveries SET status = 'dead', attempts = \
             25 WHERE subscription = 'g_ordered' AND ordering_key = 'k1' AND is_head; UPDATE \
             pgbus.deliveries SET status = 'processing', attempts = 1, locked_by = 'other', \
             locked_until = now() + interval '1 hour' WHERE subscription = 'g_ordered' AND \
             ordering_key = 'k2' AND is_head",
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn the_gauges_report_a_seeded_backlog() {
    let (mut seen, _local) = recording();
    let db = common::test_db().await;
    let client = db.connect().await;
    seed_every_state(&client).await;

    let sampled = pgbus::admin::backlog(&client, Some(&["g_plain", "g_ordered"]))
        .await
        .unwrap();
    let [ordered, plain] = &sampled[..] else {
        panic!("two rows expected: {sampled:?}");
    };
    let age = plain.oldest_due_age.expect("g_plain has due deliveries");
    assert!((100.0..130.0).contains(&age), "oldest due age {age}");
    let mut expected = vec![
        (ordered, ("g_ordered", 3, 1, 1, 1, 1)),
        (plain, ("g_plain", 3, 2, 1, 1, 0)),
    ];
    for (got, (name, due, scheduled, processing, dead, blocked)) in expected.drain(..) {
        assert_eq!(
            (
                got.subscription.as_str(),
                got.due,
                got.scheduled,
                got.processing,
                got.dead,
                got.blocked_keys
            ),
            (name, due, scheduled, processing, dead, blocked),
            "{got:?}"
        );
    }
    assert_eq!(
        ordered.oldest_due_age, None,
        "nothing of g_ordered can be claimed: its due deliveries wait behind their heads"
    );
    // Every subscription when none is named.
    let all = pgbus::admin::backlog(&client, None).await.unwrap();
    let names = |b: &[Backlog]| -> Vec<(String, i64)> {
        b.iter().map(|x| (x.subscription.clone(), x.due)).collect()
    };
    assert_eq!(names(&all), names(&sampled));

    // Recorded as gauges by hand (what `pgbus metrics` does)...
    plain.record();
    assert_eq!(
        seen.gauge("pgbus_backlog{state=due,subscription=g_plain}"),
        3.0
    );
    assert_eq!(
        seen.gauge("pgbus_backlog{state=scheduled,subscription=g_plain}"),
        2.0
    );
    let age = seen.gauge("pgbus_oldest_due_age_seconds{subscription=g_plain}");
    assert!((100.0..130.0).contains(&age), "oldest due age {age}");

    // ...and by a running bus on its maintenance tick, for its own subscriptions. Nothing
    // of g_ordered is claimable, so the bus leaves its backlog as seeded.
    let mut bus = Bus::builder(db.config())
        .gauge_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let _stream = bus
        .subscribe_with("g_ordered", ["g.ordered"], SubscriptionOptions::new())
        .unwrap();
    let running = bus.start().await.unwrap();
    let expected = [
        ("pgbus_backlog{state=due,subscription=g_ordered}", 3.0),
        ("pgbus_backlog{state=scheduled,subscription=g_ordered}", 1.0),
        (
            "pgbus_backlog{state=processing,subscription=g_ordered}",
            1.0,
        ),
        ("pgbus_backlog{state=dead,subscription=g_ordered}", 1.0),
        ("pgbus_blocked_keys{subscription=g_ordered}", 1.0),
    ];
    let seen = std::sync::Mutex::new(&mut seen);
    common::wait_for("the bus to sample g_ordered's gauges", WAIT, || {
        let mut seen = seen.lock().unwrap();
        let all = expected.iter().all(|(name, v)| seen.gauge(name) == *v);
        async move { all }
    })
    .await;
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen.gauge("pgbus_oldest_due_age_seconds{subscription=g_ordered}"),
        0.0
    );
    assert_eq!(
        seen.gauge("pgbus_backlog{state=due,subscription=g_plain}"),
        3.0,
        "the bus samples only its own subscriptions"
    );
    running.shutdown().await.unwrap();
}

/// A session idle in transaction holds the xmin horizon back: the bus's gauge reads its
/// age, the bus warns once past its threshold (set low here), `status` names it; once it
/// ends, it is gone from them.
#[tokio::test]
async fn a_long_transaction_is_a_gauge_a_warning_and_a_status() {
    let (mut seen, _local) = recording();
    let (logs, _logging) = logs::LogBuffer::scoped("pgbus=info");
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut config = db.config();
    config.application_name("long reader");
    let (holder, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    // A transaction id, kept: the horizon stays where it was until the transaction ends.
    holder
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .await
        .unwrap();

    let running = Bus::builder(db.config())
        .gauge_interval(Some(Duration::from_millis(200)))
        .long_transaction_warning(Some(Duration::from_secs(1)))
        .handler_fn("lt", ["lt.*"], |_e: Event| async { Ok(()) })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let warning = "pgbus sees a long transaction holding the xmin horizon back";
    let seen = std::sync::Mutex::new(&mut seen);
    common::wait_for("the gauge past 1 s and the warning", WAIT, || {
        let age = seen
            .lock()
            .unwrap()
            .gauge("pgbus_oldest_transaction_age_seconds{}");
        let warned = logs.count(warning) > 0;
        async move { age > 1.0 && warned }
    })
    .await;
    let line = logs
        .lines()
        .into_iter()
        .find(|l| l.contains(warning))
        .unwrap();
    assert!(line.contains("long reader"), "{line}");
    assert!(line.contains("idle in transaction"), "{line}");

    let status = pgbus::admin::status(&client).await.unwrap();
    let age = status.horizon.oldest_transaction_age.unwrap();
    assert!(age > 1.0, "{:?}", status.horizon);
    let held_by = status.horizon.oldest_transaction.as_deref().unwrap();
    assert!(held_by.contains("long reader"), "{held_by}");

    holder.batch_execute("ROLLBACK").await.unwrap();
    common::wait_for("the horizon to be released", WAIT, || async {
        let horizon = pgbus::admin::xmin_horizon(&client).await.unwrap();
        !horizon
            .oldest_transaction
            .is_some_and(|t| t.contains("long reader"))
    })
    .await;
    running.shutdown().await.unwrap();
    assert_eq!(logs.count(warning), 1, "rate-limited: one a minute");
}

/// The gauges' statement reads indexes only, never every delivery, whatever the backlog.
#[tokio::test]
async fn the_gauge_statement_uses_its_indexes_whatever_the_backlog() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let subs = ["big".to_string(), "small".to_string()];
    pgbus_testkit::bench::seed_backlog(&client, &subs[..1], "big.x", 100_000)
        .await
        .unwrap();
    pgbus_testkit::bench::seed_keyed_backlog(&client, &subs[1..], "small.x", 10, 3)
        .await
        .unwrap();
    let rows = client
        .query(
            &format!("EXPLAIN (FORMAT JSON) {}", backlog_body(&client).await),
            &[&None::<Vec<String>>, &m::GAUGE_COUNT_CAP],
        )
        .await
        .unwrap();
    let plan: serde_json::Value = rows[0].get(0);
    let text = plan.to_string();
    // Dead letters through either of their partial indexes (the planner picks by their
    // sizes): both hold dead letters only.
    for index in [
        "deliveries_ready_idx",
        "deliveries_key_idx",
        "deliveries_dead_",
        "deliveries_reap_idx",
    ] {
        assert!(text.contains(index), "{index} not used: {text}");
    }
    assert!(
        !seq_scans_deliveries(&plan),
        "the gauge statement scans every delivery: {text}"
    );
    let sampled: Vec<Backlog> = pgbus::admin::backlog(&client, None).await.unwrap();
    assert_eq!(sampled[0].due, 100_000.min(m::GAUGE_COUNT_CAP));
    assert_eq!(sampled[1].due, 10);
}

/// The statement `pgbus.backlog` runs (its parameters `$1`, `$2`), to EXPLAIN it: the
/// function's own plan is a function scan.
async fn backlog_body(client: &tokio_postgres::Client) -> String {
    client
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE oid = 'pgbus.backlog(text[], bigint)'::regprocedure",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Whether a plan has a sequential scan of `pgbus.deliveries`.
fn seq_scans_deliveries(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(map) => {
            let seq = map.get("Node Type").and_then(|k| k.as_str()) == Some("Seq Scan")
                && map.get("Relation Name").and_then(|k| k.as_str()) == Some("deliveries");
            seq || map.values().any(seq_scans_deliveries)
        }
        serde_json::Value::Array(items) => items.iter().any(seq_scans_deliveries),
        _ => false,
    }
}

/// The gauges' statement at a large backlog: its plan (EXPLAIN ANALYZE) and how long it
/// takes, for BENCHMARKS.md. Not run by default (it seeds a million deliveries):
///
/// ```text
/// PGBUS_GAUGE_BACKLOG=1000000 cargo test --release -p pgbus --test metrics -- \
///     --ignored --nocapture the_gauge_statement_at_a_large_backlog
/// ```
#[tokio::test]
#[ignore = "a benchmark: seeds PGBUS_GAUGE_BACKLOG deliveries (default 1,000,000)"]
async fn the_gauge_statement_at_a_large_backlog() {
    let backlog: u64 = std::env::var("PGBUS_GAUGE_BACKLOG")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let db = common::test_db().await;
    let client = db.connect().await;
    let subs = ["bench".to_string(), "bench_ordered".to_string()];
    pgbus_testkit::bench::seed_backlog(&client, &subs[..1], "bench.x", backlog)
        .await
        .unwrap();
    pgbus_testkit::bench::seed_keyed_backlog(&client, &subs[1..], "bench.y", backlog, 1000)
        .await
        .unwrap();
    let server: String = client
        .query_one("SELECT version()", &[])
        .await
        .unwrap()
        .get(0);
    println!("{server}; {backlog} pending deliveries in each of {subs:?}");
    for (what, cap) in [("capped", Some(m::GAUGE_COUNT_CAP)), ("exact", None)] {
        for named in [Some(vec!["bench"]), Some(vec!["bench_ordered"]), None] {
            // The function's statement, as the function runs it: without JIT.
            client.batch_execute("SET jit = off").await.unwrap();
            let explain = format!(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {}",
                backlog_body(&client).await
            );
            let plan = client.query(&explain, &[&named, &cap]).await.unwrap();
            client.batch_execute("RESET jit").await.unwrap();
            let mut times = Vec::new();
            for _ in 0..5 {
                let started = std::time::Instant::now();
                client
                    .query(pgbus_testkit::sql::BACKLOG, &[&named, &cap])
                    .await
                    .unwrap();
                times.push(started.elapsed());
            }
            times.sort();
            println!(
                "\n== {what} counts, subscriptions {named:?}: median {:?} of 5 (min {:?}, max {:?})",
                times[2], times[0], times[4]
            );
            for row in plan {
                println!("{}", row.get::<_, String>(0));
            }
        }
    }
}
