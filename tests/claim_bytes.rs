//! The claim's byte budget: a backlog of large payloads is claimed a few at a time, so
//! memory is bounded by bytes as well as by count; an event larger than the budget still
//! flows, alone; and the claim stays O(batch).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbus::{Bus, Event, HandlerError};
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(30);
const MIB: usize = 1024 * 1024;

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Writes `n` events of about 1 MiB each by SQL (past the library's payload limit
/// check), of hex digits that PostgreSQL cannot compress: stored size about equals JSON
/// size.
async fn big_events(client: &Client, n: i32) {
    client
        .execute(
            "INSERT INTO pgbus.events (id, event_name, payload)
             SELECT 'big-' || i, 'b.x',
                    jsonb_build_object('blob', (SELECT string_agg(md5(random()::text || i || j), '')
                                                FROM generate_series(1, 32768) AS j))
             FROM generate_series(1, $1) AS i",
            &[&n],
        )
        .await
        .unwrap();
}

/// Runs the claim statement by hand with a budget; returns (rows claimed, cut).
async fn claim(client: &Client, budget: i64) -> (usize, bool) {
    let claim = pgbus_testkit::claim_statement(client).await.unwrap();
    let stmt = client
        .prepare_typed(&claim, &pgbus_testkit::sql::CLAIM_TYPES)
        .await
        .unwrap();
    let rows = client
        .query(
            &stmt,
            &[
                &vec!["s"],
                &vec![100_i32],
                &100_i32,
                &60_000_i64,
                &"w",
                &4_i32,
                &budget,
                &Vec::<Option<chrono::DateTime<chrono::Utc>>>::new(),
            ],
        )
        .await
        .unwrap();
    let claimed = rows
        .iter()
        .filter(|r| r.get::<_, Option<&str>>(1).is_some())
        .count();
    let cut: bool = rows[0].get("cut");
    (claimed, cut)
}

#[tokio::test]
async fn one_claim_takes_what_fits_in_its_budget_and_at_least_one() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["b.*"], 25)
        .await
        .unwrap();
    big_events(&client, 10).await;
    common::fan_out(&client).await;
    let size: i64 = client
        .query_one(
            "SELECT max(pg_column_size(payload) + pg_column_size(headers))::int8 FROM pgbus.events",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(size > 900_000, "the payloads were compressed: {size} bytes");
    // Three and a half events' worth: three.
    assert_eq!(claim(&client, size * 7 / 2).await, (3, true));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'"
        )
        .await,
        3
    );
    // Less than one: one, alone.
    assert_eq!(claim(&client, 1).await, (1, true));
    assert_eq!(claim(&client, 0).await, (1, true));
    // Enough for the rest: all of them, and nothing left behind.
    assert_eq!(claim(&client, i64::MAX).await, (5, false));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'pending'"
        )
        .await,
        0
    );
    assert_eq!(claim(&client, i64::MAX).await, (0, false));
}

#[tokio::test]
async fn a_bus_holds_no_more_than_its_byte_budget_and_delivers_everything() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["b.*"], 25)
        .await
        .unwrap();
    big_events(&client, 12).await;
    // Every handler waits until told to go on; each records how many deliveries were
    // leased (processing) when it started.
    let seen: Arc<Mutex<HashMap<String, u32>>> = Default::default();
    let leased: Arc<Mutex<Vec<i64>>> = Default::default();
    let (s, l) = (seen.clone(), leased.clone());
    let probe = db.connect().await;
    let probe = Arc::new(probe);
    let running = Bus::builder(db.config())
        .concurrency(16)
        .batch_size(100)
        .claim_bytes(2 * MIB + MIB / 2)
        .handler_fn("s", ["b.*"], move |e: Event| {
            let (s, l, probe) = (s.clone(), l.clone(), probe.clone());
            async move {
                let n = count(
                    &probe,
                    "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'",
                )
                .await;
                l.lock().unwrap().push(n);
                *s.lock().unwrap().entry(e.id).or_default() += 1;
                Ok::<(), HandlerError>(())
            }
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_for("every big event to be delivered", WAIT, || async {
        count(&client, common::WORK_LEFT).await == 0
    })
    .await;
    let stats = running.stats();
    running.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 12, "{seen:?}");
    assert!(seen.values().all(|n| *n == 1), "{seen:?}");
    // 2.5 MiB of budget holds two ~1 MiB events, and one more claim may add one: never
    // more than three leased at once, where the count alone would allow all twelve.
    let leased = leased.lock().unwrap().clone();
    assert!(leased.iter().all(|n| *n <= 3), "leased at once: {leased:?}");
    assert!(stats.claims >= 4, "{stats:?}");
}

#[tokio::test]
async fn the_budget_reads_sizes_by_primary_key_and_the_claim_keeps_its_index() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["b.*"], 25)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload)
             SELECT 'b.x', jsonb_build_object('i', i) FROM generate_series(1, 100000) AS i;",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute("ANALYZE pgbus.deliveries; ANALYZE pgbus.events;")
        .await
        .unwrap();
    let claim = pgbus_testkit::claim_statement(&client).await.unwrap();
    let stmt = client
        .prepare_typed(
            &format!("EXPLAIN (FORMAT JSON) {claim}"),
            &pgbus_testkit::sql::CLAIM_TYPES,
        )
        .await
        .unwrap();
    let rows = client
        .query(
            &stmt,
            &[
                &vec!["s"],
                &vec![100_i32],
                &100_i32,
                &60_000_i64,
                &"w",
                &4_i32,
                &(pgbus::DEFAULT_CLAIM_BYTES as i64),
                &Vec::<Option<chrono::DateTime<chrono::Utc>>>::new(),
            ],
        )
        .await
        .unwrap();
    let plan: serde_json::Value = rows[0].get(0);
    let text = plan.to_string();
    assert!(
        text.contains("\"Index Name\":\"deliveries_ready_idx\""),
        "the claim does not use its index: {text}"
    );
    assert!(
        text.contains("\"Index Name\":\"events_pkey\""),
        "the sizes are not read by primary key: {text}"
    );
    assert!(
        !text.contains("\"Node Type\":\"Seq Scan\""),
        "the claim scans a table: {text}"
    );
}
