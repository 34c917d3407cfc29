//! The log-first publish (`sql/0018_log_first.sql`, docs/ARCHITECTURE.md "The log-first
//! publish"): a publish writes its event only, and batches cut between two snapshots turn
//! committed events into deliveries. Each test attacks one claim of the design: an open
//! transaction, other isolation levels, a cutter that dies before its commit, two cutters
//! at once, the sweep racing a batch, forged columns, and an upgrade with every kind of
//! delivery pending. A negative control shows that the open-transaction check catches a
//! boundary that passes a transaction still open.

mod common;
#[path = "shared/roles.rs"]
mod roles;

use std::time::Duration;

use pgbus::schema::MIGRATIONS;
use tokio_postgres::{Client, IsolationLevel};

const WAIT: Duration = Duration::from_secs(20);

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Cuts one batch; returns how many events it took.
async fn cut(client: &Client) -> i64 {
    client
        .query_one("SELECT pgbus.fan_out_committed()", &[])
        .await
        .unwrap()
        .get(0)
}

async fn deliveries_of(client: &Client, id: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries AS d \
             JOIN pgbus.events AS e ON e.seq = d.event_seq WHERE e.id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

/// The event ids of a subscription's deliveries, in the order its keys hand them over.
async fn handing_order(client: &Client, subscription: &str) -> Vec<String> {
    client
        .query(
            "SELECT e.id FROM pgbus.deliveries AS d JOIN pgbus.events AS e ON e.seq = d.event_seq \
             WHERE d.subscription = $1 ORDER BY d.key_pos, d.event_seq",
            &[&subscription],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn subscribe(client: &Client, name: &str, ordered: bool) {
    client
        .execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES ($1, '{*}', $2)",
            &[&name, &ordered],
        )
        .await
        .unwrap();
}

async fn publish(client: &Client, id: &str) {
    client
        .execute(
            "INSERT INTO pgbus.events (id, event_name) VALUES ($1, 'a.b')",
            &[&id],
        )
        .await
        .unwrap();
}

/// What the open-transaction scenario observed: deliveries of the event that was open
/// while batches were cut (after it committed and one more batch), and of the event
/// committed while it was open (right after the first batch).
struct OpenOutcome {
    early_delivered_at_once: i64,
    open_delivered_while_open: i64,
    open_delivered_after_commit: i64,
}

/// A transaction publishes and stays open across three batches while another event
/// commits; then it commits and one more batch is cut. `sabotage` replaces the boundary
/// after the first batch by one that passes every transaction, the open one included:
/// a broken boundary.
async fn open_transaction_scenario(sabotage: bool) -> OpenOutcome {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut open = db.connect().await;
    subscribe(&client, "s", false).await;

    let tx = open.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO pgbus.events (id, event_name) VALUES ('open', 'a.b')",
        &[],
    )
    .await
    .unwrap();
    publish(&client, "early").await;
    cut(&client).await;
    let early_delivered_at_once = deliveries_of(&client, "early").await;
    if sabotage {
        // A boundary with no transaction in progress below the current xid: it claims
        // every transaction so far finished.
        client
            .batch_execute(
                "INSERT INTO pgbus.fan_out_ticks (boundary) VALUES \
                   ((pg_snapshot_xmax(pg_current_snapshot())::text || ':' || \
                     pg_snapshot_xmax(pg_current_snapshot())::text || ':')::pg_snapshot)",
            )
            .await
            .unwrap();
    }
    cut(&client).await;
    cut(&client).await;
    let open_delivered_while_open = deliveries_of(&client, "open").await;
    tx.commit().await.unwrap();
    cut(&client).await;
    cut(&client).await;
    OpenOutcome {
        early_delivered_at_once,
        open_delivered_while_open,
        open_delivered_after_commit: deliveries_of(&client, "open").await,
    }
}

#[tokio::test]
async fn an_open_transaction_holds_back_only_its_own_event_and_is_delivered_once() {
    let o = open_transaction_scenario(false).await;
    assert_eq!(
        o.early_delivered_at_once, 1,
        "an event committed while another transaction is open is delivered at once"
    );
    assert_eq!(o.open_delivered_while_open, 0, "nothing before its commit");
    assert_eq!(
        o.open_delivered_after_commit, 1,
        "the open transaction's event is delivered exactly once after its commit"
    );
}

#[tokio::test]
async fn negative_control_a_boundary_that_passes_an_open_transaction_loses_its_event() {
    let o = open_transaction_scenario(true).await;
    assert_eq!(
        o.open_delivered_after_commit, 0,
        "the check above must see the loss a broken boundary causes"
    );
}

#[tokio::test]
async fn nothing_is_written_per_subscription_inside_the_publishing_transaction() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for i in 0..5 {
        subscribe(&client, &format!("s{i}"), i % 2 == 0).await;
    }
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, aggregate_type, aggregate_id) \
             SELECT 'e' || g, 'a.b', 'k', (g % 3)::text FROM generate_series(1, 30) AS g",
        )
        .await
        .unwrap();
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT events FROM pgbus.not_fanned_out(NULL)").await,
        30,
        "the backlog before the deliveries counts them"
    );
    assert_eq!(cut(&client).await, 30);
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        150
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM (SELECT 1 FROM pgbus.deliveries WHERE ordering_key IS NOT NULL \
             GROUP BY subscription, ordering_key HAVING count(*) FILTER (WHERE is_head) <> 1) AS v"
        )
        .await,
        0,
        "every key of every ordered subscription has exactly one head"
    );
    assert_eq!(cut(&client).await, 0, "a second batch takes nothing");
    assert_eq!(
        count(&client, "SELECT events FROM pgbus.not_fanned_out(NULL)").await,
        0
    );
}

