//! Rows of the log that this library cannot decode, written by raw SQL: each one becomes a
//! dead letter on its own, with a reason naming its column, and every other delivery of
//! the same claim is handed out.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbus::{Bus, Event, HandlerError, RunningBus};
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(20);

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Starts a bus whose subscription `s` (events `p.*`) records how often each event id
/// was handled. One claim takes the whole backlog of these tests.
async fn start(config: tokio_postgres::Config) -> (RunningBus, Arc<Mutex<HashMap<String, u32>>>) {
    let seen: Arc<Mutex<HashMap<String, u32>>> = Default::default();
    let s = seen.clone();
    let running = Bus::builder(config)
        .batch_size(500)
        .concurrency(8)
        .poll_interval(Duration::from_millis(200))
        .handler_fn("s", ["p.*"], move |e: Event| {
            *s.lock().unwrap().entry(e.id).or_default() += 1;
            async { Ok::<(), HandlerError>(()) }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    (running, seen)
}

/// Inserts `good` decodable events named `good-<n>` between the statements of `poison`
/// (so they share claims with the poison rows), and returns their ids.
async fn insert_mixed(client: &Client, poison: &[(&str, String)], good: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let per = good / (poison.len() + 1) + 1;
    let statements = poison.iter().map(|(_, sql)| sql.as_str()).chain([""]);
    for (i, sql) in statements.enumerate() {
        for j in 0..per {
            if ids.len() == good {
                break;
            }
            let id = format!("good-{i}-{j}");
            client
                .execute(
                    "INSERT INTO pgbus.events (id, event_name, payload) \
                     VALUES ($1, 'p.good', jsonb_build_object('n', $2::int))",
                    &[&id, &(ids.len() as i32)],
                )
                .await
                .unwrap();
            ids.push(id);
        }
        if !sql.is_empty() {
            client
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }
    ids
}

/// Waits until only dead letters are left, then checks: every good event handled exactly
/// once, every poison row dead with a reason naming its column, nothing else dead.
async fn check(
    client: &Client,
    running: RunningBus,
    seen: &Mutex<HashMap<String, u32>>,
    good: &[String],
    poison: &[(&str, String)],
) {
    common::wait_for("only dead letters to be left", WAIT, || async {
        count(
            client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'dead'",
        )
        .await
            == 0
    })
    .await;
    let stats = running.stats();
    running.shutdown().await.unwrap();
    assert_eq!(stats.claim_errors, 0, "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    for id in good {
        assert_eq!(
            seen.get(id),
            Some(&1),
            "{id} handled {:?} times",
            seen.get(id)
        );
    }
    assert_eq!(
        seen.len(),
        good.len(),
        "only good events are handled: {seen:?}"
    );
    let rows = client
        .query(
            "SELECT textsend(e.id), d.last_error, d.attempts,
                    (SELECT count(*) FROM pgbus.delivery_failures AS f
                      WHERE f.subscription = d.subscription AND f.event_seq = d.event_seq)
             FROM pgbus.deliveries AS d JOIN pgbus.events AS e ON e.seq = d.event_seq
             WHERE d.status = 'dead'",
            &[],
        )
        .await
        .unwrap();
    let dead: HashMap<String, (String, i32, i64)> = rows
        .iter()
        .map(|r| {
            let id: Vec<u8> = r.get::<_, Vec<u8>>(0);
            (
                String::from_utf8_lossy(&id).into_owned(),
                (r.get(1), r.get(2), r.get(3)),
            )
        })
        .collect();
    assert_eq!(dead.len(), poison.len(), "{dead:#?}");
    for (id, (error, attempts, failures)) in &dead {
        let (column, _) = poison
            .iter()
            .find(|(column, _)| id.starts_with(&format!("bad-{column}-")))
            .unwrap_or_else(|| panic!("{id} should not be dead: {error}"));
        let expected = format!("the event cannot be decoded: {column}: ");
        assert!(error.starts_with(&expected), "{id}: {error:?}");
        assert_eq!((*attempts, *failures), (1, 1), "{id}: {error}");
    }
    for (column, _) in poison {
        let expected = poison.iter().filter(|(c, _)| c == column).count();
        let found = dead
            .keys()
            .filter(|id| id.starts_with(&format!("bad-{column}-")))
            .count();
        assert_eq!(found, expected, "dead letters of {column}: {dead:#?}");
    }
}

/// Since migration 5 the log refuses infinite times in new rows; rows written before it
/// (the constraint is `NOT VALID`, so they stay) must still not break a claim. This
/// test's database drops the constraint to write such rows, after checking it works.
async fn allow_infinite_times(client: &Client) {
    let err = client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, occurred_at) VALUES ('p.x', 'infinity')",
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION),
        "{err:?}"
    );
    client
        .batch_execute("ALTER TABLE pgbus.events DROP CONSTRAINT events_times_finite")
        .await
        .unwrap();
}

