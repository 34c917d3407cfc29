//! Ordered subscriptions: per-key order without blocking other keys.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use pgbus::{
    Bus, DeadHeadPolicy, Error, Event, HandlerError, RetryPolicy, RunningBus, SubscriptionOptions,
};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

async fn count(client: &impl tokio_postgres::GenericClient, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Registers the ordered subscription "o" without running a bus.
async fn ordered_subscription(client: &tokio_postgres::Client) {
    pgbus::admin::register_subscription(client, "o", &["*"], 25)
        .await
        .unwrap();
    pgbus::ordering::set_ordering(client, "o", true, DeadHeadPolicy::Block)
        .await
        .unwrap();
}

fn ordered() -> SubscriptionOptions {
    SubscriptionOptions::new().ordered(true)
}

/// Keys whose head count is not exactly one while they have pending deliveries.
async fn head_violations(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM (
           SELECT 1 FROM pgbus.deliveries WHERE ordering_key IS NOT NULL
           GROUP BY subscription, ordering_key
           HAVING count(*) FILTER (WHERE is_head) <> 1
              AND count(*) FILTER (WHERE status <> 'dead') > 0) AS v",
    )
    .await
}

/// Handler starts per key, in the order they happened: (n, attempt).
type Starts = Arc<Mutex<HashMap<String, Vec<i64>>>>;

struct Stress {
    published: BTreeMap<String, i64>,
    publish_errors: usize,
    starts: HashMap<String, Vec<i64>>,
    head_violations: i64,
    drained: bool,
    /// Keys the buses' repair check found without a head.
    repaired: u64,
}