#[tokio::test]
async fn publishers_in_repeatable_read_and_serializable_keep_commit_order() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "o", true).await;
    let mut a = db.connect().await;
    let mut b = db.connect().await;
    for (round, level) in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable]
        .into_iter()
        .enumerate()
    {
        // `first` inserts first but commits second: it waits for nothing (it holds the
        // key), so `second` waits for the key and commits after it. Order: first, second.
        let first = format!("first{round}");
        let second = format!("second{round}");
        let ta = a
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        ta.execute(
            "INSERT INTO pgbus.events (id, event_name, ordering_key) VALUES ($1, 'a.b', 'k')",
            &[&first],
        )
        .await
        .unwrap();
        let tb = b
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&second];
        let insert = tb.execute(
            "INSERT INTO pgbus.events (id, event_name, ordering_key) VALUES ($1, 'a.b', 'k')",
            &params,
        );
        let commit_a = async {
            // The second publisher is waiting for the key before the first commits.
            common::wait_for("the second publisher to wait for the key", WAIT, || async {
                count(
                    &client,
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO pgbus.events%'",
                )
                .await
                    == 1
            })
            .await;
            ta.commit().await.unwrap();
        };
        let (inserted, ()) = tokio::join!(insert, commit_a);
        inserted.unwrap();
        tb.commit().await.unwrap();
    }
    cut(&client).await;
    let order = handing_order(&client, "o").await;
    assert_eq!(order, ["first0", "second0", "first1", "second1"]);
}

#[tokio::test]
async fn a_cutter_killed_before_its_commit_leaves_the_batch_to_the_next() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut doomed = db.connect().await;
    subscribe(&client, "s", false).await;
    publish(&client, "e1").await;
    let tx = doomed.transaction().await.unwrap();
    let taken: i64 = tx
        .query_one("SELECT pgbus.fan_out_committed()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(taken, 1);
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    client
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    common::wait_for("the killed cutter's backend to end", WAIT, || async {
        client
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .unwrap()
            .is_none()
    })
    .await;
    drop(tx);
    assert_eq!(
        deliveries_of(&client, "e1").await,
        0,
        "its work rolled back"
    );
    assert_eq!(cut(&client).await, 1, "the next batch takes the same event");
    assert_eq!(deliveries_of(&client, "e1").await, 1);
}

