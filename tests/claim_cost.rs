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
    /// By its choice of deliveries (the `candidates` CTE: the index scan and row locks), where
    /// a backlog would show first.
    picking: i64,
}

/// Runs the bus's claim statement for `sub` (a batch of 100) under
/// `EXPLAIN (ANALYZE, BUFFERS)` in a transaction that is rolled back, and returns the
/// shared buffers its execution touched.
async fn claim_buffers(client: &mut tokio_postgres::Client, sub: &str) -> Buffers {
    let claim = pgbus_testkit::claim_statement(&*client).await.unwrap();
    let tx = client.transaction().await.unwrap();
    let names = vec![sub];
    let quotas = vec![CLAIM_BATCH as i32];
    let rows = tx
        .query(
            &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {claim}"),
            &[
                &names,
                &quotas,
                &CLAIM_BATCH,
                &60_000_f64,
                &"w",
                &4_i64,
                &i64::MAX,
                &Vec::<Option<chrono::DateTime<chrono::Utc>>>::new(),
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
        .and_then(|plans| plans.iter().find(|p| p["Subplan Name"] == "CTE candidates"))
        .unwrap_or_else(|| panic!("no CTE candidates in {plan}"));
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

/// Behind a transaction held open elsewhere, the index entries of the deliveries claimed
/// since it began cannot be removed. A claim from its floor (the one the previous claim
/// returned) does not walk them; one without a floor, as the bus runs every 30 s, does.
#[tokio::test]
async fn a_claim_from_its_floor_skips_what_was_claimed_behind_an_open_transaction() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["*"], 25)
        .await
        .unwrap();
    publish_many(&client, "x", 3_000).await;
    // Claimable an hour ago (older than the floors' five-second margin), in event order:
    // written with the trigger that stamps `ready_at` off.
    client
        .batch_execute(
            "SET session_replication_role = replica; \
             UPDATE pgbus.deliveries \
             SET available_at = now() - interval '1 hour' + event_seq * interval '1 ms', \
                 ready_at = now() - interval '1 hour' + event_seq * interval '1 ms'; \
             RESET session_replication_role; ANALYZE pgbus.deliveries;",
        )
        .await
        .unwrap();
    let holder = hold_horizon(&db).await;

    let no_floor: Floors = vec![None];
    let mut floors = no_floor.clone();
    for _ in 0..25 {
        let rows = claim_from(&client, &floors).await;
        assert_eq!(rows.len(), CLAIM_BATCH as usize);
        floors = rows[0].get("floors");
        assert!(floors[0].is_some(), "a full claim returns a floor");
    }

    let from_floor = claim_index_reads(&mut client, floors).await;
    let whole = claim_index_reads(&mut client, no_floor).await;
    println!(
        "behind an open transaction: {from_floor} index entries read from the floor, {whole} without"
    );
    assert!(
        from_floor * 4 < whole,
        "a claim from its floor reads {from_floor} index entries, one without {whole}"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// The entries of the claim index that the claim read from `floors` (the deliveries it
/// claimed and every entry its scan passed on the way), with 2,500 of the subscription's
/// deliveries claimed already, in a transaction rolled back.
async fn claim_index_reads(client: &mut tokio_postgres::Client, floors: Floors) -> i64 {
    let tx = client.transaction().await.unwrap();
    let read = "SELECT pg_stat_get_xact_tuples_returned('pgbus.deliveries_ready_idx'::regclass)";
    let before: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    claim_from(&tx, &floors).await;
    let after: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    assert_eq!(count_claimed(&tx, "s").await, 26 * CLAIM_BATCH);
    tx.rollback().await.unwrap();
    after - before
}

/// A session of `db` idle in a transaction that holds an xid: the xmin horizon stays
/// where it is until the session rolls back.
async fn hold_horizon(db: &common::TestDb) -> tokio_postgres::Client {
    let holder = db.connect().await;
    holder
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .await
        .unwrap();
    holder
}

/// The claim statement's floors (`$8`), one per subscription.
type Floors = Vec<Option<chrono::DateTime<chrono::Utc>>>;

/// The bus's claim statement for subscription "s" (a batch of 100) from `floors`.
async fn claim_from(
    client: &impl tokio_postgres::GenericClient,
    floors: &Floors,
) -> Vec<tokio_postgres::Row> {
    let claim = pgbus_testkit::claim_statement(client).await.unwrap();
    client
        .query(
            &claim,
            &[
                &vec!["s"],
                &vec![CLAIM_BATCH as i32],
                &CLAIM_BATCH,
                &60_000_f64,
                &"w",
                &4_i64,
                &i64::MAX,
                floors,
            ],
        )
        .await
        .unwrap()
}

/// Acknowledges, as worker "w", the deliveries `held` names, through the bus's settlement;
/// returns how many it did not find held.
async fn ack(client: &impl tokio_postgres::GenericClient, held: &Held) -> i64 {
    client
        .query_one(
            "SELECT count(*) FILTER (WHERE kind = 'ack') FROM pgbus.settle($1, $2, $3, '{}', \
             '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', 'w')",
            &[&held.0, &held.1, &held.2],
        )
        .await
        .unwrap()
        .get(0)
}

/// The deliveries worker "w" holds: subscriptions, seqs, attempts.
type Held = (Vec<String>, Vec<i64>, Vec<i32>);

async fn held(client: &tokio_postgres::Client) -> Held {
    let row = client
        .query_one(
            "SELECT coalesce(array_agg(subscription), '{}'), coalesce(array_agg(event_seq), '{}'), \
             coalesce(array_agg(attempts), '{}') FROM pgbus.deliveries WHERE locked_by = 'w'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Behind a transaction held open elsewhere, the deliveries settled since it began leave
/// index entries that no VACUUM can remove, and ANALYZE (autovacuum's, every minute under
/// load) then sees a table of a few live rows. A settlement still looks its deliveries up
/// by key: it does not walk those rows and entries (it did, three times per settlement,
/// while the plan took the table for one row and scanned it, or its primary key, whole).
#[tokio::test]
async fn a_settlement_behind_an_open_transaction_reads_only_what_it_settles() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["*"], 25)
        .await
        .unwrap();
    let holder = hold_horizon(&db).await;
    publish_many(&client, "x", 2_500).await;
    for _ in 0..25 {
        assert_eq!(claim_from(&client, &vec![None]).await.len(), 100);
    }
    let all = held(&client).await;
    assert_eq!(all.1.len(), 2_500);
    assert_eq!(ack(&client, &all).await, 0, "all acknowledged");
    client
        .batch_execute("ANALYZE pgbus.deliveries")
        .await
        .unwrap();

    publish_many(&client, "x", 3).await;
    assert_eq!(claim_from(&client, &vec![None]).await.len(), 3);
    let three = held(&client).await;
    let tx = client.transaction().await.unwrap();
    // Rows returned by scans of the table, and entries by scans of any of its indexes.
    let read = "SELECT sum(pg_stat_get_xact_tuples_returned(c.oid))::int8 FROM pg_class AS c \
                WHERE c.oid = 'pgbus.deliveries'::regclass OR c.oid IN \
                (SELECT indexrelid FROM pg_index WHERE indrelid = 'pgbus.deliveries'::regclass)";
    let before: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    let left = ack(&tx, &three).await;
    let after: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    tx.commit().await.unwrap();
    assert_eq!(left, 0);
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
    let reads = after - before;
    println!("behind an open transaction: settling 3 deliveries read {reads} rows and entries");
    assert!(
        reads < 100,
        "settling 3 deliveries read {reads} rows and index entries (2,500 settled behind it)"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// In an ordered subscription a settlement also promotes each acknowledged head's next
/// delivery: behind a transaction held open elsewhere, with the statistics of a table of
/// a few live rows, the settlement and the promotion read a few primary key entries per
/// delivery, not the 1,200 settled behind it. (Finding the key's next delivery walks the
/// key's own promoted entries: that is `next_of_key`'s index, not counted here.)
#[tokio::test]
async fn an_ordered_settlement_behind_an_open_transaction_promotes_by_key() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    pgbus::admin::register_subscription(&client, "s", &["*"], 25)
        .await
        .unwrap();
    pgbus::admin::configure_subscription(
        &client,
        "s",
        &pgbus::admin::SubscriptionChange::new().ordered(true),
    )
    .await
    .unwrap();
    let holder = hold_horizon(&db).await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload, aggregate_type, aggregate_id) \
             SELECT 'x', '{}', 'k', (i % 5)::text FROM generate_series(1, 1500) AS i",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    // 240 rounds of the five heads, each acknowledged (promoting its key's next).
    for _ in 0..240 {
        assert_eq!(claim_from(&client, &vec![None]).await.len(), 5);
        assert_eq!(ack(&client, &held(&client).await).await, 0);
    }
    client
        .batch_execute("ANALYZE pgbus.deliveries")
        .await
        .unwrap();

    assert_eq!(claim_from(&client, &vec![None]).await.len(), 5);
    let heads = held(&client).await;
    let tx = client.transaction().await.unwrap();
    let read = "SELECT pg_stat_get_xact_tuples_returned('pgbus.deliveries_pkey'::regclass)";
    let before: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    assert_eq!(ack(&tx, &heads).await, 0);
    let after: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
    tx.commit().await.unwrap();
    let promoted = count(
        &client,
        "SELECT count(*) FROM pgbus.deliveries WHERE is_head AND status = 'pending'",
    )
    .await;
    assert_eq!(promoted, 5, "each key's next delivery is its head");
    let reads = after - before;
    println!(
        "behind an open transaction: an ordered settlement of 5 read {reads} primary key entries"
    );
    assert!(
        reads < 100,
        "settling 5 heads read {reads} entries of the primary key (1,200 settled behind it)"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// The deliveries carry one index over their pending heads (migration 27): every
/// delivery made, claimed, failed, released or promoted writes one due-time entry, not
/// two. The claim, its next due time and the gauges all read `deliveries_ready_idx`.
#[tokio::test]
async fn pending_heads_have_one_due_time_index() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let rows = client
        .query(
            "SELECT c.relname::text FROM pg_index AS i \
             JOIN pg_class AS c ON c.oid = i.indexrelid \
             WHERE i.indrelid = 'pgbus.deliveries'::regclass \
               AND pg_get_expr(i.indpred, i.indrelid) LIKE '%pending%' \
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["deliveries_ready_idx"]);
}

/// A bus older than migration 24 calls the claim without floors (seven arguments): it
/// still takes the due deliveries oldest first, leaves the scheduled one, and reports
/// when that one falls due, read from the same index as the claim's.
#[tokio::test]
async fn the_claim_without_floors_takes_what_is_due_and_tells_the_next_due_time() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "old", &["old.*"], 25)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload) \
             SELECT 'old.due', jsonb_build_object('i', i) FROM generate_series(1, 3) AS i; \
             INSERT INTO pgbus.events (event_name, payload, available_at) \
             VALUES ('old.later', '{}', now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let rows = client
        .query(
            "SELECT secs, event_name, attempts FROM \
             pgbus.claim('{old}', '{10}', 10, 60000, 'w', 1, 1000000)",
            &[],
        )
        .await
        .unwrap();
    let claimed: Vec<(String, i32)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(1), r.get::<_, i32>(2)))
        .collect();
    assert_eq!(claimed, vec![("old.due".to_owned(), 1); 3]);
    let secs: f64 = rows[0].get(0);
    assert!(
        (3_500.0..=3_600.0).contains(&secs),
        "the scheduled delivery falls due in about an hour, not in {secs} s"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'pending' AND is_head"
        )
        .await,
        1,
        "the scheduled delivery stays pending"
    );
}