/// 8 publishers over 200 keys, 8 consumers, 20% of attempts failing with backoff, and
/// leases taken away from running handlers now and then.
async fn stress(db: &common::TestDb, key_locks: bool) -> Stress {
    let config = db.config();
    if !key_locks {
        // The negative control: this database's key locks do nothing. No setting can do
        // this; only the schema's owner, by replacing the function.
        db.connect()
            .await
            .batch_execute(
                "CREATE OR REPLACE FUNCTION pgbus.lock_keys(subs text[], keys text[]) \
                 RETURNS void LANGUAGE sql AS 'SELECT'",
            )
            .await
            .unwrap();
    }
    let starts: Starts = Default::default();
    let mut buses: Vec<RunningBus> = Vec::new();
    for _ in 0..8 {
        let s = starts.clone();
        let bus = Bus::builder(config.clone())
            .concurrency(4)
            .batch_size(10)
            .poll_interval(Duration::from_millis(200))
            .pool_size(2)
            .handler_fn_with(
                "ordered",
                ["*"],
                ordered().retry(RetryPolicy::fixed(Duration::from_millis(15)).max_attempts(1000)),
                move |e| {
                    let key = format!(
                        "{}:{}",
                        e.aggregate_type.as_deref().unwrap_or_default(),
                        e.aggregate_id.as_deref().unwrap_or_default()
                    );
                    let n = e.payload["n"].as_i64().unwrap_or(-1);
                    s.lock().unwrap().entry(key).or_default().push(n);
                    let fail = fastrand::u8(0..5) == 0;
                    let slow = fastrand::u8(0..20) == 0;
                    async move {
                        if slow {
                            tokio::time::sleep(Duration::from_millis(30)).await;
                        }
                        if fail {
                            Err(HandlerError::new("chance"))
                        } else {
                            Ok(())
                        }
                    }
                },
            )
            .build()
            .unwrap()
            .start()
            .await
            .unwrap();
        buses.push(bus);
    }

    // Publishers: a key's transactions are serialized by the test (holding the key's
    // mutex across commit), so that "publish order" is well defined; the races left are
    // the ones between publishing and completing that the key locks exist for.
    let key_mutexes: Arc<Vec<tokio::sync::Mutex<i64>>> =
        Arc::new((0..200).map(|_| tokio::sync::Mutex::new(0)).collect());
    let publish_errors = Arc::new(Mutex::new(0usize));
    let mut publishers = Vec::new();
    for _ in 0..8 {
        let (config, key_mutexes, publish_errors) =
            (config.clone(), key_mutexes.clone(), publish_errors.clone());
        publishers.push(tokio::spawn(async move {
            let (mut client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(connection);
            for _ in 0..60 {
                let mut keys: Vec<usize> = (0..fastrand::usize(1..=3))
                    .map(|_| fastrand::usize(0..200))
                    .collect();
                keys.sort_unstable();
                keys.dedup();
                let mut guards = Vec::new();
                for k in &keys {
                    guards.push(key_mutexes[*k].lock().await);
                }
                let tx = client.transaction().await.unwrap();
                let mut events = Vec::new();
                for (i, k) in keys.iter().enumerate() {
                    let g = &mut guards[i];
                    let n = **g;
                    **g += 1;
                    events.push(
                        Event::new("step", json!({ "n": n })).aggregate("thing", k.to_string()),
                    );
                }
                let r = pgbus::publish_batch(&tx, &events).await;
                let ok = match r {
                    Ok(_) => tx.commit().await.is_ok(),
                    Err(_) => false,
                };
                if !ok {
                    *publish_errors.lock().unwrap() += 1;
                    // Keep the counters true: this transaction did not happen.
                    for g in guards.iter_mut() {
                        **g -= 1;
                    }
                }
            }
        }));
    }

    // Meanwhile: take leases away from running handlers (as if they outlived them), and
    // watch the head invariant.
    let client = db.connect().await;
    let mut violations = 0;
    loop {
        violations += head_violations(&client).await;
        client
            .batch_execute(
                // Rows a bus holds are skipped: waiting for them could deadlock this
                // statement with the bus's own (with the key locks off, it did).
                "UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second' \
                 WHERE ctid = ANY (ARRAY(SELECT d.ctid FROM pgbus.deliveries AS d \
                                         WHERE d.status = 'processing' AND random() < 0.05 \
                                         FOR UPDATE SKIP LOCKED))",
            )
            .await
            .unwrap();
        if publishers.iter().all(|p| p.is_finished()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // sampling period
    }
    for p in publishers {
        p.await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    let mut drained = false;
    while tokio::time::Instant::now() < deadline {
        violations += head_violations(&client).await;
        if count(&client, common::WORK_LEFT).await == 0 {
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await; // sampling period
    }
    let mut repaired = 0;
    for bus in buses {
        repaired += bus.stats().repaired;
        bus.shutdown().await.unwrap();
    }
    let published = key_mutexes
        .iter()
        .enumerate()
        .map(|(k, m)| (k.to_string(), *m.try_lock().unwrap()))
        .filter(|(_, n)| *n > 0)
        .collect();
    let starts = starts.lock().unwrap().clone();
    let publish_errors = *publish_errors.lock().unwrap();
    Stress {
        published,
        publish_errors,
        starts,
        head_violations: violations,
        drained,
        repaired,
    }
}

/// Handler starts of one key must follow publish order: never a step ahead of one that
/// has not completed. Re-runs of a step (failures, lost leases) repeat it in place.
fn order_violations(starts: &HashMap<String, Vec<i64>>) -> usize {
    let mut violations = 0;
    for seen in starts.values() {
        let mut max = -1;
        for &n in seen {
            if n > max + 1 || n < max {
                violations += 1;
            }
            max = max.max(n);
        }
    }
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_every_key_completes_in_publish_order() {
    let db = common::test_db().await;
    let s = stress(&db, true).await;
    let runs: usize = s.starts.values().map(Vec::len).sum();
    let events: i64 = s.published.values().sum();
    println!(
        "with key locks: {events} events over {} keys, {runs} handler runs",
        s.published.len()
    );
    assert!(s.drained, "deliveries left behind");
    assert_eq!(s.publish_errors, 0);
    assert_eq!(s.head_violations, 0, "a key had two heads or none");
    assert_eq!(s.repaired, 0, "a key was left without a head");
    assert_eq!(order_violations(&s.starts), 0, "{:?}", s.starts);
    for (key, n) in &s.published {
        let mut seen: Vec<i64> = s.starts[&format!("thing:{key}")].clone();
        seen.dedup();
        assert_eq!(seen, (0..*n).collect::<Vec<_>>(), "key {key}");
    }
}

/// Proof that the stress test can fail: without the per-key locks, publishers and
/// completions race and the invariants break.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_without_the_key_locks_detects_violations() {
    let db = common::test_db().await;
    let s = stress(&db, false).await;
    let found = s.publish_errors as i64
        + s.head_violations
        + i64::from(!s.drained)
        + s.repaired as i64
        + order_violations(&s.starts) as i64;
    println!(
        "without key locks: {} failed publishes, {} head violations, {} repairs, drained: {}, order violations: {}",
        s.publish_errors,
        s.head_violations,
        s.repaired,
        s.drained,
        order_violations(&s.starts)
    );
    // The stress above meets the race by chance (it usually does); this plays it once
    // for certain, on the same database and with the same check, so that the test fails
    // only if the check cannot see what the key locks prevent.
    let forced = settle_racing_a_fan_out(&db, false).await;
    assert!(
        forced > 0,
        "the forced race left no violation; the stress found {found}: errors {}, head violations {}, drained {}",
        s.publish_errors,
        s.head_violations,
        s.drained
    );
}

/// Plays the race the key locks exist for, step by step: a fan-out files a key's second
/// delivery behind its head (not a head itself) and stays uncommitted while the head is
/// acknowledged; the settlement cannot see the follower, so it promotes nothing, and when
/// the fan-out commits the key has a pending delivery and no head. With the key locks the
/// acknowledgement waits for the fan-out's commit and promotes the follower. It is
/// played with `key_locks` as the database has them. Returns the head violations (and
/// repairs) it caused.
async fn settle_racing_a_fan_out(db: &common::TestDb, key_locks: bool) -> i64 {
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe_with("race", ["race.*"], ordered()).unwrap();
    let running = bus.start().await.unwrap();
    let head = Event::new("race.step", json!({ "n": 0 })).ordering_key("race");
    pgbus::publish(&client, &head).await.unwrap();
    let head = common::within("the head", WAIT, stream.next())
        .await
        .unwrap();
    // The fan-out, held open: it takes the fan-out lock first, so that no bus files the
    // follower before it does.
    let (mut fan_out, connection) = db.config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let fan_out = fan_out.transaction().await.unwrap();
    fan_out
        .batch_execute("SELECT 1 FROM pgbus.fan_out_lock FOR UPDATE")
        .await
        .unwrap();
    let follower = Event::new("race.step", json!({ "n": 1 })).ordering_key("race");
    pgbus::publish(&client, &follower).await.unwrap();
    let filed = count(
        &fan_out,
        "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'race'",
    )
    .await;
    assert_eq!(filed, 1, "only the head is filed before the fan-out");
    fan_out
        .batch_execute("SELECT pgbus.fan_out_committed()")
        .await
        .unwrap();
    assert_eq!(
        count(
            &fan_out,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'race' AND NOT is_head"
        )
        .await,
        1,
        "the fan-out filed the follower behind the head"
    );
    if key_locks {
        // The acknowledgement waits for the fan-out's key lock (a row of pgbus.key_stripes),
        // then sees the follower.
        let ack = tokio::spawn(head.ack());
        common::wait_for(
            "the acknowledgement to wait for the key lock",
            WAIT,
            || async {
                count(
                    &client,
                    "SELECT count(*) FROM pg_catalog.pg_stat_activity AS a \
                 WHERE a.wait_event_type = 'Lock' AND a.query LIKE '%pgbus.settle(%' \
                   AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks AS l \
                               WHERE l.pid = a.pid AND l.locktype = 'tuple' \
                                 AND l.relation = 'pgbus.key_stripes'::regclass)",
                )
                .await
                    > 0
            },
        )
        .await;
        fan_out.commit().await.unwrap();
        common::within("the head's acknowledgement", WAIT, ack)
            .await
            .unwrap()
            .unwrap();
    } else {
        common::within("the head's acknowledgement", WAIT, head.ack())
            .await
            .unwrap();
        fan_out.commit().await.unwrap();
    }
    let violations = head_violations(&client).await;
    let repaired = running.stats().repaired as i64;
    running.shutdown().await.unwrap();
    violations + repaired
}

#[tokio::test]
async fn a_settle_racing_a_fan_out_of_its_key_waits_and_promotes_the_follower() {
    let db = common::test_db().await;
    assert_eq!(settle_racing_a_fan_out(&db, true).await, 0);
    let client = db.connect().await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries \
             WHERE subscription = 'race' AND is_head AND status IN ('pending', 'processing')"
        )
        .await,
        1,
        "the follower is the key's head"
    );
}

#[tokio::test]
async fn a_backing_off_key_waits_alone_and_resumes_in_order_after_a_redrive() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let seen: Arc<Mutex<Vec<(String, i64)>>> = Default::default();
    let s = seen.clone();
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let running = Bus::builder(db.config())
        .concurrency(8)
        .handler_fn_with("o", ["*"], ordered(), move |e| {
            let key = e.ordering_key.clone().unwrap_or_default();
            let n = e.payload["n"].as_i64().unwrap();
            s.lock().unwrap().push((key.clone(), n));
            let fail = key == "A"
                && n == 0
                && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst);
            async move {
                if fail {
                    Err(HandlerError::retry_after(
                        "not now",
                        Duration::from_secs(3600),
                    ))
                } else {
                    Ok(())
                }
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let a: Vec<Event> = (0..5)
        .map(|n| Event::new("a", json!({ "n": n })).ordering_key("A"))
        .collect();
    pgbus::publish_batch(&client, &a).await.unwrap();
    let others: Vec<Event> = (0..1000)
        .map(|i| Event::new("b", json!({ "n": i / 50 })).ordering_key(format!("K{}", i % 50)))
        .collect();
    pgbus::publish_batch(&client, &others).await.unwrap();
    // Every event turned into deliveries, A's head run once, the other keys drained.
    common::wait_for("the other keys to drain", WAIT, || async {
        count(
            &client,
            "SELECT (SELECT count(*) FROM pgbus.deliveries
                     WHERE ordering_key <> 'A' OR (is_head AND attempts = 0))
                  + (SELECT events FROM pgbus.not_fanned_out(NULL))",
        )
        .await
            == 0
    })
    .await;
    // A's head backs off for an hour; its followers were never started.
    let a_runs: Vec<i64> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "A")
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(a_runs, vec![0]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE ordering_key = 'A' AND attempts = 0 AND NOT is_head"
        )
        .await,
        4
    );
    // The operator retries it now: A runs in order.
    seen.lock().unwrap().clear();
    assert!(
        pgbus::ordering::redrive_head(&client, "o", "A")
            .await
            .unwrap()
    );
    common::wait_for("A to drain", WAIT, || async {
        count(&client, common::WORK_LEFT).await == 0
    })
    .await;
    let a_runs: Vec<i64> = seen.lock().unwrap().iter().map(|(_, n)| *n).collect();
    assert_eq!(a_runs, vec![0, 1, 2, 3, 4]);
    running.shutdown().await.unwrap();
}