#[tokio::test]
async fn two_cutters_at_once_take_each_event_once() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut first = db.connect().await;
    let second = db.connect().await;
    subscribe(&client, "s", false).await;
    subscribe(&client, "o", true).await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, ordering_key) \
             SELECT 'e' || g, 'a.b', (g % 4)::text FROM generate_series(1, 20) AS g",
        )
        .await
        .unwrap();
    // The first cutter holds its batch uncommitted while more events commit and the
    // second cutter runs: it waits for the cursor, then takes only what is new.
    let tx = first.transaction().await.unwrap();
    let a: i64 = tx
        .query_one("SELECT pgbus.fan_out_committed()", &[])
        .await
        .unwrap()
        .get(0);
    publish(&client, "later").await;
    let b = second.query_one("SELECT pgbus.fan_out_committed()", &[]);
    let commit = async {
        common::wait_for("the second cutter to wait for the cursor", WAIT, || async {
            count(
                &client,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE '%fan_out_committed%'",
            )
            .await
                == 1
        })
        .await;
        tx.commit().await.unwrap();
    };
    let (b, ()) = tokio::join!(b, commit);
    let b: i64 = b.unwrap().get(0);
    assert_eq!((a, b), (20, 1));
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM (SELECT event_seq FROM pgbus.deliveries \
             GROUP BY subscription, event_seq HAVING count(*) > 1) AS twice"
        )
        .await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        42
    );
}

#[tokio::test]
async fn the_sweep_keeps_events_no_batch_has_taken() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", false).await;
    client
        .batch_execute(
            "UPDATE pgbus.settings SET min_retention = '0'; \
             INSERT INTO pgbus.events (id, event_name, created_at) \
             VALUES ('old', 'a.b', now() - interval '2 days')",
        )
        .await
        .unwrap();
    let swept: i64 = client
        .query_one("SELECT events FROM pgbus.sweep(0, 100, 0)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(swept, 0, "an event no batch has taken is not swept");
    cut(&client).await;
    assert_eq!(deliveries_of(&client, "old").await, 1);
    client
        .batch_execute("DELETE FROM pgbus.deliveries")
        .await
        .unwrap();
    let swept: i64 = client
        .query_one("SELECT events FROM pgbus.sweep(0, 100, 0)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(swept, 1, "once taken and completed it is swept");
}

#[tokio::test]
async fn a_subscription_created_later_sees_only_later_events() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "early", false).await;
    publish(&client, "before").await;
    subscribe(&client, "late", false).await;
    publish(&client, "after").await;
    cut(&client).await;
    let rows: Vec<(String, String)> = client
        .query(
            "SELECT d.subscription, e.id FROM pgbus.deliveries AS d \
             JOIN pgbus.events AS e ON e.seq = d.event_seq ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let pairs: Vec<(&str, &str)> = rows.iter().map(|(s, e)| (&**s, &**e)).collect();
    assert_eq!(
        pairs,
        [("early", "after"), ("early", "before"), ("late", "after")]
    );
}

/// Waits until `task`, a statement calling `function` on another connection, waits for a
/// lock in this database, or ends; true if it was seen waiting.
async fn waits_for_a_lock<T>(
    client: &Client,
    task: &tokio::task::JoinHandle<T>,
    function: &str,
) -> bool {
    let pattern = format!("%{function}%");
    common::wait_for(
        "the statement to wait for a lock, or to end",
        WAIT,
        || async {
            task.is_finished()
                || client
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                     AND datname = current_database() AND query LIKE $1",
                        &[&pattern],
                    )
                    .await
                    .unwrap()
                    .get::<_, i64>(0)
                    == 1
        },
    )
    .await;
    !task.is_finished()
}