#[tokio::test]
async fn every_undecodable_column_dead_letters_its_row_alone_and_the_claim_goes_on() {
    let db = common::test_db().await;
    let client = db.connect().await;
    allow_infinite_times(&client).await;
    pgbus::admin::register_subscription(&client, "s", &["p.*"], 25)
        .await
        .unwrap();
    let deep_array = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let deep_object = format!("{}1{}", "{\"a\":".repeat(200), "}".repeat(200));
    let insert = |column: &str, n: u32, set: &str, value: &str| {
        format!(
            "INSERT INTO pgbus.events (id, event_name, {set}) VALUES ('bad-{column}-{n}', 'p.bad', {value})"
        )
    };
    let poison: Vec<(&str, String)> = vec![
        (
            "occurred_at",
            insert("occurred_at", 1, "occurred_at", "'infinity'"),
        ),
        (
            "occurred_at",
            insert("occurred_at", 2, "occurred_at", "'-infinity'"),
        ),
        // PostgreSQL goes to 294276 AD; chrono to about 262143.
        (
            "occurred_at",
            insert(
                "occurred_at",
                3,
                "occurred_at",
                "'294000-01-01 00:00:00+00'",
            ),
        ),
        (
            "created_at",
            insert("created_at", 1, "created_at", "'infinity'"),
        ),
        (
            "created_at",
            insert("created_at", 2, "created_at", "'-infinity'"),
        ),
        (
            "created_at",
            insert("created_at", 3, "created_at", "'294276-12-31 23:59:59+00'"),
        ),
        (
            "payload",
            insert("payload", 1, "payload", &format!("'{deep_array}'")),
        ),
        (
            "headers",
            insert("headers", 1, "headers", &format!("'{deep_object}'")),
        ),
        // The schema requires an object; a database without that constraint may hold
        // anything else.
        (
            "headers",
            format!(
                "ALTER TABLE pgbus.events DROP CONSTRAINT events_headers_check; {}; {}",
                insert("headers", 2, "headers", "'[1, 2]'"),
                insert("headers", 3, "headers", "'\"text\"'")
            ),
        ),
    ];
    // The last statement writes two rows.
    let poison: Vec<(&str, String)> = poison
        .into_iter()
        .chain([("headers", String::new())])
        .collect();
    let good = insert_mixed(&client, &poison, 30).await;
    assert_eq!(
        common::count_after_fan_out(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        good.len() as i64 + poison.len() as i64
    );
    let (running, seen) = start(db.config()).await;
    check(&client, running, &seen, &good, &poison).await;
}

/// `available_at` of `infinity` is never due, and must not break the claim's next-due
/// computation (`infinity - now()` is an error before PostgreSQL 17); `-infinity` is due
/// at once.
#[tokio::test]
async fn infinite_available_at_breaks_no_claim() {
    let db = common::test_db().await;
    let client = db.connect().await;
    allow_infinite_times(&client).await;
    pgbus::admin::register_subscription(&client, "s", &["p.*"], 25)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, available_at) VALUES
               ('never', 'p.x', 'infinity'),
               ('at-once', 'p.x', '-infinity');
             INSERT INTO pgbus.events (id, event_name)
               SELECT 'good-' || i, 'p.x' FROM generate_series(1, 10) AS i;",
        )
        .await
        .unwrap();
    let (running, seen) = start(db.config()).await;
    common::wait_for("every due event to be handled", WAIT, || async {
        seen.lock().unwrap().len() == 11
    })
    .await;
    // A later event, published while the only future delivery is the infinite one.
    pgbus::publish(
        &client,
        &Event::new("p.x", serde_json::json!({})).id("later"),
    )
    .await
    .unwrap();
    common::wait_for("the later event", WAIT, || async {
        seen.lock().unwrap().contains_key("later")
    })
    .await;
    common::wait_for("only the infinite delivery to be left", WAIT, || async {
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await == 1
    })
    .await;
    let stats = running.stats();
    running.shutdown().await.unwrap();
    assert_eq!(stats.claim_errors, 0, "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.contains_key("never"));
    assert!(seen.values().all(|n| *n == 1), "{seen:?}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries d JOIN pgbus.events e ON e.seq = d.event_seq \
             WHERE e.id = 'never' AND d.status = 'pending' AND d.attempts = 0"
        )
        .await,
        1
    );
}

/// The size limit holds for SQL writers too: a raw INSERT of a payload over
/// `MAX_EVENT_BYTES` is refused by the schema and writes nothing.
#[tokio::test]
async fn the_schema_refuses_an_oversized_event_from_sql() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let limit = pgbus::MAX_EVENT_BYTES as i32;
    let err = client
        .execute(
            "INSERT INTO pgbus.events (event_name, payload)
             VALUES ('p.big', jsonb_build_object('s', repeat('x', $1)))",
            &[&limit],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION),
        "{err:?}"
    );
    // Just under the limit is accepted.
    client
        .execute(
            "INSERT INTO pgbus.events (event_name, payload)
             VALUES ('p.big', jsonb_build_object('s', repeat('x', $1)))",
            &[&(limit - 1024)],
        )
        .await
        .unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 1);
}