/// Handler starts, in the order they happened: the payload's `n`.
type Seen = Arc<Mutex<Vec<i64>>>;

/// Key "order:7" gets n = 0..4, its n = 1 failing permanently; key "order:8" gets n = 100.
/// Returns once the dead letter exists and key 8 has run.
async fn dead_head_case(
    policy: DeadHeadPolicy,
) -> (Seen, tokio_postgres::Client, common::TestDb, RunningBus) {
    let db = common::test_db().await;
    let client = db.connect().await;
    let seen: Seen = Default::default();
    let s = seen.clone();
    let running = Bus::builder(db.config())
        .handler_fn_with("o", ["*"], ordered().on_dead(policy), move |e| {
            let n = e.payload["n"].as_i64().unwrap();
            s.lock().unwrap().push(n);
            async move {
                if n == 1 {
                    Err(HandlerError::permanent("poison"))
                } else {
                    Ok(())
                }
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    let events: Vec<Event> = (0..4)
        .map(|n| Event::new("x", json!({ "n": n })).aggregate("order", "7"))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    pgbus::publish(
        &client,
        &Event::new("x", json!({ "n": 100 })).aggregate("order", "8"),
    )
    .await
    .unwrap();
    common::wait_for("the dead head", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        )
        .await
            == 1
    })
    .await;
    common::wait_for("the other key", WAIT, || async {
        seen.lock().unwrap().contains(&100)
    })
    .await;
    (seen, client, db, running)
}

/// The starts of key "order:7", in order.
fn key_7_runs(seen: &Seen) -> Vec<i64> {
    seen.lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|n| *n < 100)
        .collect()
}