/// An ordered subscription created while a publisher is between two events of one key:
/// the creation waits for the publisher's commit (`sql/0020_ordered_creation_gate.sql`),
/// so the new subscription gets none of that transaction's events, and never in reverse.
/// Without the wait, the first event had no key position and the second had one, and the
/// batch handed the second over first.
#[tokio::test]
async fn an_ordered_subscription_created_mid_transaction_never_inverts_a_key() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut publisher = db.connect().await;
    let creator = db.connect().await;
    let keyed = "INSERT INTO pgbus.events (id, event_name, ordering_key) VALUES ($1, 'a.b', 'k')";
    let tx = publisher.transaction().await.unwrap();
    tx.execute(keyed, &[&"e1"]).await.unwrap();
    let create = tokio::spawn(async move {
        creator
            .query_one(
                "SELECT pgbus.join_subscription('o', '{*}', 25, true, 'block')",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    });
    let waited = waits_for_a_lock(&client, &create, "join_subscription").await;
    tx.execute(keyed, &[&"e2"]).await.unwrap();
    tx.commit().await.unwrap();
    assert!(create.await.unwrap(), "the subscription is created");
    client.execute(keyed, &[&"e3"]).await.unwrap();
    cut(&client).await;
    let order = handing_order(&client, "o").await;
    assert_eq!(
        order,
        ["e3"],
        "the key's events, in the order the new subscription gets them"
    );
    assert!(
        waited,
        "the creation waited for the keyed publisher under way"
    );
}

/// Behind a transaction held open elsewhere (the xmin horizon held back), 2,000 batches
/// later the boundary is still read in a few pages: it is appended, never updated
/// (`sql/0021_append_only_boundary.sql`), so its newest entry is live however many old
/// ones wait for the horizon, and old ticks are deleted as batches go. Kept in one row
/// updated by every batch (migration 18), the read walked every version: 17 pages here.
#[tokio::test]
async fn the_boundary_stays_a_few_pages_behind_an_open_transaction() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut holder = db.connect().await;
    subscribe(&client, "s", false).await;
    let held = holder.transaction().await.unwrap();
    held.query_one("SELECT pg_current_xact_id()", &[])
        .await
        .unwrap();
    client
        .batch_execute(
            "DO $$ BEGIN FOR i IN 1..2000 LOOP \
               INSERT INTO pgbus.events (id, event_name) VALUES ('h' || i, 'a.b'); COMMIT; \
               PERFORM pgbus.fan_out_committed(); COMMIT; \
             END LOOP; END $$",
        )
        .await
        .unwrap();
    let plan: serde_json::Value = client
        .query_one(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT boundary FROM pgbus.fan_out_cursor",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let top = &plan[0]["Plan"];
    let pages =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    let ticks = count(&client, "SELECT count(*) FROM pgbus.fan_out_ticks").await;
    held.rollback().await.unwrap();
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        2000,
        "every batch made its delivery"
    );
    assert!(pages <= 6, "the boundary's read took {pages} pages: {plan}");
    assert!(
        ticks <= 1024,
        "{ticks} ticks kept: old ones are not deleted"
    );
}

#[tokio::test]
async fn forged_transaction_ids_and_key_positions_are_refused_or_replaced() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let err = client
        .batch_execute("INSERT INTO pgbus.events (event_name, xid) VALUES ('a.b', '999999999')")
        .await
        .unwrap_err();
    assert!(
        common::error_chain(&err).contains("xid is set by pgbus"),
        "{err}"
    );
    client
        .batch_execute("INSERT INTO pgbus.events (id, event_name, key_pos) VALUES ('k', 'a.b', -5)")
        .await
        .unwrap();
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.events WHERE id = 'k' AND key_pos IS NULL"
        )
        .await,
        1
    );
}

