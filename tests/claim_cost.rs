//! What one claim costs does not grow with the backlog: the shared buffers it touches,
//! counted by `EXPLAIN (ANALYZE, BUFFERS)`, stay within a small constant factor from a
//! thousand pending deliveries to two hundred thousand, in its own subscription or in
//! another one.

mod common;

const CLAIM_BATCH: i64 = 100;

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Publishes `n` events named `name` in one statement (fan-out makes the deliveries) and
/// refreshes the planner's statistics.
async fn publish_many(client: &tokio_postgres::Client, name: &str, n: i64) {
    client
        .execute(
            "INSERT INTO pgbus.events (event_name, payload) \
             SELECT $1, jsonb_build_object('i', i) FROM generate_series(1, $2::int8) AS i",
            &[&name, &n],
        )
        .await
        .unwrap();
    common::fan_out(client).await;
    client
        .batch_execute("ANALYZE pgbus.deliveries; ANALYZE pgbus.events;")
        .await
        .unwrap();
}

/// Shared buffers touched, hits and reads (the cache state does not count).
#[derive(Debug, Clone, Copy)]
struct Buffers {
    /// By the whole claim statement's execution.
    statement: i64,
    /// By its choice of deliveries (the `picked` CTE: the index scan and row locks), where
    /// a backlog would show first.
    picking: i64,
}

/// Runs the bus's claim statement for `sub` (a batch of 100) under
/// `EXPLAIN (ANALYZE, BUFFERS)` in a transaction that is rolled back, and returns the
/// shared buffers its execution touched.
async fn claim_buffers(client: &mut tokio_postgres::Client, sub: &str) -> Buffers {
    let tx = client.transaction().await.unwrap();
    let names = vec![sub];
    let quotas = vec![CLAIM_BATCH as i32];
    let rows = tx
        .query(
            &format!(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
                pgbus_testkit::sql::CLAIM
            ),
            &[
                &names,
                &quotas,
                &CLAIM_BATCH,
                &60_000_f64,
                &"w",
                &4_i64,
                &i64::MAX,
            ],
        )
        .await
        .unwrap();
    let plan: serde_json::Value = rows[0].get(0);
    let claimed = count_claimed(&tx, sub).await;
    tx.rollback().await.unwrap();
    assert_eq!(claimed, CLAIM_BATCH, "the claim took a full batch of {sub}");
    let top = &plan[0]["Plan"];
    let picked = top["Plans"]
        .as_array()
        .and_then(|plans| plans.iter().find(|p| p["Subplan Name"] == "CTE picked"))
        .unwrap_or_else(|| panic!("no CTE picked in {plan}"));
    Buffers {
        statement: blocks(top),
        picking: blocks(picked),
    }
}

fn blocks(node: &serde_json::Value) -> i64 {
    let field = |k: &str| {
        node[k]
            .as_i64()
            .unwrap_or_else(|| panic!("no {k} in {node}"))
    };
    field("Shared Hit Blocks") + field("Shared Read Blocks")
}

async fn count_claimed(tx: &tokio_postgres::Transaction<'_>, sub: &str) -> i64 {
    tx.query_one(
        "SELECT count(*) FROM pgbus.deliveries WHERE subscription = $1 AND status = 'processing'",
        &[&sub],
    )
    .await
    .unwrap()
    .get(0)
}

fn assert_flat(what: &str, small: Buffers, large: Buffers) {
    println!("{what}: {small:?} at 1,000 pending, {large:?} at 200,000");
    for (part, small, large) in [
        ("the statement", small.statement, large.statement),
        ("the picking", small.picking, large.picking),
    ] {
        assert!(small > 0, "{what}: no buffers counted for {part}");
        assert!(
            large <= 2 * small + 10,
            "{what}: {part} touches {large} buffers with 200,000 pending, {small} with 1,000"
        );
    }
}

#[tokio::test]
async fn a_claim_costs_the_same_with_a_thousand_or_two_hundred_thousand_pending() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["*"], 25)
        .await
        .unwrap();
    publish_many(&client, "x", 1_000).await;
    let small = claim_buffers(&mut client, "s").await;
    publish_many(&client, "x", 199_000).await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'pending'"
        )
        .await,
        200_000
    );
    let large = claim_buffers(&mut client, "s").await;
    assert_flat("one subscription", small, large);
}

#[tokio::test]
async fn another_subscriptions_backlog_does_not_make_a_claim_cost_more() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    pgbus::admin::register_subscription(&client, "small", &["small.*"], 25)
        .await
        .unwrap();
    pgbus::admin::register_subscription(&client, "big", &["big.*"], 25)
        .await
        .unwrap();
    publish_many(&client, "small.x", 1_000).await;
    let alone = claim_buffers(&mut client, "small").await;
    publish_many(&client, "big.x", 200_000).await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'big'"
        )
        .await,
        200_000
    );
    let beside = claim_buffers(&mut client, "small").await;
    assert_flat("beside another's backlog", alone, beside);
}