#[tokio::test]
async fn a_dead_head_blocks_only_its_key_until_skipped() {
    let (seen, client, _db, running) = dead_head_case(DeadHeadPolicy::Block).await;
    // Nothing of the key ran past its dead head.
    assert_eq!(key_7_runs(&seen), vec![0, 1]);
    let blocked = pgbus::ordering::blocked_keys(&client, Some("o"))
        .await
        .unwrap();
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0].key, "order:7");
    assert_eq!(blocked[0].waiting, 2);
    assert_eq!(blocked[0].last_error.as_deref(), Some("poison"));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'pending'"
        )
        .await,
        2
    );
    // The operator skips it: the key resumes; the dead letter stays listed.
    assert!(
        pgbus::ordering::skip_head(&client, "o", "order:7")
            .await
            .unwrap()
    );
    common::wait_for("the key to resume", WAIT, || async {
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await == 1
    })
    .await;
    // The followers ran after the skip, once each, in order; the dead head did not run
    // again.
    assert_eq!(key_7_runs(&seen), vec![0, 1, 2, 3]);
    assert!(
        pgbus::ordering::blocked_keys(&client, None)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' AND NOT is_head"
        )
        .await,
        1
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_dead_head_under_skip_lets_its_key_go_on() {
    let (seen, client, _db, running) = dead_head_case(DeadHeadPolicy::Skip).await;
    common::wait_for("the rest of the key", WAIT, || async {
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await == 1
    })
    .await;
    // The followers ran after the dead head, once each, in order, with nobody's help.
    assert_eq!(key_7_runs(&seen), vec![0, 1, 2, 3]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' AND NOT is_head"
        )
        .await,
        1,
        "the skipped dead letter is kept"
    );
    assert!(
        pgbus::ordering::blocked_keys(&client, None)
            .await
            .unwrap()
            .is_empty()
    );
    running.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stale_ack_promotes_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut bus = Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut stream = bus.subscribe_with("o", ["*"], ordered()).unwrap();
    let running = bus.start().await.unwrap();
    let events: Vec<Event> = (0..2)
        .map(|n| Event::new("x", json!({ "n": n })).ordering_key("k"))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    let first = common::within("the head", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(first.event().payload["n"], 0);
    client
        .batch_execute("UPDATE pgbus.deliveries SET locked_until = now() - interval '1 second' WHERE status = 'processing'")
        .await
        .unwrap();
    let again = common::within("the same head again", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(again.event().payload["n"], 0);
    assert_eq!(again.attempt(), 2);
    assert!(matches!(first.ack().await, Err(Error::LeaseLost)));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        1,
        "a stale ack promoted the next delivery"
    );
    again.ack().await.unwrap();
    let next = common::within("the next", WAIT, stream.next())
        .await
        .unwrap();
    assert_eq!(next.event().payload["n"], 1);
    next.ack().await.unwrap();
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_locking_keys_in_opposite_orders_never_deadlock() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_subscription(&client).await;
    let mut tasks = Vec::new();
    for order in [["a", "b"], ["b", "a"]] {
        let config = db.config();
        tasks.push(tokio::spawn(async move {
            let (mut c, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            for i in 0..200 {
                let tx = c.transaction().await.unwrap();
                let events: Vec<Event> = order
                    .iter()
                    .map(|k| Event::new("x", json!(i)).ordering_key(*k))
                    .collect();
                pgbus::publish_batch(&tx, &events).await.unwrap();
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        common::within("the publishers", WAIT, t).await.unwrap();
    }
    common::fan_out(&client).await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        800
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        2
    );
}

#[tokio::test]
async fn turning_ordering_off_frees_every_waiting_delivery() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_subscription(&client).await;
    let events: Vec<Event> = (0..5)
        .map(|n| Event::new("x", json!(n)).ordering_key("k"))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    common::fan_out(&client).await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        1
    );
    pgbus::ordering::set_ordering(&client, "o", false, DeadHeadPolicy::Block)
        .await
        .unwrap();
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE is_head"
        )
        .await,
        5
    );
}