async fn orders_keys(client: &Client) -> bool {
    client
        .query_one("SELECT pgbus.orders_keys()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Sessions other than `client`'s holding a lock on this database's configuration gate.
async fn gate_holders(client: &Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' \
         AND relation = 'pgbus.config_gate'::regclass AND pid <> pg_backend_pid() \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await
}

/// The per-row ordering trigger exists only once a subscription is ordered
/// (`sql/0022_order_trigger_on_demand.sql`): before, a keyed publisher runs no trigger
/// and holds no configuration gate, and its event has no key position; after, keyed
/// events draw positions, and forged columns are still refused or replaced.
#[tokio::test]
async fn the_log_runs_its_ordering_trigger_only_once_a_subscription_is_ordered() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut publisher = db.connect().await;
    let keyed = "INSERT INTO pgbus.events (id, event_name, ordering_key) VALUES ($1, 'a.b', 'k')";
    subscribe(&client, "s", false).await;
    assert!(!orders_keys(&client).await, "a fresh log orders no key");

    let tx = publisher.transaction().await.unwrap();
    tx.execute(keyed, &[&"before"]).await.unwrap();
    assert_eq!(
        gate_holders(&client).await,
        0,
        "a keyed publisher holds no configuration gate while nothing is ordered"
    );
    tx.commit().await.unwrap();

    let changed = client
        .query_one(
            "SELECT got FROM pgbus.try_configure_subscription('s', NULL, NULL, true, NULL, 5000)",
            &[],
        )
        .await
        .unwrap();
    assert!(changed.get::<_, bool>(0));
    assert!(
        orders_keys(&client).await,
        "an ordered subscription brings the trigger"
    );

    let tx = publisher.transaction().await.unwrap();
    tx.execute(keyed, &[&"after"]).await.unwrap();
    assert_eq!(
        gate_holders(&client).await,
        1,
        "a keyed publisher holds the gate once a subscription is ordered"
    );
    tx.commit().await.unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, ordering_key, key_pos) \
             VALUES ('forged', 'a.b', 'k', -5)",
        )
        .await
        .unwrap();
    let positions = client
        .query("SELECT id, key_pos FROM pgbus.events ORDER BY seq", &[])
        .await
        .unwrap();
    let positions: Vec<(String, Option<i64>)> =
        positions.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(positions[0], ("before".to_owned(), None));
    assert!(
        matches!(positions[1], (ref id, Some(p)) if id == "after" && p > 0),
        "{positions:?}"
    );
    assert!(
        matches!(positions[2], (ref id, Some(p)) if id == "forged" && p > positions[1].1.unwrap()),
        "a forged position is replaced by a drawn one: {positions:?}"
    );
    let err = client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, ordering_key, xid) VALUES ('a.b', 'k', '999999999')",
        )
        .await
        .unwrap_err();
    assert!(
        common::error_chain(&err).contains("xid is set by pgbus"),
        "{err}"
    );

    cut(&client).await;
    assert_eq!(
        handing_order(&client, "s").await,
        ["before", "after", "forged"],
        "the key's events in commit order"
    );
}