/// Runs the bus's claim of 100 for "o" under `EXPLAIN (ANALYZE, BUFFERS)` in a
/// transaction that is rolled back: (shared buffers touched by the statement, by its
/// choice of deliveries, the plan as text). Hits and reads both count, so the cache state
/// does not matter.
async fn ordered_claim_buffers(client: &mut tokio_postgres::Client) -> (i64, i64, String) {
    let claim = pgbus_testkit::claim_statement(&*client).await.unwrap();
    let tx = client.transaction().await.unwrap();
    let names = vec!["o"];
    let quotas = vec![100_i32];
    let rows = tx
        .query(
            &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {claim}"),
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
    let claimed: i64 = tx
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing' AND locked_by = 'w'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    assert_eq!(claimed, 100, "the claim took a full batch");
    let plan: serde_json::Value = rows[0].get(0);
    let blocks = |node: &serde_json::Value| {
        node["Shared Hit Blocks"].as_i64().unwrap() + node["Shared Read Blocks"].as_i64().unwrap()
    };
    let top = &plan[0]["Plan"];
    let picked = top["Plans"]
        .as_array()
        .and_then(|plans| plans.iter().find(|p| p["Subplan Name"] == "CTE candidates"))
        .unwrap_or_else(|| panic!("no CTE candidates in {plan}"));
    (blocks(top), blocks(picked), plan.to_string())
}

/// Inserts an ordered backlog of "o" straight into the deliveries, due `age` ago (older
/// than anything inserted before, so a claim takes from it first): key `{prefix}0` is
/// `deep` long, keys `{prefix}1..={keys}` are `depth` long each, event seqs from
/// `first_seq`; then the `blocked` oldest heads are made dead or in flight.
async fn ordered_backlog(
    client: &tokio_postgres::Client,
    prefix: &str,
    first_seq: i64,
    age: &str,
    (deep, keys, depth): (i64, i64, i64),
    blocked: i64,
) {
    client
        .execute(
            "INSERT INTO pgbus.deliveries (subscription, event_seq, ordering_key, is_head, key_pos, available_at)
             SELECT 'o', $1::int8 + i, $2::text || '0', i = 1, i, now() - $3::text::interval
             FROM generate_series(1, $4::int8) AS i",
            &[&first_seq, &prefix, &age, &deep],
        )
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO pgbus.deliveries (subscription, event_seq, ordering_key, is_head, key_pos, available_at)
             SELECT 'o', $1::int8 + $4::int8 + i, $2::text || (1 + (i - 1) / $5::int8), (i - 1) % $5::int8 = 0, i, now() - $3::text::interval
             FROM generate_series(1, $6::int8) AS i",
            &[&first_seq, &prefix, &age, &deep, &depth, &(keys * depth)],
        )
        .await
        .unwrap();
    client
        .execute(
            "UPDATE pgbus.deliveries
             SET status = CASE WHEN event_seq % 2 = 0 THEN 'dead' ELSE 'processing' END,
                 locked_until = now() + interval '1 hour'
             WHERE event_seq IN (SELECT event_seq FROM pgbus.deliveries
                                 WHERE is_head AND status = 'pending' AND event_seq > $1::int8
                                 ORDER BY event_seq LIMIT $2::int8)",
            &[&first_seq, &blocked],
        )
        .await
        .unwrap();
    // As vacuum would, in time: the blocked heads' old versions leave the claim's index
    // (a plain VACUUM skips the indexes when so few rows are dead).
    client
        .batch_execute("VACUUM (ANALYZE, INDEX_CLEANUP ON) pgbus.deliveries")
        .await
        .unwrap();
}

/// The ordered claim is O(batch): the buffers a claim of 100 touches stay within 2x + 10
/// from a backlog of 2,000 deliveries to one of 1.2 million over 100,000 keys, one key
/// 200,000 deep behind a dead head, 2,000 heads dead or in flight.
#[tokio::test]
async fn an_ordered_claim_costs_the_same_with_a_deep_backlog() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    ordered_subscription(&client).await;
    // Small: 2,000 deliveries; key a0 1,000 deep, 200 keys 5 deep, 20 heads blocked.
    ordered_backlog(&client, "a", 0, "1 minute", (1_000, 200, 5), 20).await;
    let (small, small_picking, _) = ordered_claim_buffers(&mut client).await;
    // Large, and older, so the claim takes from it: 1,199,990 deliveries; key b0
    // 200,000 deep, 99,999 keys 10 deep, 2,000 heads blocked (b0's among them).
    ordered_backlog(
        &client,
        "b",
        10_000_000,
        "1 hour",
        (200_000, 99_999, 10),
        2_000,
    )
    .await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        2_000 + 1_199_990
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE ordering_key = 'b0' AND is_head AND status <> 'pending'"
        )
        .await,
        1,
        "the deep key's head is blocked"
    );
    let (large, large_picking, plan) = ordered_claim_buffers(&mut client).await;
    println!(
        "ordered claim of 100: {small} buffers ({small_picking} picking) with 2,000 pending, \
         {large} ({large_picking} picking) with 1.2M over 100k keys"
    );
    assert!(
        plan.contains("\"Index Name\":\"deliveries_ready_idx\""),
        "the claim does not use its index: {plan}"
    );
    for (part, small, large) in [
        ("the statement", small, large),
        ("the picking", small_picking, large_picking),
    ] {
        assert!(small > 0, "no buffers counted for {part}");
        assert!(
            large <= 2 * small + 10,
            "{part} touches {large} buffers with the deep backlog, {small} with the small one"
        );
    }
}

#[tokio::test]
async fn a_bus_repairs_a_key_left_without_a_head_when_it_starts() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_subscription(&client).await;
    let events: Vec<Event> = (0..3)
        .map(|n| Event::new("x", json!({ "n": n })).ordering_key("k"))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    common::fan_out(&client).await;
    // Break the invariant by hand: the key loses its head.
    client
        .batch_execute("UPDATE pgbus.deliveries SET is_head = false")
        .await
        .unwrap();
    let seen: Arc<Mutex<Vec<i64>>> = Default::default();
    let s = seen.clone();
    let running = Bus::builder(db.config())
        .handler_fn_with("o", ["*"], ordered(), move |e| {
            s.lock().unwrap().push(e.payload["n"].as_i64().unwrap());
            async { Ok(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for("the repaired key to drain", WAIT, || async {
        count(&client, common::WORK_LEFT).await == 0
    })
    .await;
    assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2]);
    assert_eq!(running.stats().repaired, 1);
    running.shutdown().await.unwrap();
}