/// With no ordered subscription a keyed publisher holds no gate, so a settings change
/// that makes a subscription ordered waits for the log's writers under way instead
/// (`pgbus.lock_config(true)` takes the log's lock while the trigger does not exist): the
/// publisher's two events of one key are handed over in order, both as the key's
/// events, and a change that cannot wait names the publisher in its way.
#[tokio::test]
async fn a_change_to_ordered_waits_for_the_log_writers_under_way() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut publisher = db.connect().await;
    let changer = db.connect().await;
    let keyed = "INSERT INTO pgbus.events (id, event_name, ordering_key) VALUES ($1, 'a.b', 'k')";
    subscribe(&client, "s", false).await;
    let tx = publisher.transaction().await.unwrap();
    tx.execute(keyed, &[&"e1"]).await.unwrap();
    let publisher_pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let refused = client
        .query_one(
            "SELECT got, waiting_on FROM pgbus.try_configure_subscription('s', NULL, NULL, true, NULL, 50)",
            &[],
        )
        .await
        .unwrap();
    assert!(
        !refused.get::<_, bool>(0),
        "the change cannot have the log at once"
    );
    let waiting_on: serde_json::Value = refused.get(1);
    assert!(
        waiting_on
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["pid"] == serde_json::json!(publisher_pid)),
        "the publisher is named: {waiting_on}"
    );
    assert!(
        !orders_keys(&client).await,
        "a refused change creates nothing"
    );

    let change = tokio::spawn(async move {
        changer
            .query_one(
                "SELECT got FROM pgbus.try_configure_subscription('s', NULL, NULL, true, NULL, 20000)",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    });
    let waited = waits_for_a_lock(&client, &change, "try_configure_subscription").await;
    tx.execute(keyed, &[&"e2"]).await.unwrap();
    tx.commit().await.unwrap();
    assert!(change.await.unwrap(), "the change is made");
    client.execute(keyed, &[&"e3"]).await.unwrap();
    cut(&client).await;
    assert!(waited, "the change waited for the publisher under way");
    assert_eq!(handing_order(&client, "s").await, ["e1", "e2", "e3"]);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 's' AND is_head",
        )
        .await,
        1,
        "the three are one key's: one head"
    );
}

/// Applies migrations up to `last` as `pgbus::migrate` does, on an empty database.
async fn migrate_up_to(client: &Client, last: i32) {
    client
        .batch_execute(
            "CREATE SCHEMA pgbus; \
             CREATE TABLE pgbus.schema_migrations (version integer PRIMARY KEY, \
               name text NOT NULL, checksum text NOT NULL, \
               applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .unwrap();
    for m in MIGRATIONS.iter().filter(|m| m.version <= last) {
        client
            .batch_execute(&format!(
                "BEGIN; SET LOCAL search_path = pg_catalog, pgbus, pg_temp; {} ; COMMIT",
                m.sql
            ))
            .await
            .unwrap();
        client
            .execute(
                "INSERT INTO pgbus.schema_migrations (version, name, checksum) \
                 VALUES ($1, $2, md5($3::text))",
                &[&m.version, &m.name, &m.sql],
            )
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn an_upgrade_delivers_every_delivery_the_old_schema_made() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let name = format!("{}_upgrade", db.name());
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .await
        .unwrap();
    let mut config = db.config();
    config.dbname(&name);
    let client = common::connect(&config).await.unwrap();
    migrate_up_to(&client, 17).await;

    // Today's schema: the trigger writes the deliveries. One of each kind.
    client
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('u', '{*}'); \
             INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES ('o', '{*}', true); \
             INSERT INTO pgbus.events (id, event_name, ordering_key) \
             SELECT 'k' || g, 'a.b', 'key' FROM generate_series(1, 4) AS g; \
             INSERT INTO pgbus.events (id, event_name, available_at) \
             VALUES ('later', 'a.b', now() + interval '1 second'); \
             UPDATE pgbus.deliveries SET status = 'processing', attempts = 1, \
               locked_until = now() - interval '1 second', locked_by = 'gone' \
             WHERE subscription = 'u' AND event_seq = 1; \
             UPDATE pgbus.deliveries SET status = 'dead', attempts = 3, last_error = 'x' \
             WHERE subscription = 'u' AND event_seq = 2;",
        )
        .await
        .unwrap();
    let before = count(&client, "SELECT count(*) FROM pgbus.deliveries").await;
    assert_eq!(before, 10);

    let applied = pgbus::migrate(&client).await.unwrap();
    assert!(applied.iter().any(|m| m.name == "log_first"), "{applied:?}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        before,
        "the upgrade keeps every delivery"
    );
    assert_eq!(
        cut(&client).await,
        0,
        "and the first batch takes none again"
    );

    // Every one of them is delivered afterwards (the dead one after a redrive).
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'pending', available_at = now() \
             WHERE status = 'dead'",
        )
        .await
        .unwrap();
    let handled = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let (h1, h2) = (handled.clone(), handled.clone());
    let running = pgbus::Bus::builder(config.clone())
        .poll_interval(Duration::from_millis(100))
        .lease(Duration::from_secs(30))
        .handler_fn("u", ["*"], move |e| {
            h1.lock().unwrap().push(("u".into(), e.id.clone()));
            async { Ok(()) }
        })
        .handler_fn_with(
            "o",
            ["*"],
            pgbus::SubscriptionOptions::new().ordered(true),
            move |e| {
                h2.lock().unwrap().push(("o".into(), e.id.clone()));
                async { Ok(()) }
            },
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap();
    common::wait_count(
        &client,
        "every delivery made before the upgrade to be handled",
        common::WORK_LEFT,
        0,
    )
    .await;
    running.shutdown().await.unwrap();
    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), 10, "{handled:?}");
    let ordered: Vec<&str> = handled
        .iter()
        .filter(|(s, _)| s == "o")
        .map(|(_, id)| &**id)
        .filter(|id| id.starts_with('k'))
        .collect();
    assert_eq!(ordered, ["k1", "k2", "k3", "k4"], "key order kept");
    drop(client);
    admin
        .batch_execute(&format!("DROP DATABASE \"{name}\" WITH (FORCE)"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_cut_inside_a_publishing_transaction_leaves_its_events_to_a_later_batch() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut own = db.connect().await;
    subscribe(&client, "s", false).await;
    publish(&client, "other").await;
    let tx = own.transaction().await.unwrap();
    tx.batch_execute("INSERT INTO pgbus.events (id, event_name) VALUES ('before', 'a.b')")
        .await
        .unwrap();
    let taken: i64 = tx
        .query_one("SELECT pgbus.fan_out_committed()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(taken, 1, "the other transaction's event only");
    tx.batch_execute("INSERT INTO pgbus.events (id, event_name) VALUES ('after', 'a.b')")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(cut(&client).await, 2);
    for id in ["other", "before", "after"] {
        assert_eq!(deliveries_of(&client, id).await, 1, "{id}");
    }
}

/// `status` and the gauges count the events committed and not yet turned into
/// deliveries (none of the subscriptions' counts has them yet), for the owner and for a
/// role with only the consumer grant; a batch empties the count.
#[tokio::test]
async fn status_counts_the_events_no_batch_has_taken() {
    let db = common::test_db().await;
    let client = db.connect().await;
    subscribe(&client, "s", false).await;
    for id in ["e1", "e2", "e3"] {
        publish(&client, id).await;
    }
    let roles = roles::Roles::create(db.config(), &["consumer"]).await;
    client
        .execute(
            "SELECT pgbus.grant_consumer($1::text::regrole)",
            &[&roles.names[0]],
        )
        .await
        .unwrap();
    let mut config = db.config();
    config.user(&roles.names[0]);
    let (consumer, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);

    let status = pgbus::admin::status(&client).await.unwrap();
    assert_eq!(status.fan_out.events, 3);
    assert!(status.fan_out.oldest_age.is_some_and(|age| age >= 0.0));
    assert_eq!(status.subscriptions[0].pending, 0);
    let seen = pgbus::admin::fan_out_backlog(&consumer).await.unwrap();
    assert_eq!(seen.events, 3);
    assert!(
        seen.oldest_age
            .is_some_and(|age| age >= status.fan_out.oldest_age.unwrap())
    );

    assert_eq!(cut(&client).await, 3);
    let status = pgbus::admin::status(&client).await.unwrap();
    assert_eq!(
        (status.fan_out.events, status.fan_out.oldest_age),
        (0, None)
    );
    assert_eq!(status.subscriptions[0].pending, 3);
    assert_eq!(
        pgbus::admin::fan_out_backlog(&consumer)
            .await
            .unwrap()
            .events,
        0
    );
}
